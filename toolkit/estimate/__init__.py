"""What the platform will measure, predicted before a platform cycle (`toolkit estimate`): what the served path runs at
the target's shapes, counted through the patched tree in the CPU runtime (`count`, with toolkit.runtime.census),
each operation priced on the recipe's accelerator (`device`) with constants fitted on the target's measurements
(`calibrate`), and the platform's workload run through vLLM 0.6.3's scheduler step by step (`schedule`, `predict`).

It may import the recipe, the runtime (the census and the wide model) and the bench's metrics (a simulated request is
a `RequestRecord`, summarised as `toolkit bench` summarises a run); the patched tree and the stand-ins' environment
are the caller's (toolkit.commands.estimate).
"""
