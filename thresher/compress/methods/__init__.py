"""The quantization methods, one module each, registered by the name a recipe gives them.

Adding a method: a stage class in ``thresher.recipe`` (its knobs, discriminated by ``method``),
a module here implementing ``protocol.QuantMethod``, and one entry in ``METHODS``.
"""

from __future__ import annotations

from thresher.compress.methods.awq import AWQMethod
from thresher.compress.methods.gptq import GPTQMethod
from thresher.compress.methods.nf4 import NF4Method
from thresher.compress.methods.protocol import QuantMethod
from thresher.compress.methods.rtn import RTNMethod
from thresher.recipe import QuantizeStage

METHODS: dict[str, type[QuantMethod]] = {
    m.name: m for m in (RTNMethod, GPTQMethod, AWQMethod, NF4Method)
}


def method_for(stage: QuantizeStage) -> QuantMethod:
    """The method a stage names, set up with the stage's knobs."""
    return METHODS[stage.method](stage)

