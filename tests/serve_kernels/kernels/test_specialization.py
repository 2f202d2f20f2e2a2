"""Integer arguments that change from one serving step to the next are not specialized on.

Triton compiles a new variant of a kernel when an integer argument changes from or to 1 or in its
divisibility by 16; for the rows of a matmul, the block-table width or the split count, that means
compiles in the middle of serving (about a second each on a GPU) as batches and contexts grow.
"""

from __future__ import annotations

import pytest

from thresher.serve_kernels.kernels import attention, moe, nf4, w4a16

PER_STEP = {
    attention._decode_kernel: {"stride_bt"},
    attention._decode_split_kernel: {"stride_bt", "num_splits"},
    attention._decode_merge_kernel: {"num_splits"},
    attention._prefill_kernel: {"stride_bt"},
    moe._moe_matmul_kernel: {"num_pairs"},
    nf4._nf4_matmul_kernel: {"M"},
    w4a16._gptq_matmul_kernel: {"M"},
    w4a16._awq_matmul_kernel: {"M"},
    w4a16._grouped_matmul_kernel: {"M"},
}


def _not_specialized(kernel) -> set[str]:
    """Argument names a kernel is not specialized on (compiled JITFunction or interpreted)."""
    dns = getattr(kernel, "do_not_specialize", None)
    if dns is None:  # the interpreter's InterpretedFunction keeps the decorator's arguments
        dns = kernel.kwargs.get("do_not_specialize", ())
    return {kernel.arg_names[a] if isinstance(a, int) else a for a in dns}


@pytest.mark.parametrize("kernel", list(PER_STEP), ids=lambda k: k.fn.__name__)
def test_per_step_integers_are_not_specialized(kernel):
    assert PER_STEP[kernel] <= set(kernel.arg_names)
    assert PER_STEP[kernel] <= _not_specialized(kernel)
