"""Where a peer's model trains: `--device auto|cpu|cuda[:N]|mps`.

Volunteers bring GPUs or only CPUs, and a run must take both: the device is a peer's own
choice, never part of the run's configuration (the config hash stays the same). Only the
model, its inner optimiser and its batches live there; the global parameters, the outer
momentum and everything that crosses the network stay fp32 on the CPU (see
`swarmd/optim/diloco.py`), so peers on different devices average the same vectors.

`auto` takes the first CUDA GPU when this torch build sees one, else the CPU. Asking for a
device that is not there is an error that says so at start-up, rather than a CUDA exception
from deep inside the first training step.
"""

from __future__ import annotations

import torch

DEVICE_CHOICES = "auto, cpu, cuda, cuda:N or mps"


class DeviceError(ValueError):
    """The requested device does not exist on this machine (or is not a device name)."""


def resolve_device(spec: str) -> torch.device:
    """The torch device `spec` names, checked to be usable here."""
    text = spec.strip().lower()
    if text == "auto":
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise DeviceError(f"unknown device {spec!r}; use {DEVICE_CHOICES}") from None
    if device.type == "cpu":
        return torch.device("cpu")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(
                f"device {spec!r}: this torch build sees no CUDA GPU (torch {torch.__version__}, "
                f"CUDA {torch.version.cuda or 'not built in'}); use --device cpu or auto"
            )
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise DeviceError(
                f"device {spec!r}: only {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}"
            )
        return device
    if device.type == "mps":
        if not torch.backends.mps.is_available():
            raise DeviceError(f"device {spec!r}: Apple MPS is not available here; use cpu")
        return device
    raise DeviceError(f"device {spec!r} is not supported; use {DEVICE_CHOICES}")
