"""``kiln-flows distill merge`` and the ``distill_merge`` flow (Kiln's ``/v1/adapters/distill_merge``).

What a user depends on: Kiln's submit-time rules with Kiln's texts, a code and the field, before any file is
read; each source adapter found through its ``latest.json`` and its ``replay.jsonl`` read with Kiln's rules;
a prompt owned by two sources refused; Kiln's sampling contract (or, opted in, a seeded weighted draw); each
source's prompts scored by that source's LoRA on the student base (checked here against a PEFT forward written
independently); the corpus reused on a retry; the merged adapter's receipts naming the recipe, Kiln's
``merge-multi:<name>`` teacher and every pinned source.

The two source adapters are trained once per module by the real pipeline on two disjoint tiny corpora; their
``replay.jsonl`` is written here in the format every published adapter carries.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
TRAIN_CONFIG = {"top_k": 16, "learning_rate": 0.01, "lora_rank": 4, "lora_alpha": 8, "optimizer": {"kind": "adam_w"},
                "seed": 3}
PROMPTS_PER_SOURCE = 3


def check(value):
    from kiln_core.contracts.distill_merge import check_distill_merge_request

    return check_distill_merge_request(value)


def merge_request(**changes) -> dict:
    request = {"name": "unified", "sources": [{"adapter": "src-a"}, {"adapter": "src-b"}],
               "rollout_budget": 2 * PROMPTS_PER_SOURCE, "config": dict(TRAIN_CONFIG)}
    return {**request, **changes}


# ---------------------------------------------------------------------------------------------- request rules


@pytest.mark.fast
def test_kilns_defaults_fill_the_request():
    request = check({"name": "unified", "sources": [{"adapter": "rust-helper"}, {"adapter": "py", "weight": 0.5}]})
    assert request.student == "base" and request.rollout_budget == 5000 and request.post_eval is None
    assert [(s.adapter, s.weight) for s in request.sources] == [("rust-helper", 1.0), ("py", 0.5)]
    assert request.config.training_mode == "off_policy" and not request.weighted_sampling
    # a config object without training_mode gets off_policy inserted; its other fields stay as given
    request = check({"name": "m", "sources": [{"adapter": "a"}], "config": {"top_k": 16}})
    assert request.config.training_mode == "off_policy" and request.config.top_k == 16


BAD_REQUESTS = [
    ({"name": "  ", "sources": [{"adapter": "a"}]}, "merge_name_missing", "name",
     "distill_merge: name must be non-empty"),
    ({"name": "bad name", "sources": [{"adapter": "a"}]}, "invalid_adapter_name", "name", "name 'bad name' must be"),
    ({"name": "m", "sources": []}, "merge_sources_empty", "sources", "distill_merge: sources must be non-empty"),
    ({"name": "m", "sources": [{"adapter": "a"}], "rollout_budget": 0}, "merge_rollout_budget", "rollout_budget",
     "distill_merge: rollout_budget must be greater than zero"),
    ({"name": "m", "sources": [{"adapter": "a"}], "config": {"training_mode": "on_policy"}},
     "merge_off_policy_required", "config.training_mode",
     'distill_merge materializes teacher logits for fixed action sequences and requires '
     'config.training_mode="off_policy"'),
    ({"name": "m", "sources": [{"adapter": "a"}], "config": {"top_k": 8}}, "top_k_unsupported", "config.top_k",
     "OPD top_k 8 is not executable"),
    ({"name": "m", "sources": [{"adapter": "a"}], "config": {"lora_alpha": 64.0}}, "unsafe_lora_scale",
     "config.lora_alpha", "unsafe LoRA scaling"),
    ({"name": "m", "sources": [{"adapter": "a"}], "config": [1]}, "invalid_request", "config",
     "OPD config must be a JSON object"),
    ({"name": "m", "sources": [{"adapter": "../a"}]}, "invalid_adapter_name", "sources[0].adapter",
     "sources[0].adapter '../a' must be"),
    ({"name": "m", "sources": [{"adapter": "a"}, {"adapter": "b"}, {"adapter": "a"}]}, "merge_duplicate_source",
     "sources[2].adapter", 'distill_merge: duplicate source adapter "a"'),
    ({"name": "m", "sources": [{"adapter": "a", "weight": 0}]}, "merge_source_weight", "sources[0].weight",
     'distill_merge: source adapter "a" weight must be finite and greater than zero'),
    ({"name": "m", "sources": [{"adapter": "a", "weight": float("inf")}]}, "merge_source_weight", "sources[0].weight",
     "weight must be finite"),
    ({"name": "m", "sources": [{"adapter": "a", "weight": float("nan")}]}, "merge_source_weight", "sources[0].weight",
     "weight must be finite"),
    ({"name": "m", "sources": [{"adapter": "a", "weight": "1"}]}, "invalid_request", "sources[0].weight",
     "Input should be a valid number"),
    ({"name": "m", "sources": [{"adapter": "a", "wieght": 2}]}, "invalid_request", "sources[0].wieght",
     "did you mean `weight`?"),
    ({"name": "m", "sources": [{"adapter": "a"}], "rolout_budget": 6}, "invalid_request", "rolout_budget",
     "did you mean `rollout_budget`?"),
    ({"name": "m", "sources": [{"adapter": "a"}], "config": {"lora_rnak": 4}}, "invalid_request", "config.lora_rnak",
     "did you mean `lora_rank`?"),
    ({"sources": [{"adapter": "a"}]}, "invalid_request", "name", "Field required"),
    ({"name": "m"}, "invalid_request", "sources", "Field required"),
    ([], "invalid_request", None, "expected an object"),
    ({"name": "m", "sources": [{"adapter": "a"}], "post_eval": {"suite": "s", "min_accuracy": 2.0}},
     "post_eval_min_accuracy_out_of_range", "post_eval.min_accuracy", "finite and in [0.0, 1.0]"),
]


@pytest.mark.fast
@pytest.mark.parametrize("value, code, field, text", BAD_REQUESTS, ids=[row[1] + "-" + str(row[2]) for row in BAD_REQUESTS])
def test_every_submit_rule_refuses_with_its_code_the_field_and_kilns_text(value, code, field, text):
    from kiln_core.errors import Rejection

    with pytest.raises(Rejection) as raised:
        check(value)
    assert (raised.value.code, raised.value.field) == (code, field)
    assert text in raised.value.message


@pytest.mark.fast
def test_post_eval_is_checked_before_the_recipes_own_rules_as_in_kiln():
    from kiln_core.errors import Rejection

    with pytest.raises(Rejection) as raised:
        check({"name": " ", "sources": [], "post_eval": {"suite": "s", "data_scope": "train-set-eval",
                                                           "min_accuracy": 0.5}})
    assert raised.value.code == "post_eval_train_set_eval_gated"


@pytest.mark.fast
def test_the_cli_flag_turns_weighted_sampling_on_in_the_request_it_records(tmp_path):
    from flows.commands.distill_merge import load_merge_request

    path = tmp_path / "merge.json"
    path.write_text(json.dumps(merge_request()))
    assert not load_merge_request(str(path)).weighted_sampling
    assert load_merge_request(str(path), weighted_sampling=True).weighted_sampling
    path.write_text("{not json")
    with pytest.raises(Exception) as raised:
        load_merge_request(str(path))
    assert raised.value.code == "invalid_request"


@pytest.mark.fast
def test_a_bad_request_exits_2_naming_the_field_before_torch_or_prefect_load(tmp_path):
    path = tmp_path / "merge.json"
    path.write_text(json.dumps(merge_request(sources=[{"adapter": "a"}, {"adapter": "a"}])))
    code = ("import sys; from flows.cli import main; rc = main(['distill', 'merge', '--request', %r, '--student', %r, "
            "'--out', %r, '--json']); print(rc, sorted({'torch', 'prefect'} & set(sys.modules)))"
            % (str(path), str(tmp_path), str(tmp_path)))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120).stdout
    error, verdict = out.strip().splitlines()[-2:]
    assert verdict == "2 []"
    assert json.loads(error) | {"message": None} == {"status": "rejected", "code": "merge_duplicate_source",
                                                     "field": "sources[1].adapter", "line": None, "message": None,
                                                     "file": str(path)}


# ---------------------------------------------------------------------------------------------- admission rules


@pytest.mark.fast
def test_the_sampling_contract_is_kilns_prompt_epochs_and_row_shares():
    from kiln_core.recipes.merge_admission import MergeRejection, check_sampling_contract

    fits = check({"name": "m", "sources": [{"adapter": "a", "weight": 3}, {"adapter": "b", "weight": 1}],
                  "rollout_budget": 8, "config": {"epochs": 2}})
    assert check_sampling_contract(fits, [3, 1]) == 8
    for counts in ([2, 2], [3, 2]):  # shares off, or the budget off
        with pytest.raises(MergeRejection) as raised:
            check_sampling_contract(fits, counts)
        expected = sum(counts) * 2
        assert raised.value.code == "merge_sampling_contract" and raised.value.field == "rollout_budget"
        assert raised.value.message == (
            f"distill_merge cannot silently approximate weighted sampling: this materialized corpus executes {expected} "
            "prompt-epochs and source shares proportional to replay row counts; set "
            f"rollout_budget={expected} and each source weight proportional to its replay row count, or pre-sample "
            "the replay logs accordingly")


@pytest.mark.fast
def test_weighted_draws_follow_the_weights_take_rows_in_file_order_and_repeat_with_the_seed():
    from kiln_core.recipes.merge_admission import draw_weighted_rows

    draws = draw_weighted_rows([3.0, 1.0], [5, 2], 4000, seed=11)
    assert draws == draw_weighted_rows([3.0, 1.0], [5, 2], 4000, seed=11)
    assert draws != draw_weighted_rows([3.0, 1.0], [5, 2], 4000, seed=12)
    share = sum(1 for source, _ in draws if source == 0) / len(draws)
    assert abs(share - 0.75) < 0.03  # 4000 draws: the binomial's standard deviation is under 0.007
    for source, count in ((0, 5), (1, 2)):
        rows = [row for s, row in draws if s == source]
        assert rows == [n % count for n in range(len(rows))]  # file order, cycling


@pytest.mark.fast
def test_the_ownership_key_is_sha256_of_the_u64_count_and_u32_tokens():
    from kiln_core.recipes.merge_admission import prompt_sequence_sha256

    tokens = [1, 300, 70000]
    expected = hashlib.sha256((3).to_bytes(8, "big") + b"".join(t.to_bytes(4, "big") for t in tokens)).digest()
    assert prompt_sequence_sha256(tokens) == expected
    assert prompt_sequence_sha256([]) == hashlib.sha256(bytes(8)).digest()


def write_replay(adapter_dir: Path, lines: list) -> Path:
    path = Path(adapter_dir) / "replay.jsonl"
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines),
                    encoding="utf-8")
    return path


USER = {"role": "user", "content": "hi"}
ANSWER = {"role": "assistant", "content": "hello"}


@pytest.mark.fast
def test_replay_lines_are_read_with_kilns_rules(tmp_path):
    from kiln_core.teachers.replay import read_replay_prompts

    write_replay(tmp_path, [
        {"prompts": [{"messages": [USER, ANSWER], "teacher_extra_messages": [USER], "trajectory": []}]},
        "",
        {"request_body": {"examples": [{"messages": [USER, {"role": "assistant", "content": "sft"}]}],
                          "prompts": [{"messages": [{"role": "user", "content": "2"}, ANSWER]}]}},
        {"prompts": [{"messages": [{"content": "no role"}, USER, ANSWER]}, {"messages": []}, {"no": "messages"}]},
        {"kind": "something else"},
        "   ",
    ])
    assert read_replay_prompts(tmp_path, source="a") == [
        [USER, ANSWER],
        [USER, {"role": "assistant", "content": "sft"}],  # examples before prompts, within a line
        [{"role": "user", "content": "2"}, ANSWER],
        [USER, ANSWER],  # a message that is not a chat message is dropped, the element kept
    ]


@pytest.mark.fast
def test_a_missing_large_undecodable_or_broken_replay_log_is_refused(tmp_path):
    from kiln_core.teachers.replay import MAX_REPLAY_BYTES, ReplayLogError, read_replay_prompts

    def refusal(directory) -> ReplayLogError:
        with pytest.raises(ReplayLogError) as raised:
            read_replay_prompts(directory, source="src-a")
        return raised.value

    missing = refusal(tmp_path)
    assert missing.code == "replay_log_missing"
    assert missing.message.startswith(f'distill_merge: source adapter "src-a" has no readable replay log at '
                                      f'{tmp_path / "replay.jsonl"}')
    (tmp_path / "replay.jsonl").mkdir()
    assert refusal(tmp_path).code == "replay_log_missing"
    (tmp_path / "replay.jsonl").rmdir()
    with open(tmp_path / "replay.jsonl", "wb") as handle:
        handle.truncate(MAX_REPLAY_BYTES + 1)  # sparse: costs no disk
    assert refusal(tmp_path).code == "replay_log_missing" and "at most 67108864 are read" in refusal(tmp_path).message
    (tmp_path / "replay.jsonl").write_bytes(b'{"prompts": []}\n\xff\n')
    assert refusal(tmp_path).code == "replay_log_missing"
    write_replay(tmp_path, [{"prompts": []}, "", "{broken"])
    broken = refusal(tmp_path)
    assert (broken.code, broken.line) == ("replay_log_invalid", 3)
    assert broken.message.startswith('distill_merge: source adapter "src-a" replay line 3 is invalid JSON: ')


@pytest.mark.fast
def test_a_prompt_must_end_with_the_assistant_answer_it_trains():
    from kiln_core.recipes.merge_admission import MergeRejection, prompt_example

    assert prompt_example([USER, ANSWER], source="a", index=0) == {"messages": [USER], "teacher_response": "hello"}
    for messages, why in (([USER, ANSWER, USER], "its last message is not an assistant answer"),
                          ([USER], "no non-empty assistant answer"),
                          ([USER, {"role": "assistant", "content": " "}], "no non-empty assistant answer")):
        with pytest.raises(MergeRejection) as raised:
            prompt_example(messages, source="a", index=4)
        assert raised.value.code == "prompt_not_trainable" and raised.value.field == "prompts[4].messages"
        assert why in raised.value.message


@pytest.mark.fast
def test_a_source_that_is_not_published_is_not_found_before_any_model_loads(tmp_path):
    from kiln_core.recipes.merge_admission import MergeRejection
    from tasks.distill_merge import prepare_distill_merge_task

    with pytest.raises(MergeRejection) as raised:
        prepare_distill_merge_task.fn(check(merge_request()), str(tmp_path / "no-student"), str(tmp_path))
    assert raised.value.code == "merge_source_not_found" and raised.value.field == "sources[0].adapter"
    assert raised.value.message == f'distill_merge: source adapter "src-a" not found at {tmp_path / "runs" / "src-a"} ' \
                                   "(no readable latest.json: train and publish it first)"


@pytest.mark.fast
def test_the_flow_run_is_named_after_the_merge():
    from flows.distill_merge import merge_run_name

    assert merge_run_name() == "merge-run"  # outside a flow run


@pytest.mark.fast
def test_the_error_page_lists_every_merge_code():
    from kiln_core.contracts.distill_merge import MERGE_REQUEST_CODES
    from kiln_core.recipes.merge_admission import MERGE_CODES

    page = (REPO / "docs" / "errors.md").read_text(encoding="utf-8")
    assert [code for code in (*MERGE_REQUEST_CODES, *MERGE_CODES) if f"`{code}`" not in page] == []


# ---------------------------------------------------------------------------------------------- two real sources


def publish_sources(student: Path, teacher: Path, root: Path, base: Path) -> dict[str, SimpleNamespace]:
    """Train ``src-a`` and ``src-b`` on disjoint synthetic corpora with the real pipeline; write their replay logs."""
    from kiln_core.contracts.identity import build_manifest_line
    from kiln_core.contracts.pipeline import parse_spec
    from kiln_core.engine.pipeline import LocalStages, run_pipeline
    from kiln_core.identity.local_teacher import local_teacher_identity
    from kiln_core.synthetic import synthesize_corpus

    line = build_manifest_line(local_teacher_identity(str(teacher), max_top_k=32))
    published = {}
    for name, seed in (("src-a", 11), ("src-b", 22)):
        corpus = synthesize_corpus(student, base / f"{name}.jsonl", n_examples=PROMPTS_PER_SOURCE, top_k=16, seed=seed,
                                   manifest_line=line)
        spec = parse_spec({"teacher": {"kind": "local_dir", "path": str(teacher)}, "student": str(student),
                           "storage_root": str(root), "adapter": name, "corpus": str(corpus),
                           "config": {"training_mode": "off_policy", "top_k": 16, "learning_rate": 0.05, "lora_rank": 4,
                                      "lora_alpha": 8, "optimizer": {"kind": "adam_w"}, "seed": 5}})
        result = run_pipeline(spec, LocalStages(handle_signals=False))
        assert result.status == "success"
        rows = [json.loads(text) for text in corpus.read_text().splitlines()[1:]]
        prompts = [row["messages"] + [{"role": "assistant", "content": row["teacher_response"]}] for row in rows]
        write_replay(result.adapter, [{"prompts": [{"messages": messages}]} for messages in prompts])
        published[name] = SimpleNamespace(adapter=Path(result.adapter), prompts=prompts)
    return published


@pytest.fixture(scope="module")
def sources(tiny_student, tiny_teacher, tmp_path_factory):
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        base = tmp_path_factory.mktemp("merge")
        root = base / "root"
        published = publish_sources(tiny_student, tiny_teacher, root, base)
    finally:
        torch.set_num_threads(threads)
    return SimpleNamespace(base=base, root=root, student=tiny_student, **{k.replace("-", "_"): v for k, v in published.items()})


def fresh_root(sources, tmp_path) -> Path:
    """A copy of the storage root with both sources published (tests that change it get their own)."""
    root = tmp_path / "root"
    shutil.copytree(sources.root / "runs" / "src-a", root / "runs" / "src-a")
    shutil.copytree(sources.root / "runs" / "src-b", root / "runs" / "src-b")
    for name in ("src-a", "src-b"):  # latest.json names absolute paths: point them at the copies
        latest = root / "runs" / name / "latest.json"
        latest.write_text(latest.read_text().replace(str(sources.root), str(root)))
    return root


def source_dir(root: Path, name: str) -> Path:
    return Path(json.loads((root / "runs" / name / "latest.json").read_text())["adapter"])


def cli(capsys, request: dict, student: Path, root: Path, *flags: str) -> tuple[int, dict]:
    from flows.cli import main

    path = root.parent / "merge.json"
    path.write_text(json.dumps(request))
    code = main(["distill", "merge", "--request", str(path), "--student", str(student), "--out", str(root), "--json",
                 "--device", "cpu", *flags])
    return code, json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def prepare(world, root: Path, **changes):
    from kiln_core.recipes.distill_merge import prepare_distill_merge

    return prepare_distill_merge(check(merge_request(**changes)), student_dir=str(world.student), out_root=str(root),
                                 device="cpu")


def reference_rows(student: Path, adapter: Path, record: dict, top_k: int):
    """The source's teacher rows, computed here: the student wearing the LoRA through PEFT, fp32 log-softmax of row
    q-1 for each assistant target q, top-K by value."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from kiln_core.chat_template import Conversation
    from kiln_core.tokenization import encode_conversations, load_student_tokenizer

    (encoded,) = encode_conversations(load_student_tokenizer(student),
                                      [Conversation(record["messages"], record["teacher_response"])])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(student)), str(adapter)).eval()
    with torch.no_grad():
        logits = model(torch.tensor([encoded.input_ids.tolist()])).logits[0].float()
    rows = torch.log_softmax(logits[torch.tensor(encoded.action_positions.tolist()) - 1], dim=-1)
    values, ids = torch.topk(rows, top_k, dim=-1)
    return ids.tolist(), values.tolist()


@pytest.mark.usefixtures("one_torch_thread")
def test_a_cli_merge_scores_each_sources_prompts_with_its_own_lora_and_records_every_source(sources, tmp_path, capsys):
    from kiln_core.identity.hashing import adapter_config_sha256, adapter_weights_sha256

    root = fresh_root(sources, tmp_path)
    code, summary = cli(capsys, merge_request(), sources.student, root)
    assert code == 0 and summary["status"] == "success" and summary["steps"] == 2 * PROMPTS_PER_SOURCE

    # one corpus: the merge's manifest, then src-a's prompts, then src-b's, in replay order
    corpus = next((root / "recipes" / "distill_merge").glob("unified-*/corpus.jsonl"))
    lines = corpus.read_text().splitlines()
    manifest = json.loads(lines[0])["teacher_identity"]
    assert manifest["served_model_id"] == "merge-multi-unified" and manifest["adapter"] is None
    rows = [json.loads(line) for line in lines[1:]]
    expected = sources.src_a.prompts + sources.src_b.prompts
    assert [row["messages"] + [{"role": "assistant", "content": row["teacher_response"]}] for row in rows] == expected

    # each row is its own source's LoRA: equal to a PEFT forward on that source, unlike the other source's
    for row, adapter, other in zip(rows, [sources.src_a.adapter] * 3 + [sources.src_b.adapter] * 3,
                                   [sources.src_b.adapter] * 3 + [sources.src_a.adapter] * 3):
        ids, values = reference_rows(sources.student, adapter, row, 16)
        got_ids = [[c["token_id"] for c in token["top_logprobs"]] for token in row["teacher_tokens"]]
        got_values = [[c["logprob"] for c in token["top_logprobs"]] for token in row["teacher_tokens"]]
        assert got_ids == ids
        assert max(abs(a - b) for x, y in zip(got_values, values) for a, b in zip(x, y)) < 1e-4
        other_values = reference_rows(sources.student, other, row, 16)[1]
        assert max(abs(a - b) for x, y in zip(got_values, other_values) for a, b in zip(x, y)) > 1e-3

    # the receipt's recipe block names the recipe, Kiln's teacher and every pinned source
    receipt = json.loads(Path(summary["receipt"]).read_text())
    recipe = receipt["recipe"]
    assert recipe["kind"] == "distill_merge" and recipe["name"] == "unified" and recipe["mode"] is None
    assert recipe["teacher"] == {"alias": "merge-multi:unified", "model_id": "merge-multi:unified",
                                 "model_version_hash": None, "identity": None}
    assert recipe["sampling"] == {"method": "kiln_contract", "rollout_budget": 6}
    for pinned, name in zip(recipe["sources"], ("src-a", "src-b")):
        directory = source_dir(root, name)
        assert pinned["adapter"] == name and pinned["weight"] == 1.0 and pinned["prompts"] == pinned["rows"] == 3
        assert pinned["weights_sha256"] == adapter_weights_sha256(directory)
        assert pinned["config_sha256"] == adapter_config_sha256(directory)
        assert pinned["identity_revision"].startswith("sha256:")
    assert recipe["sources"][0]["identity_revision"] != recipe["sources"][1]["identity_revision"]
    assert recipe["request"]["rollout_budget"] == 6 and recipe["request"]["weighted_sampling"] is False
    assert recipe["request"]["config"]["training_mode"] == "off_policy"
    # Kiln's receipt.json beside the adapter; Kiln's runner overrides output_name and auto_load
    legacy = json.loads((Path(summary["adapter"]) / "receipt.json").read_text())
    assert legacy["source_kind"] == "distill_merge" and legacy["teacher"]["alias"] == "merge-multi:unified"
    assert legacy["hyperparameters"] == recipe["request"] and legacy["seed"] == 3
    assert receipt["hyperparameters"]["seed"] == 3

    # the same merge again: the corpus and the run are reused, nothing rewritten
    before = corpus.read_bytes()
    code, again = cli(capsys, merge_request(), sources.student, root)
    assert code == 0 and again["reused"] and again["receipt"] == summary["receipt"] and corpus.read_bytes() == before
    assert len(list((root / "recipes" / "distill_merge").iterdir())) == 1


@pytest.mark.usefixtures("one_torch_thread")
def test_the_student_field_is_the_warm_start_unless_it_is_base(sources, tmp_path):
    root = fresh_root(sources, tmp_path)
    assert prepare(sources, root).config.base_adapter is None
    spec = prepare(sources, root, student="src-a")
    assert spec.config.base_adapter == "src-a" and spec.config.output_name == "unified" and not spec.config.auto_load
    assert spec.teacher.kind == "manifest_file" and spec.corpus == spec.teacher.path and spec.adapter == "unified"
    # a recipe chain's warm start applies when the request's student is "base"; the request's student wins
    from kiln_core.recipes.distill_merge import prepare_distill_merge

    for student, chained, expected in (("base", "src-b", "src-b"), ("src-a", "src-b", "src-a")):
        spec = prepare_distill_merge(check(merge_request(student=student)), student_dir=str(sources.student),
                                     out_root=str(root), base_adapter=chained, recipe="my-recipe", step=2, device="cpu")
        assert spec.config.base_adapter == expected and (spec.recipe.recipe, spec.recipe.step) == ("my-recipe", 2)


@pytest.mark.usefixtures("one_torch_thread")
def test_a_prompt_in_two_sources_is_refused_with_kilns_text(sources, tmp_path, capsys):
    root = fresh_root(sources, tmp_path)
    write_replay(source_dir(root, "src-b"), [{"prompts": [{"messages": messages}]}
                                              for messages in sources.src_b.prompts[:2] + sources.src_a.prompts[1:2]])
    code, error = cli(capsys, merge_request(), sources.student, root)
    assert (code, error["code"], error["field"]) == (2, "merge_shared_prompt", "sources[1].adapter")
    assert error["message"] == (
        'distill_merge: source adapters "src-a" and "src-b" contain the same tokenized prompt; shared prompts require '
        "weighted multi-teacher aggregation, which is not implemented, so deduplicate or pre-sample the replay logs "
        "before submitting")
    assert not (root / "recipes").exists() and not (root / "runs" / "unified").exists()
    # a repeat within one source is allowed (Kiln keys ownership by source)
    write_replay(source_dir(root, "src-b"), [{"prompts": [{"messages": messages}]}
                                              for messages in sources.src_b.prompts + sources.src_b.prompts[:1]])
    assert prepare(sources, root, rollout_budget=7, sources=[{"adapter": "src-a", "weight": 3},
                                                              {"adapter": "src-b", "weight": 4}]).corpus


@pytest.mark.usefixtures("one_torch_thread")
def test_a_budget_or_weights_off_the_replay_rows_break_the_contract_unless_weighted_sampling(sources, tmp_path, capsys):
    root = fresh_root(sources, tmp_path)
    for changes in ({"rollout_budget": 5000}, {"sources": [{"adapter": "src-a", "weight": 3}, {"adapter": "src-b"}]}):
        code, error = cli(capsys, merge_request(**changes), sources.student, root)
        assert (code, error["code"], error["field"]) == (2, "merge_sampling_contract", "rollout_budget")
        assert "executes 6 prompt-epochs" in error["message"]
    # epochs count: 2 epochs of 6 prompts are 12 prompt-epochs
    assert prepare(sources, root, rollout_budget=12, config={**TRAIN_CONFIG, "epochs": 2}).recipe.sampling == {
        "method": "kiln_contract", "rollout_budget": 12}


@pytest.mark.usefixtures("one_torch_thread")
def test_weighted_sampling_draws_the_budget_by_weight_in_a_seeded_order(sources, tmp_path):
    from kiln_core.recipes.merge_admission import draw_weighted_rows

    root = fresh_root(sources, tmp_path)
    weighted = dict(rollout_budget=10, weighted_sampling=True,
                    sources=[{"adapter": "src-a", "weight": 3}, {"adapter": "src-b", "weight": 1}])
    spec = prepare(sources, root, **weighted)
    draws = draw_weighted_rows([3.0, 1.0], [3, 3], 10, seed=3)  # config.seed
    assert spec.recipe.sampling == {"method": "weighted", "rollout_budget": 10, "seed": 3}
    assert [s.rows for s in spec.recipe.sources] == [sum(1 for s, _ in draws if s == i) for i in (0, 1)]
    assert [s.prompts for s in spec.recipe.sources] == [3, 3]
    rows = [json.loads(line) for line in Path(spec.corpus).read_text().splitlines()[1:]]
    prompts = [sources.src_a.prompts, sources.src_b.prompts]
    assert [row["messages"] + [{"role": "assistant", "content": row["teacher_response"]}] for row in rows] == \
        [prompts[source][row] for source, row in draws]
    # another seed draws another corpus, under another content address
    other = prepare(sources, root, **weighted, config={**TRAIN_CONFIG, "seed": 4})
    assert other.corpus != spec.corpus and other.recipe.sampling["seed"] == 4


@pytest.mark.usefixtures("one_torch_thread")
def test_a_missing_or_broken_replay_log_and_a_missing_source_are_refused(sources, tmp_path, capsys):
    root = fresh_root(sources, tmp_path)
    replay = source_dir(root, "src-b") / "replay.jsonl"
    replay.write_text('{"prompts": []}\n{"prompts": [\n')
    code, error = cli(capsys, merge_request(), sources.student, root)
    assert (code, error["code"], error["line"], error["file"]) == (2, "replay_log_invalid", 2, str(replay))
    replay.unlink()
    code, error = cli(capsys, merge_request(), sources.student, root)
    assert (code, error["code"]) == (2, "replay_log_missing")
    assert error["message"].startswith(f'distill_merge: source adapter "src-b" has no readable replay log at {replay}')
    code, error = cli(capsys, merge_request(sources=[{"adapter": "src-a"}, {"adapter": "src-c"}]), sources.student, root)
    assert (code, error["code"], error["field"]) == (2, "merge_source_not_found", "sources[1].adapter")
    assert error["message"].startswith(f'distill_merge: source adapter "src-c" not found at {root / "runs" / "src-c"}')


@pytest.mark.usefixtures("one_torch_thread")
def test_a_source_rewritten_after_admission_is_refused_before_it_scores(sources, tmp_path, monkeypatch):
    import kiln_core.scoring
    from kiln_core.recipes.merge_admission import MergeRejection

    root = fresh_root(sources, tmp_path)
    weights = source_dir(root, "src-b") / "adapter_model.safetensors"
    real_score = kiln_core.scoring.score_examples
    scored = []

    def score_then_rewrite_src_b(*args, **kwargs):  # src-a scores; src-b changes before its turn
        scored.append(kwargs["teacher_dir"])
        result = real_score(*args, **kwargs)
        weights.write_bytes(weights.read_bytes() + b" ")
        return result

    monkeypatch.setattr(kiln_core.scoring, "score_examples", score_then_rewrite_src_b)
    with pytest.raises(MergeRejection) as raised:
        prepare(sources, root)
    assert raised.value.code == "merge_source_changed" and raised.value.field == "sources[1].adapter"
    assert 'source adapter "src-b" changed after admission' in raised.value.message
    assert len(scored) == 1  # src-b never scored
    assert not list(root.glob("recipes/distill_merge/*/corpus.jsonl"))  # nothing half-written became visible


@pytest.mark.integration
@pytest.mark.usefixtures("one_torch_thread")
def test_the_flow_merges_on_the_prefect_server_and_refuses_a_bad_request_in_one_line(sources, tmp_path, prefect_harness):
    from flows.distill_merge import distill_merge

    root = fresh_root(sources, tmp_path)
    state = distill_merge(merge_request(), str(sources.student), str(root), return_state=True)
    assert state.is_completed(), state.message
    summary = state.result()
    assert summary["status"] == "success" and summary["steps"] == 6
    assert json.loads(Path(summary["receipt"]).read_text())["recipe"]["kind"] == "distill_merge"
    assert json.loads((Path(summary["adapter"]) / "receipt.json").read_text())["source_kind"] == "distill_merge"

    bad = distill_merge(merge_request(sources=[{"adapter": "src-a", "weight": -1}]), str(sources.student), str(root),
                        return_state=True)
    assert bad.is_failed()
    assert bad.message == ('rejected (merge_source_weight) sources[0].weight: distill_merge: source adapter "src-a" '
                           "weight must be finite and greater than zero")
