"""Exports of thresher checkpoints to other runtimes' formats (GGUF for llama.cpp and Ollama)."""

from thresher.export.gguf import GGUF_TYPES, GGUFExport, export_gguf

__all__ = ["GGUF_TYPES", "GGUFExport", "export_gguf"]
