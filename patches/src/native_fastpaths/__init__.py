"""Pure-PyTorch fast paths injected into the vendor vLLM and the model adapter, and prefix_state (the GatedDeltaNet
state across prefix-cache hits: a correctness fix, deployed and switched the same way).

Every module here imports torch lazily inside functions or at module level only; nothing
is imported at image build time, so a builder without a GPU never loads GPU code.
Each path is switched by an environment variable read at call time (see switches.py).
"""
