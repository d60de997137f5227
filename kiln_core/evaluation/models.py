"""Models to evaluate: a student directory with or without a PEFT adapter, and greedy answers.

``load_eval_model`` gives an ``EvalModel`` with the interface the metrics need (``hidden_states``,
``logit_head``, ``device``): the same decoder output and the same model's-own logits as the trainer's
``Student``, proven against ``model(...).logits`` at load (``kiln_core.logit_head.check_own_logits``). An adapter that does not fit the student (other shapes, other target modules)
is a rejection, not a crash.

Answers are generated after the prompt as Kiln renders it for generation (``kiln_core.on_policy.render``: no
BOS or EOS from the tokenizer, nothing encoded with special tokens), the form a student is trained and sampled
on; a prompt the model's chat template refuses (a system turn under Gemma 1/2) is a ``prompt_render_failed``
rejection naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from kiln_core.errors import Rejection
from kiln_core.logit_head import LogitHead, check_own_logits, decoder_of, logit_head_of

__all__ = ["EvalModel", "EvalInputError", "PromptRefused", "load_eval_model", "generate_answers",
           "generate_answer_ids"]


class EvalInputError(Rejection):
    """An evaluation input that cannot be used (exit 2): ``invalid_student``, ``adapter_mismatch``,
    ``vocabulary_mismatch``, ``eval_train_overlap``, ``invalid_option``, ``prompt_render_failed``."""


class PromptRefused(EvalInputError):
    """A prompt the model's chat template refuses to render (``prompt_render_failed``, field ``prompts[index]``).

    Attributes:
        index: The prompt's position in the list given, for a caller that knows where it came from.
    """

    def __init__(self, index: int, message: str) -> None:
        super().__init__("prompt_render_failed", message, field=f"prompts[{index}]")
        self.index = index


@dataclass
class EvalModel:
    """A causal LM ready for evaluation (eval mode, no gradients needed)."""

    model: Any
    device: torch.device
    tokenizer: Any
    source: str = ""
    """Where the model was loaded from (named in refusals)."""

    @property
    def _base(self) -> Any:
        return self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Final normed hidden states of one unpadded sequence: ``[L] -> [L, H]``."""
        return decoder_of(self.model)(input_ids=input_ids[None], use_cache=False).last_hidden_state[0]

    @property
    def logit_head(self) -> LogitHead:
        """The model's own logits: its LM head and output post-processing."""
        return logit_head_of(self.model)


def load_eval_model(student_dir: str | os.PathLike[str], adapter_dir: str | os.PathLike[str] | None = None, *,
                    device: str | None = None) -> EvalModel:
    """Load a student (fp32) and, when given, apply a PEFT adapter to it.

    Raises:
        EvalInputError: ``invalid_student`` (not loadable) or ``adapter_mismatch``.
        UnsupportedArchitecture: ``unsupported_architecture`` — its logits cannot be reproduced row by row.

    Example:
        >>> model = load_eval_model("models/student", "kiln-data/runs/demo/adapter")  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        model = AutoModelForCausalLM.from_pretrained(str(student_dir), dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(str(student_dir), local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise EvalInputError("invalid_student", f"cannot load the model in {student_dir}: {error}",
                             file=str(student_dir)) from None
    if adapter_dir is not None:
        from peft import PeftModel

        if not os.path.isfile(os.path.join(adapter_dir, "adapter_config.json")):
            raise EvalInputError("adapter_mismatch", f"{adapter_dir} is not a PEFT adapter directory "
                                 "(no adapter_config.json)", file=str(adapter_dir))
        try:
            model = PeftModel.from_pretrained(model, str(adapter_dir), is_trainable=False)
        except (RuntimeError, ValueError, KeyError, OSError) as error:  # shape or module mismatch
            raise EvalInputError("adapter_mismatch", f"adapter {adapter_dir} does not fit student {student_dir}: "
                                 f"{str(error).splitlines()[0]}", file=str(adapter_dir)) from None
    model.to(dev)
    model.eval()
    evaluated = EvalModel(model=model, device=dev, tokenizer=tokenizer, source=str(student_dir))
    check_own_logits(model, evaluated.logit_head, evaluated.hidden_states)
    return evaluated


def generate_answers(model: EvalModel, prompts: Sequence[list[dict[str, Any]]], *, max_new_tokens: int = 64,
                     batch_size: int = 8) -> list[str]:
    """Greedy answers of ``model`` to chat ``prompts`` (lists of messages), rendered with its template.

    Batches are left-padded; generation stops at the tokenizer's end-of-sequence token.

    Example:
        >>> generate_answers(model, [[{"role": "user", "content": "Name a color."}]])  # doctest: +SKIP
        ['Blue.']
    """
    return [model.tokenizer.decode(answer, skip_special_tokens=True).strip()
            for _, answer in generate_answer_ids(model, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size)]


def generate_answer_ids(model: EvalModel, prompts: Sequence[list[dict[str, Any]]], *, max_new_tokens: int = 64,
                        batch_size: int = 8) -> list[tuple[list[int], list[int]]]:
    """Greedy answers as token ids: ``(prompt ids, answer ids)`` per prompt, the answer cut after its first
    end-of-sequence token (kept: ending there was the model's choice) and never longer than ``max_new_tokens``.

    Raises:
        PromptRefused: the model's chat template refuses a prompt (before anything is generated).

    Example:
        >>> [(prompt, answer)] = generate_answer_ids(model, [[{"role": "user", "content": "Hi"}]])  # doctest: +SKIP
    """
    tokenizer = model.tokenizer
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_id = tokenizer.eos_token_id
    prompt_ids = [_prompt_ids(model, messages, index) for index, messages in enumerate(prompts)]
    answers: list[tuple[list[int], list[int]]] = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            encoded = prompt_ids[start : start + batch_size]
            width = max(len(ids) for ids in encoded)
            ids = torch.full((len(encoded), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(encoded), width), dtype=torch.long)
            for row, seq in enumerate(encoded):
                ids[row, width - len(seq):] = torch.tensor(seq, dtype=torch.long)
                mask[row, width - len(seq):] = 1
            out = model.model.generate(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                                       max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_id)
            for row, seq in enumerate(encoded):
                answer = out[row, width:].tolist()
                if eos_id is not None and eos_id in answer:
                    answer = answer[: answer.index(eos_id) + 1]
                answers.append((list(seq), answer))
    return answers


def _prompt_ids(model: EvalModel, messages: list[dict[str, Any]], index: int) -> list[int]:
    """Prompt ``index`` rendered with the generation cue as Kiln renders it, encoded without special tokens."""
    from kiln_core.on_policy.render import RenderError, encode_text, render_for_generation

    template = model.tokenizer.chat_template
    if not isinstance(template, str) or not template:
        raise PromptRefused(index, f"{model.source} has no chat template to render prompt {index} with")
    try:
        return encode_text(model.tokenizer, render_for_generation(template, messages)).tolist()
    except RenderError as error:
        raise PromptRefused(index, f"the chat template of {model.source} refuses prompt {index}: {error}") from None
