"""Planning an on-policy run: the prompts' side of the plan, then the plan both modes share.

Everything is decided and every refusal made before a model loads (only the student's tokenizer is
read), in the order of Kiln's ``opd_train_to_with_checkpoint_root_and_runtime`` (``opd.rs``):

* the teacher's capabilities as Kiln's ``LiveLocalTeacher`` reports them (``teacher_id`` = alias,
  the identity's ``vocab_size``/``max_top_k``/``tokenizer_vocab_sha256``, top-K rows only, batched)
  and its content revision (``sha256:`` + the identity's ``content_revision()``, the
  ``LogitSource::authoritative_content_revision`` default);
* the effective top-K (``resolve_opd_top_k`` under the teacher's cap) and samples per prompt (auto-scaled
  from the request's prompt count, dropped prompts included), as the ``TrainPlan``'s settings carry them (the
  engine resolved them once, right after the teacher's manifest);
* the prompts prepared (``kiln_core.on_policy.prepare``): kept prompts, dropped ones, rollout prefixes;
* the checkpoint's data record: ``inline-on-policy-opd-candidate-order-v1``, the prompt-list digest,
  candidates per epoch = kept prompts × samples per prompt; ``rollout-sampling`` is among its streams;
* then ``plan.build_plan`` (identities, seed, resume checks, run directory), shared with off-policy;
* last, the rollout store and this run's key in it.

kiln-flows trains one candidate per optimizer step on one process here, as Kiln does; larger groups
and several processes are refused for on-policy runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from kiln_core.canonical import canonical_sha256
from kiln_core.contracts.opd_config import ConfigError, OpdConfig
from kiln_core.contracts.settings import check_one_process, legacy_loss_record
from kiln_core.contracts.opd_prompt import INLINE_PROMPTS_SOURCE, OpdPrompt, prompts_content_sha256
from kiln_core.contracts.stage_refs import TrainPlan
from kiln_core.errors import Rejection
from kiln_core.on_policy.prepare import PreparedPrompts, prepare_prompts
from kiln_core.on_policy.render import kiln_eos_token_ids
from kiln_core.on_policy.sampler import DRAW_ALGORITHM, SamplingParams
from kiln_core.on_policy.schedule import ON_POLICY_DATA_SOURCE_KIND
from kiln_core.on_policy.store import RolloutStore, rollout_run_key
from kiln_core.on_policy.teacher import TeacherSource
from kiln_core.storage import resolve
from kiln_core.training import checkpoint as ckpt
from kiln_core.training.data_identity import teacher_capabilities
from kiln_core.training.distributed.world import World
from kiln_core.training.plan import DataPlan, RunPlan, Schedule, build_plan, resume_basename

__all__ = ["ROLLOUTS_DIR", "RolloutPlan", "plan_on_policy_run"]

ROLLOUTS_DIR = "rollouts"


@dataclass(frozen=True)
class RolloutPlan:
    """What an on-policy run needs beyond the shared plan.

    Attributes:
        prepared: The prepared prompts (kept, dropped, prefixes).
        sampling: The rollout sampler's parameters.
        max_tokens: Most new tokens per rollout.
        eos_token_ids: Ids that end a rollout.
        store: The rollout store.
        run_key: This run's key in the store.
    """

    prepared: PreparedPrompts
    sampling: SamplingParams
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    store: RolloutStore
    run_key: str


def plan_on_policy_run(plan: TrainPlan, *, prompts: Sequence[OpdPrompt], student_dir: str, teacher: TeacherSource,
                       rollout_root: str | None, world: World) -> tuple[RunPlan, RolloutPlan]:
    """Settle an on-policy run from its ``TrainPlan`` and apply every refusal before any model loads. The
    plan's settings (top-K under the teacher's cap, samples per prompt) are used as the engine resolved them.

    Raises:
        ConfigError: a config the on-policy loop does not run.
        Rejection: no prompts, none that tokenizes, a teacher whose vocabulary is not the student's;
            CheckpointError/ResumeError: the resume checkpoint.
    """
    from kiln_core.identity.hashing import model_vocab_size
    from kiln_core.tokenization import load_student_tokenizer

    settings, adapter_name = plan.settings, plan.adapter
    config = settings.config
    _check_runs_here(config, world)
    if not prompts:
        raise Rejection("no_prompts", "opd_train: prompts must be non-empty", field="prompts")
    run_dir = resolve(plan.run_uri)
    basename = resume_basename(plan, run_dir)
    identity = teacher.identity
    student_vocab = model_vocab_size(student_dir)
    if identity.vocab_size != student_vocab:
        raise Rejection("teacher_vocab_mismatch", f"teacher '{teacher.alias}' has vocab_size {identity.vocab_size} "
                        f"but the student's is {student_vocab}: on-policy scoring needs one vocabulary", field="teacher")
    tokenizer = load_student_tokenizer(student_dir)
    prepared = prepare_prompts(prompts, tokenizer, rendering=config.rollout_prompt_rendering)
    schedule = Schedule(len(prepared.prompts), settings.samples_per_prompt, config.epochs, 1)
    content = prompts_content_sha256(prompts)
    data = DataPlan(
        schedule=schedule,
        binding=ckpt.DataBinding(source_kind=ON_POLICY_DATA_SOURCE_KIND, content_sha256=content,
                                 item_count=schedule.candidates_per_epoch),
        capabilities=teacher_capabilities(teacher.alias, identity.vocab_size, identity.max_top_k,
                                          identity.tokenizer_vocab_sha256),
        teacher_identity=identity, teacher_content_revision=identity.identity_revision(),
        prepared_source_indices=prepared.source_indices, examples_read=len(prompts),
        examples_filtered=len(prepared.dropped), training_data=(INLINE_PROMPTS_SOURCE, None, "sha256:" + content),
        on_policy=True)
    run_plan = build_plan(plan, data=data, run_dir=run_dir, basename=basename, student_dir=student_dir,
                          teacher_alias=teacher.alias, world=world)
    eos = tuple(kiln_eos_token_ids(tokenizer.tokenizer))
    contract = run_plan.contract
    # What decides a candidate's tokens besides its place in the schedule: everything a checkpoint
    # binds (config with the seed, prompts, student, teacher, runtime) and the sampler's own rules.
    run_key = rollout_run_key({
        "adapter_name": adapter_name, "effective_config": contract.effective_config,
        "data": contract.data.model_dump(), "auxiliary_state_sha256": canonical_sha256(contract.auxiliary_state),
        "draw": DRAW_ALGORITHM, "eos_token_ids": list(eos), "loss": legacy_loss_record(contract.loss),
        **({"base_adapter_sha256": run_plan.base_adapter.adapter_model_sha256} if run_plan.base_adapter is not None else {}),
    })
    store = RolloutStore(rollout_root if rollout_root is not None else run_dir.child(ROLLOUTS_DIR).uri)
    rollouts = RolloutPlan(prepared=prepared,
                           sampling=SamplingParams.for_rollouts(temperature=config.temperature, top_p=config.top_p),
                           max_tokens=config.max_tokens, eos_token_ids=eos, store=store, run_key=run_key)
    return run_plan, rollouts


def _check_runs_here(config: OpdConfig, world: World) -> None:
    if config.training_mode != "on_policy":
        raise ConfigError('train_on_policy needs config.training_mode="on_policy"; an off_policy request trains from '
                          "its teacher-scored corpus (train_opd)", "config.training_mode")
    if config.sequences_per_step != 1:
        raise ConfigError("sequences_per_step > 1 is not supported on-policy: each rollout is sampled from the "
                          "weights its predecessor's step produced, one candidate per optimizer step as in Kiln",
                          "config.sequences_per_step", code="unsupported")
    check_one_process(world_size=world.size, field="nproc")
