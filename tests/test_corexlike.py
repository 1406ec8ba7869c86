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


# DESIGN.md section 3, "More vendor edits on the serving path" and "Exact vendor text where it changes what runs":
# what the fixture must hold, in the image's own text where DESIGN quotes it (CR stripped)
SERVING_PATH = {
    # triton imported unconditionally (upstream: under `if HAS_TRITON:`), while importing.py says False
    "vllm/triton_utils/__init__.py": (["\nfrom vllm.triton_utils.custom_cache_manager import (",
                                       "\nfrom vllm.triton_utils.libentry import libentry"], ["if HAS_TRITON:"]),
    "vllm/triton_utils/importing.py": (["HAS_TRITON = False"], []),
    # so are fused_moe's kernels
    "vllm/model_executor/layers/fused_moe/__init__.py": ([
        "\n# if HAS_TRITON:\nfrom vllm.model_executor.layers.fused_moe.fused_marlin_moe import (\n",
        "\nfrom vllm.model_executor.layers.fused_moe.fused_moe import (\n    fused_experts, fused_moe,"],
        ["\nif HAS_TRITON:"]),
    # a failing pynvml means CUDA
    "vllm/platforms/__init__.py": (["        pynvml.nvmlShutdown()\nexcept Exception:\n    is_cuda = True\n"], []),
    # pynvml at module level, [9, 0] without NVML, 32 GiB, no device-name comparison at import
    "vllm/platforms/cuda.py": ([
        "\nimport pynvml\n",
        "\n@lru_cache(maxsize=8)\ndef get_physical_device_capability(device_id: int = 0) -> Tuple[int, int]:\n"
        "    return [9, 0]\n",
        "\n# @with_nvml_context\ndef get_physical_device_total_memory(",
        "\n# @with_nvml_context\ndef warn_if_different_devices(",
        "    def get_device_total_memory(cls, device_id: int = 0) -> int:\n        return 32 * 1024 * 1024 * 1024\n"
        "        # physical_device_id = device_id_to_physical_device_id(device_id)\n"
        "        # return get_physical_device_total_memory(physical_device_id)\n",
        "\nexcept ModuleNotFoundError:\n    pass\n    # warn_if_different_devices()\n"],
        ["\n    warn_if_different_devices()\n", "\n@with_nvml_context\ndef get_physical_device_capability"]),
    # the FLASH_ATTN branch imports the flash_attn backend without probing vllm_flash_attn first; no blocksparse
    # backend, no sliding-window fallback
    "vllm/attention/selector.py": ([
        "        try:\n            # import vllm_flash_attn  # noqa: F401\n\n"
        "            from vllm.attention.backends.flash_attn import (", "except ImportError:",
        "\n    # if is_blocksparse:\n    #     logger.info(\"Using BlocksparseFlashAttention backend.\")\n",
        "\n        # elif sliding_window is not None:\n"],
        ["\n            import vllm.vllm_flash_attn", "\n    if is_blocksparse:", "\n        elif sliding_window"]),
    "vllm/attention/backends/flash_attn.py": (["from ixformer.contrib.vllm_flash_attn import"], []),
    # the ops a served step calls, routed to ixformer.functions in its argument orders, in the image's text
    "vllm/_custom_ops.py": ([
        "\nsupports_moe_ops = True\n",
        "ixf_F.silu_and_mul(x, out)", "ixf_F.gelu_and_mul(x, out)", "ixf_F.gelu_tanh_and_mul(x, out)",
        'def gelu_fast(out: torch.Tensor, x: torch.Tensor) -> None:\n    out.copy_(F.gelu(x, approximate="tanh"))\n',
        'def gelu_new(out: torch.Tensor, x: torch.Tensor) -> None:\n    out.copy_(F.gelu(x, approximate="tanh"))\n',
        'def gelu_quick(out: torch.Tensor, x: torch.Tensor) -> None:\n    out.copy_(F.gelu(x, approximate="tanh"))\n',
        "def paged_attention_v1(\n        output,\n        query,\n        key_cache,\n        value_cache,\n"
        "        head_mapping,\n        scale,\n        block_tables,\n        context_lens,\n        block_size,\n"
        "        max_context_len,\n        alibi_slopes=None,\n        kv_cache_dtype=None,\n):\n"
        "    return ixf_F.vllm_single_query_cached_kv_attention(\n            output,\n            query,\n"
        "            key_cache,\n            value_cache,\n            head_mapping,\n            scale,\n"
        "            block_tables,\n            context_lens,\n            block_size,\n            max_context_len,\n"
        "            alibi_slopes,\n        )\n",
        "    blocksparse_head_sliding_step: int = 0,\n) -> None:\n    raise NotImplementedError()\n",
        "    v_scale: float,\n) -> None:\n    raise NotImplementedError()\n",
        "ixf_F.vllm_rotary_embedding_neox(positions, query, key, head_size,",
        "ixf_F.vllm_batched_rotary_embedding(positions, query, key, head_size,",
        "ixf_F.rms_norm(input, weight, out, epsilon)",
        "residual_alpha: Optional[float] = 1) -> None:\n"
        "    ixf_F.fused_add_rms_norm(input, residual, weight, epsilon)\n",
        "ixf_F.vllm_moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, "
        "num_tokens_post_pad)",
        "ixf_F.vllm_invoke_fused_moe_kernel(A, B, C, topk_weights, topk_ids, sorted_token_ids, expert_ids, "
        "num_tokens_post_padded, mul_routed_weight, top_k, config['BLOCK_SIZE_M'])",
        "ixf_F.vllm_moe_topk_softmax(topk_weights, topk_ids, token_expert_indicies, gating_output)",
        ") -> None:\n    slot_mapping = slot_mapping.to(torch.int32) \n"
        "    ixf_F.vllm_cache_ops_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)\n",
        "ixf_F.reshape_and_cache_flash(", "ixf_F.copy_blocks(", "ixf_F.swap_blocks(",
        "def get_max_shared_memory_per_block_device_attribute(device: int) -> int:\n    # ruff: noqa: E501\n"
        "    return 32 * 1024\n"],
        ["import vllm._C", "import vllm._rocm_C", "import vllm._moe_C", "torch.ops._C.silu_and_mul",
         "torch.ops._C.gelu_", "torch.ops._C.paged_attention_v1", "torch.ops._C.paged_attention_v2",
         "torch.ops._rocm_C.paged_attention", "torch.ops._C.rms_norm", "torch.ops._C.moe_align_block_size",
         "torch.ops._moe_C.topk_softmax", "torch.ops._C_cache_ops.reshape_and_cache",
         "torch.ops._C_cuda_utils.get_max_shared"]),
    # the dynamo cache sizes and execute_model's exception dump commented out
    "vllm/worker/model_runner.py": (["# torch._dynamo.config.cache_size_limit = 128",
                                     "# torch._dynamo.config.accumulated_cache_size_limit = 128",
                                     '    # @dump_input_when_exception(exclude_args=[0], exclude_kwargs=["self"])'],
                                    ["\ntorch._dynamo.config", '\n    @dump_input_when_exception']),
    # RMSNorm passes residual_alpha to the fused op; GemmaRMSNorm neither tests for a compile nor compiles
    "vllm/model_executor/layers/layernorm.py": ([
        "        residual: Optional[torch.Tensor] = None,\n        residual_alpha: Optional[float] = 1.0,\n",
        "                self.variance_epsilon,\n                residual_alpha,\n            )\n",
        "\n        # if torch.compiler.is_compiling():\n        #     return self.forward_native(x, residual)\n",
        "\n        # if not getattr(self, \"_is_compiled\", False):\n"
        "        #     self.forward_static = torch.compile(",
        "        #     self._is_compiled = True\n        return self.forward_native(x, residual)\n"],
        ["\n        if torch.compiler.is_compiling():", "\n            self.forward_static = torch.compile("]),
    # ixformer's xops and masks in the image's import order, a head_mapping built last in __init__ for the decode,
    # the GQA expansion commented out, the flash op set before the prefill's call
    "vllm/attention/backends/xformers.py": ([
        "\nimport torch\n# from xformers import ops as xops\nfrom ixformer.contrib.xformers import ops as xops\n"
        "from xformers.ops.fmha.attn_bias import (AttentionBias,\n",
        "BlockDiagonalMask,)\nfrom ixformer.contrib.xformers.ops.fmha.attn_bias import (BlockDiagonalCausalMask,\n",
        "LowerTriangularMaskWithTensorBias)\n\n",
        "f\"Supported head sizes are: {suppored_head_sizes}.\")\n        self.head_mapping = "
        "torch.repeat_interleave(torch.arange(self.num_kv_heads, dtype=torch.int32), self.num_queries_per_kv)\n\n"
        "    def forward(",
        "                self.kv_cache_dtype,\n                self.head_mapping,\n                self.scale,",
        "\n        # if self.num_kv_heads != self.num_heads:\n"
        "        #     # GQA/MQA requires the shape [B, M, G, H, K].\n",
        "        self.attn_op = xops.fmha.flash.FwOp()\n        if self.alibi_slopes is None:\n",
        "scale=self.scale,\n                op = self.attn_op)"],
        ["\n        if self.num_kv_heads != self.num_heads:", "\n            key = key[:, :,", "self.kv_cache_dtype,\n"
         "                self.num_kv_heads,", "op=xops.fmha.flash.FwOp()"]),
    # the TP group: no PyNccl, a multi-node flag; the all-reduce's ixformer branch in _all_reduce_in_place, with
    # upstream's all_reduce() reaching it
    "vllm/distributed/parallel_state.py": ([
        "\nfrom ixformer.distributed import all_reduce\n", "\nimport vllm._custom_ops as ops\n",
        "        group_name: Optional[str] = None,\n        world_size: Optional[str] = None,\n    ):\n"
        "        use_pynccl = False # we do not use pynccl\n",
        "        self.is_multi_node = False if world_size is None else bool(world_size > torch.cuda.device_count())\n",
        "        if not supports_custom_op():\n            self._all_reduce_in_place(input_)\n"
        "            return input_\n",
        "torch.ops.vllm.inplace_all_reduce(input_,",
        "    def _all_reduce_in_place(self, input_: torch.Tensor) -> None:\n"
        "        pynccl_comm = self.pynccl_comm\n"
        "        if (pynccl_comm is not None and not pynccl_comm.disabled):\n"
        "            pynccl_comm.all_reduce(input_)\n"
        "        elif input_.is_cpu:\n"
        "            import intel_extension_for_pytorch as ipex\n"
        "            ipex.distributed.all_reduce(input_, group=self.device_group)\n"
        "        else:\n",
        "            from ixformer.contrib.torch.extension.ixformer_torch.distributed import "
        "create_ixformer_group_from_pg\n"
        "            _IXFORMER_TENSOR_MODEL_PARALLEL_GROUP = create_ixformer_group_from_pg(self.device_group)\n"
        "            all_reduce(input_, group=_IXFORMER_TENSOR_MODEL_PARALLEL_GROUP, async_op=True)\n"
        "        return input_\n"],
        ["ixformer_group = create_ixformer_group_from_pg", "\n            torch.distributed.all_reduce(input_, "
         "group=self.device_group)"]),
    # F is ixformer's, and three token counts take torch's matmul
    "vllm/model_executor/layers/linear.py": ([
        "\nimport torch\n#import ixformer.inference.functions as F\nimport ixformer.functions as F\n",
        "        if (x.shape[0] == 8192 or x.shape[0] == 16384 or x.shape[0] == 15360):\n"
        "            if bias is None:\n                return x @ layer.weight.T\n            else:\n"
        "                return x @ layer.weight.T + bias\n        return F.linear(x, layer.weight, bias)\n"],
        ["\nimport torch.nn.functional as F\n"]),
    # the LM head's matmul is ixformer's; the masked-input helper is not scripted
    "vllm/model_executor/layers/vocab_parallel_embedding.py": ([
        "return IXF.linear(x, layer.weight, bias)", "\n# @torch.jit.script\ndef get_masked_input_and_mask("],
        ["return F.linear(x, layer.weight, bias)", "\n@torch.jit.script"]),
    # zero hidden rows: an empty [0, the rank's LM-head shard] tensor, no LM head call (in forward)
    "vllm/model_executor/layers/logits_processor.py": ([
        "sampling_metadata)\n\n            # Get the logits for the next tokens.\n"
        "            if hidden_states.shape[0] > 0:\n"
        "                logits = self._get_logits(hidden_states, lm_head, embedding_bias)\n"
        "            else:\n"
        "                logits = torch.empty([0, lm_head.weight.shape[0]], device=hidden_states.device, "
        "dtype=hidden_states.dtype)\n"],
        ["self.vocab_size),", "if hidden_states.shape[0] == 0:"]),
    # CoreX's added models and quantization method
    "vllm/model_executor/models/registry.py": ([
        '"Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),', '"Qwen2_5_VLForConditionalGeneration": (',
        '"Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),'], []),
    "vllm/model_executor/layers/quantization/__init__.py": ([
        "\nfrom vllm.model_executor.layers.quantization.w8a16 import W8a16Config\n", '\n    "w8a16": W8a16Config,\n',
        '\n    # "gptq_marlin": GPTQMarlinConfig,\n'], ['\n    "gptq_marlin": GPTQMarlinConfig,']),
    "vllm/model_executor/layers/quantization/w8a16.py": (["\nclass W8a16Config("], []),
    # multiprocessing workers start with spawn (upstream fork)
    "vllm/envs.py": (['VLLM_WORKER_MULTIPROC_METHOD: str = "spawn"',
                      'os.getenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")'], ['"fork"']),
}
# the image's files that end without a newline (DESIGN.md counts 15 and names these)
NO_FINAL_NEWLINE = ("vllm/_custom_ops.py", "vllm/attention/backends/xformers.py",
                    "vllm/model_executor/models/registry.py", "vllm/engine/async_llm_engine.py",
                    "vllm/model_executor/layers/fused_moe/layer.py")


@pytest.mark.parametrize("rel", sorted(SERVING_PATH))
def test_the_fixture_has_the_vendors_serving_path_edits(corex_template: Path, rel: str) -> None:
    present, absent = SERVING_PATH[rel]
    for root in roots_of(corex_template):
        text = (root / rel).read_text(encoding="utf-8").replace("\r\n", "\n")
        missing = [p for p in present if p not in text]
        found = [a for a in absent if a in text]
        assert (missing, found) == ([], []), rel
        compile(text, rel, "exec")  # each still a module that imports


def test_the_fixture_ends_files_as_the_image_does(corex_template: Path) -> None:
    for root in roots_of(corex_template):
        for rel in NO_FINAL_NEWLINE:
            data = (root / rel).read_bytes()
            assert data.rstrip() == data and b"\r\n" in data, rel
        # and the others still end with one (CRLF, as every line)
        for rel in ("vllm/__init__.py", "vllm/attention/ops/paged_attn.py", "vllm/distributed/parallel_state.py"):
            assert (root / rel).read_bytes().endswith(b"\r\n"), rel


def test_a_files_imports_are_found_wherever_a_statement_can_hold_one() -> None:
    """`vendor compare` reads a vendor library from any import statement, however deep: the ixformer imports of the
    real image sit in try blocks and functions (DESIGN.md section 3)."""
    from toolkit.compare import _top_imports

    source = b'''
import a.sub, b as bee
from c.d import e
from . import relative
from .local import thing
def f():
    import in_function
    class K:
        from in_class import x
try:
    import in_try
except ImportError:
    import in_handler
else:
    import in_else
finally:
    import in_finally
if x:
    import in_if
else:
    import in_if_else
while x:
    import in_while
for y in z:
    import in_for
with m:
    import in_with
async def g():
    async with m:
        import in_async_with
    async for y in z:
        import in_async_for
match v:
    case 1:
        import in_case
s = "import not_a_statement"
'''
    assert _top_imports(source) == {"a", "b", "c", "in_function", "in_class", "in_try", "in_handler", "in_else",
                                    "in_finally", "in_if", "in_if_else", "in_while", "in_for", "in_with",
                                    "in_async_with", "in_async_for", "in_case"}
    assert _top_imports(b"def broken(:\n") == frozenset()
