"""`toolkit build` and `toolkit check OUTDIR`: the submission repository, without a Docker engine."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import git
import pytest
import yaml
from conftest import FLAGSHIP, REPO, flagship_data, roots_of, transformers_site

from toolkit.recipe import load_recipe
from toolkit.submission import build as submission
from toolkit.submission.inimage import expected_results

TEXT_SUFFIXES = (".py", ".sh", ".yaml", ".json", ".jinja", ".gitattributes", "Dockerfile")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from toolkit.cli import main

    out = tmp_path_factory.mktemp("build") / "submission"
    assert main(["build", str(FLAGSHIP), "-o", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def bundled(tmp_path_factory: pytest.TempPathFactory, adapter_args: list[str]) -> Path:
    """The flagship built with the pinned adapter bundled and the fixture's replacement expectations."""
    from toolkit.cli import main

    out = tmp_path_factory.mktemp("bundled") / "submission"
    assert main(["build", str(FLAGSHIP), "-o", str(out), *adapter_args]) == 0
    return out


def commit_all(repo_dir: Path, message: str = "edit") -> None:
    repo = git.Repo(repo_dir)
    repo.git.add("--all")
    repo.git.commit("-m", message, "--no-verify")


def copy_repo(built: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    git.Repo.clone_from(str(built), str(target))
    with git.Repo(target).config_writer() as cfg:
        cfg.set_value("user", "name", "t").set_value("user", "email", "t@t")
    return target


def findings(cli, outdir: Path) -> set[tuple[str, str]]:
    result = cli("check", outdir, "--json")
    return {(f["check"], f["file"]) for f in result.json()["findings"]}


def test_submission_layout_and_run_config(built: Path, cli) -> None:
    for rel in ("Dockerfile", "computility-run.yaml", ".gitattributes", "toolkit_payload/apply.sh",
                "toolkit_payload/recipe/bi100-qwen36.yaml", "toolkit_payload/MANIFEST.json",
                "toolkit_payload/src/toolkit/submission/inimage.py",
                "toolkit_payload/patches/chat_templates/qwen36_multi_system.jinja"):
        assert (built / rel).is_file(), rel
    wheels = sorted(p.name for p in (built / "toolkit_payload/wheels").glob("*.whl"))
    assert any(w.startswith("libcst-") and "cp310" in w for w in wheels)
    raw = (built / "computility-run.yaml").read_text()
    assert "  - '262144'" in raw  # numbers are quoted strings, as the platform's examples write them
    config = yaml.safe_load(raw)
    assert set(config) == {"concurrency", "command", "env"}
    assert config["command"][:3] == ["python3", "-m", "vllm.entrypoints.openai.api_server"]
    assert config["command"][config["command"].index("--served-model-name") + 1] == "llm"
    assert {"name": "XFORMERS_SDPA_FALLBACK", "value": "1"} in config["env"]
    dockerfile = (built / "Dockerfile").read_text()
    assert dockerfile.splitlines()[2].startswith("FROM harbor.4pd.io/modelhubxc/enginex-iluvatar/")
    assert 'SHELL ["/bin/bash", "-euo", "pipefail", "-c"]' in dockerfile and "WORKDIR /workspace" in dockerfile
    assert "|| true" not in dockerfile and "--mount" not in dockerfile
    result = cli("verify", built, "--json")
    assert result.code == 0, result.out
    assert result.json()["findings"] == []


def test_same_inputs_give_the_same_tree_and_commit(built: Path, cli, tmp_path: Path) -> None:
    again = tmp_path / "again"
    assert cli("build", FLAGSHIP, "-o", again).code == 0
    a, b = git.Repo(built).head.commit, git.Repo(again).head.commit
    assert a.tree.hexsha == b.tree.hexsha
    assert a.hexsha == b.hexsha


def test_no_half_written_outdir(cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(python: str, platform: str) -> list[Path]:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(submission, "fetch_wheels", boom)
    out = tmp_path / "sub"
    result = cli("build", FLAGSHIP, "-o", out)
    assert result.code == 2 and "No space left on device" in result.err and "left as it was" in result.err
    assert not out.exists()
    assert list(tmp_path.iterdir()) == [], "no temporary folder may be left behind"


def test_crlf_inputs_never_reach_the_submission(cli, tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    for rel in ("native_fastpaths/__init__.py", "native_fastpaths/attention.py", "native_fastpaths/switches.json",
                "native_fastpaths/switches.py",
                "chat_templates/qwen36_multi_system.jinja", "hybrid_kv_accounting.py"):
        (patches / rel).parent.mkdir(parents=True, exist_ok=True)
        (patches / rel).write_bytes((REPO / "patches/src" / rel).read_bytes().replace(b"\n", b"\r\n"))
    recipe = tmp_path / "recipes" / "bi100-qwen36.yaml"
    recipe.parent.mkdir()
    recipe.write_bytes(FLAGSHIP.read_bytes().replace(b"\n", b"\r\n"))
    for layer in (REPO / "layers").iterdir():  # its layers CRLF too, with this folder's patches
        (tmp_path / "layers").mkdir(exist_ok=True)
        (tmp_path / "layers" / layer.name).write_bytes(
            layer.read_bytes().replace(b'patches: "toolkit:"', b"patches: ../patches").replace(b"\n", b"\r\n"))
    out = tmp_path / "sub"
    assert cli("build", recipe, "-o", out).code == 0
    for path in out.rglob("*"):
        if path.is_file() and ".git" not in path.relative_to(out).parts and path.suffix != ".whl":
            assert b"\r" not in path.read_bytes(), path
    assert cli("check", out).code == 0
    old_spelling = cli("verify", out)  # `verify OUTDIR` was the verb before `check`: it still works, and says so
    assert old_spelling.code == 0 and f"is now `toolkit check {out}`" in old_spelling.err


def test_verify_catches_crlf_and_autocrlf_exports(cli, built: Path, tmp_path: Path) -> None:
    repo = copy_repo(built, tmp_path)
    # the prior art's failure: no eol=lf attribute, and an export on a core.autocrlf=true machine
    (repo / ".gitattributes").write_text("*.whl binary\n")
    commit_all(repo)
    got = findings(cli, repo)
    assert ("archive-crlf", "toolkit_payload/apply.sh") in got
    assert ("gitattributes", "toolkit_payload/apply.sh") in got
    # and a CRLF file committed as such
    repo2 = copy_repo(built, tmp_path / "b")
    script = repo2 / "toolkit_payload/apply.sh"
    script.write_bytes(script.read_bytes().replace(b"\n", b"\r\n"))
    subprocess.run(["git", "-c", "core.autocrlf=false", "-c", "core.safecrlf=false", "add", "--renormalize", "."],
                   cwd=repo2, check=True)
    (repo2 / ".gitattributes").write_text("* -text\n")
    commit_all(repo2)
    assert ("line-endings", "toolkit_payload/apply.sh") in findings(cli, repo2)


def test_verify_runs_the_linters(cli, built: Path, tmp_path: Path) -> None:
    repo = copy_repo(built, tmp_path)
    (repo / "toolkit_payload/extra.sh").write_text("#!/usr/bin/env bash\nrm -rf $1/*\n")
    with (repo / "Dockerfile").open("a") as f:
        f.write("RUN cd /tmp && apt-get install -y curl || true\n")
    commit_all(repo)
    got = findings(cli, repo)
    assert ("shellcheck", "toolkit_payload/extra.sh") in got
    assert ("hadolint", "Dockerfile") in got
    assert ("dockerfile", "Dockerfile") in got  # the `|| true`
    assert ("payload", "toolkit_payload/extra.sh") in got  # not in the manifest


def test_verify_checks_run_config_and_payload(cli, built: Path, tmp_path: Path) -> None:
    repo = copy_repo(built, tmp_path)
    config = repo / "computility-run.yaml"
    config.write_text(config.read_text().replace("'262144'", "'100000'"))
    (repo / "toolkit_payload/patches/native_fastpaths/attention.py").unlink()
    commit_all(repo)
    (repo / "stray.txt").write_text("uncommitted\n")
    result = cli("verify", repo, "--json")
    assert result.code == 1
    got = {(f["check"], f["file"]) for f in result.json()["findings"]}
    assert ("run-config", "computility-run.yaml") in got
    assert ("payload", "toolkit_payload/patches/native_fastpaths/attention.py") in got
    assert ("git", ".") in got
    message = next(f["message"] for f in result.json()["findings"] if f["check"] == "run-config")
    assert "100000" in message


def test_variant_build_and_refusal(cli, tmp_path: Path) -> None:
    out = tmp_path / "v"
    assert cli("build", FLAGSHIP, "-o", out, "--variant", "mnbt-8192_mns-2_ecp-true_hka-full-attention").code == 0
    config = yaml.safe_load((out / "computility-run.yaml").read_text())
    command = config["command"]
    assert command[command.index("--max-num-batched-tokens") + 1] == "8192"
    assert {"name": "HYBRID_KV_ACCOUNTING", "value": "full_attention"} in config["env"]
    assert "variant mnbt-8192_mns-2_ecp-true_hka-full-attention" in (out / "Dockerfile").read_text()
    bad = cli("build", FLAGSHIP, "-o", tmp_path / "bad", "--variant", "mnbt-8192_mns-1_ecp-false_hka-legacy40")
    assert bad.code == 2 and "chunked-prefill-batch" in bad.err
    assert not (tmp_path / "bad").exists()


def test_all_variants_with_branches_and_push(cli, tmp_path: Path) -> None:
    remote = tmp_path / "remote.git"
    git.Repo.init(remote, bare=True)
    out = tmp_path / "grid"
    result = cli("build", FLAGSHIP, "-o", out, "--all-variants", "--branches", "--push", remote, "--json")
    assert result.code == 0, result.err
    data = result.json()
    assert len(data["branches"]) == 1 + 13  # main + every variant that lints clean except base
    configs = sorted(p.parent.name for p in (out / "variants").glob("*/computility-run.yaml"))
    # neither chunked prefill off nor every layer's KV beside six images' profile starts (tests/test_lint.py)
    assert len(configs) == 13 and not any("ecp-false" in c or c.endswith("hka-legacy40") for c in configs)
    heads = {ref.name for ref in git.Repo(remote).heads}
    assert heads == {"main", *(f"variant/{c}" for c in configs)}
    branch_tree = git.Repo(remote).commit("variant/mnbt-8192_mns-4_ecp-true_hka-full-attention").tree
    config = yaml.safe_load(branch_tree["computility-run.yaml"].data_stream.read())
    assert config["command"][config["command"].index("--max-num-seqs") + 1] == "4"  # the variant's, not the base's 1
    # a branch is the very commit a build of that variant alone writes (its objects copied, not rebuilt)
    name = "mnbt-8192_mns-4_ecp-true_hka-full-attention"
    alone = cli("build", FLAGSHIP, "--variant", name, "-o", tmp_path / "alone", "--json")
    assert alone.code == 0, alone.err
    assert alone.json()["commit"] == git.Repo(remote).commit(f"variant/{name}").hexsha
    git.Repo(remote).git.fsck("--strict")


def _inimage(built: Path, rootfs: Path, transformers: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(built / "toolkit_payload/src"))
    site = transformers_site(rootfs, transformers)
    return subprocess.run([sys.executable, "-m", "toolkit.submission.inimage",
                           str(built / "toolkit_payload/recipe/bi100-qwen36.yaml"), "--rootfs", str(rootfs),
                           "--package-root", f"transformers={site}"],
                          capture_output=True, text=True, env=env, cwd=built)


def test_in_image_step_prints_ok_lines(bundled: Path, corex_rootfs: Path, transformers_455: Path) -> None:
    proc = _inimage(bundled, corex_rootfs, transformers_455)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ok = [ln for ln in proc.stdout.splitlines() if ln.startswith("[ok] ")]
    recipe = load_recipe(FLAGSHIP)
    expected = expected_results(recipe, {"vllm": 2, "transformers": 1})
    results = [ln for ln in ok if ln.split()[1] in {t.id for t in recipe.recipe.transforms}]
    assert len(results) == expected > len(recipe.recipe.transforms)
    assert "[ok] unhardcode-enforce-eager /usr/local/corex/lib64/python3/dist-packages APPLIED" in proc.stdout
    assert "[ok] package transformers 4.55.3" in proc.stdout
    assert "import check not run" in proc.stdout
    assert proc.stdout.rstrip().splitlines()[-1].startswith("== summary: ok")


def test_in_image_step_fails_loudly_on_drift(bundled: Path, corex_rootfs: Path, transformers_455: Path) -> None:
    for root in roots_of(corex_rootfs):
        path = root / "vllm/engine/arg_utils.py"
        path.write_text(path.read_text().replace("def create_model_config(", "def create_model_config_v2("))
    proc = _inimage(bundled, corex_rootfs, transformers_455)
    assert proc.returncode == 1
    fail = [ln for ln in proc.stdout.splitlines() if ln.startswith("[FAIL] ")]
    assert fail and all(ln.startswith("[FAIL] unhardcode-enforce-eager ") for ln in fail)
    assert "create_model_config_v2" in fail[0] and "bi100-qwen36.yaml:" in fail[0]
    assert "nothing was written" in proc.stdout


def test_in_image_step_runs_on_the_payload_alone(cli, adapter_args: list[str], corex_rootfs: Path,
                                                 transformers_455: Path, tmp_path: Path) -> None:
    """The image has none of this machine's packages: the step must run on the wheels the payload carries."""
    data = flagship_data()
    data["base_image"]["python"] = f"{sys.version_info[0]}.{sys.version_info[1]}"  # wheels this Python can load
    data["patches"] = str(REPO / "patches/src")
    recipe = tmp_path / "bi100-qwen36.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    out = tmp_path / "sub"
    assert cli("build", recipe, "-o", out, *adapter_args).code == 0
    site = tmp_path / "site"
    for wheel in sorted((out / "toolkit_payload/wheels").glob("*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(site)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env["PYTHONPATH"] = f"{site}:{out / 'toolkit_payload/src'}"
    proc = subprocess.run([sys.executable, "-S", "-m", "toolkit.submission.inimage",
                           str(out / "toolkit_payload/recipe" / recipe.name), "--rootfs", str(corex_rootfs),
                           "--package-root", f"transformers={transformers_site(corex_rootfs, transformers_455)}"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1].startswith("== summary: ok")


def test_the_payload_holds_the_packages_a_module_runs_under() -> None:
    from toolkit.submission.build import PACKAGE, in_image_modules

    shipped = {p.relative_to(PACKAGE).as_posix() for p in in_image_modules("toolkit.runtime.env")}
    # importing toolkit.runtime.env runs toolkit/runtime/__init__.py first, though nothing imports it by name
    assert {"__init__.py", "runtime/__init__.py", "runtime/env.py", "pyenv.py"} <= shipped
    assert not {p for p in shipped if p.startswith(("bench/", "cli.py", "image.py", "pinned.py"))}


def _one_commit_repo(folder: Path, files: dict[str, str]) -> git.Repo:
    repo = git.Repo.init(folder, initial_branch="main")
    for name, text in files.items():
        (folder / name).write_text(text)
    repo.git.add("--all")
    repo.index.commit("c", author=submission.AUTHOR, committer=submission.AUTHOR)
    return repo


def test_a_branch_whose_objects_are_incomplete_is_refused_and_no_ref_names_it(tmp_path: Path) -> None:
    from toolkit.errors import ToolkitError

    main = _one_commit_repo(tmp_path / "main", {"a.txt": "same\n"})
    variant = _one_commit_repo(tmp_path / "variant", {"a.txt": "same\n", "b.txt": "only the variant's\n"})
    blob = variant.git.rev_parse("HEAD:b.txt")
    (tmp_path / "variant" / ".git" / "objects" / blob[:2] / blob[2:]).unlink()
    with pytest.raises(ToolkitError) as raised:
        submission.add_branch(tmp_path / "main", tmp_path / "variant", "variant/x")
    assert "branch variant/x: its commit" in str(raised.value)
    assert [h.name for h in main.heads] == ["main"]
    assert not list((tmp_path / "main" / ".git" / "objects").glob("*/tmp_obj_*"))
    whole = _one_commit_repo(tmp_path / "whole", {"a.txt": "same\n", "b.txt": "only the variant's\n"})
    assert submission.add_branch(tmp_path / "main", tmp_path / "whole", "variant/y") == whole.head.commit.hexsha
    main.git.fsck("--strict")
    assert main.commit("variant/y").tree["b.txt"].data_stream.read() == b"only the variant's\n"
