"""Cache files read only as regular files, names confined to their folder, damage set aside (never
deleted), killed writers' temporary files swept under their lock, manifests tied to a digest."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_mcv import cache_files
from gguf_mcv.cache_files import DamagedManifest, NotRegularFile


def test_only_a_regular_file_is_opened_and_a_fifo_never_blocks(tmp_path: Path) -> None:
    (tmp_path / "file").write_bytes(b"data")
    os.mkfifo(tmp_path / "fifo")  # no writer: a blocking open would never return
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "file")
    with cache_files.open_regular(tmp_path / "file") as f:
        assert f.read() == b"data"
    for name in ("fifo", "folder"):
        with pytest.raises(NotRegularFile):
            cache_files.open_regular(tmp_path / name)
    with pytest.raises(OSError):  # ELOOP: a symlink is not followed
        cache_files.open_regular(tmp_path / "link")
    with cache_files.open_regular(tmp_path / "link", follow_symlinks=True) as f:
        assert f.read() == b"data"
    with pytest.raises(OSError, match="larger"):
        cache_files.read_regular(tmp_path / "file", 3)


@pytest.mark.parametrize("name", ["/etc/hostname", "../x", "a/../../x", "", "a\x00b", ".", "up/x"])
def test_names_outside_the_folder_are_refused(tmp_path: Path, name: str) -> None:
    folder = tmp_path / "cache"
    folder.mkdir()
    (folder / "up").symlink_to(tmp_path)  # a symlinked sub-folder leads out too
    assert cache_files.inside(folder, name) is None


def test_a_plain_name_is_inside(tmp_path: Path) -> None:
    assert cache_files.inside(tmp_path, "ab/cd/x.val") == tmp_path / "ab/cd/x.val"


def test_damage_is_set_aside_not_deleted(tmp_path: Path, caplog) -> None:
    (tmp_path / "cache.db").mkdir()
    (tmp_path / "cache.db" / "inside").write_text("kept")
    with caplog.at_level("WARNING"):
        aside = cache_files.set_aside(tmp_path / "cache.db", "a folder")
    assert aside is not None and (aside / "inside").read_text() == "kept" and not (tmp_path / "cache.db").exists()
    assert aside.name.startswith(".damaged-cache.db-") and len(caplog.records) == 1
    assert cache_files.set_aside(tmp_path / "missing", "gone") is None


def test_a_lock_path_that_is_a_symlink_never_truncates_its_target(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.write_text("someone else's")
    (tmp_path / "x.lock").symlink_to(victim)  # filelock opens its file with O_TRUNC
    with cache_files.folder_lock(tmp_path / "x.lock", timeout=1):
        pass
    assert victim.read_text() == "someone else's"


PATTERN = re.compile(r"\.(?P<stem>.+)-[a-z0-9_]{8}\.part")


def test_sweep_removes_killed_writers_files_and_leaves_the_rest(tmp_path: Path) -> None:
    from filelock import FileLock

    mine, dead, live = tmp_path / ".a-12345678.part", tmp_path / ".b-abcdefgh.part", tmp_path / ".c-zzzzzzzz.part"
    for p in (mine, dead, live):
        p.write_bytes(bytes(1000))
    kept = [tmp_path / "a.gguf", tmp_path / ".damaged-x-20260101-000000-1234.part"]
    for p in kept:
        p.write_text("kept")
    with FileLock(str(tmp_path / "c.lock")):  # c's writer is at work
        assert cache_files.sweep(tmp_path, PATTERN, "a") == 2000
    assert not mine.exists() and not dead.exists() and live.exists() and all(p.exists() for p in kept)


def test_a_manifest_is_trusted_only_with_its_digest(tmp_path: Path) -> None:
    path = tmp_path / "m.json"
    assert cache_files.read_manifest(path, 1) is None
    cache_files.write_manifest(path, {"version": 1, "size": 5})
    assert cache_files.read_manifest(path, 1) == {"version": 1, "size": 5, "digest": cache_files.digest_of(
        {"version": 1, "size": 5})}
    m = json.loads(path.read_text())
    m["size"] = 6
    path.write_text(json.dumps(m))
    with pytest.raises(DamagedManifest, match="digest"):
        cache_files.read_manifest(path, 1)
    path.write_text(json.dumps({"version": 0}))  # another release's: rebuilt, not damage
    assert cache_files.read_manifest(path, 1) is None
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".part")]


def _nested(depth: int, kind: str) -> str:
    if kind == "lists":
        return "[" * depth + "]" * depth
    if kind == "unclosed":
        return "[" * depth
    return '{"a":' * depth + "1" + "}" * depth


@pytest.mark.parametrize("kind", ["lists", "unclosed", "objects"])
def test_deeply_nested_json_is_damage_not_a_recursion_error(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(_nested(100_000, kind))  # 200 KB of [[[…]]]
    with pytest.raises(DamagedManifest):
        cache_files.read_manifest(path, 1)
    with pytest.raises(ValueError):
        cache_files.read_json(path, 1 << 20)


_GOOD = {"version": 1, "size": 5, "files": {"a.onnx": [10, "ab" * 32]}, "written": 1.5}
#: Values JSON can carry that a manifest's fields never hold: the wrong type, out of range, not finite.
_WRONG = ["NaN", "Infinity", "-Infinity", "1e999", "-1e400", "9" * 5000, '"text"', "[]", "{}", "null", "true",
          "false", "-0", "1.5e308", _nested(5000, "lists")]


def _damaged() -> st.SearchStrategy[bytes]:
    good = (json.dumps({**_GOOD, "digest": cache_files.digest_of(_GOOD)}, indent=1)).encode()
    truncated = st.integers(0, len(good) - 1).map(lambda n: good[:n])
    nested = st.builds(_nested, st.integers(1, 150_000), st.sampled_from(["lists", "unclosed", "objects"]))
    # one field (the digest and the version included) given a value of the wrong kind, digest unchanged
    wrong = st.builds(lambda key, value: _with(good, key, value), st.sampled_from([*_GOOD, "digest"]),
                      st.sampled_from(_WRONG))
    noise = st.binary(max_size=2000)
    flipped = st.tuples(st.integers(0, len(good) - 1), st.integers(1, 255)).map(
        lambda t: good[:t[0]] + bytes([good[t[0]] ^ t[1]]) + good[t[0] + 1:])
    return st.one_of(truncated, nested.map(str.encode), wrong, noise, flipped)


def _with(good: bytes, key: str, value: str) -> bytes:
    """``good`` with the value of its top-level ``key`` written as ``value`` (JSON text)."""
    data = json.loads(good)
    data[key] = "\x00placeholder"
    return json.dumps(data, indent=1).replace('"\\u0000placeholder"', value).encode()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=_damaged())
def test_any_damaged_manifest_is_refused_as_damaged_and_nothing_else(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "m.json"
    path.write_bytes(content)
    try:
        found = cache_files.read_manifest(path, 1)
    except DamagedManifest:
        return
    if found is None:  # a byte flip on the version makes it another release's: rebuilt, not damage
        assert json.loads(content)["version"] != 1
    else:  # a flip in the indentation changes no value
        assert found == {**_GOOD, "digest": cache_files.digest_of(_GOOD)}


def test_a_deeply_nested_onnx_manifest_is_converted_again(tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    from gguf_mcv.models.identity import file_identity
    from gguf_mcv.vision import onnx_vision

    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path))
    identity = file_identity(tiny.mmproj)
    first = onnx_vision.prepare(tiny.mmproj, identity, validate_int8=False)
    (manifest,) = first.fp32.parent.glob("*.json")
    manifest.write_text(_nested(100_000, "lists"))
    assert onnx_vision.known_int8_cosine(identity) is None
    with caplog.at_level("WARNING"):
        again = onnx_vision.prepare(tiny.mmproj, identity, validate_int8=False)
    assert again.convert_s > 0 and len([r for r in caplog.records if "unusable" in r.getMessage()]) == 1
    assert cache_files.read_manifest(manifest, onnx_vision.MANIFEST_VERSION) is not None  # a good one in its place
