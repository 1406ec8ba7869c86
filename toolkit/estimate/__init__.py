"""What the platform will measure, predicted before a platform cycle (issue 48, in progress): the scheduler's steps
simulated as vLLM 0.6.3 runs them (`schedule`) and each operation priced on the recipe's accelerator (`device`).
The operation count through the patched tree at the target's shapes, the fit on the target's measurements and the
`toolkit estimate` verb are not built yet.

It may import the recipe and the bench's metrics (a simulated request is a `RequestRecord`, summarised as `toolkit
bench` summarises a run); nothing that starts a server or builds a tree.
"""
