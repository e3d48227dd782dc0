"""KV caches: dense (full) cache and the cache interface (see ``dense.py``)."""

from pallasite.inference.cache.dense import DenseKVCache, init_dense_cache

__all__ = ["DenseKVCache", "init_dense_cache"]
