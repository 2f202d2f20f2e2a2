"""Expert pruning: REAP and its baselines (frequency, EAN, weighted EAN, random), ``auto``, damage
budgets, and applying an expert mask.

``observer`` collects per-expert statistics (and probes for local errors) layer by layer,
``saliency`` turns them into scores, ``reconstruction`` measures how much removing experts changes
a layer's output, ``budget`` splits removals across layers, ``plan`` decides what each layer keeps,
``mask`` cuts experts out, ``api.prune_model`` is the pipeline stage.

Merging, the REAP paper's other baselines, sits beside it: ``merge_observer`` adds router-logit
similarities and mean expert outputs to the observation, ``msmoe`` and ``hcsmoe`` group the
experts, ``merge`` averages each group into one expert, ``merge_api.merge_model`` is the stage.
"""

from thresher.prune.api import PruneReport, prune_model
from thresher.prune.observer import ExpertStats, observe_experts

__all__ = ["ExpertStats", "PruneReport", "observe_experts", "prune_model"]
