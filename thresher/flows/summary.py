"""The flow run's summary on its Prefect page: the MLflow parent run's link and the comparison.

A user who started a run from the Prefect UI finds its results there, without the CLI: the flow
run's Artifacts tab holds one markdown artifact with the link to the MLflow parent run and the
comparison table (the report's own table, from ``evaluate.report``). The artifact's key is the
recipe's, so the Artifacts page keeps each recipe's runs as versions of one artifact.
"""

from __future__ import annotations

import re

from thresher.evaluate.report import Report, markdown_table
from thresher.tracking import run_page


def summary_key(recipe_name: str) -> str:
    """The artifact key of a recipe's summaries: Prefect keys are lowercase letters, digits and
    dashes."""
    return "thresher-" + re.sub(r"[^a-z0-9-]", "-", recipe_name.lower())


def summary_markdown(report: Report, run_name: str, tracking_uri: str, experiment_id: str,
                     parent_run_id: str) -> str:
    """Markdown of the summary: the MLflow link, the comparison table, where the plots are."""
    url, serve = run_page(tracking_uri, experiment_id, parent_run_id)
    lines = [f"# {run_name}", "",
             f"MLflow parent run: [{run_name}]({url}) (experiment id `{experiment_id}`, "
             f"run id `{parent_run_id}`, tracking `{tracking_uri}`)."]
    if serve:
        lines += ["", f"The tracking store is not a server: `{serve}` serves the link above."]
    lines += ["", f"{len(report.rows)} variants:", "", markdown_table(report.header, report.rows),
              f"Plots and `report.html`: the parent run's `comparison/` artifacts in MLflow, and "
              f"`{report.out_dir}` on the machine that ran the flow."]
    return "\n".join(lines) + "\n"


def publish_summary(report: Report, run_name: str, recipe_name: str, tracking_uri: str,
                    experiment_id: str, parent_run_id: str) -> str:
    """Attach the summary to the current flow run as a markdown artifact; returns its markdown."""
    from prefect.artifacts import create_markdown_artifact

    markdown = summary_markdown(report, run_name, tracking_uri, experiment_id, parent_run_id)
    create_markdown_artifact(markdown=markdown, key=summary_key(recipe_name),
                             description=f"{run_name}: MLflow run and variant comparison")
    return markdown
