"""Compression benchmark: ratio vs fp32, relative L2 error and single-core encode/decode
throughput of every codec in swarmd.compression, on realistic inputs.

Inputs:
  * grads   - gradients of a small GPT-like model (built here: the project's built-in model
              does not exist yet) after a few AdamW steps on random tokens;
  * pseudo  - the DiLoCo pseudo-gradient of that model: params before - after H steps;
  * normal  - 25M-element standard normal tensor (100 MB fp32).
Tensors are encoded one parameter at a time (as the averaging layer will); throughput is
fp32 bytes / median wall time with torch.set_num_threads(1).

Usage: python benchmarks/compression.py [--quick]
The last line is `int8_ratio=... int8_rel_err=... int8_encode_GBps=... int8_decode_GBps=...`
(int8, block 256, on the 25M normal tensor).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from swarmd.compression import (
    FRAME_OVERHEAD,
    DctTopKCodec,
    DctTopKConfig,
    DecodeLimits,
    HalfCodec,
    HalfConfig,
    Int8Codec,
    Int8Config,
    PowerSGD,
    PowerSGDConfig,
    RawCodec,
    ZstdFramed,
    decode,
    zstd_compress,
)

Tensors = dict[str, torch.Tensor]


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int = 512, d: int = 192, layers: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, 4) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        x = self.tok(idx) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, mask)
        logits: torch.Tensor = self.head(self.ln(x))
        return logits


def model_inputs(inner_steps: int = 8) -> tuple[Tensors, Tensors, int]:
    """Real gradients and a real pseudo-gradient from a few AdamW steps on random tokens."""
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads: Tensors = {}
    for _ in range(inner_steps):
        tokens = torch.randint(0, 512, (8, 65))
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.reshape(-1, 512), tokens[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        grads = {
            k: v.grad.detach().clone() for k, v in model.named_parameters() if v.grad is not None
        }
        opt.step()
    pseudo = {k: before[k] - v.detach() for k, v in model.named_parameters()}
    return grads, pseudo, sum(v.numel() for v in before.values())


Encoder = Callable[[str, torch.Tensor], bytes]


def codecs() -> dict[str, Callable[[], Encoder]]:
    """Fresh encoder per measurement (PowerSGD is stateful)."""

    def plain(codec: RawCodec | HalfCodec | Int8Codec | DctTopKCodec | ZstdFramed) -> Encoder:
        return lambda _key, x: codec.encode(x)

    def powersgd() -> Encoder:
        return PowerSGD(PowerSGDConfig(rank=4)).encode

    return {
        "fp16": lambda: plain(HalfCodec(HalfConfig("float16"))),
        "bf16": lambda: plain(HalfCodec(HalfConfig("bfloat16"))),
        "int8": lambda: plain(Int8Codec(Int8Config(block_size=256))),
        "int8+zstd": lambda: plain(ZstdFramed(Int8Codec(Int8Config(block_size=256)))),
        "powersgd-r4": powersgd,
        "dct-top32-fp16": lambda: plain(DctTopKCodec(DctTopKConfig(topk=32, values="float16"))),
        "dct-top32-sign": lambda: plain(DctTopKCodec(DctTopKConfig(topk=32, values="sign"))),
        "zstd(fp32)": lambda: plain(ZstdFramed(RawCodec())),
    }


def measure(
    encoder_factory: Callable[[], Encoder], inputs: Tensors, repeats: int
) -> dict[str, float]:
    enc_times, dec_times = [], []
    payloads: dict[str, bytes] = {}
    decoded: Tensors = {}
    for _ in range(repeats):
        encode = encoder_factory()
        t0 = time.perf_counter()
        payloads = {k: encode(k, v) for k, v in inputs.items()}
        enc_times.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        decoded = {
            k: decode(p, DecodeLimits(inputs[k].numel(), inputs[k].numel() * 8 + 4096))
            for k, p in payloads.items()
        }
        dec_times.append(time.perf_counter() - t0)
    raw_bytes = sum(v.numel() * 4 for v in inputs.values())
    err2 = sum(float((decoded[k].double() - v.double()).pow(2).sum()) for k, v in inputs.items())
    norm2 = sum(float(v.double().pow(2).sum()) for v in inputs.values())
    return {
        "ratio": raw_bytes / sum(len(p) for p in payloads.values()),
        "rel_err": math.sqrt(err2 / norm2),
        "encode_GBps": raw_bytes / statistics.median(enc_times) / 1e9,
        "decode_GBps": raw_bytes / statistics.median(dec_times) / 1e9,
    }


def zstd_overhead_check(inputs: list[Tensors]) -> int:
    """Largest (frame - input) size over every payload: must never exceed the header."""
    worst = -(1 << 62)
    for group in inputs:
        for x in group.values():
            for inner in (RawCodec().encode(x), Int8Codec().encode(x)):
                worst = max(worst, len(zstd_compress(inner)) - len(inner))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1M-element normal tensor")
    args = parser.parse_args()
    torch.set_num_threads(1)
    numel = 1_000_000 if args.quick else 25_000_000
    grads, pseudo, n_params = model_inputs()
    normal = {"normal": torch.randn(numel, generator=torch.Generator().manual_seed(0))}
    # PowerSGD compresses matrices: show the 25M tensor to it as 5000 x 5000.
    side = math.isqrt(numel)
    normal_matrix = {"normal": normal["normal"][: side * side].view(side, side)}
    print(f"# torch {torch.__version__}, threads={torch.get_num_threads()}")
    print(
        f"# model: TinyGPT built in this script (the built-in model does not exist yet), "
        f"{n_params / 1e6:.2f}M params; grads = last of 8 AdamW steps on random tokens, "
        f"pseudo = params before - after those 8 steps"
    )
    print(f"# normal: {numel} elements N(0,1) (PowerSGD sees it as {side}x{side})")
    header = (
        f"{'input':<8} {'codec':<16} {'ratio':>8} {'rel_err':>9} {'enc_GB/s':>9} {'dec_GB/s':>9}"
    )
    print(header)
    results: dict[tuple[str, str], dict[str, float]] = {}
    for input_name, tensors in (("grads", grads), ("pseudo", pseudo), ("normal", normal)):
        for codec_name, factory in codecs().items():
            data = (
                normal_matrix if input_name == "normal" and codec_name == "powersgd-r4" else tensors
            )
            repeats = 3 if input_name == "normal" else 5
            r = measure(factory, data, repeats)
            results[(input_name, codec_name)] = r
            print(
                f"{input_name:<8} {codec_name:<16} {r['ratio']:>8.2f} {r['rel_err']:>9.5f} "
                f"{r['encode_GBps']:>9.3f} {r['decode_GBps']:>9.3f}",
                flush=True,
            )
    worst = zstd_overhead_check([grads, pseudo, normal])
    print(f"# zstd framing: worst growth over input = {worst} bytes (header is {FRAME_OVERHEAD})")
    ok = worst <= FRAME_OVERHEAD
    i8 = results[("normal", "int8")]
    targets = i8["ratio"] >= 3.9 and i8["encode_GBps"] >= 1 and i8["decode_GBps"] >= 1
    print(f"# targets: int8 ratio>=3.9 and >=1 GB/s each way: {targets}; zstd bounded: {ok}")
    print(
        f"int8_ratio={i8['ratio']:.3f} int8_rel_err={i8['rel_err']:.5f} "
        f"int8_encode_GBps={i8['encode_GBps']:.3f} int8_decode_GBps={i8['decode_GBps']:.3f}"
    )


if __name__ == "__main__":
    main()
