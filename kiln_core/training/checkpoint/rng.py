"""Every random generator of a process, captured as exact bytes and restored bit for bit.

Kiln's format has no slot for Python, NumPy or torch generator states (its streams are counters:
``lora-init`` is a seed), so these go to the extension file (``KilnFlowsState.rank_rng``). JSON has
no bytes: each state is base64 of its exact bytes plus their SHA-256, so a damaged state is refused
instead of silently used.
"""

from __future__ import annotations

import base64
import json
import random

import numpy as np

from kiln_core.canonical import sha256_hex
from kiln_core.contracts.checkpoint import CheckpointError, GeneratorState, RankRngState

__all__ = ["capture_rng_state", "restore_rng_state"]


def _generator_state(algorithm: str, raw: bytes) -> GeneratorState:
    return GeneratorState(algorithm=algorithm, state_base64=base64.b64encode(raw).decode("ascii"), sha256=sha256_hex(raw))


def _state_bytes(state: GeneratorState, stream: str) -> bytes:
    raw = base64.b64decode(state.state_base64.encode("ascii"), validate=True)
    if sha256_hex(raw) != state.sha256:
        raise CheckpointError("checkpoint_rng_state", f"RNG stream {stream} state does not match its sha256",
                              file="kiln_flows_state.json")
    return raw


def capture_rng_state() -> RankRngState:
    """Snapshot this process's generators (torch CPU and every CUDA device, Python, NumPy)."""
    import torch

    version, internal, gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_cached = np.random.get_state()
    cuda = [
        _generator_state(f"torch.cuda.{i}", torch.cuda.get_rng_state(i).numpy().tobytes())
        for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    ]
    return RankRngState(
        torch_cpu=_generator_state("torch.cpu.mt19937", torch.get_rng_state().numpy().tobytes()),
        torch_cuda=cuda,
        python_random=_generator_state("python.random.mt19937", json.dumps([version, list(internal), gauss]).encode()),
        numpy=_generator_state(
            "numpy.random.mt19937",
            json.dumps([np_name, np.asarray(np_keys).tolist(), int(np_pos), int(np_has_gauss), float(np_cached)]).encode(),
        ),
    )


def restore_rng_state(state: RankRngState) -> None:
    """Restore the generators captured by ``capture_rng_state`` exactly.

    Raises:
        CheckpointError: ``checkpoint_rng_state`` when a state's bytes do not match their digest.
    """
    import torch

    torch.set_rng_state(torch.frombuffer(bytearray(_state_bytes(state.torch_cpu, "torch-cpu")), dtype=torch.uint8))
    for i, cuda in enumerate(state.torch_cuda):
        raw = bytearray(_state_bytes(cuda, f"torch-cuda[{i}]"))
        torch.cuda.set_rng_state(torch.frombuffer(raw, dtype=torch.uint8), i)
    version, internal, gauss = json.loads(_state_bytes(state.python_random, "python-random"))
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = json.loads(_state_bytes(state.numpy, "numpy"))
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
