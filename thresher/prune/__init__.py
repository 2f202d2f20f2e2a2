"""Expert pruning: REAP and its baselines (frequency, EAN, random), and applying an expert mask.

``observer`` collects per-expert statistics layer by layer, ``saliency`` turns them into scores,
``mask`` chooses and cuts out experts, ``api.prune_model`` is the pipeline stage.
"""

from thresher.prune.api import PruneReport, prune_model
from thresher.prune.observer import ExpertStats, observe_experts

__all__ = ["ExpertStats", "PruneReport", "observe_experts", "prune_model"]
