"""On-policy distillation (Kiln's default ``training_mode``): the parts that stand apart from the trainer.

The student samples its own responses to the request's prompts, the teacher scores the sampled
tokens top-K, and the usual top-K reverse KL trains on them, one candidate per optimizer step. Read
in the order a run uses them:

* ``submit`` — Kiln's submit-time rules for a request with ``prompts`` (before any model loads);
* ``prompt_file`` — the pipeline's prompt JSONL reader (line-numbered rejections);
* ``prepare`` — training-path tokenization, the rollout prefix and the asymmetric teacher prompt;
* ``schedule`` — candidate order, rollout seeds and the ``rollout-sampling`` RNG stream;
* ``sampler`` — Kiln's sampling rule with a documented seeded draw and a KV-cached decode;
* ``teacher`` — a local teacher with Kiln's ``LiveLocalTeacher`` semantics;
* ``vllm_teacher`` — optional: the teacher on a vLLM server (Kiln's prompt-logprobs contract), an extension;
* ``store`` — content-addressed Parquet storage of every rollout and its teacher scores;
* ``collect`` — one candidate's rollout: read back from the store, or sampled, scored and committed.

The loop that trains on them is ``kiln_core.training.on_policy_trainer.train_on_policy``.

The contract types live in ``kiln_core.contracts`` (``OpdPrompt`` and the prompt-list digest in
``opd_prompt``). Nothing here imports torch at import time.
"""
