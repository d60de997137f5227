"""``demo``: the whole pipeline on a fresh machine, on the CPU, in a couple of minutes.

It builds a tiny teacher and student deterministically (no downloads), writes a small built-in set
of examples, and runs ``opd_distill`` end to end: the teacher scores the examples, the corpus is
admitted and materialized, the student trains with exact checkpoints, and the adapter and receipt
are published under ``./kiln-data``.
"""


import json
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.states import Cancelled

from flows.opd_distill import opd_distill
from flows.spec import PipelineSpec

_NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def demo_examples(count: int) -> list[dict[str, Any]]:
    """Small arithmetic and file-listing conversations, the same every time."""
    examples = []
    for i in range(count):
        a, b = i % 5, (i * 3) % 5
        if i % 4 == 3:
            examples.append({
                "id": f"demo-{i:03d}",
                "messages": [{"role": "system", "content": "Answer with JSON only."},
                             {"role": "user", "content": "List files under src/"}],
                "teacher_response": '{"directory":"src","recursive":true}',
                "trajectory": [
                    {"role": "assistant", "content": '{"directory":"src"}', "kind": "action", "tool_call_id": "call-1"},
                    {"role": "tool", "content": "src/lib.rs\nsrc/main.rs", "kind": "observation", "tool_call_id": "call-1"},
                    {"role": "assistant", "content": "src/lib.rs and src/main.rs", "kind": "action"},
                ],
            })
            continue
        examples.append({
            "id": f"demo-{i:03d}",
            "messages": [{"role": "user", "content": f"What is {_NUMBERS[a]} plus {_NUMBERS[b]}?"}],
            "teacher_response": f"{_NUMBERS[a].capitalize()} plus {_NUMBERS[b]} is {_NUMBERS[a + b]}.",
        })
    return examples


def prepare_demo(workdir: str, examples: int) -> dict[str, str]:
    """Build (once) the tiny models and the examples file; returns their paths and the storage root.

    Models are read from this machine's disk: under a local ``workdir`` they live in it, as the README's
    examples expect; for a remote root (``s3://…``) they are built in a folder of the system's temp directory
    named after the root, and everything the pipeline publishes goes to the root itself.
    """
    import hashlib
    import tempfile

    from kiln_core.storage import resolve
    from kiln_core.tiny_models import build_tiny_model

    location = resolve(workdir)
    if location.is_local:
        root = Path(location.path)
    else:
        digest = hashlib.sha256(location.uri.encode()).hexdigest()[:16]
        root = Path(tempfile.gettempdir()) / "kiln-flows-demo" / digest
    models = root / "demo-models"
    teacher, student = models / "teacher", models / "student"
    if not (teacher / "model.safetensors").exists():
        build_tiny_model(teacher, seed=2, hidden_size=96, num_layers=2)
    if not (student / "model.safetensors").exists():
        build_tiny_model(student, seed=1, hidden_size=64, num_layers=2)
    path = root / "demo-examples.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(record) + "\n" for record in demo_examples(examples))
    if not path.exists() or path.read_text(encoding="utf-8") != text:
        path.write_text(text, encoding="utf-8")
    return {"teacher": str(teacher), "student": str(student), "examples": str(path),
            "root": str(root) if location.is_local else location.uri}


def demo_spec(paths: dict[str, str], epochs: int) -> PipelineSpec:
    """The demo's pipeline spec: local teacher, examples scored first, AdamW on a rank-8 LoRA."""
    return PipelineSpec.model_validate({
        "teacher": {"kind": "local_dir", "path": paths["teacher"]},
        "examples": paths["examples"],
        "student": paths["student"],
        "storage_root": paths["root"],
        "adapter": "demo",
        "config": {
            "training_mode": "off_policy",
            "top_k": 16,
            "epochs": epochs,
            "checkpoint_interval": 10,
            "learning_rate": 0.02,
            "lora_rank": 8,
            "lora_alpha": 16.0,
            "seed": 7,
            "optimizer": {"kind": "adam_w"},
        },
        "options": {"progress_every_seconds": 2.0},
    })


@flow(name="kiln-flows-demo", flow_run_name="demo")
def demo(workdir: str = "./kiln-data", examples: int = 16, epochs: int = 3) -> dict[str, Any]:
    """Run the demo pipeline under ``workdir`` and return ``opd_distill``'s summary.

    A pipeline stopped by Ctrl-C ends the demo ``Cancelled`` with the pipeline's message (not ``Failed``
    with Prefect's ``CancelledRun`` traceback); a failed pipeline fails the demo with its error.
    """
    paths = prepare_demo(workdir, examples)
    pipeline = opd_distill(demo_spec(paths, epochs), return_state=True)
    if pipeline.is_cancelled():
        return Cancelled(message=pipeline.message)  # a new state: the subflow's own would be counted, not kept
    return pipeline.result()
