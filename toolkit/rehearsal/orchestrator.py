"""One variant's rehearsal: the checks asked for, decided from the run config's argv before anything starts; each
server some check needs started once, in the registry of servers' order, and handed to every check that needs it;
then each check's verdict."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from toolkit.bench.serve import stray_processes
from toolkit.errors import ToolkitError
from toolkit.recipe import Recipe
from toolkit.rehearsal.checks import CHECKS, RehearsalCheck, Run, refuse_unknown_checks
from toolkit.rehearsal.model import DEVICE_MEMORY_GB, Check, Rehearsal, not_applicable
from toolkit.rehearsal.servers import SERVERS, Live, Say, ServerSpec, Stage, StartFailed, argv_of, start
from toolkit.runtime.preflight import Tree


def _start_check(stage: Stage, spec: ServerSpec) -> Check:
    ready = f"ready after {stage.rehearsal.ready_s:.1f} s, TP {spec.tp or stage.tp}"
    if spec.name == "served":
        return Check("start", True, ready)
    return Check("start", True, f"the {spec.label} {ready}; the served server was not started: no check of it was "
                 "asked")


def _hand(name: str, live: Live, users: list[RehearsalCheck]) -> None:
    """The server to every check that needs it: one after the other, then the concurrent ones at once (the server
    batches their steps), then the last ones."""
    for check in users:
        if not check.concurrent and not check.last:
            check.on(name, live)
    concurrent = [check for check in users if check.concurrent]
    if concurrent:
        with ThreadPoolExecutor(max_workers=len(concurrent)) as pool:
            for future in [pool.submit(check.on, name, live) for check in concurrent]:
                future.result()
    for check in users:
        if check.last:
            check.on(name, live)


def _ordered(checks: list[Check]) -> list[Check]:
    """start first, then the checks in the registry's order, the weights last."""
    rank = {name: i + 1 for i, name in enumerate(CHECKS)}
    return sorted(checks, key=lambda c: 0 if c.name == "start" else rank.get(c.name, len(rank) + 1))


def rehearse(recipe: Recipe, variant: str, run_config: str, tree: Tree, python: Path, model: Path, tp: int,
             rundir: Path, image: Path | None = None, memory_gb: float = DEVICE_MEMORY_GB, port: int | None = None,
             say: Say | None = None, only: tuple[str, ...] = ()) -> Rehearsal:
    """Every check of one variant's rehearsal (`only`: these of the registry); a first server that does not start
    ends it with `start` failed, located; a later one fails the checks that needed it."""
    refuse_unknown_checks(only)
    wanted = frozenset(only or CHECKS)
    rundir.mkdir(parents=True, exist_ok=True)
    rehearsal = Rehearsal(variant, tp, rundir)
    stage = Stage(recipe, run_config, tree, python, model, tp, rundir, image, memory_gb,
                  say or (lambda text: print(text, file=sys.stderr, flush=True)), rehearsal)
    strays = stray_processes()
    if strays:
        raise ToolkitError("refusing to rehearse beside a running server: " + "; ".join(strays),
                           hint="stop it first: its workers would share this machine's cores and memory")
    run = Run(stage, argv_of(run_config), wanted)
    active: list[RehearsalCheck] = []
    results: list[Check] = []
    for name, kind in CHECKS.items():
        if name not in wanted:
            continue
        check = kind(run)
        why = check.not_applicable()
        if why is None:
            active.append(check)
        else:
            results.append(not_applicable(name, why))
    broken: dict[str, str] = {}
    started = 0
    for name, spec in SERVERS.items():
        # asked now, not up front: what a check needs may follow from what an earlier server answered
        users = [c for c in active if name in c.needs() and c.name not in broken]
        # the start and the weights are checked always: with every asked check not applicable, on the served server
        if not users and not (name == "served" and not active):
            continue
        extra = {key: said for check in users for key, said in check.env(name).items()}
        try:
            # the first server to start is the one on --port, if given
            with start(stage, spec, port=port if not started else None, extra=extra) as live:
                if not started:
                    rehearsal.checks.append(_start_check(stage, spec))
                started += 1
                _hand(name, live, users)
        except StartFailed as failed:
            if not started:
                rehearsal.checks.append(Check("start", False, f"the {spec.label} did not start: {failed}"))
                return rehearsal
            broken.update((c.name, f"the {spec.label} did not start: {failed}") for c in users)
    results += [Check(c.name, False, broken[c.name]) if c.name in broken else c.verdict() for c in active]
    rehearsal.checks = _ordered([*rehearsal.checks, *results])
    return rehearsal
