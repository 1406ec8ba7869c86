"""`toolkit upgrade`: every transform's fate at another commit of its source, on the adapter's real history (its pin
and its newest commit, from shared/) and on small sources built here for the fates that history does not show; and
`--write`, which keeps a layer's comments and layout and never writes over a user's edit."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path
from typing import Any

import git
import pytest
from conftest import REPO, flagship_before_the_upgrade
from pinned_adapter import history

from toolkit.cli import main
from toolkit.commands.upgrade import UpgradeRequest, upgrade
from toolkit.errors import InputError
from toolkit.upgrade.write import _load

FLAGSHIP = REPO / "recipes" / "bi100-qwen36.yaml"
ACTOR = git.Actor("t", "t@t")

# the source at its pin: each class is what one transform stands on
OLD = """\
import os


class Loader:
    def load(self, path):
        data = read(path)
        checked = verify(data)
        return checked

    def other(self, x):
        y = compute(x)
        return y


class Store:
    def save(self, item):
        blob = encode(item)
        write(blob)


class Cache:
    def get(self, key):
        value = lookup(key)
        return value


def limit(n, m):
    if n > 0:
        return n
    return m


class Twin:
    def run(self, q, r):
        z = prepare(q)
        return z


class Solo:
    def run(self, q):
        z = prepare(q)
        return z


class Other:
    def run(self, q):
        z = prepare(q)
        return z


def helper(a):
    b = twice(a)
    return b
"""
OTHER = "VALUE = 1\n"
NEW_OTHER = """\
VALUE = 1


def helper(a):
    b = twice(a)
    return b
"""

# the new commit: a statement wrapped in a `with`, a renamed parameter, a method moved to a new class, a post-state
# already upstream, a changed condition, a changed call beside an identical twin elsewhere, a removed class whose
# code a class that was always there also has, and a function moved to another file of the source
NEW = """\
import os
import threading

LOCK = threading.Lock()


class Loader:
    def load(self, path):
        data = read(path)
        with LOCK:
            checked = verify(data)
        return checked

    def other(self, v):
        y = compute(v)
        return y


class Archive:
    def save(self, item):
        blob = encode(item)
        write(blob)


class Cache:
    def get(self, key):
        value = lookup(key) or default()
        return value


def limit(n, m):
    if n >= 0:
        return n
    return m


class Twin:
    def run(self, q, r):
        z = prepare(r)
        return z


class Other:
    def run(self, q):
        z = prepare(q)
        return z
"""

SETTLED = """\
  - id: deploy-other
    kind: deploy
    source: "@up/other.py"
    dest: vllm/up_other.py
    why: the source's second module
    remove_when: never
  - id: moved-file
    kind: statements
    file: vllm/up_mod.py
    scope: helper
    old: b = twice(a)
    new: b = twice(a) + 0
    why: a no-op that moves with its function
    remove_when: never
  # a wrapped statement: the same edit, one level deeper
  - id: wrapped
    kind: statements
    file: vllm/up_mod.py
    scope: Loader.load
    old: checked = verify(data)
    new: checked = verify(data, strict=True)
    why: strict checks
    remove_when: never
  - id: renamed
    kind: statements
    file: vllm/up_mod.py
    scope: Loader.other
    old: y = compute(x)
    new: y = compute(x) + 1
    why: off by one
    remove_when: never
  - id: moved-class
    kind: statements
    file: vllm/up_mod.py
    scope: Store.save
    old: write(blob)
    new: write(blob, sync=True)  # durable
    why: durable writes
    remove_when: never
  - id: already-upstream
    kind: statements
    file: vllm/up_mod.py
    scope: Cache.get
    old: value = lookup(key)
    new: value = lookup(key) or default()
    why: a default for missing keys
    remove_when: upstream has it
  # the comment above the last transform stays with it
  - id: keep-last
    kind: statements
    file: vllm/up_mod.py
    scope: Loader.load
    old: return checked
    new: return checked or None
    why: explicit
    remove_when: never
"""

UNSETTLED = """\
  - id: deploy-extra
    kind: deploy
    source: "@up/extra.py"
    dest: vllm/up_extra.py
    why: a module the new commit removed
    remove_when: never
  - id: deploy-other
    kind: deploy
    source: "@up/other.py"
    dest: vllm/up_other.py
    why: the source's second module
    remove_when: never
  - id: moved-file
    kind: statements
    file: vllm/up_mod.py
    scope: helper
    old: b = twice(a)
    new: b = twice(a) + 0
    why: a no-op that moves with its function
    remove_when: never
  - id: changed-condition
    kind: statements
    file: vllm/up_mod.py
    scope: limit
    old: |
      if n > 0:
          return n
    new: |
      if n > 1:
          return n
    why: bound
    remove_when: never
  - id: twin
    kind: statements
    file: vllm/up_mod.py
    scope: Twin.run
    old: z = prepare(q)
    new: z = prepare(q, fast=True)
    why: fast
    remove_when: never
  - id: solo
    kind: statements
    file: vllm/up_mod.py
    scope: Solo.run
    old: z = prepare(q)
    new: z = prepare(q, fast=True)
    why: fast
    remove_when: never
"""


def _repo(path: Path) -> git.Repo:
    repo = git.Repo.init(path)
    repo.git.config("user.email", "t@t")
    repo.git.config("user.name", "t")
    return repo


def _commit(repo: git.Repo, files: dict[str, str | None], message: str) -> str:
    for rel, text in files.items():
        target = Path(repo.working_dir) / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        if text is None:
            target.unlink()
        else:
            target.write_text(text)
    repo.git.add("--all")
    return repo.index.commit(message, author=ACTOR, committer=ACTOR).hexsha


def _recipe_text(pin: str, transforms: str) -> str:
    return textwrap.dedent(f"""\
        # a recipe on a source of its own (this comment stays)
        name: upgrade-test
        hardware: {{vendor: iluvatar, accelerator: BI-V100, count: 4, memory_gb: 32}}
        base_image: {{reference: "corex:test", python: "3.10"}}
        vendor:
          version: ">=0.6.3,<0.6.4"
          roots: [/usr/local/lib/python3.10/site-packages]
          reference: vllm==0.6.3.post1
        serve:
          args: {{model: /model}}
        sources:
          - name: up
            git: https://example.invalid/up.git
            commit: {pin}  # the pin
        transforms:
          - id: deploy-up
            kind: deploy
            source: "@up/mod.py"
            dest: vllm/up_mod.py
            why: the source's module
            remove_when: never
        """) + transforms


@pytest.fixture
def made(tmp_path: Path) -> dict[str, Any]:
    """A source with two commits and, in a repository of their own, recipes pinned to the first."""
    src = _repo(tmp_path / "src")
    old = _commit(src, {"mod.py": OLD, "other.py": OTHER, "extra.py": OTHER}, "old")
    new = _commit(src, {"mod.py": NEW, "other.py": NEW_OTHER, "extra.py": None}, "new")
    rec = _repo(tmp_path / "recipes")
    settled = tmp_path / "recipes" / "settled.yaml"
    unsettled = tmp_path / "recipes" / "unsettled.yaml"
    _commit(rec, {"settled.yaml": _recipe_text(old, SETTLED), "unsettled.yaml": _recipe_text(old, UNSETTLED)},
            "recipes")
    return {"src": tmp_path / "src", "old": old, "new": new, "settled": settled, "unsettled": unsettled,
            "repo": rec}


def _fates(report: Any) -> dict[str, dict[str, Any]]:
    return {f["transform"]: f for f in report.as_json()["fates"]}


def test_each_fate_is_decided_by_trying_the_transform_on_the_new_files(made: dict[str, Any]) -> None:
    report = upgrade(UpgradeRequest(made["settled"], f"up={made['src']}@{made['new']}"))
    fates = _fates(report)
    assert {t: f["fate"] for t, f in fates.items()} == {
        "deploy-up": "carries", "deploy-other": "carries", "moved-file": "moved", "wrapped": "moved",
        "renamed": "moved", "moved-class": "moved", "already-upstream": "upstream", "keep-last": "carries"}
    # a function moved to another file the source deploys: the transform follows it there
    assert fates["moved-file"]["proposal"] == {"scope": "helper", "file": "vllm/up_other.py"}
    assert "+    b = twice(a) + 0" in fates["moved-file"]["diff"]
    # wrapped in a `with`: the recipe needs no change; the diff shows the edit one level deeper
    assert fates["wrapped"]["proposal"] == {} and "+            checked = verify(data, strict=True)" in \
        fates["wrapped"]["diff"]
    # a renamed parameter: both code fields follow it, and the proposal was tried
    assert fates["renamed"]["proposal"] == {"old": "y = compute(v)", "new": "y = compute(v) + 1"}
    assert fates["moved-class"]["proposal"] == {"scope": "Archive.save"}
    assert "+        write(blob, sync=True)" in fates["moved-class"]["diff"]
    assert "around it, Loader.load changed" in fates["keep-last"]["detail"]
    assert report.exit_code == 0 and report.as_json()["counts"] == {
        "carries": 3, "moved": 4, "upstream": 1, "conflict": 0, "gone": 0}


def test_a_plausible_match_elsewhere_is_a_conflict_or_gone_never_a_proposal(made: dict[str, Any]) -> None:
    report = upgrade(UpgradeRequest(made["unsettled"], f"up={made['src']}@{made['new']}"))
    fates = _fates(report)
    # `n > 0` became `n >= 0`: the same place, another meaning
    assert fates["changed-condition"]["fate"] == "conflict" and not fates["changed-condition"]["proposal"]
    assert "if n > 0:" in fates["changed-condition"]["old_code"]
    assert "if n >= 0:" in fates["changed-condition"]["new_code"]
    # `prepare(q)` became `prepare(r)`: r was a parameter before too, so this is another variable, not a rename;
    # Other.run still has `z = prepare(q)`, but it is another function that was always there
    assert fates["twin"]["fate"] == "conflict" and not fates["twin"]["proposal"]
    assert "z = prepare(r)" in fates["twin"]["new_code"]
    # Solo is gone; Other.run has the same code and the same method name, and existed at the pin: not a move
    assert fates["solo"]["fate"] == "gone" and not fates["solo"]["proposal"]
    assert fates["deploy-extra"]["fate"] == "gone"
    assert "@up/extra.py is not in commit" in fates["deploy-extra"]["detail"]
    assert report.exit_code == 1
    issues = {i["rule"]: i for i in report.as_json()["issues"]}
    assert set(issues) == {"upgrade-conflict", "upgrade-gone"}
    lines = {i["line"] for i in report.as_json()["issues"]}
    text = made["unsettled"].read_text().splitlines()
    assert {text[n - 1].strip() for n in lines} == {"- id: changed-condition", "- id: twin", "- id: solo",
                                                    "- id: deploy-extra"}


def test_write_moves_the_pin_and_the_anchors_keeps_comments_and_a_second_run_writes_nothing(
        made: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    before = made["settled"].read_text()
    code = main(["upgrade", str(made["settled"]), "--source", f"up={made['src']}@{made['new']}", "--write",
                 "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0, out
    after = made["settled"].read_text()
    assert f"commit: {made['new']}  # the pin; toolkit upgrade: was {made['old'][:12]}" in after
    assert "# a recipe on a source of its own (this comment stays)" in after
    assert "  # the comment above the last transform stays with it\n  - id: keep-last" in after
    assert "  # a wrapped statement: the same edit, one level deeper\n" in after
    assert f"  # toolkit upgrade to {made['new'][:12]}: MOVED, what it stands on moved (renamed x -> v)" in after
    assert "scope: Archive.save" in after and "file: vllm/up_other.py" in after
    assert "old: y = compute(v)" in after and "new: y = compute(v) + 1" in after
    assert "id: already-upstream" not in after
    assert f"  # toolkit upgrade to {made['new'][:12]}: removed already-upstream, UPSTREAM: " in after
    # nothing else changed: the diff is the review (the pin, two renamed fields, a scope, a file, 8 lines removed;
    # 4 notes)
    diff = made["repo"].git.diff("-U0").splitlines()
    assert sum(1 for ln in diff if ln.startswith("-") and not ln.startswith("---")) == 13, diff
    assert sum(1 for ln in diff if ln.startswith("+") and not ln.startswith("+++")) == 9, diff
    assert len(after.splitlines()) == len(before.splitlines()) - 4
    made["repo"].git.commit("-am", "upgraded")
    again = upgrade(UpgradeRequest(made["settled"], f"up={made['src']}@{made['new']}", write=True))
    assert {f["fate"] for f in again.as_json()["fates"]} == {"carries"}
    assert again.as_json()["written"] == ["nothing to write"] and again.exit_code == 0
    assert made["settled"].read_text() == after


def test_write_refuses_a_file_with_uncommitted_edits_and_writes_a_new_file_with_o(made: dict[str, Any],
                                                                                   tmp_path: Path) -> None:
    edited = made["settled"].read_text() + "# a user's edit, not committed\n"
    made["settled"].write_text(edited)
    with pytest.raises(InputError, match="it has uncommitted changes"):
        upgrade(UpgradeRequest(made["settled"], f"up={made['src']}@{made['new']}", write=True))
    assert made["settled"].read_text() == edited
    out = tmp_path / "upgraded.yaml"
    report = upgrade(UpgradeRequest(made["settled"], f"up={made['src']}@{made['new']}", write=True, output=out))
    assert report.exit_code == 0 and made["settled"].read_text() == edited
    assert f"commit: {made['new']}" in out.read_text() and "# a user's edit, not committed" in out.read_text()
    with pytest.raises(InputError, match="exists; upgrade writes a new file only"):
        upgrade(UpgradeRequest(made["settled"], f"up={made['src']}@{made['new']}", write=True, output=out))


def test_write_rewrites_the_sources_digests_lock_with_the_new_commits_files(made: dict[str, Any]) -> None:
    """A recipe that keeps a digests lock for its source (what the in-image step checks a fetched source against)
    gets the new commit's LF digests of exactly the files it uses; -o then refuses, as two files change."""
    lock = made["settled"].parent / "up.digests.json"
    lock.write_text(json.dumps({"mod.py": "0" * 64, "other.py": "0" * 64}, indent=2, sort_keys=True) + "\n")
    made["settled"].write_text(made["settled"].read_text().replace(
        "    commit: ", "    digests: up.digests.json\n    commit: ", 1))
    made["repo"].git.add("--all")
    made["repo"].git.commit("-m", "a digests lock")
    with pytest.raises(InputError, match="-o takes one"):
        upgrade(UpgradeRequest(made["settled"], f"up={made['src']}@{made['new']}", write=True,
                               output=made["settled"].parent / "new.yaml"))
    report = upgrade(UpgradeRequest(made["settled"], f"up={made['src']}@{made['new']}", write=True))
    assert report.exit_code == 0
    assert json.loads(lock.read_text()) == {"mod.py": hashlib.sha256(NEW.encode()).hexdigest(),
                                            "other.py": hashlib.sha256(NEW_OTHER.encode()).hexdigest()}
    assert any(str(lock) in line and "the digests of 2 file(s)" in line for line in report.notes), report.notes


def test_write_refuses_a_layout_it_cannot_keep_and_touches_nothing(made: dict[str, Any]) -> None:
    block = 'vendor:\n  version: ">=0.6.3,<0.6.4"\n  roots: [/usr/local/lib/python3.10/site-packages]\n' \
        "  reference: vllm==0.6.3.post1\n"
    flow = 'vendor:\n  {version: ">=0.6.3,<0.6.4", roots: [/usr/local/lib/python3.10/site-packages],\n' \
        "   reference: vllm==0.6.3.post1}\n"
    assert block in made["settled"].read_text()
    text = made["settled"].read_text().replace(block, flow)
    made["settled"].write_text(text)
    made["repo"].git.commit("-am", "a flow mapping over two lines")
    with pytest.raises(InputError, match="cannot be rewritten without changing its layout"):
        upgrade(UpgradeRequest(made["settled"], f"up={made['src']}@{made['new']}", write=True))
    assert made["settled"].read_text() == text


def test_the_commit_to_move_to_and_the_pin_must_be_in_the_clone(made: dict[str, Any]) -> None:
    with pytest.raises(InputError, match="name the commit to move to"):
        upgrade(UpgradeRequest(made["settled"], f"up={made['src']}"))
    with pytest.raises(InputError, match="declares no source 'nope'"):
        upgrade(UpgradeRequest(made["settled"], f"nope={made['src']}@{made['new']}"))
    other = _repo(made["src"].parent / "other")
    unrelated = _commit(other, {"mod.py": NEW}, "unrelated")
    with pytest.raises(InputError, match=r"is not in .*\(the pin, .*settled.yaml:\d+\)") as caught:
        upgrade(UpgradeRequest(made["settled"], f"up={made['src'].parent / 'other'}@{unrelated}"))
    assert "--from REV" in (caught.value.hint or "")


def test_every_layer_round_trips_byte_for_byte_through_the_writer() -> None:
    for path in sorted((REPO / "layers").glob("*.yaml")) + sorted((REPO / "recipes").glob("*.yaml")):
        assert _load(path).text == path.read_text(), path


@pytest.fixture(scope="module")
def adapter_history(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, str]:
    return history(tmp_path_factory.mktemp("history"))


def test_the_adapters_real_history_from_its_old_pin_to_its_newest_commit(
        adapter_history: tuple[Path, str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bare, before, newest = adapter_history
    recipe = flagship_before_the_upgrade(tmp_path)
    code = main(["upgrade", str(recipe), "--source", f"qwen36-adapter={bare}@{newest}", "--from", before, "--json"])
    data = json.loads(capsys.readouterr().out)
    fates = {f["transform"]: f for f in data["fates"]}
    unsettled = {t for t, f in fates.items() if f["fate"] != "carries"}
    print(json.dumps({t: fates[t]["fate"] for t in sorted(unsettled)}, indent=1))
    assert code == 1
    # what the newest commit's own code shows: the q/k/v projections moved into an `else:` (a fused path beside
    # them); the router and the shared gate merged into one linear; the save block and two bypassed functions
    # changed in meaning
    assert {t: fates[t]["fate"] for t in unsettled} == {
        "probe-attention-q-proj": "moved", "probe-attention-k-proj": "moved", "probe-attention-v-proj": "moved",
        "probe-moe-router": "conflict", "probe-moe-shared-gate": "conflict",
        "prefix-state-no-block-id-save": "conflict", "moe-native": "conflict", "prefix-state-gdn": "conflict"}
    assert "router_shared_gate" in fates["probe-moe-router"]["detail"]
    assert "gdn_capture_offset" in fates["prefix-state-no-block-id-save"]["new_code"]
    assert "capture_offset" in fates["prefix-state-gdn"]["new_code"]
    assert fates["adapter-model"]["fate"] == "carries" and "qwen3_5.py +" in fates["adapter-model"]["detail"]
    assert "around it, Scheduler.schedule changed" in fates["prefix-state-attach"]["detail"]
    assert data["counts"]["carries"] == len(fates) - 8
    assert fates["prefix-state-no-block-id-save"]["origin"].startswith(str(tmp_path / "layers" / "qwen36-adapter.yaml"))


def test_the_flagship_at_its_new_pin_carries_and_back_to_the_old_one_names_what_the_upgrade_decided(
        adapter_history: tuple[Path, str, str], capsys: pytest.CaptureFixture[str]) -> None:
    """The flagship in this repository is the upgrade's result: at its pin every transform carries; moved back to
    the old commit (bisecting), exactly what a person decided on the way up is unsettled."""
    bare, before, newest = adapter_history
    assert main(["upgrade", str(FLAGSHIP), "--source", f"qwen36-adapter={bare}@{newest}", "--from", newest,
                 "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {f["fate"] for f in data["fates"]} == {"carries"} and data["written"] == []
    assert main(["upgrade", str(FLAGSHIP), "--source", f"qwen36-adapter={bare}@{before}", "--from", newest,
                 "--json"]) == 1
    fates = {f["transform"]: f["fate"] for f in json.loads(capsys.readouterr().out)["fates"]}
    print(json.dumps({t: f for t, f in fates.items() if f != "carries"}, indent=1))
    assert {t for t, f in fates.items() if f != "carries"} == {
        "prefix-state-no-adapter-capture", "prefix-state-no-block-id-save", "probe-moe-router",
        "probe-attention-qgkv-proj", "moe-native", "prefix-state-gdn",
        # and what the kernels issue added at the new pin: no prebuilt modules at 5a1c8c7, no call site to guard
        "adapter-corex-kernels", "adapter-corex-causal-conv-guard"}
    assert fates["probe-attention-qgkv-proj"] == "gone"  # no self.qgkv_proj at 5a1c8c7, nothing in its place
    assert fates["adapter-corex-kernels"] == "gone"
