"""Which adapter ``config.base_adapter`` names: one rule for ``kiln-flows train``, specs and the UI form.

Kiln (``crates/kiln-train/src/adapter_shape.rs`` · ``resolve_base_adapter_dir``) takes the value as a
directory when that path exists and otherwise as a name in its adapter directory. A kiln-flows adapter
name owns ``<root>/runs/<name>/`` — one directory per run — and ``latest.json`` names its newest
published (promoted) adapter, so:

* an **adapter name** (the adapter-name rule: no ``/``) is that adapter's ``latest.json`` adapter under the
  storage root, checked against the digest ``latest.json`` records;
* a **directory** — an absolute path, a relative path with a ``/`` (from the working directory, as
  Kiln's server resolves it), or an fsspec URI — is that PEFT adapter directory.

A bare name is always a name, even where a directory of that name happens to exist in the working
directory (Kiln would take the directory). The result is pinned by the weights' digest: the run key
includes it, so a base adapter re-published under the same name makes a different run.
"""

from __future__ import annotations

import os

from pydantic import ValidationError

from kiln_core.contracts.latest import LATEST_FILE, decode_latest
from kiln_core.contracts.names import is_valid_name
from kiln_core.contracts.opd_config import OpdConfig
from kiln_core.errors import EnvironmentFailure
from kiln_core.storage import resolve
from kiln_core.contracts.base_adapter import BaseAdapter
from kiln_core.contracts.lora_targets import LoraTargets
from kiln_core.training.base_adapter import BaseAdapterError, check_base_adapter_fits, read_base_adapter

__all__ = ["resolve_base_adapter", "plan_base_adapter"]

RUNS_DIR = "runs"  # kiln_core.engine.runs' layout (it imports this module)


def resolve_base_adapter(value: str, storage_root: str) -> BaseAdapter:
    """Find the adapter ``value`` names and pin it by its weights' digest.

    Args:
        value: ``config.base_adapter``: an adapter name or an adapter directory.
        storage_root: The storage root whose ``runs/<name>/latest.json`` a name is looked up in.

    Raises:
        BaseAdapterError: ``base_adapter_missing``, naming what was looked up where.
        EnvironmentFailure: ``base_adapter_changed`` — the adapter's bytes are not the ones
            ``latest.json`` records (storage damage, or a publication in progress).

    Example:
        >>> base = resolve_base_adapter("off-policy-warm", "./kiln-data")  # doctest: +SKIP
        >>> base.uri  # doctest: +SKIP
        '/abs/kiln-data/runs/off-policy-warm/3f2a9c0d1e2b4a5c/adapter'
    """
    if not is_valid_name(value):  # a path or a URI: that directory itself
        return read_base_adapter(value, value if "://" in value else os.path.abspath(value))
    latest = resolve(storage_root).child(RUNS_DIR, value, LATEST_FILE)
    try:
        pointer = decode_latest(latest.read_bytes())
        adapter_uri, expected = pointer.adapter, pointer.adapter_model_sha256
    except FileNotFoundError:
        raise BaseAdapterError("base_adapter_missing", f"base adapter {value!r} is not a published adapter: "
                               f"{latest.uri} does not exist (train and publish {value!r} first, or give an adapter "
                               "directory)", field="config.base_adapter", file=latest.uri) from None
    except ValidationError as error:
        first = error.errors()[0]
        place = ".".join(str(part) for part in first["loc"]) or "document"
        raise BaseAdapterError("base_adapter_missing", f"base adapter {value!r}: {latest.uri} is not a kiln-flows "
                               f"latest.json: field `{place}`: {first['msg']}", field="config.base_adapter",
                               file=latest.uri) from None
    except (OSError, ValueError) as error:
        raise BaseAdapterError("base_adapter_missing", f"base adapter {value!r}: {latest.uri} is not a readable "
                               f"latest.json ({type(error).__name__}: {error})", field="config.base_adapter",
                               file=latest.uri) from None
    base = read_base_adapter(value, adapter_uri, looked_up=latest.uri)
    if base.adapter_model_sha256 != expected:
        raise EnvironmentFailure("base_adapter_changed", f"base adapter {value!r} at {base.uri} is "
                                 f"{base.adapter_model_sha256}, but {latest.uri} records {expected}", file=base.uri)
    return base


def plan_base_adapter(config: OpdConfig, storage_root: str, targets: LoraTargets) -> BaseAdapter | None:
    """The run's base adapter, resolved and checked against its LoRA config; None without one.

    Raises:
        BaseAdapterError: ``base_adapter_missing`` or ``base_adapter_mismatch`` (rank, alpha, targets).
    """
    if config.base_adapter is None:
        return None
    base = resolve_base_adapter(config.base_adapter, storage_root)
    check_base_adapter_fits(base, config, targets)
    return base
