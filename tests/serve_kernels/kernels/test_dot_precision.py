"""fp32 kernels compile to IEEE fp32 products on a GPU, as the interpreter computes them.

Triton's NVIDIA backend rounds fp32 ``tl.dot`` operands to TF32 unless told otherwise; the
interpreter that runs the kernel tests on the CPU computes true fp32, so the fp32 parity tests
would pass here and fail on hardware. Compiling each fp32 kernel for sm_80/sm_90 and reading its
PTX shows what the hardware will run.
"""

from __future__ import annotations

from tests.serve_kernels.kernels.helpers import AotSpec, aot_compile_all
from thresher.serve_kernels.kernels import attention, moe, nf4, w4a16


def test_fp32_dots_are_ieee():
    no_tf32 = {"ptx_forbids": ("tf32",)}
    specs = []
    attn = {"q_ptr": "*fp32", "k_cache_ptr": "*fp32", "v_cache_ptr": "*fp32",
            "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "cu_seqlens_q_ptr": "*i32",
            "out_ptr": "*fp32", "scale": "fp32"}
    shapes = {"HEAD_DIM": 64, "DOT_DTYPE": "tl.float32", "BLOCK_D": 64, "BLOCK_N": attention.BLOCK_N}
    specs.append(AotSpec(f"{attention.__name__}:_decode_kernel", attn,
                         {**shapes, "GROUP": 4, "BLOCK_G": 16}, **no_tf32))
    specs.append(AotSpec(f"{attention.__name__}:_prefill_kernel", attn,
                         {**shapes, "GROUP": 4, "BLOCK_M": attention.PREFILL_BLOCK_M}, **no_tf32))
    cfg = w4a16.CONFIGS["prefill"]
    gptq = {"x_ptr": "*fp32", "qweight_ptr": "*i32", "qzeros_ptr": "*i32", "scales_ptr": "*fp32",
            "g_idx_ptr": "*i32", "out_ptr": "*fp32"}
    specs.append(AotSpec(f"{w4a16.__name__}:_gptq_matmul_kernel", gptq,
                         {**cfg.constexprs, "DOT_DTYPE": "tl.float32", "SPLIT_K": cfg.split_k},
                         cfg.num_warps, cfg.num_stages, **no_tf32))
    cfg = moe.CONFIGS["prefill"]
    moe_types = {"a_ptr": "*fp32", "b_ptr": "*fp32", "scales_ptr": "*fp32", "zeros_ptr": "*i32",
                 "g_idx_ptr": "*i32", "out_ptr": "*fp32", "sorted_ids_ptr": "*i32",
                 "expert_ids_ptr": "*i32", "topk_weights_ptr": "*fp32"}
    specs.append(AotSpec(f"{moe.__name__}:_moe_matmul_kernel", moe_types,
                         {**cfg.constexprs, "FORMAT": moe.FORMATS["dense"], "MUL_WEIGHT": False,
                          "DOT_DTYPE": "tl.float32", "ROW_GROUPS": False}, cfg.num_warps,
                         cfg.num_stages, **no_tf32))
    cfg = nf4.CONFIGS["prefill"]
    specs.append(AotSpec(f"{nf4.__name__}:_nf4_matmul_kernel",
                         {"x_ptr": "*fp32", "packed_ptr": "*u8", "absmax_ptr": "*fp32",
                          "quant_map_ptr": "*fp32", "out_ptr": "*fp32"},
                         {**cfg.constexprs, "DOT_DTYPE": "tl.float32", "SPLIT_K": cfg.split_k,
                          "BLOCKSIZE": 64, "ROW_BLOCKS": True},
                         cfg.num_warps, cfg.num_stages, **no_tf32))
    aot_compile_all(specs)
