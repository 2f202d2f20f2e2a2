"""The NF4 code table is the one bitsandbytes writes into every NF4 artifact's quant_map."""

import pytest
import torch

from thresher.quant.nf4 import NF4_CODES


def test_codes_are_bitsandbytes_quant_map():
    bnbf = pytest.importorskip("bitsandbytes.functional")
    _, state = bnbf.quantize_4bit(torch.randn(64, 64), blocksize=64, quant_type="nf4")
    assert torch.equal(state.code, torch.tensor(NF4_CODES, dtype=torch.float32))
    assert len(NF4_CODES) == 16 and NF4_CODES[7] == 0.0
