"""Triton kernels of the serving engine, each beside a PyTorch reference of the same math.

Every public op dispatches through ``backend.use_triton``: the Triton kernel for CUDA tensors, the
reference on a CPU, ``THRESHER_KERNELS=triton|torch`` to force either.
"""
