"""The stand-ins for the image's GPU libraries (toolkit.runtime.standins), in a fresh interpreter each, switched on
the way the CPU runtime switches them on: the sitecustomize of `site_dir()` first on PYTHONPATH, TOOLKIT_GPU_STANDINS.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import FLAGSHIP, REPO, flagship_data

from toolkit.runtime import standins

TREE_MODULE = '''\
import ixformer.functions as ixf_F
from ixformer.contrib.xformers.ops.fmha.attn_bias import BlockDiagonalCausalMask
from xformers import ops as xops
import xformers.ops.fmha.attn_bias as bias


@xops.register_op                 # a decorator, evaluated while the module is defined
def kernel(x):
    return x


@ixf_F.autotune(configs=[ixf_F.Config(block=64)], key=["n"])   # a decorator factory
def tuned(x):
    return x


class Mask(BlockDiagonalCausalMask):   # the tree subclasses a library class and uses it as its own
    def __init__(self, n):
        self.n = n


def forward(x):
    return ixf_F.moe_align_block_size(x)  # no CPU reference: it raises


def linear(x, w):
    return ixf_F.linear(x, w)
'''


def line_of(text: str) -> int:
    return next(i for i, line in enumerate(TREE_MODULE.splitlines(), 1) if text in line)


def run(tmp_path: Path, code: str, libraries: str = "ixformer,xformers") -> subprocess.CompletedProcess[str]:
    (tmp_path / "tree").mkdir(exist_ok=True)
    (tmp_path / "tree" / "vendormod.py").write_text(TREE_MODULE)
    env = dict(os.environ, **standins.environment(tmp_path / "cache", libraries.split(","), [tmp_path / "tree"]),
               TOOLKIT_GPU_STANDINS_RECORD=str(tmp_path / "record.json"))
    if not libraries:
        env.pop(standins.ENV)
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=tmp_path)


def test_a_tree_that_imports_them_imports_and_a_call_names_library_attribute_and_caller(tmp_path: Path) -> None:
    proc = run(tmp_path, """
        import json, vendormod
        from xformers.ops.fmha.attn_bias import AttentionBias
        import xformers.ops.fmha.attn_bias as bias
        out = {"mask": vendormod.Mask(3).n, "subclass": issubclass(vendormod.Mask, vendormod.BlockDiagonalCausalMask),
               "same": bias.AttentionBias is AttentionBias, "isinstance": isinstance(vendormod.Mask(1), vendormod.Mask)}
        try:
            vendormod.forward(1)
        except RuntimeError as exc:
            out["forward"] = [type(exc).__name__, str(exc)]
        def run_kernel():  # from a function: where GPU code runs (at a module's top level it stands in again)
            vendormod.kernel(1)
        try:
            run_kernel()
        except RuntimeError as exc:
            out["kernel"] = str(exc)
        print(json.dumps(out))
    """)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["mask"] == 3 and out["subclass"] and out["same"] and out["isinstance"]
    kind, message = out["forward"]
    assert kind == "StandInCalled"
    assert message.startswith("ixformer.functions.moe_align_block_size called from ")
    assert f"vendormod.py:{line_of('moe_align_block_size')}" in message
    assert "GPU library of the image" in message and "base_image.gpu_libraries" in message
    assert out["kernel"].startswith("xformers.ops.register_op(...) called from")
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["libraries"] == ["ixformer", "xformers"]
    assert {"ixformer", "ixformer.functions", "xformers.ops.fmha.attn_bias"} <= set(record["modules"])
    assert [c["name"] for c in record["calls"]] == ["ixformer.functions.moe_align_block_size",
                                                    "xformers.ops.register_op(...)"]


def test_a_call_with_a_cpu_reference_computes_it(tmp_path: Path) -> None:
    pytest.importorskip("torch", reason="the references are plain torch")
    proc = run(tmp_path, """
        import torch, vendormod
        x, w = torch.randn(3, 4), torch.randn(5, 4)
        print(float((vendormod.linear(x, w) - x @ w.t()).abs().max()))
    """)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) < 1e-6
    calls = json.loads((tmp_path / "record.json").read_text())["calls"]
    assert calls == [{"name": "ixformer.functions.linear", "where": calls[0]["where"],
                      "mapped": "reference ixformer.functions.linear"}]
    assert json.loads((tmp_path / "record.json").read_text())["computed"] == {"ixformer.functions.linear": 1}
    assert calls[0]["where"].endswith(f"vendormod.py:{line_of('ixf_F.linear')}")


def test_undeclared_and_installed_libraries_are_left_alone(tmp_path: Path) -> None:
    # only ixformer declared: xformers stays what it is here (not installed), and the import fails as it would
    proc = run(tmp_path, "import vendormod", libraries="ixformer")
    assert proc.returncode != 0 and "No module named 'xformers'" in proc.stderr
    # a library that is really installed wins over its stand-in
    proc = run(tmp_path, "import json; print(json.__file__)", libraries="json")
    assert proc.returncode == 0 and proc.stdout.strip().endswith("json/__init__.py")
    # switched off: nothing is stood in
    proc = run(tmp_path, "import vendormod", libraries="")
    assert proc.returncode != 0 and "No module named 'ixformer'" in proc.stderr


@pytest.fixture(scope="module")
def runtime_python() -> Path:
    from toolkit.runtime.env import runtime

    return runtime()


def test_preflight_names_an_undeclared_gpu_library_and_the_importing_line(cli, runtime_python: Path,
                                                                         adapter_args: list[str],
                                                                         tmp_path: Path) -> None:
    data = flagship_data()
    data["patches"] = str(REPO / "patches/src")
    data["base_image"]["gpu_libraries"] = ["xformers"]  # ixformer left out
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    result = cli("preflight", recipe, *adapter_args, "--json")
    assert result.code == 2, result.out + result.err
    error = json.loads(result.out)
    assert "imports 'ixformer" in error["error"]
    assert "neither installed in the CPU runtime nor declared" in error["error"]
    assert " at vllm/" in error["error"] and ".py:" in error["error"]
    assert "base_image.gpu_libraries" in error["fix"] and f"{recipe}:" in error["fix"]


def test_preflight_lists_what_it_stood_in(cli, runtime_python: Path, adapter_args: list[str]) -> None:
    result = cli("preflight", FLAGSHIP, *adapter_args, "--json")
    assert result.code == 0, result.err[-2000:]
    notes = [n for n in result.json()["notes"] if n.startswith("stood in for the image's GPU libraries")]
    assert len(notes) == 1 and "(ixformer, xformers, triton)" in notes[0] and "ixformer.distributed" in notes[0]
    assert "preflight called none of them; absent from the image, so refused as there: " \
           "ixformer.contrib.vllm_flash_attn" in notes[0]
    assert notes[0].endswith("; emulated 4 device(s) of 32 GiB in every Python it started")
    standins_seen = result.json()["variants"][0]["standins"]
    assert "ixformer.functions" in standins_seen["modules"]


def test_a_compiled_extension_a_copy_lacks_is_stood_in_by_its_dotted_name(tmp_path: Path) -> None:
    (tmp_path / "tree" / "vpkg").mkdir(parents=True)
    (tmp_path / "tree" / "vpkg" / "__init__.py").write_text("REAL = True\n")
    proc = run(tmp_path, "import vpkg, vpkg._C as c; print(vpkg.REAL, c.__name__)", libraries="vpkg._C")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["True", "vpkg._C"]  # the package stays the real one; only _C is stood in
    proc = run(tmp_path, "import vpkg._C", libraries="")
    assert proc.returncode != 0 and "No module named 'vpkg._C'" in proc.stderr


def test_the_missing_module_the_error_names(tmp_path: Path) -> None:
    from toolkit.recipe import load_recipe
    from toolkit.runtime.preflight import Tree, import_failure

    (tmp_path / "vllm").mkdir()
    tree = Tree([tmp_path], tmp_path, {}, "a test tree")
    loaded = load_recipe(FLAGSHIP)
    missing_extension = import_failure(loaded, tree, {"type": "ModuleNotFoundError", "module": "vllm._C",
                                                       "where": "vllm/_custom_ops.py:12"})
    assert "add vllm._C to base_image.gpu_libraries" in (missing_extension.hint or "")
    missing_library = import_failure(loaded, tree, {"type": "ModuleNotFoundError", "module": "ixformer.functions",
                                                     "where": "vllm/_custom_ops.py:13"})
    assert "add ixformer to base_image.gpu_libraries" in (missing_library.hint or "")
    other = import_failure(loaded, tree, {"type": "ImportError", "message": "cannot import name X",
                                           "where": "vllm/sequence.py:3"})
    assert "vllm/sequence.py:3" in other.message


def test_an_absent_submodule_fails_as_on_the_image_by_import_and_by_attribute(tmp_path: Path) -> None:
    (tmp_path / "tree").mkdir()
    env = dict(os.environ, **standins.environment(tmp_path / "cache", ["ixformer"], [tmp_path / "tree"],
                                                  ["ixformer.contrib.vllm_flash_attn"]),
               TOOLKIT_GPU_STANDINS_RECORD=str(tmp_path / "record.json"))
    code = textwrap.dedent("""
        import json
        import ixformer
        out = {"class_path": hasattr(ixformer.contrib, "vllm_flash_attn")}  # contrib not imported: a stand-in class
        import ixformer.contrib
        from ixformer.contrib.xformers import ops  # a sibling of the absent one is there
        out |= {"attribute": hasattr(ixformer.contrib, "vllm_flash_attn"),
               "class_attribute": hasattr(ixformer.functions, "vllm_flash_attn")}
        try:
            from ixformer.contrib.vllm_flash_attn import flash_attn_varlen_func
            out["import"] = "imported"
        except ImportError as exc:
            out["import"] = type(exc).__name__
        print(json.dumps(out))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == {"class_path": False, "attribute": False, "class_attribute": True,
                                       "import": "ModuleNotFoundError"}
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["absent"] == ["ixformer.contrib.vllm_flash_attn"]
    assert "ixformer.contrib.vllm_flash_attn" in record["absent_imports"]


def test_the_emulated_devices_hold_in_a_child_python(tmp_path: Path) -> None:
    """pynvml and vLLM's device count, from the environment, in the Python it starts and in that one's child."""
    fake_vllm = tmp_path / "tree" / "vllm"
    fake_vllm.mkdir(parents=True)
    (fake_vllm / "__init__.py").write_text("")
    (fake_vllm / "utils.py").write_text("def _cuda_device_count_stateless(v=None):\n    return 0\n")
    env = dict(os.environ, **standins.environment(tmp_path / "cache", ["ixformer"], [tmp_path / "tree"],
                                                  devices={"count": 4, "memory_gb": 32, "capability": [7, 0]}))
    child = ("import json, pynvml, vllm.utils; h = pynvml.nvmlDeviceGetHandleByIndex(3); "
             "print(json.dumps([pynvml.nvmlDeviceGetCount(), pynvml.nvmlDeviceGetMemoryInfo(h).total, "
             "vllm.utils._cuda_device_count_stateless()]))")
    parent = f"import subprocess, sys; print(subprocess.run([sys.executable, '-c', {child!r}], " \
             "capture_output=True, text=True, check=True).stdout)"
    proc = subprocess.run([sys.executable, "-c", parent], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == [4, 32 * 2**30, 4]


REGISTRY = '''\
def _run_in_subprocess(fn):
    raise AssertionError("a fresh interpreter was started")
'''
PLUGINS = "import os\n\n\ndef load_general_plugins():\n    os.environ['PLUGINS_IN'] = str(os.getpid())\n"


def test_the_registry_check_runs_in_a_fork_with_its_own_result_failure_and_record(tmp_path: Path) -> None:
    """vLLM's `_run_in_subprocess`, under emulated devices: the inspection runs in another process (plugins loaded
    first, as `registry._run` loads them), returns its value, raises the child's traceback as the RuntimeError vLLM
    raises, leaks no import into the asker, and the child records its own stand-in calls, not its parent's."""
    tree = tmp_path / "tree"
    for module, text in {"vllm/__init__.py": "", "vllm/plugins/__init__.py": PLUGINS, "vllm/model_executor/__init__.py":
                         "", "vllm/model_executor/models/__init__.py": "",
                         "vllm/model_executor/models/registry.py": REGISTRY,
                         "modelmod.py": "import ixformer.functions as F\nF.linear  # resolved at import\n"}.items():
        (tree / module).parent.mkdir(parents=True, exist_ok=True)
        (tree / module).write_text(text)
    code = '''\
        import json, os, sys
        import ixformer.functions as F
        import vllm.model_executor.models.registry as registry
        import toolkit_standins
        def parents_own():  # a call at module level is a decorator's: inside a function, it computes
            import torch
            F.linear(torch.ones(1, 2), torch.ones(3, 2))
        parents_own()
        toolkit_standins.RECORD["load"] = {"parameters": 3}  # the parent's load check: not the child's
        def inspect():
            import modelmod
            try:
                F.moe_align_block_size(1)
            except toolkit_standins.StandInCalled:
                pass
            return {"pid": os.getpid(), "plugins": os.environ["PLUGINS_IN"]}
        got = registry._run_in_subprocess(inspect)
        try:
            registry._run_in_subprocess(lambda: 1 / 0)
        except RuntimeError as exc:
            failed = str(exc)
        print(json.dumps({"got": got, "me": os.getpid(), "failed": failed, "leaked": "modelmod" in sys.modules,
                          "shims": toolkit_standins.RECORD["shims"]}))
    '''
    env = dict(os.environ, **standins.environment(tmp_path / "cache", ["ixformer"], [tree],
                                                  devices={"count": 1, "memory_gb": 1, "capability": [7, 0]}),
               TOOLKIT_GPU_STANDINS_RECORD=str(tmp_path / "record.json"))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["got"]["pid"] != out["me"] and out["got"]["plugins"] == str(out["got"]["pid"])
    assert out["failed"].startswith("Error raised in subprocess:\nTraceback") and "ZeroDivisionError" in out["failed"]
    assert not out["leaked"] and out["shims"] == ["registry-check-forked"]
    record = standins.read_record(tmp_path / "record.json")
    [child, _] = sorted(record["processes"], key=lambda p: p["pid"] != out["got"]["pid"])
    assert [c["name"] for c in child["calls"]] == ["ixformer.functions.moe_align_block_size"]
    assert child["computed"] == {} and record["computed"] == {"ixformer.functions.linear": 1}
    assert "load" not in child and record["load"] == {"parameters": 3}


def test_the_moe_functions_the_bi_v100_lacks_fail_as_there(corex_template: Path, tmp_path: Path) -> None:
    """The vendor's _custom_ops routes vLLM's fused MoE to three ixformer functions the BI-V100's ixformer does not
    have: with the image layer's stand-ins, each call fails with the device's AttributeError (a transform routing
    the model into them is caught on this CPU), and the ops the served path does call still map to references."""
    from conftest import roots_of

    from toolkit.recipe import load_recipe
    from toolkit.runtime.env import runtime

    [ixformer] = [g for g in load_recipe(FLAGSHIP).recipe.base_image.gpu_libraries if g.name == "ixformer"]
    env = dict(os.environ, **standins.environment(tmp_path / "cache", ["ixformer", "xformers", "triton"],
                                                  [roots_of(corex_template)[0]], ixformer.absent,
                                                  devices={"count": 1, "memory_gb": 1, "capability": [7, 0]},
                                                  cpu_device=True),
               TOOLKIT_GPU_STANDINS_RECORD=str(tmp_path / "record.json"))
    code = textwrap.dedent("""
        import json
        import torch
        import vllm._custom_ops as ops
        out = {}
        calls = {"topk_softmax": lambda: ops.topk_softmax(None, None, None, None),
                 "moe_align_block_size": lambda: ops.moe_align_block_size(None, 8, 16, None, None, None),
                 "invoke_fused_moe_kernel": lambda: ops.invoke_fused_moe_kernel(
                     *[None] * 10, {"BLOCK_SIZE_M": 16})}
        for name, call in calls.items():
            try:
                call()
                out[name] = "ran"
            except AttributeError as exc:
                out[name] = str(exc)
        x = torch.randn(2, 8)
        out["silu_and_mul"] = ops.silu_and_mul(torch.empty(2, 4), x) is None
        print(json.dumps(out))
    """)
    proc = subprocess.run([str(runtime()), "-c", code], capture_output=True, text=True, env=env, cwd=tmp_path,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {
        "topk_softmax": "ixformer.functions.vllm_moe_topk_softmax is absent from the image",
        "moe_align_block_size": "ixformer.functions.vllm_moe_align_block_size is absent from the image",
        "invoke_fused_moe_kernel": "ixformer.functions.vllm_invoke_fused_moe_kernel is absent from the image",
        "silu_and_mul": True}
