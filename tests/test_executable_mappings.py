"""The mechanism ``tests/conftest.py::_free_compiled_executables`` relies on: every live XLA:CPU
executable holds its own memory mappings, and ``jax.clear_caches()`` releases them. Without it one
pytest process running the whole suite reached Linux's vm.max_map_count (65,530) and died with
SIGSEGV inside LLVM."""

import gc
import os

import jax
import jax.numpy as jnp
import pytest


def _mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def _compile_programs(seed: int, n: int = 60) -> list:
    """``n`` distinct programs (the constant differs), each compiled and run; the executables live
    in the returned functions' caches, as they do in a test module's jitted helpers."""
    x = jnp.ones((4,))
    fns = [jax.jit(lambda v, c=float(seed * 1000 + i): v * c + c) for i in range(n)]
    for f in fns:
        f(x).block_until_ready()
    return fns


def _clear() -> int:
    jax.clear_caches()
    gc.collect()
    return _mappings()


def test_clear_caches_releases_the_mappings_of_compiled_executables():
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs Linux /proc to count memory mappings")
    _compile_programs(0)  # one-time set-up of the runtime's own mappings
    before = _clear()
    fns = _compile_programs(1)
    held = _mappings()
    assert held - before >= 60, (before, held)  # at least one mapping per live executable
    after = _clear()
    assert after - before <= (held - before) / 10, (before, held, after)  # measured: ~0 left
    assert len(fns) == 60  # the functions outlive clear_caches; their executables do not
