"""`swarmd export`: a run's model out of the swarm, as files other tools load.

Online (``--run NAME --peers HOST:PORT``) it joins the DHT as a client only, reads the run's
config (signed by its creator) and the live peers' state adverts, and takes the state that
most of them hold, if at least ``--quorum`` of them agree on its hash (default: a majority of
the advertisers). It downloads that state as a joiner would: chunk by chunk against the
manifest the advertisers signed, from every donor that serves it, refusing one of another
layout or with non-finite values. Offline (``--state-dir DIR``) it reads a peer's own saved
state, which says which run config it belongs to.

It writes ``OUT/model.safetensors`` and, for the built-in GPT, ``OUT/config.json``:
Hugging Face's GPT-2 layout (swarmd/workloads/weights.py says why that class), so
``transformers.AutoModelForCausalLM.from_pretrained(OUT)`` loads it. A user's model gets its
parameters under its own names. Exit codes: 0 written, 1 no such run or no quorum, 2 bad
input (a state that does not fit its config, an unwritable directory), 3 no bootstrap peer
answered.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import trio

from swarmd.node.cli.options import CliError
from swarmd.node.dht import DHTNode
from swarmd.node.dht.oneshot import client_dht
from swarmd.node.peer.localstate import STATE_FILE
from swarmd.node.peer.model import gpt_config
from swarmd.node.peer.options import JoinError
from swarmd.node.peer.runconfig import RunConfig, RunConfigError
from swarmd.node.peer.runrecord import choose, claims
from swarmd.node.statesync.donor import StateAdvert, advert_key
from swarmd.node.statesync.download import StateSyncError, download_state
from swarmd.node.statesync.vet import nonfinite
from swarmd.optim.statedicts import GLOBAL_PREFIX
from swarmd.protocol import rpc
from swarmd.protocol.identity import Identity, PeerId
from swarmd.workloads.gpt import GPT
from swarmd.workloads.weights import WeightsError, gpt2_config, to_gpt2, write_weights


class ExportError(CliError):
    """Why nothing was written; ``code`` is the command's exit status."""


@dataclass(frozen=True)
class Exported:
    config: RunConfig
    #: The state's outer round and how many live peers advertised it (0: offline).
    round: int
    holders: int
    #: The downloaded state's hash (hex; "" offline).
    state_hash: str = ""


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def choose_state(adverts: Sequence[StateAdvert], quorum: int | None) -> tuple[bytes, list[str]]:
    """The newest state at least ``quorum`` dialable advertisers hold (None: more than half
    of them; among equal rounds, the one most hold) and its donors' addresses."""
    served = [a for a in adverts if not a.client]
    if not served:
        raise ExportError("no live peer that can be dialled advertises a state of this run")
    holders = Counter(a.state_hash for a in served)
    rounds = {a.state_hash: a.round for a in served}
    need = len(served) // 2 + 1 if quorum is None else quorum
    agreed = [h for h, n in holders.items() if n >= need]
    if not agreed:
        spread = ", ".join(f"round {rounds[h]}: {n}" for h, n in holders.most_common(4))
        raise ExportError(
            f"no quorum: the most peers agreeing on one state is {max(holders.values())} of "
            f"{len(served)}, {need} needed ({spread}); the run may be mid-round: try again, "
            "or pass --quorum"
        )
    best = max(agreed, key=lambda h: (rounds[h], holders[h], h))
    return best, sorted({a.address for a in served if a.state_hash == best})


async def _settled(
    dht: DHTNode, run: str, quorum: int | None, wait_s: float
) -> tuple[list[tuple[str, StateAdvert]], bytes, list[str]]:
    """The run's state adverts once a quorum agrees: peers of a live run publish each round's
    state a moment apart, so a read between two of them may find no quorum yet; it is read
    again every second for ``wait_s``."""
    last = ExportError(f"run {run!r}: no state adverts could be read in {wait_s:g}s")
    with trio.move_on_after(wait_s):
        while True:
            adverts = []
            for owner, value in (await dht.get_map(advert_key(run), exhaustive=True)).items():
                try:
                    adverts.append((owner, StateAdvert.from_bytes(value.value)))
                except ValueError:
                    continue
            try:
                want, donors = choose_state([a for _, a in adverts], quorum)
            except ExportError as exc:
                last = exc
                await trio.sleep(1.0)
                continue
            return adverts, want, donors
    raise last


async def _fetch(
    run: str, peers: Sequence[str], quorum: int | None, deadline_s: float
) -> tuple[RunConfig, dict[str, torch.Tensor], Exported]:
    identity = Identity.generate()
    async with client_dht(identity, peers) as dht:
        try:
            claim = choose(await claims(dht, run), run, None)
        except JoinError as exc:
            raise ExportError(str(exc)) from None
        if claim is None:
            raise ExportError(f"run {run!r}: no configuration in the DHT (is the name right?)")
        try:
            config = RunConfig.from_json(claim.raw)
        except RunConfigError as exc:
            raise ExportError(f"run {run!r}: its config is unusable: {exc}") from None
        adverts, want, donors = await _settled(dht, run, quorum, min(60.0, deadline_s))
    holders = [(o, a) for o, a in adverts if a.state_hash == want and not a.client]
    peer_ids = {a.address: PeerId.from_string(o) for o, a in holders}
    _say(f"run {run!r}: state {want.hex()[:16]} (round {holders[0][1].round}), held by "
         f"{len(holders)} of {len(adverts)} advertising peers; downloading")  # fmt: skip
    shown = [-1]

    def progress(done: int, total: int) -> None:
        tenth = done * 10 // max(1, total)
        if tenth != shown[0]:
            shown[0] = tenth
            _say(f"  {done}/{total} chunks")

    client = rpc.RpcClient(identity)
    try:
        snap = await download_state(
            client,
            donors,
            deadline_s=deadline_s,
            want_hash=want,
            peer_ids=peer_ids,
            on_progress=progress,
        )
    except StateSyncError as exc:
        raise ExportError(f"the download failed: {exc}") from None
    finally:
        client.close()
    if snap.meta.get("config") != config.hash:
        raise ExportError("the downloaded state belongs to another run config", 2)
    info = Exported(config, snap.round, len(holders), want.hex())
    return config, snap.to_state_dict(), info


def _offline(state_dir: Path) -> tuple[RunConfig, dict[str, torch.Tensor], Exported]:
    path = state_dir / STATE_FILE
    try:
        saved = torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise ExportError(f"{path}: no saved state (is this a peer's --state-dir?)") from None
    except Exception as exc:  # a torn or foreign file
        raise ExportError(f"{path}: unreadable ({exc})", 2) from None
    text = saved.get("config") if isinstance(saved, dict) else None
    if not isinstance(text, str):
        raise ExportError(
            f"{path} does not say which run config it belongs to (saved by an older swarmd): "
            "export from the live run with --run and --peers",
            2,
        )
    try:
        config = RunConfig.from_json(text.encode())
    except RunConfigError as exc:
        raise ExportError(f"{path}: its run config is unusable: {exc}", 2) from None
    if saved.get("config_hash") != config.hash:
        raise ExportError(f"{path}: the state's config hash does not match its config", 2)
    state = saved.get("global")
    if not isinstance(state, dict):
        raise ExportError(f"{path}: no global state in it", 2)
    round_ = state.get("round")
    return config, state, Exported(config, int(round_) if round_ is not None else 0, 0)


def model_weights(
    config: RunConfig, state: Mapping[str, torch.Tensor]
) -> tuple[dict[str, torch.Tensor], dict[str, object] | None]:
    """The model's parameters out of a global state, in the exported names, and the
    config.json that goes with them (None for a user's model)."""
    if config.algo == "swarm":
        raise ExportError("export of SWARM runs (a state per stage) is not supported yet", 2)
    params = {
        k.removeprefix(GLOBAL_PREFIX): v for k, v in state.items() if k.startswith(GLOBAL_PREFIX)
    }
    if not params:
        raise ExportError("the state holds no model parameters", 2)
    why = nonfinite(params)
    if why is not None:
        raise ExportError(f"the state is unusable: {why}", 2)
    gpt = gpt_config(config)
    if gpt is None:
        return params, None
    with torch.device("meta"):
        shapes = {n: tuple(p.shape) for n, p in GPT(gpt).named_parameters()}
    for name, shape in shapes.items():
        if name not in params or tuple(params[name].shape) != shape:
            raise ExportError(f"the state does not fit the run's model ({name})", 2)
    try:
        return to_gpt2(params, gpt), gpt2_config(gpt)
    except WeightsError as exc:
        raise ExportError(str(exc), 2) from None


def export(
    out: Path,
    *,
    run: str | None = None,
    peers: Sequence[str] = (),
    state_dir: Path | None = None,
    dtype: str = "fp32",
    quorum: int | None = None,
    deadline_s: float = 600.0,
) -> int:
    """The command; returns its exit status (0), or raises ExportError (a CliError: the exit
    status is its code) or, from inside the trio run, a group holding one."""
    if state_dir is not None:
        config, state, info = _offline(state_dir)
    else:
        assert run is not None
        config, state, info = trio.run(_fetch, run, list(peers), quorum, deadline_s)
    tensors, hf_config = model_weights(config, state)
    meta = {
        "run": config.name,
        "config_hash": config.hash,
        "round": str(info.round),
        "state_hash": info.state_hash,
    }
    try:
        path = write_weights(out, tensors, hf_config, dtype, meta)
    except OSError as exc:
        raise ExportError(f"could not write to {out}: {exc.strerror or exc}", 2) from None
    count = sum(t.numel() for t in tensors.values())
    size = path.stat().st_size
    kind = "GPT-2 layout (transformers loads it)" if hf_config else "the model's own names"
    print(
        f"wrote {path} ({count / 1e6:.2f}M values, {size / 1e6:.1f} MB, {dtype}, {kind}) from "
        f"run {config.name!r} round {info.round}"
        + (f", a state {info.holders} live peers agreed on" if info.holders else "")
    )
    return 0
