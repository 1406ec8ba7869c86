"""The lint rules: each learned from a configuration that failed at a slow remote start."""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from packaging.version import Version

from toolkit.lint import engine_client
from toolkit.lint.context import LintContext, rule
from toolkit.lint.kv import GIB, estimate, linear_state_bytes, vision_profile
from toolkit.lint.vllm_cli import (
    flags_in_source,
    python_files,
    release_flags,
    release_tool_parsers,
    tool_parsers_in_source,
)
from toolkit.resources import resource
from toolkit.results import Issue, Severity
from toolkit.transforms.base import ModuleEdit
from toolkit.transforms.deploy import Deploy
from toolkit.transforms.dispatch import load_switch_reader
from toolkit.transforms.kernels import SWITCH_VALUES, KernelModule, Kernels, served_dtype

E, W, INFO = Severity.ERROR, Severity.WARNING, Severity.INFO
MULTI_STEP_BACKENDS = {"FLASH_ATTN", "ROCM_FLASH", "FLASHINFER"}
# process-level variables that no recipe file has to read for them to matter
WELL_KNOWN_ENV = ("PYTHON*", "LD_*", "PATH", "CUDA_*", "NCCL_*", "OMP_*", "MKL_*", "HF_*", "TRANSFORMERS_*",
                  "TOKENIZERS_*", "TORCH_*", "PYTORCH_*", "VLLM_*", "HOME", "TMPDIR", "TZ", "LANG", "LC_*")
PLACEHOLDERS = {"todo", "tbd", "fixme", "?", "-", "n/a", "none", "later", "unknown"}


@rule("chunked-prefill-batch", E, "chunked prefill off while max_num_batched_tokens < max_model_len")
def chunked_prefill_batch(ctx: LintContext) -> Iterator[Issue]:
    max_len = ctx.int_arg("max-model-len")
    batched = ctx.int_arg("max-num-batched-tokens")
    if ctx.chunked_prefill_effective() or not max_len or batched is None or batched >= max_len:
        return
    yield Issue("chunked-prefill-batch", E,
                f"max_num_batched_tokens ({batched}) is smaller than max_model_len ({max_len}) with chunked "
                "prefill off: vLLM refuses to start",
                "enable chunked prefill, or raise max-num-batched-tokens to at least max-model-len",
                ctx.origin_of_arg("max-num-batched-tokens"))


@rule("chunked-prefill-implicit", INFO, "vLLM 0.6 turns chunked prefill on by itself above 32K context")
def chunked_prefill_implicit(ctx: LintContext) -> Iterator[Issue]:
    max_len = ctx.int_arg("max-model-len")
    if (ctx.chunked_prefill() is None and max_len and max_len > 32768
            and ctx.vllm_version < Version("0.7")):
        yield Issue("chunked-prefill-implicit", INFO,
                    f"max_model_len {max_len} > 32768 on vLLM {ctx.vllm_version}: chunked prefill is enabled "
                    "implicitly (max_num_batched_tokens defaults to 512 then)",
                    "say so in the recipe: enable-chunked-prefill: true (or 'false' to turn it off)",
                    ctx.origin_of_arg("max-model-len"))


@rule("bool-false-omits-flag", W, "a boolean false omits the flag instead of passing false")
def bool_false(ctx: LintContext) -> Iterator[Issue]:
    for name, value in ctx.args.items():
        if value is False and name == "enable-chunked-prefill":
            yield Issue("bool-false-omits-flag", W,
                        "enable-chunked-prefill: false omits the flag, which leaves chunked prefill to vLLM's "
                        "default (on above 32K context)",
                        "write 'false' (a string) to pass --enable-chunked-prefill false", ctx.origin_of_arg(name))


@rule("multi-step-backend", E, "num_scheduler_steps > 1 on a backend without multi-step, or with chunked prefill")
def multi_step(ctx: LintContext) -> Iterator[Issue]:
    steps = ctx.int_arg("num-scheduler-steps", 1) or 1
    if steps <= 1:
        return
    backend = ctx.attention_backend()
    origin = ctx.origin_of_arg("num-scheduler-steps")
    if backend not in MULTI_STEP_BACKENDS:
        yield Issue("multi-step-backend", E,
                    f"num_scheduler_steps {steps} (multi-step) is not supported on the {backend} attention backend "
                    f"(only {', '.join(sorted(MULTI_STEP_BACKENDS))})",
                    "remove num-scheduler-steps (or set it to 1)", origin)
        if ctx.chunked_prefill_effective():
            yield Issue("multi-step-backend", E,
                        f"multi-step together with chunked prefill is not supported on {backend}",
                        "drop num-scheduler-steps, or turn chunked prefill off", origin)


@rule("attention-backend", E, "a forced attention backend the image cannot load")
def attention_backend(ctx: LintContext) -> Iterator[Issue]:
    forced = ctx.recipe.env.get("VLLM_ATTENTION_BACKEND")
    if forced and forced not in ctx.recipe.base_image.attention_backends:
        yield Issue("attention-backend", E,
                    f"VLLM_ATTENTION_BACKEND={forced} but the image can load only "
                    f"{', '.join(ctx.recipe.base_image.attention_backends)}: the server fails at start",
                    "remove VLLM_ATTENTION_BACKEND, or list the backend in base_image.attention_backends once the "
                    "image ships it", ctx.origin_of_env("VLLM_ATTENTION_BACKEND"))


@rule("cuda-graphs", E, "CUDA graphs on hardware where capture hangs; flags the vendor hard-codes")
def cuda_graphs(ctx: LintContext) -> Iterator[Issue]:
    hardcoded = ctx.recipe.vendor.hardcoded
    for kwarg, flags in hardcoded.items():
        if ctx.unhardcoded(kwarg):
            continue
        for flag in flags:
            if flag in ctx.args and ctx.args[flag] not in (None, False):
                yield Issue("cuda-graphs", W,
                            f"--{flag} has no effect: the vendor hard-codes {kwarg} and no set-kwarg transform "
                            "in this recipe un-hardcodes it",
                            f"add a set-kwarg transform for {kwarg}, or drop --{flag}", ctx.origin_of_arg(flag))
    if "cuda-graph-capture-hang" not in ctx.recipe.hardware.known_issues or ctx.has_flag("enforce-eager"):
        return
    forced_eager = "enforce_eager" in hardcoded and not ctx.unhardcoded("enforce_eager")
    if not forced_eager:
        why = ("the recipe un-hardcodes enforce_eager, so without --enforce-eager vLLM captures CUDA graphs"
               if "enforce_eager" in hardcoded else "without --enforce-eager vLLM captures CUDA graphs")
        yield Issue("cuda-graphs", E,
                    f"CUDA graph capture hangs or runs out of memory on {ctx.recipe.hardware.accelerator} "
                    f"(TP {ctx.int_arg('tensor-parallel-size', 1)}): {why}",
                    "add enforce-eager: true to serve.args", ctx.loaded.origin("serve", "args"))


@rule("context-length", E, "max_model_len below what the workload needs", platform=True)
def context_length(ctx: LintContext) -> Iterator[Issue]:
    workload = ctx.recipe.serve.workload
    max_len = ctx.int_arg("max-model-len")
    origin = ctx.origin_of_arg("max-model-len") if max_len is not None else ctx.loaded.origin("serve", "args")
    largest = workload.largest_request
    if largest is not None:
        request = (f"the workload's largest request ({workload.largest_prompt_tokens:,} prompt tokens with a "
                   f"{workload.largest_prompt_completion_limit:,}-token completion limit: {largest:,} tokens)")
        if max_len is None:
            yield Issue("context-length", W, f"max-model-len is not set: whether the model's own limit holds {request} "
                        "is not known here", f"set max-model-len to at least {largest}", origin)
        elif max_len < largest:
            yield Issue("context-length", E, f"max_model_len {max_len} refuses {request}: vLLM answers it HTTP 400 "
                        "before a token", f"set max-model-len to at least {largest}", origin)
    need = workload.min_context_tokens
    if need and max_len is None:
        yield Issue("context-length", W, f"the workload needs more than {need} tokens of context but "
                    "max-model-len is not set (the model's own limit applies)", f"set max-model-len above {need}",
                    origin)
    elif need and max_len is not None and max_len <= need:
        yield Issue("context-length", E, f"max_model_len {max_len} does not exceed the workload's {need} tokens",
                    f"set max-model-len above {need}", origin)


@rule("mm-profile", E, "the max-size images vLLM profiles at start must fit one step")
def mm_profile(ctx: LintContext) -> Iterator[Issue]:
    model = ctx.recipe.model
    if model is None or model.vision is None:
        return
    vision, images = model.vision, ctx.images_per_prompt()
    batch = ctx.max_num_batched_tokens() or ctx.int_arg("max-model-len")
    origin = ctx.origin_of_arg("limit-mm-per-prompt") if ctx.arg("limit-mm-per-prompt") is not None else \
        ctx.loaded.origin("serve", "args")
    need = images * vision.max_image_tokens + 2  # the image tokens and their two delimiters, in one sequence
    if batch is not None and need > batch:
        most = (batch - 2) // vision.max_image_tokens
        yield Issue("mm-profile", E, f"vLLM profiles {images} max-size image(s) of {vision.max_image_tokens} tokens "
                    f"in one sequence at start: {need} tokens, above the {batch} a step holds "
                    "(max-num-batched-tokens): the model's dummy data refuses it and the server does not start",
                    f"set limit-mm-per-prompt to image={most} or fewer, or raise max-num-batched-tokens to {need}",
                    origin)
        return
    dtype = {"bfloat16": 2, "float16": 2, "float32": 4}[model.dtype]
    peak, flops = vision_profile(vision, images, dtype)
    peak_tflops = (ctx.recipe.hardware.peak_tflops or {}).get(model.dtype, 0.0)
    at = f", {flops / (peak_tflops * 1e12):.2f} s at the card's {peak_tflops:g} TFLOPS peak" if peak_tflops else ""
    step = f"{batch}-token step" if batch is not None else "step"
    yield Issue("mm-profile", INFO, f"the start profiles {images} max-size image(s) ({need} tokens of the {step}): "
                f"{peak / 2**30:.2f} GiB of vision-tower activations at its peak (in the kv-cache budget), "
                f"{flops / 1e12:.1f} TFLOP{at}", "each image more a prompt may carry costs as much at every start",
                origin)


@rule("kv-cache", E, "the KV cache for one max-length sequence must fit per card")
def kv_cache(ctx: LintContext) -> Iterator[Issue]:
    model = ctx.recipe.model
    max_len = ctx.int_arg("max-model-len")
    origin = ctx.loaded.origin("model") or ctx.loaded.origin("serve", "args")
    if model is None or max_len is None:
        yield Issue("kv-cache", INFO, "KV-cache estimate skipped: " + (
            "the recipe declares no model shape" if model is None else "max-model-len is not set"),
            "add a `model:` section and max-model-len to get the per-card estimate", origin)
        return
    hw = ctx.recipe.hardware
    est = estimate(model, card_gib=hw.memory_gb, overhead_gib=hw.runtime_overhead_gb,
                   tp=ctx.int_arg("tensor-parallel-size", 1) or 1, max_model_len=max_len,
                   max_num_seqs=ctx.int_arg("max-num-seqs", 256) or 256,
                   max_num_batched_tokens=ctx.max_num_batched_tokens() or max_len,
                   gpu_memory_utilization=ctx.float_arg("gpu-memory-utilization", 0.9),
                   kv_cache_dtype=str(ctx.arg("kv-cache-dtype") or "auto"), env=dict(ctx.recipe.env),
                   images=ctx.images_per_prompt())
    ctx.extra["kv_estimate"] = est.as_json()
    if not est.fits:
        yield Issue("kv-cache", E, f"the KV cache cannot hold one {max_len}-token sequence: {est.summary()}",
                    "lower max-model-len or max-num-batched-tokens, raise gpu-memory-utilization, or add cards (TP)",
                    ctx.origin_of_arg("max-model-len"))
    elif est.margin < 0.10:
        yield Issue("kv-cache", W, f"thin memory margin ({est.margin:.1%} of the budget): {est.summary()}",
                    "leave at least 10% spare: a leftover worker process or a larger prefill runs out of memory",
                    ctx.origin_of_arg("max-model-len"))
    else:
        yield Issue("kv-cache", INFO, est.summary(), "nothing to do", ctx.origin_of_arg("max-model-len"))


PREFIX_STATE_FAILURE = ("the linear-attention layers' state is not in the KV cache and vLLM 0.6.3 feeds only a hit's "
                        "uncached tokens, so a prefix hit serves different tokens (faster, silently)")


def prefix_state_hooks() -> dict[str, list[str]]:
    """What a recipe declaring exact-checkpoints must write, by the scope it goes in: every call and field of the
    runtime's own table (HOOKS, FIELDS in the toolkit's native_fastpaths/prefix_state.py, read without importing
    it); the transforms' `requires` make it deploy the module."""
    tree = ast.parse((resource("patches") / "native_fastpaths" / "prefix_state.py").read_text(encoding="utf-8"))
    table = {target.id: ast.literal_eval(node.value) for node in tree.body if isinstance(node, ast.Assign)
             for target in node.targets if isinstance(target, ast.Name) and target.id in ("HOOKS", "FIELDS")}
    needed = {ref.partition(":")[2]: list(calls) for ref, calls in table["HOOKS"].items()}
    for ref, field in table["FIELDS"].items():
        needed.setdefault(ref.partition(":")[2], []).append(f"{field}: Optional")
    return needed


@rule("prefix-state", E, "prefix caching on a model with linear attention, without exact state checkpoints")
def prefix_state(ctx: LintContext) -> Iterator[Issue]:
    model = ctx.recipe.model
    if model is None or model.linear_attention is None:
        return
    caching = ctx.has_flag("enable-prefix-caching")
    origin = ctx.origin_of_arg("enable-prefix-caching")
    declared = model.prefix_state
    if declared is None:
        if caching:
            yield Issue("prefix-state", E, f"enable-prefix-caching on a model with linear_attention, and "
                        f"model.prefix_state is not declared: {PREFIX_STATE_FAILURE}",
                        "declare model.prefix_state: exact-checkpoints (with the prefix-state transforms, "
                        "docs/lint.md: Prefix caching), or turn enable-prefix-caching off", origin)
        return
    if declared == "none":
        if caching:
            yield Issue("prefix-state", E, f"model.prefix_state is none but enable-prefix-caching is on: "
                        f"{PREFIX_STATE_FAILURE}",
                        "turn enable-prefix-caching off, or declare exact-checkpoints with its transforms",
                        origin)
        return
    in_scope: dict[str, str] = {}
    for t in ctx.recipe.transforms:
        if isinstance(t, ModuleEdit) and t.scope:
            in_scope[t.scope] = in_scope.get(t.scope, "") + t.model_dump_json()
    missing = [f"{needle} (in {scope})" for scope, needles in prefix_state_hooks().items() for needle in needles
               if needle not in in_scope.get(scope, "")]
    model_origin = ctx.loaded.origin("model", "prefix_state")
    if missing:
        yield Issue("prefix-state", E, "model.prefix_state is exact-checkpoints but the recipe's transforms lack "
                    f"{', '.join(missing)}: without them {PREFIX_STATE_FAILURE}",
                    "add the prefix-state transforms (see recipes/bi100-qwen36.yaml, ids prefix-state*)",
                    model_origin)
        return
    capacity = ctx.recipe.env.get("PREFIX_STATE_CHECKPOINTS")
    if capacity is None or not capacity.isdigit():
        yield Issue("prefix-state", E, "exact-checkpoints holds its checkpoints in host memory: their number must "
                    "be declared (env PREFIX_STATE_CHECKPOINTS)" + (f", not {capacity!r}" if capacity else ""),
                    'set env PREFIX_STATE_CHECKPOINTS to a count, e.g. "64"',
                    ctx.origin_of_env("PREFIX_STATE_CHECKPOINTS") or model_origin)
        return
    each = linear_state_bytes(model, ctx.int_arg("tensor-parallel-size", 1) or 1)
    yield Issue("prefix-state", INFO, f"prefix-state checkpoints: at most {capacity} of {each / 2**20:.1f} MiB "
                f"per card in host memory = {int(capacity) * each / GIB:.2f} GiB per card",
                "nothing to do (PREFIX_STATE_CHECKPOINTS bounds it)", ctx.origin_of_env("PREFIX_STATE_CHECKPOINTS"))


def _known_flags(ctx: LintContext) -> tuple[set[str], set[str], dict[str, str]]:
    """Flags from the reference release and from deployed files; flags only a declared source claims."""
    tree = ctx.reference_tree
    flags = release_flags(tree) if tree else set()
    parsers = release_tool_parsers(tree) if tree else set()
    for _, text in python_files(ctx.deployed_paths):
        flags |= flags_in_source(text)
        parsers |= tool_parsers_in_source(text)
    claimed: dict[str, str] = {}
    deployed = {t.pinned for t in ctx.recipe.transforms}
    for source in ctx.recipe.sources:
        if source.name in deployed:  # its files go into the image; trust what it declares it adds
            flags.update(f.lstrip("-") for f in source.provides_flags)
            parsers.update(source.provides_tool_parsers)
            continue
        for flag in source.provides_flags:
            claimed.setdefault(flag.lstrip("-"), source.name)
        for parser in source.provides_tool_parsers:
            claimed.setdefault("parser:" + parser, source.name)
    return flags, parsers, claimed


@rule("unknown-flag", E, "serving flags and tool parsers the pinned vLLM does not know")
def unknown_flags(ctx: LintContext) -> Iterator[Issue]:
    flags, parsers, claimed = _known_flags(ctx)
    if ctx.reference_tree is None:
        yield Issue("unknown-flag", W, f"flags not checked: {ctx.extra.get('reference_error')}",
                    f"make {ctx.recipe.vendor.reference} downloadable (pip) or cached, then lint again",
                    ctx.loaded.origin("vendor", "reference"))
        return
    ref = ctx.recipe.vendor.reference
    for name in ctx.args:
        if name in flags:
            continue
        source = claimed.get(name)
        if source is not None:
            yield Issue("unknown-flag", W, f"--{name} is unknown to {ref}; only source {source!r} claims to add it, "
                        "and this recipe does not deploy that source's files yet",
                        f"deploy {source}'s CLI module (or drop --{name}) before launching",
                        ctx.origin_of_arg(name))
        else:
            yield Issue("unknown-flag", E, f"--{name} is not a flag of {ref} nor of any file this recipe deploys: "
                        "the server exits with 'unrecognized arguments'",
                        "fix the spelling, or deploy the module that adds it", ctx.origin_of_arg(name))
    parser = ctx.arg("tool-call-parser")
    if isinstance(parser, str) and parser not in parsers:
        source = claimed.get("parser:" + parser)
        severity = W if source else E
        detail = (f"only source {source!r} claims it and is not deployed yet" if source
                  else f"known: {', '.join(sorted(parsers))}")
        yield Issue("unknown-flag", severity, f"tool parser {parser!r} is not registered in {ref} ({detail})",
                    "deploy the parser module, or pick a registered parser", ctx.origin_of_arg("tool-call-parser"))


@rule("env-unread", W, "env switches that no transform or deployed file reads")
def env_unread(ctx: LintContext) -> Iterator[Issue]:
    switches = {getattr(t, "switch", "") for t in ctx.recipe.transforms}
    switches |= {m.switch for _, t in _kernels(ctx) for m in t.modules}  # the adapter reads them (the kernels say so)
    texts = [text for _, text in python_files(ctx.deployed_paths)]
    for name in ctx.recipe.env:
        if name in switches or any(fnmatch.fnmatch(name, p) for p in WELL_KNOWN_ENV):
            continue
        if any(f'"{name}"' in t or f"'{name}'" in t for t in texts) or ctx.recipe.base_image.env_reader(name):
            continue
        yield Issue("env-unread", W, f"env {name} is read by no dispatch and no file this recipe deploys",
                    "remove it, or add the dispatch/deploy that reads it (a GPU library of the image that reads it "
                    "itself: its base_image.gpu_libraries[].reads_env)", ctx.origin_of_env(name))


def switch_readers(deployed: list[Path]) -> list[tuple[Path, Any, str | None]]:
    """Each deployed package's strict switch reader (a switches.py beside a switches.json), as the dispatch kind
    loads it: lint judges a value with the very code the server will run, not a second parser."""
    return [(path / "switches.py", *load_switch_reader(path)) for path in deployed
            if path.is_dir() and (path / "switches.py").is_file() and (path / "switches.json").is_file()]


@rule("switch-value", E, "an env switch set to a value its table does not allow (the server refuses to start)")
def switch_value(ctx: LintContext) -> Iterator[Issue]:
    for reader, module, broken in switch_readers(ctx.deployed_paths):
        if module is None:
            yield Issue("switch-value", E, f"the deployed switch reader {reader} does not load: {broken}",
                        f"fix {reader.with_name('switches.json')} or {reader} (copy the toolkit's "
                        "patches/src/native_fastpaths/ pair)", ctx.loaded.origin("patches"))
            continue
        for name, raw in ctx.recipe.env.items():
            if name in module.TABLE and (why := module.problem(name, str(raw))):
                yield Issue("switch-value", E, f"env {why} (the deployed {reader.parent.name}/switches.py raises on "
                            "it at the first read: the server would not start)",
                            f"set {name} to {module.allowed(name)} ({reader.with_name('switches.json')})",
                            ctx.origin_of_env(name))
    for _, t in _kernels(ctx):
        for m in t.modules:
            given = ctx.recipe.env.get(m.switch)
            if given is not None and given not in SWITCH_VALUES:
                yield Issue("switch-value", E, f"env {m.switch}={given!r}: the adapter's env_bool raises on it at "
                            f"import ({m.name}'s switch, transform {t.id}): the server would not start",
                            f"set {m.switch} to one of {', '.join(SWITCH_VALUES)}", ctx.origin_of_env(m.switch))


@rule("provenance", W, "transforms whose provenance is a placeholder, or whose remove_when now holds")
def provenance(ctx: LintContext) -> Iterator[Issue]:
    for index, t in enumerate(ctx.recipe.transforms):
        for field_name in ("why", "remove_when"):
            text = getattr(t, field_name).strip()
            if text.lower().rstrip(".") in PLACEHOLDERS or len(text) < 8:
                yield Issue("provenance", W, f"transform {t.id}: {field_name} is a placeholder ({text!r})",
                            f"say {'why the change is needed' if field_name == 'why' else 'when it can go'}",
                            ctx.loaded.origin("transforms", index, field_name))
    if ctx.rootfs is None:
        return
    from toolkit.engine.plan import Engine
    from toolkit.errors import ToolkitError
    from toolkit.inputs import rootfs_roots
    from toolkit.results import State
    from toolkit.trial import untried_here

    try:
        # what needs a pinned source that is not here is left out: lint reads no clone
        plan = Engine(ctx.loaded, rootfs_roots(ctx.recipe, ctx.rootfs), ctx.rootfs,
                      skip=frozenset(untried_here(ctx.recipe, {}))).run()
    except ToolkitError as exc:
        yield Issue("provenance", W, f"remove_when not checked against {ctx.rootfs}: {exc.message}",
                    exc.hint or "fix the vendor tree", None)
        return
    for index, t in enumerate(ctx.recipe.transforms):
        if any(r.transform == t.id and r.state is State.SUPERSEDED for r in plan.results):
            yield Issue("provenance", W, f"transform {t.id} is SUPERSEDED in {ctx.rootfs}: its remove_when "
                        f"({t.remove_when!r}) appears to hold",
                        "drop the transform once the new base image is the one you ship",
                        ctx.loaded.origin("transforms", index, "remove_when") or ctx.loaded.transform_origin(index))


@rule("source-fetch", W, "a source the image build clones: the platform's builder then needs git and network")
def source_fetch(ctx: LintContext) -> Iterator[Issue]:
    used = {t.pinned for t in ctx.recipe.transforms if t.pinned}
    for index, source in enumerate(ctx.recipe.sources):
        if source.name not in used or source.path:
            continue
        origin = ctx.loaded.origin("sources", index, "fetch") or ctx.loaded.origin("sources", index)
        if source.fetch == "image":
            yield Issue("source-fetch", W, f"source {source.name}: fetch is image, so the image build clones "
                        f"{source.git}: the platform's builder needs git and network, and shows no log when either "
                        "is missing", "drop `fetch: image` (toolkit build then clones it here and bundles it), or "
                        f"build with --source {source.name}=PATH", origin)
        elif source.fetch == "host-or-image":
            yield Issue("source-fetch", INFO, f"source {source.name}: toolkit build clones {source.git} and bundles "
                        "it; on a host that cannot reach it, the image build clones it instead (the build says so)",
                        f"--source {source.name}=PATH always bundles it", origin)


@rule("vendor-base", W, "vendor.reference is not the public release the vendor tree is closest to")
def vendor_base(ctx: LintContext) -> Iterator[Issue]:
    if ctx.rootfs is None or not ctx.compare_base:
        return
    from toolkit.compare import compare, neighbours, package_dir
    from toolkit.errors import ToolkitError
    from toolkit.inputs import rootfs_roots

    recipe = ctx.recipe
    origin = ctx.loaded.origin("vendor", "reference")
    try:
        vendor = package_dir(rootfs_roots(recipe, ctx.rootfs)[0].path, recipe.vendor.package)
        result = compare(vendor, recipe.vendor.package, neighbours(recipe.vendor.reference),
                         recipe.base_image.python, recipe.base_image.platform, guessed=True)
    except ToolkitError as exc:
        yield Issue("vendor-base", W, f"vendor.reference not compared with {ctx.rootfs}: {exc.message}",
                    exc.hint or "see `toolkit vendor compare`", origin)
        return
    closest = result.closest
    ctx.extra["vendor_base"] = {"closest": closest.spec, "candidates": {c.spec: c.identical
                                                                       for c in result.candidates}}
    if closest.spec != recipe.vendor.reference:
        ours = next((c for c in result.candidates if c.spec == recipe.vendor.reference), None)
        shown = f"{ours.identical} identical files" if ours else "not fetchable"
        yield Issue("vendor-base", W, f"vendor.reference is {recipe.vendor.reference} ({shown}), but the vendor tree "
                    f"in {ctx.rootfs} is closest to {closest.spec} ({closest.identical} identical files, "
                    f"{len(closest.differing)} differing)",
                    f"set vendor.reference to {closest.spec}: the trial and preflight then run on the vendor's true "
                    "base (`toolkit vendor compare RECIPE --rootfs DIR` for the files)", origin)


@rule("workdir-shadow", E, "a working directory with a vllm/ folder imports the unpatched copy")
def workdir(ctx: LintContext) -> Iterator[Issue]:
    wd = ctx.recipe.serve.workdir.rstrip("/") or "/"
    origin = ctx.loaded.origin("serve", "workdir") or ctx.loaded.origin("serve")
    package = ctx.recipe.vendor.package
    if any(wd == root.rstrip("/") for root in ctx.recipe.vendor.roots):
        yield Issue("workdir-shadow", E, f"serve.workdir {wd} is a vendor root: its {package}/ shadows the patched "
                    "import order", "start from a neutral folder such as /workspace", origin)
    elif ctx.rootfs is not None and (ctx.rootfs / wd.lstrip("/") / package).is_dir():
        yield Issue("workdir-shadow", E, f"serve.workdir {wd} contains a {package}/ folder in the image: Python "
                    "imports it before the patched site-packages", "start from a neutral folder", origin)
    if any(isinstance(t, ModuleEdit) for t in ctx.recipe.transforms) and wd in ("/", ""):
        yield Issue("workdir-shadow", W, "serve.workdir is /: a stray vllm/ at the image root would shadow "
                    "the patched package", "use a dedicated empty folder such as /workspace", origin)


@rule("probe", E, "a probe whose runtime is not deployed, or that moves another transform's anchor")
def probe(ctx: LintContext) -> Iterator[Issue]:
    from toolkit.transforms.probe import Probe

    deployed = {str(getattr(t, "dest", "")).strip("/").split("/")[0] for t in ctx.recipe.transforms
                if t.kind == "deploy"}
    for index, t in enumerate(ctx.recipe.transforms):
        if not isinstance(t, Probe):
            continue
        top = t.runtime.split(".")[0]
        if top not in deployed:
            yield Issue("probe", E, f"transform {t.id} imports {t.runtime}, which no deploy of this recipe installs: "
                        "the probed module would fail to import on the image",
                        f"deploy patches/src/{top} (kind: deploy, source: {top}, dest: {top})",
                        ctx.loaded.origin("transforms", index, "runtime") or ctx.loaded.transform_origin(index))
        timed = t.statements if t.statements is not None else f"{t.calls}(" if t.calls is not None else None
        if timed is None:
            continue
        probe_text = " ".join(timed.split())
        for other in ctx.recipe.transforms:
            if other is t or isinstance(other, Probe) or not isinstance(other, ModuleEdit):
                continue
            if (other.file, other.scope) != (t.file, t.scope) or other.package != t.package:
                continue
            anchors = [getattr(other, name, None) for name in ("after", "old", "call")]
            if any(a and probe_text in " ".join(str(a).split()) for a in anchors):
                yield Issue("probe", E, f"transform {t.id} times `{probe_text.rstrip('(')}`, which transform "
                            f"{other.id} anchors on in {t.scope}: once timed, that anchor is gone and "
                            f"{other.id} drifts", f"probe another statement or call, or move {other.id}'s anchor",
                            ctx.loaded.transform_origin(index))


def _endpoint_sources(ctx: LintContext) -> Iterator[tuple[int, Deploy, Path | None]]:
    """Each deploy into vLLM's entrypoints (index, deploy, its .py files' folder or file; None: its declared
    source is not found here)."""
    for index, t in enumerate(ctx.recipe.transforms):
        dest = t.dest.rstrip("/") + "/" if isinstance(t, Deploy) else ""
        if isinstance(t, Deploy) and not isinstance(t, Kernels) and not dest.startswith("/") and (
                dest.startswith(engine_client.ENDPOINTS) or engine_client.ENDPOINTS.startswith(dest)):
            source, _ = ctx.deployed_file(t.dest.rstrip("/"))
            yield index, t, source


@rule("engine-client", E, "a deployed endpoint calls what the engine client the argv selects does not have")
def engine_client_calls(ctx: LintContext) -> Iterator[Issue]:
    deployed = list(_endpoint_sources(ctx))
    if not deployed:
        return
    use_engine = ctx.has_flag(engine_client.FRONTEND_FLAG)
    client_text = _patched_text(ctx, engine_client.CLIENT_FILE)
    if not use_engine and client_text is not None:
        defaults = engine_client.engine_arg_defaults(_patched_text(ctx, "vllm/engine/arg_utils.py") or "")

        def arg(name: str) -> object:
            value = ctx.arg(name.replace("_", "-"))
            if value is None:
                return defaults.get(name)
            return ctx.int_arg(name.replace("_", "-"), 0) if not isinstance(value, bool) else value

        use_engine = bool(engine_client.unsupported_config(client_text, arg))
    cls, rel = ((engine_client.ENGINE_CLASS, engine_client.ENGINE_FILE) if use_engine else
                (engine_client.CLIENT_CLASS, engine_client.CLIENT_FILE))
    class_text = _patched_text(ctx, rel)
    members = engine_client.class_members(class_text, cls) if class_text is not None else None
    if members is None:
        yield Issue("engine-client", INFO, f"the deployed endpoints' engine-client calls were not checked: {cls} is "
                    f"not readable in {rel} of the patched tree (no reference tree, or it answers any name)",
                    "make vendor.reference fetchable", ctx.loaded.origin("vendor", "reference"))
        return
    selected = (f"--{engine_client.FRONTEND_FLAG} is passed" if ctx.has_flag(engine_client.FRONTEND_FLAG) else
                "MQLLMEngineClient.is_unsupported_config holds" if use_engine else
                f"no --{engine_client.FRONTEND_FLAG}: the multiprocessing front end")
    fix = (f"pass --{engine_client.FRONTEND_FLAG} (serve.args: {engine_client.FRONTEND_FLAG}: true), so the "
           "endpoints get an AsyncLLMEngine" if not use_engine else
           f"deploy an endpoint that calls only what {cls} has")
    unread: dict[str, list[tuple[int, Deploy]]] = {}
    for index, t, source in deployed:
        if source is None:
            unread.setdefault(t.pinned or "", []).append((index, t))
    for name, deploys in unread.items():
        yield Issue("engine-client", INFO, f"not checked: source {name} is not found here, so what its deployed "
                    f"endpoints call on the engine client is not read ({', '.join(t.id for _, t in deploys)})",
                    f"pass --source {name}=PATH", ctx.loaded.transform_origin(deploys[0][0]))
    for index, t, source in deployed:
        origin = ctx.loaded.transform_origin(index)
        if source is None:
            continue
        files = sorted(source.rglob("*.py")) if source.is_dir() else [source]
        for path in files:
            label = (t.source if source.is_file() else f"{t.source.rstrip('/')}/{path.relative_to(source)}")
            dest = t.dest if source.is_file() else f"{t.dest.rstrip('/')}/{path.relative_to(source)}"
            for call in engine_client.missing(engine_client.client_uses(path.read_text(encoding="utf-8")), members):
                yield Issue("engine-client", E, f"{dest}:{call.line} ({label}, deployed by transform {t.id}) calls "
                            f"engine_client.{call.name}, which {cls} ({rel}) does not have ({selected}): every "
                            "request that reaches it answers HTTP 500", fix, origin)


def _patched_text(ctx: LintContext, rel: str) -> str | None:
    path, _ = ctx.patched_file(rel)
    return path.read_text(encoding="utf-8") if path is not None and path.is_file() else None


@rule("deploy-needs-arg", E, "a deployed file needs a server flag the recipe does not pass")
def deploy_needs_arg(ctx: LintContext) -> Iterator[Issue]:
    for index, t in enumerate(ctx.recipe.transforms):
        if not isinstance(t, Deploy):
            continue
        for flag, why in t.needs_args.items():
            if not ctx.has_flag(flag):
                yield Issue("deploy-needs-arg", E, f"transform {t.id} deploys {t.dest}, which needs --{flag}: {why}",
                            f"pass it (serve.args: {flag}: true)", ctx.origin_of_arg(flag)
                            if flag in ctx.args else ctx.loaded.origin("transforms", index, "needs_args"))


def _kernels(ctx: LintContext) -> list[tuple[int, Kernels]]:
    return [(i, t) for i, t in enumerate(ctx.recipe.transforms) if isinstance(t, Kernels)]


def _on(ctx: LintContext, module: KernelModule) -> bool:
    """Whether the adapter uses the module under the recipe's env (a value it refuses is switch-value's error)."""
    value = ctx.recipe.env.get(module.switch)
    return (value is None or value in SWITCH_VALUES) and module.on(ctx.recipe.env)


def _installed_kernels(ctx: LintContext) -> list[tuple[int, Kernels]]:
    """The kernels transforms the target applies (its device architecture's)."""
    applied = ctx.recipe.kernels()
    return [(i, t) for i, t in _kernels(ctx) if t in applied]


@rule("kernel-artefact", E, "a prebuilt kernel switched on with no artefact for the target's device architecture")
def kernel_artefact(ctx: LintContext) -> Iterator[Issue]:
    arch = ctx.recipe.hardware.device_arch
    installed = {m.name for _, t in _installed_kernels(ctx) for m in t.modules}
    reported: set[str] = set()
    for index, t in _kernels(ctx):
        for m in t.modules:
            if m.name in installed or m.name in reported or not _on(ctx, m):
                continue
            reported.add(m.name)
            value = ctx.recipe.env.get(m.switch, f"unset: default {m.default}")
            target = arch or "hardware.device_arch is not set"
            fix = f"set {m.switch}: \"0\", or declare a kernels transform built for {arch}" if arch else \
                "set hardware.device_arch"
            yield Issue("kernel-artefact", E, f"{m.switch} is on ({value}), but no artefact of {m.name} is installed "
                        f"for the target's device architecture ({target}; transform {t.id} has {t.architecture}'s): "
                        "the import fails on the image and the adapter's PyTorch path runs instead", fix,
                        ctx.origin_of_env(m.switch) if m.switch in ctx.recipe.env
                        else ctx.loaded.origin("transforms", index, "modules"))


def _kernel_model(ctx: LintContext) -> tuple[dict[str, object], int, str] | None:
    """The served model's (text) config, TP and dtype, as the kernels' guards read them (None: not known here)."""
    model = ctx.recipe.model
    config = model.hybrid_config() if model is not None else None
    if model is None or config is None:
        return None
    return config, ctx.int_arg("tensor-parallel-size", 1) or 1, served_dtype(ctx.arg("dtype"), model.dtype)


@rule("kernel-guard", E, "a switched-on prebuilt kernel the served model never reaches, or that refuses it")
def kernel_guard(ctx: LintContext) -> Iterator[Issue]:
    model = _kernel_model(ctx) if _installed_kernels(ctx) else None
    if model is None:
        return
    config, tp, dtype = model
    served = f"{dtype} at TP {tp}"
    for index, t in _installed_kernels(ctx):
        origin = ctx.loaded.origin("transforms", index, "modules")
        for m in t.modules:
            if not _on(ctx, m):
                continue
            if refused := m.unmet(config, tp, dtype, "needs"):
                yield Issue("kernel-guard", E, f"{m.name} ({m.switch} on) refuses the served model ({served}): it "
                            f"needs {', '.join(refused)}, and its call site does not check it: every call raises and "
                            "the engine stops", f"set {m.switch}: \"0\", or serve what it needs (serve.args.dtype)",
                            ctx.origin_of_env(m.switch) if m.switch in ctx.recipe.env else origin)
            elif unmet := m.unmet(config, tp, dtype):
                yield Issue("kernel-guard", W, f"{m.name} ({m.switch} on) is never used by the served model "
                            f"({served}): its call site needs {', '.join(unmet)}; the adapter's PyTorch path runs",
                            f"set {m.switch}: \"0\" to say so, or serve what it needs", origin)
            elif whole := _taken_by(m, [w for w in t.modules if _on(ctx, w) and not w.unmet(config, tp, dtype)]):
                yield Issue("kernel-guard", W, f"{m.name} ({m.switch} on) is never used by the served model "
                            f"({served}): {whole.name} ({whole.switch} on) computes the whole of {whole.operation} "
                            f"on every step {m.name}'s guard allows", f"set {m.switch}: \"0\" to say so, or "
                            f"{whole.switch}: \"0\" to use it", origin)


def _taken_by(part: KernelModule, others: list[KernelModule]) -> KernelModule | None:
    """The kernel that computes the whole operation `part` is a part of, on every step part's guard allows (its
    guard met by the served model and asking no more of a step than part's)."""
    return next((w for w in others if part.operation.startswith(w.operation + ".")
                 and set(w.step_conditions()) <= set(part.step_conditions())), None)


@rule("operation-owner", E, "two paths switched on for one operation (a native fast path and a prebuilt kernel)")
def operation_owner(ctx: LintContext) -> Iterator[Issue]:
    from toolkit.transforms.dispatch import Dispatch

    defaults: dict[str, str] = {}
    for _, module, _ in switch_readers(ctx.deployed_paths):
        if module is not None:
            defaults.update({k: str(v.get("default", "")) for k, v in module.TABLE.items()})
    natives: list[tuple[str, str, str]] = []  # (transform, operation, switch) of each native path switched on
    for t in ctx.recipe.transforms:
        if isinstance(t, Dispatch) and t.operation is not None:
            value = str(ctx.recipe.env.get(t.switch, t.default if t.default is not None else defaults.get(t.switch)))
            if value == "1":
                natives.append((t.id, t.operation, t.switch))
    kernels = [m for _, t in _installed_kernels(ctx) for m in t.modules if _on(ctx, m)]
    for tid, operation, switch in natives:
        # one owns the other's operation where either is the whole the other is a part of; kernels among
        # themselves are the adapter's own cascade (the packed decode step where its guard holds, its parts
        # elsewhere), not two owners
        clash = [m for m in kernels if m.operation == operation or m.operation.startswith(operation + ".")
                 or operation.startswith(m.operation + ".")]
        if not clash:
            continue
        named = "; ".join(f"kernel {m.name} ({m.operation}, {m.switch} on)" for m in clash)
        yield Issue("operation-owner", E, f"operation {operation} has {len(clash) + 1} owners switched on: transform "
                    f"{tid} ({operation}, {switch} on); {named}: one silently takes it from the other, and which one "
                    "a measurement measured is not said", f"switch one off (e.g. {switch}: \"0\" to keep the kernels)",
                    ctx.origin_of_env(switch))
