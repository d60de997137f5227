"""Kiln's per-example admission rules, checked over whole columns at once.

Each rule becomes a boolean mask over examples or teacher tokens; only the failing positions are
ever looked at in Python. When several things are wrong, the reported one is the one Kiln would
hit first: the earliest example, and within it the rules in Kiln's order (opd.rs
``prepare_off_policy_distillation_dataset_with_identity``):
messages, response, tokenization and masks (a refused template, overlapping masks), action tokens,
a target at position 0 (logit_source.rs ``target_token_positions_to_logits_rows``), teacher-token
count, declared token ids, then per teacher token — candidate count, id range and finiteness,
unique ids, sign, order, mass — then, when Kiln first inserts the example's rows, its input ids
below ``vocab_size`` (``FixtureLogitSource::insert``), and the duplicate-row check.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kiln_core.admission.parsed import ParsedCorpus
from kiln_core.corpus import CorpusTables
from kiln_core.errors import AdmissionError
from kiln_core.tokenization import EncodedConversation

F32_EPSILON = float(np.finfo(np.float32).eps)
MASS_LIMIT = 1.0 + 32.0 * F32_EPSILON

# Per-token rules in the order Kiln checks them; the index is the rule's priority.
TOKEN_RULES = (
    "too_few_candidates",
    "token_id_out_of_range",
    "non_finite_logprob",
    "duplicate_candidate",
    "positive_logprob",
    "not_non_increasing",
    "mass_exceeds_one",
    "input_token_out_of_range",
    "conflicting_duplicate_row",
)
_NO_FAILURE = len(TOKEN_RULES)


@dataclass(frozen=True)
class _Failure:
    example: int
    code: str
    message: str


def check_examples(
    parsed: ParsedCorpus,
    encoded: list[EncodedConversation],
    tokenization_errors: dict[int, str],
    *,
    top_k: int,
    vocab_size: int,
) -> CorpusTables:
    """Apply every per-example rule and return the admitted corpus as flat tables.

    Args:
        parsed: The parsed corpus.
        encoded: One encoding per example (ignored where ``tokenization_errors`` has the index).
        tokenization_errors: Example index → message for examples the template could not render.
        top_k: The effective top-K (16 or 32): the first ``top_k`` candidates of each row are consumed.
        vocab_size: The student's logit width.

    Raises:
        AdmissionError: The first failure in file order.
    """
    n = parsed.num_examples
    action_counts = np.asarray([len(e.action_positions) for e in encoded], dtype=np.int64)
    token_counts = np.diff(parsed.token_offsets)
    failures: list[_Failure] = []

    for i in np.flatnonzero(parsed.messages_count == 0)[:1]:
        failures.append(_Failure(int(i), "empty_messages", f"example {i} has no messages"))
    for i in np.flatnonzero(parsed.response_empty)[:1]:
        failures.append(_Failure(int(i), "empty_response", f"example {i} has empty teacher_response"))
    for i, message in sorted(tokenization_errors.items())[:1]:
        failures.append(_Failure(i, "invalid_record", f"example {i} could not be tokenized: {message}"))
    refused = _indices_mask(n, tokenization_errors)
    problems = [i for i, e in enumerate(encoded) if e.problem is not None and not refused[i]]
    for i in problems[:1]:
        failures.append(_Failure(i, encoded[i].problem.code, f"example {i}: {encoded[i].problem.message}"))
    refused[problems] = True
    no_action = (action_counts == 0) & ~refused
    for i in np.flatnonzero(no_action)[:1]:
        failures.append(_Failure(int(i), "no_action_tokens", f"example {i} produced no assistant action tokens"))
    refused |= no_action
    count_mismatch = (token_counts != action_counts) & ~refused
    for i in np.flatnonzero(count_mismatch)[:1]:
        failures.append(
            _Failure(
                int(i),
                "token_count_mismatch",
                f"example {i} has {token_counts[i]} teacher_tokens but {action_counts[i]} action tokens",
            )
        )

    # Token-level rules run over the examples whose teacher tokens line up with their targets.
    aligned = (token_counts == action_counts) & ~refused
    token_mask = np.repeat(aligned, token_counts)
    token_example = np.repeat(np.arange(n, dtype=np.int64), token_counts)[token_mask]
    token_index = (np.arange(int(parsed.token_offsets[-1]), dtype=np.int64) - np.repeat(parsed.token_offsets[:-1], token_counts))[token_mask]
    aligned_examples = np.flatnonzero(aligned)
    positions = _concat([encoded[i].action_positions for i in aligned_examples], np.int64)
    targets = _concat([encoded[i].input_ids[encoded[i].action_positions] for i in aligned_examples], np.int64)

    declared = parsed.declared_token_ids[token_mask]
    id_mismatch = (declared != -1) & (declared != targets)
    if id_mismatch.any():
        first_per_example = _first_per_group(token_example, id_mismatch)
        for example, t in first_per_example[:1]:
            failures.append(
                _Failure(
                    example,
                    "token_id_mismatch",
                    f"example {example} token {token_index[t]} declares token_id {declared[t]}, but tokenization "
                    f"produced active target {targets[t]} at position {positions[t]}",
                )
            )

    ids, logprobs32, rule = _candidate_rules(parsed, token_mask, top_k, vocab_size)
    _mark_input_ids(rule, token_example, token_index, encoded, vocab_size)
    _mark_conflicts(rule, ids, logprobs32, token_example, encoded)
    failing = rule < _NO_FAILURE
    # Examples with a token_id mismatch fail on it before any candidate is looked at.
    failing &= ~np.isin(token_example, [f.example for f in failures if f.code == "token_id_mismatch"])
    if failing.any():
        for example, t in _first_per_group(token_example, failing)[:1]:
            code = TOKEN_RULES[rule[t]]
            failures.append(
                _Failure(example, code, _token_message(code, example, int(token_index[t]), int(positions[t]), parsed,
                                                       token_mask, t, ids, logprobs32, top_k, vocab_size,
                                                       encoded[example].input_ids))
            )

    if failures:
        first = min(failures, key=lambda f: (f.example, _EXAMPLE_RULE_ORDER.index(f.code) if f.code in _EXAMPLE_RULE_ORDER else len(_EXAMPLE_RULE_ORDER)))
        raise AdmissionError(first.code, int(parsed.example_lines[first.example]), first.message)

    return _tables(parsed, encoded, ids, logprobs32)


_EXAMPLE_RULE_ORDER = (
    "empty_messages",
    "empty_response",
    "invalid_record",
    "overlapping_masks",
    "no_action_tokens",
    "target_at_position_zero",
    "token_count_mismatch",
    "token_id_mismatch",
)


def _candidate_rules(parsed: ParsedCorpus, token_mask: np.ndarray, top_k: int, vocab_size: int):
    """First failing candidate rule per aligned teacher token (``_NO_FAILURE`` when it passes)."""
    starts = parsed.candidate_offsets[:-1][token_mask]
    counts = np.diff(parsed.candidate_offsets)[token_mask]
    rule = np.full(starts.shape[0], _NO_FAILURE, dtype=np.int64)
    enough = counts >= top_k
    rule[~enough] = TOKEN_RULES.index("too_few_candidates")

    gather = np.where(enough, starts, 0)[:, None] + np.arange(top_k, dtype=np.int64)[None, :]
    if parsed.candidate_ids.size == 0:
        gather = np.zeros((starts.shape[0], top_k), dtype=np.int64)
        ids = np.zeros_like(gather)
        logprobs64 = np.zeros(gather.shape, dtype=np.float64)
    else:
        np.minimum(gather, parsed.candidate_ids.size - 1, out=gather)
        ids = parsed.candidate_ids[gather]
        logprobs64 = parsed.candidate_logprobs[gather]
    with np.errstate(over="ignore", invalid="ignore"):
        logprobs32 = logprobs64.astype(np.float32)  # Kiln converts to f32 before validating

    def mark(code: str, violated: np.ndarray) -> None:
        hit = violated & (rule == _NO_FAILURE)
        rule[hit] = TOKEN_RULES.index(code)

    out_of_range = ids >= vocab_size
    non_finite = ~np.isfinite(logprobs32)
    # Kiln walks the entries in order and reports the first of "id out of range" / "non-finite".
    first_range = _first_true(out_of_range)
    first_finite = _first_true(non_finite)
    mark("token_id_out_of_range", out_of_range.any(axis=1) & (first_range <= first_finite))
    mark("non_finite_logprob", non_finite.any(axis=1))
    sorted_ids = np.sort(ids, axis=1)
    mark("duplicate_candidate", (sorted_ids[:, 1:] == sorted_ids[:, :-1]).any(axis=1))
    mark("positive_logprob", (logprobs32 > 0).any(axis=1))
    mark("not_non_increasing", (logprobs32[:, 1:] > logprobs32[:, :-1]).any(axis=1))
    with np.errstate(over="ignore", invalid="ignore"):
        mass = np.exp(logprobs32.astype(np.float64)).sum(axis=1)
    mark("mass_exceeds_one", mass > MASS_LIMIT)
    return ids, logprobs32, rule  # int64: ids up to 2**32 - 1 must stay visible to the messages


def _mark_input_ids(rule, token_example, token_index, encoded, vocab_size: int) -> None:
    """Kiln's first fixture insert of an example checks every input id against ``vocab_size``.

    That happens after its first teacher token's row is validated, so the rule lands on token 0.
    """
    first = np.flatnonzero((token_index == 0) & (rule == _NO_FAILURE))
    for t in first:
        if encoded[int(token_example[t])].input_ids.max(initial=0) >= vocab_size:
            rule[t] = TOKEN_RULES.index("input_token_out_of_range")


def _mark_conflicts(rule, ids, logprobs32, token_example, encoded) -> None:
    """Rows for the same exact token sequence and position must be identical (ids and f32 bits).

    Kiln keys scored rows by (full token sequence, position); identical sequences produce identical
    target positions, so token k of a later duplicate is compared with token k of the first one.
    """
    if token_example.size == 0:
        return
    examples = np.unique(token_example)
    keys: dict[bytes, int] = {}
    starts = np.searchsorted(token_example, examples)
    ends = np.searchsorted(token_example, examples, side="right")
    bits = logprobs32.view(np.uint32)
    for example, start, end in zip(examples, starts, ends):
        key = encoded[example].input_ids.tobytes()
        first = keys.setdefault(key, int(start))
        if first == start:
            continue
        length = end - start
        differs = (ids[start:end] != ids[first : first + length]).any(axis=1) | (
            bits[start:end] != bits[first : first + length]
        ).any(axis=1)
        hit = differs & (rule[start:end] == _NO_FAILURE)
        rule[start:end][hit] = TOKEN_RULES.index("conflicting_duplicate_row")


def _token_message(code, example, k, position, parsed, token_mask, t, ids, logprobs32, top_k, vocab_size, encoded_ids) -> str:
    where = f"example {example} token {k} (target position {position})"
    if code == "too_few_candidates":
        have = int(np.diff(parsed.candidate_offsets)[token_mask][t])
        return f"{where} has {have} top_logprobs, need at least {top_k}"
    if code == "token_id_out_of_range":
        bad = int(ids[t][ids[t] >= vocab_size][0])
        return f"{where} has token_id {bad} outside vocab_size {vocab_size}"
    if code == "non_finite_logprob":
        return f"{where} has a non-finite logprob (after f32 conversion)"
    if code == "duplicate_candidate":
        values, counts = np.unique(ids[t], return_counts=True)
        return f"{where}: row contains duplicate token id {int(values[counts > 1][0])}"
    if code == "positive_logprob":
        return f"{where} has a positive logprob {float(logprobs32[t].max())}"
    if code == "not_non_increasing":
        c = int(np.flatnonzero(logprobs32[t][1:] > logprobs32[t][:-1])[0]) + 1
        return f"{where}: logprobs are not non-increasing at candidate {c}: {logprobs32[t][c]} follows {logprobs32[t][c - 1]}"
    if code == "mass_exceeds_one":
        mass = float(np.exp(logprobs32[t].astype(np.float64)).sum())
        return f"{where}: sparse probability mass {mass!r} exceeds 1 + 32·f32::EPSILON"
    if code == "input_token_out_of_range":
        return f"example {example}: " + _input_id_message(encoded_ids, vocab_size)
    return f"{where} conflicts with an earlier row for the same exact token sequence"


def _input_id_message(input_ids: np.ndarray, vocab_size: int) -> str:
    index = int(np.flatnonzero(input_ids >= vocab_size)[0])
    return (f"input token {index} has id {int(input_ids[index])}, outside the student's vocab_size {vocab_size} "
            f"(the tokenizer has ids the model has no logit for)")


def _first_true(matrix: np.ndarray) -> np.ndarray:
    """Column index of the first True per row (the row width when there is none)."""
    any_true = matrix.any(axis=1)
    return np.where(any_true, matrix.argmax(axis=1), matrix.shape[1])


def _first_per_group(groups: np.ndarray, mask: np.ndarray) -> list[tuple[int, int]]:
    """``(group, first index)`` for each group with a True, ordered by group."""
    hits = np.flatnonzero(mask)
    unique, first = np.unique(groups[hits], return_index=True)
    return [(int(g), int(hits[f])) for g, f in zip(unique, first)]


def _indices_mask(n: int, indices) -> np.ndarray:
    mask = np.zeros(n, dtype=bool)
    if indices:
        mask[list(indices)] = True
    return mask


def _concat(parts, dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _tables(parsed: ParsedCorpus, encoded: list[EncodedConversation], ids, logprobs32) -> CorpusTables:
    def offsets(parts) -> np.ndarray:
        return np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64)

    inputs = [e.input_ids for e in encoded]
    actions = [e.action_positions for e in encoded]
    envs = [e.env_positions for e in encoded]
    return CorpusTables(
        lines=parsed.example_lines.copy(),
        input_ids=_concat(inputs, np.int32),
        input_offsets=offsets(inputs),
        action_positions=_concat(actions, np.int32),
        action_offsets=offsets(actions),
        env_positions=_concat(envs, np.int32),
        env_in_warning_prefix=_concat([e.env_in_warning_prefix for e in encoded], np.bool_),
        env_offsets=offsets(envs),
        teacher_ids=np.ascontiguousarray(ids, dtype=np.int32),
        teacher_logprobs=np.ascontiguousarray(logprobs32, dtype=np.float32),
        observation_tokens=np.asarray([e.observation_tokens for e in encoded], dtype=np.int64),
    )
