"""A CoreX-like vendor tree made from a public vLLM release: what the build's trial, the tests and the benchmarks
apply recipes to when the vendor image is not at hand.

The vendor image cannot be fetched here, so its documented differences (DESIGN.md section 3) are rebuilt
on top of the upstream files. The edits are plain text
replacements on purpose: they stand in for the vendor's own hand edits, and each one
checks that it matched exactly once so a changed upstream release fails loudly here.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

COREX_VERSION = "0.6.3+corex.3.2.3"
COREX_ROOTS = (
    "/usr/local/corex/lib/python3/dist-packages",
    "/usr/local/corex/lib64/python3/dist-packages",
)

# (file, pattern, replacement): the vendor changes of DESIGN.md section 3, on vLLM 0.6.3.post1
VENDOR_EDITS: tuple[tuple[str, str, str], ...] = (
    ("vllm/engine/arg_utils.py", r"enforce_eager=self\.enforce_eager,", "enforce_eager=True,"),
    ("vllm/engine/arg_utils.py", r"disable_custom_all_reduce=self\.disable_custom_all_reduce,",
     "disable_custom_all_reduce=True,"),
    ("vllm/attention/ops/paged_attn.py",
     r"(\n(\s+)use_v1 = \(max_seq_len <= 8192\n\s+and \(max_num_partitions == 1 or num_seqs \* num_heads > 512\)\)\n)",
     r"\1\2use_v1 = True\n"),
    ("vllm/triton_utils/importing.py", r"HAS_TRITON = find_spec\(\"triton\"\) is not None", "HAS_TRITON = False"),
    ("vllm/model_executor/models/registry.py",
     r'(\n(\s+)"Qwen2MoeForCausalLM": \("qwen2_moe", "Qwen2MoeForCausalLM"\),\n)',
     r'\1\2"Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),\n'
     r'\2"Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),\n'),
    ("vllm/attention/backends/xformers.py",
     r"(out = xops\.memory_efficient_attention_forward\(\n(\s+)query,\n\s+key,\n\s+value,\n"
     r"\s+attn_bias=attn_bias\[0\],\n\s+p=0\.0,\n\s+scale=self\.scale)\)",
     r"\1,\n\2op=self.attn_op)"),
    ("vllm/attention/backends/xformers.py",
     r"(\n(\s+)self\.kv_cache_dtype = kv_cache_dtype\n)",
     r"\1\2self.attn_op = None  # ixformer flash op (CoreX)\n"),
)


def corexify(tree: Path, *, only_present: bool = False) -> None:
    """Apply the documented vendor changes to an upstream vLLM tree in place.

    only_present: for trees that hold a subset of vLLM's files, skip edits of absent files.
    """
    for rel, pattern, replacement in VENDOR_EDITS:
        path = tree / rel
        if only_present and not path.exists():
            continue
        text = path.read_text(encoding="utf-8")
        new, count = re.subn(pattern, replacement, text)
        if count != 1:
            raise AssertionError(f"vendor edit on {rel} matched {count} times: {pattern!r}")
        path.write_text(new, encoding="utf-8")
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
    """`python -m toolkit.corexlike ROOTFS`: build a CoreX-like image filesystem from vLLM 0.6.3.post1."""
    import argparse

    from toolkit.inputs import fetch_reference

    parser = argparse.ArgumentParser(
        prog="python -m toolkit.corexlike",
        description="Lay out a CoreX-like image filesystem (both vLLM roots, the vendor's documented changes) "
        "built from the public vLLM release, for trying `toolkit apply/diff/verify` without the vendor image.",
    )
    parser.add_argument("rootfs", type=Path, help="folder to create (must not exist)")
    parser.add_argument("--release", default="vllm==0.6.3.post1", help="upstream release to start from")
    args = parser.parse_args(argv)
    if args.rootfs.exists():
        parser.error(f"{args.rootfs} exists; pick a new folder")
    tmp = args.rootfs.with_name(f".{args.rootfs.name}.partial")
    if tmp.exists():
        shutil.rmtree(tmp)
    make_rootfs(fetch_reference(args.release), tmp)
    tmp.rename(args.rootfs)
    print(f"CoreX-like rootfs ready: {args.rootfs} (roots: {', '.join(COREX_ROOTS)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
