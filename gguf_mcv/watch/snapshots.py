"""Snapshots: the frame (or the zone) of each event, as a JPEG in a folder bounded by count and
bytes, oldest first out.

Each file is written whole under a temporary name and renamed into place, so a reader never
sees half a picture. A folder that is full, read-only or gone costs the event its snapshot
(the event says why), never the watch. Only files this module names
(``snapshot-<time>-<frame>[-<zone>].jpg``) are counted and removed; anything else in the folder
is left alone.
"""

from __future__ import annotations

import io
import os
import re
import tempfile
from pathlib import Path

import numpy as np

from ..errors import ConfigError
from ..options import check_int

#: Files kept by default, and their bytes.
DEFAULT_MAX_FILES = 200
DEFAULT_MAX_BYTES = 200 * 2**20
#: JPEG quality of a snapshot.
QUALITY = 90

_OURS = re.compile(r"snapshot-\d{13}-\d{8}(?:-[A-Za-z0-9_-]{1,64})?\.jpg")
_ZONE = re.compile(r"[^A-Za-z0-9_-]+")


class SnapshotFolder:
    """A folder of event snapshots holding at most ``max_files`` files and ``max_bytes`` bytes."""

    def __init__(self, folder: str | os.PathLike, *, max_files: int = DEFAULT_MAX_FILES,
                 max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if not isinstance(folder, (str, os.PathLike)) or not str(folder).strip():
            raise ConfigError(f"snapshots must be a folder path, not {folder!r}.")
        self.folder = Path(folder).expanduser()
        if self.folder.exists() and not self.folder.is_dir():
            raise ConfigError(f"snapshots: {self.folder} is not a folder. Give a folder (it is made if missing).")
        self.max_files = check_int("snapshot_max_files", max_files, low=1, high=10**7)
        self.max_bytes = check_int("snapshot_max_bytes", max_bytes, low=1, high=2**50)

    def save(self, rgb: np.ndarray, *, time_s: float, frame: int,
             zone: str | None = None) -> tuple[str | None, str | None]:
        """Write ``rgb`` (HxWx3 uint8) as the snapshot of an event: (its path, None), or (None, why
        not) when the folder cannot take it. The oldest snapshots go to make room."""
        import PIL.Image  # lazy: only watches with snapshots

        # Encoded in memory first: Pillow writing straight to a file descriptor does not notice a
        # short write on a full disk, and leaves a cut picture without an error.
        encoded = io.BytesIO()
        PIL.Image.fromarray(rgb).save(encoded, format="JPEG", quality=QUALITY)
        suffix = f"-{_ZONE.sub('_', zone)[:64]}" if zone else ""
        name = f"snapshot-{int(time_s * 1000):013d}-{frame % 10**8:08d}{suffix}.jpg"
        tmp = None
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".snapshot-", suffix=".jpg.part", dir=self.folder)
            with os.fdopen(fd, "wb") as out:
                out.write(encoded.getbuffer())
            path = self.folder / name
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            return None, f"no snapshot: {self.folder} could not take it ({exc.strerror or exc})"
        finally:
            if tmp is not None:
                Path(tmp).unlink(missing_ok=True)
        self._prune(keep=path)
        return str(path), None

    def files(self) -> list[Path]:
        """The snapshots in the folder, oldest first."""
        try:
            return sorted(p for p in self.folder.iterdir() if _OURS.fullmatch(p.name) and p.is_file())
        except OSError:
            return []

    def _prune(self, keep: Path) -> None:
        kept = self.files()
        sizes = {}
        for p in kept:
            try:
                sizes[p] = p.stat().st_size
            except OSError:
                sizes[p] = 0
        total = sum(sizes.values())
        for p in list(kept):
            if len(kept) <= self.max_files and total <= self.max_bytes:
                break
            if p == keep:
                continue  # the newest stays, even alone over the bytes bound: its event names it
            try:
                p.unlink()
            except OSError:
                continue
            kept.remove(p)
            total -= sizes[p]
