"""A depth-pruned student from a teacher directory: keep some decoder layers, drop the rest.

This is the "prune, then distill" starting point (Minitron-style depth pruning): the student shares
the teacher's embeddings, final norm, head, tokenizer and chat template, so its vocabulary is the
teacher's by construction, and layer ``j`` of the student starts as teacher layer ``kept[j]``.

``--keep-layers`` takes ``every:N`` (layers ``0, N, 2N, …``), an explicit strictly increasing
list ``0,2,4``, or ``auto:N``: N layers chosen by a short measured search (``kiln_core.models.layer_search``:
blocks kept at both ends, scored by held-out reverse KL on a teacher-scored probe corpus). Which teacher layers were kept is recorded in ``kiln-derivation.json`` beside the
weights (written last: it is the directory's commit), together with the teacher's base-model digest,
so a student always says where it came from. ``config.json`` changes only ``num_hidden_layers`` (and
``layer_types`` where the architecture has one), so the student loads like any Hugging Face model.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from kiln_core.models.gguf import ModelImportError, publish_directory, refuse_existing_output

__all__ = ["DERIVATION_RECORD", "check_keep_layers", "parse_keep_layers", "derive_student", "layer_ranges",
           "read_derivation"]

DERIVATION_RECORD = "kiln-derivation.json"
_LAYER_KEY = re.compile(r"^(model\.layers\.)(\d+)(\..+)$")
# Files of a model directory that describe the tokenizer and generation, copied as they are.
_COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
           "generation_config.json", "vocab.json", "merges.txt")


def parse_keep_layers(spec: str, num_layers: int) -> list[int]:
    """The teacher layers a ``--keep-layers`` spec keeps, ascending.

    Raises:
        ModelImportError: ``invalid_keep_layers`` for a malformed spec, an index out of range, a
            repeated or decreasing index, or no layer at all.

    Example:
        >>> parse_keep_layers("every:2", 6), parse_keep_layers("0,3,5", 6)
        ([0, 2, 4], [0, 3, 5])
    """
    text = spec.strip()
    if text.startswith("every:"):
        step = text.removeprefix("every:")
        if not step.isdigit() or int(step) < 1:
            raise _bad_spec(spec, "every:N needs a positive integer N")
        return list(range(0, num_layers, int(step)))
    parts = [part.strip() for part in text.split(",")]
    if not parts or not all(part.isdigit() for part in parts):
        raise _bad_spec(spec, "use every:N or a comma-separated list of layer indices such as 0,2,4")
    layers = [int(part) for part in parts]
    if any(b <= a for a, b in zip(layers, layers[1:])):
        raise _bad_spec(spec, "layer indices must be strictly increasing")
    if layers[-1] >= num_layers:
        raise _bad_spec(spec, f"layer {layers[-1]} does not exist; the teacher has layers 0..{num_layers - 1}")
    return layers


def _bad_spec(spec: str, why: str) -> ModelImportError:
    return ModelImportError("invalid_keep_layers", f"--keep-layers {spec!r}: {why}", field="keep_layers")


def derive_student(teacher_dir: str | os.PathLike[str], keep_layers: str, out_dir: str | os.PathLike[str], *,
                   probe_corpus: str | None = None, probe_examples: int = 16, probe_budget: int | None = None) -> Path:
    """Write a depth-pruned copy of ``teacher_dir`` keeping the layers ``keep_layers`` selects.

    Args:
        teacher_dir: A Hugging Face model directory (``config.json`` + safetensors + tokenizer).
        keep_layers: ``every:N``, ``i,j,k`` (see ``parse_keep_layers``), or ``auto:N``: the N layers whose
            untrained pruned model scores the lowest held-out reverse KL on ``probe_corpus``
            (``kiln_core.models.layer_search``; the search is recorded in ``kiln-derivation.json``).
        out_dir: The student directory to create; it must not exist.
        probe_corpus: ``auto:N`` only: a teacher-scored corpus held out from training.
        probe_examples, probe_budget: ``auto:N`` only: examples of the probe used, most candidates scored.

    Returns:
        The committed student directory.

    Raises:
        ModelImportError: a bad spec, a teacher that is not a model directory, an existing output.

    Example:
        >>> derive_student("models/smollm2-135m", "every:2", "models/smollm2-135m-half")  # doctest: +SKIP
        PosixPath('models/smollm2-135m-half')
    """
    from safetensors.torch import save_file

    from kiln_core.identity.hashing import IdentityHashError, base_model_sha256

    from kiln_core.models.layer_search import search_layers

    teacher = Path(teacher_dir)
    config = _read_config(teacher)
    num_layers = config["num_hidden_layers"]  # checked by check_keep_layers
    auto, kept = check_keep_layers(teacher, keep_layers)
    if auto is not None and probe_corpus is None:
        raise ModelImportError("invalid_keep_layers", f"--keep-layers {keep_layers!r} chooses layers by measurement: "
                               "give --probe-corpus, a teacher-scored corpus held out from training", field="probe_corpus")
    out = Path(out_dir)
    refuse_existing_output(out)
    search = None
    if auto is not None:
        searched = search_layers(teacher, auto, probe_corpus, probe_examples=probe_examples, budget=probe_budget)
        kept, search = searched["kept_teacher_layers"], searched["search"]
    tensors = _renumbered_tensors(teacher, {old: new for new, old in enumerate(kept)})
    try:
        teacher_digest = base_model_sha256(teacher)
    except IdentityHashError as error:
        raise ModelImportError("invalid_model", f"teacher {teacher}: {error}") from None
    student_config = dict(config, num_hidden_layers=len(kept))
    if isinstance(config.get("layer_types"), list) and len(config["layer_types"]) == num_layers:
        student_config["layer_types"] = [config["layer_types"][i] for i in kept]
    with tempfile.TemporaryDirectory(prefix=".kiln-derive-") as tmp:
        staged = Path(tmp)
        save_file(tensors, str(staged / "model.safetensors"), metadata={"format": "pt"})
        (staged / "config.json").write_text(json.dumps(student_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        for name in _COPIED:
            if (teacher / name).is_file():
                (staged / name).write_bytes((teacher / name).read_bytes())
        record = {
            "format": "kiln-flows.depth-pruned-student.v1",
            "keep_layers_spec": keep_layers,
            "kept_teacher_layers": kept,
            "teacher_num_hidden_layers": num_layers,
            "teacher_base_model_sha256": teacher_digest,
        }
        if search is not None:
            record["search"] = search
        publish_directory(staged, out, DERIVATION_RECORD, record)
    return out


def check_keep_layers(teacher_dir: str | os.PathLike[str], keep_layers: str) -> tuple[int | None, list[int] | None]:
    """A ``--keep-layers`` spec checked against the teacher's layer count, before any work is done.

    Returns:
        ``(N, None)`` for ``auto:N``; ``(None, kept layers)`` for any other spec.

    Raises:
        ModelImportError: ``invalid_model`` (no usable ``config.json``) or ``invalid_keep_layers``.
    """
    from kiln_core.models.layer_search import parse_auto

    teacher = Path(teacher_dir)
    num_layers = _read_config(teacher).get("num_hidden_layers")
    if not isinstance(num_layers, int) or num_layers < 1:
        raise ModelImportError("invalid_model", "config.json has no positive num_hidden_layers",
                               file=str(teacher / "config.json"))
    auto = parse_auto(keep_layers, num_layers)
    return auto, parse_keep_layers(keep_layers, num_layers) if auto is None else None


def layer_ranges(kept: list[int]) -> str:
    """Kept teacher layers as runs, for people to read.

    Example:
        >>> layer_ranges([0, 1, 2, 5, 7, 8])
        '0-2+5+7-8'
    """
    runs: list[list[int]] = []  # [first, last] of each run of consecutive layers
    for layer in kept:
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return "+".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def read_derivation(student_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The student's ``kiln-derivation.json``, or None for a model that was not derived here."""
    path = Path(student_dir, DERIVATION_RECORD)
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelImportError("invalid_model", f"{model_dir} is not a model directory (no config.json)", file=str(path))
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ModelImportError("invalid_model", f"config.json is not JSON: {error}", file=str(path)) from None
    if not isinstance(value, dict):
        raise ModelImportError("invalid_model", "config.json is not a JSON object", file=str(path))
    return value


def _renumbered_tensors(teacher: Path, new_index: dict[int, int]) -> dict[str, Any]:
    """Every tensor of the teacher's shards; layer tensors renumbered, dropped layers left out."""
    from safetensors.torch import load_file

    from kiln_core.identity.hashing import IdentityHashError, select_weight_shards

    try:
        shards = select_weight_shards(teacher)
    except IdentityHashError as error:
        raise ModelImportError("invalid_model", f"teacher {teacher}: {error}") from None
    tensors: dict[str, Any] = {}
    for shard in shards:
        for name, tensor in load_file(str(shard)).items():
            match = _LAYER_KEY.match(name)
            if match is None:
                tensors[name] = tensor
            elif int(match.group(2)) in new_index:
                tensors[f"{match.group(1)}{new_index[int(match.group(2))]}{match.group(3)}"] = tensor
    return tensors
