"""The ``thresher`` command line.

Every command prints a ThresherError as one clear message (``--debug`` shows the traceback);
every option has help text, so ``thresher COMMAND --help`` explains itself.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
from collections.abc import Callable
from functools import wraps
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, get_args, get_origin

import typer
from rich.console import Console
from rich.logging import RichHandler
from rich.markup import escape
from rich.table import Table

from thresher.errors import ThresherError
from thresher.formats.artifact import DEMO_MODEL_META, PRUNE_REPORT
from thresher.recipe import (
    QUANTIZE_STAGES,
    CalibrationConfig,
    ExecutionConfig,
    GPTQStage,
    MergeStage,
    PerplexityConfig,
    PruneStage,
    QuantizeStage,
)

if TYPE_CHECKING:
    from thresher.evaluate.report import VariantRecord

app = typer.Typer(
    help="thresher: compress Mixture-of-Experts LLMs (REAP pruning; GPTQ / AWQ / NF4 / RTN "
    "quantization), track them in MLflow, publish standard checkpoints and serve them.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)
demo_model_app = typer.Typer(help="Build the demo MoE models trained on the stdlib source.",
                             no_args_is_help=True, rich_markup_mode=None)
app.add_typer(demo_model_app, name="demo-model")
export_app = typer.Typer(help="Export a model to another runtime's format (GGUF for llama.cpp and "
                         "Ollama).", no_args_is_help=True,
                         rich_markup_mode=None)
app.add_typer(export_app, name="export", short_help="Export a model to GGUF (llama.cpp, Ollama).")
stack_app = typer.Typer(help="A local Prefect server, MLflow server and process workers: the "
                        "one-machine twin of a multi-machine sweep.", no_args_is_help=True,
                        rich_markup_mode=None)
app.add_typer(stack_app, name="stack",
              short_help="A local Prefect server, MLflow server and workers.")

# Wide enough for the comparison table when the output is a file or a CI log, not a terminal.
console = Console(stderr=False, width=None if sys.stdout.isatty() else 160)
err_console = Console(stderr=True)
_state = {"debug": False}


@app.callback()
def main(
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks and debug logs.")] = False,
) -> None:
    _state["debug"] = debug
    logging.basicConfig(
        level=logging.DEBUG if debug else logging.INFO,
        format="%(message)s",
        handlers=[RichHandler(console=err_console, show_path=False, show_time=False)],
    )
    for noisy in ("httpx", "urllib3", "filelock", "alembic", "mlflow", "prefect"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def handles_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Print a ThresherError, or an OSError naming its path (a directory that cannot be written,
    say), as a message and exit 2; with --debug, show the traceback too."""

    @wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ThresherError as err:
            if _state["debug"]:
                raise
            # not wrapped at the terminal's width, and a path's brackets are not markup
            err_console.print(f"[bold red]error:[/] {escape(str(err))}", highlight=False,
                              soft_wrap=True)
            raise typer.Exit(2) from None
        except OSError as err:  # a path the command cannot read or write (not ours to fix)
            if _state["debug"] or err.filename is None:
                raise
            err_console.print(f"[bold red]error:[/] {escape(f'{err.filename}: {err.strerror}')}",
                              highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None

    return wrapper


# --- options that set recipe fields -------------------------------------------------------------
# An option that sets a recipe field takes the field's default and its description, so the
# command line and the recipe cannot drift apart (tests/test_cli.py checks every such option).

CAL = CalibrationConfig.model_fields
PPL = PerplexityConfig.model_fields
PRUNE = PruneStage.model_fields
MERGE = MergeStage.model_fields
QUANT = QuantizeStage.model_fields
GPTQ = GPTQStage.model_fields
EXEC = ExecutionConfig.model_fields


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def field_help(model: type, name: str, more: str = "", default: bool = False) -> str:
    """An option's help from the recipe field ``name`` of ``model``: its description as a
    sentence, the values a ``Literal`` allows, ``more``, and, for an option left unset by default
    (so the recipe decides), the field's default."""
    field = model.model_fields[name]
    text = (field.description or name.replace("_", " ")).rstrip(".")
    text = text[0].upper() + text[1:] + "."
    choices = get_args(field.annotation) if get_origin(field.annotation) is Literal else ()
    if choices and not all(f"'{c}'" in text for c in choices):
        text += f" One of: {', '.join(map(str, choices))}."
    if more:
        text += f" {more}"
    if default:
        text += f" Default: {_shown(field.default)}."
    return text


def knob_help(name: str) -> str:
    """Help of a ``quantize`` option that only some methods read: those methods, the field's
    description and each method's default (the option is unset unless given)."""
    owners = {m: cls.model_fields[name] for m, cls in QUANTIZE_STAGES.items()
              if name in cls.model_fields}
    first = next(iter(owners.values()))
    defaults: dict[str, list[str]] = {}
    for method, field in owners.items():
        defaults.setdefault(_shown(field.default), []).append(method)
    shown = (next(iter(defaults)) if len(defaults) == 1 else
             ", ".join(f"{'/'.join(ms)} {d}" for d, ms in defaults.items()))
    text = (first.description or name.replace("_", " ")).rstrip(".")
    return f"{'/'.join(owners)}: {text} (default: {shown})."


# --- recipes ------------------------------------------------------------------------------------


@app.command(short_help="Validate a recipe and print its plan (nothing is computed).")
@handles_errors
def check(recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")]) -> None:
    """Validate a recipe against its model's shapes and print the resolved plan: stages (shared
    prefixes run once), the reference, the GGUF files each variant gets; nothing is computed."""
    from thresher.flows.preflight import describe_source, preflight
    from thresher.flows.sweep import load_recipe

    r = load_recipe(recipe)
    found = preflight(r)
    console.print(f"[bold]{r.name}[/]: model [cyan]{r.model}[/] ({r.dtype})", highlight=False)
    console.print(("shapes checked against " if found.checked else "shapes not checked: ")
                  + found.config_source, highlight=False)
    cal = r.calibration
    console.print(f"calibration: {describe_source(cal.source, 'calibration')}; {cal.samples} "
                  f"windows of {cal.seq_len} tokens, seed {cal.seed}", highlight=False)
    ppl = r.eval.perplexity
    console.print(f"evaluation: perplexity on {describe_source(ppl.source, 'evaluation')}; "
                  f"seq_len {ppl.seq_len}, max_windows {ppl.max_windows}; tasks: "
                  f"{', '.join(r.eval.tasks) or 'none'}", highlight=False)
    table = Table(title="plan: stage computations")
    for col in ("step", "stage", "reads", "used by"):
        table.add_column(col)
    for step in r.plan():
        reads = "base model" if step.parent is None else f"step {step.parent}"
        table.add_row(str(step.index), step.stage.describe(), reads, ", ".join(step.variants))
    console.print(table)
    for v in r.variants:
        chain = " -> ".join(s.describe() for s in v.stages) or "(base model, no stages)"
        console.print(f"  variant [bold]{v.name}[/]: {chain}", highlight=False)
    if not any(not v.stages for v in r.variants):
        console.print("reference: the base model, evaluated as the variants are (no variant "
                      "without stages is listed); every variant's change is taken from it")
    if found.gguf:
        gguf_table = Table(title="GGUF files the run writes")
        for col in ("variant", "file", "how"):
            gguf_table.add_column(col)
        for name, files in found.gguf.items():
            for f in files:
                gguf_table.add_row(name, f.file, _GGUF_HOW[f.how])
        console.print(gguf_table)
    if found.parameters:
        _print_memory(found.parameters)
    pool = r.execution.work_pool
    console.print(f"{len(r.variants)} variants; runs " + (
        f"on work pool {pool!r} (retries {r.execution.retries})" if pool else "in this process"))
    console.print("[green]recipe is valid[/]")


def _print_memory(parameters: int) -> None:
    """What the evaluation's float32 copy of the model needs, against this machine's room; a
    warning, not a refusal: the run may go to a work pool's larger machine."""
    from thresher.models.inspect import size_text
    from thresher.resources import available_memory

    need = parameters * 4
    count = f"{parameters / 1e9:.1f} B" if parameters >= 1e9 else f"{parameters / 1e6:.1f} M"
    line = (f"memory: {count} parameters; evaluation holds the model whole in float32, at least "
            f"{size_text(need)}")
    room = available_memory()
    if room is None:
        console.print(line, highlight=False)
    elif need <= room[0]:
        console.print(f"{line}; {size_text(room[0])} available here", highlight=False)
    else:
        console.print(f"[yellow]{line}; only {size_text(room[0])} available here ({room[1]}): "
                      "run it where there is more (a work pool's machine), or it is refused at "
                      "its first evaluation[/]", highlight=False)


_GGUF_HOW = {
    "hand-off": "hand-off: its 4-bit codes as the Q4_1 blocks, no rounding",
    "quantized": "quantized from its 16/32-bit weights; perplexity measured",
    "requantized": "requantized: a second rounding; perplexity measured",
}


@app.command()
def schema() -> None:
    """Print the recipe JSON schema (for editors and validators)."""
    from thresher.recipe import recipe_json_schema

    print(json.dumps(recipe_json_schema(), indent=2))


# --- demo model ---------------------------------------------------------------------------------


@demo_model_app.command("build", short_help="Train the demo tokenizer and Qwen3-MoE (cached).")
@handles_errors
def demo_model_build(
    size: Annotated[str, typer.Argument(
        help="tiny (for tests), small (the demo default) or fine (64 experts, top-8, for the "
        "pruning and merging comparisons; docs/pruning.md). Measured on a 2-core x86 machine: "
        "tiny 58 s with the cores idle and 9.5 min with them shared; small 4.4 min idle, 7.5 "
        "min under load; fine 16 min under load (about 13 min idle, estimated).")] = "small",
    force: Annotated[bool, typer.Option(help="Retrain even if a cached model exists.")] = False,
) -> None:
    """Train the demo tokenizer and Qwen3-MoE on the stdlib train split (cached)."""
    from thresher.data.demo_model import build_demo_model

    path = build_demo_model(size, force=force)
    meta = json.loads((path / DEMO_MODEL_META).read_text())
    console.print(f"demo:{size} at {path}")
    console.print(f"  {meta['parameters']:,} parameters, trained {meta['spec']['steps']} steps in "
                  f"{meta['train_seconds']} s, final loss {meta['final_loss']:.3f}")


# --- evaluation ---------------------------------------------------------------------------------


@app.command("perplexity")
@handles_errors
def perplexity_cmd(
    model: Annotated[str, typer.Option(help="Hub id, local dir, models:/name/version or demo:size.")],
    seq_len: Annotated[int, typer.Option(help=field_help(PerplexityConfig, "seq_len"))
                       ] = PPL["seq_len"].default,
    max_windows: Annotated[int, typer.Option(help=field_help(
        PerplexityConfig, "max_windows", "0: all."))] = PPL["max_windows"].default,
    batch_size: Annotated[int, typer.Option(help=field_help(PerplexityConfig, "batch_size"))
                          ] = PPL["batch_size"].default,
) -> None:
    """Held-out perplexity of a model on the stdlib held-out split."""
    from pydantic import ValidationError

    from thresher.errors import EvaluationError
    from thresher.evaluate.perplexity import heldout_perplexity
    from thresher.recipe import format_validation_error

    try:
        cfg = PerplexityConfig(seq_len=seq_len, max_windows=max_windows or None,
                               batch_size=batch_size)
    except ValidationError as err:
        raise EvaluationError(format_validation_error(err, "perplexity", as_options=True)
                              ) from None
    result = heldout_perplexity(model, cfg)
    console.print(f"perplexity {result.perplexity:.3f} over {result.tokens:,} tokens in "
                  f"{result.windows} windows of {result.seq_len} ({result.convention})")


# --- flows ---------------------------------------------------------------------------------------


def print_comparison(records: list[VariantRecord], title: str = "variants") -> None:
    """The comparison table (``VariantRecord``s) on the console, with each registry URI."""
    from thresher.evaluate.report import comparison_table

    header, cells = comparison_table(records)
    table = Table(title=title)
    for col in (*header, "model"):
        table.add_column(col)
    for row, r in zip(cells, records, strict=True):
        table.add_row(*row, r.model_uri or "-")
    console.print(table)


def print_summary_table(summary: dict[str, Any]) -> None:
    """A flow run's compact comparison (fits 120 columns), and where the full table is."""
    from thresher.evaluate.report import terminal_table
    from thresher.formats.artifact import COMPARISON_MD

    console.print(terminal_table(_flow_records(summary)), markup=False, highlight=False,
                  soft_wrap=True, end="")
    console.print(f"full table: {Path(summary['report_dir']) / COMPARISON_MD}", highlight=False,
                  soft_wrap=True)
    console.print("  (also in MLflow and on the flow run's page; `thresher compare RUN_ID` "
                  "prints it)")


def _flow_records(summary: dict[str, Any]) -> list[VariantRecord]:
    """The flow's result (plain data) as records again."""
    from thresher.evaluate.report import VariantRecord

    return [VariantRecord.from_dict(v) for v in summary["variants"]]


@app.command("run", short_help="Run a recipe through the Prefect compress flow.")
@handles_errors
def run_cmd(
    recipe: Annotated[Path, typer.Argument(help="Recipe YAML file.")],
    tracking_uri: Annotated[str | None, typer.Option(
        help="MLflow tracking URI (default: the recipe's, $MLFLOW_TRACKING_URI, else SQLite "
        "under the state directory).")] = None,
    store_dir: Annotated[str | None, typer.Option(help="Artifact store directory.")] = None,
    publish_dir: Annotated[str | None, typer.Option(help="Where published variants go.")] = None,
    pool: Annotated[str | None, typer.Option(
        help="Prefect work pool whose workers run the variants (default: the recipe's "
        "execution.work_pool, else this process). The store must be on a path every worker "
        "mounts.")] = None,
) -> None:
    """Run a recipe through the Prefect `compress` flow and print the comparison table."""
    from thresher.flows.compress import compress
    from thresher.flows.preflight import preflight
    from thresher.flows.sweep import load_recipe
    from thresher.tracking import check_reachable, resolve_tracking_uri

    r = load_recipe(recipe)  # validated before Prefect or any compute starts
    # against the model's shapes, and tracking reachable: one line each, not a failed flow run
    preflight(r)
    check_reachable(resolve_tracking_uri(tracking_uri or r.tracking.mlflow_uri))
    summary = compress(r, tracking_uri=tracking_uri, store_dir=store_dir, publish_dir=publish_dir,
                       work_pool=pool)
    print_summary_table(summary)
    console.print(f"MLflow: parent run {summary['parent_run_id']} at {summary['tracking_uri']}")


@app.command(short_help="Register scheduled compress deployments with a Prefect server.")
@handles_errors
def deploy(
    schedules: Annotated[Path, typer.Argument(help="Schedules YAML (see configs/schedules.yaml).")],
    work_pool: Annotated[str | None, typer.Option(
        help="Register against this Prefect work pool (workers on any machine run the flows) "
        "instead of serving the deployments from this process.")] = None,
) -> None:
    """Register compress deployments (recipe + cron) with the Prefect server at $PREFECT_API_URL.

    Without --work-pool this process serves them: runs triggered from the Prefect UI, from
    `prefect deployment run 'compress/NAME'` or by their schedule execute here.
    """
    from thresher.flows.deploy import deploy_to_work_pool, load_schedules, serve_deployments

    specs = load_schedules(schedules)
    for s in specs:
        console.print(f"deployment compress/{s.name}: {s.recipe}, schedule {s.cron or 'none'}")
    if work_pool:
        deploy_to_work_pool(specs, work_pool)
        console.print(f"registered with work pool {work_pool!r}; start workers with "
                      f"`prefect worker start --pool {work_pool}`")
    else:
        serve_deployments(specs)


@stack_app.command("up", short_help="Start a Prefect server, an MLflow server and N workers.")
@handles_errors
def stack_up(
    workers: Annotated[int, typer.Option(min=1, help="Process workers to start.")] = 2,
    pool: Annotated[str, typer.Option(help="Work pool name.")] = "thresher",
    prefect_port: Annotated[int, typer.Option(help="Prefect server port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow server port.")] = 5000,
) -> None:
    """Start a Prefect server, an MLflow server (SQLite, proxied artifacts) and N workers."""
    from thresher.flows.stack import start_stack

    stack = start_stack(workers, pool, prefect_port, mlflow_port)
    console.print(f"Prefect: {stack.prefect_url.removesuffix('/api')}  MLflow: {stack.mlflow_url}")
    console.print(f"{workers} workers on pool {pool!r}; logs in {stack.root}/logs")
    console.print("export these, then `thresher run RECIPE --pool " + pool + "`:")
    for k, v in stack.env().items():
        console.print(f"  export {k}={v}", highlight=False)


@stack_app.command("down", short_help="Stop the processes thresher stack up started.")
@handles_errors
def stack_down() -> None:
    """Stop the processes `thresher stack up` started (state under $THRESHER_HOME/stack)."""
    from thresher.flows.stack import stop_stack

    stopped = stop_stack()
    console.print(f"stopped {', '.join(stopped)}" if stopped else "no stack is running")


# --- expert pruning -----------------------------------------------------------------------------


DEVICE_OPTION_HELP = field_help(ExecutionConfig, "device")
BUDGET_OPTION_HELP = field_help(ExecutionConfig, "offload_budget_gb")


def _memory_note(report) -> str:
    """Where a stage computed and its peak memory: the host's, and the device's on CUDA."""
    note = f"on {report.device}, peak RSS {report.peak_rss_mb:.0f} MiB"
    if report.peak_device_mb is not None:
        note += f", peak device memory {report.peak_device_mb:.0f} MiB"
    return note


def _calibration_source(text: str):
    """``stdlib`` or a comma-separated list of local files / globs."""
    from thresher.recipe import FilesSource

    if text == "stdlib":
        return "stdlib"
    return FilesSource(files=[part.strip() for part in text.split(",") if part.strip()])


@app.command("prune", short_help="Remove the lowest-saliency experts of every MoE layer (REAP).")
@handles_errors
def prune_cmd(
    model: Annotated[str, typer.Option(help="Hub id, local dir, models:/name/version or demo:size.")],
    out: Annotated[Path, typer.Option(help="Output directory for the pruned checkpoint (new).")],
    method: Annotated[str, typer.Option(help=field_help(PruneStage, "method"))
                      ] = PRUNE["method"].default,
    ratio: Annotated[float | None, typer.Option(help=field_help(
        PruneStage, "ratio", "0.5 unless --keep is given."))] = PRUNE["ratio"].default,
    keep: Annotated[int | None, typer.Option(help=field_help(
        PruneStage, "keep", "Instead of --ratio."))] = PRUNE["keep"].default,
    calibration: Annotated[str, typer.Option(
        help="'stdlib' or comma-separated local text files / globs.")] = "stdlib",
    samples: Annotated[int, typer.Option(help=field_help(CalibrationConfig, "samples"))
                       ] = CAL["samples"].default,
    seq_len: Annotated[int, typer.Option(help=field_help(CalibrationConfig, "seq_len"))
                       ] = CAL["seq_len"].default,
    seed: Annotated[int, typer.Option(help=field_help(
        CalibrationConfig, "seed", f"Also the {PRUNE['seed'].description}."))
                    ] = CAL["seed"].default,
    budget: Annotated[str, typer.Option(help=field_help(PruneStage, "budget"))
                      ] = PRUNE["budget"].default,
    protect_super_experts: Annotated[bool, typer.Option(help=field_help(
        PruneStage, "protect_super_experts"))] = PRUNE["protect_super_experts"].default,
    refit: Annotated[bool, typer.Option(help=field_help(PruneStage, "refit"))
                     ] = PRUNE["refit"].default,
    refit_damp: Annotated[float | None, typer.Option(help=field_help(
        PruneStage, "refit_damp", "Raise it (0.1-1) when calibrating on a few windows.",
        default=True))] = None,
    device: Annotated[str, typer.Option(help=DEVICE_OPTION_HELP)] = EXEC["device"].default,
    offload_budget_gb: Annotated[float | None, typer.Option(help=BUDGET_OPTION_HELP)
                                 ] = EXEC["offload_budget_gb"].default,
) -> None:
    """Remove the lowest-saliency experts of every MoE layer (REAP or a baseline) and write a
    complete pruned checkpoint with prune_report.json."""
    from pydantic import ValidationError

    from thresher.errors import CompressionError
    from thresher.models import resolve_model
    from thresher.prune.api import prune_model
    from thresher.recipe import format_validation_error

    if ratio is None and keep is None:
        ratio = 0.5
    if refit_damp is not None and not refit:
        raise CompressionError("prune: --refit-damp sets the refit's damping; add --refit")
    try:
        options = {} if refit_damp is None else {"refit_damp": refit_damp}
        stage = PruneStage(method=method, ratio=ratio, keep=keep, seed=seed, budget=budget,
                           protect_super_experts=protect_super_experts, refit=refit, **options)
        cal = CalibrationConfig(source=_calibration_source(calibration), samples=samples,
                                seq_len=seq_len, seed=seed)
    except ValidationError as err:
        raise CompressionError(format_validation_error(err, "prune", as_options=True)) from None
    report = prune_model(resolve_model(model), stage, cal, out, device=device,
                         offload_budget_gb=offload_budget_gb)
    table = Table(title=f"{stage.describe()}: {report.experts_kept} of {report.num_experts} "
                        "experts kept per MoE layer")
    for col in ("layer", "removed experts", "dead experts"):
        table.add_column(col)
    for layer in report.layers:
        dead = "-" if layer.tokens_routed is None else ", ".join(map(str, layer.dead_experts))
        table.add_row(str(layer.layer), ", ".join(map(str, layer.removed)), dead or "none")
    console.print(table)
    m = report.metrics()
    share = m.get("removed_routed_share")
    console.print(f"pruned checkpoint: {out} ({PRUNE_REPORT} beside it); {m['wall_seconds']:.1f} s "
                  f"{_memory_note(report)}"
                  + (f", removed experts had {share:.1%} of routed tokens" if share is not None
                     else "")
                  + (f"; the refit left {m['refit_error_left']:.1%} of the pruned blocks' output "
                     "error on the calibration tokens" if "refit_error_left" in m else ""))
    _print_runtime_note(out)


@app.command("merge", short_help="Merge each MoE layer's experts into fewer (M-SMoE, HC-SMoE).")
@handles_errors
def merge_cmd(
    model: Annotated[str, typer.Option(help="Hub id, local dir, models:/name/version or demo:size.")],
    out: Annotated[Path, typer.Option(help="Output directory for the merged checkpoint (new).")],
    method: Annotated[str, typer.Option(help=field_help(MergeStage, "method"))
                      ] = MERGE["method"].default,
    ratio: Annotated[float | None, typer.Option(help=field_help(
        MergeStage, "ratio", "0.5 unless --keep is given."))] = MERGE["ratio"].default,
    keep: Annotated[int | None, typer.Option(help=field_help(MergeStage, "keep"))
                    ] = MERGE["keep"].default,
    router: Annotated[str, typer.Option(help=field_help(MergeStage, "router"))
                      ] = MERGE["router"].default,
    permute: Annotated[bool | None, typer.Option(help=field_help(MergeStage, "permute"))
                       ] = MERGE["permute"].default,
    calibration: Annotated[str, typer.Option(
        help="'stdlib' or comma-separated local text files / globs.")] = "stdlib",
    samples: Annotated[int, typer.Option(help=field_help(CalibrationConfig, "samples"))
                       ] = CAL["samples"].default,
    seq_len: Annotated[int, typer.Option(help=field_help(CalibrationConfig, "seq_len"))
                       ] = CAL["seq_len"].default,
    seed: Annotated[int, typer.Option(help=field_help(CalibrationConfig, "seed"))
                    ] = CAL["seed"].default,
    device: Annotated[str, typer.Option(help=DEVICE_OPTION_HELP)] = EXEC["device"].default,
    offload_budget_gb: Annotated[float | None, typer.Option(help=BUDGET_OPTION_HELP)
                                 ] = EXEC["offload_budget_gb"].default,
) -> None:
    """Merge groups of experts of every MoE layer into frequency-weighted averages (M-SMoE or
    HC-SMoE) and write a complete checkpoint with fewer experts and merge_report.json."""
    from pydantic import ValidationError

    from thresher.errors import CompressionError
    from thresher.models import resolve_model
    from thresher.prune.merge_api import merge_model
    from thresher.recipe import format_validation_error

    try:
        stage = MergeStage(method=method, ratio=0.5 if ratio is None and keep is None else ratio,
                           keep=keep, router=router, permute=permute)
        cal = CalibrationConfig(source=_calibration_source(calibration), samples=samples,
                                seq_len=seq_len, seed=seed)
    except ValidationError as err:
        raise CompressionError(format_validation_error(err, "merge", as_options=True)) from None
    report = merge_model(resolve_model(model), stage, cal, out, device=device,
                         offload_budget_gb=offload_budget_gb)
    table = Table(title=f"{stage.describe()}: {report.experts_kept} of {report.num_experts} "
                        "experts per MoE layer")
    for col in ("layer", "merged groups (leader first)"):
        table.add_column(col)
    for layer in report.layers:
        table.add_row(str(layer.layer), "  ".join(
            "+".join(map(str, g)) for g in layer.groups if len(g) > 1))
    console.print(table)
    m = report.metrics()
    console.print(f"merged checkpoint: {out} (merge_report.json beside it); "
                  f"{m['wall_seconds']:.1f} s {_memory_note(report)}, merged-away experts had "
                  f"{m['merged_routed_share']:.1%} of routed tokens")


# --- quantization -------------------------------------------------------------------------------


@app.command("quantize", short_help="Quantize a model (GPTQ, AWQ, NF4, RTN), layer by layer.")
@handles_errors
def quantize_cmd(
    model: Annotated[str, typer.Option(help="Hub id, local dir, models:/name/version or demo:size.")],
    out: Annotated[Path, typer.Option(help="Output directory (must not exist).")],
    method: Annotated[str, typer.Option(help=f"{', '.join(QUANTIZE_STAGES)}.")] = "gptq",
    bits: Annotated[str, typer.Option(help=field_help(
        QuantizeStage, "bits", "nf4: 4."))] = str(QUANT["bits"].default),
    target_bits: Annotated[float | None, typer.Option(help=field_help(GPTQStage, "target_bits"))
                           ] = GPTQ["target_bits"].default,
    target_mb: Annotated[float | None, typer.Option(help=field_help(GPTQStage, "target_mb"))
                         ] = GPTQ["target_mb"].default,
    group_size: Annotated[int, typer.Option(help=field_help(QuantizeStage, "group_size"))
                          ] = QUANT["group_size"].default,
    sym: Annotated[bool | None, typer.Option("--sym/--asym", help=knob_help("sym"))] = None,
    act_order: Annotated[bool | None, typer.Option(help=knob_help("act_order"))] = None,
    static_groups: Annotated[bool | None, typer.Option(help=knob_help("static_groups"))] = None,
    damp_percent: Annotated[float | None, typer.Option(help=knob_help("damp_percent"))] = None,
    clip: Annotated[bool | None, typer.Option(help=knob_help("clip"))] = None,
    scale_search: Annotated[str | None, typer.Option(help=knob_help("scale_search"))] = None,
    expert_tokens: Annotated[str | None, typer.Option(help=knob_help("expert_tokens"))] = None,
    double_quant: Annotated[bool | None, typer.Option(help=knob_help("double_quant"))] = None,
    compute_dtype: Annotated[str | None, typer.Option(help=knob_help("compute_dtype"))] = None,
    calibration: Annotated[str, typer.Option(
        help="'stdlib' or a path/glob of local text files.")] = "stdlib",
    samples: Annotated[int, typer.Option(help=field_help(CalibrationConfig, "samples"))
                       ] = CAL["samples"].default,
    seq_len: Annotated[int, typer.Option(help=field_help(CalibrationConfig, "seq_len"))
                       ] = CAL["seq_len"].default,
    device: Annotated[str, typer.Option(help=DEVICE_OPTION_HELP)] = EXEC["device"].default,
    offload_budget_gb: Annotated[float | None, typer.Option(help=BUDGET_OPTION_HELP)
                                 ] = EXEC["offload_budget_gb"].default,
) -> None:
    """Quantize a model into a GPTQ / AWQ / bitsandbytes-NF4 checkpoint, layer by layer."""
    from pydantic import ValidationError

    from thresher.compress.api import quantize_model
    from thresher.errors import RecipeError
    from thresher.models import resolve_model
    from thresher.recipe import FilesSource, format_validation_error

    if method not in QUANTIZE_STAGES:
        raise RecipeError(f"--method {method}: choose one of {', '.join(QUANTIZE_STAGES)}")
    source = "stdlib" if calibration == "stdlib" else FilesSource(files=[calibration])
    options = {"method": method, "bits": bits if bits == "auto" else _int_or_text(bits),
               "target_bits": target_bits, "target_mb": target_mb,
               "group_size": group_size, "sym": sym,
               "act_order": act_order, "static_groups": static_groups,
               "damp_percent": damp_percent, "clip": clip, "double_quant": double_quant,
               "compute_dtype": compute_dtype, "scale_search": scale_search,
               "expert_tokens": expert_tokens}
    try:
        stage = QuantizeStage(**{k: v for k, v in options.items() if v is not None})
        cal = CalibrationConfig(source=source, samples=samples, seq_len=seq_len)
    except ValidationError as err:
        where = f"quantize --method {method}"
        raise RecipeError(format_validation_error(err, where, as_options=True)) from None
    report = quantize_model(resolve_model(model), stage, cal, out, device=device,
                            offload_budget_gb=offload_budget_gb)
    m = report.metrics()
    if report.allocation is not None:
        a = report.allocation
        shares = ", ".join(f"{b}-bit {100 * v:.0f}%" for b, v in a["weight_share"].items())
        console.print(f"bits auto ({a['target']}): average {a['average_bits']:.3f} bits "
                      f"({shares}), quantized matrices {a['quantized_mb']:.2f} MiB")
    console.print(f"{stage.describe()}: {int(m['quantized_matrices'])} matrices in "
                  f"{m['wall_seconds']:.1f} s {_memory_note(report)}, "
                  f"mean relative error {m['mean_quant_error']:.4f}, "
                  f"{int(m['fallback_experts'])} fallback experts, {m['artifact_mb']:.1f} MB "
                  f"({report.format} format) -> {out}")
    _print_runtime_note(out)


def _print_runtime_note(checkpoint: Path) -> None:
    """Say when standard runtimes cannot load what a command wrote (per-layer expert counts)."""
    from thresher.models.card import runtime_note
    from thresher.models.layerwise import load_config

    note = runtime_note(load_config(checkpoint))
    if note is not None:
        console.print(f"[yellow]note:[/] {note}")


def _int_or_text(value: str) -> int | str:
    """An option's integer, or the text as given (for the schema to refuse, naming the option)."""
    try:
        return int(value)
    except ValueError:
        return value


# --- export -------------------------------------------------------------------------------------


@export_app.command("gguf", short_help="Write a checkpoint to one GGUF file, tokenizer included.")
@handles_errors
def export_gguf_cmd(
    model: Annotated[str, typer.Argument(
        help="A 16/32-bit model (base or pruned), or a GPTQ/AWQ artifact with group size 32 "
        "(exported to q4_1 as it is): hub id, local dir, models:/name/version or demo:size.")],
    out: Annotated[Path, typer.Option(help="The GGUF file to write (must not exist).")],
    type_: Annotated[str, typer.Option(
        "--type", help="llama.cpp file type: f32, f16, bf16, q8_0, q6_k, q5_0, q4_1, q4_0, "
        "q4_k (Q4_K_S), q4_k_m, q3_k (Q3_K_S) or q3_k_m; each tensor takes the type llama.cpp's "
        "quantizer gives it in that file type (the head at q6_k, attn_v/ffn_down mixes); norms "
        "and routers stay f32.")] = "f16",
    imatrix: Annotated[bool, typer.Option(
        "--imatrix", help="Weight the rounding of q6_k, q5_0, q4_1, q4_0, q4_k(_m) and q3_k(_m) by the "
        "importance of each input column on calibration windows, as llama.cpp's --imatrix.")]
        = False,
    gptq: Annotated[bool, typer.Option(
        "--gptq", help="Round q4_0, q4_1, q5_0, q4_k(_m), q3_k(_m) and q6_k blocks by GPTQ against "
        "each matrix's Hessian on calibration windows, with the --imatrix fit's block scales "
        "(implies --imatrix).")] = False,
    calibration_samples: Annotated[int, typer.Option(help=field_help(
        CalibrationConfig, "samples", "For --imatrix and --gptq."), min=1)] = CAL["samples"].default,
) -> None:
    """Write a checkpoint (base, pruned or merged) to one GGUF file for llama.cpp and Ollama,
    tokenizer included: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, GLM-4.5, DeepSeek-V3, gpt-oss,
    ERNIE-4.5, Qwen3.5-MoE, Llama, Qwen3 or Qwen2."""
    from thresher.export import compute_importance, export_gguf
    from thresher.models import resolve_model

    model_dir = resolve_model(model)
    importance = (compute_importance(model_dir, CalibrationConfig(samples=calibration_samples),
                                     hessians=gptq)
                  if imatrix or gptq else None)
    result = export_gguf(model_dir, out, type_, importance=importance, gptq=gptq)
    how = " rounded by GPTQ" if result.gptq else " with an importance matrix" if result.imatrix else (
        " (GPTQ/AWQ codes as they are)" if result.lossless else "")
    console.print(f"{result.architecture} {result.type}{how}: {result.tensors} tensors, "
                  f"{result.num_experts} experts per layer, {result.file_bytes / 1e6:.1f} MB in "
                  f"{result.wall_seconds:.1f} s -> {out}")


# --- task evaluation and the comparison report ---------------------------------------------------


@app.command("tasks", short_help="Score a model on lm-evaluation-harness tasks.")
@handles_errors
def tasks_cmd(
    model: Annotated[str, typer.Option(help="Hub id, local dir, models:/name/version or demo:size.")],
    task: Annotated[list[str], typer.Option(
        "--task", "-t", help="Task to run (repeat). Built-in: stdlib_closing, stdlib_identifier, "
        "stdlib_next_line (multiple choice), stdlib_complete_line, stdlib_function_body "
        "(generative, decoded by the serving engine); or any lm-eval task name.")] = ["stdlib_closing", "stdlib_identifier",  # noqa: B006
                                                             "stdlib_next_line"],
    limit: Annotated[int, typer.Option(min=0, help="Cap on documents per task (0 = all).")] = 0,
    batch_size: Annotated[int, typer.Option(min=1, help="Sequences per forward pass.")] = 16,
    json_out: Annotated[Path | None, typer.Option("--json", help="Also write the results here.")] = None,
) -> None:
    """Score a model on lm-evaluation-harness tasks (the built-in ones run offline)."""
    from thresher.evaluate.tasks import run_tasks
    from thresher.paths import write_text_atomically

    if json_out is not None:  # refused now rather than after the tasks have run
        _check_writable_parent(json_out, "'--json'")
    results = run_tasks(model, tasks=task, limit=limit or None, batch_size=batch_size)
    table = Table(title=f"{model}: lm-eval {results.lm_eval_version}, backend {results.backend}, "
                  f"batch {results.batch_size}")
    for col in ("task", "metric", "value", "stderr", "docs"):
        table.add_column(col)
    for name, metrics in sorted(results.scores.items()):
        for metric, value in sorted(metrics.items()):
            stderr = "-" if value.stderr is None else f"{value.stderr:.4f}"
            table.add_row(name, metric, f"{value.value:.4f}", stderr,
                          str(results.samples.get(name, "")))
    console.print(table)
    if json_out is not None:
        write_text_atomically(json_out, results.to_json())
        console.print(f"results written to {json_out}")


def _check_writable_parent(path: Path, option: str) -> None:
    """Refuse an output path whose directory is missing or not writable, before any compute."""
    parent = path.parent
    if path.is_dir() or not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        why = ("is a directory" if path.is_dir() else
               f"{parent} does not exist" if not parent.exists() else
               f"{parent} is not a directory" if not parent.is_dir() else
               f"{parent} is not writable")
        raise typer.BadParameter(f"{path}: {why}", param_hint=option)


# --- serving -------------------------------------------------------------------------------------


def default_served_name(model: str, path: Path) -> str:
    """The name clients send by default: what the user typed for a hub id or a demo model (as
    vLLM does; their directories are a snapshot's commit hash and a spec hash), a registry
    model's name/version, a local directory's name."""
    from thresher.models.source import parse_model_source

    source = parse_model_source(model)
    if source.kind == "local":
        return path.name
    if source.kind == "registry":
        return source.value
    return model


def _describe_loaded(name: str, info: dict, max_model_len: int) -> str:
    """The startup line: what was loaded (format, bits, serving dtype, experts, memory)."""
    bits = info.get("bits")
    fmt = f"{info.get('format', '?')}" + (f", {bits}-bit weights" if bits else "")
    fmt += f", serving {info['dtype']}" if info.get("dtype") else ""
    experts = f", {info['num_experts']} experts" if info.get("num_experts") else ""
    if info.get("layer_num_experts"):  # a damage-budget prune: one count per layer
        experts = f", experts per layer {'/'.join(map(str, info['layer_num_experts']))}"
    params = f", {info['params'] / 1e6:.1f} M parameters" if info.get("params") else ""
    memory = ""
    if info.get("weight_bytes") is not None:
        memory = f", weights {info['weight_bytes'] / 2**20:.1f} MiB"
    if info.get("kv_cache_bytes") is not None:
        memory += f", KV cache {info['kv_cache_bytes'] / 2**20:.1f} MiB"
    spec = info.get("speculative")
    drafting = (f", speculative decoding with {spec['draft']} (k={spec['num_speculative_tokens']}"
                f"{'' if spec.get('pacing', True) else ', no pacing'})" if spec else "")
    return (f"loaded {name}: {fmt}{experts}{params}{memory}, context {max_model_len} tokens"
            f"{drafting}")


@app.command(short_help="Compare variants: table, Pareto frontier, task bars, saliency.")
@handles_errors
def compare(
    run_ids: Annotated[list[str], typer.Argument(
        help="MLflow run ids: variant runs, or a flow's parent run (expands to its variants).")],
    out: Annotated[Path, typer.Option(help="Directory for the report files.")] = Path("comparison"),
    tracking_uri: Annotated[str | None, typer.Option(
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else SQLite under the state "
        "directory).")] = None,
    log_to: Annotated[str | None, typer.Option(
        help="Log the report files to this MLflow run (e.g. the flow's parent run).")] = None,
) -> None:
    """Compare variants: a table, quality-vs-size with the Pareto frontier, task bars, saliency."""
    from thresher.evaluate.report import build_report, collect_from_mlflow, log_report

    records = collect_from_mlflow(run_ids, tracking_uri=tracking_uri)
    report = build_report(records, out)
    print_comparison(records, title=f"{len(records)} variants")
    for kind, path in report.files.items():
        console.print(f"  {kind}: {path}")
    if log_to:
        log_report(report, log_to, tracking_uri=tracking_uri)
        console.print(f"report logged to MLflow run {log_to} (artifacts/comparison)")


def _speculative_config(draft: str | None, num_speculative_tokens: int | None,
                        pacing: bool = True):
    """The engine's speculative-decoding options from ``serve``'s flags (None: plain decoding)."""
    from thresher.serve_kernels.engine.speculative import SpeculativeConfig

    if draft is None:
        if num_speculative_tokens is not None:
            raise typer.BadParameter("needs --draft (ngram or a draft model) to propose tokens",
                                     param_hint="'--num-speculative-tokens'")
        return None
    if num_speculative_tokens is None:
        return SpeculativeConfig(draft, adaptive=pacing)
    return SpeculativeConfig(draft, num_speculative_tokens, adaptive=pacing)


@app.command(short_help="Serve a model over an OpenAI-compatible HTTP API.")
@handles_errors
def serve(
    model: Annotated[str, typer.Argument(
        help="Published artifact directory, models:/name/version, or demo:tiny|small.")],
    host: Annotated[str, typer.Option(help="Interface to bind (loopback by default).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port.")] = 8000,
    api_key: Annotated[str | None, typer.Option(
        envvar="THRESHER_API_KEY",
        help="Require 'Authorization: Bearer KEY' on /v1 endpoints (an empty key is refused; "
             "leave it unset to serve without one).")] = None,
    served_model_name: Annotated[str | None, typer.Option(
        help="Model name clients send (default: a hub id or demo:SIZE as given, a registry "
             "model's name/version, a local directory's name).")] = None,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="Sequences in the running batch.")] = 64,
    max_queue: Annotated[int, typer.Option(
        min=0, help="Sequences allowed to wait beyond the running batch; more get HTTP "
                    "429.")] = 256,
    max_model_len: Annotated[int | None, typer.Option(
        min=1, help="Context length (default: the model's).")] = None,
    dtype: Annotated[str, typer.Option(
        help="Serving dtype: auto (16-bit on a GPU; on a CPU bfloat16 where it has bf16 dot "
             "products (AVX512-BF16) or for checkpoints of 128 MB and more, else float32), "
             "float32, bfloat16, float16.")] = "auto",
    max_num_batched_tokens: Annotated[int, typer.Option(
        min=1, help="New tokens per engine step (prefill chunks plus decode rows).")] = 2048,
    block_size: Annotated[int, typer.Option(min=1, help="Tokens per KV-cache block.")] = 16,
    num_kv_blocks: Annotated[int | None, typer.Option(
        min=1, help="KV-cache blocks (default: from --kv-cache-gb, else sized from GPU memory on "
                    "CUDA, else 1 GiB on a CPU).")] = None,
    kv_cache_gb: Annotated[float | None, typer.Option(
        help="KV-cache size in GiB (instead of --num-kv-blocks).")] = None,
    gpu_memory_utilization: Annotated[float, typer.Option(
        help="CUDA: this engine's share of the GPU's memory for weights, activations "
             "and the KV cache (other processes' use not counted; free memory caps it).")] = 0.9,
    enforce_eager: Annotated[bool, typer.Option(
        help="CUDA: run decode steps eagerly instead of replaying CUDA graphs.")] = False,
    max_body_bytes: Annotated[int, typer.Option(
        min=1, help="Largest request body accepted; larger ones get HTTP 413.")] = 8 * 2**20,
    draft: Annotated[str | None, typer.Option(
        help="Speculative decoding: 'ngram' (prompt lookup) or a draft model (artifact "
             "directory, models:/name/version, demo:NAME) with the target's tokenizer.")] = None,
    num_speculative_tokens: Annotated[int | None, typer.Option(
        min=1, max=16, help="Speculative decoding: tokens proposed per sequence and step (k; "
                            "default 3 with --draft).")] = None,
    speculative_pacing: Annotated[bool, typer.Option(
        help="Speculative decoding: a sequence whose recent proposals mostly fail decodes "
             "plainly for a while (2 to 64 steps) before proposing again; off, every sequence "
             "proposes at every step.")] = True,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions).

    Exits with status 3 if the engine itself fails (after answering every waiting request), so
    that a supervisor restarts it; a failure of one request fails that request alone.
    """
    from thresher.models import resolve_model
    from thresher.serve_kernels import LLMEngine
    from thresher.serve_kernels.server import (
        ServerConfig,
        bind_listener,
        bind_warning,
        build_app,
        run_server,
    )

    if api_key is None and os.environ.get("THRESHER_API_KEY") == "":  # click skips an empty one
        api_key = ""
    if api_key is not None and not api_key.strip():
        raise typer.BadParameter("the API key is empty (an unset variable?); pass a key, or "
                                 "leave --api-key and THRESHER_API_KEY unset to serve without one",
                                 param_hint="'--api-key' / THRESHER_API_KEY")
    warning = bind_warning(host, api_key)
    if warning:
        err_console.print(f"[bold yellow]warning:[/] {warning}", highlight=False, soft_wrap=True)
    try:
        sock = bind_listener(host, port)
    except OSError as err:
        raise typer.BadParameter(f"cannot listen on {host}:{port}: {err.strerror or err}",
                                 param_hint="'--host' / '--port'") from None
    path = resolve_model(model)
    try:
        speculative = _speculative_config(draft, num_speculative_tokens, speculative_pacing)
        engine = LLMEngine(path, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                           dtype=dtype, max_num_batched_tokens=max_num_batched_tokens,
                           block_size=block_size, num_kv_blocks=num_kv_blocks,
                           kv_cache_gb=kv_cache_gb, gpu_memory_utilization=gpu_memory_utilization,
                           enforce_eager=enforce_eager, speculative=speculative)
    except ValueError as err:  # an engine option out of range: the message starts "name=value"
        option = re.match(r"(\w+)=", str(err))
        raise typer.BadParameter(str(err), param_hint=option and
                                 f"'--{option.group(1).replace('_', '-')}'") from None
    name = served_model_name or default_served_name(model, path)
    console.print(_describe_loaded(name, engine.model_info, engine.max_model_len), highlight=False,
                  soft_wrap=True)
    auth = "API key required" if api_key else "no API key"
    console.print(f"serving '{name}' at http://{host}:{port}/v1 ({auth}); metrics at /metrics",
                  highlight=False, soft_wrap=True)
    app_ = build_app(engine, ServerConfig(served_model_name=name, api_key=api_key,
                                          max_num_seqs=max_num_seqs, max_queue=max_queue,
                                          max_body_bytes=max_body_bytes))
    status = run_server(app_, host, port, sock)
    if status:
        err_console.print("[bold red]error:[/] the engine failed (the log above has the "
                          "traceback); exiting so that a supervisor can restart the server",
                          highlight=False)
        raise typer.Exit(status)


# --- the embedded default -----------------------------------------------------------------------


DEMO_RECIPE = Path(__file__).parent / "configs" / "demo.yaml"  # inside the package: wheels have it


@app.command(short_help="Run the embedded default recipe end to end.")
@handles_errors
def demo(
    recipe: Annotated[Path, typer.Option(
        help="Recipe to run.", show_default="the embedded recipe")] = DEMO_RECIPE,
    print_recipe: Annotated[bool, typer.Option(
        "--print-recipe", help="Print the recipe (a start for your own) and exit.")] = False,
) -> None:
    """Run the embedded default end to end: the demo model through the compress flow."""
    from thresher.flows.compress import compress
    from thresher.flows.sweep import load_recipe
    from thresher.models import resolve_model
    from thresher.tracking import resolve_tracking_uri

    r = load_recipe(recipe)
    if print_recipe:
        print(recipe.read_text(), end="")
        return
    path = resolve_model(r.model)  # a demo model is trained here, before the flow starts
    if (path / DEMO_MODEL_META).is_file():
        meta = json.loads((path / DEMO_MODEL_META).read_text())
        console.print(f"{r.model}: {meta['parameters']:,} parameters, trained in "
                      f"{meta['train_seconds']} s ({path})")
    summary = compress(r)
    print_summary_table(summary)
    uri = resolve_tracking_uri(r.tracking.mlflow_uri)
    console.print(f"\nMLflow runs: parent {summary['parent_run_id']} in {uri}")
    console.print(f"  open the MLflow UI:  .venv/bin/mlflow ui --backend-store-uri {uri} "
                  "--workers 1 --port 5000   (then http://127.0.0.1:5000)")
    console.print("  open the Prefect UI: .venv/bin/prefect server start --port 4200   "
                  "(then http://127.0.0.1:4200; the flow runs are in its database)")


def run() -> None:
    """Entry point of `python -m thresher`."""
    sys.exit(app())
