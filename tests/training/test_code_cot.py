"""Code-first CoT recipe (training/recipes/code_cot.py): the generator's programs meet their hidden
tests in the sandbox, the extractor finds the code when CoT follows it, and in code-first samples
every code token precedes every CoT token."""

import pytest

from pallasite.models.tokenizer import train_bpe
from pallasite.training.recipes import code_cot as C
from pallasite.training.recipes.chat import CHAT_SPECIAL_TOKENS


@pytest.fixture(scope="module")
def specs():
    return C.split_specs(60, 12, seed=3)


def test_specs_are_compositions_of_two_to_four_operations(specs):
    train, test = specs
    sizes = {len(s.steps) + (s.reduction is not None) for s in train + test}
    assert sizes <= {2, 3, 4} and len(sizes) >= 2
    assert not {C.code(s) for s in train} & {C.code(s) for s in test}  # held-out programs
    s = train[0]
    assert all(s.run(xs) == want for xs, want in s.tests)


def test_reference_programs_pass_their_hidden_tests_and_wrong_ones_fail(specs):
    _, test = specs
    good = C.pass_at_1([C.response(s, "code_first") for s in test], test)
    assert good["pass@1"] == 1.0 and good["extracted"] == 1.0
    swapped = [
        C.response(s, "code_first") for s in test[1:] + test[:1]
    ]  # each answer to another spec
    assert C.pass_at_1(swapped, test)["pass@1"] < 0.5
    assert C.pass_at_1(["no code here"] * len(test), test) == {
        "pass@1": 0.0,
        "extracted": 0.0,
        "passed": 0,
        "total": len(test),
    }


def test_the_extractor_returns_the_code_even_when_cot_follows(specs):
    s = specs[0][1]
    for variant in C.VARIANTS:
        assert C.extract_code(C.response(s, variant)) == C.code(s)
    trailing = C.response(s, "code_first") + "\n```python\nprint('a second block')\n```"
    assert C.extract_code(trailing) == C.code(s)  # the first block, not a later one
    assert (
        C.extract_code("```python\ndef f(xs):\n    return xs") == "def f(xs):\n    return xs"
    )  # unclosed fence
    assert C.extract_code("def f(xs): return xs") is None


def test_in_code_first_samples_every_code_token_precedes_every_cot_token(specs):
    train, _ = specs
    tok = train_bpe(C.all_texts(train), 400, special_tokens=CHAT_SPECIAL_TOKENS)
    for s in train[:20]:
        roles = C.token_roles(tok, s, "code_first")
        code_at = [i for i, r in enumerate(roles) if r == "code"]
        cot_at = [i for i, r in enumerate(roles) if r == "cot"]
        assert code_at and cot_at and max(code_at) < min(cot_at)
        flipped = C.token_roles(tok, s, "cot_first")  # negative control: the classic order fails it
        assert max(i for i, r in enumerate(flipped) if r == "cot") < min(
            i for i, r in enumerate(flipped) if r == "code"
        )
    with pytest.raises(ValueError, match="variant 'cot_last'"):
        C.response(train[0], "cot_last")
