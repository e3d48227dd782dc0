"""The XLA:CPU variant of the panel matmul (float32 or bfloat16 weights, float32 activations and
sums): ``panel_matmul.cc`` compiled on first use with the system C++ compiler (AVX2 + FMA) into
``$PALLASITE_CACHE/kernels`` (keyed by the source, the flags and the jaxlib version), loaded and
registered as XLA FFI targets. ``unavailable()`` says why it cannot run here (no x86-64 AVX2, no
compiler, a failed build, a damaged cached build), None when it can.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from typing import Optional

import jax
import jax.numpy as jnp

TARGETS = {"float32": ("pallasite_panel_matmul_f32", "PallasitePanelMatmulF32"),
           "bfloat16": ("pallasite_panel_matmul_bf16", "PallasitePanelMatmulBF16")}  # weight dtype -> (target, symbol)
FLAGS = ("-std=c++17", "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", "-w")
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "panel_matmul.cc")


def _cpu_has_avx2_fma() -> bool:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "avx2" in flags and "fma" in flags


def _compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")


def _jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def _library_path() -> str:
    from pallasite.models.offline import cache_dir

    with open(SOURCE, "rb") as f:
        digest = hashlib.sha256(f.read() + " ".join((_jaxlib_version(),) + FLAGS).encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), "kernels", f"panel_matmul_{digest}.so")


def _build(path: str, cxx: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=os.path.dirname(path))
    os.close(fd)
    cmd = [cxx, *FLAGS, "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
        os.replace(tmp, path)  # atomic: a concurrent build never loads half a file
    except subprocess.CalledProcessError as e:
        raise RuntimeError(f"building {SOURCE} failed: {e.stderr.strip()[-400:]}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.lru_cache(maxsize=None)
def unavailable() -> Optional[str]:
    """None when the kernel is registered with XLA:CPU; else why it is not."""
    if not _cpu_has_avx2_fma():
        return "this CPU has no AVX2 + FMA"
    path = _library_path()
    if not os.path.exists(path):
        cxx = _compiler()
        if cxx is None:
            return "no C++ compiler (set CXX) to build ops/panels/panel_matmul.cc"
        try:
            _build(path, cxx)
        except (RuntimeError, OSError) as e:
            return str(e)
    try:
        lib = ctypes.cdll.LoadLibrary(path)
    except OSError as e:  # a damaged cached build: say so (delete it to rebuild)
        return f"cannot load {path}: {e}"
    for target, symbol in TARGETS.values():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return None


def panel_matmul_cpu(x_MK: jax.Array, w_packed_KN: jax.Array) -> jax.Array:
    """x [M, K] (taken as float32) @ the panel-packed w [K, N] (float32 or bfloat16) -> float32, on
    XLA:CPU (``unavailable()`` must be None)."""
    M, N = x_MK.shape[0], w_packed_KN.shape[1]
    target = TARGETS[jnp.dtype(w_packed_KN.dtype).name][0]
    call = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct((M, N), jnp.float32), vmap_method="sequential")
    return call(x_MK.astype(jnp.float32), w_packed_KN)
