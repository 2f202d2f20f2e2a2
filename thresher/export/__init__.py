"""Exports of thresher checkpoints to other runtimes' formats (GGUF for llama.cpp and Ollama)."""

from thresher.export.gguf import (
                                  GGUF_TYPES,
                                  GGUFExport,
                                  dequantize_gguf,
                                  export_gguf,
                                  gguf_importance,
)
from thresher.export.imatrix import ImportanceMatrix, compute_importance

__all__ = ["GGUF_TYPES", "GGUFExport", "ImportanceMatrix", "compute_importance", "dequantize_gguf",
           "export_gguf", "gguf_importance"]
