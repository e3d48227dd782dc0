"""Training: data (corpora, packing, resumable iterator), optim (AdamW + warmup/cosine, decay
mask), step (pure jitted train step over split NNX state), checkpointing (orbax), metrics
(JSONL + TensorBoard) and loop (``train(config, workdir)``). See docs/training.md.

Submodules are imported on use so ``import pallasite.training`` stays cheap.
"""
