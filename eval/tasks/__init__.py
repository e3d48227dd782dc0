"""Reasoning tasks generated here (no dataset download): ``gsm_symbolic`` (symbolic arithmetic word
problems, answers checked with z3) and ``folio`` (first-order logic premises / conclusions, labels
by z3), with the answer grammars CRANE constrains (docs/constrained.md)."""
