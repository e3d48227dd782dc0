"""CRANE's checks (the paper brief, "CPU verification"), on random-weight models over a hand
vocabulary with ``<<``, ``>>``, ``<<(``, `` >>``, ``>>.``:

1. text outside spans is token-identical to unconstrained greedy decoding from the same prefix;
2. every terminated span parses, where unconstrained sampling parses < 20% of its spans;
3. inside spans each chosen token is the argmax over the brute-force valid set;
5. variables the problem does not declare never appear in a span.
(4, opportunistic == always-mask, is in test_constrained.py.)"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallasite.eval.tasks import gsm_symbolic
from pallasite.inference import engine as E
from pallasite.inference.config import GenerationConfig
from pallasite.inference.constrained import Constraint, session_of
from pallasite.inference.constrained.strategy import build_constrained
from pallasite.models.transformer import forward


def _fixtures():
    import importlib.util
    import pathlib
    import sys

    if "constrained_fixtures" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "constrained_fixtures", pathlib.Path(__file__).with_name("constrained_fixtures.py")
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["constrained_fixtures"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["constrained_fixtures"]


F = _fixtures()
CRANE = Constraint("lark", F.SPAN_LARK, start="<<", end=">>", tokenizer=F.VOCAB)
PROMPTS = [[F.ID[b"x"]], [F.ID[b"q"], F.ID[b"a"]], [F.ID[b"y"]], [F.ID[b"1"], F.ID[b"."]]]


def _generate(model, prompts, constraint, *, temperature=0.0, seed=0, n=40):
    cfg, g, st = model
    gen = GenerationConfig(
        max_new_tokens=n,
        stop_tokens=(F.EOS,),
        temperature=temperature,
        seed=seed,
        constraint=constraint,
    )
    strategy, args = build_constrained(gen, len(prompts))
    s = E.run_decode(
        g, st, cfg, prompts, gen, strategy=strategy, args=args, key=jax.random.key(seed)
    )
    return E.results(s), (session_of(args) if hasattr(args, "session") else None)


def _in_span(text: str) -> bool:
    return F._open_span(text)


def _logits_along(model, prompt, out):
    cfg, g, st = model
    seq = np.array([prompt + out], np.int32)
    return np.asarray(forward(g, st, jnp.asarray(seq))[0])[
        0, len(prompt) - 1 : len(prompt) - 1 + len(out)
    ]


@pytest.fixture(scope="module", params=[0, 7])
def model(request):
    return F.tiny_model(
        seed=request.param, scale=30.0
    )  # large weights: peaked, varied greedy choices


def test_free_text_is_unconstrained_greedy_and_span_tokens_are_the_valid_argmax(model):
    out, sess = _generate(model, PROMPTS, CRANE)
    free_steps = span_steps = deviations = 0
    for r, (prompt, toks) in enumerate(zip(PROMPTS, out)):
        logits = _logits_along(model, prompt, toks)
        for t, chosen in enumerate(toks):
            prefix = toks[:t]
            valid = np.array([F.oracle_valid(prefix, v, spans=True) for v in range(F.MODEL_VOCAB)])
            assert valid[chosen], f"row {r} step {t}: chose an invalid token"
            best_valid = logits[t][valid].max()
            assert logits[t][chosen] >= best_valid - 1e-5, (
                f"row {r} step {t}: not the argmax of the valid set"
            )
            if _in_span(F.decode(prefix)):
                span_steps += 1
            else:
                free_steps += 1
                free_argmax = int(np.argmax(logits[t]))
                if logits[t][chosen] < logits[t][free_argmax] - 1e-5:
                    # outside spans only a token whose S-straddle cannot parse is ever replaced
                    assert not valid[free_argmax]
                    deviations += 1
    assert free_steps > 10 and span_steps > 10
    assert (
        sess.stats.invalid_proposals >= 1
    )  # some proposals were masked (the check is not vacuous)
    # and literally: the first free stretch equals plain greedy decoding from the same prompt
    plain, _ = _generate(model, PROMPTS, None)
    for toks, ref in zip(out, plain):
        # up to the token that opens the first span, or the first plain-greedy token whose
        # S-straddle cannot parse (the one place CRANE must differ)
        k = next(
            (
                t
                for t in range(min(len(toks), len(ref)))
                if _in_span(F.decode(toks[: t + 1]))
                or not F.oracle_valid(ref[:t], ref[t], spans=True)
            ),
            min(len(toks), len(ref)),
        )
        assert toks[:k] == ref[:k]


def test_every_terminated_span_parses_where_unconstrained_rarely_does():
    model = F.tiny_model(seed=3, scale=1.0)  # near-uniform logits: random text

    def spans(texts):
        closed = []
        for t in texts:
            i = 0
            while (k := t.find("<<", i)) >= 0 and (e := t.find(">>", k + 2)) >= 0:
                closed.append(t[k : e + 2])
                i = e + 2
        return closed

    prompts = [[F.ID[b"x"]]] * 48
    free, _ = _generate(model, prompts, None, temperature=1.0, seed=1, n=48)
    crane, sess = _generate(model, prompts, CRANE, temperature=1.0, seed=1, n=48)
    free_spans = spans([F.decode(o) for o in free])
    crane_spans = spans([F.decode(o) for o in crane])
    assert len(free_spans) >= 20 and np.mean([F.parses(s) for s in free_spans]) < 0.2
    assert len(crane_spans) >= 20 and all(F.parses(s) for s in crane_spans), crane_spans
    assert not sess.errors()


def test_disallowed_variables_never_appear_in_a_span():
    """The GSM answer grammar with the problem's variables ("a", "ab"): no "b", "x", "y", "q" in any
    span, while the unrestricted grammar's spans do contain them (non-vacuous)."""
    model = F.tiny_model(seed=4, scale=1.0)
    prompts = [[F.ID[b"x"]]] * 32

    def span_vars(out):
        found = set()
        for o in out:
            text = F.decode(o)
            for s in re.findall(r"<<(.*?)(?:>>|$)", text, flags=re.S):
                found |= gsm_symbolic.variables_in(s)
        return found

    restricted = Constraint(
        "lark", gsm_symbolic.answer_grammar(["a", "ab"]), start="<<", end=">>", tokenizer=F.VOCAB
    )
    free_grammar = Constraint(
        "lark", gsm_symbolic.answer_grammar(None), start="<<", end=">>", tokenizer=F.VOCAB
    )
    out, _ = _generate(model, prompts, restricted, temperature=1.0, seed=2, n=48)
    assert span_vars(out) <= {"a", "ab"}
    out_free, _ = _generate(model, prompts, free_grammar, temperature=1.0, seed=2, n=48)
    assert span_vars(out_free) - {"a", "ab"}
