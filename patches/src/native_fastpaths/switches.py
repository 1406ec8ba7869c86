"""Environment switches: the one reader of every switch in `switches.json`, strict, read at call time (so a server
restart with new env needs no rebuild).

The table beside this file gives each switch its default, its type and what it selects; the toolkit reads the same
table when it injects a dispatch, and the code it injects calls `on()` here. A value outside a switch's allowed set
raises at its first read, naming the switch, the value, what is allowed and where it was read: a server with
`PREFIX_STATE=01` fails to start instead of running with the scheduler's side on and the layer's side off.

Types: `flag` is exactly "0" or "1"; `count` a whole number >= 0 written in plain digits ("08" and " 8" are refused:
one spelling per value); `choice` one of `values`; `text` any string.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

TABLE: dict[str, dict[str, object]] = json.loads(
    Path(__file__).with_name("switches.json").read_text(encoding="utf-8"))
DEFAULTS = {name: str(entry["default"]) for name, entry in TABLE.items()}
FLAG = ("0", "1")


class SwitchError(ValueError):
    """A switch set to a value its table entry does not allow."""


def allowed(name: str) -> str:
    """What the switch accepts, in words (the error message and the toolkit's lint say the same)."""
    entry = TABLE[name]
    kind = entry["type"]
    if kind == "flag":
        return "exactly 0 or 1"
    if kind == "count":
        return "a whole number >= 0 in plain digits"
    if kind == "choice":
        return "one of " + ", ".join(map(str, entry["values"]))  # type: ignore[attr-defined]
    return "any text"


def problem(name: str, raw: str) -> str | None:
    """Why `raw` is not a value of switch `name` (None: it is one)."""
    if name not in TABLE:
        return f"{name} is not a switch of {__name__} (known: {', '.join(sorted(TABLE))})"
    entry = TABLE[name]
    kind = entry["type"]
    if kind == "flag":
        ok = raw in FLAG
    elif kind == "count":
        ok = raw.isascii() and raw.isdigit() and (raw == "0" or not raw.startswith("0"))
    elif kind == "choice":
        ok = raw in entry["values"]  # type: ignore[operator]
    else:
        ok = kind == "text"
    return None if ok else f"{name}={raw!r}: expected {allowed(name)}"


def _caller(depth: int) -> str:
    frame = sys._getframe(depth)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def value(name: str, _depth: int = 2) -> str:
    """The switch's value (its default when unset), checked against the table."""
    raw = os.environ.get(name, DEFAULTS.get(name, ""))
    why = problem(name, raw)
    if why is not None:
        table = Path(__file__).with_name("switches.json")
        raise SwitchError(f"{why} (read at {_caller(_depth)}; the table is {table})")
    return raw


def on(name: str) -> bool:
    """A flag switch: True for "1", False for "0", anything else raises."""
    if TABLE.get(name, {}).get("type") != "flag":
        raise SwitchError(f"{name} is not a flag switch (read at {_caller(2)})")
    return value(name, 3) == "1"


def count(name: str) -> int:
    if TABLE.get(name, {}).get("type") != "count":
        raise SwitchError(f"{name} is not a count switch (read at {_caller(2)})")
    return int(value(name, 3))


def small_batch_variant() -> str:
    return value("MOE_SMALL_BATCH_VARIANT", 3)


def small_batch_threshold() -> int:
    return count("MOE_SMALL_BATCH_THRESHOLD")
