"""The model adapter as the suite uses it: its history from 5a1c8c7 (the flagship's pin until the upgrade) to
2f7d5f5 (its newest public commit, the flagship's pin now), `wudixzy/competition` `qwen3_6_scripts/`.

The files are third-party code and never committed here: they are read from `../shared/qwen36-adapter-5a1c8c7/`
and `../shared/qwen36-adapter-2f7d5f5/` beside this checkout (byte for byte, each file's git blob id in their
BLOBS.txt), checked against those ids, and committed into a repository of the test's own, one commit each, so
`--source qwen36-adapter=REPO@COMMIT` reads them as it reads a clone (git cannot remake the real commits without the
rest of their trees; the files, not the ids, are what the recipe uses). In CI (CI=true) a missing or changed copy
fails the tests that need it; elsewhere they skip, and say where to get it. A test that needs what neither commit
has (a drifted commit; a mutant) edits these files in its own repository (`add_commit`); nothing here re-types them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import git
import pytest

REPO = Path(__file__).resolve().parent.parent
PIN = "5a1c8c79e234df641b4d6ed8790d5fc5435a08b7"
PINNED = REPO.parent / "shared" / "qwen36-adapter-5a1c8c7"
SUBDIR = "qwen3_6_scripts"
# the adapter's newest public commit (196 after the pin: the upgrade and kernel issues' input), as shared/ has it
NEWEST = "2f7d5f5720863570d23d989ef8bbc7a387c606d4"
NEWEST_FILES = REPO.parent / "shared" / "qwen36-adapter-2f7d5f5"
COMMITS = {PINNED: PIN, NEWEST_FILES: NEWEST}


def how_to_get(folder: Path) -> str:
    """Where a copy of the adapter's files belongs and how to make one (the commit the folder is named for)."""
    commit = COMMITS.get(folder, folder.name.rpartition("-")[2])
    return (f"the adapter's files at {commit[:7]} belong in {folder} (the workplace's shared/ folder beside this "
            f"checkout); elsewhere: git clone https://github.com/wudixzy/competition && git -C competition "
            f"checkout {commit}, then copy its {SUBDIR}/ and BLOBS.txt there")


class PinMismatch(Exception):
    """A copy of the pinned files that is missing or not byte for byte the pin's."""


def git_blob_id(data: bytes) -> str:
    """What `git hash-object` says of these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def check_copy(folder: Path = PINNED) -> dict[str, str]:
    """Every file BLOBS.txt lists (path -> git blob id), each checked byte for byte; PinMismatch names the first
    file missing or changed. A line is `BLOB SHA256 PATH` (the pin's listing) or `BLOB PATH` (the newest's)."""
    listing = folder / "BLOBS.txt"
    if not listing.is_file():
        raise PinMismatch(f"no {listing}: {how_to_get(folder)}")
    blobs: dict[str, str] = {}
    for number, line in enumerate(listing.read_text().splitlines(), 1):
        if not line.strip():
            continue
        words = line.split(maxsplit=2)
        sha256: str | None
        if len(words) == 3 and _is_sha256(words[1]):
            blob, sha256, rel = words
        else:
            (blob, rel), sha256 = line.split(maxsplit=1), None
        path = folder / rel
        if not path.is_file():
            raise PinMismatch(f"{path} is missing ({listing}:{number} lists it): {how_to_get(folder)}")
        data = path.read_bytes()
        if git_blob_id(data) != blob or sha256 not in (None, hashlib.sha256(data).hexdigest()):
            raise PinMismatch(f"{path} is not the pin's file: its git blob id is {git_blob_id(data)}, "
                              f"{listing}:{number} says {blob}: {how_to_get(folder)}")
        blobs[rel] = blob
    return blobs


def _is_sha256(word: str) -> bool:
    return len(word) == 64 and all(c in "0123456789abcdef" for c in word)


def require(folder: Path = PINNED) -> Path:
    """The checked folder of pinned files; in CI a missing or changed copy fails, elsewhere the test skips."""
    try:
        check_copy(folder)
    except PinMismatch as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{exc} (CI=true: the suite's adapter is the pinned one)")
        pytest.skip(str(exc))
    return folder / SUBDIR


def source_file(rel: str) -> bytes:
    """One file of the flagship's pin (the newest commit's; rel: under qwen3_6_scripts/)."""
    return (require(NEWEST_FILES) / rel).read_bytes()


def make_repo(work: Path, subdir: str = SUBDIR) -> tuple[Path, str]:
    """A bare repository of the adapter's history here (`history`); returns (clone, the flagship's pin: the newest
    commit's files)."""
    bare, _, newest = history(work, subdir)
    return bare, newest


def history(work: Path, subdir: str = SUBDIR) -> tuple[Path, str, str]:
    """A bare repository whose first commit holds the files of 5a1c8c7 (the flagship's pin before the upgrade)
    under `subdir`, and whose second holds the newest commit's (the flagship's pin now, `add_newest`); returns
    (clone, first, second).

    Its work tree keeps an uncommitted edit of qwen3_5.py (a build must read the commit, never the work tree), and
    a large wheel the recipe never uses, where the pin has transformers' (left out of shared/): bundling must leave
    it out."""
    pinned = require()
    source = work / "adapter-work"
    repo = git.Repo.init(source)
    (source / ".gitattributes").write_bytes((PINNED / ".gitattributes").read_bytes())  # * -text: bytes as they are
    _copy_files(pinned, source / subdir)
    wheel = source / subdir / "wheels" / "transformers-4.55.3-py3-none-any.whl"
    wheel.parent.mkdir(parents=True, exist_ok=True)
    wheel.write_bytes(os.urandom(1 << 20))
    repo.git.add("--all")
    actor = git.Actor("t", "t@t")
    first = repo.index.commit(f"qwen3_6_scripts at {PIN[:7]} (from {PINNED})", author=actor,
                              committer=actor).hexsha
    bare = work / "adapter.git"
    git.Repo.clone_from(str(source), str(bare), bare=True)
    second = add_newest(bare, subdir)
    (source / subdir / "qwen3_5.py").write_text("raise RuntimeError('uncommitted edit')\n")  # must never leak
    return bare, first, second


def add_commit(bare: Path, rel: str, data: str | bytes, message: str, subdir: str = SUBDIR) -> str:
    """A later commit (pushed to the bare clone as `later`) with one file of the pin changed; returns the commit."""
    work = bare.parent / "adapter-work"
    repo = git.Repo(work)
    repo.git.checkout("--", ".")
    target = work / subdir / rel
    if isinstance(data, str):
        target.write_text(data)
    else:
        target.write_bytes(data)
    return _commit_pushed(repo, bare, message, "later")


def _copy_files(folder: Path, target: Path) -> None:
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            copied = target / path.relative_to(folder)
            copied.parent.mkdir(parents=True, exist_ok=True)
            copied.write_bytes(path.read_bytes())


def _commit_pushed(repo: git.Repo, bare: Path, message: str, branch: str) -> str:
    """Everything in the work tree committed and pushed to the bare clone as `branch`; returns the commit."""
    repo.git.add("--all")
    actor = git.Actor("t", "t@t")
    commit = repo.index.commit(message, author=actor, committer=actor).hexsha
    repo.git.push(str(bare), f"HEAD:refs/heads/{branch}")
    return commit


def add_newest(bare: Path, subdir: str = SUBDIR) -> str:
    """A later commit (pushed to the bare clone as `newest`) whose files are the adapter's newest commit's, byte for
    byte (files the pin has and it lacks removed; the pin's stand-in wheel kept, as neither copy has the real one);
    returns the commit."""
    newest = require(NEWEST_FILES)
    work = bare.parent / "adapter-work"
    repo = git.Repo(work)
    repo.git.checkout("--", ".")
    for path in sorted((work / subdir).rglob("*")):
        if path.is_file() and "wheels" not in path.relative_to(work / subdir).parts:
            path.unlink()
    _copy_files(newest, work / subdir)
    return _commit_pushed(repo, bare, f"qwen3_6_scripts at {NEWEST[:7]} (from {NEWEST_FILES})", "newest")


def checked_source(work: Path) -> str:
    """The pinned files checked against their digests, committed into a repository under `work`: `CLONE@COMMIT`,
    as `--source qwen36-adapter=` takes it (the benchmarks' default)."""
    check_copy()
    clone, commit = make_repo(work)
    return f"{clone}@{commit}"
