"""Startup checks: what the server needs at start, read from the patched files (vLLM never imported)."""

from __future__ import annotations

import shutil
from pathlib import Path

from conftest import FLAGSHIP, roots_of

from toolkit.recipe import load_recipe
from toolkit.startup import REASONING, TOOL_PARSERS, startup_checks


def failed(root: Path) -> dict[str, str]:
    return {c.name: c.detail for c in startup_checks(root, load_recipe(FLAGSHIP).recipe) if not c.ok}


def test_the_patched_flagship_passes_every_check(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    for root in roots_of(corex_rootfs):
        assert failed(root) == {}
    names = {c.name for c in startup_checks(roots_of(corex_rootfs)[0], load_recipe(FLAGSHIP).recipe)}
    assert {"flag --reasoning-parser", "tool parser qwen3_coder", "reasoning parser qwen3",
            "architecture Qwen3_6MoeForCausalLM", "compile vllm/model_executor/models/qwen3_5.py"} <= names


def test_the_vendor_tree_without_the_adapter_cannot_start(corex_rootfs: Path) -> None:
    got = failed(roots_of(corex_rootfs)[0])
    assert "unrecognized arguments" in got["flag --reasoning-parser"]
    assert got["tool parser qwen3_coder"] == f"no module in {TOOL_PARSERS} registers it"
    assert got["reasoning parser qwen3"].startswith(f"no {REASONING} package")
    assert "registry" not in got  # the registry is not patched either: the architectures are not checked there


def test_a_parser_the_package_never_imports_is_not_registered(cli, corex_rootfs: Path,
                                                              flagship_args: list[str]) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    root = roots_of(corex_rootfs)[0]
    init = root / TOOL_PARSERS / "__init__.py"
    init.write_text(init.read_text().replace("from .qwen3coder_tool_parser import Qwen3CoderToolParser\n", ""))
    assert "does not import it" in failed(root)["tool parser qwen3_coder"]
    model = root / "vllm/model_executor/models/qwen3_5.py"
    model.write_text(model.read_text().replace("class Qwen3_5MoeForCausalLM(", "class Renamed("))
    got = failed(root)
    assert "defines no class Qwen3_5MoeForCausalLM" in got["architecture Qwen3_6MoeForCausalLM"]
    assert "architecture Qwen3_5ForCausalLM" not in got
    shutil.rmtree(root / REASONING)
    (root / "vllm/bi100_env.py").write_text("def broken(:\n")
    got = failed(root)
    assert "reasoning parser qwen3" in got and "compile vllm/bi100_env.py" in got


def test_host_verify_reports_startup_findings(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    assert cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args).code == 0
    for root in roots_of(corex_rootfs):
        shutil.rmtree(root / REASONING)
    result = cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1
    startup = [f for f in result.json()["findings"] if f["check"] == "startup"]
    assert {f["file"] for f in startup} == {"reasoning parser qwen3"} and len(startup) == 2
