"""Constrained decoding on the device, and CRANE (docs/constrained.md).

    from pallasite.inference.constrained import Constraint
    pallasite.generate(model, prompts, grammar=LARK_TEXT)               # or json_schema=..., regex=...
    pallasite.generate(model, prompts, constraint=Constraint("lark", g, start="<<", end=">>"))  # CRANE

Masks come from llguidance (``grammars``, ``vocab``), are computed on the host per row (``rows``,
``host``) and applied inside the compiled decode loop (``strategy``). ``crane`` has the paper's
four modes side by side. Names are exported lazily (importing this package imports no engine).
"""

from pallasite.lazy import lazy_exports

_EXPORTS = {
    "Constraint": "pallasite.inference.constrained.constraint",
    "ConstraintError": "pallasite.inference.constrained.grammars",
    "TokenBytes": "pallasite.inference.constrained.vocab",
    "vocab_for": "pallasite.inference.constrained.vocab",
    "HostSession": "pallasite.inference.constrained.host",
    "ConstrainedConfig": "pallasite.inference.constrained.strategy",
    "ConstrainedStrategy": "pallasite.inference.constrained.strategy",
    "build_constrained": "pallasite.inference.constrained.strategy",
    "draft_masks": "pallasite.inference.constrained.strategy",
    "host_masks": "pallasite.inference.constrained.strategy",
    "session_of": "pallasite.inference.constrained.strategy",
}


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
