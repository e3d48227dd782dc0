"""Shared timing helper for the benchmarks: median wall time of a jitted call, synchronised."""

from __future__ import annotations

import time

import jax
import numpy as np


def median_time(fn, *args, iters: int = 10, warmup: int = 2) -> float:
    """Median seconds of ``fn(*args)`` over ``iters`` calls after ``warmup`` calls (compile)."""
    out = None
    for _ in range(warmup):
        out = fn(*args)
    jax.block_until_ready(out)
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        samples.append(time.perf_counter() - t0)
    return float(np.median(samples))
