"""The verbs as library functions (toolkit.api): the same reports as the command line's --json, no subprocess."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from conftest import FLAGSHIP

from toolkit import api

TIMED = ("built in", " s", "ran on ")  # notes that carry a duration differ from run to run


def steady(report: dict[str, Any]) -> dict[str, Any]:
    data = dict(report)
    data["notes"] = [n for n in data["notes"] if not any(t in n for t in TIMED)]
    data.pop("outdir", None)
    return data


def test_build_and_check_through_the_api_are_the_clis(cli, tmp_path: Path) -> None:
    report = api.build(api.BuildRequest(FLAGSHIP, tmp_path / "api"))
    assert report.ok and report.exit_code == 0
    shown = cli("build", FLAGSHIP, "-o", tmp_path / "cli", "--json").json()
    assert (report.extra["commit"], report.extra["tree"]) == (shown["commit"], shown["tree"])
    assert report.as_json()["issues"] == shown["issues"] and report.as_json()["exit_code"] == shown["exit_code"] == 0
    checked = api.check(tmp_path / "api").as_json()
    assert checked == cli("check", tmp_path / "api", "--json").json()


def test_preflight_and_lint_through_the_api_are_the_clis(cli, adapter: tuple[Path, str], tmp_path: Path) -> None:
    from toolkit.commands.common import Inputs
    from toolkit.runtime.env import runtime

    runtime()
    clone, commit = adapter
    report = api.preflight(api.PreflightRequest(FLAGSHIP, Inputs({"qwen36-adapter": f"{clone}@{commit}"}),
                                                variant="kv-legacy40"))
    shown = cli("preflight", FLAGSHIP, "--source", f"qwen36-adapter={clone}@{commit}", "--variant", "kv-legacy40",
                "--json").json()
    assert report.as_json()["variants"] == shown["variants"] and report.exit_code == shown["exit_code"] == 0
    assert steady(report.as_json()) == steady(shown)
    strict = api.lint(api.LintRequest(FLAGSHIP, variant="kv-legacy40", strict=True))
    assert strict.exit_code == 1 == cli("lint", FLAGSHIP, "--variant", "kv-legacy40", "--strict").code


def test_errors_are_raised_with_their_fix(tmp_path: Path) -> None:
    try:
        api.apply(api.ApplyRequest(FLAGSHIP, tmp_path / "missing"))
    except api.ToolkitError as exc:
        assert "is not a folder" in exc.message and exc.hint and exc.exit_code == 2
    else:
        raise AssertionError("apply on a missing rootfs must raise")
