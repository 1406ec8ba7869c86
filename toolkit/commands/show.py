"""show: the recipe as its layers compose it, each item with the file:line it came from (as `kustomize build` or
`bitbake -e` show theirs)."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from toolkit.recipe import LoadedRecipe, load_recipe
from toolkit.results import Report

PLAIN_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class ShowRequest:
    recipe: Path
    resolved: bool = False  # the merged recipe as YAML, every value commented with its origin


def origins(loaded: LoadedRecipe) -> dict[str, str]:
    """Dotted location -> file:line, for every value of the merged recipe."""
    out: dict[str, str] = {}

    def walk(node: Any, path: tuple[str | int, ...]) -> None:
        if path:
            out[".".join(str(p) for p in path)] = loaded.where(*path)
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, (*path, key))
        elif isinstance(node, list):
            for index, value in enumerate(node):
                walk(value, (*path, index))

    walk(loaded.located.data, ())
    return out


def _scalar(value: Any) -> str:
    """A YAML scalar that loads back as exactly this value: JSON's spelling (ASCII, every other character escaped),
    which YAML reads the same, except the floats JSON has no word for."""
    if isinstance(value, float) and not math.isfinite(value):
        return ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    return json.dumps(value)


def _key(key: str | int) -> str:
    if isinstance(key, str) and PLAIN_KEY.match(key) and yaml.safe_load(key) == key:
        return key
    return str(key) if isinstance(key, int) and not isinstance(key, bool) else _scalar(key)


def resolved_yaml(loaded: LoadedRecipe) -> str:
    """The merged recipe as YAML (yaml.safe_load gives the merged data back), each line ending in its origin."""
    lines = [f"# {loaded.recipe.name}, merged from {', '.join(loaded.layers)} (toolkit show --resolved)"]

    def emit(node: Any, path: tuple[str | int, ...], pad: str) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            here = (*path, key)
            lead = f"{pad}{_key(key)}:" if isinstance(node, dict) else f"{pad}-"
            note = f"  # {loaded.where(*here)}"
            if isinstance(value, dict | list) and value:
                lines.append(lead + note)
                emit(value, here, pad + "  ")
            else:
                lines.append(f"{lead} {_scalar(value)}{note}")

    emit(loaded.located.data, (), "")
    return "\n".join(lines) + "\n"


def show(request: ShowRequest) -> Report:
    loaded = load_recipe(request.recipe)
    data = loaded.located.data
    rows: list[tuple[str, str]] = [(f"layer {i + 1}", layer) for i, layer in enumerate(loaded.layers)]
    for key, value in data.items():
        if key == "transforms":
            rows += [(f"transforms[{i}] {t.get('id')} ({t.get('kind')})", loaded.where("transforms", i))
                     for i, t in enumerate(value)]
        elif key == "variants" and isinstance(value, dict):
            rows += [(f"variants.{name}", loaded.where("variants", name)) for name in value]
        else:
            rows.append((key, loaded.where(key)))
    extra: dict[str, Any] = {"layers": list(loaded.layers), "resolved": data, "origins": origins(loaded)}
    if request.resolved:
        extra["resolved_yaml"] = resolved_yaml(loaded)
    return Report("show", str(loaded.path), columns=("item", "origin"), rows=tuple(rows), extra=extra,
                  notes=(f"{len(loaded.recipe.transforms)} transforms from {len(loaded.layers)} file(s); "
                         "`--resolved` prints the merged recipe with every value's origin",))
