"""Reading a source adapter's ``replay.jsonl``: the prompts it trained on, as Kiln's ``distill_merge`` reads them.

Kiln (crates/kiln-server/src/training_queue.rs · derive_source_prompts, and the
admission-time reader in api/training.rs):

* the file must be a regular file of at most 64 MiB of UTF-8; every non-blank line (Rust's trim) valid JSON;
* from each line take ``request_body`` when the key is there, else the whole line; then its arrays
  ``examples`` (SFT requests) and ``prompts`` (OPD requests), in that order;
* from each element keep only the ``messages`` entries that parse as chat messages; an element left with
  none is skipped; ``teacher_extra_messages`` and ``trajectory`` are dropped. Lines are not filtered by type.

kiln-flows writes the log beside every adapter it trains (``kiln_core.engine.replay_log``); a Kiln adapter's
own log reads the same way.
"""

from __future__ import annotations

import os
from typing import Any

from kiln_core.errors import Rejection

__all__ = ["MAX_REPLAY_BYTES", "REPLAY_FILE", "ReplayLogError", "read_replay_prompts"]

REPLAY_FILE = "replay.jsonl"
MAX_REPLAY_BYTES = 64 * 1024 * 1024


class ReplayLogError(Rejection, ValueError):
    """A source adapter's replay log that cannot be read; codes ``replay_log_missing``, ``replay_log_invalid``."""


def _missing(source: str, uri: str, why: str) -> ReplayLogError:
    return ReplayLogError("replay_log_missing", f'distill_merge: source adapter "{source}" has no readable replay '
                          f"log at {uri} ({why})", file=uri)


def _read_bounded(location: Any, source: str) -> bytes:
    """The log's bytes: a regular file (symlinks followed, as Rust's ``fs::metadata``) of at most 64 MiB."""
    try:
        info = os.stat(location.path) if location.is_local else location.fs.info(location.path)
    except FileNotFoundError:
        raise _missing(source, location.uri, "no such file") from None
    except OSError as error:
        raise _missing(source, location.uri, f"{type(error).__name__}: {error}") from None
    is_file = os.path.isfile(location.path) if location.is_local else info.get("type") == "file"
    size = info.st_size if location.is_local else int(info.get("size") or 0)
    if not is_file:
        raise _missing(source, location.uri, "not a regular file")
    if size > MAX_REPLAY_BYTES:
        raise _missing(source, location.uri, f"{size} bytes; at most {MAX_REPLAY_BYTES} are read")
    try:
        data = location.read_bytes()
    except OSError as error:
        raise _missing(source, location.uri, f"{type(error).__name__}: {error}") from None
    if len(data) > MAX_REPLAY_BYTES:  # grew after the size check
        raise _missing(source, location.uri, f"more than {MAX_REPLAY_BYTES} bytes")
    return data


def _chat_messages(element: Any) -> list[dict[str, Any]]:
    """The element's ``messages`` entries that parse as chat messages (Kiln's ``filter_map``)."""
    from pydantic import ValidationError

    from kiln_core.contracts.example import ChatMessage

    messages = element.get("messages") if isinstance(element, dict) else None
    if not isinstance(messages, list):
        return []
    kept = []
    for message in messages:
        try:
            ChatMessage.model_validate(message)
        except ValidationError:
            continue
        kept.append(message)
    return kept


def _array(body: Any, key: str) -> list[Any]:
    value = body.get(key) if isinstance(body, dict) else None
    return value if isinstance(value, list) else []


def read_replay_prompts(adapter_dir: str | os.PathLike[str], *, source: str) -> list[list[dict]]:
    """The prompts a source adapter trained on, read from ``<adapter_dir>/replay.jsonl`` under Kiln's rules.

    Args:
        adapter_dir: The adapter directory (local path or fsspec URI).
        source: The source's adapter name, for the messages (``sources[i].adapter``).

    Returns:
        One item per prompt, in file order: that prompt's chat messages (JSON objects as written).

    Raises:
        ReplayLogError: ``replay_log_missing`` (absent, not a regular file, over 64 MiB, not UTF-8), or
            ``replay_log_invalid`` naming the 1-based line that is not JSON (``line`` set).

    Example:
        >>> read_replay_prompts("kiln-data/runs/rust-helper/3f2a9c0d1e2b4a5c/adapter", source="rust-helper")  # doctest: +SKIP
        [[{'role': 'user', 'content': 'Reverse a list'}, {'role': 'assistant', 'content': 'xs[::-1]'}]]
    """
    from kiln_core.admission.parsed import RUST_WHITESPACE
    from kiln_core.storage import resolve
    from kiln_core.strict_json import loads_nesting_limited

    location = resolve(os.fspath(adapter_dir)).child(REPLAY_FILE)
    data = _read_bounded(location, source)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise _missing(source, location.uri, f"not UTF-8 at byte {error.start}") from None
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    prompts: list[list[dict]] = []
    for number, raw in enumerate(lines, start=1):
        line = raw.strip(RUST_WHITESPACE)
        if not line:
            continue
        try:
            value = loads_nesting_limited(line, where=f"replay line {number}")
        except (ValueError, Rejection) as error:
            detail = getattr(error, "message", None) or str(error)
            raise ReplayLogError("replay_log_invalid", f'distill_merge: source adapter "{source}" replay line '
                                 f"{number} is invalid JSON: {detail}", line=number, file=location.uri) from None
        body = value["request_body"] if isinstance(value, dict) and "request_body" in value else value
        for element in _array(body, "examples") + _array(body, "prompts"):
            messages = _chat_messages(element)
            if messages:
                prompts.append(messages)
    return prompts
