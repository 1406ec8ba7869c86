"""The toolkit as a library: every verb of the `toolkit` command as a function taking a typed request and returning
its Report (`report.ok`, `report.exit_code`, `report.as_json()` as `--json` prints it). Errors are raised as
`ToolkitError` (`.message`, `.hint`, `.exit_code`).

    from pathlib import Path
    from toolkit import api

    report = api.build(api.BuildRequest(Path("recipes/bi100-qwen36.yaml"), Path("/tmp/submission")))
    assert report.ok, report.as_json()
    assert api.check(Path("/tmp/submission")).ok

Progress and the vendor's own messages go to stderr, as on the command line.
"""

from __future__ import annotations

from toolkit import __version__
from toolkit.commands.bench import BenchRequest, ExperimentRequest, Load, bench, bench_compare, experiment
from toolkit.commands.build import BuildRequest, build, check
from toolkit.commands.common import Inputs
from toolkit.commands.estimate import EstimateRequest, estimate
from toolkit.commands.lint import LintRequest, lint, variants
from toolkit.commands.preflight import PreflightRequest, preflight
from toolkit.commands.profile import ProfileRequest, profile
from toolkit.commands.profile import compare as profile_compare
from toolkit.commands.rehearse import RehearseRequest, rehearse
from toolkit.commands.schema import schema_text
from toolkit.commands.show import ShowRequest, show
from toolkit.commands.tree import ApplyRequest, DiffRequest, VerifyRequest, apply, diff, verify
from toolkit.commands.upgrade import UpgradeRequest, upgrade
from toolkit.commands.vendor import CompareRequest, compare, pull
from toolkit.errors import ToolkitError
from toolkit.results import Report

vendor_pull, vendor_compare = pull, compare

__all__ = [
    "ApplyRequest", "BenchRequest", "BuildRequest", "CompareRequest", "DiffRequest", "EstimateRequest",
    "ExperimentRequest", "Inputs",
    "LintRequest", "Load", "PreflightRequest", "ProfileRequest", "RehearseRequest", "Report", "ShowRequest",
    "ToolkitError", "UpgradeRequest", "VerifyRequest",
    "__version__", "apply", "bench", "bench_compare", "build", "check", "diff", "estimate", "experiment", "lint",
    "preflight",
    "profile", "profile_compare", "rehearse", "schema_text", "show", "upgrade", "variants", "vendor_compare",
    "vendor_pull",
    "verify",
]
