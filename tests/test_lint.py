"""Every lint rule fires on a configuration that cannot start and stays quiet on one that can."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import FLAGSHIP, REPO, flagship_data, flagship_origin, yaml_text

from toolkit.errors import RecipeError
from toolkit.lint import RULES, lint
from toolkit.recipe import load_recipe
from toolkit.results import Severity
from toolkit.variants import find as find_variant

BASE: dict[str, Any] = flagship_data()
PRIOR_ART = sorted((REPO / "tests" / "recipes").glob("prior-*.yaml"))


# the unknown-flag rule reads vLLM 0.6.3's argument parser from its source: fetched (and cached) first
pytestmark = pytest.mark.usefixtures("vllm_063")


def write(tmp_path: Path, mutate: Callable[[dict[str, Any]], None], name: str = "r.yaml") -> Path:
    data = copy.deepcopy(BASE)
    data["patches"] = str(REPO / "patches" / "src")
    mutate(data)
    path = tmp_path / name
    path.write_text(yaml_text(data, sort_keys=False))
    return path


def issues_of(path: Path, rule: str, rootfs: Path | None = None) -> list[Any]:
    return [i for i in lint(load_recipe(path), rootfs=rootfs).issues if i.rule == rule]


def set_args(**kwargs: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        for key, value in kwargs.items():
            key = key.replace("_", "-")
            if value is None:
                data["serve"]["args"].pop(key, None)
            else:
                data["serve"]["args"][key] = value

    return mutate


def both(*mutations: Callable[[dict[str, Any]], None]) -> Callable[[dict[str, Any]], None]:
    def mutate(data: dict[str, Any]) -> None:
        for m in mutations:
            m(data)

    return mutate


def set_env(**env: str) -> Callable[[dict[str, Any]], None]:
    return lambda data: data["env"].update(env)


def drop_transform(tid: str) -> Callable[[dict[str, Any]], None]:
    return lambda data: data.__setitem__("transforms", [t for t in data["transforms"] if t["id"] != tid])


# (rule, severity it must report, mutation that fires it, mutation that must not)
CASES: list[tuple[str, Severity, Callable[[dict[str, Any]], None], Callable[[dict[str, Any]], None]]] = [
    ("chunked-prefill-batch", Severity.ERROR,
     set_args(enable_chunked_prefill="false", max_num_batched_tokens=8192),
     set_args(enable_chunked_prefill="false", max_num_batched_tokens=262144)),
    ("chunked-prefill-implicit", Severity.INFO, set_args(enable_chunked_prefill=None), set_args()),
    ("bool-false-omits-flag", Severity.WARNING, set_args(enable_chunked_prefill=False),
     set_args(enable_chunked_prefill="false", max_num_batched_tokens=262144)),
    ("multi-step-backend", Severity.ERROR, set_args(num_scheduler_steps=8), set_args(num_scheduler_steps=1)),
    ("attention-backend", Severity.ERROR, set_env(VLLM_ATTENTION_BACKEND="FLASHINFER"),
     set_env(VLLM_ATTENTION_BACKEND="XFORMERS")),
    ("cuda-graphs", Severity.ERROR, set_args(enforce_eager=None), set_args()),
    # 13 max-size images of 1280 tokens do not fit a 16384-token step the start profiles them in; 12 do; the
    # flagship's 6 fit its 8192, 7 do not
    ("mm-profile", Severity.ERROR, set_args(limit_mm_per_prompt="image=13", max_num_batched_tokens=16384),
     set_args(limit_mm_per_prompt="image=12", max_num_batched_tokens=16384)),
    ("mm-profile", Severity.ERROR, set_args(limit_mm_per_prompt="image=7"), set_args(limit_mm_per_prompt="image=6")),
    # the replay's largest request is 254,336 prompt tokens with a 4,096-token completion limit
    ("context-length", Severity.ERROR, set_args(max_model_len=245000), set_args(max_model_len=258432)),
    ("kv-cache", Severity.ERROR, set_args(gpu_memory_utilization=0.6),
     both(set_args(gpu_memory_utilization=0.92), lambda d: d["model"].update(layers_block_type=True))),
    ("unknown-flag", Severity.ERROR, set_args(max_num_seq=4),
     set_args(max_num_seqs=4, reasoning_parser=None, tool_call_parser="hermes")),
    ("env-unread", Severity.WARNING, set_env(MOE_NATIVE_TYPO="1"), set_env(PYTHONUNBUFFERED="1")),
    ("switch-value", Severity.ERROR, set_env(PREFIX_STATE="01"), set_env(PREFIX_STATE="0")),
    ("provenance", Severity.WARNING,
     lambda d: d["transforms"][0].__setitem__("why", "TODO"), lambda d: None),
    ("workdir-shadow", Severity.ERROR,
     lambda d: d["serve"].__setitem__("workdir", "/usr/local/corex/lib/python3/dist-packages"),
     lambda d: d["serve"].__setitem__("workdir", "/workspace")),
    ("source-fetch", Severity.WARNING, lambda d: d["sources"][0].__setitem__("fetch", "image"),
     lambda d: d["sources"][0].__setitem__("fetch", "host")),
    ("prefix-state", Severity.ERROR, lambda d: d["model"].pop("prefix_state"),
     both(lambda d: d["model"].pop("prefix_state"), set_args(enable_prefix_caching=None))),
    # prefix-state's hook anchored on the very call probe-begin-forward times
    ("probe", Severity.ERROR, lambda d: transform(d, "prefix-state-begin-step").__setitem__(
        "after", "self.attn_state.begin_forward(model_input)"), lambda d: None),
    ("deploy-needs-arg", Severity.ERROR, set_args(disable_frontend_multiprocessing=None),
     set_args(disable_frontend_multiprocessing=True)),
    # the kernels built for ivcore10 on a target of another architecture: every switched-on one has no artefact
    ("kernel-artefact", Severity.ERROR, lambda d: d["hardware"].__setitem__("device_arch", "ivcore11"),
     both(lambda d: d["hardware"].__setitem__("device_arch", "ivcore11"),
          set_env(**{m["switch"]: "0" for t in BASE["transforms"] if t["id"] == "adapter-corex-kernels"
                     for m in t["modules"]}))),
    # a conv of 3 taps: the causal conv kernel (4 taps, no call-site check) raises on every decode
    ("kernel-guard", Severity.ERROR, lambda d: d["model"]["linear_attention"].__setitem__("conv_kernel", 3),
     both(lambda d: d["model"]["linear_attention"].__setitem__("conv_kernel", 3),
          set_env(BI100_GDN_COREX_CAUSAL_CONV="0"))),
    # served in bf16, the float16 kernels are never used: said, not refused
    ("kernel-guard", Severity.WARNING, set_args(dtype=None), set_args(dtype="half")),
    # the base's MoE is the adapter's with its kernels: the native MoE on beside them is a second owner
    ("operation-owner", Severity.ERROR, set_env(MOE_NATIVE="1"),
     set_env(MOE_NATIVE="1", BI100_MOE_COREX_EXACT_REDUCE="0", BI100_MOE_COREX_WEIGHT_GATHER="0",
             BI100_MOE_COREX_DIRECT_ROUTED="0")),
]


def transform(data: dict[str, Any], tid: str) -> dict[str, Any]:
    return next(t for t in data["transforms"] if t["id"] == tid)


def test_probe_runtime_must_be_deployed(tmp_path: Path) -> None:
    found = issues_of(write(tmp_path, lambda d: transform(d, "probe-sample").__setitem__("runtime", "elsewhere.prof")),
                      "probe")
    assert [i.message.split(":")[0] for i in found] == [
        "transform probe-sample imports elsewhere.prof, which no deploy of this recipe installs"], found
    assert found[0].line is not None and "dest: elsewhere" in found[0].fix
# rules that need a vendor tree to compare with (lint --rootfs), or a source's deployed files (lint --source): their
# cases are in the test named beside them
ROOTFS_RULES = {
    "vendor-base": "test_corexlike.py::test_vendor_compare_names_063_and_exactly_the_files_the_fixture_changed",
    "engine-client": "test_frontend.py::test_without_the_flag_lint_names_the_call_the_class_and_the_flag"}


BAD_FLAGS = ("01", " 1", "true", "on", "2", "")


@pytest.mark.parametrize("switch", ["PREFIX_STATE", "MOE_NATIVE"])
@pytest.mark.parametrize("bad", BAD_FLAGS)
def test_switch_values_are_refused_as_the_server_refuses_them(tmp_path: Path, switch: str, bad: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Lint's verdict is the deployed reader's own message (no second parser), for the base and for a variant."""
    monkeypatch.syspath_prepend(str(REPO / "patches" / "src"))
    from native_fastpaths import switches

    monkeypatch.setenv(switch, bad)
    with pytest.raises(switches.SwitchError) as raised:
        switches.on(switch)
    runtime_reason = str(raised.value).split(" (read at ")[0]
    found = issues_of(write(tmp_path, set_env(**{switch: bad})), "switch-value")
    assert [i.message.split(" (the deployed")[0] for i in found] == [f"env {runtime_reason}"]
    assert found[0].line is not None and "exactly 0 or 1" in found[0].fix

    def in_variant(data: dict[str, Any]) -> None:
        data["variants"]["odd"] = {"env": {switch: bad}}

    loaded = load_recipe(write(tmp_path, in_variant, "v.yaml"))
    assert lint(loaded).errors == 0
    odd = lint(loaded, find_variant(loaded.recipe, "odd").apply(loaded.recipe), variant="odd")
    assert [i.rule for i in odd.issues if i.severity is Severity.ERROR] == ["switch-value"]


def test_two_owners_of_one_operation_are_named_with_their_switches(tmp_path: Path) -> None:
    [issue] = issues_of(write(tmp_path, set_env(RMSNORM_NATIVE="1")), "operation-owner")
    assert issue.severity is Severity.ERROR and issue.message.startswith("operation gdn.gated-norm has 2 owners")
    assert "transform rmsnorm-native (gdn.gated-norm, RMSNORM_NATIVE on)" in issue.message
    assert "kernel corex_gdn_gated_norm (gdn.gated-norm.decode, BI100_GDN_COREX_GATED_NORM on)" in issue.message
    assert issue.fix == 'switch one off (e.g. RMSNORM_NATIVE: "0" to keep the kernels)'
    # the adapter's own cascade (the packed decode step, its beta/decay and q/k parts) is not two owners
    assert issues_of(write(tmp_path, set_env(CHUNK_PARALLEL="1")), "operation-owner") == []


def test_a_part_of_an_operation_a_switched_on_kernel_computes_whole_is_said_to_never_run(tmp_path: Path) -> None:
    [issue] = issues_of(write(tmp_path, set_env(BI100_GDN_COREX_QK_MAP="1")), "kernel-guard")
    assert issue.severity is Severity.WARNING
    assert issue.message.startswith("corex_gdn_qk_map (BI100_GDN_COREX_QK_MAP on) is never used by the served model "
                                    "(float16 at TP 4): corex_gdn_packed_decode (BI100_GDN_COREX_PACKED_DECODE on) "
                                    "computes the whole of gdn.decode.step")
    # with the packed step off, it runs where its own guard holds
    assert issues_of(write(tmp_path, set_env(BI100_GDN_COREX_QK_MAP="1", BI100_GDN_COREX_PACKED_DECODE="0")),
                     "kernel-guard") == []


def test_a_kernel_switch_the_adapter_does_not_read_is_refused(tmp_path: Path) -> None:
    [issue] = issues_of(write(tmp_path, set_env(BI100_GDN_COREX_QK_MAP="TRUE")), "switch-value")
    assert issue.severity is Severity.ERROR and issue.line is not None
    assert issue.message.startswith("env BI100_GDN_COREX_QK_MAP='TRUE': the adapter's env_bool raises on it")


def test_every_rule_has_a_case() -> None:
    assert {c[0] for c in CASES} | set(ROOTFS_RULES) == set(RULES)


@pytest.mark.parametrize("rule,severity,fire,quiet", CASES, ids=[c[0] for c in CASES])
def test_rule_fires(tmp_path: Path, rule: str, severity: Severity, fire, quiet) -> None:  # type: ignore[no-untyped-def]
    found = issues_of(write(tmp_path, fire), rule)
    assert any(i.severity is severity for i in found), found
    for issue in found:
        assert issue.line is not None and issue.fix


@pytest.mark.parametrize("rule,severity,fire,quiet", CASES, ids=[c[0] for c in CASES])
def test_rule_stays_quiet(tmp_path: Path, rule: str, severity: Severity, fire, quiet) -> None:  # type: ignore[no-untyped-def]
    # quiet at the severity the case fires at (kv-cache always prints its numbers at info; the others are silent)
    found = [i for i in issues_of(write(tmp_path, quiet), rule) if i.severity is severity]
    assert found == []


def test_flagship_lints_without_errors_and_says_what_it_waits_for() -> None:
    result = lint(load_recipe(FLAGSHIP))
    assert result.errors == 0
    # the adapter is deployed: its flag (--reasoning-parser) and parser (qwen3_coder) are no longer waited for;
    # and with 10 KV caches (HYBRID_KV_ACCOUNTING=full_attention) the KV margin is no longer thin
    assert [i for i in result.issues if i.severity is Severity.WARNING] == []
    legacy = lint(load_recipe(FLAGSHIP), find_variant(load_recipe(FLAGSHIP).recipe, "kv-legacy40").apply(
        load_recipe(FLAGSHIP).recipe), variant="kv-legacy40")
    warnings = [i for i in legacy.issues if i.severity is Severity.WARNING]
    assert [i.rule for i in warnings] == ["kv-cache"]
    assert "thin memory margin" in warnings[0].message and "all 40 layers" in warnings[0].message
    assert "HYBRID_KV_ACCOUNTING=legacy40" in warnings[0].message


def test_a_declared_source_that_is_not_deployed_is_waited_for(tmp_path: Path) -> None:
    def undeploy(data: dict[str, Any]) -> None:
        adapter_files = {t["dest"] for t in data["transforms"] if str(t.get("source", "")).startswith("@")}
        data["transforms"] = [t for t in data["transforms"] if not str(t.get("source", "")).startswith("@")
                              and t.get("file") not in adapter_files and not t.get("requires")]

    found = issues_of(write(tmp_path, undeploy), "unknown-flag")
    assert sorted((i.severity, i.message.split(" is ")[0]) for i in found) == [
        (Severity.WARNING, "--reasoning-parser"), (Severity.WARNING, "tool parser 'qwen3_coder'")]
    assert all("qwen36-adapter" in i.message for i in found)


def test_kv_estimate_numbers_for_the_flagship(tmp_path: Path) -> None:
    result = lint(load_recipe(FLAGSHIP))
    kv = result.data["kv_estimate"]
    # vLLM 0.6.3 sizes KV by the config's layers_block_type: the hybrid-kv-accounting transforms give the adapter's
    # config classes one, and HYBRID_KV_ACCOUNTING=full_attention counts the 10 full-attention layers
    assert kv["attention_layers"] == 10
    assert kv["accounting"] == "10 full-attention layers (layers_block_type, HYBRID_KV_ACCOUNTING=full_attention)"
    assert kv["kv_per_token_bytes"] == 10 * 2 * 1 * 256 * 2  # 10 layers, K+V, 1 KV head/card, 256, bf16
    assert kv["weights_gib"] == pytest.approx(35e9 * 2 / 4 / 2**30)
    assert kv["kv_needed_gib"] == pytest.approx(262144 * 10240 / 2**30)  # 16,384 blocks of 16
    assert kv["fits"] is True and kv["margin"] >= 0.10
    assert kv["budget_gib"] == pytest.approx(32 * 0.90)
    # beside the start's six-image profile, more than 3 full-length sequences (the platform replays one at a time)
    assert kv["kv_available_gib"] / kv["kv_needed_gib"] >= 3.5
    # six images a prompt (the flagship's --limit-mm-per-prompt), profiled at start: 5120 patches each through the
    # tower's widest block
    one_image = 1280 * 4 * (6 * 1152 + 2 * 4304) * 2 / 2**30
    assert kv["vision_gib"] == pytest.approx(6 * one_image)
    twelve = lint(load_recipe(write(tmp_path, set_args(limit_mm_per_prompt="image=12", max_num_batched_tokens=16384),
                                    "twelve.yaml")))
    assert twelve.data["kv_estimate"]["vision_gib"] == pytest.approx(12 * one_image)
    # against the flagship with the same 16,384-token step (a step's activations are in the budget too)
    wide = lint(load_recipe(write(tmp_path, set_args(max_num_batched_tokens=16384), "wide.yaml")))
    less = wide.data["kv_estimate"]["kv_available_gib"] - 6 * one_image
    assert twelve.data["kv_estimate"]["kv_available_gib"] == pytest.approx(less)
    [said] = [i for i in twelve.issues if i.rule == "mm-profile"]
    assert said.severity is Severity.INFO and said.message.startswith(
        "the start profiles 12 max-size image(s) (15362 tokens of the 16384-token step): 1.78 GiB of vision-tower "
        "activations at its peak (in the kv-cache budget), 89.7 TFLOP, 0.61 s at the card's 147 TFLOPS peak")
    # the switch decides, as vLLM will: legacy40 counts every layer, and an env without it takes the default
    legacy = lint(load_recipe(write(tmp_path, set_env(HYBRID_KV_ACCOUNTING="legacy40")))).data["kv_estimate"]
    assert legacy["attention_layers"] == 40 and legacy["kv_per_token_bytes"] == 40960
    assert "HYBRID_KV_ACCOUNTING=legacy40" in legacy["accounting"]
    unset = write(tmp_path, lambda d: d["env"].pop("HYBRID_KV_ACCOUNTING"), "unset.yaml")
    assert lint(load_recipe(unset)).data["kv_estimate"]["attention_layers"] == 10


def test_kv_counts_only_full_attention_layers_when_the_config_says_so(tmp_path: Path) -> None:
    recipe = write(tmp_path, lambda d: d["model"].update(layers_block_type=True))
    kv = lint(load_recipe(recipe)).data["kv_estimate"]
    assert kv["attention_layers"] == 10 and kv["kv_per_token_bytes"] == 10 * 2 * 1 * 256 * 2
    assert "10 full-attention layers (layers_block_type)" in kv["accounting"]


def test_kv_warning_on_thin_margin(tmp_path: Path) -> None:
    found = issues_of(write(tmp_path, both(set_args(gpu_memory_utilization=0.94),
                                           set_env(HYBRID_KV_ACCOUNTING="legacy40"))), "kv-cache")
    assert [i.severity for i in found] == [Severity.WARNING]
    assert "thin memory margin" in found[0].message and "GiB" in found[0].message


def test_flag_added_by_a_deployed_file_is_known(tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    (patches / "cli").mkdir(parents=True)
    (patches / "cli" / "args.py").write_text(
        'def extend(parser):\n    parser.add_argument("--my-flag", type=int)\n\n'
        '@ToolParserManager.register_module(["my_parser"])\nclass P: ...\n')

    def mutate(data: dict[str, Any]) -> None:
        data["transforms"].append({"id": "deploy-cli", "kind": "deploy", "source": "cli", "dest": "toolkit_cli",
                                   "why": "adds --my-flag", "remove_when": "vLLM has the flag"})
        data["serve"]["args"].update({"my-flag": 3, "tool-call-parser": "my_parser"})

    path = write(tmp_path, mutate)
    text = path.read_text().replace(str(REPO / "patches" / "src"), str(patches))
    for entry in (REPO / "patches" / "src").iterdir():  # the recipe's other deploys find their sources
        (patches / entry.name).symlink_to(entry)
    path.write_text(text)
    found = issues_of(path, "unknown-flag")
    assert not [i for i in found if "my-flag" in i.message or "my_parser" in i.message]


def test_hardcoded_flag_without_unhardcode_warns(tmp_path: Path) -> None:
    found = issues_of(write(tmp_path, drop_transform("unhardcode-enforce-eager")), "cuda-graphs")
    assert [i.severity for i in found] == [Severity.WARNING]
    assert "--enforce-eager has no effect" in found[0].message
    # and with the vendor forcing eager, leaving the flag out cannot enable CUDA graphs
    quiet = write(tmp_path, both(drop_transform("unhardcode-enforce-eager"), set_args(enforce_eager=None)), "q.yaml")
    assert issues_of(quiet, "cuda-graphs") == []


def test_remove_when_holds_in_a_newer_image(tmp_path: Path, corex_rootfs: Path) -> None:
    for root in ("usr/local/corex/lib/python3/dist-packages", "usr/local/corex/lib64/python3/dist-packages"):
        path = corex_rootfs / root / "vllm/engine/arg_utils.py"
        path.write_text(path.read_text().replace("enforce_eager=True,", "enforce_eager=self.enforce_eager,"))
    found = issues_of(FLAGSHIP, "provenance", rootfs=corex_rootfs)
    assert [i.message.split(":")[0] for i in found] == ["transform unhardcode-enforce-eager is SUPERSEDED in "
                                                        f"{corex_rootfs}"]
    assert found[0].origin is not None
    assert (found[0].origin.file, found[0].origin.line) == flagship_origin("remove_when:",
                                                                          after="- id: unhardcode-enforce-eager")


def test_workdir_with_vllm_folder_in_the_image(tmp_path: Path, corex_rootfs: Path) -> None:
    (corex_rootfs / "workspace" / "vllm").mkdir(parents=True)
    found = issues_of(FLAGSHIP, "workdir-shadow", rootfs=corex_rootfs)
    assert [i.severity for i in found] == [Severity.ERROR]


@pytest.mark.parametrize("path", PRIOR_ART, ids=[p.stem for p in PRIOR_ART])
def test_prior_art_failures_are_caught(cli, path: Path) -> None:
    expected = path.read_text().splitlines()[1].split("must report: ")[1]
    rule = expected.split()[0]
    result = cli("lint", path, "--json")
    assert result.code == 2
    errors = [i for i in result.json()["issues"] if i["severity"] == "error"]
    assert [i["rule"] for i in errors] == [rule] * (2 if "twice" in expected else 1), errors


def test_lint_exit_codes(cli, tmp_path: Path) -> None:
    assert cli("lint", FLAGSHIP).code == 0
    assert cli("lint", FLAGSHIP, "--strict").code == 0  # no warning: 10 KV caches leave a wide margin
    assert cli("lint", FLAGSHIP, "--variant", "kv-legacy40", "--strict").code == 1  # 40: the thin KV margin
    assert cli("lint", write(tmp_path, both(set_args(gpu_memory_utilization=0.98),
                                            lambda d: d["model"].update(layers_block_type=True))), "--strict").code == 0
    assert cli("lint", write(tmp_path, set_args(num_scheduler_steps=8))).code == 2


def test_variants_drop_impossible_combinations(cli) -> None:
    result = cli("variants", FLAGSHIP, "--json")
    assert result.code == 0
    variants = {v["name"]: v for v in result.json()["variants"]}
    assert len(variants) == 1 + 5 + 2 * 4 * 2 * 2
    assert variants["base"]["status"] == "ok" and variants["no-sdpa-fallback"]["status"] == "ok"
    # the two other owners of the kernels' operations lint clean too (one owner per operation)
    assert all(variants[n]["status"] == "ok" for n in ("native-moe", "native-paths", "adapter-paths"))
    assert variants["kv-legacy40"]["status"] == "ok"
    dropped = {n for n, v in variants.items() if v["status"] == "DROPPED"}
    # chunked prefill off below the context; every layer's KV beside six images' start profile (one 262,144-token
    # sequence does not fit)
    assert dropped == {n for n in variants if "_ecp-false_" in n or n.endswith("_hka-legacy40")}
    rules = {n: {i["rule"] for i in v["issues"] if i["severity"] == "error"} for n, v in variants.items()}
    assert all(("chunked-prefill-batch" in rules[n]) == ("_ecp-false_" in n) for n in dropped)
    assert all(("kv-cache" in rules[n]) == n.endswith("_hka-legacy40") for n in dropped)
    assert variants["mnbt-16384_mns-2_ecp-true_hka-legacy40"]["args"] == {
        "max-num-batched-tokens": 16384, "max-num-seqs": 2, "enable-chunked-prefill": "true"}
    assert variants["mnbt-16384_mns-2_ecp-true_hka-legacy40"]["env"] == {"HYBRID_KV_ACCOUNTING": "legacy40"}


def test_lint_one_variant(cli) -> None:
    bad = cli("lint", FLAGSHIP, "--variant", "mnbt-8192_mns-1_ecp-false_hka-full-attention", "--json")
    assert bad.code == 2
    issue = next(i for i in bad.json()["issues"] if i["severity"] == "error")
    assert issue["variant"] == "mnbt-8192_mns-1_ecp-false_hka-full-attention"
    assert (issue["file"], issue["line"]) == flagship_origin("max-num-batched-tokens: [8192")
    missing = cli("lint", FLAGSHIP, "--variant", "nope")
    assert missing.code == 2 and "no variant 'nope'" in missing.err


def test_verify_refuses_a_recipe_with_lint_errors(cli, tmp_path: Path, corex_rootfs: Path,
                                                   flagship_args: list[str]) -> None:
    bad = write(tmp_path, set_args(num_scheduler_steps=8))
    assert cli("apply", bad, "--rootfs", corex_rootfs, *flagship_args).code == 0
    result = cli("verify", bad, "--rootfs", corex_rootfs, *flagship_args, "--json")
    assert result.code == 1
    assert {i["rule"] for i in result.json()["issues"]} == {"multi-step-backend"}
    assert json.loads(cli("verify", FLAGSHIP, "--rootfs", corex_rootfs, *flagship_args, "--json").out)["issues"] == []


def without_prefix_state_transforms(data: dict[str, Any]) -> None:
    data["transforms"] = [t for t in data["transforms"] if not t["id"].startswith("prefix-state")]


def test_prefix_state_lint_names_the_failure_and_the_fix(tmp_path: Path, cli) -> None:  # type: ignore[no-untyped-def]
    """A copy of the flagship without the fix fails (exit 2), whichever way the fix is missing; the flagship passes
    and says what its checkpoints cost."""
    copy_path = write(tmp_path, lambda d: d["model"].pop("prefix_state"), "a.yaml")
    undeclared = issues_of(copy_path, "prefix-state")
    assert [i.severity for i in undeclared] == [Severity.ERROR]
    assert "serves different tokens" in undeclared[0].message and "exact-checkpoints" in undeclared[0].fix
    assert undeclared[0].line == line_of(copy_path, "enable-prefix-caching:")

    refused = issues_of(write(tmp_path, lambda d: d["model"].__setitem__("prefix_state", "none"), "b.yaml"),
                        "prefix-state")
    assert [i.severity for i in refused] == [Severity.ERROR] and "prefix_state is none" in refused[0].message
    fine = issues_of(write(tmp_path, both(lambda d: d["model"].__setitem__("prefix_state", "none"),
                                          set_args(enable_prefix_caching=None)), "c.yaml"), "prefix-state")
    assert fine == []

    unbacked = write(tmp_path, without_prefix_state_transforms, "d.yaml")
    found = issues_of(unbacked, "prefix-state")
    assert [i.severity for i in found] == [Severity.ERROR]
    for needle in ("prefix_state.limit_hit (in Scheduler.schedule)", "gdn_forward (in GatedDeltaNet.forward)",
                   "prefix_state_plan: Optional (in ModelInputForGPU)"):
        assert needle in found[0].message, found[0].message
    assert cli("lint", unbacked).code == 2

    undeployed = write(tmp_path, drop_transform("deploy-native-fastpaths"), "g.yaml")
    with pytest.raises(RecipeError, match="prefix-state-import-scheduler requires deploy-native-fastpaths"):
        load_recipe(undeployed)

    half = write(tmp_path, drop_transform("prefix-state-begin-step"), "e.yaml")
    assert [i.message for i in issues_of(half, "prefix-state")
            if "lack prefix_state.begin_step (in ModelRunner.execute_model):" in i.message]

    unbounded = write(tmp_path, lambda d: d["env"].pop("PREFIX_STATE_CHECKPOINTS"), "f.yaml")
    assert ["PREFIX_STATE_CHECKPOINTS" in i.message for i in issues_of(unbounded, "prefix-state")] == [True]

    flagship = issues_of(FLAGSHIP, "prefix-state")
    assert [i.severity for i in flagship] == [Severity.INFO]
    assert "at most 64 of 15.4 MiB per card" in flagship[0].message and "0.96 GiB" in flagship[0].message
    assert cli("lint", FLAGSHIP).code == 0


def line_of(path: Path, start: str) -> int:
    return next(n for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip().startswith(start))


def test_a_deployed_reader_that_does_not_load_is_an_issue_not_a_crash(tmp_path: Path) -> None:
    """The reader checks its own table when imported; lint loads it and reports why it does not load."""
    import shutil

    patches = tmp_path / "patches"
    shutil.copytree(REPO / "patches" / "src", patches)
    table_file = patches / "native_fastpaths" / "switches.json"
    table = json.loads(table_file.read_text())
    table["PREFIX_STATE"]["type"] = "bool"
    table_file.write_text(json.dumps(table))

    def broken(data: dict[str, Any]) -> None:
        data["patches"] = str(patches)

    found = issues_of(write(tmp_path, broken), "switch-value")
    assert len(found) == 1 and found[0].severity is Severity.ERROR, found
    assert "does not load: SwitchError:" in found[0].message and "PREFIX_STATE: type 'bool'" in found[0].message


# -- platform rules and start rules ---------------------------------------------------------------------------------

PLATFORM_RULES = {"context-length"}  # what only the platform's submission requires; vLLM starts such a variant


def test_only_the_platform_rules_are_marked_platform() -> None:
    # every other rule guards a start vLLM or the hardware refuses, or answers that would be wrong: an error for
    # every verb (go through the table when a rule is added: which side is it on?)
    assert {rule_id for rule_id, info in RULES.items() if info.platform} == PLATFORM_RULES


def test_a_platform_rule_is_a_warning_for_a_diagnostic_run_and_stays_an_error_for_a_submission(tmp_path: Path) -> None:
    # how the team ran its diagnostic experiments: short prompts, faster restarts
    short = load_recipe(write(tmp_path, set_args(max_model_len=100000)))
    submission = lint(short)
    [error] = [i for i in submission.refusals if i.rule == "context-length"]
    assert error.severity is Severity.ERROR and error.platform and submission.not_a_submission == ()
    diagnostic = lint(short, for_submission=False)
    assert [i.rule for i in diagnostic.refusals] == [], diagnostic.refusals
    [warning] = diagnostic.not_a_submission
    assert warning.rule == "context-length" and warning.severity is Severity.WARNING and warning.platform
    assert warning.message == f"{error.message} (only the platform's submission requires this)"
    assert warning.line == error.line and warning.fix == error.fix  # still where to fix it, and how


def test_the_context_rule_names_the_largest_request_or_the_context_it_must_exceed(tmp_path: Path) -> None:
    [largest] = issues_of(write(tmp_path, set_args(max_model_len=245000)), "context-length")
    assert largest.message == ("max_model_len 245000 refuses the workload's largest request (254,336 prompt tokens "
                               "with a 4,096-token completion limit: 258,432 tokens): vLLM answers it HTTP 400 before "
                               "a token")
    assert largest.fix == "set max-model-len to at least 258432"
    written = tmp_path / "r.yaml"
    assert largest.origin is not None and largest.origin.file == str(written)
    assert written.read_text().splitlines()[largest.origin.line - 1].strip() == "max-model-len: 245000"
    assert issues_of(write(tmp_path, set_args(max_model_len=258432), "exact.yaml"), "context-length") == []

    def rounded(data: dict[str, Any]) -> None:
        data["serve"]["workload"] = {"min_context_tokens": 235000}

    [rounded_up] = issues_of(write(tmp_path, both(rounded, set_args(max_model_len=235000)), "r2.yaml"),
                             "context-length")
    assert rounded_up.message == "max_model_len 235000 does not exceed the workload's 235000 tokens"
    half = write(tmp_path, lambda d: d["serve"]["workload"].pop("largest_prompt_completion_limit"), "half.yaml")
    with pytest.raises(RecipeError, match="largest_prompt_tokens and largest_prompt_completion_limit describe one "
                                          "request: give both or neither"):
        load_recipe(half)


def test_what_vllm_refuses_stays_an_error_for_a_diagnostic_run(tmp_path: Path) -> None:
    refused = load_recipe(write(tmp_path, both(set_args(max_model_len=100000, enable_chunked_prefill="false",
                                                        max_num_batched_tokens=8192))))
    diagnostic = lint(refused, for_submission=False)
    assert [i.rule for i in diagnostic.refusals] == ["chunked-prefill-batch"]
    assert not diagnostic.refusals[0].platform
    assert [i.rule for i in diagnostic.not_a_submission] == ["context-length"]


def test_build_refuses_the_short_context_copy_that_a_diagnostic_run_takes(cli: Any, tmp_path: Path) -> None:
    short = write(tmp_path, set_args(max_model_len=100000))
    out = tmp_path / "sub"
    result = cli("build", short, "-o", out, "--json")
    assert result.code == 2 and not out.exists(), result.out + result.err
    assert "context-length" in result.err and "max_model_len 100000 refuses the workload's largest request " \
        "(254,336 prompt tokens with a 4,096-token completion limit: 258,432 tokens)" in result.err
    assert "the recipe would not be accepted as a submission; lint found 1 error(s)" in result.err
    assert "preflight, rehearse, estimate and experiment run it as it is" in result.err


def test_variants_marks_a_platform_only_configuration_and_drops_only_what_cannot_start(cli: Any,
                                                                                      tmp_path: Path) -> None:
    result = cli("variants", write(tmp_path, set_args(max_model_len=100000)), "--json")
    assert result.code == 0, result.out + result.err
    variants = {v["name"]: v for v in result.json()["variants"]}
    # the diagnostic verbs run these (they used to be DROPPED as if vLLM refused them)
    assert variants["base"]["status"] == "NOT A SUBMISSION"
    assert variants["base"]["issues"][0]["rule"] == "context-length"
    dropped = {n for n, v in variants.items() if v["status"] == "DROPPED"}
    assert dropped == {n for n in variants if "_ecp-false_" in n}  # what vLLM refuses stays dropped
    assert {v["status"] for n, v in variants.items() if n not in dropped} == {"NOT A SUBMISSION"}
    [note] = result.json()["notes"]
    assert f"{len(variants) - len(dropped)} of {len(variants)} variant(s) can start" in note
    assert f"{len(variants) - len(dropped)} of them NOT A SUBMISSION" in note and "build refuses them" in note


def test_an_env_variable_a_gpu_library_reads_itself_is_not_unread_once_declared(tmp_path: Path) -> None:
    """ENABLE_CUSTOM_IPC is read by ixformer on the image, by no file of the patched tree: the image layer's
    gpu_libraries[].reads_env says so, and without it the flagship's env is reported unread, naming it."""
    assert BASE["env"]["ENABLE_CUSTOM_IPC"] == "1"
    assert issues_of(write(tmp_path, lambda d: None), "env-unread") == []

    def undeclared(data: dict[str, Any]) -> None:
        for library in data["base_image"]["gpu_libraries"]:
            if isinstance(library, dict):
                library.pop("reads_env", None)

    [issue] = issues_of(write(tmp_path, undeclared, "u.yaml"), "env-unread")
    assert "env ENABLE_CUSTOM_IPC is read by no dispatch" in issue.message and "reads_env" in issue.fix
