"""The DHT keys of a run, in a module of their own so that readers that never train (`swarmd
dashboard`, `swarmd status`) name them without importing torch (runconfig.py and the state
donor, whose modules define what is stored under them, do)."""

from __future__ import annotations

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


def advert_key(run: str) -> str:
    """The DHT key under which donors of ``run`` advertise; each donor uses its peer id as
    sub-key, so a peer has exactly one current advert and nobody can overwrite another's."""
    return f"{run}/state"


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
