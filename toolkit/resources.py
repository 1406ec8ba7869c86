"""The files the toolkit reads at run time besides its modules: the Dockerfile template, templates/, the patches a
recipe may deploy (`patches: toolkit:`), the recipe layers (`include: toolkit:NAME`) and the recipe JSON Schema.

The checkout's top-level folders are their one source. A wheel carries them under `toolkit/_data/` (the build
backend copies them there: pyproject.toml's force-include); a checkout or an editable install reads them where
they are. Nothing here imports anything but the standard library and the errors module.
"""

from __future__ import annotations

from pathlib import Path

from toolkit.errors import ToolkitError

PACKAGE = Path(__file__).resolve().parent
BUNDLED = PACKAGE / "_data"  # in an installed wheel
CHECKOUT = PACKAGE.parent  # a checkout, or an editable install of one
# name -> where the checkout keeps it (the wheel keeps it as _data/<name>)
LAYOUT = {"Dockerfile.j2": "Dockerfile.j2", "templates": "templates", "patches": "patches/src",
          "schema.json": "recipes/schema.json", "layers": "layers"}
TOOLKIT_PATCHES = "toolkit:"  # `patches: toolkit:` in a recipe: the toolkit's own patches folder


def resource(name: str) -> Path:
    """Where one of LAYOUT's files or folders is, for this installation."""
    bundled = BUNDLED / name
    if bundled.exists():
        return bundled
    checkout = CHECKOUT / LAYOUT[name]
    if checkout.exists():
        return checkout
    raise ToolkitError(f"the toolkit's {name} is not installed: neither {bundled} nor {checkout} exists",
                       hint="reinstall the toolkit (`pip install vllm-recipe-toolkit`, or `pip install -e CHECKOUT` "
                       "for a checkout): a wheel carries it under toolkit/_data")
