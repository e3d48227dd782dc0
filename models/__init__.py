"""Models: config, NNX transformer, checkpoint import/export."""

from pallasite.models.config import ModelConfig
from pallasite.models.transformer import Transformer, abstract_model, forward, init_model

__all__ = ["ModelConfig", "Transformer", "abstract_model", "forward", "init_model"]
