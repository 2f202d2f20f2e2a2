"""The bundled serving engine: Triton kernels, paged KV cache, continuous batching, an OpenAI API."""
