"""The grammar of names read back from a store or a remote (store/names.py), and the second wall:
backends refuse any path that resolves outside their root. Pure checks and real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from smartckpt_cli.errors import UnsafePathError
from smartckpt_cli.remote.replica import open_remote
from smartckpt_cli.store.journal import fold
from smartckpt_cli.store.names import (
    InvalidName,
    blob_rel,
    check_rel,
    commit_names,
    is_manifest_file,
    is_temporary,
    journal_object,
    parse_marker,
)
from smartckpt_cli.store.storage import LocalStorage
from smartckpt_cli.store.storage.objects import ObjectStorage
from tests._names import HASH, cid, commit

BAD_RELS = [
    "/etc/passwd",
    "../x",
    "manifests/../../x",
    "blobs//x",
    "./x",
    "x/",
    "",
    "a\x00b",
    "\udcff",
    "a" * 600,
    "a\\b",
    "with space",
]


@pytest.mark.parametrize("rel", BAD_RELS)
def test_check_rel_refuses_what_could_leave_the_root(rel: str) -> None:
    with pytest.raises(InvalidName):
        check_rel(rel)


@pytest.mark.parametrize(
    "rel", ["journal.jsonl", "blobs/ab/ab" + "0" * 30, "manifests/000000000001-0123456789ab.json"]
)
def test_check_rel_accepts_the_formats_names(rel: str) -> None:
    assert check_rel(rel) == rel


def test_a_commit_line_names_only_its_own_manifest_and_parts() -> None:
    good = commit(7)
    assert commit_names(good, "j") == (7, cid(7), good["manifest"], HASH, None)
    multi = commit(7, world=3)
    step, ident, manifest, _, parts = commit_names(multi, "j")
    assert (step, ident, manifest) == (7, cid(7), multi["parts"][0][0])
    assert parts is not None and [p.manifest for p in parts] == [q[0] for q in multi["parts"]]
    other = commit(8)["manifest"]  # another checkpoint's manifest: would let prune delete it
    for field, value in [
        ("manifest", other),
        ("manifest", "/home/me/precious.json"),
        ("manifest", "manifests/../../x.json"),
        ("id", "../../x"),
        ("id", "ABCDEF012345"),
        ("step", -1),
        ("step", "7"),
        ("step", True),
        ("manifest_hash", "zz"),
        ("world_size", 2),
    ]:
        with pytest.raises(InvalidName, match=f"j: {field}"):
            commit_names({**good, field: value}, "j")
    bad_parts = commit(7, world=2)
    bad_parts["parts"][1][0] = "../../outside.json"
    with pytest.raises(InvalidName, match=r"parts\[1\] manifest '../../outside.json'"):
        commit_names(bad_parts, "j")


def test_an_invalid_commit_line_is_a_damaged_checkpoint_that_names_nothing() -> None:
    events = [{"event": "init", "store_id": "5" * 32}, commit(1), {**commit(2), "manifest": "/etc/passwd"}]
    problems: list[str] = []
    _, records, _ = fold(events, ["l1", "l2", "l3"], problems)
    sound, bad = records
    assert sound.invalid is None and sound.manifests() == [commit(1)["manifest"]]
    assert bad.step == 2 and bad.manifest == "" and bad.manifests() == [] and bad.parts is None
    assert (
        bad.invalid
        == f"l3: manifest '/etc/passwd' is not this checkpoint's manifest ({commit(2)['manifest']})"
    )
    assert problems == [bad.invalid]


def test_listing_grammars() -> None:
    assert is_manifest_file("000000000001-0123456789ab.json")
    assert is_manifest_file("000000000001-0123456789ab-r12.json")
    assert not is_manifest_file("README") and not is_manifest_file("000000000001-0123456789ab.json.tmp.1.2")
    assert is_temporary("ab" + "0" * 30 + ".tmp.123.4", "ab" + "0" * 30)
    assert not is_temporary("ab" + "0" * 30 + ".tmp.123.4", "cd" + "0" * 30)
    assert journal_object("000000000003-commit-0123456789ab.json") is not None
    for name in [
        "../000000000003-commit-0123456789ab.json",
        "000000000003-commit-x.json",
        "3-commit-0123456789ab.json",
    ]:
        assert journal_object(name) is None
    assert parse_marker("000000000004-0123456789ab-r1.json") == (4, "0123456789ab", 1)
    assert parse_marker("000000000004-0123456789ab-r01.json") is None
    with pytest.raises(InvalidName):
        blob_rel("../../x")


def test_local_storage_refuses_paths_and_symlinks_outside(tmp_path: Path) -> None:
    root, outside = tmp_path / "store", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "precious").write_text("keep")
    storage = LocalStorage(root)
    for rel in ["../outside/precious", str(outside / "precious"), "manifests/../../outside/precious"]:
        for call in (storage.read, storage.remove, lambda r: storage.write(r, b"x")):
            with pytest.raises(UnsafePathError):
                call(rel)
    (root / "blobs").symlink_to(outside)  # a folder of the store planted to point outside
    with pytest.raises(UnsafePathError, match="outside the store"):
        storage.write("blobs/precious", b"overwritten")
    with pytest.raises(UnsafePathError):
        storage.remove("blobs/precious")
    assert (outside / "precious").read_text() == "keep"
    inside = root / "inner"
    inside.mkdir()
    (root / "alias").symlink_to(inside)  # a symlink that stays inside is fine
    storage.write("alias/x", b"ok")
    assert (inside / "x").read_bytes() == b"ok"


def test_remotes_refuse_names_outside_their_prefix(tmp_path: Path) -> None:
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "m.json").write_text("keep")
    remote = open_remote(f"file://{tmp_path / 'bucket' / 'prefix'}")
    for rel in [
        "../../outside/m.json",
        "manifests/../../../outside/m.json",
        str(tmp_path / "outside" / "m.json"),
    ]:
        with pytest.raises(UnsafePathError):
            remote.read(rel)
        with pytest.raises(UnsafePathError):
            remote.write(rel, b"x")
        with pytest.raises(UnsafePathError):
            remote.remove(rel)
    os.makedirs(tmp_path / "bucket" / "prefix")
    (tmp_path / "bucket" / "prefix" / "journal").symlink_to(tmp_path / "outside")
    with pytest.raises(UnsafePathError):
        remote.write("journal/m.json", b"x")
    assert (tmp_path / "outside" / "m.json").read_text() == "keep"
    fs = ObjectStorage("memory://KEY:SE/CRET@bucket/prefix")
    assert fs.base == "bucket/prefix"  # the secret is not part of the object names
    with pytest.raises(UnsafePathError):
        fs.read("../other-prefix/x")
