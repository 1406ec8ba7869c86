"""The cached CPU-only Python for vLLM 0.6.3 trees (../shared/VLLM_CPU.md, measured): torch's CPU build and the
pure-Python dependencies `import vllm` needs, pinned; vLLM itself comes from the patched tree on PYTHONPATH."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

from toolkit.errors import InputError
from toolkit.pyenv import TORCH, cached_python, pip, venv

KIND = "cpu-runtime"
NAME = "vllm063"
# what `import vllm`, its OpenAI CLI module and LLMEngine (its metrics: prometheus_client) need, found by importing
# until nothing was missing; the pins matter
# (compressed-tensors newer than 0.6 needs a newer transformers; numpy 2 breaks vLLM 0.6.3)
REQUIREMENTS = ("transformers==4.55.3", "numpy<2.0.0", "compressed-tensors==0.6.0", "gguf==0.10.0", "psutil",
                "msgspec", "pydantic", "sentencepiece", "cloudpickle", "mistral_common", "py-cpuinfo", "aiohttp",
                "openai", "pyzmq", "partial-json-parser", "prometheus_client",
                # the OpenAI server the platform starts (found by starting it), and outlines (vLLM's own pin): vLLM
                # 0.6.3 gives every chat request guided-decoding parameters, so each one imports outlines and lark
                "fastapi", "uvicorn", "uvloop", "prometheus-fastapi-instrumentator", "outlines>=0.0.43,<0.1",
                # outlines pulls datasets, and with it pyarrow: newer ones need numpy 2
                "pyarrow<18",
                "pyairports",  # outlines declares it; the index's only version is an empty placeholder (_airports)
                # vLLM 0.6.3 declares it (for Qwen2-VL): the adapter's qwen3_5.py since 2f7d5f5 imports
                # vllm.model_executor.models.qwen2_vl, which imports einops at the top
                "einops")
# must never be in it: each changes the code paths vLLM takes on a CPU
ABSENT = ("intel_extension_for_pytorch", "triton", "xformers", "vllm")


PINS = (TORCH, *REQUIREMENTS, *(f"absent {m}" for m in ABSENT))


def _fill(python: Path, scratch: Path, say: Callable[[str], None]) -> None:
    say(f"installing {TORCH} (the local CPU build)")
    pip(python, "install", "--quiet", TORCH)
    say(f"installing the {len(REQUIREMENTS)} pure-Python packages vLLM 0.6.3 and its OpenAI server need: "
        f"{', '.join(REQUIREMENTS)}")
    pip(python, "install", "--quiet", *REQUIREMENTS)
    pip(python, "uninstall", "--quiet", "-y", *ABSENT)
    _airports(python, say)
    _outlines_compiled(python, scratch, say)


# a guided regex turned into outlines' token index with a small byte-level tokenizer: every numba function of that
# path compiled once, into numba's cache beside outlines' own files
_COMPILE_OUTLINES = """
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast
from outlines.fsm.guide import RegexGuide
from outlines.models.transformers import TransformerTokenizer

tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(["<tool_call> a tool call </tool_call>"] * 4, trainers.BpeTrainer(
    vocab_size=300, special_tokens=["<|im_end|>"], show_progress=False,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")
RegexGuide("<tool_call>\\n[a-z]+ [0-9]{1,3}", TransformerTokenizer(fast))
"""


def _outlines_compiled(python: Path, scratch: Path, say: Callable[[str], None]) -> None:
    """outlines (vLLM 0.6.3's guided decoding) compiles its numba functions on the first guided request of every new
    environment, 10-20 s inside a server's first request; compiled here once instead, into the environment."""
    say("compiling outlines' numba functions once (guided decoding: about 15 s)")
    env = {"PATH": "/usr/bin:/bin", "HOME": str(scratch), "OUTLINES_CACHE_DIR": str(scratch / "outlines"),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    proc = subprocess.run([str(python), "-c", _COMPILE_OUTLINES], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise InputError(f"compiling outlines' numba functions in the new CPU runtime failed (exit "
                         f"{proc.returncode}):\n{tail}", hint="run again (nothing half-built is kept); if it fails "
                         "the same way, the installed outlines or numba does not work with this Python")


def _airports(python: Path, say: Callable[[str], None]) -> None:
    """outlines.types imports pyairports.airports.AIRPORT_LIST when outlines is imported (by every chat request);
    the only pyairports a package index may hold (0.0.1) is an empty placeholder, so the module is written here,
    with no airports: guided decoding by airport code is the one thing that would differ."""
    site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    package = site / "pyairports"
    if (package / "airports.py").exists():
        return
    say(f"pyairports has no airports module (an empty placeholder): writing one with no airports in {package}")
    package.mkdir(exist_ok=True)
    (package / "__init__.py").touch()
    (package / "airports.py").write_text("AIRPORT_LIST: list = []  # written by toolkit: the index's pyairports is "
                                         "an empty placeholder\n")


def runtime() -> Path:
    """The runtime's Python, built on first use (about a minute, about 1.8 GB)."""
    return venv(KIND, NAME, _fill, "about a minute, about 1.8 GB", PINS)


def built() -> Path | None:
    """The runtime's Python if it is built already (`toolkit build` uses it only then)."""
    return cached_python(KIND, NAME, _fill, PINS)
