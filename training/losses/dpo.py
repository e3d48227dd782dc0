"""Direct Preference Optimization (Rafailov et al. 2023) over the one train step (``loss="dpo"``).

  L = −log σ(β [(log π_θ(y_w|x) − log π_ref(y_w|x)) − (log π_θ(y_l|x) − log π_ref(y_l|x))])

averaged over pairs. Each batch row holds one pair, packed as two segments of the same row: the
chosen response ``y_w`` in segment 1 and the rejected ``y_l`` in segment 2, each after its own copy
of the prompt (prompt tokens at ``loss_mask = 0``, so log π is the response's sequence log-prob).
The frozen reference (the SFT model) enters as ``ref_logps`` [B, 2], precomputed once by the data
kind (``training/preference/data.py``) with the same ``sequence_logprobs`` — exactly the numbers
an in-step reference pass would give, without a second model in the step. Default β = 0.1 (the
DPO paper's and TRL's). Logged: ``reward_accuracy`` (margin > 0), ``margin``, the implicit
rewards β·(log π − log π_ref) of chosen and rejected.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallasite.errors import ConfigError
from pallasite.registry import LOSS
from pallasite.training.losses import LM_BATCH_KEYS, LossKind, LossTerms
from pallasite.training.losses.sft import sequence_logprobs

DPO_BATCH_KEYS = LM_BATCH_KEYS + ("ref_logps",)


@dataclasses.dataclass(frozen=True)
class DPOConfig:
    beta: float = 0.1

    def __post_init__(self):
        if not self.beta > 0:
            raise ConfigError(f"DPOConfig.beta must be > 0, got {self.beta!r}")


def dpo_loss(policy_logps_B2, ref_logps_B2, beta: float):
    """(per-pair loss [B], margin [B], chosen reward [B], rejected reward [B])."""
    chosen = beta * (policy_logps_B2[:, 0] - ref_logps_B2[:, 0])
    rejected = beta * (policy_logps_B2[:, 1] - ref_logps_B2[:, 1])
    margin = chosen - rejected
    return -jax.nn.log_sigmoid(margin), margin, chosen, rejected


def dpo_terms(model, batch: dict, config: DPOConfig = None, chunk: int = 0) -> LossTerms:
    config = config or DPOConfig()
    logps, _, aux = sequence_logprobs(model, batch, n_segments=2)
    loss, margin, chosen, rejected = dpo_loss(
        logps, batch["ref_logps"].astype(jnp.float32), config.beta
    )
    metrics = {
        "reward_accuracy": jnp.mean((margin > 0).astype(jnp.float32)),
        "margin": jnp.mean(margin),
        "chosen_reward": jnp.mean(chosen),
        "rejected_reward": jnp.mean(rejected),
    }
    return LossTerms(
        total=jnp.sum(loss),
        count=jnp.float32(loss.shape[0]),
        aux={k: jnp.asarray(v, jnp.float32) for k, v in aux.items()},
        metrics=metrics,
    )


def pairs_in_batch(batch: dict):
    return jnp.float32(batch["ref_logps"].shape[0])


LOSS.register(
    "dpo",
    LossKind(terms=dpo_terms, normalizer=pairs_in_batch, batch_keys=DPO_BATCH_KEYS),
    config=DPOConfig,
)

__all__ = ["DPOConfig", "DPO_BATCH_KEYS", "dpo_loss", "dpo_terms"]
