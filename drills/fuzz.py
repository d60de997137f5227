"""Bad input at scale: mutated corpora through admission (``fuzz-admission``).

The admission mutation property of ``tests/test_admission_paths.py`` run for many thousands of cases.
A seeded mutator (byte flips, inserted bytes, cuts, truncation; JSON field deletions, type swaps,
number edits — NaN, ±Infinity, 1e400, 2**32 - 1, −1, ... —; line shuffles, duplicates, drops, blank
lines; duplicate keys) damages a small valid corpus; each case is admitted with an output root and
must end in an admission or in exactly one ``AdmissionError`` with a code from ``ADMISSION_CODES``
and a line inside the file. Any other exception is a crash. A rejection must leave nothing under
``<root>/corpora``; an admission must leave exactly one committed directory and no staging entries.
Every ``parity_every``-th case is also admitted with the exact parser only (the fast one stepped
aside) and must get the same verdict. Case ``i`` of seed ``s`` is reproducible:
``mutate_corpus(base, case_ops(s, i))``. The byte and JSON mutations are shared with
``drills.fuzz_oracle``.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from drills import DrillReport, tiny_student, where

# ----------------------------------------------------------------------------------- corpus mutator

INSERT_BYTES = [b"{", b"}", b"[", b"]", b'"', b",", b":", b"\n", b"\r", b"\r\n", b" ", b"\t", b"\x0c", b"\xff",
                b"\xc3", b"\x00", b"0", b"-", b"9", b"e", b"NaN", b"null", "\u3000".encode(), b"\\", b"\\u0000",
                b"\\ud800", "\u2028".encode(), b"\xef\xbb\xbf"]
SWAP_VALUES = [None, True, False, 0, -1, 1.5, "x", "", [], {}, [None], {"token_id": 1}, 2**32, 2**64, -0.0, "\u0000",
               "\ud7ff\U0001f600", 10**40]
NUMBER_SENTINELS = {"@@NAN@@": "NaN", "@@INF@@": "Infinity", "@@NINF@@": "-Infinity", "@@HUGE@@": "1e400",
                    "@@TINY@@": "-1e-400", "@@BIGNEG@@": "-1e39", "@@BIGINT@@": "-1" + "0" * 400, "@@LONGINT@@": "9" * 5000}
CORPUS_OPS = ["flip", "insert", "cut", "truncate", "delete", "swap", "number", "number", "string", "shuffle",
              "duplicate", "drop", "blank", "dupkey", "parts", "uspace"]
# "parts" (content parts) and "uspace" (Unicode whitespace around a record) are valid shapes that only
# the exact parser reads: they send the following mutations down the exact path of the default flow.


def _nodes(value: Any, path: tuple = ()) -> Iterator[tuple]:
    if isinstance(value, dict):
        for key, child in value.items():
            yield path + (key,)
            yield from _nodes(child, path + (key,))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield path + (index,)
            yield from _nodes(child, path + (index,))


def _get(value: Any, path: tuple) -> Any:
    for part in path:
        value = value[part]
    return value


def _dumps(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    for sentinel, literal in NUMBER_SENTINELS.items():
        text = text.replace(f'"{sentinel}"', literal)
    return text


def _mutate_value(rng: random.Random, record: Any, op: str) -> bool:
    """Mutate one node of a parsed JSON value in place; False when there was nothing to mutate."""
    if op == "number":
        paths = [p for p in _nodes(record) if isinstance(_get(record, p), (int, float)) and not isinstance(_get(record, p), bool)]
    elif op == "string":
        paths = [p for p in _nodes(record) if isinstance(_get(record, p), str)]
    else:
        paths = list(_nodes(record))
    if not paths:
        return False
    path = rng.choice(paths)
    parent, key = _get(record, path[:-1]), path[-1]
    if op == "delete":
        del parent[key]
    elif op == "swap":
        parent[key] = rng.choice(SWAP_VALUES)
    elif op == "string":
        old = parent[key]
        parent[key] = rng.choice([old + "x", "", old[:-1], old.upper(), "../" + old, old + "\u0301", old * 3, "\x00" + old,
                                  old.replace(" ", "\u00a0")])
    else:
        old = parent[key]
        choice = rng.randrange(len(NUMBER_SENTINELS) + 9)
        if choice < len(NUMBER_SENTINELS):
            parent[key] = rng.choice(list(NUMBER_SENTINELS))
        else:
            parent[key] = _number_edit(old, choice - len(NUMBER_SENTINELS))
    return True


def _number_edit(old: int | float, which: int) -> int | float:
    """One arithmetic edit of a number; edits that overflow a float (huge integers) become infinity."""
    edits = [lambda: old + 1, lambda: old - 1, lambda: -old, lambda: old * 1e30, lambda: float(old),
             lambda: 2**32 - 1, lambda: 0.5, lambda: -1, lambda: 2**31]
    try:
        return edits[which]()
    except OverflowError:
        return float("inf") if old > 0 else float("-inf")


def _mutate_record_line(rng: random.Random, lines: list[str], op: str) -> list[str]:
    candidates = [i for i, line in enumerate(lines) if line.strip().startswith("{")]
    if not candidates:
        return lines
    index = rng.choice(candidates)
    try:
        record = json.loads(lines[index])
    except ValueError:
        return lines
    if op == "uspace":
        lines = list(lines)
        lines[index] = rng.choice(["\u3000", "\x0c", "\u00a0", "\u2009"]) + lines[index]
        return lines
    if op == "parts":
        messages = record.get("messages") if isinstance(record, dict) else None
        if not isinstance(messages, list):
            return lines
        for message in messages:
            if isinstance(message, dict) and isinstance(message.get("content"), str):
                message["content"] = [{"type": "text", "text": message["content"]}]
        lines = list(lines)
        lines[index] = _dumps(record)
        return lines
    if op == "dupkey":
        objects = [p for p in _nodes(record) if isinstance(_get(record, p), dict) and _get(record, p)] + [()]
        path = rng.choice(objects)
        target = _get(record, path) if path else record
        if not isinstance(target, dict) or not target:
            return lines
        key = rng.choice(list(target))
        text = _dumps(record)
        needle = json.dumps(key, ensure_ascii=False) + ":"
        position = text.find(needle)
        if position < 0:
            return lines
        value = rng.choice(['1', '"x"', 'null', json.dumps(target[key], ensure_ascii=False)])
        lines = list(lines)
        lines[index] = text[:position] + needle + value + "," + text[position:]
        return lines
    if not _mutate_value(rng, record, op):
        return lines
    lines = list(lines)
    lines[index] = _dumps(record)
    return lines


def joined(lines: list[str]) -> bytes:
    return ("\n".join(lines) + "\n").encode("utf-8", "surrogatepass")  # a lone surrogate stays (invalid UTF-8)


def mutate_corpus(base: list[str], ops: list[tuple[str, int]]) -> bytes:
    """Apply ``ops`` (name, seed) in order to the corpus lines ``base``; returns the file bytes."""
    lines = list(base)
    data: bytes | None = None
    for op, seed in ops:
        rng = random.Random(seed)
        if op in ("delete", "swap", "number", "string", "dupkey", "parts", "uspace", "shuffle", "duplicate", "drop", "blank"):
            if data is not None:
                lines = data.decode("utf-8", "replace").split("\n")
                data = None
            if op in ("delete", "swap", "number", "string", "dupkey", "parts", "uspace"):
                lines = _mutate_record_line(rng, lines, op)
            elif op == "shuffle":
                rng.shuffle(lines)
            elif op == "duplicate" and lines:
                lines.insert(rng.randrange(len(lines) + 1), rng.choice(lines))
            elif op == "drop" and lines:
                lines.pop(rng.randrange(len(lines)))
            elif op == "blank":
                lines.insert(rng.randrange(len(lines) + 1), rng.choice(["", " ", "\t", "\u3000", "\r", "\x0c"]))
            continue
        current = data if data is not None else joined(lines)
        if current:
            data = _mutate_bytes(rng, op, current)
    return data if data is not None else joined(lines)


def _mutate_bytes(rng: random.Random, op: str, data: bytes) -> bytes:
    """One byte-level edit of non-empty ``data``: flip, insert, cut or truncate at a random position."""
    buffer = bytearray(data)
    position = rng.randrange(len(buffer))
    if op == "flip":
        buffer[position] ^= rng.randrange(1, 256)
    elif op == "insert":
        buffer[position:position] = rng.choice(INSERT_BYTES)
    elif op == "cut":
        del buffer[position: position + rng.randrange(1, 9)]
    else:  # truncate
        del buffer[position:]
    return bytes(buffer)


def case_ops(seed: int, index: int) -> list[tuple[str, int]]:
    """The operations of case ``index`` of a run with ``seed`` (reproducible on their own)."""
    rng = random.Random(seed * 1_000_003 + index)
    return [(rng.choice(CORPUS_OPS), rng.randrange(2**32)) for _ in range(rng.randint(1, 3))]


def physical_lines(data: bytes) -> int:
    if not data:
        return 0
    return data.count(b"\n") + (0 if data.endswith(b"\n") else 1)


def _visible(root: Path) -> list[str]:
    corpora = root / "corpora"
    if not corpora.exists():
        return []
    return sorted(str(p.relative_to(corpora)) for p in corpora.rglob("*"))


@contextmanager
def _exact_parser_only() -> Iterator[None]:
    from kiln_core.admission import columnar

    original = columnar.parse_columnar
    columnar.parse_columnar = lambda data, lines: None
    try:
        yield
    finally:
        columnar.parse_columnar = original


def _verdict(corpus: Path, student_dir: Path, student: Any, out: Path | None) -> tuple:
    from kiln_core.admission import admit_corpus
    from kiln_core.errors import AdmissionError

    try:
        result = admit_corpus(str(corpus), str(student_dir), top_k=16, student=student,
                              out_root=str(out) if out is not None else None)
    except AdmissionError as error:
        return ("rejected", error.code, error.line), None
    return ("admitted", result.examples, result.action_tokens, result.env_tokens, result.dataset_sha256), result


def run_fuzz_admission(*, workdir: Path, examples: int = 10_000, seed: int = 0, parity_every: int = 25,
                       **_: Any) -> dict[str, Any]:
    """Admit ``examples`` mutated corpora; see the module docstring."""
    from kiln_core.errors import ADMISSION_CODES
    from kiln_core.synthetic import synthesize_corpus
    from kiln_core.tokenization import load_student_tokenizer

    report = DrillReport("fuzz-admission", seed=seed, mutator="seeded (drills.fuzz.case_ops)")
    student_dir = tiny_student(workdir)
    student = load_student_tokenizer(student_dir)
    base_path = synthesize_corpus(student_dir, workdir / "base.jsonl", n_examples=3, top_k=16, seed=5, trajectory_every=2,
                                  words=3)
    base = base_path.read_text(encoding="utf-8").splitlines()
    cases = workdir / "cases"
    shutil.rmtree(cases, ignore_errors=True)
    cases.mkdir()
    corpus = cases / "corpus.jsonl"
    out = cases / "out"
    distinct: set[str] = set()
    for index in range(examples):
        ops = case_ops(seed, index)
        label = f"case {index} ops={ops}"
        try:
            data = mutate_corpus(base, ops)
        except Exception as error:  # the drill's own mutator broke: not a finding about admission
            report.count("mutator_errors")
            report.note(f"{label}: mutator error {type(error).__name__}: {error}")
            continue
        try:
            distinct.add(hashlib.sha256(data).hexdigest())
            corpus.write_bytes(data)
            verdict, result = _verdict(corpus, student_dir, student, out)
            report.count("cases_tried")
            problems = []
            if verdict[0] == "rejected":
                _, code, line = verdict
                report.count("rejected")
                report.bump("rejected_by_code", code)
                if code not in ADMISSION_CODES:
                    problems.append(f"unknown code {code}")
                if line is not None and not 1 <= line <= physical_lines(data):
                    problems.append(f"line {line} outside the file's {physical_lines(data)} lines")
                left = _visible(out)
                if left:
                    problems.append(f"rejection left {left[:5]} under corpora/")
            else:
                report.count("admitted")
                entries = _visible(out)
                hex_digest = verdict[4].removeprefix("sha256:")
                if [e for e in entries if e.startswith(".") or "/." in e or "incomplete" in e]:
                    problems.append(f"staging entries left: {entries}")
                if not (out / "corpora" / hex_digest / "admission.json").is_file():
                    problems.append("admitted but no committed admission.json")
                if verdict[1] < 1 or verdict[2] < 1:
                    problems.append(f"admitted {verdict[1]} examples / {verdict[2]} action tokens")
            if parity_every and index % parity_every == 0:
                report.count("parity_checked")
                try:
                    with _exact_parser_only():
                        exact, _ = _verdict(corpus, student_dir, student, None)
                except Exception as error:  # a crash on the exact path is a crash of admission
                    report.bump("crashes_by_type", type(error).__name__)
                    report.failed_trial(f"{label} (exact parser only): {type(error).__name__}: {error} @ {where(error)}",
                                        crash=True)
                    continue
                if exact != verdict:
                    problems.append(f"parsers disagree: default {verdict}, exact-only {exact}")
                    report.count("parity_mismatches")
            if problems:
                report.failed_trial(f"{label}: " + "; ".join(problems))
            else:
                report.passed_trial()
        except Exception as error:  # anything but AdmissionError is a crash
            report.count("cases_tried")
            report.bump("crashes_by_type", type(error).__name__)
            report.failed_trial(f"{label}: {type(error).__name__}: {error} @ {where(error)}", crash=True)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    report["distinct_inputs"] = len(distinct)
    report["codes_seen"] = len(report.figures.get("rejected_by_code", {}))
    figures = report.finish()
    figures["passed"] = (figures["passed"] and figures.get("admitted", 0) > 0 and figures["codes_seen"] >= 5
                         and not figures.get("mutator_errors"))
    return figures
