"""Data pipeline: packing correctness, determinism, exact iterator resume, sources, tokenizer."""
import json

import numpy as np
import pytest

from pallasite.models.tokenizer import load_tokenizer, train_bpe
from pallasite.training import data as D
from pallasite.training.config import train_defaults


def _docs(lengths, start=10):
    # document i is the tokens start+1000*i, start+1000*i+1, ... then eos (=1)
    return [np.asarray(list(range(start + 1000 * i, start + 1000 * i + n)) + [1], np.int32)
            for i, n in enumerate(lengths)]


def test_packing_segments_positions_and_mask():
    docs = _docs([5, 3, 9, 2, 7])
    T = 6
    rows = D.pack_stream(docs, np.arange(len(docs)), T)
    stream = np.concatenate(docs)
    R = rows["tokens"].shape[0]
    assert R == (len(stream) - 1) // T
    # every stream position (but the first) is a target exactly once, in order
    np.testing.assert_array_equal(rows["targets"].reshape(-1), stream[1:R * T + 1])
    np.testing.assert_array_equal(rows["tokens"].reshape(-1), stream[:R * T])
    doc_of = lambda t: -1 if t == 1 else (t - 10) // 1000  # noqa: E731
    for r in range(R):
        tok, seg, pos, m, tgt = (rows[k][r] for k in ("tokens", "segment_ids", "positions", "loss_mask", "targets"))
        assert seg[0] == 1 and pos[0] == 0
        for t in range(1, T):
            same_doc = seg[t] == seg[t - 1]
            # a new segment starts exactly after an eos token
            assert same_doc == (tok[t - 1] != 1), (r, t, tok, seg)
            assert pos[t] == (pos[t - 1] + 1 if same_doc else 0)
        for t in range(T):
            # the target is masked iff it is the first token of the next document
            assert m[t] == (0.0 if tok[t] == 1 else 1.0)
            if m[t] and tgt[t] != 1:  # an unmasked target is the next token of the same document
                assert doc_of(tgt[t]) == doc_of(tok[t]) and tgt[t] == tok[t] + 1


def test_packed_rows_do_not_attend_across_documents():
    """The model's loss on a packed row equals the losses of its documents run alone."""
    import jax
    import jax.numpy as jnp

    from pallasite.models.config import ModelConfig
    from pallasite.models.transformer import init_model

    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=64)
    model = init_model(cfg, 0)
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(3, 64, n), 1).astype(np.int32) for n in (6, 4, 9)]
    rows = D.pack_stream(docs, np.arange(3), seq_len=21)  # all 22 tokens in one row
    assert rows["tokens"].shape == (1, 21) and rows["segment_ids"][0, -1] == 3

    def nll(logits, targets):
        lp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(lp, targets[..., None], -1)[..., 0]

    from flax import nnx

    graphdef, state = nnx.split(model)
    def nll_of(tokens, positions, segments, targets):
        logits = jax.jit(lambda t, p, s: nnx.merge(graphdef, state)(t, p, segment_ids_BT=s)[0])(
            jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments))
        return np.asarray(nll(logits, jnp.asarray(targets)))

    packed = nll_of(rows["tokens"], rows["positions"], rows["segment_ids"], rows["targets"])[0]
    # each document alone, right-padded into one batch (padding cannot affect earlier positions)
    L = max(len(d) for d in docs) - 1
    alone_tok = np.zeros((3, L), np.int32)
    alone_tgt = np.zeros((3, L), np.int32)
    for i, d in enumerate(docs):
        alone_tok[i, : len(d) - 1], alone_tgt[i, : len(d) - 1] = d[:-1], d[1:]
    pos = np.broadcast_to(np.arange(L, dtype=np.int32), (3, L))
    alone_all = nll_of(alone_tok, pos, np.ones((3, L), np.int32), alone_tgt)
    start = 0
    for i, d in enumerate(docs):
        m = rows["loss_mask"][0, start:start + len(d) - 1]
        assert m.all()
        np.testing.assert_allclose(packed[start:start + len(d) - 1], alone_all[i, : len(d) - 1], atol=2e-5)
        start += len(d)
    # negative control: with one segment (no packing mask) later documents see the earlier ones
    leak = nll_of(rows["tokens"], rows["positions"], np.ones_like(rows["segment_ids"]), rows["targets"])[0]
    assert np.abs(leak[len(docs[0]):] - packed[len(docs[0]):]).max() > 1e-3


def _dataset(seed=0, lengths=None):
    rng = np.random.default_rng(123)
    lengths = lengths or rng.integers(5, 60, 40).tolist()
    return D.PackedDataset(_docs(lengths), seq_len=16, batch_size=3, seed=seed)


def test_deterministic_and_seeded():
    a, b, c = _dataset(0), _dataset(0), _dataset(1)
    ia, ib, ic = a.iterator(), b.iterator(), c.iterator()
    for _ in range(5):
        x, y, z = next(ia), next(ib), next(ic)
        for k in x:
            np.testing.assert_array_equal(x[k], y[k])
    assert not np.array_equal(x["tokens"], z["tokens"])


def test_iterator_resume_is_exact_across_epochs():
    ds = _dataset(0)
    n = ds.batches_per_epoch
    it = ds.iterator()
    for _ in range(n - 2):
        next(it)
    state = json.loads(json.dumps(it.state()))  # JSON round trip, as in the checkpoint
    expected = [next(it) for _ in range(5)]  # crosses into epoch 1
    assert it.state()["epoch"] == 1
    resumed = _dataset(0).iterator(state)  # a fresh dataset object, as after a restart
    for e in expected:
        got = next(resumed)
        for k in e:
            np.testing.assert_array_equal(got[k], e[k])
    # epochs are reshuffled, not repeated
    assert not np.array_equal(ds.batch(0, 0)["tokens"], ds.batch(1, 0)["tokens"])


def test_resume_onto_different_data_fails():
    state = _dataset(0).iterator().state()
    with pytest.raises(ValueError, match="different data"):
        _dataset(0, lengths=[30] * 40).iterator(state)
    with pytest.raises(ValueError, match="different data"):
        _dataset(1).iterator(state)


def test_stdlib_split_is_fixed_by_file():
    cfg = train_defaults().data
    cfg.max_train_bytes, cfg.max_eval_bytes = 200_000, 50_000
    train, ev = D.load_documents(cfg)
    train2, ev2 = D.load_documents(cfg)
    assert [d.doc_id for d in train] == [d.doc_id for d in train2]
    assert not {d.doc_id for d in train} & {d.doc_id for d in ev}
    assert all(d.doc_id.endswith(".py") for d in train + ev)
    assert sum(len(d.text) for d in train) >= 200_000 * 0.5
    all_ids = [d.doc_id for d in D.stdlib_documents()]
    assert all_ids == sorted(all_ids) and not any("/test/" in i or i.startswith("test/") for i in all_ids)
    assert len(D.stdlib_texts("eval")) < len(D.stdlib_texts("train"))


def test_jsonl_and_text_sources(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text("\n".join(json.dumps({"body": f"document number {i} " * 5}) for i in range(40)))
    cfg = train_defaults().data
    cfg.source, cfg.paths, cfg.field, cfg.heldout_percent = "jsonl", (str(p),), "body", 20
    train, ev = D.load_documents(cfg)
    assert len(train) + len(ev) == 40 and ev and train
    assert train[0].text.startswith("document number")
    cfg.field = "text"
    with pytest.raises(D.DataError, match=r"d\.jsonl:1: jsonl record has no field 'text'"):
        D.load_documents(cfg)
    (tmp_path / "a.txt").write_text("hello " * 50)
    (tmp_path / "b.txt").write_text("world " * 50)
    cfg.source, cfg.paths, cfg.eval_paths = "text", (str(tmp_path / "a.txt"),), (str(tmp_path / "b.txt"),)
    train, ev = D.load_documents(cfg)
    assert [d.text[:5] for d in train] == ["hello"] and [d.text[:5] for d in ev] == ["world"]
    cfg.paths = (str(tmp_path / "missing*.txt"),)
    with pytest.raises(FileNotFoundError, match="missing"):
        D.load_documents(cfg)


def test_unigram_entropy():
    b = {"targets": np.array([[1, 1, 2, 2]]), "loss_mask": np.array([[1, 1, 1, 1.0]])}
    assert abs(D.unigram_entropy([b]) - np.log(2)) < 1e-12
    b["loss_mask"] = np.array([[1, 1, 0, 0.0]])  # masked targets do not count
    assert D.unigram_entropy([b]) == 0.0


def test_bpe_train_save_load_roundtrip(tmp_path):
    texts = D.stdlib_texts("train", max_bytes=40_000)
    tok = train_bpe(texts, 320, save_to=str(tmp_path / "tok"))
    assert len(tok) == 320
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    again = load_tokenizer(str(tmp_path / "tok"))
    s = "def f(x):\n    return 'héllo ✓ 😀'\n"
    ids = again.encode(s, add_special_tokens=False)
    assert ids == tok.encode(s, add_special_tokens=False) and again.decode(ids) == s
    assert len(ids) < len(s.encode())  # merges were learned
    # deterministic: the same corpus gives the same merges
    assert train_bpe(texts, 320).get_vocab() == tok.get_vocab()
    with pytest.raises(ValueError, match="vocab_size"):
        train_bpe(texts, 200)


def test_missing_tokenizer_names_folder_and_files(tmp_path):
    with pytest.raises(FileNotFoundError) as e:
        load_tokenizer(str(tmp_path))
    assert str(tmp_path) in str(e.value) and "tokenizer.json" in str(e.value)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"))
