"""Offline wheels for the in-image step, for the image's Python, fetched with pip and cached."""

from __future__ import annotations

import shutil
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from toolkit.errors import InputError
from toolkit.inputs import cache_dir, pip_download

# what `python3 -m toolkit.submission.inimage` imports, with their own dependencies, pinned to this machine's versions
IN_IMAGE_PACKAGES = ("libcst", "pyyaml", "pydantic", "pydantic-core", "typing-extensions", "annotated-types",
                     "typing-inspection", "packaging")


def pins() -> list[str]:
    out = []
    for name in IN_IMAGE_PACKAGES:
        try:
            out.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            raise InputError(f"{name} is not installed here, so its version cannot be pinned for the image",
                              hint="pip install -e . (it brings every in-image dependency)") from None
    return out


def platforms(platform: str) -> list[str]:
    arch = platform.rsplit("_", 1)[-1] if platform.endswith(("x86_64", "aarch64")) else "x86_64"
    arch = "x86_64" if platform.endswith("x86_64") else arch
    return [f"manylinux_2_{v}_{arch}" for v in (28, 17)] + [f"manylinux2014_{arch}", f"manylinux1_{arch}"]


def fetch_wheel(requirement: str, python: str, platform: str) -> Path:
    """One pinned wheel (name==version) for the image's CPython, e.g. a package the in-image step installs."""
    return fetch_wheels(python, platform, [requirement])[0]


def fetch_wheels(python: str, platform: str, requirements: list[str] | None = None) -> list[Path]:
    """One wheel per pinned package for the image's CPython (cached; pip runs only on a miss).

    Default: the in-image step's own dependencies, pinned to this machine's versions."""
    requirements = pins() if requirements is None else requirements
    folder = cache_dir() / "wheels" / f"cp{python.replace('.', '')}-{platform}"
    folder.mkdir(parents=True, exist_ok=True)
    found: list[Path] = []
    missing: list[str] = []
    for req in requirements:
        name, _, version = req.partition("==")
        prefix = name.replace("-", "_").lower()
        hits = [w for w in folder.glob("*.whl") if w.name.lower().startswith(f"{prefix}-{version}-")]
        (found.extend(hits[:1]) if hits else missing.append(req))
    if missing:
        print(f"fetching {len(missing)} wheel(s) for CPython {python} ({platform}) with pip: {', '.join(missing)}",
              file=sys.stderr)
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            pip_download(missing, Path(tmp), python=python, platforms=platforms(platform), implementation="cp")
            for wheel in Path(tmp).glob("*.whl"):
                shutil.move(str(wheel), folder / wheel.name)
                found.append(folder / wheel.name)
    return sorted(found, key=lambda p: p.name.lower())
