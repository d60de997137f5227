"""Planning a training run: everything decided, and every refusal made, before the model loads.

Both planners start from the engine's ``TrainPlan`` (``kiln_core.contracts.stage_refs``), whose settings
(``ResolvedSettings``: top-K, samples per prompt, learning rate, loss, world size, LoRA targets), seed, base
adapter and device options are used as resolved, never derived again from the config. ``plan_off_policy_run`` settles what an admitted corpus
decides (``DataPlan``: schedule, the data binding, the teacher's revision); ``build_plan`` — shared with
the on-policy planner (``on_policy_plan``) — resolves the device and precision, computes
the identities a checkpoint binds (``run_identity``, ``data_identity``), loads and checks the
checkpoint to resume from, and settles the run directory. A rejected input costs no model load and
writes nothing.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any, Callable

import torch

from kiln_core.contracts.identity import TeacherIdentity
from kiln_core.contracts.opd_config import ConfigError, OpdConfig
from kiln_core.contracts.receipt import DistributedReceipt
from kiln_core.contracts.settings import ResolvedSettings, kiln_optimizer_json
from kiln_core.contracts.stage_refs import TrainPlan
from kiln_core.contracts.checkpoint import DataCursor
from kiln_core.corpus import CorpusTables
from kiln_core.corpus_set import ShardedCorpus, ShardLayout
from kiln_core.storage import Location, move_aside, remove_tree, resolve
from kiln_core.training import checkpoint as ckpt
from kiln_core.training import run_identity
from kiln_core.contracts.base_adapter import BaseAdapter
from kiln_core.training.base_adapter import settle_base_adapter
from kiln_core.training.data_identity import corpus_content_revision, teacher_capabilities
from kiln_core.training.lora_targets import resolve_lora_targets
from kiln_core.training.distributed.world import World
from kiln_core.training.objectives import step_loss
from kiln_core.contracts.training_record import TRAINING_DATA_SOURCE, RunFacts
from kiln_core.training.receipt import library_versions, training_finished
from kiln_core.training.student import resolve_device, resolve_precision, student_identity

__all__ = ["ADAPTER_DIR", "Schedule", "RunPlan", "DataPlan", "plan_off_policy_run", "resume_basename", "build_plan"]

ADAPTER_DIR = "adapter"


@dataclass(frozen=True)
class Schedule:
    """File-order candidate schedule. Candidate c (0-based over the whole run) is example
    ``(c % candidates_per_epoch) // samples_per_prompt``: each example repeated consecutively. Step s
    takes the next ``sequences_per_step`` candidates of that flat order (a group may span an epoch
    boundary; the last group may be shorter)."""

    examples: int
    samples_per_prompt: int
    epochs: int
    sequences_per_step: int

    @property
    def candidates_per_epoch(self) -> int:
        return self.examples * self.samples_per_prompt

    @property
    def total_candidates(self) -> int:
        return self.epochs * self.candidates_per_epoch

    @property
    def total_steps(self) -> int:
        return -(-self.total_candidates // self.sequences_per_step)

    def candidates_of_step(self, step: int) -> range:
        return range(step * self.sequences_per_step, min((step + 1) * self.sequences_per_step, self.total_candidates))

    def example_of(self, candidate: int) -> int:
        return (candidate % self.candidates_per_epoch) // self.samples_per_prompt

    def cursor_after(self, step: int) -> tuple[int, int]:
        """(epoch_index, cursor_in_epoch) of the next candidate once ``step`` steps are committed."""
        return divmod(min(step * self.sequences_per_step, self.total_candidates), self.candidates_per_epoch)


@dataclass(frozen=True)
class RunPlan:
    """The resolved run: settings, schedule, seed, the checkpoint contract, and the checkpoint being resumed."""

    run_dir: Location
    adapter_name: str
    settings: ResolvedSettings
    """The run's settings, its LoRA targets resolved (from the student when the plan did not carry them)."""
    schedule: Schedule
    seed: int
    device: torch.device
    precision: str
    contract: ckpt.RunContract
    facts: RunFacts
    loaded: ckpt.LoadedCheckpoint | None
    world: World
    base_adapter: BaseAdapter | None = None
    """The warm start (``config.base_adapter``) a fresh run loads before step 1; a resume never reloads it."""
    shards: ShardLayout | None = None
    """The corpus's shards when it is a set (checkpoints record the data cursor); None for one file."""
    gate_follows: bool = False
    """A gate decides about a successful run after training (``TrainPlan.gate_follows``): its stage composes the
    receipt then, not the trainer."""

    def data_cursor(self, step: int) -> DataCursor | None:
        """Where the next candidate comes from once ``step`` steps are committed (a set of shards only)."""
        if self.shards is None:
            return None
        candidate = min(step * self.schedule.sequences_per_step, self.schedule.total_candidates)
        return self.shards.cursor(candidate, samples_per_prompt=self.schedule.samples_per_prompt)

    def learning_rate_at(self, step: int) -> float:
        """The rate optimizer step ``step`` (1-based) trains at: ``learning_rate`` unless the config has a schedule."""
        from kiln_core.training.optim import scheduled_learning_rate

        settings = self.settings
        return scheduled_learning_rate(settings.learning_rate, settings.config.lr_schedule, step, self.schedule.total_steps)

    @property
    def loss_fn(self) -> Callable:
        return step_loss(self.settings.loss)


@dataclass(frozen=True)
class DataPlan:
    """What the training data decides about a run: the only part off-policy and on-policy plans differ in.

    Attributes:
        schedule: The candidate schedule (on-policy: ``total_steps`` is the candidate count, an upper
            bound of the optimizer steps, since empty rollouts train nothing).
        binding: The checkpoint's ``data`` record (source kind, prompt-list digest, candidates per epoch).
        capabilities: Kiln's ``LogitSourceCaps`` of the teacher source.
        teacher_identity: The pinned ``TeacherIdentity``, or None.
        teacher_content_revision: Kiln's ``authoritative_content_revision`` of the source.
        prepared_source_indices: Request indices of the prepared examples/prompts, in order.
        examples_read: Examples or prompts in the request.
        examples_filtered: Prompts dropped at tokenization (0 off-policy: admission refuses them).
        training_data: The receipt's ``training_data`` as ``(source, path, sha256)``.
        on_policy: Whether checkpoints carry Kiln's ``rollout-sampling`` stream.
        shards: The corpus's ``ShardLayout`` when it is a set of shards, else None.
    """

    schedule: Schedule
    binding: ckpt.DataBinding
    capabilities: dict[str, Any]
    teacher_identity: Any | None
    teacher_content_revision: str
    prepared_source_indices: list[int]
    examples_read: int
    examples_filtered: int
    training_data: tuple[str, str | None, str]
    on_policy: bool = False
    shards: ShardLayout | None = None


def plan_off_policy_run(plan: TrainPlan, *, tables: CorpusTables | ShardedCorpus, dataset_sha256: str, dataset_path: str,
                        student_dir: str, teacher_identity: TeacherIdentity | None, teacher_alias: str,
                        world: World) -> RunPlan:
    """Settle an off-policy run from its ``TrainPlan`` and apply every refusal before any model loads
    (cheapest checks first). The plan's settings, seed, base adapter and device are taken as the engine
    resolved them, not derived again. ``tables`` is one
    corpus file's tables or a set of shards (``ShardedCorpus``, ``dataset_sha256`` its set digest).

    Raises:
        ConfigError, CheckpointError, ResumeError: rejected input; nothing is written.
    """
    from kiln_core.identity.hashing import model_vocab_size

    run_dir = resolve(plan.run_uri)
    basename = resume_basename(plan, run_dir)
    settings = plan.settings
    top_k = settings.top_k
    if tables.num_examples == 0 or tables.top_k != top_k:
        raise ConfigError(f"corpus has {tables.num_examples} examples at top_k {tables.top_k}; the config resolves "
                          f"top_k to {top_k}", "config.top_k")
    schedule = Schedule(tables.num_examples, settings.samples_per_prompt, settings.config.epochs,
                        settings.config.sequences_per_step * world.size)  # candidates per optimizer step, all ranks
    caps = teacher_capabilities(teacher_alias, model_vocab_size(student_dir), top_k,
                                teacher_identity.tokenizer_vocab_sha256 if teacher_identity is not None else None)
    # Kiln's data.content_sha256 is the prompt-list digest; a hand-built table has none, so it is
    # bound by the corpus file's digest instead.
    content = tables.kiln_prompts_sha256 or dataset_sha256.removeprefix("sha256:")
    data = DataPlan(
        schedule=schedule,
        binding=ckpt.DataBinding(source_kind=ckpt.OFF_POLICY_SOURCE_KIND, content_sha256=content,
                                 item_count=schedule.candidates_per_epoch),
        capabilities=caps, teacher_identity=teacher_identity,
        teacher_content_revision=corpus_content_revision(tables, caps),
        # every admitted example has an action token (admission refuses the others)
        prepared_source_indices=list(range(tables.num_examples)), examples_read=tables.num_examples,
        examples_filtered=0, training_data=(TRAINING_DATA_SOURCE, dataset_path, dataset_sha256),
        shards=tables.layout if isinstance(tables, ShardedCorpus) else None)
    return build_plan(plan, data=data, run_dir=run_dir, basename=basename, student_dir=student_dir,
                      teacher_alias=teacher_alias, world=world)


def resume_basename(plan: TrainPlan, run_dir: Location) -> str | None:
    """The checked checkpoint basename ``plan.resume`` names, or None for a fresh run.

    Raises:
        ValueError: ``plan.resume`` is still ``"latest"`` (the engine resolves it to a basename or None).
        ResumeError: not a checkpoint basename of this adapter.
    """
    if plan.resume == "latest":
        raise ValueError("plan.resume 'latest' must be resolved to a checkpoint basename (or None) before training")
    return ckpt.check_resume_basename(plan.resume, run_dir, plan.adapter) if plan.resume else None


def check_packing_world(config: OpdConfig, world_size: int) -> None:
    """Refuse ``pack_sequences`` with several processes: a rank's block of a step is trained one sequence after
    another (``step.train_step_distributed``), so packing there would be a setting that does nothing.

    Raises:
        ConfigError: ``unsupported`` on ``config.pack_sequences``.
    """
    if config.pack_sequences and world_size > 1:
        raise ConfigError(f"pack_sequences trains in one process, not {world_size}: leave it off with --nproc, "
                          "--ray or distributed.world_size", "config.pack_sequences", code="unsupported")


def build_plan(plan: TrainPlan, *, data: DataPlan, run_dir: Location, basename: str | None, student_dir: str,
               teacher_alias: str, world: World) -> RunPlan:
    """The run of a ``TrainPlan`` whose data side is settled: identities, the checkpoint contract, the resume checks.

    Shared by both training modes; ``data`` carries what differs. ``basename`` is an already checked
    resume checkpoint name, or None for a fresh run. ``plan.base_adapter`` is ``config.base_adapter``
    resolved (``kiln_core.engine.base_adapter``); an adapter directory in the config is read here when it is None.

    Raises:
        ConfigError, CheckpointError, ResumeError: rejected input; nothing is written.
        BaseAdapterError: ``base_adapter_missing``/``base_adapter_mismatch``.
    """
    from kiln_core.identity.hashing import read_model_config

    adapter_name = plan.adapter
    settings = plan.settings
    if settings.lora_targets is None:  # a direct call of the trainers: the student's, resolved here
        settings = settings.model_copy(update={"lora_targets": resolve_lora_targets(student_dir)})
    config, lora_targets = settings.config, settings.lora_targets
    check_packing_world(config, world.size)
    base_adapter = settle_base_adapter(config, plan.base_adapter, lora_targets)

    schedule = data.schedule
    dev = resolve_device(plan.device)
    prec = resolve_precision(dev, plan.precision)
    versions = library_versions()

    identity = student_identity(student_dir)
    shards = run_identity.base_weight_shard_manifest(student_dir)
    provenance = run_identity.execution_provenance(device=dev, precision=prec, identity=identity, versions=versions)
    num_layers = int(read_model_config(student_dir)[1].get("num_hidden_layers", 0))
    teacher_identity = data.teacher_identity
    teacher = teacher_identity.as_ordered_dict() if teacher_identity is not None else None
    aux = run_identity.auxiliary_state(
        identity=identity, shard_manifest=shards, provenance=provenance, device_type=dev.type,
        kiln_flows_version=versions["kiln-flows"], prepared_source_indices=data.prepared_source_indices,
        capabilities=data.capabilities, teacher_identity=teacher, teacher_content_revision=data.teacher_content_revision,
        precision=prec, chat_template_rollouts=config.rollout_prompt_rendering == "chat_template",
        planning=run_identity.checkpoint_planning(device=dev, gradient_checkpointing=plan.gradient_checkpointing, num_layers=num_layers))
    precision_record = run_identity.precision_policy(prec, config.optimizer.kind)

    def contract_for_seed(seed: int) -> ckpt.RunContract:
        return ckpt.RunContract(
            adapter_name=adapter_name, effective_config=settings.kiln_effective_config(seed),
            precision_policy=precision_record, data=data.binding, init_seed=seed, optimizer_kind=config.optimizer.kind,
            optimizer_json=kiln_optimizer_json(config.optimizer), learning_rate=settings.learning_rate,
            epochs=config.epochs, auxiliary_state=aux, examples_read=data.examples_read,
            examples_filtered=data.examples_filtered, on_policy=data.on_policy, world_size=world.size,
            backend=world.backend, sequences_per_step=config.sequences_per_step,
            optimizer_steps_total=schedule.total_steps, loss=settings.loss,
            lr_schedule=config.lr_schedule.model_dump(mode="json") if config.lr_schedule is not None else None,
            pack_sequences=True if config.pack_sequences else None,
            lora_targets=None if lora_targets.is_kiln_default else lora_targets)

    loaded = None
    if basename is not None:
        loaded = ckpt.load_checkpoint(run_dir, basename)
        # A request that leaves the seed null resumes with the checkpoint's (Kiln's rule); a fresh run draws it
        # from its run key (``ResolvedSettings.seed_for``), so every attempt draws the same one.
        contract = ckpt.validate_resume(loaded, contract_for_seed, config.seed)
    else:
        contract = contract_for_seed(plan.seed)
    _preflight_outputs(run_dir, adapter_name, config.checkpoint_interval,
                       loaded.manifest.progress.global_step if loaded else 0, schedule.total_steps,
                       may_change=world.is_main)
    source, path, sha256 = data.training_data
    facts = RunFacts(
        adapter_name=adapter_name, student_dir=str(student_dir), student_identity=identity, shard_manifest=shards,
        execution_provenance=provenance, precision_policy=precision_record, dataset_path=path,
        dataset_sha256=sha256, training_data_source=source, settings=settings, seed=contract.init_seed,
        teacher_alias=teacher_alias, teacher_identity=teacher,
        teacher_identity_revision=teacher_identity.identity_revision() if teacher_identity else None,
        teacher_content_revision=data.teacher_content_revision, examples_read=data.examples_read,
        examples_filtered=data.examples_filtered, candidates_per_epoch=schedule.candidates_per_epoch,
        total_steps=schedule.total_steps, device=dev.type, library_versions=versions,
        base_adapter=base_adapter.receipt_record() if base_adapter is not None else None, recipe=plan.recipe,
        ignored_request_keys=plan.ignored_request_keys,
        distributed=None if world.size == 1 and world.cluster is None else DistributedReceipt(
            world_size=world.size, backend=world.backend, strategy=world.strategy,
            sequences_per_step_per_rank=config.sequences_per_step, sequences_per_optimizer_step=schedule.sequences_per_step,
            **(world.cluster.receipt_fields() if world.cluster is not None else {})))
    run_plan = RunPlan(run_dir=run_dir, adapter_name=adapter_name, settings=settings, schedule=schedule,
                       seed=contract.init_seed, device=dev, precision=prec, contract=contract, facts=facts,
                       loaded=loaded, world=world, base_adapter=base_adapter, shards=data.shards,
                       gate_follows=plan.gate_follows)
    if loaded is not None:
        check_data_cursor(run_plan, loaded)
    return run_plan


def check_data_cursor(plan: RunPlan, loaded: ckpt.LoadedCheckpoint) -> None:
    """A checkpoint resumes only where its recorded data cursor says it left the data.

    The checkpoint's data binding already pins the set digest; the cursor is the set's shard and row
    of the next candidate, recorded for people and checked here so that a checkpoint whose position
    disagrees with its step count (or one written for one file, resumed on a set) is refused by name.

    Raises:
        ResumeError: ``data_cursor_mismatch``.
    """
    step = loaded.manifest.progress.global_step
    expected, recorded = plan.data_cursor(step), loaded.extension.data_cursor
    if recorded != expected:
        def text(cursor: DataCursor | None) -> str:
            if cursor is None:
                return "no shard cursor (one corpus file)"
            return f"epoch {cursor.epoch}, shard {cursor.shard} ({cursor.shard_sha256}), row {cursor.row}"

        raise ckpt.ResumeError("data_cursor_mismatch", f"checkpoint {loaded.basename} records {text(recorded)} "
                               f"after step {step}; this run's corpus puts step {step + 1} at {text(expected)}",
                               file=loaded.basename)


def _preflight_outputs(run_dir: Location, adapter_name: str, interval: int | None, start: int, total: int,
                       *, may_change: bool = True) -> None:
    """Settle the run directory before any work.

    * A published adapter whose training succeeded (its training record, or its receipt) is a finished run:
      refuse (new adapter name).
    * A published adapter *without* one is a publication cut short between the adapter commit and the
      records (a crash, a storage outage): it is removed and republished by this run, which recomputes
      the same bytes from the newest checkpoint.
    * A fresh run into a directory that already holds checkpoints it would write: refuse.
    * A resume from an *earlier* checkpoint the user chose (the newest one is damaged): the later
      checkpoints it would write again are moved aside as hidden ``.<name>.superseded-<id>``
      directories — never deleted, never overwritten — so the run can publish its own.

    Only one process (rank 0) changes the directory; the others just check.
    """
    adapter = run_dir.child(ADAPTER_DIR)
    if adapter.child("adapter_config.json").exists():
        if training_finished(run_dir):
            raise ConfigError(f"adapter {adapter_name!r} is already published at {adapter.uri}; "
                              "choose a new adapter name", "adapter", code="adapter_exists")
        if may_change:
            remove_tree(adapter)
    if not interval:
        return
    clashes = [name for step, name in ckpt.committed_checkpoints(run_dir, adapter_name)
               if step > start and step % interval == 0 and step < total]
    if clashes and start == 0:
        raise ConfigError(f"run directory {run_dir.uri} already holds checkpoint {clashes[0]} that this run would "
                          "write; resume from the newest checkpoint or use a new adapter name", "resume_checkpoint",
                          code="checkpoint_exists")
    for name in clashes if may_change else ():
        move_aside(run_dir.child(name), f".{name}.superseded-{secrets.token_hex(4)}")
