"""CPU references for the vendor image's GPU libraries and the adapter's prebuilt kernels (kind kernels):
plain-torch functions with the vendor's signatures and in-place semantics, in one registry keyed by the dotted name
the vendor tree calls (one module per library, as the transform kinds are; the kernels' two by the operations they
serve). The stand-ins (`toolkit_standins`) run a reference when the tree calls a function that has one, and record
it; a function with no reference still raises StandInCalled, naming library, function and caller: a wrong value is
never silent.

Loaded only when the tree first calls a stood-in function (torch is imported then); copied beside the stand-ins
as `toolkit_references` for the CPU runtime, so its imports are relative.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import corex_gdn, corex_moe, ixformer, xformers

REFERENCES: dict[str, Callable[..., Any]] = {**ixformer.FUNCTIONS, **xformers.FUNCTIONS, **corex_gdn.FUNCTIONS,
                                             **corex_moe.FUNCTIONS}


def reference(name: str) -> Callable[..., Any] | None:
    return REFERENCES.get(name)
