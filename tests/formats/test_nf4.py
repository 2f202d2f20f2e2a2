"""NF4 without bitsandbytes: the pure-torch read path against bitsandbytes' own, bit for bit."""

import subprocess
import sys

import bitsandbytes.functional as bnbf
import pytest
import torch

from thresher.formats.nf4 import STATE_KEY, NF4Weight, pack_nf4, unpack_nf4

SHAPES = [(64, 128), (33, 66)]  # 33 * 66 is not a multiple of the 64-element block


def bnb_quantized(shape: tuple[int, int], dtype: torch.dtype, double_quant: bool, seed: int):
    w = (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)
    return bnbf.quantize_4bit(w, blocksize=64, compress_statistics=double_quant, quant_type="nf4",
                              quant_storage=torch.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("double_quant", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_dequantize_is_bit_identical_to_bitsandbytes(dtype, double_quant, shape):
    for seed in range(3):
        packed, state = bnb_quantized(shape, dtype, double_quant, seed)
        expected = bnbf.dequantize_4bit(packed, state, quant_type="nf4")
        weight = NF4Weight.from_quant_state(packed, state)
        assert torch.equal(weight.dequantize(), expected.float())
        assert torch.equal(unpack_nf4(pack_nf4(weight)).dequantize(), expected.float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("double_quant", [False, True])
def test_pack_writes_bitsandbytes_bytes_and_unpack_round_trips(dtype, double_quant):
    packed, state = bnb_quantized((48, 96), dtype, double_quant, seed=1)
    ours = pack_nf4(NF4Weight.from_quant_state(packed, state))
    theirs = {"weight": packed, **{f"weight.{k}": v for k, v in state.as_dict(packed=True).items()}}
    assert list(ours) == list(theirs)
    for key in theirs:
        assert ours[key].dtype == theirs[key].dtype and torch.equal(ours[key], theirs[key]), key
    again = pack_nf4(unpack_nf4(ours))
    assert list(again) == list(ours)
    assert all(torch.equal(again[k], ours[k]) for k in ours)
    assert STATE_KEY in ours


def test_reading_nf4_does_not_import_bitsandbytes(tmp_path):
    packed, state = bnb_quantized((32, 64), torch.bfloat16, True, seed=2)
    path = tmp_path / "w.pt"
    torch.save(pack_nf4(NF4Weight.from_quant_state(packed, state)), path)
    code = ("import sys, torch; from thresher.formats.nf4 import unpack_nf4; "
            f"w = unpack_nf4(torch.load({str(path)!r})); w.dequantize(); "
            "assert 'bitsandbytes' not in sys.modules, 'bitsandbytes was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
