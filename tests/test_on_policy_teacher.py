"""Teacher scoring of rollouts with Kiln's ``LiveLocalTeacher`` semantics.

What a user depends on: the teacher's top-K at each sampled token is the full-vocabulary
log-softmax of the row that predicts it, ranked with ties to the lower id, checked by Kiln's row
rules; a teacher whose identity does not fit, or whose numbers are broken, is refused. Checked
against a reference computed here from the full logits in float64 (tolerance 1e-5).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest

from kiln_core.contracts.identity import TeacherIdentity
from kiln_core.errors import Rejection
from kiln_core.on_policy.prepare import PreparedPrompt, candidate_sequences
from kiln_core.on_policy.teacher import LiveLocalTeacher, TeacherRows, check_teacher_rows


@pytest.fixture(scope="module")
def identity(tiny_teacher) -> TeacherIdentity:
    from kiln_core.identity.local_teacher import local_teacher_identity

    return local_teacher_identity(str(tiny_teacher), max_top_k=32, device_kind="cpu")


@pytest.fixture(scope="module")
def teacher(tiny_teacher, identity) -> LiveLocalTeacher:
    return LiveLocalTeacher.load(str(tiny_teacher), identity=identity, top_k=16, device="cpu")


def reference_rows(model, tokens, targets, k):
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([list(tokens)]), use_cache=False).logits[0].double().numpy()
    ids, values = [], []
    for q in targets:
        row = logits[q - 1]
        logprobs = row - (row.max() + np.log(np.exp(row - row.max()).sum()))
        order = sorted(range(row.shape[0]), key=lambda v: (-logprobs[v], v))[:k]
        ids.append(order)
        values.append(logprobs[order])
    return np.array(ids), np.array(values)


TOKENS = np.array([1, 87, 34, 120, 2, 208, 1, 75, 199, 5, 301, 44, 12], dtype=np.int32)


def test_rows_match_the_full_vocabulary_reference(teacher):
    targets = np.array([1, 4, 5, 9, 12], dtype=np.int32)
    rows = teacher.score(TOKENS, targets)
    ref_ids, ref_values = reference_rows(teacher.model, TOKENS, targets, 16)
    assert rows.ids.dtype == np.int32 and rows.logprobs.dtype == np.float32 and rows.ids.shape == (5, 16)
    np.testing.assert_array_equal(rows.ids, ref_ids)
    np.testing.assert_allclose(rows.logprobs, ref_values, atol=1e-5, rtol=0)
    check_teacher_rows(rows, 16, 400)
    assert teacher.score(TOKENS, targets, top_k=32).ids.shape == (5, 32)


def test_an_asymmetric_candidate_is_scored_in_the_teachers_own_sequence(teacher):
    prefix = np.array([1, 87, 34, 2], np.int32)
    hinted = np.array([1, 99, 98, 97, 87, 34, 2], np.int32)
    sampled = [120, 208, 5]
    plain = teacher.score_candidate(candidate_sequences(PreparedPrompt(0, prefix, prefix, prefix, None), sampled))
    asymmetric = teacher.score_candidate(candidate_sequences(PreparedPrompt(0, prefix, prefix, prefix, hinted),
                                                             sampled))
    direct = teacher.score(np.concatenate([hinted, sampled]), np.array([7, 8, 9]))
    np.testing.assert_array_equal(asymmetric.ids, direct.ids)
    np.testing.assert_array_equal(asymmetric.logprobs, direct.logprobs)
    assert not np.array_equal(asymmetric.logprobs, plain.logprobs)  # the hint changes what the teacher predicts


def test_identity_must_fit_the_model_and_k(teacher, identity):
    wider = TeacherIdentity.model_validate({**identity.as_ordered_dict(), "vocab_size": 512})
    with pytest.raises(Rejection) as caught:
        LiveLocalTeacher(teacher.model, identity=wider, top_k=16)
    assert caught.value.code == "vocab_size_mismatch"
    assert caught.value.message == "live local teacher identity vocab_size 512 does not match model vocab_size 400"
    narrow = TeacherIdentity.model_validate({**identity.as_ordered_dict(), "max_top_k": 20})
    with pytest.raises(Rejection) as caught:
        LiveLocalTeacher(teacher.model, identity=narrow, top_k=32)
    assert (caught.value.code, caught.value.message) == ("top_k_exceeds_identity",
                                                         "live local teacher top_k 32 exceeds identity max_top_k 20")


@pytest.mark.parametrize("tokens, targets, k, fragment", [
    ([], [1], None, "tokens must not be empty"),
    ([1, 2, 400], [1], None, "outside vocab_size 400"),
    ([1, 2, 3], [0, 1], None, "position 0 has no preceding logits row"),
    ([1, 2, 3], [2, 1], None, "strictly increasing"),
    ([1, 2, 3], [1, 1], None, "strictly increasing"),
    ([1, 2, 3], [3], None, "below the token length 3"),
    ([1, 2, 3], [], None, "at least one target"),
    ([1, 2, 3], [1], 33, "top_k 33 must be in 1..=32"),
])
def test_requests_kiln_refuses_are_refused(teacher, tokens, targets, k, fragment):
    with pytest.raises(Rejection) as caught:
        teacher.score(np.array(tokens, np.int64), np.array(targets, np.int64), top_k=k)
    assert caught.value.code == "invalid_rollout" and fragment in caught.value.message


def test_a_teacher_producing_non_finite_logprobs_is_refused(teacher, identity):
    import torch

    broken = copy.deepcopy(teacher.model)
    with torch.no_grad():
        broken.get_output_embeddings().weight[7] = float("nan")
    with pytest.raises(Rejection) as caught:
        LiveLocalTeacher(broken, identity=identity, top_k=16).score(TOKENS, np.array([3, 4]))
    assert caught.value.code == "teacher_output" and "row 0 token" in caught.value.message


@pytest.mark.parametrize("mutate, rule", [
    (lambda ids, values: ids.__setitem__((1, 2), 400), "has a token id outside vocab_size"),
    (lambda ids, values: ids.__setitem__((1, 2), ids[1, 1]), "contains a duplicate token id"),
    (lambda ids, values: values.__setitem__((1, 0), 0.5), "has a non-finite or positive logprob"),
    (lambda ids, values: values.__setitem__((1, 3), np.inf), "has a non-finite or positive logprob"),
    (lambda ids, values: values.__setitem__((1, 3), values[1, 1] + 0.25), "logprobs are not non-increasing"),
    (lambda ids, values: values.__setitem__((1, slice(None)), np.log(0.2)), "sparse probability mass exceeds 1"),
])
def test_every_row_rule_of_kiln(mutate, rule):
    ids = np.tile(np.arange(8, dtype=np.int32), (3, 1))
    values = np.tile(np.log(np.linspace(0.2, 0.01, 8)).astype(np.float32), (3, 1))
    check_teacher_rows(TeacherRows(ids, values), 8, 400)
    mutate(ids, values)
    with pytest.raises(Rejection) as caught:
        check_teacher_rows(TeacherRows(ids, values), 8, 400)
    assert caught.value.code == "teacher_output" and caught.value.message.endswith(f"row 1 {rule}")


def test_a_directory_that_is_not_a_model_is_refused(identity, tmp_path):
    with pytest.raises(Rejection) as caught:
        LiveLocalTeacher.load(str(tmp_path), identity=identity, top_k=16, device="cpu")
    assert caught.value.code == "teacher_invalid"
