"""The engine: plan every transform over every root, then write all of it or nothing."""

from __future__ import annotations

import difflib
import hashlib
import json
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import libcst as cst
from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from toolkit.errors import InputDriftError, ToolkitError, WriteError
from toolkit.markers import append_markers, read_markers
from toolkit.recipe import Deploy, LoadedRecipe, SourceTransform, TransformBase
from toolkit.results import Result, State
from toolkit.sources import Root, version_with_source
from toolkit.transforms import FileKind, file_kind, source_kind
from toolkit.transforms.base import Context, decide
from toolkit.transforms.deploy import DeployKind
from toolkit.transforms.files import FileOp, FilePlan

STATE_FILE = ".toolkit/state.json"
ROOTFS_LABEL = "/"


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


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
        return self.before_src if isinstance(self.before_src, str) else self.before_src.code

    @property
    def after(self) -> str:
        return self.after_src if isinstance(self.after_src, str) else self.after_src.code

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


@dataclass(frozen=True)
class TextFile:
    """A decoded Python file with what is needed to write it back byte-compatibly."""

    text: str  # LF-normalised when the file was uniformly CRLF
    newline: str
    bom: bool

    @classmethod
    def decode(cls, data: bytes) -> TextFile:
        bom = data.startswith(b"\xef\xbb\xbf")
        text = data[3:].decode("utf-8") if bom else data.decode("utf-8")
        if "\r\n" in text and "\n" not in text.replace("\r\n", ""):
            return cls(text.replace("\r\n", "\n"), "\r\n", bom)
        return cls(text, "\n", bom)

    def encode(self, text: str) -> bytes:
        if self.newline != "\n":
            text = text.replace("\n", self.newline)
        return (b"\xef\xbb\xbf" if self.bom else b"") + text.encode("utf-8")


def read_state(root: Path) -> dict[str, object]:
    path = root / STATE_FILE
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise InputDriftError(f"{path}: unreadable toolkit state ({exc})",
                              hint="remove it only together with a pristine reinstall of the vendor package") from None
    return data if isinstance(data, dict) else {}


def gated_off(spec: TransformBase, version: str | None) -> str | None:
    """Why a transform is excluded in a root, or None when it applies."""
    if spec.gate is None or spec.gate.vendor_version is None:
        return None
    if version is None:
        return None  # checked by the caller: unknown version with a version gate is an input problem
    try:
        matches = Version(version) in SpecifierSet(spec.gate.vendor_version)
    except InvalidVersion:
        return None
    return None if matches else f"vendor version {version} is outside {spec.gate.vendor_version}"


class Engine:
    def __init__(self, loaded: LoadedRecipe, roots: list[Root], rootfs: Path | None, *,
                 check_version: bool = True, lock: dict[str, object] | None = None,
                 trees: dict[str, Path] | None = None, skip: frozenset[str] = frozenset(),
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
        self.ctx = Context(loaded.patches_dir, dict(trees or {}))
        self.index = {t.id: i for i, t in enumerate(self.recipe.transforms)}
        self.transforms = self.recipe.for_package(self.package)
        active = [t for t in self.transforms if t.id not in skip]
        self.source_specs = [t for t in active if isinstance(t, SourceTransform)]
        self.source = {t.id: source_kind(t, self.ctx) for t in self.source_specs}
        self.files = {t.id: file_kind(t, self.ctx) for t in active if not isinstance(t, SourceTransform)}
        # files a deploy installs in the roots and source transforms then edit: deployed once, patched
        self.deployed: dict[str, tuple[bytes, Deploy]] = {}
        self.broken: dict[str, str] = {}  # deployed-and-patched file -> why its replacement contract fails
        targets = {t.file for t in self.source_specs}
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
                hint=f"the roots must hold {package}'s metadata or its version module",
            )
        if self.check_version and version is not None:
            spec = SpecifierSet(self.version_spec)
            if Version(version) not in spec:
                if package == self.recipe.vendor.package:
                    field, line = "vendor.version", self.loaded.line_of("vendor", "version")
                else:
                    index = [p.name for p in self.recipe.packages].index(package)
                    field, line = f"packages[{package}].version", self.loaded.line_of("packages", index, "version")
                raise InputDriftError(
                    f"{package} {version} in {self.roots[0].label} does not satisfy {field} {self.version_spec} "
                    f"({self.loaded.path}:{line})",
                    hint=f"the base image changed: review the transforms against it, then update {field}",
                )
        return versions

    def _read_sources(self) -> dict[str, bytes | None]:
        """Each target file's bytes, identical in every root (or refused)."""
        states = {r.label: read_state(r.path) for r in self.roots}
        out: dict[str, bytes | None] = {}
        for rel in dict.fromkeys(t.file for t in self.source_specs):
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

    def _result(self, spec: TransformBase, root: str, file: str, state: State, message: str) -> Result:
        return Result(spec.id, spec.kind, root, file, state, message, self.loaded.transform_line(self.index[spec.id]))

    def _plan_file(self, rel: str, data: bytes | None, version: str | None) -> list[tuple[TransformBase, State, str]]:
        specs = [t for t in self.source_specs if t.file == rel]
        if data is None:
            return [(t, State.DRIFTED, f"{rel}: file not found in the vendor root") for t in specs]
        try:
            tf = TextFile.decode(data)
            module = cst.parse_module(tf.text)
        except UnicodeDecodeError as exc:
            return [(t, State.DRIFTED, f"{rel}: not UTF-8 ({exc.reason})") for t in specs]
        except cst.ParserSyntaxError as exc:
            return [(t, State.DRIFTED, f"{rel}: does not parse ({exc.message} at {exc.raw_line}:{exc.raw_column})")
                    for t in specs]
        markers = read_markers(tf.text)
        outcome: list[tuple[TransformBase, State, str]] = []
        new_markers: list[tuple[str, str]] = []
        for spec in specs:
            why_off = gated_off(spec, version)
            if why_off:
                outcome.append((spec, State.GATED_OFF, why_off))
                continue
            kind = self.source[spec.id]
            decision = decide(spec, kind.probe(module), markers.get(spec.id))
            if decision.state is State.APPLIED:
                before = module
                module = kind.rewrite(module)
                check = kind.probe(module)
                if check.post != spec.expect or check.pre != 0:
                    outcome.append((spec, State.DRIFTED, f"{rel}: rewrite did not reach the post-state "
                                    f"(found {check.found}); this is a toolkit bug, please report it"))
                    continue
                new_markers.append((spec.id, spec.digest()))
                self.plan.steps.append(Step(spec.id, self.roots[0].label, rel, before, module))
            outcome.append((spec, decision.state, decision.message))
        if all(s is not State.DRIFTED for _, s, _ in outcome):
            text = append_markers(module.code, new_markers) if new_markers else tf.text
            try:
                compile(text, rel, "exec", dont_inherit=True)
            except SyntaxError as exc:
                last = outcome[-1][0]
                outcome.append((last, State.DRIFTED, f"{rel}: patched file does not compile: {exc}"))
                return outcome
            new = tf.encode(text)
            for root in self.roots:
                path = root.path / rel
                if path.is_file() and path.read_bytes() == new:
                    continue
                mode = path.stat().st_mode & 0o7777 if path.is_file() else 0o644
                self.plan.ops.append(FileOp(path, content=new, mode=mode))
                self.plan.changed_py.append(path)
        return outcome

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
        return self._result(kind.spec, ROOTFS_LABEL, kind.spec.target_label, State.GATED_OFF,
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
                return FilePlan(State.APPLIED, f"{', '.join(replaced)} written with the transforms that edit it",
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
                    self.plan.results.append(self._result(spec, label, shown, State.GATED_OFF, why_off))
                    continue
                owned = owned_rootfs if kind.rootfs_level else {
                    k: v for k, v in self._owned(base).items() if not k.startswith("/")}
                fp = self.plan_file_kind(kind, base, owned)
                self.plan.results.append(self._result(spec, label, shown, fp.state, fp.message))
                self.plan.ops.extend(fp.ops)
                for rel, digest in fp.owned:
                    if kind.rootfs_level:
                        for root in self.roots:
                            owned_out[root.label]["/" + rel] = digest
                    else:
                        owned_out[label][rel] = digest
                for op in fp.ops:
                    if op.content is not None:
                        before = op.path.read_bytes().decode("utf-8", "replace") if op.path.is_file() else ""
                        after = op.content.decode("utf-8", "replace")
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
        contents = self._read_sources()
        if self.lock is not None:
            check_lock(self.lock, self.plan, version)
        for rel, data in contents.items():
            for spec, state, message in self._plan_file(rel, data, version):
                for root in self.roots:
                    self.plan.results.append(self._result(spec, root.label, rel, state, message))
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
                    State.APPLIED, State.ALREADY_APPLIED) and r.transform in self.source}),
            }
            data = (json.dumps(state, indent=2, sort_keys=True) + "\n").encode()
            path = root.path / STATE_FILE
            if not path.is_file() or path.read_bytes() != data:
                self.plan.ops.append(FileOp(path, content=data))


def make_lock(plan: Plan, recipe_name: str, package: str) -> dict[str, object]:
    version = next(iter(plan.versions.values()), None)
    return {"recipe": recipe_name, "vendor": {"package": package, "version": version},
            "files": dict(sorted(plan.pristine.items()))}


def check_lock(lock: dict[str, object], plan: Plan, version: str | None) -> None:
    """Refuse inputs that differ from the lock, before any transform is planned."""
    vendor = lock.get("vendor", {})
    locked_version = vendor.get("version") if isinstance(vendor, dict) else None
    problems = []
    if locked_version != version:
        problems.append(f"vendor version {version} (locked {locked_version})")
    files = lock.get("files", {})
    files = files if isinstance(files, dict) else {}
    for rel, digest in plan.pristine.items():
        if rel not in files:
            problems.append(f"{rel} is not in the lock")
        elif files[rel] != digest:
            problems.append(f"{rel} sha256 {digest[:12]} (locked {str(files[rel])[:12]})")
    if problems:
        raise InputDriftError("input drift against the lock: " + "; ".join(problems),
                              hint="the base image changed: review the diff, then refresh the lock with --write-lock")


# -- writing ----------------------------------------------------------------------------------

Snapshot = tuple[str, bytes | str | None, int]


def _snapshot(path: Path) -> Snapshot:
    if path.is_symlink():
        return ("link", os.readlink(path), 0)
    if path.is_file():
        return ("file", path.read_bytes(), path.stat().st_mode & 0o7777)
    return ("none", None, 0)


def _place(path: Path, content: bytes | None, link: str | None, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.toolkit-tmp")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    if link is not None:
        os.symlink(link, tmp)
    elif content is not None:
        tmp.write_bytes(content)
        os.chmod(tmp, mode)
    else:
        if path.is_symlink() or path.exists():
            path.unlink()
        return
    os.replace(tmp, path)


def commit(ops: list[FileOp]) -> None:
    """Write every op, or on any failure put back every byte that was there before."""
    done: list[tuple[Path, Snapshot]] = []
    made_dirs: list[Path] = []
    current = Path()
    try:
        for op in ops:
            current = op.path
            missing = [p for p in [op.path.parent, *op.path.parent.parents] if not p.exists()]
            for folder in reversed(missing):
                folder.mkdir()
                made_dirs.append(folder)
            snap = _snapshot(op.path)
            done.append((op.path, snap))
            _place(op.path, op.content, op.link, op.mode)
    except BaseException as exc:
        _rollback(done, made_dirs)
        if isinstance(exc, OSError):
            raise WriteError(
                f"writing {current} failed ({exc.strerror or exc}); all {len(done)} earlier write(s) were "
                "rolled back, every root is as it was",
                hint="free space or fix permissions, then run apply again",
            ) from exc
        raise


def _rollback(done: list[tuple[Path, Snapshot]], made_dirs: list[Path]) -> None:
    for path, (what, data, mode) in reversed(done):
        if what == "link":
            _place(path, None, str(data), 0)
        elif what == "file":
            _place(path, data if isinstance(data, bytes) else None, None, mode)
        elif path.is_symlink() or path.exists():
            path.unlink()
    for folder in reversed(made_dirs):
        if folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()


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
