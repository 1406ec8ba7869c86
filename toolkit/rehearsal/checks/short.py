"""short: a one-line question answered as the platform's short requests are (streamed, usage, reasoning)."""

from __future__ import annotations

from toolkit.bench import client
from toolkit.bench.metrics import RequestRecord
from toolkit.rehearsal.checks.base import RehearsalCheck, Run
from toolkit.rehearsal.requests import answered, send
from toolkit.rehearsal.servers import Live


def short_request(run: Run, live: Live) -> RequestRecord:
    """The short request on the served server, sent once however many checks need it (its first token is the one
    the report times)."""
    def go() -> RequestRecord:
        [record] = send(run.stage, live.server, [client.Conversation(
            "short", [client.Turn("Say hello in one word.")])], 1, "short")
        run.stage.rehearsal.first_token_s = record.ttft
        return record
    record: RequestRecord = live.once("short", go)
    return record


class Short(RehearsalCheck):
    name = "short"
    summary = "a one-line question, streamed"
    servers = ("served",)

    def on(self, server: str, live: Live) -> None:
        self.result = answered("short", short_request(self.run, live), self.run.reasoning)
