"""4-bit KV cache (FlatQuant W4A4KV4, Sun et al. ICML 2025) behind the ``KVCache`` contract.

Per layer: keys and values as asymmetric 4-bit codes per token and per group of ``min(128, Dh)``
channels of one KV head, packed two per byte head-major ``[B, K, S, Dh/2]`` with float32 scales
and uint8 zero points ``[B, K, S, G]`` (``ops/quant/kv4_attention.py``); FlatQuant's key transform
``k_trans`` applied to the keys after RoPE and its inverse-transpose ``q_trans`` to the queries
(``q̃ k̃ᵀ = q kᵀ``, official ``quant_kcache``; the value transform is folded into ``v_proj``); and
the learned K/V clip logits. Single-token decode with ``impl="pallas"`` runs the 4-bit decode
kernel; otherwise the cache is dequantized for the reference attention. The step's own K/V are
attended in quantized form, as in the official fake-quant evaluation. Sub-config ``KV4Config``:
``transforms`` names an ``.npz`` written by quantization (relative to the model folder), else
identity transforms (plain KV4).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from pallasite.inference.cache.base import HeadMajorCache
from pallasite.ops.attention import attention
from pallasite.ops.quant.kv4_attention import dequantize_cache_bksd, kv4_decode_attention
from pallasite.ops.quant.quantizers import NO_CLIP_LOGIT, kv_group_size, pack_int4, quantize_kv_asym
from pallasite.registry import KV_CACHE

TRANSFORM_KEYS = ("k_trans", "q_trans", "k_clip", "v_clip")


@dataclasses.dataclass(frozen=True)
class KV4Config:
    """``kv_cache="kv4"`` options: quantization group and the transforms file (None: identity)."""

    group: int = 128
    transforms: Optional[str] = None  # .npz with TRANSFORM_KEYS; relative paths: the model's folder

    def __post_init__(self):
        if int(self.group) <= 0:
            raise ValueError(f"KV4Config.group={self.group!r} must be a positive number of channels")


@struct.dataclass
class KV4Cache(HeadMajorCache):
    k_q: jax.Array  # [L, B, K, S, Dh/2] uint8
    k_scale: jax.Array  # [L, B, K, S, G] float32
    k_zero: jax.Array  # [L, B, K, S, G] uint8
    v_q: jax.Array
    v_scale: jax.Array
    v_zero: jax.Array
    k_trans: jax.Array  # [L, Dh, Dh]  keys after RoPE: k @ k_trans
    q_trans: jax.Array  # [L, Dh, Dh]  queries after RoPE: q @ q_trans  (= k_trans^{-T})
    k_clip: jax.Array  # [L, 2] LAC logits (max, min)
    v_clip: jax.Array  # [L, 2]
    group: int = struct.field(pytree_node=False, default=128)
    bits: int = struct.field(pytree_node=False, default=4)

    @property
    def slots_leaf(self):
        return self.k_q

    @classmethod
    def create(cls, model_cfg, batch_size: int, max_len: int, *, config: Optional[KV4Config] = None,
               model=None) -> "KV4Cache":
        config = config or KV4Config()
        transforms = None
        if config.transforms is not None:
            path = config.transforms
            if not os.path.isabs(path) and getattr(model, "path", None):
                path = os.path.join(model.path, path)
            transforms = load_kv_transforms(path)
        return init_kv4_cache(model_cfg, batch_size, max_len, transforms, group=config.group)

    def nbytes(self) -> int:
        """Bytes of the stored keys/values (codes + scales + zero points), transforms excluded."""
        leaves = (self.k_q, self.k_scale, self.k_zero, self.v_q, self.v_scale, self.v_zero)
        return int(sum(a.size * a.dtype.itemsize for a in leaves))

    def _write(self, codes_q, codes_s, codes_z, x_BTKD, clip, positions_BT):
        q, s, z = quantize_kv_asym(x_BTKD.astype(jnp.float32), clip, bits=self.bits, group=self.group)
        packed = jnp.swapaxes(pack_int4(q), 1, 2)  # [B, K, T, Dh/2]
        B = x_BTKD.shape[0]
        rows = jnp.arange(B)[:, None]
        # advanced indices (rows, positions) around a slice: the indexed view is [B, T, K, ...]
        codes_q = codes_q.at[rows, :, positions_BT].set(jnp.swapaxes(packed, 1, 2), mode="drop")
        codes_s = codes_s.at[rows, :, positions_BT].set(s.astype(codes_s.dtype), mode="drop")
        codes_z = codes_z.at[rows, :, positions_BT].set(z.astype(codes_z.dtype), mode="drop")
        return codes_q, codes_s, codes_z

    def update_and_attend(
        self,
        q_BTHD: jax.Array,
        k_BTKD: jax.Array,
        v_BTKD: jax.Array,
        positions_BT: jax.Array,
        *,
        sliding_window: Optional[int] = None,
        impl: str = "ref",
        interpret: Optional[bool] = None,
    ):
        """Transform q/k (after RoPE), quantize and write k/v at their positions, attend. → (out, cache)."""
        q = jnp.einsum("bthd,de->bthe", q_BTHD.astype(jnp.float32), self.q_trans.astype(jnp.float32))
        k = jnp.einsum("btkd,de->btke", k_BTKD.astype(jnp.float32), self.k_trans.astype(jnp.float32))
        kq, ks, kz = self._write(self.k_q, self.k_scale, self.k_zero, k, self.k_clip, positions_BT)
        vq, vs, vz = self._write(self.v_q, self.v_scale, self.v_zero, v_BTKD, self.v_clip, positions_BT)
        new = self.replace(k_q=kq, k_scale=ks, k_zero=kz, v_q=vq, v_scale=vs, v_zero=vz)
        if impl == "pallas" and q.shape[1] == 1:  # the op logs and uses its reference for > 1 group
            out = kv4_decode_attention(q, kq, ks, kz, vq, vs, vz, positions_BT, sliding_window=sliding_window,
                                       impl="pallas", interpret=interpret)
        else:
            k_full = dequantize_cache_bksd(kq, ks, kz)
            v_full = dequantize_cache_bksd(vq, vs, vz)
            out = attention(q, k_full, v_full, q_positions_BT=positions_BT, causal=True,
                            sliding_window=sliding_window, impl="ref")
        return out.astype(q_BTHD.dtype), new


def identity_kv_transforms(cfg) -> dict:
    """Per-layer K transforms and clips for a cache without FlatQuant transforms (plain KV4)."""
    L, Dh = cfg.n_layers, cfg.dh
    eye = jnp.broadcast_to(jnp.eye(Dh, dtype=jnp.float32), (L, Dh, Dh))
    clip = jnp.full((L, 2), NO_CLIP_LOGIT, jnp.float32)
    return dict(k_trans=eye, q_trans=eye, k_clip=clip, v_clip=clip)


def save_kv_transforms(path: str, transforms: dict) -> str:
    """Write the per-layer K transforms and K/V clips (``TRANSFORM_KEYS``) as an ``.npz``."""
    np.savez(path, **{k: np.asarray(transforms[k], np.float32) for k in TRANSFORM_KEYS})
    return path if path.endswith(".npz") else path + ".npz"


def load_kv_transforms(path: str) -> dict:
    """Read ``save_kv_transforms``' file; a missing file or key is named."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"KV4 transforms file {path!r} does not exist")
    with np.load(path) as z:
        missing = [k for k in TRANSFORM_KEYS if k not in z.files]
        if missing:
            raise ValueError(f"KV4 transforms file {path!r} lacks {missing}; expected keys {TRANSFORM_KEYS}")
        return {k: jnp.asarray(z[k], jnp.float32) for k in TRANSFORM_KEYS}


def init_kv4_cache(cfg, batch_size: int, max_len: int, transforms: Optional[dict] = None,
                   group: int = 128, bits: int = 4) -> KV4Cache:
    """Empty 4-bit cache for ``cfg`` (``[L, B, K, S, ...]``); ``transforms`` is the dict written by
    the FlatQuant pipeline (``k_trans, q_trans [L, Dh, Dh]``, ``k_clip, v_clip [L, 2]``)."""
    if bits != 4:
        raise ValueError(f"KV4Cache stores 4-bit codes; bits={bits}")
    L, K, Dh = cfg.n_layers, cfg.n_kv_heads, cfg.dh
    if Dh % 2:
        raise ValueError(f"KV4Cache: head_dim={Dh} must be even to pack nibble pairs")
    G = Dh // kv_group_size(Dh, group)
    t = identity_kv_transforms(cfg) if transforms is None else transforms
    for name, shape in (("k_trans", (L, Dh, Dh)), ("q_trans", (L, Dh, Dh)), ("k_clip", (L, 2)), ("v_clip", (L, 2))):
        if name not in t or tuple(t[name].shape) != shape:
            got = None if name not in t else tuple(t[name].shape)
            raise ValueError(f"init_kv4_cache: transforms[{name!r}] must have shape {shape}, got {got}")
    # distinct buffers for every leaf: decode loops donate the cache, and a buffer may be donated once
    codes = lambda: jnp.zeros((L, batch_size, K, max_len, Dh // 2), jnp.uint8)  # noqa: E731
    scales = lambda: jnp.ones((L, batch_size, K, max_len, G), jnp.float32)  # noqa: E731
    zeros = lambda: jnp.zeros((L, batch_size, K, max_len, G), jnp.uint8)  # noqa: E731
    own = lambda a: jnp.array(a, jnp.float32, copy=True)  # noqa: E731
    return KV4Cache(k_q=codes(), k_scale=scales(), k_zero=zeros(), v_q=codes(), v_scale=scales(), v_zero=zeros(),
                    k_trans=own(t["k_trans"]), q_trans=own(t["q_trans"]), k_clip=own(t["k_clip"]),
                    v_clip=own(t["v_clip"]), group=group, bits=bits)


KV_CACHE.register("kv4", KV4Cache, config=KV4Config)
