"""The merge stage (M-SMoE and HC-SMoE) on random-init models of every MoE family and on the
trained tiny demo model: standard checkpoints with fewer experts that transformers loads and the
serving engine decodes like thresher's loader, built from the routing the model really does."""

import json
import json.decoder

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import CALIBRATION_FILE, build_random_model
from thresher.data.windows import calibration_windows
from thresher.errors import CompressionError
from thresher.formats.artifact import MERGE_REPORT
from thresher.models import get_adapter, load_model, load_tokenizer, save_model
from thresher.models.checkpoint import CheckpointReader
from thresher.models.layerwise import LayerwiseModel
from thresher.models.random_init import MOE_FAMILIES
from thresher.prune.hcsmoe import agglomerate, lead_by_frequency
from thresher.prune.merge import align_to_leader
from thresher.prune.merge_api import merge_model
from thresher.prune.merge_observer import observe_for_merge
from thresher.prune.msmoe import group_around_leaders
from thresher.recipe import CalibrationConfig, FilesSource, MergeStage
from thresher.serve_kernels import LLM, SamplingParams

CAL = CalibrationConfig(source=FilesSource(files=[CALIBRATION_FILE]), samples=4, seq_len=32)
PROMPTS = [[5, 17, 300, 42, 9, 77], [1023, 4000, 12, 3, 250], [61, 8, 99, 1500, 31, 7, 2, 640]]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
METHODS = ("m_smoe", "hc_smoe")


@pytest.fixture
def saved_family(tmp_path, tiny_tokenizer):
    """A saved random-init model of a family, with the demo tokenizer (for calibration text)."""

    def make(family: str, **kw):
        model = build_random_model(family, num_layers=2, vocab_size=len(tiny_tokenizer), **kw)
        path = tmp_path / f"{family}-base"
        save_model(model, tiny_tokenizer, path)
        return model, path

    return make


def greedy_transformers(path, prompts) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path).eval()  # plain transformers
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens,
                               min_new_tokens=GREEDY.max_tokens, do_sample=False
                               )[0, len(p):].tolist() for p in prompts]


def expert_matrices(model, layer: int, e: int) -> torch.Tensor:
    adapter = get_adapter(model.config)
    experts = adapter.experts(adapter.layers(model)[layer])
    return torch.cat([experts.gate_up_proj.data[e].flatten(), experts.down_proj.data[e].flatten()])


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_merged_checkpoint_loads_in_transformers_and_serves_like_it(family, method, saved_family,
                                                                    tmp_path):
    model, base = saved_family(family)
    out = tmp_path / "merged"
    if family == "gpt_oss" and method == "m_smoe":  # biases beside the fused experts: refused
        with pytest.raises(CompressionError, match="merge with permute: false"):
            merge_model(base, MergeStage(method=method, ratio=0.5), CAL, out, show_progress=False)
        return
    report = merge_model(base, MergeStage(method=method, ratio=0.5), CAL, out, show_progress=False)

    adapter = get_adapter(model.config)
    config = AutoConfig.from_pretrained(out)
    assert adapter.num_experts(config) == 4 and adapter.top_k(config) == 2
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    for r in report.layers:
        i, groups = r.layer, r.groups
        layer, orig = adapter.layers(merged)[i], adapter.layers(model)[i]
        assert sorted(e for g in groups for e in g) == list(range(8)) and len(groups) == 4
        # router: one row per group, its leader's (the most routed member)
        counts = r.tokens_routed
        assert all(counts[g[0]] == max(counts[e] for e in g) for g in groups)
        torch.testing.assert_close(adapter.router(layer).weight.data,
                                   adapter.router(orig).weight.data[[g[0] for g in groups]])
        assert adapter.experts(layer).gate_up_proj.shape[0] == 4
        experts = adapter.experts(orig)
        for pos, g in enumerate(groups):
            w = torch.tensor([counts[e] for e in g], dtype=torch.float64)
            w = w / w.sum() if w.sum() > 0 else torch.full_like(w, 1 / len(g))
            parts = [(experts.gate_up_proj.data[e], experts.down_proj.data[e]) for e in g]
            if method == "m_smoe":  # members' neurons aligned to the leader's, then averaged
                parts = [parts[0]] + [align_to_leader(parts[0], p) for p in parts[1:]]
            want = sum(wj * torch.cat([gu.flatten(), d.flatten()]).double()
                       for wj, (gu, d) in zip(w, parts, strict=True))
            torch.testing.assert_close(expert_matrices(merged, i, pos), want.float())
    saved = json.loads((out / MERGE_REPORT).read_text())
    assert saved["method"] == method and saved["metrics"]["experts_kept"] == 4.0
    llm = LLM(out, dtype="float32")
    assert [layer.mlp.router.out_features for layer in llm.engine.runner.model.layers
            if hasattr(layer.mlp, "router")] == [4] * len(report.layers)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == greedy_transformers(out, PROMPTS)


@pytest.mark.parametrize("method", METHODS)
def test_merging_every_expert_with_itself_reproduces_the_model(method, saved_family, tmp_path):
    _, base = saved_family("qwen2_moe")  # the shared expert rides along untouched
    out = tmp_path / "same"
    report = merge_model(base, MergeStage(method=method, keep=8, permute=True), CAL, out,
                         show_progress=False)
    assert all(layer.groups == [[e] for e in range(8)] for layer in report.layers)
    before, after = CheckpointReader(base), CheckpointReader(out)
    assert sorted(before.tensor_names()) == sorted(after.tensor_names())
    for name in before.tensor_names():
        assert torch.equal(before.get(name), after.get(name)), name


def test_frequencies_and_logit_similarity_come_from_the_models_routing(saved_family,
                                                                       tiny_tokenizer):
    model, base = saved_family("qwen3_moe")
    windows = calibration_windows(tiny_tokenizer, CAL)
    stats = observe_for_merge(LayerwiseModel(base), windows, mean_outputs=True,
                              show_progress=False)
    with torch.no_grad():
        logits = model(windows, output_router_logits=True).router_logits  # per layer [T, E]
    for s, layer_logits in zip(stats, logits, strict=True):
        chosen = torch.topk(layer_logits, 2, dim=-1).indices.flatten()
        assert s.count.tolist() == torch.bincount(chosen, minlength=8).tolist()
        col = layer_logits.double()
        cos = torch.nn.functional.cosine_similarity(col.T[:, None], col.T[None], dim=-1)
        torch.testing.assert_close(s.logit_similarity(), cos)
        # M-SMoE: the 4 most routed experts lead; the others join their most similar leader
        groups = group_around_leaders(s.frequency(), s.logit_similarity(), 4)
        leaders = sorted(torch.argsort(-s.count, stable=True)[:4].tolist())
        assert [g[0] for g in groups] == leaders
        for g in groups:
            for e in g[1:]:
                assert cos[e, g[0]] == cos[e, leaders].max()
    # HC-SMoE's mean outputs: every expert on every token of the layer's MoE input
    layer = get_adapter(model.config).layers(model)[0]
    captured = []
    handle = layer.mlp.register_forward_pre_hook(lambda _m, a: captured.append(a[0]))
    with torch.no_grad():
        model(windows)
        handle.remove()
        x = captured[0].reshape(-1, captured[0].shape[-1])
        adapter = get_adapter(model.config)
        want = torch.stack([adapter.expert_forward(layer, e, x).double().mean(0) for e in range(8)])
    torch.testing.assert_close(stats[0].mean_outputs(), want, rtol=1e-4, atol=1e-6)


def test_agglomerative_clustering_by_linkage():
    points = torch.tensor([[0.0], [1.0], [2.2], [10.0], [11.0], [30.0]])
    assert agglomerate(points, 3) == [[0, 1, 2], [3, 4], [5]]
    # a chain: single linkage follows it, complete linkage stops where the span grows
    chain = torch.tensor([[0.0], [1.0], [2.0], [3.0], [4.5], [9.0]])
    assert agglomerate(chain, 2, "single") == [[0, 1, 2, 3, 4], [5]]
    assert agglomerate(chain, 3, "complete") == [[0, 1], [2, 3, 4], [5]]
    freq = torch.tensor([0.1, 0.3, 0.2, 0.0, 0.4, 0.0])
    assert lead_by_frequency([[0, 1, 2], [3, 4], [5]], freq) == [[1, 0, 2], [4, 3], [5]]


def test_neuron_alignment_undoes_a_permutation_and_merges_twins_exactly():
    torch.manual_seed(0)
    gate_up, down = torch.randn(2 * 16, 32), torch.randn(32, 16)
    perm = torch.randperm(16)
    twin = (torch.cat([gate_up[:16][perm], gate_up[16:][perm]]), down[:, perm])
    aligned = align_to_leader((gate_up, down), twin)
    assert torch.equal(aligned[0], gate_up) and torch.equal(aligned[1], down)


def test_merge_refuses_what_does_not_fit_the_model(saved_family, tmp_path):
    _, base = saved_family("mixtral")
    with pytest.raises(CompressionError, match="fewer than the 2 each token is routed to"):
        merge_model(base, MergeStage(keep=1), CAL, tmp_path / "a", show_progress=False)
    with pytest.raises(CompressionError, match="exceeds the 8 experts"):
        merge_model(base, MergeStage(keep=9), CAL, tmp_path / "b", show_progress=False)
    with pytest.raises(CompressionError, match="merges none"):
        merge_model(base, MergeStage(ratio=0.1), CAL, tmp_path / "c", show_progress=False)
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("stage", [MergeStage(method="m_smoe", ratio=0.5),
                                   MergeStage(method="hc_smoe", ratio=0.5, router="average",
                                              linkage="complete")],
                         ids=["m_smoe", "hc_smoe-average-complete"])
def test_trained_tiny_demo_merges_evaluates_and_serves(tiny_demo, tmp_path, stage):
    from thresher.evaluate.perplexity import heldout_perplexity
    from thresher.recipe import PerplexityConfig

    cal = CalibrationConfig(source=FilesSource(files=[json.decoder.__file__]), samples=8,
                            seq_len=64)
    out = tmp_path / "merged"
    report = merge_model(tiny_demo, stage, cal, out, show_progress=False)
    assert report.metrics()["merged_routed_share"] > 0
    merged = load_model(out)
    adapter = get_adapter(merged.config)
    assert adapter.num_experts(merged.config) == 4
    if stage.router == "average":  # each row: the frequency-weighted mean of its group's rows
        base = load_model(tiny_demo)
        layer = report.layers[0]
        total = sum(layer.tokens_routed[e] for e in layer.groups[0])
        want = sum(layer.tokens_routed[e] / total * adapter.router(
            adapter.layers(base)[0]).weight.data[e].double() for e in layer.groups[0])
        torch.testing.assert_close(adapter.router(adapter.layers(merged)[0]).weight.data[0],
                                   want.float())
    ppl = heldout_perplexity(merged, PerplexityConfig(seq_len=64, max_windows=4),
                             tokenizer=load_tokenizer(out))
    assert 1.0 < ppl.perplexity < 1e4
    llm = LLM(out, dtype="float32")
    with torch.no_grad():
        want = [merged.generate(torch.tensor([p]), max_new_tokens=GREEDY.max_tokens,
                                min_new_tokens=GREEDY.max_tokens, do_sample=False
                                )[0, len(p):].tolist() for p in PROMPTS]
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
