"""A CoreX-like vendor tree made from a public vLLM release: what the build's trial, the tests and the benchmarks
apply recipes to when the vendor image is not at hand.

The vendor image cannot be fetched here, so its documented differences (DESIGN.md section 3, measured on a copy
of the image's tree) are rebuilt on top of its true base, vLLM 0.6.3: the hard-coded flags, the paged attention
and API-server edits, the registry entries, the module-level imports of the vendor's GPU libraries (ixformer,
xformers) in the six modules that have them, the model files CoreX adds, no `vllm_flash_attn/`, and CRLF line
endings as in the copies people work from. The edits are plain text replacements on purpose: they stand in for
the vendor's own hand edits, in the image's own text wherever DESIGN.md quotes it ("Exact vendor text where it
changes what runs"), and each one checks its match count so a changed upstream release fails loudly here.
With them, the nine files the adapter replaces carry exactly the real image's digests (../shared/ADAPTER.md
section 7; `tests/test_corexlike.py` holds them to it).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import NamedTuple

COREX_VERSION = "0.6.3+corex.3.2.3"
COREX_BASE = "vllm==0.6.3"  # the vendor's true base release (DESIGN.md section 3)
COREX_ROOTS = (
    "/usr/local/corex/lib/python3/dist-packages",
    "/usr/local/corex/lib64/python3/dist-packages",
)
# the image's GPU-only libraries the tree imports at module level (what base_image.gpu_libraries declares)
GPU_LIBRARIES = ("ixformer", "xformers")


class VendorEdit(NamedTuple):
    file: str
    pattern: str
    replacement: str
    matches: int = 1  # how many times the pattern must match in the upstream file


# the vendor changes of DESIGN.md section 3, on vLLM 0.6.3
DOCUMENTED_EDITS: tuple[VendorEdit, ...] = (
    VendorEdit("vllm/engine/arg_utils.py", r"enforce_eager=self\.enforce_eager,", "enforce_eager=True,"),
    VendorEdit("vllm/engine/arg_utils.py", r"disable_custom_all_reduce=self\.disable_custom_all_reduce,",
               "disable_custom_all_reduce=True,"),
    # the blank line after the V1/V2 heuristic becomes a forced V1
    VendorEdit("vllm/attention/ops/paged_attn.py",
               r"(\n(\s+)use_v1 = \(max_seq_len <= 8192\n\s+and \(max_num_partitions == 1 or num_seqs \* num_heads "
               r"> 512\)\)\n)\n", r"\1\2use_v1 = True\n"),
    # ixformer's paged_attention_v1 takes no kv_cache_dtype ... blocksparse_head_sliding_step
    VendorEdit("vllm/attention/ops/paged_attn.py",
               r"(ops\.paged_attention_v1\((?:\n\s+\w+,){11})(?:\n\s+\w+,){8}", r"\1"),
    VendorEdit("vllm/triton_utils/importing.py", r"HAS_TRITON = find_spec\(\"triton\"\) is not None",
               "HAS_TRITON = False"),
    VendorEdit("vllm/model_executor/models/registry.py",
               r'(\n(\s+)"Qwen2MoeForCausalLM": \("qwen2_moe", "Qwen2MoeForCausalLM"\),\n)',
               r'\1\2"Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),\n'
               r'\2"Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),\n'),
    # CoreX's other added models (DESIGN.md section 3, "Exact vendor text"); where in the dicts is not recorded:
    # beside their relatives
    VendorEdit("vllm/model_executor/models/registry.py",
               r'(\n(\s+)"Gemma2ForCausalLM": \("gemma2", "Gemma2ForCausalLM"\),\n)',
               r'\1\2"Glm4ForCausalLM": ("glm4", "Glm4ForCausalLM"),\n'),
    VendorEdit("vllm/model_executor/models/registry.py",
               r'(\n(\s+)"Qwen2VLForConditionalGeneration": \("qwen2_vl", "Qwen2VLForConditionalGeneration"\),  '
               r'# noqa: E501\n)',
               r'\1\2"Qwen2_5_VLForConditionalGeneration": ("qwen2_5_vl", "Qwen2_5_VLForConditionalGeneration"),  '
               r'# noqa: E501\n'),
    # CoreX's w8a16 method is registered, and gptq_marlin is not (commented out in the registry)
    VendorEdit("vllm/model_executor/layers/quantization/__init__.py",
               r"(\nfrom vllm\.model_executor\.layers\.quantization\.tpu_int8 import Int8TpuConfig\n)",
               r"\1from vllm.model_executor.layers.quantization.w8a16 import W8a16Config\n"),
    VendorEdit("vllm/model_executor/layers/quantization/__init__.py",
               r'\n    "gptq_marlin": GPTQMarlinConfig,\n', '\n    # "gptq_marlin": GPTQMarlinConfig,\n'),
    VendorEdit("vllm/model_executor/layers/quantization/__init__.py", r'(\n    "ipex": IPEXConfig,\n)',
               r'\1    "w8a16": W8a16Config,\n'),
    VendorEdit("vllm/entrypoints/openai/api_server.py", r"\nimport re\n", r"\nimport regex as re\n"),
    VendorEdit("vllm/entrypoints/chat_utils.py", r'if model_type == "qwen2_vl":',
               r'if model_type in ("qwen2_vl","qwen2_5_vl"):', matches=2),
    # the vendor's GPU libraries, imported at module level as in the image (and inside _all_reduce_in_place);
    # _custom_ops' gelu_fast/new/quick use F.gelu (which F the image imports is not recorded: torch's)
    VendorEdit("vllm/_custom_ops.py", r"(\nfrom vllm\.platforms import current_platform\n)",
               r"\1import ixformer.functions as ixf_F\nfrom ixformer.distributed import _distributed as cdist\n"
               r"import torch.nn.functional as F\n"),
    VendorEdit("vllm/distributed/parallel_state.py", r"(\nfrom vllm\.utils import supports_custom_op\n)",
               r"\1import vllm._custom_ops as ops\nfrom ixformer.distributed import all_reduce\n"
               r"import ixformer.distributed as ixfd\n"),
    # the forward's F is ixformer's in the image, imported under the vendor's earlier (commented) path
    VendorEdit("vllm/model_executor/layers/linear.py", r"\nimport torch\.nn\.functional as F\n",
               "\n#import ixformer.inference.functions as F\nimport ixformer.functions as F\n"),
    VendorEdit("vllm/model_executor/layers/vocab_parallel_embedding.py", r"(\nimport torch\.nn\.functional as F\n)",
               r"\1import ixformer.functions as IXF\n"),
    # in the image's order: xformers' ops commented out, ixformer's, then the masks split between the two
    VendorEdit("vllm/attention/backends/xformers.py",
               r"\nfrom xformers import ops as xops\nfrom xformers\.ops\.fmha\.attn_bias import \(AttentionBias,\n"
               r"\s+BlockDiagonalCausalMask,\n\s+BlockDiagonalMask,\n\s+LowerTriangularMaskWithTensorBias\)\n",
               "\n# from xformers import ops as xops\n"
               "from ixformer.contrib.xformers import ops as xops\n"
               "from xformers.ops.fmha.attn_bias import (AttentionBias,\n"
               "                                         BlockDiagonalMask,)\n"
               "from ixformer.contrib.xformers.ops.fmha.attn_bias import (BlockDiagonalCausalMask,\n"
               "                                                          LowerTriangularMaskWithTensorBias)\n"),
    VendorEdit("vllm/attention/backends/flash_attn.py",
               r"\nfrom vllm\.vllm_flash_attn import \(flash_attn_varlen_func,\n\s+flash_attn_with_kvcache\)\n",
               "\nfrom ixformer.contrib.vllm_flash_attn import (flash_attn_varlen_func as _flash_attn_varlen_func,\n"
               "                                              flash_attn_with_kvcache as _flash_attn_with_kvcache)\n"
               "flash_attn_varlen_func = _flash_attn_varlen_func\n"
               "flash_attn_with_kvcache = _flash_attn_with_kvcache\n"),
)
# the vendor edits on the serving path (DESIGN.md section 3, "More vendor edits on the serving path", in the text
# "Exact vendor text where it changes what runs" quotes where it quotes it)
SERVING_PATH_EDITS: tuple[VendorEdit, ...] = (
    # triton's cache manager and libentry imported unconditionally (upstream: under `if HAS_TRITON:`)
    VendorEdit("vllm/triton_utils/__init__.py",
               r"if HAS_TRITON:\n\n    (from vllm\.triton_utils\.custom_cache_manager import \()\n        "
               r"(maybe_set_triton_cache_manager\))\n    (from vllm\.triton_utils\.libentry import libentry)\n\n    "
               r"(__all__ \+= \[\"maybe_set_triton_cache_manager\", \"libentry\"\])\n",
               r"\1\n    \2\n\3\n\n\4\n"),
    # so are fused_moe's marlin and triton kernels (the image ships triton; HAS_TRITON says False)
    VendorEdit("vllm/model_executor/layers/fused_moe/__init__.py",
               r"\nif HAS_TRITON:\n    (from vllm\.model_executor\.layers\.fused_moe\.fused_marlin_moe import \(\n)"
               r"        (fused_marlin_moe, single_marlin_moe\)\n)    (from vllm\.model_executor\.layers\.fused_moe\."
               r"fused_moe import \(\n)        (fused_experts, fused_moe, fused_topk, get_config_file_name,\n)"
               r"        (grouped_topk\)\n)\n    __all__ \+= \[\n((?:        \"\w+\",\n)+)    \]\n",
               "\n# if HAS_TRITON:\n\\1    \\2\\3    \\4    \\5\n__all__ += [\n    \"fused_marlin_moe\",\n"
               "    \"single_marlin_moe\",\n    \"fused_moe\",\n    \"fused_topk\",\n    \"fused_experts\",\n"
               "    \"get_config_file_name\",\n    \"grouped_topk\",\n]\n"),
    # a failing pynvml means CUDA (upstream: nothing)
    VendorEdit("vllm/platforms/__init__.py",
               r"(\n        pynvml\.nvmlShutdown\(\)\nexcept Exception:\n)    pass\n", r"\1    is_cuda = True\n"),
    # the CUDA platform: capability [9, 0] without NVML, 32 GiB whatever the device says, and no device-name
    # comparison at import (the sphinx probe stays, its fallback is `pass`)
    VendorEdit("vllm/platforms/cuda.py",
               r"@lru_cache\(maxsize=8\)\n@with_nvml_context\n(def get_physical_device_capability\(device_id: int = "
               r"0\) -> Tuple\[int, int\]:\n)    handle = pynvml\.nvmlDeviceGetHandleByIndex\(device_id\)\n    return "
               r"pynvml\.nvmlDeviceGetCudaComputeCapability\(handle\)\n",
               "@lru_cache(maxsize=8)\n\\1    return [9, 0]\n"),
    VendorEdit("vllm/platforms/cuda.py",
               r"\n@with_nvml_context\n(def (?:get_physical_device_total_memory|warn_if_different_devices)\()",
               r"\n# @with_nvml_context\n\1", matches=2),
    VendorEdit("vllm/platforms/cuda.py",
               r"\n        (physical_device_id = device_id_to_physical_device_id\(device_id\)\n)        (return "
               r"get_physical_device_total_memory\(physical_device_id\)\n)",
               r"\n        return 32 * 1024 * 1024 * 1024\n        # \1        # \2"),
    VendorEdit("vllm/platforms/cuda.py",
               r"(\nexcept ModuleNotFoundError:\n)    warn_if_different_devices\(\)\n",
               r"\1    pass\n    # warn_if_different_devices()\n"),
    # the FLASH_ATTN branch no longer probes vllm_flash_attn: it imports the flash_attn backend, whose module
    # level imports ixformer.contrib.vllm_flash_attn, and takes XFORMERS only on ImportError; no blocksparse
    # backend and no sliding-window fallback
    VendorEdit("vllm/attention/selector.py", r"\n            import vllm\.vllm_flash_attn  # noqa: F401\n",
               "\n            # import vllm_flash_attn  # noqa: F401\n\n"),
    VendorEdit("vllm/attention/selector.py",
               r"\n    if is_blocksparse:\n        logger\.info\(\"Using BlocksparseFlashAttention backend\.\"\)\n"
               r"        "
               r"from vllm\.attention\.backends\.blocksparse_attn import \(\n            "
               r"BlocksparseFlashAttentionBackend\)\n        return BlocksparseFlashAttentionBackend\n",
               "\n    # if is_blocksparse:\n    #     logger.info(\"Using BlocksparseFlashAttention backend.\")\n"
               "    #     from vllm.attention.backends.blocksparse_attn import (\n"
               "    #         BlocksparseFlashAttentionBackend)\n    #     return BlocksparseFlashAttentionBackend\n"),
    VendorEdit("vllm/attention/selector.py",
               r"\n        elif sliding_window is not None:\n            logger\.info\(\n                \"Cannot use "
               r"FlashAttention-2 backend due to sliding window\.\"\)\n"
               r"            selected_backend = _Backend\.XFORMERS\n",
               "\n        # elif sliding_window is not None:\n        #     logger.info(\n"
               "        #         \"Cannot use FlashAttention-2 backend due to sliding window.\")\n"
               "        #     selected_backend = _Backend.XFORMERS\n"),
    # _custom_ops: no vllm._C, _rocm_C or _moe_C import; the MoE ops are said to be there
    VendorEdit("vllm/_custom_ops.py",
               r"\nif not current_platform\.is_tpu\(\):\n    try:\n        import vllm\._C\n"
               r"    except ImportError as e:\n"
               r"        logger\.warning\(\"Failed to import from vllm\._C with %r\", e\)\n\nif current_platform\."
               r"is_rocm\(\):\n    import vllm\._rocm_C  # noqa: F401\n\nsupports_moe_ops = False\nwith contextlib\."
               r"suppress\(ImportError\):\n    import vllm\._moe_C  # noqa: F401\n    supports_moe_ops = True\n",
               "\nsupports_moe_ops = True\n"),
    # the ops a served step calls, routed to ixformer.functions (its argument orders)
    VendorEdit("vllm/_custom_ops.py", r"torch\.ops\._C\.(silu_and_mul|gelu_and_mul|gelu_tanh_and_mul)\(out, x\)",
               r"ixf_F.\1(x, out)", matches=3),
    VendorEdit("vllm/_custom_ops.py", r"torch\.ops\._C\.(?:gelu_fast|gelu_new|gelu_quick)\(out, x\)",
               'out.copy_(F.gelu(x, approximate="tanh"))', matches=3),
    # the image's paged_attention_v1, as it has it (no annotations: nothing wraps it)
    VendorEdit("vllm/_custom_ops.py",
               r"def paged_attention_v1\(\n(?:    \w+: [^\n]+\n)+\) -> None:\n    torch\.ops\._C\.paged_attention_v1\("
               r"[^)]*\)\n",
               "def paged_attention_v1(\n        output,\n        query,\n        key_cache,\n        value_cache,\n"
               "        head_mapping,\n        scale,\n        block_tables,\n        context_lens,\n"
               "        block_size,\n"
               "        max_context_len,\n        alibi_slopes=None,\n        kv_cache_dtype=None,\n):\n"
               "    return ixf_F.vllm_single_query_cached_kv_attention(\n            output,\n            query,\n"
               "            key_cache,\n            value_cache,\n            head_mapping,\n            scale,\n"
               "            block_tables,\n            context_lens,\n            block_size,\n"
               "            max_context_len,\n            alibi_slopes,\n        )\n"),
    VendorEdit("vllm/_custom_ops.py", r"(\) -> None:\n)    torch\.ops\._C\.paged_attention_v2\([^)]*\)\n",
               r"\1    raise NotImplementedError()\n"),
    VendorEdit("vllm/_custom_ops.py", r"(\) -> None:\n)    torch\.ops\._rocm_C\.paged_attention\([^)]*\)\n",
               r"\1    raise NotImplementedError()\n"),
    VendorEdit("vllm/_custom_ops.py",
               r"torch\.ops\._C\.rotary_embedding\(positions, query, key, head_size,\n\s+cos_sin_cache, is_neox\)",
               "ixf_F.vllm_rotary_embedding_neox(positions, query, key, head_size,\n"
               "                                    cos_sin_cache, is_neox)"),
    VendorEdit("vllm/_custom_ops.py",
               r"torch\.ops\._C\.batched_rotary_embedding\(positions, query, key, head_size,\n\s+cos_sin_cache, "
               r"is_neox, rot_dim,\n\s+cos_sin_cache_offsets\)",
               "ixf_F.vllm_batched_rotary_embedding(positions, query, key, head_size,\n"
               "                                        cos_sin_cache, is_neox, rot_dim,\n"
               "                                        cos_sin_cache_offsets)"),
    VendorEdit("vllm/_custom_ops.py", r"torch\.ops\._C\.rms_norm\(out, input, weight, epsilon\)",
               "ixf_F.rms_norm(input, weight, out, epsilon)"),
    # takes residual_alpha (layernorm passes it) and does not pass it on
    VendorEdit("vllm/_custom_ops.py",
               r"(def fused_add_rms_norm\(input: torch\.Tensor, residual: torch\.Tensor,\n\s+weight: torch\.Tensor, "
               r"epsilon: float)\) -> None:\n    torch\.ops\._C\.fused_add_rms_norm\(input, residual, weight, "
               r"epsilon\)",
               "\\1,\n                       residual_alpha: Optional[float] = 1) -> None:\n"
               "    ixf_F.fused_add_rms_norm(input, residual, weight, epsilon)"),
    # the MoE ops, on ixformer functions the BI-V100's ixformer does not have
    VendorEdit("vllm/_custom_ops.py",
               r"torch\.ops\._C\.moe_align_block_size\(topk_ids, num_experts, block_size,\n\s+sorted_token_ids, "
               r"experts_ids,\n\s+num_tokens_post_pad\)",
               "ixf_F.vllm_moe_align_block_size(topk_ids, num_experts, block_size, sorted_token_ids, experts_ids, "
               "num_tokens_post_pad)"),
    VendorEdit("vllm/_custom_ops.py",
               r"torch\.ops\._moe_C\.topk_softmax\(topk_weights, topk_ids,\n\s+token_expert_indicies, "
               r"gating_output\)\n",
               "ixf_F.vllm_moe_topk_softmax(topk_weights, topk_ids, token_expert_indicies, gating_output)\n\n\n"
               "def invoke_fused_moe_kernel(A, B, C, topk_weights, topk_ids, sorted_token_ids, expert_ids,\n"
               "                            num_tokens_post_padded, mul_routed_weight, top_k, config) -> None:\n"
               "    ixf_F.vllm_invoke_fused_moe_kernel(A, B, C, topk_weights, topk_ids, sorted_token_ids, expert_ids, "
               "num_tokens_post_padded, mul_routed_weight, top_k, config['BLOCK_SIZE_M'])\n"),
    VendorEdit("vllm/_custom_ops.py",
               r"def reshape_and_cache\(\n(?:    \w+: [^\n]+\n)+\) -> None:\n    torch\.ops\._C_cache_ops\."
               r"reshape_and_cache\([^)]*\)\n",
               "def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, "
               "v_scale) -> None:\n    slot_mapping = slot_mapping.to(torch.int32) \n"
               "    ixf_F.vllm_cache_ops_reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)\n"),
    VendorEdit("vllm/_custom_ops.py",
               r"torch\.ops\._C_cache_ops\.reshape_and_cache_flash\(key, value, key_cache,\n\s+value_cache, "
               r"slot_mapping,\n\s+kv_cache_dtype, k_scale,\n\s+v_scale\)",
               "ixf_F.reshape_and_cache_flash(key, value, key_cache, value_cache,\n"
               "                                  slot_mapping, kv_cache_dtype, k_scale,\n"
               "                                  v_scale)"),
    VendorEdit("vllm/_custom_ops.py", r"torch\.ops\._C_cache_ops\.(copy_blocks|swap_blocks)\(", r"ixf_F.\1(",
               matches=2),
    VendorEdit("vllm/_custom_ops.py",
               r"return torch\.ops\._C_cuda_utils\.get_max_shared_memory_per_block_device_attribute\(\n        "
               r"device\)\n", "return 32 * 1024\n"),
    # the model runner's dynamo cache sizes and its execute_model's exception dump are commented out
    VendorEdit("vllm/worker/model_runner.py", r"\n(torch\._dynamo\.config\.(?:accumulated_)?cache_size_limit = 128)",
               r"\n# \1", matches=2),
    VendorEdit("vllm/worker/model_runner.py",
               r"\n    (@dump_input_when_exception\(exclude_args=\[0\], exclude_kwargs=\[\"self\"\]\))\n",
               r"\n    # \1\n"),
    # the xformers backend: a head_mapping built last in __init__, passed to the decode where upstream passes
    # num_kv_heads; the GQA expansion before the prefill commented out (query, key and value stay [1, tokens,
    # heads, head_size]); the prefill's op is ixformer's flash op, made on each call
    VendorEdit("vllm/attention/backends/xformers.py",
               r"(\n            raise ValueError\(\n                f\"Head size \{head_size\} is not supported by "
               r"PagedAttention\. \"\n                f\"Supported head sizes are: \{suppored_head_sizes\}\.\"\)\n)",
               r"\1        self.head_mapping = torch.repeat_interleave(torch.arange(self.num_kv_heads, "
               r"dtype=torch.int32), self.num_queries_per_kv)\n"),
    VendorEdit("vllm/attention/backends/xformers.py",
               r"(\n\s+self\.kv_cache_dtype,\n(\s+))self\.num_kv_heads,(\n\s+self\.scale,)",
               r"\1self.head_mapping,\3"),
    VendorEdit("vllm/attention/backends/xformers.py",
               r"\n        if self\.num_kv_heads != self\.num_heads:\n            # GQA/MQA requires the shape "
               r"\[B, M, G, H, K\]\.\n            # Note that the output also has the same shape \(which is different"
               r"\n            # from a spec from the doc\)\.\n            query = query\.view\(query\.shape\[0\], "
               r"self\.num_kv_heads,\n                               self\.num_queries_per_kv, query\.shape\[-1\]\)"
               r"\n            key = key\[:, :,\n                      None, :\]\.expand\(key\.shape\[0\], "
               r"self\.num_kv_heads,\n                                      self\.num_queries_per_kv, "
               r"key\.shape\[-1\]\)\n            value = value\[:, :,\n                          None, :\]\.expand"
               r"\(value\.shape\[0\], self\.num_kv_heads,\n                                          "
               r"self\.num_queries_per_kv,\n                                          value\.shape\[-1\]\)\n",
               "\n        # if self.num_kv_heads != self.num_heads:\n        #     # GQA/MQA requires the shape "
               "[B, M, G, H, K].\n        #     # Note that the output also has the same shape (which is different"
               "\n        #     # from a spec from the doc).\n        #     query = query.view(query.shape[0], "
               "self.num_kv_heads,\n        #                        self.num_queries_per_kv, query.shape[-1])"
               "\n        #     key = key[:, :,\n        #               None, :].expand(key.shape[0], "
               "self.num_kv_heads,\n        #                               self.num_queries_per_kv, "
               "key.shape[-1])\n        #     value = value[:, :,\n        #                   None, :].expand"
               "(value.shape[0], self.num_kv_heads,\n        #                                   "
               "self.num_queries_per_kv,\n        #                                   value.shape[-1])\n"),
    VendorEdit("vllm/attention/backends/xformers.py",
               r"(\n(        )if self\.alibi_slopes is None:\n            # Add the batch dimension\.\n"
               r"(?:            [^\n]*\n)+?                scale=self\.scale)\)",
               r"\n\2self.attn_op = xops.fmha.flash.FwOp()\1,\n                op = self.attn_op)"),
    # the TP group: no PyNccl communicator ever, a multi-node flag from the world size given (callers give none)
    VendorEdit("vllm/distributed/parallel_state.py",
               r"(\n        group_name: Optional\[str\] = None,\n)(    \):\n)(        group_name = group_name or "
               r"\"anonymous\"\n)",
               "\\1        world_size: Optional[str] = None,\n\\2        use_pynccl = False # we do not use pynccl\n"
               "\\3"),
    VendorEdit("vllm/distributed/parallel_state.py", r"(\n        self\.local_rank = local_rank\n)",
               r"\1        self.is_multi_node = False if world_size is None else bool(world_size > "
               r"torch.cuda.device_count())\n"),
    # the TP all-reduce (upstream's all_reduce() reaches it): ixformer's, on a group built from the device group
    # on every call, in place, not waited on; a CPU tensor still takes upstream's ipex branch
    VendorEdit("vllm/distributed/parallel_state.py",
               r"(\n    def _all_reduce_in_place\(self, input_: torch\.Tensor\) -> None:\n(?:        [^\n]*\n)+?"
               r"        else:\n)            torch\.distributed\.all_reduce\(input_, group=self\.device_group\)\n",
               "\\1            # torch.distributed.all_reduce(input_, group=self.device_group)\n"
               "            # global _IXFORMER_TENSOR_MODEL_PARALLEL_GROUP\n"
               "            # if _IXFORMER_TENSOR_MODEL_PARALLEL_GROUP is None:\n"
               "            from ixformer.contrib.torch.extension.ixformer_torch.distributed import "
               "create_ixformer_group_from_pg\n"
               "            _IXFORMER_TENSOR_MODEL_PARALLEL_GROUP = create_ixformer_group_from_pg(self.device_group)\n"
               "            all_reduce(input_, group=_IXFORMER_TENSOR_MODEL_PARALLEL_GROUP, async_op=True)\n"
               "        return input_\n"),
    # the unquantized linear layers: torch's matmul at three token counts, ixformer's linear otherwise
    VendorEdit("vllm/model_executor/layers/linear.py",
               r"(\n              bias: Optional\[torch\.Tensor\] = None\) -> torch\.Tensor:\n\n)"
               r"(        return F\.linear\(x, layer\.weight, bias\)\n)",
               "\\1        if (x.shape[0] == 8192 or x.shape[0] == 16384 or x.shape[0] == 15360):\n"
               "            if bias is None:\n                return x @ layer.weight.T\n            else:\n"
               "                return x @ layer.weight.T + bias\n\\2"),
    # the LM head's matmul is ixformer's; the masked-input helper is not scripted
    VendorEdit("vllm/model_executor/layers/vocab_parallel_embedding.py",
               r"\n        return F\.linear\(x, layer\.weight, bias\)\n",
               "\n        return IXF.linear(x, layer.weight, bias)\n"),
    VendorEdit("vllm/model_executor/layers/vocab_parallel_embedding.py",
               r"\n@torch\.jit\.script\n(def get_masked_input_and_mask\()", r"\n# @torch.jit.script\n\1"),
    # no LM head call for zero rows: an empty [0, the rank's padded shard] tensor
    VendorEdit("vllm/model_executor/layers/logits_processor.py",
               r"(\n            # Get the logits for the next tokens\.\n)            (logits = self\._get_logits\("
               r"hidden_states, lm_head, embedding_bias\)\n)",
               "\\1            if hidden_states.shape[0] > 0:\n                \\2            else:\n"
               "                logits = torch.empty([0, lm_head.weight.shape[0]], device=hidden_states.device, "
               "dtype=hidden_states.dtype)\n"),
    # multiprocessing workers start with spawn (upstream: fork)
    VendorEdit("vllm/envs.py", r'(\n    VLLM_WORKER_MULTIPROC_METHOD: str = )"fork"', r'\1"spawn"'),
    VendorEdit("vllm/envs.py", r'os\.getenv\("VLLM_WORKER_MULTIPROC_METHOD", "fork"\)',
               'os.getenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")'),
    # RMSNorm takes residual_alpha and passes it to the fused op; GemmaRMSNorm neither checks for a compile nor
    # compiles forward_static (both commented out)
    VendorEdit("vllm/model_executor/layers/layernorm.py",
               r"(\n    def forward_cuda\(\n        self,\n        x: torch\.Tensor,\n        residual: Optional\["
               r"torch\.Tensor\] = None,\n)(    \) -> Union\[torch\.Tensor, Tuple\[torch\.Tensor, torch\.Tensor\]\]:\n"
               r"        if self\.variance_size_override is not None:\n(?:        [^\n]*\n|\n)+?                "
               r"self\.variance_epsilon,\n)(            \)\n            return x, residual\n)",
               "\\1        residual_alpha: Optional[float] = 1.0,\n\\2                residual_alpha,\n\\3"),
    VendorEdit("vllm/model_executor/layers/layernorm.py",
               r"\n        if torch\.compiler\.is_compiling\(\):\n"
               r"            return self\.forward_native\(x, residual\)\n"
               r"\n        if not getattr\(self, \"_is_compiled\", False\):\n            self\.forward_static = "
               r"torch\.compile\(  # type: ignore\n                self\.forward_static\)\n            "
               r"self\._is_compiled = True\n",
               "\n        # if torch.compiler.is_compiling():\n        #     return self.forward_native(x, residual)\n"
               "\n        # if not getattr(self, \"_is_compiled\", False):\n        #     self.forward_static = "
               "torch.compile(  # type: ignore\n        #         self.forward_static)\n"
               "        #     self._is_compiled = True\n"),
)
# the image's files without a final newline (DESIGN.md counts 15 and names these five); applied last
NO_FINAL_NEWLINE = ("vllm/_custom_ops.py", "vllm/attention/backends/xformers.py",
                    "vllm/model_executor/models/registry.py", "vllm/engine/async_llm_engine.py",
                    "vllm/model_executor/layers/fused_moe/layer.py")
FINAL_NEWLINE_EDITS: tuple[VendorEdit, ...] = tuple(VendorEdit(rel, r"\n\Z", "") for rel in NO_FINAL_NEWLINE)
VENDOR_EDITS = (*DOCUMENTED_EDITS, *SERVING_PATH_EDITS, *FINAL_NEWLINE_EDITS)  # applied in this order
# what CoreX ships that upstream 0.6.3 has not (stand-ins: the registries name them, nothing here runs them); a
# class registered where vLLM iterates over its kind derives from that kind's base (module, class)
COREX_ONLY = {
    "vllm/model_executor/models/qwen3.py": "Qwen3ForCausalLM",
    "vllm/model_executor/models/qwen3_moe.py": "Qwen3MoeForCausalLM",
    "vllm/model_executor/models/glm4.py": "Glm4ForCausalLM",
    "vllm/model_executor/models/qwen2_5_vl.py": "Qwen2_5_VLForConditionalGeneration",
    "vllm/model_executor/layers/quantization/w8a16.py": "W8a16Config",
}
COREX_ONLY_BASES = {
    "vllm/model_executor/layers/quantization/w8a16.py": ("vllm.model_executor.layers.quantization.base_config",
                                                         "QuantizationConfig"),
}
COREX_DROPS = ("vllm/vllm_flash_attn",)  # upstream folders the image does not have


def corexify(tree: Path, *, only_present: bool = False, crlf: bool = True) -> None:
    """Apply the documented vendor changes to an upstream vLLM tree in place.

    only_present: for trees that hold a subset of vLLM's files, skip edits of absent files.
    crlf: store every .py file with CRLF line endings, as the copies of the vendor tree are.
    """
    for edit in VENDOR_EDITS:
        path = tree / edit.file
        if only_present and not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        new, count = re.subn(edit.pattern, edit.replacement, text)
        if count != edit.matches:
            raise AssertionError(f"vendor edit on {edit.file} matched {count} times, not {edit.matches}: "
                                 f"{edit.pattern!r}")
        path.write_text(new, encoding="utf-8")
    if not only_present:
        for rel, cls in COREX_ONLY.items():
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            module, base = COREX_ONLY_BASES.get(rel, ("", ""))
            header, bases = (f"from {module} import {base}\n", f"({base})") if module else ("", "")
            (tree / rel).write_text(f'"""Stand-in for the CoreX-only module {rel} (the real one is the vendor\'s)."""'
                                    f"\n{header}\n\nclass {cls}{bases}:\n    pass\n", encoding="utf-8")
    for rel in COREX_DROPS:
        if (tree / rel).is_dir():
            shutil.rmtree(tree / rel)
    if crlf:
        for path in (tree / "vllm").rglob("*.py"):
            data = path.read_bytes()
            path.write_bytes(data.replace(b"\r\n", b"\n").replace(b"\n", b"\r\n"))
    for meta in tree.glob("vllm-*.dist-info"):
        fixed = tree / f"vllm-{COREX_VERSION}.dist-info"
        meta.rename(fixed)
        metadata = fixed / "METADATA"
        metadata.write_text(
            re.sub(r"^Version: .*$", f"Version: {COREX_VERSION}", metadata.read_text(encoding="utf-8"),
                   count=1, flags=re.MULTILINE),
            encoding="utf-8",
        )


def make_rootfs(reference: Path, rootfs: Path, *, corex: bool = True, roots: tuple[str, ...] = COREX_ROOTS) -> Path:
    """Lay out an image-like filesystem with the vendor package under every root.

    /usr/local/corex is a relative link to /usr/local/corex-3.2.3, as in the image; the cusolver
    library the recipe links to is an empty stand-in file behind the usual soname link.
    """
    real = rootfs / "usr/local/corex-3.2.3"
    real.mkdir(parents=True, exist_ok=True)
    link = rootfs / "usr/local/corex"
    if not link.exists():
        os.symlink("corex-3.2.3", link)
    for root in roots:
        target = rootfs / root.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        for item in reference.iterdir():
            if item.name.startswith("."):
                continue
            if item.is_dir():
                shutil.copytree(item, target / item.name, dirs_exist_ok=True)
            else:
                shutil.copy2(item, target / item.name)
        if corex:
            corexify(target)
    lib64 = real / "lib64"
    lib64.mkdir(parents=True, exist_ok=True)
    # the usual soname chain: the versioned file and a link to it
    (lib64 / "libcusolver.so.11.4.1.48").write_bytes(b"")
    if not (lib64 / "libcusolver.so.11").is_symlink():
        os.symlink("libcusolver.so.11.4.1.48", lib64 / "libcusolver.so.11")
    return rootfs


def main(argv: list[str] | None = None) -> int:
    """`python -m toolkit.corexlike ROOTFS`: build a CoreX-like image filesystem from vLLM 0.6.3."""
    import argparse

    from toolkit.inputs import fetch_reference

    parser = argparse.ArgumentParser(
        prog="python -m toolkit.corexlike",
        description="Lay out a CoreX-like image filesystem (both vLLM roots, the vendor's documented changes) "
        "built from the public vLLM release, for trying `toolkit apply/diff/verify` without the vendor image.",
    )
    parser.add_argument("rootfs", type=Path, help="folder to create (must not exist)")
    parser.add_argument("--release", default=COREX_BASE, help="upstream release to start from (default: the "
                        "vendor's true base)")
    args = parser.parse_args(argv)
    if args.rootfs.exists():
        parser.error(f"{args.rootfs} exists; pick a new folder")
    args.rootfs.parent.mkdir(parents=True, exist_ok=True)
    # laid out beside the target in a folder of our own, renamed into place whole
    work = Path(tempfile.mkdtemp(prefix=f".{args.rootfs.name}.", dir=args.rootfs.parent))
    try:
        make_rootfs(fetch_reference(args.release), work / "rootfs")
        (work / "rootfs").rename(args.rootfs)
    finally:
        shutil.rmtree(work)
    print(f"CoreX-like rootfs ready: {args.rootfs} (roots: {', '.join(COREX_ROOTS)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
