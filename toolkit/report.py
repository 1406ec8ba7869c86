"""The one reporter: a human table (rich) or JSON, for every verb."""

from __future__ import annotations

import json
import sys
from typing import TextIO

from rich.console import Console
from rich.table import Table

from toolkit.results import Report, State

_STYLE = {
    State.APPLIED: "green",
    State.ALREADY_APPLIED: "cyan",
    State.SUPERSEDED: "yellow",
    State.DRIFTED: "bold red",
    State.GATED_OFF: "dim",
}


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
        lines = {r.transform: r.recipe_line for r in report.results}
        for (transform, state, message), where in groups.items():
            table.add_row(transform, str(lines[transform] or ""), ",".join(where),
                          f"[{_STYLE[state]}]{state.value}[/]", " ".join(message.split()))
        console.print(table)
        for root, name in short.items():
            if root in roots:
                console.print(f"  {name} = {root}")
    for f in report.findings:
        console.print(f"[bold red]FINDING[/] {f.check} {f.root} {f.file}: {f.message}")
    for note in report.notes:
        console.print(f"note: {note}")
    counts = ", ".join(f"{report.count(s)} {s.value}" for s in State if report.count(s))
    verdict = "[green]ok[/]" if report.ok else "[bold red]FAILED[/]"
    findings = f", {len(report.findings)} finding(s)" if report.findings else ""
    console.print(f"{verdict}: {counts or 'no transforms'}{findings}")
