"""Pinned sources (the model adapter): the files a recipe uses, read from a local clone at the pinned commit.

Host-only: it needs GitPython, which the in-image step does not carry (that step reads what `toolkit build`
bundled, or what apply.sh fetched).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import git

from toolkit.errors import InputError
from toolkit.inputs import COMPLETE, cache_dir, cached_tree
from toolkit.recipe import Recipe, Source
from toolkit.transforms.deploy import Deploy, lf_digest

SOURCE_INFO = ".toolkit-source.json"  # beside the exported files: what was exported, from where, with digests


def used_paths(recipe: Recipe, name: str) -> list[str]:
    """The paths (files or folders, relative to the source's subdir) the recipe's transforms take from a source."""
    return sorted({t.pinned_path for t in recipe.transforms if isinstance(t, Deploy) and t.pinned == name})


def _blobs(tree: git.Tree, rel: str) -> dict[str, git.Blob]:
    try:
        obj = tree / rel
    except KeyError:
        return {}
    if isinstance(obj, git.Blob):
        return {rel: obj}
    top = str(obj.path)
    return {f"{rel}/{str(b.path)[len(top) + 1:]}": b for b in obj.traverse()
            if isinstance(b, git.Blob) and b.mode != 0o120000}


def resolve_commit(name: str, checkout: Path, rev: str) -> str:
    """The full commit a revision names in a local clone (bare and --no-checkout clones work: git reads blobs)."""
    try:
        repo = git.Repo(checkout)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError):
        raise InputError(f"source {name}: {checkout} is not a git repository",
                          hint=f"clone the adapter there (a bare clone is enough), or fix --source {name}=PATH"
                          ) from None
    try:
        return str(repo.git.rev_parse("--verify", "--quiet", f"{rev}^{{commit}}"))
    except git.GitCommandError:
        raise InputError(f"source {name}: commit {rev} is not in {checkout}",
                          hint=f"git -C {checkout} fetch, or correct the pinned commit") from None


def export_source(source: Source, checkout: Path, commit: str, paths: list[str]) -> Path:
    """The files a recipe uses from a pinned commit of a local clone, as a plain tree (cached).

    Blobs are read with git at the commit, so uncommitted edits, the work tree (or its absence) and files the
    recipe does not use never reach a submission. `@name/path` is relative to the source's subdir.
    """
    commit = resolve_commit(source.name, checkout, commit)
    # "binary-as-is": the digests' form (a binary's digest is of its bytes); a tree recorded before it is not reused
    key = hashlib.sha256(json.dumps([source.subdir, paths, "binary-as-is"]).encode()).hexdigest()[:12]
    target = cache_dir() / "sources" / f"{source.name}-{commit}-{key}"

    def build(tree: Path, scratch: Path) -> None:
        top = _folder_at(source, checkout, commit)
        if top is None:
            raise InputError(f"source {source.name}: no folder {source.subdir!r} at commit {commit[:12]}",
                             hint="fix sources[].subdir, or the pinned commit")
        digests: dict[str, str] = {}
        for rel in paths:
            blobs = _blobs(top, rel)
            if not blobs:
                where = f"{source.subdir}/{rel}" if source.subdir else rel
                raise InputError(f"source {source.name}: {where} is not in commit {commit[:12]}",
                                  hint="fix the deploy's @name/path, or the pinned commit")
            for path, blob in blobs.items():
                data = blob.data_stream.read()
                out = tree / path
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(data)
                os.chmod(out, 0o755 if blob.mode & 0o111 else 0o644)
                digests[path] = lf_digest(data)  # as the lock records
        info = {"name": source.name, "git": source.git, "commit": commit, "subdir": source.subdir,
                "files": dict(sorted(digests.items()))}
        (tree / SOURCE_INFO).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")

    return cached_tree(target, build)


def files_at(source: Source, checkout: Path, commit: str, paths: list[str]) -> dict[str, bytes]:
    """The files under `paths` (relative to the source's subdir) at a commit of a local clone, as git holds them; a
    path the commit lacks has no entry (an upgrade asks what is gone, where an export refuses)."""
    top = _folder_at(source, checkout, resolve_commit(source.name, checkout, commit))
    if top is None:
        return {}
    return {path: blob.data_stream.read() for rel in paths for path, blob in _blobs(top, rel).items()}


def _folder_at(source: Source, checkout: Path, commit: str) -> git.Tree | None:
    """The source's folder (its subdir, else the whole tree) at a resolved commit, or None where the commit lacks it."""
    top = git.Repo(checkout).commit(commit).tree
    if not source.subdir:
        return top
    try:
        folder = top / source.subdir
    except KeyError:
        return None
    return folder if isinstance(folder, git.Tree) else None


def source_info(tree: Path) -> dict[str, object]:
    data = json.loads((tree / SOURCE_INFO).read_text())
    return data if isinstance(data, dict) else {}


def parse_source_override(item: str) -> tuple[str, str, str | None]:
    """NAME=PATH or NAME=PATH@COMMIT (the commit overrides the pin for one run)."""
    name, sep, rest = item.partition("=")
    if not sep or not name or not rest:
        raise InputError(f"--source {item!r}: expected NAME=PATH or NAME=PATH@COMMIT",
                          hint="e.g. --source qwen36-adapter=../competition")
    path, at, rev = rest.rpartition("@")
    if at and path and re.fullmatch(r"[0-9a-fA-F]{7,40}", rev):
        return name, path, rev.lower()
    return name, rest, None


GIT_TIMEOUT_S = int(os.environ.get("TOOLKIT_GIT_TIMEOUT", "300"))


def _git(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """git without prompts (a URL that wants credentials fails instead of waiting for a person), bounded in time."""
    env = dict(os.environ, GIT_TERMINAL_PROMPT="0", GIT_ASKPASS="true", SSH_ASKPASS="true")
    try:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, env=env,
                              timeout=GIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(["git", *args], 124, "", f"no answer in {GIT_TIMEOUT_S} s "
                                           "(TOOLKIT_GIT_TIMEOUT)")


def mirror_path(source: Source) -> Path:
    key = hashlib.sha256(source.git.encode()).hexdigest()[:12]
    return cache_dir() / "git" / f"{source.name}-{key}.git"


def _has_commit(repo: Path, commit: str) -> bool:
    return _git("rev-parse", "--verify", "--quiet", f"{commit}^{{commit}}", cwd=repo).returncode == 0


def fetch_source(source: Source, commit: str) -> Path:
    """A bare mirror of the source's URL in the cache holding the pinned commit: cloned once, fetched again only
    when the commit is not in it yet (a second build does not touch the network). The commit is verified."""
    mirror = mirror_path(source)
    hint = (f"clone it where you can reach it and pass --source {source.name}=PATH (a bare clone is enough), or "
            "fix sources[].git")
    if (mirror / COMPLETE).is_file():
        if _has_commit(mirror, commit):
            return mirror
        print(f"source {source.name}: fetching {source.git} into {mirror} (the pinned commit {commit[:12]} is not "
              "in the cached mirror yet)", file=sys.stderr, flush=True)
        # gc off: a commit a force-push left behind stays in the mirror, so the pin keeps resolving
        proc = _git("-c", "gc.auto=0", "fetch", "--quiet", "--prune", source.git, "+refs/*:refs/*", cwd=mirror)
        if proc.returncode != 0:
            raise InputError(f"source {source.name}: cannot fetch {source.git}: {_last(proc.stderr)}", hint=hint)
    else:
        print(f"source {source.name}: cloning {source.git} into {mirror} (git, once; later builds reuse it)",
              file=sys.stderr, flush=True)

        def build(tree: Path, scratch: Path) -> None:
            proc = _git("clone", "--quiet", "--mirror", source.git, str(tree))
            if proc.returncode != 0:
                raise InputError(f"source {source.name}: cannot clone {source.git}: {_last(proc.stderr)}", hint=hint)

        cached_tree(mirror, build)
    if not _has_commit(mirror, commit):
        # some servers hand out a commit no branch or tag reaches any more (after a force-push) when asked for it
        _git("-c", "gc.auto=0", "fetch", "--quiet", source.git, commit, cwd=mirror)
    if not _has_commit(mirror, commit):
        raise InputError(
            f"source {source.name}: the pinned commit {commit} is not in {source.git}: no branch or tag reaches it "
            "(a force-push or a wrong pin) and the server does not hand it out by its id",
            hint=f"correct sources[].commit, or pass --source {source.name}=PATH with a clone that still has it")
    return mirror


def _last(text: str) -> str:
    """git's own reason: its last fatal: or error: line (what follows is advice), else its last line."""
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    said = [ln for ln in lines if ln.startswith(("fatal:", "error:"))]
    return (said or lines or ["no message"])[-1]


def resolve_pinned(recipe: Recipe, recipe_dir: Path, overrides: dict[str, tuple[str, str | None]],
                   fetch: bool = False) -> tuple[dict[str, Path], dict[str, str]]:
    """Each declared source with a local clone, its used files exported at the pinned (or overriding) commit.

    fetch: sources with no local clone whose `fetch` is not `image` are cloned by this host into the cache
    (`toolkit build`); one the host cannot reach is an error, or, for `host-or-image`, left to the image build.
    Returns the checkouts and the commits actually exported, by source name.
    """
    unknown = sorted(set(overrides) - {s.name for s in recipe.sources})
    if unknown:
        raise InputError(f"--source names no declared source: {', '.join(unknown)}",
                          hint=f"declared: {', '.join(s.name for s in recipe.sources) or 'none'}")
    pinned: dict[str, Path] = {}
    commits: dict[str, str] = {}
    for source in recipe.sources:
        local, rev = overrides.get(source.name, (source.path, None))
        if local:
            checkout = Path(local) if Path(local).is_absolute() or source.name in overrides else recipe_dir / local
            checkout = checkout.resolve()
        elif fetch and source.fetch != "image" and used_paths(recipe, source.name):
            try:
                checkout = fetch_source(source, source.commit)
            except InputError as exc:
                if source.fetch != "host-or-image":
                    raise
                print(f"source {source.name}: {exc.message}; sources[].fetch is host-or-image, so the IMAGE BUILD "
                      f"will clone {source.git} (it needs git and network in the platform's builder)",
                      file=sys.stderr, flush=True)
                continue
        else:
            continue
        tree = export_source(source, checkout, rev or source.commit, used_paths(recipe, source.name))
        pinned[source.name] = tree
        commits[source.name] = str(source_info(tree)["commit"])
    return pinned, commits
