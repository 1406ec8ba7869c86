"""The command line: help that teaches, JSON errors, exit codes, the installed entry point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import FLAGSHIP


def test_help_lists_verbs_and_exit_codes(cli, capsys) -> None:
    import pytest

    with pytest.raises(SystemExit) as info:
        cli("--help")
    assert info.value.code == 0
    out = capsys.readouterr().out
    for word in ("apply", "diff", "verify", "schema", "exit codes", "input drift", "--rootfs /"):
        assert word in out


def test_missing_rootfs_is_a_clear_error(cli, tmp_path: Path) -> None:
    result = cli("apply", FLAGSHIP, "--rootfs", tmp_path / "nope")
    assert result.code == 2
    assert "is not a folder" in result.err and "fix:" in result.err


def test_rootfs_without_vendor_roots(cli, tmp_path: Path) -> None:
    result = cli("verify", FLAGSHIP, "--rootfs", tmp_path, "--json")
    assert result.code == 2
    data = json.loads(result.out)
    assert data["ok"] is False and "/usr/local/corex/lib/python3/dist-packages" in data["error"]
    assert "toolkit vendor pull" in data["fix"]


def test_recipe_error_exit_code_and_location(cli, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"include: {FLAGSHIP}\nhardware:\n  count: 4\n  colour: red\n")
    result = cli("apply", bad, "--rootfs", tmp_path)
    assert result.code == 2
    assert f"{bad}:4:3: hardware.colour: unknown key 'colour'" in result.err


def test_console_script_is_installed() -> None:
    exe = shutil.which("toolkit") or str(Path(sys.executable).parent / "toolkit")
    proc = subprocess.run([exe, "--version"], capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.startswith("toolkit ")
