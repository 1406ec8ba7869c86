"""The documentation site's reference pages are made from the code (toolkit/docs.py): every verb and option the
parser has is on the CLI page, every recipe key and model the schema has on the recipe page. (`.ci/run` builds the
whole site with `mkdocs build --strict`: a broken link, a missing anchor or a page outside the nav fails it.)"""

from __future__ import annotations

import argparse
import re

from toolkit.cli import build_parser
from toolkit.docs import cli_reference, recipe_reference
from toolkit.recipe import json_schema


def _every_command(parser: argparse.ArgumentParser, line: str = "toolkit") -> list[tuple[str, argparse.ArgumentParser]]:
    found = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.append((f"{line} {name}", sub))
                found += _every_command(sub, f"{line} {name}")
    return found


def _section(page: str, line: str) -> str:
    start = page.index(f"## `{line}`\n")
    following = page.find("\n## `", start + 1)
    return page[start:following if following != -1 else len(page)]


def test_the_cli_page_lists_every_verb_and_every_option_the_parser_has() -> None:
    parser = build_parser()
    page = cli_reference(parser)
    commands = _every_command(parser)
    assert {"toolkit build", "toolkit rehearse", "toolkit estimate", "toolkit vendor pull"} <= dict(commands).keys()
    for line, sub in commands:
        section = _section(page, line)
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction | argparse._SubParsersAction):
                continue
            for spelled in action.option_strings or [action.metavar or action.dest]:
                assert re.search(rf"^\| (`[^`]*`, )*`{re.escape(str(spelled))}`", section, re.M), (line, spelled)
            if action.help:
                assert " ".join(action.help.split())[:60].replace("|", "\\|") in section, (line, action.dest)


def test_the_recipe_page_lists_every_key_and_model_the_schema_has() -> None:
    schema = json_schema()
    page = recipe_reference(schema)
    top = page[page.index("## The recipe"):page.index("\n## ", page.index("## The recipe") + 1)]
    for key in schema["properties"]:
        assert f"| `{key}` |" in top, key
    for name, model in schema["$defs"].items():
        assert f"\n## {name}\n" in page, name
        section = page[page.index(f"\n## {name}\n"):]
        for key in model.get("properties", {}):
            assert f"| `{key}` |" in section.split("\n## ", 2)[1], (name, key)
