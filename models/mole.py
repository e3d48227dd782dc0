"""Mixture of Lookup Experts FFN (``ffn="mole"``) — Jie et al., "Mixture of Lookup Experts",
ICML 2025 (arXiv 2503.15798; official code github.com/JieShibo/MoLE). For layer ``l``::

    u = RMSNorm_post(h);   g = softmax(u · R_l)          # float32, all N experts, no top-k
    E_lj = W_down^{lj} · GELU(W_up^{lj} · RMSNorm_l(e))  # e = the embedding-layer output
    out = h + FFN_shared(u) + Σ_j g_j · E_lj

The shared FFN (width D_s = ``d_ff``) and the experts (width D_r = ``d_expert`` or ``d_ff``) are
non-gated exact-GELU MLPs; there is no auxiliary loss. The experts see only ``e``, so after
training they become a lookup table ``LUT[id, l, j]`` (``models/mole_lut.py``): in ``mode="lut"``
the module holds no expert weights and reads the step's rows from ``lut_rows`` [B, T, N, d].
Defaults: ``n_experts=4``, D_r = D_s. Deviations: the router matmul runs in float32 (official:
activation dtype, softmax in float32); ``n_experts=0`` is the paper's non-gated dense baseline;
training runs each expert once per distinct token id of each batch shard (an exact rewrite). docs/experts.md.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax
import jax.numpy as jnp
from flax import nnx

from pallasite import sharding
from pallasite.models.config import ModelConfig, kind_config
from pallasite.models.context import ForwardContext
from pallasite.models.layers import RMSNorm, activation, make_linear
from pallasite.registry import FFN

MOLE_MODES = ("train", "lut")


@dataclasses.dataclass(frozen=True)
class MoLEConfig:
    """Sub-config ``ModelConfig.mole``.

    n_experts: N routed lookup experts per layer (0 → the dense baseline, shared FFN only).
    d_expert: D_r, hidden width of each routed expert (None → cfg.d_ff = D_s).
    d_shared: D_s, hidden width of the shared FFN (None → cfg.d_ff).
    mode: "train" (experts are FFNs over the normed embedding) or "lut" (experts replaced by
      per-step rows of the re-parameterised lookup table; no expert parameters exist).
    activation: "gelu_exact" (torch ``nn.GELU()``, the paper's) — "gelu" (tanh) only for ablations.
    lut_dtype: storage dtype of the LUT ("float16" as in the official ``.half()``; "bfloat16";
      "float32" for exactness tests).
    dedup_fraction: training-mode speed-up, exact: the experts see only the embedding of the
      token id, so they are run once per *distinct* id of the batch (at most
      ``dedup_fraction · B·T`` rows, or the vocabulary if smaller) and gathered back; a batch with
      more distinct ids than that takes the plain all-tokens path (``lax.cond``). 0 → always
      the plain path. Same values and gradients (tests/models/test_mole.py).
    """

    n_experts: int = 4
    d_expert: Optional[int] = None
    d_shared: Optional[int] = None
    mode: str = "train"
    activation: str = "gelu_exact"
    lut_dtype: str = "float16"
    dedup_fraction: float = 0.5

    def __post_init__(self):
        if int(self.n_experts) < 0:
            raise ValueError(f"MoLEConfig.n_experts must be >= 0, got {self.n_experts!r}")
        for name in ("d_expert", "d_shared"):
            v = getattr(self, name)
            if v is not None and int(v) <= 0:
                raise ValueError(f"MoLEConfig.{name} must be a positive integer or None, got {v!r}")
        if self.mode not in MOLE_MODES:
            raise ValueError(f"MoLEConfig.mode={self.mode!r}; expected one of {MOLE_MODES}")
        if self.activation not in ("gelu_exact", "gelu", "silu"):
            raise ValueError(f"MoLEConfig.activation={self.activation!r}; expected gelu_exact | gelu | silu")
        if not 0.0 <= float(self.dedup_fraction) <= 1.0:
            raise ValueError(f"MoLEConfig.dedup_fraction={self.dedup_fraction!r}; expected a fraction in [0, 1]")
        if self.lut_dtype not in ("float16", "bfloat16", "float32"):
            raise ValueError(f"MoLEConfig.lut_dtype={self.lut_dtype!r}; expected float16 | bfloat16 | float32")

    def replace(self, **changes) -> "MoLEConfig":
        return dataclasses.replace(self, **changes)


def mole_config_of(cfg: ModelConfig) -> MoLEConfig:
    return kind_config(cfg, "ffn", "mole", MoLEConfig)


class LUTRows(nnx.Variable):
    """Per-step lookup-table rows ``[B, T, N, d]`` of the tokens being processed (LUT mode).

    Not a parameter (no gradient, not counted as model weights): ``mole_decode.with_lut_rows``
    places the rows fetched from the host / disk LUT store here before each forward."""


class GeluMLP(nnx.Module):
    """Non-gated two-matrix MLP ``down(act(up(x)))`` (Pythia / the paper's shared expert)."""

    def __init__(self, cfg: ModelConfig, d_hidden: int, act: str, *, rngs: nnx.Rngs):
        self.act = activation(act)
        self.up_proj = make_linear(
            cfg.d_model, d_hidden, cfg=cfg, axes=("embed", "mlp"), use_bias=cfg.mlp_bias, rngs=rngs
        )
        self.down_proj = make_linear(
            d_hidden, cfg.d_model, cfg=cfg, axes=("mlp", "embed"), use_bias=cfg.mlp_bias, rngs=rngs
        )

    def __call__(self, x_BTD):
        return self.down_proj(self.act(self.up_proj(x_BTD)))


def experts_forward(n_XD: jax.Array, up_NDF: jax.Array, down_NFD: jax.Array, act: str, dtype) -> jax.Array:
    """All N routed experts on the same input: ``[..., D] -> [..., N, D]`` (pure function;
    shared by the training-mode FFN and the LUT builder so both compute the same numbers)."""
    f = activation(act)
    h = jnp.einsum("...d,ndf->...nf", n_XD.astype(dtype), up_NDF.astype(dtype))
    return jnp.einsum("...nf,nfd->...nd", f(h), down_NFD.astype(dtype))


def mixed_experts_forward(
    n_XD: jax.Array, g_XN: jax.Array, up_NDF: jax.Array, down_NFD: jax.Array, act: str, dtype
) -> jax.Array:
    """``Σ_j g_j · E_j(n)`` without materialising the N expert outputs ``[..., N, D]``.

    Exact rewrite used by the training-mode FFN: ``Σ_j g_j W_down^j f(W_up^j n)
    = [g ⊗ f(W_up n)] · W_down`` with ``W_up`` flattened to ``[D, N·F]`` and ``W_down`` to
    ``[N·F, D]``: two plain GEMMs instead of two expert-batched einsums plus an ``[X, N, D]``
    intermediate (on XLA:CPU the batched form ran ~3× slower per FLOP). Same math as
    ``experts_forward`` followed by the gate-weighted sum (only the summation order differs)."""
    N, D, F = up_NDF.shape
    f = activation(act)
    h = jnp.dot(n_XD.astype(dtype), up_NDF.astype(dtype).transpose(1, 0, 2).reshape(D, N * F))
    a = f(h).reshape(*h.shape[:-1], N, F) * g_XN.astype(dtype)[..., None]
    return jnp.dot(a.reshape(*h.shape[:-1], N * F), down_NFD.astype(dtype).reshape(N * F, D))


def unique_rows(ids_X: jax.Array, max_unique: int):
    """Static-size dedup of token ids: ``(n_unique, rep_U, slot_X)`` with ``rep_U`` a position
    holding each distinct id (slots ≥ n_unique point at position 0) and ``slot_X`` the slot of
    every position, so ``ids[rep_U][slot_X] == ids`` whenever ``n_unique <= max_unique``."""
    ids_X = jnp.asarray(ids_X)  # a numpy input indexed by a traced order would fail under scan
    X = ids_X.shape[0]
    order_X = jnp.argsort(ids_X)
    sorted_X = ids_X[order_X]
    new_X = jnp.concatenate([jnp.ones((1,), bool), sorted_X[1:] != sorted_X[:-1]])
    slot_sorted = jnp.cumsum(new_X.astype(jnp.int32)) - 1
    slot_X = jnp.zeros((X,), jnp.int32).at[order_X].set(slot_sorted)
    rep_U = (
        jnp.zeros((max_unique,), jnp.int32)
        .at[jnp.where(new_X, slot_sorted, max_unique)]
        .set(order_X.astype(jnp.int32), mode="drop")
    )
    return slot_sorted[-1] + 1, rep_U, jnp.minimum(slot_X, max_unique - 1)


def dedup_mixed_experts(n_GXD, ids_GX, g_GXN, up_NDF, down_NFD, act: str, dtype, max_unique: int) -> jax.Array:
    """``Σ_j g_j · E_j(n)`` computing the experts once per distinct token id *within each of G
    row groups* (``n`` must be a function of the id, as the normed embedding is): inputs carry a
    leading group axis ``[G, X, ...]``. The groups are the batch's shards on the mesh, so the
    sort and the gathers stay on each device (one global dedup over a sharded batch would gather
    the whole batch and hold a [V, N·F] hidden on every chip). Falls back to
    ``mixed_experts_forward`` on all rows when any group has more than ``max_unique`` ids."""
    n_unique_G, rep_GU, slot_GX = jax.vmap(lambda ids: unique_rows(ids, max_unique))(ids_GX)

    def dedup(n_GXD, g_GXN, up, down):
        # up-projection + GELU once per distinct id ([G, U, N·F]); the gate-weighted
        # down-projection stays one GEMM over all rows (a per-expert [U, N, D] output would need N
        # small GEMMs)
        N, D, F = up.shape
        n_GUD = jnp.take_along_axis(n_GXD, rep_GU[..., None], axis=1)
        h_GUF = jnp.dot(n_GUD.astype(dtype), up.astype(dtype).transpose(1, 0, 2).reshape(D, N * F))
        a_GXF = jnp.take_along_axis(activation(act)(h_GUF), slot_GX[..., None], axis=1)
        a_GXNF = a_GXF.reshape(*slot_GX.shape, N, F) * g_GXN.astype(dtype)[..., None]
        return jnp.dot(a_GXNF.reshape(*slot_GX.shape, N * F), down.astype(dtype).reshape(N * F, D))

    def full(n_GXD, g_GXN, up, down):
        return mixed_experts_forward(n_GXD, g_GXN, up, down, act, dtype).astype(dtype)

    # one predicate for all groups: a per-group cond under vmap would run both branches
    return jax.lax.cond(jnp.all(n_unique_G <= max_unique), dedup, full, n_GXD, g_GXN, up_NDF, down_NFD)


class RoutedExperts(nnx.Module):
    """N stacked non-gated GELU experts (weights ``up [N, D, F]``, ``down [N, F, D]``)."""

    def __init__(self, cfg: ModelConfig, n_experts: int, d_expert: int, act: str, *, rngs: nnx.Rngs):
        pdt = jnp.dtype(cfg.param_dtype)
        init = jax.nn.initializers.normal(0.02)
        self.act, self.dtype = act, jnp.dtype(cfg.dtype)
        self.up = nnx.Param(
            init(rngs.params(), (n_experts, cfg.d_model, d_expert), pdt), logical_axes=("expert", "embed", "expert_mlp")
        )
        self.down = nnx.Param(
            init(rngs.params(), (n_experts, d_expert, cfg.d_model), pdt), logical_axes=("expert", "expert_mlp", "embed")
        )

    def __call__(self, n_BTD):
        return experts_forward(n_BTD, self.up[...], self.down[...], self.act, self.dtype)


class MoLEFFN(nnx.Module):
    """The MoLE feed-forward block (see the module docstring for the equations)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        m = mole_config_of(cfg)
        self.n_experts, self.mode = int(m.n_experts), m.mode
        self.dedup_fraction, self.vocab_size = float(m.dedup_fraction), cfg.vocab_size
        self.d_model = cfg.d_model
        self.dtype = jnp.dtype(cfg.dtype)
        self.shared = GeluMLP(cfg, m.d_shared or cfg.d_ff, m.activation, rngs=rngs)
        if self.n_experts:
            self.router = nnx.Param(
                jax.nn.initializers.normal(0.02)(
                    rngs.params(), (cfg.d_model, self.n_experts), jnp.dtype(cfg.param_dtype)
                ),
                logical_axes=("embed", None),
            )
        else:
            self.router = None
        if self.n_experts and self.mode == "train":
            self.expert_norm = RMSNorm(cfg.d_model, cfg=cfg, axis_name="embed")
            self.experts = RoutedExperts(cfg, self.n_experts, m.d_expert or cfg.d_ff, m.activation, rngs=rngs)
        else:
            self.expert_norm = self.experts = None
        # LUT mode reads this step's rows from ``lut_rows``, written before the layers run by
        # ``mole_decode.with_lut_rows`` (``lut_forward`` / the ``LUTServing`` wrapper, which fetches
        # all layers' rows of the step's ids with ONE host callback per forward).
        self.lut_rows = LUTRows(jnp.zeros((0,), jnp.float32)) if (self.n_experts and self.mode == "lut") else None

    def gates(self, u_BTD: jax.Array) -> jax.Array:
        """g = softmax(u · R) over all N experts, in float32: ``[B, T, N]``."""
        # HIGHEST: a true fp32 matmul on accelerators too (TF32 / bf16 passes would not be "fp32")
        logits = jnp.dot(
            u_BTD.astype(jnp.float32), self.router[...].astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
        )
        return jax.nn.softmax(logits, axis=-1)

    def expert_outputs(self, embed_BTD: jax.Array) -> jax.Array:
        """E_lj(RMSNorm_l(e)) for all j: ``[B, T, N, D]`` (training mode only)."""
        return self.experts(self.expert_norm(embed_BTD))

    def __call__(self, x_BTD, ctx: ForwardContext):
        y = self.shared(x_BTD)
        if not self.n_experts:
            return y, {}
        B, T, _ = x_BTD.shape
        g_BTN = self.gates(x_BTD).astype(self.dtype)
        if self.mode == "train":
            embed_BTD, token_ids_BT = ctx.embed_BTD, ctx.token_ids_BT
            if embed_BTD is None:
                raise ValueError("MoLE FFN needs the embedding-layer output (ForwardContext.embed_BTD)")
            ex = self.experts
            n_BTD = self.expert_norm(embed_BTD)
            G = sharding.batch_shards(B)  # dedup per batch shard: device-local (see dedup_mixed_experts)
            X, D = B * T // G, self.d_model
            max_unique = min(int(self.dedup_fraction * X), self.vocab_size or X)
            if token_ids_BT is not None and 0 < max_unique < X:
                mix = dedup_mixed_experts(
                    n_BTD.reshape(G, X, D),
                    token_ids_BT.reshape(G, X),
                    g_BTN.reshape(G, X, -1),
                    ex.up[...],
                    ex.down[...],
                    ex.act,
                    ex.dtype,
                    max_unique,
                ).reshape(B, T, D)
            else:
                mix = mixed_experts_forward(n_BTD, g_BTN, ex.up[...], ex.down[...], ex.act, ex.dtype)
            return y + mix.astype(y.dtype), {}
        else:
            e_BTND = self.lut_rows[...]
            want = (B, T, self.n_experts, self.d_model)
            if tuple(e_BTND.shape) != want:
                raise ValueError(
                    f"MoLE FFN in LUT mode: lut_rows has shape {tuple(e_BTND.shape)}, expected {want} "
                    "([B, T, N, d] for the tokens of this call). Fill it with "
                    "pallasite.inference.mole_decode.with_lut_rows, lut_forward or serve_with_store before the forward."
                )
        mix = jnp.einsum("btn,btnd->btd", g_BTN, e_BTND.astype(self.dtype))
        return y + mix, {}


FFN.register("mole", MoLEFFN, config=MoLEConfig)


# ----------------------------------------------------------------------------- variants
def expert_variant_fields(
    kind: str, d_ff: int, *, moe_width: str = "equal_params", top_k: int = 2, moe_gated: bool = False
) -> dict:
    """ModelConfig fields (ffn / moe / mole / d_ff / hidden_act) of one variant of the paper's
    comparison for a dense FFN width ``d_ff`` = D_s: dense (MoLE with N = 0: non-gated GELU),
    moleN, moeN (top-k exact-GELU experts), dense_glu (gated control).

    MoE experts: ``moe_gated=False`` (default, the paper's Table 2) → non-gated two-matrix MLPs of
    width D_s/k (D_s/2 at top-2: k·2·d·D_s/k = the dense FFN's activated parameters, with either
    ``moe_width``). ``moe_gated=True`` → SwiGLU-form experts (the HF families' form) of width
    D_s/(1.5k) for equal activated parameters (``moe_width="equal_params"``) or D_s/2 literally
    (``"paper"``, 1.5× the activated parameters). Used by configs/experts and benchmarks/experts
    (kept here so neither needs the other)."""
    if kind == "dense":
        return dict(ffn="mole", ffn_config=dict(n_experts=0))
    if kind == "dense_glu":  # control: the core's gated FFN (GeGLU) at the dense model's activated params
        return dict(ffn="dense", hidden_act="gelu_exact", d_ff=max(1, round(d_ff * 2 / 3)))
    if kind.startswith("mole"):
        return dict(ffn="mole", ffn_config=dict(n_experts=int(kind[4:])))
    if kind.startswith("moe"):
        if moe_width not in ("equal_params", "paper"):
            raise ValueError(f"moe_width={moe_width!r}; expected equal_params | paper")
        if not moe_gated:
            width = max(1, d_ff // top_k) if moe_width == "equal_params" else d_ff // 2
        else:  # k SwiGLU experts of width D_s/(1.5k) activate 2·d·D_s parameters, like the dense FFN
            width = max(1, round(d_ff * 2 / (3 * top_k))) if moe_width == "equal_params" else d_ff // 2
        return dict(
            ffn="moe",
            hidden_act="gelu_exact",
            ffn_config=dict(
                num_experts=int(kind[3:]),
                top_k=top_k,
                d_expert=width,
                norm_topk_prob=True,
                gated=moe_gated,
                lb_loss_coef=0.01,
                z_loss_coef=0.001,
            ),
        )
    raise ValueError(f"unknown expert variant {kind!r}; expected dense | dense_glu | moleN | moeN")


# ----------------------------------------------------------------------------- accounting
def activated_ffn_params(cfg: ModelConfig) -> int:
    """Per-layer FFN parameters touched per token at inference (paper's "activated"):
    shared FFN + router; the experts are lookups (0 FLOPs, 0 resident parameters)."""
    m = mole_config_of(cfg)
    ds = m.d_shared or cfg.d_ff
    return 2 * cfg.d_model * ds + (cfg.d_model * m.n_experts if m.n_experts else 0)


def lut_bytes_per_token(cfg: ModelConfig, itemsize: int = 2) -> int:
    """Bytes of LUT moved to the device per processed token: L · N · d · itemsize."""
    m = mole_config_of(cfg)
    return cfg.n_layers * m.n_experts * cfg.d_model * itemsize
