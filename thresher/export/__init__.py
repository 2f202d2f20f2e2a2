"""Exports of thresher checkpoints to other runtimes' formats (GGUF for llama.cpp and Ollama)."""

from thresher.export.gguf import GGUF_TYPES, GGUFExport, export_gguf
from thresher.export.imatrix import ImportanceMatrix, compute_importance

__all__ = ["GGUF_TYPES", "GGUFExport", "ImportanceMatrix", "compute_importance", "export_gguf"]
