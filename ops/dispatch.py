"""Which variant of a Pallas kernel runs, and the one place that says so when a kernel falls back.

``pick_variant(interpret)`` maps the ``interpret`` argument every kernel takes and the target
platform to a ``Variant``: a ``pltpu.InterpretParams`` runs the TPU (Mosaic) kernel in the TPU
interpreter; ``None`` means by platform (TPU -> Mosaic, GPU -> Triton, CPU -> the GPU-layout kernel
in the generic interpreter); ``True`` is that generic interpreter anywhere; ``False`` compiles.
``target_platform("tpu")`` overrides the platform for ahead-of-time lowering from a CPU host (the
compile matrix). ``warn_fallback`` logs, once per kernel and reason, that a shape goes to the jnp
reference instead of a kernel: a fallback is never silent.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Any, Iterator, Optional

import jax
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as pltriton

logger = logging.getLogger("pallasite.ops")

_STATE = threading.local()
_WARNED: set = set()
_PLATFORMS = ("tpu", "gpu", "cpu")


@contextlib.contextmanager
def target_platform(platform: str) -> Iterator[None]:
    """Pick kernel variants for ``platform`` ("tpu" | "gpu" | "cpu") instead of the default backend
    inside the block (for ``jax.jit(f).lower(...)`` on abstract TPU devices or ``jax.export`` to
    CUDA from a CPU-only machine)."""
    if platform not in _PLATFORMS:
        raise ValueError(f"target_platform: {platform!r}; expected one of {_PLATFORMS}")
    old = getattr(_STATE, "platform", None)
    _STATE.platform = platform
    try:
        yield
    finally:
        _STATE.platform = old


def platform() -> str:
    """The platform kernels are built for: the ``target_platform`` override, else the backend."""
    override = getattr(_STATE, "platform", None)
    if override is not None:
        return override
    backend = jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else backend


@dataclasses.dataclass(frozen=True)
class Variant:
    """``kind``: "tpu" (Mosaic block layout) or "gpu" (Triton block layout); ``interpret``: the
    value handed to ``pl.pallas_call`` (False, True or an ``InterpretParams``). Hashable: kernels
    take it as a static argument."""

    kind: str
    interpret: Any = False

    @property
    def compiled(self) -> bool:
        return self.interpret is False


def pick_variant(interpret: Optional[Any] = None) -> Variant:
    if isinstance(interpret, pltpu.InterpretParams):
        return Variant("tpu", interpret)
    where = platform()
    if interpret is None:
        interpret = where == "cpu"
    if interpret is True:
        return Variant("gpu", True)
    if interpret is not False:
        raise TypeError(f"interpret={interpret!r}; expected None, a bool or pltpu.InterpretParams")
    if where == "tpu":
        return Variant("tpu", False)
    if where == "gpu":
        return Variant("gpu", False)
    raise ValueError(
        f"interpret=False on platform {where!r}: compiled Pallas kernels need a TPU or GPU; "
        "pass interpret=None (interpret on CPU) or pltpu.InterpretParams(...)"
    )


def triton_params(interpret, num_warps: int = 4, num_stages: int = 2):
    """Compiler parameters of a GPU-variant ``pallas_call``: Triton when compiled (jax's default GPU
    lowering is Mosaic GPU, which these grid kernels are not written for), None when interpreted."""
    return (
        None
        if interpret is not False
        else pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    )


def tpu_interpret_params(**overrides) -> pltpu.InterpretParams:
    """The TPU interpreter as the tests use it: races detected, uninitialised memory NaN."""
    return pltpu.InterpretParams(
        **{"detect_races": True, "uninitialized_memory": "nan", **overrides}
    )


def warn_once(kernel: str, message: str, **shapes) -> None:
    """Log a warning about ``kernel`` once per (kernel, message), naming the shapes."""
    key = (kernel, message)
    if key in _WARNED:
        return
    _WARNED.add(key)
    where = ", ".join(f"{k}={v}" for k, v in shapes.items())
    logger.warning("pallasite.ops: %s: %s (%s)", kernel, message, where)


def warn_fallback(kernel: str, reason: str, **shapes) -> None:
    """Log (once per ``kernel`` and ``reason``) that a call runs the jnp reference (and shapes)."""
    warn_once(kernel, f"cannot serve this call ({reason}); using the jnp reference", **shapes)


def reset_fallback_warnings() -> None:
    """Forget which fallbacks were logged (tests that check the log)."""
    _WARNED.clear()


__all__ = [
    "Variant",
    "pick_variant",
    "platform",
    "target_platform",
    "triton_params",
    "tpu_interpret_params",
    "warn_once",
    "warn_fallback",
    "reset_fallback_warnings",
    "logger",
]
