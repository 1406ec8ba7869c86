"""Docker through the SDK: build the submission image, verify inside it, compare with a host apply."""

from __future__ import annotations

import io
import shutil
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

import docker
import docker.errors
import git

from toolkit.engine.plan import Engine
from toolkit.engine.writer import commit
from toolkit.errors import EXIT_FAILED, ToolkitError
from toolkit.inputs import Root
from toolkit.recipe import LoadedRecipe, load_recipe
from toolkit.submission.inimage import bundled_pinned
from toolkit.submission.render import IMAGE_PAYLOAD, PAYLOAD
from toolkit.transforms.base import ModuleEdit
from toolkit.trial import untried_here

Log = Callable[[str], None]


class ImageError(ToolkitError):
    exit_code = EXIT_FAILED


def client() -> docker.DockerClient:
    try:
        c = docker.from_env()
        c.ping()
    except docker.errors.DockerException as exc:
        raise ToolkitError(f"no Docker engine reachable ({exc})",
                           hint="start dockerd, or point DOCKER_HOST at its socket") from None
    return c


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ImageBuild:
    tag: str
    image_id: str
    log: list[str]


def committed_context(outdir: Path) -> io.BytesIO:
    """The build context the platform sees: `git archive` of the committed tree (after .gitattributes), not
    OUTDIR's working files, which may hold what git would change or leave out."""
    context = io.BytesIO()
    git.Repo(outdir).archive(context, treeish="HEAD", format="tar")
    context.seek(0)
    return context


@dataclass(frozen=True)
class StreamError:
    error: str


def whole_lines(chunks: Iterable[dict[str, Any]]) -> Iterator[str | StreamError]:
    """The build stream's text as whole lines, and its error: Docker cuts its `stream` text into chunks anywhere,
    also inside a line (an `[ok]` or `[FAIL]` line cut in two would be printed, and looked for, as two)."""
    pending = ""
    for chunk in chunks:
        pending += chunk.get("stream") or ""
        *done, pending = pending.split("\n")
        yield from (line.rstrip("\r") for line in done)
        if "error" in chunk:
            if pending:
                yield pending.rstrip("\r")
                pending = ""
            yield StreamError(str(chunk["error"]).strip())
    if pending:
        yield pending.rstrip("\r")


def build_image(outdir: Path, tag: str, log: Log = _print) -> ImageBuild:
    """`docker build` of the committed submission with the legacy builder and no network, streaming the log."""
    api = client().api
    lines: list[str] = []
    error = None

    def keep(line: str) -> None:
        if line.strip():
            lines.append(line)
            log(line)

    stream = api.build(fileobj=committed_context(outdir), custom_context=True, tag=tag, rm=True, forcerm=True,
                       decode=True, network_mode="none")
    for item in whole_lines(stream):
        if isinstance(item, str):
            keep(item)
        else:
            error = item.error
            keep(error)
    if error is not None:
        fails = [ln for ln in lines if ln.startswith("[FAIL]")]
        raise ImageError("image build failed: " + ("; ".join(fails) if fails else error),
                         hint="the [FAIL] lines name the transform and recipe line; fix the recipe or base image")
    image = api.inspect_image(tag)  # type: ignore[no-untyped-call]
    return ImageBuild(tag, image["Id"], lines)


def run_in_image(tag: str, command: list[str]) -> tuple[int, str]:
    c = client()
    container = c.containers.create(tag, command=command, network_mode="none")
    try:
        container.start()
        status = container.wait()
        output = container.logs(stdout=True, stderr=True).decode("utf-8", "replace")
        return int(status.get("StatusCode", 1)), output
    finally:
        container.remove(force=True)


def verify_in_image(tag: str, recipe_file: str) -> tuple[int, str]:
    payload = IMAGE_PAYLOAD
    command = (f'PYTHONPATH="{payload}/site:{payload}/src" python3 -m toolkit.submission.inimage --verify-only '
               f'"{payload}/recipe/{recipe_file}"')
    return run_in_image(tag, ["bash", "-c", command])


def copy_out(tag: str, paths: list[str], dest: Path) -> None:
    """Copy folders or files out of an image into dest, keeping their absolute layout."""
    c = client()
    container = c.containers.create(tag, command=["true"], network_mode="none")
    try:
        for path in paths:
            try:
                stream, _ = container.get_archive(path)
            except docker.errors.NotFound:
                raise ToolkitError(f"{path} does not exist in image {tag}",
                                   hint="check vendor.roots in the recipe against the image") from None
            target = dest / path.lstrip("/")
            if target.exists():
                raise ToolkitError(f"{target} exists", hint="pull into an empty folder")
            with tempfile.TemporaryDirectory(dir=dest) as tmp, \
                    tarfile.open(fileobj=io.BytesIO(b"".join(stream))) as tar:
                tar.extractall(tmp, filter="tar")  # refuses absolute paths and .. escapes
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.move(str(Path(tmp) / PurePosixPath(path).name), target)
    finally:
        container.remove(force=True)


def vendor_pull(loaded: LoadedRecipe, dest: Path, image: str | None = None) -> list[str]:
    """Extract the recipe's vendor roots from the base image into a rootfs folder for apply/diff/verify."""
    tag = image or loaded.recipe.base_image.reference
    try:
        client().images.get(tag)
    except docker.errors.ImageNotFound:
        raise ToolkitError(f"image {tag} is not present in the engine",
                           hint=f"docker pull {tag} (or load it) first; toolkit never pulls implicitly") from None
    dest.mkdir(parents=True, exist_ok=True)
    copy_out(tag, list(loaded.recipe.vendor.roots), dest)
    return list(loaded.recipe.vendor.roots)


@dataclass(frozen=True)
class Comparison:
    compared: int
    differences: list[str]


def compare_with_host(loaded: LoadedRecipe, base_image: str, built_image: str, work: Path) -> Comparison:
    """The patched files in the built image must equal a host apply on the base image's pristine roots.

    The host apply reads the sources the payload bundles; what needs a source fetched at image build is left out
    of the comparison (the in-image verify covers it)."""
    recipe = loaded.recipe
    pristine = work / "pristine"
    vendor_pull(loaded, pristine, base_image)
    roots = [Root(r, pristine / r.lstrip("/")) for r in recipe.vendor.roots]
    pinned = bundled_pinned(loaded)
    skip = frozenset(untried_here(recipe, pinned))
    # roots only: image-level links need the whole image
    plan = Engine(loaded, roots, None, pinned=pinned, skip=skip).run()
    if not plan.ok:
        raise ImageError("host apply on the pulled base image drifted", hint="run `toolkit apply` on it to see why")
    commit(plan.ops)
    patched = work / "patched"
    patched.mkdir()
    copy_out(built_image, list(recipe.vendor.roots), patched)
    files = sorted({t.file for t in recipe.for_package(recipe.vendor.package)
                    if isinstance(t, ModuleEdit) and t.id not in skip})
    differences = []
    compared = 0
    for root in recipe.vendor.roots:
        for rel in files:
            host = pristine / root.lstrip("/") / rel
            image = patched / root.lstrip("/") / rel
            compared += 1
            if not image.is_file() or host.read_bytes() != image.read_bytes():
                differences.append(f"{root}/{rel}")
    return Comparison(compared, differences)


def image_flow(outdir: Path, tag: str, log: Log = _print) -> dict[str, Any]:
    """Build, verify inside, compare with the host; returns a summary for the report."""
    recipes = sorted((outdir / PAYLOAD / "recipe").glob("*.yaml"))
    if len(recipes) != 1:
        raise ToolkitError(f"{outdir} has no single resolved recipe in {PAYLOAD}/recipe")
    loaded = load_recipe(recipes[0])
    built = build_image(outdir, tag, log)
    code, output = verify_in_image(tag, recipes[0].name)
    for line in output.splitlines():
        log(line)
    if code != 0:
        raise ImageError(f"toolkit verify inside {tag} failed (exit {code})", hint="see the [FAIL] lines above")
    with tempfile.TemporaryDirectory() as tmp:
        comparison = compare_with_host(loaded, loaded.recipe.base_image.reference, tag, Path(tmp))
    if comparison.differences:
        raise ImageError("patched files in the image differ from a host apply: " + ", ".join(comparison.differences),
                         hint="the in-image step and `toolkit apply` must produce the same bytes; report this")
    return {"image": tag, "image_id": built.image_id, "compared_files": comparison.compared,
            "ok_lines": sum(1 for ln in built.log if ln.startswith("[ok]"))}
