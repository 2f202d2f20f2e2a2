"""The runtime note of checkpoints that standard runtimes cannot load, and the model card."""

from transformers import AutoConfig

from thresher.formats.artifact import MODEL_CARD
from thresher.models.card import runtime_note, write_model_card


def test_only_per_layer_expert_counts_get_a_note_and_the_card_leads_with_it(tiny_demo, tmp_path):
    config = AutoConfig.from_pretrained(tiny_demo)
    assert runtime_note(config) is None  # a standard checkpoint
    config.layer_num_experts = [6, 5, 2, 3]
    note = runtime_note(config)
    assert "layer_num_experts [6, 5, 2, 3]" in note
    for runtime in ("transformers", "vLLM", "llama.cpp", "'uniform' budget"):
        assert runtime in note
    card = write_model_card(tmp_path, "v", note)
    assert card == tmp_path / MODEL_CARD
    text = card.read_text()
    assert text.startswith("# v\n") and "**Runtime compatibility:** Its MoE layers" in text
