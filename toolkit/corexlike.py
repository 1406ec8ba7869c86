"""A CoreX-like vendor tree made from a public vLLM release: what the build's trial, the tests and the benchmarks
apply recipes to when the vendor image is not at hand.

The vendor image cannot be fetched here, so its documented differences (DESIGN.md section 3, measured on a copy
of the image's tree) are rebuilt on top of its true base, vLLM 0.6.3: the hard-coded flags, the paged attention
and API-server edits, the registry entries, the module-level imports of the vendor's GPU libraries (ixformer,
xformers) in the six modules that have them, the model files CoreX adds, no `vllm_flash_attn/`, and CRLF line
endings as in the copies people work from. The edits are plain text replacements on purpose: they stand in for
the vendor's own hand edits, and each one checks its match count so a changed upstream release fails loudly here.
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
    # the prefill passes ixformer's flash op (measured on the image's tree: a fresh FwOp per call)
    VendorEdit("vllm/attention/backends/xformers.py",
               r"(out = xops\.memory_efficient_attention_forward\(\n(\s+)query,\n\s+key,\n\s+value,\n"
               r"\s+attn_bias=attn_bias\[0\],\n\s+p=0\.0,\n\s+scale=self\.scale)\)",
               r"\1,\n\2op=xops.fmha.flash.FwOp())"),
    VendorEdit("vllm/entrypoints/openai/api_server.py", r"\nimport re\n", r"\nimport regex as re\n"),
    VendorEdit("vllm/entrypoints/chat_utils.py", r'if model_type == "qwen2_vl":',
               r'if model_type in ("qwen2_vl","qwen2_5_vl"):', matches=2),
    # the vendor's GPU libraries, imported at module level as in the image (and once inside a method)
    VendorEdit("vllm/_custom_ops.py", r"(\nfrom vllm\.platforms import current_platform\n)",
               r"\1import ixformer.functions as ixf_F\nfrom ixformer.distributed import _distributed as cdist\n"),
    VendorEdit("vllm/distributed/parallel_state.py", r"(\nfrom vllm\.utils import supports_custom_op\n)",
               r"\1from ixformer.distributed import all_reduce\nimport ixformer.distributed as ixfd\n"),
    VendorEdit("vllm/distributed/parallel_state.py", r"(\n(\s+)self\.device_group = None\n\s+self\.cpu_group = None\n)",
               r"\1\2from ixformer.contrib.torch.extension.ixformer_torch.distributed import "
               r"create_ixformer_group_from_pg  # noqa\n"),
    # the forward's F.linear is ixformer's in the image
    VendorEdit("vllm/model_executor/layers/linear.py", r"\nimport torch\.nn\.functional as F\n",
               r"\nimport ixformer.functions as F\n"),
    VendorEdit("vllm/model_executor/layers/vocab_parallel_embedding.py", r"(\nimport torch\.nn\.functional as F\n)",
               r"\1import ixformer.functions as IXF\n"),
    VendorEdit("vllm/attention/backends/xformers.py",
               r"\nfrom xformers import ops as xops\nfrom xformers\.ops\.fmha\.attn_bias import \(AttentionBias,\n"
               r"\s+BlockDiagonalCausalMask,\n\s+BlockDiagonalMask,\n\s+LowerTriangularMaskWithTensorBias\)\n",
               "\nfrom ixformer.contrib.xformers import ops as xops\n"
               "from ixformer.contrib.xformers.ops.fmha.attn_bias import (BlockDiagonalCausalMask,\n"
               "                                                          BlockDiagonalMask,\n"
               "                                                          LowerTriangularMaskWithTensorBias)\n"
               "from xformers.ops.fmha.attn_bias import (AttentionBias, )\n"),
    VendorEdit("vllm/attention/backends/flash_attn.py",
               r"\nfrom vllm\.vllm_flash_attn import \(flash_attn_varlen_func,\n\s+flash_attn_with_kvcache\)\n",
               "\nfrom ixformer.contrib.vllm_flash_attn import (flash_attn_varlen_func as _flash_attn_varlen_func,\n"
               "                                              flash_attn_with_kvcache as _flash_attn_with_kvcache)\n"
               "flash_attn_varlen_func = _flash_attn_varlen_func\n"
               "flash_attn_with_kvcache = _flash_attn_with_kvcache\n"),
)
# the vendor edits on the serving path (DESIGN.md section 3, "More vendor edits on the serving path")
SERVING_PATH_EDITS: tuple[VendorEdit, ...] = (
    # triton's cache manager and libentry imported unconditionally (upstream: under `if HAS_TRITON:`)
    VendorEdit("vllm/triton_utils/__init__.py",
               r"if HAS_TRITON:\n\n    (from vllm\.triton_utils\.custom_cache_manager import \()\n        "
               r"(maybe_set_triton_cache_manager\))\n    (from vllm\.triton_utils\.libentry import libentry)\n\n    "
               r"(__all__ \+= \[\"maybe_set_triton_cache_manager\", \"libentry\"\])\n",
               r"\1\n    \2\n\3\n\n\4\n"),
    # a failing pynvml means CUDA (upstream: nothing); the CUDA platform imports pynvml at module level (as
    # upstream), reports capability [9, 0] and 32 GiB whatever the device says, and never compares device names
    VendorEdit("vllm/platforms/__init__.py",
               r"(\n        pynvml\.nvmlShutdown\(\)\nexcept Exception:\n)    pass\n", r"\1    is_cuda = True\n"),
    VendorEdit("vllm/platforms/cuda.py",
               r"physical_device_id = device_id_to_physical_device_id\(device_id\)\n        major, minor = "
               r"get_physical_device_capability\(physical_device_id\)\n        return DeviceCapability\(major=major, "
               r"minor=minor\)", "return DeviceCapability(major=9, minor=0)"),
    VendorEdit("vllm/platforms/cuda.py",
               r"physical_device_id = device_id_to_physical_device_id\(device_id\)\n        return "
               r"get_physical_device_total_memory\(physical_device_id\)", "return 32 * 1024**3"),
    VendorEdit("vllm/platforms/cuda.py",
               r"\ntry:\n    from sphinx\.ext\.autodoc\.mock import _MockModule\n\n    if not isinstance\(pynvml, "
               r"_MockModule\):\n        warn_if_different_devices\(\)\nexcept ModuleNotFoundError:\n    "
               r"warn_if_different_devices\(\)\n", "\n"),
    # the FLASH_ATTN branch no longer probes vllm.vllm_flash_attn: it imports the flash_attn backend, whose module
    # level imports ixformer.contrib.vllm_flash_attn, and takes XFORMERS only on ImportError
    VendorEdit("vllm/attention/selector.py", r"\n            import vllm\.vllm_flash_attn  # noqa: F401\n",
               "\n            # import vllm.vllm_flash_attn  # noqa: F401\n"),
    # the ops a served step calls, routed to ixformer.functions (its argument orders)
    VendorEdit("vllm/_custom_ops.py", r"torch\.ops\._C\.(silu_and_mul|gelu_and_mul|gelu_tanh_and_mul)\(out, x\)",
               r"ixf_F.\1(x, out)", matches=3),
    VendorEdit("vllm/_custom_ops.py",
               r"def paged_attention_v1\(\n    out: torch\.Tensor,\n(    query: torch\.Tensor,\n    key_cache: "
               r"torch\.Tensor,\n    value_cache: torch\.Tensor,\n)    num_kv_heads: int,\n(    scale: float,\n    "
               r"block_tables: torch\.Tensor,\n)    seq_lens: torch\.Tensor,\n(    block_size: int,\n)    "
               r"max_seq_len: int,\n    alibi_slopes: Optional\[torch\.Tensor\],\n(?:    \w+: [^\n]+\n)+\) -> None:\n"
               r"    torch\.ops\._C\.paged_attention_v1\([^)]*\)\n",
               "def paged_attention_v1(\n    output: torch.Tensor,\n\\1    head_mapping: torch.Tensor,\n\\2"
               "    context_lens: torch.Tensor,\n\\3    max_context_len: int,\n"
               "    alibi_slopes: Optional[torch.Tensor] = None,\n    kv_cache_dtype: Optional[str] = None,\n"
               ") -> None:\n    ixf_F.vllm_single_query_cached_kv_attention(\n        output, query, key_cache, "
               "value_cache, head_mapping, scale, block_tables,\n        context_lens, block_size, max_context_len, "
               "alibi_slopes)\n"),
    VendorEdit("vllm/_custom_ops.py", r"(\) -> None:\n)    torch\.ops\._C\.paged_attention_v2\([^)]*\)\n",
               r'\1    raise NotImplementedError("paged_attention_v2 (ixformer has only v1)")\n'),
    VendorEdit("vllm/_custom_ops.py",
               r"torch\.ops\._C\.rotary_embedding\(positions, query, key, head_size,\n\s+cos_sin_cache, is_neox\)",
               "ixf_F.vllm_rotary_embedding_neox(positions, query, key, head_size,\n"
               "                                    cos_sin_cache, is_neox)"),
    VendorEdit("vllm/_custom_ops.py", r"torch\.ops\._C\.rms_norm\(out, input, weight, epsilon\)",
               "ixf_F.rms_norm(input, weight, out, epsilon)"),
    VendorEdit("vllm/_custom_ops.py",
               r"(def fused_add_rms_norm\(input: torch\.Tensor, residual: torch\.Tensor,\n\s+weight: torch\.Tensor, "
               r"epsilon: float)\) -> None:\n    torch\.ops\._C\.fused_add_rms_norm\(input, residual, weight, "
               r"epsilon\)",
               "\\1,\n                       residual_alpha: float = 1) -> None:\n"
               "    ixf_F.fused_add_rms_norm(input, residual, weight, epsilon)"),
    VendorEdit("vllm/_custom_ops.py",
               r"torch\.ops\._C_cache_ops\.reshape_and_cache\(key, value, key_cache,\n\s+value_cache, "
               r"slot_mapping,\n\s+kv_cache_dtype, k_scale, v_scale\)",
               "ixf_F.vllm_cache_ops_reshape_and_cache(key, value, key_cache, value_cache,\n"
               "                                          slot_mapping.to(torch.int32))"),
    VendorEdit("vllm/_custom_ops.py", r"torch\.ops\._C_cache_ops\.(copy_blocks|swap_blocks)\(", r"ixf_F.\1(",
               matches=2),
    # the model runner's dynamo cache sizes and its execute_model's exception dump are commented out
    VendorEdit("vllm/worker/model_runner.py", r"\n(torch\._dynamo\.config\.(?:accumulated_)?cache_size_limit = 128)",
               r"\n# \1", matches=2),
    VendorEdit("vllm/worker/model_runner.py",
               r"\n    (@dump_input_when_exception\(exclude_args=\[0\], exclude_kwargs=\[\"self\"\]\))\n",
               r"\n    # \1\n"),
    # the xformers backend: a head_mapping built once, passed to the decode where upstream passes num_kv_heads, and
    # no GQA expansion before the prefill (query, key and value stay [1, tokens, heads, head_size])
    VendorEdit("vllm/attention/backends/xformers.py",
               r"(\n(\s+)self\.num_queries_per_kv = self\.num_heads // self\.num_kv_heads\n)",
               r"\1\2self.head_mapping = torch.repeat_interleave(\n\2    torch.arange(self.num_kv_heads, "
               r"dtype=torch.int32), self.num_queries_per_kv)\n"),
    VendorEdit("vllm/attention/backends/xformers.py",
               r"(\n\s+self\.kv_cache_dtype,\n(\s+))self\.num_kv_heads,(\n\s+self\.scale,)",
               r"\1self.head_mapping,\3"),
    VendorEdit("vllm/attention/backends/xformers.py",
               r"\n        if self\.num_kv_heads != self\.num_heads:\n            # GQA/MQA requires the shape "
               r"\[B, M, G, H, K\]\.\n(?:            [^\n]*\n|                [^\n]*\n)+?"
               r"(?=        # Set attention bias if not provided\.)", "\n"),
    # the TP all-reduce through ixformer on a group built from the device group, in place, nothing waited on
    VendorEdit("vllm/distributed/parallel_state.py",
               r"(\n        if self\.world_size == 1:\n            return input_\n\n)        if not "
               r"supports_custom_op\(\):\n            self\._all_reduce_in_place\(input_\)\n            return "
               r"input_\n(?:\n|        [^\n]*\n|            [^\n]*\n|                [^\n]*\n|"
               r"                                              [^\n]*\n)+?            return input_\n",
               "\\1        from ixformer.contrib.torch.extension.ixformer_torch.distributed import "
               "create_ixformer_group_from_pg\n"
               "        ixformer_group = create_ixformer_group_from_pg(self.device_group)\n"
               "        all_reduce(input_, group=ixformer_group, async_op=True)\n        return input_\n"),
    # the LM head's matmul is ixformer's
    VendorEdit("vllm/model_executor/layers/vocab_parallel_embedding.py",
               r"\n        return F\.linear\(x, layer\.weight, bias\)\n",
               "\n        return IXF.linear(x, layer.weight, bias)\n"),
    # no LM head call for zero rows: an empty [0, vocab] tensor
    VendorEdit("vllm/model_executor/layers/logits_processor.py",
               r"(\n        # Get the logits for the next tokens\.\n)",
               "\n        if hidden_states.shape[0] == 0:\n            return torch.empty((0, self.vocab_size), "
               "dtype=hidden_states.dtype,\n                               device=hidden_states.device)\\1"),
    # multiprocessing workers start with spawn (upstream: fork)
    VendorEdit("vllm/envs.py", r'(\n    VLLM_WORKER_MULTIPROC_METHOD: str = )"fork"', r'\1"spawn"'),
    VendorEdit("vllm/envs.py", r'os\.getenv\("VLLM_WORKER_MULTIPROC_METHOD", "fork"\)',
               'os.getenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")'),
    # GemmaRMSNorm's forward_static is not compiled
    VendorEdit("vllm/model_executor/layers/layernorm.py",
               r"\n        if not getattr\(self, \"_is_compiled\", False\):\n            self\.forward_static = "
               r"torch\.compile\(  # type: ignore\n                self\.forward_static\)\n            "
               r"self\._is_compiled = True\n", "\n"),
)
VENDOR_EDITS = (*DOCUMENTED_EDITS, *SERVING_PATH_EDITS)  # applied in this order
# what CoreX ships that upstream 0.6.3 has not (stand-ins: the registry names them, nothing here imports them)
COREX_ONLY = {
    "vllm/model_executor/models/qwen3.py": "Qwen3ForCausalLM",
    "vllm/model_executor/models/qwen3_moe.py": "Qwen3MoeForCausalLM",
    "vllm/model_executor/models/glm4.py": "Glm4ForCausalLM",
    "vllm/model_executor/models/qwen2_5_vl.py": "Qwen2_5_VLForConditionalGeneration",
    "vllm/model_executor/layers/quantization/w8a16.py": "W8A16Config",
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
            (tree / rel).write_text(f'"""Stand-in for the CoreX-only module {rel} (the real one is the vendor\'s)."""'
                                    f"\n\n\nclass {cls}:\n    pass\n", encoding="utf-8")
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
