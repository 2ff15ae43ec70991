"""The local Hub stand-in (tests/hubserver.py), exercised with the real huggingface_hub client.

Besides checking the fixture, these tests record how the installed client behaves on
dropped connections, errors and retries, which the library's own tests build on.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import time
import types
from pathlib import Path

import httpx2
import pytest
from huggingface_hub import (
    HfApi,
    constants,
    file_download,
    get_hf_file_metadata,
    hf_hub_download,
    hf_hub_url,
    list_repo_files,
    snapshot_download,
)
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

REPO = "acme/tiny-gguf"


def payload(n: int, seed: int = 0) -> bytes:
    """n reproducible pseudo-random bytes."""
    out = bytearray()
    while len(out) < n:
        out += hashlib.sha256(b"%d:%d" % (seed, len(out))).digest()
    return bytes(out[:n])


@pytest.fixture
def repo(hub):
    """A small repo: an LFS .gguf, a text file and a file in a subfolder."""
    files = {"model-Q4_K_M.gguf": payload(300_000), "README.md": "# tiny\n", "mmproj/mmproj-f16.gguf": payload(5000, 1)}
    hub.add_repo(REPO, files)
    return files


@pytest.fixture
def no_retry_sleep(monkeypatch):
    """The client sleeps 1 s before each resume of a broken download; tests need not wait."""
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=lambda s: None))


def cached_blobs(env) -> list[Path]:
    return sorted((env.cache / f"models--{REPO.replace('/', '--')}" / "blobs").iterdir())


# --- API ---------------------------------------------------------------------------------


def test_model_info_with_files_metadata(hub, repo):
    info = HfApi().model_info(REPO, revision="main", files_metadata=True)
    assert info.sha == hub.commit(REPO) and len(info.sha) == 40
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == set(repo)
    gguf = siblings["model-Q4_K_M.gguf"]
    assert gguf.size == 300_000
    assert gguf.lfs.sha256 == hashlib.sha256(repo["model-Q4_K_M.gguf"]).hexdigest()
    assert siblings["README.md"].size == 7 and siblings["README.md"].lfs is None
    plain = HfApi().model_info(REPO)  # without files_metadata: names only, like the Hub
    assert [s.size for s in plain.siblings] == [None] * 3


def test_list_repo_files_and_tree(hub, repo):
    assert sorted(list_repo_files(REPO)) == sorted(repo)
    top = {e.path: type(e).__name__ for e in HfApi().list_repo_tree(REPO)}
    assert top == {"README.md": "RepoFile", "model-Q4_K_M.gguf": "RepoFile", "mmproj": "RepoFolder"}
    sub = list(HfApi().list_repo_tree(REPO, path_in_repo="mmproj"))
    assert [e.path for e in sub] == ["mmproj/mmproj-f16.gguf"] and sub[0].lfs.size == 5000
    hub.tree_page_size = 2  # the client follows the Link: rel="next" pages
    hub.log.clear()
    assert sorted(list_repo_files(REPO)) == sorted(repo)
    assert hub.count("GET", "/api/models/*/tree/*") == 2
    info = HfApi().get_paths_info(REPO, ["README.md", "mmproj", "nope"])
    assert [e.path for e in info] == ["README.md", "mmproj"]


def test_unknown_repo_revision_and_file(hub, repo):
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info("acme/nope")
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("acme/nope", "x.gguf")
    with pytest.raises(RevisionNotFoundError):
        hf_hub_download(REPO, "README.md", revision="dev")
    with pytest.raises(EntryNotFoundError):  # RemoteEntryNotFoundError
        hf_hub_download(REPO, "nope.gguf")


# --- downloads ---------------------------------------------------------------------------


def test_download_into_cache_then_cached(hub, hf_env, repo):
    path = Path(hf_hub_download(REPO, "mmproj/mmproj-f16.gguf"))
    assert path.read_bytes() == repo["mmproj/mmproj-f16.gguf"]
    assert path.is_relative_to(hf_env.cache) and hub.commit(REPO) in path.parts
    # LFS files are cached under their sha256 (the ETag), other files under their git blob id
    assert cached_blobs(hf_env)[0].name == hashlib.sha256(repo["mmproj/mmproj-f16.gguf"]).hexdigest()
    assert [(r.method, r.status) for r in hub.log] == [("HEAD", 200), ("GET", 200)]
    hub.log.clear()
    assert hf_hub_download(REPO, "mmproj/mmproj-f16.gguf") == str(path)
    assert [r.method for r in hub.log] == ["HEAD"]  # revision "main" is re-checked, the body is not fetched


def test_offline_makes_no_requests(hub, hf_env, repo):
    path = hf_hub_download(REPO, "README.md")
    hub.log.clear()
    hf_env.set_offline()
    assert hf_hub_download(REPO, "README.md") == path
    assert hub.count() == 0


def test_file_metadata_and_no_xet(hub, repo):
    meta = get_hf_file_metadata(hf_hub_url(REPO, "model-Q4_K_M.gguf"))
    assert meta.etag == hashlib.sha256(repo["model-Q4_K_M.gguf"]).hexdigest()
    assert meta.size == 300_000 and meta.commit_hash == hub.commit(REPO)
    assert meta.xet_file_data is None  # so downloads use plain HTTP GET, never Xet
    readme = get_hf_file_metadata(hf_hub_url(REPO, "README.md"))
    assert readme.etag == hashlib.sha1(b"blob 7\0# tiny\n").hexdigest()


def test_snapshot_download(hub, repo):
    folder = Path(snapshot_download(REPO, allow_patterns=["*.gguf"]))
    assert sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()) == [
        "mmproj/mmproj-f16.gguf", "model-Q4_K_M.gguf"]
    assert hub.count("GET", "/api/models/*") == 2  # repo_info, then the tree of that commit


def test_new_commit_when_files_change(hub, repo):
    old = hub.commit(REPO)
    hub.add_repo(REPO, {"README.md": "# changed\n"})
    assert hub.commit(REPO) != old
    assert Path(hf_hub_download(REPO, "README.md")).read_text() == "# changed\n"
    assert Path(hf_hub_download(REPO, "README.md", revision=hub.commit(REPO))).read_text() == "# changed\n"
    with pytest.raises(RevisionNotFoundError):  # the stand-in keeps no history
        hf_hub_download(REPO, "README.md", revision=old)


def test_range_request(hub, repo):
    url = hf_hub_url(REPO, "model-Q4_K_M.gguf")
    data = repo["model-Q4_K_M.gguf"]
    r = httpx2.get(url, headers={"Range": "bytes=1000-1999"})
    assert r.status_code == 206 and r.content == data[1000:2000]
    assert r.headers["Content-Range"] == "bytes 1000-1999/300000" and r.headers["Content-Length"] == "1000"
    assert httpx2.get(url, headers={"Range": "bytes=299990-"}).content == data[299990:]
    assert httpx2.get(url, headers={"Range": "bytes=-10"}).content == data[-10:]
    r = httpx2.get(url, headers={"Range": "bytes=300000-"})
    assert r.status_code == 416 and r.headers["Content-Range"] == "bytes */300000"
    assert [r.range for r in hub.log][:1] == ["bytes=1000-1999"]


# --- faults: broken bodies ----------------------------------------------------------------


def test_drop_small_file_restarts_from_zero(hub, repo, no_retry_sleep):
    """Observed: the client keeps only whole DOWNLOAD_CHUNK_SIZE (10 MiB) chunks, so a file cut
    before its first chunk is complete is fetched again from byte 0, without a Range header."""
    hub.faults.drop(f"{REPO}/model-Q4_K_M.gguf", after_bytes=100_000)
    path = hf_hub_download(REPO, "model-Q4_K_M.gguf")
    assert Path(path).read_bytes() == repo["model-Q4_K_M.gguf"]
    gets = hub.requests("GET")
    assert [(g.dropped, g.bytes_sent, g.range) for g in gets] == [(True, 100_000, None), (False, 300_000, None)]


def test_drop_resumes_with_range(hub, repo, no_retry_sleep, monkeypatch):
    """Observed: after whole chunks arrived, the client retries with "Range: bytes=<kept>-" and
    appends the 206 body; the finished file is intact."""
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 64 * 1024)
    hub.faults.drop(f"{REPO}/model-Q4_K_M.gguf", after_bytes=200_000)
    path = hf_hub_download(REPO, "model-Q4_K_M.gguf")
    assert Path(path).read_bytes() == repo["model-Q4_K_M.gguf"]
    first, second = hub.requests("GET")
    assert first.dropped and first.bytes_sent == 200_000
    assert second.range == f"bytes={3 * 64 * 1024}-" and second.status == 206


def test_drop_every_time_gives_up(hub, hf_env, repo, no_retry_sleep):
    """Observed: 1 try + 5 resumes without progress, then the transport error propagates and no
    file (not even a partial one) is left in the cache."""
    hub.faults.drop(f"{REPO}/*.gguf", after_bytes=0, times=None)
    with pytest.raises(httpx2.RemoteProtocolError):
        hf_hub_download(REPO, "model-Q4_K_M.gguf")
    assert hub.count("GET") == 6
    assert cached_blobs(hf_env) == []


def test_corrupt_bytes_arrive_corrupted(hub, repo):
    """The client does not check the sha256 of plain HTTP downloads: verifying is the library's job."""
    hub.faults.corrupt(f"{REPO}/model-Q4_K_M.gguf", offset=12_345)
    got = Path(hf_hub_download(REPO, "model-Q4_K_M.gguf")).read_bytes()
    want = repo["model-Q4_K_M.gguf"]
    assert len(got) == len(want) and got[12_345] == want[12_345] ^ 0xFF
    assert got[:12_345] == want[:12_345] and got[12_346:] == want[12_346:]


def test_throttled_download_can_be_abandoned(hub, repo):
    hub.faults.throttle(REPO, bytes_per_s=100_000)
    t0 = time.monotonic()
    with httpx2.stream("GET", hf_hub_url(REPO, "model-Q4_K_M.gguf")) as r:
        first = next(r.iter_bytes(20_000))
    assert len(first) == 20_000 and time.monotonic() - t0 > 0.1
    (entry,) = hub.requests("GET")
    deadline = time.monotonic() + 5
    while not entry.finished and time.monotonic() < deadline:  # the server notices the hang-up
        time.sleep(0.05)
    assert entry.finished and entry.bytes_sent < 300_000


def test_killed_download_leaves_temp_file_and_rerun_succeeds(hub, hf_env, repo):
    """Observed: a killed process leaves blobs/<etag>.<random>.incomplete; the next run does not
    resume it but downloads afresh under a new temporary name."""
    hub.faults.throttle(f"{REPO}/*.gguf", bytes_per_s=200_000)
    script = f"from huggingface_hub import hf_hub_download; hf_hub_download({REPO!r}, 'model-Q4_K_M.gguf')"
    proc = subprocess.Popen([sys.executable, "-c", script], env=os.environ.copy())
    deadline = time.monotonic() + 20
    while not any(r.bytes_sent for r in hub.requests("GET")) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert [p.name.endswith(".incomplete") for p in cached_blobs(hf_env)] == [True]
    hub.faults.clear()
    path = Path(hf_hub_download(REPO, "model-Q4_K_M.gguf"))
    assert path.read_bytes() == repo["model-Q4_K_M.gguf"]
    assert hub.requests("GET")[-1].range is None
    assert sum(p.name.endswith(".incomplete") for p in cached_blobs(hf_env)) == 1  # the stale one stays


# --- faults: error answers ----------------------------------------------------------------


def test_not_found_faults(hub, repo):
    f = hub.faults.not_found(REPO)
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info(REPO)
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download(REPO, "README.md")
    hub.faults.remove(f)
    hub.faults.not_found(f"{REPO}/README.md")
    with pytest.raises(EntryNotFoundError):
        hf_hub_download(REPO, "README.md")
    assert hf_hub_download(REPO, "mmproj/mmproj-f16.gguf")  # other files are untouched


def test_private_repo_needs_token(hub, repo):
    hub.faults.unauthorized(REPO, token="hf_good")
    with pytest.raises(RepositoryNotFoundError) as e:  # no token: the Hub's 401 "repo not found"
        hf_hub_download(REPO, "README.md")
    assert e.value.response.status_code == 401
    with pytest.raises(RepositoryNotFoundError):
        HfApi().model_info(REPO)
    with pytest.raises(HfHubHTTPError) as e:  # wrong token: 401 invalid credentials
        hf_hub_download(REPO, "README.md", token="hf_bad")
    assert e.value.response.status_code == 401 and not isinstance(e.value, RepositoryNotFoundError)
    assert Path(hf_hub_download(REPO, "README.md", token="hf_good")).read_text() == "# tiny\n"
    assert hub.requests("GET")[-1].authorization == "Bearer hf_good"


def test_gated_repo(hub, repo):
    hub.faults.unauthorized(REPO, gated=True)
    with pytest.raises(GatedRepoError):
        hf_hub_download(REPO, "README.md")
    with pytest.raises(GatedRepoError):
        HfApi().model_info(REPO, token="hf_not_accepted")  # with a token: 403 GatedRepo


def test_server_error_then_recover(hub, repo):
    """Observed: a 5xx on the metadata HEAD makes hf_hub_download (nothing cached) ask again at once."""
    hub.faults.server_error(REPO, times=1)
    assert hf_hub_download(REPO, "README.md")
    assert [(r.method, r.status) for r in hub.log] == [("HEAD", 500), ("HEAD", 200), ("GET", 200)]
    hub.faults.server_error(REPO, times=1)
    with pytest.raises(HfHubHTTPError):  # model_info does not retry
        HfApi().model_info(REPO)
    hub.faults.server_error(f"{REPO}/*", times=None, method="GET")
    with pytest.raises(HfHubHTTPError):  # nor does the body GET, on 5xx
        hf_hub_download(REPO, "model-Q4_K_M.gguf")


# --- request log -------------------------------------------------------------------------


def test_request_log(hub, repo):
    hf_hub_download(REPO, "README.md")
    list_repo_files(REPO)
    assert hub.count() == 3
    assert hub.count("HEAD", hub.file_path(REPO, "README.md")) == 1
    assert hub.count("GET", f"/api/models/{REPO}/tree/*") == 1
    assert all(r.status == 200 and r.finished for r in hub.log)
    hub.log.clear()
    assert hub.count() == 0
