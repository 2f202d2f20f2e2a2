"""The built-in tasks' generated questions, and their lm-eval include directory."""

from __future__ import annotations

import json
import os

import pytest
import yaml

from thresher.data.sources import stdlib_root
from thresher.evaluate.builtin_tasks import (
    BODY_LINES,
    CONFIG_DIR,
    GENERATIVE,
    MULTIPLE_CHOICE,
    NUM_CHOICES,
    TASKS,
    generate_docs,
    prepare_builtin_tasks,
)


class _TaskYamlLoader(yaml.SafeLoader):
    """Reads lm-eval's ``!function module.name`` tags as their text."""


_TaskYamlLoader.add_constructor("!function", lambda loader, node: f"!function {node.value}")


def load_task_yaml(text: str) -> dict:
    return yaml.load(text, Loader=_TaskYamlLoader)  # noqa: S506 (a SafeLoader subclass)


@pytest.fixture(scope="module")
def docs() -> dict[str, list[dict]]:
    return {name: generate_docs(task, docs=120) for name, task in TASKS.items()}


def test_questions_are_well_formed_and_deterministic(docs):
    for name in MULTIPLE_CHOICE:
        task = TASKS[name]
        assert len(docs[name]) >= 100, name
        assert docs[name] == generate_docs(task, docs=120), f"{name} is not deterministic"
        labels = set()
        for d in docs[name]:
            assert len(d["choices"]) == NUM_CHOICES == len(set(d["choices"])), d
            assert 0 <= d["label"] < NUM_CHOICES
            labels.add(d["label"])
        assert labels == set(range(NUM_CHOICES)), f"{name}: the answer is not shuffled"
    assert TASKS["stdlib_next_line"].chance == 1 / NUM_CHOICES


def test_generative_prompts_continue_into_their_held_out_targets(docs):
    """The target is what the held-out file says right after the prompt; prompts are spread
    over the files and the same seed gives the same prompts."""
    assert set(GENERATIVE) == {"stdlib_complete_line", "stdlib_function_body"}
    for name in GENERATIVE:
        assert TASKS[name].chance is None
        assert len(docs[name]) == 120 and docs[name] == generate_docs(TASKS[name], docs=120)
        assert len({d["source"] for d in docs[name]}) >= 12, name
        for d in docs[name]:
            assert set(d) == {"context", "target", "source"}
            assert d["context"].strip()  # it ends where the target's line begins, minus "\n"
            source = (stdlib_root() / d["source"]).read_text(encoding="utf-8", errors="replace")
            if name == "stdlib_complete_line":
                assert d["context"] + "\n" + d["target"] + "\n" in source, d
                assert len(d["target"].strip()) >= 12 and len(d["target"]) <= 100
            else:
                lines = d["target"].split("\n")
                assert len(lines) == BODY_LINES and d["context"] + "\n" + lines[0] in source, d
                assert any(ln.lstrip().startswith(("def ", "async def "))
                           for ln in d["context"].splitlines()), d


def test_answers_are_the_held_out_text(docs):
    """The right choice continues the context exactly as the held-out file does."""
    for name in ("stdlib_next_line", "stdlib_identifier", "stdlib_closing"):
        for d in docs[name][:40]:
            source = (stdlib_root() / d["source"]).read_text(encoding="utf-8", errors="replace")
            assert d["context"] + d["choices"][d["label"]] in source, (name, d)
            wrong = [c for i, c in enumerate(d["choices"]) if i != d["label"]]
            assert all(d["context"] + c not in source for c in wrong) or name == "stdlib_closing"


def test_identifier_choices_all_come_from_the_context(docs):
    for d in docs["stdlib_identifier"]:
        assert all(c in d["context"] for c in d["choices"])


def test_closing_answers_are_balanced(docs):
    answers = [d["choices"][d["label"]] for d in docs["stdlib_closing"]]
    top = max(answers.count(a) for a in set(answers))
    assert top <= len(answers) / NUM_CHOICES + 1


def test_include_dir_is_an_lm_eval_task_directory(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("THRESHER_HOME", str(tmp_path))
    root = prepare_builtin_tasks()
    assert root.is_relative_to(tmp_path)
    assert prepare_builtin_tasks() == root  # generated once
    assert (root / "utils.py").is_file()  # the generative configs' !function module
    for name in TASKS:
        config = load_task_yaml((root / f"{name}.yaml").read_text())
        shipped = load_task_yaml((CONFIG_DIR / f"{name}.yaml").read_text())
        data = config["dataset_kwargs"]["data_files"]["test"]
        assert data == str(root / f"{name}.jsonl")
        assert {k: v for k, v in config.items() if k != "dataset_kwargs"} == \
               {k: v for k, v in shipped.items() if k != "dataset_kwargs"}
        first = json.loads((root / f"{name}.jsonl").read_text().splitlines()[0])
        assert set(first) == ({"context", "target", "source"} if name in GENERATIVE
                              else {"context", "choices", "label", "source"})
    manager = TaskManager(include_path=str(root), include_defaults=False)
    assert set(TASKS) <= set(manager.all_tasks)
    task = manager.load(["stdlib_closing"])["tasks"]["stdlib_closing"]
    doc = next(iter(task.test_docs()))
    assert task.doc_to_text(doc) == doc["context"] and task.doc_to_choice(doc) == doc["choices"]
    task = manager.load(["stdlib_complete_line"])["tasks"]["stdlib_complete_line"]
    doc = next(iter(task.test_docs()))
    assert task.doc_to_text(doc) == doc["context"] and task.doc_to_target(doc) == doc["target"]
    assert task.process_results(doc, [doc["target"].strip()])["exact_match"] == 1.0


def test_task_code_others_could_write_is_not_run(tmp_path, monkeypatch, caplog):
    """lm-eval runs the include directory's ``utils.py``: one that another user could have
    written (here: world-writable, with code planted in it) is not used; the tasks are generated
    again in a private directory, with a warning."""
    monkeypatch.setenv("THRESHER_HOME", str(tmp_path))
    root = prepare_builtin_tasks()
    planted = root / "utils.py"
    planted.write_text("raise SystemExit('planted code ran')\n")
    planted.chmod(0o666)
    with caplog.at_level("WARNING", logger="thresher.paths"):
        again = prepare_builtin_tasks()
    assert again != root and not again.is_relative_to(tmp_path)
    assert (again / "utils.py").read_bytes() == (CONFIG_DIR / "utils.py").read_bytes()
    assert str(root) in caplog.text
    config = load_task_yaml((again / "stdlib_next_line.yaml").read_text())
    assert config["dataset_kwargs"]["data_files"]["test"] == str(again / "stdlib_next_line.jsonl")


def test_files_are_written_private_whatever_the_umask(tmp_path, monkeypatch):
    monkeypatch.setenv("THRESHER_HOME", str(tmp_path))
    before = os.umask(0o002)  # group-writable by default, as on many shared machines
    try:
        root = prepare_builtin_tasks()
    finally:
        os.umask(before)
    assert prepare_builtin_tasks() == root  # reused: nothing in it is writable by others
    assert all(not f.stat().st_mode & 0o022 for f in [root, *root.iterdir()])
