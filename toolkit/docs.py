"""The documentation site's two reference pages, made from what the toolkit runs: the CLI reference from its argument
parser, the recipe reference from its JSON Schema (docs/gen_pages.py writes them at `mkdocs build`), so neither can
fall behind the code it describes."""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Iterator
from typing import Any


def arguments(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The parser's arguments in its help's order. argparse keeps its list private; its help formatter is handed
    each group's, so a formatter that only collects them reads them."""
    seen: list[argparse.Action] = []

    class Collect(argparse.HelpFormatter):
        def add_arguments(self, actions: Iterable[argparse.Action]) -> None:
            seen.extend(actions)

    shown = parser.formatter_class
    parser.formatter_class = Collect
    try:
        parser.format_help()
    finally:
        parser.formatter_class = shown
    return seen


def _subcommands(action: argparse.Action) -> dict[str, argparse.ArgumentParser]:
    choices = action.choices
    if isinstance(choices, dict) and all(isinstance(p, argparse.ArgumentParser) for p in choices.values()):
        return choices
    return {}


def verbs(parser: argparse.ArgumentParser, prefix: str = "toolkit") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    """Every command line the parser takes (`toolkit build`, `toolkit vendor pull`, ...), in the parser's order."""
    for action in arguments(parser):
        for name, sub in _subcommands(action).items():
            yield f"{prefix} {name}", sub
            yield from verbs(sub, f"{prefix} {name}")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _option(action: argparse.Action) -> tuple[str, str, str]:
    """(the option or argument as typed, its help, its default) for one row."""
    if action.option_strings:
        spelled = ", ".join(f"`{s}`" for s in action.option_strings)
        if action.nargs != 0:
            metavar = action.metavar or action.dest.upper()
            spelled += f" `{metavar if isinstance(metavar, str) else ' '.join(metavar)}`"
    else:
        spelled = f"`{action.metavar or action.dest}`"
    default = action.default
    shown = "" if default in (None, False, argparse.SUPPRESS) or action.nargs == 0 else f"`{default}`"
    return spelled, _cell(action.help or ""), shown


def cli_reference(parser: argparse.ArgumentParser) -> str:
    """One section per verb: what it does, its usage, every argument and option with its help and default."""
    out = ["# CLI reference", "",
           "Generated from `toolkit`'s own argument parser at each docs build (`toolkit VERB --help` prints the same).",
           ""]
    if parser.epilog:
        out += ["```text", parser.epilog.rstrip(), "```", ""]
    for line, sub in verbs(parser):
        out += [f"## `{line}`", ""]
        if sub.description:  # raw in the terminal (indented continuation lines): paragraphs here
            out += [" ".join(paragraph.split()) + "\n" for paragraph in sub.description.strip().split("\n\n")]
        out += ["```text", sub.format_usage().strip(), "```", ""]
        rows = [_option(a) for a in arguments(sub) if "--help" not in a.option_strings and not _subcommands(a)]
        if rows:
            out += ["| argument | what it does | default |", "| --- | --- | --- |"]
            out += [f"| {spelled} | {help_} | {default} |" for spelled, help_, default in rows]
            out.append("")
        if sub.epilog:
            out += ["```text", sub.epilog.rstrip(), "```", ""]
    return "\n".join(out)


def _type(node: dict[str, Any]) -> str:
    if "$ref" in node:
        name = str(node["$ref"]).rsplit("/", 1)[-1]
        return f"[{name}](#{name.lower()})"
    if "anyOf" in node:
        return " or ".join(_type(n) for n in node["anyOf"] if n.get("type") != "null") or "null"
    if "enum" in node:
        return " \\| ".join(f"`{v}`" for v in node["enum"])
    kind = node.get("type", "any")
    if kind == "array":
        return f"list of {_type(node.get('items', {}))}"
    if kind == "object" and isinstance(node.get("additionalProperties"), dict):
        return f"map of {_type(node['additionalProperties'])}"
    return str(kind)


def _fields(schema: dict[str, Any]) -> list[str]:
    required = set(schema.get("required", []))
    rows = ["| key | type | required | what it is |", "| --- | --- | --- | --- |"]
    for key, node in schema.get("properties", {}).items():
        if "discriminator" in node.get("items", {}).get("anyOf", [{}])[0]:
            mapping = node["items"]["anyOf"][0]["discriminator"]["mapping"]
            kinds = ", ".join(f"[`{kind}`](#{ref.rsplit('/', 1)[-1].lower()})" for kind, ref in mapping.items())
            shown = f"list of transforms, by `kind`: {kinds}"
        else:
            shown = _type(node)
        rows.append(f"| `{key}` | {shown} | {'yes' if key in required else ''} | "
                    f"{_cell(str(node.get('description', '')))} |")
    return rows


def recipe_reference(schema: dict[str, Any]) -> str:
    """The recipe's top-level keys, then each model the schema defines, with every field's type and description."""
    out = ["# Recipe reference", "",
           "Generated from the recipe's JSON Schema (`toolkit schema`, committed as `recipes/schema.json` for editors) "
           "at each docs build. A key not listed here is refused with the valid keys named.", "",
           "## The recipe", ""]
    out += [*_fields(schema), ""]
    for name, model in sorted(schema.get("$defs", {}).items()):
        out += [f"## {name}", ""]
        if model.get("description"):
            out += [_cell(str(model["description"])), ""]
        if model.get("properties"):
            out += [*_fields(model), ""]
        elif "enum" in model:
            out += ["One of " + ", ".join(f"`{v}`" for v in model["enum"]), ""]
    return "\n".join(out)
