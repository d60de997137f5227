"""A stand-in vLLM server for the scoring tests: a real HTTP server process on loopback.

    python tests/fake_vllm_server.py --port 0 --teacher DIR --manifest FILE

prints the port it listens on as its first stdout line, once it is listening. ``POST
/<scenario>/v1/completions`` answers like vLLM's OpenAI completions endpoint with ``prompt_logprobs``
computed from the teacher in DIR with torch (fp32, eager attention, full-vocabulary log_softmax of
row p − 1 for prompt position p), and ``system_fingerprint`` set to the Kiln fingerprint of the
identity in FILE's manifest line. Each prompt position holds the top-K candidates with ranks 1..K
(descending, ties → lower id first) plus the observed token as an extra K+1-th entry, with its true
rank, when it is outside the top K; position 0 is ``null``.

The request body must be exactly Kiln's (reference/kiln-opd-spec.md §8.4), else HTTP 400. Scenarios
pick a contract violation so a client's checks can be tested:

* ``ok``: a correct response;
* ``bad-fingerprint``: the fingerprint of a different identity;
* ``bad-model``: ``model`` names another model;
* ``missing-rank``: the rank-2 candidate of every position has no ``rank``;
* ``high-mass``: every candidate claims logprob −0.01 (probability mass far above 1).

The fingerprint is computed here independently of kiln_core, so the test checks both sides.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCENARIOS = ("ok", "bad-fingerprint", "bad-model", "missing-rank", "high-mass")
EXPECTED_BODY_KEYS = ["model", "prompt", "max_tokens", "temperature", "prompt_logprobs", "n", "stream", "add_special_tokens"]


def fingerprint(identity: dict) -> str:
    """``kiln-teacher-v1.`` + unpadded base64url(canonical identity) + ``.`` + hex sha256(canonical identity)."""
    canonical = json.dumps(identity, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    encoded = base64.urlsafe_b64encode(canonical).rstrip(b"=").decode("ascii")
    return f"kiln-teacher-v1.{encoded}.{hashlib.sha256(canonical).hexdigest()}"


class Teacher:
    """The tiny teacher model; one forward at a time (the lock keeps CPU use predictable)."""

    def __init__(self, teacher_dir: str) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.set_num_threads(1)
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(
            teacher_dir, dtype=torch.float32, attn_implementation="eager", local_files_only=True
        ).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(teacher_dir, local_files_only=True)
        self.lock = threading.Lock()

    def prompt_logprobs(self, prompt: list[int], k: int) -> list[dict | None]:
        import numpy as np

        torch = self.torch
        with self.lock, torch.inference_mode():
            logits = self.model(input_ids=torch.tensor([prompt]), use_cache=False).logits[0]
            logprobs = torch.log_softmax(logits.float(), dim=-1).numpy()
        vocab = np.arange(logprobs.shape[-1])
        entries: list[dict | None] = [None]
        for p in range(1, len(prompt)):
            row = logprobs[p - 1]
            top = np.lexsort((vocab, -row))[:k]  # descending logprob, ties → lower id
            entry = {str(int(i)): self._candidate(row, int(i), rank) for rank, i in enumerate(top, start=1)}
            observed = prompt[p]
            if str(observed) not in entry:
                rank = int((row > row[observed]).sum()) + 1  # vLLM's rank: 1 + how many are strictly higher
                entry[str(observed)] = self._candidate(row, observed, rank)
            entries.append(entry)
        return entries

    def _candidate(self, row, token_id: int, rank: int) -> dict:
        return {"logprob": float(row[token_id]), "rank": rank, "decoded_token": self.tokenizer.decode([token_id])}


class Handler(BaseHTTPRequestHandler):
    teacher: Teacher
    identity: dict
    served_model: str
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002
        pass

    def _send(self, status: int, payload: dict) -> None:
        body = json.dumps(payload).encode("utf-8")
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self) -> None:  # noqa: N802
        scenario, _, route = self.path.strip("/").partition("/")
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if scenario not in SCENARIOS or route != "v1/completions":
            self._send(404, {"error": f"unknown route {self.path}"})
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._send(400, {"error": "body is not JSON"})
            return
        problem = self._check_body(body)
        if problem:
            self._send(400, {"object": "error", "message": problem, "type": "BadRequestError", "code": 400})
            return
        self._send(200, self._respond(scenario, body))

    def _check_body(self, body: dict) -> str | None:
        if not isinstance(body, dict) or list(body) != EXPECTED_BODY_KEYS:
            return f"body keys must be exactly {EXPECTED_BODY_KEYS}, got {list(body) if isinstance(body, dict) else body}"
        fixed = {"max_tokens": 1, "temperature": 0.0, "n": 1, "stream": False, "add_special_tokens": False}
        for key, value in fixed.items():
            if body[key] != value or type(body[key]) is not type(value):
                return f"{key} must be {value!r}, got {body[key]!r}"
        if body["model"] != self.served_model:
            return f"The model `{body['model']}` does not exist."
        prompt, k = body["prompt"], body["prompt_logprobs"]
        if not isinstance(prompt, list) or len(prompt) < 2 or not all(type(t) is int and t >= 0 for t in prompt):
            return "prompt must be a list of at least two token ids"
        if type(k) is not int or not 1 <= k <= self.identity["max_top_k"]:
            return f"prompt_logprobs must be in 1..{self.identity['max_top_k']}"
        if len(prompt) + 1 > self.identity["max_model_len"]:
            return "prompt too long"
        return None

    def _respond(self, scenario: str, body: dict) -> dict:
        prompt, k = body["prompt"], body["prompt_logprobs"]
        entries = self.teacher.prompt_logprobs(prompt, k)
        identity = self.identity
        model = self.served_model
        if scenario == "bad-fingerprint":
            identity = {**identity, "max_model_len": identity["max_model_len"] - 1}
        elif scenario == "bad-model":
            model = self.served_model + "-other"
        elif scenario == "missing-rank":
            for entry in entries[1:]:
                for candidate in entry.values():
                    if candidate["rank"] == 2:
                        del candidate["rank"]
        elif scenario == "high-mass":
            for entry in entries[1:]:
                for candidate in entry.values():
                    candidate["logprob"] = -0.01
        return {
            "id": "cmpl-fake",
            "object": "text_completion",
            "created": 1700000000,
            "model": model,
            "system_fingerprint": fingerprint(identity),
            "choices": [
                {"index": 0, "text": "!", "logprobs": None, "finish_reason": "length", "stop_reason": None,
                 "prompt_logprobs": entries}
            ],
            "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + 1, "completion_tokens": 1},
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--teacher", required=True, help="teacher model directory")
    parser.add_argument("--manifest", required=True, help="file whose first line is the teacher's manifest")
    args = parser.parse_args()
    with open(args.manifest, encoding="utf-8") as handle:
        manifest = json.loads(handle.readline())
    Handler.identity = manifest["teacher_identity"]
    Handler.served_model = Handler.identity["served_model_id"]
    Handler.teacher = Teacher(args.teacher)
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    print(server.server_address[1], flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        sys.stdout.flush()


if __name__ == "__main__":
    main()
