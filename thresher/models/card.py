"""Which runtimes can load a checkpoint, said where a user of the artifact will read it.

A damage-budget prune leaves MoE layers with different expert counts (``layer_num_experts`` in
config.json). thresher's loader, quantizers and serving engine read that list; transformers,
vLLM and llama.cpp build every layer with one ``num_experts`` and cannot load the checkpoint.
The flow warns when it publishes one and writes the note into the artifact's model card
(README.md); ``thresher prune`` and ``thresher quantize`` print it.
"""

from __future__ import annotations

from pathlib import Path

from thresher.formats.artifact import MODEL_CARD

PER_LAYER_EXPERTS_NOTE = (
    "its MoE layers keep different numbers of experts (layer_num_experts {counts}, a 'damage' "
    "budget prune): thresher loads, quantizes, evaluates and serves it, but plain transformers "
    "(from_pretrained), vLLM and GGUF/llama.cpp hold one expert count per model and cannot load "
    "it; a 'uniform' budget writes a standard checkpoint")


def runtime_note(config) -> str | None:
    """Why standard runtimes cannot load a checkpoint with this config (None when they can)."""
    counts = getattr(config, "layer_num_experts", None)
    return PER_LAYER_EXPERTS_NOTE.format(counts=list(counts)) if counts else None


def write_model_card(path: str | Path, name: str, note: str) -> Path:
    """A README.md for artifact ``path`` that leads with ``note`` (what loads it, what does not)."""
    card = Path(path) / MODEL_CARD
    card.write_text(f"# {name}\n\nA checkpoint compressed by thresher.\n\n"
                    f"**Runtime compatibility:** {note[0].upper()}{note[1:]}.\n\n"
                    "Load it with thresher: `thresher perplexity --model DIR`, "
                    "`thresher serve DIR`, or `thresher.models.load_model(DIR)`; the recipe, "
                    "lineage and metrics are in thresher.json.\n")
    return card


def write_gguf_card(path: str | Path, variant: str, files: list[dict],
                    variant_perplexity: float | None) -> Path:
    """The README.md of a variant's GGUF directory: how each file was made and, where its weights
    differ from the variant's (a rounding the variant did not have), their measured perplexity
    beside the variant's own. ``files``: ``{"file", "type", "how", "perplexity"?, "imatrix"?}``
    with ``how`` one of thresher.export's HANDOFF, QUANTIZED, REQUANTIZED."""
    own = f"{variant_perplexity:.3f}" if variant_perplexity is not None else "not measured"
    lines = [f"# {variant} (GGUF)", "", "GGUF files of the thresher variant "
             f"`{variant}` for llama.cpp and Ollama. The variant's own perplexity on the recipe's "
             f"evaluation text: {own}.", ""]
    for f in files:
        weighted = " weighted by an importance matrix from the recipe's calibration windows" \
            if f.get("imatrix") else ""
        if f["how"] == "hand-off":
            text = ("the variant's 4-bit codes and group scales handed to Q4_1 blocks as they "
                    "are: the same weights as the variant (its zero points kept as fp16 minima)")
        elif f["how"] == "requantized":
            text = (f"**a second rounding**: the variant's quantized weights were dequantized and "
                    f"rounded again into {f['type']} blocks{weighted}, so these are not the "
                    "variant's weights; they were evaluated by thresher: perplexity "
                    f"{f['perplexity']:.3f} on the same text (the variant: {own})")
        else:
            text = (f"the variant's 16/32-bit weights rounded into {f['type']} blocks{weighted}; "
                    f"perplexity of these weights {f['perplexity']:.3f} on the same text (the variant: "
                    f"{own})")
        lines.append(f"- `{f['file']}` ({f['how']}): {text}.")
    card = Path(path) / MODEL_CARD
    card.write_text("\n".join(lines) + "\n")
    return card
