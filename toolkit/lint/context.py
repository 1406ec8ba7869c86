"""What a lint rule sees (the recipe, the variant, the vendor's parser read from source) and the one table rules
register themselves in."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from packaging.version import Version

from toolkit.errors import InputError
from toolkit.inputs import fetch_reference
from toolkit.recipe import ArgValue, LoadedRecipe, Recipe
from toolkit.results import Issue, Origin, Severity
from toolkit.transforms.deploy import Deploy

TRUE = {"true", "1", "yes", "on"}
FALSE = {"false", "0", "no", "off"}


# vLLM before 0.7 turns chunked prefill on by itself above this context (EngineArgs.create_engine_config)
AUTO_CHUNKED_ABOVE = 32768


def explicit_chunked_prefill(value: ArgValue) -> bool | None:
    """--enable-chunked-prefill as vLLM's StoreBoolean reads it: True/False when set, None when left to vLLM."""
    if value is True:
        return True
    if isinstance(value, str):
        return value.lower() in TRUE if value.lower() in TRUE | FALSE else None
    return None


def images_per_prompt(value: ArgValue) -> int:
    """The images one prompt may carry, from --limit-mm-per-prompt's value (vLLM's `key=value,...`, e.g. `image=12`);
    vLLM's default is 1; a value it cannot read is the unknown-flag rule's and preflight's to refuse, and counts as
    the default here."""
    if not isinstance(value, str):
        return 1
    for item in value.split(","):
        key, _, count = item.partition("=")
        if key.strip() == "image" and count.strip().isdigit():
            return int(count)
    return 1


def chunked_prefill_effective(value: ArgValue, max_model_len: int | None, version: Version,
                              auto: bool = True) -> bool:
    """Whether vLLM chunks prefills: the flag's value when given, else (`auto`: the tree still has vLLM's rule)
    on for a context above 32K before 0.7."""
    explicit = explicit_chunked_prefill(value)
    if explicit is not None:
        return explicit
    return bool(auto and max_model_len and max_model_len > AUTO_CHUNKED_ABOVE and version < Version("0.7"))


@dataclass
class LintContext:
    loaded: LoadedRecipe
    recipe: Recipe  # with the variant's overrides applied
    variant: str | None = None
    rootfs: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    compare_base: bool = False  # with rootfs: compare its vendor tree with vendor.reference's neighbours

    # -- serve args, by their dash spelling -----------------------------------------------------

    @cached_property
    def args(self) -> dict[str, ArgValue]:
        return {k.replace("_", "-"): v for k, v in self.recipe.serve.args.items()}

    def arg(self, name: str) -> ArgValue:
        return self.args.get(name)

    def has_flag(self, name: str) -> bool:
        value = self.arg(name)
        return value is True or (isinstance(value, str) and value.lower() in TRUE)

    def int_arg(self, name: str, default: int | None = None) -> int | None:
        value = self.arg(name)
        if value is None or isinstance(value, bool | list):
            return default
        try:
            return int(float(value))
        except ValueError:
            return default

    def float_arg(self, name: str, default: float) -> float:
        value = self.arg(name)
        try:
            return float(value) if value is not None and not isinstance(value, bool | list) else default
        except ValueError:
            return default

    def origin_of_arg(self, name: str) -> Origin | None:
        for key in (name, name.replace("-", "_")):
            if self.variant and (origin := self._variant_origin("args", key)):
                return origin
            if key in self.recipe.serve.args:
                return self.loaded.origin("serve", "args", key)
        return self.loaded.origin("serve", "args")

    def origin_of_env(self, name: str) -> Origin | None:
        if self.variant and (origin := self._variant_origin("env", name)):
            return origin
        return self.loaded.origin("env", name)

    def _variant_origin(self, section: str, key: str) -> Origin | None:
        loc = ("variants", self.variant or "", section, key)
        if loc in self.loaded.located.key_marks:
            return self.loaded.origin(*loc)
        if self.variant and (("matrix", section, key) in self.loaded.located.key_marks):
            return self.loaded.origin("matrix", section, key)
        return None

    # -- vLLM semantics -----------------------------------------------------------------------

    @cached_property
    def vllm_version(self) -> Version:
        return Version(self.recipe.vendor.reference_version)

    def chunked_prefill(self) -> bool | None:
        """True/False when set explicitly, None when left to vLLM."""
        return explicit_chunked_prefill(self.arg("enable-chunked-prefill"))

    def chunked_prefill_effective(self) -> bool:
        return chunked_prefill_effective(self.arg("enable-chunked-prefill"), self.int_arg("max-model-len"),
                                         self.vllm_version)

    def images_per_prompt(self) -> int:
        return images_per_prompt(self.arg("limit-mm-per-prompt"))

    def max_num_batched_tokens(self) -> int | None:
        explicit = self.int_arg("max-num-batched-tokens")
        if explicit is not None:
            return explicit
        max_len = self.int_arg("max-model-len")
        if self.chunked_prefill_effective():
            return 512
        return max(max_len, 2048) if max_len else None

    def attention_backend(self) -> str:
        return self.recipe.attention_backend()

    def unhardcoded(self, kwarg: str) -> bool:
        return any(getattr(t, "kind", "") == "set-kwarg" and getattr(t, "arg", "") == kwarg
                   for t in self.recipe.transforms)

    @cached_property
    def reference_tree(self) -> Path | None:
        base = self.recipe.base_image
        try:
            return fetch_reference(self.recipe.vendor.reference, base.python, base.platform)
        except InputError as exc:
            self.extra["reference_error"] = str(exc)
            return None

    @cached_property
    def deployed_paths(self) -> list[Path]:
        return [self.loaded.patches_dir / t.source for t in self.recipe.transforms
                if isinstance(t, Deploy) and t.pinned is None]

    def deployed_file(self, rel: str) -> tuple[Path | None, Deploy | None]:
        """The file a deploy puts at `rel` in every vendor root (rel: `vllm/...`), as it will be there: the deploy's
        source (None where it comes from a declared source not found here) and the deploy; (None, None) where
        nothing is deployed there (the vendor's file stays)."""
        for t in reversed(self.recipe.transforms):
            if not isinstance(t, Deploy) or t.dest.startswith("/"):
                continue
            dest = t.dest.rstrip("/")
            if not t.covers(rel):
                continue
            if t.pinned is None:
                base = self.loaded.patches_dir / t.source
            elif t.pinned in self.loaded.found:
                base = self.loaded.found[t.pinned] / t.pinned_path
            else:
                return None, t
            return (base / rel[len(dest) + 1:] if rel != dest else base), t
        return None, None

    def patched_file(self, rel: str) -> tuple[Path | None, Deploy | None]:
        """The file at `rel` of the patched tree: a deploy's source, else the reference release's (the vendor's
        edits by transforms are not applied: no rule here reads what they change)."""
        source, deploy = self.deployed_file(rel)
        if deploy is not None:
            return source, deploy
        tree = self.reference_tree
        return (tree / rel if tree is not None and (tree / rel).is_file() else None), None


Rule = Callable[[LintContext], Iterator[Issue]]


@dataclass(frozen=True)
class RuleInfo:
    id: str
    severity: Severity  # the most severe it reports
    summary: str
    check: Rule
    # only the platform's submission requires what it checks (the workload's context, ...): vLLM starts such a
    # variant, so a diagnostic run (preflight, rehearse, estimate, experiment) goes on with a warning
    platform: bool = False


RULES: dict[str, RuleInfo] = {}


def rule(rule_id: str, severity: Severity, summary: str, platform: bool = False) -> Callable[[Rule], Rule]:
    def register(fn: Rule) -> Rule:
        RULES[rule_id] = RuleInfo(rule_id, severity, summary, fn, platform)
        return fn

    return register
