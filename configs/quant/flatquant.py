"""W4A4KV4 quantization settings (FlatQuant, Sun et al., ICML 2025, and its baselines) for
``pallasite quantize``.

    pallasite quantize --model M --output DIR --config pallasite.configs.quant.flatquant:quick
    pallasite quantize --model M --output DIR --config pallasite.configs.quant.flatquant:method=hadamard

``arg``: empty — the paper's calibration (128 windows × 2048 tokens, 15 epochs, batch 4 = 480
AdamW steps per layer, lr 5e-3, clip lr ×10, AdamW weight decay 0.01); ``quick`` — for a CPU,
SmolLM2-135M: 8 windows × 128 tokens, 4 epochs, batch 4 = 8 steps per layer on
every layer (1/960 of the paper's token-steps; its quality cost is not measured yet); plus
``key=value`` pairs (e.g. ``quick,method=rtn``).
"""

from pallasite.training.config import ConfigDict, parse_arg


def get_config(arg=None) -> ConfigDict:
    a = parse_arg(arg, quick=False, method="flatquant")
    c = ConfigDict()
    c.method = a.method  # rtn | smoothquant | hadamard | flatquant
    c.text = ""  # calibration text (FILE | DIR | stdlib); empty: Debian python3.11-doc prose (eval/corpora.py)
    c.w_bits, c.a_bits, c.kv_bits = 4, 4, 4
    c.impl = "ref"  # ref (jnp, integer-exact) | pallas (fused transform+quantize, int GEMM, KV4 decode kernels)
    c.calib = ConfigDict(dict(nsamples=8 if a.quick else 128, seq_len=128 if a.quick else 2048, batch=4,
                              epochs=4 if a.quick else 15, lr=5e-3, clip_lr_mult=10.0, weight_decay=0.01,
                              diag_alpha=0.3, seed=0))
    return c
