"""Wire formats are the floor: each file kiln-flows writes has one strict model in ``kiln_core.contracts``.

What a user depends on: the files of a run (``latest.json``, ``train_receipt.json``, checkpoint
manifests, the eval curve, ``admission.json``, ``teachers.json``) keep their exact bytes — digests of
them are recorded elsewhere (``latest.json`` pins the receipt) — and parse back through their model
into the same bytes; and a reader finds every format's model in one place.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from kiln_core.contracts.latest import LATEST_FILE, LatestPointer, decode_latest, encode_latest
from test_post_eval_fate import trained, write_run  # noqa: F401 (fixtures: one real training run)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_latest_json_bytes_are_the_published_ones_and_round_trip(tmp_path, write_run):
    from kiln_core.canonical import sha256_prefixed
    from kiln_core.engine.publish import latest_pointer, write_latest

    run = write_run(tmp_path)
    written = write_latest(str(run))
    data = (run.parent / LATEST_FILE).read_bytes()
    assert written.uri == str(run.parent / LATEST_FILE)
    receipt_bytes = (run / "train_receipt.json").read_bytes()
    receipt = json.loads(receipt_bytes)
    # the document as publication has always written it: these keys in this order, indent 2, no newline
    expected = json.dumps({
        "adapter": str(run / "adapter"),
        "receipt": str(run / "train_receipt.json"),
        "receipt_sha256": sha256_prefixed(receipt_bytes),
        "run": str(run),
        "adapter_model_sha256": sha256_prefixed((run / "adapter" / "adapter_model.safetensors").read_bytes()),
        "dataset_sha256": receipt["training_data"]["sha256"],
        "produced_at": receipt["produced_at"],
    }, indent=2).encode("utf-8")
    assert data == expected and not data.endswith(b"\n")
    pointer = decode_latest(data)
    assert pointer == latest_pointer(str(run)) and encode_latest(pointer) == data


@pytest.mark.parametrize("change", [
    lambda document: {key: value for key, value in document.items() if key != "receipt_sha256"},
    lambda document: {**document, "extra": 1},
    lambda document: {**document, "run": None},
])
def test_latest_pointer_is_strict(change):
    document = dict(adapter="/r/a", receipt="/r/t", receipt_sha256="sha256:0", run="/r", adapter_model_sha256="sha256:1",
                    dataset_sha256=None, produced_at="2026-01-01T00:00:00+00:00")
    assert decode_latest(json.dumps(document)) == LatestPointer(**document)
    with pytest.raises(ValidationError):
        decode_latest(json.dumps(change(document)))
