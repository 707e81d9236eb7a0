"""Gradient reducers: what a strategy still has to sum or average of the gradients after backward, beyond
data parallelism's own sync. Each strategy builds its reducers where it is applied; the plan runs them in
order once per step, so a new strategy adds one to the list instead of a field and a line to the step."""

from __future__ import annotations

from typing import Protocol


class GradientReducer(Protocol):
    def reduce_gradients(self) -> None: ...
