"""Run by mkdocs-gen-files at every `mkdocs build`: the reference pages from the toolkit itself (toolkit/docs.py)."""

import json

import mkdocs_gen_files

from toolkit.cli import build_parser
from toolkit.docs import cli_reference, recipe_reference
from toolkit.recipe import json_schema

with mkdocs_gen_files.open("reference/cli.md", "w") as page:
    page.write(cli_reference(build_parser()))
with mkdocs_gen_files.open("reference/recipe.md", "w") as page:
    page.write(recipe_reference(json.loads(json.dumps(json_schema()))))
