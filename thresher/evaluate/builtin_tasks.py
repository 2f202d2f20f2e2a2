"""Offline tasks over the held-out stdlib split, for lm-evaluation-harness.

Perplexity alone hides damage that tasks reveal, and the standard tasks (hellaswag, arc, ...)
cannot be downloaded here, nor would a 2 M-parameter model trained on Python source score above
chance on them. So thresher generates its own from held-out standard library files that the demo
models never saw in training: multiple-choice questions (one log-likelihood per choice), and
generative ones (greedy ``generate_until``), which see damage that the choices hide: a pruned
model that still ranks four candidate lines right may no longer write the line.

The task configs are lm-eval YAML files shipped in ``thresher/evaluate/tasks/``. The data is
generated deterministically at run time (the questions depend on the running Python's stdlib, so
it cannot ship inside the package) into ``<state dir>/tasks/<key>/``, beside a copy of each YAML
whose ``data_files`` now name the generated files. That directory is an ordinary lm-eval include
path: ``lm_eval --include_path DIR --tasks stdlib_next_line`` runs the same task. lm-eval runs
the configs' ``!function`` code (``utils.py``) from it, so it is used only if it and every file
in it are the current user's and nobody else can write to them (``paths.is_private``); otherwise
the tasks are generated again in a private directory.
"""

from __future__ import annotations

import ast
import fcntl
import hashlib
import json
import keyword
import logging
import platform
import random
import re
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from thresher.data.sources import stdlib_files, stdlib_root
from thresher.paths import build_dir_atomically, code_dir, fallback_code_dir, is_private

log = logging.getLogger(__name__)

GENERATOR_VERSION = 2
CONFIG_DIR = Path(__file__).parent / "tasks"
NUM_CHOICES = 4
CONTEXT_LINES = 6
NEAREST = 8  # distractors come from the answer's nearest neighbours in length
DOCS_PER_TASK = 300
MAX_DOCS_PER_FILE = 10

# multiple choice: {"context", "choices", "label", "source"}; generative: {"context", "target",
# "source"} (the scoring of generated text is thresher.evaluate.text_match). A generative prompt
# ends at the end of a line, without its newline: code tokenizers merge a newline with the next
# line's indentation, and a prompt ending in a bare newline token (rare in training) made the
# demo models answer with another newline.
Doc = dict
GEN_CONTEXT_LINES = 12  # a generative prompt sees more of the file than a choice does
MAX_LINE_CHARS = 100
BODY_LINES = 3  # lines of a function body to write
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


Corpus = dict[str, list[str]]  # held-out file (relative path) -> its lines


@dataclass(frozen=True)
class BuiltinTask:
    """One generated task: its name, what it asks, and how its questions are made."""

    name: str
    description: str
    make_docs: Callable[[str, Corpus, random.Random], list[Doc]]
    balance_answers: bool = False  # no answer text on more than 1/NUM_CHOICES of the questions
    max_per_file: int = MAX_DOCS_PER_FILE
    generative: bool = False  # generate_until, scored on the text; else multiple choice

    @property
    def chance(self) -> float | None:
        """The score of a blind guess (multiple choice); None for a generative task."""
        return None if self.generative else 1.0 / NUM_CHOICES


def _candidate_line(line: str) -> bool:
    """A line worth asking about: real code, long enough that it is not guessable by shape."""
    text = line.strip()
    return len(text) >= 12 and not text.startswith("#")


def _context(lines: list[str], i: int) -> str:
    return "\n".join(lines[max(0, i - CONTEXT_LINES) : i]) + "\n"


def next_line_docs(source: str, corpus: Corpus, rng: random.Random) -> list[Doc]:
    """Which line comes next? The true line against three lines of about its length taken from
    other held-out files: telling them apart takes reading the context, not knowing the line."""
    lines = corpus[source]
    by_length = _lines_by_length(corpus)
    positions = list(range(CONTEXT_LINES, len(lines)))
    rng.shuffle(positions)  # gathering distractors is the costly part: stop at enough questions
    docs: list[Doc] = []
    for i in positions:
        if len(docs) == MAX_DOCS_PER_FILE:
            break
        answer = lines[i]
        if not _candidate_line(answer) or not any(ln.strip() for ln in lines[i - 3 : i]):
            continue
        near = [ln for d in range(-2, 3) for ln, src in by_length.get(len(answer) + d, ())
                if src != source and ln.strip() != answer.strip()]
        near = sorted(set(near))
        if len(near) >= NUM_CHOICES - 1:
            docs.append(_doc(source, _context(lines, i), answer,
                             rng.sample(near, NUM_CHOICES - 1), rng))
    return docs


_LENGTH_INDEX: dict[tuple[str, ...], dict[int, list[tuple[str, str]]]] = {}


def _lines_by_length(corpus: Corpus) -> dict[int, list[tuple[str, str]]]:
    """Every candidate line of the corpus with its file, by length (built once per corpus)."""
    key = tuple(corpus)
    if key not in _LENGTH_INDEX:
        index: dict[int, list[tuple[str, str]]] = {}
        for src, lines in corpus.items():
            for ln in lines:
                if _candidate_line(ln):
                    index.setdefault(len(ln), []).append((ln, src))
        _LENGTH_INDEX.clear()
        _LENGTH_INDEX[key] = index
    return _LENGTH_INDEX[key]


def identifier_docs(source: str, corpus: Corpus, rng: random.Random) -> list[Doc]:
    """Which name comes next? The line is cut before a name; all four choices are names that the
    preceding lines used, so frequency and mere presence in the context do not decide it."""
    lines = corpus[source]
    docs = []
    for i in range(CONTEXT_LINES, len(lines)):
        line = lines[i]
        if not _candidate_line(line):
            continue
        context = _context(lines, i)
        seen = sorted({n for n in _IDENT.findall(context) if _is_name(n)})
        matches = [m for m in _IDENT.finditer(line)
                   if m.start() > len(line) - len(line.lstrip()) and m.group() in seen
                   and line[m.start() - 1] not in "\"'"]
        if not matches:
            continue
        m = rng.choice(matches)
        others = [n for n in seen if not n.startswith(m.group()) and not m.group().startswith(n)]
        if len(others) < NUM_CHOICES - 1:
            continue
        docs.append(_doc(source, context + line[: m.start()], m.group(),
                         _similar(m.group(), others, rng), rng))
    return docs


_CLOSING = re.compile(r"^(?P<head>.*[^)\]}\s])(?P<run>[)\]}]{2,})(?P<tail>:?,?)$")
_CLOSING_RUNS = sorted({a + b + c for a in ")]}" for b in ")]}" for c in ("", *")]}")})


def closing_docs(source: str, corpus: Corpus, rng: random.Random) -> list[Doc]:
    """Which brackets close the line? The line is cut before its final run of two or more
    closing brackets; the other choices are runs of similar length, so the answer must come
    from the brackets left open, not from how often each run occurs."""
    lines = corpus[source]
    docs = []
    for i in range(CONTEXT_LINES, len(lines)):
        match = _CLOSING.match(lines[i].rstrip())
        if not match or len(match["run"]) > 3 or "#" in lines[i]:
            continue
        answer = match["run"]
        others = [r for r in _CLOSING_RUNS if r != answer]
        docs.append(_doc(source, _context(lines, i) + match["head"], answer,
                         _similar(answer, others, rng), rng))
    return docs


def _is_name(text: str) -> bool:
    return len(text) >= 3 and not keyword.iskeyword(text)


def _similar(answer: str, others: list[str], rng: random.Random) -> list[str]:
    """Distractors of about the answer's length, so that length alone does not give it away."""
    nearest = sorted(others, key=lambda o: (abs(len(o) - len(answer)), o))[:NEAREST]
    return rng.sample(nearest, NUM_CHOICES - 1)


def _doc(source: str, context: str, answer: str, distractors: list[str], rng: random.Random) -> Doc:
    choices = [answer, *distractors]
    rng.shuffle(choices)
    return {"context": context, "choices": choices, "label": choices.index(answer),
            "source": source}


def complete_line_docs(source: str, corpus: Corpus, rng: random.Random) -> list[Doc]:
    """Write the next line: the previous lines of the file as the prompt, the true line as the
    target (the generated text's first non-blank line is scored). Lines are real code of 12-100 characters after some code."""
    lines = corpus[source]
    docs = []
    for i in range(CONTEXT_LINES, len(lines)):
        answer = lines[i]
        if (not _candidate_line(answer) or len(answer) > MAX_LINE_CHARS
                or not any(ln.strip() for ln in lines[i - 3 : i])):
            continue
        docs.append({"context": "\n".join(lines[max(0, i - GEN_CONTEXT_LINES) : i]),
                     "target": answer, "source": source})
    return docs


def function_body_docs(source: str, corpus: Corpus, rng: random.Random) -> list[Doc]:
    """Write the first lines of a function: the lines before it, its signature and docstring (if
    it has one) as the prompt; its first ``BODY_LINES`` non-blank code lines as the target."""
    lines = corpus[source]
    try:
        tree = ast.parse("\n".join(lines))
    except SyntaxError:
        return []
    docs = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        body = node.body[1:] if ast.get_docstring(node) is not None else node.body
        if not body:
            continue
        start = body[0].lineno - 1  # first code line after the docstring
        target = [ln for ln in lines[start : node.end_lineno]
                  if ln.strip() and not ln.strip().startswith("#")][:BODY_LINES]
        if len(target) < BODY_LINES:
            continue  # a body shorter than the lines asked for
        head = max(0, node.lineno - 1 - CONTEXT_LINES)
        docs.append({"context": "\n".join(lines[head:start]),
                     "target": "\n".join(target), "source": source})
    return docs


TASKS: dict[str, BuiltinTask] = {
    "stdlib_next_line": BuiltinTask(
        "stdlib_next_line",
        "choose the true next line of a held-out stdlib file against three lines of about its "
        "length from other held-out files", next_line_docs),
    "stdlib_identifier": BuiltinTask(
        "stdlib_identifier",
        "complete a cut line with the right name; all four choices are names the preceding lines "
        "used", identifier_docs),
    "stdlib_closing": BuiltinTask(
        "stdlib_closing",
        "close a cut line with the right run of 2-3 closing brackets", closing_docs,
        balance_answers=True, max_per_file=40),  # rare runs are few: draw from more lines
    "stdlib_complete_line": BuiltinTask(
        "stdlib_complete_line",
        "write the next line of a held-out stdlib file from its previous 12 lines (greedy); "
        "exact match and character similarity", complete_line_docs, generative=True),
    "stdlib_function_body": BuiltinTask(
        "stdlib_function_body",
        f"write the first {BODY_LINES} lines of a held-out function's body from the lines before "
        "it, its signature and docstring (greedy); matching lines and character similarity",
        function_body_docs, generative=True, max_per_file=20),  # functions gather in few files
}
MULTIPLE_CHOICE = [name for name, task in TASKS.items() if not task.generative]
GENERATIVE = [name for name, task in TASKS.items() if task.generative]


def generate_docs(task: BuiltinTask, docs: int = DOCS_PER_TASK, seed: int = 0) -> list[Doc]:
    """``docs`` questions drawn evenly across the held-out files (at most a few per file)."""
    root = stdlib_root()
    corpus = {path.relative_to(root).as_posix():
              path.read_text(encoding="utf-8", errors="replace").splitlines()
              for path in stdlib_files("heldout")}
    pool: list[Doc] = []
    for source in corpus:
        rng = random.Random(f"{seed}:{task.name}:{source}")
        candidates = task.make_docs(source, corpus, rng)
        pool += rng.sample(candidates, min(task.max_per_file, len(candidates)))
    rng = random.Random(f"{seed}:{task.name}")
    rng.shuffle(pool)
    if not task.balance_answers:
        return pool[:docs]
    answers = Counter(d["choices"][d["label"]] for d in pool)
    # The largest per-answer cap under which no answer exceeds 1/NUM_CHOICES of what is kept.
    cap = max((c for c in range(1, docs // NUM_CHOICES + 1)
               if c * NUM_CHOICES <= min(docs, sum(min(n, c) for n in answers.values()))),
              default=1)
    count, out = Counter[str](), []
    for doc in pool:
        answer = doc["choices"][doc["label"]]
        if count[answer] < cap and len(out) < docs:
            count[answer] += 1
            out.append(doc)
    return out


def data_key(seed: int = 0) -> str:
    """What determines the generated data: this generator's code and the task configs, the
    Python whose stdlib is the text, and the seed."""
    code = hashlib.sha256(Path(__file__).read_bytes())
    for config in sorted([*CONFIG_DIR.glob("*.yaml"), CONFIG_DIR / "utils.py"]):
        code.update(config.read_bytes())
    blob = json.dumps({"generator": GENERATOR_VERSION, "code": code.hexdigest(),
                       "python": platform.python_version(),
                       "stdlib": str(stdlib_root()), "seed": seed, "docs": DOCS_PER_TASK,
                       "tasks": sorted(TASKS)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def prepare_builtin_tasks(seed: int = 0) -> Path:
    """Generate (once) the data and the include-path directory of every built-in task."""
    final = code_dir("tasks") / f"stdlib-{data_key(seed)}"
    if final.exists() and not _all_private(final):
        final = fallback_code_dir("tasks", final) / final.name
    with open(final.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "complete").is_file():
            return final
        with build_dir_atomically(final, mode=0o700) as tmp:  # loaded as code: private
            for task in TASKS.values():
                data = tmp / f"{task.name}.jsonl"
                docs = generate_docs(task, seed=seed)
                data.write_text("".join(json.dumps(d) + "\n" for d in docs))
                (tmp / f"{task.name}.yaml").write_text(_with_data_file(task.name, final / data.name))
                log.info("built-in task %s: %d questions", task.name, len(docs))
            shutil.copy(CONFIG_DIR / "utils.py", tmp / "utils.py")  # the configs' !function
            (tmp / "complete").write_text("")
            for f in tmp.iterdir():
                f.chmod(0o644)  # not the umask's mode, which may let the group write
    return final


def _all_private(directory: Path) -> bool:
    """``directory`` and everything in it are ``is_private``."""
    return is_private(directory) and all(is_private(f) for f in directory.iterdir())


def _with_data_file(name: str, data: Path) -> str:
    """The shipped config with ``data_files`` naming ``data``, edited as text: lm-eval's
    ``!function`` tags do not survive a safe YAML load and dump."""
    text = (CONFIG_DIR / f"{name}.yaml").read_text()
    placeholder = f"test: {name}.jsonl"
    if text.count(placeholder) != 1:
        raise ValueError(f"{name}.yaml: expected one data_files line {placeholder!r}")
    return text.replace(placeholder, f"test: {json.dumps(str(data))}")
