"""Environment switches, read at call time so a server restart with new env needs no rebuild.

The one table of switches, their defaults and what each selects is `switches.json` beside this file: this module
reads it, and so does the toolkit when it injects a dispatch (a recipe's dispatch takes its default from it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TABLE: dict[str, dict[str, str]] = json.loads(Path(__file__).with_name("switches.json").read_text(encoding="utf-8"))
DEFAULTS = {name: entry["default"] for name, entry in TABLE.items()}
VARIANTS = ("auto", "direct", "gemm", "bmm", "segments")


def value(name: str) -> str:
    return os.environ.get(name, DEFAULTS[name])


def enabled(name: str) -> bool:
    return value(name).strip().lower() in ("1", "true", "yes", "on")


def small_batch_variant() -> str:
    variant = value("MOE_SMALL_BATCH_VARIANT").strip().lower()
    if variant not in VARIANTS:
        raise ValueError(f"MOE_SMALL_BATCH_VARIANT must be one of {', '.join(VARIANTS)}, got {variant!r}")
    return variant


def small_batch_threshold() -> int:
    return int(value("MOE_SMALL_BATCH_THRESHOLD"))
