"""Sender signatures on all-gather payloads: what lets a member pass payloads on.

A client-mode member (nobody can dial it) cannot receive pushes, so it pulls every step's
payloads from the group's reachable members, including other members' payloads that only
passed through them. The channel authenticates only the member that answers, so each payload
carries its sender's signature over the group, the step, the payload's digest and the state
hash: a member that relays it can withhold it (the client then counts the sender late, as
when a push is lost) but cannot alter it, invent one, or move it to another step.
"""

from __future__ import annotations

import hashlib
import struct

from swarmd.protocol import averaging_pb2 as apb
from swarmd.protocol.identity import Identity, PeerId, verify_signature

_DOMAIN = b"swarmd/gather/v1\x00"


def _message(group_id: bytes, step: int, payload: bytes | bytearray, state_hash: bytes) -> bytes:
    digest = hashlib.blake2b(payload, digest_size=32).digest()
    return b"".join(
        (_DOMAIN, struct.pack(">HQ", len(group_id), step), group_id, digest, state_hash)
    )


def signed_info(
    identity: Identity, group_id: bytes, step: int, payload: bytes, state_hash: bytes
) -> apb.GatherInfo:
    """The GatherInfo this member sends ``payload`` with."""
    return apb.GatherInfo(
        group_id=group_id,
        step=step,
        state_hash=state_hash,
        sender_key=identity.public_key,
        signature=identity.sign(_message(group_id, step, payload, state_hash)),
    )


def check_signed(info: apb.GatherInfo, payload: bytes | bytearray, sender: PeerId) -> str | None:
    """Why ``payload`` with ``info`` is not ``sender``'s for info's group and step, or None."""
    key = bytes(info.sender_key)
    if len(key) != 32 or PeerId.from_public_key(key) != sender:
        return "the payload's key is not its sender's"
    message = _message(bytes(info.group_id), info.step, payload, bytes(info.state_hash))
    if not verify_signature(key, bytes(info.signature), message):
        return "the payload's signature does not match it"
    return None
