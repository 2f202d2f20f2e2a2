"""What files an artifact directory holds, by name: the one place those names are spelled.

A stage output or published artifact is a Hugging Face checkpoint plus thresher's own files: the
manifest, the report of the stage that made it, and (in the store) the marker of a finished
entry. A flow run's comparison report is a directory of its own. Writers and readers (the flow,
the report, the loader) import the names from here, so they cannot drift apart.
"""

from __future__ import annotations

MANIFEST = "thresher.json"
"""Recipe, lineage, metrics, library versions and the sha256 of every file (published artifacts)."""

MODEL_CARD = "README.md"
"""A published artifact's model card, written when standard runtimes cannot load it (per-layer
expert counts): it says which runtimes can."""

PRUNE_REPORT = "prune_report.json"
"""Per-layer REAP saliency and the experts removed (written beside a pruned checkpoint)."""

QUANTIZE_REPORT = "quantize_report.json"
"""Per-matrix quantization errors and timings (written beside a quantized checkpoint)."""

MERGE_REPORT = "merge_report.json"
"""Per-layer expert groups, their leaders and routed-token counts (beside a merged checkpoint)."""

STAGE_REPORTS = (PRUNE_REPORT, MERGE_REPORT, QUANTIZE_REPORT)

TASK_SAMPLES = "task_samples.json"
"""Per-document task scores of a variant, ``{"<task>/<metric>": [score by doc id]}`` (a run
artifact the comparison report pairs with the base's)."""

WINDOW_NLL = "window_nll.json"
"""Per-window mean NLL of a variant on the held-out windows, ``{"perplexity": [...],
"gguf/<type>": [...]}`` (its own and its GGUF files'): the comparison report pairs them with the
base's for the interval of the perplexity change."""

GGUF_SOURCE = "source.json"
"""In a published ``<variant>.gguf/`` directory: what its files were made from (the artifact's
content hash, the GGUF options) and how each file was written and measured."""

STORE_COMPLETE = ".thresher-complete.json"
"""Marks a finished entry of the artifact store; holds its key, content hash and stage metrics."""

# The comparison report of a flow run (``thresher.evaluate.report``).
COMPARISON_MD = "comparison.md"
COMPARISON_HTML = "comparison_table.html"
REPORT_HTML = "report.html"
REPORT_DATA = "report_data.json"
REPORT_ARTIFACT_PATH = "comparison"
"""The folder of the parent MLflow run that holds the comparison report."""

DEMO_MODEL_META = "demo_model.json"
"""Spec, training time and final loss of a demo model (beside its checkpoint)."""

PROVENANCE = (MANIFEST, *STAGE_REPORTS, DEMO_MODEL_META)
"""Files that record how an artifact was made (input path, wall time, peak memory), not what it
computes: its content hash leaves them out, so an artifact computed again (a store entry damaged
or removed) gets the hash it had, and the stages downstream of it keep their store keys."""
