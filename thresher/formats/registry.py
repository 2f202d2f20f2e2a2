"""The checkpoint formats thresher writes and reads, by the name a method's ``format`` and an
artifact's ``PackedFormat.kind`` use: GPTQ v1 ``gptq``, AWQ ``gemm``, bitsandbytes NF4.

Which method writes which format is the method's own ``format``, in ``thresher.compress.methods``.
"""

from __future__ import annotations

from thresher.errors import ArtifactError
from thresher.formats.awq import AWQ
from thresher.formats.base import CheckpointFormat
from thresher.formats.gptq import GPTQ
from thresher.formats.nf4 import NF4

FORMATS: dict[str, CheckpointFormat] = {f.kind: f for f in (GPTQ, AWQ, NF4)}


def format_for(kind: str) -> CheckpointFormat:
    """The format named ``kind``."""
    try:
        return FORMATS[kind]
    except KeyError:
        raise ArtifactError(f"checkpoint format {kind!r}: thresher reads and writes "
                            f"{', '.join(FORMATS)}") from None
