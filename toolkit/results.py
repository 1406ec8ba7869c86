"""Results as data: every verb returns a Report, one reporter prints it."""

from __future__ import annotations

import enum
from dataclasses import asdict, dataclass, field
from typing import Any

from toolkit import __version__


class State(str, enum.Enum):
    WOULD_APPLY = "WOULD_APPLY"  # planned, not written (diff, --dry-run, trials); an apply that commits says APPLIED
    APPLIED = "APPLIED"
    ALREADY_APPLIED = "ALREADY_APPLIED"
    SUPERSEDED = "SUPERSEDED"
    DRIFTED = "DRIFTED"
    GATED_OFF = "GATED_OFF"

    @property
    def ok(self) -> bool:
        return self is not State.DRIFTED


@dataclass(frozen=True)
class Origin:
    """Where in a recipe (the file of the layer that declared it, and the line) a value or a transform came from."""

    file: str
    line: int

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


@dataclass(frozen=True)
class Result:
    """The state of one transform in one root."""

    transform: str
    kind: str
    root: str
    file: str
    state: State
    message: str
    origin: Origin | None = None  # the transform's (or its faulty field's) place in the recipe's layers

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = self.state.value
        del data["origin"]
        data["recipe_file"] = self.origin.file if self.origin else None
        data["recipe_line"] = self.origin.line if self.origin else None
        return data


@dataclass(frozen=True)
class Finding:
    """A verify check that failed (line endings, compile, payload...)."""

    check: str
    root: str
    file: str
    message: str

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class Severity(str, enum.Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


@dataclass(frozen=True)
class Issue:
    """A lint finding about the recipe itself."""

    rule: str
    severity: Severity
    message: str
    fix: str
    origin: Origin | None = None
    variant: str | None = None
    # an error of a platform rule (what only the platform's submission requires): an error for a submission, a
    # warning for a diagnostic run, which runs the variant (vLLM starts it) and says the platform would not accept it
    platform: bool = False

    @property
    def line(self) -> int | None:
        return self.origin.line if self.origin else None

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["severity"] = self.severity.value
        del data["origin"]
        data["file"] = self.origin.file if self.origin else None
        data["line"] = self.line
        return data


@dataclass(frozen=True)
class Report:
    verb: str
    recipe: str
    results: tuple[Result, ...] = ()
    findings: tuple[Finding, ...] = ()
    notes: tuple[str, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)
    issues: tuple[Issue, ...] = ()
    columns: tuple[str, ...] = ()  # list-type verbs (variants) print these rows as a table
    rows: tuple[tuple[str, ...], ...] = ()
    exit_code: int = 0  # what the command line exits with for this report

    @property
    def ok(self) -> bool:
        return (all(r.state.ok for r in self.results) and not self.findings
                and not any(i.severity is Severity.ERROR for i in self.issues))

    def count(self, state: State) -> int:
        return sum(1 for r in self.results if r.state is state)

    def as_json(self) -> dict[str, Any]:
        return {
            "verb": self.verb,
            "toolkit_version": __version__,
            "recipe": self.recipe,
            "ok": self.ok,
            "summary": {s.value: self.count(s) for s in State},
            "results": [r.as_json() for r in self.results],
            "findings": [f.as_json() for f in self.findings],
            "issues": [i.as_json() for i in self.issues],
            "notes": list(self.notes),
            "exit_code": self.exit_code,
            **self.extra,
        }
