"""Quantization: RTN, GPTQ, AWQ, NF4; the sequential calibration driver; checkpoint formats."""
