"""The `toolkit` console script: the CLI's imports (libcst, pydantic, GitPython) take a moment, and an interrupt
during them must end as quietly as one during a verb."""

from __future__ import annotations

import sys


def main() -> int:
    try:
        from toolkit.cli import main as cli_main
    except KeyboardInterrupt:
        print("toolkit: interrupted while starting; nothing was read or written", file=sys.stderr)
        return 130
    return cli_main()
