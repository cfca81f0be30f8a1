"""Every DHT key of a run, built here and nowhere else: what lives under `swarmd/<run>/` is
readable in one place (and access.py's filter of a run's keys can be checked against it). A
module of its own, with no torch, so that readers that never train (`swarmd dashboard`,
`swarmd status`) name the keys too; the modules that define what is stored under each key
say so in its docstring."""

from __future__ import annotations


def run_prefixes(run: str) -> tuple[str, str]:
    """What every key of ``run`` begins with (access.py filters a run's records by them)."""
    return f"swarmd/{run}/", f"{run}/"


#: The run config's lifetime in the DHT: records live at most a day; the creator re-publishes
#: it while it runs.
CONFIG_TTL_S = 23 * 3600.0


def config_key(run: str) -> str:
    """The run's signed config, one entry per signer (peer/runrecord.py)."""
    return f"swarmd/{run}/config"


def peers_key(run: str) -> str:
    """Heartbeats: one entry per live peer, naming its address (peer/membership.py)."""
    return f"swarmd/{run}/peers"


#: What follows the address in a client-mode peer's heartbeat (nobody can dial it).
CLIENT_MARK = " client"


def is_client(heartbeat_value: str) -> bool:
    return heartbeat_value.endswith(CLIENT_MARK)


def heartbeat_address(heartbeat_value: str) -> str:
    """The address a heartbeat names, without the client mark."""
    return heartbeat_value.removesuffix(CLIENT_MARK)


def progress_key(run: str) -> str:
    """Progress records: one entry per training peer, refreshed with its progress line
    (progress_record.py); what the dashboard shows."""
    return f"swarmd/{run}/progress"


def advert_key(run: str, scope: str = "") -> str:
    """The DHT key under which donors of ``run`` advertise; each donor uses its peer id as
    sub-key, so a peer has exactly one current advert and nobody can overwrite another's.
    A ``scope`` (a SWARM stage's state: peer/sharedstate.py) has adverts of its own."""
    return f"{run}/{scope}/state" if scope else f"{run}/state"


def round_key(run: str, round_no: int, fragment: int = 0) -> str:
    """Matchmaking of one outer round (and streaming fragment): averaging/matchmaking.py."""
    return f"swarmd/{run}/mm/{fragment}/{round_no}"


def state_round_key(run: str, round_no: int, state_hash: bytes, fragment: int = 0) -> str:
    """A round's matchmaking among only the peers that hold the very same state (the first
    16 hex digits of its hash): a peer that drifted can never blend its parameters into the
    group's (algorithms/loop.py, DeMo's groups in algorithms/demo/strategy.py)."""
    return f"{round_key(run, round_no, fragment)}/{state_hash.hex()[:16]}"


def stage_round_key(run: str, stage: int, state_hash: bytes, boundary: int) -> str:
    """A SWARM stage's averaging round, among its servers that hold the same stage state (the
    first 32 hex digits of its hash) at the same wall-clock boundary (periods since the
    epoch: a state carried through a lone round keys the next round anew; server_role.py)."""
    return f"swarmd/{run}/stage{stage}/{state_hash.hex()[:32]}/{boundary}"


def recovery_key(run: str, stage: int) -> str:
    """Who rebuilds a lost SWARM stage: an entry per asker, the earliest holds it
    (algorithms/swarm/recovery.py)."""
    return f"swarmd/{run}/stage{stage}/recovery"


def stages_key(run: str) -> str:
    """SWARM stage servers: one entry per server, naming its stage, address and measured
    throughput (algorithms/swarm/directory.py)."""
    return f"swarmd/{run}/stages"


def access_key(run: str) -> str:
    """The run's access list (allowed and denied keys), signed by its creator under its own
    peer id; entries of other signers are not read (node/access.py)."""
    return f"swarmd/{run}/access"


def members_key(run: str) -> str:
    """A secret run's member tokens: one entry per peer, an HMAC of its own peer id under the
    run's secret, which only holders of the secret can check (node/access.py)."""
    return f"swarmd/{run}/members"
