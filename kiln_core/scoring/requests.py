"""Examples as teacher requests: the admission mask builder's token ids and targets, and their identity.

Shared by one-file scoring (``kiln_core.scoring``) and sharded scoring (``kiln_core.scoring.shards``), which
must tokenize exactly alike for a set to equal the file it would otherwise be.
"""

from __future__ import annotations

import hashlib

from kiln_core.scoring.examples import ScoreRequest, ScoringError, ScoringExample

__all__ = ["encode_requests", "sequence_key"]


def encode_requests(student, batch: list[ScoringExample], max_model_len: int) -> list[ScoreRequest]:
    """The admission mask builder over one batch; a failure is traced to its line.

    Raises:
        ScoringError: what admission would refuse (``tokenization_failed``, ``no_action_tokens``,
            ``overlapping_masks``, ``target_at_position_zero``, ``context_too_long``), naming the line.
    """
    from kiln_core.tokenization import TokenizationError, encode_conversations

    try:
        encoded = encode_conversations(student, [example.conversation for example in batch])
    except TokenizationError:
        encoded = []
        for example in batch:
            try:
                encoded.extend(encode_conversations(student, [example.conversation]))
            except TokenizationError as error:
                raise ScoringError("tokenization_failed", str(error), line=example.line) from None
    requests = []
    for example, enc in zip(batch, encoded):
        if enc.problem is not None:  # what admission would refuse, refused before the teacher runs
            code = "tokenization_failed" if enc.problem.code == "invalid_record" else enc.problem.code
            raise ScoringError(code, enc.problem.message, line=example.line)
        if enc.action_positions.shape[0] == 0:
            raise ScoringError("no_action_tokens", "the example produced no assistant action tokens", line=example.line)
        if enc.input_ids.shape[0] > max_model_len:
            raise ScoringError(
                "context_too_long",
                f"{enc.input_ids.shape[0]} tokens exceed the teacher's max_model_len {max_model_len}",
                line=example.line,
            )
        requests.append(ScoreRequest(line=example.line, input_ids=enc.input_ids, positions=enc.action_positions))
    return requests


def sequence_key(request: ScoreRequest) -> bytes:
    """A digest of an example's token ids and targets: examples sharing it get the same rows, byte for byte."""
    digest = hashlib.sha256(request.input_ids.astype("<i4").tobytes())
    digest.update(b"|")
    digest.update(request.positions.astype("<i4").tobytes())
    return digest.digest()
