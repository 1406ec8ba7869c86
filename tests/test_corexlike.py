"""The CoreX-like fixture is only worth what it shares with the real image (../shared/DESIGN.md section 3,
../shared/ADAPTER.md section 7), and `toolkit vendor compare` finds the base it was built on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import FLAGSHIP, REPO, flagship_data, roots_of

from toolkit.corexlike import COREX_DROPS, COREX_ONLY, VENDOR_EDITS
from toolkit.recipe import load_recipe
from toolkit.transforms.deploy import Deploy, lf_digest

# ADAPTER.md section 7: the sha256 (LF-normalised) of the nine files the adapter replaces, in the real image
REAL_IMAGE = {
    "vllm/attention/ops/paged_attn.py": "86399eb986001cfdfc2c8db174c13bd177af490b5023fa8f94bef9ce2320d9f1",
    "vllm/model_executor/models/mamba_cache.py": "e8c4f8e2019eb2a5e438febba5aef83e52dc52eed69b88848d76a1478ed15942",
    "vllm/sequence.py": "676938ba1175d9280dd1a1149bfd67fa068ff756c34bc96c52ad1fefc3ce97c2",
    "vllm/core/scheduler.py": "99cfe49101dec65171b98ff24f8e8c098ac217e9a493d10fdacea4d5111f0bcf",
    "vllm/entrypoints/openai/protocol.py": "9229c5cd3da7a44c526245e7fecef3aaf28cd9ccd9e89582fbd4a641bdc75f02",
    "vllm/entrypoints/openai/cli_args.py": "154ea8b20e14dba71d6a8e7f4eb6cd977d4de93d3d70fb77ea10921cd87ba7ec",
    "vllm/entrypoints/openai/serving_chat.py": "f84a863aed8ff31c602a90f7dae7b5c52fff7cc868fe9ad83ff95e56f7d216c2",
    "vllm/entrypoints/openai/api_server.py": "88f01e152ef422f2a14c714fa5a0a6c79d592f0c4fce87d95a302aa810bb2351",
    "vllm/entrypoints/chat_utils.py": "685c08fc78874baf19ece2c3c972a7a66e131833c31ec697d6505f0387965e12",
}
# DESIGN.md section 3: the vendor's GPU libraries, imported at module level by these six modules
VENDOR_IMPORTS = {
    "vllm/_custom_ops.py": ("import ixformer.functions as ixf_F", "from ixformer.distributed import _distributed"),
    "vllm/distributed/parallel_state.py": ("from ixformer.distributed import all_reduce",
                                           "import ixformer.distributed as ixfd"),
    "vllm/model_executor/layers/linear.py": ("import ixformer.functions as F",),
    "vllm/model_executor/layers/vocab_parallel_embedding.py": ("import ixformer.functions as IXF",),
    "vllm/attention/backends/xformers.py": ("from ixformer.contrib.xformers import ops as xops",
                                            "from ixformer.contrib.xformers.ops.fmha.attn_bias import",
                                            "from xformers.ops.fmha.attn_bias import (AttentionBias"),
    "vllm/attention/backends/flash_attn.py": ("from ixformer.contrib.vllm_flash_attn import",),
}


def test_the_replaced_files_carry_the_real_images_digests(corex_template: Path) -> None:
    for root in roots_of(corex_template):
        got = {rel: lf_digest((root / rel).read_bytes()) for rel in REAL_IMAGE}
        assert got == REAL_IMAGE
    # and they are what the flagship's replacement contracts expect: no --expect swap on the fixture
    recipe = load_recipe(FLAGSHIP).recipe
    contracts = {t.dest: t.replaces for t in recipe.transforms if isinstance(t, Deploy) and t.replaces}
    assert contracts == REAL_IMAGE


def test_the_fixture_is_as_unfriendly_as_the_image(corex_template: Path) -> None:
    root = roots_of(corex_template)[0]
    for rel, lines in VENDOR_IMPORTS.items():
        text = (root / rel).read_text(encoding="utf-8")
        for line in lines:
            assert line in text, (rel, line)
    # every Python file is stored with CRLF, as in the copies of the vendor tree people work from
    sample = [root / rel for rel in (*VENDOR_IMPORTS, *REAL_IMAGE, "vllm/__init__.py")]
    assert all(b"\r\n" in p.read_bytes() and b"\n" not in p.read_bytes().replace(b"\r\n", b"") for p in sample)
    for rel in COREX_ONLY:
        assert (root / rel).is_file(), rel
    for rel in COREX_DROPS:
        assert not (root / rel).exists(), rel
    assert (root / "vllm-0.6.3+corex.3.2.3.dist-info" / "METADATA").is_file()


def test_vendor_compare_names_063_and_exactly_the_files_the_fixture_changed(corex_template: Path,
                                                                           tmp_path: Path, capsys) -> None:
    from toolkit.cli import main

    capsys.readouterr()
    code = main(["vendor", "compare", str(FLAGSHIP), "--rootfs", str(corex_template), "--json"])
    out = capsys.readouterr().out
    assert code == 0
    report = json.loads(out)
    assert report["closest"] == "vllm==0.6.3"
    by = {c["candidate"]: c for c in report["candidates"]}
    assert set(by) == {"vllm==0.6.2", "vllm==0.6.3", "vllm==0.6.3.post1"}
    base = by["vllm==0.6.3"]
    changed = {e.file for e in VENDOR_EDITS}
    assert {f["file"] for f in base["files"]} == changed
    assert set(base["only_vendor"]) == set(COREX_ONLY)
    assert base["only_upstream"] == sorted(f"{d}/{n}" for d in COREX_DROPS
                                           for n in ("__init__.py", "flash_attn_interface.py"))
    assert base["identical"] > by["vllm==0.6.3.post1"]["identical"] > by["vllm==0.6.2"]["identical"]
    imports = {f["file"]: f["vendor_imports"] for f in base["files"]}
    assert all("ixformer" in imports[rel] for rel in VENDOR_IMPORTS)
    assert "ixformer" in report["vendor_libraries"] and report["undeclared_gpu_libraries"] == []
    assert any("vendor.reference" in n and "is the closest candidate" in n for n in report["notes"])
    # a recipe that still says 0.6.3.post1 is told which release to name, here and by lint --rootfs
    data = flagship_data()
    data["patches"] = str(REPO / "patches/src")
    data["vendor"]["reference"] = "vllm==0.6.3.post1"
    data["base_image"]["gpu_libraries"] = ["xformers"]
    stale = tmp_path / "stale.yaml"
    stale.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["vendor", "compare", str(stale), "--rootfs", str(corex_template), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["closest"] == "vllm==0.6.3" and report["undeclared_gpu_libraries"] == ["ixformer"]
    assert any("not the closest: set it to vllm==0.6.3" in n for n in report["notes"])
    main(["lint", str(stale), "--rootfs", str(corex_template), "--json"])
    issues = [i for i in json.loads(capsys.readouterr().out)["issues"] if i["rule"] == "vendor-base"]
    assert len(issues) == 1 and "closest to vllm==0.6.3" in issues[0]["message"]
    main(["lint", str(FLAGSHIP), "--rootfs", str(corex_template), "--json"])
    assert not [i for i in json.loads(capsys.readouterr().out)["issues"] if i["rule"] == "vendor-base"]


def test_vendor_compare_takes_a_bare_package_copy_and_refuses_no_tree(corex_template: Path, tmp_path: Path,
                                                                     capsys) -> None:
    from toolkit.cli import main

    vllm = roots_of(corex_template)[0] / "vllm"
    capsys.readouterr()
    assert main(["vendor", "compare", str(FLAGSHIP), "--root", str(vllm), "--candidates", "vllm==0.6.3",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["closest"] == "vllm==0.6.3"
    assert main(["vendor", "compare", str(FLAGSHIP), "--root", str(tmp_path), "--json"]) == 2
    error = json.loads(capsys.readouterr().out)
    assert f"no vllm/ package in {tmp_path}" in error["error"]
    assert main(["vendor", "compare", str(FLAGSHIP), "--json"]) == 2
    assert "--rootfs DIR or as --root DIR" in json.loads(capsys.readouterr().out)["error"]


# DESIGN.md section 3, "More vendor edits on the serving path": what the fixture must hold, each against the fact
SERVING_PATH = {
    # triton imported unconditionally (upstream: under `if HAS_TRITON:`), while importing.py says False
    "vllm/triton_utils/__init__.py": (["\nfrom vllm.triton_utils.custom_cache_manager import (",
                                       "\nfrom vllm.triton_utils.libentry import libentry"], ["if HAS_TRITON:"]),
    "vllm/triton_utils/importing.py": (["HAS_TRITON = False"], []),
    # a failing pynvml means CUDA
    "vllm/platforms/__init__.py": (["        pynvml.nvmlShutdown()\nexcept Exception:\n    is_cuda = True\n"], []),
    # pynvml at module level, [9, 0], 32 GiB, no device-name comparison at import
    "vllm/platforms/cuda.py": (["\nimport pynvml\n", "return DeviceCapability(major=9, minor=0)",
                                "return 32 * 1024**3"], ["\n    warn_if_different_devices()\n"]),
    # the FLASH_ATTN branch imports the flash_attn backend without probing vllm_flash_attn first
    "vllm/attention/selector.py": (["# import vllm.vllm_flash_attn", "from vllm.attention.backends.flash_attn import",
                                    "except ImportError:"], ["\n            import vllm.vllm_flash_attn"]),
    "vllm/attention/backends/flash_attn.py": (["from ixformer.contrib.vllm_flash_attn import"], []),
    # the ops a served step calls, routed to ixformer.functions in its argument orders
    "vllm/_custom_ops.py": ([
        "ixf_F.silu_and_mul(x, out)", "ixf_F.gelu_and_mul(x, out)", "ixf_F.gelu_tanh_and_mul(x, out)",
        "    head_mapping: torch.Tensor,\n", "ixf_F.vllm_single_query_cached_kv_attention(\n        output, query, "
        "key_cache, value_cache, head_mapping, scale, block_tables,\n        context_lens, block_size, "
        "max_context_len, alibi_slopes)", 'raise NotImplementedError("paged_attention_v2',
        "ixf_F.vllm_rotary_embedding_neox(positions, query, key, head_size,", "ixf_F.rms_norm(input, weight, out, "
        "epsilon)", "residual_alpha: float = 1) -> None:\n    ixf_F.fused_add_rms_norm(input, residual, weight, "
        "epsilon)", "ixf_F.vllm_cache_ops_reshape_and_cache(key, value, key_cache, value_cache,",
        "slot_mapping.to(torch.int32))", "ixf_F.copy_blocks(", "ixf_F.swap_blocks("],
        ["torch.ops._C.silu_and_mul", "torch.ops._C.paged_attention_v1", "torch.ops._C.rms_norm",
         "torch.ops._C_cache_ops.reshape_and_cache("]),
    # the dynamo cache sizes and execute_model's exception dump commented out
    "vllm/worker/model_runner.py": (["# torch._dynamo.config.cache_size_limit = 128",
                                     "# torch._dynamo.config.accumulated_cache_size_limit = 128",
                                     '    # @dump_input_when_exception(exclude_args=[0], exclude_kwargs=["self"])'],
                                    ["\ntorch._dynamo.config", '\n    @dump_input_when_exception']),
    # GemmaRMSNorm's forward_static is not compiled
    "vllm/model_executor/layers/layernorm.py": ([], ["torch.compile("]),
    # ixformer's xops and masks, a head_mapping for the decode, no GQA expansion, the flash op for the prefill
    "vllm/attention/backends/xformers.py": ([
        "\nfrom ixformer.contrib.xformers import ops as xops\n",
        "from ixformer.contrib.xformers.ops.fmha.attn_bias import (BlockDiagonalCausalMask,",
        "from xformers.ops.fmha.attn_bias import (AttentionBias, )",
        "self.head_mapping = torch.repeat_interleave(\n            torch.arange(self.num_kv_heads, "
        "dtype=torch.int32), self.num_queries_per_kv)",
        "                self.kv_cache_dtype,\n                self.head_mapping,\n                self.scale,",
        "scale=self.scale,\n                op=xops.fmha.flash.FwOp())"],
        ["GQA/MQA requires the shape", ".expand(key.shape[0], self.num_kv_heads", "self.kv_cache_dtype,\n"
         "                self.num_kv_heads,"]),
    # the TP all-reduce: ixformer's, on a group built from the device group, in place, not waited on
    "vllm/distributed/parallel_state.py": ([
        "\nfrom ixformer.distributed import all_reduce\n",
        "ixformer_group = create_ixformer_group_from_pg(self.device_group)\n"
        "        all_reduce(input_, group=ixformer_group, async_op=True)\n        return input_\n"],
        ["torch.ops.vllm.inplace_all_reduce(input_,"]),
    "vllm/model_executor/layers/linear.py": (["\nimport ixformer.functions as F\n"], []),
    # the LM head's matmul is ixformer's
    "vllm/model_executor/layers/vocab_parallel_embedding.py": (["return IXF.linear(x, layer.weight, bias)"],
                                                               ["return F.linear(x, layer.weight, bias)"]),
    # zero hidden rows: an empty [0, vocab] tensor, no LM head call
    "vllm/model_executor/layers/logits_processor.py": (["if hidden_states.shape[0] == 0:\n            return "
                                                        "torch.empty((0, self.vocab_size),"], []),
    # multiprocessing workers start with spawn (upstream fork)
    "vllm/envs.py": (['VLLM_WORKER_MULTIPROC_METHOD: str = "spawn"',
                      'os.getenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")'], ['"fork"']),
}


@pytest.mark.parametrize("rel", sorted(SERVING_PATH))
def test_the_fixture_has_the_vendors_serving_path_edits(corex_template: Path, rel: str) -> None:
    present, absent = SERVING_PATH[rel]
    for root in roots_of(corex_template):
        text = (root / rel).read_text(encoding="utf-8").replace("\r\n", "\n")
        missing = [p for p in present if p not in text]
        found = [a for a in absent if a in text]
        assert (missing, found) == ([], []), rel
        compile(text, rel, "exec")  # each still a module that imports
