"""apply + verify of the flagship recipe vs a plain text-replacement script doing the same edits.

Both run in this process on fresh copies of the same CoreX-like tree (vLLM 0.6.3 with the
vendor changes, CRLF, two roots). The baseline is what the prior art's patch_ops.sh did: str.replace
on the anchors, copy the files, make the link, grep for the results. Prints medians and the ratio.

    python benchmarks/apply.py [--repeat 5]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from toolkit.corexlike import COREX_BASE, COREX_ROOTS, make_rootfs
from toolkit.engine.plan import Engine
from toolkit.engine.verify import verify_tree
from toolkit.engine.writer import commit
from toolkit.inputs import fetch_reference, rootfs_roots
from toolkit.pinned import resolve_pinned
from toolkit.recipe import load_recipe

REPO = Path(__file__).resolve().parent.parent
RECIPE = REPO / "recipes" / "bi100-qwen36.yaml"

TEXT_EDITS = [
    ("vllm/engine/arg_utils.py", "enforce_eager=True,", "enforce_eager=self.enforce_eager,"),
    ("vllm/engine/arg_utils.py", "disable_custom_all_reduce=True,",
     "disable_custom_all_reduce=self.disable_custom_all_reduce,"),
    ("vllm/attention/ops/paged_attn.py", "        use_v1 = True\n", ""),
    ("vllm/entrypoints/openai/protocol.py", 'ConfigDict(extra="forbid")', 'ConfigDict(extra="ignore")'),
    ("vllm/model_executor/models/registry.py",
     '    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),\n',
     '    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),\n'
     + "".join(f'    "{a}": ("qwen3_5", "Qwen3_5ForCausalLM"),\n' for a in (
         "Qwen3_5ForCausalLM", "Qwen3_5MoeForCausalLM", "Qwen3_6ForCausalLM", "Qwen3_6MoeForCausalLM"))),
    ("vllm/attention/backends/xformers.py", '        """\n\n        original_query = query\n',
     '        """\n        if __import__("os").environ.get("XFORMERS_SDPA_FALLBACK", "1") == "1" and ('
     "query.shape[-1] > 128 and self.alibi_slopes is None and self.sliding_window is None and "
     "attn_type == AttentionType.DECODER):\n"
     "            from native_fastpaths.attention import sdpa_varlen_prefill as _f\n"
     "            return _f(query, key, value, attn_metadata.seq_lens, self.scale)\n\n"
     "        original_query = query\n"),
]


def text_replacement(rootfs: Path) -> None:
    """The baseline: anchors by text, copy, link, then grep that every edit landed."""
    patches = REPO / "patches" / "src"
    for root in COREX_ROOTS:
        base = rootfs / root.lstrip("/")
        for rel, old, new in TEXT_EDITS:
            path = base / rel
            text = path.read_text()
            if text.count(old) != 1:
                raise SystemExit(f"baseline anchor not found once in {rel}")
            path.write_text(text.replace(old, new) + f"# patched: {rel}\n")
        shutil.copytree(patches / "native_fastpaths", base / "native_fastpaths", dirs_exist_ok=True)
        for rel, _, new in TEXT_EDITS:
            if new and new not in (base / rel).read_text():
                raise SystemExit(f"baseline verify failed for {rel}")
    dest = rootfs / "opt/toolkit/chat_templates"
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(patches / "chat_templates/qwen36_multi_system.jinja", dest)
    os.symlink("libcusolver.so.11", rootfs / "usr/local/corex/lib64/libcusolver.so")


PINNED: dict[str, Path] = {}  # the adapter's pinned files (tests/pinned_adapter.py), exported once in main()


def toolkit_apply_verify(rootfs: Path) -> None:
    loaded = load_recipe(RECIPE)
    roots = rootfs_roots(loaded.recipe, rootfs)
    plan = Engine(loaded, roots, rootfs, pinned=PINNED).run()
    if not plan.ok:
        raise SystemExit("toolkit apply drifted on the benchmark tree")
    commit(plan.ops)
    report = verify_tree(loaded, roots, rootfs, PINNED)
    if not report.ok:
        raise SystemExit("toolkit verify failed on the benchmark tree")


def measure(fn: Callable[[Path], None], template: Path, work: Path, repeat: int) -> list[float]:
    times = []
    for i in range(repeat):
        tree = work / f"{fn.__name__}-{i}"
        shutil.copytree(template, tree, symlinks=True)
        start = time.perf_counter()
        fn(tree)
        times.append(time.perf_counter() - start)
        shutil.rmtree(tree)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        reference = fetch_reference(COREX_BASE)
        template = make_rootfs(reference, work / "template")
        # the adapter is third-party and never here: its pinned files from ../shared, in a repository of our own
        sys.path.insert(0, str(REPO / "tests"))
        import pinned_adapter

        try:
            pinned_adapter.check_copy()
        except pinned_adapter.PinMismatch as exc:
            raise SystemExit(f"apply benchmark: {exc}") from None
        clone, pin = pinned_adapter.make_repo(work / "adapter")
        overrides: dict[str, tuple[str, str | None]] = {"qwen36-adapter": (str(clone), pin)}
        PINNED.update(resolve_pinned(load_recipe(RECIPE).recipe, RECIPE.parent, overrides)[0])
        # one warm-up each so imports and the page cache do not count against either side
        measure(text_replacement, template, work, 1)
        measure(toolkit_apply_verify, template, work, 1)
        base = measure(text_replacement, template, work, args.repeat)
        ours = measure(toolkit_apply_verify, template, work, args.repeat)
    b, o = statistics.median(base), statistics.median(ours)
    print(f"tree: CoreX-like {COREX_BASE}, {len(COREX_ROOTS)} roots, recipe {RECIPE.name}")
    print(f"text-replacement baseline : median {b * 1000:8.1f} ms over {args.repeat} runs")
    print(f"toolkit apply + verify    : median {o * 1000:8.1f} ms over {args.repeat} runs")
    print(f"ratio toolkit / baseline  : {o / b:8.1f}x   (goal: apply+verify < 2 s and <= 5x)")
    goal = o < 2.0 and o / b <= 5.0
    print("goal met" if goal else "goal NOT met")
    return 0


if __name__ == "__main__":
    sys.exit(main())
