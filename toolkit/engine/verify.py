"""Verify: the engine's check mode. Every root carries every marker and post-state (the per-file evaluation that
plans an apply, checking instead of rewriting), every edited file is byte for byte what the last apply wrote (its
digest in the root's state file), every file compiles and keeps its line endings."""

from __future__ import annotations

from pathlib import Path

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from toolkit.engine.evaluate import Evaluation, evaluate, gated_off
from toolkit.engine.plan import Engine
from toolkit.engine.state import STATE_FILE, read_state
from toolkit.inputs import Root, version_with_source
from toolkit.recipe import LoadedRecipe
from toolkit.results import Finding, Report, Result, State
from toolkit.startup import startup_checks
from toolkit.transforms.deploy import DeployKind
from toolkit.transforms.files import is_binary, sha256


def _verify_sources(engine: Engine, root: Root, version: str | None,
                    cache: dict[tuple[str, ...], Evaluation]) -> tuple[list[Result], list[Finding]]:
    """Check one root; roots holding byte-identical files share one evaluation (cache keyed by sha256)."""
    results: list[Result] = []
    findings: list[Finding] = []
    state = read_state(root.path)
    marked = state.get("marked", [])
    marked = marked if isinstance(marked, list) else []
    applied = state.get("files", {})
    applied = applied if isinstance(applied, dict) else {}
    for rel, kinds in engine.edits_by_file.items():
        path = root.path / rel
        data = path.read_bytes() if path.is_file() else None
        if (changed := _changed_after_apply(rel, data, applied.get(rel))) is not None:
            findings.append(Finding("changed-after-apply", root.label, rel, changed))
        key = (rel, sha256(data) if data is not None else "missing", *sorted(marked))
        if key not in cache:
            cache[key] = evaluate(rel, data, kinds, version, check=True, marked=marked)
        checked = cache[key]
        if checked.unreadable:
            findings.append(Finding("compile", root.label, rel, checked.unreadable))
        results.extend(engine.verdict(verdict, root.label, rel) for verdict in checked.states)
    return results, findings


def _changed_after_apply(rel: str, data: bytes | None, entry: object) -> str | None:
    """Why the file at `rel` is not what the last apply wrote there, or None. Markers and post-states show that each
    edit is present, not that nothing else changed: a hand edit elsewhere in an edited file (a deployed module that
    transforms then edit has no source digest to compare) is seen against the digest apply recorded of its result."""
    if not isinstance(entry, dict) or not entry.get("patched") or data is None:
        return None  # never applied here (verify of a pristine tree says so through its markers), or gone
    if sha256(data) == entry["patched"]:
        return None
    return (f"sha256 {sha256(data)[:12]} is not what apply wrote ({str(entry['patched'])[:12]}, recorded in "
            f"{STATE_FILE}): the file changed after apply; rebuild the tree from the base image and apply again "
            "(a change it needs belongs in a transform)")


def _lf_findings(label: str, base: Path, files: list[Path], check: str) -> list[Finding]:
    out = []
    for path in files:
        if path.is_file() and not path.is_symlink() and b"\r" in path.read_bytes():
            out.append(Finding(check, label, path.relative_to(base).as_posix(),
                               "contains CR bytes; this recipe requires LF-only line endings"))
    return out


def verify_tree(loaded: LoadedRecipe, roots: list[Root], rootfs: Path | None,
                pinned: dict[str, Path] | None = None, package: str | None = None) -> Report:
    engine = Engine(loaded, roots, rootfs, check_version=False, pinned=pinned, package=package)
    recipe = loaded.recipe
    package = engine.package
    results: list[Result] = []
    findings: list[Finding] = []
    notes: list[str] = []
    cache: dict[tuple[str, ...], Evaluation] = {}
    found = {root.label: version_with_source(root.path, package) for root in roots}
    versions = {label: v for label, (v, _) in found.items()}
    for root in roots:
        version, where = found[root.label]
        notes.append(f"{root.label}: {package} {version} (read from {where})")
        try:
            ok_version = version is not None and Version(version) in SpecifierSet(engine.version_spec)
        except InvalidVersion:
            ok_version = False
        if not ok_version:
            findings.append(Finding("vendor-version", root.label, where,
                                    f"{package} version {version} does not satisfy {engine.version_spec}"))
        r, f = _verify_sources(engine, root, version, cache)
        results.extend(r)
        findings.extend(f)
        for pattern in recipe.checks.lf_only:
            findings.extend(_lf_findings(root.label, root.path, sorted(root.path.glob(pattern)), "line-endings"))
    # deploys and links: planning them with nothing left to do is exactly "in place"
    version = versions[roots[0].label]
    for kind in engine.files.values():
        spec = kind.spec
        shown = spec.target_label
        if (skipped := engine.no_rootfs(kind)) is not None:
            results.append(skipped)
        for label, base in engine.file_bases(kind):
            why_off = gated_off(spec, version)
            if why_off:
                results.append(engine.result(spec, label, shown, State.GATED_OFF, why_off))
                continue
            plan = engine.plan_file_kind(kind, base, {})
            state, message = plan.state, plan.message
            if state is State.WOULD_APPLY:
                state, message = State.DRIFTED, f"not in place: {message}"
            results.append(engine.result(spec, label, shown, state, message))
            if isinstance(kind, DeployKind):
                deployed = [target for target, _ in kind.targets(base).values()]
                texts = [p for p in deployed if p.is_file() and not is_binary(p.read_bytes())]
                findings.extend(_lf_findings(label, base, texts, "line-endings"))
    if engine.package == recipe.vendor.package:
        for root in roots:
            checks = startup_checks(root.path, recipe)
            findings.extend(Finding("startup", root.label, c.name, c.detail) for c in checks if not c.ok)
            notes.append(f"{root.label}: {sum(c.ok for c in checks)} of {len(checks)} startup check(s) passed "
                         "(flags, parsers, architectures, deployed modules compile)")
    results.sort(key=lambda r: (engine.index[r.transform], r.root))
    return Report("verify", str(loaded.path), tuple(results), tuple(findings), tuple(notes))

