"""Constrained decoding as a generation feature: masks == the brute-force valid set (an independent
lark oracle), delimiter-straddling tokens by characters, masks inside the compiled loop with a
different grammar per row, opportunistic == always-mask (tokens and a chi-square test), clear
errors, the pallasite.generate / CLI sugar, and the speculative-decoding draft masks."""

import json

import jax
import numpy as np
import pytest

from pallasite.inference import engine as E
from pallasite.inference.config import GenerationConfig
from pallasite.inference.constrained import Constraint, ConstraintError, HostSession, session_of
from pallasite.inference.constrained.rows import test_bit as bit
from pallasite.inference.constrained.strategy import build_constrained, words_for
from pallasite.registry import UnknownKindError


def _fixtures():
    import importlib.util
    import pathlib
    import sys

    if "constrained_fixtures" not in sys.modules:  # a helper beside this file (tests is no package)
        spec = importlib.util.spec_from_file_location(
            "constrained_fixtures", pathlib.Path(__file__).with_name("constrained_fixtures.py")
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["constrained_fixtures"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["constrained_fixtures"]


F = _fixtures()
EOS, ID, MODEL_VOCAB, SPAN_LARK, TOKENS, VOCAB = (
    F.EOS,
    F.ID,
    F.MODEL_VOCAB,
    F.SPAN_LARK,
    F.TOKENS,
    F.VOCAB,
)
decode, oracle_valid, parses, tiny_model = F.decode, F.oracle_valid, F.parses, F.tiny_model

W = words_for(MODEL_VOCAB)


def _session(constraint):
    return HostSession([constraint.bind(VOCAB)], (EOS,))


def _mask_row(sess, ids):
    out = np.zeros((1, 64), np.int32)
    out[0, : len(ids)] = ids
    sess.sync(out, np.array([len(ids)]))
    return sess.masks(W, np.zeros(1, bool))[0]


@pytest.mark.parametrize("spans", [False, True])
def test_mask_is_exactly_the_brute_force_valid_set(spans):
    """Random walks: at every state the packed mask == {t : the lark oracle accepts text + t} ==
    {t : row.valid(t)} — straddling tokens, forced stretches and ids beyond the tokenizer included."""
    rng = np.random.default_rng(0)
    c = Constraint("lark", SPAN_LARK, start="<<" if spans else None, end=">>" if spans else None)
    states = 0
    for walk in range(6):
        sess = _session(c)
        ids = []
        for step in range(14):
            words = _mask_row(sess, ids)
            mask = np.array([bit(words, t) for t in range(MODEL_VOCAB)])
            want = np.array([oracle_valid(ids, t, spans=spans) for t in range(MODEL_VOCAB)])
            valid = np.array([sess.rows[0].valid(t) for t in range(MODEL_VOCAB)])
            diff = [
                (TOKENS[t] if t < len(TOKENS) else t, mask[t], want[t])
                for t in np.nonzero(mask != want)[0]
            ]
            assert not diff, f"after {decode(ids)!r}: (token, mask, oracle) {diff}"
            assert (valid == want).all(), f"row.valid disagrees after {decode(ids)!r}"
            states += 1
            choices = np.nonzero(want)[0]
            choices = choices[choices != EOS]
            if len(choices) == 0:
                break
            ids.append(int(rng.choice(choices)))
    assert states > 40


def test_tokens_straddling_the_delimiters_are_split_by_characters():
    c = Constraint("lark", SPAN_LARK, start="<<", end=">>")
    sess = _session(c)
    row = sess.rows[0]
    # "<<(" opens the span and its "(" is the span's first character; "<<)" would open a span that
    # cannot parse, so it is invalid in free text (and so is "<)" once the text ends in "<")
    assert row.valid(ID[b"<<("]) and not row.valid(ID[b"<<)"]) and row.valid(ID[b"<)"])
    ids = [ID[b"x"], ID[b"<"]]
    words = _mask_row(sess, ids)
    assert not bit(words, ID[b"<)"]) and bit(words, ID[b"<("]) and bit(words, ID[b"q"])
    ids += [ID[b"<("], ID[b"a"], ID[b")"]]
    _mask_row(sess, ids)
    assert row.span == b"<<(a)"  # S completed across two tokens, the remainder kept
    assert not row.valid(ID[b")"]) and row.valid(ID[b">>."]) and row.valid(ID[b" >>"])
    ids += [ID[b">>."]]
    _mask_row(sess, ids)
    assert row.span is None and row.closed_spans == [b"<<(a)>>"] and row.free_text.endswith(b".")
    # a token that closes a span and opens the next one: both parts are checked
    ids += [ID[b"<<"], ID[b"b"]]
    _mask_row(sess, ids)
    assert row.valid(ID[b">><<"])
    ids += [ID[b">><<"]]
    words = _mask_row(sess, ids)
    assert row.closed_spans[-1] == b"<<b>>" and row.span == b"<<"
    assert bit(words, ID[b"("]) and not bit(words, ID[b")"]) and not bit(words, EOS)


def test_kinds_compile_and_failures_name_the_grammar_and_the_engine_message():
    for kind, src in (
        ("lark", SPAN_LARK),
        ("ebnf", 'root ::= "<<" [ab]+ ">>"'),
        ("regex", r"<<[ab]+>>"),
        ("json_schema", {"type": "integer"}),
    ):
        HostSession([Constraint(kind, src, tokenizer=VOCAB)])
    with pytest.raises(
        ConstraintError,
        match=r"lark constraint 'answer.lark' does not compile \(llguidance\).*"
        r"unknown name",
    ):
        HostSession(
            [Constraint("lark", 'start: "<<" expr ">>"', name="answer.lark", tokenizer=VOCAB)]
        )
    with pytest.raises(ConstraintError, match=r"'ab\+'.*must begin with its start delimiter '<<'"):
        HostSession([Constraint("regex", r"[ab]+>>", name="ab+", start="<<", end=">>", tokenizer=VOCAB)])
    HostSession([Constraint("regex", r"<<[ab]+>>", start="<<", end=">>", tokenizer=VOCAB)])
    with pytest.raises(ConstraintError, match="json_schema constraint 'tool'.*must be JSON"):
        HostSession([Constraint("json_schema", "{not json", name="tool", tokenizer=VOCAB)])
    with pytest.raises(UnknownKindError, match="known: ebnf, json_schema, lark, regex"):
        Constraint("peg", "x")
    with pytest.raises(ConstraintError, match="no tokenizer.*bind"):
        build_constrained(GenerationConfig(constraint=Constraint("lark", SPAN_LARK)), 1)
    with pytest.raises(ConstraintError, match="2 entries for 3 prompts"):
        build_constrained(
            GenerationConfig(constraint=(None, Constraint("lark", SPAN_LARK, tokenizer=VOCAB))), 3
        )
    with pytest.raises(ValueError, match="needs a stop token"):
        build_constrained(
            GenerationConfig(
                constraint=Constraint("lark", SPAN_LARK, tokenizer=VOCAB), stop_tokens=()
            ),
            1,
        )
    with pytest.raises(ConstraintError, match="end needs a start"):
        Constraint("lark", SPAN_LARK, end=">>")
    gen = GenerationConfig(constraint={"kind": "regex", "source": "<<a>>"})
    assert gen.strategy == "constrained" and isinstance(gen.constraint, Constraint)


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


def _run(model, prompts, constraint, *, mode=None, temperature=0.0, seed=0, n=24, stream=None):
    cfg, g, st = model
    gen = GenerationConfig(
        max_new_tokens=n,
        stop_tokens=(EOS,),
        temperature=temperature,
        seed=seed,
        constraint=constraint,
        strategy_config=mode,
    )
    strategy, args = build_constrained(gen, len(prompts))
    s = E.run_decode(
        g,
        st,
        cfg,
        prompts,
        gen,
        strategy=strategy,
        args=args,
        key=jax.random.key(seed),
        stream=stream,
    )
    return E.results(s), (session_of(args) if hasattr(args, "session") else None)


MODES = (
    {"opportunistic": True},
    {"opportunistic": False, "overlap": False},
    {"opportunistic": False, "overlap": True},
)


def test_per_row_grammars_in_one_compiled_loop_and_mode_equivalence(model):
    """Rows with a whole-output grammar, CRANE spans, a regex and no constraint in one batch; greedy
    and temperature sampling give the same tokens in the three masking modes (opportunistic,
    always, always + overlap); the unconstrained row equals unconstrained decoding."""
    prompts = [[ID[b"x"], ID[b"a"]], [ID[b"q"]], [ID[b"y"], ID[b"b"]], [ID[b"1"]]]
    cons = (
        Constraint("lark", SPAN_LARK, tokenizer=VOCAB),
        Constraint("lark", SPAN_LARK, start="<<", end=">>", tokenizer=VOCAB),
        Constraint("regex", r"(ab|1)+\.", tokenizer=VOCAB),
        None,
    )
    free, _ = _run(model, prompts, None)
    for temperature, modes in ((0.0, MODES[::2]), (1.0, MODES)):
        outs = [
            _run(model, prompts, cons, mode=m, temperature=temperature, seed=3)[0] for m in modes
        ]
        assert all(o == outs[0] for o in outs)
        out = outs[0]
        if temperature == 0.0:
            assert out[3] == free[3]
        for r in range(3):
            text = decode(out[r])
            terminated = out[r] and out[r][-1] == EOS
            if r == 0 and terminated:
                assert parses(text)
            if r == 1:
                assert oracle_valid(out[r][:-1], out[r][-1], spans=True) or not out[r]
            if r == 2 and terminated:
                import re

                assert re.fullmatch(r"(ab|1)+\.", text)


def test_streaming_equals_the_while_loop(model):
    prompts = [[ID[b"q"]], [ID[b"x"]]]
    c = Constraint("lark", SPAN_LARK, start="<<", end=">>", tokenizer=VOCAB)
    seen = [[], []]
    loop, _ = _run(model, prompts, c, temperature=1.0, seed=5)
    streamed, _ = _run(
        model,
        prompts,
        c,
        temperature=1.0,
        seed=5,
        n=24,
        stream=lambda new: [seen[i].extend(t) for i, t in enumerate(new)],
    )
    assert loop == streamed == seen


def _chi2(counts, probs):
    from scipy.stats import chisquare

    probs = np.asarray(probs, np.float64)
    keep = probs > 0
    assert counts[~keep].sum() == 0, "a masked token was drawn"
    expected = probs[keep] / probs[keep].sum() * counts.sum()
    return chisquare(counts[keep], expected).pvalue


def test_sampling_distribution_is_the_masked_softmax(model):
    """First token of 3000 rows at temperature 1 with a whole-output grammar, opportunistic masking:
    chi-square against softmax(masked logits) passes; against the unmasked softmax it fails (negative
    control). (Always-masking draws the same tokens: the mode-equivalence test.)"""
    cfg, g, st = model
    from pallasite.models.transformer import forward

    prompt = [ID[b"x"], ID[b"<"]]
    logits = np.asarray(forward(g, st, np.array([prompt], np.int32))[0])[0, -1].astype(np.float64)
    c = Constraint("lark", SPAN_LARK, tokenizer=VOCAB)
    valid = np.array([oracle_valid([], t, spans=False) for t in range(MODEL_VOCAB)])
    masked = np.where(valid, logits, -np.inf)
    p_masked = np.exp(masked - masked.max())
    p_masked /= p_masked.sum()
    p_free = np.exp(logits - logits.max())
    p_free /= p_free.sum()
    n_rows = 3000
    out, sess = _run(model, [prompt] * n_rows, c, mode=MODES[0], temperature=1.0, seed=11, n=1)
    counts = np.bincount(np.array([r[0] for r in out]), minlength=MODEL_VOCAB).astype(float)
    assert _chi2(counts, p_masked) > 1e-3
    assert (
        sess.stats.invalid_proposals > 100
    )  # most proposals were invalid: the redraw was exercised
    with pytest.raises(AssertionError):
        assert _chi2(counts, p_free) > 1e-3


def test_pallasite_generate_sugar_binds_the_model_tokenizer():
    import pallasite
    from pallasite.inference.constrained.sugar import (
        cli_options,
        grammar_kind,
        make_generation_config,
    )

    cfg, g, st = tiny_model(seed=2)
    m = pallasite.Model(cfg, st, tokenizer=VOCAB, graphdef=g)
    texts = pallasite.generate(
        m, ["x", "q"], grammar=SPAN_LARK, max_new_tokens=40, temperature=1.0, seed=1
    )
    assert all(parses(t) for t in texts), texts
    crane = pallasite.generate(
        m, ["x"], constraint=Constraint("lark", SPAN_LARK, start="<<", end=">>"), max_new_tokens=30
    )
    assert isinstance(crane[0], str)
    assert grammar_kind('root ::= "a"') == "ebnf" and grammar_kind(SPAN_LARK) == "lark"
    with pytest.raises(ConstraintError, match="pass one of"):
        make_generation_config(None, {"grammar": SPAN_LARK, "regex": "a"}, VOCAB)

    class Args:
        grammar, json_schema, regex = None, None, None

    a = Args()
    assert cli_options(a) == {}
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        a.grammar = os.path.join(d, "g.gbnf")
        with open(a.grammar, "w") as f:
            f.write('root ::= "<<" "a" ">>"')
        c = cli_options(a)["constraint"]
        assert c.kind == "ebnf" and c.name == "g.gbnf"
        a.grammar, a.json_schema = None, os.path.join(d, "s.json")
        with open(a.json_schema, "w") as f:
            json.dump({"type": "integer"}, f)
        assert cli_options(a)["constraint"].kind == "json_schema"
        a.regex = "[ab]+"
        with pytest.raises(ConstraintError, match="pass one of --grammar, --json-schema, --regex"):
            cli_options(a)
        a.json_schema = None
        assert cli_options(a)["constraint"].kind == "regex"


def test_json_schema_outputs_validate_with_a_real_bpe_tokenizer():
    """A byte-level BPE (the tokenizer path llguidance.hf wraps) and a random model: every output
    that ends with eos is JSON valid under the schema."""
    from flax import nnx

    from pallasite.models.config import ModelConfig
    from pallasite.models.tokenizer import train_bpe
    from pallasite.models.transformer import init_model

    corpus = [
        json.dumps({"city": c, "n": i})
        for i, c in enumerate(["Paris", "Lima", "Oslo", "Rome"] * 50)
    ]
    tok = train_bpe(corpus, 300)
    cfg = ModelConfig(
        vocab_size=len(tok),
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        eos_token_id=(tok.eos_token_id,),
    )
    g, st = nnx.split(init_model(cfg, seed=0))
    schema = {
        "type": "object",
        "properties": {"city": {"enum": ["Paris", "Lima"]}, "n": {"type": "integer"}},
        "required": ["city", "n"],
        "additionalProperties": False,
    }
    c = Constraint("json_schema", schema, tokenizer=tok)
    prompts = [tok.encode("{", add_special_tokens=False)] * 6
    gen = GenerationConfig(max_new_tokens=48, temperature=0.7, seed=0, constraint=c)
    out = E.generate_ids(g, st, cfg, prompts, gen)
    done = [r for r in out if r and r[-1] == tok.eos_token_id]
    assert len(done) >= 3
    for r in done:
        obj = json.loads(tok.decode(r, skip_special_tokens=True))
        assert (
            set(obj) == {"city", "n"}
            and obj["city"] in ("Paris", "Lima")
            and isinstance(obj["n"], int)
        )


def test_draft_masks_are_the_masks_after_each_draft_prefix():
    c = Constraint("lark", SPAN_LARK, start="<<", end=">>").bind(VOCAB)
    sess = HostSession([c, c], (EOS,))
    out = np.zeros((2, 16), np.int32)
    draft = np.array([[ID[b"<<"], ID[b"a"], ID[b"+"]], [ID[b"<<"], ID[b")"], ID[b"a"]]])
    got = sess.draft_masks(out, np.zeros(2, np.int32), np.zeros(2, bool), draft, W)
    assert got.shape == (2, 4, W)
    for k in range(4):
        ref = HostSession([c], (EOS,))
        want = _mask_row(ref, list(draft[0, :k]))
        assert (got[0, k] == want).all()
    assert (got[1, 2:] == 0).all()  # ")" after "<<" is invalid: nothing after it
    assert sess.rows[0].consumed == 0  # the session itself did not move
    for j in range(4):  # what a drafter may draft at step j
        assert (sess.prefix_mask(out, np.zeros(2, np.int32), np.zeros(2, bool), draft, j, W) == got[:, j]).all()


def test_pallasite_generate_cli_flags_end_to_end(tmp_path, capsys):
    """``pallasite generate --json-schema FILE`` on a saved model: the printed completion is JSON
    valid under the schema (or, cut by --max-new-tokens, a prefix of it); a grammar that does not
    compile is one error line naming the file and quoting llguidance (exit 1, no traceback)."""
    from flax import nnx

    import pallasite
    from pallasite import cli
    from pallasite.models.config import ModelConfig
    from pallasite.models.tokenizer import train_bpe
    from pallasite.models.transformer import init_model

    corpus = [json.dumps({"n": i}) for i in range(200)]
    tok = train_bpe(corpus, 280)
    cfg = ModelConfig(
        vocab_size=len(tok),
        d_model=32,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=64,
        eos_token_id=(tok.eos_token_id,),
    )
    g, st = nnx.split(init_model(cfg, seed=0))
    pallasite.Model(cfg, st, tok, g).save(str(tmp_path / "hf"), format="hf")
    schema = tmp_path / "n.json"
    schema.write_text(
        json.dumps(
            {
                "type": "object",
                "properties": {"n": {"type": "integer"}},
                "required": ["n"],
                "additionalProperties": False,
            }
        )
    )
    cli.main(
        [
            "generate",
            "--model",
            str(tmp_path / "hf"),
            "--prompt",
            "x:",
            "--json-schema",
            str(schema),
            "--max-new-tokens",
            "24",
            "--temperature",
            "0.7",
        ]
    )
    captured = capsys.readouterr()
    assert captured.out.startswith("x:")
    text = captured.out[len("x:") :].strip()
    try:
        assert set(json.loads(text)) == {"n"} and isinstance(json.loads(text)["n"], int), text
    except json.JSONDecodeError:  # only an output cut by --max-new-tokens may be unfinished
        import re

        assert re.search(r"\[generate\] 24 tokens", captured.err), (text, captured.err)
        assert text.startswith("{"), text
    bad = tmp_path / "bad.lark"
    bad.write_text('start: "<<" expr ">>"\n')
    with pytest.raises(SystemExit) as e:
        cli.main(
            ["generate", "--model", str(tmp_path / "hf"), "--prompt", "x", "--grammar", str(bad)]
        )
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err, err
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("[")]
    assert len(lines) == 1 and "'bad.lark' does not compile (llguidance)" in lines[0], err
    assert "unknown name" in lines[0], err
