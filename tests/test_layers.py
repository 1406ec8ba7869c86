"""Recipe layers: `include:`, the merge rules, group defaults, origins in every report, `toolkit show`, and the
flagship split into layers building exactly what the single file built."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import FLAGSHIP, REPO, flagship_origin, roots_of, transformers_site
from flagship_snapshot import SNAPSHOT, differences, snapshot

from toolkit.errors import RecipeError
from toolkit.recipe import load_recipe

LAYERS = REPO / "layers"
BASE = """\
name: base
hardware: {vendor: v, accelerator: a, count: 1, memory_gb: 8}
base_image: {reference: img, python: "3.10"}
vendor:
  version: ">=0.6.3,<0.6.4"
  roots: [/site]
  reference: vllm==0.6.3
serve:
  args: {port: 8000, model: /model}
env: {A: "1", B: "2"}
transforms:
  - id: one
    kind: set-kwarg
    file: vllm/engine/arg_utils.py
    scope: EngineArgs.create_model_config
    call: ModelConfig
    arg: enforce_eager
    new: self.enforce_eager
    why: w
    remove_when: r
  - id: two
    kind: set-kwarg
    file: vllm/engine/arg_utils.py
    scope: EngineArgs.create_engine_config
    call: ParallelConfig
    arg: disable_custom_all_reduce
    new: self.disable_custom_all_reduce
    why: w
    remove_when: r
"""
TRANSFORM = """\
  - id: {id}
    kind: set-kwarg
    file: vllm/x.py
    call: f
    arg: a
    new: "1"
    why: w
    remove_when: r
"""


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def line(path: Path, needle: str) -> int:
    return next(i + 1 for i, ln in enumerate(path.read_text().splitlines()) if needle in ln)


def error(path: Path) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    return info.value


# -- the merge rules ------------------------------------------------------------------------------------------------

def test_a_later_layer_overrides_by_key_and_keeps_every_origin(tmp_path: Path) -> None:
    base = write(tmp_path, "layers/base.yaml", BASE)
    top = write(tmp_path, "recipes/top.yaml", "include: [../layers/base.yaml]\nname: top\n"
                "serve:\n  args: {port: 9000, host: 0.0.0.0}\nvendor:\n  roots: [/other]\nenv: {B: '3'}\n"
                "transforms:\n" + TRANSFORM.format(id="three"))
    loaded = load_recipe(top)
    recipe = loaded.recipe
    assert loaded.layers == (str(base.parent.parent / "layers/base.yaml"), str(top))
    assert recipe.name == "top"
    assert recipe.serve.args == {"port": 9000, "model": "/model", "host": "0.0.0.0"}  # merged key by key
    assert recipe.vendor.roots == ["/other"] and recipe.vendor.reference == "vllm==0.6.3"  # a list: replaced
    assert recipe.env == {"A": "1", "B": "3"}
    assert [t.id for t in recipe.transforms] == ["one", "two", "three"]  # concatenated in include order
    assert str(loaded.origin("serve", "args", "port")) == f"{top}:4"
    assert str(loaded.origin("serve", "args", "model")) == f"{loaded.layers[0]}:{line(base, 'args:')}"
    assert str(loaded.transform_origin(0)) == f"{loaded.layers[0]}:{line(base, '- id: one')}"
    assert str(loaded.transform_origin(2)) == f"{top}:{line(top, '- id: three')}"


def test_a_duplicate_id_names_both_layers_unless_instead_of(tmp_path: Path) -> None:
    base = write(tmp_path, "base.yaml", BASE)
    top = write(tmp_path, "top.yaml", "include: base.yaml\ntransforms:\n" + TRANSFORM.format(id="one"))
    err = error(top)
    assert err.file == str(top) and err.line == line(top, "- id: one")
    assert "duplicate transform id 'one'" in str(err) and f"at {base}:{line(base, '- id: one')}" in str(err)
    assert "instead_of: one" in str(err)
    top.write_text("include: base.yaml\ntransforms:\n" + TRANSFORM.format(id="one") + "    instead_of: one\n"
                   + TRANSFORM.format(id="four"))
    loaded = load_recipe(top)
    assert [t.id for t in loaded.recipe.transforms] == ["one", "two", "four"]  # in the replaced one's place
    assert loaded.recipe.transforms[0].file == "vllm/x.py"
    assert loaded.transform_origin(0) is not None and loaded.transform_origin(0).file == str(top)  # type: ignore
    top.write_text("include: base.yaml\ntransforms:\n" + TRANSFORM.format(id="five") + "    instead_of: nine\n")
    err = error(top)
    assert "instead_of 'nine': no earlier layer has a transform of that id" in str(err)
    assert err.line == line(top, "instead_of: nine") and "one, two" in str(err)


def test_a_missing_include_and_a_cycle_name_the_chain(tmp_path: Path) -> None:
    write(tmp_path, "a.yaml", "include: [b.yaml]\nname: a\n")
    write(tmp_path, "b.yaml", "include:\n  - c.yaml\n")
    top = write(tmp_path, "top.yaml", BASE + "include: [a.yaml]\n")
    err = error(top)
    b = tmp_path / "b.yaml"
    assert err.file == str(b) and err.line == 2 and "c.yaml not found" in str(err)
    assert f"included from {tmp_path / 'a.yaml'}:1" in str(err) and f"included from {top}:{line(top, 'include:')}" \
        in str(err)
    write(tmp_path, "c.yaml", "include: a.yaml\n")
    err = error(top)
    assert "include cycle:" in str(err) and err.file == str(tmp_path / "c.yaml") and err.line == 1
    assert f"{(tmp_path / 'a.yaml').resolve()} -> {(tmp_path / 'b.yaml').resolve()}" in str(err)
    write(tmp_path, "self.yaml", BASE + "include: self.yaml\n")
    assert "include cycle" in str(error(tmp_path / "self.yaml"))
    write(tmp_path, "bad.yaml", BASE + "include: [1, 2]\n")
    assert "include takes recipe files, got 1" in str(error(tmp_path / "bad.yaml"))


def test_include_errors_deeper_in_the_chain_name_it(tmp_path: Path) -> None:
    top = write(tmp_path, "top.yaml", BASE + "include: [a.yaml]\n")
    a = write(tmp_path, "a.yaml", "include:\n  - b.yaml\n  - 3\n")
    write(tmp_path, "b.yaml", "env: {C: '1'}\n")
    err = error(top)
    assert err.file == str(a) and err.line == 3 and "got 3" in str(err) and f"included from {top}:" in str(err)
    a.write_text("include: [b.yaml, c.yaml]\n")
    write(tmp_path, "c.yaml", "include: [b.yaml]\n")  # b twice: its transforms would be repeated
    err = error(top)
    assert "b.yaml is included twice (first at" in str(err) and err.file == str(tmp_path / "c.yaml")
    a.write_text("include: [b.yaml]\n")
    (tmp_path / "b.yaml").write_bytes(b"env: {C: '\xff'}\n")
    err = error(top)
    assert "not UTF-8" in str(err) and f"included from {a}:1" in str(err)
    top.write_text(BASE + "include: ['toolkit:../recipes/bi100-qwen36.yaml']\n")
    assert "include takes recipe files" in str(error(top))


def test_malformed_lists_are_refused_not_dropped(tmp_path: Path) -> None:
    plain = write(tmp_path, "plain.yaml", BASE.split("transforms:")[0] + "transforms: 5\n")
    assert "transforms" in str(error(plain)) and "list" in str(error(plain))
    base = write(tmp_path, "base.yaml", BASE.replace("transforms:\n  - id: one", "transforms:\n    id: one")
                 .split("  - id: two")[0])
    top = write(tmp_path, "top.yaml", "include: base.yaml\ntransforms:\n" + TRANSFORM.format(id="three"))
    err = error(top)
    assert err.file == str(base) and "transforms is a list" in str(err)
    write(tmp_path, "src.yaml", BASE + "sources: {name: x}\n")
    top.write_text("include: src.yaml\nsources:\n  - {name: [y]}\n")
    assert "sources is a list" in str(error(top))
    top.write_text(BASE + "  - defaults: {why: w}\n    transforms: {id: x}\n")
    assert "a group's `transforms` is a list" in str(error(top))


def test_instead_of_replaces_an_included_transform_once(tmp_path: Path) -> None:
    write(tmp_path, "base.yaml", BASE)
    top = write(tmp_path, "top.yaml", "include: base.yaml\ntransforms:\n" + TRANSFORM.format(id="n1")
                + TRANSFORM.format(id="n2") + "    instead_of: n1\n")
    assert "instead_of 'n1': no earlier layer has a transform of that id" in str(error(top))  # its own file's
    top.write_text("include: base.yaml\ntransforms:\n" + TRANSFORM.format(id="one") + "    instead_of: one\n"
                   + TRANSFORM.format(id="x") + "    instead_of: one\n")
    assert "instead_of 'one': already replaced by the transform at" in str(error(top))
    top.write_text("include: base.yaml\ntransforms:\n" + TRANSFORM.format(id="x") + "    instead_of: [one]\n")
    assert "instead_of ['one']" in str(error(top))
    write(tmp_path, "none.yaml", "env: {C: '1'}\n")
    top.write_text("include: none.yaml\n" + BASE + TRANSFORM.format(id="x") + "    instead_of: nope\n")
    assert "instead_of 'nope': no earlier layer" in str(error(top))


def test_instead_of_replaces_a_transform_of_a_layer_included_before_it(tmp_path: Path) -> None:
    # the flagship's adapter layer takes the place of the image layer's fix, a sibling include merged before it
    write(tmp_path, "base.yaml", BASE)
    write(tmp_path, "sibling.yaml", "transforms:\n" + TRANSFORM.format(id="own-two") + "    instead_of: two\n")
    top = write(tmp_path, "top.yaml", "include: [base.yaml, sibling.yaml]\n")
    loaded = load_recipe(top)
    assert [t.id for t in loaded.recipe.transforms] == ["one", "own-two"]
    assert loaded.transform_origin(1).file == str(tmp_path / "sibling.yaml")
    top.write_text("include: [sibling.yaml, base.yaml]\n")  # merged after it: nothing to take the place of
    err = error(top)
    assert "instead_of 'two': no earlier layer has a transform of that id" in str(err)
    assert err.file == str(tmp_path / "sibling.yaml") and err.line == line(tmp_path / "sibling.yaml", "instead_of")


def test_a_recipe_level_error_points_at_the_recipe(tmp_path: Path) -> None:
    write(tmp_path, "base.yaml", BASE.replace("name: base\n", ""))
    top = write(tmp_path, "top.yaml", "include: base.yaml\nenv: {C: '1'}\n")
    err = error(top)
    assert "missing required key 'name'" in str(err) and err.file == str(top) and err.line == 1


def test_a_layer_through_a_symlinked_folder(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    write(shared, "layers/a.yaml", BASE + "patches: ../patches\ninclude: [../common/c.yaml]\n")
    write(shared, "common/c.yaml", "env: {C: '1'}\n")
    (shared / "patches").mkdir()
    project = tmp_path / "project" / "recipes"
    project.mkdir(parents=True)
    (project / "vl").symlink_to(shared / "layers")
    top = write(project, "top.yaml", "include: [vl/a.yaml]\n")
    loaded = load_recipe(top)
    assert loaded.patches_dir == (shared / "patches").resolve() and loaded.recipe.env["C"] == "1"
    assert all(Path(layer).exists() for layer in loaded.layers), loaded.layers


def test_an_error_inside_a_layer_names_the_layer(tmp_path: Path) -> None:
    base = write(tmp_path, "base.yaml", BASE.replace("count: 1", "count: one"))
    top = write(tmp_path, "top.yaml", "include: base.yaml\nname: top\n")
    err = error(top)
    assert err.file == str(base) and err.line == line(base, "count: one") and err.key == "hardware.count"
    base.write_text(BASE + "  - [unclosed\n")
    err = error(top)
    assert err.file == str(base) and "invalid YAML" in str(err) and f"included from {top}:1" in str(err)


def test_sources_merge_by_name_and_relative_paths_stay_with_their_layer(tmp_path: Path) -> None:
    source = "sources:\n  - {name: ada, git: https://example.invalid/a.git, commit: " + "a" * 40 + \
             ", path: clones/ada}\n  - {name: bee, git: https://example.invalid/b.git, commit: " + "b" * 40 + "}\n"
    write(tmp_path, "layers/base.yaml", BASE + "patches: mypatches\n" + source)
    top = write(tmp_path, "recipes/deep/top.yaml", "include: ../../layers/base.yaml\nsources:\n"
                "  - {name: bee, git: https://example.invalid/b2.git, commit: " + "c" * 40 + "}\n")
    loaded = load_recipe(top)
    assert [(s.name, s.git) for s in loaded.recipe.sources] == [("ada", "https://example.invalid/a.git"),
                                                                 ("bee", "https://example.invalid/b2.git")]
    assert loaded.patches_dir == (tmp_path / "layers/mypatches").resolve()
    assert (top.parent / str(loaded.recipe.sources[0].path)).resolve() == (tmp_path / "layers/clones/ada").resolve()


def test_group_defaults_fill_what_members_leave_out(tmp_path: Path) -> None:
    top = write(tmp_path, "top.yaml", BASE + """\
  - defaults:
      why: shared why
      remove_when: shared
      requires: [one]
    transforms:
      - {id: g1, kind: set-kwarg, file: vllm/x.py, call: f, arg: a, new: "1"}
      - {id: g2, kind: set-kwarg, file: vllm/x.py, call: f, arg: a, new: "1", why: w, remove_when: r}
      - defaults: {why: inner}
        transforms:
          - {id: g3, kind: set-kwarg, file: vllm/x.py, call: f, arg: a, new: "1"}
""")
    loaded = load_recipe(top)
    got = {t.id: t for t in loaded.recipe.transforms}
    assert [t.id for t in loaded.recipe.transforms] == ["one", "two", "g1", "g2", "g3"]
    assert (got["g1"].why, got["g1"].remove_when, got["g1"].requires) == ("shared why", "shared", ["one"])
    assert (got["g2"].why, got["g2"].remove_when, got["g2"].requires) == ("w", "r", ["one"])  # its own win
    assert (got["g3"].why, got["g3"].remove_when) == ("inner", "shared")  # the inner group's over the outer's
    assert str(loaded.origin("transforms", 2, "why")) == f"{top}:{line(top, 'why: shared why')}"  # the defaults'
    assert str(loaded.origin("transforms", 3, "requires")) == f"{top}:{line(top, 'requires: [one]')}"
    assert str(loaded.origin("transforms", 3, "why")) == f"{top}:{line(top, 'id: g2')}"
    top.write_text(BASE + "  - defaults: {why: w}\n    transforms: []\n    colour: red\n")
    err = error(top)
    assert "a group of transforms has `defaults` and `transforms` only" in str(err) and err.line == line(top, "colour")
    top.write_text(BASE + "  - defaults: {id: x}\n    transforms: []\n")
    assert "`id` and `kind` are each member's own" in str(error(top))


def test_toolkit_layers_are_installed_with_the_toolkit(tmp_path: Path) -> None:
    top = write(tmp_path, "top.yaml", "include: [toolkit:corex-3.2.3.yaml, toolkit:vllm-probes.yaml]\nname: mine\n"
                "serve:\n  args: {model: /model}\n")
    loaded = load_recipe(top)
    assert loaded.recipe.base_image.gpu_library_names == ["ixformer", "xformers", "triton"]
    assert loaded.patches_dir == (REPO / "patches" / "src").resolve()
    assert loaded.layers[0] == "toolkit:corex-3.2.3.yaml"
    assert str(loaded.transform_origin(0)) == f"toolkit:corex-3.2.3.yaml:{line(LAYERS / 'corex-3.2.3.yaml', '- id:')}"
    top.write_text("include: toolkit:nope.yaml\n")
    assert "toolkit:nope.yaml not found" in str(error(top))


# -- the flagship -------------------------------------------------------------------------------------------------

def test_the_flagship_is_its_layers() -> None:
    loaded = load_recipe(FLAGSHIP)
    assert [Path(p).name for p in loaded.layers] == ["corex-3.2.3.yaml", "qwen36-adapter.yaml", "vllm-probes.yaml",
                                                      "bi100-qwen36.yaml"]
    by_file: dict[str, list[str]] = {}
    for index, t in enumerate(loaded.recipe.transforms):
        origin = loaded.transform_origin(index)
        assert origin is not None
        by_file.setdefault(Path(origin.file).name, []).append(t.id)
    assert "bi100-qwen36.yaml" not in by_file  # the recipe adds the model, serving, env and variants only
    assert by_file["vllm-probes.yaml"] == ["probe-step", "probe-begin-forward", "probe-model-forward",
                                           "probe-compute-logits", "probe-sample", "probe-paged-attention"]
    image = {"unhardcode-enforce-eager", "link-libcusolver", "deploy-native-fastpaths", "prefix-flash"}
    assert image <= set(by_file["corex-3.2.3.yaml"])
    probes = [t for t in loaded.recipe.transforms if t.kind == "probe"]
    # 27 at 5a1c8c7; at 2f7d5f5 one packed q/gate/k/v probe for three, and the shared gate inside the router's
    assert len(probes) == 24 and all(t.remove_when.startswith("never") for t in probes)
    text = "\n".join(Path(p).read_text() for p in loaded.layers)
    assert text.count("remove_when: never (profiling") == 2  # said once per group


def test_the_flagship_builds_what_it_built_before_the_split(tmp_path: Path, adapter: tuple[Path, str],
                                                            corex_rootfs: Path, transformers_455: Path) -> None:
    """tests/data/flagship-snapshot.json was written from the single-file flagship; the layered one must build and
    patch the same files (`python tests/flagship_snapshot.py` rewrites it for a change meant to change them)."""
    clone, commit = adapter
    site = transformers_site(corex_rootfs, transformers_455)
    actual = snapshot(FLAGSHIP, tmp_path, ["--source", f"qwen36-adapter={clone}@{commit}"],
                      ["--package-root", f"transformers={site}"], corex_rootfs)
    expected = json.loads(SNAPSHOT.read_text())
    assert differences(expected, actual) == []
    # 86 + 3 adapter fixes + 3; then at 2f7d5f5 two more (keep prefix caching, no adapter capture), one probe for
    # q/k/v's three and none for the shared gate; then the prebuilt kernels and the causal conv's guard; then the
    # image layer's completion limit cut to the room left; then the adapter's four MRoPE chunk-alignment edits
    assert len(actual["transforms"]) == 98 and len(actual["patched"]) > 70


def test_the_snapshot_sees_a_changed_build(tmp_path: Path) -> None:
    """The comparison names a moved transform and a changed file (what the test above relies on)."""
    expected = json.loads(SNAPSHOT.read_text())
    moved = json.loads(SNAPSHOT.read_text())
    moved["transforms"][0], moved["transforms"][1] = moved["transforms"][1], moved["transforms"][0]
    moved["build"]["Dockerfile"] = "0" * 64
    found = differences(expected, moved)
    assert "build: Dockerfile changed" in found and any(d.startswith("-unhardcode-custom-all-reduce") for d in found)


def test_reports_name_the_layer_a_transform_came_from(cli, corex_rootfs: Path, flagship_args: list[str]) -> None:
    for root in roots_of(corex_rootfs):
        path = root / "vllm/engine/arg_utils.py"
        path.write_text(path.read_text().replace("enforce_eager=True,", "enforce_eager=bool(1),"))
    result = cli("apply", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args)
    assert result.code == 1
    layer, at = flagship_origin("old:", after="- id: unhardcode-enforce-eager")
    assert Path(layer).name == "corex-3.2.3.yaml"
    assert f"corex-3.2.3.yaml:{at}" in result.out  # the human table, not only --json


# -- toolkit show ---------------------------------------------------------------------------------------------------

def test_show_resolved_is_the_merged_recipe_with_origins(cli) -> None:
    result = cli("show", FLAGSHIP, "--resolved")
    assert result.code == 0
    assert yaml.safe_load(result.out) == load_recipe(FLAGSHIP).located.data
    body = [ln for ln in result.out.splitlines()[1:]]
    assert body and all(" # " in ln for ln in body), [ln for ln in body if " # " not in ln][:3]
    count = next(ln for ln in body if ln.strip().startswith("count:"))
    assert count.endswith(f"corex-3.2.3.yaml:{line(LAYERS / 'corex-3.2.3.yaml', 'count: 4')}")


def test_show_json_and_table(cli) -> None:
    data = cli("show", FLAGSHIP, "--json").json()
    assert [Path(p).name for p in data["layers"]][-1] == "bi100-qwen36.yaml"
    assert data["origins"]["serve.args.max-model-len"] == f"{FLAGSHIP}:{line(FLAGSHIP, 'max-model-len:')}"
    assert data["origins"]["transforms.0"].endswith(f"corex-3.2.3.yaml:{line(LAYERS / 'corex-3.2.3.yaml', '- id:')}")
    assert data["resolved"]["name"] == "bi100-qwen36"
    table = cli("show", FLAGSHIP)
    assert table.code == 0 and "probe-paged-attention" in table.out and "vllm-probes.yaml" in table.out


def test_show_resolved_loads_back_whatever_the_keys(cli, tmp_path: Path) -> None:
    top = write(tmp_path, "top.yaml", BASE + 'description: "a\\x7fb\\x85c"\nvariants:\n'
                '  "no": {env: {"ON": "1", "YES": "2", "Null": "3"}}\n  "on": {}\n')
    result = cli("show", top, "--resolved")
    assert result.code == 0, result.err
    assert yaml.safe_load(result.out) == load_recipe(top).located.data


def test_show_refuses_a_broken_include(cli, tmp_path: Path) -> None:
    top = write(tmp_path, "top.yaml", "include: [gone.yaml]\n")
    result = cli("show", top, "--json")
    assert result.code == 2 and "gone.yaml not found" in result.json()["error"]



# -- a second model from the same image layer -----------------------------------------------------------------------

QWEN25 = REPO / "recipes" / "bi100-qwen25.yaml"


def test_a_second_model_shares_the_image_layer_and_copies_no_transform() -> None:
    flagship, qwen25 = load_recipe(FLAGSHIP), load_recipe(QWEN25)
    shared = (str(LAYERS / "corex-3.2.3.yaml"), str(LAYERS / "vllm-probes.yaml"))
    # 0.6.3's own front end gets what the flagship's adapter brings in its replaced files
    assert qwen25.layers[:3] == (shared[0], str(LAYERS / "vllm063-openai.yaml"), shared[1])
    assert set(shared) <= set(flagship.layers) and str(LAYERS / "vllm063-openai.yaml") not in flagship.layers
    assert all(str(qwen25.transform_origin(i)).startswith(str(LAYERS)) for i in range(len(qwen25.recipe.transforms)))
    assert "transforms:" not in QWEN25.read_text() and qwen25.recipe.sources == []
    assert qwen25.recipe.model is not None and qwen25.recipe.model.architecture == "Qwen2ForCausalLM"
    assert qwen25.recipe.serve.args["tool-call-parser"] == "hermes"


def test_the_second_model_lints_builds_checks_and_preflights(cli, tmp_path: Path) -> None:
    lint = cli("lint", QWEN25, "--strict", "--json")
    assert lint.code == 0, lint.out
    kv = next(i for i in lint.json()["issues"] if i["rule"] == "kv-cache")
    assert kv["file"] == str(QWEN25) and "28 attention layers" in kv["message"]
    out = tmp_path / "submission"
    build = cli("build", QWEN25, "-o", out, "--json")
    assert build.code == 0, build.out
    results = build.json()["results"]
    assert results and {r["state"] for r in results} == {"WOULD_APPLY"}  # every transform tried on the fixture
    assert {r["transform"] for r in results} == {t.id for t in load_recipe(QWEN25).recipe.transforms}
    assert cli("check", out).code == 0
    preflight = cli("preflight", QWEN25, "--all-variants", "--json")
    assert preflight.code == 0, preflight.out
    assert "vllm.model_executor.models.qwen2.Qwen2ForCausalLM" in preflight.out


def test_a_build_refused_by_lint_names_the_layer(cli, tmp_path: Path) -> None:
    layer = write(tmp_path, "layers/env.yaml", "env:\n  VLLM_ATTENTION_BACKEND: FLASH_ATTN\n")
    top = write(tmp_path, "top.yaml", f"include: [{FLAGSHIP}, layers/env.yaml]\n")
    result = cli("build", top, "-o", tmp_path / "out")
    assert result.code == 2 and f"attention-backend {layer}:2:" in result.err, result.err
    assert not (tmp_path / "out").exists()
