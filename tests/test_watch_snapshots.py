"""gguf_mcv.watch.snapshots: event pictures in a folder bounded by count and bytes, written whole;
a full or read-only folder costs the snapshot, never the watch."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.watch.snapshots import SnapshotFolder


def picture(seed: int, side: int = 64) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)


def test_a_snapshot_is_a_jpeg_that_decodes_and_names_its_time_frame_and_zone(tmp_path: Path) -> None:
    folder = SnapshotFolder(tmp_path / "made" / "here")
    path, warning = folder.save(picture(0), time_s=1_700_000_000.5, frame=42, zone="front door/left")
    assert warning is None and path is not None
    assert Path(path).name == "snapshot-1700000000500-00000042-front_door_left.jpg"
    with PIL.Image.open(path) as image:
        assert image.format == "JPEG" and image.size == (64, 64)
    assert not [p for p in Path(path).parent.iterdir() if p.name.startswith(".")]  # no temporary left


def test_the_oldest_go_first_beyond_the_count(tmp_path: Path) -> None:
    folder = SnapshotFolder(tmp_path, max_files=3)
    paths = [folder.save(picture(i), time_s=1000.0 + i, frame=i)[0] for i in range(5)]
    assert [p.name for p in folder.files()] == [Path(p).name for p in paths[2:]]  # type: ignore[arg-type]


def test_the_oldest_go_first_beyond_the_bytes_and_the_newest_always_stays(tmp_path: Path) -> None:
    one = len(Path(SnapshotFolder(tmp_path / "probe").save(picture(0, 128), time_s=1, frame=0)[0]).read_bytes())
    folder = SnapshotFolder(tmp_path / "f", max_bytes=int(one * 2.5))
    for i in range(6):
        folder.save(picture(i, 128), time_s=10.0 + i, frame=i)
    kept = folder.files()
    assert len(kept) == 2 and sum(p.stat().st_size for p in kept) <= one * 2.5 + 2048
    tiny = SnapshotFolder(tmp_path / "t", max_bytes=1)
    path, warning = tiny.save(picture(1), time_s=1, frame=1)
    assert warning is None and [str(p) for p in tiny.files()] == [path]  # alone over the bound, still kept


def test_other_files_in_the_folder_are_left_alone(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "snapshot-of-my-cat.jpg").write_bytes(b"x")
    folder = SnapshotFolder(tmp_path, max_files=1)
    for i in range(3):
        folder.save(picture(i), time_s=5.0 + i, frame=i)
    assert (tmp_path / "notes.txt").exists() and (tmp_path / "snapshot-of-my-cat.jpg").exists()
    assert len(folder.files()) == 1


def test_bad_folders_and_bounds_are_refused(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    for bad, match in ((tmp_path / "file", "not a folder"), ("", "folder path"), (3, "folder path")):
        with pytest.raises(ConfigError, match=match):
            SnapshotFolder(bad)  # type: ignore[arg-type]
    for kw in ({"max_files": 0}, {"max_bytes": 0}, {"max_files": True}, {"max_bytes": 2**60}):
        with pytest.raises(ConfigError):
            SnapshotFolder(tmp_path, **kw)  # type: ignore[arg-type]


@contextlib.contextmanager
def _tmpfs(tmp_path: Path, options: str, why: str) -> Iterator[Path]:
    """A tmpfs mounted with ``options`` under ``tmp_path``, unmounted after; the test skips
    (saying ``why``) where it cannot be mounted."""
    where = tmp_path / "mount"
    where.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)],
                                           capture_output=True).returncode != 0:
        pytest.skip(f"{why} needs root and mount(8)")
    try:
        yield where
    finally:
        subprocess.run(["umount", str(where)], check=False)


def test_a_full_folder_is_a_warning_and_leaves_no_partial_file(tmp_path: Path) -> None:
    with _tmpfs(tmp_path, "size=16k", "a full tmpfs") as where:
        folder = SnapshotFolder(where, max_bytes=10**9)
        results = [folder.save(picture(i, 256), time_s=100.0 + i, frame=i) for i in range(4)]
        warnings = [w for _, w in results if w]
        assert warnings and all("could not take it" in w for w in warnings)
        assert not [p for p in where.iterdir() if p.name.startswith(".snapshot-")]
        for p in folder.files():  # whatever was written is whole
            with PIL.Image.open(p) as image:
                image.load()


def test_a_read_only_folder_is_a_warning(tmp_path: Path) -> None:
    with _tmpfs(tmp_path, "size=1m,ro", "a read-only mount") as where:
        path, warning = SnapshotFolder(where).save(picture(0), time_s=1, frame=1)
        assert path is None and warning is not None and "could not take it" in warning
