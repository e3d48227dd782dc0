"""OVERTONE token-level smoothing for knowledge editing (Liu et al., ICML 2025, arXiv 2502.00602),
``loss="overtone"``.

What is implemented (the brief's reconstruction; the PDF's §4 could not be read here, so the exact
filter and any λ schedule are unverified): at every response position t the one-hot target is
replaced by

    q_t = λ · e_{y_t} + (1 − λ) · sg[filter(π_θ(· | x, y_<t))],   L = Σ_t m_t KL(q_t ‖ π_θ) / Σ m_t

where filter keeps the model's own high-probability tokens and renormalises them (``min_p``: π_v ≥
ε · max π — default, ε = 0.1; ``top_p``; ``top_k``; ``threshold``: π_v ≥ ε) and sg is stop-gradient.
q comes from the same forward pass (no extra pass). KL = Σ_v q_v log q_v − Σ_v q_v (z_v − lse(z)):
at λ = 1 this is the ``lm`` cross-entropy term for term (value and gradient). The gradient on the
logits is π − q: clipped-out tokens are pushed down with the full π_v while kept plausible tokens
are pushed down less (or up), and tokens the model already fits get a target near its own
prediction. Default λ = 0.8 (any λ > 0.5 keeps argmax q = y_t). Logged: the mean number of tokens
the filter keeps (``loss/kept_tokens``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.scipy.special import xlogy

from pallasite.errors import ConfigError
from pallasite.registry import LOSS
from pallasite.training.losses import LossKind, LossTerms
from pallasite.training.losses.lm import masked_tokens
from pallasite.training.losses.sft import forward_logits

FILTERS = ("min_p", "top_p", "top_k", "threshold")


@dataclasses.dataclass(frozen=True)
class OvertoneConfig:
    lam: float = 0.8  # weight of the one-hot target
    filter: str = "min_p"  # min_p | top_p | top_k | threshold
    eps: float = 0.1  # min_p: keep π_v >= eps * max π; threshold: keep π_v >= eps
    top_p: float = 0.9
    top_k: int = 5

    def __post_init__(self):
        if not 0.0 <= self.lam <= 1.0:
            raise ConfigError(f"OvertoneConfig.lam must lie in [0, 1], got {self.lam!r}")
        if self.filter not in FILTERS:
            raise ConfigError(f"OvertoneConfig.filter={self.filter!r}; expected one of {FILTERS}")
        if self.filter == "top_k" and int(self.top_k) < 1:
            raise ConfigError(f"OvertoneConfig.top_k must be >= 1, got {self.top_k!r}")


def keep_mask(probs_NV, config: OvertoneConfig):
    """bool [N, V]: the tokens the filter keeps (never empty: the argmax is always kept)."""
    if config.filter == "min_p":
        keep = probs_NV >= config.eps * jnp.max(probs_NV, axis=-1, keepdims=True)
    elif config.filter == "threshold":
        keep = probs_NV >= config.eps
    elif config.filter == "top_k":
        kth = jax.lax.top_k(probs_NV, int(config.top_k))[0][..., -1:]
        keep = probs_NV >= kth
    else:  # top_p: the smallest prefix of the sorted distribution whose mass reaches top_p
        order = jnp.argsort(-probs_NV, axis=-1)
        sorted_p = jnp.take_along_axis(probs_NV, order, axis=-1)
        before = jnp.cumsum(sorted_p, axis=-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < config.top_p
        keep = (
            jnp.zeros_like(keep_sorted)
            .at[jnp.arange(probs_NV.shape[0])[:, None], order]
            .set(keep_sorted)
        )
    return keep | (probs_NV >= jnp.max(probs_NV, axis=-1, keepdims=True))


def overtone_targets(logits_NV, targets_N, config: OvertoneConfig):
    """q [N, V] (no gradient) and the number of kept tokens [N]."""
    probs = jax.nn.softmax(jax.lax.stop_gradient(logits_NV), axis=-1)
    keep = keep_mask(probs, config)
    filtered = jnp.where(keep, probs, 0.0)
    filtered = filtered / jnp.sum(filtered, axis=-1, keepdims=True)
    onehot = jax.nn.one_hot(targets_N, logits_NV.shape[-1], dtype=jnp.float32)
    q = config.lam * onehot + (1.0 - config.lam) * filtered
    return jax.lax.stop_gradient(q), jnp.sum(keep, axis=-1)


def forward_kl(q_NV, logits_NV):
    """KL(q ‖ softmax(logits)) per row = Σ q log q − Σ q (z − lse(z)), with 0 log 0 = 0."""
    lse = jax.nn.logsumexp(logits_NV, axis=-1, keepdims=True)
    cross = jnp.sum(q_NV * (lse - logits_NV), axis=-1)  # −Σ q log π
    return jnp.sum(xlogy(q_NV, q_NV), axis=-1) + cross


def overtone_kl(logits_NV, targets_N, config: OvertoneConfig):
    """(KL(q_t ‖ π_θ) per position [N], kept tokens [N])."""
    q, kept = overtone_targets(logits_NV, targets_N, config)
    return forward_kl(q, logits_NV), kept


def overtone_terms(model, batch: dict, config: OvertoneConfig = None, chunk: int = 0) -> LossTerms:
    config = config or OvertoneConfig()
    logits, aux = forward_logits(model, batch)
    B, T, V = logits.shape
    kl, kept = overtone_kl(logits.reshape(B * T, V), batch["targets"].reshape(B * T), config)
    m = batch["loss_mask"].reshape(B * T).astype(jnp.float32)
    n = jnp.sum(m)
    return LossTerms(
        total=jnp.sum(kl * m),
        count=n,
        aux={k: jnp.asarray(v, jnp.float32) for k, v in aux.items()},
        metrics={"kept_tokens": jnp.sum(kept * m) / jnp.maximum(n, 1.0)},
    )


LOSS.register(
    "overtone", LossKind(terms=overtone_terms, normalizer=masked_tokens), config=OvertoneConfig
)

__all__ = [
    "OvertoneConfig",
    "FILTERS",
    "keep_mask",
    "overtone_targets",
    "forward_kl",
    "overtone_kl",
    "overtone_terms",
]
