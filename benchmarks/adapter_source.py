"""The benchmarks' default adapter: the pinned files in ../shared, checked against their digests and committed into a
repository of the run's own (tests/pinned_adapter.py), as `--source qwen36-adapter=CLONE@COMMIT` takes it."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def pinned_source(work: Path, benchmark: str) -> str:
    sys.path.insert(0, str(REPO / "tests"))
    import pinned_adapter

    try:
        return str(pinned_adapter.checked_source(work))
    except pinned_adapter.PinMismatch as exc:
        raise SystemExit(f"{benchmark} benchmark: {exc}") from None
