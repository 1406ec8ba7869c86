"""Recipe loading: every error names file:line, the committed schema is in sync, valid recipes round-trip."""

from __future__ import annotations

import ast
import json
from pathlib import Path
from typing import Any

import jsonschema
import libcst as cst
import pytest
import yaml
from conftest import FLAGSHIP, REPO, flagship_data, flagship_origin, recipe_text
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from toolkit.errors import RecipeError
from toolkit.recipe import json_schema, load_recipe, parse_recipe
from toolkit.transforms.base import Context
from toolkit.transforms.dict_entries import DictEntries, DictEntriesKind

GOOD = recipe_text(flagship_data())  # the flagship as one file, its layers merged


def error_for(text: str, name: str = "r.yaml") -> RecipeError:
    with pytest.raises(RecipeError) as info:
        parse_recipe(text, name)
    return info.value


def line_of(text: str, needle: str) -> int:
    return next(i + 1 for i, ln in enumerate(text.splitlines()) if needle in ln)


def test_flagship_loads() -> None:
    loaded = load_recipe(FLAGSHIP)
    assert loaded.recipe.name == "bi100-qwen36"
    assert loaded.recipe.vendor.roots == [
        "/usr/local/corex/lib/python3/dist-packages", "/usr/local/corex/lib64/python3/dist-packages"]
    origin = loaded.transform_origin(0)
    assert origin is not None and (origin.file, origin.line) == flagship_origin("id: unhardcode-enforce-eager")


def test_bad_yaml_names_line_and_column() -> None:
    text = GOOD.replace("  count: 4\n", "  count: [4\n")
    err = error_for(text)
    assert err.file == "r.yaml" and err.line is not None
    assert str(err).startswith("r.yaml:") and "invalid YAML" in str(err)


def test_unknown_key_lists_valid_keys() -> None:
    text = GOOD.replace("    arg: enforce_eager\n", "    arg: enforce_eager\n    argument: oops\n", 1)
    err = error_for(text)
    assert err.line == line_of(text, "argument: oops")
    assert "unknown key 'argument'" in str(err)
    assert "valid keys here:" in str(err) and "arg, call, expect, file" in str(err)


def test_a_fast_paths_off_variant_that_does_not_exist_is_refused_with_the_known_ones() -> None:
    assert "fast_paths_off: adapter-paths" in GOOD
    err = error_for(GOOD.replace("fast_paths_off: adapter-paths", "fast_paths_off: adapter-path", 1))
    assert "checks.fast_paths_off names variant 'adapter-path', which is not under variants (known: " in str(err)
    assert "adapter-paths" in str(err)


def test_a_fast_paths_off_variant_that_sets_args_is_refused_at_load() -> None:
    # compared with the served variant: another configuration would make any difference meaningless
    last = "      RMSNORM_NATIVE: '0'\n"
    text = GOOD.replace(last, last + "    args:\n      max-num-seqs: 2\n", 1)
    assert text != GOOD
    err = error_for(text)
    assert "checks.fast_paths_off names variant 'adapter-paths', which sets serve args or unsets env" in str(err)
    assert "give adapter-paths only env values" in str(err)
    unset = GOOD.replace("      RMSNORM_NATIVE: '0'\n", "      RMSNORM_NATIVE: null\n", 1)
    assert "which sets serve args or unsets env" in str(error_for(unset))


def test_unknown_top_level_key() -> None:
    err = error_for(GOOD + "servings: {}\n")
    assert err.line == len(GOOD.splitlines()) + 1
    assert "base_image" in str(err) and "transforms" in str(err)


def test_wrong_type_names_the_key() -> None:
    text = GOOD.replace("  count: 4\n", "  count: four\n")
    err = error_for(text)
    assert err.line == line_of(text, "count: four")
    assert err.key == "hardware.count" and "integer" in str(err)


def test_bad_expression_is_caught_at_load() -> None:
    text = GOOD.replace("new: self.enforce_eager", "new: self.enforce_eager(", 1)
    err = error_for(text)
    assert err.line == line_of(text, "new: self.enforce_eager(")
    assert "not a Python expression" in str(err)


def test_unknown_kind_lists_kinds() -> None:
    text = GOOD.replace("kind: set-kwarg", "kind: set-kwargs", 1)
    err = error_for(text)
    assert err.line == line_of(text, "kind: set-kwargs")
    assert "unknown kind 'set-kwargs'" in str(err) and "dict-entries" in str(err)


def test_missing_key_points_at_its_mapping() -> None:
    text = GOOD.replace("    call: ModelConfig\n", "", 1)
    err = error_for(text)
    assert err.line == line_of(text, "- id: unhardcode-enforce-eager")
    assert "missing required key 'call'" in str(err)


def test_duplicate_key_and_duplicate_id() -> None:
    err = error_for(GOOD.replace("  count: 4\n", "  count: 4\n  count: 8\n"))
    assert "duplicate key 'count'" in str(err)
    text = GOOD.replace("id: unhardcode-custom-all-reduce", "id: unhardcode-enforce-eager")
    err = error_for(text)
    second = [i + 1 for i, ln in enumerate(text.splitlines()) if "id: unhardcode-enforce-eager" in ln][1]
    assert err.line == second
    assert "duplicate transform id 'unhardcode-enforce-eager'" in str(err)


def test_missing_provenance_is_an_error() -> None:
    text = GOOD.replace("    remove_when: the base image's arg_utils.py passes self.enforce_eager "
                        "(diff reports SUPERSEDED)\n", "", 1)
    assert "missing required key 'remove_when'" in str(error_for(text))


def test_several_problems_are_all_reported() -> None:
    text = GOOD.replace("  count: 4\n", "  count: four\n").replace("  memory_gb: 32\n", "  memory_gb: -1\n")
    message = str(error_for(text))
    assert "2 problems" in message and "hardware.count" in message and "hardware.memory_gb" in message


def test_missing_and_non_utf8_files(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="recipe file not found"):
        load_recipe(tmp_path / "nope.yaml")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes(b"name: caf\xe9\n")
    with pytest.raises(RecipeError, match="not UTF-8"):
        load_recipe(bad)


def test_crlf_recipe_loads_the_same(tmp_path: Path) -> None:
    crlf = tmp_path / "crlf.yaml"
    crlf.write_bytes(GOOD.replace("\n", "\r\n").encode())
    assert load_recipe(crlf).recipe == load_recipe(FLAGSHIP).recipe


def test_committed_schema_is_in_sync() -> None:
    committed = json.loads((REPO / "recipes" / "schema.json").read_text())
    assert committed == json.loads(json.dumps(json_schema())), "run `toolkit schema -o recipes/schema.json`"


def test_flagship_validates_against_the_schema() -> None:
    jsonschema.validate(yaml.safe_load(GOOD), json_schema())


def test_schema_cli(cli) -> None:
    result = cli("schema")
    assert result.code == 0 and json.loads(result.out)["title"] == "toolkit recipe"


# -- property tests ----------------------------------------------------------------------------

ident = st.from_regex(r"[a-z][a-z0-9_]{0,8}", fullmatch=True).filter(lambda s: s.isidentifier())
tid = st.from_regex(r"[a-z][a-z0-9-]{0,12}", fullmatch=True)
text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=20).filter(
    lambda s: s.strip() == s and s != "")
expr = st.sampled_from(["True", "False", "None", "self.x", "1 + 2", '"forbid"', "f(a, b=2)", "[1, 2]"])
relpy = st.lists(ident, min_size=1, max_size=3).map(lambda parts: "/".join(parts) + ".py")
scope = st.lists(ident, max_size=2).map(".".join)
prov = {"why": text, "remove_when": text}


def transform_strategy() -> st.SearchStrategy[dict[str, Any]]:
    common = {"id": tid, "file": relpy, "scope": scope, **prov}
    return st.one_of(
        st.fixed_dictionaries({"kind": st.just("set-kwarg"), "call": ident, "arg": ident, "new": expr, **common},
                              optional={"old": expr, "expect": st.integers(1, 3)}),
        st.fixed_dictionaries({"kind": st.just("assign"), "target": ident, "old": expr, **common},
                              optional={"new": expr}),
        st.fixed_dictionaries({"kind": st.just("dict-entries"), "name": ident,
                               "entries": st.dictionaries(ident, expr, min_size=1, max_size=3), **common},
                              optional={"after": ident}),
        st.fixed_dictionaries({"kind": st.just("dispatch"), "switch": ident.map(str.upper),
                               "target": st.tuples(ident, ident).map(lambda t: f"{t[0]}.mod:{t[1]}"), **common},
                              optional={"default": st.sampled_from(["0", "1"]), "when": expr,
                                        "args": st.lists(expr, max_size=3)}),
        st.fixed_dictionaries({"kind": st.just("deploy"), "id": tid, "source": relpy,
                               "dest": st.one_of(relpy, relpy.map(lambda p: "/opt/" + p)), **prov},
                              optional={"overwrite": st.booleans()}),
        st.fixed_dictionaries({"kind": st.just("symlink"), "id": tid, "link": relpy.map(lambda p: "/usr/" + p),
                               "target": st.sampled_from(["lib.so.*", "lib.so.11"]), **prov}),
    )


recipes = st.fixed_dictionaries({
    "name": tid,
    "hardware": st.fixed_dictionaries({"vendor": text, "accelerator": text, "count": st.integers(1, 16),
                                       "memory_gb": st.floats(1, 256)}),
    "base_image": st.fixed_dictionaries({"reference": text, "python": st.sampled_from(["3.10", "3.11"])}),
    "vendor": st.fixed_dictionaries({
        "version": st.sampled_from([">=0.6.3,<0.6.4", "==0.6.3+corex.3.2.3", ">=0.8"]),
        "roots": st.lists(relpy.map(lambda p: "/" + p), min_size=1, max_size=2, unique=True),
        "reference": st.sampled_from(["vllm==0.6.3.post1", "vllm==0.8.5.post1"])}),
    "transforms": st.lists(transform_strategy(), min_size=1, max_size=4, unique_by=lambda t: t["id"]),
    "serve": st.fixed_dictionaries({}, optional={
        "args": st.dictionaries(tid, st.one_of(st.booleans(), st.integers(0, 10**6), text), max_size=4),
        "concurrency": st.integers(1, 64)}),
}, optional={"env": st.dictionaries(ident.map(str.upper), text, max_size=3)})


# built once: checking the schema itself on every validate() call cost seconds per test
VALIDATOR = jsonschema.Draft202012Validator(json_schema())


def loader_accepts(data: dict[str, Any]) -> tuple[bool, str]:
    try:
        parse_recipe(yaml.safe_dump(data, allow_unicode=True), "generated.yaml")
    except RecipeError as exc:
        return False, str(exc)
    return True, ""


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recipes)
def test_schema_and_loader_agree_and_valid_recipes_round_trip(data: dict[str, Any]) -> None:
    # identifiers are drawn with keywords in (`as`, `if`...): the schema and the loader must say the same of them
    schema_errors = [e.message for e in VALIDATOR.iter_errors(data)]
    accepted, why = loader_accepts(data)
    assert accepted == (not schema_errors), f"loader: {why or 'accepts'}; schema: {schema_errors or 'accepts'}"
    if not accepted:
        return
    recipe, _, _ = parse_recipe(yaml.safe_dump(data, allow_unicode=True), "generated.yaml")
    dumped = recipe.model_dump(mode="json", exclude_none=True)
    VALIDATOR.validate(dumped)
    again, _, _ = parse_recipe(yaml.safe_dump(dumped, allow_unicode=True), "dumped.yaml")
    assert again == recipe


NAME_CASES = [
    ("set-kwarg", "call", "as"), ("set-kwarg", "call", "torch.if.x"), ("set-kwarg", "arg", "not-an-arg"),
    ("set-kwarg", "arg", "for"), ("assign", "target", "self.x"), ("assign", "target", "None"),
    ("dict-entries", "name", "a b"), ("dispatch", "target", "mod:class"), ("dispatch", "target", "import.m:f"),
    ("add-import", "names", ["ok", "lambda"]), ("set-kwarg", "scope", "A..b"),
]


@pytest.mark.parametrize(("kind", "field", "value"), NAME_CASES, ids=lambda v: str(v))
def test_bad_names_are_refused_by_both_schema_and_loader(kind: str, field: str, value: Any) -> None:
    base: dict[str, dict[str, Any]] = {
        "set-kwarg": {"call": "ModelConfig", "arg": "enforce_eager", "new": "False"},
        "assign": {"target": "use_v1", "old": "True"},
        "dict-entries": {"name": "_MODELS", "entries": {"a": "1"}},
        "dispatch": {"switch": "X", "target": "pkg.mod:fn"},
        "add-import": {"module": "os", "names": ["path"]},
    }
    transform = {"kind": kind, "id": "t", "file": "m.py", "why": "w", "remove_when": "r", **base[kind]}
    data = yaml.safe_load(GOOD)
    data["transforms"] = [transform]
    accepted, _ = loader_accepts(data)
    assert accepted and VALIDATOR.is_valid(data)  # the unmodified transform is valid by both
    transform[field] = value
    accepted, why = loader_accepts(data)
    assert not accepted and not VALIDATOR.is_valid(data), why
    assert f"transforms.0.{field}" in why


def test_serve_module_must_be_a_module_name() -> None:
    data = yaml.safe_load(GOOD)
    data["serve"]["module"] = "not a module!"
    accepted, why = loader_accepts(data)
    assert not accepted and not VALIDATOR.is_valid(data)
    assert "serve.module" in why


ADAPTER_CASES = [
    ("statements with both old and after", lambda t: t["adapter-register-tool-parser"].update(old="pass"),
     "give `old` (replace) or `after` (insert after), not both"),
    ("statements at the top of the module", lambda t: t["adapter-register-tool-parser"].pop("after"),
     "inserting at the top needs a function or class `scope`"),
    ("statements that are not Python", lambda t: t["adapter-prefix-chunks-full-table"].update(new="x = ("),
     "not Python statements"),
    ("a replacement that also overwrites", lambda t: t["adapter-replace-protocol"].update(overwrite=True),
     "`replaces` already allows the replacement"),
    ("a digest that is not one", lambda t: t["adapter-replace-protocol"].update(replaces="abc"),
     "String should match pattern"),
    ("an undeclared package", lambda t: t["adapter-transformers-type-imports"].update(package="tokenizers"),
     "edits package 'tokenizers', which is not declared under packages"),
    ("a symlink with a package", lambda t: t["link-libcusolver"].update(package="transformers"),
     "drop `package`"),
]


@pytest.mark.parametrize(("case", "mutate", "message"), ADAPTER_CASES, ids=[c[0] for c in ADAPTER_CASES])
def test_adapter_fields_are_checked_at_load(case: str, mutate: Any, message: str) -> None:
    data = yaml.safe_load(GOOD)
    mutate({t["id"]: t for t in data["transforms"]})
    accepted, why = loader_accepts(data)
    assert not accepted and message in why, why


@settings(max_examples=80, deadline=None)
@given(
    keys=st.lists(ident, min_size=0, max_size=5, unique=True),
    new=st.dictionaries(ident.map(lambda s: "N" + s), st.integers(0, 99), min_size=1, max_size=3),
    multiline=st.booleans(),
    trailing=st.booleans(),
    after_index=st.integers(-1, 5),
)
def test_dict_entries_keep_order_and_layout(keys: list[str], new: dict[str, int], multiline: bool, trailing: bool,
                                             after_index: int) -> None:
    """Inserting entries gives the expected ordered dict, in the dict's own layout, whatever that is."""
    items = [f'"{k}": {i}' for i, k in enumerate(keys)]
    if multiline:
        body = "".join(f"    {it},\n" for it in items) if trailing else ",\n".join(f"    {it}" for it in items)
        source = "M = {\n" + body + ("\n" if items and not trailing else "") + "}\n"
    else:
        source = "M = {" + ", ".join(items) + ("," if trailing and items else "") + "}\n"
    after = keys[after_index] if keys and 0 <= after_index < len(keys) else None
    spec = DictEntries(kind="dict-entries", id="t", why="w", remove_when="r", file="m.py", name="M",
                       entries={k: str(v) for k, v in new.items()}, after=after)
    kind = DictEntriesKind(spec, Context(Path(".")))
    module = cst.parse_module(source)
    assert kind.count(module).pre == 1
    out = kind.rewrite(module).code
    value = ast.literal_eval(out.split("=", 1)[1].strip())
    order = list(keys)
    at = order.index(after) + 1 if after else len(order)
    order[at:at] = list(new)
    assert list(value) == order
    sites = kind.count(cst.parse_module(out))
    assert (sites.pre, sites.post) == (0, 1)
    if multiline and items:
        assert all(line.startswith(("    ", "M = {", "}")) for line in out.splitlines())


def test_the_registry_is_the_one_list_of_kinds() -> None:
    """The recipe's union, the JSON Schema and the engine's dispatch all come from toolkit.transforms.KINDS; each
    kind's model lives in the module of its behaviour, and a kind edits Python exactly when it counts sites."""
    from toolkit.recipe import TRANSFORM_MODELS
    from toolkit.transforms import KINDS

    items = json_schema()["properties"]["transforms"]["items"]["anyOf"][0]  # [1]: a group of them
    mapping = items["discriminator"]["mapping"]
    assert set(mapping) == set(KINDS) == set(TRANSFORM_MODELS)
    assert [ref["$ref"] for ref in items["oneOf"]] == [f"#/$defs/{k.model.__name__}" for k in KINDS.values()]
    for name, kind in KINDS.items():
        assert mapping[name] == f"#/$defs/{kind.model.__name__}"
        assert TRANSFORM_MODELS[name] is kind.model
        assert kind.model.__module__ == kind.behaviour.__module__, f"{name}: model and behaviour in two modules"
        assert kind.edits_python == all(hasattr(kind.behaviour, m) for m in ("count", "rewrite")), name
        assert kind.edits_python != hasattr(kind.behaviour, "plan"), name


@pytest.mark.parametrize("text", ["a: [1, 2\nb: 3\n", "a: 1\n b: 2\n", "a:\n\t- x\n", "a: 'open\n", "a: *nothing\n",
                                  "name: x\x01\n", "- 1\n- 2\nb: 3\n"])
def test_yaml_libyaml_refuses_reads_as_pyyamls_own_error(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes are composed by libyaml where PyYAML has it; a document it refuses is composed again by PyYAML's
    parser, so the message and its line are PyYAML's, as before."""
    from toolkit import yamlpos

    def refused() -> tuple[str, yamlpos.Mark | None]:
        with pytest.raises(yamlpos.YamlLoadError) as caught:
            yamlpos.load(text, "r.yaml")
        return caught.value.message, caught.value.mark

    assert yamlpos._COMPOSER is yaml.CSafeLoader  # the wheel's libyaml, on every machine the tests run on
    fast = refused()
    monkeypatch.setattr(yamlpos, "_COMPOSER", yaml.SafeLoader)
    assert fast == refused()


def test_the_recipes_nodes_and_marks_are_the_same_from_libyaml_and_pyyaml(monkeypatch: pytest.MonkeyPatch) -> None:
    from toolkit import yamlpos

    for path in sorted([*REPO.glob("recipes/*.yaml"), *REPO.glob("layers/*.yaml"), *REPO.glob("tests/**/*.yaml")]):
        text = path.read_text(encoding="utf-8")
        fast = yamlpos.load(text, path.name)
        with monkeypatch.context() as patch:
            patch.setattr(yamlpos, "_COMPOSER", yaml.SafeLoader)
            slow = yamlpos.load(text, path.name)
        assert (fast.data, fast.marks, fast.key_marks) == (slow.data, slow.marks, slow.key_marks), path
