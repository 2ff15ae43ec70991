"""Shared pytest fixtures."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hubserver import HubServer  # tests/ is on sys.path (pytest imports this rootdir conftest)

# llama.cpp's wheel threads with OpenMP, whose threads spin at a barrier by default: two test
# workers, each with a two-thread model, share two cores, and a spinning thread holds a core the
# other worker's threads wait for. Set before llama.cpp is first loaded; children inherit it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

# --- local Hub stand-in ---
# `hub` gives each test an empty Hub (tests/hubserver.py) that the real huggingface_hub
# client talks to, with a fresh HF cache; `hf_env` alone gives only the client settings.
# One server thread serves the whole session; its root folder, faults and log are reset per test.


@dataclass
class HfEnv:
    """Where the huggingface_hub client of this test points."""

    endpoint: str
    home: Path  # HF_HOME
    cache: Path  # HF_HUB_CACHE
    monkeypatch: pytest.MonkeyPatch

    def set_offline(self, offline: bool = True) -> None:
        """HF_HUB_OFFLINE for this test, in the environment and in the imported client."""
        import huggingface_hub.constants as c

        self.monkeypatch.setenv("HF_HUB_OFFLINE", "1" if offline else "0")
        self.monkeypatch.setattr(c, "HF_HUB_OFFLINE", offline)


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    with HubServer(tmp_path_factory.mktemp("hub")) as server:
        yield server


@pytest.fixture
def hf_env(hub_server: HubServer, tmp_path_factory: pytest.TempPathFactory,
           monkeypatch: pytest.MonkeyPatch) -> Iterator[HfEnv]:
    """Point huggingface_hub at the stand-in, with a fresh cache and no token, telemetry or progress bars.

    Environment variables reach subprocesses; huggingface_hub read them into module globals at import
    time, so the globals its download and API paths consult at call time are patched too.
    """
    import huggingface_hub.constants as c
    from huggingface_hub import hf_api
    from huggingface_hub.utils import close_session

    # import_module: `huggingface_hub.utils.tqdm` the attribute is the tqdm class, not the module
    cache_manager = importlib.import_module("huggingface_hub.utils._cache_manager")
    hf_tqdm = importlib.import_module("huggingface_hub.utils.tqdm")

    home = tmp_path_factory.mktemp("hf_home")
    env = HfEnv(hub_server.url, home, home / "hub", monkeypatch)
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE",
                "HUGGINGFACE_HUB_CACHE", "HUGGINGFACE_ASSETS_CACHE", "HF_HUB_ENABLE_HF_TRANSFER",
                "HUGGINGFACE_CO_STAGING", "HF_HUB_ETAG_TIMEOUT", "HF_HUB_DOWNLOAD_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    settings = {
        "HF_ENDPOINT": env.endpoint, "HF_HOME": str(home), "HF_HUB_CACHE": str(env.cache),
        "HF_ASSETS_CACHE": str(home / "assets"), "HF_XET_CACHE": str(home / "xet"),
        "HF_TOKEN_PATH": str(home / "token"), "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1", "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost",
    }
    for var, value in settings.items():
        monkeypatch.setenv(var, value)

    patches: dict[str, object] = {
        "ENDPOINT": env.endpoint,
        "HUGGINGFACE_CO_URL_TEMPLATE": env.endpoint + "/{repo_id}/resolve/{revision}/{filename}",
        "HF_HOME": str(home), "HF_HUB_CACHE": str(env.cache), "HUGGINGFACE_HUB_CACHE": str(env.cache),
        "HF_ASSETS_CACHE": str(home / "assets"), "HUGGINGFACE_ASSETS_CACHE": str(home / "assets"),
        "HF_XET_CACHE": str(home / "xet"), "HF_TOKEN_PATH": str(home / "token"),
        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens"), "HF_HUB_OFFLINE": False,
        "HF_HUB_DISABLE_TELEMETRY": True, "HF_HUB_DISABLE_PROGRESS_BARS": True,
        "HF_HUB_DISABLE_UPDATE_CHECK": True, "AGENT_HARNESSES_PATH": str(home / ".agent_harnesses.json"),
        "CHECK_FOR_UPDATE_DONE_PATH": str(home / ".check_for_update_done"),
        "CHECK_FOR_SKILL_UPDATE_DONE_PATH": str(home / ".check_for_skill_update_done"),
    }
    for name, patched in patches.items():
        monkeypatch.setattr(c, name, patched, raising=False)  # raising=False: not every version has all
    monkeypatch.setattr(hf_api.api, "endpoint", env.endpoint)  # the HfApi behind hf_api.model_info & co.
    monkeypatch.setattr(cache_manager, "HF_HUB_CACHE", str(env.cache))  # scan_cache_dir's default
    monkeypatch.setattr(hf_tqdm, "HF_HUB_DISABLE_PROGRESS_BARS", True)
    try:  # huggingface_hub >= 2.x fetches an agent registry for its user agent once per process
        from huggingface_hub.utils import _detect_agent

        monkeypatch.setattr(_detect_agent, "_registry", _detect_agent._EMPTY_REGISTRY)
    except (ImportError, AttributeError):
        pass
    close_session()  # the shared HTTP client is rebuilt with this environment (proxies)
    yield env
    close_session()  # no pooled connection outlives the test


@pytest.fixture
def hub(hub_server: HubServer, hf_env: HfEnv, tmp_path: Path) -> Iterator[HubServer]:
    """The running Hub stand-in, serving an empty folder, with no faults and an empty request log."""
    hub_server.reset(root=tmp_path / "hub_repos")
    yield hub_server
    hub_server.reset()


# --- end of local Hub stand-in ---


# --- generated models ---
# The tiny random-weight MiniCPM-V-2.6-shaped ladder (gguf_mcv/synthetic.py) is built once per
# session; `tiny_model` is one loaded Model shared by the tests that only ask questions.


@pytest.fixture(scope="session", autouse=True)
def _private_cache_for_session_fixtures(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The same private cache for session- and module-scoped fixtures, which run before the
    function-scoped one below (a model they load converts its ONNX encoder into this cache)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GGUF_MCV_CACHE", str(tmp_path_factory.getbasetemp() / "gguf_mcv_cache"))
        yield


@pytest.fixture(autouse=True)
def _private_caches(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test writes into the user's gguf_mcv cache or reads their catalog."""
    monkeypatch.setenv("GGUF_MCV_CACHE", str(tmp_path_factory.getbasetemp() / "gguf_mcv_cache"))
    monkeypatch.delenv("GGUF_MCV_CATALOG", raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path_factory.getbasetemp() / "empty-config"))
    # speed predictions from the documented defaults: no test waits for a machine probe
    # unless it asks for one (tests/test_speed_probe.py)
    monkeypatch.setenv("GGUF_MCV_NO_PROBE", "1")


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    """The tiny synthetic ladder: ``.quants[...]``, ``.mmproj``, ``.spec``."""
    from gguf_mcv.testing import synthetic

    return synthetic.build(tmp_path_factory.mktemp("tiny_model"))


@pytest.fixture(scope="session")
def tiny_model(tiny):
    """One loaded tiny Model (Q4_K_M, n_ctx 4096) for tests that do not change its settings."""
    import gguf_mcv

    model = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj,
                          n_ctx=4096, n_threads=2)
    yield model
    model.close()


@pytest.fixture(scope="session")
def byte_vocab(tmp_path_factory: pytest.TempPathFactory):
    """A random-weight model whose vocabulary is the 256 bytes (and one merge): every byte,
    continuation bytes and 0xF8-0xFF included, is a token the sampler may pick, so under a
    grammar the grammar alone decides what is written (``.f16``, ``.mmproj``)."""
    import dataclasses

    from gguf_mcv.testing import synthetic, synthetic_specs

    spec = dataclasses.replace(synthetic.TINY, n_merges=1, n_vocab=0)
    spec = dataclasses.replace(spec, n_vocab=synthetic_specs.min_vocab(spec))
    return synthetic.build(tmp_path_factory.mktemp("byte_model"), spec, quants=[])


@pytest.fixture(scope="session")
def byte_model(byte_vocab):
    """:func:`byte_vocab` loaded (n_ctx 2048)."""
    import gguf_mcv

    model = gguf_mcv.load(model_path=byte_vocab.f16, mmproj_path=byte_vocab.mmproj, n_ctx=2048, n_threads=2)
    assert model.engine.llama.n_vocab() < 300
    yield model
    model.close()


@pytest.fixture(scope="session")
def retuned_mmproj(tiny, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A same-size copy of the tiny mmproj that differs only in the middle, as a re-exported
    fine-tuned tower would: half the rows of a weight matrix scaled. The tiny file's vision
    blocks lie in its last MiB, so the matrix is the resampler's output projection."""
    import gguf
    import numpy as np

    raw = bytearray(Path(tiny.mmproj).read_bytes())
    mib = 2**20
    tensor = next(t for t in gguf.GGUFReader(str(tiny.mmproj)).tensors if t.name == "resampler.proj.weight")
    start, n = int(tensor.data_offset), int(tensor.n_bytes) // 2
    assert tensor.tensor_type == gguf.GGMLQuantizationType.F16 and mib < start < start + n < len(raw) - mib
    rows = np.frombuffer(raw, dtype="<f2", count=n // 2, offset=start)
    rows *= 3.0
    out = tmp_path_factory.mktemp("retuned") / "mmproj-model-f16.gguf"
    out.write_bytes(bytes(raw))
    original = Path(tiny.mmproj).read_bytes()
    assert raw[:mib] == original[:mib] and raw[-mib:] == original[-mib:] and bytes(raw) != original
    return out


@pytest.fixture
def probe_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Calls of :func:`gguf_mcv.hardware.probe` from now on, from every module that imported it."""
    from gguf_mcv import hardware

    calls: list[int] = []
    real = hardware.probe

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    for name, module in list(sys.modules.items()):
        if (name == "gguf_mcv" or name.startswith("gguf_mcv.")) and getattr(module, "probe", None) is real:
            monkeypatch.setattr(module, "probe", counted)
    return calls
