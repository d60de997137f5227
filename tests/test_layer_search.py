"""``models derive-student --keep-layers auto:N``: the kept layers are chosen by held-out reverse KL.

The reference derives every candidate to disk the ordinary way (``--keep-layers i,j,k``), loads it as a
student and evaluates it on the probe corpus; the search, which prunes one loaded teacher in memory, must
report the same metrics (1e-5 absolute) and keep the candidate with the lowest reverse KL.
"""

from __future__ import annotations

import json

import pytest

from test_evaluation import write_jsonl
from test_models import cli, four_layer_teacher, last_json  # noqa: F401

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PROBE = [
    ("Name three primary colors.", "Red, yellow and blue are the three primary colors."),
    ("What does a thermometer measure?", "A thermometer measures temperature."),
    ("Spell the word cat backwards.", "The word cat spelled backwards is tac."),
    ("How many legs does a spider have?", "A spider has eight legs."),
]


@pytest.fixture(scope="module")
def probe(tmp_path_factory, four_layer_teacher):  # noqa: F811
    from kiln_core.scoring import score_examples

    base = tmp_path_factory.mktemp("probe")
    source = write_jsonl(base / "probe-examples.jsonl",
                         [{"messages": [{"role": "user", "content": q}], "teacher_response": a} for q, a in PROBE])
    out = base / "probe.jsonl"
    score_examples(str(source), teacher_dir=str(four_layer_teacher), student_dir=str(four_layer_teacher), top_k=32,
                   out_uri=str(out))
    return out


@pytest.mark.fast
def test_candidates_keep_a_block_at_each_end_within_the_budget():
    from kiln_core.models.layer_search import both_ends_candidates

    assert both_ends_candidates(6, 3) == [[0, 4, 5], [0, 1, 5]]
    assert both_ends_candidates(30, 15)[0] == [0, *range(16, 30)] and len(both_ends_candidates(30, 15)) == 14
    spread = both_ends_candidates(30, 15, budget=4)
    assert [len([i for i in kept if i < 15]) for kept in spread] == [1, 5, 10, 14]  # a = 1 .. 14: both extremes, evenly between
    assert both_ends_candidates(30, 15, budget=1) == [both_ends_candidates(30, 15)[0]]
    assert all(len(kept) == 15 and kept == sorted(set(kept)) for kept in both_ends_candidates(30, 15))


@pytest.mark.fast
@pytest.mark.parametrize("spec", ["auto:1", "auto:4", "auto:x", "auto:"])
def test_an_auto_count_outside_the_teacher_is_refused(spec):
    from kiln_core.models import ModelImportError
    from kiln_core.models.layer_search import parse_auto

    with pytest.raises(ModelImportError) as caught:
        parse_auto(spec, 4)
    assert caught.value.code == "invalid_keep_layers" and "auto:N" in caught.value.message


def test_auto_keeps_the_candidate_with_the_lowest_held_out_reverse_kl(tmp_path, four_layer_teacher, probe):  # noqa: F811
    from kiln_core.evaluation import admit_eval_corpus, evaluate_tables, load_eval_model
    from kiln_core.models import derive_student

    result = cli("models", "derive-student", str(four_layer_teacher), "--keep-layers", "auto:3", "--probe-corpus",
                 str(probe), "--out", str(tmp_path / "auto"), "--json")
    assert result.returncode == 0, result.stderr
    summary = last_json(result)
    record = json.loads((tmp_path / "auto" / "kiln-derivation.json").read_text())
    search = record["search"]
    assert [c["kept_teacher_layers"] for c in search["candidates"]] == [[0, 2, 3], [0, 1, 3]]
    for i, candidate in enumerate(search["candidates"]):
        reference_dir = derive_student(four_layer_teacher, ",".join(map(str, candidate["kept_teacher_layers"])),
                                       tmp_path / f"candidate-{i}")
        tables = admit_eval_corpus(str(probe), str(reference_dir), top_k=32).tables
        reference = evaluate_tables(load_eval_model(reference_dir, device="cpu"), tables)
        assert candidate["tokens"] == reference.tokens > 0 and candidate["examples"] == len(PROBE)
        assert abs(candidate["reverse_kl"] - reference.reverse_kl) < 1e-5
        assert abs(candidate["teacher_token_nll"] - reference.teacher_token_nll) < 1e-5
    best = min(search["candidates"], key=lambda c: c["reverse_kl"])["kept_teacher_layers"]
    assert record["kept_teacher_layers"] == summary["kept_teacher_layers"] == best
    assert record["keep_layers_spec"] == "auto:3" and search["chosen"] == search["candidates"].index(
        next(c for c in search["candidates"] if c["kept_teacher_layers"] == best))
    assert search["probe_corpus_sha256"].startswith("sha256:") and search["probe_examples"] == len(PROBE)
    chosen = derive_student(four_layer_teacher, ",".join(map(str, best)), tmp_path / "by-hand")
    assert (chosen / "model.safetensors").read_bytes() == (tmp_path / "auto" / "model.safetensors").read_bytes()


def test_auto_without_a_probe_corpus_is_refused_and_writes_nothing(tmp_path, four_layer_teacher):  # noqa: F811
    result = cli("models", "derive-student", str(four_layer_teacher), "--keep-layers", "auto:2", "--out",
                 str(tmp_path / "s"), "--json")
    assert result.returncode == 2 and last_json(result)["code"] == "invalid_keep_layers"
    assert "--probe-corpus" in last_json(result)["message"] and not (tmp_path / "s").exists()


def test_a_budget_of_one_scores_one_candidate(tmp_path, four_layer_teacher, probe):  # noqa: F811
    result = cli("models", "derive-student", str(four_layer_teacher), "--keep-layers", "auto:3", "--probe-corpus",
                 str(probe), "--probe-budget", "1", "--probe-examples", "2", "--out", str(tmp_path / "s"), "--json")
    assert result.returncode == 0, result.stderr
    search = last_json(result)["search"]
    assert len(search["candidates"]) == 1 and search["probe_examples"] == 2 and search["budget"] == 1


def test_the_real_preparation_derives_an_auto_student_once_per_probe(tmp_path, four_layer_teacher, probe, monkeypatch):  # noqa: F811
    """``prepare_student`` (demo --real, bench/distill_quality.py): an ``auto:N`` student is searched once, then
    reused; another probe corpus is another search, never the first probe's student."""
    import shutil

    from kiln_core.models import derive
    from kiln_core.models.prepare import prepare_student

    teacher = tmp_path / "models" / "teacher"
    shutil.copytree(four_layer_teacher, teacher)
    first = prepare_student(teacher, "auto:3", probe_corpus=probe)
    assert first.parent == teacher.parent
    assert json.loads((first / "kiln-derivation.json").read_text())["keep_layers_spec"] == "auto:3"

    derived = []
    real_derive = derive.derive_student
    monkeypatch.setattr(derive, "derive_student", lambda *a, **k: derived.append(a) or real_derive(*a, **k))
    assert prepare_student(teacher, "auto:3", probe_corpus=probe) == first and derived == []
    other_probe = tmp_path / "other-probe.jsonl"
    other_probe.write_bytes(probe.read_bytes())
    second = prepare_student(teacher, "auto:3", probe_corpus=other_probe)
    assert second != first and len(derived) == 1 and (second / "kiln-derivation.json").is_file()


def test_a_fixed_spec_ignores_the_probe_and_keeps_one_cache_entry(tmp_path, four_layer_teacher, probe):  # noqa: F811
    """The demo and the bench pass their training corpus as the probe whatever the spec: only ``auto:N`` uses it."""
    import shutil

    from kiln_core.models.prepare import prepare_student

    teacher = tmp_path / "models" / "teacher"
    shutil.copytree(four_layer_teacher, teacher)
    with_probe = prepare_student(teacher, "0,3", probe_corpus=probe)
    assert prepare_student(teacher, "0,3") == with_probe == teacher.parent / "student-0_3"
    assert "search" not in json.loads((with_probe / "kiln-derivation.json").read_text())
