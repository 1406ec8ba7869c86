"""Every transform kind on real vLLM 0.6.3.post1 files: apply, apply again, drift, CRLF, roots that differ."""

from __future__ import annotations

import json
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import libcst as cst
import pytest
import yaml
from conftest import REPO, roots_of, small_rootfs, switch_package, tree_digest

from toolkit.corexlike import COREX_ROOTS, COREX_VERSION
from toolkit.markers import read_markers
from toolkit.transforms.cstutil import resolve_scope
from toolkit.transforms.replace_body import body_digest

BASE: dict[str, Any] = {
    "name": "kind-test",
    "hardware": {"vendor": "iluvatar", "accelerator": "BI-V100", "count": 4, "memory_gb": 32},
    "base_image": {"reference": "corex:test", "python": "3.10"},
    "vendor": {"version": ">=0.6.3,<0.6.4", "roots": list(COREX_ROOTS), "reference": "vllm==0.6.3.post1"},
    "serve": {"args": {"model": "/model"}},
}
PROVENANCE = {"why": "test", "remove_when": "never"}


RUNTIME_DEPLOY = {"id": "deploy-profile-runtime", "kind": "deploy", "source": "native_fastpaths",
                  "dest": "native_fastpaths"}  # what a probed module imports (lint refuses a probe without it)


def write_recipe(folder: Path, transforms: list[dict[str, Any]], patches: Path | None = None) -> Path:
    if any(t["kind"] == "probe" for t in transforms):
        transforms = [*transforms, RUNTIME_DEPLOY]
    data = dict(BASE, transforms=[{**PROVENANCE, **t} for t in transforms])
    data["patches"] = str(patches or REPO / "patches" / "src")
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@dataclass(frozen=True)
class Case:
    name: str
    spec: dict[str, Any]
    drift: Callable[[str], str | None]  # the vendor file with its pre-state gone (None: the file is gone)
    after: Callable[[str], bool]  # the patched text has the intended change
    drift_words: tuple[str, ...] = ()  # what the DRIFTED message must mention
    field: str = ""  # the recipe field a DRIFTED result points at (its line)


def _sub(pattern: str, repl: str) -> Callable[[str], str]:
    def apply(text: str) -> str:
        new, n = re.subn(pattern, repl, text)
        assert n >= 1, pattern
        return new

    return apply


CASES = [
    Case(
        "set-kwarg",
        {"id": "eager", "kind": "set-kwarg", "file": "vllm/engine/arg_utils.py",
         "scope": "EngineArgs.create_model_config", "call": "ModelConfig", "arg": "enforce_eager",
         "old": "True", "new": "self.enforce_eager"},
        _sub(r"enforce_eager=True,", "enforce_eager=  False,"),
        lambda t: "enforce_eager=self.enforce_eager," in t,
        ("enforce_eager=False", "ModelConfig"),
        field="old",
    ),
    Case(
        "assign-replace",
        {"id": "triton", "kind": "assign", "file": "vllm/triton_utils/importing.py", "target": "HAS_TRITON",
         "old": "False", "new": 'find_spec("triton") is not None'},
        _sub(r"HAS_TRITON = False", "HAS_TRITON = bool(0)"),
        lambda t: 'HAS_TRITON = find_spec("triton") is not None' in t,
        ("HAS_TRITON = bool(0)",),
        field="old",
    ),
    Case(
        "assign-remove",
        {"id": "use-v1", "kind": "assign", "file": "vllm/attention/ops/paged_attn.py",
         "scope": "PagedAttention.forward_decode", "target": "use_v1", "old": "True", "others": 1},
        _sub(r"def forward_decode\(", "def forward_decode_v1("),
        lambda t: "use_v1 = True" not in t,
        ("no scope 'PagedAttention.forward_decode'", "PagedAttention.forward_decode_v1"),
        field="scope",
    ),
    Case(
        "dict-entries",
        {"id": "registry", "kind": "dict-entries", "file": "vllm/model_executor/models/registry.py",
         "name": "_TEXT_GENERATION_MODELS", "after": "Qwen3MoeForCausalLM",
         # a module and class this tree has: verify's startup checks resolve every registered architecture
         "entries": {"Qwen3_5ForCausalLM": '("qwen2_moe", "Qwen2MoeForCausalLM")'}},
        _sub(r'\s+"Qwen3MoeForCausalLM": \("qwen3_moe", "Qwen3MoeForCausalLM"\),', ""),
        lambda t: '"Qwen3MoeForCausalLM"),\n    "Qwen3_5ForCausalLM": ("qwen2_moe", "Qwen2MoeForCausalLM"),' in t,
        ("no key 'Qwen3MoeForCausalLM'",),
        field="after",
    ),
    Case(
        "dispatch",
        {"id": "rmsnorm-native", "kind": "dispatch", "file": "vllm/model_executor/layers/layernorm.py",
         "scope": "RMSNorm.forward_native", "switch": "RMSNORM_NATIVE", "default": "1",
         "target": "native_fastpaths.attention:sdpa_varlen_prefill"},
        _sub(r"class RMSNorm\(", "class RMSNormV2("),
        lambda t: '__import__("native_fastpaths.switches", fromlist=["on"]).on("RMSNORM_NATIVE")' in t
        and "return _toolkit_rmsnorm_native(self, x, residual)" in t,
        ("RMSNormV2.forward_native",),
        field="scope",
    ),
    Case(
        "add-import",
        {"id": "import-os", "kind": "add-import", "file": "vllm/triton_utils/importing.py", "module": "os"},
        lambda t: None,
        lambda t: t.index("import os") < t.index("logger = init_logger"),
        ("file not found",),
        field="file",
    ),
    Case(
        "replace-body",
        {"id": "extra-repr", "kind": "replace-body", "file": "vllm/model_executor/layers/layernorm.py",
         "scope": "RMSNorm.extra_repr", "source": "kinds_fixture.py:extra_repr"},
        _sub(r"def extra_repr\(self\) -> str:\n(\s+)s = ", r"def extra_repr(self) -> str:\n\1s = 'vendor' + "),
        lambda t: 'return f"toolkit eps={self.variance_epsilon}"' in t,
        ("old_digest",),
        field="old_digest",
    ),
    Case(
        "probe-function",
        {"id": "probe-step", "kind": "probe", "file": "vllm/worker/model_runner.py",
         "scope": "ModelRunner.execute_model", "region": "step",
         "bucket": {"tokens": "model_input.attn_metadata.num_prefill_tokens", "edges": {"decode": 0, "prefill": None}}},
        _sub(r"def execute_model\(\n        self,\n        model_input: ModelInputForGPUWithSamplingMetadata",
             "def execute_model(\n        self,\n        inputs: ModelInputForGPUWithSamplingMetadata"),
        lambda t: "@_toolkit_profile.probe('step', tokens='model_input.attn_metadata.num_prefill_tokens', "
        "buckets=(('decode', 0), ('prefill', None),))\n    def execute_model(" in t
        and t.startswith("import native_fastpaths.profiling as _toolkit_profile\n"),  # the file has no docstring
        ("must be a parameter of ModelRunner.execute_model", "parameters: self, inputs"),
        field="bucket",
    ),
    Case(
        "probe-statements",
        {"id": "probe-begin-forward", "kind": "probe", "file": "vllm/worker/model_runner.py",
         "scope": "ModelRunner.execute_model", "region": "step.begin_forward",
         "statements": "self.attn_state.begin_forward(model_input)"},
        _sub(r"self\.attn_state\.begin_forward\(model_input\)", "self.attn_state.begin_forward(model_input, 1)"),
        lambda t: "        with _toolkit_profile.region('step.begin_forward') if _toolkit_profile.ON else "
        "_toolkit_profile.OFF:\n            self.attn_state.begin_forward(model_input)\n" in t,
        ("0 untimed site(s), 0 timed",),
        field="statements",
    ),
    Case(
        "probe-calls",
        {"id": "probe-sample", "kind": "probe", "file": "vllm/worker/model_runner.py",
         "scope": "ModelRunner.execute_model", "region": "step.sample", "calls": "self.model.sample"},
        _sub(r"self\.model\.sample\(", "self.model.sampler("),
        lambda t: "_toolkit_profile.timed('step.sample', self.model.sample)(" in t and "= self.model.sample(" not in t,
        ("calls of self.model.sample",),
        field="calls",
    ),
]
# the registry case registers an architecture of qwen2_moe.py: verify resolves it to the class in that file
FILES = sorted({c.spec["file"] for c in CASES} | {"vllm/model_executor/models/qwen2_moe.py"})


@pytest.fixture(scope="module")
def kind_patches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    patches = tmp_path_factory.mktemp("patches")
    (patches / "kinds_fixture.py").write_text(
        "def extra_repr(self) -> str:\n    return f\"toolkit eps={self.variance_epsilon}\"\n")
    # the profile runtime and the switch reader with its table (the dispatch case's default is the table's)
    (patches / "native_fastpaths").mkdir()
    for name in ("__init__.py", "profiling.py", "switches.py", "switches.json"):
        shutil.copy(REPO / "patches" / "src" / "native_fastpaths" / name, patches / "native_fastpaths" / name)
    return patches


@pytest.fixture
def tree(vllm_063: Path, tmp_path: Path) -> Path:
    return small_rootfs(vllm_063, tmp_path / "rootfs", FILES)


def _spec(case: Case) -> dict[str, Any]:
    return dict(case.spec)


def _run(cli, recipe: Path, tree: Path, verb: str = "apply") -> tuple[int, dict[str, Any], str]:
    result = cli(verb, recipe, "--rootfs", tree, "--json")
    return result.code, json.loads(result.out), result.err


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_apply_is_idempotent(cli, case: Case, tree: Path, tmp_path: Path, kind_patches: Path) -> None:
    recipe = write_recipe(tmp_path, [_spec(case)], kind_patches)
    code, report, _ = _run(cli, recipe, tree)
    assert code == 0, report
    assert [r["state"] for r in report["results"] if r["transform"] == case.spec["id"]] == ["APPLIED", "APPLIED"]
    for root in roots_of(tree):
        text = (root / case.spec["file"]).read_text()
        assert case.after(text), text[-3000:]
        assert case.spec["id"] in read_markers(text)
        compile(text, case.spec["file"], "exec")
    snapshot = tree_digest(tree)
    code, report, _ = _run(cli, recipe, tree)
    assert code == 0
    assert [r["state"] for r in report["results"] if r["transform"] == case.spec["id"]] == ["ALREADY_APPLIED",
                                                                                            "ALREADY_APPLIED"]
    assert tree_digest(tree) == snapshot
    code, report, _ = _run(cli, recipe, tree, "verify")
    assert code == 0 and report["ok"], report


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_drift_is_reported_and_nothing_written(cli, case: Case, tree: Path, tmp_path: Path,
                                               kind_patches: Path) -> None:
    spec = _spec(case)
    if case.name == "replace-body":
        # pin the body being replaced: a changed vendor body is then drift
        module = cst.parse_module((roots_of(tree)[0] / spec["file"]).read_text())
        fn = resolve_scope(module, spec["scope"])
        assert isinstance(fn, cst.FunctionDef)
        spec["old_digest"] = body_digest(fn)
    # a second, healthy transform on another file must not be written either
    healthy = {"id": "healthy", "kind": "set-kwarg", "file": "vllm/engine/arg_utils.py",
               "scope": "EngineArgs.create_engine_config", "call": "ParallelConfig",
               "arg": "disable_custom_all_reduce", "old": "True", "new": "self.disable_custom_all_reduce"}
    recipe = write_recipe(tmp_path, [healthy, spec], kind_patches)
    for root in roots_of(tree):
        path = root / case.spec["file"]
        drifted_text = case.drift(path.read_text())
        if drifted_text is None:
            path.unlink()
        else:
            path.write_text(drifted_text)
    before = tree_digest(tree)
    code, report, _ = _run(cli, recipe, tree)
    assert code == 1
    assert tree_digest(tree) == before
    drifted = [r for r in report["results"] if r["state"] == "DRIFTED"]
    assert {r["transform"] for r in drifted} == {case.spec["id"]}
    assert {r["root"] for r in drifted} == set(COREX_ROOTS)
    for r in drifted:
        assert r["file"] == case.spec["file"]
        lines = recipe.read_text().splitlines()
        second = [i for i, ln in enumerate(lines) if ln.startswith("- why:")][1]
        at = next(i + 1 for i, ln in enumerate(lines) if i > second and ln.startswith(f"  {case.field}:"))
        assert r["recipe_line"] == at, (case.field, lines[r["recipe_line"] - 1])  # the line of the field at fault
        for word in case.drift_words:
            assert word in r["message"], (word, r["message"])


def test_import_already_there_is_superseded(cli, tree: Path, tmp_path: Path) -> None:
    for root in roots_of(tree):
        path = root / "vllm/triton_utils/importing.py"
        path.write_text("import os\n" + path.read_text())
    code, report, _ = _run(cli, write_recipe(tmp_path, [CASES[5].spec]), tree)
    assert code == 0
    assert [r["state"] for r in report["results"]] == ["SUPERSEDED", "SUPERSEDED"]
    assert cli("apply", write_recipe(tmp_path, [CASES[5].spec]), "--rootfs", tree, "--strict").code == 4


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_crlf_targets_keep_their_line_endings(cli, case: Case, tree: Path, tmp_path: Path,
                                              kind_patches: Path) -> None:
    recipe = write_recipe(tmp_path, [_spec(case)], kind_patches)
    for root in roots_of(tree):
        path = root / case.spec["file"]
        path.write_bytes(path.read_bytes().replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))
    code, report, _ = _run(cli, recipe, tree)
    assert code == 0, report
    for root in roots_of(tree):
        data = (root / case.spec["file"]).read_bytes()
        assert data.count(b"\n") == data.count(b"\r\n"), "every line must still end in CRLF"
        assert case.after(data.decode().replace("\r\n", "\n"))
    code, report, _ = _run(cli, recipe, tree)
    assert {r["state"] for r in report["results"]} == {"ALREADY_APPLIED"}


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_roots_that_differ_are_refused(cli, case: Case, tree: Path, tmp_path: Path, kind_patches: Path) -> None:
    recipe = write_recipe(tmp_path, [_spec(case)], kind_patches)
    path = roots_of(tree)[0] / case.spec["file"]
    path.write_text(path.read_text() + "\n# only in lib\n")
    before = tree_digest(tree)
    result = cli("apply", recipe, "--rootfs", tree)
    assert result.code == 3
    assert "differs between vendor roots" in result.err and case.spec["file"] in result.err
    assert tree_digest(tree) == before


def test_stale_marker_from_an_older_transform_is_drift(cli, tree: Path, tmp_path: Path) -> None:
    spec = dict(CASES[1].spec)
    assert cli("apply", write_recipe(tmp_path, [spec]), "--rootfs", tree).code == 0
    spec["new"] = "True"  # the transform changed since it was applied
    code, report, _ = _run(cli, write_recipe(tmp_path, [spec]), tree)
    assert code == 1
    assert all("stale patch" in r["message"] for r in report["results"])


def test_gate_excludes_a_transform(cli, tree: Path, tmp_path: Path) -> None:
    spec = dict(CASES[0].spec, gate={"vendor_version": ">=0.7"})
    code, report, _ = _run(cli, write_recipe(tmp_path, [spec]), tree)
    assert code == 0
    assert [r["state"] for r in report["results"]] == ["GATED_OFF", "GATED_OFF"]
    assert COREX_VERSION in report["results"][0]["message"]


def test_match_contract_counts_sites(cli, tree: Path, tmp_path: Path) -> None:
    # ModelConfig has exactly one enforce_eager site; a contract of two is drift, not a partial patch
    spec = dict(CASES[0].spec, expect=2)
    code, report, _ = _run(cli, write_recipe(tmp_path, [spec]), tree)
    assert code == 1
    assert "exactly 2 time(s)" in report["results"][0]["message"]


# -- the dispatch runs the injected path with the switch on and the original with it off ------------

STAND_IN = '''
def scale(x, factor=2, *, bias=0):
    """Original vendor code path."""
    return ("original", x * factor + bias)
'''
FAST = '''
def scale(x, factor=2, *, bias=0):
    return ("fast", x * factor + bias)
'''


def test_dispatch_switch_selects_the_path(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rootfs = tmp_path / "rootfs"
    patches = tmp_path / "patches"
    switch_package(patches, "fastpkg", {"FAST_SCALE": "1"})
    (patches / "fastpkg" / "ops.py").write_text(FAST)
    for root in COREX_ROOTS:
        base = rootfs / root.lstrip("/")
        (base / "vllm").mkdir(parents=True)
        (base / "vllm" / "__init__.py").write_text("")
        (base / "vllm" / "ops.py").write_text(STAND_IN)
        (base / "vllm-0.6.3+corex.3.2.3.dist-info").mkdir()
        (base / "vllm-0.6.3+corex.3.2.3.dist-info" / "METADATA").write_text("Version: 0.6.3+corex.3.2.3\n")
    recipe = write_recipe(tmp_path, [
        {"id": "fast-scale", "kind": "dispatch", "file": "vllm/ops.py", "scope": "scale",
         "switch": "FAST_SCALE", "default": "1", "target": "fastpkg.ops:scale"},
        {"id": "deploy-fastpkg", "kind": "deploy", "source": "fastpkg", "dest": "fastpkg"},
    ], patches)
    assert cli("apply", recipe, "--rootfs", rootfs).code == 0
    root = str(rootfs / COREX_ROOTS[1].lstrip("/"))
    monkeypatch.syspath_prepend(root)
    for name in [m for m in sys.modules if m.split(".")[0] in ("vllm", "fastpkg")]:
        monkeypatch.delitem(sys.modules, name)
    import vllm.ops  # type: ignore[import-not-found]

    assert vllm.ops.__file__.startswith(root)
    monkeypatch.delenv("FAST_SCALE", raising=False)
    assert vllm.ops.scale(3, bias=1) == ("fast", 7)  # default on
    monkeypatch.setenv("FAST_SCALE", "0")
    assert vllm.ops.scale(3, bias=1) == ("original", 7)
    monkeypatch.setenv("FAST_SCALE", "1")
    assert vllm.ops.scale(3, 3, bias=1) == ("fast", 10)
    assert vllm.ops.scale.__doc__ == "Original vendor code path."
    import fastpkg.switches  # type: ignore[import-not-found]

    for bad in ("01", " 1", "true", "on", "2", ""):  # neither path: the injected test refuses, naming the value
        monkeypatch.setenv("FAST_SCALE", bad)
        with pytest.raises(fastpkg.switches.SwitchError, match=re.escape(f"FAST_SCALE={bad!r}: expected exactly 0 "
                                                                          "or 1 (read at ") + ".*vllm/ops.py:"):
            vllm.ops.scale(3)
    for name in [m for m in sys.modules if m.split(".")[0] in ("vllm", "fastpkg")]:
        monkeypatch.delitem(sys.modules, name)


def test_the_evaluation_memo_sees_every_input_and_hands_out_its_own_lists(tmp_path: Path) -> None:
    """evaluate() is memoised: the same module planned again with the replace-body source changed on disk (a recipe
    copy with an edited patches file, in one process) rewrites to the new body, and a caller that extends the
    states it got changes no later answer."""
    from pydantic import TypeAdapter

    from toolkit.engine.evaluate import evaluate
    from toolkit.recipe import Transform
    from toolkit.transforms import edit_kind
    from toolkit.transforms.base import Context

    module = b"def f(x):\n    return x\n"
    source = tmp_path / "fast.py"
    spec = TypeAdapter(Transform).validate_python({"id": "body", "kind": "replace-body", "file": "m.py", "scope": "f",
                                                   "source": "fast.py:f", **PROVENANCE})

    def plan() -> Any:
        return evaluate("m.py", module, [edit_kind(spec, Context(patches_dir=tmp_path))], None)

    source.write_text("def f(x):\n    return x + 1\n")
    first = plan()
    assert first.text is not None and "return x + 1" in first.text
    first.states.append(first.states[0])
    again = plan()
    assert len(again.states) == 1 and again.text == first.text
    source.write_text("def f(x):\n    return x * 2\n")
    changed = plan()
    assert changed.text is not None and "return x * 2" in changed.text and "x + 1" not in changed.text
