"""The served path on a CPU (`pytest -k generate`): vLLM 0.6.3's own LLMEngine, the vendor's GPU executor, Worker,
ModelRunner, CacheEngine and xFormers backend on CPU tensors (toolkit/runtime/cpu_device.py), the vendor's GPU
library computed by the CPU references, over the CoreX-like tree patched by recipes/bi100-qwen25.yaml, with a tiny
Qwen2 checkpoint (toolkit/runtime/tiny_model.py). Greedy; each generated token is checked against a recompute:
the prompt plus the tokens so far sent alone to a fresh engine (no cache, no prefix hit, no chunking), so the paged
KV cache and the decode reference are checked against the prefill reference. Then the same at TP 2 (two worker
processes, a gloo group, the ixformer all-reduce on it), without the prefix cache, with a reference made wrong on
purpose, with each shim left out, and with a checkpoint that does not write every parameter.

The flagship (Qwen3.6 through the adapter) runs the same harness in test_generate_flagship.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO, roots_of

from toolkit.cli import main
from toolkit.inputs import cache_dir
from toolkit.pyenv import code, script
from toolkit.recipe import load_recipe
from toolkit.runtime import cpu_device, standins, tiny_model
from toolkit.runtime.env import runtime
from toolkit.runtime.preflight import emulated_devices

RECIPE = REPO / "recipes" / "bi100-qwen25.yaml"
HARNESS = REPO / "tests" / "runtime_generate.py"
# float32, the same logprob through the paged decode, a full prefill and transformers' own forward: with the tiny
# model's 0.15 initializer its logits are large, and the two implementations (vLLM's cached rotary table and
# transformers' computed one, their summation orders) part by up to 1.02e-3 (measured on the 640-token vocabulary);
# every mutant below moves a token or a logprob by far more
TOLERANCE = 2e-3
# three prompts over 16-token blocks: 37 and 21 tokens (neither ends on a block); with a 32-token budget the first
# is prefilled in two chunks, its last one in the same step as the second's prefill, then both decode together;
# the later one shares the first's two full blocks
PROMPTS = [[(7 * i + 3) % 300 + 8 for i in range(37)], [(5 * i + 1) % 300 + 8 for i in range(21)]]
LATER = [[*PROMPTS[0][:32], 40, 41, 42, 43, 44]]
BASE = {"dtype": "float32", "budget": 32, "max_tokens": 6, "prompts": PROMPTS, "later": LATER, "blocks": 96}
ALL_REFERENCES = {"ixformer.functions.rms_norm", "ixformer.functions.fused_add_rms_norm",
                  "ixformer.functions.vllm_rotary_embedding_neox", "ixformer.functions.silu_and_mul",
                  "ixformer.functions.linear", "ixformer.functions.vllm_cache_ops_reshape_and_cache",
                  "ixformer.functions.vllm_single_query_cached_kv_attention",
                  "ixformer.contrib.xformers.ops.memory_efficient_attention_forward"}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, corex_template: Path) -> dict[str, Any]:
    """The patched tree, the tiny checkpoint (built once, cached by content) and the environment of the runs."""
    work = tmp_path_factory.mktemp("generate")
    rootfs = work / "rootfs"
    shutil.copytree(corex_template, rootfs, symlinks=True)
    assert main(["apply", str(RECIPE), "--rootfs", str(rootfs)]) == 0
    return cpu_served(work, RECIPE, [roots_of(rootfs)[1]])


def cpu_served(work: Path, recipe_path: Path, paths: list[Path]) -> dict[str, Any]:
    """The recipe's tiny checkpoint (built once, cached by content) and the environment of the runs: the recipe's
    env, the patched `paths` first, the vendor's GPU path on CPU tensors against an emulated 0.5 GB card (the tiny
    model's KV fits many times)."""
    recipe = load_recipe(recipe_path).recipe
    python = runtime()
    model = tiny_model.build(tiny_model.tiny_spec(recipe.model, 2), python, cache_dir() / "tiny-models")
    devices = dict(emulated_devices(recipe), memory_gb=0.5)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TOOLKIT_")}, **recipe.env,
           **standins.environment(work / "standins", recipe.base_image.gpu_library_names, [*paths, REPO / "tests"],
                                  recipe.base_image.absent_modules, devices, cpu_device=True)}
    return {"work": work, "python": python, "model": model, "env": env}


def run(served: dict[str, Any], name: str, **settings: Any) -> dict[str, Any]:
    """One harness run: its JSON, the stand-ins' record (every process), or the failure's stderr. With
    `runs={name: settings}`, those runs one after another in one process: each name's result, beside `code`,
    `stderr` and the process's `record`."""
    record = served["work"] / f"record-{name}" / "standins.json"
    record.parent.mkdir()
    env = dict(served["env"], TOOLKIT_GPU_STANDINS_RECORD=str(record))
    if settings.get("without"):
        env[standins.CPU_DEVICE_ENV] = f"on without {settings['without']}"  # in every process the run starts
    request = {**BASE, "model": str(served["model"]), "tp": 1, "prefix_caching": True, **settings}
    # its own process group: a worker left behind by a failed start is stopped with the run, whatever happens
    with subprocess.Popen(script(served["python"], HARNESS, json.dumps(request)), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, env=env, start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=300)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
    result: dict[str, Any] = {"code": proc.returncode, "stderr": stderr}
    if proc.returncode == 0:
        line = next(line for line in stdout.splitlines() if line.startswith("RESULT "))
        result.update(json.loads(line.removeprefix("RESULT ")), record=standins.read_record(record))
    return result


def mismatches(outputs: dict[str, Any], oracle: dict[str, Any]) -> list[str]:
    """Each generated token that is not the recompute's token, or whose logprob is not the recompute's."""
    found = []
    for name, out in outputs.items():
        for step, (token, logprob) in enumerate(zip(out["tokens"], out["logprobs"], strict=True)):
            want = oracle[f"{name}@{step}"]
            if token != want["tokens"][0] or abs(logprob - want["logprobs"][0]) > TOLERANCE:
                found.append(f"{name} token {step}: {token} ({logprob:.5f}), recompute {want['tokens'][0]} "
                             f"({want['logprobs'][0]:.5f})")
    return found


def differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    found = []
    for name in a:
        if a[name]["tokens"] != b[name]["tokens"]:
            found.append(f"{name}: {a[name]['tokens']} vs {b[name]['tokens']}")
        elif any(abs(x - y) > TOLERANCE for x, y in zip(a[name]["logprobs"], b[name]["logprobs"], strict=True)):
            found.append(f"{name}: logprobs {a[name]['logprobs']} vs {b[name]['logprobs']}")
    return found


def tp1_and_off(served: dict[str, Any], **settings: Any) -> dict[str, Any]:
    """The TP 1 run with its recompute oracle, then the same prompts with the prefix cache off, in one process:
    the TP 1 result, with the other's under `off`."""
    result = run(served, "tp1", runs={"tp1": {"oracle": True}, "off": {"prefix_caching": False}}, **settings)
    assert result["code"] == 0, result["stderr"][-4000:]
    return {**result.pop("tp1"), **result}


@pytest.fixture(scope="module")
def tp1(served: dict[str, Any]) -> dict[str, Any]:
    return tp1_and_off(served)


def test_generation_matches_the_recompute_at_tp1(tp1: dict[str, Any]) -> None:
    print(json.dumps({k: tp1[k] for k in ("outputs", "prefix_hit_rate")}, indent=1))
    assert not mismatches(tp1["outputs"], tp1["oracle"])
    assert not mismatches(tp1["outputs"], tp1["reference"])  # transformers' own forward: no vendor code, no reference
    assert len(set(tp1["outputs"]["0"]["tokens"])) > 1  # not a model that repeats one token whatever it reads
    assert tp1["prefix_hit_rate"] > 0  # the later request's two blocks came from the cache
    record = tp1["record"]
    assert set(record["computed"]) >= ALL_REFERENCES, sorted(record["computed"])
    assert not [c for c in record["calls"] if not c["mapped"]]
    assert set(record["shims"]) == {*cpu_device.SHIMS, *cpu_device.CHECKS, *cpu_device.FORCING, standins.REGISTRY_SHIM}
    assert not record["load"]["unwritten"] and record["load"]["parameters"] > 0
    # the KV cache the vendor's profile run sized: the emulated card's 0.9, less what the model and its peak took
    blocks, size = tp1["cache"]["num_gpu_blocks"], tp1["cache"]["block_bytes"]
    assert 0 < blocks * size < 0.9 * 0.5 * 2**30 and blocks > BASE["blocks"]


def same_tokens_cache_off_and_at_tp2(served: dict[str, Any], tp1: dict[str, Any], **settings: Any) -> None:
    """The TP 1 run's tokens again with the prefix cache off (run beside it), and at TP 2 with the second rank in
    its own process (the ixformer all-reduce computed on both ranks, over gloo)."""
    assert tp1["off"]["prefix_hit_rate"] is None and tp1["off"]["outputs"]
    assert not differences(tp1["outputs"], tp1["off"]["outputs"])
    tp2 = run(served, "tp2", tp=2, **settings)
    assert tp2["code"] == 0, tp2["stderr"][-4000:]
    assert not differences(tp1["outputs"], tp2["outputs"])
    workers = [p for p in tp2["record"]["processes"] if p.get("computed")]
    assert len(workers) == 1, "the second rank computed in its own process"
    for rank in (tp2["record"], workers[0]):
        assert rank["computed"]["ixformer.distributed.all_reduce"] > 0
        assert rank["shims"] and "gloo-for-nccl" in rank["shims"]


def rewritten_checkpoint(served: dict[str, Any], folder: Path, edit: str) -> Path:
    """A copy of the tiny checkpoint with its tensors edited by `edit` (Python, on the dict `tensors`)."""
    shutil.copytree(served["model"], folder)
    code = ("from safetensors.torch import load_file, save_file\nimport sys\ntensors = load_file(sys.argv[1])\n"
            f"{edit}\nsave_file(tensors, sys.argv[1], metadata={{'format': 'pt'}})\n")
    subprocess.run([str(served["python"]), "-c", code, str(folder / "model.safetensors")], check=True)
    return folder


def test_prefix_cache_off_and_tp2_give_the_same_tokens(served: dict[str, Any], tp1: dict[str, Any]) -> None:
    same_tokens_cache_off_and_at_tp2(served, tp1)


MUTANTS = ("transposed-kv-layout", "causal-mask-off-by-one", "head-mapping-ignored")


@pytest.fixture(scope="module")
def mutants(served: dict[str, Any]) -> dict[str, Any]:
    """Each wrong reference's run with its oracle, one after another in one process (the right reference put back
    between them)."""
    result = run(served, "mutants", prefix_caching=False, oracle=True,
                 runs={mutant: {"mutant": mutant} for mutant in MUTANTS})
    assert result["code"] == 0, result["stderr"][-4000:]
    return result


@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_wrong_reference_fails_the_generation_check(mutants: dict[str, Any], mutant: str) -> None:
    assert mismatches(mutants[mutant]["outputs"], mutants[mutant]["oracle"])


# what the vendor's start meets without each shim (CPU torch's own errors)
WITHOUT = {"cuda-tensors-on-cpu": "Could not run 'aten::empty.memory_format' with arguments from the 'CUDA' backend",
           "torch-cuda-calls": "module 'torch._C' has no attribute '_cuda_setDevice'",
           "emulated-memory": "'NoneType' object has no attribute 'cudaMemGetInfo'",
           "gloo-for-nccl": "Distributed package doesn't have NCCL built in"}


# the device tests matter only where a TP all-reduce runs, and an engine at TP 2 whose rank fails in a collective
# can leave the other waiting in it: that shim is seen needed on the tree's own all-reduce, below
@pytest.mark.parametrize("shim", [s for s in cpu_device.SHIMS if s != "device-tensor-tests"])
def test_each_shim_is_needed(served: dict[str, Any], shim: str) -> None:
    # at TP 1: the vendor's worker asks for an NCCL group there too, and at TP 2 a worker that dies in that call
    # can leave the driver waiting for it in the group's rendezvous until the timeout
    result = run(served, f"without-{shim}", without=shim)
    assert result["code"] != 0, f"the engine ran without {shim}"
    assert WITHOUT[shim] in result["stderr"], result["stderr"][-3000:]


def test_a_parameter_the_checkpoint_does_not_write_fails_the_start(served: dict[str, Any], tmp_path: Path) -> None:
    # vLLM's Qwen2 loader refuses a name it does not know but says nothing of a tensor that is not there: the
    # parameter keeps its initial value (the adapter's loader skips unknown names too, ADAPTER.md 4b)
    dropped = rewritten_checkpoint(served, tmp_path / "dropped", "del tensors['model.layers.1.mlp.down_proj.weight']")
    result = run(served, "dropped", model=str(dropped))
    assert result["code"] != 0
    assert "UnwrittenParameters: 1 of 31 parameters of Qwen2ForCausalLM" in result["stderr"], result["stderr"][-3000:]
    assert "model.layers.1.mlp.down_proj.weight" in result["stderr"]
    unchecked = run(served, "dropped-unchecked", model=str(dropped), without="load-check")
    assert unchecked["code"] == 0, "without the check the same checkpoint loads and serves, silently"


@pytest.mark.parametrize(("value", "devices", "says"), [
    ("yes", {"count": 1, "memory_gb": 1}, "TOOLKIT_CPU_DEVICE='yes' is not known"),
    ("on without", {"count": 1, "memory_gb": 1}, "is not known"),
    ("on without nope", {"count": 1, "memory_gb": 1}, "no shim named nope"),
    ("on", None, "needs the emulated devices"),
])
def test_the_switch_refuses_what_it_does_not_know(value: str, devices: dict[str, Any] | None, says: str) -> None:
    with pytest.raises(cpu_device.CpuDeviceError, match=says):
        cpu_device.from_environment({cpu_device.ENV: value}, devices)


def test_the_runtime_refuses_an_unknown_switch_value(served: dict[str, Any]) -> None:
    # raised in the sitecustomize, which Python would report and carry on without: the runtime stops instead
    env = dict(served["env"], TOOLKIT_CPU_DEVICE="yes")
    proc = subprocess.run([str(served["python"]), "-c", "print('started')"], capture_output=True, text=True, env=env)
    assert proc.returncode == 2 and "started" not in proc.stdout
    assert "TOOLKIT_CPU_DEVICE='yes' is not known" in proc.stderr


ALL_REDUCE = """
import json, os, torch, torch.distributed as dist
from vllm.distributed.parallel_state import GroupCoordinator
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
group = type("Group", (), {"pynccl_comm": None, "device_group": dist.group.WORLD})()
x = torch.ones(3, device="cuda")
try:
    GroupCoordinator._all_reduce_in_place(group, x)
    print(json.dumps({"reduced": x.tolist()}))
except ImportError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@pytest.mark.parametrize("shim_on", [True, False], ids=["with", "without"])
def test_the_trees_all_reduce_takes_the_ixformer_branch_only_with_the_device_tests(served: dict[str, Any],
                                                                                   shim_on: bool) -> None:
    """The image's _all_reduce_in_place tests `input_.is_cpu` before its ixformer branch: on CPU tensors it takes
    upstream's CPU branch (an intel_extension_for_pytorch the image lacks) unless the tree's tests are answered as
    on the device."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    record = served["work"] / f"record-all-reduce-{shim_on}" / "standins.json"
    record.parent.mkdir()
    env = dict(served["env"], TOOLKIT_GPU_STANDINS_RECORD=str(record), PORT=str(port))
    if not shim_on:
        env[standins.CPU_DEVICE_ENV] = "on without device-tensor-tests"
    proc = subprocess.run(code(served["python"], ALL_REDUCE), capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    if shim_on:
        assert out == {"reduced": [1.0, 1.0, 1.0]}
        assert standins.read_record(record)["computed"]["ixformer.distributed.all_reduce"] == 1
    else:
        assert out == {"error": "No module named 'intel_extension_for_pytorch'"}
