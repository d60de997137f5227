"""Helpers shared by the on-policy tests: prompts, requests and students with other chat templates."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from kiln_core.contracts.opd_config import OpdRequest, parse_opd_request


def chat(user: str, *, system: str | None = None, dummy: bool = True) -> dict[str, Any]:
    """One on-policy prompt: optional system turn, a user turn, and Kiln's dummy assistant turn."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    if dummy:
        messages.append({"role": "assistant", "content": ""})
    return {"messages": messages}


def request(prompts: list[dict[str, Any]], teacher: str = "tiny-teacher", **config: Any) -> OpdRequest:
    return parse_opd_request({"teacher": teacher, "prompts": prompts, "config": config})


def student_with_template(source: Path, destination: Path, template: str) -> Path:
    """The student's config and tokenizer (no weights) with another chat template."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(source) / name, destination / name)
    config = json.loads((destination / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    (destination / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    (destination / "chat_template.jinja").write_text(template, encoding="utf-8")
    return destination


class CountingRollouts:
    """The student's own sampler, counted; for seeds in ``eos_first`` (a residue class) the student
    stops at once, as when it samples EOS first — the tiny random student almost never does by itself.

    ``factory(student)`` is what ``train_on_policy(rollout_backend=...)`` takes.
    """

    def __init__(self, eos_first_modulus: int | None = None) -> None:
        self.eos_first_modulus = eos_first_modulus
        self.seeds: list[int] = []

    def eos_first(self, seed: int) -> bool:
        return self.eos_first_modulus is not None and seed % self.eos_first_modulus == 0

    def factory(self, student):
        from kiln_core.training.on_policy_trainer import StudentRollouts

        real = StudentRollouts(student)
        counter = self

        class Counted:
            def sample(self, prompt_ids, *, params, max_tokens, eos_token_ids, seed):
                counter.seeds.append(seed)
                if counter.eos_first(seed):
                    return []
                return real.sample(prompt_ids, params=params, max_tokens=max_tokens, eos_token_ids=eos_token_ids,
                                   seed=seed)

        return Counted()
