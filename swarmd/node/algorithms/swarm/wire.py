"""What a trainer and a stage server send each other: a few tensors in one payload.

A stage call carries up to four tensors (token ids, hidden states, targets, gradients), so
they travel as one bundle on the tensor plane rather than as one call each (a round trip per
tensor would double a micro-batch's latency on a wide-area link). Layout, little-endian::

    "SWB1" count:u8 then per entry: codec:u8 ndim:u8 dims:u32*ndim
    then each entry's bytes, in order

Float tensors travel in the run's activation format (fp16 by default, as SWARM and Petals
send activations; bf16, fp32, or int8 with one fp16 scale per row of the last dimension).
Everything is checked before use: the declared sizes must add up to exactly the payload,
shapes are bounded, floats must be finite. The caller then checks shapes against what its
stage expects (`expect`)."""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAGIC = b"SWB1"
MAX_ENTRIES = 4
MAX_DIMS = 4
MAX_DIM = 1 << 24
#: The largest magnitude a float may have on the wire, whatever its format: fp16's largest.
#: Activations and gradients beyond it are a diverged or hostile micro-batch, and fp16 would
#: carry them as infinities.
MAX_ABS = 65504.0

#: codec number -> (name, element bytes of the stored dtype)
_F32, _F16, _BF16, _I64, _Q8 = range(5)
ACTIVATION_CODECS = {"fp32": _F32, "fp16": _F16, "bf16": _BF16, "int8": _Q8}
_RAW = {_F32: torch.float32, _F16: torch.float16, _BF16: torch.bfloat16, _I64: torch.int64}


class WireError(ValueError):
    """A malformed or refused bundle: the caller answers INVALID_ARGUMENT with this text."""


def _as_bytes(t: torch.Tensor) -> memoryview:
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    view: memoryview = memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]
    return view


def _entry_bytes(codec: int, shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    if codec == _Q8:
        return n + 2 * (n // shape[-1])
    return n * _RAW[codec].itemsize


def _encode_q8(t: torch.Tensor) -> list[memoryview]:
    x = t.detach().float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / 127.0
    scale16 = scale.to(torch.float16).clamp_min(torch.finfo(torch.float16).tiny)
    codes = torch.round(x / scale16.float()).clamp_(-127, 127).to(torch.int8)
    return [_as_bytes(codes), _as_bytes(scale16)]


def encode(tensors: Sequence[torch.Tensor], activations: str = "fp16") -> list[memoryview]:
    """The bundle of `tensors` (int64 ones as they are, floats in `activations`)."""
    if not 1 <= len(tensors) <= MAX_ENTRIES:
        raise ValueError(f"a bundle holds 1..{MAX_ENTRIES} tensors, got {len(tensors)}")
    head = [MAGIC, struct.pack("<B", len(tensors))]
    body: list[memoryview] = []
    for t in tensors:
        codec = _I64 if t.dtype == torch.int64 else ACTIVATION_CODECS[activations]
        if codec == _Q8 and t.dim() == 0:
            codec = _F32  # a scalar (the loss) has no row to scale
        head.append(struct.pack(f"<BB{t.dim()}I", codec, t.dim(), *t.shape))
        if codec == _Q8:
            body.extend(_encode_q8(t))
        else:
            body.append(_as_bytes(t.to(_RAW[codec])))
    return [memoryview(b"".join(head)), *body]


@dataclass(frozen=True)
class _Entry:
    codec: int
    shape: tuple[int, ...]


def _read_header(data: memoryview) -> tuple[list[_Entry], int]:
    if len(data) < 5 or bytes(data[:4]) != MAGIC:
        raise WireError("not a stage bundle (bad magic)")
    (count,) = struct.unpack_from("<B", data, 4)
    if not 1 <= count <= MAX_ENTRIES:
        raise WireError(f"a bundle holds 1..{MAX_ENTRIES} tensors, this one says {count}")
    pos, entries = 5, []
    for _ in range(count):
        if pos + 2 > len(data):
            raise WireError("bundle header cut short")
        codec, ndim = struct.unpack_from("<BB", data, pos)
        pos += 2
        if codec > _Q8 or ndim > MAX_DIMS or pos + 4 * ndim > len(data):
            raise WireError(f"bad bundle entry (codec {codec}, {ndim} dims)")
        shape = struct.unpack_from(f"<{ndim}I", data, pos)
        pos += 4 * ndim
        if any(not 1 <= d <= MAX_DIM for d in shape) or (codec == _Q8 and ndim == 0):
            raise WireError(f"bad bundle entry shape {shape}")
        entries.append(_Entry(codec, shape))
    return entries, pos


def decode(payload: bytes | bytearray | memoryview) -> list[torch.Tensor]:
    """The bundle's tensors: int64 as sent, floats as fp32; raises WireError if malformed,
    cut short or padded, or if a float is NaN or infinite."""
    data = memoryview(payload).cast("B")
    entries, pos = _read_header(data)
    need = sum(_entry_bytes(e.codec, e.shape) for e in entries)
    if pos + need != len(data):
        raise WireError(f"bundle declares {pos + need} bytes, carries {len(data)}")
    out = []
    for e in entries:
        size = _entry_bytes(e.codec, e.shape)
        raw = torch.frombuffer(bytearray(data[pos : pos + size]), dtype=torch.uint8)
        pos += size
        if e.codec == _Q8:
            n = size * e.shape[-1] // (e.shape[-1] + 2)
            codes = raw[:n].view(torch.int8).reshape(e.shape).float()
            scales = raw[n:].view(torch.float16).reshape(*e.shape[:-1], 1).float()
            t = codes * scales
        else:
            t = raw.view(_RAW[e.codec]).reshape(e.shape)
            if e.codec != _I64:
                t = t.float()
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise WireError("bundle carries NaN or infinite values")
        if t.is_floating_point() and t.numel() and float(t.abs().max()) > MAX_ABS:
            raise WireError(f"bundle carries values beyond {MAX_ABS:g}")
        out.append(t)
    return out


def expect(
    tensors: Sequence[torch.Tensor], shapes: Sequence[tuple[int | None, ...]], what: str
) -> None:
    """Refuses a bundle whose tensors are not `shapes` (None: any size in that dimension)."""
    if len(tensors) != len(shapes):
        raise WireError(f"{what}: expected {len(shapes)} tensors, got {len(tensors)}")
    for i, (t, want) in enumerate(zip(tensors, shapes, strict=True)):
        ok = t.dim() == len(want) and all(
            w is None or w == d for w, d in zip(want, t.shape, strict=False)
        )
        if not ok:
            shown = tuple("*" if w is None else w for w in want)
            raise WireError(f"{what}: tensor {i} has shape {tuple(t.shape)}, expected {shown}")
