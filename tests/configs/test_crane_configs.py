"""configs/crane: the GSM kinds' defaults (problems, steps, model width) and the user's overrides."""

import pytest

from pallasite.configs.crane import folio, gsm
from pallasite.errors import ConfigError


def test_gsm_kind_defaults_and_overrides(tmp_path, monkeypatch):
    monkeypatch.setenv("PALLASITE_CRANE_DATA", str(tmp_path))
    data = tmp_path / "given.jsonl"
    data.write_text('{"text": "x"}\n')
    c = gsm.get_config(f"kind=relations_many_names,data={data}")
    assert (c.train.steps, c.model.d_model, c.data.seq_len) == (1800, 128, 512)
    # the traces it writes when no data is given are named by the kind's own problem count
    steps = gsm.get_config("kind=steps,n=8")
    assert steps.data.paths == (str(tmp_path / "gsm_train_8_steps.jsonl"),)
    assert (steps.train.steps, steps.model.d_model, steps.data.seq_len) == (300, 96, 256)
    many = gsm.get_config("kind=relations_many_names,n=8,steps=5")
    assert many.data.paths == (str(tmp_path / "gsm_train_8_relations_many_names.jsonl"),)
    assert many.train.steps == 5
    # without n= the kind's own count: the traces written are 40000 problems' (writing stubbed)
    from pallasite.eval.tasks import traces

    written = []
    monkeypatch.setattr(traces, "write", lambda task, path, n, kind: written.append((task, n, kind)))
    gsm.get_config("kind=relations_many_names")
    gsm.get_config("kind=relations_restated")
    assert written == [("gsm", 40000, "relations_many_names"), ("gsm", 4000, "relations_restated")]
    assert folio.get_config("n=8").data.paths == (str(tmp_path / "folio_train_8.jsonl"),)
    with pytest.raises(ConfigError, match="kind='nope'"):
        gsm.get_config("kind=nope")
