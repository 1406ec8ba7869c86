"""`toolkit lint`: configurations that cannot start, caught from the recipe before a remote launch.

The package owns the lint stage: `context` (what a rule sees, the registry), `rules` (each rule, registered on
import), `kv` (the KV-cache estimate), `vllm_cli` (the pinned vLLM's flags, read from source). It may import the
recipe, sources, the engine and the trial (a rule checks remove_when against a given image); nothing later."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.lint import rules as _rules  # noqa: F401  (the rules register themselves in RULES on import)
from toolkit.lint.context import RULES, LintContext
from toolkit.recipe import LoadedRecipe, Recipe
from toolkit.results import Issue, Severity

__all__ = ["RULES", "LintResult", "lint"]


@dataclass(frozen=True)
class LintResult:
    issues: tuple[Issue, ...]
    data: dict[str, Any]

    @property
    def errors(self) -> int:
        return sum(1 for i in self.issues if i.severity is Severity.ERROR)

    @property
    def warnings(self) -> int:
        return sum(1 for i in self.issues if i.severity is Severity.WARNING)

    @property
    def refusals(self) -> tuple[Issue, ...]:
        """What vLLM or the hardware would refuse (and, for a submission, what the platform requires)."""
        return tuple(i for i in self.issues if i.severity is Severity.ERROR)

    @property
    def not_a_submission(self) -> tuple[Issue, ...]:
        """What only the platform's submission requires, found by a diagnostic run: the variant runs, but would not
        be accepted as a submission."""
        return tuple(i for i in self.issues if i.platform and i.severity is Severity.WARNING)

    def exit_code(self, strict: bool) -> int:
        if self.errors:
            return 2
        return 1 if strict and self.warnings else 0


def lint(loaded: LoadedRecipe, recipe: Recipe | None = None, *, variant: str | None = None,
         rootfs: Path | None = None, compare_base: bool = False, for_submission: bool = True) -> LintResult:
    """compare_base: with rootfs, also compare its vendor tree with vendor.reference and its neighbours (fetched by
    pip once, cached): the `lint --rootfs` verb asks for it, verify does not.

    for_submission: False for a diagnostic run (preflight, rehearse, estimate, experiment), where an error of a
    platform rule (what only the submission requires) is a warning marked `platform`; a configuration vLLM itself
    refuses stays an error either way."""
    ctx = LintContext(loaded, recipe or loaded.recipe, variant, rootfs, compare_base=compare_base)
    issues: list[Issue] = []
    for info in RULES.values():
        for issue in info.check(ctx):
            platform = info.platform and issue.severity is Severity.ERROR
            if platform and not for_submission:
                # the verb that ran it says "<verb>, but not a submission": the message says why only
                issues.append(Issue(issue.rule, Severity.WARNING, f"{issue.message} (only the platform's "
                                    "submission requires this)", issue.fix, issue.origin, variant, platform=True))
                continue
            issues.append(Issue(issue.rule, issue.severity, issue.message, issue.fix, issue.origin, variant,
                                platform=platform))
    order = {Severity.ERROR: 0, Severity.WARNING: 1, Severity.INFO: 2}
    issues.sort(key=lambda i: (order[i.severity], loaded.layers.index(i.origin.file) if i.origin and i.origin.file
                               in loaded.layers else len(loaded.layers), i.line or 0, i.rule))
    return LintResult(tuple(issues), dict(ctx.extra))

