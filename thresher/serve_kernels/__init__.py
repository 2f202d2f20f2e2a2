"""The bundled serving engine: Triton kernels, paged KV cache, continuous batching, an OpenAI API.

``LLM(path_or_uri).generate(prompts, SamplingParams(...))`` for offline use; ``LLMEngine`` for a
server's step loop. Both load a published artifact (16-bit, GPTQ, AWQ or NF4).
"""

from thresher.serve_kernels.engine.llm_engine import LLM, LLMEngine
from thresher.serve_kernels.engine.sampling_params import (
    EngineStats,
    RequestOutput,
    SamplingParams,
)

__all__ = ["LLM", "EngineStats", "LLMEngine", "RequestOutput", "SamplingParams"]
