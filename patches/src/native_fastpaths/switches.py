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
from typing import Any

TABLE_FILE = Path(__file__).with_name("switches.json")
TABLE: dict[str, dict[str, Any]] = json.loads(TABLE_FILE.read_text(encoding="utf-8"))
TYPES = ("flag", "count", "choice", "text")
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
        return "one of " + ", ".join(entry["values"])
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
        ok = raw in entry["values"]
    else:
        ok = kind == "text"
    return None if ok else f"{name}={raw!r}: expected {allowed(name)}"


def _check_table() -> dict[str, str]:
    """The table itself is sound (else nothing it says can be trusted): each entry has a known type, a choice lists
    its values, and its default is one of its own allowed values. Returns the defaults."""
    defaults = {}
    for name, entry in TABLE.items():
        where = f"{TABLE_FILE}: {name}"
        if entry.get("type") not in TYPES:
            raise SwitchError(f"{where}: type {entry.get('type')!r} is not one of {', '.join(TYPES)}")
        values = entry.get("values")
        if entry["type"] == "choice" and not (isinstance(values, list) and values
                                              and all(isinstance(v, str) for v in values)):
            raise SwitchError(f"{where}: a choice lists its values as strings, got {values!r}")
        if not isinstance(entry.get("default"), str):
            raise SwitchError(f"{where}: no default (a string), got {entry.get('default')!r}")
        why = problem(name, entry["default"])
        if why is not None:
            raise SwitchError(f"{where}: its default is not allowed ({why})")
        defaults[name] = entry["default"]
    return defaults


def check_environment() -> None:
    """Every switch of the table that the environment sets, judged now: called when the server imports the
    scheduler's hooks (prefix_state), so a bad value stops the server at start, not at its first request."""
    for name in TABLE:
        raw = os.environ.get(name)
        if raw is not None and (why := problem(name, raw)) is not None:
            raise SwitchError(f"{why} (set in the environment; checked at start by {_caller(2)}; the table is "
                              f"{TABLE_FILE})")


def _caller(depth: int) -> str:
    frame = sys._getframe(depth)
    return f"{frame.f_code.co_filename}:{frame.f_lineno}"


def value(name: str, _depth: int = 2) -> str:
    """The switch's value (its default when unset), checked against the table."""
    raw = os.environ.get(name, DEFAULTS.get(name, ""))
    why = problem(name, raw)
    if why is not None:
        raise SwitchError(f"{why} (read at {_caller(_depth)}; the table is {TABLE_FILE})")
    return raw


def _typed(name: str, kind: str, depth: int) -> str:
    if TABLE.get(name, {}).get("type") != kind:
        known = ", ".join(n for n, e in TABLE.items() if e["type"] == kind)
        raise SwitchError(f"{name} is not a {kind} switch of {TABLE_FILE} (read at {_caller(depth)}; its "
                          f"{kind} switches: {known})")
    return value(name, depth + 1)


def on(name: str) -> bool:
    """A flag switch: True for "1", False for "0", anything else raises."""
    return _typed(name, "flag", 3) == "1"


def count(name: str, _depth: int = 3) -> int:
    return int(_typed(name, "count", _depth))


def small_batch_variant() -> str:
    return _typed("MOE_SMALL_BATCH_VARIANT", "choice", 3)


def small_batch_threshold() -> int:
    return count("MOE_SMALL_BATCH_THRESHOLD", 4)


DEFAULTS = _check_table()
