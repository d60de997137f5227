"""Bad input at scale: mutated HF next-token requests through the oracle's gates (``fuzz-oracle``).

Valid ``kiln.hf-next-token-request.v1`` files made by ``make_request`` from the tiny student are
mutated (bytes; JSON fields: deletions, type swaps, numbers, strings, lists, unknown and duplicate
keys, non-canonical number literals; half of the JSON mutations get their derived hashes recomputed
so the deeper rules are reached) and run through the oracle's gates in the runner's order: strict
JSON + schema + cross-field (``parse_request_bytes``), receipts (``check_source_receipts``), model
identity (``check_model_identity``) and the tokenizer re-check (``check_model_inputs``). Each case is
accepted or raises ``OracleRejection`` with a rule from ``ALL_RULES``; anything else is a crash.
"""

from __future__ import annotations

import hashlib
import json
import random
import shutil
from pathlib import Path
from typing import Any

from drills import DrillReport, tiny_student, where
from drills.fuzz import NUMBER_SENTINELS, SWAP_VALUES, _get, _mutate_bytes, _mutate_value, _nodes

# ----------------------------------------------------------------------------------- oracle mutator

ORACLE_OPS = ["flip", "insert", "cut", "truncate", "delete", "swap", "number", "number", "string", "list", "list",
              "unknown-key", "dupkey", "literal", "candidates"]


def _refresh(doc: dict) -> dict:
    """Recompute the derived fields so that only the mutation itself is left to catch (best effort)."""
    from kiln_core.canonical import canonical_sha256, sha256_prefixed

    try:
        prompt = doc["prompt"]
        prompt["utf8_sha256"] = sha256_prefixed(prompt["messages"][0]["content"].encode("utf-8"))
        prompt["token_count"] = len(prompt["token_ids"])
        doc["input_token_ids"] = prompt["token_ids"] + [item["token_id"] for item in doc["continuation_prefix"]]
        doc["input_token_ids_sha256"] = canonical_sha256(doc["input_token_ids"])
    except Exception:  # the mutation broke the shape: leave the document as it is
        pass
    return doc


def mutate_request(base: bytes, ops: list[tuple[str, int]], refresh: bool) -> bytes:
    """Apply ``ops`` to a request file's bytes (JSON-level ops parse, mutate and re-serialize)."""
    data = base
    for op, seed in ops:
        rng = random.Random(seed)
        if op in ("flip", "insert", "cut", "truncate"):
            if data:
                data = _mutate_bytes(rng, op, data)
            continue
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            continue
        if op == "literal":  # a literal strict JSON refuses, in place of one number
            numbers = [m for m in _number_spans(data)]
            if numbers:
                start, end = rng.choice(numbers)
                literal = rng.choice([b"NaN", b"Infinity", b"-Infinity", b"1e400", b"1e-400", b"0.10000000000000001",
                                      b"9" * 4100, b"1.0", b"-0", b"1E2", b"17.000"])
                data = data[:start] + literal + data[end:]
            continue
        if op == "dupkey":
            text = data.decode("utf-8", "replace")
            keys = [k for k in ('"id":', '"schema":', '"token_id":', '"text":', '"engine":', '"path":', '"sha256":')
                    if k in text]
            if keys:
                key = rng.choice(keys)
                position = text.find(key)
                data = (text[:position] + key + rng.choice(['"x"', "1", "null", "[]"]) + "," + text[position:]).encode(
                    "utf-8", "surrogatepass")
            continue
        if op == "unknown-key":
            objects = [p for p in _nodes(doc) if isinstance(_get(doc, p), dict)] + [()]
            path = rng.choice(objects)
            (_get(doc, path) if path else doc)[rng.choice(["extra", "x-unknown", "Id", "schema "])] = rng.choice(SWAP_VALUES)
        elif op == "list":
            lists = [p for p in _nodes(doc) if isinstance(_get(doc, p), list)]
            if lists:
                target = _get(doc, rng.choice(lists))
                action = rng.randrange(6)
                if action == 0 and target:
                    target.append(json.loads(json.dumps(rng.choice(target))))
                elif action == 1 and target:
                    target.pop(rng.randrange(len(target)))
                elif action == 2:
                    rng.shuffle(target)
                elif action == 3:
                    target.clear()
                elif action == 4 and target:
                    target.insert(0, json.loads(json.dumps(target[-1])))
                else:
                    target.append(rng.choice(SWAP_VALUES))
        elif op == "candidates":
            candidates = doc.get("candidates") if isinstance(doc, dict) else None
            if isinstance(candidates, list) and len(candidates) == 2 and all(isinstance(c, dict) for c in candidates):
                action = rng.randrange(4)
                if action == 0:
                    candidates.reverse()
                elif action == 1:
                    candidates[1]["token_id"] = candidates[0].get("token_id")
                elif action == 2:
                    candidates[rng.randrange(2)]["token_id"] = rng.choice([0, 1, 399, 400, 401, 248319, 2**32])
                else:
                    candidates[rng.randrange(2)]["engine"] = rng.choice(["kiln", "vllm", "hf", ""])
        elif not _mutate_value(rng, doc, op):
            continue
        if refresh and isinstance(doc, dict):
            doc = _refresh(doc)
        text = json.dumps(doc, ensure_ascii=rng.random() < 0.5, indent=rng.choice([None, 2]))
        for sentinel, literal in NUMBER_SENTINELS.items():
            text = text.replace(f'"{sentinel}"', literal)
        data = text.encode("utf-8", "surrogatepass")
    return data


def _number_spans(data: bytes) -> list[tuple[int, int]]:
    import re

    return [(m.start(1), m.end(1)) for m in re.finditer(rb"[:\[,]\s*(-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?)", data)]


def oracle_case_ops(seed: int, index: int) -> tuple[list[tuple[str, int]], bool, bool]:
    """(ops, refresh derived fields, check receipts) of case ``index`` (half skip the receipts, as a run
    without ``--receipts-root`` does, so the model-identity gate sees the mutated identities)."""
    rng = random.Random(seed * 2_000_003 + index)
    ops = [(rng.choice(ORACLE_OPS), rng.randrange(2**32)) for _ in range(rng.randint(1, 3))]
    return ops, rng.random() < 0.5, rng.random() < 0.5


def run_fuzz_oracle(*, workdir: Path, examples: int = 10_000, seed: int = 0, **_: Any) -> dict[str, Any]:
    """Run ``examples`` mutated oracle requests through every input gate; see the module docstring."""
    from kiln_core.oracle import OracleRejection, check_model_identity, check_source_receipts, make_request
    from kiln_core.oracle.errors import ALL_RULES
    from kiln_core.oracle.reference import check_model_inputs, load_tokenizer
    from kiln_core.oracle.request import parse_request_bytes

    report = DrillReport("fuzz-oracle", seed=seed)
    student_dir = tiny_student(workdir)
    oracle_dir = workdir / "oracle"
    shutil.rmtree(oracle_dir, ignore_errors=True)
    oracle_dir.mkdir()
    made = make_request(student_dir, message="What is two plus two?", prefix_text="Two plus", kiln_id=17, vllm_id=42,
                        request_id="drill-request-1", out=oracle_dir / "drill-request-1.json", source_commit="ab" * 20)
    base = Path(made.request_uri).read_bytes()
    tokenizer = load_tokenizer(student_dir)
    # the unmutated request must pass every gate, or the drill measures nothing
    loaded = parse_request_bytes(base)
    check_source_receipts(loaded.request, made.receipts_root)
    check_model_identity(loaded.request.model_identity, student_dir)
    check_model_inputs(student_dir, loaded.request, tokenizer)
    distinct: set[str] = set()
    for index in range(examples):
        ops, refresh, receipts = oracle_case_ops(seed, index)
        label = f"case {index} ops={ops} refresh={refresh} receipts={receipts}"
        stage = "parse"
        try:
            data = mutate_request(base, ops, refresh)
        except Exception as error:  # the drill's own mutator broke: not a finding about the oracle
            report.count("mutator_errors")
            report.note(f"{label}: mutator error {type(error).__name__}: {error}")
            continue
        try:
            distinct.add(hashlib.sha256(data).hexdigest())
            report.count("cases_tried")
            loaded = parse_request_bytes(data, "<fuzz>")
            stage = "receipts"
            if receipts:
                check_source_receipts(loaded.request, made.receipts_root)
            stage = "model_identity"
            check_model_identity(loaded.request.model_identity, student_dir)
            stage = "model_inputs"
            check_model_inputs(student_dir, loaded.request, tokenizer)
            report.count("accepted")
            if data == base:
                report.count("accepted_identical_to_base")
            report.passed_trial()
        except OracleRejection as error:
            report.count("rejected")
            report.bump("rejected_by_rule", error.rule)
            report.bump("rejected_at_stage", stage)
            if error.rule not in ALL_RULES or not error.message:
                report.failed_trial(f"{label}: rejection without a known rule: {error!r}")
            else:
                report.passed_trial()
        except Exception as error:
            report.bump("crashes_by_type", type(error).__name__)
            report.failed_trial(f"{label} stage={stage}: {type(error).__name__}: {error} @ {where(error)}", crash=True)
    report["distinct_inputs"] = len(distinct)
    report["rules_seen"] = len(report.figures.get("rejected_by_rule", {}))
    figures = report.finish()
    figures["passed"] = figures["passed"] and figures.get("accepted", 0) > 0 and not figures.get("mutator_errors")
    return figures
