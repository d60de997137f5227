"""One optimizer step: forward → loss → finite check → backward over a group of candidates, then the
update, the per-module gradient norms and the commit into the loop's progress.

A step's group comes from the run's candidate source (``corpus_examples`` for a corpus: the next
``sequences_per_step`` × world size candidates, Kiln: 1; one rollout on-policy). With one process
(``train_examples``) it is trained here; with several (``train_step_distributed``) rank r trains its
contiguous block of the group and the LoRA gradients are summed across ranks before the same update is
applied everywhere.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, Sequence

import torch

from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.corpus import CorpusTables, TrainingExample
from kiln_core.loss import compose_step_loss, echo_env_cross_entropy
from kiln_core.training.optim import set_learning_rate
from kiln_core.training.plan import RunPlan
from kiln_core.training.progress import TOKEN_COUNT_KEYS, Clock, LoopProgress
from kiln_core.training.student import Student, lora_module

__all__ = ["StopTraining", "sequence_loss", "corpus_examples", "train_examples", "train_step_distributed",
           "module_grad_norms", "lora_delta_norms"]


class StopTraining(Exception):
    """An expected end of training that is not success (``nan_loss``, ``cancelled``, a held-out watch
    stop: ``training_error`` with ``stop_reason`` ``diverged``/``stalled``/``flat``)."""

    def __init__(self, reason: str, message: str, *, stop_reason: str | None = None) -> None:
        super().__init__(message)
        self.reason, self.message, self.stop_reason = reason, message, stop_reason


def sequence_loss(student: Student, batch: dict[str, torch.Tensor], loss_fn: Callable, config: OpdConfig,
                  hidden: torch.Tensor | None = None):
    """Loss of one candidate: mean top-K KL over its action targets (+ λ·ECHO env CE when it fires).

    ``hidden`` is the candidate's ``[L, H]`` hidden states when a packed forward already computed them.
    Returns ``(loss, env_ce, token_counts)``; ``env_ce`` is a float only when the ECHO term fired.
    """
    ids = batch["input_ids"]  # [L]
    if hidden is None:
        hidden = student.hidden_states(ids)  # [L, H], post final norm
    rows = batch["action_positions"] - 1  # target q is scored from row q-1
    head = student.logit_head
    kl = loss_fn(hidden.index_select(0, rows), head, batch["teacher_ids"], batch["teacher_logprobs"],
                 target_ids=ids.index_select(0, batch["action_positions"]))
    env_positions = batch["env_positions"]  # [E], the observation tokens with a causal row
    observed = int(batch.get("observation_tokens", env_positions.shape[0]))  # |O|, before the warning filter
    # O': Kiln trims the warning prefix with warning_filter on and env_mask_mode env_only, which are
    # also its defaults when `echo` is null (opd.rs prepares the env mask with MaskConfig::default()).
    echo = config.echo
    trims = echo is None or (echo.warning_filter and echo.env_mask_mode == "env_only")
    keep = env_positions[~batch["env_in_warning_prefix"]] if trims else env_positions
    kept = int(keep.shape[0])
    env_ce, lam = None, 0.0
    if echo is not None and echo.lambda_ != 0.0 and kept > 0:  # Kiln: no env CE rows, no ECHO term
        lam = echo.lambda_
        env_ce = echo_env_cross_entropy(hidden.index_select(0, keep - 1), head, ids.index_select(0, keep), observed)
    loss, fired = compose_step_loss(kl, env_ce, lam, observed)
    # Kiln's TokenCountReceipt::observe_completion (train_receipt.rs): env_tokens is the active env-CE
    # count after the warning filter; context is what is neither action nor active env.
    before = max(observed, kept)
    counts = {
        "action_tokens": int(rows.shape[0]), "env_tokens": kept,
        "env_tokens_before_warning_filter": before, "env_tokens_after_warning_filter": kept,
        "warning_tokens_filtered": before - kept,
        "context_tokens": int(ids.shape[0]) - int(rows.shape[0]) - kept,
    }
    return loss, (float(env_ce.detach()) if fired else None), counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":  # make the phase timings honest on an asynchronous device
        torch.cuda.synchronize(device)


def _forward(student: Student, load: Callable[[], TrainingExample], plan: RunPlan, clock: Clock):
    with clock.phase("data"):
        batch = load().to_torch(student.device)
    with clock.phase("forward"):
        loss, env_ce, counts = sequence_loss(student, batch, plan.loss_fn, plan.settings.config)
        _sync(student.device)
    return loss, env_ce, counts


def _backward(loss: torch.Tensor, scale: int, config: OpdConfig, clock: Clock, device: torch.device) -> None:
    with clock.phase("backward"):
        with torch.autograd.detect_anomaly() if config.detect_anomaly else contextlib.nullcontext():
            (loss / scale).backward()  # gradient of the mean of the group's per-sequence losses
        _sync(device)


def corpus_examples(tables: CorpusTables, plan: RunPlan, step: int) -> list[tuple[int, Callable[[], TrainingExample]]]:
    """Step ``step``'s group of candidates from the corpus tables, as ``(candidate, load)`` pairs."""
    def loader(candidate: int) -> Callable[[], TrainingExample]:
        return lambda: tables.example(plan.schedule.example_of(candidate))

    return [(candidate, loader(candidate)) for candidate in plan.schedule.candidates_of_step(step)]


def train_examples(student: Student, optimizer: torch.optim.Optimizer,
                   examples: Sequence[tuple[int, Callable[[], TrainingExample]]], plan: RunPlan,
                   progress: LoopProgress, clock: Clock) -> float:
    """One optimizer step over ``examples`` — ``(label, load)`` pairs, ``label`` naming the candidate in
    a non-finite-loss message — committed into ``progress``; returns the step loss (their mean).

    Off-policy examples come from the corpus tables, on-policy ones from the rollout store
    (``Rollout.training_example``): the same loss trains both.
    """
    optimizer.zero_grad(set_to_none=True)
    if plan.settings.config.pack_sequences and len(examples) > 1:
        return _train_packed(student, optimizer, examples, plan, progress, clock)
    losses = []
    for label, load in examples:
        loss, env_ce, counts = _forward(student, load, plan, clock)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise StopTraining("nan_loss", f"OPD loss became non-finite at candidate {label}")
        _backward(loss, len(examples), plan.settings.config, clock, student.device)
        losses.append(value)
        progress.record_candidate(counts, env_ce)
    return _apply_update(student, optimizer, plan, progress, losses, clock)


def _train_packed(student: Student, optimizer: torch.optim.Optimizer,
                  examples: Sequence[tuple[int, Callable[[], TrainingExample]]], plan: RunPlan,
                  progress: LoopProgress, clock: Clock) -> float:
    """``train_examples`` with ``config.pack_sequences``: one forward pass over the group packed end to end,
    each candidate's loss from its own rows, one backward of their mean."""
    with clock.phase("data"):
        batches = [load().to_torch(student.device) for _, load in examples]
    with clock.phase("forward"):
        hidden = student.packed_hidden_states([batch["input_ids"] for batch in batches])
        results = [sequence_loss(student, batch, plan.loss_fn, plan.settings.config, hidden=rows)
                   for batch, rows in zip(batches, hidden)]
        _sync(student.device)
    losses = [float(loss.detach()) for loss, _, _ in results]
    for (label, _), value in zip(examples, losses):
        if not math.isfinite(value):
            raise StopTraining("nan_loss", f"OPD loss became non-finite at candidate {label}")
    _backward(torch.stack([loss for loss, _, _ in results]).sum(), len(examples), plan.settings.config, clock, student.device)
    for _, env_ce, counts in results:
        progress.record_candidate(counts, env_ce)
    return _apply_update(student, optimizer, plan, progress, losses, clock)


# One row per candidate a rank trains in a step: present, loss, ECHO fired, ECHO env CE, token counts.
_STAT_COLUMNS = 4 + len(TOKEN_COUNT_KEYS)


def train_step_distributed(student: Student, optimizer: torch.optim.Optimizer,
                           examples: Sequence[tuple[int, Callable[[], TrainingExample]]], plan: RunPlan,
                           progress: LoopProgress, clock: Clock) -> float:
    """One optimizer step of a multi-process run: ``train_examples``' math over the whole group.

    Every rank is given the whole group; rank r trains its contiguous block of ``sequences_per_step``.
    Per-candidate losses, token counts and ECHO values are gathered first, so every rank checks and
    records them in candidate order, exactly as one process would (a non-finite loss stops every rank
    at the same candidate, before any update).

    Under ``strategy: fsdp`` every forward and backward all-gathers the sharded base weights, so every
    rank runs ``sequences_per_step`` of each: a slot without a candidate (the short last group) and a
    non-finite loss still run one, whose LoRA gradients are discarded (``_collective_pass``).
    """
    world = plan.world
    per_rank = plan.settings.config.sequences_per_step
    sharded = world.strategy == "fsdp" and world.size > 1
    optimizer.zero_grad(set_to_none=True)
    rows = torch.zeros(per_rank, _STAT_COLUMNS, dtype=torch.float64)
    block = world.shard(range(len(examples)), per_rank)
    for slot, (_, load) in enumerate(examples[block.start:block.stop]):
        loss, env_ce, counts = _forward(student, load, plan, clock)
        value = float(loss.detach())
        if math.isfinite(value):  # a non-finite loss is reported below, on every rank alike
            _backward(loss, len(examples), plan.settings.config, clock, student.device)
        elif sharded:
            _collective_pass(student, loss, clock)
        rows[slot] = torch.tensor([1.0, value, 0.0 if env_ce is None else 1.0, env_ce or 0.0,
                                   *(counts[key] for key in TOKEN_COUNT_KEYS)], dtype=torch.float64)
    for _ in range(per_rank - len(block) if sharded else 0):  # an idle slot joins the all-gathers all the same
        loss, _, _ = _forward(student, examples[0][1], plan, clock)
        _collective_pass(student, loss, clock)
    with clock.phase("all_reduce"):
        gathered = world.all_gather_rows(rows)  # [W, sequences_per_step, columns], rank-major = candidate order
    losses = []
    for offset, (label, _) in enumerate(examples):
        row = gathered[offset // per_rank, offset % per_rank].tolist()
        if not math.isfinite(row[1]):
            raise StopTraining("nan_loss", f"OPD loss became non-finite at candidate {label}")
        losses.append(row[1])
        progress.record_candidate({key: int(count) for key, count in zip(TOKEN_COUNT_KEYS, row[4:])},
                                  row[3] if row[2] else None)
    with clock.phase("all_reduce"):
        world.all_reduce_gradients_(list(student.lora_parameters.values()))
    return _apply_update(student, optimizer, plan, progress, losses, clock)


def _collective_pass(student: Student, loss: torch.Tensor, clock: Clock) -> None:
    """Backward through ``loss`` for its collectives only (FSDP's all-gathers): the LoRA gradients it would
    add are discarded, so the gradients already accumulated stay bit for bit what they were."""
    params = list(student.lora_parameters.values())
    kept = [param.grad for param in params]
    for param in params:
        param.grad = None
    with clock.phase("backward"):
        loss.backward()
    for param, grad in zip(params, kept):
        param.grad = grad


def module_grad_norms(parameters: dict[str, torch.nn.Parameter]) -> dict[str, float]:
    """Kiln's per-module LoRA gradient norm (``trainer.rs`` ``observe_lora_grad_norms_from_kt_grad_store``):
    each gradient's L2 norm (squares summed in f32, root in f64), then per module the root of the
    summed squared norms over every layer and both LoRA matrices."""
    squares: dict[str, float] = {}
    for name, param in parameters.items():
        if param.grad is None:
            continue
        norm = math.sqrt(float(param.grad.detach().float().square().sum()))
        if math.isfinite(norm):
            module = lora_module(name)
            squares[module] = squares.get(module, 0.0) + norm * norm
    return {module: math.sqrt(total) for module, total in squares.items()}


def _apply_update(student: Student, optimizer: torch.optim.Optimizer, plan: RunPlan, progress: LoopProgress,
                  losses: list[float], clock: Clock) -> float:
    """Optimizer step on the accumulated gradients (at the step's scheduled rate, when the config has a schedule),
    finite check, commit; returns the step loss."""
    with clock.phase("optimizer"):
        norms = module_grad_norms(student.lora_parameters)
        if plan.settings.config.lr_schedule is not None:  # without one the rate stays the optimizer's constant one, as Kiln
            set_learning_rate(optimizer, plan.learning_rate_at(progress.global_step + 1))
        optimizer.step()
        if not math.isfinite(float(torch.nn.utils.get_total_norm(list(student.lora_parameters.values())))):
            raise StopTraining("nan_loss", f"OPD LoRA parameters became non-finite after step {progress.global_step + 1}")
    progress.commit_step(sum(losses) / len(losses), norms)
    return progress.loss_history[-1]


def lora_delta_norms(student: Student, alpha_over_rank: float) -> list[dict[str, Any]]:
    """Kiln's ``lora_delta_norm_summary_from_adapter``: per module, over its layers, the L2 norms of A and
    B and the upper bound ``‖A‖·‖B‖·alpha/rank`` of ``‖ΔW‖`` (mean and max)."""
    pairs: dict[tuple[str, str], dict[str, float]] = {}
    for name, param in student.lora_parameters.items():
        layer_key = name.split(".lora_")[0]
        matrix = "a" if ".lora_A." in name else "b"
        norm = math.sqrt(float(param.detach().float().square().sum()))
        pairs.setdefault((lora_module(name), layer_key), {})[matrix] = norm
    by_module: dict[str, list[tuple[float, float]]] = {}
    for (module, _), pair in sorted(pairs.items()):
        if "a" in pair and "b" in pair:
            by_module.setdefault(module, []).append((pair["a"], pair["b"]))
    rows = []
    for module, values in sorted(by_module.items()):
        a, b = [v[0] for v in values], [v[1] for v in values]
        delta = [x * y * alpha_over_rank for x, y in values]
        rows.append({"module": module, "pair_count": len(values), "a_l2_mean": sum(a) / len(a), "a_l2_max": max(a),
                     "b_l2_mean": sum(b) / len(b), "b_l2_max": max(b), "delta_l2_upper_bound_mean": sum(delta) / len(delta),
                     "delta_l2_upper_bound_max": max(delta)})
    return rows
