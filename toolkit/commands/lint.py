"""lint and variants: configurations that cannot start, caught from the recipe."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.commands.common import Inputs, pinned
from toolkit.lint import lint as lint_recipe
from toolkit.recipe import load_recipe
from toolkit.results import Report, Severity
from toolkit.variants import expand as expand_variants
from toolkit.variants import find as find_variant

NOT_A_SUBMISSION = "NOT A SUBMISSION"


@dataclass(frozen=True)
class LintRequest:
    recipe: Path
    variant: str | None = None
    rootfs: Path | None = None  # also check against an extracted image (shadowing, remove_when, the true base)
    strict: bool = False  # exit 1 on warnings
    verbose: bool = False  # info-level notes too
    inputs: Inputs = field(default_factory=Inputs)  # --source: deployed third-party files are read too


def lint(request: LintRequest) -> Report:
    loaded = load_recipe(request.recipe)
    loaded, _ = pinned(loaded, request.inputs)  # the sources found here: lint reads their deployed files too
    recipe = loaded.recipe
    if request.variant:
        recipe = find_variant(recipe, request.variant).apply(recipe)
    result = lint_recipe(loaded, recipe, variant=request.variant, rootfs=request.rootfs,
                         compare_base=request.rootfs is not None)
    issues = tuple(i for i in result.issues
                   if request.verbose or i.severity is not Severity.INFO or i.rule == "kv-cache")
    return dataclasses.replace(Report("lint", str(loaded.path), issues=issues, extra=result.data),
                               exit_code=result.exit_code(request.strict))


def variants(recipe: Path) -> Report:
    """The expanded experiment set with the lint result of each, linted as the diagnostic verbs that run them do:
    one vLLM or the hardware would refuse is DROPPED; one only the platform's submission forbids runs, marked
    NOT A SUBMISSION (build would refuse it)."""
    loaded = load_recipe(recipe)
    rows = []
    entries = []
    for variant in expand_variants(loaded.recipe):
        result = lint_recipe(loaded, variant.apply(loaded.recipe), variant=variant.name, for_submission=False)
        why = result.refusals or result.not_a_submission
        status = "DROPPED" if result.refusals else NOT_A_SUBMISSION if result.not_a_submission else "ok"
        rows.append((variant.name, variant.describe(), str(result.errors), str(result.warnings), status,
                     "; ".join(f"{i.rule}: {i.message}" for i in why)))
        entries.append({"name": variant.name, "args": variant.args, "env": variant.env, "status": status,
                        "errors": result.errors, "warnings": result.warnings,
                        "issues": [i.as_json() for i in result.issues if i.severity is not Severity.INFO]})
    runs = sum(1 for e in entries if e["status"] != "DROPPED")
    platform = sum(1 for e in entries if e["status"] == NOT_A_SUBMISSION)
    return Report("variants", str(loaded.path), columns=("variant", "overrides", "errors", "warnings", "status",
                                                          "why"), rows=tuple(rows),
                  notes=(f"{runs} of {len(entries)} variant(s) can start; DROPPED ones fail lint with an error"
                         + (f"; {platform} of them {NOT_A_SUBMISSION}: they run (preflight, rehearse, estimate, "
                            "experiment) but build refuses them, the platform requires what they lack" if platform
                            else ""),),
                  extra={"variants": entries})
