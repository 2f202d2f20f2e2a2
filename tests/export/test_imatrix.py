"""The importance matrix against llama.cpp's definition (tools/imatrix): for every GGUF weight
tensor, the mean over calibration tokens of x_j^2 of that matmul's input; for ``ffn_*_exps`` one
vector per expert over the tokens routed to it (not weighted by the gate), the down projection's
input being act(gate x) * up x. The reference runs the whole model once with hooks on its modules
and routes and projects with the exported GGUF file's own router and expert tensors, so a wrong
layer-by-layer pass, routing, expert slice or tensor name shows up."""

from collections import defaultdict

import gguf
import numpy as np
import pytest
import torch

from tests.conftest import build_random_model
from tests.export.conftest import CAL
from thresher.data.windows import calibration_windows
from thresher.export import compute_importance, export_gguf, gguf_importance
from thresher.models import save_model
from thresher.models.loading import load_model

# GGUF role -> the module (under a decoder layer) whose input that tensor multiplies
MODULES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
           "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
           "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
           "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
           "ffn_up_shexp": "mlp.shared_expert.up_proj",
           "ffn_down_shexp": "mlp.shared_expert.down_proj"}


def _hooked_forward(model, windows) -> tuple[dict[str, np.ndarray], dict[int, torch.Tensor]]:
    """Mean squares of every dense matmul's input by GGUF name, and each MoE block's input."""
    sums: dict[str, torch.Tensor] = defaultdict(lambda: torch.zeros(()))
    counts: dict[str, int] = defaultdict(int)
    moe_in: dict[int, torch.Tensor] = {}

    def square(name):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()
            sums[name] = sums[name] + (x * x).sum(0)
            counts[name] += x.shape[0]
        return hook

    def keep(i):
        def hook(module, args):
            moe_in[i] = args[0].reshape(-1, args[0].shape[-1]).double()
        return hook

    handles = []
    for i, layer in enumerate(model.model.layers):
        for role, path in MODULES.items():
            try:
                module = layer.get_submodule(path)
            except AttributeError:
                continue
            handles.append(module.register_forward_pre_hook(square(f"blk.{i}.{role}.weight")))
        if hasattr(layer.mlp, "experts"):
            handles.append(layer.mlp.register_forward_pre_hook(keep(i)))
    if not model.config.tie_word_embeddings:  # llama.cpp's --process-output
        handles.append(model.lm_head.register_forward_pre_hook(square("output.weight")))
    with torch.no_grad():
        model(input_ids=windows)
    for h in handles:
        h.remove()
    return {name: (sums[name] / counts[name]).numpy() for name in sums}, moe_in


def _expert_reference(moe_in: dict[int, torch.Tensor], top_k: int, gguf_path
                      ) -> dict[str, list[np.ndarray | None]]:
    """Per expert, the mean squares of its inputs over the tokens the file's router sends it."""
    tensors = {t.name: torch.from_numpy(np.array(t.data)).double()
               for t in gguf.GGUFReader(gguf_path).tensors}
    ref: dict[str, list[np.ndarray | None]] = {}
    for i, x in moe_in.items():
        chosen = (x @ tensors[f"blk.{i}.ffn_gate_inp.weight"].T).topk(top_k, dim=1).indices
        gate, up = tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"]
        rows = {role: [] for role in ("gate", "up", "down")}
        for e in range(gate.shape[0]):
            xe = x[(chosen == e).any(dim=1)]
            if not len(xe):
                for r in rows.values():
                    r.append(None)
                continue
            hidden = torch.nn.functional.silu(xe @ gate[e].T) * (xe @ up[e].T)
            rows["gate"].append((xe * xe).mean(0).numpy())
            rows["up"].append((xe * xe).mean(0).numpy())
            rows["down"].append((hidden * hidden).mean(0).numpy())
        ref.update({f"blk.{i}.ffn_{role}_exps.weight": r for role, r in rows.items()})
    return ref


@pytest.mark.parametrize("source", ["demo", "qwen2_moe", "qwen3"])
def test_importance_is_llama_cpp_imatrix_of_every_tensor(source, tiny_demo, tiny_tokenizer,
                                                         tmp_path):
    """The trained tiny demo (Qwen3-MoE: attention, routed experts, tied head); a random
    Qwen2-MoE (shared expert, untied head); a random dense Qwen3 (dense MLP)."""
    model_dir = tiny_demo
    if source != "demo":
        kw = {"norm_topk_prob": False} if source == "qwen2_moe" else {}
        model_dir = tmp_path / source
        save_model(build_random_model(source, vocab_size=len(tiny_tokenizer), **kw),
                   tiny_tokenizer, model_dir)
    windows = calibration_windows(tiny_tokenizer, CAL)  # the random models share its tokenizer
    got = gguf_importance(model_dir, compute_importance(model_dir, windows=windows,
                                                        show_progress=False))

    model = load_model(model_dir).eval()
    dense, moe_in = _hooked_forward(model, windows)
    export_gguf(model_dir, tmp_path / "f32.gguf", "f32", show_progress=False)
    top_k = int(getattr(model.config, "num_experts_per_tok", 0) or 0)
    want = {name: [v] for name, v in dense.items()} | _expert_reference(moe_in, top_k,
                                                                        tmp_path / "f32.gguf")
    # every matrix but the embeddings and the routers, which llama.cpp's imatrix skips or
    # the export keeps at F32
    assert set(got) - set(want) <= {"token_embd.weight"} | {n for n in got if "gate_inp" in n}
    assert set(want) <= set(got)
    assert got["token_embd.weight"] == [None]
    roles = {name.split(".")[2] if name.startswith("blk.") else name for name in want}
    expected_roles = {"attn_q", "attn_k", "attn_v", "attn_output"} | {
        "demo": {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"},
        "qwen2_moe": {"ffn_gate_exps", "ffn_up_exps", "ffn_down_exps", "ffn_gate_shexp",
                      "ffn_up_shexp", "ffn_down_shexp", "output.weight"},
        "qwen3": {"ffn_gate", "ffn_up", "ffn_down", "output.weight"}}[source]
    assert roles == expected_roles
    for name, vectors in want.items():
        assert len(got[name]) == len(vectors), name
        for e, (g, w) in enumerate(zip(got[name], vectors, strict=True)):
            if w is None:
                assert g is None, (name, e)
                continue
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-7, err_msg=f"{name}[{e}]")
