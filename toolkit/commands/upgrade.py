"""upgrade: move a recipe to another commit of a source it builds on, every transform's fate decided and shown."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path

from toolkit.errors import EXIT_FAILED, EXIT_OK, InputError
from toolkit.pinned import files_at, parse_source_override, resolve_commit, used_paths
from toolkit.recipe import load_recipe
from toolkit.results import Issue, Report, Severity
from toolkit.transforms.base import Context
from toolkit.upgrade.fates import Fate, Side, classify, under
from toolkit.upgrade.write import describe, write

COLUMNS = ("transform", "line", "kind", "fate", "detail")


@dataclass(frozen=True)
class UpgradeRequest:
    recipe: Path
    source: str  # NAME=CLONE@COMMIT: the clone and the commit to move to
    from_commit: str | None = None  # the clone's commit holding the pinned files, where the pin's id is not in it
    write: bool = False  # write the upgraded layers (in place where git vouches for them, else to `output`)
    output: Path | None = None


def upgrade(request: UpgradeRequest) -> Report:
    loaded = load_recipe(request.recipe)
    name, where, rev = parse_source_override(request.source)
    declared = {s.name: (i, s) for i, s in enumerate(loaded.recipe.sources)}
    if name not in declared:
        raise InputError(f"--source {request.source}: the recipe declares no source {name!r}",
                         hint=f"declared: {', '.join(declared) or 'none'}")
    if rev is None:
        raise InputError(f"--source {request.source}: name the commit to move to, NAME=CLONE@COMMIT",
                         hint=f"e.g. --source {name}={where}@$(git -C {where} rev-parse origin/main)")
    index, source = declared[name]
    checkout = Path(where).resolve()
    new_commit = resolve_commit(name, checkout, rev)
    try:
        old_commit = resolve_commit(name, checkout, request.from_commit or source.commit)
    except InputError as exc:
        raise InputError(f"{exc.message} (the pin, {loaded.where('sources', index, 'commit')})",
                         hint="fetch the pin into the clone, or pass --from REV: the commit of this clone that holds "
                         "the pinned files") from None
    paths = used_paths(loaded.recipe, name)
    old = Side(old_commit, files_at(source, checkout, old_commit, paths))
    lacking = [p for p in paths if not under(old.files, p)]
    if lacking:
        raise InputError(f"source {name}: {', '.join(lacking)} not in {old_commit[:12]}, the commit upgraded from",
                         hint="the recipe does not build at that commit: pass --from the commit it builds at")
    new = Side(new_commit, files_at(source, checkout, new_commit, paths))
    print(f"upgrade: source {name} {old_commit[:12]} -> {new_commit[:12]}: trying the transforms that read its "
          f"{len(paths)} path(s) on the new files", file=sys.stderr, flush=True)
    outcomes = classify(loaded.recipe, name, old, new, Context(loaded.patches_folder(), {}))
    origins = {t.id: loaded.transform_origin(i) for i, t in enumerate(loaded.recipe.transforms)}
    rows = tuple((o.transform, str(origins[o.transform] or ""), o.kind, o.fate.value.upper(), o.detail)
                 for o in outcomes)
    issues = tuple(Issue(f"upgrade-{o.fate.value}", Severity.ERROR, _shown(o.detail, o.old_code, o.new_code),
                         o.decide, origins[o.transform]) for o in outcomes if not o.fate.settled)
    counts = {f.value: sum(1 for o in outcomes if o.fate is f) for f in Fate}
    notes = [f"source {name}: {old_commit} -> {new_commit}; "
             + ", ".join(f"{n} {fate}" for fate, n in counts.items() if n)]
    written: list[str] = []
    if request.write:
        written = describe(write(loaded, name, old_commit, new_commit, outcomes, new.files, request.output))
        notes += written
    settled = all(o.fate.settled for o in outcomes)
    report = Report("upgrade", str(loaded.path), notes=tuple(notes), issues=issues, columns=COLUMNS, rows=rows,
                    extra={"source": name, "from": old_commit, "to": new_commit, "counts": counts,
                           "fates": [o.as_json() | {"origin": str(origins[o.transform] or "")} for o in outcomes],
                           "written": written})
    return dataclasses.replace(report, exit_code=EXIT_OK if settled else EXIT_FAILED)


def _shown(detail: str, old_code: str, new_code: str) -> str:
    """A conflict's detail with both sides of the code, as a person reads them side by side."""
    out = detail
    if old_code:
        out += "\n  at the old pin:\n" + _indented(old_code)
    if new_code:
        out += "\n  at the new commit:\n" + _indented(new_code)
    return out


def _indented(code: str, limit: int = 40) -> str:
    lines = code.splitlines()
    shown = lines[:limit] + ([f"... {len(lines) - limit} more lines (--json has them all)"] if len(lines) > limit
                             else [])
    return "\n".join("    | " + ln for ln in shown)
