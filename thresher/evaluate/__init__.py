"""Evaluation: perplexity, task scores (lm-evaluation-harness), and the comparison report."""
