"""The CPU runtime of a patched vendor tree: the vendor's own Python runs here before anything reaches a GPU.

`env` builds the cached CPU-only Python that can import vLLM 0.6.3 from a vendor root (its dependencies, never
vLLM itself: the patched tree is what is imported); `stages` runs inside it with the shims applied from outside
the tree; `preflight` feeds it each variant's exact argv and reports what the vendor's code says.
May import: every stage up to the submission (it renders each variant's argv); bench and the CLI come after it.
"""
