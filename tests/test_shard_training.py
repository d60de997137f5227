"""Training on a corpus given as a set of shards (a directory or an index), read one shard at a time.

A set trains on its examples in shard order, then file order within a shard, so a set cut from one file
trains exactly as that file does; checkpoints record the shard and row of the next candidate, and an
interrupted run resumed across a shard boundary ends with the uninterrupted run's adapter bytes.

The corpus is one synthesized 9-example file for the tiny student, cut into shards of 4, 3 and 2
examples (each shard: the same manifest line, then its examples' lines).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from kiln_core.contracts.corpus_shards import set_sha256
from kiln_core.synthetic import synthesize_corpus
from shard_support import write_file, write_set

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CONFIG = {"training_mode": "off_policy", "top_k": 16, "epochs": 2, "seed": 11, "lora_rank": 4, "lora_alpha": 8.0,
          "learning_rate": 5e-3, "sequences_per_step": 2, "checkpoint_interval": 1}
CUTS = (4, 3, 2)


class StopAt(Exception):
    pass


@pytest.fixture(scope="module")
def corpus_lines(tiny_student, tmp_path_factory) -> list[str]:
    path = synthesize_corpus(tiny_student, tmp_path_factory.mktemp("whole") / "whole.jsonl", n_examples=sum(CUTS),
                             top_k=16, seed=7)
    return path.read_text(encoding="utf-8").splitlines()


def spec_for(corpus: Path, root: Path, tiny_student, adapter: str = "set-run", **config):
    """A pipeline spec training ``corpus`` (a file, a directory or an index) under ``root``."""
    from kiln_core.contracts.pipeline import parse_spec

    first = corpus if corpus.suffix == ".jsonl" else sorted(corpus.parent.glob("*.jsonl") if corpus.is_file()
                                                                else corpus.glob("*.jsonl"))[0]
    manifest = write_file(root.parent / f"{root.name}-manifest.jsonl", first.read_text().splitlines()[:1])
    return parse_spec({"teacher": {"kind": "manifest_file", "path": str(manifest)}, "corpus": str(corpus),
                       "student": str(tiny_student), "storage_root": str(root), "adapter": adapter,
                       "config": {**CONFIG, **config}})


def run(spec, *, stop_at: int | None = None):
    from kiln_core.engine import run_pipeline
    from kiln_core.engine.pipeline import LocalStages

    def hook(step: int) -> None:
        if stop_at is not None and step == stop_at:
            raise StopAt(step)

    return run_pipeline(spec, LocalStages(handle_signals=False, on_step_committed=hook))


def adapter_bytes(result) -> bytes:
    return (Path(result.adapter) / "adapter_model.safetensors").read_bytes()


def checkpoint_state(run_dir: Path, step: int) -> dict:
    [checkpoint] = run_dir.glob(f"*-checkpoint-step-{step:08d}.kiln-checkpoint")
    return json.loads((checkpoint / "kiln_flows_state.json").read_text())


def test_a_set_cut_from_one_file_trains_exactly_as_the_file(tiny_student, corpus_lines, tmp_path):
    whole = write_file(tmp_path / "whole.jsonl", corpus_lines)
    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    from_file = run(spec_for(whole, tmp_path / "file-root", tiny_student))
    from_set = run(spec_for(shards, tmp_path / "set-root", tiny_student))
    assert from_file.status == from_set.status == "success"
    assert from_set.total_steps == from_file.total_steps == 9  # 9 examples × 2 epochs, 2 per step
    assert adapter_bytes(from_set) == adapter_bytes(from_file)
    assert from_set.loss_history == from_file.loss_history

    digests = ["sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()
               for p in sorted(shards.glob("*.jsonl"))]
    receipt = json.loads(Path(from_set.receipt).read_text())
    assert from_set.dataset_sha256 == set_sha256(digests) == receipt["training_data"]["sha256"]
    assert receipt["training_data"]["path"] == str(shards)
    assert from_set.run != from_file.run  # the set digest keys the run, not a file's digest


def test_checkpoints_name_the_shard_and_row_of_the_next_candidate(tiny_student, corpus_lines, tmp_path):
    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    result = run(spec_for(shards, tmp_path / "root", tiny_student))
    run_dir = Path(result.run)
    shard_digests = ["sha256:" + hashlib.sha256(p.read_bytes()).hexdigest()
                     for p in sorted(shards.glob("*.jsonl"))]
    # Candidate c = 2·step is example c mod 9 of epoch c // 9; examples 0-3 are shard 0, 4-6 shard 1, 7-8 shard 2.
    expected = {1: (0, 0, 2), 2: (0, 1, 0), 4: (0, 2, 1), 5: (1, 0, 1), 8: (1, 2, 0)}
    for step, (epoch, shard, row) in expected.items():
        cursor = checkpoint_state(run_dir, step)["data_cursor"]
        assert cursor == {"set_sha256": result.dataset_sha256, "epoch": epoch, "shard": shard,
                          "shard_sha256": shard_digests[shard], "row": row, "sample": 0}, step


def test_a_run_interrupted_inside_a_shard_resumes_across_the_boundary_to_the_same_bytes(tiny_student, corpus_lines,
                                                                                       tmp_path):
    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    straight = run(spec_for(shards, tmp_path / "straight", tiny_student))
    spec = spec_for(shards, tmp_path / "stopped", tiny_student)
    with pytest.raises(StopAt):
        run(spec, stop_at=3)  # next candidate: example 6, row 2 of shard 1; step 4 crosses into shard 2
    resumed = run(spec)
    assert resumed.status == "success" and resumed.steps == 9
    assert adapter_bytes(resumed) == adapter_bytes(straight)
    receipt = json.loads(Path(resumed.receipt).read_text())
    assert receipt["data"]["resumed_from_checkpoint"].endswith("step-00000003.kiln-checkpoint")


def test_a_set_given_by_an_index_trains_as_the_directory_does(tiny_student, corpus_lines, tmp_path):
    from kiln_core.admission.shards import build_index

    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    index = tmp_path / "corpus" / "corpus.index.json"
    build_index(str(index), [p.name for p in sorted(shards.glob("*.jsonl"))])
    by_directory = run(spec_for(shards, tmp_path / "dir-root", tiny_student, epochs=1))
    by_index = run(spec_for(index, tmp_path / "index-root", tiny_student, epochs=1))
    assert by_index.dataset_sha256 == by_directory.dataset_sha256
    assert adapter_bytes(by_index) == adapter_bytes(by_directory)


def test_a_checkpoint_whose_cursor_disagrees_with_the_set_is_refused(tiny_student, corpus_lines, tmp_path,
                                                                       monkeypatch):
    from kiln_core.contracts.checkpoint import ResumeError
    from kiln_core.corpus_set import ShardLayout

    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    spec = spec_for(shards, tmp_path / "root", tiny_student)
    real_cursor = ShardLayout.cursor
    with monkeypatch.context() as patched:  # a writer that put the wrong row into its checkpoints
        patched.setattr(ShardLayout, "cursor", lambda self, c, **kw: real_cursor(self, c, **kw).model_copy(
            update={"row": 99}))
        with pytest.raises(StopAt):
            run(spec, stop_at=2)
    with pytest.raises(ResumeError) as refused:
        run(spec)
    assert refused.value.code == "data_cursor_mismatch"
    assert "shard 1" in str(refused.value) and "row 0" in str(refused.value) and "row 99" in str(refused.value)


def test_a_shard_that_no_longer_matches_its_index_stops_the_run_before_training(tiny_student, corpus_lines, tmp_path):
    from kiln_core.admission.shards import build_index
    from kiln_core.errors import AdmissionError

    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    index = tmp_path / "corpus" / "corpus.index.json"
    build_index(str(index), [p.name for p in sorted(shards.glob("*.jsonl"))])
    part = shards / "part-01.jsonl"
    part.write_text(part.read_text().replace("\n", "\n\n", 1))  # a blank line: another file, same examples
    with pytest.raises(AdmissionError) as refused:
        run(spec_for(index, tmp_path / "root", tiny_student))
    assert refused.value.code == "shard_digest_mismatch" and refused.value.file == "part-01.jsonl"
    assert not (tmp_path / "root" / "runs").exists() or not any((tmp_path / "root" / "runs").rglob("*.kiln-checkpoint"))


def test_kiln_flows_train_takes_a_request_whose_dataset_path_is_a_shard_directory(tiny_student, corpus_lines, tmp_path,
                                                                                  capsys):
    from flows.cli import main

    write_set(tmp_path / "corpus", corpus_lines, CUTS)
    whole = write_file(tmp_path / "whole.jsonl", corpus_lines)
    write_file(tmp_path / "teacher-manifest.jsonl", corpus_lines[:1])
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"dataset_path": "corpus", "teacher": "teacher-manifest.jsonl",
                                   "config": {**CONFIG, "epochs": 1}}))
    code = main(["train", "--request", str(request), "--adapter", "cli-set", "--student", str(tiny_student),
                 "--out", str(tmp_path / "root"), "--admit-workers", "2", "--json"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0 and summary["status"] == "success", summary
    [record] = (tmp_path / "root" / "corpora" / "sets").rglob("*.json")
    totals = json.loads(record.read_text())["totals"]
    assert (totals["shards"], totals["examples"]) == (3, 9)
    single = run(spec_for(whole, tmp_path / "file-root", tiny_student, epochs=1))
    assert (Path(summary["adapter"]) / "adapter_model.safetensors").read_bytes() == adapter_bytes(single)


def test_the_opd_distill_flow_admits_a_set_with_one_task_per_shard(prefect_harness, tiny_student, corpus_lines,
                                                                   tmp_path):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from flows.opd_distill import opd_distill

    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    spec = spec_for(shards, tmp_path / "root", tiny_student, epochs=1)
    spec = spec.model_copy(update={"options": spec.options.model_copy(update={"admit_workers": 2})})
    state = opd_distill(spec, return_state=True)
    assert state.is_completed(), f"{state.type}: {state.message}"
    summary = state.result()
    assert summary["status"] == "success" and summary["dataset_sha256"] == spec_set_digest(shards)
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id])))
    shard_runs = sorted(run.name for run in runs if run.name.startswith("admit-shard"))
    assert len(shard_runs) == 3 and all(name.endswith(f"part-{n:02d}.jsonl") for n, name in enumerate(shard_runs)), shard_runs


def spec_set_digest(directory: Path) -> str:
    return set_sha256(["sha256:" + hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.glob("*.jsonl"))])


def test_two_torchrun_ranks_read_the_set_as_they_read_the_file(tiny_student, corpus_lines, tmp_path):
    """Every rank opens the set and reads the shard its block falls in: the same bytes as the file's 2-rank run."""
    shards = write_set(tmp_path / "corpus", corpus_lines, CUTS)
    whole = write_file(tmp_path / "whole.jsonl", corpus_lines)

    def two_ranks(corpus: Path, root: Path):
        from kiln_core.contracts.spec_blocks import DistributedOptions

        spec = spec_for(corpus, root, tiny_student, epochs=1, checkpoint_interval=2)
        return run(spec.model_copy(update={"distributed": DistributedOptions(nproc=2)}))

    from_set, from_file = two_ranks(shards, tmp_path / "set-root"), two_ranks(whole, tmp_path / "file-root")
    assert from_set.status == from_file.status == "success" and from_set.steps == 3  # 9 candidates, 4 per step
    assert adapter_bytes(from_set) == adapter_bytes(from_file)
    cursor = checkpoint_state(Path(from_set.run), 2)["data_cursor"]  # candidate 8: example 8, shard 2's row 1
    assert (cursor["epoch"], cursor["shard"], cursor["row"]) == (0, 2, 1)
