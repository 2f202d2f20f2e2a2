"""lm-eval's entry points for the generative built-in tasks (``!function utils.<name>``).

prepare_builtin_tasks copies this file beside the generated task configs; the scoring itself is
thresher.evaluate.text_match, so the tests and the report use the same code.
"""

from thresher.evaluate.text_match import process_complete_line, process_function_body

__all__ = ["process_complete_line", "process_function_body"]
