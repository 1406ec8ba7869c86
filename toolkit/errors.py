"""Typed errors. Each carries the exit code the CLI returns for it."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # a transform DRIFTED, or verify found a problem
EXIT_USAGE = 2  # bad recipe, bad arguments, missing files
EXIT_CANNOT_START = 2  # preflight: the vendor's own code refuses a variant
EXIT_INPUT_DRIFT = 3  # the vendor tree is not what the lock or the other roots say
EXIT_SUPERSEDED = 4  # --strict only: a patch is no longer needed


class ToolkitError(Exception):
    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message if not self.hint else f"{self.message}\n  fix: {self.hint}"


class RecipeError(ToolkitError):
    """A recipe that cannot be loaded; the message names file:line:col."""

    def __init__(
        self,
        file: str,
        line: int | None,
        column: int | None,
        message: str,
        *,
        key: str | None = None,
        hint: str | None = None,
    ) -> None:
        where = file if line is None else f"{file}:{line}:{column or 1}"
        prefix = f"{where}: " + (f"{key}: " if key else "")
        super().__init__(prefix + message, hint=hint)
        self.file = file
        self.line = line
        self.column = column
        self.key = key


class InputError(ToolkitError):
    """A vendor tree or reference release that cannot be found or fetched."""


class WriteError(ToolkitError):
    """A write failed half-way; everything written before it was rolled back."""

    exit_code = EXIT_FAILED


class InputDriftError(ToolkitError):
    """The pristine inputs are not what was locked, or the roots disagree."""

    exit_code = EXIT_INPUT_DRIFT
