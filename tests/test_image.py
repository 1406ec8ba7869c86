"""The Docker flow against a real engine: build, in-image apply, verify inside, extract, compare.

A stand-in for the vendor image is made locally (Debian's Python 3.11 unpacked from its packages plus
the vLLM 0.6.3.post1 files turned CoreX-like under both roots) since no registry is reachable.
Without an engine these tests skip and say why; with TOOLKIT_REQUIRE_DOCKER=1 (set by .ci/run) a
missing engine is a failure.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import FLAGSHIP, REPO, TRANSFORMERS_FILES, flagship_data, transformers_site

from toolkit.corexlike import COREX_ROOTS
from toolkit.recipe import load_recipe
from toolkit.submission.inimage import expected_results
from toolkit.transforms.base import ModuleEdit

BASE_TAG = "toolkit-test/corex:py311"
DRIFTED_TAG = "toolkit-test/corex-drifted:py311"


@pytest.fixture(scope="module")
def base_images(engine: Any, vllm_063: Path, transformers_455: Path) -> dict[str, str]:
    from toolkit.testing import make_base_image

    def with_transformers(rootfs: Path) -> None:
        # the image's transformers is outside the CoreX roots, on the interpreter's own path: found by find_spec
        site = rootfs / "usr/local/lib/python3.11/dist-packages"
        for rel in TRANSFORMERS_FILES:
            (site / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(transformers_455 / rel, site / rel)
        for meta in transformers_455.glob("transformers-*.dist-info"):
            shutil.copytree(meta, site / meta.name)

    def drift(rootfs: Path) -> None:
        with_transformers(rootfs)
        for root in COREX_ROOTS:
            path = rootfs / root.lstrip("/") / "vllm/engine/arg_utils.py"
            path.write_text(path.read_text().replace("enforce_eager=True,", "enforce_eager=bool(1),"))

    return {"good": make_base_image(BASE_TAG, vllm_063, edit=with_transformers),
            "drifted": make_base_image(DRIFTED_TAG, vllm_063, edit=drift)}


def recipe_for(tmp_path: Path, base: str) -> Path:
    data = flagship_data()
    data["base_image"].update(reference=base, python="3.11")
    data["patches"] = str(REPO / "patches" / "src")
    path = tmp_path / "bi100-qwen36.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_full_image_flow(cli, base_images: dict[str, str], adapter_args: list[str], tmp_path: Path) -> None:
    # the pinned adapter bundled, with the fixture's replacement expectations baked into the submission
    result = cli("build", recipe_for(tmp_path, base_images["good"]), "-o", tmp_path / "sub", *adapter_args,
                 "--image", "toolkit-test/submission:flow", "--json")
    assert result.code == 0, result.err[-3000:]
    data = result.json()
    recipe = load_recipe(FLAGSHIP).recipe
    patched = {t.file for t in recipe.for_package("vllm") if isinstance(t, ModuleEdit)}
    assert data["compared_files"] == 2 * len(patched)  # every patched module x 2 roots, identical to a host apply
    expected = expected_results(load_recipe(FLAGSHIP), {"vllm": 2, "transformers": 1})
    assert data["ok_lines"] >= expected
    assert "[ok] `import vllm` from /workspace resolves to /usr/local/corex/lib64/python3/dist-packages/vllm" \
        in result.err
    assert "[ok] package transformers 4.55.3 at /usr/local/lib/python3.11/dist-packages" in result.err
    assert "[ok] source qwen36-adapter: " in result.err and "[ok] start reasoning parser qwen3 " in result.err
    assert f"== summary: ok, {expected} APPLIED" in result.err


def test_drifted_base_image_fails_the_build(cli, base_images: dict[str, str], adapter_args: list[str],
                                           tmp_path: Path) -> None:
    result = cli("build", recipe_for(tmp_path, base_images["drifted"]), "-o", tmp_path / "sub", *adapter_args,
                 "--image", "toolkit-test/submission:drifted")
    assert result.code == 1
    assert "[FAIL] unhardcode-enforce-eager /usr/local/corex/lib/python3/dist-packages" in result.err
    assert "enforce_eager=bool(1)" in result.err
    assert "image build failed" in result.err


def test_vendor_pull_gives_a_tree_apply_accepts(cli, base_images: dict[str, str], adapter_args: list[str],
                                                transformers_455: Path, tmp_path: Path) -> None:
    recipe = recipe_for(tmp_path, base_images["good"])
    pulled = tmp_path / "pulled"
    assert cli("vendor", "pull", recipe, "-o", pulled).code == 0
    for root in yaml.safe_load(recipe.read_text())["vendor"]["roots"]:
        assert (pulled / root.lstrip("/") / "vllm/engine/arg_utils.py").is_file()
    result = cli("diff", recipe, "--rootfs", pulled, "--stat", *adapter_args, "--package-root",
                 f"transformers={transformers_site(pulled, transformers_455)}")
    assert "unhardcode-enforce-eager" in result.out


def test_a_source_fetched_by_the_host_builds_without_git_or_network(cli, engine: Any, base_images: dict[str, str],
                                                                   vllm_063: Path, tmp_path: Path) -> None:
    """No --source: `toolkit build` clones the adapter from its URL (file:// here) into its cache and bundles it;
    the image build runs with no network (network_mode none) from a base image that has no git."""
    from pinned_adapter import make_repo

    bare, commit = make_repo(tmp_path / "remote")
    recipe = recipe_for(tmp_path, base_images["good"])
    data = yaml.safe_load(recipe.read_text())
    data["sources"][0].update(git=f"file://{bare}", commit=commit, fetch="host")
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    probe = engine.containers.run(base_images["good"], ["bash", "-c", "command -v git || echo no-git"],
                                  network_mode="none", remove=True)
    assert probe.strip() == b"no-git"
    result = cli("build", recipe, "-o", tmp_path / "sub", "--image", "toolkit-test/submission:host-fetch", "--json")
    assert result.code == 0, result.err[-3000:]
    assert f"source qwen36-adapter: cloning file://{bare}" in result.err
    assert "[ok] source qwen36-adapter: " in result.err and "fetch source" not in result.err
    assert "== summary: ok," in result.err


def test_build_log_lines_are_whole_across_stream_chunks() -> None:
    """Docker cuts the build's text anywhere: a line split over two chunks is one line, an [ok] and a [FAIL] kept
    whole, and the error comes after the text that preceded it."""
    from toolkit.submission.image import StreamError, whole_lines

    chunks = [{"stream": "Step 1/3 : FROM base\n[o"}, {"stream": "k] adapter-model APPLIED\n[FA"},
              {"stream": "IL] register-qwen3-5 DRIFTED (recipe.yaml:12)\r\n"}, {"stream": "tail without newline"},
              {"error": "The command returned a non-zero code: 1\n"}]
    assert list(whole_lines(chunks)) == [
        "Step 1/3 : FROM base", "[ok] adapter-model APPLIED", "[FAIL] register-qwen3-5 DRIFTED (recipe.yaml:12)",
        "tail without newline", StreamError("The command returned a non-zero code: 1")]
    assert list(whole_lines([{"stream": "a"}, {"stream": "b"}])) == ["ab"]
