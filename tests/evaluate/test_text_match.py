"""Scoring generated text against the held-out text."""

from __future__ import annotations

from thresher.evaluate.text_match import (
    char_similarity,
    code_lines,
    process_complete_line,
    process_function_body,
)


def test_line_scores():
    doc = {"target": "    return self._data[key]"}
    assert process_complete_line(doc, ["\n\n    return self._data[key]\n    x = 1"]) == {
        "exact_match": 1.0, "char_similarity": 1.0}
    near = process_complete_line(doc, ["return self._date[key]"])
    far = process_complete_line(doc, ["import os"])
    assert near["exact_match"] == far["exact_match"] == 0.0
    assert 0.9 < near["char_similarity"] < 1.0 and far["char_similarity"] < 0.4
    assert char_similarity("", "") == 1.0 and char_similarity("", "x") == 0.0


def test_function_body_scores_line_by_line_ignoring_whitespace():
    doc = {"target": "        x = 1\n        if x:\n            return  x"}
    assert code_lines(doc["target"]) == ["x = 1", "if x:", "return x"]
    full = process_function_body(doc, ["    x = 1\n\n    if x:\n        return x\n    y = 2"])
    assert full == {"line_match": 1.0, "char_similarity": 1.0}
    part = process_function_body(doc, ["x = 1\nif y:\n"])
    assert abs(part["line_match"] - 1 / 3) < 1e-9 and part["char_similarity"] < 1.0
    assert process_function_body(doc, [""]) == {"line_match": 0.0, "char_similarity": 0.0}
