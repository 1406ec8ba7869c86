"""Rendering: the Dockerfile, the platform run config and the in-image script, from the recipe."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import jinja2

from toolkit.errors import ToolkitError
from toolkit.recipe import ArgValue, Recipe, Source

PROJECT = Path(__file__).resolve().parent.parent
DOCKERFILE_TEMPLATE = PROJECT / "Dockerfile.j2"
TEMPLATES = PROJECT / "templates"
PAYLOAD = "toolkit_payload"  # in the submission repository
IMAGE_PAYLOAD = "/opt/toolkit-payload"  # where the Dockerfile copies it


def yamlquote(value: object) -> str:
    """A YAML single-quoted scalar: every argv item and env value is a string, numbers included."""
    return "'" + str(value).replace("'", "''") + "'"


def dockerquote(value: object) -> str:
    # JSON string syntax is what Docker's ENV parser accepts for double-quoted values
    return json.dumps(str(value))


def argv(recipe: Recipe) -> list[str]:
    out = ["python3", "-m", recipe.serve.module]
    for key, value in recipe.serve.args.items():
        out.extend(flag_words(key, value))
    return out


def flag_words(key: str, value: ArgValue) -> list[str]:
    flag = "--" + key.replace("_", "-")
    if value is None or value is False:
        return []
    if value is True:
        return [flag]
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, str(value)]


@dataclass(frozen=True)
class Rendered:
    dockerfile: str
    run_config: str
    apply_sh: str


def _env() -> jinja2.Environment:
    for path in (DOCKERFILE_TEMPLATE, TEMPLATES):
        if not path.exists():
            raise ToolkitError(f"template {path} not found",
                               hint="install the toolkit from its checkout with `pip install -e .`")
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader([str(PROJECT), str(TEMPLATES)]),
        undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        autoescape=False,
    )
    env.filters["yamlquote"] = yamlquote
    env.filters["dockerquote"] = dockerquote
    env.filters["shquote"] = shlex.quote
    return env


def render(recipe: Recipe, recipe_file: str, variant: str | None, fetched: list[Source] | None = None) -> Rendered:
    env = _env()
    context = {
        "recipe_name": recipe.name, "recipe_file": recipe_file, "variant": variant,
        "base_image": recipe.base_image.reference, "workdir": recipe.serve.workdir,
        "env": sorted(recipe.env.items()), "argv": argv(recipe), "concurrency": recipe.serve.concurrency,
        "payload_name": PAYLOAD, "payload_dir": IMAGE_PAYLOAD,
        "fetched": [{"name": s.name, "git": s.git, "commit": s.commit, "subdir": s.subdir} for s in fetched or []],
    }
    return Rendered(
        dockerfile=env.get_template("Dockerfile.j2").render(context),
        run_config=env.get_template("computility-run.yaml.j2").render(context),
        apply_sh=env.get_template("apply.sh.j2").render(context),
    )
