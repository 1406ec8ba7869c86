"""The recipe: pydantic models, loaded from YAML with file:line errors."""

from __future__ import annotations

import hashlib
import json
import keyword
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

import libcst as cst
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from toolkit.errors import RecipeError
from toolkit.yamlpos import Located, YamlLoadError, load

ID_PATTERN = r"^[a-z0-9][a-z0-9._-]*$"
ENV_PATTERN = r"^[A-Za-z_][A-Za-z0-9_]*$"


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _python_expression(value: str) -> str:
    try:
        cst.parse_expression(value)
    except cst.ParserSyntaxError as exc:
        raise ValueError(f"not a Python expression: {value!r} ({exc.message})") from None
    return value


def _relative_path(value: str) -> str:
    path = PurePosixPath(value)
    if path.is_absolute() or ".." in path.parts or "\\" in value or not value:
        raise ValueError(f"must be a relative POSIX path inside the tree, got {value!r}")
    return value


# Names are defined once, as a pattern plus a keyword ban; the loader and the JSON Schema both take them from here,
# so a value one accepts the other accepts too.
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
_DOTTED = rf"{_IDENT}(?:\.{_IDENT})*"
_KEYWORDS = "|".join(keyword.kwlist)


def _banned(separators: str) -> str:
    edge = f"[{re.escape(separators)}]" if separators else "$^"
    return rf"(?:^|{edge})(?:{_KEYWORDS})(?:{edge}|$)"


def _name_field(pattern: str, separators: str, description: str) -> Any:
    return Field(pattern=f"^{pattern}$", description=description,
                 json_schema_extra={"not": {"pattern": _banned(separators)}})


def _no_keyword(separators: str) -> AfterValidator:
    banned = _banned(separators)

    def check(value: str) -> str:
        if re.search(banned, value):
            raise ValueError(f"{value!r} uses a Python keyword as a name")
        return value

    return AfterValidator(check)


PyExpr = Annotated[str, Field(description="A Python expression, compared structurally (formatting-independent)"),
                   AfterValidator(_python_expression)]
Identifier = Annotated[str, _name_field(_IDENT, "", "A Python identifier (not a keyword)"), _no_keyword("")]
DottedName = Annotated[str, _name_field(_DOTTED, ".", "A dotted Python name, e.g. torch.ops.foo"), _no_keyword(".")]
ScopeName = Annotated[str, _name_field(f"(?:{_DOTTED})?", ".", "A dotted scope; empty for the module"),
                      _no_keyword(".")]
CallableRef = Annotated[str, _name_field(f"{_DOTTED}:{_IDENT}", ".:", "A callable as module.path:function"),
                        _no_keyword(".:")]


class Hardware(Strict):
    vendor: str = Field(description="GPU vendor, e.g. iluvatar")
    accelerator: str = Field(description="Accelerator model, e.g. BI-V100")
    count: int = Field(ge=1, description="Accelerators per server")
    memory_gb: float = Field(gt=0, description="Memory per accelerator in GiB")
    known_issues: list[Literal["cuda-graph-capture-hang"]] = Field(
        default_factory=list, description="Failure modes known on this hardware (drive lint rules)")
    runtime_overhead_gb: float = Field(
        default=1.0, ge=0, description="Per-card memory outside vLLM's accounting (runtime, NCCL buffers), GiB")


class BaseImage(Strict):
    reference: str = Field(min_length=1, description="The vendor image the submission builds FROM")
    python: str = Field(pattern=r"^3\.\d+$", description="Python version inside the image, e.g. 3.10")
    platform: str = Field(default="manylinux1_x86_64", description="Wheel platform tag of the image")
    attention_backends: list[str] = Field(
        default_factory=lambda: ["XFORMERS"],
        description="Attention backends the image can load; the first is the one vLLM picks by default")


class Vendor(Strict):
    package: str = Field(default="vllm", description="The vendor-patched package")
    version: str = Field(description="Version specifier the vendor roots must satisfy, e.g. ==0.6.3+corex.3.2.3")
    roots: list[str] = Field(min_length=1, description="Absolute site-packages folders inside the image")
    reference: str = Field(
        description="The public release (name==version) used to check transforms off-image, e.g. vllm==0.6.3.post1"
    )
    hardcoded: dict[str, list[str]] = Field(
        default_factory=dict,
        description="Keyword arguments the vendor hard-codes -> the serving flags that do nothing until a "
        "set-kwarg transform un-hardcodes them",
    )

    @field_validator("version")
    @classmethod
    def _spec(cls, value: str) -> str:
        try:
            SpecifierSet(value)
        except InvalidSpecifier:
            raise ValueError(f"not a version specifier: {value!r} (example: ==0.6.3+corex.3.2.3)") from None
        return value

    @field_validator("roots")
    @classmethod
    def _absolute(cls, roots: list[str]) -> list[str]:
        for root in roots:
            if not root.startswith("/"):
                raise ValueError(f"vendor roots are absolute paths inside the image, got {root!r}")
        if len(set(roots)) != len(roots):
            raise ValueError("vendor roots are listed twice")
        return roots

    @field_validator("reference")
    @classmethod
    def _pinned(cls, value: str) -> str:
        name, sep, version = value.partition("==")
        if not sep or not name or not version:
            raise ValueError(f"reference must be pinned as name==version, got {value!r}")
        try:
            Version(version)
        except InvalidVersion:
            raise ValueError(f"not a version: {version!r}") from None
        return value

    @property
    def reference_name(self) -> str:
        return self.reference.partition("==")[0]

    @property
    def reference_version(self) -> str:
        return self.reference.partition("==")[2]


class Gate(Strict):
    vendor_version: str | None = Field(
        default=None, description="Apply only when the root's vendor version matches this specifier"
    )

    @field_validator("vendor_version")
    @classmethod
    def _spec(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                SpecifierSet(value)
            except InvalidSpecifier:
                raise ValueError(f"not a version specifier: {value!r}") from None
        return value


class TransformBase(Strict):
    kind: str
    id: str = Field(pattern=ID_PATTERN, description="Unique id; it is also the marker name")
    why: str = Field(min_length=1, description="Provenance: why this change is needed")
    remove_when: str = Field(min_length=1, description="Provenance: when this change can be dropped")
    gate: Gate | None = Field(default=None, description="Conditions that exclude this transform (GATED_OFF)")
    package: str | None = Field(
        default=None, description="The package whose roots this transform edits: vendor.package (default) or "
        "a name declared under packages (e.g. transformers); paths are relative to that package's roots")
    requires: list[str] = Field(
        default_factory=list, description="Ids of transforms whose files this one needs at run time (e.g. an import "
        "of a deployed module): where they cannot be applied (a source not available here), neither is this one")

    # Fields that do not change what the transform does; a change to them must not make markers stale.
    _provenance_fields: typing.ClassVar[frozenset[str]] = frozenset({"why", "remove_when", "requires"})

    @property
    def target_label(self) -> str:
        """What the transform changes, as shown in reports."""
        return str(getattr(self, "file", None) or getattr(self, "dest", None) or getattr(self, "link", ""))

    def digest(self) -> str:
        body = self.model_dump(mode="json", exclude=set(self._provenance_fields))
        if body.get("package") is None:
            body.pop("package", None)  # the default package: digests of existing transforms stay as they were
        raw = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(raw).hexdigest()[:12]


class SourceTransform(TransformBase):
    file: str = Field(description="Module path relative to the vendor root, e.g. vllm/engine/arg_utils.py")
    scope: ScopeName = Field(default="",
                             description="Dotted scope inside the module, e.g. EngineArgs.create_model_config")
    expect: int = Field(default=1, ge=1, description="How many sites must match (the match contract)")

    @field_validator("file")
    @classmethod
    def _py_file(cls, value: str) -> str:
        _relative_path(value)
        if not value.endswith(".py"):
            raise ValueError(f"source transforms edit .py files, got {value!r}")
        return value


class SetKwarg(SourceTransform):
    """Set a keyword argument of a call inside a scope (un-hardcode a literal)."""

    kind: Literal["set-kwarg"]
    call: DottedName = Field(description="The callee as written, e.g. ModelConfig or torch.ops.foo")
    arg: Identifier = Field(description="The keyword argument name")
    old: PyExpr | None = Field(default=None, description="The value it must have now (any value when omitted)")
    new: PyExpr = Field(description="The value to set")


class Assign(SourceTransform):
    """Replace or remove a plain assignment `target = old` inside a scope."""

    kind: Literal["assign"]
    target: Identifier = Field(description="The assigned name")
    old: PyExpr | None = Field(default=None, description="The value assigned now (any value when omitted)")
    new: PyExpr | None = Field(default=None, description="The new value; omit to remove the statement")
    others: int = Field(
        default=0, ge=0,
        description="How many other assignments to the target the scope holds, before and after (e.g. upstream's "
        "own heuristic before a vendor override); any other count means the code changed: DRIFTED")

    @model_validator(mode="after")
    def _remove_needs_old(self) -> Assign:
        if self.new is None and self.old is None:
            raise ValueError("removing an assignment needs `old` so that only the intended statement goes")
        return self


class DictEntries(SourceTransform):
    """Insert entries into a dict literal bound to a name."""

    kind: Literal["dict-entries"]
    name: Identifier = Field(description="The name the dict literal is assigned to")
    entries: dict[str, PyExpr] = Field(min_length=1, description="String key -> value expression")
    after: str | None = Field(default=None, description="Insert after this existing key (default: at the end)")


class Dispatch(SourceTransform):
    """Insert `if <switch on> [and <when>]: return injected(...)` at the top of a function."""

    kind: Literal["dispatch"]
    switch: str = Field(pattern=ENV_PATTERN, description="Environment variable that turns the fast path on")
    default: Literal["0", "1"] | None = Field(
        default=None, description="Value of the switch when it is unset; omitted: the default in the injected "
        "package's switches.json (the one table the package reads too)")
    target: CallableRef = Field(description="The injected callable, as module.path:function")
    args: list[PyExpr] | None = Field(
        default=None, description="Arguments passed to it (default: the function's own parameters, in order)"
    )
    when: PyExpr | None = Field(default=None, description="An extra condition, evaluated inside the function")



class AddImport(SourceTransform):
    """Add `import module` or `from module import names` after the module's imports."""

    kind: Literal["add-import"]
    module: DottedName
    names: list[Identifier] = Field(default_factory=list,
                                    description="Names to import from the module (empty: import it)")

    @model_validator(mode="after")
    def _module_scope(self) -> AddImport:
        if self.scope:
            raise ValueError("add-import works at module level; leave `scope` empty")
        return self


def _python_block(value: str) -> str:
    try:
        module = cst.parse_module(textwrap.dedent(value).strip("\n") + "\n")
    except cst.ParserSyntaxError as exc:
        raise ValueError(f"not Python statements: {exc.message} at line {exc.raw_line}") from None
    if not module.body:
        raise ValueError("no statement given")
    return value


PyBlock = Annotated[str, Field(description="Python statements (dedented; compared structurally)"),
                    AfterValidator(_python_block)]


class Statements(SourceTransform):
    """Replace a run of statements in a scope (`old`), insert after one (`after`), or insert at the scope's top."""

    kind: Literal["statements"]
    old: PyBlock | None = Field(default=None, description="The consecutive statements to replace")
    after: PyBlock | None = Field(default=None, description="The statement(s) to insert `new` after")
    new: PyBlock = Field(description="The statements written instead of `old`, after `after`, or at the top")

    @model_validator(mode="after")
    def _one_place(self) -> Statements:
        if self.old is not None and self.after is not None:
            raise ValueError("give `old` (replace) or `after` (insert after), not both")
        if self.old is None and self.after is None and not self.scope:
            raise ValueError("inserting at the top needs a function or class `scope`")
        return self


class ReplaceBody(SourceTransform):
    """Replace a function body with the body of a function in patches/src."""

    kind: Literal["replace-body"]
    source: str = Field(description="path/in/patches.py:qualified.function whose body is used")
    old_digest: str | None = Field(
        default=None, description="sha256 prefix of the body being replaced (toolkit diff prints it)"
    )

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        path, sep, qualname = value.partition(":")
        if not sep:
            raise ValueError(f"source must be path.py:function, got {value!r}")
        _relative_path(path)
        if not re.fullmatch(_DOTTED, qualname) or re.search(_banned("."), qualname):
            raise ValueError(f"not a dotted Python name: {qualname!r}")
        return value


Sha256 = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$", description="A full sha256 in hex")]


class Deploy(TransformBase):
    """Copy a file or folder from patches/src into a vendor root (relative dest) or the image (absolute dest)."""

    kind: Literal["deploy"]
    source: str = Field(description="Path relative to the recipe's patches folder")
    dest: str = Field(description="Relative: inside every vendor root; absolute: inside the image filesystem")
    overwrite: bool = Field(default=False, description="Allow replacing a file that exists with other content")
    replaces: Sha256 | None = Field(
        default=None, description="A whole-file replacement as a contract: the sha256 (line endings normalised "
        "to LF) of the vendor file this deploy replaces. Any other file there is DRIFTED and nothing is written; "
        "one file only")

    @field_validator("source")
    @classmethod
    def _source(cls, value: str) -> str:
        if value.startswith("@"):
            name, _, rest = value[1:].partition("/")
            if not name or not rest:
                raise ValueError(f"a file of a declared source is written @name/path, got {value!r}")
            _relative_path(rest)
            return value
        return _relative_path(value)

    @property
    def tree(self) -> str | None:
        """The declared source this deploy takes its files from, if any."""
        return self.source[1:].partition("/")[0] if self.source.startswith("@") else None

    @property
    def tree_path(self) -> str:
        return self.source[1:].partition("/")[2] if self.source.startswith("@") else self.source

    @model_validator(mode="after")
    def _one_replacement(self) -> Deploy:
        if self.replaces is not None and self.overwrite:
            raise ValueError("`replaces` already allows the replacement, and only of that file: drop `overwrite`")
        if self.replaces is not None and self.package is None and self.dest.startswith("/"):
            raise ValueError("`replaces` contracts a vendor file: dest is relative to the package roots")
        return self

    @field_validator("dest")
    @classmethod
    def _dest(cls, value: str) -> str:
        if value.startswith("/"):
            _relative_path(value.lstrip("/"))
        else:
            _relative_path(value)
        return value


class Symlink(TransformBase):
    """Create a symlink; the target may be a glob, resolved beside the link (exactly `expect` matches)."""

    kind: Literal["symlink"]
    link: str = Field(description="Absolute: in the image filesystem; relative: in every vendor root")
    target: str = Field(description="What the link points to; a glob (*, ?) is resolved in the link's folder")
    expect: int = Field(default=1, ge=1, le=1, description="How many files the glob must match")

    @model_validator(mode="after")
    def _no_package(self) -> Symlink:
        if self.package is not None:
            raise ValueError("a symlink is made in the vendor roots or the image filesystem; drop `package`")
        return self

    @property
    def is_glob(self) -> bool:
        return any(ch in self.target for ch in "*?[")


Transform = Annotated[
    SetKwarg | Assign | DictEntries | Dispatch | AddImport | Statements | ReplaceBody | Deploy | Symlink,
    Field(discriminator="kind"),
]
TRANSFORM_MODELS: dict[str, type[TransformBase]] = {
    typing.get_args(m.model_fields["kind"].annotation)[0]: m
    for m in (SetKwarg, Assign, DictEntries, Dispatch, AddImport, Statements, ReplaceBody, Deploy, Symlink)
}

ArgValue = str | int | float | bool | list[str] | None


class Serve(Strict):
    module: DottedName = Field(default="vllm.entrypoints.openai.api_server", description="python3 -m MODULE")
    workdir: str = Field(default="/workspace", description="Neutral working directory (no vllm/ folder in it)")
    concurrency: int = Field(default=1, ge=1, description="The platform's concurrency setting")
    args: dict[str, ArgValue] = Field(
        default_factory=dict,
        description="Server flags without leading dashes; true = bare flag, false/null = omitted",
    )
    workload: dict[str, int] = Field(
        default_factory=dict, description="What the evaluation needs, e.g. min_context_tokens: 235000"
    )


class LinearAttention(Strict):
    num_key_heads: int = Field(ge=1)
    num_value_heads: int = Field(ge=1)
    key_head_dim: int = Field(ge=1)
    value_head_dim: int = Field(ge=1)
    conv_kernel: int = Field(default=4, ge=1)


class ConfigFallback(Strict):
    """A model the reference tree and the stock transformers know, with the same attention shape."""

    model_type: str = Field(description="e.g. qwen2_moe")
    architecture: Identifier = Field(description="e.g. Qwen2MoeForCausalLM")


class ModelShape(Strict):
    """What the KV-cache estimate needs to know about the served model."""

    params_b: float = Field(gt=0, description="Total parameters, billions (all experts)")
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    hidden_size: int = Field(ge=1)
    num_layers: int = Field(ge=1)
    full_attention_interval: int = Field(
        default=1, ge=1, description="Layer i is full attention when (i + 1) % interval == 0; others are linear")
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    linear_attention: LinearAttention | None = None
    architecture: Identifier | None = Field(
        default=None, description="The architecture the served config.json declares, e.g. Qwen3_5MoeForCausalLM "
        "(preflight resolves it through the patched registry)")
    model_type: str | None = Field(default=None, description="The served config's model_type, e.g. qwen3_5_moe")
    num_attention_heads: int | None = Field(
        default=None, ge=1, description="Query heads of a full-attention layer (default hidden/head_dim)")
    layers_block_type: bool = Field(
        default=False, description="Whether the served config declares layers_block_type; without it vLLM 0.6.3 "
        "counts every layer as attention when it sizes the KV cache")
    config_fallback: ConfigFallback | None = Field(
        default=None, description="What preflight builds the config as when the served model's config classes come "
        "from a source that is not available here (the vendor's config checks still run; the architecture is not "
        "checked, and the report says so)")


class Source(Strict):
    """A pinned upstream the recipe builds on (the model adapter), and what it is known to add.

    Deploys name its files as `@name/path`. With a local checkout (`path`, or `--source name=PATH`) the
    pinned commit is exported from it and bundled into the submission; without one, the submission
    clones the URL at image build and checks out and verifies the pinned commit (the builder needs git
    and network), and the build says so.
    """

    name: str = Field(pattern=ID_PATTERN)
    git: str = Field(description="Repository URL")
    commit: str = Field(pattern=r"^[0-9a-f]{40}$", description="The pinned commit")
    subdir: str | None = Field(default=None, description="The folder of the repository that `@name/path` is "
                               "relative to (e.g. qwen3_6_scripts)")
    path: str | None = Field(default=None, description="Local checkout (relative to the recipe) to bundle from")
    digests: str | None = Field(
        default=None, description="A lock file (relative to the recipe, JSON path -> sha256) of the used files at "
        "the pinned commit; the in-image step checks a fetched source against it")

    @field_validator("subdir")
    @classmethod
    def _subdir(cls, value: str | None) -> str | None:
        return None if value is None else _relative_path(value.rstrip("/"))
    provides_flags: list[str] = Field(default_factory=list, description="Server flags its CLI module adds")
    provides_tool_parsers: list[str] = Field(default_factory=list)


class Package(Strict):
    """A second package the recipe edits besides the vendor's (e.g. transformers), with roots of its own."""

    name: DottedName = Field(description="The import name, e.g. transformers")
    version: str = Field(description="Version specifier its roots must satisfy, e.g. ==4.55.3")
    install: str | None = Field(
        default=None, description="name==version: the wheel the submission carries and the in-image step installs "
        "offline when the image holds another version")
    roots: list[str] = Field(
        default_factory=list, description="Absolute site-packages folders in the image; empty: found in the image "
        "with importlib.util.find_spec (without importing it), on a host with --package-root NAME=DIR")
    reference: str | None = Field(
        default=None, description="The release (name==version) the build tries the transforms on; default: install")

    _spec = field_validator("version")(Vendor._spec.__func__)  # type: ignore[attr-defined]

    @field_validator("install", "reference")
    @classmethod
    def _pinned(cls, value: str | None) -> str | None:
        return None if value is None else Vendor._pinned.__func__(cls, value)  # type: ignore[attr-defined]

    @property
    def trial_release(self) -> str | None:
        return self.reference or self.install


class Overrides(Strict):
    args: dict[str, ArgValue] = Field(default_factory=dict, description="Serve args to set (null removes one)")
    env: dict[str, str | None] = Field(default_factory=dict, description="Env to set (null removes one)")


class Matrix(Strict):
    args: dict[str, list[ArgValue]] = Field(default_factory=dict, description="Serve arg -> values to try")
    env: dict[str, list[str]] = Field(default_factory=dict, description="Env var -> values to try")


class Checks(Strict):
    lf_only: list[str] = Field(
        default_factory=list, description="Globs (relative to each vendor root) of files that must be LF-only"
    )


class Recipe(Strict):
    name: str = Field(pattern=ID_PATTERN)
    description: str = ""
    hardware: Hardware
    base_image: BaseImage
    vendor: Vendor
    patches: str = Field(default="../patches/src", description="The patches folder, relative to the recipe file")
    transforms: list[Transform] = Field(default_factory=list,
                                        description="The code changes (none for a serve-only recipe)")
    env: dict[str, str] = Field(default_factory=dict, description="Environment of the server")
    serve: Serve
    checks: Checks = Field(default_factory=Checks)
    model: ModelShape | None = Field(default=None, description="Model shape, for the KV-cache estimate")
    sources: list[Source] = Field(default_factory=list, description="Pinned upstream sources")
    packages: list[Package] = Field(default_factory=list,
                                    description="Packages besides the vendor's that transforms edit")
    variants: dict[str, Overrides] = Field(default_factory=dict, description="Named experiment variants")
    matrix: Matrix | None = Field(default=None, description="Variants expanded as the product of these values")

    @field_validator("variants")
    @classmethod
    def _variant_names(cls, variants: dict[str, Overrides]) -> dict[str, Overrides]:
        for name in variants:
            if not re.match(ID_PATTERN, name) or name == "base":
                raise ValueError(f"variant names are lowercase ids (and not 'base'), got {name!r}")
        return variants

    @model_validator(mode="after")
    def _known_sources(self) -> Recipe:
        names = {s.name for s in self.sources}
        for t in self.transforms:
            tree = getattr(t, "tree", None)
            if tree is not None and tree not in names:
                raise ValueError(f"transform {t.id} deploys from @{tree}, which is not declared under sources "
                                 f"(declared: {', '.join(sorted(names)) or 'none'})")
        return self

    @model_validator(mode="after")
    def _known_requirements(self) -> Recipe:
        ids = {t.id for t in self.transforms}
        for t in self.transforms:
            unknown = [r for r in t.requires if r not in ids or r == t.id]
            if unknown:
                raise ValueError(f"transform {t.id} requires {', '.join(unknown)}, which is not another transform "
                                 "of this recipe")
        return self

    @model_validator(mode="after")
    def _known_packages(self) -> Recipe:
        names = {p.name for p in self.packages}
        if self.vendor.package in names:
            raise ValueError(f"packages lists the vendor package {self.vendor.package}; it is declared by vendor")
        for t in self.transforms:
            if t.package is not None and t.package not in names | {self.vendor.package}:
                raise ValueError(f"transform {t.id} edits package {t.package!r}, which is not declared under "
                                 f"packages (declared: {', '.join(sorted(names)) or 'none'})")
        return self

    def with_expectations(self, expected: dict[str, str]) -> Recipe:
        """The recipe with the `replaces` digests of its replacement deploys taken from a lock (dest -> sha256)."""
        contracts = {t.dest: t for t in self.transforms if isinstance(t, Deploy) and t.replaces is not None}
        unknown = sorted(set(expected) - set(contracts))
        if unknown:
            raise ValueError(f"no replacement deploy has dest {', '.join(unknown)} (known: {', '.join(contracts)})")
        for dest, digest in expected.items():
            if not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(f"{dest}: not a sha256: {digest!r}")
        transforms = [t.model_copy(update={"replaces": expected[t.dest]})
                      if isinstance(t, Deploy) and t.dest in expected else t for t in self.transforms]
        return self.model_copy(update={"transforms": transforms})

    def package_of(self, transform: TransformBase) -> str:
        return transform.package or self.vendor.package

    def for_package(self, name: str) -> list[TransformBase]:
        return [t for t in self.transforms if self.package_of(t) == name]

    def package(self, name: str) -> Package | None:
        return next((p for p in self.packages if p.name == name), None)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not re.match(ENV_PATTERN, name):
                raise ValueError(f"not an environment variable name: {name!r}")
        return env


@dataclass(frozen=True)
class LoadedRecipe:
    """A validated recipe plus where it came from (for file:line messages and relative paths)."""

    recipe: Recipe
    path: Path
    located: Located

    @property
    def patches_dir(self) -> Path:
        return (self.path.parent / self.recipe.patches).resolve()

    def line_of(self, *loc: str | int) -> int | None:
        mark = self.located.mark_for(loc)
        return mark.line if mark else None

    def transform_line(self, index: int) -> int | None:
        return self.line_of("transforms", index)

    def where(self, index: int) -> str:
        line = self.transform_line(index)
        return f"{self.path}:{line}" if line else str(self.path)


def _unwrap(annotation: Any) -> list[Any]:
    """The model classes an annotation can hold (through Optional, list, dict, Annotated)."""
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType, list, dict):
        out: list[Any] = []
        for arg in typing.get_args(annotation):
            out.extend(_unwrap(arg))
        return out
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return []


def _strip(annotation: Any) -> Any:
    """Drop Annotated and Optional around an annotation."""
    while typing.get_origin(annotation) is Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return _strip(args[0])
    return annotation


def _pick_model(annotation: Any, node: Any) -> type[BaseModel] | None:
    models: list[type[BaseModel]] = _unwrap(annotation)
    if len(models) == 1:
        return models[0]
    if isinstance(node, dict) and node.get("kind") in TRANSFORM_MODELS:
        return TRANSFORM_MODELS[node["kind"]]  # the discriminated union: the YAML's own kind decides
    return None


def _model_at(data: Any, loc: tuple[str | int, ...]) -> type[BaseModel] | None:
    """The model class that owns the mapping at a (cleaned) data location."""
    annotation: Any = Recipe
    node = data
    for part in loc:
        model = _pick_model(annotation, node)
        if model is not None and isinstance(part, str) and part in model.model_fields:
            annotation = model.model_fields[part].annotation
        else:  # a list index or a free dict key: step into the container's item type
            args = typing.get_args(_strip(annotation))
            annotation = args[-1] if args else None
        try:
            node = node[part]
        except (KeyError, IndexError, TypeError):
            node = None
    return _pick_model(annotation, node)


def _clean_loc(data: Any, loc: tuple[str | int, ...]) -> tuple[str | int, ...]:
    """Drop pydantic's synthetic parts (union tags, function-after names) from a location."""
    out: list[str | int] = []
    node = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if (isinstance(node, dict) and part in node) or in_list:
            out.append(part)
            node = node[part]
        elif last and isinstance(node, dict) and isinstance(part, str) and not part.startswith("function-"):
            out.append(part)  # a missing field
        # else: a tag such as 'set-kwarg' or '[key]' that is not in the data
    return tuple(out)


def _format_error(source: str, located: Located, err: Any) -> RecipeError:
    loc = _clean_loc(located.data, tuple(err["loc"]))
    mark = located.mark_for(loc)
    key = ".".join(str(p) for p in loc) or None
    kind = err["type"]
    message = err["msg"].removeprefix("Value error, ")
    hint: str | None = None
    if kind == "extra_forbidden":
        owner = _model_at(located.data, loc[:-1])
        valid = sorted(owner.model_fields) if owner else []
        message = f"unknown key {loc[-1]!r}"
        hint = f"valid keys here: {', '.join(valid)}" if valid else None
    elif kind == "missing":
        parent = located.mark_for(loc[:-1])
        mark = parent
        message = f"missing required key {loc[-1]!r}"
    elif kind == "union_tag_not_found":
        message = f"missing `kind`; known kinds: {', '.join(sorted(TRANSFORM_MODELS))}"
    elif kind == "union_tag_invalid":
        loc = (*loc, "kind")
        mark = located.mark_for(loc)
        key = ".".join(str(p) for p in loc)
        message = f"unknown kind {err['ctx']['tag']!r}"
        hint = f"known kinds: {', '.join(sorted(TRANSFORM_MODELS))}"
    elif "input" in err and isinstance(err["input"], str | int | float | bool):
        message = f"{message} (got {err['input']!r})"
    return RecipeError(
        source, mark.line if mark else None, mark.column if mark else None, message, key=key, hint=hint
    )


def parse_recipe(text: str, source: str = "<recipe>") -> tuple[Recipe, Located]:
    try:
        located = load(text)
    except YamlLoadError as exc:
        raise RecipeError(
            source, exc.mark.line if exc.mark else None, exc.mark.column if exc.mark else None, exc.message
        ) from None
    if not isinstance(located.data, dict):
        raise RecipeError(source, 1, 1, "a recipe is a YAML mapping at the top level")
    try:
        recipe = Recipe.model_validate(located.data)
    except ValidationError as exc:
        errors = [_format_error(source, located, e) for e in exc.errors()]
        if len(errors) > 1:
            combined = errors[0]
            combined.message = f"{source}: {len(errors)} problems:\n" + "\n".join(f"  {e}" for e in errors)
            combined.hint = None
            raise combined from None
        raise errors[0] from None
    seen: dict[str, int] = {}
    for index, transform in enumerate(recipe.transforms):
        if transform.id in seen:
            mark = located.mark_for(("transforms", index, "id"))
            raise RecipeError(
                source,
                mark.line if mark else None,
                mark.column if mark else None,
                f"duplicate transform id {transform.id!r} (first used by transform #{seen[transform.id] + 1})",
                key=f"transforms.{index}.id",
                hint="give every transform its own id: the id is also its marker in patched files",
            )
        seen[transform.id] = index
    return recipe, located


def load_recipe(path: str | Path) -> LoadedRecipe:
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise RecipeError(str(path), None, None, "recipe file not found") from None
    except OSError as exc:
        raise RecipeError(str(path), None, None, f"cannot read recipe: {exc.strerror}") from None
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise RecipeError(str(path), None, None, f"recipe is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    recipe, located = parse_recipe(text, str(path))
    return LoadedRecipe(recipe, path.resolve(), located)


def json_schema() -> dict[str, Any]:
    schema = Recipe.model_json_schema()
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "toolkit recipe"
    return schema
