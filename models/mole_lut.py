"""MoLE re-parameterisation (params → lookup table), LUT stores and LUT quantization — Jie et al.,
ICML 2025, §3.2 and §4.4 (official ``reparameterize.py``).

``build_lut(model)`` gives ``[vocab, layer, expert, d]`` (the official layout) with the training
FFN's own ``mole.experts_forward``; ``to_lut_model`` drops the expert weights and norms. Stores
share one interface (``fetch(ids)`` on the host, ``decode(payload)`` on the device): ``HostLUT``
(RAM) and ``open_lut`` (a memory-mapped ``save_lut`` file whose header — magic, shape, dtype,
quantization, data SHA-256, model fingerprint — is checked; ``LUTFileError`` names the file and
the mismatch). Quantization: NormalFloat levels (QLoRA) over token-wise blocks of ``block`` values,
one float16 absmax scale each, codes bit-packed; paper defaults NF4 / block 768, NF3 / block 128.
Deviation: the paper lists no NF3 levels; ours follow QLoRA's construction with k = 3.
File format and figures: docs/experts.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from dataclasses import dataclass
from statistics import NormalDist

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.layers import rms_norm
from pallasite.models.mole import LUTRows, experts_forward, mole_config_of
from pallasite.models.transformer import abstract_model

MAGIC = b"PLSLUT01"
FORMAT_VERSION = 1
_ALIGN = 4096
QUANT_KINDS = ("none", "nf4", "nf3")


class LUTFileError(ValueError):
    """A LUT file that cannot be used for the requested model (names file and reason)."""


# ----------------------------------------------------------------------------- build
def _layer_expert_params(model) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
    """[(norm_scale [D], up [N, D, F], down [N, F, D])] per layer, for list or scan layouts."""
    cfg = model.cfg
    if mole_config_of(cfg).mode != "train":
        raise ValueError("build_lut needs a training-mode MoLE model (mole.mode='train'); this one has no experts")
    if cfg.scan_layers:
        ffn = model.layers.ffn
        s, u, d = ffn.expert_norm.scale[...], ffn.experts.up[...], ffn.experts.down[...]
        return [(s[i], u[i], d[i]) for i in range(cfg.n_layers)]
    return [(b.ffn.expert_norm.scale[...], b.ffn.experts.up[...], b.ffn.experts.down[...]) for b in model.layers]


def build_lut(model, *, dtype=None, chunk: int = 4096) -> np.ndarray:
    """Re-parameterise every expert of every layer into ``LUT [V, L, N, d]`` (host numpy).

    ``LUT[v, l, j] = E_lj(RMSNorm_l(Embed[v]))`` computed in the model's compute dtype, then cast
    to ``dtype`` (default ``MoLEConfig.lut_dtype``, float16 as in the paper)."""
    cfg = model.cfg
    m = mole_config_of(cfg)
    if not m.n_experts:
        raise ValueError("build_lut: this MoLE config has n_experts=0 (dense baseline); there is nothing to tabulate")
    out_dtype = np.dtype(jnp.dtype(dtype or m.lut_dtype))
    cdt = jnp.dtype(cfg.dtype)
    emb_VD = _table(model)
    V = emb_VD.shape[0]
    layers = _layer_expert_params(model)

    @jax.jit
    def tabulate(emb_cD, scale, up, down):
        n = rms_norm(emb_cD.astype(cdt), scale, cfg.norm_eps).astype(cdt)  # same casts as RMSNorm/Embed
        return experts_forward(n, up, down, m.activation, cdt).astype(out_dtype)

    lut = np.empty((V, cfg.n_layers, m.n_experts, cfg.d_model), out_dtype)
    for start in range(0, V, chunk):
        stop = min(V, start + chunk)
        block = emb_VD[start:stop]
        if stop - start < chunk and V > chunk:  # pad the last chunk: one compiled shape
            block = jnp.pad(block, ((0, chunk - (stop - start)), (0, 0)))
        for layer, (s, u, d) in enumerate(layers):
            lut[start:stop, layer] = np.asarray(tabulate(block, s, u, d))[: stop - start]
    return lut


def lut_config(cfg: ModelConfig) -> ModelConfig:
    """The LUT-mode twin of a training-mode MoLE config."""
    return cfg.replace(ffn_config=mole_config_of(cfg).replace(mode="lut"))


def to_lut_model(model):
    """The LUT-mode model sharing every non-expert parameter of ``model`` (experts and expert
    norms dropped; ``lut_rows`` placeholders added)."""
    cfg_l = lut_config(model.cfg)
    lut_model = abstract_model(cfg_l)
    src = dict(nnx.to_flat_state(nnx.state(model)))
    flat = nnx.to_flat_state(nnx.state(lut_model))
    new = []
    for path, var in flat:
        if issubclass(var.type, LUTRows):
            new.append((path, var.replace(jnp.zeros((cfg_l.n_layers, 0) if cfg_l.scan_layers else (0,), jnp.float32))))
            continue
        if path not in src:
            raise KeyError(
                f"to_lut_model: parameter {'/'.join(map(str, path))} of the LUT model is missing in the source model"
            )
        new.append((path, var.replace(src[path][...])))
    nnx.update(lut_model, nnx.from_flat_state(new))
    return lut_model


def device_param_bytes(model_or_state) -> int:
    """Bytes of ``nnx.Param`` leaves (what must live on the device as weights)."""
    state = model_or_state if isinstance(model_or_state, nnx.State) else nnx.state(model_or_state, nnx.Param)
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state) if hasattr(x, "dtype")))


def _table(model) -> jax.Array:
    """The embedding table [V, D] in row order whatever order the embedding kind stores it in."""
    return model.embed.rows(jnp.arange(model.embed.embedding.shape[0]))


def lut_fingerprint(model) -> str:
    """SHA-256 of what a LUT depends on and the LUT-mode model still holds: shapes, the
    embedding table and every router (a LUT from another training run fails this check)."""
    cfg = model.cfg
    m = mole_config_of(cfg)
    h = hashlib.sha256()
    h.update(json.dumps([cfg.vocab_size, cfg.n_layers, m.n_experts, cfg.d_model, m.activation]).encode())
    h.update(np.ascontiguousarray(np.asarray(_table(model), np.float32)).tobytes())
    if cfg.scan_layers:
        routers = [model.layers.ffn.router[...]]
    else:
        routers = [b.ffn.router[...] for b in model.layers]
    for r in routers:
        h.update(np.ascontiguousarray(np.asarray(r, np.float32)).tobytes())
    return h.hexdigest()


# ----------------------------------------------------------------------------- NormalFloat
def nf_levels(bits: int) -> np.ndarray:
    """QLoRA NormalFloat levels for ``bits`` (sorted, in [-1, 1], with an exact 0)."""
    offset = 0.9677083
    nd = NormalDist()
    half = 2 ** (bits - 1)
    pos = [nd.inv_cdf(p) for p in np.linspace(offset, 0.5, half + 1)[:-1]]
    neg = [-nd.inv_cdf(p) for p in np.linspace(offset, 0.5, half)[:-1]]
    v = np.array(sorted(pos + [0.0] + neg), np.float64)
    return (v / np.abs(v).max()).astype(np.float32)


def _bits_of(kind: str) -> int:
    if kind not in ("nf4", "nf3"):
        raise ValueError(f"LUT quantization kind {kind!r}; expected one of {QUANT_KINDS}")
    return int(kind[2])


def _padded_row(row_len: int, block: int) -> int:
    n = -(-row_len // block) * block
    return -(-n // 8) * 8  # whole 8-code groups for packing


def quantize_lut(lut, kind: str = "nf4", block: int = 768):
    """Token-wise blocked NF-k quantization of ``lut [V, L, N, d]``.

    Returns ``(codes [V, row_bytes] uint8 packed, scales [V, n_blocks] float16)``."""
    bits = _bits_of(kind)
    if block <= 0:
        raise ValueError(f"quantize_lut: block must be positive, got {block}")
    V = lut.shape[0]
    row_len = int(np.prod(lut.shape[1:]))
    padded = _padded_row(row_len, block)
    n_blocks = padded // block
    x = np.zeros((V, n_blocks * block), np.float32)
    x[:, :row_len] = np.asarray(lut, np.float32).reshape(V, row_len)
    xb = x.reshape(V, n_blocks, block)
    absmax = np.abs(xb).max(axis=-1)
    scales = absmax.astype(np.float16)
    s = np.where(scales.astype(np.float32) > 0, scales.astype(np.float32), 1.0)[..., None]
    levels = nf_levels(bits)
    mids = (levels[1:] + levels[:-1]) / 2  # nearest level by bisection on the midpoints
    codes = np.searchsorted(mids, np.clip(xb / s, -1, 1)).astype(np.uint8).reshape(V, -1)
    codes = np.pad(codes, ((0, 0), (0, padded - codes.shape[1])))
    return _pack(codes, bits), scales


def _pack(codes_VC: np.ndarray, bits: int) -> np.ndarray:
    """8 codes of ``bits`` bits → ``bits`` bytes (little-endian bitstream per group)."""
    V, C = codes_VC.shape
    g = codes_VC.reshape(V, C // 8, 8).astype(np.uint32)
    word = np.zeros((V, C // 8), np.uint32)
    for k in range(8):
        word |= g[..., k] << np.uint32(bits * k)
    out = np.stack([(word >> np.uint32(8 * i)) & np.uint32(0xFF) for i in range(bits)], axis=-1)
    return out.astype(np.uint8).reshape(V, C // 8 * bits)


def dequantize_rows(codes, scales, *, kind: str, block: int, row_shape, xp=jnp):
    """Inverse of ``quantize_lut`` for gathered rows: ``codes [..., row_bytes]``,
    ``scales [..., n_blocks]`` → ``float16 [..., *row_shape]``. ``xp=jnp`` runs on the device
    (the packed bytes are what crosses the bus), ``xp=np`` on the host."""
    bits = _bits_of(kind)
    lead = codes.shape[:-1]
    g = codes.reshape(*lead, -1, bits).astype(xp.uint32)
    word = g[..., 0]
    for i in range(1, bits):
        word = word | (g[..., i] << xp.uint32(8 * i))
    idx = xp.stack([(word >> xp.uint32(bits * k)) & xp.uint32((1 << bits) - 1) for k in range(8)], axis=-1)
    vals = xp.asarray(nf_levels(bits))[idx.reshape(*lead, -1).astype(xp.int32)]
    n_blocks = scales.shape[-1]
    vals = vals[..., : n_blocks * block].reshape(*lead, n_blocks, block) * scales[..., None].astype(xp.float32)
    row_len = int(np.prod(row_shape))
    return vals.reshape(*lead, -1)[..., :row_len].reshape(*lead, *row_shape).astype(xp.float16)


def storage_ratio(kind: str, block: int, row_len: int) -> float:
    """Bytes of the quantized LUT over bytes of the FP16 LUT (codes + float16 scales)."""
    if kind == "none":
        return 1.0
    bits = _bits_of(kind)
    padded = _padded_row(row_len, block)
    return (padded // 8 * bits + (padded // block) * 2) / (row_len * 2)


# ----------------------------------------------------------------------------- stores
def decode_payload(meta, payload) -> jax.Array:
    """Gathered rows as stored (``(rows,)`` or NF ``(codes, scales)``) → rows ``[..., L, N, d]``
    on the device; depends only on the table's metadata, so a server that keeps the arrays
    elsewhere (``mole_decode.serve_in_host_memory``) needs no copy of the store."""
    if meta.quant == "none":
        return payload[0]
    return dequantize_rows(payload[0], payload[1], kind=meta.quant, block=meta.block, row_shape=meta.row_shape)


@dataclass(frozen=True)  # hashable: a static attribute of serving modules (part of the graphdef)
class _Meta:
    vocab_size: int
    n_layers: int
    n_experts: int
    d_model: int
    dtype: str
    quant: str = "none"
    block: int = 0
    fingerprint: str = ""

    @property
    def row_shape(self):
        return (self.n_layers, self.n_experts, self.d_model)

    def bytes_per_token(self) -> int:
        row_len = int(np.prod(self.row_shape))
        if self.quant == "none":
            return row_len * np.dtype(jnp.dtype(self.dtype)).itemsize
        padded = _padded_row(row_len, self.block)
        return padded // 8 * _bits_of(self.quant) + (padded // self.block) * 2


class LUTStore:
    """Interface: ``fetch(ids) → host payload`` (only the needed rows), ``decode(device
    payload) → jnp rows [..., L, N, d]``; ``rows(ids)`` does fetch → device_put → decode."""

    meta: _Meta
    location = "?"

    @property
    def stats(self) -> dict:
        """Counters of the serving (callback) path: host gathers, tokens, bytes read from the
        store, bytes handed to the device (equal: packed NF payloads are unpacked on the device)."""
        if not hasattr(self, "_stats"):
            self._stats = {"gathers": 0, "tokens": 0, "bytes_read": 0, "bytes_to_device": 0}
        return self._stats

    def reset_stats(self) -> None:
        self._stats = {"gathers": 0, "tokens": 0, "bytes_read": 0, "bytes_to_device": 0}

    def host_fetch(self, ids) -> tuple:
        """``fetch`` plus counters (the host side of ``LUTServing``'s callback, once per decode
        step: kept to one id check, one gather per stored array and integer counter updates;
        no per-call reductions over the payload)."""
        ids = np.asarray(ids)
        payload = self.fetch(ids)
        st = self.stats
        n_bytes = ids.size * self._row_nbytes()
        st["gathers"] += 1
        st["tokens"] += ids.size
        st["bytes_read"] += n_bytes
        st["bytes_to_device"] += n_bytes
        return payload

    def _row_nbytes(self) -> int:
        """Bytes of one token's payload (codes + scales for NF stores), cached."""
        if getattr(self, "_row_nbytes_cache", None) is None:
            self._row_nbytes_cache = int(sum(a.dtype.itemsize * int(np.prod(a.shape[1:])) for a in self._arrays()))
        return self._row_nbytes_cache

    def payload_shapes(self, lead: tuple) -> tuple:
        """ShapeDtypeStructs of ``fetch(ids)`` for ids of shape ``lead``."""
        return tuple(jax.ShapeDtypeStruct(tuple(lead) + a.shape[1:], jnp.dtype(a.dtype)) for a in self._arrays())

    def fetch(self, ids) -> tuple:
        ids = np.asarray(ids)
        # one reduction checks both bounds: negative ids wrap to huge unsigned values
        if ids.size and int(ids.astype(np.uint64, copy=False).max()) >= self.meta.vocab_size:
            raise ValueError(
                f"LUT fetch: token ids must lie in [0, {self.meta.vocab_size}), got range "
                f"[{int(ids.min())}, {int(ids.max())}]"
            )
        return tuple(np.asarray(a[ids]) for a in self._arrays())

    def decode(self, payload) -> jax.Array:
        return decode_payload(self.meta, payload)

    @property
    def arrays(self) -> tuple:
        """The arrays holding the table: ``(lut,)`` or ``(codes, scales)``, each ``[V, ...]``."""
        return self._arrays()

    def rows(self, ids, device=None) -> jax.Array:
        return self.decode(jax.device_put(self.fetch(ids), device))

    @property
    def bytes_per_token(self) -> int:
        return self.meta.bytes_per_token()

    @property
    def nbytes(self) -> int:
        return int(sum(a.nbytes for a in self._arrays()))

    def check_model(self, model) -> None:
        """Fail unless this LUT was built for ``model`` (shapes and fingerprint)."""
        _check_meta(self.meta, model, where=self.location)

    def _arrays(self):
        """The numpy arrays holding the table (codes and scales); each store kind provides them."""
        raise NotImplementedError(f"{type(self).__name__} must define _arrays()")


class HostLUT(LUTStore):
    """LUT (float or NF-quantized) held in host RAM as numpy arrays."""

    location = "host RAM"

    def __init__(
        self,
        lut_VLND=None,
        *,
        quant: str = "none",
        block: int = 0,
        fingerprint: str = "",
        codes=None,
        scales=None,
        row_shape=None,
    ):
        if quant == "none":
            lut_VLND = np.ascontiguousarray(lut_VLND)
            V, L, N, D = lut_VLND.shape
            self.data = (lut_VLND,)
            dt = str(jnp.dtype(lut_VLND.dtype))
        else:
            if codes is None:
                codes, scales = quantize_lut(lut_VLND, quant, block)
                row_shape = lut_VLND.shape[1:]
            V, (L, N, D) = codes.shape[0], tuple(row_shape)
            self.data = (np.ascontiguousarray(codes), np.ascontiguousarray(scales))
            dt = "float16"
        self.meta = _Meta(V, L, N, D, dt, quant, int(block), fingerprint)

    def _arrays(self):
        return self.data

    @classmethod
    def from_model(cls, model, *, quant: str = "none", block: int = 768, dtype=None):
        return cls(build_lut(model, dtype=dtype), quant=quant, block=block, fingerprint=lut_fingerprint(model))


def save_lut(path: str, store: HostLUT) -> str:
    """Write a ``HostLUT`` to ``path`` (see the module docstring for the format)."""
    meta = store.meta
    arrays = store._arrays()
    sha = hashlib.sha256()
    for a in arrays:
        sha.update(memoryview(np.ascontiguousarray(a)).cast("B"))
    header = {
        "format": "pallasite-mole-lut",
        "format_version": FORMAT_VERSION,
        "layout": "[vocab, layer, expert, d]",
        "vocab_size": meta.vocab_size,
        "n_layers": meta.n_layers,
        "n_experts": meta.n_experts,
        "d_model": meta.d_model,
        "dtype": meta.dtype,
        "quant": meta.quant,
        "block": meta.block,
        "fingerprint": meta.fingerprint,
        "arrays": [{"shape": list(a.shape), "dtype": str(jnp.dtype(a.dtype)), "nbytes": int(a.nbytes)} for a in arrays],
        "data_nbytes": int(sum(a.nbytes for a in arrays)),
        "sha256": sha.hexdigest(),
    }
    blob = json.dumps(header, sort_keys=True).encode()
    data_offset = -(-(len(MAGIC) + 8 + len(blob)) // _ALIGN) * _ALIGN
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(MAGIC + struct.pack("<Q", len(blob)) + blob)
        f.write(b"\0" * (data_offset - f.tell()))
        for a in arrays:
            f.write(memoryview(np.ascontiguousarray(a)).cast("B"))
    os.replace(tmp, path)  # a crash mid-write never leaves a valid-looking file
    return path


class DiskLUT(LUTStore):
    """A LUT file on disk, memory-mapped: ``fetch`` reads only the pages of the requested rows."""

    location = "disk (mmap)"

    def __init__(self, path: str, header: dict, data_offset: int):
        self.path = path
        self.meta = _Meta(
            header["vocab_size"],
            header["n_layers"],
            header["n_experts"],
            header["d_model"],
            header["dtype"],
            header["quant"],
            header["block"],
            header["fingerprint"],
        )
        self.location = f"disk file {path}"
        arrays, off = [], data_offset
        for a in header["arrays"]:
            arrays.append(
                np.memmap(path, dtype=np.dtype(jnp.dtype(a["dtype"])), mode="r", offset=off, shape=tuple(a["shape"]))
            )
            off += a["nbytes"]
        self.data = tuple(arrays)

    def _arrays(self):
        return self.data


def read_lut_header(path: str) -> tuple[dict, int]:
    if not os.path.exists(path):
        raise LUTFileError(
            f"MoLE LUT file {path!r} does not exist (build it with save_lut(path, HostLUT.from_model(model)))"
        )
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(len(MAGIC) + 8)
        if len(head) < len(MAGIC) + 8 or head[: len(MAGIC)] != MAGIC:
            raise LUTFileError(
                f"MoLE LUT file {path!r}: not a pallasite LUT (bad magic {head[:8]!r}, expected {MAGIC!r})"
            )
        (n,) = struct.unpack("<Q", head[len(MAGIC) :])
        if n > size:
            raise LUTFileError(f"MoLE LUT file {path!r}: header length {n} exceeds the file size {size} (truncated?)")
        try:
            header = json.loads(f.read(n))
        except ValueError as e:
            raise LUTFileError(f"MoLE LUT file {path!r}: unreadable JSON header ({e})") from None
    if header.get("format_version") != FORMAT_VERSION:
        raise LUTFileError(
            f"MoLE LUT file {path!r}: format_version {header.get('format_version')!r}, "
            f"this code reads version {FORMAT_VERSION}"
        )
    data_offset = -(-(len(MAGIC) + 8 + n) // _ALIGN) * _ALIGN
    want = data_offset + int(header["data_nbytes"])
    if size != want:
        raise LUTFileError(
            f"MoLE LUT file {path!r} is {size} bytes, the header says {want} "
            f"({'truncated' if size < want else 'trailing data'}); rebuild it"
        )
    return header, data_offset


def open_lut(path: str, model=None, *, verify: bool = True) -> DiskLUT:
    """Open a LUT file memory-mapped. With ``model`` the shapes and the model fingerprint
    must match; with ``verify`` the SHA-256 of the data section is checked (one sequential
    read of the file)."""
    header, data_offset = read_lut_header(path)
    if verify:
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            f.seek(data_offset)
            for chunk in iter(lambda: f.read(1 << 24), b""):
                sha.update(chunk)
        if sha.hexdigest() != header["sha256"]:
            raise LUTFileError(
                f"MoLE LUT file {path!r}: data checksum mismatch (sha256 {sha.hexdigest()[:16]}…, "
                f"header {header['sha256'][:16]}…): the file is corrupted"
            )
    store = DiskLUT(path, header, data_offset)
    if model is not None:
        store.check_model(model)
    return store


def _check_meta(meta: _Meta, model, *, where: str) -> None:
    cfg = model.cfg
    m = mole_config_of(cfg)
    want = {"vocab_size": cfg.vocab_size, "n_layers": cfg.n_layers, "n_experts": m.n_experts, "d_model": cfg.d_model}
    bad = [f"{k}: LUT has {getattr(meta, k)}, model has {v}" for k, v in want.items() if getattr(meta, k) != v]
    if bad:
        raise LUTFileError(f"MoLE LUT in {where} was built for another model shape: " + "; ".join(bad))
    fp = lut_fingerprint(model)
    if meta.fingerprint and meta.fingerprint != fp:
        raise LUTFileError(
            f"MoLE LUT in {where} was built from other weights (fingerprint {meta.fingerprint[:12]}…, "
            f"this model's embedding+routers give {fp[:12]}…)"
        )
