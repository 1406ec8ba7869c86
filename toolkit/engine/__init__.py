"""The engine: planning every transform over every root in memory (plan), the one per-file evaluation that apply,
diff, --dry-run and verify share (evaluate), the all-or-nothing writer (writer), the per-root state file and the
lock (state), the text codec (codec), and verify, the engine's check mode (verify).

It may import the recipe, the transform kinds, results and sources; nothing here imports a later stage
(submission, runtime, bench, cli)."""
