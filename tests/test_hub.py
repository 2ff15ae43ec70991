"""Hub resolution and downloads through the real huggingface_hub client and the local stand-in."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

import gguf_mcv
from gguf_mcv.errors import (
    DownloadError,
    HubAuthError,
    ModelNotFoundError,
    NotEnoughDiskError,
    OfflineError,
)
from gguf_mcv.models import hub as hubmod

REPO = "acme/minicpm-tiny-gguf"


def publish(hub, tiny, repo: str = REPO, names: dict[str, str] | None = None) -> None:
    """Serve the tiny ladder as ``repo``; ``names`` maps quant (or 'mmproj') to a path in the repo."""
    names = names or {}
    files = {names.get(q, f"ggml-model-{q}.gguf"): path for q, path in tiny.quants.items()}
    files[names.get("mmproj", "mmproj-model-f16.gguf")] = tiny.mmproj
    hub.add_repo(repo, files)


def test_load_from_hub_and_answer(hub, tiny) -> None:
    publish(hub, tiny)
    with gguf_mcv.load(REPO, quant="Q4_K_M", n_ctx=1024) as model:
        reply = model.ask("What is it?", np.zeros((64, 64, 3), dtype=np.uint8), max_tokens=3)
        assert reply.usage.image_tokens == 64
        assert model.info.repo == REPO and model.info.quant == "Q4_K_M"
        assert Path(model.info.model_path).name == "ggml-model-Q4_K_M.gguf"
    gets = hub.requests(method="GET", path="*/resolve/*")
    assert sorted(Path(r.path).name for r in gets) == ["ggml-model-Q4_K_M.gguf", "mmproj-model-f16.gguf"]


def test_files_land_in_the_hf_cache_and_are_not_fetched_twice(hub, hf_env, tiny) -> None:
    publish(hub, tiny)
    first = gguf_mcv.pull(REPO, quant="Q2_K")
    assert str(first.model).startswith(str(hf_env.cache))
    hub.log.clear()
    second = gguf_mcv.pull(REPO, quant="Q2_K")
    assert second.model == first.model
    assert hub.count(method="GET", path="*/resolve/*") == 0


@pytest.mark.parametrize("names", [
    {"Q4_K_M": "Model-7.6B-Q4_K_M.gguf", "mmproj": "mmproj-model-f16.gguf"},
    {"Q4_K_M": "MiniCPM-V-4_5-Q4_K_M.gguf", "mmproj": "mmproj-MiniCPM-V-4.6-F16.gguf"},
    {"Q4_K_M": "minicpm-v-2_6-q4_k_m.gguf", "mmproj": "MMPROJ-model-F16.gguf"},
    {"Q4_K_M": "sub/folder/ggml-model-Q4_K_M.gguf", "mmproj": "sub/folder/mmproj-model-f16.gguf"},
])
def test_naming_schemes_resolve(hub, tiny, names: dict[str, str]) -> None:
    publish(hub, tiny, names=names)
    files = gguf_mcv.pull(REPO, quant="q4_k_m")
    assert files.model.name == Path(names["Q4_K_M"]).name
    assert files.mmproj.name == Path(names["mmproj"]).name


def test_mmproj_in_the_same_folder_wins(hub, tiny) -> None:
    hub.add_repo(REPO, {
        "a/ggml-model-Q4_K_M.gguf": tiny.quants["Q4_K_M"],
        "a/mmproj-model-f16.gguf": tiny.mmproj,
        "b/ggml-model-Q8_0.gguf": tiny.quants["Q8_0"],
        "b/mmproj-model-f16.gguf": tiny.mmproj,
    })
    listing = hubmod.list_files(REPO)
    model = listing.model_file("Q8_0")
    assert listing.mmproj_for(model).path == "b/mmproj-model-f16.gguf"


def test_unknown_quant_lists_what_exists(hub, tiny) -> None:
    publish(hub, tiny)
    with pytest.raises(ModelNotFoundError, match="no Q5_0 .*Q8_0"):
        gguf_mcv.pull(REPO, quant="Q5_0")


def test_missing_repo_says_so(hub) -> None:
    with pytest.raises(ModelNotFoundError, match="No model repository 'acme/nothing'"):
        gguf_mcv.pull("acme/nothing", quant="Q4_K_M")


def test_unauthorized_repo_asks_for_a_token(hub, tiny) -> None:
    publish(hub, tiny)
    hub.faults.unauthorized(REPO, token="hf_right", gated=True)
    with pytest.raises(HubAuthError, match="HF_TOKEN"):
        gguf_mcv.pull(REPO, quant="Q4_K_M")


def test_corrupted_bytes_are_caught_removed_and_refetched(hub, hf_env, tiny) -> None:
    publish(hub, tiny)
    fault = hub.faults.corrupt(f"{REPO}/ggml-model-Q4_K_M.gguf", offset=5000)
    with pytest.raises(DownloadError, match="deleted"):
        gguf_mcv.pull(REPO, quant="Q4_K_M")
    assert not list(hf_env.cache.rglob("ggml-model-Q4_K_M.gguf"))
    hub.faults.remove(fault)
    files = gguf_mcv.pull(REPO, quant="Q4_K_M")
    assert files.model.read_bytes() == Path(tiny.quants["Q4_K_M"]).read_bytes()


def test_offline_uses_the_cache_with_zero_requests(hub, hf_env, tiny) -> None:
    publish(hub, tiny)
    online = gguf_mcv.pull(REPO, quant="Q4_0")
    hub.log.clear()
    hf_env.set_offline(True)
    offline = gguf_mcv.pull(REPO, quant="Q4_0")
    assert offline.model == online.model
    assert len(hub.log) == 0
    with pytest.raises(OfflineError, match="Q8_0"):
        gguf_mcv.pull(REPO, quant="Q8_0")
    assert len(hub.log) == 0


def test_unreachable_hub_falls_back_to_the_cache(hub, hf_env, tiny, monkeypatch) -> None:
    publish(hub, tiny)
    online = gguf_mcv.pull(REPO, quant="Q4_0")
    import huggingface_hub.constants as hfc
    from huggingface_hub import hf_api

    dead = "http://127.0.0.1:9"  # nothing listens on the discard port
    monkeypatch.setattr(hfc, "ENDPOINT", dead)
    monkeypatch.setattr(hf_api.api, "endpoint", dead)
    assert gguf_mcv.pull(REPO, quant="Q4_0").model == online.model


def test_not_enough_disk_is_refused_before_writing(hub, hf_env, tiny, monkeypatch) -> None:
    publish(hub, tiny)
    real = shutil.disk_usage
    monkeypatch.setattr(hubmod.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=1_000_000))
    with pytest.raises(NotEnoughDiskError, match="only 1.0 MB is free"):
        gguf_mcv.pull(REPO, quant="Q8_0")
    assert hub.count(method="GET", path="*/resolve/*") == 0
    assert not list(hf_env.cache.rglob("*.gguf"))


def test_dropped_connection_completes_on_the_next_call(hub, hf_env, tiny, monkeypatch) -> None:
    from huggingface_hub import file_download

    monkeypatch.setattr(file_download.time, "sleep", lambda s: None)  # the client's retry back-off
    publish(hub, tiny)
    hub.faults.drop(f"{REPO}/ggml-model-Q8_0.gguf", after_bytes=300_000, times=None)
    with pytest.raises((DownloadError, OfflineError)):
        gguf_mcv.pull(REPO, quant="Q8_0")
    assert not list(hf_env.cache.rglob("*.incomplete"))
    hub.faults.clear()
    files = gguf_mcv.pull(REPO, quant="Q8_0")
    assert files.model.read_bytes() == Path(tiny.quants["Q8_0"]).read_bytes()


def test_stale_partial_from_a_killed_download_is_removed(hub, hf_env, tiny) -> None:
    publish(hub, tiny)
    listing = hubmod.list_files(REPO)
    target = listing.model_file("Q6_K")
    from huggingface_hub.file_download import repo_folder_name

    blobs = hf_env.cache / repo_folder_name(repo_id=REPO, repo_type="model") / "blobs"
    blobs.mkdir(parents=True)
    stale = blobs / f"{target.sha256}.deadbeef.incomplete"
    stale.write_bytes(b"x" * 1000)
    files = gguf_mcv.pull(REPO, quant="Q6_K")
    assert not stale.exists()
    assert files.model.stat().st_size == target.size


def test_remote_header_is_read_with_a_small_ranged_request(hub, tiny) -> None:
    publish(hub, tiny)
    listing = hubmod.list_files(REPO)
    f = listing.model_file("Q8_0")
    header = hubmod.remote_text_header(listing, f)
    shape = header.shape
    assert (shape.architecture, shape.n_layers, shape.n_embd, shape.n_head_kv) == ("qwen2", 2, 256, 2)
    assert shape.n_vocab == tiny.spec.n_vocab and header.chat_template
    gets = hub.requests(method="GET", path="*/resolve/*")
    assert len(gets) == 1 and gets[0].range == f"bytes=0-{hubmod.HEADER_FIRST_BYTES - 1}"
    assert gets[0].bytes_sent <= hubmod.HEADER_FIRST_BYTES < f.size


@pytest.mark.parametrize("quant", ["Q4_K_M", None])
def test_a_load_from_the_hub_probes_the_machine_once_and_carries_out_one_plan(hub, tiny, probe_calls, quant) -> None:
    publish(hub, tiny)
    calls = probe_calls
    with gguf_mcv.load(REPO, quant=quant, n_ctx=1024, vision_backend="llama.cpp") as model:
        assert len(calls) == 1
        planned = model.info.plan
        assert planned is not None and planned.quant == model.info.quant
        assert Path(planned.files[0]).name == Path(model.info.model_path).name
        assert (model.info.n_ctx, model.info.parallel) == (planned.n_ctx, planned.parallel)


def test_a_download_is_identified_by_the_hubs_sha256_without_hashing_it_again(hub, hf_env, tiny,
                                                                              monkeypatch) -> None:
    from gguf_mcv.models import identity

    publish(hub, tiny)
    served = {Path(rel).name: info.sha256 for rel, info in hub.files(REPO).items()}

    def refuse(f):
        raise AssertionError("a verified download was hashed again for its identity")

    monkeypatch.setattr(identity, "_sha256", refuse)
    with gguf_mcv.load(REPO, quant="Q4_K_M", n_ctx=1024, vision_backend="llama.cpp") as model:
        assert model.identity()["model"] == served["ggml-model-Q4_K_M.gguf"]
        assert model.identity()["projector"] == served["mmproj-model-f16.gguf"]
    hf_env.set_offline(True)  # offline, the digest is the blob's name in the HF cache
    files = gguf_mcv.pull(REPO, quant="Q4_K_M")
    assert identity.file_identity(files.mmproj) == served["mmproj-model-f16.gguf"]
