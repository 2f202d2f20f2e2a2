"""The C side of the one-call CPU decode step (``cpu_step.c``): its structs and a dense matmul.

``cpu_step.c`` runs every decoder layer of a decode step in one call over a table of pointers
(``ThrModel`` holding one ``ThrLayer`` per layer, each linear a ``ThrLinear``) that
``modeling.native_step`` fills once per model. The structs here mirror the C ones field for
field. ``dense_matmul`` and ``nf4_matmul`` expose the step's 16-bit / fp32 and NF4 matmuls for
their tests and benchmarks; ``amx`` says whether its bf16 matmuls run on the matrix units (AMX),
and switches them.
"""

from __future__ import annotations

import ctypes

import torch

from thresher.serve_kernels.kernels.cpu_native import loaded

LIN_NONE, LIN_F32, LIN_BF16, LIN_Q4, LIN_NF4, LIN_Q8 = 0, 1, 2, 3, 4, 5
_ptr, _i32, _i64, _f32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class ThrLinear(ctypes.Structure):
    """One matrix: dense fp32 / bf16 row-major [n, k], cpu_q4's packed 4-bit codes or 8-bit
    codes [n, k] with their scales, or NF4 codes with bf16 absmax [n, k / group] (``sz``) and
    the 16 code values (``map``)."""

    _fields_ = [("kind", _i32), ("pad", _i32), ("n", _i64), ("k", _i64), ("group", _i64),
                ("w", _ptr), ("sz", _ptr), ("bias", _ptr), ("map", _ptr)]


class ThrLayer(ctypes.Structure):
    """One decoder layer: attention (standard or latent), norms, its cache, and a dense MLP or an
    MoE (softmax routing or a rule)."""

    _fields_ = [("qkv", ThrLinear), ("o", ThrLinear), ("in_norm", _ptr), ("post_norm", _ptr),
                ("q_norm", _ptr), ("k_norm", _ptr), ("qk_norm_full", _i32), ("pad", _i32),
                ("clip", _f32), ("pad2", _f32), ("rotary_dim", _i64), ("k_cache", _ptr),
                ("v_cache", _ptr), ("moe", _i32), ("top_k", _i32), ("experts", _i32),
                ("renorm", _i32), ("expert_bf16", _i32), ("pad3", _i32), ("router", ThrLinear),
                ("gate_up", ctypes.POINTER(ThrLinear)), ("down", ctypes.POINTER(ThrLinear)),
                ("shared_gate_up", ThrLinear), ("shared_down", ThrLinear),
                ("shared_gate", ThrLinear), ("interleave", _i32),
                # a routing rule: sigmoid or softmax scores, a selection bias, expert groups
                ("rule", _i32), ("sigmoid", _i32), ("n_group", _i32), ("topk_group", _i32),
                ("scaling", _f32), ("correction", _ptr),
                # latent attention: qkv is the down projection, q_b the query's up projection
                ("mla", _i32), ("pad4", _i32), ("heads", _i64), ("q_rank", _i64),
                ("nope", _i64), ("rank", _i64), ("v_dim", _i64), ("att_scale", _f32),
                ("pad5", _f32), ("q_b", ThrLinear), ("q_a_norm", _ptr), ("kv_a_norm", _ptr),
                ("w_kb_t", _ptr), ("w_vb", _ptr),
                # gpt-oss: sinks and a window; top-k logits softmaxed; clamped SwiGLU experts
                ("sinks", _ptr), ("window", _i64), ("topk_softmax", _i32), ("clamped", _i32),
                ("alpha", _f32), ("limit", _f32), ("up", ctypes.POINTER(ThrLinear)),
                # Qwen3.5: gated attention, or a Gated DeltaNet with per-sequence states
                ("gated", _i32), ("delta", _i32), ("nk", _i64), ("nv", _i64), ("dk", _i64),
                ("dv", _i64), ("taps", _i64), ("delta_eps", _f32), ("pad6", _f32),
                ("in_z", ThrLinear), ("in_b", ThrLinear), ("in_a", ThrLinear), ("conv_w", _ptr),
                ("neg_a", _ptr), ("dt_bias", _ptr), ("delta_norm", _ptr), ("conv_state", _ptr),
                ("delta_state", _ptr)]


class ThrModel(ctypes.Structure):
    """The shapes, embeddings, final norm, rotary table, layers and LM head of one model."""

    _fields_ = [("layers", _i64), ("hidden", _i64), ("hq", _i64), ("hkv", _i64), ("d", _i64),
                ("block_size", _i64), ("max_inter", _i64), ("qkv_max", _i64), ("att_max", _i64),
                ("eps", _f32), ("scale", _f32),
                ("bf16", _i32), ("pad", _i32), ("embed", _ptr), ("final_norm", _ptr),
                ("cos_sin", _ptr), ("layer", ctypes.POINTER(ThrLayer)), ("lm_head", ThrLinear)]


def amx(enabled: bool | None = None) -> bool:
    """Whether the C step's bf16 matmuls run on AMX tiles: where the CPU has them and Linux lends
    them (asked once per process). ``enabled`` False keeps the vector units (benchmarks compare
    the two; a row's bits differ between them), True asks again."""
    lib = loaded()
    if lib is None:
        return False
    return bool(lib.thr_amx(-1 if enabled is None else int(enabled)))


def dense_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 @ w.T for w [N, K] fp32 or bf16 (contiguous) -> fp32 [M, N], unrounded."""
    lib = loaded()
    assert lib is not None, "cpu_step needs thresher's C kernels (cpu_native.library())"
    assert w.dtype in (torch.float32, torch.bfloat16) and w.is_contiguous()
    x = x.float().contiguous()
    y = torch.empty(x.shape[0], w.shape[0])
    if lib.thr_dense_matmul(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(),
                            int(w.dtype == torch.bfloat16), w.shape[0], y.data_ptr()):
        raise MemoryError("cpu_step: out of memory for the activation buffer")
    return y


def nf4_matmul(x: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor, quant_map: torch.Tensor,
               blocksize: int) -> torch.Tensor:
    """x [M, K] @ W.T for an NF4 W [N, K] (``cpu_nf4.c``): ``codes`` uint8 [N * K / 2] as
    published, ``absmax`` bf16 [N, K / blocksize], ``quant_map`` fp32 [16] -> fp32 [M, N],
    unrounded (activations and absmax in bf16 inside, weights and sums in fp32)."""
    lib = loaded()
    assert lib is not None, "cpu_step needs thresher's C kernels (cpu_native.library())"
    n, k = absmax.shape[0], x.shape[1]
    assert codes.dtype == torch.uint8 and codes.numel() * 2 == n * k and absmax.dtype == torch.bfloat16
    x, quant_map = x.float().contiguous(), quant_map.float().contiguous()
    codes, absmax = codes.contiguous(), absmax.contiguous()
    y = torch.empty(x.shape[0], n)
    rc = lib.thr_nf4_matmul(x.data_ptr(), x.shape[0], k, codes.data_ptr(), absmax.data_ptr(),
                            quant_map.data_ptr(), blocksize, n, y.data_ptr())
    if rc == -2:
        raise ValueError(f"NF4 block size {blocksize} must be a multiple of 32 dividing {k}")
    if rc:
        raise MemoryError("cpu_nf4: out of memory for the activation buffer")
    return y
