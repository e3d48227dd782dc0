"""The CLI meets careless input: every user error is one line naming the input and exit status 1
(no traceback), ``--debug`` / ``PALLASITE_DEBUG=1`` show the traceback, a bug is not hidden, Ctrl-C
exits 130; ``--chat`` output, ``train --help``, and ``generate`` prompt-length errors."""

import os
import subprocess
import sys

import pytest

import pallasite
from pallasite import cli
from pallasite.errors import ConfigError, InputError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "configs", "tiny.py")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random tiny Llama (context 64) saved as an HF folder with a fresh BPE tokenizer that has
    a chat template."""
    from flax import nnx

    from pallasite.models.config import ModelConfig
    from pallasite.models.tokenizer import train_bpe
    from pallasite.models.transformer import init_model

    folder = tmp_path_factory.mktemp("cli_model")
    texts = [
        open(os.path.join(os.path.dirname(os.__file__), name)).read()
        for name in ("os.py", "abc.py")
    ]
    tokenizer = train_bpe(texts, vocab_size=300)
    tokenizer.chat_template = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    )
    cfg = ModelConfig(
        family="llama",
        vocab_size=320,
        d_model=32,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=64,
        max_seq_len=64,
        eos_token_id=(int(tokenizer.eos_token_id),),
    )
    g, s = nnx.split(init_model(cfg, seed=0))
    pallasite.Model(cfg, s, tokenizer, g).save(str(folder / "hf"), format="hf")
    (folder / "nofield.jsonl").write_text('{"body": "x = 1"}\n')
    (folder / "notes.txt").write_text("not a model\n")
    damaged = folder / "damaged"
    damaged.mkdir()
    (damaged / "config.json").write_text((folder / "hf" / "config.json").read_text())
    (damaged / "model.safetensors").write_bytes(
        (folder / "hf" / "model.safetensors").read_bytes()[:-100]
    )
    return folder


def _fails(capsys, argv, code=1):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err
    assert e.value.code == code, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith("[")]
    assert len(lines) == 1, err  # one line (log lines of the run itself start with "[")
    return lines[0]


USER_ERRORS = [
    # (name, argv with {m} = model folder, {d} = fixture folder, substrings the line must contain)
    (
        "config key",
        ["train", "--config", TINY, "--workdir", "{d}/w", "--config.train.stepz=3"],
        ["train.stepz", "known"],
    ),
    (
        "config type",
        ["train", "--config", TINY, "--workdir", "{d}/w", "--config.train.steps=abc"],
        ["train.steps", "an int", "'abc'"],
    ),
    (
        "model field",
        ["train", "--config", TINY, "--workdir", "{d}/w", "--config.model.n_heads=3"],
        ["config.model", "n_heads=3"],
    ),
    (
        "ffn kind",
        ["train", "--config", TINY, "--workdir", "{d}/w", "--config.model.ffn=dence"],
        ["'dence'", "dense, moe, mole"],
    ),
    (
        "config file",
        ["train", "--config", "{d}/none.py", "--workdir", "{d}/w"],
        ["none.py", "does not exist"],
    ),
    (
        "missing model",
        ["generate", "--model", "{d}/nope", "--prompt", "x"],
        ["nope", "does not exist"],
    ),
    (
        "not a model",
        ["generate", "--model", "{d}/notes.txt", "--prompt", "x"],
        ["notes.txt", "not a .gguf"],
    ),
    (
        "damaged weights",
        ["generate", "--model", "{d}/damaged", "--prompt", "x"],
        ["model.safetensors", "truncated"],
    ),
    ("empty prompt", ["generate", "--model", "{m}", "--prompt", ""], ["--prompt is empty"]),
    (
        "zero new tokens",
        ["generate", "--model", "{m}", "--prompt", "x", "--max-new-tokens", "0"],
        ["max_new_tokens", ">= 1", "got 0"],
    ),
    (
        "cache kind",
        ["generate", "--model", "{m}", "--prompt", "x", "--kv-cache", "fancy"],
        ["--kv-cache='fancy'", "catekv, dense, kv4"],
    ),
    (
        "cache option",
        ["generate", "--model", "{m}", "--prompt", "x", "--kv-cache", "catekv", "--catekv.rr", "1"],
        ["'rr'", "known keys"],
    ),
    (
        "top-p",
        ["generate", "--model", "{m}", "--prompt", "x", "--temperature", "1", "--top-p", "2"],
        ["top_p", "(0, 1]", "2.0"],
    ),
    (
        "draft confidence",
        ["generate", "--model", "{m}", "--prompt", "x", "--drafter", "{m}", "--draft-confidence", "2"],
        ["confidence_threshold", "(0, 1]", "2.0"],
    ),
    (
        "lookup draft tokens",
        ["generate", "--model", "{m}", "--prompt", "x", "--prompt-lookup", "--num-draft-tokens", "0"],
        ["num_draft_tokens", ">= 1", "0"],
    ),
    (
        "lookup with a drafter",
        ["generate", "--model", "{m}", "--prompt", "x", "--prompt-lookup", "--drafter", "{m}"],
        ["--prompt-lookup", "no --drafter"],
    ),
    (
        "panels in float16",
        ["generate", "--model", "{m}", "--prompt", "x", "--dtype", "float16", "--cpu-panels"],
        ["float16", "float32 / bfloat16"],
    ),
    (
        "long prompt",
        ["generate", "--model", "{m}", "--prompt", "x = 1\n" * 200],
        ["context of 64 tokens"],
    ),
    (
        "prompt + new",
        ["generate", "--model", "{m}", "--prompt", "x = 1", "--max-new-tokens", "80"],
        ["max_new_tokens (80)", "context of 64 tokens"],
    ),
    (
        "jsonl field",
        ["eval", "--model", "{m}", "--data", "{d}/nofield.jsonl", "--seq-len", "16"],
        ["nofield.jsonl:1", "no field 'text'", "['body']"],
    ),
    (
        "eval data",
        ["eval", "--model", "{m}", "--data", "{d}/none.txt"],
        ["none.txt", "matches no file"],
    ),
    (
        "eval window",
        ["eval", "--model", "{m}", "--data", "{d}/notes.txt", "--seq-len", "100"],
        ["--seq-len 100", "max_seq_len=64"],
    ),
    ("heldout of a folder", ["eval", "--model", "{m}", "--data", "heldout"], ["workdir"]),
]


@pytest.mark.parametrize("name, argv, needles", USER_ERRORS, ids=[c[0] for c in USER_ERRORS])
def test_user_errors_are_one_line_and_exit_1(tiny_model, capsys, name, argv, needles):
    argv = [a.format(m=tiny_model / "hf", d=tiny_model) for a in argv]
    line = _fails(capsys, argv)
    assert line.startswith(f"pallasite {argv[0]}: error: "), line
    for needle in needles:
        assert needle in line, (needle, line)


def test_usage_errors_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["generate", "--prompt", "x"])  # --model missing: argparse's usage error
    assert e.value.code == 2 and "--model" in capsys.readouterr().err


def test_debug_flag_and_env_show_the_traceback(tiny_model, capsys, monkeypatch):
    argv = ["train", "--config", TINY, "--workdir", str(tiny_model / "w"), "--config.train.stepz=3"]
    monkeypatch.delenv("PALLASITE_DEBUG", raising=False)
    with pytest.raises(ConfigError, match="train.stepz"):
        cli.main(["--debug", *argv])
    # --debug reaches child processes through the env for that command only: later calls in this
    # process (a notebook, the tests) must not inherit it (Ctrl-C would then raise, not exit 130)
    assert "PALLASITE_DEBUG" not in os.environ
    monkeypatch.setenv("PALLASITE_DEBUG", "1")
    with pytest.raises(ConfigError, match="train.stepz"):
        cli.main(argv)
    monkeypatch.setenv("PALLASITE_DEBUG", "0")
    _fails(capsys, argv)


def test_a_bug_is_not_turned_into_a_user_error(tiny_model, monkeypatch):
    def broken(args, overrides):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(cli, "_cmd_convert", broken)
    with pytest.raises(ZeroDivisionError):
        cli.main(["convert", "--input", "x", "--output", "y", "--to", "hf"])


def test_ctrl_c_exits_130(monkeypatch, capsys):
    def interrupted(args, overrides):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_cmd_convert", interrupted)
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", "--input", "x", "--output", "y", "--to", "hf"])
    assert e.value.code == 130 and "interrupted" in capsys.readouterr().err


def test_console_script_prints_no_traceback(tmp_path):
    """The real entry point in a fresh process (what a user runs)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pallasite.cli",
            "train",
            "--config",
            TINY,
            "--workdir",
            str(tmp_path),
            "--config.train.stepz=3",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ, JAX_PLATFORMS="cpu"),
    )
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "train.stepz" in proc.stderr


def test_train_help_documents_overrides_and_arg(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["train", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0
    assert (
        "--config.a.b=VALUE" in out and "FILE.py:ARG" in out and "configs/quickstart.py:cpu" in out
    )


def test_chat_prints_the_answer_below_the_prompt_and_the_rate(tiny_model, capsys):
    cli.main(
        [
            "generate",
            "--model",
            str(tiny_model / "hf"),
            "--prompt",
            "hello there",
            "--chat",
            "--max-new-tokens",
            "6",
        ]
    )
    captured = capsys.readouterr()
    assert captured.out.startswith("hello there\n\n")
    assert (
        "<|user|>" not in captured.out and "<|assistant|>" not in captured.out
    )  # the template stays hidden
    assert "tokens/s" in captured.err
    cli.main(
        [
            "generate",
            "--model",
            str(tiny_model / "hf"),
            "--prompt",
            "def f(",
            "--max-new-tokens",
            "3",
        ]
    )
    out = capsys.readouterr().out
    assert out.startswith("def f(") and not out.startswith(
        "def f(\n\n"
    )  # a completion continues the prompt


def test_generate_refuses_prompts_longer_than_the_context(tiny_model):
    """ModelConfig.max_seq_len = 64: a 200-id prompt used to give 4 tokens silently."""
    model = pallasite.load(str(tiny_model / "hf"))
    with pytest.raises(
        InputError, match=r"prompt 0 has 200 tokens, longer than the model's context of 64"
    ):
        pallasite.generate(model, [[5] * 200], max_new_tokens=4)
    with pytest.raises(
        InputError,
        match=r"\(60 tokens\) \+ max_new_tokens \(8\) = 68 exceeds the model's context "
        r"of 64 .*at most 4 new tokens",
    ):
        pallasite.generate(model, [[5] * 60], max_new_tokens=8)
    assert (
        len(pallasite.generate(model, [[5] * 60], max_new_tokens=4, stop_tokens=[])[0]) == 4
    )  # fits exactly


def test_generate_with_a_confident_drafter_prints_the_targets_text(tiny_model, capsys):
    """--drafter with --draft-confidence (speculative decoding that drafts only where the drafter is
    sure): the printed text is the target's own greedy text."""
    base = ["generate", "--model", str(tiny_model / "hf"), "--prompt", "def f(", "--max-new-tokens", "8"]
    cli.main(base)
    want = capsys.readouterr().out
    cli.main(base + ["--drafter", str(tiny_model / "hf"), "--draft-confidence", "0.3"])
    assert capsys.readouterr().out == want


def test_generate_on_cpu_panels_prints_the_same_text(tiny_model, capsys):
    """--cpu-panels (the float32 linears through ops.panels' CPU kernel), alone and with a drafter
    that is converted too: the same greedy text as the plain model."""
    base = ["generate", "--model", str(tiny_model / "hf"), "--prompt", "def f(", "--max-new-tokens", "8"]
    cli.main(base)
    want = capsys.readouterr().out
    cli.main(base + ["--cpu-panels"])
    assert capsys.readouterr().out == want
    cli.main(base + ["--cpu-panels", "--drafter", str(tiny_model / "hf")])
    assert capsys.readouterr().out == want


def test_generate_with_prompt_lookup_prints_the_targets_text(tiny_model, capsys):
    """--prompt-lookup (drafts copied from the text, no drafter): the target's own greedy text."""
    base = ["generate", "--model", str(tiny_model / "hf"), "--prompt", "x = x + 1\nx = x + 1\nx = x",
            "--max-new-tokens", "12"]
    cli.main(base)
    want = capsys.readouterr().out
    cli.main(base + ["--prompt-lookup"])
    assert capsys.readouterr().out == want
