"""GGUF (llama.cpp) checkpoints → pallasite: dequantised weights, config and tokenizer.

    cfg, state, tokenizer = import_gguf(offline_model_path("gemma3-270m"))  # or "smollm2-135m"

Read with ``models/gguf_reader.py``; every tensor type (F32/F16, legacy and K-quants) is
dequantised to float32 with ``gguf.quants.dequantize`` (exact: blocks hold f16 scales), then cast
to ``dtype``. Architectures are a table (``GGUF_ARCHITECTURES``): ``llama`` and ``gemma3``. What
llama.cpp's converter changed is undone: dims are fastest-first (our view is ``[out, in]``;
kernels are ``[in, out]``); llama's q/k rows are permuted for pair-wise rotary
(``unpermute_rotary``; gemma3 is not permuted); gemma3 norms are stored as 1 + w (1 is
subtracted). gemma3 hyper-parameters llama.cpp hard-codes are taken as it takes them (one global
layer in 6, local RoPE base 10k, attention scale head_dim ** -0.5 except the 62-layer 27B). No
``output.weight`` means a tied head; ``rope_freqs.weight`` (Llama 3.1 scaling) is refused unless
all ones. The tokenizer is rebuilt with ``tokenizers`` alone (``models/tokenizer.py``): ``gpt2`` =
byte-level BPE with llama.cpp's ``tokenizer.ggml.pre`` splits (``smollm`` isolates digits, where
transformers' converter uses the plain GPT-2 split: " ½" differs, tests pin both), ``llama`` =
SentencePiece BPE. docs/models.md and docs/checkpoints.md have the details and measurements.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Optional, Union

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.models.config import GEMMA3_FLAGS, ModelConfig, gemma3_layer_types
from pallasite.models.gguf_reader import GGUFFile
from pallasite.models.hf import CheckpointMismatchError
from pallasite.models.offline import (  # noqa: F401  (re-exported: the offline models)
    GEMMA3_PIP,
    OFFLINE_MODELS,
    SMOLLM2_PIP,
    cache_dir,
    gemma3_gguf_path,
    offline_model_path,
    smollm2_gguf_path,
)
from pallasite.models.tokenizer import (  # noqa: F401  (token types re-exported)
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_UNKNOWN,
    TOKEN_UNUSED,
    TOKEN_USER_DEFINED,
    GGUFVocab,
    byte_level_bpe_tokenizer,
    bytes_to_unicode,
    sentencepiece_bpe_tokenizer,
)
from pallasite.models.transformer import abstract_model

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> list of regexes applied in order (each isolates its matches), after
# llama.cpp's llama-vocab.cpp. Unknown pre types use the GPT-2 split (llama.cpp's default).
PRE_TOKENIZER_SPLITS = {
    "default": [_GPT2_SPLIT],
    "gpt2": [_GPT2_SPLIT],
    "smollm": [r"\p{N}", _GPT2_SPLIT],
    "starcoder": [r"\p{N}", _GPT2_SPLIT],
    "refact": [r"\p{N}", _GPT2_SPLIT],
    "codeshell": [r"\p{N}", _GPT2_SPLIT],
    "llama3": [_LLAMA3_SPLIT],
    "llama-v3": [_LLAMA3_SPLIT],
    "llama-bpe": [_LLAMA3_SPLIT],
}
_bytes_to_unicode = bytes_to_unicode  # (older name)


# --------------------------------------------------------------------------- metadata

def _reader(path_or_file) -> GGUFFile:
    return path_or_file if isinstance(path_or_file, GGUFFile) else GGUFFile(path_or_file)


def gguf_metadata(reader, *, skip=("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                                   "tokenizer.ggml.scores")) -> dict[str, Any]:
    """Metadata as plain Python values (the large token arrays skipped)."""
    fields = _reader(reader).fields
    return {k: (v.tolist() if isinstance(v, np.ndarray) else v)
            for k, v in fields.items() if k not in skip}


class _Meta:
    """``{arch}.key`` lookups with named errors for required keys."""

    def __init__(self, meta: dict, arch: str):
        self.meta, self.arch = meta, arch

    def __call__(self, key, default=None, required=False):
        full = f"{self.arch}.{key}"
        if full not in self.meta:
            if required:
                raise ValueError(f"GGUF metadata: required key {full!r} is missing")
            return default
        return self.meta[full]

    def tok_id(self, name) -> Optional[int]:
        v = self.meta.get(f"tokenizer.ggml.{name}_token_id")
        return None if v is None else int(v)


def _common_config(get: _Meta, n_tokens: Optional[int]) -> dict:
    """ModelConfig kwargs every decoder-only GGUF architecture states the same way."""
    if get("expert_count", 0):
        raise ValueError(f"GGUF: mixture-of-experts files "
                         f"({get.arch}.expert_count={get('expert_count')}) "
                         "are not supported")
    d = int(get("embedding_length", required=True))
    n_heads = int(get("attention.head_count", required=True))
    n_kv = get("attention.head_count_kv", n_heads)
    if isinstance(n_kv, list):
        raise ValueError(f"GGUF: per-layer head_count_kv {n_kv} is not supported")
    head_dim = int(get("attention.key_length", d // n_heads))
    if int(get("attention.value_length", head_dim)) != head_dim:
        raise ValueError("GGUF: key_length != value_length is not supported")
    rot = int(get("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise ValueError(f"GGUF: partial rotary (rope.dimension_count={rot} < head_dim={head_dim}) is not supported")
    scaling = None
    stype = get("rope.scaling.type", "none")
    if stype == "linear":
        scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor", required=True))}
    elif stype not in ("none", None):
        raise ValueError(f"GGUF: rope.scaling.type {stype!r} is not supported; expected none | linear")
    vocab = get("vocab_size", n_tokens)
    if vocab is None:
        raise ValueError(f"GGUF metadata: neither {get.arch}.vocab_size nor tokenizer.ggml.tokens "
                         "is present")
    eos = get.tok_id("eos")
    return dict(
        vocab_size=int(vocab), d_model=d, n_layers=int(get("block_count", required=True)), n_heads=n_heads,
        n_kv_heads=int(n_kv), head_dim=head_dim, d_ff=int(get("feed_forward_length", required=True)),
        norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_seq_len=int(get("context_length", 2048)),
        bos_token_id=get.tok_id("bos"), eos_token_id=None if eos is None else (eos,),
        pad_token_id=get.tok_id("padding"),
    )


def _llama_config(get: _Meta, n_tokens: Optional[int]) -> ModelConfig:
    return ModelConfig(**_common_config(get, n_tokens), family="llama")


def _gemma3_config(get: _Meta, n_tokens: Optional[int]) -> ModelConfig:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if get(key, 0.0):  # llama.cpp reads 0 as "none"
            raise ValueError(f"GGUF: {get.arch}.{key}={get(key)} is not supported "
                             "(no logit soft-capping)")
    kw = _common_config(get, n_tokens)
    n = kw["n_layers"]
    pattern = get("attention.sliding_window_pattern", 6)
    if not isinstance(pattern, int):
        raise ValueError(f"GGUF: {get.arch}.attention.sliding_window_pattern={pattern!r}; "
                         "only an int is supported")
    window = get("attention.sliding_window")
    types = gemma3_layer_types(n, pattern) if window else ("full",) * n  # llama.cpp: no window: no SWA
    # llama.cpp's gemma3 hparams: the 27B (62 layers) scales by d_model / n_heads, others by head_dim.
    qpas = kw["d_model"] // kw["n_heads"] if n == 62 else kw["head_dim"]
    return ModelConfig(**kw, **GEMMA3_FLAGS, hidden_act="gelu", layer_types=types,
                       sliding_window=int(window) if window else None,
                       rope_local_theta=(_f32(get("rope.freq_base_swa", 10000.0)) if window else None),
                       query_pre_attn_scalar=float(qpas))


def _f32(v) -> float:
    """GGUF stores these as float32: 1e-5 arrives as 9.99999974e-06; keep the short decimal."""
    return float(str(np.float32(v)))


@dataclasses.dataclass(frozen=True)
class GGUFArchitecture:
    """How one ``general.architecture`` maps onto pallasite: its config, its block's tensors
    ``(pallasite path in a block, GGUF suffix, is a linear kernel, rotary-permuted heads attr)``,
    and the offset llama.cpp's converter added to every norm weight (subtracted on import)."""

    name: str
    config: Callable[[_Meta, Optional[int]], ModelConfig]
    block: tuple
    norm_offset: float = 0.0


GGUF_ARCHITECTURES: dict[str, GGUFArchitecture] = {}


def register_gguf_architecture(arch: GGUFArchitecture) -> None:
    GGUF_ARCHITECTURES[arch.name] = arch


def _architecture(meta: dict) -> GGUFArchitecture:
    arch = meta.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; "
                         f"supported: {list(GGUF_ARCHITECTURES)}")
    return GGUF_ARCHITECTURES[arch]


def config_from_gguf(meta: dict, *, n_tokens: Optional[int] = None) -> ModelConfig:
    """ModelConfig from GGUF metadata (any architecture of ``GGUF_ARCHITECTURES``)."""
    arch = _architecture(meta)
    return arch.config(_Meta(meta, arch.name), n_tokens)


# --------------------------------------------------------------------------- weights

def unpermute_rotary(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (pairs → halves) on an ``[H*Dh, ...]`` weight or bias."""
    shape = w_out_in.shape
    half = shape[0] // n_heads // 2
    return w_out_in.reshape(n_heads, half, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def permute_rotary(w_out_in: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's permutation (halves → pairs), the inverse of ``unpermute_rotary``."""
    shape = w_out_in.shape
    half = shape[0] // n_heads // 2
    return w_out_in.reshape(n_heads, 2, half, *shape[1:]).swapaxes(1, 2).reshape(shape)


_LINEARS = ((("attn", "v_proj", "kernel"), "attn_v.weight", True, None),
            (("attn", "o_proj", "kernel"), "attn_output.weight", True, None),
            (("attn", "v_proj", "bias"), "attn_v.bias", False, None),
            (("attn", "o_proj", "bias"), "attn_output.bias", False, None),
            (("ffn", "gate_proj", "kernel"), "ffn_gate.weight", True, None),
            (("ffn", "up_proj", "kernel"), "ffn_up.weight", True, None),
            (("ffn", "down_proj", "kernel"), "ffn_down.weight", True, None))
_LLAMA_BLOCK = ((("attn", "q_proj", "kernel"), "attn_q.weight", True, "n_heads"),
                (("attn", "k_proj", "kernel"), "attn_k.weight", True, "n_kv_heads"),
                (("attn", "q_proj", "bias"), "attn_q.bias", False, "n_heads"),
                (("attn", "k_proj", "bias"), "attn_k.bias", False, "n_kv_heads"),
                (("input_norm", "scale"), "attn_norm.weight", False, None),
                (("post_attn_norm", "scale"), "ffn_norm.weight", False, None)) + _LINEARS
# llama.cpp's gemma3 names: post_attention_norm norms the attention output, ffn_norm is the FFN's
# input norm (our post_attn_norm), post_ffw_norm its output norm.
_GEMMA3_BLOCK = ((("attn", "q_proj", "kernel"), "attn_q.weight", True, None),
                 (("attn", "k_proj", "kernel"), "attn_k.weight", True, None),
                 (("attn", "q_proj", "bias"), "attn_q.bias", False, None),
                 (("attn", "k_proj", "bias"), "attn_k.bias", False, None),
                 (("attn", "q_norm", "scale"), "attn_q_norm.weight", False, None),
                 (("attn", "k_norm", "scale"), "attn_k_norm.weight", False, None),
                 (("input_norm", "scale"), "attn_norm.weight", False, None),
                 (("attn_out_norm", "scale"), "post_attention_norm.weight", False, None),
                 (("post_attn_norm", "scale"), "ffn_norm.weight", False, None),
                 (("ffn_out_norm", "scale"), "post_ffw_norm.weight", False, None)) + _LINEARS
_BLOCK = list(_LLAMA_BLOCK)
_TOP = [(("embed", "embedding"), "token_embd.weight", False),
        (("final_norm", "scale"), "output_norm.weight", False),
        (("lm_head", "kernel"), "output.weight", True)]

register_gguf_architecture(GGUFArchitecture("llama", _llama_config, _LLAMA_BLOCK))
register_gguf_architecture(GGUFArchitecture("gemma3", _gemma3_config, _GEMMA3_BLOCK,
                                            norm_offset=1.0))


def import_gguf(path, *, dtype=None, scan_layers: Optional[bool] = None, with_tokenizer: bool = True):
    """(ModelConfig, nnx.State, tokenizer or None) from a GGUF file of a supported architecture.

    ``dtype``: parameter storage dtype (default float32, exact for the dequantised values).
    The state matches ``nnx.split(abstract_model(cfg))[1]`` for either layer layout.
    """
    reader = _reader(path)
    meta = gguf_metadata(reader)
    arch = _architecture(meta)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    cfg = config_from_gguf(meta, n_tokens=None if tokens is None else len(tokens))
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        if not np.all(tensors["rope_freqs.weight"].dequantize() == 1.0):
            raise ValueError("GGUF: rope_freqs.weight (Llama 3.1-style per-frequency RoPE scaling) is not supported")
        tensors.pop("rope_freqs.weight")
    param_dtype = jnp.dtype(dtype if dtype is not None else "float32").name
    bias = "blk.0.attn_q.bias" in tensors
    changes = dict(param_dtype=param_dtype, tie_embeddings="output.weight" not in tensors,
                   qkv_bias=bias, o_bias="blk.0.attn_output.bias" in tensors)
    if scan_layers is not None:
        changes["scan_layers"] = bool(scan_layers)
    cfg = cfg.replace(**changes)

    consumed: set[str] = set()
    # Dequantise the block tensors on a small thread pool (gguf's numpy kernels release the GIL for
    # most of their work); the embedding / head (most of a large-vocabulary model) are dequantised
    # when read and copied into their parameter at once, so the float32 model exists about once.
    from concurrent.futures import ThreadPoolExecutor

    big = {n for n in ("token_embd.weight", "output.weight") if n in tensors}
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        small = [t for n, t in tensors.items() if n not in big]
        dequantized = dict(pool.map(lambda t: (t.name, t.dequantize()), small))

    def read(name: str, shape_out_in: tuple) -> np.ndarray:
        if name not in tensors:
            raise CheckpointMismatchError(f"GGUF: missing tensor {name!r} (expected shape {tuple(shape_out_in)})")
        got = tensors[name].shape  # numpy order (GGUF lists dims fastest-first)
        if got != tuple(shape_out_in):
            raise CheckpointMismatchError(f"GGUF tensor {name!r} has shape {got}, expected {tuple(shape_out_in)}")
        consumed.add(name)
        w = (tensors[name].dequantize() if name in big else dequantized.pop(name)).reshape(got)
        if arch.norm_offset and name.endswith("norm.weight"):  # undo the converter's 1 + w
            w = w - np.float32(arch.norm_offset)
        return w

    abs_flat = {tuple(p): v for p, v in nnx.to_flat_state(nnx.split(abstract_model(cfg))[1])}
    top_shapes = {p: v.shape for p, v in abs_flat.items() if p[0] != "layers"}
    layer_shapes = {(p[1:] if cfg.scan_layers else p[2:]): (v.shape[1:] if cfg.scan_layers else v.shape)
                    for p, v in abs_flat.items() if p[0] == "layers" and (cfg.scan_layers or p[1] == 0)}
    known = {p for p, *_ in arch.block}
    unknown = sorted(set(layer_shapes) - known)
    if unknown:
        raise CheckpointMismatchError(f"GGUF import ({arch.name}): no mapping for pallasite block "
                                      f"parameters {unknown}")

    def param(x):  # the one copy into a parameter
        return jnp.asarray(x, dtype=param_dtype)

    values: dict[tuple, Any] = {}
    for p, name, lin in _TOP:
        if p in top_shapes:
            shp = top_shapes[p]
            values[p] = param(read(name, shp[::-1]).T if lin else read(name, shp))
    per_layer = []
    for i in range(cfg.n_layers):
        layer = {}
        for p, suffix, lin, heads in arch.block:
            if p not in layer_shapes:
                continue
            shp = layer_shapes[p]
            w = read(f"blk.{i}.{suffix}", shp[::-1] if lin else shp)
            if heads is not None:
                w = unpermute_rotary(w, getattr(cfg, heads))
            layer[p] = w.T if lin else w  # a view: param() below makes the one copy
        per_layer.append(layer)
    extra = sorted(set(tensors) - consumed)
    if extra:
        raise CheckpointMismatchError(f"GGUF: {len(extra)} unexpected tensor(s) for a {arch.name} "
                                      f"model: {extra[:20]}")
    if cfg.scan_layers:
        for rel in layer_shapes:
            values[("layers",) + rel] = param(np.stack([layer.pop(rel) for layer in per_layer]))
    else:
        for i, layer in enumerate(per_layer):
            for rel, v in layer.items():
                values[("layers", i) + rel] = param(v)
    del per_layer
    flat = [(p, var.replace(values.pop(p))) for p, var in abs_flat.items()]
    state = nnx.from_flat_state(flat)
    tokenizer = tokenizer_from_gguf(reader) if with_tokenizer and tokens is not None else None
    return cfg, state, tokenizer


# --------------------------------------------------------------------------- tokenizer

def gguf_vocab(path_or_reader: Union[str, Any]) -> tuple[str, GGUFVocab]:
    """(``tokenizer.ggml.model``, the vocabulary and its special ids / flags) of a GGUF file."""
    fields = _reader(path_or_reader).fields

    def get(key, default=None):
        v = fields.get(f"tokenizer.ggml.{key}", default)
        return v.tolist() if isinstance(v, np.ndarray) else v

    kind = get("model")
    if "tokenizer.ggml.tokens" not in fields:
        raise ValueError("GGUF file has no tokenizer.ggml.tokens")
    tokens = tuple(get("tokens"))
    types = tuple(get("token_type", [TOKEN_NORMAL] * len(tokens)))
    merges = get("merges")
    def ident(name):
        return None if get(f"{name}_token_id") is None else int(get(f"{name}_token_id"))

    template = fields.get("tokenizer.chat_template")
    # llama.cpp adds BOS to a SentencePiece vocabulary unless the file says otherwise.
    add_bos = bool(get("add_bos_token", kind == "llama"))
    return kind, GGUFVocab(
        tokens=tokens, types=types, merges=None if merges is None else tuple(merges),
        pre=get("pre", "default"), bos_id=ident("bos"), eos_id=ident("eos"), unk_id=ident("unknown"),
        pad_id=ident("padding"), add_bos=add_bos, add_eos=bool(get("add_eos_token", False)),
        add_space_prefix=bool(get("add_space_prefix", False)), chat_template=template)


def tokenizer_from_gguf(path_or_reader: Union[str, Any]):
    """A ``transformers.PreTrainedTokenizerFast`` rebuilt from GGUF metadata with ``tokenizers``:
    ``gpt2`` (byte-level BPE) or ``llama`` (SentencePiece BPE with byte fallback)."""
    kind, vocab = gguf_vocab(path_or_reader)
    if kind == "gpt2":
        splits = PRE_TOKENIZER_SPLITS.get(vocab.pre, PRE_TOKENIZER_SPLITS["default"])
        return byte_level_bpe_tokenizer(vocab, splits)
    if kind == "llama":
        return sentencepiece_bpe_tokenizer(vocab)
    raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; expected 'gpt2' (byte-level BPE) or "
                     "'llama' (SentencePiece BPE)")
