"""List a repository's GGUF files on the Hugging Face Hub and fetch them, verified, into the HF cache.

This is the fetching layer: it knows repositories, files and quants, not model names
or memory (:mod:`gguf_mcv.resolver` turns a name into a planned quant and calls it).

All Hub I/O and the cache layout belong to ``huggingface_hub``: files land in the
standard cache (``HF_HUB_CACHE`` / ``HF_HOME``), so a file another tool fetched is
not fetched again, and ``HF_TOKEN`` / ``HF_HUB_OFFLINE`` are honoured. On top of
it this module adds what small machines on flaky links need: the repo's ``.gguf``
files classified by quant (any naming scheme), the matching mmproj, a free-disk
check before anything is written, a sha256 check of every ``.gguf`` against the
Hub's LFS hash (a bad file is deleted, never taken for a good one; a good one's digest
is remembered as its identity, :mod:`gguf_mcv.models.identity`, so it is never hashed again), clean-up of
partial files a killed download left behind, and errors that say what to do.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import logging
import re
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from ..errors import (
    CorruptModelError,
    DownloadError,
    HubAuthError,
    ModelNotFoundError,
    NotEnoughDiskError,
    OfflineError,
)
from ..units import format_size
from . import identity
from .headers import TextHeader, parse_header, text_header
from .quants import GgufFileInfo, classify_gguf, normalize_quant, quality_rank

logger = logging.getLogger(__name__)

#: free space kept beyond the files themselves when checking the disk
DISK_MARGIN = 64 * 2**20
#: pauses (s) before retrying a listing the Hub answered with a 5xx error (downloads are
#: retried by huggingface_hub itself)
RETRY_DELAYS = (1.0, 3.0)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_MMPROJ_PREFERENCE = ("F16", "BF16", "F32", "Q8_0")


@dataclass(frozen=True)
class RemoteFile:
    """A ``.gguf`` file of a repository: its path, size and LFS sha256 when known."""

    path: str
    size: int | None
    sha256: str | None
    info: GgufFileInfo

    @property
    def folder(self) -> str:
        return self.path.rpartition("/")[0]


@dataclass(frozen=True)
class RepoFiles:
    """The ``.gguf`` files of one revision of a repository, text models and projectors."""

    repo: str
    revision: str  #: the commit
    files: tuple[RemoteFile, ...]
    from_cache: bool = False
    requested: str = "main"  #: the branch, tag or commit asked for

    def text_models(self) -> dict[str, list[RemoteFile]]:
        """Whole (unsharded) text-model files by quant, best quality first."""
        by_quant: dict[str, list[RemoteFile]] = {}
        for f in self.files:
            if not f.info.is_mmproj and f.info.quant and not f.info.is_sharded:
                by_quant.setdefault(f.info.quant, []).append(f)
        return dict(sorted(by_quant.items(), key=lambda kv: -quality_rank(kv[0])))

    def projectors(self) -> list[RemoteFile]:
        return [f for f in self.files if f.info.is_mmproj]

    def model_file(self, quant: str, preferred_name: str | None = None) -> RemoteFile:
        """The text model of ``quant`` (the catalog's file name first, then the shallowest)."""
        q = normalize_quant(quant)
        candidates = self.text_models().get(q)
        if not candidates:
            have = ", ".join(self.text_models()) or "none"
            if self.from_cache:
                raise OfflineError(
                    f"Offline, and no {q} model file of {self.repo} is in the local cache (cached: "
                    f"{have}). Connect once and run `gguf-mcv pull {self.repo} --quant {q}`."
                )
            raise ModelNotFoundError(f"{self.repo} has no {q} model file (quants available: {have}).")
        named = [f for f in candidates if preferred_name and f.info.filename == preferred_name]
        return (named or sorted(candidates, key=lambda f: (f.path.count("/"), f.path)))[0]

    def mmproj_for(self, model: RemoteFile) -> RemoteFile:
        """The projector for ``model``: same folder first, then the repo root, F16 preferred."""
        projectors = self.projectors()
        if not projectors and self.from_cache:
            raise OfflineError(
                f"Offline, and no mmproj (vision projector) of {self.repo} is in the local cache. "
                f"Connect once and run `gguf-mcv pull {self.repo}`."
            )
        if not projectors:
            raise ModelNotFoundError(
                f"{self.repo} has no mmproj (vision projector) file: gguf_mcv needs one next to "
                "the model. Pass model_path= and mmproj_path= to use local files."
            )

        def preference(f: RemoteFile) -> tuple[int, int, str]:
            place = 0 if f.folder == model.folder else (1 if f.folder == "" else 2)
            kind = _MMPROJ_PREFERENCE.index(f.info.quant) if f.info.quant in _MMPROJ_PREFERENCE else 9
            return place, kind, f.path

        return min(projectors, key=preference)


def list_files(repo: str, revision: str | None = None) -> RepoFiles:
    """The repo's ``.gguf`` files, from the Hub; from the local cache when offline or unreachable."""
    if _offline():
        return cached_files(repo, revision)
    from huggingface_hub import HfApi  # lazy: ~0.3 s to import

    try:
        info = _retrying(lambda: HfApi().model_info(repo, revision=revision, files_metadata=True),
                         repo)
    except OfflineError as exc:
        logger.warning("%s; using the local cache", exc)
        return cached_files(repo, revision)
    files = []
    for sibling in info.siblings or []:
        kind = classify_gguf(sibling.rfilename)
        if kind is None:
            continue
        lfs = sibling.lfs
        sha = getattr(lfs, "sha256", None) if lfs is not None else None
        size = getattr(lfs, "size", None) if lfs is not None else sibling.size
        files.append(RemoteFile(sibling.rfilename, size if size is not None else sibling.size, sha, kind))
    return RepoFiles(repo, info.sha or (revision or "main"), tuple(files), requested=revision or "main")


def cached_files(repo: str, revision: str | None = None) -> RepoFiles:
    """The repo's ``.gguf`` files already complete in the local HF cache (no network)."""
    from huggingface_hub import scan_cache_dir  # lazy: ~0.3 s to import
    from huggingface_hub.errors import CacheNotFound  # lazy: ~0.3 s to import

    try:
        cache = scan_cache_dir(_hf_cache())
    except CacheNotFound:
        cache = None
    repos = [r for r in (cache.repos if cache else ()) if r.repo_id.lower() == repo.lower()
             and r.repo_type == "model"]
    wanted = revision or "main"
    for cached in repos:
        for rev in cached.revisions:
            if wanted in rev.refs or rev.commit_hash.startswith(wanted):
                files = []
                for f in rev.files:
                    rel = f.file_path.relative_to(rev.snapshot_path).as_posix()
                    kind = classify_gguf(rel)
                    if kind is not None:
                        sha = f.blob_path.name if _SHA256.match(f.blob_path.name) else None
                        files.append(RemoteFile(rel, f.size_on_disk, sha, kind))
                return RepoFiles(cached.repo_id, rev.commit_hash, tuple(files), from_cache=True,
                                 requested=wanted)
    raise OfflineError(
        f"The Hub is offline or unreachable and {repo} (revision {wanted}) is not in the local "
        f"cache {_hf_cache()}. Connect once and run `gguf-mcv pull {repo}` to fetch it."
    )


def cached_models() -> dict[str, list[tuple[str, int]]]:
    """``.gguf`` files in the local HF cache, by repo id: (path in repo, bytes on disk)."""
    from huggingface_hub import scan_cache_dir  # lazy: ~0.3 s to import
    from huggingface_hub.errors import CacheNotFound  # lazy: ~0.3 s to import

    try:
        cache = scan_cache_dir(_hf_cache())
    except CacheNotFound:
        return {}
    found: dict[str, list[tuple[str, int]]] = {}
    for repo in cache.repos:
        if repo.repo_type != "model":
            continue
        files = {(f.file_path.relative_to(rev.snapshot_path).as_posix(), f.size_on_disk)
                 for rev in repo.revisions for f in rev.files if f.file_name.endswith(".gguf")}
        if files:
            found[repo.repo_id] = sorted(files)
    return found


def fetch(listing: RepoFiles, files: list[RemoteFile], *, progress: bool | None = None) -> list[Path]:
    """Download ``files`` of ``listing`` (or find them in the cache), verified; their local paths."""
    from huggingface_hub import try_to_load_from_cache  # lazy: ~0.3 s to import

    cached = {f.path: try_to_load_from_cache(listing.repo, f.path, revision=listing.revision,
                                             cache_dir=_hf_cache()) for f in files}
    missing = [f for f in files if not isinstance(cached[f.path], str)]
    if missing and listing.from_cache:
        raise OfflineError(_missing_offline(listing, missing))
    _check_disk(missing)
    paths = []
    for f in files:
        local = cached[f.path]
        path = Path(local) if isinstance(local, str) else _download(listing, f, progress)
        _verify(path, f, fresh=not isinstance(local, str))
        paths.append(path)
    return paths


def _download(listing: RepoFiles, f: RemoteFile, progress: bool | None) -> Path:
    from huggingface_hub import hf_hub_download  # lazy: ~0.3 s to import

    if f.sha256:
        _remove_stale_partials(listing.repo, f.sha256)
    show = sys.stderr.isatty() if progress is None else progress
    try:
        # huggingface_hub retries transport errors and 5xx answers itself. The requested
        # revision (not the commit) makes the cache record the branch for offline use.
        with hub_errors(listing.repo, f.path):
            return Path(hf_hub_download(
                listing.repo, f.path, revision=listing.requested, cache_dir=_hf_cache(),
                tqdm_class=None if show else _silent_tqdm(),
            ))
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise NotEnoughDiskError(
                f"The disk filled up while downloading {f.path} ({format_size(f.size)}) into "
                f"{_hf_cache()}; the partial file was removed. Free some space and try again."
            ) from exc
        raise


def _verify(path: Path, f: RemoteFile, *, fresh: bool) -> None:
    """Check size and sha256 (once per file version); delete the file and raise on mismatch."""
    real = path.resolve()
    size = real.stat().st_size
    if f.size is not None and size != f.size:
        problem = f"has {size} bytes, expected {f.size}"
    elif f.sha256 is None or identity.known(real) == f.sha256:
        return
    else:
        digest = _sha256(real)
        if digest == f.sha256:
            identity.remember(real, f.sha256)  # its identity from now on: never hashed again
            return
        problem = f"has sha256 {digest[:12]}…, expected {f.sha256[:12]}…"
    real.unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    raise DownloadError(
        f"{f.path} from {_repo_of(path)} {problem}: the file was damaged "
        f"{'in transit' if fresh else 'in the cache'} and has been deleted. Run the same command "
        "again to fetch it anew."
    )


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(8 * 2**20), b""):
            h.update(block)
    return h.hexdigest()


def _remove_stale_partials(repo: str, sha: str) -> None:
    """Delete partial downloads of this blob that a killed process left behind.

    huggingface_hub writes each download to a process-unique ``<etag>.<id>.incomplete``
    and deletes it on failure, but a SIGKILL leaves it. When we can take the blob's
    download lock nobody is writing it, so every such file is stale.
    """
    from filelock import FileLock, Timeout  # lazy: ~0.3 s to import
    from huggingface_hub.file_download import repo_folder_name  # lazy: ~0.3 s to import

    folder = repo_folder_name(repo_id=repo, repo_type="model")
    blobs = Path(_hf_cache()) / folder / "blobs"
    partials = list(blobs.glob(f"{sha}*.incomplete"))
    if not partials:
        return
    lock = Path(_hf_cache()) / ".locks" / folder / f"{sha}.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    try:
        with FileLock(str(lock), timeout=0):
            for p in partials:
                p.unlink(missing_ok=True)
    except Timeout:
        pass  # another process is downloading it right now; its lock makes us wait later


def _check_disk(missing: list[RemoteFile]) -> None:
    needed = sum(f.size or 0 for f in missing)
    if not needed:
        return
    where = Path(_hf_cache())
    while not where.exists() and where != where.parent:
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < needed + DISK_MARGIN:
        names = ", ".join(f.path for f in missing)
        raise NotEnoughDiskError(
            f"Downloading {names} needs {format_size(needed)} (+{format_size(DISK_MARGIN)} margin) but only "
            f"{format_size(free)} is free in {where}. Free some space, choose a smaller quant, or point "
            "HF_HUB_CACHE at a bigger disk."
        )


class _ServerError(DownloadError):
    """A 5xx answer: the Hub (or a proxy) failed, and trying again may work."""


def _retrying(call, repo: str, filename: str | None = None):
    """``call()`` with Hub errors translated, retried after :data:`RETRY_DELAYS` on 5xx answers."""
    for delay in (*RETRY_DELAYS, None):
        try:
            with hub_errors(repo, filename):
                return call()
        except _ServerError as exc:
            if delay is None:
                raise
            logger.warning("%s; retrying in %.0f s", exc, delay)
            time.sleep(delay)


@contextlib.contextmanager
def hub_errors(repo: str, filename: str | None = None) -> Iterator[None]:
    """Turn huggingface_hub's exceptions into gguf_mcv errors that say what to do."""
    from huggingface_hub import errors as hf  # lazy: ~0.3 s to import

    what = f"{filename} in {repo}" if filename else repo
    try:
        yield
    except hf.GatedRepoError as exc:
        raise HubAuthError(
            f"{repo} is gated: accept its terms at https://huggingface.co/{repo} and set HF_TOKEN "
            "to a token of that account."
        ) from exc
    except hf.RepositoryNotFoundError as exc:
        raise ModelNotFoundError(
            f"No model repository {repo!r} on the Hub (or it is private: set HF_TOKEN). Check the "
            "name; `gguf-mcv models` lists the catalog."
        ) from exc
    except hf.RevisionNotFoundError as exc:
        raise ModelNotFoundError(f"{repo} has no revision like that: {exc}") from exc
    except hf.LocalEntryNotFoundError as exc:
        # the Hub could not be asked (after huggingface_hub's own retries) and no copy is cached
        cause = exc.__cause__ or exc.__context__
        status = getattr(getattr(cause, "response", None), "status_code", None)
        if status is not None and status >= 500:
            raise _ServerError(f"The Hub answered {status} for {what}; try again later.") from exc
        raise OfflineError(
            f"Could not reach the Hub for {what}, and it is not in the local cache. Check the "
            "network and run the same command again."
        ) from exc
    except hf.EntryNotFoundError as exc:
        raise ModelNotFoundError(f"{what} does not exist on the Hub.") from exc
    except hf.OfflineModeIsEnabled as exc:
        raise OfflineError(f"HF_HUB_OFFLINE is set and {what} is not in the local cache.") from exc
    except hf.HfHubHTTPError as exc:
        status = exc.response.status_code if exc.response is not None else None
        if status in (401, 403):
            raise HubAuthError(
                f"The Hub refused access to {repo} ({status}): set HF_TOKEN to a valid token "
                "with access to it."
            ) from exc
        kind = _ServerError if status is not None and status >= 500 else DownloadError
        raise kind(f"The Hub answered {status} for {what}; try again later. ({exc})") from exc
    except hf.HTTPError as exc:  # transport errors: no connection, timeouts, dropped streams
        raise OfflineError(
            f"The connection to the Hub failed for {what} ({type(exc).__name__}: {exc}). Check the "
            "network and run the same command again; files already complete are kept."
        ) from exc


#: first bytes fetched to read a remote header, and the most ever fetched for one
HEADER_FIRST_BYTES = 256 * 1024
HEADER_MAX_BYTES = 8 * 2**20


def remote_text_header(listing: RepoFiles, f: RemoteFile) -> TextHeader:
    """The header of a text model on the Hub, from ranged reads of its first bytes.

    Enough to plan memory for a repo the catalog does not know: the architecture keys
    come first in a GGUF file, so a few hundred KB suffice; more is fetched (doubling,
    up to :data:`HEADER_MAX_BYTES`) only when they are not there yet.
    """
    from huggingface_hub import get_session, hf_hub_url  # lazy: ~0.3 s to import
    from huggingface_hub.utils import build_hf_headers, hf_raise_for_status  # lazy: ~0.3 s to import

    url = hf_hub_url(listing.repo, f.path, revision=listing.revision)
    want = HEADER_FIRST_BYTES
    while True:
        with hub_errors(listing.repo, f.path):
            resp = get_session().get(url, headers={**build_hf_headers(), "Range": f"bytes=0-{want - 1}"},
                                     follow_redirects=True)
            hf_raise_for_status(resp)
        data = resp.content
        fields, _ = parse_header(io.BytesIO(data), tensors=False, partial=True)
        arch = fields.get("general.architecture")
        complete = isinstance(arch, str) and f"{arch}.block_count" in fields and (
            f"{arch}.attention.head_count_kv" in fields or "tokenizer.ggml.tokens" in fields)
        if complete or len(data) < want or want >= HEADER_MAX_BYTES:
            try:
                return text_header(fields, {}, f"{listing.repo}/{f.path}", f.size or 0)
            except CorruptModelError as exc:
                raise CorruptModelError(f"Could not read the header of {f.path} in {listing.repo}: {exc}") from exc
        want *= 2


def _missing_offline(listing: RepoFiles, missing: list[RemoteFile]) -> str:
    names = ", ".join(f.path for f in missing)
    return (
        f"Offline, and {names} of {listing.repo} are not in the local cache {_hf_cache()}. "
        f"Connect once and run `gguf-mcv pull {listing.repo}` with the same quant to fetch them."
    )


def _offline() -> bool:
    from huggingface_hub import constants as hfc  # lazy: ~0.3 s to import

    return bool(hfc.HF_HUB_OFFLINE)


def _hf_cache() -> str:
    from huggingface_hub import constants as hfc  # lazy: ~0.3 s to import

    return str(hfc.HF_HUB_CACHE)


def _silent_tqdm():
    from huggingface_hub.utils import tqdm as hf_tqdm  # lazy: ~0.3 s to import

    class Silent(hf_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs["disable"] = True
            super().__init__(*args, **kwargs)

    return Silent


def _repo_of(path: Path) -> str:
    for part in path.parts:
        if part.startswith("models--"):
            return part[len("models--"):].replace("--", "/")
    return str(path.parent)


