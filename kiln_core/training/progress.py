"""The loop's own state between steps (``LoopProgress``) and its phase clock (``Clock``).

``LoopProgress.loop_state()`` is exactly what a checkpoint stores as ``opd_loop_state.json``;
``restore`` is what a resume takes back.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from kiln_core.contracts.checkpoint import DataStats, LoraGradNorms, OpdLoopState, TokenCounts
from kiln_core.training.plan import Schedule

__all__ = ["TOKEN_COUNT_KEYS", "LoopProgress", "Clock"]

TOKEN_COUNT_KEYS = tuple(TokenCounts.model_fields)


@dataclass
class LoopProgress:
    """The loop's typed state; ``loop_state()`` is exactly what a checkpoint stores."""

    global_step: int = 0
    loss_history: list[float] = field(default_factory=list)
    token_counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TOKEN_COUNT_KEYS, 0))
    grad_norms: LoraGradNorms = field(default_factory=LoraGradNorms)
    last_env_ce: float | None = None
    consumed: int | None = None
    """Candidates consumed, counted on its own when steps do not determine it (on-policy: an empty
    rollout or a skipped prompt consumes a candidate without a step); None derives it from the step."""

    def position(self, schedule: Schedule) -> tuple[int, int]:
        """(epoch_index, cursor_in_epoch) of the next candidate."""
        if self.consumed is None:
            return schedule.cursor_after(self.global_step)
        return divmod(self.consumed, schedule.candidates_per_epoch)

    def loop_state(self, schedule: Schedule, examples_read: int, examples_filtered: int = 0) -> OpdLoopState:
        epoch, cursor = self.position(schedule)
        return OpdLoopState(
            global_step=self.global_step, epoch_index=epoch, cursor_in_epoch=cursor, loss_history=list(self.loss_history),
            last_loss=self.loss_history[-1] if self.loss_history else None,
            data_stats=DataStats(examples_read=examples_read, examples_filtered=examples_filtered,
                                 examples_trained=self.global_step),
            token_counts=TokenCounts(**self.token_counts), run_env_ce=self.last_env_ce, lora_grad_norms=self.grad_norms)

    def record_candidate(self, counts: dict[str, int], env_ce: float | None) -> None:
        self.token_counts = {key: self.token_counts[key] + counts[key] for key in TOKEN_COUNT_KEYS}
        if env_ce is not None:  # the ECHO term fired for this candidate
            self.last_env_ce = env_ce

    def commit_step(self, loss: float, module_norms: dict[str, float]) -> None:
        self.global_step += 1
        self.loss_history.append(loss)
        self.grad_norms = self.grad_norms.observe(module_norms)

    def restore(self, state: OpdLoopState, candidates_per_epoch: int) -> None:
        """Take over the progress a checkpoint recorded (in place); the candidate cursor is restored as
        its own counter when this progress keeps one (on-policy)."""
        self.global_step = state.global_step
        self.loss_history = list(state.loss_history)
        self.token_counts = state.token_counts.model_dump()
        self.grad_norms = state.lora_grad_norms
        self.last_env_ce = state.run_env_ce
        if self.consumed is not None:
            self.consumed = state.epoch_index * candidates_per_epoch + state.cursor_in_epoch


class Clock:
    """Accumulates wall time per phase (data, forward, backward, optimizer, checkpoint, ...)."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.totals_ms: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.totals_ms[name] = self.totals_ms.get(name, 0.0) + (time.perf_counter() - t0) * 1e3
