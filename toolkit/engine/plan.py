"""Planning: every transform over every root of a package, in memory; the writer then makes all of it or nothing."""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from toolkit.engine.evaluate import Verdict, evaluate, gated_off
from toolkit.engine.state import STATE_FILE, check_lock, read_state
from toolkit.errors import InputDriftError, ToolkitError
from toolkit.inputs import Root, version_with_source
from toolkit.markers import read_markers
from toolkit.recipe import LoadedRecipe
from toolkit.results import Result, State
from toolkit.transforms import edit_kind, file_kind
from toolkit.transforms.base import Context, EditKind, FileKind, ModuleEdit, TransformBase
from toolkit.transforms.cstutil import module_code
from toolkit.transforms.deploy import Deploy, DeployKind
from toolkit.transforms.files import FileOp, FilePlan, is_binary, sha256

ROOTFS_LABEL = "/"


@dataclass(frozen=True)
class Step:
    """One transform's change to one file, for diffs (code is generated only when a diff is asked for)."""

    transform: str
    root: str
    file: str
    before_src: str | cst.Module
    after_src: str | cst.Module

    @property
    def before(self) -> str:
        return self.before_src if isinstance(self.before_src, str) else module_code(self.before_src)

    @property
    def after(self) -> str:
        return self.after_src if isinstance(self.after_src, str) else module_code(self.after_src)

    def unified(self) -> str:
        return "".join(difflib.unified_diff(
            self.before.splitlines(keepends=True), self.after.splitlines(keepends=True),
            fromfile=f"a/{self.file}", tofile=f"b/{self.file}",
        ))


@dataclass
class Plan:
    results: list[Result] = field(default_factory=list)
    ops: list[FileOp] = field(default_factory=list)
    steps: list[Step] = field(default_factory=list)
    changed_py: list[Path] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    versions: dict[str, str | None] = field(default_factory=dict)
    pristine: dict[str, str] = field(default_factory=dict)  # file -> sha256 of the pristine bytes

    @property
    def ok(self) -> bool:
        return all(r.state.ok for r in self.results)

    def written(self) -> list[Result]:
        """The results once the writer made the plan's writes: what would apply did."""
        return [dataclasses.replace(r, state=State.APPLIED) if r.state is State.WOULD_APPLY else r
                for r in self.results]


class Engine:
    def __init__(self, loaded: LoadedRecipe, roots: list[Root], rootfs: Path | None, *,
                 check_version: bool = True, lock: dict[str, object] | None = None,
                 pinned: dict[str, Path] | None = None, skip: frozenset[str] = frozenset(),
                 package: str | None = None, check_replaced: bool = True):
        """skip: ids of transforms left out of this plan (the caller reports why); used only for trials.

        package: whose roots these are (default the vendor's); only that package's transforms are planned.
        check_replaced: False only on a stand-in of the image (the reference), where the vendor files that
        whole-file replacements expect are not the real ones; the trial says so.
        """
        self.lock = lock
        self.loaded = loaded
        self.recipe = loaded.recipe
        self.package = package or self.recipe.vendor.package
        declared = self.recipe.package(self.package)
        if self.package != self.recipe.vendor.package and declared is None:
            raise ToolkitError(f"package {self.package!r} is not declared in {loaded.path}",
                               hint="declare it under packages: (name, version)")
        self.version_spec = declared.version if declared is not None else self.recipe.vendor.version
        self.check_replaced = check_replaced
        self.roots = roots
        self.rootfs = rootfs
        self.check_version = check_version
        self.ctx = Context(loaded.patches_folder(), dict(pinned or {}), self.recipe.hardware.device_arch,
                           self.recipe.base_image.platform)
        self.index = {t.id: i for i, t in enumerate(self.recipe.transforms)}
        self.transforms = self.recipe.for_package(self.package)
        active = [t for t in self.transforms if t.id not in skip]
        self.edit_specs = [t for t in active if isinstance(t, ModuleEdit)]
        self.edits = {t.id: edit_kind(t, self.ctx) for t in self.edit_specs}
        self.edits_by_file: dict[str, list[EditKind]] = defaultdict(list)  # target file -> its edits, recipe order
        for t in self.edit_specs:
            self.edits_by_file[t.file].append(self.edits[t.id])
        self.files = {t.id: file_kind(t, self.ctx) for t in active if not isinstance(t, ModuleEdit)}
        # files a deploy installs in the roots and source transforms then edit: deployed once, patched
        self.deployed: dict[str, tuple[bytes, Deploy]] = {}
        self.broken: dict[str, str] = {}  # deployed-and-patched file -> why its replacement contract fails
        targets = {t.file for t in self.edit_specs}
        for kind in self.files.values():
            if isinstance(kind, DeployKind):
                kind.check_replaced = check_replaced
            if isinstance(kind, DeployKind) and not kind.rootfs_level and roots:
                for rel, data in kind.contents(roots[0].path).items():
                    if rel in targets:
                        self.deployed[rel] = (data, kind.spec)

    # -- inputs -----------------------------------------------------------------------------

    def _versions(self) -> dict[str, str | None]:
        package = self.package
        found = {r.label: version_with_source(r.path, package) for r in self.roots}
        versions = {label: v for label, (v, _) in found.items()}
        for label, (v, where) in found.items():
            self.plan.notes.append(f"{label}: {package} {v} (read from {where})")
        if len(set(versions.values())) > 1:
            raise InputDriftError(
                "vendor roots carry different versions: " + ", ".join(f"{k}={v}" for k, v in versions.items()),
                hint="every root must hold the same vendor build; patching one and running the other is the bug",
            )
        version = next(iter(versions.values()))
        gated = [t.id for t in self.transforms if t.gate and t.gate.vendor_version]
        if version is None and (self.check_version or gated):
            raise InputDriftError(
                f"no {package} version in {self.roots[0].path}: {found[self.roots[0].label][1]}",
                hint=f"the roots must hold {package}'s metadata or its version module: a bare copy of {package}/ "
                f"needs the image's {package}-*.dist-info beside it (`toolkit vendor pull` keeps it)",
            )
        if self.check_version and version is not None:
            spec = SpecifierSet(self.version_spec)
            if Version(version) not in spec:
                if package == self.recipe.vendor.package:
                    field, origin = "vendor.version", self.loaded.where("vendor", "version")
                else:
                    index = [p.name for p in self.recipe.packages].index(package)
                    field, origin = f"packages[{package}].version", self.loaded.where("packages", index, "version")
                raise InputDriftError(
                    f"{package} {version} in {self.roots[0].label} does not satisfy {field} {self.version_spec} "
                    f"({origin})",
                    hint=f"the base image changed: review the transforms against it, then update {field}",
                )
        return versions

    def _read_targets(self) -> dict[str, bytes | None]:
        """Each target file's bytes, identical in every root (or refused)."""
        states = {r.label: read_state(r.path) for r in self.roots}
        out: dict[str, bytes | None] = {}
        for rel in self.edits_by_file:
            seen: dict[str, bytes | None] = {}
            for root in self.roots:
                path = root.path / rel
                seen[root.label] = path.read_bytes() if path.is_file() else None
                recorded = states[root.label].get("files", {})
                entry = recorded.get(rel) if isinstance(recorded, dict) else None
                data = seen[root.label]
                if isinstance(entry, dict) and data is not None and sha256(data) not in (
                        entry.get("pristine"), entry.get("patched")):
                    raise InputDriftError(
                        f"{path} changed since toolkit last applied (sha256 {sha256(data)[:12]} is neither the "
                        f"recorded pristine {str(entry.get('pristine'))[:12]} "
                        f"nor patched {str(entry.get('patched'))[:12]})",
                        hint="reinstall the pristine vendor package (or rebuild from the base image) and apply again",
                    )
            if len({sha256(v) if v is not None else None for v in seen.values()}) > 1:
                desc = ", ".join(f"{k}: {sha256(v)[:12] if v is not None else 'missing'}" for k, v in seen.items())
                raise InputDriftError(
                    f"{rel} differs between vendor roots ({desc}); refusing to patch them differently",
                    hint="reinstall the vendor package so every root holds the same files",
                )
            out[rel] = seen[self.roots[0].label]
            if rel in self.deployed:
                out[rel] = self._deployed_input(rel, out[rel], states[self.roots[0].label])
            else:
                self._pristine_of(rel, out[rel], states[self.roots[0].label])
        return out

    def _deployed_input(self, rel: str, current: bytes | None, state: dict[str, object]) -> bytes:
        """The input of a file this recipe deploys and then patches: the deployed source, or our own result."""
        source, spec = self.deployed[rel]
        self.plan.pristine[rel] = sha256(source)
        files = state.get("files", {})
        entry = files.get(rel) if isinstance(files, dict) else None
        ours = current is not None and isinstance(entry, dict) and sha256(current) == entry.get("patched")
        if spec.replaces is not None and not ours and current != source:
            # the vendor file a replacement takes over (or its absence): the deploy's own result says whether the
            # contract holds
            kind = self.files[spec.id]
            assert isinstance(kind, DeployKind)
            if (broken := kind.contract(rel, current, {}, source)) is not None:
                self.broken[rel] = broken
            if current is not None:
                self.plan.steps.append(Step(spec.id, self.roots[0].label, rel, current.decode("utf-8", "replace"),
                                            source.decode("utf-8", "replace")))
        if current is None or current == source:
            return source
        if ours and isinstance(entry, dict) and entry.get("pristine") == sha256(source):
            return current  # deployed and patched before, from the same source: markers decide
        if spec.replaces is not None and not ours:
            return source
        if ours or spec.overwrite:
            return source  # the deployed source changed (a new pin): start again from it
        raise InputDriftError(
            f"{rel} exists in the vendor roots with content this recipe did not deploy",
            hint=f"set `overwrite: true` on transform {spec.id} if replacing it is intended",
        )

    def _pristine_of(self, rel: str, data: bytes | None, state: dict[str, object]) -> None:
        if data is None:
            return
        files = state.get("files", {})
        entry = files.get(rel) if isinstance(files, dict) else None
        if isinstance(entry, dict) and sha256(data) == entry.get("patched"):
            self.plan.pristine[rel] = str(entry.get("pristine"))
        elif not read_markers(data.decode("utf-8", errors="replace")):
            self.plan.pristine[rel] = sha256(data)

    # -- planning ---------------------------------------------------------------------------

    def result(self, spec: TransformBase, root: str, file: str, state: State, message: str,
                field: str | None = None) -> Result:
        """A result that names the recipe line of the field at fault when one is known, else the transform's."""
        index = self.index[spec.id]
        origin = self.loaded.origin("transforms", index, field) if field else None
        return Result(spec.id, spec.kind, root, file, state, message, origin or self.loaded.transform_origin(index))

    def verdict(self, verdict: Verdict, root: str, file: str) -> Result:
        return self.result(verdict.spec, root, file, verdict.state, verdict.message, verdict.field)

    def _plan_file(self, rel: str, data: bytes | None, version: str | None) -> list[Verdict]:
        planned = evaluate(rel, data, self.edits_by_file[rel], version)
        for tid, before, after in planned.edits:
            self.plan.steps.append(Step(tid, self.roots[0].label, rel, before, after))
        if planned.text is not None and planned.codec is not None:
            new = planned.codec.encode(planned.text)
            for root in self.roots:
                path = root.path / rel
                if path.is_file() and path.read_bytes() == new:
                    continue
                mode = path.stat().st_mode & 0o7777 if path.is_file() else 0o644
                self.plan.ops.append(FileOp(path, content=new, mode=mode))
                self.plan.changed_py.append(path)
        return list(planned.states)

    def _owned(self, root: Path) -> dict[str, str]:
        deployed = read_state(root).get("deployed", {})
        return {str(k): str(v) for k, v in deployed.items()} if isinstance(deployed, dict) else {}

    def file_bases(self, kind: FileKind) -> list[tuple[str, Path]]:
        """Where a deploy or link acts: the image filesystem (absolute paths) or every vendor root."""
        if kind.rootfs_level:
            return [(ROOTFS_LABEL, self.rootfs)] if self.rootfs is not None else []
        return [(r.label, r.path) for r in self.roots]

    def no_rootfs(self, kind: FileKind) -> Result | None:
        """The GATED_OFF result of an image-level deploy or link when no image filesystem is given."""
        if not kind.rootfs_level or self.rootfs is not None:
            return None
        return self.result(kind.spec, ROOTFS_LABEL, kind.spec.target_label, State.GATED_OFF,
                            "writes outside the vendor roots; no image filesystem is given (--reference mode)")

    def plan_file_kind(self, kind: FileKind, base: Path, owned: dict[str, str]) -> FilePlan:
        if isinstance(kind, DeployKind) and not kind.rootfs_level:
            # files that source transforms edit are written by the engine, deployed and patched at once
            plan = kind.plan(base, owned, frozenset(self.deployed))
            targets = kind.targets(base)
            broken = [why for rel, why in self.broken.items() if rel in targets]
            if broken:
                return FilePlan(State.DRIFTED, "; ".join(broken))
            written = {op.path for op in self.plan.ops} if hasattr(self, "plan") else set()
            replaced = [rel for rel, (target, _) in targets.items() if rel in self.deployed and target in written]
            if plan.state is State.ALREADY_APPLIED and replaced:
                # the engine writes it, deployed and patched in one write: the deploy did happen here
                return FilePlan(State.WOULD_APPLY, f"{', '.join(replaced)} written with the transforms that edit it",
                                plan.ops, plan.owned)
            return plan
        return kind.plan(base, owned)

    def _plan_files(self, version: str | None) -> dict[str, dict[str, str]]:
        """Plan deploys and links; returns what each root's state should record as ours."""
        owned_out: dict[str, dict[str, str]] = defaultdict(dict)
        state_root = self.roots[0].path
        for tid, kind in self.files.items():
            spec = kind.spec
            why_off = gated_off(spec, version)
            if (skipped := self.no_rootfs(kind)) is not None:
                self.plan.results.append(skipped)
                continue
            owned_rootfs = {k[1:]: v for k, v in self._owned(state_root).items() if k.startswith("/")}
            for label, base in self.file_bases(kind):
                shown = spec.target_label
                if why_off:
                    self.plan.results.append(self.result(spec, label, shown, State.GATED_OFF, why_off))
                    continue
                owned = owned_rootfs if kind.rootfs_level else {
                    k: v for k, v in self._owned(base).items() if not k.startswith("/")}
                fp = self.plan_file_kind(kind, base, owned)
                self.plan.results.append(self.result(spec, label, shown, fp.state, fp.message))
                self.plan.ops.extend(fp.ops)
                for rel, digest in fp.owned:
                    if kind.rootfs_level:
                        for root in self.roots:
                            owned_out[root.label]["/" + rel] = digest
                    else:
                        owned_out[label][rel] = digest
                for op in fp.ops:
                    if op.content is not None:
                        before = _shown(op.path.read_bytes()) if op.path.is_file() else ""
                        after = _shown(op.content)
                        self.plan.steps.append(Step(tid, label, shown, before, after))
                    elif op.link is not None:
                        self.plan.steps.append(Step(tid, label, shown, "", f"symlink -> {op.link}\n"))
                    if op.path.suffix == ".py":
                        self.plan.changed_py.append(op.path)
        return owned_out

    def run(self) -> Plan:
        self.plan = Plan()
        versions = self._versions()
        self.plan.versions = versions
        version = next(iter(versions.values()))
        contents = self._read_targets()
        if self.lock is not None:
            check_lock(self.lock, self.plan.pristine, version)
        for rel, data in contents.items():
            for verdict in self._plan_file(rel, data, version):
                self.plan.results.extend(self.verdict(verdict, root.label, rel) for root in self.roots)
        owned = self._plan_files(version)
        if self.plan.ok:
            self._plan_housekeeping(contents, owned, version)
        self.plan.results.sort(key=lambda r: (self.index[r.transform], r.root))
        return self.plan

    def _plan_housekeeping(self, contents: dict[str, bytes | None], owned: dict[str, dict[str, str]],
                           version: str | None) -> None:
        """Stale bytecode removal and the per-root state file (the record of what we changed)."""
        new_by_path = {op.path: op.content for op in self.plan.ops if op.content is not None}
        for path in self.plan.changed_py:
            cache = path.parent / "__pycache__"
            if cache.is_dir():
                for pyc in sorted(cache.glob(f"{path.stem}.*.pyc")):
                    self.plan.ops.append(FileOp(pyc))
        for root in self.roots:
            files = {}
            for rel, data in contents.items():
                if data is None:
                    continue
                current = new_by_path.get(root.path / rel, data)
                files[rel] = {"pristine": self.plan.pristine.get(rel), "patched": sha256(current or b"")}
            state = {
                "recipe": self.recipe.name,
                "recipe_file": self.loaded.path.name,
                "vendor_version": version,
                "files": files,
                "deployed": dict(sorted(owned.get(root.label, {}).items())),
                **({"package": self.package} if self.package != self.recipe.vendor.package else {}),
                "transforms": {t.id: t.digest() for t in self.transforms},
                # what carries our marker: verify must not take a lost marker for an upstream fix
                "marked": sorted({r.transform for r in self.plan.results if r.root == root.label and r.state in (
                    State.WOULD_APPLY, State.ALREADY_APPLIED) and r.transform in self.edits}),
            }
            data = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
            path = root.path / STATE_FILE
            if not path.is_file() or path.read_bytes() != data:
                self.plan.ops.append(FileOp(path, content=data))


def _shown(data: bytes) -> str:
    """A file's content as a diff shows it: text as text, a binary (a prebuilt kernel) as its size and digest."""
    if is_binary(data):
        return f"<binary, {len(data)} bytes, sha256 {sha256(data)}>\n"
    return data.decode("utf-8", "replace")


def run_packages(engines: list[Engine]) -> Plan:
    """Plan every package's transforms and merge the plans: one commit writes all of them or nothing."""
    merged = Plan()
    order: dict[str, int] = {}
    for engine in engines:
        plan = engine.run()
        order.update(engine.index)
        merged.results.extend(plan.results)
        merged.ops.extend(plan.ops)
        merged.steps.extend(plan.steps)
        merged.changed_py.extend(plan.changed_py)
        merged.notes.extend(plan.notes)
        merged.versions.update({f"{engine.package}@{k}" if engine.package != engine.recipe.vendor.package else k: v
                                for k, v in plan.versions.items()})
        merged.pristine.update(plan.pristine)
    merged.results.sort(key=lambda r: (order[r.transform], r.root))
    return merged
