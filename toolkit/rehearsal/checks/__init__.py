"""The one registry of rehearsal checks, in the order they are reported (and, on a server they share, sent)."""

from __future__ import annotations

from toolkit.errors import ToolkitError
from toolkit.rehearsal.checks.answers import Answers
from toolkit.rehearsal.checks.base import RehearsalCheck, Run
from toolkit.rehearsal.checks.cache_hits import CacheHits
from toolkit.rehearsal.checks.kernels import Kernels
from toolkit.rehearsal.checks.multi_system import MultiSystem
from toolkit.rehearsal.checks.parsers import Parsers
from toolkit.rehearsal.checks.prefix_cache import PrefixCache
from toolkit.rehearsal.checks.profile import Profile
from toolkit.rehearsal.checks.replay import (
    CompletionLimit,
    ImageChunks,
    SeveralImages,
    StillServing,
    ToolCallIndex,
    ToolThread,
)
from toolkit.rehearsal.checks.short import Short
from toolkit.rehearsal.checks.tools import Tools

CHECKS: dict[str, type[RehearsalCheck]] = {c.name: c for c in (
    Short, Tools, MultiSystem, Parsers, Profile, Kernels, PrefixCache, CacheHits, Answers, CompletionLimit,
    ToolCallIndex, ToolThread, SeveralImages, ImageChunks, StillServing)}
# what --check can choose; the start and the weights are checked whenever a server starts
REQUEST_CHECKS = tuple(CHECKS)


def refuse_unknown_checks(only: tuple[str, ...]) -> None:
    """An unknown --check, refused before anything is built or started."""
    unknown = sorted(set(only) - set(REQUEST_CHECKS))
    if unknown:
        raise ToolkitError(f"--check {', '.join(unknown)}: no such check", hint=f"one of {', '.join(REQUEST_CHECKS)}")


__all__ = ["CHECKS", "REQUEST_CHECKS", "RehearsalCheck", "Run", "refuse_unknown_checks"]
