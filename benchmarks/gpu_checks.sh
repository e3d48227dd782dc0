#!/usr/bin/env bash
# One script for every GPU check (run from the repository root on a CUDA machine, e.g. the H200
# device: `bash benchmarks/gpu_checks.sh`). Writes logs and JSON lines under ${OUT:-gpu_out}/.
# `bash benchmarks/gpu_checks.sh quant_kernels decode_bench` runs only the named checks.
# Needs jax[cuda], flax, optax, orbax, torch, transformers; ml-collections, gguf and tensorboardX
# travel as wheels in .whl/ when missing (see the device tool's README).
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
mkdir -p /tmp/pp && ln -sfn "$PWD" /tmp/pp/pallasite && export PYTHONPATH=/tmp/pp:${PYTHONPATH:-}
export JAX_PLATFORMS=cuda,cpu XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
LOGS=$(mktemp -d)  # per-check logs; appended to one file because the device returns few files
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUT/all.log" 2>&1
ONLY=" $* "  # optional: names of the checks to run (default all)
run() {  # name, timeout seconds, command...
  local name=$1 limit=$2; shift 2
  [ "$ONLY" = "  " ] || [[ "$ONLY" == *" $name "* ]] || return 0
  echo "== $name"; ( time timeout "$limit" "$@" ) > "$LOGS/$name.log" 2>&1; echo "rc=$?" >> "$LOGS/$name.log"
  tail -n 3 "$LOGS/$name.log"; { echo "=== $name"; cat "$LOGS/$name.log"; } >> "$OUT/all.log"
  grep -h '^{' "$LOGS/$name.log" | sed "s/^{/{\"check\": \"$name\", /" >> "$OUT/results.jsonl" || true
}
# compiled GPU (Triton) kernels vs their jnp references, then the attention benchmark: flash prefill
# timed against the reference and XLA's fused attention (jax.nn.dot_product_attention / cuDNN)
run attention_kernels 200 python -m pallasite.benchmarks.gpu_check_attention
run quant_kernels     150 python -m pallasite.benchmarks.gpu_check_quant
# the kernel test files with interpret=None: on the GPU they run the compiled Triton variants
run kernel_tests      240 python -m pytest -q -p no:cacheprovider -m "not slow" tests/ops/test_gmm.py \
                          tests/ops/test_attention_kernels.py tests/ops/test_quant.py
run gmm_timing        30  python -m pallasite.benchmarks.gmm --quick
run decode_bench      90  python -m pallasite.benchmarks.decode --quick --dtypes bfloat16 --random-weights  # no GGUF on the GPU box
run experts_bench     150 python -m pallasite.benchmarks.experts --quick --time-budget 20
run train_bench       50  python -m pallasite.benchmarks.train --quick
run fp4_kernels       120 python -m pallasite.benchmarks.gpu_check_fp4
run fp4_bench         300 python -m pallasite.benchmarks.fp4 --quick
# speculative decoding's round cost (verify of K + 1 tokens and the 2x8192 drafter's step, in target
# steps; random weights: no GGUF on the GPU box) and the speed-up it predicts at the target calls per
# token the trained drafter made on CPU (docs/speculative.md): a prediction, not a measurement; and
# what the confidence gate's narrowed verify (one compiled call per width) costs against direct calls
run spec_round_cost   180 python -m pallasite.benchmarks.spec_round_cost --random-weights --dtype bfloat16 \
                          --drafter-shape 2x8192 --calls-per-token 1=0.604,8=0.906 --narrowed
