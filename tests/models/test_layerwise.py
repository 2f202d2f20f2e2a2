import pytest
import torch

from tests.conftest import build_random_model
from thresher.models import save_model
from thresher.models.layerwise import LayerwiseModel


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "qwen2_moe", "llama", "glm4_moe",
                                    "deepseek_v3"])
def test_layerwise_matches_full_forward_one_layer_resident(family, tmp_path):
    model = build_random_model(family, num_layers=3)
    save_model(model, None, tmp_path)
    lw = LayerwiseModel(tmp_path)
    assert lw.resident_layers() == []
    lw.load_outer()
    ids = torch.randint(0, model.config.vocab_size, (2, 16))
    hidden = lw.embed(ids)
    for i in range(lw.num_layers):
        lw.load_layer(i)
        assert lw.resident_layers() == [i], "exactly one decoder layer in memory"
        hidden = lw.layer_forward(i, hidden)
        lw.release_layer(i)
        assert lw.resident_layers() == []
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    torch.testing.assert_close(lw.logits(hidden), ref, rtol=1e-4, atol=1e-4)
