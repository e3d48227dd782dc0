"""Quantization experiment configs (FlatQuant W4A4KV4 and baselines); see docs/quant.md."""
