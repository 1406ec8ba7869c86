"""Experiment variants: named overrides plus a matrix expanded as a product, each linted."""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any

from toolkit.errors import ToolkitError
from toolkit.recipe import ArgValue, Recipe

BASE = "base"


@dataclass(frozen=True)
class Variant:
    name: str
    args: dict[str, ArgValue]  # overrides (None removes the flag)
    env: dict[str, str | None]

    def apply(self, recipe: Recipe) -> Recipe:
        args = dict(recipe.serve.args)
        env = dict(recipe.env)
        for key, value in self.args.items():
            args.pop(key, None) if value is None else args.__setitem__(key, value)
        for key, env_value in self.env.items():
            env.pop(key, None) if env_value is None else env.__setitem__(key, env_value)
        return recipe.model_copy(update={"serve": recipe.serve.model_copy(update={"args": args}), "env": env})

    def describe(self) -> str:
        parts = [f"--{k}={v}" for k, v in self.args.items()] + [f"{k}={v}" for k, v in self.env.items()]
        return " ".join(parts) or "(the recipe as written)"


def _short(key: str, keys: list[str]) -> str:
    """mnbt for max-num-batched-tokens, unless two keys of the matrix would share it."""
    short = "".join(w[0] for w in re.split(r"[-_]", key.lower()) if w)
    clash = [k for k in keys if k != key and "".join(w[0] for w in re.split(r"[-_]", k.lower()) if w) == short]
    return key.lower().replace("_", "-") if clash else short


def _slug(value: Any) -> str:
    return re.sub(r"[^a-z0-9.]+", "-", str(value).lower()).strip("-") or "none"


def expand(recipe: Recipe) -> list[Variant]:
    """The base recipe, each named variant, then every combination of the matrix."""
    out = [Variant(BASE, {}, {})]
    out += [Variant(name, dict(v.args), dict(v.env)) for name, v in recipe.variants.items()]
    matrix = recipe.matrix
    if matrix and (matrix.args or matrix.env):
        axes: list[tuple[str, str, list[Any]]] = [("args", k, v) for k, v in matrix.args.items()]
        axes += [("env", k, v) for k, v in matrix.env.items()]
        keys = [k for _, k, _ in axes]
        for combo in itertools.product(*(values for _, _, values in axes)):
            args = {k: v for (section, k, _), v in zip(axes, combo, strict=True) if section == "args"}
            env = {k: v for (section, k, _), v in zip(axes, combo, strict=True) if section == "env"}
            name = "_".join(f"{_short(k, keys)}-{_slug(v)}" for (_, k, _), v in zip(axes, combo, strict=True))
            out.append(Variant(name, args, env))
    names = [v.name for v in out]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ToolkitError(f"variant names collide: {', '.join(dupes)}",
                           hint="rename the named variants so they differ from the matrix's generated names")
    return out


def find(recipe: Recipe, name: str) -> Variant:
    variants = expand(recipe)
    for variant in variants:
        if variant.name == name:
            return variant
    raise ToolkitError(f"no variant {name!r}",
                       hint="list them with `toolkit variants RECIPE`: " + ", ".join(v.name for v in variants[:8])
                       + (" ..." if len(variants) > 8 else ""))
