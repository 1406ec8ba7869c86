"""What a rehearsal check is: when it applies (from the run config's argv, before anything starts), which servers it
needs, what it sends to each, and what it compares."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import ClassVar

from toolkit.bench import experiment
from toolkit.rehearsal.model import Check
from toolkit.rehearsal.servers import Live, Stage


@dataclass
class Run:
    """What every check of one rehearsal sees: the stage its servers share and the run config's argv, read once."""

    stage: Stage
    served: list[str]  # the run config's argv, as the platform runs it
    wanted: frozenset[str]

    @cached_property
    def reasoning(self) -> bool:
        return experiment.flag_value(self.served, "--reasoning-parser") is not None

    @cached_property
    def caching(self) -> bool:
        return "--enable-prefix-caching" in self.served

    @cached_property
    def tool_parser(self) -> str | None:
        """The served tool parser when auto tool choice is on, else None."""
        parser = experiment.flag_value(self.served, "--tool-call-parser")
        return parser if "--enable-auto-tool-choice" in self.served else None


class RehearsalCheck:
    """One check. The orchestrator asks `not_applicable` before anything starts, starts each server some check
    `needs` once (in the registry of servers' order), hands it to `on` of every check that needs it (the
    `concurrent` ones at once, after the others; the `last` ones after all of them), and reports `verdict`."""

    name: ClassVar[str]
    summary: ClassVar[str]  # what it checks, in a few words (--help)
    concurrent: ClassVar[bool] = False  # its requests may go beside the other concurrent checks' (batched steps)
    last: ClassVar[bool] = False  # its requests go after every other check's on the server (still serving?)
    servers: ClassVar[tuple[str, ...]]  # the servers it needs (of servers.SERVERS)

    def __init__(self, run: Run) -> None:
        self.run = run
        self.result: Check | None = None  # what `on` found, for a check whose verdict is made there

    def not_applicable(self) -> str | None:
        """Why nothing of the run config is there for this check to look at (None: it applies)."""
        return None

    def needs(self) -> tuple[str, ...]:
        """The servers it needs, asked again before each server starts (what an earlier one answered may change
        it)."""
        return self.servers

    def env(self, server: str) -> dict[str, tuple[str, str]]:
        """More env for `server`, each with why (the served server's probes, for the profile)."""
        return {}

    def on(self, server: str, live: Live) -> None:
        raise NotImplementedError

    def verdict(self) -> Check:
        return self.result or self.unsent()

    def unsent(self) -> Check:
        """The verdict of a check whose requests never went out (no server it needs answered them)."""
        return Check(self.name, False, f"its requests were not sent: no server it needs ({', '.join(self.needs())}) "
                     "answered them")
