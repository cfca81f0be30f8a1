"""The built-in model (a small, stage-splittable GPT) and data sources.

Imports torch and the standard library only: the daemon depends on this package,
never the reverse.
"""

from swarmd.workloads.allowed import AllowedWorkloads, WorkloadNotAllowed
from swarmd.workloads.data import (
    BYTE_VOCAB,
    DataError,
    TokenSource,
    bin_source,
    builtin_corpus,
    load_source,
    shard_for_peer,
    text_source,
)
from swarmd.workloads.device import DeviceError, resolve_device
from swarmd.workloads.evaluate import evaluate
from swarmd.workloads.gpt import GPT, GPTConfig, lm_loss
from swarmd.workloads.registry import ModelLoadError, check_model, load_model

__all__ = [
    "BYTE_VOCAB",
    "GPT",
    "AllowedWorkloads",
    "DataError",
    "DeviceError",
    "GPTConfig",
    "ModelLoadError",
    "TokenSource",
    "WorkloadNotAllowed",
    "bin_source",
    "builtin_corpus",
    "check_model",
    "evaluate",
    "lm_loss",
    "load_model",
    "load_source",
    "resolve_device",
    "shard_for_peer",
    "text_source",
]
