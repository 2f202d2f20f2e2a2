"""How generated text is scored against the held-out text (the generative built-in tasks).

Exact match is the honest measure but nearly all-or-nothing on models this small: a 2 M-parameter
model rarely writes a whole line right, so the score would sit near zero for every variant and
separate nothing. Character similarity (difflib's ratio: twice the matched characters over the
total) gives partial credit per prompt, so a damaged model that writes a worse near-miss scores
lower. Function bodies are scored line by line after normalizing whitespace (indentation and
spacing are not what the task asks for), not by running the file's doctests: bodies that pass
them are out of reach at this size. lm-eval calls ``process_*`` through the task configs'
``!function utils....`` (``thresher/evaluate/tasks/utils.py``).
"""

from __future__ import annotations

from difflib import SequenceMatcher


def char_similarity(generated: str, target: str) -> float:
    """difflib's ratio in [0, 1]: 1 for equal strings; both empty counts as equal."""
    if not generated and not target:
        return 1.0
    return SequenceMatcher(None, generated, target, autojunk=False).ratio()


def normalize_line(line: str) -> str:
    """A line with its indentation dropped and inner whitespace collapsed."""
    return " ".join(line.split())


def code_lines(text: str) -> list[str]:
    """Normalized non-blank lines of ``text``."""
    return [n for n in (normalize_line(ln) for ln in text.splitlines()) if n]


def score_line(generated: str, target: str) -> dict[str, float]:
    """The first non-blank generated line against the true one, both stripped: exact match and
    similarity (the prompt stops before the newline, so the generation starts with one)."""
    first = next((ln.strip() for ln in generated.split("\n") if ln.strip()), "")
    return {"exact_match": float(first == target.strip()),
            "char_similarity": char_similarity(first, target.strip())}


def score_lines(generated: str, target: str) -> dict[str, float]:
    """The first lines generated against the target's lines, position by position: the
    fraction that match exactly (normalized) and the similarity of the joined lines."""
    want = code_lines(target)
    got = code_lines(generated)[: len(want)]
    matched = sum(g == w for g, w in zip(got, want, strict=False))
    return {"line_match": matched / len(want),
            "char_similarity": char_similarity("\n".join(got), "\n".join(want))}


def process_complete_line(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of ``stdlib_complete_line``."""
    return score_line(results[0], doc["target"])


def process_function_body(doc: dict, results: list[str]) -> dict[str, float]:
    """lm-eval ``process_results`` of ``stdlib_function_body``."""
    return score_lines(results[0], doc["target"])
