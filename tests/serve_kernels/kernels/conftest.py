"""Run the Triton kernels on CPU tensors through Triton's interpreter when there is no GPU.

Setting ``TRITON_INTERPRET=1`` here (at conftest import, before this directory's test modules
import the kernels) makes ``@triton.jit`` build interpreted kernels. It does not have to win the
import race: if another test imported the kernel modules first, ``backend.launcher`` wraps their
compiled kernels in the interpreter at launch time, and it only looks at the variable when a
kernel is launched. With a GPU the variable is left alone and the same tests run the compiled
kernels on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
