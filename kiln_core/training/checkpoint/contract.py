"""What a run binds into its checkpoints: the records it writes and the ones a resume must match.

``RunContract`` is Kiln's ``OpdCheckpointDescriptor`` (``opd.rs``) plus our extension. The same
object builds the manifest records when a checkpoint is written and recomputes them when a run asks
to resume, so "equal to what this run would write" is one comparison per record, in Kiln's order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from kiln_core.contracts.checkpoint import (
    ADAPTER_FILE,
    LOOP_STATE_FILE,
    LOOP_STATE_TYPE,
    LORA_INIT_ALGORITHM,
    OPTIMIZER_FILE,
    ROLLOUT_ALGORITHM,
    DataBinding,
    OpdLoopState,
    OptimizerRecord,
    Precision,
    Progress,
    RngStream,
    SchedulerRecord,
    StateFiles,
)
from kiln_core.contracts.lora_targets import LoraTargets

__all__ = ["RunContract"]


@dataclass(frozen=True)
class RunContract:
    """Everything a checkpoint of this run records about the run (not about its progress).

    Attributes:
        adapter_name: Output adapter name.
        effective_config: ``ResolvedSettings.kiln_effective_config``.
        precision_policy: ``run_identity.precision_policy``.
        data: Source kind, prompt-list digest, candidates per epoch.
        init_seed: The effective seed (``lora-init`` stream).
        optimizer_kind: ``sgd``, ``adam_w`` or ``muon``.
        optimizer_json: ``kiln_core.contracts.settings.kiln_optimizer_json``.
        learning_rate: The resolved, constant learning rate.
        epochs: Configured epochs.
        auxiliary_state: ``run_identity.auxiliary_state``.
        examples_read: Prompts in the request; ``examples_filtered`` of them had no action token.
        on_policy: Adds Kiln's ``rollout-sampling`` stream (on-policy training comes next).
        world_size, backend, sequences_per_step, optimizer_steps_total, loss, lr_schedule, pack_sequences,
            lora_targets: our extension (``KilnFlowsState``), compared after Kiln's records.
    """

    adapter_name: str
    effective_config: dict[str, Any]
    precision_policy: dict[str, Any]
    data: DataBinding
    init_seed: int
    optimizer_kind: str
    optimizer_json: dict[str, Any]
    learning_rate: float
    epochs: int
    auxiliary_state: dict[str, Any]
    examples_read: int
    examples_filtered: int = 0
    on_policy: bool = False
    world_size: int = 1
    backend: str | None = None
    sequences_per_step: int = 1
    optimizer_steps_total: int = 1
    loss: str = "teacher_top_k"
    lr_schedule: dict[str, Any] | None = None
    pack_sequences: bool | None = None
    lora_targets: LoraTargets | None = None
    """None for Kiln's seven projections."""

    @property
    def candidates_per_epoch(self) -> int:
        return self.data.item_count

    @property
    def total_candidates(self) -> int:
        return self.candidates_per_epoch * self.epochs

    @property
    def stateful_optimizer(self) -> bool:
        return self.optimizer_kind != "sgd"

    def precision(self) -> Precision:
        return Precision.model_validate(self.precision_policy)

    def optimizer_record(self, step: int) -> OptimizerRecord:
        return OptimizerRecord(kind=self.optimizer_kind, step=step,
                               hyperparameters={"learning_rate": self.learning_rate, "optimizer": self.optimizer_json},
                               state_file=OPTIMIZER_FILE if self.stateful_optimizer else None)

    def scheduler_record(self, step: int) -> SchedulerRecord:
        return SchedulerRecord(kind="constant", step=step, state={"learning_rate": self.learning_rate})

    def data_order(self) -> list[int]:
        return list(range(self.candidates_per_epoch))

    def state_files(self) -> StateFiles:
        return StateFiles(adapter_parameters=ADAPTER_FILE, loss_history=LOOP_STATE_FILE,
                          optimizer_state=OPTIMIZER_FILE if self.stateful_optimizer else None)

    def progress(self, loop: OpdLoopState) -> Progress:
        return Progress(global_step=loop.global_step, total_steps=self.total_candidates, epoch_index=loop.epoch_index,
                        cursor_in_epoch=loop.cursor_in_epoch, data_order=self.data_order())

    def rng_states(self, loop: OpdLoopState) -> dict[str, RngStream]:
        """Kiln's OPD streams: ``lora-init`` always; ``rollout-sampling`` on-policy (position = consumed
        candidates). Our precision policy never rounds stochastically, so no ``optimizer-rounding``."""
        streams = {"lora-init": RngStream(algorithm=LORA_INIT_ALGORITHM, seed=self.init_seed, position=0)}
        if self.on_policy:
            consumed = loop.epoch_index * self.candidates_per_epoch + loop.cursor_in_epoch
            streams["rollout-sampling"] = RngStream(algorithm=ROLLOUT_ALGORITHM, seed=self.init_seed, position=consumed)
        return streams

    def loop_state_problem(self, progress: Progress, loop: OpdLoopState) -> str | None:
        """Kiln's ``OpdCheckpointLoopState::validate`` (``opd.rs``): the first broken rule's message."""
        per_epoch, epochs = self.candidates_per_epoch, self.epochs
        if loop.schema_version != 1 or loop.state_type != LOOP_STATE_TYPE:
            return "unsupported OPD checkpoint loop-state contract"
        if per_epoch <= 0 or epochs <= 0:
            return "OPD checkpoint has an empty training schedule"
        if (loop.global_step, loop.epoch_index, loop.cursor_in_epoch) != (
                progress.global_step, progress.epoch_index, progress.cursor_in_epoch):
            return "OPD checkpoint loop state disagrees with manifest progress"
        if progress.total_steps != per_epoch * epochs or len(progress.data_order) != per_epoch:
            return "OPD checkpoint manifest schedule differs from its loop state"
        if loop.epoch_index >= epochs:
            return f"OPD checkpoint next epoch {loop.epoch_index} exceeds configured epochs {epochs}"
        if loop.cursor_in_epoch >= per_epoch:
            return "OPD checkpoint candidate cursor exceeds one epoch"
        if loop.global_step > loop.epoch_index * per_epoch + loop.cursor_in_epoch:
            return "OPD checkpoint has more optimizer steps than consumed candidates"
        if len(loop.loss_history) != loop.global_step:
            return f"OPD checkpoint loss-history length {len(loop.loss_history)} does not match global step {loop.global_step}"
        if not all(math.isfinite(loss) for loss in loop.loss_history):
            return "OPD checkpoint loss history contains a non-finite value"
        last = loop.loss_history[-1] if loop.loss_history else None
        if last != loop.last_loss:
            return "OPD checkpoint last_loss does not match loss history"
        stats = loop.data_stats
        if stats.examples_filtered > stats.examples_read or stats.examples_trained != loop.global_step:
            return "OPD checkpoint data counters are inconsistent"
        if loop.run_env_ce is not None and not math.isfinite(loop.run_env_ce):
            return "OPD checkpoint contains a non-finite ECHO measurement"
        guard = loop.guardrail
        if not all(math.isfinite(v) for v in [*guard.overlap_history, *guard.entropy_gap_history,
                                               guard.last_diversity, guard.last_self_play_kl]):
            return "OPD checkpoint contains non-finite guardrail state"
        return None
