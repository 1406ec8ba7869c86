"""What a rehearsal is made of and says: its sizes, a check's result, a substitution, the rehearsal's record."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# the tiny model's length: the tool-thread check's third turn (29 tool schemas in the flagship's template) is about
# 7,200 of its tokens; the completion-limit check prefills a prompt this long, whose prefix attention grows with its
# square (measured on the second model's served server alone: 12,288 tokens took 61 s, 8,192 took 37 s)
MAX_MODEL_LEN = 8192
# below the rehearsal's prompt lengths, so a prefill is chunked and runs beside decodes, as on the platform
BATCH_TOKENS = 256
# a multimodal model's start profiles one max-size image in one sequence (the adapter since 2f7d5f5: 1,282 tokens of
# the tiny model's vision tower), and vLLM refuses a budget under that: the served server of such a model gets this
# budget; the comparison servers, whose requests are text, start with no image per prompt and the small budget, so
# the prompts that chunk stay short (measured: a fast-path mutant's rehearsal took 71 s with prompts grown 4x for
# the large budget, 35 s with these)
MULTIMODAL_BATCH_TOKENS = 1536
# a run config that lets a prompt carry several images is rehearsed with two (the several-images check sends two):
# its start profiles two max-size images in one sequence (2 x 1,280 + 2 tokens), so its served server gets this budget
SEVERAL_IMAGES = 2
SEVERAL_IMAGES_BATCH_TOKENS = 2688
# the KV cache the vendor sizes from the emulated card's memory is allocated in this machine's memory (the start's
# profile run of a MULTIMODAL_BATCH_TOKENS prefill with its image must leave room for it)
DEVICE_MEMORY_GB = 2.0
START_TIMEOUT_S = 600.0
MAX_TOKENS = 8
SWAP_SPACE_GB = 0
TOP_LOGPROBS = 5
# the servers whose answers are compared (cache on, cache off, TP 1) compute in float32: in bf16 how a prefill is
# chunked and batched changes its rounding, and through the MoE router's top-k that can change a token (measured: a
# bf16 chunked GatedDeltaNet prefill one ulp off moved a random model's logprobs by 0.5); the served dtype's server
# runs every other check
COMPARED_DTYPE = "float32"
# the comparison servers name each token by its id (vLLM 0.6.3's flag; the adapter's serving_chat.py keeps it): a
# token that prints as no text, or as another's text, is still told apart
TOKEN_IDS_FLAG = "--return-tokens-as-token-ids"
# two float32 answers that part where both runs had the two tokens this close in logprob took the two sides of a
# near-tie (the generation test's tolerance)
TIE_NATS = 1e-3


@dataclass(frozen=True)
class Substitution:
    flag: str
    served: str | None  # what the run config says (None: it says nothing)
    rehearsed: str
    why: str


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str
    applicable: bool = True  # False: nothing of the run config for this check to look at (the detail says why)

    @property
    def result(self) -> str:
        return "n/a" if self.applicable is False else ("ok" if self.ok else "FAIL")


def not_applicable(name: str, why: str) -> Check:
    return Check(name, True, why, applicable=False)


@dataclass
class Rehearsal:
    """One variant's rehearsal: its checks, and what ran instead of the platform's."""

    variant: str
    tp: int
    rundir: Path
    checks: list[Check] = field(default_factory=list)
    substitutions: list[Substitution] = field(default_factory=list)
    shims: list[str] = field(default_factory=list)
    references: dict[str, int] = field(default_factory=dict)  # the vendor's GPU library computed: calls
    ready_s: float | None = None
    first_token_s: float | None = None
    hit_rate: float | None = None
    logs: list[str] = field(default_factory=list)
    requests: list[dict[str, Any]] = field(default_factory=list)  # each request the checks sent, as answered

    @property
    def ok(self) -> bool:
        return bool(self.checks) and all(c.ok for c in self.checks)

    def has(self, name: str) -> bool:
        return any(c.name == name for c in self.checks)

    def substitute(self, *subs: Substitution) -> None:
        """Said once each, in the order first met."""
        self.substitutions.extend(s for s in subs if s not in self.substitutions)

    def as_json(self) -> dict[str, Any]:
        return {"variant": self.variant, "tp": self.tp, "ok": self.ok, "rundir": str(self.rundir),
                "checks": [{**asdict(c), "result": c.result} for c in self.checks],
                "substitutions": [asdict(s) for s in self.substitutions], "shims": self.shims,
                "references": self.references, "ready_s": self.ready_s, "first_token_s": self.first_token_s,
                "cache_hit_rate": self.hit_rate, "logs": self.logs, "requests": self.requests}
