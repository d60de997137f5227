"""The local teacher registry: immutable aliases, atomic storage, pinned manifests, and the CLI."""

from __future__ import annotations

import json
import shutil

import pytest

from kiln_core.contracts.identity import parse_manifest_line
from kiln_core.contracts.teachers import REGISTRY_FILE
from kiln_core.teachers.local_registry import (
    LocalRegistryError,
    get_local_teacher,
    list_local_teachers,
    register_local_teacher,
    resolve_pinned_manifest,
)


def test_register_then_get_and_list(tmp_path, tiny_teacher):
    root = tmp_path / "root"
    entry = register_local_teacher(root, "tiny-teacher", tiny_teacher, device_kind="cpu")
    identity = parse_manifest_line(entry.off_policy_manifest).teacher_identity
    assert entry.identity == identity.as_ordered_dict()
    assert list(entry.identity)[:3] == ["schema", "protocol", "served_model_id"]
    assert entry.identity_revision == "sha256:" + identity.content_revision()
    assert identity.served_model_id == "tiny-teacher"
    assert entry.teacher_dir == str(tiny_teacher.resolve())
    assert get_local_teacher(root, "tiny-teacher") == entry
    assert list_local_teachers(root) == [entry]
    stored = json.loads((root / REGISTRY_FILE).read_text(encoding="utf-8"))
    assert stored["teachers"][0]["off_policy_manifest"] == entry.off_policy_manifest
    assert not [p for p in root.iterdir() if p.name.startswith(".")]  # no temp files left behind


def test_aliases_are_immutable(tmp_path, tiny_teacher, tiny_student):
    root = tmp_path / "root"
    first = register_local_teacher(root, "t", tiny_teacher, device_kind="cpu")
    # Same identity again: a no-op that returns the original entry (original timestamp).
    again = register_local_teacher(root, "t", tiny_teacher, device_kind="cpu")
    assert again == first
    # A copy of the same teacher elsewhere has the same identity: still a no-op.
    copy = tmp_path / "teacher-copy"
    shutil.copytree(tiny_teacher, copy)
    assert register_local_teacher(root, "t", copy, device_kind="cpu") == first
    # Different weights, or the same weights with different scoring options: refused.
    with pytest.raises(LocalRegistryError) as caught:
        register_local_teacher(root, "t", tiny_student, device_kind="cpu")
    assert caught.value.code == "alias_exists"
    assert first.identity_revision in caught.value.message
    with pytest.raises(LocalRegistryError) as caught:
        register_local_teacher(root, "t", tiny_teacher, device_kind="cpu", max_top_k=16)
    assert caught.value.code == "alias_exists"
    assert list_local_teachers(root) == [first]


def test_unknown_alias_lists_known(tmp_path, tiny_teacher):
    register_local_teacher(tmp_path, "alpha", tiny_teacher, device_kind="cpu")
    with pytest.raises(LocalRegistryError) as caught:
        get_local_teacher(tmp_path, "beta")
    assert caught.value.code == "unknown_alias"
    assert "alpha" in caught.value.message
    assert list_local_teachers(tmp_path / "empty") == []


@pytest.mark.parametrize("alias", [" padded", "t@local", "demo\n", "a/b", "..", "x" * 129, "-lead", "t.kiln-checkpoint"])
def test_bad_alias_refused(tmp_path, tiny_teacher, alias):
    # Aliases follow the adapter-name rule (fullmatch: a trailing newline is not accepted either).
    with pytest.raises(LocalRegistryError) as caught:
        register_local_teacher(tmp_path, alias, tiny_teacher, device_kind="cpu")
    assert caught.value.code == "bad_alias"
    assert not (tmp_path / "teachers.json").exists()


def test_alias_is_the_served_model_id(tmp_path, tiny_teacher):
    entry = register_local_teacher(tmp_path, "t.local_v1-2", tiny_teacher, device_kind="cpu")
    assert entry.identity["served_model_id"] == "t.local_v1-2"


def test_resolve_pinned_manifest_from_alias_or_file(tmp_path, tiny_teacher):
    entry = register_local_teacher(tmp_path, "tiny", tiny_teacher, device_kind="cpu")
    assert resolve_pinned_manifest(tmp_path, "tiny") == entry.off_policy_manifest
    manifest_file = tmp_path / "manifest.jsonl"
    manifest_file.write_text(entry.off_policy_manifest + "\n", encoding="utf-8")
    assert resolve_pinned_manifest(tmp_path, manifest_file) == entry.off_policy_manifest
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(entry.off_policy_manifest + "\n" + '{"messages": []}\n', encoding="utf-8")
    assert resolve_pinned_manifest(tmp_path, str(corpus)) == entry.off_policy_manifest
    bad = tmp_path / "bad.jsonl"
    bad.write_text(" " + entry.off_policy_manifest + "\n", encoding="utf-8")
    with pytest.raises(LocalRegistryError) as caught:
        resolve_pinned_manifest(tmp_path, bad)
    assert caught.value.code == "bad_manifest_file"


def test_corrupt_registry_detected(tmp_path, tiny_teacher):
    entry = register_local_teacher(tmp_path, "tiny", tiny_teacher, device_kind="cpu")
    path = tmp_path / REGISTRY_FILE
    document = json.loads(path.read_text(encoding="utf-8"))
    document["teachers"][0]["identity"]["max_top_k"] = 16  # identity no longer matches its manifest
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(LocalRegistryError) as caught:
        get_local_teacher(tmp_path, entry.alias)
    assert caught.value.code == "corrupt_registry"


def test_a_registry_with_an_unknown_top_level_key_is_corrupt(tmp_path, tiny_teacher):
    entry = register_local_teacher(tmp_path, "tiny", tiny_teacher, device_kind="cpu")
    path = tmp_path / REGISTRY_FILE
    path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), "mirrors": []}), encoding="utf-8")
    with pytest.raises(LocalRegistryError) as caught:
        get_local_teacher(tmp_path, entry.alias)
    assert caught.value.code == "corrupt_registry" and "mirrors" in caught.value.message


def test_memory_filesystem_root(tiny_teacher):
    import fsspec

    root = "memory://kiln-registry-test"
    try:
        entry = register_local_teacher(root, "tiny", tiny_teacher, device_kind="cpu")
        assert get_local_teacher(root, "tiny") == entry
        assert resolve_pinned_manifest(root, "tiny") == entry.off_policy_manifest
    finally:
        fsspec.filesystem("memory").rm("/kiln-registry-test", recursive=True)


def test_cli_register_and_list(tmp_path, tiny_teacher, tiny_student, capsys):
    from flows.cli import main

    root = str(tmp_path / "data")
    assert main(["teachers", "register", "tiny", str(tiny_teacher), "--out", root, "--device", "cpu", "--json"]) == 0
    entry = json.loads(capsys.readouterr().out)
    assert entry["alias"] == "tiny" and entry["identity_revision"].startswith("sha256:")

    assert main(["teachers", "register", "tiny", str(tiny_student), "--root", root, "--device", "cpu"]) == 2
    assert "alias_exists" in capsys.readouterr().err

    assert main(["teachers", "list", "--out", root, "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [item["alias"] for item in listed] == ["tiny"]
    assert main(["teachers", "list", "--root", root]) == 0  # the older spelling stays a hidden alias
    assert "tiny\tsha256:" in capsys.readouterr().out

    assert main(["manifest", "--registry", root, "--alias", "tiny"]) == 0
    assert capsys.readouterr().out == entry["off_policy_manifest"] + "\n"
    assert main(["manifest", "--root", root, "--alias", "tiny"]) == 0
    assert capsys.readouterr().out == entry["off_policy_manifest"] + "\n"
    assert main(["manifest", "--root", root, "--alias", "nope"]) == 2
    assert main(["teachers"]) == 2
