"""The fast path of corpus parsing: the whole buffer through ``pyarrow.json`` with an explicit schema.

The millions of top-K candidates become flat numpy arrays without a Python object each. This path
accepts only corpora whose every field has the expected JSON type; at the first sign of anything
else (content parts, tool calls, a negative id, a null Arrow cannot tell from a missing field, JSON
nested as deep as serde_json's limit, a line pyarrow and Kiln would split differently, a field outside
the schema, a number beyond an f64) it returns
``None`` and the exact parser in ``records.py`` decides, naming the line.
"""

from __future__ import annotations

import numpy as np

from kiln_core.admission.parsed import SEGMENT_KINDS, U32_MAX, ParsedCorpus, decode_json_line, offsets_of
from kiln_core.admission.source import LineIndex, json_blank_lines
from kiln_core.chat_template import Conversation, Segment
from kiln_core.contracts.identity import MANIFEST_SCHEMA
from kiln_core.kiln_prompts import KilnPromptDigest
from kiln_core.strict_json import SERDE_JSON_RECURSION_LIMIT, NestingTooDeep, text_nesting_depth


# --- fast path ----------------------------------------------------------------------------------


def _fast_schema():
    import pyarrow as pa

    candidate = pa.struct([("token_id", pa.int64()), ("logprob", pa.float64())])
    teacher_token = pa.struct(
        [
            ("token_id", pa.int64()),
            ("token", pa.string()),
            ("logprob", pa.float64()),
            ("top_logprobs", pa.list_(candidate)),
        ]
    )
    # `tool_calls` is arbitrary JSON the chat template reads, which Arrow cannot carry through: typed
    # null, the parse itself refuses any other value (and the exact parser decides).
    message = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("name", pa.string()),
            ("tool_call_id", pa.string()),
            ("tool_calls", pa.null()),
        ]
    )
    segment = pa.struct(
        [
            ("role", pa.string()),
            ("content", pa.string()),
            ("kind", pa.string()),
            ("tool_call_id", pa.string()),
            ("warning_prefix_len", pa.int64()),
        ]
    )
    # The manifest line's identity, field by field (Kiln's TeacherIdentity), so that the parse can refuse
    # every field outside the schema; the exact manifest checks still read the line itself.
    adapter = pa.struct([("name", pa.string()), ("weights_sha256", pa.string()), ("config_sha256", pa.string())])
    identity = pa.struct(
        [("schema", pa.string()), ("protocol", pa.string()), ("served_model_id", pa.string()),
         ("base_model_sha256", pa.string()), ("tokenizer_vocab_sha256", pa.string()),
         ("tokenizer_config_sha256", pa.string()), ("adapter", adapter), ("vocab_size", pa.int64()),
         ("max_top_k", pa.int64()), ("max_model_len", pa.int64()), ("max_prompt_logprob_candidates", pa.int64()),
         ("logprobs_mode", pa.string()), ("implementation", pa.string()), ("inference_config_sha256", pa.string())]
    )
    return pa.schema(
        [
            ("schema", pa.string()),
            ("teacher_identity", identity),
            ("id", pa.string()),
            ("messages", pa.list_(message)),
            ("teacher_response", pa.string()),
            ("teacher_tokens", pa.list_(teacher_token)),
            ("trajectory", pa.list_(segment)),
        ]
    )


def parse_columnar(data: bytes, lines: LineIndex) -> ParsedCorpus | None:
    """Columnar parse with pyarrow, or ``None`` when the exact path must decide."""
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.json as pj

    blank = json_blank_lines(data, lines)
    record_lines = np.flatnonzero(~blank) + 1
    if record_lines.size == 0:
        return None
    if text_nesting_depth(data) >= SERDE_JSON_RECURSION_LIMIT:
        return None  # pyarrow reads any depth; serde_json refuses the line, the exact parser names it
    try:
        table = pj.read_json(
            pa.BufferReader(data),  # zero-copy, unlike io.BytesIO of a bytearray
            read_options=pj.ReadOptions(block_size=_block_size(lines)),
            # A field outside the schema sends the corpus to the exact parser: pyarrow would skip its value
            # unread, and a number there beyond an f64 (1.8e308) is "number out of range" to serde_json.
            parse_options=pj.ParseOptions(explicit_schema=_fast_schema(), unexpected_field_behavior="error"),
        )
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return None
    if table.num_rows != record_lines.size:
        return None

    schema_column = table.column("schema").to_numpy(zero_copy_only=False)
    is_manifest = np.asarray([value == MANIFEST_SCHEMA for value in schema_column], dtype=bool)
    parsed = ParsedCorpus(parser="fast")
    for row in np.flatnonzero(is_manifest):
        number = int(record_lines[row])
        raw = lines.raw(data, number - 1).decode("utf-8")
        try:
            value = decode_json_line(raw)
        except (ValueError, NestingTooDeep):
            return None
        parsed.manifest_records.append((number, raw, value))

    manifest_rows = np.flatnonzero(is_manifest)
    if manifest_rows.size == 0 or np.array_equal(manifest_rows, np.arange(manifest_rows.size)):
        examples = table.slice(manifest_rows.size)  # the usual layout: zero-copy
    else:
        examples = table.filter(pa.array(~is_manifest))  # misplaced manifests: admission rejects them anyway
    parsed.example_lines = record_lines[~is_manifest].astype(np.int64)
    if parsed.example_lines.size:
        parsed.first_example_line = int(parsed.example_lines[0])
    if examples.column("messages").null_count or examples.column("teacher_response").null_count:
        return None
    if examples.column("teacher_tokens").null_count:
        return None  # `null` vs missing matters to the exact parser
    trajectories = examples.column("trajectory")
    if trajectories.null_count and data.count(b'"trajectory"') != len(trajectories) - trajectories.null_count:
        return None  # a `"trajectory": null` (refused) may hide among the rows without one (allowed)

    prompts = KilnPromptDigest()
    conversations = _fast_conversations(examples, prompts)
    if conversations is None:
        return None
    parsed.conversations = conversations
    parsed.kiln_prompts_sha256 = prompts.hexdigest()
    parsed.messages_count = pc.list_value_length(examples.column("messages")).to_numpy().astype(np.int64)
    parsed.response_empty = (
        pc.equal(pc.utf8_length(examples.column("teacher_response")), 0).to_numpy(zero_copy_only=False).astype(bool)
    )

    tokens = pc.list_flatten(examples.column("teacher_tokens"))
    parsed.token_offsets = offsets_of(pc.list_value_length(examples.column("teacher_tokens")).to_numpy())
    token_ids = pc.struct_field(tokens, "token_id")
    top = pc.struct_field(tokens, "top_logprobs")
    if top.null_count:
        return None
    candidates = pc.list_flatten(top)
    candidate_ids = pc.struct_field(candidates, "token_id")
    candidate_logprobs = pc.struct_field(candidates, "logprob")
    if candidates.null_count or candidate_ids.null_count or candidate_logprobs.null_count:
        return None
    if token_ids.null_count < len(token_ids) and pc.min(token_ids).as_py() < 0:
        return None  # a negative declared id is the exact parser's invalid_record, not "absent"
    parsed.declared_token_ids = token_ids.fill_null(-1).to_numpy().astype(np.int64)
    parsed.candidate_offsets = offsets_of(pc.list_value_length(top).to_numpy())
    parsed.candidate_ids = candidate_ids.to_numpy().astype(np.int64, copy=False)
    parsed.candidate_logprobs = candidate_logprobs.to_numpy().astype(np.float64, copy=False)
    declared_known = parsed.declared_token_ids[parsed.declared_token_ids != -1]
    if np.any(declared_known < 0) or np.any(declared_known > U32_MAX):
        return None
    if parsed.candidate_ids.size and (parsed.candidate_ids.min() < 0 or parsed.candidate_ids.max() > U32_MAX):
        return None
    token_logprob = pc.struct_field(tokens, "logprob")
    if np.isinf(parsed.candidate_logprobs).any() or pc.any(pc.is_inf(token_logprob)).as_py():
        return None  # pyarrow reads 1.8e308 or a 400-digit integer as infinite; serde_json refuses the line
    parsed.numeric_logits = len(token_logprob) > token_logprob.null_count or len(candidates) > 0
    return parsed


def _block_size(lines: LineIndex) -> int:
    """Parser block size: 8 MiB (measured fastest for 64 MiB corpora of 100 KB lines on 2 cores),
    and never smaller than the longest line (a row may not straddle blocks)."""
    longest = int((lines.ends - lines.starts).max()) if len(lines) else 0
    return max(8 << 20, 1 << int(longest + 2).bit_length())


def _fast_conversations(examples, prompts: KilnPromptDigest) -> list[Conversation] | None:
    """Build conversations from the (small) text columns and feed each example's prompt to Kiln's
    prompt digest; ``None`` if any needs the exact parser.

    Arrow reads a missing and a null field alike as None; the prompt digest treats them alike too.
    """
    messages_column = examples.column("messages").to_pylist()
    responses = examples.column("teacher_response").to_pylist()
    trajectories = examples.column("trajectory").to_pylist()
    conversations = []
    for messages, response, trajectory in zip(messages_column, responses, trajectories):
        normalized = []
        for message in messages:
            if message is None or message["role"] is None:
                return None
            plain = {key: value for key, value in message.items() if value is not None}
            plain["content"] = message["content"] or ""
            normalized.append(plain)
        segments = None
        if trajectory:
            segments = []
            for segment in trajectory:
                if segment is None or segment["role"] is None or segment["content"] is None:
                    return None
                kind = segment["kind"]  # null or missing: Arrow cannot tell which, Kiln can
                prefix = segment["warning_prefix_len"] or 0
                if kind not in SEGMENT_KINDS or prefix < 0:
                    return None
                segments.append(Segment(segment["role"], segment["content"], kind, segment["tool_call_id"], prefix))
        conversations.append(Conversation(messages=normalized, teacher_response=response, trajectory=segments))
        prompts.add(messages, response, trajectory)
    return conversations
