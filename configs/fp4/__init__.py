"""FP4 training experiment configs (Wang et al., ICML 2025, DGE + OCC); see docs/fp4.md."""
