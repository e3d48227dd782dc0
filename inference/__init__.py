"""Inference: KV caches (``inference.cache``), token sampling (``inference.sampling``) and the
generation engine (``inference.engine``: jitted prefill + one-while-loop decode behind a
decode-strategy seam). Speculative / constrained / guided decoding plug in as strategies.

Names are exported lazily so that importing a submodule never drags in the others.
"""

_EXPORTS = {
    "generate_ids": "pallasite.inference.engine",
    "run_decode": "pallasite.inference.engine",
    "prefill": "pallasite.inference.engine",
    "decode_step": "pallasite.inference.engine",
    "decode_loop": "pallasite.inference.engine",
    "DecodeState": "pallasite.inference.engine",
    "SamplingStrategy": "pallasite.inference.engine",
    "GenerationConfig": "pallasite.inference.config",
    "SamplingParams": "pallasite.inference.sampling",
    "SamplingSpec": "pallasite.inference.sampling",
}


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'pallasite.inference' has no attribute {name!r}")


__all__ = sorted(_EXPORTS)
