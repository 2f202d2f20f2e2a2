"""Deployments and schedules: compress jobs started from the Prefect UI, the CLI or a cron schedule.

``configs/schedules.yaml`` lists deployments, each a recipe file and an optional cron schedule.
A deployment is of the ``compress`` flow, whose parameter is the typed recipe: the recipe file is
read at deploy time and becomes the deployment's parameters, so the Prefect UI's Run page shows
the recipe as a form (drawn from the recipe schema) prefilled from the file, and the schedule
runs that recipe. Edit the file, deploy again. Two ways to run them:

- ``serve`` (one machine): this process registers the deployments with the Prefect server and
  executes their runs itself, as they are triggered from the UI, ``prefect deployment run`` or the
  schedule.
- a work pool (many machines): the deployments are registered against a Prefect work pool, and
  ``prefect worker start --pool NAME`` on any machine with thresher installed picks the runs up;
  the entrypoint is the module path ``thresher.flows.compress.compress``, imported from the
  installed package, so workers need no source checkout.
"""

from __future__ import annotations

from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from thresher.errors import RecipeError, TrackingError
from thresher.flows.sweep import load_recipe

RECIPE_KEYS = {"model", "variants", "name"}  # a recipe's, where a schedules file was expected


class DeploymentSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    recipe: str = Field(description="recipe YAML path (relative to the schedules file)")
    cron: str | None = Field(None, description="cron schedule, e.g. '0 3 * * *'")
    timezone: str = "UTC"
    paused: bool = False
    tracking_uri: str | None = None

    @field_validator("cron")
    @classmethod
    def _cron(cls, v: str | None) -> str | None:
        """Checked as Prefect's schedule checks it, at load rather than mid-registration."""
        if v is not None:
            from prefect.schedules import Cron

            Cron(v)  # raises ValueError naming the string
        return v

    @field_validator("timezone")
    @classmethod
    def _timezone(cls, v: str) -> str:
        try:
            ZoneInfo(v)
        except (ZoneInfoNotFoundError, ValueError):
            raise ValueError(f"{v!r} is not an IANA time zone (e.g. UTC, Europe/Berlin)") from None
        return v


class SchedulesFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    deployments: list[DeploymentSpec] = Field(min_length=1)


def load_schedules(path: str | Path) -> list[DeploymentSpec]:
    """Read a schedules file; recipe paths become absolute and every recipe is validated."""
    path = Path(path)
    if not path.is_file():
        raise RecipeError(f"{path}: no such schedules file")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise RecipeError(f"{path}: not valid YAML: {err}") from None
    if isinstance(data, dict) and "deployments" not in data and RECIPE_KEYS & set(data):
        raise RecipeError(
            f"{path}: a recipe, where `thresher deploy` takes a schedules file naming recipes "
            "(configs/schedules.yaml: deployments: [{name: NAME, recipe: PATH, cron: '0 3 * * *'}]"
            f"); to run this recipe once, `thresher run {path}`")
    try:
        parsed = SchedulesFile.model_validate(data)
    except ValidationError as err:
        keys = ", ".join(DeploymentSpec.model_fields)
        problems = "\n".join(
            f"  {'.'.join(map(str, e['loc'])) or '(top level)'}: "
            + (f"unknown key (a deployment takes {keys})" if e["type"] == "extra_forbidden"
               else e["msg"].removeprefix("Value error, "))
            for e in err.errors())
        raise RecipeError(f"{path}: the schedules file is invalid\n{problems}") from None
    specs = []
    for spec in parsed.deployments:
        recipe = (path.parent / spec.recipe).resolve()  # an absolute path stays as it is
        load_recipe(recipe)  # refuse a broken recipe now, not at 3 am
        specs.append(spec.model_copy(update={"recipe": str(recipe)}))
    return specs


def _schedules(spec: DeploymentSpec) -> list:
    from prefect.schedules import Cron

    return [Cron(spec.cron, timezone=spec.timezone)] if spec.cron else []


def deployment_parameters(spec: DeploymentSpec) -> dict:
    """The deployment's parameters: the recipe file's content, as the run form submits it."""
    params: dict = {"recipe": load_recipe(spec.recipe).model_dump(mode="json", by_alias=True)}
    if spec.tracking_uri:
        params["tracking_uri"] = spec.tracking_uri
    return params


def _description(spec: DeploymentSpec) -> str:
    return (f"thresher compress, prefilled from {spec.recipe} at deploy time: edit the recipe on "
            "the Run page (Custom run) or edit the file and deploy again.")


def check_prefect_api() -> None:
    """Refuse, with the address and what to start, when the Prefect API does not answer."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        err = client.api_healthcheck()
        if err is not None:
            raise TrackingError(
                f"the Prefect API at {client.api_url} does not answer ({type(err).__name__}: "
                f"{err}); start one (`thresher stack up`, or `prefect server start`) and point "
                "PREFECT_API_URL at it")


def serve_deployments(specs: list[DeploymentSpec]) -> None:
    """Register the deployments and execute their runs in this process (blocks)."""
    from prefect import serve

    from thresher.flows.compress import compress

    check_prefect_api()

    deployments = [
        compress.to_deployment(
            name=s.name, parameters=deployment_parameters(s), schedules=_schedules(s),
            paused=s.paused, tags=["thresher"], description=_description(s),
        )
        for s in specs
    ]
    serve(*deployments)


def deploy_to_work_pool(specs: list[DeploymentSpec], work_pool: str) -> list[str]:
    """Register the deployments against ``work_pool``; workers run them from their installed
    thresher. Returns deployment ids."""
    from prefect.deployments.runner import EntrypointType

    from thresher.flows.compress import compress

    check_prefect_api()
    ids = []
    for s in specs:
        ids.append(str(compress.deploy(
            name=s.name, work_pool_name=work_pool, entrypoint_type=EntrypointType.MODULE_PATH,
            parameters=deployment_parameters(s),
            schedules=_schedules(s), paused=s.paused, tags=["thresher"],
            description=_description(s),
            print_next_steps=False,
        )))
    return ids
