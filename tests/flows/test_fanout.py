"""How a recipe's variants are grouped into flow runs for a work pool."""

from __future__ import annotations

from pathlib import Path

from thresher.flows.fanout import variant_groups
from thresher.flows.sweep import load_recipe

ROOT = Path(__file__).resolve().parents[2]


def test_groups_are_maximal_shared_prefixes():
    recipe = load_recipe(ROOT / "configs" / "sweep-demo.yaml")
    assert variant_groups(recipe) == [
        ["base"],
        ["reap25-gptq3", "reap25-gptq4", "reap25-awq4"],
        ["reap50-gptq3", "reap50-gptq4", "reap50-awq4"],
    ]


def test_variants_without_a_shared_first_stage_run_apart():
    recipe = load_recipe(ROOT / "configs" / "demo.yaml")
    groups = variant_groups(recipe)
    assert ["auto50", "auto50-gptq4", "auto50-awq4", "auto50-nf4"] in groups
    assert ["gptq4"] in groups and ["awq4"] in groups and ["nf4"] in groups
    assert sorted(n for g in groups for n in g) == sorted(v.name for v in recipe.variants)


def test_stack_refuses_a_taken_port(tmp_path):
    import socket

    import pytest

    from thresher.errors import ExecutionError
    from thresher.flows.stack import start_stack

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ExecutionError, match=f"port {port} for the prefect server is in use"):
            start_stack(1, prefect_port=port, mlflow_port=port, root=tmp_path)
    assert not (tmp_path / "stack.json").exists()
