"""The one reporter: a human table (rich) or JSON, for every verb."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TextIO

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from toolkit.results import Origin, Report, Severity, State

_STYLE = {
    State.WOULD_APPLY: "green",
    State.APPLIED: "green",
    State.ALREADY_APPLIED: "cyan",
    State.SUPERSEDED: "yellow",
    State.DRIFTED: "bold red",
    State.GATED_OFF: "dim",
}
_SEVERITY = {Severity.ERROR: "bold red", Severity.WARNING: "yellow", Severity.INFO: "cyan"}


def _short(origin: Origin | None, recipe: str) -> str:
    """A transform's line, and its layer's file name when that is not the recipe the report is about."""
    if origin is None:
        return ""
    if Path(origin.file).resolve() == Path(recipe).resolve():
        return str(origin.line)
    return f"{Path(origin.file).name}:{origin.line}"


def emit(report: Report, *, as_json: bool, stream: TextIO | None = None) -> None:
    stream = stream or sys.stdout
    if as_json:
        stream.write(json.dumps(report.as_json(), indent=2) + "\n")
        return
    console = Console(file=stream, highlight=False, soft_wrap=False, width=max(Console().width, 120))
    roots = list(dict.fromkeys(r.root for r in report.results))
    short = {root: ("rootfs" if root == "/" else f"R{i + 1}") for i, root in enumerate(r for r in roots if r != "/")}
    short["/"] = "rootfs"
    if report.results:
        table = Table(title=f"toolkit {report.verb}: {report.recipe}", expand=False)
        table.add_column("transform", overflow="fold", max_width=34)
        table.add_column("line", justify="right")
        table.add_column("roots")
        table.add_column("state")
        table.add_column("detail", overflow="fold")
        # identical outcomes in every root collapse into one row: the roots hold the same files
        groups: dict[tuple[str, State, str], list[str]] = {}
        for r in report.results:
            groups.setdefault((r.transform, r.state, r.message), []).append(short[r.root])
        origins = {r.transform: r.origin for r in report.results}
        for (transform, state, message), where in groups.items():
            table.add_row(transform, _short(origins[transform], report.recipe), ",".join(where),
                          f"[{_STYLE[state]}]{state.value}[/]", escape(" ".join(message.split())))
        console.print(table)
        for root, name in short.items():
            if root in roots:
                console.print(f"  {name} = {root}")
    if report.rows:
        table = Table(title=f"toolkit {report.verb}: {report.recipe}", expand=False)
        for name in report.columns:
            table.add_column(name, overflow="fold")
        for row in report.rows:
            table.add_row(*(escape(cell) for cell in row))
        console.print(table)
    for issue in report.issues:
        location = str(issue.origin) if issue.origin else report.recipe
        variant = escape(f" [variant {issue.variant}]") if issue.variant else ""
        console.print(f"[{_SEVERITY[issue.severity]}]{issue.severity.value}[/] {issue.rule}{variant} {location}: "
                      f"{escape(issue.message)}")
        if issue.severity is not Severity.INFO:
            console.print(f"  fix: {escape(issue.fix)}")
    for f in report.findings:
        console.print(f"[bold red]FINDING[/] {f.check} {f.root} {f.file}: {escape(f.message)}")
    for note in report.notes:
        console.print(f"note: {escape(note)}")
    counts = ", ".join(f"{report.count(s)} {s.value}" for s in State if report.count(s))
    verdict = "[green]ok[/]" if report.ok else "[bold red]FAILED[/]"
    findings = f", {len(report.findings)} finding(s)" if report.findings else ""
    issues = ", ".join(f"{n} {s.value}(s)" for s in Severity
                       if (n := sum(1 for i in report.issues if i.severity is s)))
    summary = ", ".join(x for x in (counts, findings.lstrip(", "), issues) if x)
    console.print(f"{verdict}: {summary or 'nothing to report'}")
