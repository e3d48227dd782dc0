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
        if self.graphdef is None:
            self.graphdef = nnx.split(abstract_model(self.config))[0]

    # -------------------------------------------------------------- inference
    @functools.cached_property
    def _logits_fn(self):
        graphdef = self.graphdef
        return jax.jit(lambda state, ids: forward(graphdef, state, ids)[0])

    def logits(self, ids) -> jax.Array:
        """float32 logits [batch, seq, vocab] for an int array of token ids ([seq] or [batch, seq])."""
        ids = np.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"Model.logits expects integer token ids, got dtype {ids.dtype}")
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2:
            raise ValueError(f"Model.logits expects ids of shape [seq] or [batch, seq], got {ids.shape}")
        if ids.size and (ids.min() < 0 or ids.max() >= self.config.vocab_size):
            raise ValueError(
                f"token ids must lie in [0, {self.config.vocab_size}); got range [{ids.min()}, {ids.max()}]"
            )
        return self._logits_fn(self.state, jnp.asarray(ids, jnp.int32))

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of strings")
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: cannot decode ids to text")
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
            raise ValueError(f"Model.save: format={format!r}; expected 'hf' or 'orbax'")
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
        raise FileNotFoundError(f"pallasite.load: {path!r} does not exist")
    if os.path.isfile(path):
        if path.endswith(".gguf"):
            from pallasite.models.gguf import import_gguf

            cfg, state, tokenizer = import_gguf(path, dtype=dtype)
            return Model(cfg, state, tokenizer, path=os.path.dirname(os.path.abspath(path)))
        raise ValueError(f"pallasite.load: {path!r} is a file but not a .gguf; expected a GGUF file or a folder")
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
    raise ValueError(
        f"pallasite.load: cannot tell what {path!r} holds; expected a GGUF file, an HF folder with "
        f"config.json + *.safetensors, or a pallasite folder with {ORBAX_MARKER}"
    )


def generate(model: Model, prompts: Union[str, Sequence[int], Sequence[Union[str, Sequence[int]]]],
             config: Optional[GenerationConfig] = None, *, stream=None, **options) -> list:
    """Complete each prompt. Prompts are strings (needs a tokenizer) or lists of token ids.

    Options are a ``GenerationConfig`` and/or its fields as keywords (``max_new_tokens``,
    ``temperature``, ``top_k``, ``top_p``, ``seed``, ``stop_tokens``, ``kv_cache``,
    ``kv_cache_config``, ``strategy``, ``drafter``, ``method``, ...). Returns completions as strings when the model has a
    tokenizer, else lists of token ids. Generation stops at ``stop_tokens`` (default: the model's
    eos ids) or ``max_new_tokens``; ``stream`` is called once per step with each row's new tokens."""
    gen = GenerationConfig.make(config, **options)
    if gen.drafter is not None:  # speculative decoding: the drafter follows this model's text
        from pallasite.inference.speculative import bind_target

        gen = bind_target(gen, model)
    if isinstance(prompts, str) or (len(prompts) > 0 and isinstance(prompts[0], (int, np.integer))):
        prompts = [prompts]
    prompt_ids = [model.encode(p) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
    if gen.stop_tokens is None and not model.config.eos_token_id and model.tokenizer is not None \
            and model.tokenizer.eos_token_id is not None:
        gen = gen.replace(stop_tokens=(int(model.tokenizer.eos_token_id),))
    out_ids = generate_ids(model.graphdef, model.state, model.config, prompt_ids, gen, stream=stream, model=model)
    if model.tokenizer is None:
        return out_ids
    return [model.decode(ids) for ids in out_ids]


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
        raise ValueError(f"serve_lut: where={where!r}; expected one of {LUT_PLACES}")
    if model.config.ffn != "mole" or mole_config_of(model.config).mode != "train" or not mole_config_of(model.config).n_experts:
        raise ValueError(f"serve_lut: needs a training-mode MoLE model with experts (config.ffn='mole', "
                         f"n_experts > 0); got ffn={model.config.ffn!r}")
    trained = nnx.merge(model.graphdef, model.state)
    if where == "disk":
        if path is None:
            raise ValueError("serve_lut: where='disk' needs path= (the LUT file to read, or to build if missing)")
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
            raise ValueError("serve_lut: where='device' keeps the float LUT on the device; quant must be 'none'")
        served = MD.serve_on_device(lut_model, store.data[0])
    graphdef, state = nnx.split(served)
    return Model(served.cfg, state, model.tokenizer, graphdef, path=model.path)
