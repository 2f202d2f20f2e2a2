"""The quantization math that both ``compress`` and ``export`` build on: uniform grids, RTN, the
Hessian of a layer's inputs and its damped inverse factor, GPTQ's column loop, the NF4 codes.

It imports only torch and ``errors``: the checkpoint formats, the compressors and the GGUF
exporter all sit above it, so one copy of each piece of math serves them all.
"""
