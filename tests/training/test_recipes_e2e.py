"""Every recipe config runs through ``pallasite.training.loop.train`` (tiny sizes): SFT -> DPO
(off-policy == SimpleMix r=0, bit for bit, through the whole data kind), facts -> CE / OVERTONE
editing (FT and LoRA, adapters saved), code-first SFT with sandboxed pass@1."""

import json
import os
import pathlib

import pytest

from pallasite.training.config import load_config
from pallasite.training.loop import train

CONFIGS = pathlib.Path(__file__).resolve().parents[2] / "configs" / "recipes"
TINY = [
    "--config.train.eval_every=0",
    "--config.train.checkpoint_every=0",
    "--config.train.progress=false",
    "--config.data.eval_batches=1",
    "--config.train.log_every=1",
]


def _run(name, arg, workdir, overrides=()):
    config = load_config(str(CONFIGS / f"{name}.py"), arg, TINY + list(overrides))
    return train(config, str(workdir))


def _losses(workdir):
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl"))]
    return [r["loss"] for r in rows if r.get("kind", "train") == "train" and "loss" in r]


@pytest.mark.slow
def test_sft_then_dpo_and_simplemix_r0_equals_offpolicy(tmp_path, monkeypatch):
    from pallasite import cli

    # the CLI, from a directory without the repository: configs/... resolves to the package's copy
    monkeypatch.chdir(tmp_path)
    cli.main(
        ["train", "--config", "configs/recipes/sft.py:cpu,steps=3", "--workdir", "sft"]
        + TINY
        + [
            "--config.data.kind_config.n_examples=100",
            "--config.data.batch_size=8",
            "--config.data.seq_len=64",
            "--config.tokenizer.vocab_size=300",
            "--config.data.kind_config.eval_prompts=4",
        ]
    )
    sft = json.load(open(tmp_path / "sft" / "result.json"))
    assert {"reward/objective", "reward/open_ended"} <= set(sft) and os.path.exists(
        tmp_path / "sft" / "hf"
    )
    common = [
        f"--config.data.kind_config.init_from={tmp_path / 'sft'}",
        "--config.data.kind_config.n_prompts=8",
        "--config.data.kind_config.n_samples=2",
        "--config.data.kind_config.eval_prompts=4",
        "--config.data.batch_size=4",
        "--config.data.seq_len=128",  # a pair (two prompt copies + responses) must fit one row
        "--config.data.kind_config.max_new_tokens=6",
    ]
    off = _run("dpo", "cpu,steps=3,mix=offpolicy", tmp_path / "off", common)
    mix0 = _run(
        "dpo",
        "cpu,steps=3,mix=simplemix",
        tmp_path / "mix0",
        common + ["--config.data.kind_config.ratio=0.0"],
    )
    assert (
        _losses(tmp_path / "off") == _losses(tmp_path / "mix0")
        and len(_losses(tmp_path / "off")) == 3
    )
    assert off["pairs/onpolicy_fraction"] == 0.0 and "reward/objective" in mix0


@pytest.mark.slow
def test_facts_then_ce_and_overtone_editing(tmp_path):
    facts = _run(
        "overtone", "stage=facts,steps=3", tmp_path / "facts", ["--config.data.batch_size=16"]
    )
    assert "facts/recall" in facts
    init = [
        f"--config.data.kind_config.init_from={tmp_path / 'facts'}",
        "--config.data.kind_config.n_locality=4",
    ]
    for method, mode in (("ce", "ft"), ("overtone", "lora")):
        res = _run(
            "overtone",
            f"stage=edit,method={method},mode={mode},steps=2",
            tmp_path / f"{method}_{mode}",
            init,
        )
        assert {
            "reliability",
            "generality",
            "locality",
            "portability",
            "before/reliability",
        } <= set(res)
        assert (res.get("adapter_dir") is not None) == (mode == "lora")


@pytest.mark.slow
def test_code_first_sft_reports_sandboxed_pass_at_1(tmp_path):
    res = _run(
        "code_cot",
        "variant=code_first,steps=2,n_train=40",
        tmp_path / "code",
        [
            "--config.data.kind_config.n_test=4",
            "--config.data.kind_config.max_new_tokens=16",
            "--config.data.batch_size=4",
            "--config.tokenizer.vocab_size=300",
            "--config.data.seq_len=256",  # the 300-token BPE spells the longest example in 211 tokens
        ],
    )
    assert res["code/total"] == 4 and 0.0 <= res["code/pass@1"] <= 1.0


def test_bad_recipe_inputs_are_named(tmp_path, capsys):
    from pallasite import cli
    from pallasite.errors import ConfigError
    from pallasite.training.data import DATA_KIND

    with pytest.raises(ConfigError, match="set data.kind_config.init_from"):
        _run("dpo", "cpu", tmp_path / "nodpo")
    # through the CLI, by module name: one line naming the field, exit status 1, no traceback
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["train", "--config", "recipes.dpo:cpu", "--workdir", str(tmp_path / "cli")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "set data.kind_config.init_from" in err
    assert "Traceback" not in err
    with pytest.raises(ValueError, match="unknown key 'mixx'"):
        DATA_KIND.make_config("preference", {"mixx": "onpolicy"}, field="config.data.kind_config")
    with pytest.raises(
        ValueError, match="config.data.kind='sftt' is not a registered data_kind kind"
    ):
        _run("sft", "cpu", tmp_path / "badkind", ["--config.data.kind=sftt"])
