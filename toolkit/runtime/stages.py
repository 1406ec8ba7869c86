"""Runs inside the CPU runtime's Python, with a patched vendor tree first on sys.path: the vendor's own argument
parser, engine arguments and config construction for each variant, with the target hardware emulated.

Standard library only at the top: it is executed as a script (`python stages.py < request.json`), never imported
by the toolkit. What emulates the image is applied from outside the tree, before anything imports vllm, by
`toolkit_standins` (standins.py), loaded by the sitecustomize on PYTHONPATH in this Python and in every child:
- an emulated `pynvml` reports the recipe's device count and memory, so vLLM takes the CUDA platform, as on the
  image, and its config code sees the accelerators it will see there (nothing touches a GPU; the `+cpu` version
  trick of ../shared/VLLM_CPU.md is for running layers on the CPU, which this does not do), and vLLM's
  `cuda_device_count_stateless` returns that count;
- the image's GPU-only libraries (base_image.gpu_libraries) are stood in, their `absent` submodules fail to
  import; what was stood in and called is part of the result.
Prints one JSON object on stdout; everything the vendor logs goes to stderr.
"""

from __future__ import annotations

import json
import os
import re
import sys
import traceback
from typing import Any

TREES: list[str] = []  # the patched trees on sys.path (from the request): where a failure is located


def _in_tree(filename: str) -> str | None:
    for tree in TREES:
        if filename.startswith(tree.rstrip("/") + "/"):
            return filename[len(tree.rstrip("/")) + 1:]
    return None


def _failure(stage: str, exc: BaseException) -> dict[str, Any]:
    frames: list[traceback.FrameSummary] = list(traceback.extract_tb(exc.__traceback__))
    if isinstance(exc, ModuleNotFoundError):
        # the import statement that failed: the innermost frame that is not the import machinery
        frames = [f for f in frames if not f.filename.startswith("<frozen")]
    where = next((f"{_in_tree(f.filename)}:{f.lineno}" for f in reversed(frames) if _in_tree(f.filename)), "")
    out = {"stage": stage, "ok": False, "type": type(exc).__name__, "message": str(exc).strip() or repr(exc),
           "where": where}
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        out["module"] = exc.name
    return out


def _variant(request: dict[str, Any], variant: dict[str, Any]) -> dict[str, Any]:
    stages: list[dict[str, Any]] = []
    out: dict[str, Any] = {"name": variant["name"], "stages": stages}
    saved = dict(os.environ)
    os.environ.update(variant.get("env", {}))  # the run config's env: vLLM reads some of it while it configures
    try:
        return _stages(request, variant, out, stages)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _stages(request: dict[str, Any], variant: dict[str, Any], out: dict[str, Any],
            stages: list[dict[str, Any]]) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils import FlexibleArgumentParser

    try:
        parser = make_arg_parser(FlexibleArgumentParser(description="preflight"))
        # argparse exits on an unknown flag: turn that into the vendor's own message
        def refuse(status: int = 0, message: str | None = None) -> None:
            raise SystemExit(message or f"exit {status}")

        parser.exit = refuse
        args = parser.parse_args(variant["argv"])
        stages.append({"stage": "parse", "ok": True, "message": f"{len(variant['argv'])} argv item(s) parsed by the "
                       "patched make_arg_parser"})
    except (SystemExit, Exception) as exc:
        stages.append(_failure("parse", exc))
        return out
    args.model = variant["model_dir"]
    try:
        engine_args = AsyncEngineArgs.from_cli_args(args)
        config = engine_args.create_engine_config()
    except Exception as exc:
        stages.append(_failure("engine-config", exc))
        return out
    stages.append({"stage": "engine-config", "ok": True, "message": "create_engine_config accepted the arguments"})
    turned_off = _turned_off(args, config)
    if turned_off:
        stages.append({"stage": "served-flags", "ok": False, "type": "FlagDropped", "message": (
            f"the served argv turns on {', '.join(turned_off)}, and the vendor's create_engine_config turned it off "
            "without an error (vLLM 0.6.3 does so for any model it sees as multimodal, with a warning only): the "
            "server would start and serve without it")})
    out["config"] = {
        "enforce_eager": config.model_config.enforce_eager,
        "disable_custom_all_reduce": config.parallel_config.disable_custom_all_reduce,
        "max_model_len": config.model_config.max_model_len,
        "enable_chunked_prefill": config.scheduler_config.chunked_prefill_enabled,
        "max_num_batched_tokens": config.scheduler_config.max_num_batched_tokens,
        "max_num_seqs": config.scheduler_config.max_num_seqs,
        "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
        "distributed_executor_backend": str(config.parallel_config.distributed_executor_backend),
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
        "block_size": config.cache_config.block_size,
        "gpu_memory_utilization": config.cache_config.gpu_memory_utilization,
    }
    try:
        out["kv"] = _kv(config)
        switch = request.get("kv_switch")
        if switch:  # the other accounting too, as the config classes compute it under each value of the switch
            accountings = {}
            for value in (switch["when"], switch["otherwise"]):
                saved = os.environ.get(switch["switch"])
                os.environ[switch["switch"]] = value
                try:
                    accountings[value] = _kv(config)
                finally:
                    os.environ.pop(switch["switch"])
                    if saved is not None:
                        os.environ[switch["switch"]] = saved
            out["kv"]["switch"] = switch["switch"]
            out["kv"]["accountings"] = accountings
    except Exception as exc:
        stages.append(_failure("kv", exc))
    stages.extend(_attention(dict(request, expected_backend=variant.get("expected_backend")), config))
    stages.extend(_registrations(args, config))
    stages.extend(_prefix_state(request, config))
    return out


def _turned_off(args: Any, config: Any) -> list[str]:
    """Flags the served argv turns on that the engine's config holds off."""
    return ["--enable-prefix-caching"] if getattr(args, "enable_prefix_caching", False) and \
        not config.cache_config.enable_prefix_caching else []


def _prefix_state(request: dict[str, Any], config: Any) -> list[dict[str, Any]]:
    """model.prefix_state exact-checkpoints, against the patched files: every hook the transforms add is there."""
    if request.get("prefix_state") != "exact-checkpoints" or not config.cache_config.enable_prefix_caching:
        return []
    try:
        from native_fastpaths import prefix_state  # type: ignore[import-not-found]  # the patched tree's

        gaps = prefix_state.missing_hooks()
    except Exception as exc:
        return [_failure("prefix-state", exc)]
    return [{"stage": "prefix-state", "ok": not gaps, "type": "" if not gaps else "MissingHook",
             "message": f"the {len(prefix_state.HOOKS) + len(prefix_state.FIELDS)} prefix-state hooks are in the "
             "patched tree" if not gaps else "model.prefix_state is exact-checkpoints but the patched tree lacks "
             + "; ".join(gaps)}]


def _kv(config: Any) -> dict[str, Any]:
    """The vendor's own numbers: the CacheEngine block size and how many layers it allocates a cache for."""
    from vllm.worker.cache_engine import CacheEngine

    block = CacheEngine.get_cache_block_size(config.cache_config, config.model_config, config.parallel_config)
    return {"block_bytes": block, "block_size": config.cache_config.block_size,
            "bytes_per_token": block // config.cache_config.block_size,
            "attention_layers": config.model_config.get_num_attention_layers(config.parallel_config),
            "layers": config.model_config.get_num_layers(config.parallel_config)}


# what each backend's get_name() says (the multi-step runner compares those strings)
_BACKEND_NAMES = {"XFORMERS": "xformers", "FLASH_ATTN": "flash-attn", "FLASHINFER": "flashinfer",
                  "ROCM_FLASH": "rocm-flash-attn", "TORCH_SDPA": "torch-sdpa"}


def _attention(request: dict[str, Any], config: Any) -> list[dict[str, Any]]:
    """The backend vLLM's own selector picks on the emulated device, and what the model load then refuses."""
    import logging

    said: list[str] = []

    class Said(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    selector_log = logging.getLogger("vllm.attention.selector")
    handler, level = Said(logging.INFO), selector_log.level
    selector_log.addHandler(handler)
    selector_log.setLevel(logging.INFO)
    try:
        from vllm.attention.selector import which_attn_to_use

        mc, cc = config.model_config, config.cache_config
        backend = which_attn_to_use(mc.get_head_size(), mc.get_sliding_window(), mc.dtype, cc.cache_dtype,
                                    cc.block_size, mc.is_attention_free).name
    except Exception as exc:
        return [_failure("attention-backend", exc)]
    finally:
        selector_log.removeHandler(handler)
        selector_log.setLevel(level)
    loadable = request.get("attention_backends") or []
    expected = request.get("expected_backend")
    forced = os.environ.get("VLLM_ATTENTION_BACKEND")
    reason = "; ".join(said) or (f"VLLM_ATTENTION_BACKEND={forced}" if forced else
                                 "its first choice, nothing ruled out")
    why = f"vLLM selects {backend} ({reason})"
    if backend not in loadable:
        message = f"{why}, which the image cannot load (it has {', '.join(loadable)}): the model fails to load"
    elif expected and backend != expected:
        message = (f"{why}, but the recipe expects {expected} (VLLM_ATTENTION_BACKEND, else "
                   "base_image.attention_backends[0], as lint reads it): the recipe and the vendor's selector disagree")
    else:
        message = why
    ok = backend in loadable and (not expected or backend == expected)
    stages = [{"stage": "attention-backend", "ok": ok, "type": "" if ok else "ImportError", "message": message,
               "backend": backend, "reason": reason}]
    if config.scheduler_config.is_multi_step:
        try:
            from vllm.worker.multi_step_model_runner import _get_supported_attention_backends

            chunked = config.scheduler_config.chunked_prefill_enabled
            supported = _get_supported_attention_backends(chunked)
            name = _BACKEND_NAMES.get(backend, backend.lower())
            ok = name in supported
            what = "Multi-Step + Chunked-Prefill" if chunked else "Multi-Step"
            stages.append({"stage": "multi-step", "ok": ok, "type": "" if ok else "ValueError",
                           "where": "vllm/worker/multi_step_model_runner.py",
                           "message": f"{what} with {name}" if ok else f"{what} not supported for attention backend: "
                           f"{name} (MultiStepModelRunner raises this when the model loads; supported: "
                           f"{', '.join(supported)})"})
        except Exception as exc:
            stages.append(_failure("multi-step", exc))
    return stages


def _registrations(args: Any, config: Any) -> list[dict[str, Any]]:
    stages: list[dict[str, Any]] = []
    name = getattr(args, "tool_call_parser", None)
    if name:
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager

        known = sorted(ToolParserManager.tool_parsers)
        stages.append({"stage": "tool-parser", "ok": name in known, "type": "" if name in known else "KeyError",
                       "message": f"{name!r} registered" if name in known else
                       f"invalid tool call parser: {name} (chose from {{ {','.join(known)} }})"})
    reasoning = getattr(args, "reasoning_parser", None)
    if reasoning:
        try:
            from vllm.reasoning import ReasoningParserManager

            known = list(ReasoningParserManager.list_registered())
            ok = reasoning in known
            stages.append({"stage": "reasoning-parser", "ok": ok, "type": "" if ok else "KeyError",
                           "message": f"{reasoning!r} registered" if ok else
                           f"invalid reasoning parser: {reasoning} (registered: {', '.join(known)})"})
        except Exception as exc:
            stages.append(_failure("reasoning-parser", exc))
    try:
        from vllm.model_executor.models import ModelRegistry

        architectures = list(getattr(config.model_config.hf_config, "architectures", None) or [])
        cls, arch = ModelRegistry.resolve_model_cls(architectures)
        stages.append({"stage": "architecture", "ok": True, "message": f"{arch} -> {cls.__module__}.{cls.__name__}"})
    except Exception as exc:
        stages.append(_failure("architecture", exc))
    return stages


def _env_reads(roots: list[str], names: list[str]) -> dict[str, list[str]]:
    """Where in the patched trees each env name is read (by its string in a .py file)."""
    found: dict[str, list[str]] = {n: [] for n in names}
    patterns = {n: re.compile(rf"""["']{re.escape(n)}["']""") for n in names}
    for root in roots:
        for folder, _, files in os.walk(root):
            for file in files:
                if not file.endswith(".py"):
                    continue
                path = os.path.join(folder, file)
                try:
                    with open(path, encoding="utf-8", errors="replace") as handle:
                        text = handle.read()
                except OSError:
                    continue
                for name, pattern in patterns.items():
                    # the substring test first: a regex search of every file for every name was 3 s a preflight
                    if len(found[name]) < 3 and name in text and pattern.search(text):
                        found[name].append(os.path.relpath(path, root))
    return found


def main() -> int:
    request = json.load(sys.stdin)
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's logger writes to stdout: only the result goes there
    TREES.extend(request.get("trees", request["roots"]))
    result: dict[str, Any] = {"variants": []}
    try:
        import vllm.utils
    except Exception as exc:
        result["import_error"] = _failure("import", exc)
    else:
        result["vllm"] = vllm.utils.__file__.rsplit("/vllm/", 1)[0]
        for variant in request["variants"]:
            result["variants"].append(_variant(request, variant))
        result["env"] = _env_reads(request.get("trees", request["roots"]), request["env"])  # packages' files too
    standins = sys.modules.get("toolkit_standins")  # installed by the runtime's sitecustomize, when declared
    result["standins"] = getattr(standins, "RECORD", None)
    json.dump(result, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
