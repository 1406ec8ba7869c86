"""The verbs as functions: each takes a typed request (a frozen dataclass) and returns its Report, whose exit_code
is what the command line exits with. The CLI only turns arguments into requests and prints reports; `toolkit.api`
re-exports these for scripts.

The package owns the verbs' pipelines (what runs in which order: lint, trial, preflight, write, check); it may
import every stage; only the CLI and the API import it.
"""
