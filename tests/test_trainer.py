"""The OPD trainer on the tiny student: learning, exact resume (exception, SIGKILL), cancel, NaN, ECHO."""

from __future__ import annotations

import json
import os
import signal
import uuid

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from kiln_core.contracts.opd_config import ConfigError, OpdConfig
from kiln_core.corpus import CorpusTables, TrainingExample
from kiln_core.storage import resolve
from kiln_core.training.checkpoint import CheckpointError, ResumeError, latest_checkpoint
from kiln_core.training.trainer import CANCEL_MESSAGE, train_opd
from kill_support import sigkill_when
from plan_support import split_plan_options, train_plan

DATASET_SHA = "sha256:" + "ab" * 32
ADAPTER = "demo"


class Crash(RuntimeError):
    """What ``crash_after`` raises: the test's own stand-in for a process dying after a step."""


def crash_after(step: int):
    """An ``on_step_committed`` callback that stops the run once ``step`` is committed."""
    def hook(committed: int) -> None:
        if committed == step:
            raise Crash(f"simulated crash after step {step}")
    return hook


def table_arrays(tables: CorpusTables) -> dict[str, np.ndarray]:
    """The array fields of ``tables`` (what ``np.savez`` can store for a subprocess)."""
    return {name: value for name in tables.__dataclass_fields__ if isinstance(value := getattr(tables, name), np.ndarray)}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny matrices: one thread (conftest)


def synthetic_tables(n: int = 6, k: int = 16, seed: int = 0, vocab: int = 400, nan_example: int | None = None) -> CorpusTables:
    """``n`` examples of 20-40 tokens; the teacher's top-K rows are valid (unique ids, sorted, mass < 1).

    The last 60% of each sequence are action targets; tokens 2-5 are observations, the first of them
    inside a warning prefix.
    """
    rng = np.random.default_rng(seed)
    examples = []
    for i in range(n):
        length = int(rng.integers(20, 41))
        ids = rng.integers(3, 380, size=length).astype(np.int32)
        actions = np.arange(length - int(length * 0.6), length, dtype=np.int32)
        teacher_ids = np.stack([rng.permutation(vocab)[:k] for _ in actions]).astype(np.int32)
        probs = np.sort(rng.dirichlet(np.full(k, 0.3)))[::-1] * 0.9
        logprobs = np.tile(np.log(probs).astype(np.float32), (len(actions), 1))
        if i == nan_example:
            logprobs[:] = -np.inf  # only a hand-built table can do this: admission refuses it
        examples.append(TrainingExample(
            index=i, line=i + 2, input_ids=ids, action_positions=actions,
            env_positions=np.arange(2, 6, dtype=np.int32), env_in_warning_prefix=np.array([True, False, False, False]),
            teacher_ids=teacher_ids, teacher_logprobs=logprobs))
    return CorpusTables.from_examples(examples, k)


def make_config(**overrides) -> OpdConfig:
    values = dict(training_mode="off_policy", top_k=16, lora_rank=4, lora_alpha=8.0, seed=11,
                  learning_rate=2e-2, checkpoint_interval=2, epochs=1)
    values.update(overrides)
    return OpdConfig.model_validate(values)


def run(student, root, config, tables=None, **kwargs):
    plan_options, hooks = split_plan_options(kwargs)
    return train_opd(train_plan(config, str(root), ADAPTER, **plan_options),
                     tables if tables is not None else synthetic_tables(), dataset_sha256=DATASET_SHA,
                     dataset_path="corpus.jsonl", student_dir=str(student), teacher_alias="tiny-teacher", **hooks)


def adapter_bytes(root) -> bytes:
    location = resolve(str(root)).child("adapter", "adapter_model.safetensors")
    return location.read_bytes()


def receipt(root) -> dict:
    return json.loads(resolve(str(root)).child("train_receipt.json").read_text())


def resume_from_latest(student, root, config, **kwargs):
    return run(student, root, config, resume_checkpoint=latest_checkpoint(resolve(str(root)), ADAPTER), **kwargs)


# ---------------------------------------------------------------------------------------------


def test_loss_falls_with_a_high_learning_rate(tiny_student, tmp_path):
    # Kiln's Muon moves every matrix by lr·sqrt(max(rows, cols)) per orthogonal direction: 5e-3 is hot here.
    result = run(tiny_student, tmp_path, make_config(epochs=4, learning_rate=5e-3, checkpoint_interval=None))
    assert result.status == "success" and result.steps == result.total_steps == 24
    first, last = np.mean(result.loss_history[:6]), np.mean(result.loss_history[-6:])
    assert last < 0.75 * first, (first, last)
    r = receipt(tmp_path)
    assert r["status"] == "success" and r["opd"]["final_opd_loss"] == result.loss_history[-1]
    assert r["token_counts"]["action_tokens"] == 4 * int(synthetic_tables().action_positions.shape[0])
    assert r["adapters"]["output"]["adapter_model_sha256"].startswith("sha256:")
    assert not any(name.endswith(".kiln-checkpoint") for name in os.listdir(tmp_path))


@pytest.mark.parametrize("optimizer", [{"kind": "muon"}, {"kind": "adam_w"}])
def test_two_interruptions_one_in_epoch_two_resume_bit_exactly(tiny_student, tmp_path, optimizer):
    config = make_config(epochs=2, optimizer=optimizer)  # 12 steps, a checkpoint every 2
    reference = run(tiny_student, tmp_path / "reference", config)
    # checkpoints at 2, 4, ..., 10; none at 12: the end publishes the adapter instead
    assert reference.latest_checkpoint == "demo-checkpoint-step-00000010.kiln-checkpoint"
    with pytest.raises(Crash):
        run(tiny_student, tmp_path / "resumed", config, on_step_committed=crash_after(3))
    assert receipt(tmp_path / "resumed")["failure_reason"] == "training_error"
    assert latest_checkpoint(resolve(str(tmp_path / "resumed")), ADAPTER) == "demo-checkpoint-step-00000002.kiln-checkpoint"
    with pytest.raises(Crash):
        resume_from_latest(tiny_student, tmp_path / "resumed", config, on_step_committed=crash_after(9))  # epoch 2 (steps 7-12)
    assert latest_checkpoint(resolve(str(tmp_path / "resumed")), ADAPTER) == "demo-checkpoint-step-00000008.kiln-checkpoint"
    final = resume_from_latest(tiny_student, tmp_path / "resumed", config)
    assert final.status == "success" and final.resumed_from == "demo-checkpoint-step-00000008.kiln-checkpoint"
    assert adapter_bytes(tmp_path / "resumed") == adapter_bytes(tmp_path / "reference")
    assert final.loss_history == reference.loss_history
    assert receipt(tmp_path / "resumed")["token_counts"] == receipt(tmp_path / "reference")["token_counts"]


def test_sigkill_after_a_checkpoint_then_resume_is_bit_exact(tiny_student, tmp_path):
    config = make_config(epochs=2)
    reference = run(tiny_student, tmp_path / "reference", config)
    tables = synthetic_tables()
    np.savez(tmp_path / "tables.npz", **table_arrays(tables))
    killed = tmp_path / "killed"
    # Event-driven, not timed: the driver blocks on its (never written) stdin after step 5, that is
    # after checkpoint 4 is committed, so the SIGKILL below always lands in an unfinished run.
    driver = (
        "import sys, numpy as np, torch\n"
        "torch.set_num_threads(1)\n"
        "from kiln_core.corpus import CorpusTables\n"
        "from kiln_core.contracts.stage_refs import TrainPlan\n"
        "from kiln_core.training.trainer import train_opd\n"
        f"data = np.load({str(tmp_path / 'tables.npz')!r})\n"
        "tables = CorpusTables(**{k: data[k] for k in data.files})\n"
        f"plan = TrainPlan.model_validate_json({train_plan(config, str(killed), ADAPTER).model_dump_json()!r})\n"
        f"train_opd(plan, tables, dataset_sha256={DATASET_SHA!r}, dataset_path='corpus.jsonl',\n"
        f"    student_dir={str(tiny_student)!r}, teacher_alias='tiny-teacher',\n"
        "    on_progress=lambda step, total, loss: step >= 5 and sys.stdin.readline())\n"
    )
    manifest = killed / "demo-checkpoint-step-00000004.kiln-checkpoint" / "checkpoint_manifest.json"
    sigkill_when(driver, manifest.exists, what="a checkpoint at step 4")
    assert not (killed / "adapter").exists() and not (killed / "train_receipt.json").exists()
    final = resume_from_latest(tiny_student, killed, config)
    assert final.status == "success" and final.resumed_from is not None
    assert adapter_bytes(killed) == adapter_bytes(tmp_path / "reference")
    assert final.loss_history == reference.loss_history


def test_cancellation_publishes_a_checkpoint_and_a_cancelled_receipt(tiny_student, tmp_path):
    config = make_config(checkpoint_interval=5)
    seen = []
    result = run(tiny_student, tmp_path, config, on_progress=lambda s, t, loss: seen.append(s), should_cancel=lambda: len(seen) >= 3)
    assert result.status == "cancelled" and result.steps == 3
    # the receipt says it was cancelled and which checkpoint a retry resumes from
    kept = f"{CANCEL_MESSAGE}; checkpoint demo-checkpoint-step-00000003.kiln-checkpoint kept (a retry resumes from it)"
    assert result.failure_reason == "cancelled" and result.failure_message == kept
    assert result.latest_checkpoint == "demo-checkpoint-step-00000003.kiln-checkpoint"
    r = receipt(tmp_path)
    assert (r["status"], r["failure_reason"], r["failure_message"]) == ("failed", "cancelled", kept)
    assert r["adapters"]["output"] == {"path": None, "adapter_model_sha256": None, "adapter_model_bytes": None}
    assert not (tmp_path / "adapter").exists()
    resumed = resume_from_latest(tiny_student, tmp_path, config)
    assert resumed.status == "success" and resumed.steps == 6


def test_sigterm_is_a_cooperative_cancel(tiny_student, tmp_path):
    def progress(step, total, loss):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    result = run(tiny_student, tmp_path, make_config(checkpoint_interval=None), on_progress=progress, handle_signals=True)
    assert result.status == "cancelled" and result.steps == 2
    assert result.latest_checkpoint == "demo-checkpoint-step-00000002.kiln-checkpoint"
    assert signal.getsignal(signal.SIGTERM) is before


class TerminationSignal(BaseException):
    """The test's own stand-in for Prefect's: in a worker's run, SIGTERM raises a ``BaseException``."""


def test_a_termination_signal_raised_mid_run_writes_a_cancelled_receipt_and_propagates(tiny_student, tmp_path):
    """A worker's cancel (``tasks/train.py``): the signal's exception stops training at once, the receipt
    says ``cancelled`` (not ``training_error``), the exception still reaches the caller (Prefect then
    ends the run Cancelled), and a retry resumes from the newest committed checkpoint."""
    config = make_config(checkpoint_interval=2)

    def progress(step, total, loss):
        if step == 3:
            raise TerminationSignal("SIGTERM")

    with pytest.raises(TerminationSignal):
        run(tiny_student, tmp_path, config, on_progress=progress)
    r = receipt(tmp_path)
    assert (r["status"], r["failure_reason"]) == ("failed", "cancelled")
    # not "TerminationSignal: SIGTERM": what stopped it, and the checkpoint a retry resumes from
    assert r["failure_message"] == ("training cancelled after step 3 by TerminationSignal (SIGTERM); checkpoint "
                                    "demo-checkpoint-step-00000002.kiln-checkpoint kept (a retry resumes from it)")
    assert not (tmp_path / "adapter").exists()
    assert latest_checkpoint(resolve(str(tmp_path)), ADAPTER) == "demo-checkpoint-step-00000002.kiln-checkpoint"
    resumed = resume_from_latest(tiny_student, tmp_path, config)
    assert resumed.status == "success" and resumed.resumed_from == "demo-checkpoint-step-00000002.kiln-checkpoint"


def test_non_finite_loss_fails_with_nan_loss(tiny_student, tmp_path):
    result = run(tiny_student, tmp_path, make_config(checkpoint_interval=None), tables=synthetic_tables(nan_example=2))
    assert result.status == "failed" and result.failure_reason == "nan_loss" and result.steps == 2
    assert result.failure_message == "OPD loss became non-finite at candidate 2"
    r = receipt(tmp_path)
    assert (r["status"], r["failure_reason"]) == ("failed", "nan_loss")
    assert not (tmp_path / "adapter").exists()


def test_published_adapter_loads_with_peft(tiny_student, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    run(tiny_student, tmp_path, make_config(checkpoint_interval=None))
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(str(tiny_student), dtype=torch.float32)
    ids = torch.tensor([[5, 17, 42, 99, 7]])
    with torch.no_grad():
        before = base(ids).logits
    model = PeftModel.from_pretrained(base, str(tmp_path / "adapter"))
    loaded = {name.replace(".default", ""): p for name, p in model.named_parameters() if "lora_" in name}
    assert set(saved) == set(loaded)
    assert all(torch.equal(saved[name], loaded[name].detach()) for name in saved)
    with torch.no_grad():
        assert not torch.allclose(model(ids).logits, before)


@pytest.mark.parametrize("mode, filtered", [("env_only", 6), ("full_obs", 0)])
def test_echo_term_fires_and_counts_warning_filtered_tokens(tiny_student, tmp_path, mode, filtered):
    plain = run(tiny_student, tmp_path / "plain", make_config(checkpoint_interval=None))
    echo = run(tiny_student, tmp_path / "echo", make_config(checkpoint_interval=None, echo={"lambda": 0.5, "env_mask_mode": mode}))
    assert echo.status == "success"
    assert echo.loss_history[0] > plain.loss_history[0]  # λ·env_CE is added to the same KL
    r = receipt(tmp_path / "echo")
    assert r["echo"]["enabled"] and r["opd"]["echo_combined"] and r["echo"]["final_env_ce"] > 0
    counts = r["token_counts"]
    # Kiln's TokenCountReceipt: env_tokens is the active env-CE count, after the warning filter.
    assert counts["env_tokens_before_warning_filter"] == 24
    assert counts["env_tokens"] == counts["env_tokens_after_warning_filter"] == 24 - filtered
    assert counts["warning_tokens_filtered"] == filtered
    zero = run(tiny_student, tmp_path / "zero", make_config(checkpoint_interval=None, echo={"lambda": 0.0}))
    assert zero.loss_history == plain.loss_history
    assert receipt(tmp_path / "zero")["echo"]["dropped_reason"] == "echo.lambda is 0"


@pytest.mark.parametrize("optimizer", [{"kind": "muon"}, {"kind": "adam_w"}, {"kind": "sgd"}])
def test_each_optimizer_runs_a_step(tiny_student, tmp_path, optimizer):
    result = run(tiny_student, tmp_path, make_config(optimizer=optimizer, checkpoint_interval=1, learning_rate=None),
                 tables=synthetic_tables(n=2))
    assert result.status == "success" and result.steps == 2
    ckpt_dir = tmp_path / "demo-checkpoint-step-00000001.kiln-checkpoint"
    assert (ckpt_dir / "optimizer.safetensors").exists() == (optimizer["kind"] != "sgd")
    lora_b = [t for name, t in load_file(tmp_path / "adapter" / "adapter_model.safetensors").items() if "lora_B" in name]
    assert any(bool(t.abs().sum() > 0) for t in lora_b)  # B starts at zero; a step moved it
    assert receipt(tmp_path)["hyperparameters"]["learning_rate"] == (2e-3 if optimizer["kind"] == "muon" else 1e-5)


def test_sequences_per_step_accumulates_and_resumes_exactly(tiny_student, tmp_path):
    config = make_config(sequences_per_step=4, checkpoint_interval=1)  # 6 candidates -> steps of 4 and 2
    reference = run(tiny_student, tmp_path / "reference", config)
    assert reference.status == "success" and reference.total_steps == 2 and len(reference.loss_history) == 2
    manifest = json.loads((tmp_path / "reference" / "demo-checkpoint-step-00000001.kiln-checkpoint" / "checkpoint_manifest.json").read_text())
    assert (manifest["progress"]["epoch_index"], manifest["progress"]["cursor_in_epoch"]) == (0, 4)
    assert "sequences_per_step" not in manifest["effective_config"]  # ours, not Kiln's: in the extension file
    extension = json.loads((tmp_path / "reference" / "demo-checkpoint-step-00000001.kiln-checkpoint" / "kiln_flows_state.json").read_text())
    assert (extension["sequences_per_step"], extension["world_size"], extension["optimizer_steps_total"]) == (4, 1, 2)
    with pytest.raises(Crash):
        run(tiny_student, tmp_path / "resumed", config, on_step_committed=crash_after(1))
    resume_from_latest(tiny_student, tmp_path / "resumed", config)
    assert adapter_bytes(tmp_path / "resumed") == adapter_bytes(tmp_path / "reference")


def test_tail_loss_and_detect_anomaly_run(tiny_student, tmp_path):
    result = run(tiny_student, tmp_path, make_config(loss="teacher_top_k_tail", detect_anomaly=True, checkpoint_interval=None),
                 tables=synthetic_tables(n=2))
    assert result.status == "success" and all(np.isfinite(result.loss_history))
    assert receipt(tmp_path)["opd"]["loss"] == "teacher_top_k_tail"


def test_refusals_happen_before_any_training(tiny_student, tmp_path):
    config = make_config()
    with pytest.raises(CheckpointError) as caught:
        run(tiny_student, tmp_path, config, resume_checkpoint="../demo-checkpoint-step-00000002.kiln-checkpoint")
    assert caught.value.code == "invalid_checkpoint_name" and not tmp_path.joinpath("train_receipt.json").exists()
    with pytest.raises(ConfigError):
        run(tiny_student, tmp_path, make_config(top_k=32))  # tables were admitted at K=16
    with pytest.raises(Crash):
        run(tiny_student, tmp_path, config, on_step_committed=crash_after(3))
    with pytest.raises(ResumeError, match="effective OPD configuration differs"):
        resume_from_latest(tiny_student, tmp_path, make_config(learning_rate=1e-2))
    with pytest.raises(ResumeError, match="OPD resume seed 11 differs from requested seed 12"):
        resume_from_latest(tiny_student, tmp_path, make_config(seed=12))
    with pytest.raises(ConfigError, match="already holds checkpoint"):
        run(tiny_student, tmp_path, config)  # a fresh run would overwrite step 2
    inherited = resume_from_latest(tiny_student, tmp_path, make_config(seed=None))
    assert inherited.status == "success" and inherited.effective_seed == 11
    with pytest.raises(ConfigError, match="already published"):
        run(tiny_student, tmp_path, make_config(checkpoint_interval=None))


def test_memory_filesystem_run_and_resume(tiny_student):
    root = f"memory://train-{uuid.uuid4().hex}/runs/{ADAPTER}"
    config = make_config(checkpoint_interval=2)
    with pytest.raises(Crash):
        run(tiny_student, root, config, on_step_committed=crash_after(3))
    final = resume_from_latest(tiny_student, root, config)
    assert final.status == "success" and final.adapter == root + "/adapter"
    assert final.receipt == root + "/train_receipt.json"
    assert receipt(root)["status"] == "success" and len(adapter_bytes(root)) > 0


def test_gradient_checkpointing_gives_the_same_adapter(tiny_student, tmp_path):
    config = make_config(checkpoint_interval=None)
    run(tiny_student, tmp_path / "plain", config, tables=synthetic_tables(n=3))
    run(tiny_student, tmp_path / "recompute", config, tables=synthetic_tables(n=3), gradient_checkpointing=True)
    assert adapter_bytes(tmp_path / "recompute") == adapter_bytes(tmp_path / "plain")


def test_non_finite_parameters_after_a_step_fail_with_nan_loss(tiny_student, tmp_path, monkeypatch):
    import kiln_core.training.lifecycle as lifecycle  # where both loops build their optimizer

    real_build = lifecycle.build_optimizer

    def poisoned_optimizer(spec, params, lr):
        optimizer = real_build(spec, params, lr)
        real_step = optimizer.step

        def step(*args, **kwargs):
            real_step(*args, **kwargs)
            with torch.no_grad():  # what an exploding update looks like after the fact
                next(iter(params.values())).fill_(float("inf"))

        optimizer.step = step
        return optimizer

    monkeypatch.setattr(lifecycle, "build_optimizer", poisoned_optimizer)
    result = run(tiny_student, tmp_path, make_config(checkpoint_interval=None), tables=synthetic_tables(n=2))
    assert (result.status, result.failure_reason) == ("failed", "nan_loss")
    assert result.failure_message == "OPD LoRA parameters became non-finite after step 1"
    assert receipt(tmp_path)["failure_reason"] == "nan_loss"


def test_hidden_states_are_post_norm_rows_of_the_logits(tiny_student):
    from kiln_core.training.student import load_student

    student = load_student(str(tiny_student), rank=4, alpha=8.0, seed=0, device="cpu")
    ids = torch.tensor([5, 17, 42, 99, 7, 250])
    with torch.no_grad():
        hidden = student.hidden_states(ids)  # [L, H]
        logits = student.model(input_ids=ids[None]).logits[0]  # [L, V], what generation would see
    torch.testing.assert_close(student.logit_head.logits(hidden), logits, rtol=1e-5, atol=1e-5)
    names = list(student.lora_parameters)
    assert names == sorted(names) and all(".lora_A." in n or ".lora_B." in n for n in names)
    modules = {n.split(".")[-4] for n in names}
    assert modules == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    again = load_student(str(tiny_student), rank=4, alpha=8.0, seed=0, device="cpu")
    assert all(torch.equal(p, again.lora_parameters[n]) for n, p in student.lora_parameters.items())
    other = load_student(str(tiny_student), rank=4, alpha=8.0, seed=1, device="cpu")
    assert not torch.equal(student.lora_parameters[names[0]], other.lora_parameters[names[0]])
