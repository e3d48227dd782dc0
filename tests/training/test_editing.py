"""The synthetic-facts editing benchmark (training/recipes/editing.py): HTO against hand-computed
values, edits that move people across countries, masks that cover exactly the new object."""

import numpy as np

from pallasite.models.tokenizer import train_bpe
from pallasite.training.recipes import editing as E


def test_hto_against_hand_computed_crossing_steps():
    # 4 recorded steps (0 = before editing), 2 facts; fact 0 has 3 target tokens, fact 1 has 2
    S, R, T = 4, 2, 3
    p = np.zeros((S, R, T))
    p[1:, 0, 0] = 0.95  # fact 0, token 0 crosses 0.9 at step 1
    p[3:, 0, 1] = 0.91  # token 1 at step 3
    p[:, 0, 2] = 0.5  # token 2 never crosses: counts as S = 4
    p[2:, 1, 0] = 0.99  # fact 1: both tokens at step 2
    p[2:, 1, 1] = 0.99
    p[:, 1, 2] = 0.99  # outside the mask: ignored
    mask = np.array([[1, 1, 1], [1, 1, 0]])
    got = E.hto(p, mask)
    want_var = (np.var([1, 3, 4]) + np.var([2, 2])) / 2
    want_step = (np.mean([1, 3, 4]) + 2.0) / 2
    np.testing.assert_allclose(got["hto_variance"], want_var, rtol=0, atol=1e-12)
    np.testing.assert_allclose(got["hto_mean_step"], want_step, rtol=0, atol=1e-12)
    assert want_var > 0  # the heterogeneous fact makes the figure non-trivial


def test_edits_move_each_person_to_another_country_and_are_seeded():
    world = E.make_world()
    edits = E.choose_edits(world, 24, seed=3)
    assert len({e.subject for e in edits}) == 24
    for e in edits:
        i = world.subjects.index(e.subject)
        assert e.old_city == world.born_in[i]
        assert world.country(e.new_city) == e.new_country != world.country(e.old_city)
    assert E.choose_edits(world, 24, seed=3) == edits != E.choose_edits(world, 24, seed=4)


def test_parse_country_reads_the_composed_hop():
    assert E.parse_country(" Vel Arno, a city in Ombria.") == "Ombria"
    assert E.parse_country(" Vel Arno.") is None


def test_edit_rows_learn_exactly_the_new_city_tokens():
    world = E.make_world()
    tok = train_bpe(E.sentences(world), 300)
    edits = E.choose_edits(world, 4, seed=0)
    rows = E.edit_rows(tok, edits, 32)
    for r, e in enumerate(edits):
        learned = rows["targets"][r][rows["loss_mask"][r] > 0]
        assert tok.decode(learned.tolist()) == " " + e.new_city
        inputs = rows["tokens"][r][rows["segment_ids"][r] > 0].tolist()
        assert tok.decode(inputs + learned[-1:].tolist()) == f"{E.edit_prompt(e.subject)} {e.new_city}"
