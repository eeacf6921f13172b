"""An on/off switch of a kernel path, for A/B runs and the tests that compare both paths."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Switch:
    """True while on. `set(enabled)` switches it inside a `with` block and back after it (graphs
    captured inside keep the choice)."""

    def __init__(self, on: bool = True):
        self.on = on

    def __bool__(self) -> bool:
        return self.on

    @contextlib.contextmanager
    def set(self, enabled: bool) -> Iterator[None]:
        previous, self.on = self.on, enabled
        try:
            yield
        finally:
            self.on = previous
