"""Compile matrix (marker ``tpu_compile``, deselected by default; CI runs it in ``.venv-tpu``):
every TPU (Mosaic) kernel AOT-compiled by the real XLA:TPU / Mosaic compilers from libtpu for
abstract v5e and v5p chips, every GPU (Triton) kernel lowered for CUDA with ``jax.export``, at
SmolLM2-135M / Llama-3-8B / Mixtral-8x7B shapes (``benchmarks/kernel_matrix.py`` holds the cases).
A compile that hangs past ``PALLASITE_COMPILE_TIMEOUT`` seconds (180) kills the run, naming it.

    .venv-tpu/bin/python -m pytest -q -m tpu_compile tests/ops
"""

import jax
import jax.numpy as jnp
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pallasite.benchmarks import kernel_matrix as km

pytestmark = pytest.mark.tpu_compile

CASES = km.cases()
TPU_CASES = [(c, chip) for c in CASES if "tpu" in c.platforms for chip in km.DEFAULT_CHIPS]
CUDA_CASES = [c for c in CASES if "cuda" in c.platforms]


@pytest.mark.parametrize(
    "case,chip", TPU_CASES, ids=[f"{c.kernel}-{c.model}-{chip}" for c, chip in TPU_CASES]
)
def test_tpu_kernel_compiles(case, chip):
    res = km.compile_tpu(case, chip)
    assert res["device_kind"].startswith("TPU v5")
    assert res["mosaic_calls"] >= 1, "no Mosaic kernel in the compiled program (a silent fallback?)"


@pytest.mark.parametrize("case", CUDA_CASES, ids=[f"{c.kernel}-{c.model}" for c in CUDA_CASES])
def test_gpu_kernel_lowers_for_cuda_through_triton(case):
    res = km.lower_cuda(case)
    assert res["triton_calls"] >= 1, "no Triton custom call in the lowered module"


def test_negative_control_an_illegal_tpu_block_fails_to_compile():
    """The harness reports a kernel that does not compile: a (7, 100) block breaks (8, 128)."""

    def bad(x):
        return pl.pallas_call(
            lambda x_ref, o_ref: o_ref.__setitem__(..., x_ref[...] * 2),
            grid=(2,),
            in_specs=[pl.BlockSpec((7, 100), lambda i: (i, 0))],
            out_specs=pl.BlockSpec((7, 100), lambda i: (i, 0)),
            out_shape=jax.ShapeDtypeStruct((14, 200), jnp.float32),
            compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
        )(x)

    with pytest.raises(Exception, match="divisible by 8 and 128"):
        km.compile_tpu(km.Case("bad_block", "none", bad, (((14, 200), jnp.float32),)), "v5e")
