"""`toolkit preflight`: each variant's exact argv through the patched vendor tree's own parser, engine arguments
and config construction, on a CPU with the recipe's accelerators emulated; then the parsers and the model's
architecture through the patched registries, the env switches the deployed code reads, and the vendor's own KV
cache block size. What the vendor raises is reported as it raised it, by variant.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from toolkit.engine.plan import ROOTFS_LABEL, Engine, Step, run_packages
from toolkit.engine.state import STATE_FILE
from toolkit.engine.writer import commit
from toolkit.errors import ToolkitError
from toolkit.inputs import Root, cache_dir, package_roots, reference_root, remember, rootfs_roots
from toolkit.lint import lint
from toolkit.lint.kv import GIB, estimate
from toolkit.pyenv import build_key, script
from toolkit.recipe import LoadedRecipe, ModelShape, Recipe
from toolkit.results import Finding, Report
from toolkit.runtime import standins
from toolkit.submission.render import argv
from toolkit.transforms.deploy import Deploy
from toolkit.transforms.symlink import Symlink
from toolkit.trial import lacking_sources, reference_rootfs, untried_here
from toolkit.variants import Variant
from toolkit.variants import find as find_variant

STAGES = Path(__file__).with_name("stages.py")
# read by the interpreter or the platform, not by code in the tree
OUTSIDE_THE_TREE = ("PYTHON", "CUDA_", "NCCL_", "HF_", "TRANSFORMERS_", "OMP_")


@dataclass(frozen=True)
class Stage:
    stage: str
    ok: bool
    message: str
    type: str = ""
    where: str = ""

    def describe(self) -> str:
        return f"{self.type}: {self.message}" if self.type else self.message


@dataclass
class Outcome:
    """One variant: the vendor's verdict, stage by stage, and lint's."""

    variant: str
    stages: list[Stage] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    kv: dict[str, Any] = field(default_factory=dict)
    lint_errors: list[str] = field(default_factory=list)  # "rule: message"
    not_checked: list[str] = field(default_factory=list)
    standins: dict[str, Any] = field(default_factory=dict)  # the GPU libraries stood in, and what was called
    not_a_submission: list[str] = field(default_factory=list)  # "rule: message" only the platform requires

    @property
    def starts(self) -> bool:
        return all(s.ok for s in self.stages)

    def as_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "starts": self.starts, "stages": [dict(s.__dict__) for s in self.stages],
                "config": self.config, "kv": self.kv, "lint_errors": self.lint_errors,
                "not_checked": self.not_checked, "standins": self.standins,
                "not_a_submission": self.not_a_submission}


def model_config(model: ModelShape, max_model_len: int, folder: Path, fallback: bool = False,
                 env: dict[str, str] | None = None) -> Path:
    """A config.json with the recipe's model shape (no weights: the vendor's config code reads only this).

    fallback: as the recipe's config_fallback model, when the served model's config classes are not here; a flat
    config that serializes layers_block_type where the served config's classes would compute it (with `env`)."""
    if fallback and model.config_fallback is not None:
        model = model.model_copy(update={"architecture": model.config_fallback.architecture,
                                         "model_type": model.config_fallback.model_type, "text_config": False,
                                         "layers_block_type": model.counts_full_attention_only(env or {})})
    if model.architecture is None or model.model_type is None:
        raise ToolkitError("preflight needs the served model's architecture and model_type",
                           hint="set model.architecture and model.model_type in the recipe, or pass "
                           "--model-config DIR (a folder with the model's config.json)")
    layer_types = ["full_attention" if (i + 1) % model.full_attention_interval == 0 else "linear_attention"
                   for i in range(model.num_layers)]
    shape: dict[str, Any] = {
        "hidden_size": model.hidden_size, "num_hidden_layers": model.num_layers, "head_dim": model.head_dim,
        "num_key_value_heads": model.num_kv_heads,
        "num_attention_heads": model.num_attention_heads or model.hidden_size // model.head_dim,
        "max_position_embeddings": max(max_model_len, 262144), "torch_dtype": model.dtype, "vocab_size": 32000,
        "rms_norm_eps": 1e-6,
        "layer_types": layer_types, "full_attention_interval": model.full_attention_interval,
    }
    data: dict[str, Any] = {"architectures": [model.architecture], "model_type": model.model_type}
    if model.text_config:  # a composite config (Qwen3.5/3.6): the text model's shape under text_config
        data.update(torch_dtype=model.dtype, text_config=shape)
    else:
        data.update(shape)
    if model.layers_block_type is True:  # serialized by the checkpoint (a switch: the config classes compute it)
        data["layers_block_type"] = ["attention" if t == "full_attention" else "linear_attention"
                                     for t in layer_types]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data, indent=2))
    return folder


@dataclass(frozen=True)
class Tree:
    """Where the patched packages are, first on the runtime's sys.path, and what could not be patched here."""

    paths: list[Path]
    vendor: Path
    untried: dict[str, str]
    where: str
    reference: bool = False  # a CoreX-like copy of the public release, not the image's own files
    # each transform's change to each file it wrote here, in order (empty for roots patched beforehand): what
    # says which transform wrote a line a traceback points at
    steps: tuple[tuple[Path, Step], ...] = ()


def _root_items(recipe: Recipe, package: str) -> set[str]:
    """What of a root the runtime needs: the package, and what the recipe deploys beside it (native_fastpaths)."""
    names = {package}
    for t in recipe.for_package(package):
        if isinstance(t, Deploy) and not t.dest.startswith("/"):
            names.add(PurePosixPath(t.dest).parts[0])
    return names


def _copy_root(source: Path, target: Path, package: str, names: set[str]) -> Path:
    """The package (with its metadata) and the named items of a root, copied: never the rest of an image's
    site-packages, whose GPU builds (torch for the device) would shadow the runtime's own."""
    target.mkdir(parents=True)
    skip = shutil.ignore_patterns("__pycache__")
    for name in sorted(names):
        item = source / name
        if item.is_dir():
            shutil.copytree(item, target / name, symlinks=True, ignore=skip)
        elif item.is_file():
            shutil.copy2(item, target / name)
    for meta in source.glob(f"{package.replace('-', '_')}-*.dist-info"):
        shutil.copytree(meta, target / meta.name, symlinks=True)
    # what toolkit apply recorded there (pristine and patched digests): without it an already-applied root reads
    # as foreign content, and build would refuse what apply accepts on the same root
    state = source / STATE_FILE
    if state.is_file():
        (target / STATE_FILE).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(state, target / STATE_FILE)
    return target


def _package_sources(loaded: LoadedRecipe, rootfs: Path | None, given: dict[str, str]) -> dict[str, Path]:
    """Where each declared package that transforms edit is read from: its roots under the rootfs (or
    --package-root) when there are any, else the release the trial uses."""
    recipe = loaded.recipe
    out: dict[str, Path] = {}
    for package in recipe.packages:
        if not recipe.for_package(package.name):
            continue
        if rootfs is not None and (package.name in given or package.roots or package.trial_release is None):
            # with neither roots nor a release, package_roots says what to pass
            out[package.name] = package_roots(recipe, package.name, rootfs, given)[0].path
        elif package.trial_release is not None:
            out[package.name] = reference_root(package.trial_release, recipe.base_image.python,
                                               recipe.base_image.platform).path
    return out


def patched_copy(loaded: LoadedRecipe, pinned: dict[str, Path], work: Path, rootfs: Path | None = None,
                 given: dict[str, str] | None = None, image: Path | None = None) -> Tree:
    """The recipe applied to a copy of the vendor roots under `rootfs` (checked as the image is: version and
    replacement contracts), or by default of the CoreX-like reference tree; each package from its roots or
    its release. With `image` (a folder this call creates), what the recipe deploys at absolute paths in the image
    (the chat template) is written under it."""
    recipe = loaded.recipe
    exact = rootfs is not None
    base = rootfs if rootfs is not None else reference_rootfs(recipe)[0]
    package = recipe.vendor.package
    vendor = _copy_root(rootfs_roots(recipe, base)[0].path, work / "vendor", package, _root_items(recipe, package))
    untried = untried_here(recipe, pinned)
    skip = set(untried)
    if image is not None:
        image.mkdir(parents=True)
        # links into the image's own libraries: nothing on this machine to point at, and nothing here loads them
        skip |= {t.id for t in recipe.transforms if isinstance(t, Symlink) and t.link.startswith("/")}
    engines = [Engine(loaded, [Root(recipe.vendor.roots[0], vendor)], image, pinned=pinned,
                      skip=frozenset(skip), check_version=exact, check_replaced=exact)]
    paths = [vendor]
    for name, source in _package_sources(loaded, rootfs, given or {}).items():
        target = _copy_root(source, work / name, name, _root_items(recipe, name))
        engines.append(Engine(loaded, [Root(str(target), target)], None, pinned=pinned, skip=frozenset(untried),
                              package=name))
        paths.insert(0, target)
    plan = run_packages(engines)
    where = f"the vendor roots under {rootfs}" if exact else "the reference tree"
    if not plan.ok:
        drifted = sorted({r.transform for r in plan.results if not r.state.ok})
        raise ToolkitError(f"the recipe does not apply to {where}: {', '.join(drifted)} DRIFTED",
                           hint=f"see `toolkit diff RECIPE {f'--rootfs {rootfs}' if exact else '--reference'}`")
    commit(plan.ops)
    where_is = {root.label: root.path for engine in engines for root in engine.roots}
    if image is not None:
        where_is[ROOTFS_LABEL] = image
    steps = tuple((where_is[step.root] / step.file.lstrip("/"), step) for step in plan.steps
                  if step.root in where_is)
    if exact:
        return Tree(paths, vendor, untried, f"a copy of the vendor roots under {rootfs} with the recipe applied",
                    steps=steps)
    return Tree(paths, vendor, untried, _reference_where(recipe), reference=True, steps=steps)


def _reference_where(recipe: Recipe) -> str:
    return f"a copy of {recipe.vendor.reference} (CoreX-like) with the recipe applied"


def given_tree(loaded: LoadedRecipe, rootfs: Path, given: dict[str, str], work: Path) -> Tree:
    """Vendor roots the recipe was already applied to (an extracted image, a test rootfs), copied as they are."""
    recipe = loaded.recipe
    package = recipe.vendor.package
    vendor = _copy_root(rootfs_roots(recipe, rootfs)[0].path, work / "vendor", package, _root_items(recipe, package))
    paths = [vendor]
    for name in (p.name for p in recipe.packages if recipe.for_package(p.name)):
        source = package_roots(recipe, name, rootfs, given)[0].path
        paths.insert(0, _copy_root(source, work / name, name, _root_items(recipe, name)))
    return Tree(paths, vendor, {}, f"the patched roots under {rootfs}")


def _dropped_flags(recipe: Recipe, missing: set[str]) -> dict[str, str]:
    """Flags that depend on a source whose files could not be deployed here (it adds them, or vLLM takes them only
    for the multimodal model it registers): not checked, said so."""
    dropped = {flag.lstrip("-"): f"added by source {s.name}" for s in recipe.sources if s.name in missing
               for flag in s.provides_flags}
    for source in recipe.sources:
        if source.name in missing and source.registers_multimodal:
            dropped["limit-mm-per-prompt"] = f"taken for the multimodal model source {source.name} registers"
    return dropped


def _claimed_parsers(recipe: Recipe, missing: set[str]) -> dict[str, str]:
    return {p: s.name for s in recipe.sources if s.name in missing for p in s.provides_tool_parsers}


def run(loaded: LoadedRecipe, variants: list[Variant], tree: Tree, python: Path,
        model_dir: Path | None = None) -> list[Outcome]:
    recipe = loaded.recipe
    missing_sources = lacking_sources(recipe, tree.untried)
    dropped = _dropped_flags(recipe, missing_sources)
    claimed = _claimed_parsers(recipe, missing_sources)
    fallback = bool(missing_sources) and model_dir is None and recipe.model is not None \
        and recipe.model.config_fallback is not None
    outcomes: list[Outcome] = []
    requests = []
    with tempfile.TemporaryDirectory(prefix="toolkit-preflight-") as tmp:
        for variant in variants:
            applied = variant.apply(recipe)
            words = argv(applied)[3:]
            outcome = Outcome(variant.name)
            kept: list[str] = []
            skip_value = False
            for i, word in enumerate(words):
                if skip_value:
                    skip_value = False
                    continue
                name = word[2:] if word.startswith("--") else None
                if name in dropped:
                    outcome.not_checked.append(f"--{name} ({dropped[name]}, not available here)")
                    skip_value = i + 1 < len(words) and not words[i + 1].startswith("--")
                    continue
                kept.append(word)
            max_len = applied.serve.args.get("max-model-len")
            folder = model_dir or model_config(recipe.model or _no_model(), int(str(max_len or 4096)),
                                               Path(tmp) / variant.name, fallback, dict(applied.env))
            requests.append({"name": variant.name, "argv": kept, "model_dir": str(folder), "env": dict(applied.env),
                             "expected_backend": applied.attention_backend()})
            linted = lint(loaded, applied, variant=variant.name, for_submission=False)
            outcome.lint_errors = [f"{i.rule}: {i.message}" for i in linted.refusals]
            outcome.not_a_submission = [f"{i.rule}: {i.message}" for i in linted.not_a_submission]
            outcomes.append(outcome)
        # both accountings come from the served config's classes; a fallback config serializes one of them
        switch = recipe.model.layers_block_type if recipe.model is not None and not fallback else None
        request = {"kv_switch": switch.model_dump() if not isinstance(switch, bool | None) else None,
                   "attention_backends": recipe.base_image.attention_backends,
                   "prefix_state": recipe.model.prefix_state if recipe.model is not None and not missing_sources
                   else None,
                   "variants": requests, "roots": [str(tree.vendor)], "trees": [str(p) for p in tree.paths],
                   "env": sorted(recipe.env)}
        # one process for every variant: importing vLLM once costs seconds
        result = _run_stages(python, tree, request, loaded)
    by_name = {v["name"]: v for v in result["variants"]}
    for outcome in outcomes:
        data = by_name[outcome.variant]
        outcome.stages = []
        for s in data["stages"]:
            stage = Stage(s["stage"], s["ok"], s["message"], s.get("type", ""), s.get("where", ""))
            parser = str(recipe.serve.args.get("tool-call-parser") or "")
            if stage.stage == "tool-parser" and not stage.ok and parser in claimed:
                outcome.not_checked.append(f"tool parser {parser} (registered by source {claimed[parser]}, not "
                                           "available here)")
                continue
            if stage.stage == "architecture" and fallback:
                outcome.not_checked.append(f"the served architecture (config built as the recipe's config_fallback "
                                           f"{stage.message.split(' -> ')[0]}: the served model's config classes come "
                                           f"from {', '.join(sorted(missing_sources))})")
                rule = recipe.model.layers_block_type if recipe.model is not None else False
                if not isinstance(rule, bool):
                    outcome.not_checked.append(
                        f"the layers_block_type the served config classes compute ({rule.switch}): the fallback "
                        "config declares what they would, so the vendor's KV numbers hold only if the transforms on "
                        "them apply (the in-image step tries them)")
                continue
            outcome.stages.append(stage)
        outcome.config = data.get("config", {})
        outcome.standins = result.get("standins") or {}
        outcome.kv = data.get("kv", {})
        if missing_sources:
            outcome.not_checked.append(f"what source(s) {', '.join(sorted(missing_sources))} register (tool and "
                                       "reasoning parsers, the model's module) is checked by the in-image step")
            if recipe.model is not None and recipe.model.prefix_state == "exact-checkpoints":
                outcome.not_checked.append("the prefix-state hooks (the model's GatedDeltaNet comes from "
                                           f"{', '.join(sorted(missing_sources))}: the in-image step applies them)")
    env_reads = result.get("env", {})
    for outcome in outcomes:
        unread = [n for n, where in env_reads.items() if not where and not n.startswith(OUTSIDE_THE_TREE)
                  and not recipe.base_image.env_reader(n)]
        if unread and not missing_sources:
            outcome.stages.append(Stage("env", False, f"set by the recipe but read by no code in the patched tree: "
                                        f"{', '.join(unread)}", "EnvUnread"))
    return outcomes


def _no_model() -> ModelShape:
    raise ToolkitError("preflight needs the served model's shape",
                       hint="add a `model:` section to the recipe, or pass --model-config DIR")


def emulated_devices(recipe: Recipe) -> dict[str, Any]:
    """The recipe's accelerators as the runtime emulates them (count, memory; the capability the vendor's pynvml
    reports before its platform code overrides it)."""
    return {"count": recipe.hardware.count, "memory_gb": recipe.hardware.memory_gb, "capability": [7, 0]}


def _run_stages(python: Path, tree: Tree, request: dict[str, Any], loaded: LoadedRecipe) -> dict[str, Any]:
    recipe = loaded.recipe
    env = {"PATH": "/usr/bin:/bin", "HOME": str(Path.home()),
           "VLLM_LOGGING_LEVEL": "WARNING", "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1",
           "DO_NOT_TRACK": "1",
           **standins.environment(cache_dir() / "runtime", recipe.base_image.gpu_library_names, tree.paths,
                                  recipe.base_image.absent_modules, emulated_devices(recipe),
                                  kernels=recipe.kernel_modules())}
    proc = subprocess.run(script(python, STAGES), input=json.dumps(request), capture_output=True, text=True,
                          env=env, timeout=600)
    if proc.returncode != 0:
        raise ToolkitError(f"the patched vLLM could not be run on the CPU runtime ({tree.where}):\n"
                           + "\n".join(proc.stderr.strip().splitlines()[-12:]), hint=_where_hint(tree))
    try:
        data = json.loads(proc.stdout)
    except json.JSONDecodeError:
        raise ToolkitError("the preflight stages script printed no result: " + proc.stdout[-500:]) from None
    if not isinstance(data, dict):
        return {}
    failed = data.get("import_error")
    if failed:
        raise import_failure(loaded, tree, failed)
    return data


def _where_hint(tree: Tree) -> str:
    if tree.reference:
        return (f"this ran on {tree.where}, not on the image's own files; where the image differs, run on them: "
                "`toolkit vendor pull RECIPE -o DIR`, then --rootfs DIR")
    return "the traceback is the patched tree's own; `toolkit verify RECIPE --rootfs DIR` checks it compiles"


def import_failure(loaded: LoadedRecipe, tree: Tree, failed: dict[str, Any]) -> ToolkitError:
    """`import vllm` failed: an undeclared GPU library names the field to add it to; anything else says where."""
    module = str(failed.get("module") or "")
    where = failed.get("where") or "a file outside the patched trees"
    absent = [a for a in loaded.recipe.base_image.absent_modules if module == a or module.startswith(a + ".")]
    if failed.get("type") == "ModuleNotFoundError" and absent:
        return ToolkitError(
            f"the patched tree imports {module!r} at {where} unconditionally, and the recipe declares {absent[0]} "
            f"absent from the image ({loaded.where('base_image', 'gpu_libraries')}): on the image this import fails "
            f"too ({tree.where})",
            hint="guard the import (the vendor's selector falls back on ImportError), or correct `absent` if the "
                 "image does have it")
    if failed.get("type") == "ModuleNotFoundError" and module:
        # the missing module's own name when its package is in the tree (a compiled extension a copy lacks),
        # else its top-level library
        top = module.split(".")[0]
        name = module if any((Path(p) / top).is_dir() for p in tree.paths) else top
        return ToolkitError(
            f"the patched tree imports {module!r} at {where}, and {name} is neither installed in the CPU runtime "
            f"nor declared as a GPU library of the image ({tree.where})",
            hint=f"if only the image has it, add {name} to base_image.gpu_libraries "
            f"({loaded.where('base_image', 'gpu_libraries')}): "
            "preflight then stands it in; if it is a pure-Python package, the runtime lacks it (report it)")
    return ToolkitError(f"importing the patched vLLM failed at {where}: {failed.get('type')}: {failed.get('message')}",
                        hint=_where_hint(tree))


def kv_summary(recipe: Recipe, outcome: Outcome) -> str | None:
    """The vendor's KV block size against lint's estimate: the same bytes per token, and sequences per card."""
    kv = outcome.kv
    if not kv or recipe.model is None:
        return None
    args = outcome.config
    env = find_variant(recipe, outcome.variant).apply(recipe).env
    est = estimate(recipe.model, card_gib=recipe.hardware.memory_gb, overhead_gib=recipe.hardware.runtime_overhead_gb,
                   tp=int(args.get("tensor_parallel_size", 1)), max_model_len=int(args.get("max_model_len", 1)),
                   max_num_seqs=int(args.get("max_num_seqs", 1)),
                   max_num_batched_tokens=int(args.get("max_num_batched_tokens", 1)),
                   gpu_memory_utilization=float(args.get("gpu_memory_utilization", 0.9)), env=dict(env))
    per_token = int(kv["bytes_per_token"])
    max_len = int(args["max_model_len"])

    def fits(bytes_per_token: int) -> float:
        return est.kv_available_gib * GIB / (bytes_per_token * max_len)

    agree = "agrees with lint" if per_token == est.kv_per_token_bytes else (
        f"DISAGREES with lint's {est.kv_per_token_bytes} B/token")
    said = (f"KV: the vendor's CacheEngine block is {kv['block_bytes']} B ({kv['block_size']} tokens, "
            f"{kv['attention_layers']} of {kv['layers']} layers counted), {per_token} B/token/card, {agree}; "
            f"{fits(per_token):.2f} sequence(s) of {max_len} tokens fit per card in lint's "
            f"{est.kv_available_gib:.2f} GiB")
    both = kv.get("accountings") or {}
    if both:
        said += f"; by {kv['switch']}: " + "; ".join(
            f"{value}: {a['attention_layers']} layers, {a['block_bytes']} B per block, "
            f"{fits(int(a['bytes_per_token'])):.2f} sequence(s) per card" for value, a in both.items())
    return said



def standins_summary(record: dict[str, Any]) -> str | None:
    """What was stood in for the image's GPU libraries, and whether the vendor's code called any of it."""
    kernels = record.get("kernels") or []
    libraries = [name for name in record.get("libraries") or [] if name not in kernels]
    if not libraries and not kernels:
        return None
    modules = record.get("modules") or []
    calls = record.get("calls") or []
    used = ", ".join(sorted(modules)) or "none imported"
    if not calls:
        called = "preflight called none of them"
    else:
        seen = dict.fromkeys(f"{c['name']} from {c['where']}" + (f" (ran {c['mapped']})" if c.get("mapped") else
                                                                  " (raised)") for c in calls)
        called = f"preflight called {len(calls)}: " + "; ".join(seen)
    absent = sorted(set(record.get("absent_imports") or []))
    refused = (f"; absent from the image, so refused as there: {', '.join(absent)}" if absent else "")
    devices = record.get("devices")
    emulated = (f"; emulated {devices['count']} device(s) of {devices['memory_gb']:g} GiB in every Python it started"
                if devices else "")
    misses = sorted(set(record.get("patch_misses") or []))
    if misses:
        emulated += f" (NOT patched, so the device count there is the CPU's: {', '.join(misses)})"
    prebuilt = f" and the prebuilt kernels ({', '.join(kernels)})" if kernels else ""
    return (f"stood in for the image's GPU libraries ({', '.join(libraries)}){prebuilt}: {len(modules)} module(s): "
            f"{used}; {called}{refused}{emulated}")


def report(loaded: LoadedRecipe, outcomes: list[Outcome], where: str) -> Report:
    """One row per variant, the vendor's failures as findings, and how preflight and lint agree."""
    rows: list[tuple[str, ...]] = []
    findings: list[Finding] = []
    notes = [where]
    unchecked = Counter(n for o in outcomes for n in dict.fromkeys(o.not_checked))
    notes.extend(f"not checked here ({'every variant' if k == len(outcomes) else f'{k} of {len(outcomes)} variants'}"
                 f"): {n}" for n, k in unchecked.items())
    for o in outcomes:
        failed = [s for s in o.stages if not s.ok]
        detail = "; ".join(f"{s.stage}: {s.describe()}" for s in failed) or "; ".join(
            s.message for s in o.stages if s.stage == "architecture")
        if o.lint_errors and o.starts:
            notes.append(f"{o.variant}: lint error not reproduced by the vendor's code (a GPU-only failure, or a lint "
                         f"rule to revisit): {o.lint_errors[0]}")
        if failed and not o.lint_errors:
            notes.append(f"{o.variant}: the vendor's code refuses what lint missed: {failed[0].stage}: "
                         f"{failed[0].describe()}")
        notes.extend(f"{o.variant}: preflighted, but not a submission: {said}" for said in o.not_a_submission)
        rows.append((o.variant, "starts" if o.starts else "CANNOT START", "error" if o.lint_errors else
                     "warning" if o.not_a_submission else "ok", detail))
        findings.extend(Finding(s.stage, o.variant, s.where, s.describe()) for s in failed)
    said = standins_summary(outcomes[0].standins) if outcomes else None
    if said:
        notes.append(said)
    backends = Counter(s.message for o in outcomes for s in o.stages if s.stage == "attention-backend" and s.ok)
    notes.extend(f"attention backend ({'every variant' if k == len(outcomes) else f'{k} of {len(outcomes)} variants'}"
                 f"): {message}" for message, k in backends.items())
    kv = kv_summary(loaded.recipe, outcomes[0]) if outcomes else None
    if kv:
        notes.append(f"{outcomes[0].variant}: {kv}")
    starting = sum(o.starts for o in outcomes)
    notes.append(f"{starting} of {len(outcomes)} variant(s) start; the others fail in the vendor's own code (exit 2)")
    return Report("preflight", str(loaded.path), findings=tuple(findings), notes=tuple(notes),
                  columns=("variant", "verdict", "lint", "detail"), rows=tuple(rows),
                  extra={"variants": [o.as_json() for o in outcomes]})


def tree_digest(roots: list[Path]) -> str:
    """The files under each root by path and bytes; not its bytecode, nor the toolkit's state record (which says
    how the root came to be patched, and the vendor's code never reads)."""
    digest = hashlib.sha256()
    for index, root in enumerate(roots):
        digest.update(f"root {index}\0".encode())
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                           and p != root / STATE_FILE):
            data = path.read_bytes()
            digest.update(f"{path.relative_to(root).as_posix()}\0{len(data)}\0".encode()
                          + hashlib.sha256(data).digest())
    return digest.hexdigest()


def _key(loaded: LoadedRecipe, variants: list[Variant], python: Path, model_dir: Path | None, trees: object) -> str:
    """What a preflight result depends on: the recipe as resolved, the variants, the trees it runs on (`trees`: the
    pinned sources' cached paths, or the bytes of roots that may change), the model folder's bytes, the stages
    script, the runtime."""
    recipe = loaded.recipe.model_dump(mode="json")
    recipe.pop("patches", None)
    patches = sorted((p.relative_to(loaded.patches_dir).as_posix(), hashlib.sha256(p.read_bytes()).hexdigest())
                     for p in loaded.patches_dir.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    model = tree_digest([model_dir]) if model_dir is not None else None
    raw = json.dumps([recipe, patches, [v.name for v in variants], trees, model, str(python)], sort_keys=True)
    # the toolkit's own sources decide the patched tree, the stand-ins and the stages: any change runs it again
    toolkit_files = sorted(p for p in Path(standins.__file__).parents[1].rglob("*.py") if "__pycache__" not in p.parts)
    return build_key(raw, files=toolkit_files)


def _remembered(target: Path) -> list[Outcome] | None:
    if not target.is_file():
        return None
    return [Outcome(d["variant"], [Stage(**s) for s in d["stages"]], d["config"], d["kv"], d["lint_errors"],
                    d["not_checked"], d.get("standins", {}), d.get("not_a_submission", []))
            for d in json.loads(target.read_text())]


def cached_run(loaded: LoadedRecipe, variants: list[Variant], pinned: dict[str, Path], python: Path, work: Path,
               rootfs: Path | None = None, given: dict[str, str] | None = None, applied: bool = False,
               model_dir: Path | None = None) -> tuple[list[Outcome], Tree, bool]:
    """run() on a patched copy of the reference tree (rootfs: of the vendor roots under it; applied: those roots as
    they are) made in `work`, remembered by everything it depends on (True: from the cache). The reference and the
    pinned sources are cached by their pins, so their paths say their bytes; a rootfs is the user's and may change:
    its copy is keyed by its bytes, so `preflight` after `apply` and `build` on the same roots run the vendor's
    imports once, and a changed file runs them again."""
    if rootfs is None:
        target = cache_dir() / "preflight" / (_key(loaded, variants, python, model_dir, {
            name: str(tree) for name, tree in sorted(pinned.items())}) + ".json")
        remembered = _remembered(target)
        # remembered, nothing is copied: the tree is only named
        tree = patched_copy(loaded, pinned, work) if remembered is None else Tree(
            [], work, untried_here(loaded.recipe, pinned), _reference_where(loaded.recipe), reference=True)
    else:
        tree = given_tree(loaded, rootfs, given or {}, work) if applied else \
            patched_copy(loaded, pinned, work, rootfs, given)
        target = cache_dir() / "preflight" / (_key(loaded, variants, python, model_dir, [
            sorted(tree.untried.items()), tree_digest(tree.paths)]) + ".json")
        remembered = _remembered(target)
    if remembered is not None:
        return remembered, tree, True
    outcomes = run(loaded, variants, tree, python, model_dir)
    remember(target, json.dumps([o.as_json() for o in outcomes]))
    return outcomes, tree, False
