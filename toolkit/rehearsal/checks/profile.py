"""profile: the served server runs with its probes on; its `toolkit profile` table must hold decode and prefill
steps, and names the declared probe regions the served path never reached."""

from __future__ import annotations

from pathlib import Path

from toolkit.bench import experiment
from toolkit.recipe import Recipe
from toolkit.rehearsal.checks.base import RehearsalCheck
from toolkit.rehearsal.checks.short import short_request
from toolkit.rehearsal.model import Check
from toolkit.rehearsal.servers import Live
from toolkit.transforms.probe import Probe

# the served server's probes on (no TOOLKIT_PROFILE_SYNC: a CPU computes as it is asked)
PROFILE_ENV = {k: v for k, v in experiment.PROFILE_ENV.items() if k != "TOOLKIT_PROFILE_SYNC"}


def declared(recipe: Recipe) -> list[str]:
    return [t.region for t in recipe.transforms if isinstance(t, Probe)]


def profile_check(recipe: Recipe, folder: Path) -> Check:
    """The `toolkit profile` table of the served server's requests (written beside its records): every declared
    probe region it reached, per bucket, and the declared ones it did not reach."""
    from toolkit.bench.profile import load, tables, text_table

    regions = declared(recipe)
    if not sorted(folder.glob("profile-*.jsonl")):
        return Check("profile", False, f"the served server ran with TOOLKIT_PROFILE=1 and wrote no record in {folder}"
                     f": its code carries none of the {len(regions)} declared probes")
    buckets = tables(load([folder]))
    (folder / "profile.txt").write_text(text_table(buckets), encoding="utf-8")
    reached = {bucket: {row["region"] for row in rows} for bucket, rows in buckets.items()}
    problems = [f"no {b} step was profiled" for b in ("decode", "prefill") if not reached.get(b)]
    seen = set().union(*reached.values()) if reached else set()
    unreached = [r for r in regions if r not in seen]
    shown = ", ".join(f"{b}: {len(reached[b] & set(regions))} of {len(regions)} declared regions"
                      for b in reached)
    said = f"not reached: {', '.join(unreached)}" if unreached else "every declared region reached"
    return Check("profile", not problems, "; ".join([*problems, said]) if problems else
                 f"{shown}; {said}; the table: {folder / 'profile.txt'}")


class Profile(RehearsalCheck):
    name = "profile"
    summary = "the TOOLKIT_PROFILE table of the served path"
    servers = ("served",)

    @property
    def folder(self) -> Path:
        return self.run.stage.rundir / "profile"

    def not_applicable(self) -> str | None:
        return None if declared(self.run.stage.recipe) else "the recipe declares no probe"

    def env(self, server: str) -> dict[str, tuple[str, str]]:
        if server != "served":
            return {}
        return {key: (value, "the profile check's probes on")
                for key, value in {**PROFILE_ENV, "TOOLKIT_PROFILE_DIR": str(self.folder)}.items()}

    def on(self, server: str, live: Live) -> None:
        short_request(self.run, live)  # the table needs a prefill and decode steps to hold

    def verdict(self) -> Check:
        return profile_check(self.run.stage.recipe, self.folder)
