"""Test helpers shipped with the package: a per-kind check in the spirit of LibCST's codemod test case (source in,
transform, expected source and state out, through the engine's own per-file evaluation), and a local stand-in for
the vendor base image for the tests with a real Docker engine."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from toolkit.corexlike import COREX_ROOTS, make_rootfs
from toolkit.engine.evaluate import evaluate
from toolkit.markers import strip_markers
from toolkit.recipe import Transform
from toolkit.results import State
from toolkit.transforms import edit_kind
from toolkit.transforms.base import Context, ModuleEdit

PROVENANCE = {"why": "a test", "remove_when": "never"}


def check_kind(spec: dict[str, Any], before: str, after: str | None, state: State = State.WOULD_APPLY, *,
               patches_dir: Path = Path("."), version: str | None = None) -> str:
    """Plan one source transform (a recipe entry without `why`/`remove_when`/`file`) on `before` and assert its
    state and, when it rewrites, the result without markers (`after`; None: not compared); then assert that the
    result is idempotent (a second plan: ALREADY_APPLIED, same text) and checks clean. Returns the planned text."""
    model = TypeAdapter(Transform).validate_python({"id": "t", "file": "m.py", **PROVENANCE, **spec})
    assert isinstance(model, ModuleEdit), f"{model.kind} is not a source kind"
    kind = edit_kind(model, Context(patches_dir=patches_dir))
    planned = evaluate("m.py", before.encode(), [kind], version)
    verdict = planned.states[0]
    assert verdict.state is state, f"expected {state.value}, got {verdict.state.value}: {verdict.message}"
    if state is not State.WOULD_APPLY:
        return before
    assert planned.text is not None
    if after is not None:
        assert strip_markers(planned.text) == after, f"planned:\n{planned.text}"
    again = evaluate("m.py", planned.text.encode(), [kind], version)
    assert [v.state for v in again.states] == [State.ALREADY_APPLIED], again.states
    assert again.text == planned.text, "a second plan changed the text"
    checked = evaluate("m.py", planned.text.encode(), [kind], version, check=True)
    assert not checked.drifted, checked.states
    return planned.text


# -- a local stand-in for the vendor base image (tests with a real Docker engine) -------------------

# Debian's python3.11 and what it needs to run, unpacked with dpkg-deb: no registry is reachable
# from the engine, so base images are made from local files and `docker import`ed.
DEBIAN_PYTHON_PACKAGES = (
    "python3.11-minimal", "libpython3.11-minimal", "libpython3.11-stdlib", "python3.11", "media-types",
    "libc6", "libexpat1", "zlib1g", "bash", "libtinfo6", "coreutils", "libssl3", "libffi8", "libselinux1",
    "libpcre2-8-0", "libacl1", "libattr1", "libgmp10", "libcap2", "libzstd1", "liblzma5", "libbz2-1.0",
    "libncursesw6", "libreadline8", "libsqlite3-0", "libuuid1", "libcrypt1", "libtirpc3", "libnsl2", "libdb5.3",
    "libgssapi-krb5-2", "libkrb5-3", "libk5crypto3", "libcom-err2", "libkrb5support0", "libkeyutils1",
    "libgcc-s1", "libstdc++6",
)


def debian_python_rootfs() -> Path:
    """Debian's Python 3.11 unpacked into a folder (cached): the base of the stand-in vendor image."""
    import subprocess

    from toolkit.inputs import cache_dir, cached_tree

    def build(root: Path, debs: Path) -> None:
        proc = subprocess.run(["apt-get", "download", *DEBIAN_PYTHON_PACKAGES], cwd=debs, capture_output=True,
                              text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"apt-get download failed (run `apt-get update` first): {proc.stderr[-2000:]}")
        for deb in sorted(debs.glob("*.deb")):
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True)
        (root / "usr/bin/python3").unlink(missing_ok=True)
        os.symlink("python3.11", root / "usr/bin/python3")
        (root / "tmp").mkdir(exist_ok=True)
        os.chmod(root / "tmp", 0o1777)

    return cached_tree(cache_dir() / "docker-base" / "debian-python3.11", build)


def make_base_image(tag: str, reference: Path, *, edit: Callable[[Path], None] | None = None) -> str:
    """A CoreX-like image: Debian's Python plus the vLLM files under both CoreX roots; `edit` may drift it."""
    import io
    import tarfile
    import tempfile

    import docker

    from toolkit.inputs import COMPLETE

    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp) / "rootfs"
        shutil.copytree(debian_python_rootfs(), rootfs, symlinks=True)
        (rootfs / COMPLETE).unlink()
        make_rootfs(reference, rootfs)
        if edit is not None:
            edit(rootfs)
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            tar.add(rootfs, arcname=".")
        # the vendor image puts its site-packages on PYTHONPATH; lib64 first, as CoreX does
        pythonpath = ":".join(reversed(COREX_ROOTS))
        api = docker.from_env().api
        api.import_image_from_data(buffer.getvalue(), repository=tag.rsplit(":", 1)[0], tag=tag.rsplit(":", 1)[1],
                                   changes=[f"ENV PYTHONPATH={pythonpath}", "ENV PATH=/usr/local/bin:/usr/bin:/bin",
                                            'CMD ["python3"]'])
    return tag


def make_userland_image(tag: str) -> str:
    """An image that holds only this machine's /etc and the merged-/usr links: run with /usr (and the Python and
    environment to use) mounted read-only, it is this machine's userland in a container. For running the cached
    CPU test server with `docker run` in tests, where no registry is reachable."""
    import io
    import tarfile

    import docker

    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        for name in ("tmp", "root", "dev", "proc", "sys", "run", "usr", "var/tmp"):
            info = tarfile.TarInfo(name)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if name.endswith("tmp") else 0o755
            tar.addfile(info)
        for link in ("bin", "lib", "lib64", "sbin"):
            if Path("/", link).is_symlink():
                info = tarfile.TarInfo(link)
                info.type, info.linkname = tarfile.SYMTYPE, os.readlink(Path("/", link))
                tar.addfile(info)
        # passwd/group (getpass), ld.so.cache (multiarch library folders), the rest of /etc as this machine has it
        tar.add("/etc", arcname="etc", filter=lambda m: None if m.issym() and m.name.endswith("mtab") else m)
    repository, _, version = tag.rpartition(":")
    docker.from_env().api.import_image_from_data(buffer.getvalue(), repository=repository, tag=version,
                                                 changes=["ENV PATH=/usr/local/bin:/usr/bin:/bin", 'CMD ["bash"]'])
    return tag
