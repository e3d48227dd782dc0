"""KV caches behind one contract (``base.KVCache``): dense, 4-bit (``kv4``), CateKV hybrid (``catekv``)."""

from pallasite.inference.cache.base import KVCache
from pallasite.inference.cache.dense import DenseKVCache, init_dense_cache

__all__ = ["KVCache", "DenseKVCache", "init_dense_cache"]
