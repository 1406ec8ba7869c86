"""verify: every root carries every marker and post-state, compiles, and keeps its line endings."""

from __future__ import annotations

import hashlib
from pathlib import Path

import libcst as cst
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from toolkit.engine import STATE_FILE, Engine, TextFile, gated_off, read_state
from toolkit.markers import read_markers
from toolkit.recipe import LoadedRecipe, SourceTransform
from toolkit.results import Finding, Report, Result, State
from toolkit.sources import Root, version_with_source
from toolkit.startup import startup_checks
from toolkit.transforms.base import Probe, decide

NOT_APPLIED = "not applied: the pre-state is still there (run `toolkit apply`)"


Parsed = tuple[TextFile, cst.Module, dict[str, Probe]]


def _verify_sources(engine: Engine, root: Root, version: str | None,
                    cache: dict[tuple[str, str], Parsed | Exception]) -> tuple[list[Result], list[Finding]]:
    """Check one root; roots holding byte-identical files share one parse (cache keyed by sha256)."""
    results: list[Result] = []
    findings: list[Finding] = []
    for rel in dict.fromkeys(t.file for t in engine.source_specs):
        specs = [t for t in engine.source_specs if t.file == rel]
        path = root.path / rel
        if not path.is_file():
            results.extend(engine._result(t, root.label, rel, State.DRIFTED, f"{rel}: file not found") for t in specs)
            continue
        data = path.read_bytes()
        key = (rel, hashlib.sha256(data).hexdigest())
        if key not in cache:
            try:
                tf = TextFile.decode(data)
                compile(data, str(path), "exec", dont_inherit=True)
                module = cst.parse_module(tf.text)
                probes = {t.id: engine.source[t.id].probe(module) for t in specs}
                cache[key] = (tf, module, probes)
            except (UnicodeDecodeError, SyntaxError, cst.ParserSyntaxError) as exc:
                cache[key] = exc
        parsed = cache[key]
        if isinstance(parsed, Exception):
            findings.append(Finding("compile", root.label, rel, f"does not compile: {parsed}"))
            results.extend(engine._result(t, root.label, rel, State.DRIFTED, f"{rel}: unreadable") for t in specs)
            continue
        tf, module, probes = parsed
        markers = read_markers(tf.text)
        marked = read_state(root.path).get("marked", [])
        for spec in specs:
            why_off = gated_off(spec, version)
            if why_off:
                results.append(engine._result(spec, root.label, rel, State.GATED_OFF, why_off))
                continue
            decision = decide(spec, probes[spec.id], markers.get(spec.id))
            state, message = decision.state, decision.message
            if state is State.APPLIED:
                state, message = State.DRIFTED, f"{rel}: {NOT_APPLIED}"
            elif state is State.SUPERSEDED and isinstance(marked, list) and spec.id in marked:
                state, message = State.DRIFTED, (
                    f"{rel}: marker missing although toolkit applied this transform here "
                    f"(per {STATE_FILE}); the file was edited after apply")
            results.append(engine._result(spec, root.label, rel, state, message))
    return results, findings


def _lf_findings(label: str, base: Path, files: list[Path], check: str) -> list[Finding]:
    out = []
    for path in files:
        if path.is_file() and not path.is_symlink() and b"\r" in path.read_bytes():
            out.append(Finding(check, label, path.relative_to(base).as_posix(),
                               "contains CR bytes; this recipe requires LF-only line endings"))
    return out


def verify_tree(loaded: LoadedRecipe, roots: list[Root], rootfs: Path | None,
                trees: dict[str, Path] | None = None, package: str | None = None) -> Report:
    engine = Engine(loaded, roots, rootfs, check_version=False, trees=trees, package=package)
    recipe = loaded.recipe
    package = engine.package
    results: list[Result] = []
    findings: list[Finding] = []
    notes: list[str] = []
    cache: dict[tuple[str, str], Parsed | Exception] = {}
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
    for spec in engine.transforms:
        if isinstance(spec, SourceTransform):
            continue
        kind = engine.files[spec.id]
        shown = spec.target_label
        if (skipped := engine.no_rootfs(kind)) is not None:
            results.append(skipped)
        for label, base in engine.file_bases(kind):
            why_off = gated_off(spec, version)
            if why_off:
                results.append(engine._result(spec, label, shown, State.GATED_OFF, why_off))
                continue
            plan = engine.plan_file_kind(kind, base, {})
            state, message = plan.state, plan.message
            if state is State.APPLIED:
                state, message = State.DRIFTED, f"not in place: {message}"
            results.append(engine._result(spec, label, shown, state, message))
            if spec.kind == "deploy":
                deployed = [target for target, _ in kind.targets(base).values()]  # type: ignore[union-attr]
                texts = [p for p in deployed if not _binary(p)]
                findings.extend(_lf_findings(label, base, texts, "line-endings"))
    if engine.package == recipe.vendor.package:
        for root in roots:
            checks = startup_checks(root.path, recipe)
            findings.extend(Finding("startup", root.label, c.name, c.detail) for c in checks if not c.ok)
            notes.append(f"{root.label}: {sum(c.ok for c in checks)} of {len(checks)} startup check(s) passed "
                         "(flags, parsers, architectures, deployed modules compile)")
    order = {t.id: i for i, t in enumerate(recipe.transforms)}
    results.sort(key=lambda r: (order[r.transform], r.root))
    return Report("verify", str(loaded.path), tuple(results), tuple(findings), tuple(notes))


def _binary(path: Path) -> bool:
    try:
        return b"\0" in path.read_bytes()[:8192]
    except OSError:
        return False
