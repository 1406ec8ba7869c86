"""One check that a tree is complete (toolkit.trial.require_complete): every verb that runs the served code refuses,
before it builds a runtime or starts anything, a tree without the transforms whose source has no local files here,
naming them and the fix; with the source given it goes on. The flagship's adapter is not reachable from any test
(conftest), as on a newcomer's machine without the adapter's host."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAGSHIP

from toolkit.runtime import env


class RuntimeWanted(Exception):
    """The verb went on to build (or find) the CPU runtime: the check came too late, or not at all."""


@pytest.fixture
def tripwire(monkeypatch: pytest.MonkeyPatch) -> None:
    def wanted(*args: Any, **kwargs: Any) -> Path:
        raise RuntimeWanted("the verb asked for the CPU runtime")
    monkeypatch.setattr(env, "runtime", wanted)


@pytest.mark.parametrize("verb, args", [
    ("preflight", []),
    ("rehearse", []),
    ("estimate", ["--workload", "short", "--concurrency", "1"]),
    ("estimate", ["--calibrate", "benchmarks/data/target-section2"]),
])
def test_a_verb_that_runs_the_served_code_refuses_an_incomplete_tree_first(
        cli: Callable[..., Any], tripwire: None, tmp_path: Path, verb: str, args: list[str]) -> None:
    out = tmp_path / "run"
    result = cli(verb, FLAGSHIP, *args, *(["-o", out] if verb != "preflight" else []), "--json")
    assert result.code == 2, result.err
    said = result.json()
    assert said["ok"] is False
    message = said["error"]
    assert message.startswith(f"{verb}: the tree would not be the submission's: "), message
    assert "need source(s) qwen36-adapter, which have no local files here" in message
    assert "each deploys from it, edits what it deploys, or requires one that does (adapter-" in message
    assert "adapter-model" in message and "nothing was built or started" in message
    assert said["fix"].startswith("pass --source qwen36-adapter=PATH (a clone of "
                                  "https://github.com/wudixzy/competition.git at 2f7d5f572086")
    assert not out.exists()


def test_with_the_source_the_check_lets_the_verb_go_on(cli: Callable[..., Any], tripwire: None,
                                                      adapter_args: list[str]) -> None:
    # past the check, the verb reaches for the runtime (which the tripwire stops)
    with pytest.raises(RuntimeWanted):
        cli("preflight", FLAGSHIP, *adapter_args)
