"""Optimizer: AdamW (Loshchilov & Hutter 2019) with linear warmup + cosine decay, global-norm
gradient clipping and a weight-decay mask.

Schedule (step s counted from 0, W warmup steps, S total steps, peak lr, floor r*lr):

    lr(s) = lr * (s + 1) / W                                   s < W
    lr(s) = r*lr + (lr - r*lr) * (1 + cos(pi * (s - W) / (S - W))) / 2     W <= s <= S

(the warmup starts at lr/W rather than 0 so that the first update is not wasted — nanoGPT's
convention; optax's ``warmup_cosine_decay_schedule`` would start at exactly 0).

Weight decay applies to matrices only by default: RMSNorm scales (parameter name ``scale``),
biases (``bias``) and embedding tables (``embedding``) are excluded unless ``decay_norms`` /
``decay_biases`` / ``decay_embeddings`` say otherwise. Decay is decoupled (AdamW), multiplied by
the scheduled lr as in optax. ``optim.moments="fp8"`` stores Adam's moments in FP8 / FP16
(``optim_moments.py``, the FP8-LM mixed precision of FP4 training).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from pallasite.errors import ConfigError
from pallasite.training.optim_moments import MOMENT_FORMATS, adamw_low_precision


def lr_schedule(lr: float, steps: int, warmup_steps: int, min_lr_ratio: float = 0.1):
    warmup = max(int(warmup_steps), 0)
    total = max(int(steps), warmup + 1)
    floor = lr * min_lr_ratio

    def schedule(step):
        s = jnp.asarray(step, jnp.float32)
        warm = lr * (s + 1.0) / max(warmup, 1)
        frac = jnp.clip((s - warmup) / (total - warmup), 0.0, 1.0)
        cos = floor + (lr - floor) * 0.5 * (1.0 + jnp.cos(math.pi * frac))
        return jnp.where(s < warmup, warm, cos)

    return schedule


def _param_name(path) -> str:
    names = [getattr(k, "key", getattr(k, "name", None)) for k in path]
    names = [n for n in names if n not in (None, "value")]
    return str(names[-1]) if names else ""


def decay_mask(params, *, decay_norms: bool = False, decay_biases: bool = False, decay_embeddings: bool = False):
    """Pytree of bools (True = apply weight decay) with the structure of ``params``."""

    def rule(path, _):
        name = _param_name(path)
        if name == "scale":
            return decay_norms
        if name == "bias":
            return decay_biases
        if name == "embedding":
            return decay_embeddings
        return True

    return jax.tree_util.tree_map_with_path(rule, params)


def make_optimizer(optim_cfg, steps: int) -> tuple[optax.GradientTransformation, callable]:
    """(optax transformation, schedule) from a ``config.optim`` group."""
    schedule = lr_schedule(optim_cfg.lr, steps, optim_cfg.warmup_steps, optim_cfg.min_lr_ratio)
    mask = lambda p: decay_mask(p, decay_norms=optim_cfg.decay_norms, decay_biases=optim_cfg.decay_biases,  # noqa: E731
                                decay_embeddings=optim_cfg.decay_embeddings)
    parts = []
    if optim_cfg.clip_norm and optim_cfg.clip_norm > 0:
        parts.append(optax.clip_by_global_norm(optim_cfg.clip_norm))
    moments = str(optim_cfg.get("moments", "float32"))
    if moments == "float32":
        parts.append(optax.adamw(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                                 weight_decay=optim_cfg.weight_decay, mask=mask))
    elif moments in MOMENT_FORMATS:  # FP8-LM's FP8 first / FP16 second moment (optim_moments.py)
        parts.append(adamw_low_precision(schedule, b1=optim_cfg.b1, b2=optim_cfg.b2, eps=optim_cfg.eps,
                                         weight_decay=optim_cfg.weight_decay, mask=mask, moments=moments))
    else:
        raise ConfigError(f"optim.moments={moments!r}; expected one of {['float32', *sorted(MOMENT_FORMATS)]}")
    return optax.chain(*parts), schedule


__all__ = ["lr_schedule", "decay_mask", "make_optimizer"]
