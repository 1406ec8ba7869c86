"""`toolkit build -o DIR`: it never deletes or overwrites what it cannot prove it wrote, and says what it did."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import git
import pytest
from conftest import FLAGSHIP, REPO, tree_digest

from toolkit import cli as cli_mod
from toolkit.commands import build as build_verb
from toolkit.recipe import load_recipe
from toolkit.submission.build import check_outdir, protected_problem, replaceable_problem


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A submission as `toolkit build` leaves it."""
    out = tmp_path_factory.mktemp("previous") / "submission"
    assert cli_mod.main(["build", str(FLAGSHIP), "-o", str(out)]) == 0
    return out


def copy_of(previous: Path, tmp_path: Path) -> Path:
    target = tmp_path / "out"
    shutil.copytree(previous, target, symlinks=True)
    return target


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith("."))


def test_force_on_a_folder_of_other_files_deletes_nothing(cli, tmp_path: Path) -> None:
    # what `-o /tmp --force` did: every file in the folder was deleted
    shared = tmp_path / "shared-tmp"
    (shared / "other-program").mkdir(parents=True)
    (shared / "other-program" / "state.db").write_text("precious")
    (shared / "notes.txt").write_text("precious")
    before = tree_digest(shared)
    result = cli("build", FLAGSHIP, "-o", shared, "--force")
    assert result.code == 2
    assert tree_digest(shared) == before
    assert "not a submission written by toolkit" in result.err and "nothing was touched" in result.err
    assert leftovers(tmp_path) == []


def test_force_on_the_current_folder_holding_a_checkout_deletes_nothing(cli, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # what `-o . --force` did from a checkout: the checkout, recipe included, was deleted
    checkout = tmp_path / "checkout"
    (checkout / "recipes").mkdir(parents=True)
    shutil.copy2(FLAGSHIP, checkout / "recipes" / FLAGSHIP.name)
    shutil.copytree(REPO / "layers", checkout / "layers")
    shutil.copytree(REPO / "patches", checkout / "patches")
    git.Repo.init(checkout)
    before = tree_digest(checkout)
    monkeypatch.chdir(checkout)
    result = cli("build", "recipes/" + FLAGSHIP.name, "-o", ".", "--force")
    assert result.code == 2, result.err
    assert "contains the current folder" in result.err and "nothing was touched" in result.err
    assert tree_digest(checkout) == before
    result = cli("build", "recipes/" + FLAGSHIP.name, "-o", "..", "--force")
    assert result.code == 2 and tree_digest(checkout) == before


@pytest.mark.parametrize("where", ["root", "home", "recipe", "layer", "patches", "checkout"])
def test_protected_folders_are_refused_whatever_the_flags(where: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # checked on the guard itself: a broken guard must not get the chance to touch / or $HOME
    monkeypatch.chdir(tmp_path)
    loaded = load_recipe(FLAGSHIP)
    folder = {"root": Path("/"), "home": Path.home(), "recipe": FLAGSHIP.parent, "patches": loaded.patches_dir,
              "layer": Path(loaded.layers[0]).parent, "checkout": REPO}[where]
    assert protected_problem(folder, loaded)
    for force in (False, True):
        with pytest.raises(cli_mod.ToolkitError, match="nothing was touched"):
            check_outdir(folder, loaded, force)


def test_a_previous_submission_is_replaced_atomically(cli, previous: Path, tmp_path: Path) -> None:
    out = copy_of(previous, tmp_path)
    old_commit = git.Repo(out).head.commit.hexsha
    assert replaceable_problem(out) is None
    result = cli("build", FLAGSHIP, "-o", out, "--force", "--json")
    assert result.code == 0, result.err
    notes = result.json()["notes"]
    assert any(f"replaced the previous submission in {out} (commit {old_commit[:12]}" in n for n in notes), notes
    assert (out / "Dockerfile").is_file() and replaceable_problem(out) is None
    assert leftovers(tmp_path) == [], "the old tree and the temporary one are both gone"


def test_without_force_an_existing_submission_is_kept(cli, previous: Path, tmp_path: Path) -> None:
    out = copy_of(previous, tmp_path)
    before = tree_digest(out)
    result = cli("build", FLAGSHIP, "-o", out)
    assert result.code == 2 and "--force" in result.err and "nothing was touched" in result.err
    assert tree_digest(out) == before


@pytest.mark.parametrize("change", ["untracked", "ignored", "modified", "user-commit"])
def test_a_changed_submission_is_not_replaced(cli, previous: Path, tmp_path: Path, change: str) -> None:
    out = copy_of(previous, tmp_path)
    repo = git.Repo(out)
    if change == "untracked":
        (out / "my-notes.md").write_text("results of last night's run")
    elif change == "ignored":
        (out / ".git" / "info").mkdir(exist_ok=True)
        (out / ".git" / "info" / "exclude").write_text("*.log\n")
        (out / "server.log").write_text("the only copy of a log")
    elif change == "modified":
        (out / "computility-run.yaml").write_text((out / "computility-run.yaml").read_text() + "# tuned by hand\n")
    else:
        (out / "README.md").write_text("mine")
        repo.git.add("README.md")
        repo.git.commit("-m", "my change", "--no-verify", author="Someone <someone@example.com>",
                        env={"GIT_COMMITTER_NAME": "Someone", "GIT_COMMITTER_EMAIL": "someone@example.com"})
    before = tree_digest(out)
    result = cli("build", FLAGSHIP, "-o", out, "--force")
    assert result.code == 2, result.out
    assert tree_digest(out) == before
    expected = {"untracked": "my-notes.md", "ignored": "server.log", "modified": "computility-run.yaml",
                "user-commit": "someone@example.com"}[change]
    assert expected in result.err and "nothing was touched" in result.err
    assert leftovers(tmp_path) == []


def test_an_empty_folder_is_filled_without_force(cli, tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    assert cli("build", FLAGSHIP, "-o", out).code == 0
    assert (out / "Dockerfile").is_file()


def test_an_interrupt_while_writing_leaves_outdir_as_it_was(cli, previous: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    out = copy_of(previous, tmp_path)
    before = tree_digest(out)

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr("toolkit.submission.build.fetch_wheels", interrupted)
    result = cli("build", FLAGSHIP, "-o", out, "--force")
    assert result.code == 130
    assert "Traceback" not in result.err
    assert f"{out} was left as it was (the previous submission" in result.err
    assert tree_digest(out) == before and leftovers(tmp_path) == []


def test_an_interrupt_after_writing_says_the_submission_is_complete(cli, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "fresh"

    def interrupted(*args: object, **kwargs: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(build_verb, "verify_submission", interrupted)  # the slow linters run after the swap
    result = cli("build", FLAGSHIP, "-o", out)
    assert result.code == 130
    assert "nothing half-written" not in result.err
    assert f"{out} holds the complete new submission (commit" in result.err
    assert replaceable_problem(out) is None


def test_a_closed_pipe_ends_quietly(corex_rootfs: Path, flagship_args: list[str]) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "toolkit.cli", "diff", str(FLAGSHIP), "--rootfs", str(corex_rootfs),
                             *flagship_args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=REPO)
    assert proc.stdout is not None and proc.stderr is not None
    assert proc.stdout.readline().startswith(b"# transform")
    proc.stdout.close()  # what `| head -1` does
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
    assert os.environ.get("PYTHONWARNINGS", "") != "error"  # a warning about the pipe would have shown above


def test_an_interrupt_while_starting_ends_quietly(tmp_path: Path) -> None:
    # the interrupt lands while the CLI's heavy imports run, before any verb has started
    code = ("import builtins, sys\n"
            "import toolkit.entry as entry\n"
            "real = builtins.__import__\n"
            "def slow(name, *args, **kwargs):\n"
            "    if name == 'toolkit.cli':\n"
            "        raise KeyboardInterrupt\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = slow\n"
            "sys.exit(entry.main())\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 130
    assert "Traceback" not in proc.stderr and "interrupted while starting" in proc.stderr
