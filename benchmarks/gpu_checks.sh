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
run attention_kernels 150 python -m pallasite.ops.attention.gpu_check
run quant_kernels     150 python -m pallasite.ops.quant.gpu_check
run gmm               60  python -m pytest -q -p no:cacheprovider tests/ops/test_gmm.py
run gmm_timing        30  python -m pallasite.ops.gmm --quick
run decode_bench      90  python -m pallasite.benchmarks.decode --quick --dtypes bfloat16
run experts_bench     150 python -m pallasite.benchmarks.experts --quick --time-budget 20
run train_bench       50  python -m pallasite.benchmarks.train --quick
run fp4_kernels       120 python -m pallasite.ops.quant.fp4_gpu_check
run fp4_bench         300 python -m pallasite.benchmarks.fp4 --quick
