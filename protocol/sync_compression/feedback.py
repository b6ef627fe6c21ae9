"""Error feedback: what a replica meant to send and did not, carried into its next contribution.

A lossy contribution drops something every step. Error feedback keeps it: the replica sends the
compression of ``x + e`` (its gradient ``x`` plus the **residual** ``e``) and keeps ``e' = x + e - sent``,
where ``sent`` is its own contribution as the collective decodes it. Summed over steps,
``sent_1 + ... + sent_t + e_t = x_1 + ... + x_t`` exactly in real arithmetic (float32 rounds each
addition once), so no gradient mass is lost, only delayed.

A step's residual is **staged** when its round runs and **committed** only when the replica applies that
step (:meth:`ErrorFeedback.commit`). So:

* a round that fails, or a step that reopens, is averaged again at the next revision from the same
  committed residual: a redone step never counts its feedback twice;
* a step applied with no update (a lost step) commits nothing: the residual stays as it was;
* a replica that takes another state (a resync, a join, a checkpoint restore) starts from zero
  (:meth:`ErrorFeedback.reset`): the residual is this replica's own debt to the average, not state of the
  stage, so it is not in the parameter hash, a checkpoint or a state download.

Replicas keep different residuals; what they apply stays identical, because every replica applies the
collective's result, never its own residual.
"""

from __future__ import annotations

import torch


class ErrorFeedback:
    """One replica's residual over a flat vector, with the step's staged successor."""

    def __init__(self) -> None:
        self._residual: torch.Tensor | None = None  # (numel,) float32; None = zero
        self._staged: tuple[int, torch.Tensor | None] | None = None

    @property
    def residual(self) -> torch.Tensor | None:
        """The committed residual (None while it is zero)."""
        return self._residual

    def corrected(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` plus the committed residual: what to compress this step (a new tensor)."""
        if self._residual is None:
            return x.clone()
        if self._residual.shape != x.shape:
            raise ValueError(f"error feedback holds {list(self._residual.shape)} values, the contribution has {list(x.shape)}")
        return x + self._residual

    def stage(self, step: int, residual: torch.Tensor | None) -> None:
        """The residual to keep if ``step`` is applied (None: keep the committed one: this replica sent
        nothing this time). A later stage of the same step (another revision) replaces it."""
        self._staged = (step, residual)

    def commit(self, step: int) -> bool:
        """``step`` was applied: its staged residual becomes the residual. False if none was staged for it."""
        staged, self._staged = self._staged, None
        if staged is None or staged[0] != step:
            return False
        if staged[1] is not None:
            self._residual = staged[1]
        return True

    def reset(self) -> None:
        """This replica takes another state: forget the residual and whatever was staged."""
        self._residual = None
        self._staged = None
