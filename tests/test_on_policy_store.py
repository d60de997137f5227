"""The rollout store: content-addressed Parquet, committed once, audited token by token.

What a user depends on: a retry finds every candidate an earlier attempt committed — exactly as it
was stored, never re-sampled — a crash before the commit leaves nothing visible, a finished run can be
read back in schedule order, and what comes back feeds the same loss code as an off-policy example.
Checked on local disk, ``memory://`` and a real S3 endpoint (moto's standalone server).
"""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from kiln_core.corpus import CorpusTables
from kiln_core.errors import EnvironmentFailure, Rejection
from kiln_core.on_policy.store import COMMIT_FILE, PARQUET_FILE, Rollout, RolloutKey, RolloutStore, rollout_run_key
from kiln_core.storage import resolve

RUN = rollout_run_key({"effective_config": {"seed": 3}, "data_sha256": "ab" * 32, "adapter": "demo"})


def make_rollout(cursor: int, *, sampled=(40, 41, 42), teacher_prefix=(9, 9, 9, 2), k: int = 4,
                 step: int = 0, salt: float = 0.0) -> Rollout:
    rng = np.random.default_rng(cursor)
    n = len(sampled)
    values = np.sort(np.log(rng.dirichlet(np.ones(k + 2), size=n)[:, :k]).astype(np.float32), axis=1)[:, ::-1] - salt
    return Rollout(
        key=RolloutKey(RUN, epoch=0, cursor=cursor, global_step=step, seed=1000 + cursor),
        source_index=cursor // 2, sample_index=cursor % 2,
        rollout_prefix=np.array([1, 5, 2], np.int32), sampled_ids=np.array(sampled, np.int32),
        teacher_prefix=None if teacher_prefix is None else np.array(teacher_prefix, np.int32),
        teacher_ids=np.array([rng.permutation(100)[:k] for _ in range(n)], dtype=np.int32).reshape(n, k),
        teacher_logprobs=np.ascontiguousarray(values).reshape(n, k),
        metadata={"policy_sha256": "cd" * 32},
    )


def assert_same(a: Rollout, b: Rollout) -> None:
    assert (a.key, a.source_index, a.sample_index, a.metadata) == (b.key, b.source_index, b.sample_index, b.metadata)
    for name in ("rollout_prefix", "sampled_ids", "teacher_ids", "teacher_logprobs"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
        assert getattr(a, name).dtype == getattr(b, name).dtype
    assert (a.teacher_prefix is None) == (b.teacher_prefix is None)
    if a.teacher_prefix is not None:
        np.testing.assert_array_equal(a.teacher_prefix, b.teacher_prefix)


@pytest.fixture(params=["local", "memory"])
def store(request, tmp_path) -> RolloutStore:
    if request.param == "local":
        return RolloutStore(str(tmp_path / "rollouts"))
    return RolloutStore(f"memory://rollout-tests-{uuid.uuid4().hex[:8]}/rollouts")


def test_a_rollout_reads_back_bit_exactly(store):
    key = make_rollout(0).key
    assert store.get(key) is None
    for rollout in (make_rollout(0), make_rollout(1, teacher_prefix=None)):
        assert_same(store.put(rollout), rollout)
        assert_same(store.get(rollout.key), rollout)


def test_a_committed_candidate_is_never_replaced(store):
    first = store.put(make_rollout(3))
    second = store.put(make_rollout(3, sampled=(7, 8), salt=0.5))  # a retry that sampled differently
    assert_same(second, first)
    assert_same(store.get(first.key), first)


def test_the_key_names_every_field_that_decides_the_tokens():
    base = RolloutKey(RUN, 1, 2, 3, 4)
    assert base.digest() == RolloutKey(RUN, 1, 2, 3, 4).digest()
    variants = [RolloutKey("0" * 64, 1, 2, 3, 4), RolloutKey(RUN, 0, 2, 3, 4), RolloutKey(RUN, 1, 0, 3, 4),
                RolloutKey(RUN, 1, 2, 0, 4), RolloutKey(RUN, 1, 2, 3, 0)]
    assert len({v.digest() for v in variants} | {base.digest()}) == 6
    assert rollout_run_key({"a": 1}) != rollout_run_key({"a": 2}) and len(RUN) == 64


def test_an_empty_rollout_is_stored_and_trains_nothing(store):
    empty = make_rollout(4, sampled=())
    stored = store.put(empty)
    assert stored.empty and stored.teacher_ids.shape == (0, 4)
    with pytest.raises(ValueError):
        stored.training_example()


def test_the_training_example_has_the_shapes_of_an_admitted_example(store):
    stored = store.put(make_rollout(5))
    example = stored.training_example()
    assert example.input_ids.tolist() == [1, 5, 2, 40, 41, 42] and example.action_positions.tolist() == [3, 4, 5]
    np.testing.assert_array_equal(example.teacher_ids, stored.teacher_ids)
    # exactly what an off-policy corpus example of the same content gives the loss
    admitted = CorpusTables.from_examples([example], top_k=4).example(0).to_torch()
    batch = example.to_torch()
    assert batch.keys() == admitted.keys()
    assert batch["observation_tokens"] == admitted["observation_tokens"] == 0  # |O|: a plain int, no env tokens
    for name, tensor in batch.items():
        if name == "observation_tokens":
            continue
        assert (tensor.dtype, tuple(tensor.shape)) == (admitted[name].dtype, tuple(admitted[name].shape)), name
        assert bool((tensor == admitted[name]).all()), name
    assert batch["teacher_ids"].shape == (3, 4) and batch["env_positions"].numel() == 0


def test_audit_lists_a_run_in_schedule_order_and_skips_uncommitted_work(store, monkeypatch):
    for cursor in (4, 0, 2):
        store.put(make_rollout(cursor, step=cursor))
    # an attempt that died before its commit file: never visible, and a later put commits over it
    crashed = make_rollout(6)
    from kiln_core.storage import StagedDirectory

    staged = StagedDirectory(store.location(crashed.key), commit_name=COMMIT_FILE)
    staged.__enter__()
    staged.write(PARQUET_FILE, b"partial")
    assert store.get(crashed.key) is None
    assert [r.key.cursor for r in store.audit(RUN)] == [0, 2, 4]
    if store.root.is_local:
        staged.__exit__(None, None, None)
    assert_same(store.put(crashed), crashed)
    assert [r.key.cursor for r in store.audit(RUN)] == [0, 2, 4, 6]
    assert store.audit("f" * 64) == []


def test_a_tampered_rollout_is_refused(store):
    rollout = store.put(make_rollout(7))
    location = store.location(rollout.key)
    parquet = location.child(PARQUET_FILE)
    with parquet.fs.open(parquet.path, "wb") as handle:
        handle.write(b"PAR1-not-what-was-committed")
    with pytest.raises(Rejection) as caught:
        store.get(rollout.key)
    assert caught.value.code == "corrupt_rollout" and "does not match the digest" in caught.value.message

    moved = store.put(make_rollout(8))
    record = json.loads(store.location(moved.key).child(COMMIT_FILE).read_bytes())
    misplaced = store.location(RolloutKey(RUN, 0, 9, 0, 1009))
    for name, payload in ((PARQUET_FILE, store.location(moved.key).child(PARQUET_FILE).read_bytes()),
                          (COMMIT_FILE, json.dumps(record).encode())):
        target = misplaced.child(name)
        target.fs.makedirs(misplaced.path, exist_ok=True)
        with target.fs.open(target.path, "wb") as handle:
            handle.write(payload)
    with pytest.raises(Rejection) as caught:
        store.get(RolloutKey(RUN, 0, 9, 0, 1009))
    assert caught.value.code == "corrupt_rollout"
    assert "is not a kiln-flows.opd-rollout.v1 record" in caught.value.message


def test_storage_failures_are_environment_failures(store, monkeypatch):
    from kiln_core.storage import StagedDirectory

    def full(self, relative_path, data):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(StagedDirectory, "write", full)
    with pytest.raises(EnvironmentFailure) as caught:
        store.put(make_rollout(10))
    assert caught.value.code == "storage_unavailable" and caught.value.retryable
    assert store.get(make_rollout(10).key) is None


@pytest.mark.integration
def test_the_store_on_s3(tmp_path_factory):
    from drills.s3_server import S3Server, aws_environment, clear_s3fs_cache

    server = S3Server(log_path=str(tmp_path_factory.mktemp("moto-rollouts") / "moto.log"))
    server.start()
    try:
        server.create_bucket("rollouts")
        with aws_environment(server):
            clear_s3fs_cache()
            store = RolloutStore(f"s3://rollouts/{uuid.uuid4().hex[:8]}/rollouts")
            written = [store.put(make_rollout(c)) for c in (2, 0)]
            assert_same(store.put(make_rollout(0, salt=1.0)), written[1])
            clear_s3fs_cache()
            fresh = RolloutStore(store.root.uri)
            assert [r.key.cursor for r in fresh.audit(RUN)] == [0, 2]
            assert_same(fresh.get(written[0].key), written[0])
            assert resolve(store.root.uri).child(RUN).exists()
    finally:
        clear_s3fs_cache()
        server.stop()
