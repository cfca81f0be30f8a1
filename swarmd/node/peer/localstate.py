"""This peer's own copy of its state on disk: what it resumes from after a crash or a restart.

Written after every outer step (or fragment round), so a peer that dies loses at most the inner
steps since; the group's newer state, when one is advertised, still wins over it on restart.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from swarmd.node.statesync.vet import nonfinite

log = logging.getLogger("swarmd.daemon")

STATE_FILE = "state.pt"


class SaveError(Exception):
    """The state could not be written (a full disk, say); the last good file is untouched."""


def _temp_path(path: Path, pid: int) -> Path:
    return path.with_name(f".{path.name}.{pid}.tmp")


def remove_stale_temps(path: Path) -> list[Path]:
    """Removes the temp files that saves of ``path`` by dead processes left behind (a
    ``kill -9`` mid-save once left 170 MB that nothing ever removed); a live process's are
    kept (it may be saving now). Returns what was removed."""
    removed = []
    for tmp in path.parent.glob(f".{path.name}.*.tmp"):
        pid_text = tmp.name[len(path.name) + 2 : -len(".tmp")]
        if not pid_text.isdigit() or _alive(int(pid_text)):
            continue
        try:
            tmp.unlink()
        except OSError as exc:
            log.warning("could not remove the stale temp file %s: %s", tmp, exc)
            continue
        removed.append(tmp)
    if removed:
        log.info("removed %d stale temp file(s) of %s", len(removed), path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def save_state(path: Path, state: dict[str, Any]) -> None:
    """Atomic: a crash leaves the old file or the new one, never a torn one. Raises SaveError
    (the old file kept, the temp file removed) when the disk refuses the write."""
    tmp = _temp_path(path, os.getpid())
    try:
        with open(tmp, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise SaveError(f"could not save the state to {path}: {exc.strerror or exc}") from exc
        raise


def load_saved(path: Path, config_hash: str) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        state: dict[str, Any] = torch.load(path, weights_only=True)
    except Exception as exc:  # a torn or foreign file must not stop the peer: start over
        log.warning("ignoring unreadable saved state %s: %s", path, exc)
        return None
    if state.get("config_hash") != config_hash:
        log.warning("saved state %s belongs to another run config; ignoring it", path)
        return None
    for part in ("global", "local"):
        tensors = state.get(part, {} if part == "local" else None)
        why = nonfinite(tensors) if isinstance(tensors, dict) else f"no {part} state"
        if why is not None:  # a NaN state once crashed the peer that loaded it
            log.warning("ignoring saved state %s: %s", path, why)
            return None
    return state
