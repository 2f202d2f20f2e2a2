"""Model sources, family adapters, layer-by-layer access, and checkpoint I/O."""

from thresher.models.adapters import Adapter, get_adapter, supported_model_types
from thresher.models.loading import load_model, load_tokenizer, save_model
from thresher.models.source import resolve_model

__all__ = [
    "Adapter",
    "get_adapter",
    "load_model",
    "load_tokenizer",
    "resolve_model",
    "save_model",
    "supported_model_types",
]
