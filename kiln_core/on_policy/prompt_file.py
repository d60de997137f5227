"""The pipeline's prompt file: a JSONL of ``OpdPrompt`` objects, one per line, local or any fsspec URI.

Lines follow Kiln's JSONL conventions (``crates/kiln-train/src/opd.rs`` ·
``parse_off_policy_distillation_dataset_str``): split on ``\\n`` (a ``\\r`` before it is dropped),
each line trimmed, blank lines skipped. Every other line must be one JSON object that parses as an
``OpdPrompt`` (unknown fields ignored, as serde ignores them) with non-empty ``messages``. A
rejection names the 1-based physical line (blank lines counted) and the rule:

``file_not_found``, ``file_too_large`` (over 64 MiB, Kiln's request-body and prompt-size bound),
``invalid_utf8``, ``invalid_json`` (``kiln_core.strict_json``'s rules: syntax, ``NaN``/``Infinity``, a
duplicate key, a float literal no float represents exactly, nesting too deep; or a lone surrogate),
``not_an_object``, ``invalid_prompt`` (the record's shape), ``prompt_no_messages`` (Kiln's ``OPD
prompt {i} has no messages``), ``no_prompts`` (nothing but blank lines). An unreachable store is an
``EnvironmentFailure`` (``storage_unavailable``).

The prompts' identity is not the file's bytes: it is Kiln's digest of the prompt list
(``kiln_core.contracts.opd_prompt.prompts_content_sha256``), so the same prompts sent inline or in a
file train the same run.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from kiln_core.contracts.opd_prompt import OpdPrompt
from kiln_core.errors import EnvironmentFailure, Rejection
from kiln_core.storage import resolve
from kiln_core.strict_json import StrictJsonError, loads_strict

__all__ = ["MAX_PROMPT_FILE_BYTES", "PROMPTS_DIR", "PromptFile", "read_prompt_file", "parse_prompt_lines",
           "write_inline_prompts"]

MAX_PROMPT_FILE_BYTES = 64 * 1024 * 1024
PROMPTS_DIR = "prompts"
"""Where inline prompts are written under a storage root (``write_inline_prompts``)."""


@dataclass(frozen=True)
class PromptFile:
    """Prompts read from a file.

    Attributes:
        uri: Where they were read from.
        prompts: The prompts, in file order.
        lines: The 1-based physical line of each prompt.
        rows: Each prompt's JSON object as written, unknown fields included (Kiln's overlap check hashes
            training rows as written: ``kiln_core.post_eval.overlap.row_identity``).
    """

    uri: str
    prompts: tuple[OpdPrompt, ...]
    lines: tuple[int, ...]
    rows: tuple[dict[str, Any], ...] = ()


def read_prompt_file(uri: str, storage_options: dict[str, Any] | None = None) -> PromptFile:
    """Read and validate a prompt JSONL.

    Raises:
        Rejection: the first rule a line breaks (see the module docstring), with ``line`` and ``file``.
        EnvironmentFailure: ``storage_unavailable`` when the store cannot be read.

    Example:
        >>> read_prompt_file("s3://bucket/prompts.jsonl").prompts[0].messages[0].role  # doctest: +SKIP
        'user'
    """
    location = resolve(uri, storage_options)
    try:
        with location.fs.open(location.path, "rb") as handle:
            data = handle.read(MAX_PROMPT_FILE_BYTES + 1)
    except FileNotFoundError:
        raise Rejection("file_not_found", f"prompt file {uri} does not exist", file=uri) from None
    except IsADirectoryError:
        raise Rejection("file_not_found", f"prompt file {uri} is a directory", file=uri) from None
    except OSError as error:
        raise EnvironmentFailure("storage_unavailable", f"cannot read prompt file {uri}: {error}", file=uri) from None
    if len(data) > MAX_PROMPT_FILE_BYTES:
        raise Rejection("file_too_large", f"prompt file is larger than {MAX_PROMPT_FILE_BYTES} bytes; split it into "
                        "smaller jobs", file=uri)
    records = _parse_records(data, uri)
    return PromptFile(uri=location.uri, prompts=tuple(prompt for prompt, _, _ in records),
                      lines=tuple(line for _, line, _ in records), rows=tuple(row for _, _, row in records))


def parse_prompt_lines(data: bytes, *, file: str | None = None) -> tuple[tuple[OpdPrompt, ...], tuple[int, ...]]:
    """Parse prompt JSONL bytes; returns the prompts and their 1-based physical lines.

    Example:
        >>> parse_prompt_lines(b'\\n{"messages": [{"role": "user", "content": "hi"}]}\\n')[1]
        (2,)
    """
    records = _parse_records(data, file)
    return tuple(prompt for prompt, _, _ in records), tuple(line for _, line, _ in records)


def _parse_records(data: bytes, file: str | None) -> list[tuple[OpdPrompt, int, dict[str, Any]]]:
    """``(prompt, physical line, JSON object)`` of every prompt line, or the first rule a line breaks."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data[: error.start].count(b"\n") + 1
        raise Rejection("invalid_utf8", f"not valid UTF-8 at byte {error.start}", line=line, file=file) from None
    records: list[tuple[OpdPrompt, int, dict[str, Any]]] = []
    for number, raw in enumerate(text.split("\n"), start=1):
        stripped = raw.removesuffix("\r").strip()
        if not stripped:
            continue
        value = _parse_json(stripped, number, file)
        if not isinstance(value, dict):
            raise Rejection("not_an_object", f"a prompt line must be a JSON object, not {type(value).__name__}",
                            line=number, file=file)
        try:
            prompt = OpdPrompt.model_validate(value)
        except ValidationError as error:
            first = error.errors()[0]
            where = ".".join(str(part) for part in first["loc"])
            raise Rejection("invalid_prompt", f"{first['msg']}", line=number, field=where or None, file=file) from None
        if not prompt.messages:
            raise Rejection("prompt_no_messages", f"OPD prompt {len(records)} has no messages", line=number,
                            field="messages", file=file)
        records.append((prompt, number, value))
    if not records:
        raise Rejection("no_prompts", "the prompt file holds no prompt (only blank lines)", file=file)
    return records


def _parse_json(text: str, line: int, file: str | None) -> Any:
    try:
        value = loads_strict(text)
        json.dumps(value, ensure_ascii=False).encode("utf-8")  # a lone surrogate escape: serde refuses it too
        return value
    except UnicodeEncodeError:
        raise Rejection("invalid_json", "a string holds a lone UTF-16 surrogate escape", line=line, file=file) from None
    except StrictJsonError as error:
        raise Rejection("invalid_json", f"not valid JSON: {error}", line=line, file=file) from None


def write_inline_prompts(prompts: list[OpdPrompt], storage_root: str) -> str:
    """Write a request's inline prompts as ``<root>/prompts/<digest>.jsonl`` (once; same prompts, same file).

    Each line is Kiln's re-serialization of one prompt, so reading the file back gives the same
    prompt-list digest as the inline list.

    Example:
        >>> write_inline_prompts(request.prompts, "./kiln-data")  # doctest: +SKIP
        '/abs/kiln-data/prompts/3b1f….jsonl'
    """
    from kiln_core.contracts.opd_prompt import kiln_prompt_value, prompts_content_sha256
    from kiln_core.serde_json import serde_json_text
    from kiln_core.storage import write_bytes_atomic

    location = resolve(storage_root).child(PROMPTS_DIR, f"{prompts_content_sha256(prompts)}.jsonl")
    if not location.exists():
        data = "".join(serde_json_text(kiln_prompt_value(prompt)) + "\n" for prompt in prompts).encode("utf-8")
        write_bytes_atomic(location, data)
    return location.uri
