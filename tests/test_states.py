"""Each source kind decides its state structurally: the pre-state, the post-state, and a changed value (drift).

A changed value is never "already done": SUPERSEDED means the file is in the post-state, decided by the same
structural match as the rewrite, not by the old text being absent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import libcst as cst
import pytest
from conftest import flagship_data, switch_package
from pydantic import TypeAdapter

from toolkit.errors import ToolkitError
from toolkit.recipe import Transform
from toolkit.results import State
from toolkit.testing import check_kind
from toolkit.transforms import edit_kind
from toolkit.transforms.base import Context, decide

PROVENANCE = {"why": "test", "remove_when": "never", "file": "m.py"}

# kind spec, then (module source, expected state) rows; no marker is present in any of them
TABLE: list[tuple[str, dict[str, Any], list[tuple[str, State]]]] = [
    ("assign-remove", {"kind": "assign", "scope": "f", "target": "use_v1", "old": "True", "others": 1}, [
        ("def f(n):\n    use_v1 = n < 8\n    use_v1 = True\n    return use_v1\n", State.WOULD_APPLY),
        ("def f(n):\n    use_v1 = n < 8\n    return use_v1\n", State.SUPERSEDED),
        ("def f(n):\n    use_v1 = n < 8\n    use_v1 = bool(1)\n    return use_v1\n", State.DRIFTED),
        ("def f(n):\n    use_v1 = n < 8\n    use_v1 = not False\n    return use_v1\n", State.DRIFTED),
        ("def f(n):\n    return True\n", State.DRIFTED),  # the heuristic itself went: not the code we know
        # the forced value moved to another function: V1 is still forced, the scope's calm is no post-state
        ("def f(n):\n    use_v1 = n < 8\n    return use_v1\n\ndef g():\n    use_v1 = True\n", State.DRIFTED),
    ]),
    ("assign-remove-sole", {"kind": "assign", "target": "FLAG", "old": "True"}, [
        ("FLAG = True\n", State.WOULD_APPLY),
        ("X = 1\n", State.SUPERSEDED),
        ("FLAG = 1 == 1\n", State.DRIFTED),
    ]),
    ("assign-replace", {"kind": "assign", "target": "HAS_TRITON", "old": "False", "new": "probe()"}, [
        ("HAS_TRITON = False\n", State.WOULD_APPLY),
        ("HAS_TRITON = probe()\n", State.SUPERSEDED),
        ("HAS_TRITON = bool(0)\n", State.DRIFTED),
        ("HAS_TRITON = probe()\nHAS_TRITON = bool(0)\n", State.DRIFTED),
    ]),
    ("set-kwarg", {"kind": "set-kwarg", "scope": "f", "call": "Config", "arg": "eager", "old": "True",
                   "new": "self.eager"}, [
        ("def f(self):\n    return Config(eager=True)\n", State.WOULD_APPLY),
        ("def f(self):\n    return Config(eager=self.eager)\n", State.SUPERSEDED),
        ("def f(self):\n    return Config(eager=bool(1))\n", State.DRIFTED),
        ("def f(self):\n    Config(eager=self.eager)\n    return Config(eager=False)\n", State.DRIFTED),
    ]),
    ("dict-entries", {"kind": "dict-entries", "name": "MODELS", "entries": {"b": "2"}, "after": "a"}, [
        ("MODELS = {'a': 1}\n", State.WOULD_APPLY),
        ("MODELS = {'a': 1, 'b': 2}\n", State.SUPERSEDED),
        ("MODELS = {'a': 1, 'b': 3}\n", State.DRIFTED),
        ("if X:\n    MODELS = {'a': 1}\nelse:\n    MODELS = {'a': 1, 'b': 3}\n", State.DRIFTED),
    ]),
    ("statements-replace", {"kind": "statements", "scope": "C.f", "old": "pass", "new": "self.hit = False"}, [
        ("class C:\n    def f(self, a):\n        if a:\n            pass\n        return a\n", State.WOULD_APPLY),
        ("class C:\n    def f(self, a):\n        if a:\n            self.hit = False\n", State.SUPERSEDED),
        ("class C:\n    def f(self, a):\n        if a:\n            self.hit = True\n", State.DRIFTED),
        # two sites where the contract says one: never a guess
        ("class C:\n    def f(self, a):\n        if a:\n            pass\n        else:\n            pass\n",
         State.DRIFTED),
        ("class C:\n    def f(self, a):\n        pass\n        x = a\n        pass\n", State.DRIFTED),
        ("class C:\n    def g(self):\n        pass\n", State.DRIFTED),  # no scope C.f
    ]),
    ("statements-block", {"kind": "statements", "scope": "f", "old": "a()\nb()", "new": "c()"}, [
        ("def f():\n    a()  # first\n    b(\n    )\n    d()\n", State.WOULD_APPLY),
        ("def f():\n    a()\n    d()\n    b()\n", State.DRIFTED),  # not consecutive
        ("def f():\n    c()\n    d()\n", State.SUPERSEDED),
    ]),
    ("statements-after", {"kind": "statements", "after": "from .a import A", "new": "from .b import B"}, [
        ("if TYPE_CHECKING:\n    from .a import A\n    from .z import Z\n", State.WOULD_APPLY),
        ("if TYPE_CHECKING:\n    from .a import A\n    from .b import B\n", State.SUPERSEDED),
        ("if TYPE_CHECKING:\n    from .z import Z\n", State.DRIFTED),
    ]),
    ("statements-top", {"kind": "statements", "scope": "f", "new": "if x is None:\n    return 0"}, [
        ('def f(x):\n    """Doc."""\n    return x + 1\n', State.WOULD_APPLY),
        ('def f(x):\n    """Doc."""\n    if x is None:\n        return 0\n    return x + 1\n', State.SUPERSEDED),
    ]),
    ("dict-entries-pairs", {"kind": "dict-entries", "name": "M", "after": "a", "entries": {"b": '"B"'}}, [
        ('M = OrderedDict[str, str]([("a", "A"), ("c", "C")])\n', State.WOULD_APPLY),
        ('M = OrderedDict([("a", "A"), ("b", "B"), ("c", "C")])\n', State.SUPERSEDED),
        ('M = OrderedDict([("a", "A"), ("b", "X")])\n', State.DRIFTED),
    ]),
    ("add-import", {"kind": "add-import", "module": "os"}, [
        ("x = 1\n", State.WOULD_APPLY),
        ("import os\nx = 1\n", State.SUPERSEDED),
    ]),
]
CASES = [(name, spec, source, state) for name, spec, rows in TABLE for source, state in rows]


@pytest.mark.parametrize(("name", "spec", "source", "state"), CASES,
                         ids=[f"{c[0]}-{i}-{c[3].value}" for i, c in enumerate(CASES)])
def test_state_is_decided_structurally(name: str, spec: dict[str, Any], source: str, state: State) -> None:
    check_kind(spec, source, None, state)  # idempotent, and the result checks clean
    model = TypeAdapter(Transform).validate_python({"id": name, **PROVENANCE, **spec})
    kind = edit_kind(model, Context(patches_dir=Path(".")))  # type: ignore[arg-type]
    module = cst.parse_module(source)
    if state is State.WOULD_APPLY:
        # the rewrite lands in the post-state: probing the result again reads SUPERSEDED (no marker here)
        again = decide(model, kind.count(kind.rewrite(module)), None)  # type: ignore[arg-type]
        assert again.state is State.SUPERSEDED, again.message


# -- a dispatch's default comes from the injected package's switch table -------------------------------------

def _dispatch(patches: Path, **extra: Any) -> str:
    from toolkit.transforms.dispatch import DispatchKind

    model = TypeAdapter(Transform).validate_python({
        "id": "fast", **PROVENANCE, "kind": "dispatch", "scope": "f", "switch": "FAST", "target": "pkg.mod:f",
        **extra})
    kind = DispatchKind(model, Context(patches_dir=patches))  # type: ignore[arg-type]
    fn = cst.parse_module("def f(x):\n    return x\n").body[0]
    assert isinstance(fn, cst.FunctionDef)
    return cst.Module(body=[kind.statement(fn)]).code


def test_dispatch_default_is_read_from_the_table(tmp_path: Path) -> None:
    switch_package(tmp_path, "pkg", {"FAST": "0"})
    reader = '__import__("pkg.switches", fromlist=["on"]).on("FAST")'
    assert reader in _dispatch(tmp_path)
    assert reader in _dispatch(tmp_path, default="0")  # restating it is fine
    with pytest.raises(ToolkitError, match="contradicts"):
        _dispatch(tmp_path, default="1")


def test_dispatch_without_the_package_reader_is_refused(tmp_path: Path) -> None:
    """No second parser of a switch: a package without its table and reader cannot be dispatched into."""
    with pytest.raises(ToolkitError, match=r"has no switches\.json") as raised:
        _dispatch(tmp_path, default="1")
    assert "copy the toolkit's patches/src/native_fastpaths/ pair" in str(raised.value.hint)
    switch_package(tmp_path, "pkg", {"FAST": "1"})
    (tmp_path / "pkg" / "switches.py").unlink()
    with pytest.raises(ToolkitError, match=r"has no switches\.py"):
        _dispatch(tmp_path)


def test_dispatch_switch_must_be_a_flag_of_the_table(tmp_path: Path) -> None:
    switch_package(tmp_path, "pkg", {"OTHER": "1"})
    with pytest.raises(ToolkitError, match="switch FAST is not a flag"):
        _dispatch(tmp_path)


def test_flagship_dispatch_defaults_come_from_the_package_table() -> None:
    import json

    from conftest import REPO

    table = json.loads((REPO / "patches/src/native_fastpaths/switches.json").read_text())
    recipe = flagship_data()
    dispatches = [t for t in recipe["transforms"] if t["kind"] == "dispatch"]
    assert dispatches and all("default" not in t and t["switch"] in table for t in dispatches)


def test_check_kind_compares_the_rewritten_source() -> None:
    """The per-kind helper of toolkit.testing: source in, transform, expected source and state out."""
    spec = {"kind": "set-kwarg", "scope": "f", "call": "Config", "arg": "eager", "old": "True", "new": "eager"}
    before = "def f(eager):\n    return Config(eager=True)\n"
    check_kind(spec, before, "def f(eager):\n    return Config(eager=eager)\n")
    with pytest.raises(AssertionError, match="planned"):
        check_kind(spec, before, "def f(eager):\n    return Config(eager=False)\n")
    with pytest.raises(AssertionError, match="expected SUPERSEDED, got WOULD_APPLY"):
        check_kind(spec, before, None, State.SUPERSEDED)
    check_kind(spec, "def f(eager):\n    return Config(eager=1)\n", None, State.DRIFTED)
