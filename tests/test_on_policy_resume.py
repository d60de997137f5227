"""Exact resume of on-policy training: interrupted anywhere, resumed from its checkpoint, same adapter bytes.

What a user depends on: a run stopped by an error after any step, or SIGKILLed mid-run, and resumed
from its newest checkpoint ends with a byte-identical ``adapter_model.safetensors`` on CPU and the same
losses and token counts as an uninterrupted run; the step counter, the candidate cursor and the
rollout stream position are restored separately (the runs here have empty rollouts, so they differ);
and rollouts committed before the interruption are read back, never sampled again.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from kiln_core.contracts.opd_config import parse_opd_request
from kiln_core.on_policy.store import RolloutStore
from kiln_core.on_policy.teacher import LiveLocalTeacher, TeacherSource
from kiln_core.training.checkpoint import latest_checkpoint
from kiln_core.training.on_policy_trainer import train_on_policy
from kill_support import sigkill_when
from on_policy_support import CountingRollouts
from plan_support import split_plan_options, train_plan
from test_on_policy_trainer import ADAPTER, ALIAS, PROMPTS
from test_trainer import Crash, crash_after

EOS_FIRST_MODULUS = 3  # about a third of the rollouts are empty: steps and candidates part ways
CANDIDATES = 12  # 3 kept prompts × 2 samples × 2 epochs, none skipped


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


def request_body() -> dict:
    return {"teacher": ALIAS, "prompts": PROMPTS,
            "config": dict(samples_per_prompt=2, max_tokens=6, top_k=16, lora_rank=4, lora_alpha=8.0, seed=23,
                           learning_rate=2e-2, checkpoint_interval=2, epochs=2)}


@pytest.fixture(scope="module")
def teacher(tiny_teacher) -> TeacherSource:
    from kiln_core.identity.local_teacher import local_teacher_identity

    identity = local_teacher_identity(str(tiny_teacher), max_top_k=32, device_kind="cpu")
    return TeacherSource.loaded(LiveLocalTeacher.load(str(tiny_teacher), identity=identity, top_k=16, device="cpu"),
                                ALIAS)


def run(student, teacher, root: Path, counting: CountingRollouts, **kwargs):
    req = parse_opd_request(request_body())
    torch.set_num_threads(1)
    plan_options, hooks = split_plan_options(kwargs)
    plan = train_plan(req.config, str(root), ADAPTER, prompts=req.prompts, teacher=teacher, **plan_options)
    return train_on_policy(plan, req.prompts, student_dir=str(student), teacher=teacher,
                           rollout_backend=counting.factory, **hooks)


@pytest.fixture(scope="module")
def reference(tiny_student, teacher, tmp_path_factory):
    root = tmp_path_factory.mktemp("on-policy-reference")
    result = run(tiny_student, teacher, root, CountingRollouts(EOS_FIRST_MODULUS))
    assert result.status == "success" and result.consumed_candidates == CANDIDATES
    assert 0 < result.steps < CANDIDATES  # some rollouts were empty
    return {"root": root, "result": result, "rollouts": RolloutStore(result.rollout_root).audit(result.rollout_run_key)}


def adapter_bytes(root: Path) -> bytes:
    return (root / "adapter" / "adapter_model.safetensors").read_bytes()


def receipt(root: Path) -> dict:
    return json.loads((root / "train_receipt.json").read_text())


def committed(root: Path, run_key: str) -> list:
    return RolloutStore(str(root / "rollouts")).audit(run_key)


def position(root: Path, basename: str | None) -> int:
    """Candidates a checkpoint had consumed (0 without one)."""
    if basename is None:
        return 0
    progress = json.loads((root / basename / "checkpoint_manifest.json").read_text())["progress"]
    return progress["epoch_index"] * 6 + progress["cursor_in_epoch"]


def assert_same_run(root: Path, final, reference) -> None:
    ref = reference["result"]
    assert final.status == "success" and final.steps == ref.steps and final.consumed_candidates == CANDIDATES
    assert adapter_bytes(root) == adapter_bytes(reference["root"])
    assert final.loss_history == ref.loss_history
    mine, theirs = receipt(root), receipt(reference["root"])
    assert mine["token_counts"] == theirs["token_counts"] and mine["opd"]["action_tokens"] == theirs["opd"]["action_tokens"]
    rollouts = committed(root, ref.rollout_run_key)  # every candidate once, token for token the reference's
    assert [r.key for r in rollouts] == [r.key for r in reference["rollouts"]]
    for a, b in zip(rollouts, reference["rollouts"]):
        np.testing.assert_array_equal(a.sampled_ids, b.sampled_ids)
        np.testing.assert_array_equal(a.teacher_logprobs, b.teacher_logprobs)


@pytest.mark.parametrize("crash_step", [1, 3, "last"])
def test_an_error_after_any_step_then_resume_is_bit_exact(tiny_student, teacher, reference, tmp_path, crash_step):
    step = reference["result"].steps if crash_step == "last" else crash_step
    with pytest.raises(Crash):
        run(tiny_student, teacher, tmp_path, CountingRollouts(EOS_FIRST_MODULUS), on_step_committed=crash_after(step))
    assert receipt(tmp_path)["failure_reason"] == "training_error" and not (tmp_path / "adapter").exists()
    run_key = reference["result"].rollout_run_key
    before = committed(tmp_path, run_key)
    checkpoint = latest_checkpoint(str(tmp_path), ADAPTER)  # None after step 1: the retry starts over
    assert (checkpoint is None) == (step < 2)
    counting = CountingRollouts(EOS_FIRST_MODULUS)
    final = run(tiny_student, teacher, tmp_path, counting, resume_checkpoint=checkpoint)
    assert final.resumed_from == checkpoint
    assert_same_run(tmp_path, final, reference)
    # what the interrupted attempt committed is read back, not sampled again
    start = position(tmp_path, checkpoint)
    assert len(counting.seeds) == final.rollouts_sampled == CANDIDATES - len(before)
    assert final.rollouts_reused == sum(1 for r in before if r.key.epoch * 6 + r.key.cursor >= start)
    assert final.rollouts_reused > 0 or crash_step == "last"  # the last step may have its own checkpoint


def test_two_interruptions_one_in_the_second_epoch(tiny_student, teacher, reference, tmp_path):
    steps = reference["result"].steps
    with pytest.raises(Crash):
        run(tiny_student, teacher, tmp_path, CountingRollouts(EOS_FIRST_MODULUS), on_step_committed=crash_after(3))
    first = latest_checkpoint(str(tmp_path), ADAPTER)
    with pytest.raises(Crash):
        run(tiny_student, teacher, tmp_path, CountingRollouts(EOS_FIRST_MODULUS), resume_checkpoint=first,
            on_step_committed=crash_after(steps - 1))
    second = latest_checkpoint(str(tmp_path), ADAPTER)
    assert position(tmp_path, second) >= 6  # in epoch 2
    loop = json.loads((tmp_path / second / "opd_loop_state.json").read_text())
    manifest = json.loads((tmp_path / second / "checkpoint_manifest.json").read_text())
    # three separate counters: steps < consumed candidates == stream position
    assert loop["global_step"] < position(tmp_path, second) == manifest["rng_states"]["rollout-sampling"]["position"]
    final = run(tiny_student, teacher, tmp_path, CountingRollouts(EOS_FIRST_MODULUS), resume_checkpoint=second)
    assert_same_run(tmp_path, final, reference)


def test_sigkill_mid_run_then_resume_is_bit_exact_and_reuses_committed_rollouts(tiny_student, tiny_teacher, teacher,
                                                                                reference, tmp_path):
    (tmp_path / "request.json").write_text(json.dumps(request_body()))
    killed = tmp_path / "killed"
    tests_dir = Path(__file__).parent
    # Event-driven, not timed: after step 5 (checkpoint 4 and a later rollout are committed by then) the
    # driver blocks on its stdin, which nothing writes, so the SIGKILL always lands in an unfinished run.
    driver = (
        "import json, sys, torch\n"
        "torch.set_num_threads(1)\n"
        f"sys.path.insert(0, {str(tests_dir)!r})\n"
        "from on_policy_support import CountingRollouts\n"
        "from plan_support import train_plan\n"
        "from kiln_core.contracts.opd_config import parse_opd_request\n"
        "from kiln_core.identity.local_teacher import local_teacher_identity\n"
        "from kiln_core.on_policy.teacher import TeacherSource\n"
        "from kiln_core.training.on_policy_trainer import train_on_policy\n"
        f"req = parse_opd_request(json.loads(open({str(tmp_path / 'request.json')!r}).read()))\n"
        f"identity = local_teacher_identity({str(tiny_teacher)!r}, max_top_k=32, device_kind='cpu')\n"
        f"teacher = TeacherSource.local({ALIAS!r}, identity, {str(tiny_teacher)!r}, device='cpu')\n"
        f"plan = train_plan(req.config, {str(killed)!r}, {ADAPTER!r}, prompts=req.prompts, teacher=teacher)\n"
        f"train_on_policy(plan, req.prompts, student_dir={str(tiny_student)!r}, teacher=teacher,\n"
        f"    rollout_backend=CountingRollouts({EOS_FIRST_MODULUS}).factory,\n"
        "    on_progress=lambda event: event.step >= 5 and sys.stdin.readline())\n"
    )
    run_key = reference["result"].rollout_run_key
    checkpoint = killed / f"{ADAPTER}-checkpoint-step-00000004.kiln-checkpoint"

    def a_rollout_after_the_checkpoint_is_committed() -> bool:
        return (checkpoint / "checkpoint_manifest.json").exists() and len(list(
            (killed / "rollouts" / run_key).glob("[!.]*/rollout.json"))) > position(killed, checkpoint.name)  # not staging

    sigkill_when(driver, a_rollout_after_the_checkpoint_is_committed, what="a checkpoint and a later rollout")
    assert not (killed / "adapter").exists() and not (killed / "train_receipt.json").exists()
    before = committed(killed, run_key)
    latest = latest_checkpoint(str(killed), ADAPTER)
    counting = CountingRollouts(EOS_FIRST_MODULUS)
    final = run(tiny_student, teacher, killed, counting, resume_checkpoint=latest)
    assert_same_run(killed, final, reference)
    assert len(counting.seeds) == CANDIDATES - len(before) and final.rollouts_reused >= 1
