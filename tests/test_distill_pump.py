"""``kiln-flows distill pump`` and the ``distill_pump`` flow: Kiln's ``/v1/distill/pump`` on the engine path.

What a user depends on: every Kiln submit-time rule of the route refuses its request with Kiln's text, a
stable code and the field (exit 2), before any model loads; the teacher is a registered alias, pinned
(changed files are refused); ``examples`` train off-policy (the scored rows equal ``kiln-flows score`` of
the same examples) or on-policy, ``domain``/``wide`` train on-policy on a user-supplied prompt bank and
are refused without one; ``rank`` replaces ``config.lora_rank``; the receipts name the recipe, the mode,
the teacher identity and the whole request; a vLLM teacher scores off-policy examples; the flow runs it
on a Prefect server and fails a bad request with one line.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from flows.cli import main
from kiln_core.contracts.distill_pump import check_distill_pump_request
from kiln_core.errors import Rejection

ALIAS = "big-teacher"
KILN_SEED_TEXT = ("distill/pump domain and wide seed modes require on_policy training; off_policy requires explicit "
                  "examples with assistant actions")
TRAIN = {"top_k": 16, "lora_rank": 4, "lora_alpha": 8.0, "seed": 3, "learning_rate": 0.02, "checkpoint_interval": 10}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


ANSWERED = [{"messages": [user("What is two plus two?"), assistant("Four.")]},
            {"messages": [{"role": "system", "content": "Be brief."}, user("Name a colour."), assistant("Blue.")]}]
QUESTIONS = [{"messages": [user("What is two plus two?")]}, {"messages": [user("Name a colour."), assistant("")]}]


def body(**overrides) -> dict:
    return {"name": "pump", "teacher": ALIAS, "mode": {"examples": ANSWERED}, **overrides}


def rejection(value) -> Rejection:
    with pytest.raises(Rejection) as caught:
        check_distill_pump_request(value, file="pump.json")
    return caught.value


# ------------------------------------------------------------------------------------------ request rules (fast)


@pytest.mark.parametrize(("value", "code", "field", "text"), [
    ([], "invalid_request", None, "must be a JSON object"),
    (body(rnak=4), "invalid_request", "rnak", "did you mean `rank`?"),
    (body(config={"lora_rnak": 4}), "invalid_request", "config.lora_rnak", "did you mean `lora_rank`?"),
    (body(mode=["math"]), "invalid_request", "mode", "must be one of"),
    (body(mode={"domain": "math", "examples": ANSWERED}), "invalid_request", "mode", "names `domain` and `examples`"),
    (body(mode={}), "invalid_request", "mode", "names none of them"),
    (body(mode={"domain": "math", "domian": "x"}), "invalid_request", "mode.domian", "unknown key"),
    (body(mode={"domain": 3}), "invalid_request", "mode.domain", "Input should be a valid string"),
    (body(rollout_budget=-1), "invalid_request", "rollout_budget", "greater than or equal to 0"),
    (body(name=" "), "invalid_request", "name", "distill/pump requires non-empty name and teacher"),
    (body(teacher=""), "invalid_request", "teacher", "distill/pump requires non-empty name and teacher"),
    (body(name="a b"), "invalid_adapter_name", "name", "must be 1-128 characters"),
    (body(post_eval={"suite": "s", "min_accuracy": 2.0}), "post_eval_min_accuracy_out_of_range",
     "post_eval.min_accuracy", "must be finite and in [0.0, 1.0]"),
    (body(config={"loss": "sampled_token"}), "invalid_config", "config.loss", "sampled_token is unsupported"),
    (body(rank=4, config={"lora_alpha": 32.0}), "unsafe_lora_scale", "config.lora_alpha", "alpha/rank = 8.000"),
    (body(rank=0), "invalid_config", "rank", "distill/pump rank 0"),
    (body(mode={"domain": "math"}, config={"training_mode": "off_policy"}), "seed_mode_requires_on_policy",
     "config.training_mode", KILN_SEED_TEXT),
    (body(mode={"wide": False}, config={"training_mode": "off_policy"}), "seed_mode_requires_on_policy",
     "config.training_mode", KILN_SEED_TEXT),
    (body(mode={"examples": []}), "no_prompts", "mode.examples", "distill/pump requires at least one prompt"),
    (body(mode={"examples": [ANSWERED[0], {"messages": []}]}), "prompt_no_messages", "mode.examples[1].messages",
     "distill/pump prompt 1 has no messages"),
    (body(mode={"examples": QUESTIONS}, config={"training_mode": "off_policy"}), "prompt_no_action",
     "mode.examples[0]", "distill/pump prompt 0 requires a non-empty assistant action for off-policy scoring"),
    (body(mode={"examples": [{"messages": [user("q"), assistant("a"), user("and?")]}]},
          config={"training_mode": "off_policy"}), "prompt_not_trainable", "mode.examples[0].messages",
     "distill/pump prompt 0 has an assistant turn but does not end with one"),
    (body(mode={"examples": [{**ANSWERED[0], "teacher_extra_messages": [user("hint")]}]},
          config={"training_mode": "off_policy"}), "prompt_not_trainable",
     "mode.examples[0].teacher_extra_messages", "teacher-only context"),
])
def test_each_submit_rule_names_its_code_field_and_kiln_text(value, code, field, text):
    error = rejection(value)
    assert (error.code, error.field) == (code, field), error.describe()
    assert text in error.message


def test_kiln_defaults_and_what_the_request_accepts():
    request = check_distill_pump_request(body(mode={"wide": False}))
    assert request.mode_name == "wide"  # {"wide": false} still selects wide: the bool is never read
    assert (request.rollout_budget, request.use_cache, request.rank) == (50000, True, None)
    assert request.config.training_mode == "on_policy"  # the plain OpdConfig default, not off_policy
    assert request.kiln_value()["mode"] == {"wide": False}
    assert check_distill_pump_request(body()).kiln_value()["mode"] == {"examples": ANSWERED}  # as Kiln re-serializes
    # on-policy examples need no assistant action; rank replaces lora_rank for the LoRA-scale check
    check_distill_pump_request(body(mode={"examples": QUESTIONS}))
    from kiln_core.contracts.distill_pump import effective_pump_config

    ranked = check_distill_pump_request(body(rank=64, config={"lora_rank": 1, "lora_alpha": 32.0}))
    assert effective_pump_config(ranked).lora_rank == 64 and ranked.config.lora_rank == 1


# ------------------------------------------------------------------------------------------ files and CLI refusals


@pytest.fixture(scope="module")
def root(tiny_teacher, tmp_path_factory) -> Path:
    """A storage root whose registry holds the tiny teacher under ``ALIAS``."""
    directory = tmp_path_factory.mktemp("pump-root")
    assert main(["teachers", "register", ALIAS, str(tiny_teacher), "--out", str(directory), "--device", "cpu",
                 "--json"]) == 0
    return directory


def write(directory: Path, value, name: str = "pump.json") -> str:
    path = directory / name
    path.write_text(json.dumps(value), encoding="utf-8")
    return str(path)


def pump(capsys, *argv) -> tuple[int, dict | None, str]:
    code = main(["distill", "pump", *argv, "--json"])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, (json.loads(lines[-1]) if lines else None), captured.err


def test_an_unregistered_alias_is_refused_with_kilns_text(tiny_student, root, tmp_path, capsys):
    request = write(tmp_path, body(teacher="nobody"))
    code, error, _ = pump(capsys, "--request", request, "--student", str(tiny_student), "--out", str(root))
    assert code == 2 and error["code"] == "teacher_not_registered" and error["field"] == "teacher"
    assert error["message"].startswith("distill/pump: teacher alias 'nobody' is not registered")


def test_domain_and_wide_need_a_prompt_bank(tiny_student, root, tmp_path, capsys):
    for mode, named in (({"domain": "math"}, "domain 'math'"), ({"wide": True}, "wide")):
        request = write(tmp_path, body(mode=mode))
        code, error, _ = pump(capsys, "--request", request, "--student", str(tiny_student), "--out", str(root))
        assert code == 2 and error["code"] == "pump_prompt_bank_required" and error["field"] == "prompt_bank"
        assert named in error["message"] and "--prompt-bank FILE" in error["message"]
    assert not (root / "runs").exists()


def test_examples_refuse_a_prompt_bank(tiny_student, root, tmp_path, capsys):
    bank = tmp_path / "bank.jsonl"
    bank.write_text(json.dumps({"messages": [user("hi")]}) + "\n")
    code, error, _ = pump(capsys, "--request", write(tmp_path, body()), "--student", str(tiny_student), "--out",
                          str(root), "--prompt-bank", str(bank))
    assert code == 2 and error["code"] == "invalid_option" and error["field"] == "prompt_bank"


def test_a_bad_prompt_bank_line_is_refused_with_its_line(tiny_student, root, tmp_path, capsys):
    bank = tmp_path / "bank.jsonl"
    bank.write_text(json.dumps({"messages": [user("hi")]}) + "\n\n{\"messages\": []}\n")
    code, error, _ = pump(capsys, "--request", write(tmp_path, body(mode={"domain": "math"})), "--student",
                          str(tiny_student), "--out", str(root), "--prompt-bank", str(bank))
    assert code == 2 and error["code"] == "prompt_no_messages" and error["line"] == 3


def test_a_vllm_teacher_never_runs_on_policy(tiny_student, root, tmp_path, capsys):
    """Kiln's rule: remote logits are prefetched. An explicit on_policy and domain/wide are refused."""
    for value in (body(config={"training_mode": "on_policy"}), body(mode={"domain": "math"})):
        code, error, _ = pump(capsys, "--request", write(tmp_path, value), "--student", str(tiny_student), "--out",
                              str(root), "--vllm-teacher", "http://127.0.0.1:9")
        assert code == 2 and error["code"] == "remote_teacher_on_policy"
        assert error["message"].startswith('distill/pump cannot use a remote teacher with training_mode="on_policy"')


def test_a_teacher_changed_since_registration_is_refused(tiny_teacher, tiny_student, tmp_path, capsys):
    import shutil

    from safetensors.torch import load_file, save_file

    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_teacher, teacher)
    storage = tmp_path / "root"
    assert main(["teachers", "register", ALIAS, str(teacher), "--out", str(storage), "--device", "cpu"]) == 0
    weights = next(teacher.glob("*.safetensors"))
    tensors = load_file(weights)
    first = next(iter(tensors))
    tensors[first] = tensors[first] + 1.0
    save_file(tensors, weights, metadata={"format": "pt"})
    capsys.readouterr()
    code, error, _ = pump(capsys, "--request", write(tmp_path, body()), "--student", str(tiny_student), "--out",
                          str(storage))
    assert code == 2 and error["code"] == "teacher_identity_mismatch" and "base_model_sha256" in error["message"]
    assert not (storage / "runs").exists()


def test_a_lora_teacher_whose_adapter_was_rewritten_is_refused_with_kilns_text(tiny_student, tmp_path, capsys):
    """A registered local teacher wearing a LoRA is pinned to its adapter digests (Kiln's identity rule)."""
    from test_base_adapter import write_adapter

    adapter = write_adapter(tiny_student, tmp_path / "lora", seed=11)
    storage = tmp_path / "root"
    assert main(["teachers", "register", "lora-teacher", str(adapter), "--out", str(storage), "--device", "cpu"]) == 0
    registered = read_json(storage / "teachers.json")["teachers"][0]["identity"]["adapter"]
    assert registered["name"] == "lora-teacher" and len(registered["weights_sha256"]) == 64
    rewritten = write_adapter(tiny_student, tmp_path / "other", seed=12) / "adapter_model.safetensors"
    (adapter / "adapter_model.safetensors").write_bytes(rewritten.read_bytes())
    capsys.readouterr()
    code, error, _ = pump(capsys, "--request", write(tmp_path, body(teacher="lora-teacher")), "--student",
                          str(tiny_student), "--out", str(storage))
    assert code == 2 and error["code"] == "teacher_identity_mismatch"
    assert error["message"] == (f"teacher 'lora-teacher' is pinned to adapter 'lora-teacher', but the exact registered "
                                f"content could not be loaded from {adapter.resolve()}; re-register after any adapter "
                                "rewrite")


def test_help_and_a_rejected_request_load_neither_torch_nor_prefect(tmp_path):
    bad = write(tmp_path, body(mode={"wide": True}, config={"training_mode": "off_policy"}))
    script = ("import sys\nfrom flows.cli import main\n"
              f"code = main(['distill', 'pump', '--request', {bad!r}, '--student', 'x', '--json'])\n"
              "print(code, 'torch' in sys.modules, 'prefect' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).resolve().parents[1])
    error, verdict = done.stdout.strip().splitlines()
    assert json.loads(error)["code"] == "seed_mode_requires_on_policy" and verdict == "2 False False"


def test_samples_per_prompt_follows_kilns_rule_for_the_bank(tiny_student, root, tmp_path):
    """Default S on-policy: 64 below 50 prompts (the bank's count); off-policy: each example once."""
    from kiln_core.contracts.opd_config import effective_samples_per_prompt
    from kiln_core.engine.pipeline import LocalStages, resolve_settings
    from kiln_core.recipes.distill_pump import prepare_distill_pump
    from kiln_core.training.lora_targets import resolve_lora_targets

    bank = tmp_path / "bank.jsonl"
    bank.write_text("".join(json.dumps({"messages": [user(f"Question {i}?")]}) + "\n" for i in range(3)))
    warnings: list[str] = []
    request = check_distill_pump_request(body(mode={"domain": "any-name-at-all"}, config={"top_k": 16, "max_tokens": 8}))
    spec = prepare_distill_pump(request, student_dir=str(tiny_student), out_root=str(root), prompt_bank=str(bank),
                                on_warning=warnings.append)
    stages = LocalStages()
    manifest = stages.manifest(spec.teacher, spec.storage_root, 32)
    settings = resolve_settings(spec, manifest, resolve_lora_targets(str(tiny_student)))
    assert settings.samples_per_prompt == 64  # Kiln's default 4, auto-scaled from the 3 prompts
    prompts = stages.prompts(spec, manifest, settings, str(tiny_student))
    assert prompts.samples_per_prompt == 64 and prompts.examples == 3
    assert spec.recipe.mode == "domain" and spec.recipe.request["mode"] == {"domain": "any-name-at-all"}
    assert warnings == ["distill/pump: 3 of 3 prompts had no assistant turn; each ends with Kiln's empty assistant "
                        "turn, where the student's rollout starts"]
    off = check_distill_pump_request(body(config={"training_mode": "off_policy"}))
    assert effective_samples_per_prompt(off.config) == 1


# ------------------------------------------------------------------------------------------ end to end (tiny models)


def read_json(path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


@pytest.mark.usefixtures("one_torch_thread")
def test_off_policy_examples_train_with_the_scores_of_kiln_flows_score(tiny_student, root, tmp_path, capsys):
    request = write(tmp_path, body(name="pump-off", rank=4, rollout_budget=7, config={**TRAIN, "lora_rank": 16,
                                                                                       "training_mode": "off_policy"}))
    code, result, _ = pump(capsys, "--request", request, "--student", str(tiny_student), "--out", str(root),
                           "--device", "cpu")
    assert code == 0 and result["status"] == "success" and result["total_steps"] == 2  # each example once
    run = Path(result["run"])
    receipt = read_json(run / "train_receipt.json")
    assert receipt["config"]["lora_rank"] == 4  # rank replaced config.lora_rank
    assert read_json(run / "adapter" / "adapter_config.json")["r"] == 4
    registered = next(e for e in read_json(root / "teachers.json")["teachers"] if e["alias"] == ALIAS)
    recipe = receipt["recipe"]
    assert (recipe["kind"], recipe["mode"], recipe["name"]) == ("distill_pump", "examples", "pump-off")
    assert recipe["teacher"] == {"alias": ALIAS, "model_id": registered["identity"]["served_model_id"],
                                 "model_version_hash": registered["identity_revision"],
                                 "identity": registered["identity"]}
    assert recipe["teacher_identity_revision"] == registered["identity_revision"]
    assert recipe["request"]["rank"] == 4 and recipe["request"]["rollout_budget"] == 7
    assert recipe["request"]["use_cache"] is True and recipe["request"]["config"]["lora_rank"] == 16
    kiln = read_json(run / "adapter" / "receipt.json")
    assert kiln["source_kind"] == "distill_pump" and kiln["adapter"] == "pump-off" and kiln["seed"] == 3
    assert kiln["teacher"] == recipe["teacher"] and kiln["hyperparameters"] == recipe["request"]

    # The corpus the run trained on holds what `kiln-flows score` writes for the same examples.
    examples = tmp_path / "examples.jsonl"
    examples.write_text("".join(json.dumps({"messages": e["messages"][:-1], "teacher_response": e["messages"][-1]
                                            ["content"]}) + "\n" for e in ANSWERED))
    scored = tmp_path / "scored.jsonl"
    assert main(["score", str(examples), "--teacher", ALIAS, "--registry", str(root), "--student", str(tiny_student),
                 "--top-k", "16", "--out", str(scored), "--device", "cpu", "--quiet"]) == 0
    (trained,) = (root / "scored").glob("*.jsonl")
    ours, theirs = trained.read_text().splitlines(), scored.read_text().splitlines()
    assert ours[0] == theirs[0] and len(ours) == len(theirs) == 3
    for mine, reference in zip(ours[1:], theirs[1:]):
        assert json.loads(mine)["teacher_tokens"] == json.loads(reference)["teacher_tokens"]


@pytest.mark.usefixtures("one_torch_thread")
def test_on_policy_examples_train_on_policy(tiny_student, root, tmp_path, capsys):
    request = write(tmp_path, body(name="pump-on", mode={"examples": QUESTIONS},
                                   config={**TRAIN, "samples_per_prompt": 2, "max_tokens": 3}))
    code, result, err = pump(capsys, "--request", request, "--student", str(tiny_student), "--out", str(root),
                             "--device", "cpu")
    assert code == 0 and result["total_steps"] == 4, result  # 2 prompts × 2 samples
    assert "1 of 2 prompts had no assistant turn" in err
    receipt = read_json(Path(result["run"]) / "train_receipt.json")
    assert receipt["opd"]["training_mode"] == "on_policy" and receipt["recipe"]["mode"] == "examples"
    assert read_json(Path(result["adapter"]) / "receipt.json")["source_kind"] == "distill_pump"


@pytest.mark.usefixtures("one_torch_thread")
def test_domain_with_a_prompt_bank_trains_on_policy(tiny_student, root, tmp_path, capsys):
    bank = tmp_path / "bank.jsonl"
    bank.write_text(json.dumps({"messages": [user("Solve 2x = 4.")]}) + "\n"
                    + json.dumps({"messages": [user("What is 3 squared?")]}) + "\n")
    request = write(tmp_path, body(name="pump-math", mode={"domain": "math"},
                                   config={**TRAIN, "samples_per_prompt": 2, "max_tokens": 3}))
    code, result, _ = pump(capsys, "--request", request, "--student", str(tiny_student), "--out", str(root),
                           "--prompt-bank", str(bank), "--device", "cpu")
    assert code == 0 and result["total_steps"] == 4, result
    receipt = read_json(Path(result["run"]) / "train_receipt.json")
    assert receipt["opd"]["training_mode"] == "on_policy"
    assert receipt["recipe"]["mode"] == "domain" and receipt["recipe"]["request"]["mode"] == {"domain": "math"}


# ------------------------------------------------------------------------------------------ a vLLM teacher

SERVER = Path(__file__).with_name("fake_vllm_server.py")


@pytest.fixture(scope="module")
def vllm_url(root, tmp_path_factory):
    """The fake vLLM server serving the registered teacher (its fingerprint is the registered identity's)."""
    entry = next(e for e in read_json(root / "teachers.json")["teachers"] if e["alias"] == ALIAS)
    manifest = tmp_path_factory.mktemp("pump-vllm") / "manifest.jsonl"
    manifest.write_text(entry["off_policy_manifest"] + "\n", encoding="utf-8")
    log = manifest.with_name("server.log")
    with open(log, "w") as stderr:
        process = subprocess.Popen([sys.executable, str(SERVER), "--port", "0", "--teacher", entry["teacher_dir"],
                                    "--manifest", str(manifest)], stdout=subprocess.PIPE, stderr=stderr, text=True)
    port: list[str] = []
    reader = threading.Thread(target=lambda: port.append(process.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout=120)
    try:
        if not port or not port[0].strip():
            process.kill()
            raise RuntimeError(f"fake vLLM server did not start: {log.read_text()[-2000:]}")
        yield f"http://127.0.0.1:{int(port[0])}/ok"
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_vllm_teacher_scores_the_examples_off_policy(tiny_student, root, vllm_url, tmp_path, capsys):
    from kiln_core.recipes.distill_pump import prepare_distill_pump

    examples = [{"messages": [user("Spell cat."), assistant("C, A, T.")]},
                {"messages": [user("Say hello."), assistant("Hello!")]}]
    value = body(name="pump-vllm", mode={"examples": examples}, config=TRAIN)  # training_mode left at its default
    code, result, err = pump(capsys, "--request", write(tmp_path, value), "--student", str(tiny_student), "--out",
                             str(root), "--vllm-teacher", vllm_url, "--device", "cpu")
    assert code == 0, result
    assert "trains off_policy (Kiln's rule for a remote teacher)" in err
    receipt = read_json(Path(result["run"]) / "train_receipt.json")
    assert receipt["opd"]["training_mode"] == "off_policy" and result["total_steps"] == 2
    registered = next(e for e in read_json(root / "teachers.json")["teachers"] if e["alias"] == ALIAS)
    assert receipt["recipe"]["teacher"]["model_version_hash"] == registered["identity_revision"]

    # The corpus it trained: pinned to the registered manifest, scored by the server like the local teacher.
    spec = prepare_distill_pump(check_distill_pump_request(value), student_dir=str(tiny_student), out_root=str(root),
                                vllm_teacher=vllm_url, on_warning=lambda message: None)
    remote = Path(spec.corpus).read_text().splitlines()
    assert remote[0] == registered["off_policy_manifest"] and spec.teacher.kind == "manifest_file"
    local_examples = tmp_path / "examples.jsonl"
    local_examples.write_text("".join(json.dumps({"messages": e["messages"][:-1], "teacher_response": e["messages"][-1]
                                                  ["content"]}) + "\n" for e in examples))
    local = tmp_path / "local.jsonl"
    assert main(["score", str(local_examples), "--teacher", ALIAS, "--registry", str(root), "--student",
                 str(tiny_student), "--top-k", "16", "--out", str(local), "--device", "cpu", "--quiet"]) == 0
    for served, computed in zip(remote[1:], local.read_text().splitlines()[1:]):
        served_tokens, computed_tokens = json.loads(served)["teacher_tokens"], json.loads(computed)["teacher_tokens"]
        assert [t["token_id"] for t in served_tokens] == [t["token_id"] for t in computed_tokens]
        assert [t["top_logprobs"][0]["token_id"] for t in served_tokens] == \
            [t["top_logprobs"][0]["token_id"] for t in computed_tokens]


@pytest.mark.usefixtures("one_torch_thread")
def test_the_flow_takes_a_vllm_teacher_too(prefect_harness, tiny_student, root, vllm_url):
    from flows.distill_pump import distill_pump

    examples = [{"messages": [user("Spell dog."), assistant("D, O, G.")]}]
    summary = distill_pump(body(name="pump-vllm-flow", mode={"examples": examples}, config=TRAIN), str(tiny_student),
                           str(root), vllm_teacher=vllm_url)
    receipt = read_json(Path(summary["run"]) / "train_receipt.json")
    assert summary["status"] == "success" and receipt["opd"]["training_mode"] == "off_policy"
    assert receipt["recipe"]["kind"] == "distill_pump" and receipt["training_data"]["sha256"].startswith("sha256:")


# ------------------------------------------------------------------------------------------ the flow


def test_the_flow_fails_a_bad_request_with_one_line(prefect_harness, tiny_student, tmp_path):
    from flows.distill_pump import distill_pump

    state = distill_pump(body(mode={"wide": True}, config={"training_mode": "off_policy"}), str(tiny_student),
                         str(tmp_path / "root"), return_state=True)
    assert state.is_failed() and state.message == ("rejected (seed_mode_requires_on_policy) config.training_mode: "
                                                   + KILN_SEED_TEXT)
    state = distill_pump(body(teacher="nobody"), str(tiny_student), str(tmp_path / "root"), return_state=True)
    assert state.is_failed() and state.message.startswith("rejected (teacher_not_registered) teacher: distill/pump: "
                                                          "teacher alias 'nobody' is not registered")


@pytest.mark.integration
@pytest.mark.usefixtures("one_torch_thread")
def test_the_flow_trains_a_pump_on_the_prefect_server(prefect_harness, tiny_student, root, tmp_path):
    from flows.distill_pump import distill_pump
    from test_pipeline_flow import task_runs

    request = body(name="pump-flow", config={**TRAIN, "training_mode": "off_policy"})
    state = distill_pump(request, str(tiny_student), str(root), return_state=True)
    assert state.is_completed(), f"{state.type}: {state.message}"
    summary = state.result()
    assert summary["status"] == "success" and summary["latest"]
    receipt = read_json(summary["receipt"])
    assert receipt["recipe"]["kind"] == "distill_pump" and receipt["recipe"]["teacher"]["alias"] == ALIAS
    assert read_json(Path(summary["adapter"]) / "receipt.json")["source_kind"] == "distill_pump"
    stages = ("distill", "score", "admit", "train", "publish")  # the prepare task first: distill-pump-prepare-<name>
    runs = task_runs(state.state_details.flow_run_id, stages)
    assert all(runs[stage].state.is_completed() for stage in stages)
    assert runs["distill"].name == "distill-pump-prepare-pump-flow"
