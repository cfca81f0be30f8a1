"""DHT ids: 256-bit integers in one XOR metric space shared by nodes and keys.

A node's id is its peer id read as an integer. Peer ids are already SHA-256 of a public key,
so nobody can choose where in the id space they land, which is what makes it expensive to
surround a key with one's own nodes. A key's id is a domain-separated SHA-256 of the key, so
keys and nodes spread uniformly over the same space.
"""

from __future__ import annotations

import hashlib
import random
import secrets

from swarmd.protocol.identity import PeerId

ID_BITS = 256
ID_BYTES = ID_BITS // 8
_KEY_DOMAIN = b"swarmd/dht-key/v1\0"


def node_id(peer_id: PeerId) -> int:
    return int.from_bytes(peer_id.raw, "big")


def key_id(key: bytes) -> int:
    return int.from_bytes(hashlib.sha256(_KEY_DOMAIN + key).digest(), "big")


def id_to_bytes(value: int) -> bytes:
    return value.to_bytes(ID_BYTES, "big")


def id_from_bytes(raw: bytes) -> int:
    if len(raw) != ID_BYTES:
        raise ValueError(f"a DHT id has {ID_BYTES} bytes, got {len(raw)}")
    return int.from_bytes(raw, "big")


def distance(a: int, b: int) -> int:
    return a ^ b


def bucket_index(own: int, other: int) -> int:
    """Index of the k-bucket ``other`` belongs to: the position of the highest differing bit."""
    d = own ^ other
    if d == 0:
        raise ValueError("a node has no bucket for itself")
    return d.bit_length() - 1


def random_id_in_bucket(own: int, index: int, rng: random.Random | None = None) -> int:
    """A uniformly random id whose bucket (relative to ``own``) is ``index``: for refreshes.
    ``rng``: the simulator's seeded source; a node draws from the OS's."""
    bits = rng.getrandbits if rng is not None else secrets.randbits
    low = bits(index) if index > 0 else 0
    return own ^ ((1 << index) | low)
