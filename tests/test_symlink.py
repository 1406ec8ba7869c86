"""symlink: glob targets on real soname chains, and links that already exist (same file or another one)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from toolkit.results import State
from toolkit.transforms.base import Context
from toolkit.transforms.symlink import Symlink, SymlinkKind

LIB = "usr/local/corex/lib64"


def plan(base: Path, target: str = "libcusolver.so.*") -> tuple[State, str, list[str]]:
    spec = Symlink(kind="symlink", id="link", why="w", remove_when="r", link=f"/{LIB}/libcusolver.so", target=target)
    result = SymlinkKind(spec, Context(patches_dir=base)).plan(base, {})
    return result.state, result.message, [op.link or "" for op in result.ops]


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    folder = tmp_path / LIB
    folder.mkdir(parents=True)
    (folder / "libcusolver.so.11.4.1.48").write_bytes(b"\x7fELF")
    return folder


@pytest.mark.parametrize("absolute", [False, True], ids=["relative-chain", "absolute-chain"])
def test_a_soname_chain_is_one_match_and_the_shortest_name_wins(tmp_path: Path, lib: Path, absolute: bool) -> None:
    # absolute links point inside the image: they must be resolved under the rootfs, not on this host
    os.symlink(f"/{LIB}/libcusolver.so.11.4.1.48" if absolute else "libcusolver.so.11.4.1.48",
               lib / "libcusolver.so.11")
    os.symlink("libcusolver.so.11", lib / "libcusolver.so.11.4")
    state, message, links = plan(tmp_path)
    assert state is State.WOULD_APPLY, message
    assert links == ["libcusolver.so.11"]
    assert "shortest of" in message and "libcusolver.so.11.4.1.48" in message


def test_two_different_libraries_are_drift(tmp_path: Path, lib: Path) -> None:
    (lib / "libcusolver.so.10").write_bytes(b"\x7fELF old")
    state, message, links = plan(tmp_path)
    assert state is State.DRIFTED and not links
    assert "2 distinct file(s)" in message and "libcusolver.so.10" in message


def test_no_match_is_drift(tmp_path: Path, lib: Path) -> None:
    (lib / "libcusolver.so.11.4.1.48").unlink()
    state, message, _ = plan(tmp_path)
    assert state is State.DRIFTED and "matched 0 distinct file(s)" in message


def test_an_existing_link_to_the_same_file_is_superseded(tmp_path: Path, lib: Path) -> None:
    os.symlink("libcusolver.so.11.4.1.48", lib / "libcusolver.so.11")
    os.symlink("libcusolver.so.11.4.1.48", lib / "libcusolver.so")
    state, message, _ = plan(tmp_path)
    assert state is State.SUPERSEDED, message


def test_an_existing_link_to_another_file_is_drift(tmp_path: Path, lib: Path) -> None:
    (lib / "libother.so.1").write_bytes(b"\x7fELF other")
    os.symlink("libother.so.1", lib / "libcusolver.so")
    state, message, _ = plan(tmp_path)
    assert state is State.DRIFTED, message
    assert "libother.so.1" in message


def test_our_link_again_is_already_applied(tmp_path: Path, lib: Path) -> None:
    os.symlink("libcusolver.so.11.4.1.48", lib / "libcusolver.so.11")
    os.symlink("libcusolver.so.11", lib / "libcusolver.so")
    state, message, _ = plan(tmp_path)
    assert state is State.ALREADY_APPLIED, message
