"""tools: the agent's request with its 29 tool schemas answered, and the schemas in the prompt."""

from __future__ import annotations

from typing import Any

from toolkit.bench import client, workloads
from toolkit.rehearsal.checks.base import RehearsalCheck
from toolkit.rehearsal.model import Check
from toolkit.rehearsal.requests import answered, counted_as_rendered, render_prompt, send, tools_body
from toolkit.rehearsal.servers import Live
from toolkit.runtime.tiny_model import CHAT_TEMPLATE


class Tools(RehearsalCheck):
    """The server's prompt_tokens is the served template's rendering with the tools, which names every tool."""

    name = "tools"
    summary = "29 tool schemas, tool_choice auto; the schemas in the prompt"
    concurrent = True
    servers = ("served",)


    def on(self, server: str, live: Live) -> None:
        stage = self.run.stage
        body: dict[str, Any] = tools_body()
        [record] = send(stage, live.server, [client.Conversation("tools", body=body)], 1, "tools")
        rendered = render_prompt(stage.python, stage.model, live.argv, body["messages"], body["tools"])
        check = answered("tools", record, self.run.reasoning,
                         f", {len(workloads.TOOL_NAMES)} tool schemas with tool_choice auto")
        problems = [] if check.ok else [check.detail]
        unnamed = [t["function"]["name"] for t in body["tools"] if t["function"]["name"] not in rendered["text"]]
        # the tiny model's own template is a stand-in that renders no tools: what it drops says nothing of the
        # checkpoint's template, which is the one served where the argv names none
        stand_in = rendered["template"] == CHAT_TEMPLATE
        if unnamed and not stand_in:
            problems.append(f"the served template's rendering names {len(body['tools']) - len(unnamed)} of "
                            f"{len(body['tools'])} tools (not: {', '.join(unnamed[:4])})")
        problems += counted_as_rendered(record, rendered, "the served template's rendering with the tools",
                                        ": the schemas did not reach the prompt as rendered")
        self.result = Check("tools", not problems, "; ".join(problems) or (
            f"{check.detail}; prompt_tokens = the served template's rendering with every tool schema" if not stand_in
            else f"{check.detail}; prompt_tokens = the served template's rendering; the schemas in the prompt not "
            "checked: the argv names no --chat-template, so the checkpoint's own is served, and the tiny model "
            "carries a stand-in without tools (rehearse with --model CHECKPOINT to check the real one)"))
