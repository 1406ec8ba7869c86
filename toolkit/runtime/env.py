"""The cached CPU-only Python for vLLM 0.6.3 trees (../shared/VLLM_CPU.md, measured): torch's CPU build and the
pure-Python dependencies `import vllm` needs, pinned; vLLM itself comes from the patched tree on PYTHONPATH."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from toolkit.pyenv import TORCH, cached_python, pip, venv

KIND = "cpu-runtime"
NAME = "vllm063"
# what `import vllm`, its OpenAI CLI module and LLMEngine (its metrics: prometheus_client) need, found by importing
# until nothing was missing; the pins matter
# (compressed-tensors newer than 0.6 needs a newer transformers; numpy 2 breaks vLLM 0.6.3)
REQUIREMENTS = ("transformers==4.55.3", "numpy<2.0.0", "compressed-tensors==0.6.0", "gguf==0.10.0", "psutil",
                "msgspec", "pydantic", "sentencepiece", "cloudpickle", "mistral_common", "py-cpuinfo", "aiohttp",
                "openai", "pyzmq", "partial-json-parser", "prometheus_client")
# must never be in it: each changes the code paths vLLM takes on a CPU
ABSENT = ("intel_extension_for_pytorch", "triton", "xformers", "vllm")


PINS = (TORCH, *REQUIREMENTS, *(f"absent {m}" for m in ABSENT))


def _fill(python: Path, scratch: Path, say: Callable[[str], None]) -> None:
    say(f"installing {TORCH} (the local CPU build)")
    pip(python, "install", "--quiet", TORCH)
    say(f"installing the {len(REQUIREMENTS)} pure-Python packages `import vllm` needs: {', '.join(REQUIREMENTS)}")
    pip(python, "install", "--quiet", *REQUIREMENTS)
    pip(python, "uninstall", "--quiet", "-y", *ABSENT)


def runtime() -> Path:
    """The runtime's Python, built on first use (about a minute, about 1.3 GB)."""
    return venv(KIND, NAME, _fill, "about a minute, about 1.3 GB", PINS)


def built() -> Path | None:
    """The runtime's Python if it is built already (`toolkit build` uses it only then)."""
    return cached_python(KIND, NAME, _fill, PINS)
