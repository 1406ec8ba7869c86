"""Fuzzing: recipe documents (valid and mutated) and vendor files (formatting, CRLF, BOM, anchors moved).

The loader never crashes: a document is a Recipe or a RecipeError. Apply never writes on DRIFTED, every result
is one of the five states, formatting never causes drift, a structural change always does, and a second apply
after a success writes nothing.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import tempfile
from pathlib import Path
from typing import Any

import yaml
from conftest import flagship_data, switch_package, tree_digest, yaml_text
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from toolkit.engine.plan import Engine
from toolkit.engine.writer import commit
from toolkit.errors import RecipeError
from toolkit.inputs import rootfs_roots
from toolkit.recipe import load_recipe, parse_recipe
from toolkit.results import State

FLAGSHIP_DATA = flagship_data()
JUNK = st.one_of(st.none(), st.booleans(), st.integers(-5, 10**6), st.floats(allow_nan=True),
                 st.text(max_size=12), st.lists(st.text(max_size=4), max_size=3),
                 st.dictionaries(st.text(max_size=4), st.integers(), max_size=2))


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for key, value in node.items():
            out += _paths(value, (*prefix, key))
    elif isinstance(node, list):
        for i, value in enumerate(node):
            out += _paths(value, (*prefix, i))
    return out


PATHS = _paths(FLAGSHIP_DATA)


@st.composite
def mutated_documents(draw: st.DrawFn) -> str:
    data = copy.deepcopy(FLAGSHIP_DATA)
    for _ in range(draw(st.integers(1, 3))):
        path = draw(st.sampled_from(PATHS))
        parent: Any = data
        try:
            for part in path[:-1]:
                parent = parent[part]
            action = draw(st.sampled_from(["replace", "delete", "rename"]))
            if action == "replace":
                parent[path[-1]] = draw(JUNK)
            elif action == "delete":
                del parent[path[-1]]
            elif isinstance(parent, dict):
                parent[draw(st.text(min_size=1, max_size=8))] = parent.pop(path[-1])
        except (KeyError, IndexError, TypeError):
            continue  # an earlier mutation removed or replaced this path's parent
    text = yaml_text(data, allow_unicode=True, sort_keys=False)
    if draw(st.booleans()):  # and raw text damage: a stray character anywhere
        at = draw(st.integers(0, len(text)))
        text = text[:at] + draw(st.sampled_from([":", "-", "\t", "'", "{", "\n  ", "&a", "*a", "!!python/name:x"])) \
            + text[at:]
    return text


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_documents())
def test_the_loader_never_crashes_on_mutated_recipes(text: str) -> None:
    try:
        recipe, _, _ = parse_recipe(text, "fuzzed.yaml")
    except RecipeError as exc:
        assert str(exc).startswith("fuzzed.yaml"), str(exc)  # every error names the file
        return
    # a document that loads keeps every transform it holds (a serve-only recipe, transforms deleted, is valid), the
    # document as the loader reads it: libyaml's, and PyYAML's where libyaml refuses (toolkit/yamlpos.py); the two
    # differ on damaged text (libyaml reads `link\t: x` as the key link, PyYAML refuses the tab)
    try:
        document = yaml.load(text, Loader=yaml.CSafeLoader)
    except yaml.YAMLError:
        document = yaml.safe_load(text)
    assert len(recipe.transforms) == len(document.get("transforms") or [])


@settings(max_examples=60, deadline=None)
@given(st.binary(max_size=200))
@example(b"name: x\x01")  # a control character: pyyaml's ReaderError used to escape the loader as a traceback
@example(b"a: !!python/name:os.system")
@example(b"a: 2026-13-45")
def test_the_loader_never_crashes_on_bytes(data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "r.yaml"
        path.write_bytes(data)
        with contextlib.suppress(RecipeError):  # a clear error is fine; any other exception fails the test
            load_recipe(path)


# -- vendor files ----------------------------------------------------------------------------------------------

ROOTS = ["/usr/local/corex/lib/python3/dist-packages", "/usr/local/corex/lib64/python3/dist-packages"]
PROV = {"why": "fuzz", "remove_when": "never"}
TRANSFORMS = [
    {"id": "eager", "kind": "set-kwarg", "file": "vllm/args.py", "scope": "EngineArgs.create_model_config",
     "call": "ModelConfig", "arg": "enforce_eager", "old": "True", "new": "self.enforce_eager", **PROV},
    {"id": "use-v1", "kind": "assign", "file": "vllm/args.py", "scope": "EngineArgs.create_engine_config",
     "target": "use_v1", "old": "True", "others": 1, **PROV},
    {"id": "registry", "kind": "dict-entries", "file": "vllm/registry.py", "name": "_MODELS", "after": "A",
     "entries": {"C": '("c", "C")'}, **PROV},
    {"id": "import-sys", "kind": "add-import", "file": "vllm/registry.py", "module": "sys", **PROV},
    {"id": "fast", "kind": "dispatch", "file": "vllm/args.py", "scope": "EngineArgs.pick", "switch": "FAST",
     "target": "fastpkg.ops:pick", "default": "1", **PROV},
]
ARGS = '''"""Vendor engine arguments."""
import os


class EngineArgs:
    def create_model_config(self):
        return ModelConfig(
            model=self.model,
            enforce_eager=True,
        )

    def create_engine_config(self):
        use_v1 = self.n <= 8
        use_v1 = True
        return use_v1

    def pick(self, x, *, y=1):
        return x + y
'''
REGISTRY = '''import os

_MODELS = {
    "A": ("a", "A"),
    "B": ("b", "B"),
}
'''
FORMAT = ["crlf", "bom", "comments", "one-line-call", "blank-lines"]
STRUCTURE = {  # mutation -> the transform it must make DRIFTED
    "duplicate-anchor": "use-v1", "rename-scope": "eager", "move-into-other-scope": "use-v1",
    "changed-value": "eager", "key-taken": "registry", "anchor-key-gone": "registry",
}


# mutation -> (file, old text, new text) replacements, applied in order
MUTATIONS: dict[str, list[tuple[str, str, str]]] = {
    "comments": [("args", "    def ", "    # vendor note\n    def "),
                 ("args", "        use_v1 = True", "        # forced\n        use_v1 = True"),
                 ("registry", '    "B"', '    # b is new\n    "B"')],
    "one-line-call": [("args",
                       "ModelConfig(\n            model=self.model,\n            enforce_eager=True,\n        )",
                       "ModelConfig(model=self.model, enforce_eager=True)")],
    "blank-lines": [("args", "\n\n", "\n\n\n")],
    "duplicate-anchor": [("args", "        use_v1 = True\n", "        use_v1 = True\n        use_v1 = True\n")],
    "rename-scope": [("args", "def create_model_config(", "def create_model_cfg(")],
    "move-into-other-scope": [("args", "        use_v1 = True\n", ""),
                              ("args", "        return x + y", "        use_v1 = True\n        return x + y")],
    "changed-value": [("args", "enforce_eager=True", "enforce_eager=False")],
    "key-taken": [("registry", '    "B": ("b", "B"),', '    "B": ("b", "B"),\n    "C": ("x", "X"),')],
    "anchor-key-gone": [("registry", '    "A": ("a", "A"),\n', "")],
}


def _mutate(args: str, registry: str, mutations: list[str]) -> tuple[str, str]:
    files = {"args": args, "registry": registry}
    for m in mutations:
        # crlf and bom change the bytes (in _encode); an earlier mutation may have taken a later one's text
        for name, old, new in MUTATIONS.get(m, []):
            files[name] = files[name].replace(old, new)
    return files["args"], files["registry"]


def _encode(text: str, mutations: list[str]) -> bytes:
    if "crlf" in mutations:
        text = text.replace("\n", "\r\n")
    data = text.encode()
    return b"\xef\xbb\xbf" + data if "bom" in mutations else data


def _digest(folder: Path) -> str:
    return hashlib.sha256(repr(sorted(tree_digest(folder).items())).encode()).hexdigest()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.sampled_from(FORMAT + sorted(STRUCTURE)), unique=True, max_size=4))
def test_apply_on_fuzzed_vendor_files(mutations: list[str]) -> None:
    args, registry = _mutate(ARGS, REGISTRY, mutations)
    with tempfile.TemporaryDirectory() as tmp:
        rootfs = Path(tmp) / "rootfs"
        switch_package(Path(tmp), "fastpkg", {"FAST": "1"})
        for root in ROOTS:
            base = rootfs / root.lstrip("/")
            (base / "vllm").mkdir(parents=True)
            (base / "vllm" / "__init__.py").write_text("")
            (base / "vllm" / "args.py").write_bytes(_encode(args, mutations))
            (base / "vllm" / "registry.py").write_bytes(_encode(registry, mutations))
            (base / "vllm-0.6.3+corex.3.2.3.dist-info").mkdir()
            (base / "vllm-0.6.3+corex.3.2.3.dist-info" / "METADATA").write_text("Version: 0.6.3+corex.3.2.3\n")
        data = {"name": "fuzz", "hardware": {"vendor": "v", "accelerator": "a", "count": 1, "memory_gb": 32},
                "base_image": {"reference": "corex:test", "python": "3.10"},
                "vendor": {"version": ">=0.6.3,<0.6.4", "roots": ROOTS, "reference": "vllm==0.6.3.post1"},
                "patches": tmp, "transforms": TRANSFORMS, "serve": {"args": {"model": "/model"}}}
        (Path(tmp) / "r.yaml").write_text(yaml.safe_dump(data))
        loaded = load_recipe(Path(tmp) / "r.yaml")
        roots = rootfs_roots(loaded.recipe, rootfs)
        before = _digest(rootfs)
        plan = Engine(loaded, roots, rootfs).run()
        assert {r.state for r in plan.results} <= set(State)
        drifted = {r.transform for r in plan.results if r.state is State.DRIFTED}
        expected = {STRUCTURE[m] for m in mutations if m in STRUCTURE}
        assert drifted == expected, [r.message for r in plan.results if r.state is State.DRIFTED]
        if not plan.ok:
            assert _digest(rootfs) == before  # planning wrote nothing, and nothing is committed on DRIFTED
            return
        assert {r.state for r in plan.results} == {State.WOULD_APPLY}, "formatting alone must never change a state"
        commit(plan.ops)
        for root in roots:
            raw = (root.path / "vllm/args.py").read_bytes()
            assert raw.startswith(b"\xef\xbb\xbf") == ("bom" in mutations)
            assert (b"\r\n" in raw) == ("crlf" in mutations)
            compile(raw.decode("utf-8-sig"), "args.py", "exec")
        after = _digest(rootfs)
        again = Engine(loaded, roots, rootfs).run()
        assert {r.state for r in again.results} == {State.ALREADY_APPLIED}
        assert again.ops == []
        commit(again.ops)
        assert _digest(rootfs) == after
