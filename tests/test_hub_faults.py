"""Download faults end to end through pull(): afterwards the cache holds only whole, verified files."""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gguf_mcv
from gguf_mcv.errors import NotEnoughDiskError
from gguf_mcv.models import hub as hubmod

REPO = "acme/flaky-gguf"
PULL = "import sys, gguf_mcv; print(gguf_mcv.pull(sys.argv[1], quant=sys.argv[2]).model)"


def publish(hub, tiny) -> None:
    hub.add_repo(REPO, {f"ggml-model-{q}.gguf": p for q, p in tiny.quants.items()}
                 | {"mmproj-model-f16.gguf": tiny.mmproj})


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def assert_cache_clean(cache: Path) -> None:
    """Only whole files: no partial downloads, and every blob named by its sha256 matches it."""
    assert not list(cache.rglob("*.incomplete"))
    for blob in cache.rglob("blobs/*"):
        if len(blob.name) == 64:
            assert sha(blob) == blob.name, blob


def test_killed_download_then_rerun(hub, hf_env, tiny) -> None:
    publish(hub, tiny)
    hub.faults.throttle(f"{REPO}/ggml-model-Q8_0.gguf", bytes_per_s=200_000)
    child = subprocess.Popen([sys.executable, "-c", PULL, REPO, "Q8_0"], env=os.environ)
    deadline = time.time() + 60
    while time.time() < deadline and child.poll() is None:
        if list(hf_env.cache.rglob("*.incomplete")):
            time.sleep(1.5)  # ~300 KB of the ~2 MB file are on their way: kill it mid-file
            break
        time.sleep(0.05)
    else:
        child.kill()
        pytest.fail("the download never started")
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=10)
    assert list(hf_env.cache.rglob("*.incomplete"))  # the kill left a partial file behind
    hub.faults.clear()
    files = gguf_mcv.pull(REPO, quant="Q8_0")
    assert sha(files.model) == sha(Path(tiny.quants["Q8_0"]))
    assert_cache_clean(hf_env.cache)


def test_server_errors_then_recovery(hub, hf_env, tiny, monkeypatch) -> None:
    import types

    from huggingface_hub.utils import _http

    monkeypatch.setattr(hubmod, "RETRY_DELAYS", (0.05, 0.05))
    # huggingface_hub's own back-off (1 s, 2 s, 4 s...) would make this test slow
    monkeypatch.setattr(_http, "time", types.SimpleNamespace(**{**vars(time), "sleep": lambda s: None}))
    publish(hub, tiny)
    hub.faults.server_error(REPO, times=2, status=503)
    files = gguf_mcv.pull(REPO, quant="Q4_0")  # retried past two 503s
    assert sha(files.model) == sha(Path(tiny.quants["Q4_0"]))
    hub.faults.server_error(f"{REPO}/ggml-model-Q5_K_M.gguf", times=None, status=500)
    with pytest.raises(gguf_mcv.DownloadError, match="500"):
        gguf_mcv.pull(REPO, quant="Q5_K_M")
    hub.faults.clear()
    assert gguf_mcv.pull(REPO, quant="Q5_K_M").model.is_file()
    assert_cache_clean(hf_env.cache)


def test_disk_fills_mid_file_simulated_at_the_write(hub, hf_env, tiny, monkeypatch) -> None:
    from huggingface_hub import file_download

    publish(hub, tiny)
    real_get = file_download.http_get

    class FullDisk:
        def __init__(self, f, room: int) -> None:
            self.f, self.room = f, room

        def write(self, data: bytes) -> int:
            if len(data) > self.room:
                raise OSError(errno.ENOSPC, "No space left on device")
            self.room -= len(data)
            return self.f.write(data)

        def __getattr__(self, name: str):
            return getattr(self.f, name)

    def http_get(url, temp_file, **kw):
        return real_get(url, FullDisk(temp_file, 500_000), **kw)

    monkeypatch.setattr(file_download, "http_get", http_get)
    with pytest.raises(NotEnoughDiskError, match="partial file was removed"):
        gguf_mcv.pull(REPO, quant="Q8_0")
    assert_cache_clean(hf_env.cache)
    assert not list(hf_env.cache.rglob("ggml-model-Q8_0.gguf"))
    monkeypatch.setattr(file_download, "http_get", real_get)
    assert gguf_mcv.pull(REPO, quant="Q8_0").model.is_file()


def test_disk_fills_mid_file_on_a_real_small_tmpfs(hub, hf_env, tiny, tmp_path, monkeypatch) -> None:
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1500k", "tmpfs", str(mount)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {done.stderr.strip()}")
    try:
        import huggingface_hub.constants as hfc

        monkeypatch.setattr(hfc, "HF_HUB_CACHE", str(mount / "hub"))
        monkeypatch.setattr(hubmod, "DISK_MARGIN", 0)  # let the check pass: the file itself fits...
        publish(hub, tiny)
        # ...but the mmproj does not fit beside it, so the disk fills mid-file
        with pytest.raises(NotEnoughDiskError):
            gguf_mcv.pull(REPO, quant="Q4_K_M")
        assert_cache_clean(mount / "hub")
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_two_processes_pull_the_same_file_at_once(hub, hf_env, tiny) -> None:
    publish(hub, tiny)
    hub.faults.throttle(f"{REPO}/ggml-model-Q6_K.gguf", bytes_per_s=1_000_000)
    children = [subprocess.Popen([sys.executable, "-c", PULL, REPO, "Q6_K"], env=os.environ,
                                 stdout=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [c.communicate(timeout=120)[0].strip() for c in children]
    assert [c.returncode for c in children] == [0, 0]
    assert outs[0] == outs[1] and sha(Path(outs[0])) == sha(Path(tiny.quants["Q6_K"]))
    assert_cache_clean(hf_env.cache)
