"""What the running verb has done that an interrupt cannot undo, so that the interrupt's message tells the truth."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class Progress:
    untouched: str = "nothing was written"
    done: list[str] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        return "; ".join(self.done) if self.done else self.untouched

    def reset(self) -> None:
        self.untouched, self.done = Progress().untouched, []


PROGRESS = Progress()
