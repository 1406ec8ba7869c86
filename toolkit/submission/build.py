"""`toolkit build`: the submission repository (Dockerfile, run config, payload), committed deterministically."""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git
import yaml

from toolkit import __version__
from toolkit.errors import ToolkitError
from toolkit.inputs import COMPLETE
from toolkit.layers import TOOLKIT_LAYER
from toolkit.lint import lint
from toolkit.pinned import SOURCE_INFO, source_info
from toolkit.recipe import LoadedRecipe, Recipe, Source
from toolkit.results import Issue
from toolkit.submission.render import PAYLOAD, render
from toolkit.submission.wheels import fetch_wheel, fetch_wheels
from toolkit.transforms.files import sha256
from toolkit.variants import BASE, Variant, expand

MANIFEST = "MANIFEST.json"
PACKAGE = Path(__file__).resolve().parent.parent  # the toolkit package
# fixed so the same recipe and sources give the same commit, not only the same tree
EPOCH = os.environ.get("SOURCE_DATE_EPOCH", "946684800")
AUTHOR = git.Actor("toolkit", "toolkit@localhost")
GITATTRIBUTES = """\
# Written by toolkit before the first commit: every text file is LF in the repository and in any checkout
# or `git archive`, whatever core.autocrlf says (a CRLF shell script fails the image build).
* text=auto eol=lf
*.whl binary
*.so binary
"""


@dataclass(frozen=True)
class Built:
    outdir: Path
    commit: str
    tree: str
    files: int
    branch: str


def resolved_recipe(recipe: Recipe) -> str:
    """The recipe as the in-image step reads it: variant applied, patches beside it in the payload."""
    data = recipe.model_dump(mode="json", exclude_defaults=True)
    data.pop("patches", None)  # last, however the recipe spelled it (the default, `toolkit:`, a path): one text
    data["patches"] = "../patches"
    data.pop("variants", None)
    data.pop("matrix", None)
    checks = data.get("checks")
    if isinstance(checks, dict):  # the rehearsal's reference names a variant: gone with them, and no step reads it
        checks.pop("fast_paths_off", None)
    header = f"# Resolved by toolkit from recipe {recipe.name}; the in-image step applies exactly this.\n"
    return header + yaml.safe_dump(data, sort_keys=False, allow_unicode=True, width=1000)


@functools.cache
def in_image_modules(entry: str = "toolkit.submission.inimage") -> tuple[Path, ...]:
    """The toolkit modules the in-image step imports (its import closure, read with ast), and their packages'
    __init__ files: the payload ships these, not the CLI, Docker, git or benchmark code the image never runs.
    Read once a process (the installed toolkit does not change under it): a build of every variant asked for each
    (0.25 s a variant)."""
    def path_of(module: str) -> Path | None:
        parts = module.split(".")[1:]
        if not parts:
            return PACKAGE / "__init__.py"
        rel = Path(*parts)
        for candidate in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    seen: set[Path] = set()
    todo = [entry]
    while todo:
        path = path_of(todo.pop())
        if path is None or path in seen:
            continue
        seen.add(path)
        # importing a module runs its packages' __init__ first: they are part of the closure too
        todo.extend(".".join(("toolkit", *parent.parts)) for parent in path.relative_to(PACKAGE).parents)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("toolkit"):
                todo.append(node.module)
                todo.extend(f"{node.module}.{a.name}" for a in node.names)
            elif isinstance(node, ast.Import):
                todo.extend(a.name for a in node.names if a.name.startswith("toolkit"))
    return tuple(sorted(seen))


def used_sources(recipe: Recipe) -> list[Source]:
    used = {t.pinned for t in recipe.transforms if t.pinned}
    return [s for s in recipe.sources if s.name in used]


def patch_sources(loaded: LoadedRecipe, recipe: Recipe) -> dict[str, Path]:
    """Payload-relative path -> file, for every file a transform takes from the patches folder."""
    out: dict[str, Path] = {}
    base = loaded.patches_dir
    for t in recipe.transforms:
        files: list[Path] = []
        for rel in t.patch_paths():
            src = base / rel
            files += [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        for path in files:
            if "__pycache__" in path.parts or path.suffix == ".pyc":
                continue
            if not path.exists():
                raise ToolkitError(f"transform {t.id}: {path} not found", hint="fix the recipe's source path")
            out[f"patches/{path.relative_to(base).as_posix()}"] = path
    return out


def _write(path: Path, data: bytes, executable: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    os.chmod(path, 0o755 if executable else 0o644)


def _lf(text: str) -> bytes:
    return text.replace("\r\n", "\n").encode("utf-8")


def write_tree(loaded: LoadedRecipe, recipe: Recipe, variant: str | None, target: Path,
               pinned: dict[str, Path]) -> None:
    recipe_file = loaded.path.name
    fetched = [s for s in used_sources(recipe) if s.name not in pinned]
    rendered = render(recipe, recipe_file, variant, fetched)
    _write(target / ".gitattributes", GITATTRIBUTES.encode())
    _write(target / "Dockerfile", _lf(rendered.dockerfile))
    _write(target / "computility-run.yaml", _lf(rendered.run_config))
    payload = target / PAYLOAD
    _write(payload / "apply.sh", _lf(rendered.apply_sh), executable=True)
    _write(payload / "recipe" / recipe_file, _lf(resolved_recipe(recipe)))
    for path in in_image_modules():
        _write(payload / "src" / "toolkit" / path.relative_to(PACKAGE), _lf(path.read_text(encoding="utf-8")))
    for rel, path in patch_sources(loaded, recipe).items():
        data = path.read_bytes()
        # shipped text is LF whatever the checkout did to it; binary files go as they are
        _write(payload / rel, data if b"\0" in data[:8192] else data.replace(b"\r\n", b"\n"),
               executable=bool(path.stat().st_mode & 0o111))
    for source in used_sources(recipe):
        digests: object = None
        if source.name in pinned:  # bundled: the used files of the pinned commit, read from the local clone
            tree = pinned[source.name]
            for path in sorted(p for p in tree.rglob("*") if p.is_file() and p.name not in (COMPLETE, SOURCE_INFO)):
                data = path.read_bytes()
                # text goes LF, as the platform's clone (after .gitattributes) and the deploy will have it anyway
                _write(payload / "sources" / source.name / path.relative_to(tree),
                       data if b"\0" in data[:8192] else data.replace(b"\r\n", b"\n"),
                       executable=bool(path.stat().st_mode & 0o111))
            digests = source_info(tree)["files"]
        elif source.digests:  # fetched: the lock the recipe keeps for it, checked by the in-image step
            lock = loaded.path.parent / source.digests
            try:
                digests = json.loads(lock.read_text(encoding="utf-8"))
            except (OSError, json.JSONDecodeError) as exc:
                raise ToolkitError(f"source {source.name}: digests lock {lock} is unreadable ({exc})",
                                   hint="a JSON object: path (under subdir) -> sha256 of the LF text") from None
        if digests is not None:
            _write(payload / "sources" / f"{source.name}.digests.json",
                   (json.dumps(digests, indent=2, sort_keys=True) + "\n").encode())
    for package in recipe.packages:
        if package.install and recipe.for_package(package.name):
            wheel = fetch_wheel(package.install, recipe.base_image.python, recipe.base_image.platform)
            _write(payload / "packages" / wheel.name, wheel.read_bytes())
    for wheel in fetch_wheels(recipe.base_image.python, recipe.base_image.platform):
        _write(payload / "wheels" / wheel.name, wheel.read_bytes())
    files = {p.relative_to(payload).as_posix(): sha256(p.read_bytes())
             for p in sorted(payload.rglob("*")) if p.is_file()}
    manifest = {"toolkit_version": __version__, "files": files}
    _write(payload / MANIFEST, (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode())


def _commit(repo_dir: Path, message: str, branch: str) -> tuple[str, str]:
    repo = git.Repo.init(repo_dir, initial_branch=branch)
    with repo.config_writer() as cfg:
        cfg.set_value("core", "autocrlf", "false")
    repo.git.add("--all")
    date = f"{EPOCH} +0000"
    commit = repo.index.commit(message, author=AUTHOR, committer=AUTHOR, author_date=date, commit_date=date)
    return commit.hexsha, commit.tree.hexsha


def refuse_on_lint(loaded: LoadedRecipe, recipe: Recipe, variant: str | None) -> None:
    errors = lint(loaded, recipe, variant=variant).refusals
    if errors:
        lines = "\n".join(f"  {i.rule} {i.origin or loaded.path}: {i.message}" for i in errors)
        # a platform rule's errors alone: vLLM would start it, the platform would not accept it
        platform_only = all(i.platform for i in errors)
        why = "would not be accepted as a submission" if platform_only else "cannot start"
        hint = "fix them, or see `toolkit lint` for details"
        if platform_only:
            hint += "; preflight, rehearse, estimate and experiment run it as it is"
        raise ToolkitError(f"the recipe{f' (variant {variant})' if variant else ''} {why}; lint found "
                           f"{len(errors)} error(s):\n{lines}", hint=hint)


def _contains(folder: Path, path: Path) -> bool:
    return path == folder or folder in path.parents


def _empty_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and not any(path.iterdir())


def replaceable_problem(outdir: Path) -> str | None:
    """Why OUTDIR is not a previous submission of this tool that can be replaced with nothing lost (None: it is).

    Proof of ownership: the payload manifest every build writes, a git repository at OUTDIR itself whose branch
    heads were all committed by this tool, and a working tree with nothing else in it (no change, no untracked or
    ignored file), so that replacing it loses nothing that `git` and the recipe cannot give back.
    """
    if not outdir.is_dir() or outdir.is_symlink():
        return f"{outdir} is not a folder"
    if not (outdir / PAYLOAD / MANIFEST).is_file():
        return f"{outdir} holds no {PAYLOAD}/{MANIFEST}: it is not a submission written by toolkit"
    try:
        repo = git.Repo(outdir)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        return f"{outdir} is not a git repository: it is not a submission written by toolkit"
    if repo.working_tree_dir is None or Path(repo.working_tree_dir).resolve() != outdir.resolve():
        return f"{outdir} is inside another git repository ({repo.working_tree_dir}), not a submission's own"
    for head in repo.heads:
        if head.commit.author.email != AUTHOR.email:
            return (f"{outdir}: branch {head.name} has commit {head.commit.hexsha[:12]} by {head.commit.author.email}, "
                    "not by toolkit: somebody committed there")
    # --no-optional-locks: looking must not rewrite the index of a folder that is not proven ours yet
    changed = str(repo.git.execute(["git", "--no-optional-locks", "status", "--porcelain", "--ignored",
                                    "--untracked-files=all"])).splitlines()
    if changed:
        more = f" and {len(changed) - 5} more" if len(changed) > 5 else ""
        shown = ", ".join(line[3:] for line in changed[:5]) + more
        return f"{outdir} has {len(changed)} path(s) that are not the built commit: {shown}"
    return None


def protected_problem(outdir: Path, loaded: LoadedRecipe) -> str | None:
    """Why OUTDIR may never be replaced whatever the flags: a system folder, or one holding what the build reads."""
    target = outdir.resolve()
    if target == Path(target.anchor) or target == Path.home().resolve():
        return f"{outdir} is {'the root folder' if target == Path(target.anchor) else 'your home folder'}"
    layers = [("a layer of the recipe", Path(layer)) for layer in loaded.layers[:-1]
              if not layer.startswith(TOOLKIT_LAYER)]
    for label, path in (("the current folder", Path.cwd()), ("the recipe", loaded.path), *layers,
                        ("the patches folder", loaded.patches_dir), ("the toolkit checkout", PACKAGE.parent)):
        if _contains(target, path.resolve()):
            return f"{outdir} contains {label} ({path})"
    return None


def check_outdir(outdir: Path, loaded: LoadedRecipe, force: bool) -> str | None:
    """Refuse, before anything is written, an OUTDIR whose replacement could lose somebody's files.

    Returns the commit of the previous submission that will be replaced (None: OUTDIR is new or empty).
    """
    problem = protected_problem(outdir, loaded)
    if problem is None and (not outdir.exists() or _empty_folder(outdir)):
        return None  # nothing there to lose
    if problem is None and not force:
        raise ToolkitError(f"{outdir} exists; nothing was touched",
                           hint="choose a new folder, or pass --force to replace a previous submission built there")
    problem = problem or replaceable_problem(outdir)
    if problem:
        raise ToolkitError(f"refusing to write the submission to {outdir}: {problem}; nothing was touched",
                           hint="choose a new folder (--force only replaces an unchanged submission that "
                           "`toolkit build` wrote)")
    return str(git.Repo(outdir).head.commit.hexsha)


def _swap(tmp: Path, outdir: Path) -> None:
    """Put the new tree in place; the old one is removed only once the new one is there."""
    if not outdir.exists() or _empty_folder(outdir):
        os.replace(tmp, outdir)  # rename(2) replaces an empty folder atomically
        return
    old = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.old.", dir=outdir.parent))
    os.replace(outdir, old / outdir.name)
    try:
        os.replace(tmp, outdir)
    except BaseException:
        os.replace(old / outdir.name, outdir)
        old.rmdir()
        raise
    shutil.rmtree(old)


def build(loaded: LoadedRecipe, recipe: Recipe, outdir: Path, *, variant: str | None = None,
          force: bool = False, branch: str = "main", extra_files: dict[str, str] | None = None,
          pinned: dict[str, Path] | None = None) -> Built:
    """Write the whole submission next to OUTDIR, commit it, then move it into place."""
    refuse_on_lint(loaded, recipe, variant)
    check_outdir(outdir, loaded, force)
    outdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{outdir.name}.new.", dir=outdir.parent))
    try:
        write_tree(loaded, recipe, variant, tmp, pinned or {})
        for rel, text in sorted((extra_files or {}).items()):
            _write(tmp / rel, _lf(text))
        message = f"Submission for recipe {recipe.name}" + (f", variant {variant}" if variant else "") + (
            "\n\nGenerated by `toolkit build`; change the recipe, not these files.\n")
        commit, tree = _commit(tmp, message, branch)
        files = sum(1 for p in tmp.rglob("*") if p.is_file() and ".git" not in p.relative_to(tmp).parts)
        check_outdir(outdir, loaded, force)  # again: OUTDIR may have changed while the tree was written
        _swap(tmp, outdir)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError):
            raise ToolkitError(f"writing the submission failed ({exc.strerror or exc}); {outdir} was left as it was",
                               hint="free space or fix permissions, then build again") from exc
        raise
    return Built(outdir, commit, tree, files, branch)


def files_by_kind(outdir: Path) -> dict[str, int]:
    """How many files of each kind a submission holds, for the build report."""
    kinds = {"sources": "bundled source files", "wheels": "offline wheels", "src": "toolkit engine files",
             "patches": "patch files", "packages": "package wheels (installed if the image differs)"}
    counts: dict[str, int] = {}
    for path in sorted(p for p in outdir.rglob("*") if p.is_file() and ".git" not in p.relative_to(outdir).parts):
        parts = path.relative_to(outdir).parts
        if parts[0] == PAYLOAD:
            label = kinds.get(parts[1], "payload files (apply.sh, recipe, manifest)") if len(parts) > 2 else \
                "payload files (apply.sh, recipe, manifest)"
        elif parts[-1] == "computility-run.yaml":
            label = "run config(s)"
        else:
            label = "top-level files (Dockerfile, .gitattributes)"
        counts[label] = counts.get(label, 0) + 1
    return counts


def server_command(outdir: Path) -> list[str]:
    config = yaml.safe_load((outdir / "computility-run.yaml").read_text(encoding="utf-8"))
    return [str(item) for item in config.get("command", [])]


def push(outdir: Path, url: str, branches: list[str]) -> None:
    repo = git.Repo(outdir)
    try:
        repo.git.push(url, *[f"{b}:{b}" for b in branches], "--force")
    except git.GitCommandError as exc:
        raise ToolkitError(f"git push to {url} failed: {exc.stderr.strip()}",
                           hint="check the URL and your credentials; the local repository is complete") from None


def add_branch(repo_dir: Path, source: Path, branch: str) -> str:
    """The single commit of another built repository, as a branch of repo_dir.

    Its objects are copied over as the loose files they are (content-addressed: a name that exists already holds the
    same bytes), which takes a fraction of what a `git fetch` costs per branch; a source whose objects were packed
    is fetched."""
    objects = source / ".git" / "objects"
    if any((objects / "pack").glob("*.pack")):
        repo = git.Repo(repo_dir)
        repo.git.fetch(str(source), f"+HEAD:refs/heads/{branch}")
        return str(repo.git.rev_parse(f"refs/heads/{branch}"))
    ours = repo_dir / ".git" / "objects"
    for loose in sorted(objects.glob("[0-9a-f][0-9a-f]/*")):
        target = ours / loose.parent.name / loose.name
        if not target.exists():
            target.parent.mkdir(exist_ok=True)
            # under a temporary name first, as git writes objects: a copy cut short never holds an object's name
            partial = target.with_name(f"tmp_obj_{os.getpid()}_{loose.name}")
            shutil.copyfile(loose, partial)
            os.chmod(partial, 0o444)
            os.replace(partial, target)
    commit = git.Repo(source).head.commit.hexsha
    repo = git.Repo(repo_dir)
    try:
        repo.git.fsck("--connectivity-only", "--no-dangling", commit)  # every object it needs is here, before
        repo.git.update_ref(f"refs/heads/{branch}", commit)           # any ref names it
    except git.GitCommandError as exc:
        raise ToolkitError(f"branch {branch}: its commit {commit[:12]} could not be added to {repo_dir} "
                           f"({exc.stderr.strip()})",
                           hint="build again; main and the branches added before this one are complete") from None
    return commit


@dataclass(frozen=True)
class Grid:
    built: Built
    branches: list[str]
    kept: list[Variant]
    dropped: list[tuple[Variant, list[Issue]]]


def build_all_variants(loaded: LoadedRecipe, outdir: Path, *, force: bool, branches: bool,
                       pinned: dict[str, Path] | None = None) -> Grid:
    """The base submission with one run config per variant that lints clean (and a branch each)."""
    kept: list[Variant] = []
    dropped: list[tuple[Variant, list[Issue]]] = []
    for variant in expand(loaded.recipe):
        errors = list(lint(loaded, variant.apply(loaded.recipe), variant=variant.name).refusals)
        if errors:
            dropped.append((variant, errors))
        else:
            kept.append(variant)
    if not any(v.name == BASE for v in kept):
        raise ToolkitError("the base recipe itself fails lint", hint="run `toolkit lint RECIPE` and fix it first")
    configs = {f"variants/{v.name}/computility-run.yaml": render(v.apply(loaded.recipe), loaded.path.name,
                                                                 v.name).run_config
               for v in kept if v.name != BASE}
    built = build(loaded, loaded.recipe, outdir, force=force, extra_files=configs, pinned=pinned)
    names = [built.branch]
    if branches:
        for variant in kept:
            if variant.name == BASE:
                continue
            with tempfile.TemporaryDirectory() as tmp:
                one = build(loaded, variant.apply(loaded.recipe), Path(tmp) / "repo", variant=variant.name,
                            pinned=pinned)
                add_branch(outdir, one.outdir, f"variant/{variant.name}")
            names.append(f"variant/{variant.name}")
    return Grid(built, names, kept, dropped)
