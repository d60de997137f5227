"""The on-policy trainer on the tiny student and teacher: what it samples, scores, trains and records.

What a user depends on: each candidate is the student's own rollout (Kiln's prefix and seed) scored by
the teacher in the teacher's own prompt; the first step's loss is the top-K reverse KL of those rows
(checked against a naive fp32 reference, tolerance 1e-5); empty rollouts and prompts without a
prompt/assistant split are consumed without a step, a loss, a progress report, a checkpoint or a
cancellation check; checkpoints and the receipt carry Kiln's on-policy records; and every bad input
is refused before a model loads.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch

from kiln_core.contracts.opd_config import ConfigError
from kiln_core.errors import Rejection
from kiln_core.on_policy.sampler import SamplingParams, sample_rollout
from kiln_core.on_policy.store import RolloutStore
from kiln_core.on_policy.teacher import LiveLocalTeacher, TeacherSource
from kiln_core.training.checkpoint import CheckpointError
from kiln_core.training.on_policy_trainer import train_on_policy
from naive_losses import normalize
from on_policy_support import CountingRollouts, chat, request
from plan_support import split_plan_options, train_plan

ADAPTER = "onpol"
ALIAS = "tiny-teacher"
SEED = 11
PROMPTS = [
    chat("What is two plus two?"),
    {**chat("List files under src/.", system="You are a helpful assistant."),
     "teacher_extra_messages": [{"role": "user", "content": "Answer with JSON only."},
                                {"role": "assistant", "content": "Use the directory key."}]},
    chat("Summarize the text in one sentence.", dummy=False),  # no assistant turn: dropped at tokenization
    chat("Translate to French: good morning"),
]
KEPT = [0, 1, 3]


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


@pytest.fixture(scope="module")
def identity(tiny_teacher):
    from kiln_core.identity.local_teacher import local_teacher_identity

    return local_teacher_identity(str(tiny_teacher), max_top_k=32, device_kind="cpu")


@pytest.fixture(scope="module")
def teacher(tiny_teacher, identity) -> TeacherSource:
    loaded = LiveLocalTeacher.load(str(tiny_teacher), identity=identity, top_k=16, teacher_id=ALIAS, device="cpu")
    return TeacherSource.loaded(loaded, ALIAS)


def make_request(prompts=PROMPTS, **overrides):
    values = dict(samples_per_prompt=2, max_tokens=6, top_k=16, lora_rank=4, lora_alpha=8.0, seed=SEED,
                  learning_rate=2e-2, checkpoint_interval=2, epochs=1)
    values.update(overrides)
    return request(prompts, teacher=ALIAS, **values)


def run(student, teacher, root, req=None, **kwargs):
    req = req if req is not None else make_request()
    plan_options, hooks = split_plan_options(kwargs)
    plan = train_plan(req.config, str(root), ADAPTER, prompts=req.prompts, teacher=teacher, **plan_options)
    return train_on_policy(plan, req.prompts, student_dir=str(student), teacher=teacher, **hooks)


def stored(result):
    return RolloutStore(result.rollout_root).audit(result.rollout_run_key)


def read_json(path):
    return json.loads(path.read_text())


# ---------------------------------------------------------------------------------------------


def test_rollouts_are_the_students_own_and_scored_in_the_teachers_prompt(tiny_student, tiny_teacher, teacher,
                                                                        tmp_path):
    from transformers import AutoModelForCausalLM

    from kiln_core.on_policy.render import kiln_eos_token_ids
    from kiln_core.tokenization import load_student_tokenizer

    result = run(tiny_student, teacher, tmp_path)
    assert result.status == "success"
    rollouts = stored(result)
    # prompt-major, then sample index; the dropped prompt has no candidates
    assert [(r.source_index, r.sample_index) for r in rollouts] == [(s, i) for s in KEPT for i in range(2)]
    base = AutoModelForCausalLM.from_pretrained(str(tiny_student), dtype=torch.float32).eval()
    first = rollouts[0]  # sampled before any step: the LoRA is still the identity (B = 0)
    params = SamplingParams.for_rollouts(temperature=1.0, top_p=0.9)
    eos = kiln_eos_token_ids(load_student_tokenizer(str(tiny_student)).tokenizer)
    expected = sample_rollout(base, first.rollout_prefix.tolist(), params=params, max_tokens=6,
                              eos_token_ids=eos, seed=SEED + 0 + 0 * 1_000_003 + 0 * 1_000_033)
    assert first.sampled_ids.tolist() == expected and len(expected) > 0
    # the asymmetric prompt: the teacher's prefix carries the extra messages, the student's does not
    hinted = next(r for r in rollouts if r.source_index == 1 and not r.empty)
    assert hinted.teacher_prefix is not None and len(hinted.teacher_prefix) > len(hinted.rollout_prefix)
    loaded = teacher.load(16)
    sequence = np.concatenate([hinted.teacher_prefix, hinted.sampled_ids])
    targets = np.arange(len(hinted.teacher_prefix), len(sequence))
    rows = loaded.score(sequence, targets, top_k=16)
    np.testing.assert_array_equal(hinted.teacher_ids, rows.ids)
    np.testing.assert_array_equal(hinted.teacher_logprobs, rows.logprobs)
    # the first step trains on exactly those rows: top-K reverse KL, recomputed naively in fp32
    ids = torch.tensor(np.concatenate([first.rollout_prefix, first.sampled_ids]).astype(np.int64))[None]
    with torch.no_grad():
        logits = base(input_ids=ids).logits[0].float()
    rows_at = torch.arange(len(first.rollout_prefix) - 1, ids.shape[1] - 1)
    student = normalize(logits[rows_at].gather(1, torch.tensor(first.teacher_ids).long()))
    target = torch.exp(torch.tensor(first.teacher_logprobs))
    target = target / target.sum(dim=-1, keepdim=True)
    naive = float((student * (torch.log(student) - torch.log(target))).sum(dim=-1).mean())
    assert result.loss_history[0] == pytest.approx(naive, abs=1e-5)


def test_empty_rollouts_and_split_less_prompts_are_consumed_without_a_step(tiny_student, teacher, tmp_path,
                                                                          monkeypatch):
    import kiln_core.on_policy.prepare as prepare

    real_encode = prepare.encode_conversations

    def first_action_at_zero_for_french(student, conversations):  # how a template with no header would tokenize
        results = real_encode(student, conversations)
        return [type(r)(r.input_ids, np.concatenate([[0], r.action_positions]).astype(np.int32), r.env_positions,
                        r.env_in_warning_prefix) if "French" in c.messages[-1]["content"] else r
                for c, r in zip(conversations, results)]

    monkeypatch.setattr(prepare, "encode_conversations", first_action_at_zero_for_french)
    counting = CountingRollouts(eos_first_modulus=3)
    reports, polls, committed = [], [], []
    result = run(tiny_student, teacher, tmp_path, make_request(epochs=2, checkpoint_interval=1),
                 rollout_backend=counting.factory, on_progress=reports.append,
                 should_cancel=lambda: polls.append(1) or False, on_step_committed=committed.append)
    assert result.status == "success"
    rollouts = stored(result)
    # prompts 0 and 1 are sampled (2 samples × 2 epochs each); prompt 3 is kept but never sampled
    assert sorted({r.source_index for r in rollouts}) == [0, 1] and len(rollouts) == len(counting.seeds) == 8
    empty = [r for r in rollouts if r.empty]
    trained = [r for r in rollouts if not r.empty]
    assert empty and trained and [r.empty for r in rollouts] == [counting.eos_first(r.key.seed) for r in rollouts]
    steps = len(trained)
    assert result.steps == len(result.loss_history) == steps == len(reports) == len(polls) == len(committed)
    assert result.consumed_candidates == result.total_steps == 12  # 3 kept prompts × 2 samples × 2 epochs
    # each rollout was sampled at the step count reached by then: empties do not advance it
    assert [r.key.global_step for r in rollouts] == [sum(not x.empty for x in rollouts[:i]) for i in range(8)]
    assert [e.step for e in reports] == list(range(1, steps + 1))
    # a checkpoint per step while candidates remain; the cursor runs ahead of the step
    names = sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".kiln-checkpoint"))
    assert len(names) == steps - (1 if reports[-1].consumed_candidates == 12 else 0)
    for report in reports[:-1]:
        manifest = read_json(tmp_path / f"{ADAPTER}-checkpoint-step-{report.step:08d}.kiln-checkpoint" /
                             "checkpoint_manifest.json")
        progress = manifest["progress"]
        assert progress["epoch_index"] * 6 + progress["cursor_in_epoch"] == report.consumed_candidates
        assert manifest["rng_states"]["rollout-sampling"]["position"] == report.consumed_candidates >= report.step
    receipt = read_json(tmp_path / "train_receipt.json")
    assert receipt["data"]["examples_read"] == 4 and receipt["data"]["examples_filtered"] == 1
    assert receipt["opd"]["action_tokens"] == sum(len(r.sampled_ids) for r in trained)
    assert receipt["token_counts"]["context_tokens"] == sum(len(r.rollout_prefix) for r in trained)
    assert receipt["token_counts"]["env_tokens"] == receipt["opd"]["env_tokens"] == 0


def test_progress_reports_rollout_throughput_and_teacher_tokens(tiny_student, teacher, tmp_path):
    reports = []
    result = run(tiny_student, teacher, tmp_path, on_progress=reports.append)
    rollouts = stored(result)
    assert len(reports) == result.steps == 6
    for n, report in enumerate(reports, start=1):
        assert report.rollouts_sampled == n and report.rollouts_reused == 0
        assert report.teacher_tokens_scored == report.sampled_tokens == sum(len(r.sampled_ids) for r in rollouts[:n])
        assert report.fraction == pytest.approx(n / 6) and report.rollouts_per_second > 0
        assert report.teacher_tokens_per_second == pytest.approx(report.teacher_tokens_scored / report.elapsed_s)
    assert (result.rollouts_sampled, result.teacher_tokens_scored) == (6, reports[-1].teacher_tokens_scored)
    assert result.phase_timings_ms["rollout_sampling"] > 0 and result.phase_timings_ms["teacher_scoring"] > 0


def test_receipt_records_an_on_policy_run(tiny_student, teacher, identity, tmp_path):
    import kiln_structs as kiln

    result = run(tiny_student, teacher, tmp_path, make_request(samples_per_prompt=3, max_tokens=3, checkpoint_interval=None))
    receipt = read_json(tmp_path / "train_receipt.json")
    kiln.TrainReceipt.model_validate(receipt)
    # Kiln's re-serialization of the prompt list: sorted keys, compact, empty lists left out
    kiln_prompts = [{"messages": p["messages"], **({"teacher_extra_messages": p["teacher_extra_messages"]}
                                                   if p.get("teacher_extra_messages") else {})} for p in PROMPTS]
    digest = hashlib.sha256(json.dumps(kiln_prompts, sort_keys=True, separators=(",", ":"),
                                       ensure_ascii=False).encode()).hexdigest()
    assert receipt["training_data"] == {"source": "inline_opd_prompts", "path": None, "sha256": "sha256:" + digest}
    opd = receipt["opd"]
    assert (opd["training_mode"], opd["samples_per_prompt"], opd["top_k"], opd["teacher_id"]) == ("on_policy", 3, 16, ALIAS)
    revision = "sha256:" + hashlib.sha256(json.dumps(identity.as_ordered_dict(), separators=(",", ":"),
                                                     ensure_ascii=False).encode()).hexdigest()
    assert opd["teacher_content_revision"] == revision and opd["teacher_identity"] == identity.as_ordered_dict()
    assert receipt["config"]["samples_per_prompt"] == 3 and receipt["config"]["training_mode"] == "on_policy"
    assert receipt["data"]["examples_trained"] == len(receipt["loss_history"]) == result.steps > 0
    assert receipt["data"]["candidates_per_epoch"] == 9


def test_default_samples_per_prompt_scale_with_the_request_prompt_count(tiny_student, teacher, tmp_path):
    """Resolved once (the engine's settings; here the submit checks' ``plan_on_policy``, which resolves them the
    same way); the training planner takes the plan's value into the schedule, the checkpoint and the receipt."""
    from kiln_core.contracts.stage_refs import TrainPlan
    from kiln_core.on_policy.submit import TeacherBinding, plan_on_policy
    from kiln_core.training.distributed.world import World
    from kiln_core.training.on_policy_plan import plan_on_policy_run

    def samples(prompts):
        req = request(prompts, teacher=ALIAS, top_k=16, max_tokens=4)  # samples_per_prompt left at Kiln's default 4
        submitted = plan_on_policy(req, teacher=TeacherBinding(ALIAS, "local", teacher.identity, "teacher-dir"),
                                   student_dir=str(tiny_student))
        plan = TrainPlan.for_config(req.config, str(tmp_path), ADAPTER, top_k=submitted.top_k,
                                    samples_per_prompt=submitted.samples_per_prompt, device="cpu")
        run_plan, rollouts = plan_on_policy_run(plan, prompts=req.prompts, student_dir=str(tiny_student),
                                                teacher=teacher, rollout_root=None, world=World())
        assert run_plan.facts.settings.samples_per_prompt == submitted.samples_per_prompt
        samples_per_prompt = run_plan.facts.settings.samples_per_prompt
        assert run_plan.schedule.candidates_per_epoch == len(rollouts.prepared.prompts) * samples_per_prompt
        assert run_plan.contract.effective_config["effective_samples_per_prompt"] == samples_per_prompt
        return samples_per_prompt

    # counted before dropping prompts: 49 + 1 user-only prompt is 50 prompts
    assert samples(PROMPTS) == 64
    assert samples([chat(f"q{i}") for i in range(49)] + [chat("u", dummy=False)]) == 16
    assert samples([chat(f"q{i}") for i in range(200)]) == 4


def test_a_run_whose_every_rollout_is_empty_publishes_the_initial_adapter(tiny_student, teacher, tmp_path):
    everything_empty = CountingRollouts(eos_first_modulus=1)
    result = run(tiny_student, teacher, tmp_path, make_request(checkpoint_interval=1),
                 rollout_backend=everything_empty.factory)
    assert (result.status, result.steps, result.consumed_candidates, len(everything_empty.seeds)) == ("success", 0, 6, 6)
    assert result.latest_checkpoint is None and all(r.empty for r in stored(result))
    receipt = read_json(tmp_path / "train_receipt.json")
    assert receipt["opd"]["final_opd_loss"] is None and receipt["opd"]["action_tokens"] == 0


def test_kilns_checkpoint_structs_parse_an_on_policy_checkpoint(tiny_student, teacher, identity, tmp_path):
    import kiln_structs as kiln

    result = run(tiny_student, teacher, tmp_path, make_request(rollout_prompt_rendering="chat_template"),
                 rollout_backend=CountingRollouts(eos_first_modulus=3).factory)
    directory = tmp_path / result.latest_checkpoint
    manifest = kiln.TrainingCheckpointManifest.model_validate_json((directory / "checkpoint_manifest.json").read_text())
    loop = kiln.OpdCheckpointLoopState.model_validate_json((directory / "opd_loop_state.json").read_text())
    raw = read_json(directory / "checkpoint_manifest.json")
    assert set(manifest.auxiliary_state) == kiln.OPD_AUXILIARY_KEYS
    assert set(manifest.effective_config) == kiln.OPD_EFFECTIVE_CONFIG_KEYS
    assert manifest.effective_config["effective_samples_per_prompt"] == 2 and manifest.effective_config["effective_top_k"] == 16
    assert manifest.data.source_kind == "inline-on-policy-opd-candidate-order-v1" and manifest.data.item_count == 6
    assert manifest.data.content_sha256 == read_json(tmp_path / "train_receipt.json")["training_data"]["sha256"][7:]
    consumed = loop.epoch_index * 6 + loop.cursor_in_epoch
    assert raw["rng_states"] == {
        "lora-init": {"algorithm": "kiln.seeded-lora-init.v1", "seed": SEED, "position": 0},
        "rollout-sampling": {"algorithm": "kiln.opd-rollout-candidate.v1", "seed": SEED, "position": consumed}}
    assert manifest.progress.total_steps == 6 and loop.global_step <= consumed
    assert (loop.data_stats.examples_read, loop.data_stats.examples_filtered) == (4, 1)
    aux = manifest.auxiliary_state
    assert aux["prepared_source_indices"] == KEPT and aux["use_chat_template_rollout_prefixes"] is True
    assert aux["prepared_source_order_sha256"] == "sha256:" + hashlib.sha256(b"[0,1,3]").hexdigest()
    caps = kiln.LogitSourceCaps.model_validate(aux["teacher_capabilities"])
    assert caps.model_dump() == {"teacher_id": ALIAS, "vocab_size": 400, "max_top_k": 32, "supports_full_vocab": False,
                                 "supports_batched": True, "tokenizer_hash": identity.tokenizer_vocab_sha256}
    assert aux["teacher_content_revision"] == identity.identity_revision()


def test_cancellation_at_a_step_boundary_checkpoints_and_resumes(tiny_student, teacher, tmp_path):
    reference = run(tiny_student, teacher, tmp_path / "reference", make_request(checkpoint_interval=5))
    req = make_request(checkpoint_interval=5)
    reports = []
    cancelled = run(tiny_student, teacher, tmp_path / "run", req, on_progress=reports.append,
                    should_cancel=lambda: len(reports) >= 3)
    assert (cancelled.status, cancelled.steps, cancelled.failure_reason) == ("cancelled", 3, "cancelled")
    assert cancelled.latest_checkpoint == f"{ADAPTER}-checkpoint-step-00000003.kiln-checkpoint"
    receipt = read_json(tmp_path / "run" / "train_receipt.json")
    assert (receipt["status"], receipt["failure_reason"]) == ("failed", "cancelled")
    resumed = run(tiny_student, teacher, tmp_path / "run", req, resume_checkpoint=cancelled.latest_checkpoint)
    assert resumed.status == "success" and resumed.loss_history == reference.loss_history
    assert (tmp_path / "run/adapter/adapter_model.safetensors").read_bytes() == \
        (tmp_path / "reference/adapter/adapter_model.safetensors").read_bytes()


def test_refusals_happen_before_any_model_loads(tiny_student, identity, tmp_path):
    def never(top_k):
        raise AssertionError("the teacher must not load")

    source = TeacherSource(ALIAS, identity, never)
    cases = [
        (make_request(training_mode="off_policy"), {}, ConfigError, "invalid_config"),
        (make_request(sequences_per_step=2), {}, ConfigError, "unsupported"),
        (make_request(prompts=[chat("a", dummy=False)]), {}, Rejection, "no_valid_prompts"),
        (make_request(top_k=15), {}, Rejection, "top_k_unsupported"),
        (make_request(), {"resume_checkpoint": "../x.kiln-checkpoint"}, CheckpointError, "invalid_checkpoint_name"),
        (make_request(), {"resume_checkpoint": f"{ADAPTER}-checkpoint-step-00000002.kiln-checkpoint"}, CheckpointError,
         "checkpoint_not_found"),
    ]
    for req, kwargs, error, code in cases:
        with pytest.raises(error) as caught:
            run(tiny_student, source, tmp_path, req, **kwargs)
        assert caught.value.code == code, (code, caught.value)
    wider = TeacherSource(ALIAS, identity.model_copy(update={"vocab_size": 512}), never)
    with pytest.raises(Rejection) as caught:
        run(tiny_student, wider, tmp_path)
    assert caught.value.code == "teacher_vocab_mismatch"
    with pytest.raises(Rejection) as caught:
        req = make_request()
        train_on_policy(train_plan(req.config, str(tmp_path), ADAPTER, prompts=req.prompts, teacher=source), [],
                        student_dir=str(tiny_student), teacher=source)
    assert caught.value.code == "no_prompts"
    assert list(tmp_path.iterdir()) == []


def test_a_loaded_teacher_must_allow_the_runs_top_k(tiny_teacher, identity):
    narrow = identity.model_copy(update={"max_top_k": 16})
    loaded = LiveLocalTeacher.load(str(tiny_teacher), identity=narrow, top_k=16, device="cpu")
    with pytest.raises(Rejection) as caught:
        TeacherSource.loaded(loaded).load(32)
    assert caught.value.code == "top_k_exceeds_identity"
    assert TeacherSource.loaded(loaded).load(16) is loaded


def test_a_run_on_an_object_store_cancels_and_resumes(tiny_student, teacher):
    import uuid

    from kiln_core.storage import resolve

    root = f"memory://on-policy-{uuid.uuid4().hex[:8]}/runs/{ADAPTER}"
    reports = []
    cancelled = run(tiny_student, teacher, root, make_request(checkpoint_interval=None), on_progress=reports.append,
                    should_cancel=lambda: len(reports) >= 2)
    assert cancelled.status == "cancelled" and cancelled.latest_checkpoint.endswith("step-00000002.kiln-checkpoint")
    assert cancelled.rollout_root == f"{root}/rollouts" and len(stored(cancelled)) == 2
    resumed = run(tiny_student, teacher, root, make_request(checkpoint_interval=None),
                  resume_checkpoint=cancelled.latest_checkpoint)
    assert resumed.status == "success" and resumed.steps == 6 and resumed.rollouts_sampled == 4
    assert resolve(root).child("adapter", "adapter_model.safetensors").exists()


def test_activation_checkpointing_samples_and_trains_the_same(tiny_student, teacher, tmp_path):
    # the sampler's KV cache must survive activation checkpointing (transformers turns the cache off
    # for a checkpointed model that is training with gradients on)
    plain = run(tiny_student, teacher, tmp_path / "plain", make_request(checkpoint_interval=None))
    recompute = run(tiny_student, teacher, tmp_path / "recompute", make_request(checkpoint_interval=None),
                    gradient_checkpointing=True)
    assert [r.sampled_ids.tolist() for r in stored(recompute)] == [r.sampled_ids.tolist() for r in stored(plain)]
    assert (tmp_path / "recompute/adapter/adapter_model.safetensors").read_bytes() == \
        (tmp_path / "plain/adapter/adapter_model.safetensors").read_bytes()


def test_sigterm_stops_at_the_next_step_boundary_but_not_after_the_last_candidate(tiny_student, teacher, tmp_path):
    import os
    import signal

    def terminate_at_step_2(event):
        if event.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    stopped = run(tiny_student, teacher, tmp_path / "stopped", on_progress=terminate_at_step_2, handle_signals=True)
    assert (stopped.status, stopped.steps) == ("cancelled", 2) and signal.getsignal(signal.SIGTERM) is before
    # a stop asked for once every candidate is consumed changes nothing (Kiln: only while candidates remain)
    reports = []
    finished = run(tiny_student, teacher, tmp_path / "finished", make_request([chat("What is two plus two?")]),
                   on_progress=reports.append, should_cancel=lambda: reports[-1].consumed_candidates == 2)
    assert (finished.status, finished.steps, finished.latest_checkpoint) == ("success", 2, None)
