"""Checkpoint layouts that other tools load: GPTQ v1 ``gptq``, AWQ ``gemm``, bitsandbytes NF4."""
