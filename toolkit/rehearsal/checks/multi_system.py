"""multi-system: three system messages, two after user turns, each reaching the prompt; the answer limited by
max_completion_tokens alone, as current OpenAI clients send it."""

from __future__ import annotations

from toolkit.bench import client
from toolkit.rehearsal.checks.base import RehearsalCheck
from toolkit.rehearsal.model import MAX_TOKENS, Check
from toolkit.rehearsal.requests import (
    SYSTEMS,
    counted_as_rendered,
    multi_system_messages,
    problems,
    render_prompt,
    send,
)
from toolkit.rehearsal.servers import Live


class MultiSystem(RehearsalCheck):
    name = "multi-system"
    summary = "three system messages, two after user turns; max_completion_tokens alone"
    concurrent = True
    servers = ("served",)


    def on(self, server: str, live: Live) -> None:
        stage = self.run.stage
        messages = multi_system_messages()
        body = {"messages": messages, "max_completion_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        [record] = send(stage, live.server, [client.Conversation("multi-system", body=body)], 1, "multi-system")
        found = problems(record, self.run.reasoning)
        rendered = render_prompt(stage.python, stage.model, live.argv, messages)
        missing = [i + 1 for i, text in enumerate(SYSTEMS) if text not in rendered["text"]]
        if missing:
            found.append(f"the served template's rendering lacks system message(s) {missing} of {len(SYSTEMS)}")
        found += counted_as_rendered(record, rendered, "the served template's rendering")
        self.result = Check("multi-system", not found, "; ".join(found) or (
            f"{len(SYSTEMS)} system messages (two after user turns) accepted, max_completion_tokens alone limited "
            f"the answer to {record.completion_tokens} tokens; "
            f"prompt_tokens {record.prompt_tokens} = the rendering's, which holds every system message"))
