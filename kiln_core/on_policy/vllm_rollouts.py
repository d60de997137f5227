"""An optional on-policy rollout backend: a vLLM server samples with the trainer's current LoRA.

The server serves the *student base model* with LoRA enabled (``vllm serve STUDENT --enable-lora
--max-lora-rank R``, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``). Before a rollout is sampled with
weights the server does not have yet (the first one, and the first after every optimizer step), the
backend

1. saves the LoRA as PEFT writes it (``adapter_config.json`` + ``adapter_model.safetensors``, what
   vLLM loads) into ``<sync_dir>/<fresh name>/``, staged then renamed so the server never reads half
   a directory;
2. ``POST /v1/load_lora_adapter {"lora_name", "lora_path"}`` under a fresh name (vLLM refuses to load
   a name twice, and a retried process must not collide with the name a crashed one left loaded);
3. ``POST /v1/unload_lora_adapter {"lora_name"}`` for the previous name, and deletes its directory.

Rollouts are ``POST /v1/completions`` with ``model`` = the loaded LoRA's name, ``prompt`` = token
ids, Kiln's rollout sampling rule (``kiln_core.on_policy.sampler``: top-k 20, min-p 0, presence 1.5,
repetition 1, frequency 0, the request's temperature and top-p), ``seed`` = the candidate seed,
``stop_token_ids`` = the EOS ids and ``return_token_ids: true``, whose ``choices[0].token_ids`` holds
the sampled ids. A trailing EOS id is stripped (Kiln never keeps EOS). Field names are vLLM's
(``vllm-project/vllm``): ``vllm/entrypoints/openai/protocol.py`` · ``CompletionRequest`` (``top_k``,
``min_p``, ``repetition_penalty``, ``seed``, ``stop_token_ids``, ``return_token_ids``, vLLM ≥ 0.10.2),
``CompletionResponseChoice.token_ids``, ``LoadLoRAAdapterRequest {lora_name, lora_path}`` and
``UnloadLoRAAdapterRequest {lora_name}`` (moved to ``vllm/entrypoints/serve/lora/protocol.py`` in later
versions); the LoRA docs' "Dynamically serving LoRA adapters" (docs.vllm.ai ``features/lora``). A rank
above the server's limit is refused at load ("LoRA rank R is greater than max_lora_rank M",
``vllm/lora/worker_manager.py``); that answer becomes ``vllm_lora_rank_exceeded``.

Greedy. Kiln's rule takes the argmax of the *raw* logits at temperature 0 (no penalties), while vLLM
applies its penalties before its greedy argmax (``vllm/v1/sample/sampler.py``); at temperature 0 the
penalties are therefore sent as 0, which makes vLLM's greedy Kiln's greedy.

What is exact and what is not. vLLM's sampler is not Kiln's documented draw
(``kiln-flows.splitmix64-f32.v1``) and its kernels are not the trainer's: a vLLM rollout is seeded but
not bit-reproducible across machines, GPUs or vLLM versions. Exact resume still holds, because a
committed rollout is read back from the rollout store (``kiln_core.on_policy.collect``), never sampled
again; only candidates never committed are sampled on a retry.

Errors: unreachable, 5xx, 408 or 429 → ``EnvironmentFailure`` (``vllm_unreachable``, ``vllm_http_error``: the
pipeline retries, the retry resumes and reuses committed rollouts); any other refusal or a malformed
answer → a ``Rejection`` naming the rule. An API key, when the server needs one, comes from the
``VLLM_API_KEY`` environment variable (sent as a bearer token; never a parameter, log or receipt).

Example:
    >>> backend = vllm_rollout_backend("http://127.0.0.1:8000", sync_dir="/shared/lora-sync")  # doctest: +SKIP
    >>> train_on_policy(..., rollout_backend=backend)  # doctest: +SKIP
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Any, Callable, Sequence

from kiln_core.errors import EnvironmentFailure, Rejection
from kiln_core.on_policy.sampler import SamplingParams

__all__ = ["API_KEY_ENV", "VllmRollouts", "vllm_rollout_backend"]

API_KEY_ENV = "VLLM_API_KEY"
DEFAULT_TIMEOUT_S = 120.0
_EXCERPT_CHARS = 400
_TRANSIENT_4XX = (408, 429)  # timed out, too many requests: the world, not the input


def endpoint_urls(base_url: str) -> dict[str, str]:
    """The three endpoints under ``base_url`` (loopback-or-https, as for scoring: ``completions_url``).

    Example:
        >>> endpoint_urls("http://127.0.0.1:8000")["load"]
        'http://127.0.0.1:8000/v1/load_lora_adapter'
    """
    from kiln_core.scoring.vllm import completions_url

    completions = completions_url(base_url)
    v1 = completions[: -len("/completions")]
    return {"completions": completions, "load": f"{v1}/load_lora_adapter", "unload": f"{v1}/unload_lora_adapter"}


def request_body(lora_name: str, prompt_ids: Sequence[int], *, params: SamplingParams, max_tokens: int,
                 eos_token_ids: Sequence[int], seed: int) -> dict[str, Any]:
    """One rollout's ``/v1/completions`` body under Kiln's rollout rule.

    Example:
        >>> body = request_body("lora-1", [1, 2], params=SamplingParams(temperature=0.0, top_p=0.9), max_tokens=8,
        ...                     eos_token_ids=[0], seed=5)
        >>> body["presence_penalty"], body["top_p"], body["return_token_ids"]
        (0.0, 1.0, True)
    """
    greedy = params.temperature == 0
    top_p = params.top_p if 0 < params.top_p < 1 and not greedy else 1.0  # Kiln: top-p off outside (0, 1)
    return {
        "model": lora_name,
        "prompt": [int(t) for t in prompt_ids],
        "max_tokens": int(max_tokens),
        "temperature": float(params.temperature),
        "top_p": float(top_p),
        "top_k": int(params.top_k),
        "min_p": float(params.min_p),
        # Kiln's greedy ignores penalties; vLLM's greedy would apply them first (module docstring).
        "presence_penalty": 0.0 if greedy else float(params.presence_penalty),
        "frequency_penalty": 0.0 if greedy else float(params.frequency_penalty),
        "repetition_penalty": 1.0 if greedy else float(params.repetition_penalty),
        "seed": int(seed),
        "stop_token_ids": [int(t) for t in eos_token_ids],
        "n": 1,
        "stream": False,
        "add_special_tokens": False,
        "return_token_ids": True,
    }


class VllmRollouts:
    """A ``RolloutBackend`` whose rollouts a vLLM server samples with the trainer's current LoRA.

    Args:
        student: The ``Student`` being trained (its LoRA is what the server must serve).
        base_url: The server's base URL (loopback ``http`` or ``https``).
        sync_dir: A local directory the server can read (a filesystem both see); one subdirectory per
            served step, removed when the next one is loaded.
        timeout_s: Seconds per request.
        name_prefix: Start of every LoRA name (the adapter name reads well in the server's log).

    Example:
        >>> backend = VllmRollouts(student, "http://127.0.0.1:8000", "/shared/sync")  # doctest: +SKIP
        >>> backend.sync_weights(0); backend.sample([1, 5], params=p, max_tokens=8, eos_token_ids=[2], seed=7)  # doctest: +SKIP
        [17, 4]
    """

    receipt_label = "vllm"

    def __init__(self, student: Any, base_url: str, sync_dir: str, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 name_prefix: str = "kiln") -> None:
        import httpx

        self.student = student
        self.urls = endpoint_urls(base_url)
        self.sync_dir = os.path.abspath(sync_dir)
        self.vocab_size = int(student.model.get_base_model().config.vocab_size)
        self.prefix = f"{name_prefix}-{uuid.uuid4().hex[:8]}"  # fresh per process: a retry never collides
        self.served_step: int | None = None
        self.lora_name: str | None = None
        headers = {}
        api_key = os.environ.get(API_KEY_ENV)
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        # Redirects stay off: a request must never be replayed to another endpoint.
        self._client = httpx.Client(timeout=timeout_s, follow_redirects=False, headers=headers)

    # ---- the weights
    def sync_weights(self, global_step: int) -> None:
        """Serve the student's LoRA as it is after ``global_step`` optimizer steps (nothing if served already).

        Raises:
            Rejection: ``vllm_lora_rank_exceeded``, ``vllm_lora_updates_disabled``, ``vllm_lora_load``.
            EnvironmentFailure: ``vllm_unreachable``, ``vllm_http_error``, ``sync_dir_unwritable``.
        """
        if self.served_step == global_step and self.lora_name is not None:
            return
        name = f"{self.prefix}-step-{global_step:08d}"
        files = self.student.peft_adapter_files()
        path = self._write_adapter(name, files)
        response = self._post(self.urls["load"], {"lora_name": name, "lora_path": path})
        if response.status_code != 200:
            shutil.rmtree(path, ignore_errors=True)
            self._refuse_load(response, files)
        previous, self.lora_name, self.served_step = self.lora_name, name, global_step
        if previous is not None:
            self._unload(previous)

    def _write_adapter(self, name: str, files: dict[str, bytes]) -> str:
        final = os.path.join(self.sync_dir, name)
        staging = os.path.join(self.sync_dir, f".{name}.staging")
        try:
            os.makedirs(staging, exist_ok=True)
            for filename, data in files.items():
                with open(os.path.join(staging, filename), "wb") as handle:
                    handle.write(data)
            os.replace(staging, final)
        except OSError as error:
            shutil.rmtree(staging, ignore_errors=True)
            raise EnvironmentFailure("sync_dir_unwritable", f"cannot write the LoRA for the vLLM server under "
                                     f"{self.sync_dir}: {error}", file=self.sync_dir) from None
        return final

    def _refuse_load(self, response: Any, files: dict[str, bytes]) -> None:
        text = response.text[:_EXCERPT_CHARS]
        where = f"POST {self.urls['load']} -> HTTP {response.status_code}: {text}"
        if response.status_code >= 500 or response.status_code in _TRANSIENT_4XX:
            raise EnvironmentFailure("vllm_http_error", where)
        if "max_lora_rank" in text:
            rank = json.loads(files["adapter_config.json"]).get("r")
            raise Rejection("vllm_lora_rank_exceeded", f"the vLLM server refuses LoRA rank {rank}: restart it with "
                            f"`--max-lora-rank {rank}` or more, or train a lower config.lora_rank ({where})",
                            field="config.lora_rank")
        if response.status_code in (404, 405):
            raise Rejection("vllm_lora_updates_disabled", "the vLLM server does not load LoRA adapters at runtime: "
                            "start it with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True "
                            f"({where})")
        raise Rejection("vllm_lora_load", f"the vLLM server refused the LoRA of this step ({where})")

    def _unload(self, name: str) -> None:
        response = self._post(self.urls["unload"], {"lora_name": name})
        if response.status_code >= 500:
            raise EnvironmentFailure("vllm_http_error", f"POST {self.urls['unload']} -> HTTP {response.status_code}: "
                                     f"{response.text[:_EXCERPT_CHARS]}")
        # A 4xx (already gone) leaves nothing loaded to free; the directory goes either way.
        shutil.rmtree(os.path.join(self.sync_dir, name), ignore_errors=True)

    def close(self) -> None:
        """Unload the served LoRA and remove its directory (best effort: the run's outcome stands)."""
        try:
            if self.lora_name is not None:
                self._unload(self.lora_name)
        except (EnvironmentFailure, Rejection):
            pass
        finally:
            self.lora_name = self.served_step = None
            self._client.close()

    # ---- the rollouts
    def sample(self, prompt_ids: Sequence[int], *, params: SamplingParams, max_tokens: int,
               eos_token_ids: Sequence[int], seed: int) -> list[int]:
        """One rollout from the served LoRA (``sync_weights`` first); EOS never returned.

        Raises:
            Rejection: ``vllm_rollout_request`` (a 4xx), ``vllm_rollout_response`` (a malformed answer).
            EnvironmentFailure: ``vllm_unreachable``, ``vllm_http_error``.
        """
        if self.lora_name is None:
            raise RuntimeError("VllmRollouts.sample before sync_weights: the server would sample stale weights")
        body = request_body(self.lora_name, prompt_ids, params=params, max_tokens=max_tokens,
                            eos_token_ids=eos_token_ids, seed=seed)
        response = self._post(self.urls["completions"], body)
        where = f"POST {self.urls['completions']}"
        if response.status_code >= 500 or response.status_code in _TRANSIENT_4XX:
            raise EnvironmentFailure("vllm_http_error", f"{where} -> HTTP {response.status_code}: "
                                     f"{response.text[:_EXCERPT_CHARS]}")
        if response.status_code != 200:
            raise Rejection("vllm_rollout_request", f"{where} -> HTTP {response.status_code}: "
                            f"{response.text[:_EXCERPT_CHARS]}")
        return self._sampled_ids(response, max_tokens, set(body["stop_token_ids"]))

    def _sampled_ids(self, response: Any, max_tokens: int, eos: set[int]) -> list[int]:
        def bad(rule: str) -> Rejection:
            return Rejection("vllm_rollout_response", f"invalid vLLM rollout from {self.urls['completions']}: {rule}")

        try:
            answer = response.json()
        except ValueError:
            raise bad("the body is not JSON") from None
        choices = answer.get("choices") if isinstance(answer, dict) else None
        if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
            raise bad("`choices` must hold exactly one choice")
        if answer.get("model") != self.lora_name:
            raise bad(f"`model` {answer.get('model')!r} is not the LoRA requested ({self.lora_name!r})")
        ids = choices[0].get("token_ids")
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise bad("choices[0].token_ids is not a list of integers (a vLLM without `return_token_ids`?)")
        if ids and ids[-1] in eos:
            ids = ids[:-1]  # the stop token: Kiln never keeps EOS
        if len(ids) > max_tokens:
            raise bad(f"{len(ids)} tokens returned for max_tokens {max_tokens}")
        for token in ids:
            if not 0 <= token < self.vocab_size:
                raise bad(f"token id {token} is outside the student's vocabulary (size {self.vocab_size})")
            if token in eos:
                raise bad(f"EOS id {token} before the end of the rollout")
        return ids

    def _post(self, url: str, body: dict[str, Any]) -> Any:
        import httpx

        try:
            return self._client.post(url, json=body)
        except httpx.TimeoutException:
            raise EnvironmentFailure("vllm_unreachable", f"POST {url} timed out") from None
        except httpx.HTTPError as error:
            raise EnvironmentFailure("vllm_unreachable", f"POST {url} failed: {error}") from None


def vllm_rollout_backend(base_url: str, *, sync_dir: str, timeout_s: float | None = None,
                         name_prefix: str = "kiln") -> Callable[[Any], VllmRollouts]:
    """``train_on_policy``'s ``rollout_backend``: builds a ``VllmRollouts`` from the loaded student.

    The URL is checked now (``invalid_option`` for plain HTTP to a non-loopback host), before any model loads.

    Example:
        >>> factory = vllm_rollout_backend("http://127.0.0.1:8000", sync_dir="/tmp/sync")
        >>> callable(factory)
        True
    """
    endpoint_urls(base_url)
    return lambda student: VllmRollouts(student, base_url, sync_dir, timeout_s=timeout_s or DEFAULT_TIMEOUT_S,
                                        name_prefix=name_prefix)
