"""schema: the recipe JSON Schema, derived from the recipe models (recipes/schema.json is the committed copy)."""

from __future__ import annotations

import json

from toolkit.recipe import json_schema


def schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
