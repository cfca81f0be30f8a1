"""Keeping Python's cyclic garbage collector off the long-lived heap of a daemon.

A daemon imports torch, grpc and protobuf before it serves anything: a few hundred thousand
objects that live until exit. CPython's full collections walk all of them each time, and an
all-reduce round allocates enough short-lived containers (trio tasks, protobuf messages,
byte views) to set off several: in 4-peer, 100 M-value rounds on 2 cores, `gc_collect_main`
was 8.5% of all CPU samples (perf), the largest single user-space cost after the tensor
kernels. `gc.freeze()` moves what exists into a permanent generation that collections skip;
objects made later are collected as before.
"""

from __future__ import annotations

import gc


def settle_heap() -> None:
    """Collect once, then exempt every surviving object from later collections; call after
    start-up imports and before the main loop."""
    gc.collect()
    gc.freeze()
