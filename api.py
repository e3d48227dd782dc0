"""The small public API (Gemma-style): ``load``, ``Model``, ``generate``.

    model = pallasite.load("path/to/hf_folder" | "model.gguf" | "pallasite_ckpt/" | "train_workdir/")
    logits = model.logits(ids)                              # float32 [batch, seq, vocab]
    texts = pallasite.generate(model, ["Hello"], max_new_tokens=16)
    model.save("out/", format="hf" | "orbax")
    served = pallasite.serve_lut(model, "host")             # a MoLE model with its experts as an offloaded LUT

These names are used from Colab and by external checks: keep them stable.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from pallasite.errors import DataError, InputError
from pallasite.inference.config import GenerationConfig
from pallasite.inference.engine import generate_ids
from pallasite.models.config import ModelConfig
from pallasite.models.transformer import abstract_model, forward

ORBAX_MARKER = "pallasite_model.json"


@dataclasses.dataclass
class Model:
    """A model ready for inference: config, split NNX state, (optionally) a tokenizer, and the folder
    it was loaded from (``path``: where artifacts saved with the model — a CateKV head mask, KV4
    transforms — are looked up)."""

    config: ModelConfig
    state: Any
    tokenizer: Any = None
    graphdef: Any = None
    path: Optional[str] = None

    def __post_init__(self):
        if self.config.ffn == "moe" and getattr(self.config.ffn_config, "placement", None):  # Occult placement
            from pallasite.models.occult import apply_config_placement

            self.config, self.state = apply_config_placement(self.config, self.state, self.path)
            self.graphdef = None
        if self.graphdef is None:
            self.graphdef = nnx.split(abstract_model(self.config))[0]

    # -------------------------------------------------------------- inference
    @functools.cached_property
    def _logits_fn(self):
        graphdef = self.graphdef
        return jax.jit(lambda state, ids, positions, segments, cache: forward(
            graphdef, state, ids, positions, segment_ids_BT=segments, cache=cache)[0])

    def _scoring_cache(self, batch: int, length: int):
        """The model's own KV cache kind for scoring when it is not the dense one (a 4-bit cache
        changes the numbers: a W4A4KV4 model is scored with its KV quantization), else None."""
        if self.config.kv_cache == "dense":
            return None
        from pallasite.inference.engine import make_cache_factory

        return make_cache_factory(self.config, GenerationConfig(), self)(self.config, batch, length)

    def logits(self, ids, *, positions=None, segment_ids=None) -> jax.Array:
        """float32 logits [batch, seq, vocab] for token ids ([seq] or [batch, seq]; every row the
        same length — pad ragged rows yourself: the logits at a row's real positions do not depend on
        right padding). ``positions`` / ``segment_ids`` (same shape) describe packed rows: positions
        restart per document and attention stays inside a segment (default: 0..T-1, one segment)."""
        if isinstance(ids, (list, tuple)) and ids and isinstance(ids[0], (list, tuple, np.ndarray)):
            lengths = sorted({len(row) for row in ids})
            if len(lengths) > 1:
                raise InputError(f"Model.logits: the rows have different lengths {lengths[:6]}; give "
                                 f"rows of one length (right-pad the shorter ones and ignore the "
                                 f"logits past each row's end)")
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise InputError(f"Model.logits expects integer token ids, got dtype {ids.dtype}")
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise InputError(f"Model.logits expects ids of shape [seq] or [batch, seq], got {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise InputError(
                f"token ids must lie in [0, {self.config.vocab_size}); got range [{ids.min()}, {ids.max()}]"
            )
        extra = []
        for name, value in (("positions", positions), ("segment_ids", segment_ids)):
            if value is not None:
                value = np.asarray(value).reshape(ids.shape) if np.size(value) == ids.size else None
                if value is None:
                    raise InputError(f"Model.logits: {name} must have the shape of ids {ids.shape}")
                value = jnp.asarray(value, jnp.int32)
            extra.append(value)
        return self._logits_fn(self.state, jnp.asarray(ids, jnp.int32), *extra,
                               self._scoring_cache(*ids.shape))

    def encode(self, text: str, *, bos: bool = True) -> list[int]:
        """Token ids of ``text``, led by BOS where the tokenizer's convention adds one (Gemma,
        Llama; ``models.tokenizer.bos_prefix``) unless ``bos=False``; no other special tokens."""
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer: pass token ids instead of strings")
        return (self.bos_prefix if bos else []) + list(self.tokenizer.encode(text, add_special_tokens=False))

    @functools.cached_property
    def bos_prefix(self) -> list[int]:
        from pallasite.models.tokenizer import bos_prefix

        return [] if self.tokenizer is None else bos_prefix(self.tokenizer)

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise InputError("this model has no tokenizer: cannot decode ids to text")
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    # ----------------------------------------------------------------- saving
    def save(self, path: str, format: str = "hf") -> str:
        """Write the model to ``path``: ``hf`` (config.json + safetensors) or ``orbax``."""
        os.makedirs(path, exist_ok=True)
        if format == "hf":
            from pallasite.models.hf import export_hf

            export_hf(self.config, self.state, path)
        elif format == "orbax":
            import orbax.checkpoint as ocp

            params_dir = os.path.abspath(os.path.join(path, "params"))
            with ocp.StandardCheckpointer() as ckptr:
                ckptr.save(params_dir, nnx.to_pure_dict(self.state), force=True)
            with open(os.path.join(path, ORBAX_MARKER), "w") as f:
                json.dump({"format": "pallasite-orbax", "version": 1, "config": self.config.to_dict()}, f, indent=1)
        else:
            raise InputError(f"Model.save: format={format!r}; expected 'hf' or 'orbax'")
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(path)
        return path


def _load_tokenizer_if_present(folder: str):
    if any(os.path.exists(os.path.join(folder, f)) for f in ("tokenizer.json", "tokenizer_config.json")):
        from pallasite.models.tokenizer import load_tokenizer

        return load_tokenizer(folder)
    return None


def _load_orbax(path: str, dtype=None) -> Model:
    import orbax.checkpoint as ocp

    with open(os.path.join(path, ORBAX_MARKER)) as f:
        meta = json.load(f)
    cfg = ModelConfig.from_dict(meta["config"])
    if dtype is not None:
        cfg = cfg.replace(param_dtype=str(jnp.dtype(dtype)), dtype=str(jnp.dtype(dtype)))
    graphdef, abstract_state = nnx.split(abstract_model(cfg))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), nnx.to_pure_dict(abstract_state))
    with ocp.StandardCheckpointer() as ckptr:
        restored = ckptr.restore(os.path.abspath(os.path.join(path, "params")), target)
    nnx.replace_by_pure_dict(abstract_state, restored)
    return Model(cfg, abstract_state, _load_tokenizer_if_present(path), graphdef, path=os.path.abspath(path))


def _is_training_workdir(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "checkpoints")) and os.path.exists(os.path.join(path, "config.json"))


def load_workdir(workdir: str, dtype=None, step: Optional[int] = None) -> Model:
    """The model of a ``pallasite train`` workdir at checkpoint ``step`` (default: the latest),
    with the workdir's tokenizer: works for every architecture (MoE and MoLE included, which have
    no HF layout)."""
    import ml_collections

    from pallasite import sharding as shd
    from pallasite.models.tokenizer import load_tokenizer
    from pallasite.training import step as step_lib
    from pallasite.training.checkpointing import Checkpointer
    from pallasite.training.loop import model_config_for
    from pallasite.training.optim import make_optimizer

    with open(os.path.join(workdir, "config.json")) as f:
        config = ml_collections.ConfigDict(json.load(f))
    tokenizer = load_tokenizer(config.tokenizer.path or os.path.join(workdir, "tokenizer"))
    cfg = model_config_for(config, tokenizer)
    optimizer, _ = make_optimizer(config.optim, config.train.steps)
    mesh = shd.make_mesh({"data": 1})
    graphdef, abstract, _ = step_lib.abstract_train_state(cfg, optimizer, mesh, shd.rules_from_config(()), config.seed)
    ckpt = Checkpointer(os.path.join(workdir, "checkpoints"), async_save=False)
    try:
        step = ckpt.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"pallasite.load: training workdir {workdir!r} has no checkpoint yet")
        state, _, _ = ckpt.restore(step, abstract)
    finally:
        ckpt.close()
    pure = nnx.to_pure_dict(nnx.state(nnx.merge(graphdef, state["params"], state["other"])))
    if dtype is not None:
        cfg = cfg.replace(param_dtype=str(jnp.dtype(dtype)), dtype=str(jnp.dtype(dtype)))
        pure = jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, pure)
    graphdef, params = nnx.split(abstract_model(cfg))
    nnx.replace_by_pure_dict(params, pure)
    return Model(cfg, params, tokenizer, graphdef, path=os.path.abspath(workdir))


def load(path: str, *, dtype: Optional[Union[str, jnp.dtype]] = None) -> Model:
    """Load a model from an HF folder, a GGUF file, a pallasite orbax model folder, or a training
    workdir (latest checkpoint)."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(2, "does not exist (expected a model: an HF folder, a .gguf file, "
                                   "a pallasite orbax folder or a training workdir)", path)
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            from pallasite.models.gguf import import_gguf

            _check_gguf_file(path)
            cfg, state, tokenizer = import_gguf(path, dtype=dtype)
            return Model(cfg, state, tokenizer, path=os.path.dirname(os.path.abspath(path)))
        raise InputError(f"pallasite.load: {path!r} is a file but not a .gguf; expected a GGUF file or a folder")
    if os.path.exists(os.path.join(path, ORBAX_MARKER)):
        return _load_orbax(path, dtype)
    if _is_training_workdir(path):  # before the HF check: a workdir also holds a config.json
        return load_workdir(path, dtype)
    if os.path.exists(os.path.join(path, "config.json")):
        from pallasite.models.hf import import_hf

        cfg, state = import_hf(path, dtype=dtype)
        return Model(cfg, state, _load_tokenizer_if_present(path), path=os.path.abspath(path))
    for sub in ("model", "final_model", "export", "hf"):
        if os.path.isdir(os.path.join(path, sub)):
            return load(os.path.join(path, sub), dtype=dtype)
    if not os.access(path, os.R_OK | os.X_OK):
        raise PermissionError(13, "cannot read this folder (permission denied)", path)
    raise InputError(
        f"pallasite.load: cannot tell what {path!r} holds; expected a GGUF file, an HF folder with "
        f"config.json + *.safetensors, a pallasite folder with {ORBAX_MARKER}, or a training "
        f"workdir"
    )


def _check_gguf_file(path: str) -> None:
    """A .gguf that is not one (empty, truncated header, another format) fails naming the file."""
    with open(path, "rb") as f:
        head = f.read(8)
    if head[:4] != b"GGUF":
        what = ("is empty" if not head
                else f"does not start with the GGUF magic (starts with {head[:4]!r})")
        raise DataError(f"{path}: {what}; expected a GGUF model file")


def generate(model: Model, prompts: Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]],
             config: Optional[GenerationConfig] = None, *, stream=None, **options) -> list:
    """Complete each prompt. Prompts are strings (needs a tokenizer) or lists of token ids.

    Options are a ``GenerationConfig`` and/or its fields as keywords (``max_new_tokens``,
    ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_tokens``, ``kv_cache``,
    ``kv_cache_config``, ``strategy``, ``constraint``, ``drafter``, ``method`` (speculative decoding,
    docs/speculative.md), ...; ``grammar=`` / ``json_schema=`` /
    ``regex=`` constrain the completion, docs/constrained.md). Returns one completion per prompt:
    a string for a string prompt, a list of new token ids for a token-id prompt. A prompt longer
    than the model's context (``ModelConfig.max_seq_len``) or the KV cache fails naming both lengths. Generation
    stops at ``stop_tokens`` (default: the model's eos ids) or ``max_new_tokens``; ``stream`` is
    called once per step with each row's new tokens."""
    # grammar= / json_schema= / regex= become GenerationConfig.constraint, bound to the tokenizer
    from pallasite.inference.constrained.sugar import make_generation_config

    gen = make_generation_config(config, options, model.tokenizer)
    if gen.drafter is not None:  # speculative decoding: the drafter follows this model's text
        from pallasite.inference.speculative import bind_target

        gen = bind_target(gen, model)
    if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    prompt_ids = []
    for i, p in enumerate(prompts):
        ids = model.encode(p) if isinstance(p, str) else [int(t) for t in p]
        if isinstance(p, str) and not ids:
            raise InputError(f"prompt {i} ({p!r}) is empty: it encodes to no tokens; give some "
                             f"text")
        prompt_ids.append(ids)
    if gen.stop_tokens is None and not model.config.eos_token_id and model.tokenizer is not None \
            and model.tokenizer.eos_token_id is not None:
        gen = gen.replace(stop_tokens=(int(model.tokenizer.eos_token_id),))
    out_ids = generate_ids(model.graphdef, model.state, model.config, prompt_ids, gen, stream=stream, model=model)
    # text in, text out; token ids in, token ids out (per prompt)
    return [model.decode(ids) if isinstance(p, str) else ids for p, ids in zip(prompts, out_ids)]


LUT_PLACES = ("host", "device", "disk")


def serve_lut(model: Model, where: str = "host", *, path: Optional[str] = None, quant: str = "none",
              block: int = 768) -> Model:
    """A MoLE model served with its experts re-parameterised into a lookup table (Jie et al.,
    ICML 2025, §3.2–3.3): ``where="host"`` keeps the LUT in the backend's host memory and gathers
    the step's rows in the compiled graph (``mole_decode.serve_in_host_memory``); ``"disk"`` reads
    rows from the memory-mapped LUT file ``path`` through a host callback (``open_lut`` checks the
    file against the model; with no such file it is built and saved first); ``"device"`` keeps
    the whole LUT in device memory (no offloading). ``quant`` = none | nf4 | nf3 (paper §4.4,
    token-wise blocks of ``block`` values). The result is a ``Model`` for ``logits``/``generate``."""
    from pallasite.inference import mole_decode as MD
    from pallasite.models import mole_lut as ML
    from pallasite.models.mole import mole_config_of

    if where not in LUT_PLACES:
        raise InputError(f"serve_lut: where={where!r}; expected one of {LUT_PLACES}")
    mole = mole_config_of(model.config) if model.config.ffn == "mole" else None
    if mole is None or mole.mode != "train" or not mole.n_experts:
        raise InputError(f"serve_lut: needs a training-mode MoLE model with experts (config.ffn='mole', "
                         f"n_experts > 0); got ffn={model.config.ffn!r}")
    trained = nnx.merge(model.graphdef, model.state)
    if where == "disk":
        if path is None:
            raise InputError("serve_lut: where='disk' needs path= (the LUT file to read, or to build if missing)")
        if not os.path.exists(path):
            ML.save_lut(path, ML.HostLUT.from_model(trained, quant=quant, block=block))
        store = ML.open_lut(path, trained)
    else:
        store = ML.HostLUT.from_model(trained, quant=quant, block=block)
    lut_model = ML.to_lut_model(trained)
    if where == "host":
        served = MD.serve_in_host_memory(lut_model, store)
    elif where == "disk":
        served = MD.serve_with_store(lut_model, store)
    else:
        if quant != "none":
            raise InputError("serve_lut: where='device' keeps the float LUT on the device; quant must be 'none'")
        served = MD.serve_on_device(lut_model, store.data[0])
    graphdef, state = nnx.split(served)
    return Model(served.cfg, state, model.tokenizer, graphdef, path=model.path)
