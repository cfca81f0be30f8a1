"""`--device`: names resolve to usable torch devices, and a missing or unknown one is a clear
error before anything starts."""

from __future__ import annotations

import pytest
import torch

from swarmd.workloads import DeviceError, resolve_device


def test_cpu_and_auto() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(" CPU ") == torch.device("cpu")
    expected = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device("auto") == expected


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("gpu", "unknown device 'gpu'; use auto, cpu, cuda, cuda:N or mps"),
        ("", "unknown device ''"),
        ("meta", "device 'meta' is not supported"),
    ],
)
def test_names_that_are_not_training_devices(spec: str, message: str) -> None:
    with pytest.raises(DeviceError, match=message):
        resolve_device(spec)


def test_cuda_is_refused_without_a_gpu_and_checked_against_the_count() -> None:
    if not torch.cuda.is_available():
        with pytest.raises(DeviceError, match=r"sees no CUDA GPU.*use --device cpu or auto"):
            resolve_device("cuda")
        return
    assert resolve_device("cuda").type == "cuda"
    count = torch.cuda.device_count()
    with pytest.raises(DeviceError, match=f"only {count} CUDA GPU"):
        resolve_device(f"cuda:{count}")
