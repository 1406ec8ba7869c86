"""Measuring a served model the way the platform's evaluator does.

Owns: the streaming client and its per-request records (`client`, `sse`), the workloads (`workloads`), the run
metrics, official score and targets (`metrics`), what a run writes (`output`), the server lifecycle and leftover
checks (`serve`), the cached CPU test server (`cpu_server`), the experiment runner (`experiment`) and the
rehearsal's server command (`rehearse`: a run config's argv on the CPU runtime, its substitutions recorded).
May import: every earlier stage (recipe, variants, lint, the submission's render, results). Nothing but the
CLI imports this package.
"""
