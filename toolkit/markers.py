"""Markers: one comment line per applied transform, at the end of the patched file.

They are plain text so that CI, the in-image step and a person with grep can check them
without importing the (GPU-bound) module. The digest ties a marker to the exact version
of the transform that wrote it, so a stale older patch is never taken for the current one.
"""

from __future__ import annotations

import re

MARKER_PREFIX = "# toolkit-marker:"
_MARKER = re.compile(r"^# toolkit-marker: (?P<id>\S+) (?P<digest>[0-9a-f]{12})[ \t]*\r?$", re.MULTILINE)


def read_markers(text: str) -> dict[str, str]:
    return {m["id"]: m["digest"] for m in _MARKER.finditer(text)}


def marker_line(transform_id: str, digest: str) -> str:
    return f"{MARKER_PREFIX} {transform_id} {digest}"


def append_markers(text: str, markers: list[tuple[str, str]]) -> str:
    if not markers:
        return text
    if text and not text.endswith("\n"):
        text += "\n"
    return text + "".join(marker_line(i, d) + "\n" for i, d in markers)


def strip_markers(text: str) -> str:
    """The text without its marker lines (what a transform wrote, for comparisons)."""
    return "".join(line for line in text.splitlines(keepends=True) if not _MARKER.match(line))
