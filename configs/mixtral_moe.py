"""Mixtral-style MoE with expert parallelism: the Mixtral-8x7B shape (32 layers, d 4096, 8 SwiGLU
experts of width 14336, top-2, renormalised, GQA 32/8, 32k vocab), bf16 compute over float32
master weights, remat per block, tokens routed to experts by ``shard_map`` + ``all_to_all``
with Occult dispatch (one replica per (token, device); Luo et al., ICML 2025).

Mesh: ``expert=8`` (one expert per chip group), ``fsdp`` takes the rest of the slice::

    pallasite compile --config configs/mixtral_moe.py --topology v5p:4x4x4

``arg``: ``batch=N`` (global batch, default 128 x 4096 tokens), ``seq=N``, ``dispatch=standard``,
``layers=N`` (fewer layers: a quick compile of the same per-layer layout), ``expert=N``.
"""

from pallasite.training.config import parse_arg, train_defaults


def get_config(arg=None):
    a = parse_arg(arg, batch=128, seq=4096, dispatch="occult", layers=32, expert=8)
    c = train_defaults()
    c.model = dict(family="mixtral", vocab_size=32000, d_model=4096, n_layers=a.layers, n_heads=32, n_kv_heads=8,
                   d_ff=14336, norm_eps=1e-5, rope_theta=1e6, max_seq_len=32768, tie_embeddings=False,
                   dtype="bfloat16", param_dtype="float32", remat="full", scan_layers=True, ffn="moe",
                   attention_impl="pallas",
                   ffn_config=dict(num_experts=8, top_k=2, norm_topk_prob=True, capacity_factor=1.25,
                                   dispatch=a.dispatch, lb_loss_coef=0.01, z_loss_coef=0.001),
                   bos_token_id=1, eos_token_id=(2,))
    c.tokenizer.vocab_size = 32000
    c.data.seq_len = a.seq
    c.data.batch_size = a.batch
    c.optim.lr = 3e-4
    c.optim.warmup_steps = 2000
    c.train.steps = 100_000
    c.train.loss_chunk = 8192
    c.train.eval_every = 1000
    c.train.checkpoint_every = 1000
    c.mesh.data = 1
    c.mesh.expert = a.expert
    c.mesh.fsdp = -1
    return c
