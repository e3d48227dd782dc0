"""Hugging Face safetensors ⇄ pallasite state, no torch (config mapping: ``models/hf_config.py``).

    cfg, state = import_hf("path/to/hf_folder", scan_layers=True)   # state ≅ nnx.split(abstract_model(cfg))[1]
    export_hf(cfg, state, "out_folder")                             # config.json, generation_config.json, safetensors

Weights are read with safetensors' numpy backend from ``model.safetensors`` or the shards of
``model.safetensors.index.json``. HF ``[out, in]`` linears are transposed to our ``[in, out]``;
with ``scan_layers`` layer parameters are stacked on ``[L]``; a tied head is dropped (or accepted
when equal to the embedding). Strict: every parameter comes from exactly one shape-checked read
and every tensor in the file is consumed, else ``CheckpointMismatchError`` names the tensor and
the shapes. HF -> pallasite -> HF round-trips bit-exactly with ``dtype=None``. FFN kinds register
their tensor mapping in ``pallasite.registry.HF_FFN`` as ``(to_hf_fn, from_hf_fn)`` (contract:
docs/checkpoints.md; ``models/hf_moe.py`` is the worked example).
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping, Optional

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.errors import DataError, UserError
from pallasite.models.config import ModelConfig
from pallasite.models.hf_config import config_from_hf, config_to_hf
from pallasite.models.transformer import abstract_model
from pallasite.registry import HF_FFN

SAFETENSORS_SINGLE = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5_000_000_000  # transformers' default "5GB"

# Buffers some exporters persist that carry no weights (RoPE tables are recomputed).
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
_ST_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}


class CheckpointMismatchError(UserError, ValueError):
    """The checkpoint does not match the model the config describes (missing/extra/misshaped)."""


# --------------------------------------------------------------------------- tensor mapping

Read = Callable[..., np.ndarray]


def _ffn_mapping(kind: str):
    return HF_FFN.get(kind, field="HF tensor mapping for ffn")


def linear_to_hf(kernel_in_out: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(np.swapaxes(kernel_in_out, -1, -2))


def linear_from_hf(read: Read, name: str, in_out_shape) -> np.ndarray:
    """Read an HF ``[out, in]`` Linear weight, checking it against our ``[in, out]`` shape."""
    return np.ascontiguousarray(np.swapaxes(read(name, shape=tuple(in_out_shape)[::-1]), -1, -2))


# (relative pallasite path under the block's ffn module, HF suffix after prefix, is a linear kernel)
_DENSE_FFN = [
    (("gate_proj", "kernel"), "mlp.gate_proj.weight", True),
    (("up_proj", "kernel"), "mlp.up_proj.weight", True),
    (("down_proj", "kernel"), "mlp.down_proj.weight", True),
    (("gate_proj", "bias"), "mlp.gate_proj.bias", False),
    (("up_proj", "bias"), "mlp.up_proj.bias", False),
    (("down_proj", "bias"), "mlp.down_proj.bias", False),
]


def _dense_to_hf(cfg, ffn_params, prefix, layer):
    return {
        prefix + hf: (linear_to_hf(ffn_params[p]) if lin else ffn_params[p])
        for p, hf, lin in _DENSE_FFN
        if p in ffn_params
    }


def _dense_from_hf(cfg, read, prefix, layer, expected):
    return {
        p: (linear_from_hf(read, prefix + hf, expected[p]) if lin else read(prefix + hf, shape=expected[p]))
        for p, hf, lin in _DENSE_FFN
        if p in expected
    }


HF_FFN.register("dense", (_dense_to_hf, _dense_from_hf))

# Attention is the same for every family (a linear kind keeps kernel/bias names).
_ATTN = [(("attn", n, "kernel"), f"self_attn.{n}.weight", True) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
_ATTN += [(("attn", n, "bias"), f"self_attn.{n}.bias", False) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
_ATTN += [
    (("attn", "q_norm", "scale"), "self_attn.q_norm.weight", False),
    (("attn", "k_norm", "scale"), "self_attn.k_norm.weight", False),
]
_NORMS = [
    (("input_norm", "scale"), "input_layernorm.weight", False),
    (("post_attn_norm", "scale"), "post_attention_layernorm.weight", False),
]
# Gemma 2/3 (cfg.sandwich_norm): HF's post_attention_layernorm norms the attention *output*; the
# FFN's input norm (our post_attn_norm) is pre_feedforward_layernorm. Weights stay as HF stores
# them (Gemma's (1 + w) is applied at run time, models/layers.py).
_SANDWICH_NORMS = [
    (("input_norm", "scale"), "input_layernorm.weight", False),
    (("attn_out_norm", "scale"), "post_attention_layernorm.weight", False),
    (("post_attn_norm", "scale"), "pre_feedforward_layernorm.weight", False),
    (("ffn_out_norm", "scale"), "post_feedforward_layernorm.weight", False),
]
_BLOCK = _ATTN + _NORMS


def block_table(cfg: ModelConfig) -> list:
    """(pallasite path in a block, HF suffix, is a linear kernel) for the attention and norms."""
    return _ATTN + (_SANDWICH_NORMS if cfg.sandwich_norm else _NORMS)


_TOP = [
    (("embed", "embedding"), "model.embed_tokens.weight", False),
    (("final_norm", "scale"), "model.norm.weight", False),
    (("lm_head", "kernel"), "lm_head.weight", True),
]


def _split_block(rel_params: Mapping[tuple, Any], table: list = _BLOCK):
    """Split a block's params into (attention + norms, ffn relative to the ffn module, unknown)."""
    block_keys = {p for p, _, _ in table}
    base, ffn, unknown = {}, {}, []
    for p, v in rel_params.items():
        if p in block_keys:
            base[p] = v
        elif p[0] == "ffn":
            ffn[p[1:]] = v
        else:
            unknown.append(p)
    return base, ffn, unknown


def _layer_prefix(i: int) -> str:
    return f"model.layers.{i}."


def _flat_values(state) -> dict[tuple, Any]:
    out = {}
    for path, v in nnx.to_flat_state(state):
        out[tuple(path)] = v.get_value() if isinstance(v, nnx.Variable) else v
    return out


# --------------------------------------------------------------------------- reading

_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit on the JSON header


def check_safetensors_file(file_path: str) -> None:
    """Raise ``DataError`` naming ``file_path`` and what is wrong if it is not a complete
    safetensors file: empty, truncated (header or tensor data), or another format. Reads only the
    8-byte length and the JSON header."""
    size = os.path.getsize(file_path)
    fix = "re-download or re-export it"
    if size == 0:
        raise DataError(f"{file_path}: the file is empty (0 bytes); expected a safetensors file; {fix}")
    with open(file_path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise DataError(
                f"{file_path}: truncated: {size} bytes, fewer than the 8-byte header "
                f"length of a safetensors file; {fix}"
            )
        n = int.from_bytes(head, "little")
        first = f.read(1)
        if n > _MAX_HEADER_BYTES or first != b"{":
            raise DataError(
                f"{file_path}: not a safetensors file (it does not start with an 8-byte "
                f"header length and a JSON header; first bytes {head + first!r})"
            )
        f.seek(8)
        if n > size - 8:
            raise DataError(
                f"{file_path}: truncated: the header needs {n:,} bytes after the first "
                f"8, the file has {size - 8:,}; {fix}"
            )
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DataError(f"{file_path}: not a safetensors file (its header is not JSON)") from None
    if not isinstance(header, dict):
        raise DataError(f"{file_path}: not a safetensors file (its header is not a JSON object)")
    ends = [
        int(v["data_offsets"][1])
        for k, v in header.items()
        if k != "__metadata__" and isinstance(v, dict) and "data_offsets" in v
    ]
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise DataError(
            f"{file_path}: truncated: its {len(ends)} tensors need {need:,} bytes, the file has {size:,}; {fix}"
        )


class _Reader:
    """Tensor access over one or several safetensors files, tracking what was consumed. Every file
    is checked first (``check_safetensors_file``) so a damaged one fails naming it."""

    def __init__(self, path: str):
        from safetensors import SafetensorError, safe_open

        self.path = path
        index = os.path.join(path, SAFETENSORS_INDEX)
        single = os.path.join(path, SAFETENSORS_SINGLE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
                files = sorted(set(weight_map.values()))
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
                raise DataError(
                    f"{index}: not a safetensors index (expected JSON with a 'weight_map' of tensor name -> shard file)"
                ) from None
            missing = [fn for fn in files if not os.path.isfile(os.path.join(path, fn))]
            if missing:
                raise DataError(f"{index} names shard(s) that are not in {path}: {missing[:4]}")
        elif os.path.exists(single):
            files, weight_map = [SAFETENSORS_SINGLE], None
        else:
            raise FileNotFoundError(f"{path}: neither {SAFETENSORS_SINGLE} nor {SAFETENSORS_INDEX} found")
        self.handles = {}
        for fn in files:
            file_path = os.path.join(path, fn)
            check_safetensors_file(file_path)
            try:
                self.handles[fn] = safe_open(file_path, framework="numpy")
            except SafetensorError as e:  # what the header check cannot see (bad offsets, dtypes)
                raise DataError(f"{file_path}: not a readable safetensors file ({e})") from None
        self.where: dict[str, str] = {}
        for fn, h in self.handles.items():
            for k in h.keys():
                if k in self.where:
                    raise CheckpointMismatchError(f"tensor {k!r} appears in both {self.where[k]} and {fn}")
                self.where[k] = fn
        if weight_map is not None:
            for k, fn in weight_map.items():
                if self.where.get(k) != fn:
                    raise CheckpointMismatchError(
                        f"{SAFETENSORS_INDEX} maps tensor {k!r} to {fn}, but it is in {self.where.get(k, 'no shard')}"
                    )
        self.consumed: set[str] = set()

    def shape(self, name: str) -> tuple:
        return tuple(self.handles[self.where[name]].get_slice(name).get_shape())

    def has(self, name: str) -> bool:
        return name in self.where

    def __call__(self, name: str, shape=None) -> np.ndarray:
        if name not in self.where:
            exp = "" if shape is None else f" (expected shape {tuple(shape)})"
            raise CheckpointMismatchError(f"{self.path}: missing tensor {name!r}{exp}")
        if shape is not None and self.shape(name) != tuple(shape):
            raise CheckpointMismatchError(
                f"{self.path}: tensor {name!r} has shape {self.shape(name)}, expected {tuple(shape)}"
            )
        self.consumed.add(name)
        return self.handles[self.where[name]].get_tensor(name)

    def unused(self) -> list[str]:
        return sorted(k for k in self.where if k not in self.consumed and not k.endswith(_IGNORED_SUFFIXES))


def _check_cover(got: Mapping, expected: Mapping, where: str):
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        raise CheckpointMismatchError(f"{where}: mapping produced no value for {missing} and unexpected {extra}")
    for p, shp in expected.items():
        if tuple(got[p].shape) != tuple(shp):
            raise CheckpointMismatchError(
                f"{where}: parameter {p} has shape {tuple(got[p].shape)}, expected {tuple(shp)}"
            )


def read_hf_config(path: str) -> dict:
    file_path = os.path.join(path, "config.json")
    with open(file_path) as f:
        try:
            config = json.load(f)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataError(f"{file_path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise DataError(f"{file_path}: expected a JSON object of model settings, got {type(config).__name__}")
    return config


def import_hf(path: str, *, dtype=None, scan_layers: Optional[bool] = None, cfg: Optional[ModelConfig] = None):
    """(ModelConfig, nnx.State) from an HF folder; the state matches
    ``nnx.split(abstract_model(cfg))[1]`` in either layer layout.

    ``dtype``: storage dtype to cast parameters to (``cfg.param_dtype``); None keeps the
    checkpoint's. ``scan_layers``: stacked layout (default: the config's default, False).
    ``cfg``: skip config.json and use this config (e.g. one with method sub-configs).
    """
    path = os.fspath(path)
    if cfg is None:
        cfg = config_from_hf(read_hf_config(path))
    read = _Reader(path)
    embed_name = "model.embed_tokens.weight"
    if not read.has(embed_name):
        read(embed_name, shape=(cfg.vocab_size, cfg.d_model))  # raises the named error
    if dtype is None:  # keep the checkpoint's storage dtype (bit-exact round trip)
        st_dtype = read.handles[read.where[embed_name]].get_slice(embed_name).get_dtype()
        if st_dtype not in _ST_DTYPES:
            raise CheckpointMismatchError(f"{path}: {embed_name} has unsupported dtype {st_dtype}")
        param_dtype = _ST_DTYPES[st_dtype]
    else:
        param_dtype = jnp.dtype(dtype).name
    changes = {"param_dtype": param_dtype}
    if scan_layers is not None:
        changes["scan_layers"] = bool(scan_layers)
    cfg = cfg.replace(**changes)

    abs_state = nnx.split(abstract_model(cfg))[1]
    abs_flat = {tuple(p): v for p, v in nnx.to_flat_state(abs_state)}
    top_shapes = {p: v.shape for p, v in abs_flat.items() if p[0] != "layers"}
    layer_shapes = {}
    for p, v in abs_flat.items():
        if p[0] == "layers":
            if cfg.scan_layers:
                layer_shapes[p[1:]] = v.shape[1:]
            elif p[1] == 0:
                layer_shapes[p[2:]] = v.shape
    table = block_table(cfg)
    base_shapes, ffn_shapes, unknown = _split_block(layer_shapes, table)
    if unknown:
        raise CheckpointMismatchError(f"no HF mapping for pallasite block parameters {unknown}")
    _, ffn_from_hf = _ffn_mapping(cfg.ffn)

    values: dict[tuple, np.ndarray] = {}
    for p, hf_name, lin in _TOP:
        if p in top_shapes:
            values[p] = linear_from_hf(read, hf_name, top_shapes[p]) if lin else read(hf_name, shape=top_shapes[p])
    if cfg.tie_embeddings and read.has("lm_head.weight"):
        # Some exporters save the tied head anyway; accept it only if it really is the embedding.
        head = read("lm_head.weight", shape=(cfg.vocab_size, cfg.d_model))
        if not np.array_equal(head, values[("embed", "embedding")]):
            raise CheckpointMismatchError(
                f"{path}: tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight"
            )
    per_layer = []
    for i in range(cfg.n_layers):
        prefix = _layer_prefix(i)
        layer = {
            p: (linear_from_hf(read, prefix + hf, base_shapes[p]) if lin else read(prefix + hf, shape=base_shapes[p]))
            for p, hf, lin in table
            if p in base_shapes
        }
        ffn = ffn_from_hf(cfg, read, prefix, i, ffn_shapes)
        _check_cover(ffn, ffn_shapes, f"layer {i} ffn ({cfg.ffn})")
        layer.update({("ffn",) + p: v for p, v in ffn.items()})
        per_layer.append(layer)
    extra = read.unused()
    if extra:
        shown = ", ".join(f"{k} {read.shape(k)}" for k in extra[:20])
        raise CheckpointMismatchError(
            f"{path}: {len(extra)} unexpected tensor(s) not used by the {cfg.family} model (ffn={cfg.ffn}, "
            f"tie_embeddings={cfg.tie_embeddings}): {shown}{' …' if len(extra) > 20 else ''}"
        )

    if cfg.scan_layers:
        for rel in layer_shapes:
            values[("layers",) + rel] = np.stack([per_layer[i][rel] for i in range(cfg.n_layers)])
    else:
        for i, layer in enumerate(per_layer):
            for rel, v in layer.items():
                values[("layers", i) + rel] = v

    flat = []
    for p, var in abs_flat.items():
        arr = values[p]
        if tuple(arr.shape) != tuple(var.shape):  # guards the mapping code itself
            raise CheckpointMismatchError(f"parameter {'/'.join(map(str, p))}: got {arr.shape}, expected {var.shape}")
        flat.append((p, var.replace(jnp.asarray(arr, dtype=param_dtype))))
    return cfg, nnx.from_flat_state(flat)


# --------------------------------------------------------------------------- writing


def state_to_hf_tensors(cfg: ModelConfig, state) -> dict[str, np.ndarray]:
    """{HF name: numpy array} for a pallasite state (either layout), in HF's layout."""
    flat = {p: np.asarray(v) for p, v in _flat_values(state).items()}
    out: dict[str, np.ndarray] = {}
    top, layers = {}, [dict() for _ in range(cfg.n_layers)]
    for p, v in flat.items():
        if p[0] != "layers":
            top[p] = v
        elif cfg.scan_layers:
            for i in range(cfg.n_layers):
                layers[i][p[1:]] = v[i]
        else:
            layers[int(p[1])][p[2:]] = v
    for p, hf_name, lin in _TOP:
        if p in top:
            out[hf_name] = linear_to_hf(top.pop(p)) if lin else top.pop(p)
    if top:
        raise ValueError(f"export_hf: no HF mapping for top-level parameters {sorted(top)}")
    ffn_to_hf, _ = _ffn_mapping(cfg.ffn)
    table = block_table(cfg)
    for i, layer in enumerate(layers):
        prefix = _layer_prefix(i)
        base, ffn, unknown = _split_block(layer, table)
        if unknown:
            raise ValueError(f"export_hf: no HF mapping for layer {i} parameters {unknown}")
        for p, hf, lin in table:
            if p in base:
                out[prefix + hf] = linear_to_hf(base[p]) if lin else base[p]
        out.update(ffn_to_hf(cfg, ffn, prefix, i))
    return out


def _save_with_umask(save_file, tensors, file_path: str, metadata: dict) -> None:
    """safetensors' ``save_file`` creates files readable by their owner only (0600); give the
    file the mode every other output gets, 0666 minus the user's umask."""
    save_file(tensors, file_path, metadata=metadata)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file_path, 0o666 & ~umask)


def export_hf(cfg: ModelConfig, state, path: str, *, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
    """Write an HF folder: config.json, generation_config.json and safetensors (sharded with
    ``model.safetensors.index.json`` when the tensors exceed ``max_shard_bytes``)."""
    from safetensors.numpy import save_file

    from pallasite.registry import LINEAR

    to_float = getattr(LINEAR.get(cfg.linear), "to_float", None)
    if to_float is not None:  # a kind that keeps float weights in a layout of its own (panels) writes them plain
        cfg, state = to_float(cfg, state)
    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = state_to_hf_tensors(cfg, state)
    dtype = tensors["model.embed_tokens.weight"].dtype.name
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config_to_hf(cfg, dtype=dtype), f, indent=2)
    gen = {"_from_model_config": True, "bos_token_id": cfg.bos_token_id, "pad_token_id": cfg.pad_token_id}
    if cfg.eos_token_id is not None:
        gen["eos_token_id"] = cfg.eos_token_id[0] if len(cfg.eos_token_id) == 1 else list(cfg.eos_token_id)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({k: v for k, v in gen.items() if v is not None}, f, indent=2)

    # Greedy packing in name order; a tensor larger than the limit gets a shard of its own.
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = np.ascontiguousarray(tensors[name])
        size += nbytes
    for stale in (SAFETENSORS_SINGLE, SAFETENSORS_INDEX):
        if os.path.exists(os.path.join(path, stale)):
            os.remove(os.path.join(path, stale))
    meta = {"format": "pt"}  # transformers refuses safetensors files without a known format tag
    if len(shards) == 1:
        _save_with_umask(save_file, shards[0], os.path.join(path, SAFETENSORS_SINGLE), meta)
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save_with_umask(save_file, shard, os.path.join(path, fn), meta)
        weight_map.update({k: fn for k in shard})
    index = {"metadata": {"total_size": int(sum(t.nbytes for t in tensors.values()))}, "weight_map": weight_map}
    with open(os.path.join(path, SAFETENSORS_INDEX), "w") as f:
        json.dump(index, f, indent=2)
