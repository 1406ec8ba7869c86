"""preflight: each variant's argv through the patched vLLM's own parser and config code, on a CPU."""

from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from toolkit.commands.common import Inputs, chosen_variants, pinned
from toolkit.errors import EXIT_CANNOT_START, EXIT_OK
from toolkit.recipe import load_recipe
from toolkit.results import Report
from toolkit.trial import require_applied, require_complete


@dataclass(frozen=True)
class PreflightRequest:
    recipe: Path
    inputs: Inputs = field(default_factory=Inputs)
    variant: str | None = None  # one variant; default: the base
    all_variants: bool = False
    rootfs: Path | None = None  # vendor roots the recipe was applied to (default: a patched copy of the reference)
    model_config: Path | None = None  # a folder with the served model's config.json (default: from `model:`)


def preflight(request: PreflightRequest) -> Report:
    """Exit 2 (in the report's exit_code) when a variant cannot start."""
    from toolkit.runtime import preflight as runtime_preflight
    from toolkit.runtime.env import runtime

    loaded, found = pinned(load_recipe(request.recipe), request.inputs)
    if request.rootfs is None:
        require_complete(loaded, found, "preflight")
    else:  # the roots are run as they are: what must be complete is what is there, not what could be built here
        require_applied(loaded, found, request.rootfs, "preflight",
                        f"`toolkit apply {request.recipe} --rootfs {request.rootfs}` first (preflight runs the roots "
                        "as they are), or leave --rootfs out to run a patched copy of the reference tree")
    variants = chosen_variants(loaded, request.variant, request.all_variants)
    python = runtime()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="toolkit-preflight-tree-") as tmp:
        print(f"preflight: {len(variants)} variant(s) through the vendor's own code", file=sys.stderr, flush=True)
        outcomes, tree, cached = runtime_preflight.cached_run(
            loaded, variants, found, python, Path(tmp), request.rootfs, dict(request.inputs.package_roots),
            applied=True, model_dir=request.model_config)
    how = "remembered from an earlier run on the same files" if cached else f"{time.monotonic() - started:.1f} s"
    report = runtime_preflight.report(loaded, outcomes, f"ran on {tree.where}, {how}")
    return dataclasses.replace(report, exit_code=EXIT_OK if all(o.starts for o in outcomes) else EXIT_CANNOT_START)
