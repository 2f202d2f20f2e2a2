"""Exports of thresher checkpoints to other runtimes' formats (GGUF for llama.cpp and Ollama)."""

from thresher.export.gguf import (
    GGUF_TYPES,
    HANDOFF,
    QUANTIZED,
    REQUANTIZED,
    GGUFExport,
    check_gguf_architecture,
    check_gguf_widths,
    dequantize_gguf,
    export_gguf,
    gguf_importance,
    gguf_route,
)
from thresher.export.imatrix import ImportanceMatrix, compute_importance

__all__ = ["GGUF_TYPES", "HANDOFF", "QUANTIZED", "REQUANTIZED", "GGUFExport", "ImportanceMatrix",
           "check_gguf_architecture", "check_gguf_widths", "compute_importance",
           "dequantize_gguf", "export_gguf", "gguf_importance", "gguf_route"]
