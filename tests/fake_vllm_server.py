"""A stand-in vLLM server for the scoring tests: a real HTTP server process on loopback.

    python tests/fake_vllm_server.py --port 0 --teacher DIR --manifest FILE

prints the port it listens on as its first stdout line, once it is listening. ``POST
/<scenario>/v1/completions`` answers like vLLM's OpenAI completions endpoint with ``prompt_logprobs``
computed from the teacher in DIR with torch (fp32, eager attention, full-vocabulary log_softmax of
row p − 1 for prompt position p), and ``system_fingerprint`` set to the Kiln fingerprint of the
identity in FILE's manifest line. Each prompt position holds the top-K candidates with ranks 1..K
(descending, ties → lower id first) plus the observed token as an extra K+1-th entry, with its true
rank, when it is outside the top K; position 0 is ``null``.

The request body must be exactly Kiln's (Kiln's ``crates/kiln-train/src/remote_teacher.rs``), else HTTP 400. Scenarios
pick a contract violation so a client's checks can be tested:

* ``ok``: a correct response;
* ``bad-fingerprint``: the fingerprint of a different identity;
* ``bad-model``: ``model`` names another model;
* ``missing-rank``: the rank-2 candidate of every position has no ``rank``;
* ``high-mass``: every candidate claims logprob −0.01 (probability mass far above 1).

The fingerprint is computed here independently of kiln_core, so the test checks both sides.

With ``--student DIR`` it also stands in for ``vllm serve DIR --enable-lora`` with runtime LoRA updates
(``--teacher`` and ``--manifest`` become optional): ``POST /<scenario>/v1/load_lora_adapter
{"lora_name", "lora_path"}`` loads a PEFT adapter directory onto a fresh fp32 copy of the student (400
"LoRA rank R is greater than max_lora_rank M." above ``--max-lora-rank``; 400 for a name loaded
already), ``/v1/unload_lora_adapter {"lora_name"}`` drops it (404 when unknown), and a completions
body with ``return_token_ids`` samples from the named LoRA (404 for an unknown model) the way vLLM
does: penalties first (repetition over prompt and output, then frequency and presence over the
output), greedy argmax at temperature 0, else temperature, top-k, top-p, min-p and a draw from a
``torch.Generator`` seeded with the request's ``seed``; it stops after a ``stop_token_ids`` id, which
``token_ids`` includes, as vLLM's does. The sampler is written here, independently of kiln_core's.
Rollout scenarios: ``rollout-bad-token`` (an id outside the vocabulary), ``rollout-no-token-ids``
(no ``token_ids``), ``rollout-bad-request`` (HTTP 400), ``rollout-server-error`` (HTTP 500),
``lora-rank-2`` (loads refuse ranks above 2). ``GET /stats`` counts the rollouts sampled and the
LoRAs loaded, unloaded and currently held. Like ``vllm serve``, a ``VLLM_API_KEY`` in the server's
environment makes every POST require ``Authorization: Bearer <key>`` (HTTP 401 otherwise).
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

SCENARIOS = ("ok", "bad-fingerprint", "bad-model", "missing-rank", "high-mass", "rollout-bad-token",
             "rollout-no-token-ids", "rollout-bad-request", "rollout-server-error", "lora-rank-2")
ROLLOUT_KEYS = {"model", "prompt", "max_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                "frequency_penalty", "repetition_penalty", "seed", "stop_token_ids", "return_token_ids"}
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


class Student:
    """The student base model and the LoRAs loaded onto fresh copies of it; one forward at a time."""

    def __init__(self, student_dir: str, max_lora_rank: int) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        torch.set_num_threads(1)
        self.torch = torch
        self.base = AutoModelForCausalLM.from_pretrained(
            student_dir, dtype=torch.float32, attn_implementation="eager", local_files_only=True).eval()
        self.vocab_size = int(self.base.config.vocab_size)
        self.max_lora_rank = max_lora_rank
        self.loras: dict = {}
        self.stats = {"rollouts": 0, "loaded": 0, "unloaded": 0}
        self.lock = threading.Lock()

    def load(self, name: str, path: str, max_rank: int) -> tuple[int, str]:
        import copy
        import os

        from peft import PeftModel

        with self.lock:
            if name in self.loras:
                return 400, f"The lora adapter '{name}' has already been loaded."
            try:
                with open(os.path.join(path, "adapter_config.json"), encoding="utf-8") as handle:
                    rank = json.load(handle)["r"]
            except (OSError, ValueError, KeyError) as error:
                return 400, f"Loading lora {path} failed: {error}"
            if rank > max_rank:
                return 400, f"LoRA rank {rank} is greater than max_lora_rank {max_rank}."
            self.loras[name] = PeftModel.from_pretrained(copy.deepcopy(self.base), path).eval()
            self.stats["loaded"] += 1
            return 200, f"Success: LoRA adapter '{name}' added successfully."

    def unload(self, name: str) -> tuple[int, str]:
        with self.lock:
            if self.loras.pop(name, None) is None:
                return 404, f"The lora adapter '{name}' cannot be found."
            self.stats["unloaded"] += 1
            return 200, f"Success: LoRA adapter '{name}' removed successfully."

    def sample(self, body: dict) -> tuple[list[int], str]:
        """vLLM's order: penalties, then greedy or temperature → top-k → top-p → min-p → seeded draw."""
        torch = self.torch
        prompt, stop = list(body["prompt"]), set(body["stop_token_ids"])
        generator = torch.Generator().manual_seed(body["seed"])
        output: list[int] = []
        with self.lock, torch.inference_mode():
            model = self.loras[body["model"]]
            self.stats["rollouts"] += 1
            for _ in range(body["max_tokens"]):
                logits = model(input_ids=torch.tensor([prompt + output]), use_cache=False).logits[0, -1].float()
                token = self._pick(logits, prompt, output, body, generator)
                output.append(token)
                if token in stop:
                    return output, "stop"
        return output, "length"

    def _pick(self, logits, prompt: list[int], output: list[int], body: dict, generator) -> int:
        torch = self.torch
        logits = logits.clone()
        repetition = body["repetition_penalty"]
        if repetition != 1.0:
            seen = torch.tensor(sorted(set(prompt + output)), dtype=torch.long)
            values = logits[seen]
            logits[seen] = torch.where(values > 0, values / repetition, values * repetition)
        if output:
            ids, counts = torch.unique(torch.tensor(output, dtype=torch.long), return_counts=True)
            logits[ids] -= body["frequency_penalty"] * counts.float() + body["presence_penalty"]
        if body["temperature"] < 1e-5:
            return int(torch.argmax(logits))
        logits = logits / body["temperature"]
        if 0 < body["top_k"] < logits.shape[0]:
            kth = torch.topk(logits, body["top_k"]).values[-1]
            logits[logits < kth] = float("-inf")
        probs = torch.softmax(logits, dim=-1)
        if body["top_p"] < 1.0:
            ordered, order = torch.sort(probs, descending=True)
            before = torch.cumsum(ordered, dim=0) - ordered  # mass strictly ahead of each id
            probs[order[before >= body["top_p"]]] = 0.0
        if body["min_p"] > 0:
            probs[probs < body["min_p"] * probs.max()] = 0.0
        return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


class Handler(BaseHTTPRequestHandler):
    teacher: Teacher | None = None
    student: Student | None = None
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

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"object": "error", "message": message, "type": "BadRequestError", "code": status})

    def do_GET(self) -> None:  # noqa: N802
        if self.path == "/stats" and self.student is not None:
            self._send(200, {**self.student.stats, "held": sorted(self.student.loras)})
        else:
            self._send(404, {"error": f"unknown route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        import os

        scenario, _, route = self.path.strip("/").partition("/")
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        key = os.environ.get("VLLM_API_KEY")
        if key and self.headers.get("Authorization") != f"Bearer {key}":
            self._send(401, {"error": "Unauthorized"})
            return
        routes = ("v1/completions", "v1/load_lora_adapter", "v1/unload_lora_adapter")
        if scenario not in SCENARIOS or route not in routes:
            self._send(404, {"error": f"unknown route {self.path}"})
            return
        try:
            body = json.loads(raw)
        except ValueError:
            self._send(400, {"error": "body is not JSON"})
            return
        if route != "v1/completions" or (isinstance(body, dict) and "return_token_ids" in body):
            self._student_route(scenario, route, body)
            return
        if self.teacher is None:
            self._error(400, "this server has no --teacher to score with")
            return
        problem = self._check_body(body)
        if problem:
            self._send(400, {"object": "error", "message": problem, "type": "BadRequestError", "code": 400})
            return
        self._send(200, self._respond(scenario, body))

    def _student_route(self, scenario: str, route: str, body: dict) -> None:
        student = self.student
        if student is None:
            self._send(404, {"error": "this server has no --student (LoRA serving is off)"})
            return
        if route == "v1/load_lora_adapter":
            max_rank = 2 if scenario == "lora-rank-2" else student.max_lora_rank
            status, message = student.load(str(body.get("lora_name")), str(body.get("lora_path")), max_rank)
        elif route == "v1/unload_lora_adapter":
            status, message = student.unload(str(body.get("lora_name")))
        else:
            self._rollout(scenario, body)
            return
        if status == 200:
            self._send(200, {"message": message})
        else:
            self._error(status, message)

    def _rollout(self, scenario: str, body: dict) -> None:
        student = self.student
        missing = ROLLOUT_KEYS - set(body)
        if missing or body.get("return_token_ids") is not True:
            self._error(400, f"rollout body lacks {sorted(missing)} or return_token_ids true")
            return
        if body["model"] not in student.loras:
            self._error(404, f"The model `{body['model']}` does not exist.")
            return
        prompt = body["prompt"]
        if not isinstance(prompt, list) or not prompt or not all(type(t) is int and 0 <= t < student.vocab_size
                                                                for t in prompt):
            self._error(400, "prompt must be a non-empty list of token ids")
            return
        if scenario == "rollout-bad-request":
            self._error(400, "top_p must be in (0, 1], got 0.0.")
            return
        if scenario == "rollout-server-error":
            self._error(500, "EngineCore encountered an issue.")
            return
        ids, reason = student.sample(body)
        if scenario == "rollout-bad-token":
            ids = ids[:-1] + [student.vocab_size]
        choice = {"index": 0, "text": "", "logprobs": None, "finish_reason": reason,
                  "stop_reason": ids[-1] if reason == "stop" else None, "token_ids": ids}
        if scenario == "rollout-no-token-ids":
            del choice["token_ids"]
        self._send(200, {"id": "cmpl-fake", "object": "text_completion", "created": 1700000000, "model": body["model"],
                         "choices": [choice], "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                                                        "total_tokens": len(prompt) + len(ids)}})

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
    parser.add_argument("--teacher", help="teacher model directory (scoring)")
    parser.add_argument("--manifest", help="file whose first line is the teacher's manifest (scoring)")
    parser.add_argument("--student", help="student base model directory (LoRA loading and rollouts)")
    parser.add_argument("--max-lora-rank", type=int, default=16, help="largest LoRA rank a load accepts")
    args = parser.parse_args()
    if (args.teacher is None) != (args.manifest is None) or (args.teacher is None and args.student is None):
        parser.error("give --teacher with --manifest, --student, or both")
    if args.teacher is not None:
        with open(args.manifest, encoding="utf-8") as handle:
            manifest = json.loads(handle.readline())
        Handler.identity = manifest["teacher_identity"]
        Handler.served_model = Handler.identity["served_model_id"]
        Handler.teacher = Teacher(args.teacher)
    if args.student is not None:
        Handler.student = Student(args.student, args.max_lora_rank)
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
