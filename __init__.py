"""pallasite: ICML 2025 methods for efficient and reliable language models, on one JAX core.

Public API (kept stable; see README):

    model = pallasite.load(path)                  # HF folder, GGUF file, pallasite checkpoint or train workdir
    logits = model.logits(ids)                    # float32 [batch, seq, vocab]
    texts = pallasite.generate(model, prompts, max_new_tokens=32)
    model.save(path, format="hf" | "orbax")
    served = pallasite.serve_lut(model, "host")   # MoLE: experts as an offloaded lookup table
"""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy: `import pallasite` must stay cheap and must not import jax-heavy modules eagerly.
    if name in ("load", "Model", "serve_lut"):
        from pallasite import api

        return getattr(api, name)
    if name == "generate":
        from pallasite import api

        return api.generate
    raise AttributeError(f"module 'pallasite' has no attribute {name!r}")


__all__ = ["load", "Model", "generate", "serve_lut", "__version__"]
