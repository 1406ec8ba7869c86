"""The kernels kind against the adapter's real prebuilt CoreX modules (../shared/qwen36-adapter-2f7d5f5): the
manifest pinned and checked at build and in the image, the ELF machine checked, the ten modules installed into both
vLLM roots; their stand-ins in the CPU runtime (asked before the tree's unloadable binaries, counted per call); the
census counting one call as one launch; the rehearsal's kernels check."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAGSHIP, REPO, flagship_data, recipe_text, roots_of, transformers_site
from pinned_adapter import NEWEST_FILES, add_commit, make_repo, require

from toolkit.errors import ToolkitError
from toolkit.recipe import load_recipe
from toolkit.rehearsal.checks.kernels import kernels_check
from toolkit.results import State
from toolkit.runtime import standins
from toolkit.transforms.base import Context
from toolkit.transforms.kernels import Kernels, KernelsKind

BUNDLE = "prebuilt/corex-3.2.3-ivcore10"
SPEC: Kernels = next(t for t in load_recipe(FLAGSHIP).recipe.transforms if isinstance(t, Kernels))


def _source(tmp_path: Path) -> Path:
    """The adapter's prebuilt folder, copied byte for byte into a source tree of the test's own."""
    top = tmp_path / "adapter"
    shutil.copytree(require(NEWEST_FILES) / BUNDLE, top / BUNDLE)
    for path in (top / BUNDLE).iterdir():
        path.chmod(0o644)
    return top


def _kind(top: Path, spec: Kernels = SPEC, arch: str | None = "ivcore10") -> KernelsKind:
    return KernelsKind(spec, Context(REPO / "patches" / "src", {"qwen36-adapter": top}, arch, "manylinux1_x86_64"))


def _reseal(folder: Path) -> Kernels:
    """The manifest rewritten for the files as they are now, and a spec pinning it (what a careless rebuild does)."""
    lines = [f"{hashlib.sha256(p.read_bytes()).hexdigest()}  {p.name}" for p in sorted(folder.glob("*.so"))]
    (folder / "SHA256SUMS").write_text("\n".join(lines) + "\n")
    digest = hashlib.sha256((folder / "SHA256SUMS").read_bytes()).hexdigest()
    return SPEC.model_copy(update={"manifest_sha256": digest})


def test_the_ten_modules_install_in_every_root_with_the_manifests_digests(tmp_path: Path) -> None:
    kind = _kind(_source(tmp_path))
    manifest = dict(line.split()[::-1] for line in (require(NEWEST_FILES) / BUNDLE / "SHA256SUMS").read_text()
                    .splitlines())
    assert len(manifest) == 10
    for root in (tmp_path / "r1", tmp_path / "r2"):
        (root / "vllm").mkdir(parents=True)
        plan = kind.plan(root, {})
        assert plan.state is State.WOULD_APPLY and len(plan.ops) == 10
        for op in plan.ops:
            assert op.content is not None
            op.path.write_bytes(op.content)
        installed = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (root / "vllm").glob("*.so")}
        assert installed == manifest
        again = kind.plan(root, dict(plan.owned))
        assert again.state is State.ALREADY_APPLIED
        assert "sha256 as SHA256SUMS: corex_attn_head_rms_norm.so 534019b3c2ad" in again.message
    # nothing but the artefacts: the manifest stays in the payload
    assert not (tmp_path / "r1" / "vllm" / "SHA256SUMS").exists()


def test_a_flipped_byte_is_refused_naming_the_file_and_its_manifest_line(tmp_path: Path) -> None:
    top = _source(tmp_path)
    path = top / BUNDLE / "corex_gdn_qk_map.so"
    data = bytearray(path.read_bytes())
    data[4096] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ToolkitError) as caught:
        _kind(top)
    found = hashlib.sha256(data).hexdigest()
    assert f"{path} has sha256 {found}, not the manifest's 015b61046ad7" in caught.value.message
    assert caught.value.message.endswith(f"({top / BUNDLE / 'SHA256SUMS'}:6)")


def test_a_manifest_that_is_not_the_pinned_one_is_refused(tmp_path: Path) -> None:
    top = _source(tmp_path)
    path = top / BUNDLE / "corex_gdn_qk_map.so"
    path.write_bytes(path.read_bytes() + b"\0")
    _reseal(top / BUNDLE)  # a manifest that matches the changed file, but not the recipe's pin
    with pytest.raises(ToolkitError, match=r"SHA256SUMS has sha256 [0-9a-f]{64}, the recipe pins c99e3a408145"):
        _kind(top)


def test_an_artefact_for_another_machine_is_refused(tmp_path: Path) -> None:
    top = _source(tmp_path)
    path = top / BUNDLE / "corex_moe_direct_routed.so"
    data = bytearray(path.read_bytes())
    struct.pack_into("<H", data, 18, 183)  # e_machine: aarch64
    path.write_bytes(bytes(data))
    spec = _reseal(top / BUNDLE)
    with pytest.raises(ToolkitError, match=r"corex_moe_direct_routed.so is an ELF for aarch64, not the image's x86_64"):
        _kind(top, spec)
    path.write_bytes(b"#!/bin/sh\n" + bytes(data))
    with pytest.raises(ToolkitError, match=r"corex_moe_direct_routed.so is not an ELF file"):
        _kind(top, _reseal(top / BUNDLE))


def test_the_declared_modules_must_be_the_manifests(tmp_path: Path) -> None:
    top = _source(tmp_path)
    fewer = SPEC.model_copy(update={"modules": SPEC.modules[1:]})
    with pytest.raises(ToolkitError, match=r"lists corex_gdn_causal_conv.so beyond the declared modules"):
        _kind(top, fewer)


def test_another_device_architecture_is_gated_off(tmp_path: Path) -> None:
    kind = _kind(_source(tmp_path), arch="ivcore11")
    (tmp_path / "root" / "vllm").mkdir(parents=True)
    plan = kind.plan(tmp_path / "root", {})
    assert plan.state is State.GATED_OFF and plan.ops == ()
    assert plan.message == "built for ivcore10; the target's device architecture is ivcore11"


def test_build_refuses_a_flipped_byte_in_the_pinned_commit(cli, tmp_path: Path) -> None:
    clone, _ = make_repo(tmp_path)
    path = require(NEWEST_FILES) / BUNDLE / "corex_gdn_packed_decode.so"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x80
    flipped = add_commit(clone, f"{BUNDLE}/corex_gdn_packed_decode.so", bytes(data), "a flipped byte")
    result = cli("build", FLAGSHIP, "-o", tmp_path / "sub", "--source", f"qwen36-adapter={clone}@{flipped}")
    assert result.code == 2
    assert "corex_gdn_packed_decode.so has sha256" in result.err and "not the manifest's 27b7ae2ce4fe" in result.err
    assert not (tmp_path / "sub").exists()


def test_the_image_step_installs_and_verifies_them_in_both_roots(cli, corex_rootfs: Path, adapter_args: list[str],
                                                                  transformers_455: Path, tmp_path: Path) -> None:
    out = tmp_path / "sub"
    result = cli("build", FLAGSHIP, "-o", out, *adapter_args)
    assert result.code == 0, result.err[-3000:]
    bundled = out / "toolkit_payload/sources/qwen36-adapter" / BUNDLE
    assert sorted(p.name for p in bundled.iterdir()) == sorted(["SHA256SUMS", *(f"{m.name}.so" for m in SPEC.modules)])
    site = transformers_site(corex_rootfs, transformers_455)
    recipe = out / "toolkit_payload/recipe/bi100-qwen36.yaml"
    env = dict(os.environ, PYTHONPATH=str(out / "toolkit_payload/src"))
    command = [sys.executable, "-m", "toolkit.submission.inimage", str(recipe), "--rootfs", str(corex_rootfs),
               "--package-root", f"transformers={site}"]
    proc = subprocess.run(command, capture_output=True, text=True, cwd=out, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    manifest = (bundled / "SHA256SUMS").read_text()
    for root in roots_of(corex_rootfs):
        assert f"[ok] adapter-corex-kernels /{root.relative_to(corex_rootfs)} APPLIED" in proc.stdout
        for module in SPEC.modules:
            installed = root / "vllm" / f"{module.name}.so"
            assert f"{hashlib.sha256(installed.read_bytes()).hexdigest()}  {installed.name}" in manifest
    verify = subprocess.run([*command, "--verify-only"], capture_output=True, text=True, cwd=out, env=env)
    assert verify.returncode == 0 and "corex_moe_direct_routed.so 0eb120e89608" in verify.stdout
    # a bundled artefact changed after the build: refused in the image, naming it, before anything is written
    path = bundled / "corex_gdn_gated_norm.so"
    path.chmod(0o644)
    path.write_bytes(path.read_bytes()[:-1] + b"\x01")
    again = subprocess.run(command, capture_output=True, text=True, cwd=out, env=env)
    assert again.returncode == 1
    assert "corex_gdn_gated_norm.so" in again.stdout and "[FAIL]" in again.stdout


def test_a_kernel_is_stood_in_before_the_trees_binary_and_counted(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    tree = tmp_path / "tree"
    (tree / "vllm").mkdir(parents=True)
    (tree / "vllm" / "__init__.py").write_text("")
    # the image's binary, which cannot load on this CPU (nor here: not an ELF at all)
    (tree / "vllm" / "corex_moe_exact_reduce.so").write_bytes(b"\x7fELF" + b"\0" * 60)
    record = tmp_path / "standins.json"
    # called from a function, as the adapter calls it (a call in a module body is taken for a decorator's)
    script = ("import torch\nfrom vllm import corex_moe_exact_reduce as m\n\ndef decode():\n"
              "    return m.serial_float(torch.ones(8, 16, dtype=torch.float16), torch.full((8,), 0.5, "
              "dtype=torch.float16))\n\nout = decode()\nprint(out.dtype, tuple(out.shape), float(out[0, 0]))\n")
    env = {**os.environ, **standins.environment(tmp_path / "cache", [], [tree],
                                                   kernels=["vllm.corex_moe_exact_reduce"]),
           standins.RECORD_ENV: str(record)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["torch.float16", "(1,", "16)", "4.0"]
    data = standins.read_record(record)
    assert data["computed"] == {"vllm.corex_moe_exact_reduce.serial_float": 1}
    # without the stand-in the tree's binary is what Python finds: the adapter's try/except ImportError then
    # falls back to its PyTorch path, silently
    env[standins.KERNELS_ENV] = ""
    bare = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert bare.returncode == 1 and "ImportError" in bare.stderr
    # a tree that does not hold the binary (its transform not applied there) gets no stand-in either
    env[standins.KERNELS_ENV] = "vllm.corex_moe_exact_reduce"
    (tree / "vllm" / "corex_moe_exact_reduce.so").unlink()
    absent = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert absent.returncode == 1 and "ImportError: cannot import name 'corex_moe_exact_reduce' from 'vllm'" in \
        absent.stderr, absent.stderr[-1000:]
    (tree / "vllm" / "corex_moe_exact_reduce.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF" + b"\0" * 60)
    # a function the module has no reference of raises, naming it as a kernel
    missing = subprocess.run([sys.executable, "-c", script.replace("serial_float", "serial_double")],
                             capture_output=True, text=True, env=env)
    assert "vllm.corex_moe_exact_reduce.serial_double called from" in missing.stderr
    assert "a prebuilt device kernel (kind kernels) with no CPU reference" in missing.stderr


def test_the_census_counts_a_kernel_call_as_one_launch(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from toolkit.runtime import census as census_module

    rows: list[dict[str, Any]] = []
    census = census_module.Census(lambda: ("decode", "step.moe"), rows.append)
    standins.call_references_through(census.vendor)
    standins.RECORD["kernels"] = ["vllm.corex_moe_weight_gather"]
    try:
        w13 = torch.ones(16, 8, 32, dtype=torch.float16)
        w2 = torch.ones(16, 32, 4, dtype=torch.float16)
        ids = torch.arange(8, dtype=torch.int64)
        census.start()
        standins.standin("vllm.corex_moe_weight_gather.gather")(w13, w2, ids)
        census.stop()
    finally:
        standins.RECORD["kernels"] = []
        standins.call_references_through(standins._direct)
    [step] = rows
    [row] = [r for r in step["ops"] if r[1] == "vllm.corex_moe_weight_gather.gather"]
    region, _, dtype, kind, _, calls, _, nbytes = row
    assert (region, dtype, kind, calls) == ("step.moe", "float16", "vendor", 1)
    assert len(step["ops"]) == 1  # its reference's own operations are inside the one launch, not beside it
    # the 8 selected experts of 16, read and written once (not both whole stacks handed to it)
    selected = 8 * (8 * 32 + 32 * 4) * 2
    assert selected <= nbytes < (16 * (8 * 32 + 32 * 4) * 2 + selected)


def test_a_kernels_bytes_are_what_it_reads_of_its_arguments_not_its_references_copies(tmp_path: Path) -> None:
    """The direct-routed MoE kernel at one TP-4 rank's shapes: handed both whole stacks (256 experts), it reads the 8
    selected experts' rows; its reference's gathered and float32 copies are not traffic."""
    torch = pytest.importorskip("torch")
    from toolkit.runtime import census as census_module

    rows: list[dict[str, Any]] = []
    census = census_module.Census(lambda: ("decode", "step.moe"), rows.append)
    standins.call_references_through(census.vendor)
    standins.RECORD["kernels"] = ["vllm.corex_moe_direct_routed"]
    half = 2
    try:
        x = torch.full((1, 2048), 0.01, dtype=torch.float16)
        w13 = torch.full((256, 256, 2048), 0.01, dtype=torch.float16)
        w2 = torch.full((256, 2048, 128), 0.01, dtype=torch.float16)
        ids = torch.tensor([3, 9, 17, 40, 77, 128, 200, 255], dtype=torch.int64)
        weights = torch.full((8,), 0.125, dtype=torch.float16)
        census.start()
        gate_up = standins.standin("vllm.corex_moe_direct_routed.w13")(x, w13, ids)
        activated = gate_up[:, :128].contiguous()
        standins.standin("vllm.corex_moe_direct_routed.w2_reduce")(activated, w2, ids, weights)
        census.stop()
    finally:
        standins.RECORD["kernels"] = []
        standins.call_references_through(standins._direct)
    [step] = rows
    by_name = {r[1]: r for r in step["ops"]}
    ids_bytes = 8 * 8
    # w13: the token, the 8 experts' gate and up rows, the ids; it writes [8, 256] half
    assert by_name["vllm.corex_moe_direct_routed.w13"][-1] == (
        2048 * half + 8 * 256 * 2048 * half + ids_bytes + 8 * 256 * half)
    # w2_reduce: the activations, the 8 experts' down rows, the ids, the weights; it writes [1, 2048] half
    assert by_name["vllm.corex_moe_direct_routed.w2_reduce"][-1] == (
        8 * 128 * half + 8 * 2048 * 128 * half + ids_bytes + 8 * half + 2048 * half)
    # about 12.6 MB a layer, where the whole stacks are 403 MB and the reference's copies about 200 MB
    both = by_name["vllm.corex_moe_direct_routed.w13"][-1] + by_name["vllm.corex_moe_direct_routed.w2_reduce"][-1]
    assert 12.5e6 < both < 12.7e6


def _module(name: str) -> Any:
    return next(m for m in SPEC.modules if m.name == name)


def test_the_kernels_check_names_a_switched_on_module_that_never_ran(tmp_path: Path) -> None:
    record = tmp_path / "standins.json"
    record.write_text(json.dumps({"modules": ["vllm.corex_gdn_causal_conv"], "computed": {
        "vllm.corex_gdn_beta_decay.beta_decay": 3, "ixformer.functions.linear": 9}}))
    tiny = {"linear_key_head_dim": 32, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4}
    modules = [(f"vllm.{n}", _module(n)) for n in ("corex_gdn_causal_conv", "corex_gdn_beta_decay",
                                                   "corex_gdn_qk_map", "corex_paged_kv_gather",
                                                   "corex_moe_direct_routed")]
    check = kernels_check({}, modules, record, tiny, 2, "float16")
    assert not check.ok
    assert check.detail.startswith("switched on and never ran: corex_gdn_causal_conv (BI100_GDN_COREX_CAUSAL_CONV "
                                   "on, its guard met by the rehearsed model, imported, never called); called: "
                                   "corex_gdn_beta_decay x3")
    assert "corex_gdn_qk_map (its guard needs linear_key_head_dim 128 (here 32))" in check.detail
    assert "corex_paged_kv_gather (its guard needs a context over 32768 tokens)" in check.detail
    assert "switched off: corex_moe_direct_routed (BI100_MOE_COREX_DIRECT_ROUTED 0)" in check.detail
    off = kernels_check({"BI100_GDN_COREX_CAUSAL_CONV": "0"}, modules, record, tiny, 2, "float16")
    assert off.ok and "switched off: corex_gdn_causal_conv" in off.detail
    # served in bf16 nothing is reachable, and nothing is owed
    assert kernels_check({}, modules, record, tiny, 2, "bfloat16").ok


def test_a_recipe_of_another_architecture_installs_nothing_and_lint_says_so(cli, tmp_path: Path) -> None:
    data = flagship_data()
    data["hardware"]["device_arch"] = "ivcore11"
    data["patches"] = str(REPO / "patches" / "src")
    path = tmp_path / "r.yaml"
    path.write_text(recipe_text(data))
    assert load_recipe(path).recipe.kernel_modules() == []
    result = cli("lint", path, "--json")
    assert result.code == 2
    rules = [i["rule"] for i in result.json()["issues"] if i["severity"] == "error"]
    assert rules == ["kernel-artefact"] * 8  # the eight the base switches on (beta/decay and q/k stay off)


def test_a_guard_is_read_against_the_served_config_and_says_what_it_cannot_know() -> None:
    packed = _module("corex_gdn_packed_decode")
    served = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128}
    assert packed.unmet(served, 4, "float16") == []
    assert packed.unmet(served, 2, "float16") == ["linear_num_key_heads/tp 4 (here 8)",
                                                  "linear_num_value_heads/tp 8 (here 16)"]
    assert packed.unmet(served, 3, "bfloat16")[:2] == ["dtype float16 (here bfloat16)",
                                                       "linear_num_key_heads/tp 4 (here 16 over TP 3, not a whole "
                                                       "number per rank)"]
    assert packed.unmet({**served, "linear_key_head_dim": 128.0}, 4, "float16") == []
    assert "linear_value_head_dim 128 (the model's config has no linear_value_head_dim)" in packed.unmet(
        {k: v for k, v in served.items() if k != "linear_value_head_dim"}, 4, "float16")
    assert packed.step_conditions() == ["a step of exactly 1 token(s)"]


def test_a_manifest_in_binary_mode_reads_and_a_malformed_line_is_named(tmp_path: Path) -> None:
    from toolkit.transforms.kernels import read_manifest

    manifest = tmp_path / "SHA256SUMS"
    manifest.write_text(f"{'ab' * 32} *corex_a.so\n{'CD' * 32}  corex_b.so\n")
    assert read_manifest(manifest) == {"corex_a.so": ("ab" * 32, 1), "corex_b.so": ("cd" * 32, 2)}
    manifest.write_text(f"{'ab' * 32}  corex_a.so\n{'zz' * 32}  corex_b.so\n")
    with pytest.raises(ToolkitError, match=r"SHA256SUMS:2: not a sha256sum line for one artefact"):
        read_manifest(manifest)


def test_upgrade_to_commit_with_other_artefacts_is_a_conflict_naming_their_digests(tmp_path: Path,
                                                                                   capsys: Any) -> None:
    from toolkit.cli import main

    clone, pinned = make_repo(tmp_path)
    path = require(NEWEST_FILES) / BUNDLE / "corex_moe_exact_reduce.so"
    data = bytearray(path.read_bytes())
    data[-2] ^= 0x40
    rebuilt = add_commit(clone, f"{BUNDLE}/corex_moe_exact_reduce.so", bytes(data), "a rebuilt kernel")
    code = main(["upgrade", str(FLAGSHIP), "--source", f"qwen36-adapter={clone}@{rebuilt}", "--from", pinned,
                 "--json"])
    fates = {f["transform"]: f for f in json.loads(capsys.readouterr().out)["fates"]}
    assert code == 1
    assert {t for t, f in fates.items() if f["fate"] != "carries"} == {"adapter-corex-kernels"}
    kernels = fates["adapter-corex-kernels"]
    assert kernels["fate"] == "conflict" and kernels["detail"] == (
        f"the prebuilt artefacts changed: {BUNDLE}/corex_moe_exact_reduce.so (binary: sha256 d26f2fa39c39 -> "
        f"{hashlib.sha256(data).hexdigest()[:12]})")
    assert kernels["decide"].startswith("check the new manifest and set manifest_sha256")
