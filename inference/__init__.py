"""Inference: KV caches (``inference.cache``), token sampling (``inference.sampling``) and the
generation engine (``inference.engine``: jitted prefill + one-while-loop decode behind a
decode-strategy seam). Speculative / constrained / guided decoding plug in as strategies.

Names are exported lazily so that importing a submodule never drags in the others.
"""

from pallasite.lazy import lazy_exports

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


__getattr__ = lazy_exports(__name__, _EXPORTS)


__all__ = sorted(_EXPORTS)
