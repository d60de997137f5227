"""The content digests inside a ``kiln.teacher-identity.v1`` (Kiln's scripts/vllm_teacher.py).

Each digest is domain-separated and independent of paths, mtimes and shard names (except the adapter
digest, which binds its file name), so two copies of the same weights hash the same wherever they
live. Weight shards are hashed streaming with a fixed buffer, and shards are hashed in parallel on a
thread pool: ``hashlib`` releases the GIL while it digests a large buffer, so threads scale with
cores without copying data into worker processes.

Every function raises ``IdentityHashError`` (a ``ValueError`` with a stable ``code``) for input that
cannot be hashed under the rules, never a half-computed digest.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kiln_core.errors import Rejection

BASE_MODEL_DOMAIN = b"kiln.base-model-content.v1\0"
TOKENIZER_VOCAB_DOMAIN = b"kiln.tokenizer-vocab.v1\0"
ADAPTER_WEIGHTS_DOMAIN = b"kiln.adapter-weights.v1\0"
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
SAFETENSORS_INDEX = "model.safetensors.index.json"
SINGLE_SAFETENSORS = "model.safetensors"
# 8 MiB: large enough that per-call overhead vanishes next to SHA-256 itself, small enough that
# hashing many shards at once stays bounded (one buffer per worker thread).
READ_BUFFER_BYTES = 8 * 1024 * 1024
U32_MAX = 2**32 - 1


class IdentityHashError(Rejection, ValueError):
    """Input that the identity hashing rules (``scripts/vllm_teacher.py``) refuse; ``code`` is stable, the
    message says what to fix."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(code, message)

    def __str__(self) -> str:
        return self.message


def _u64(value: int) -> bytes:
    return struct.pack("<Q", value)


# ---------------------------------------------------------------------------------------------
# Files


def sha256_file(path: str | Path, *, buffer_bytes: int = READ_BUFFER_BYTES) -> tuple[bytes, int]:
    """Stream one file through SHA-256 with a single reusable buffer.

    Args:
        path: The file to hash.
        buffer_bytes: Read size; memory use is one buffer of this size.

    Returns:
        ``(raw 32-byte digest, length in bytes)``.

    Example:
        >>> digest, length = sha256_file("model.safetensors")  # doctest: +SKIP
    """
    hasher = hashlib.sha256()
    buffer = bytearray(buffer_bytes)
    view = memoryview(buffer)
    length = 0
    # buffering=0: readinto fills our buffer straight from the kernel, with no second copy.
    with open(path, "rb", buffering=0) as handle:
        while True:
            count = handle.readinto(buffer)
            if not count:
                break
            hasher.update(view[:count])
            length += count
    return hasher.digest(), length


def checked_regular_file(path: Path, what: str) -> Path:
    """Refuse missing paths, non-files, empty files and symlinks with a message naming ``what``.

    The one symlink accepted is a Hugging Face cache snapshot's link into its own cache's ``blobs/``
    (``models--org--name/snapshots/<rev>/model.safetensors -> ../../blobs/<sha256>``): the cache lays
    every model out that way. Reads follow it, so digests are over the same bytes as a plain copy's; the
    path returned is still the snapshot's, whose file name is the one a loader and a manifest use.
    """
    if path.is_symlink():
        _check_cache_link(path, what)
    if not path.exists():
        raise IdentityHashError("missing_file", f"{what} {path} does not exist{hf_cache_repo_hint(path.parent)}")
    if not path.is_file():
        raise IdentityHashError("not_a_file", f"{what} {path} is not a regular file")
    if path.stat().st_size == 0:
        raise IdentityHashError("empty_file", f"{what} {path} is empty")
    return path


def hf_cache_repo_hint(directory: str | Path) -> str:
    """``''``, unless ``directory`` is a Hugging Face cache repo folder (``models--org--name`` holding ``blobs/``
    and ``snapshots/``) given where a model directory belongs: then a hint naming the snapshot folder(s) to give
    instead, the one ``refs/main`` points at first.

    Example:
        >>> hf_cache_repo_hint("./student")
        ''
    """
    root = Path(directory)
    snapshots = root / "snapshots"
    if not (snapshots.is_dir() and (root / "blobs").is_dir()):
        return ""
    found = sorted(entry for entry in snapshots.iterdir() if entry.is_dir())
    main = root / "refs" / "main"
    pinned = snapshots / main.read_text(encoding="utf-8").strip() if main.is_file() else None
    found.sort(key=lambda entry: entry != pinned)  # refs/main's snapshot first, the others in name order
    if not found:
        return f"; {root} is a Hugging Face cache folder with no snapshot in it yet"
    more = f" (or {', '.join(str(entry) for entry in found[1:3])}{', …' if len(found) > 3 else ''})" if len(found) > 1 else ""
    return f"; {root} is a Hugging Face cache folder, not a model directory: give its snapshot {found[0]}{more}"


def hf_cache_repo(path: Path) -> Path | None:
    """The ``models--…`` folder of the Hugging Face cache snapshot that holds ``path``, or None.

    A snapshot is ``<repo>/snapshots/<revision>/`` next to ``<repo>/blobs/``; the path is taken as given
    (not resolved), since resolving it would leave the snapshot.
    """
    for folder in Path(os.path.abspath(path)).parents:
        if folder.parent.name == "snapshots" and (folder.parent.parent / "blobs").is_dir():
            return folder.parent.parent
    return None


def _check_cache_link(path: Path, what: str) -> None:
    """Accept a symlink only inside a Hugging Face cache snapshot, pointing into that cache's ``blobs/``."""
    repo = hf_cache_repo(path)
    if repo is None:
        raise IdentityHashError("symlink", f"{what} {path} is a symlink; copy the real file in (symlinks are "
                                "refused, except a Hugging Face cache snapshot's links into its blobs/)")
    blobs, target = (repo / "blobs").resolve(), path.resolve()
    if not target.is_relative_to(blobs):
        raise IdentityHashError("symlink", f"{what} {path} is a symlink to {target}, outside its Hugging Face "
                                f"cache's {blobs}; only links into the cache's own blobs/ are followed")


# ---------------------------------------------------------------------------------------------
# Base model weights


def select_weight_shards(model_dir: str | Path) -> list[Path]:
    """The safetensors shards a loader reads from ``model_dir``, in a stable order.

    The shard index (``model.safetensors.index.json``) wins when present: its ``weight_map``'s unique
    file names. Otherwise ``model.safetensors``, otherwise every ``*.safetensors`` file, sorted.

    Raises:
        IdentityHashError: no shards, an unreadable index, an index entry that escapes the directory,
            or a shard that is a symlink, missing or empty.

    Example:
        >>> [p.name for p in select_weight_shards("teacher/")]  # doctest: +SKIP
        ['model-00001-of-00002.safetensors', 'model-00002-of-00002.safetensors']
    """
    root = Path(model_dir)
    if not root.is_dir():
        raise IdentityHashError("missing_dir", f"model directory {root} does not exist or is not a directory")
    index_path = root / SAFETENSORS_INDEX
    if index_path.exists():
        names = _index_shard_names(index_path)
    elif (root / SINGLE_SAFETENSORS).exists() or (root / SINGLE_SAFETENSORS).is_symlink():
        names = [SINGLE_SAFETENSORS]
    else:
        names = sorted(entry.name for entry in root.iterdir() if entry.name.endswith(".safetensors"))
    if not names:
        raise IdentityHashError("no_shards", f"no safetensors weights in {root} (pickled .bin weights are not hashed)"
                                f"{hf_cache_repo_hint(root)}")
    return [checked_regular_file(root / name, "weight shard") for name in names]


def _index_shard_names(index_path: Path) -> list[str]:
    try:
        index = json.loads(index_path.read_bytes())
        weight_map = index["weight_map"]
        names = sorted(set(weight_map.values()))
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise IdentityHashError("bad_index", f"{index_path} has no readable weight_map: {error}") from None
    for name in names:
        # A shard name is a bare file name in the model directory, never a path elsewhere.
        if not isinstance(name, str) or not name or name != Path(name).name or name in (".", ".."):
            raise IdentityHashError("bad_index", f"{index_path} names shard {name!r}, which is not a plain file name")
    return names


def base_model_digest(records: Iterable[tuple[bytes, int]]) -> str:
    """Combine per-shard ``(raw digest, length)`` records into ``base_model_sha256``.

    Records are sorted by (digest bytes, length), so shard names and order never matter.

    Example:
        >>> import hashlib
        >>> base_model_digest([(hashlib.sha256(b"weight-v1").digest(), 9)])
        'aa7e9961df654af2a7405c5d2c07eb5a72b58f86060035c245c3415793c459c1'
    """
    ordered = sorted(records)
    hasher = hashlib.sha256(BASE_MODEL_DOMAIN)
    hasher.update(_u64(len(ordered)))
    for digest, length in ordered:
        if len(digest) != 32:
            raise IdentityHashError("bad_digest", "shard digests must be 32 raw bytes")
        hasher.update(_u64(length))
        hasher.update(digest)
    return hasher.hexdigest()


def hash_files_parallel(paths: list[Path], *, max_workers: int | None = None) -> list[tuple[bytes, int]]:
    """``sha256_file`` over ``paths`` on a thread pool; results in the order of ``paths``.

    Args:
        paths: Files to hash.
        max_workers: Threads; default one per CPU, never more than the number of files.
    """
    workers = max(1, min(len(paths), max_workers or os.cpu_count() or 1))
    if workers == 1:
        return [sha256_file(path) for path in paths]
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kiln-hash") as pool:
        return list(pool.map(sha256_file, paths))


def base_model_sha256(model_dir: str | Path, *, max_workers: int | None = None) -> str:
    """``base_model_sha256`` of a local model directory (raw lowercase hex, no prefix).

    Args:
        model_dir: A Hugging Face model directory with safetensors weights.
        max_workers: Shards hashed at once; default one per CPU.

    Raises:
        IdentityHashError: see ``select_weight_shards``.

    Example:
        >>> base_model_sha256("teacher/")  # doctest: +SKIP
        '3f1c...'
    """
    shards = select_weight_shards(model_dir)
    records = hash_files_parallel(shards, max_workers=max_workers)
    for shard, (_, length) in zip(shards, records):
        if length == 0:  # the file was truncated between the check and the read
            raise IdentityHashError("empty_file", f"weight shard {shard} is empty")
    return base_model_digest(records)


# ---------------------------------------------------------------------------------------------
# Tokenizer


def vocab_digest(vocab: Mapping[str, int]) -> str:
    """``tokenizer_vocab_sha256`` of a token → id map (the pure part of the rule).

    Example:
        >>> vocab_digest({"a": 0, "b": 1})
        '0e7ed7c4b2c375344d31b534f7cbb119b528114f1301f09d6642801b100710ff'
    """
    pairs = []
    for token, token_id in vocab.items():
        if type(token_id) is not int or not 0 <= token_id <= U32_MAX:
            raise IdentityHashError("bad_token_id", f"token {token!r} has id {token_id!r}, which does not fit in u32")
        try:
            encoded = token.encode("utf-8")
        except (UnicodeEncodeError, AttributeError):
            raise IdentityHashError("bad_token", f"token {token!r} (id {token_id}) is not valid UTF-8 text") from None
        pairs.append((token_id, encoded))
    pairs.sort()
    hasher = hashlib.sha256(TOKENIZER_VOCAB_DOMAIN)
    hasher.update(_u64(len(pairs)))
    for token_id, encoded in pairs:
        hasher.update(struct.pack("<I", token_id))
        hasher.update(_u64(len(encoded)))
        hasher.update(encoded)
    return hasher.hexdigest()


def load_fast_tokenizer(model_dir: str | Path) -> Any:
    """Load the fast tokenizer of a local model directory (no hub access)."""
    from transformers import AutoTokenizer

    hint = hf_cache_repo_hint(model_dir)
    if hint:  # transformers would say, over several lines, that it cannot build a tokenizer
        raise IdentityHashError("no_tokenizer", f"no tokenizer in {model_dir}{hint}")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(model_dir), use_fast=True, local_files_only=True)
    except (OSError, ValueError, KeyError) as error:
        raise IdentityHashError("no_tokenizer", f"cannot load a fast tokenizer from {model_dir}: {error}") from None
    if _backend(tokenizer) is None:
        raise IdentityHashError("not_fast_tokenizer", f"{model_dir} has no fast (tokenizer.json) tokenizer")
    return tokenizer


def _backend(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind a transformers tokenizer, or the object itself if it is one."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return backend
    if hasattr(tokenizer, "to_str") and hasattr(tokenizer, "get_vocab_size"):
        return tokenizer
    return None


def _as_tokenizer(tokenizer_or_dir: Any) -> Any:
    if isinstance(tokenizer_or_dir, (str, os.PathLike)):
        return load_fast_tokenizer(tokenizer_or_dir)
    if _backend(tokenizer_or_dir) is None:
        raise IdentityHashError("not_fast_tokenizer", "tokenizer identity needs a fast tokenizer (tokenizer.json)")
    return tokenizer_or_dir


def tokenizer_vocab_sha256(tokenizer_or_dir: Any) -> str:
    """``tokenizer_vocab_sha256`` of a fast tokenizer, or of the tokenizer in a model directory.

    The complete ``get_vocab()`` map (added tokens included) is hashed; its size must equal the
    backend's ``get_vocab_size(with_added_tokens=True)``, otherwise some ids are unreachable by name
    and the digest would not describe the tokenizer.

    Raises:
        IdentityHashError: ``vocab_count_mismatch``, ``bad_token_id``, ``bad_token``, ``not_fast_tokenizer``.

    Example:
        >>> tokenizer_vocab_sha256("teacher/")  # doctest: +SKIP
    """
    tokenizer = _as_tokenizer(tokenizer_or_dir)
    backend = _backend(tokenizer)
    if backend is tokenizer:
        vocab = backend.get_vocab(with_added_tokens=True)
    else:
        vocab = tokenizer.get_vocab()
    expected = backend.get_vocab_size(with_added_tokens=True)
    if len(vocab) != expected:
        raise IdentityHashError(
            "vocab_count_mismatch",
            f"tokenizer get_vocab() has {len(vocab)} entries but the backend reports {expected} "
            "(with added tokens); the vocabulary digest would not cover every id",
        )
    return vocab_digest(vocab)


def tokenizer_config_sha256(tokenizer_or_dir: Any) -> str:
    """SHA-256 of the fast tokenizer's backend JSON string (``backend_tokenizer.to_str()``).

    This is deliberately not a hash of ``tokenizer_config.json`` or of ``tokenizer.json``'s bytes:
    the serialized backend is what decides tokenization.

    Example:
        >>> tokenizer_config_sha256("teacher/")  # doctest: +SKIP
    """
    backend = _backend(_as_tokenizer(tokenizer_or_dir))
    return hashlib.sha256(backend.to_str().encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------------------------
# Model config


def read_model_config(model_dir: str | Path) -> tuple[bytes, dict[str, Any]]:
    """The exact bytes of ``config.json`` and their decoded object."""
    path = checked_regular_file(Path(model_dir) / "config.json", "model config")
    raw = path.read_bytes()
    try:
        config = json.loads(raw)
    except ValueError as error:
        raise IdentityHashError("bad_config", f"{path} is not valid JSON: {error}") from None
    if not isinstance(config, dict):
        raise IdentityHashError("bad_config", f"{path} is not a JSON object")
    return raw, config


def _positive_int(value: Any, where: str) -> int:
    if type(value) is not int or value < 1:
        raise IdentityHashError("bad_config", f"{where} must be a positive integer, got {value!r}")
    return value


def config_value(config: Mapping[str, Any], key: str, *, where: str = "config.json") -> int | None:
    """A positive integer from ``config[key]`` or ``config["text_config"][key]``; both must agree."""
    text_config = config.get("text_config")
    outer = config.get(key)
    inner = text_config.get(key) if isinstance(text_config, dict) else None
    if outer is not None:
        outer = _positive_int(outer, f"{where} {key}")
    if inner is not None:
        inner = _positive_int(inner, f"{where} text_config.{key}")
    if outer is not None and inner is not None and outer != inner:
        raise IdentityHashError("bad_config", f"{where} {key}={outer} disagrees with text_config.{key}={inner}")
    return outer if outer is not None else inner


def model_vocab_size(model_dir: str | Path) -> int:
    """The model's logit width: ``config.json`` ``vocab_size`` or ``text_config.vocab_size``.

    Example:
        >>> model_vocab_size("teacher/")  # doctest: +SKIP
        151936
    """
    _, config = read_model_config(model_dir)
    value = config_value(config, "vocab_size")
    if value is None:
        raise IdentityHashError("bad_config", f"{Path(model_dir) / 'config.json'} has no vocab_size")
    return value


# ---------------------------------------------------------------------------------------------
# Adapter


def adapter_weights_file(adapter_dir: str | Path) -> Path:
    """The single adapter weights file (``adapter_model.safetensors`` or ``adapter_model.bin``)."""
    root = Path(adapter_dir)
    present = [name for name in ADAPTER_WEIGHT_FILES if (root / name).exists() or (root / name).is_symlink()]
    if len(present) != 1:
        raise IdentityHashError(
            "adapter_weights",
            f"adapter directory {root} must contain exactly one of {list(ADAPTER_WEIGHT_FILES)}, found {present}",
        )
    return checked_regular_file(root / present[0], "adapter weights")


def adapter_weights_sha256(adapter_dir: str | Path) -> str:
    """``adapter.weights_sha256``: the weights file's digest bound to its file name.

    Example:
        >>> adapter_weights_sha256("my-lora/")  # doctest: +SKIP
    """
    path = adapter_weights_file(adapter_dir)
    digest, length = sha256_file(path)
    name = path.name.encode("utf-8")
    hasher = hashlib.sha256(ADAPTER_WEIGHTS_DOMAIN)
    hasher.update(_u64(1))
    hasher.update(_u64(len(name)))
    hasher.update(name)
    hasher.update(_u64(length))
    hasher.update(digest)
    return hasher.hexdigest()


def adapter_config_sha256(adapter_dir: str | Path) -> str:
    """``adapter.config_sha256``: plain SHA-256 of the raw ``adapter_config.json`` bytes."""
    path = checked_regular_file(Path(adapter_dir) / "adapter_config.json", "adapter config")
    return hashlib.sha256(path.read_bytes()).hexdigest()
