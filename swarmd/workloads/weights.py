"""A model's weights in and out of swarmd, in formats other tools read.

The built-in GPT is written in Hugging Face's GPT-2 layout (`GPT2LMHeadModel`), because it is
GPT-2's architecture exactly once the biases are zero: learned positions, pre-norm blocks,
LayerNorm with eps 1e-5, exact GELU (`activation_function = "gelu"`, not GPT-2's tanh
"gelu_new"), attention scaled by 1/sqrt(head size), a 4x MLP and, unless the run unties them
(SWARM), the output projection tied to the token embedding. GPT-2's `Conv1D` stores each
weight as (in, out), the transpose of `nn.Linear`'s. Llama or GPT-NeoX would need rotary
positions and another norm; GPT-2 needs nothing but zeros.

A user's model (an entry point) is written as its own `state_dict()` names.

Files are safetensors: a header of names, dtypes and shapes, then raw bytes, so reading one
runs no code (a torch pickle can). Everything is written to a temporary name and renamed, so
a failure leaves no half-written file behind.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from swarmd.workloads.gpt import GPT, GPTConfig

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
#: A weights file larger than this is refused before it is read (a 7B fp32 model is 28 GB).
MAX_WEIGHTS_BYTES = 64 << 30
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class WeightsError(ValueError):
    """A weights file that cannot be used; the message says which tensor and why."""


def _linear(name: str) -> bool:
    return name.endswith(("attn.qkv.weight", "attn.proj.weight", "fc.weight", "fc_proj.weight"))


def _gpt2_name(name: str) -> str:
    """swarmd's GPT parameter name -> GPT2LMHeadModel's."""
    if name == "head.lm_head.weight":
        return "lm_head.weight"
    if name.startswith("embed."):
        return "transformer." + name.removeprefix("embed.")
    if name == "head.ln_f.weight":
        return "transformer.ln_f.weight"
    _, index, rest = name.split(".", 2)  # blocks.{i}.{rest}
    rest = {
        "ln1.weight": "ln_1.weight",
        "ln2.weight": "ln_2.weight",
        "attn.qkv.weight": "attn.c_attn.weight",
        "attn.proj.weight": "attn.c_proj.weight",
        "fc.weight": "mlp.c_fc.weight",
        "fc_proj.weight": "mlp.c_proj.weight",
    }[rest]
    return f"transformer.h.{index}.{rest}"


def _bias_of(gpt2_name: str) -> str | None:
    """The bias GPT-2 has next to this weight (swarmd's GPT has none: written as zeros)."""
    if gpt2_name.startswith("transformer.h.") or gpt2_name == "transformer.ln_f.weight":
        return gpt2_name.removesuffix("weight") + "bias"
    return None


def to_gpt2(params: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """The built-in GPT's parameters (named as `GPT.named_parameters()`; a tied head may be
    missing) in GPT2LMHeadModel's names and layout, with its zero biases."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in params.items():
        if config.tie_weights and name == "head.lm_head.weight":
            continue  # the same tensor as the token embedding
        try:
            key = _gpt2_name(name)
        except (ValueError, KeyError):
            raise WeightsError(f"{name!r} is not a parameter of the built-in GPT") from None
        value = tensor.detach().to("cpu", torch.float32)
        out[key] = (value.t() if _linear(name) else value).contiguous()
        bias = _bias_of(key)
        if bias is not None:
            out[bias] = torch.zeros(out[key].shape[-1])
    return out


def from_gpt2(tensors: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """GPT2LMHeadModel-named tensors back to the built-in GPT's parameter names. Biases must
    be zero (this GPT has none); a tied head is taken from the embedding."""
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in GPT(config).named_parameters()}
    wanted = {_gpt2_name(n): n for n in shapes}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in tensors.items():
        if key.endswith(".bias") and key.removesuffix("bias") + "weight" in wanted:
            if bool(tensor.any()):
                raise WeightsError(f"{key}: the built-in GPT has no biases; this one is not zero")
            continue
        if key == "lm_head.weight" and config.tie_weights:
            continue
        if key not in wanted:
            raise WeightsError(f"{key!r} is not a tensor of this run's model")
        name = wanted[key]
        out[name] = tensor.t().contiguous() if _linear(name) else tensor
    return out


def gpt2_config(config: GPTConfig) -> dict[str, Any]:
    """config.json for `transformers.AutoModelForCausalLM.from_pretrained(dir)`."""
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": config.vocab_size,
        "n_positions": config.block_size,
        "n_embd": config.n_embd,
        "n_layer": config.n_layer,
        "n_head": config.n_head,
        "n_inner": 4 * config.n_embd,
        "activation_function": "gelu",
        "layer_norm_epsilon": 1e-5,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "tie_word_embeddings": config.tie_weights,
        "torch_dtype": "float32",
        "swarmd": {"model": "builtin", "byte_tokens": config.vocab_size == 256},
    }


def write_weights(
    out_dir: Path,
    tensors: Mapping[str, torch.Tensor],
    config: Mapping[str, Any] | None,
    dtype: str = "fp32",
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Writes ``out_dir/model.safetensors`` (and ``config.json`` when given), each through a
    temporary file renamed into place. Returns the weights file's path."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise WeightsError(f"dtype {dtype!r}: one of {', '.join(DTYPES)}")
    out_dir.mkdir(parents=True, exist_ok=True)
    cast = {k: v.detach().to("cpu", DTYPES[dtype]).contiguous() for k, v in tensors.items()}
    path = out_dir / WEIGHTS_FILE
    tmp = out_dir / f".{WEIGHTS_FILE}.{os.getpid()}.tmp"
    try:
        save_file(cast, str(tmp), metadata=dict(metadata or {}))
        os.replace(tmp, path)
        if config is not None:
            text = json.dumps({**config, "torch_dtype": _hf_dtype(dtype)}, indent=2)
            tmp_cfg = out_dir / f".{CONFIG_FILE}.{os.getpid()}.tmp"
            tmp_cfg.write_text(text + "\n")
            os.replace(tmp_cfg, out_dir / CONFIG_FILE)
    finally:
        for leftover in out_dir.glob(f".*.{os.getpid()}.tmp"):
            leftover.unlink(missing_ok=True)
    return path


def _hf_dtype(dtype: str) -> str:
    return {"fp32": "float32", "bf16": "bfloat16"}[dtype]


def read_weights(path: Path, expected: Mapping[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Reads a safetensors file and checks it against ``expected`` (name -> shape): every
    name present, no other, each shape equal, every value a finite float. Returns fp32
    tensors. Raises WeightsError saying what is wrong."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        size = path.stat().st_size
    except OSError as exc:
        raise WeightsError(f"{path}: {exc.strerror or exc}") from None
    if size > MAX_WEIGHTS_BYTES:
        raise WeightsError(f"{path}: {size} bytes, over the {MAX_WEIGHTS_BYTES} bytes allowed")
    try:
        tensors = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise WeightsError(f"{path}: not a readable safetensors file ({exc})") from None
    return check_weights(tensors, expected, str(path))


def check_weights(
    tensors: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Size], where: str
) -> dict[str, torch.Tensor]:
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise WeightsError(
            f"{where}: tensors do not match the run's model "
            f"(missing: {', '.join(missing[:5]) or '-'}; unknown: {', '.join(extra[:5]) or '-'})"
        )
    out = {}
    for name, shape in expected.items():
        tensor = tensors[name]
        if tuple(tensor.shape) != tuple(shape):
            raise WeightsError(
                f"{where}: {name} has shape {tuple(tensor.shape)}, the run's model {tuple(shape)}"
            )
        if not tensor.dtype.is_floating_point:
            raise WeightsError(f"{where}: {name} is {tensor.dtype}, not a float tensor")
        value = tensor.to(torch.float32)
        if not bool(torch.isfinite(value).all()):
            raise WeightsError(f"{where}: {name} holds NaN or infinite values")
        out[name] = value
    return out
