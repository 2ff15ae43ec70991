"""batch_ray: the batch job on a real two-node local Ray cluster gives the local job's rows (greedy)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import PIL.Image
import pytest
import raycluster  # tests/ is on sys.path
from raycluster import free_port

from gguf_mcv.jobs import batch
from gguf_mcv.jobs.batch_ray import Answerer, item_from, records

PROMPTS = ["What is it?", "Which colours?"]


def _png(path: Path, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(path)
    return path


def _answers(rows: list[dict]) -> dict[str, tuple]:
    """By key: the item, answer and error (timings and KV-cache hits depend on the worker)."""
    return {r["key"]: (r["input"], r["prompt"], r["answer"], r["parsed"], r["error"], r["finish_reason"],
                       r["usage"] and r["usage"]["completion_tokens"]) for r in rows}


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_bytes().splitlines()]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("ray_in")
    for i in range(3):
        _png(folder / f"p{i}.png", 700 + i)
    (folder / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 cut short")
    return folder


def test_answerer_returns_rows_and_error_rows(tiny, folder: Path) -> None:
    """The callable class alone (no cluster): one row per record, bad items as error rows."""
    items = batch.collect(folder, prompts=PROMPTS[:1], options={"max_tokens": 2, "temperature": 0.0})
    assert [item_from(r["item"]) for r in records(items)] == [(i, None) for i in items]
    rows = folder / "rows.jsonl"
    rows.write_text('{"image": "gone.png", "prompt": "p"}\n')
    missing = batch.collect(rows)  # an item that carries its problem (MediaError) to the worker
    answerer = Answerer({"model_path": str(tiny.quants["Q2_K"]), "mmproj_path": str(tiny.mmproj),
                         "n_ctx": 1024, "n_threads": 1})
    try:
        out = answerer({"key": np.array([r["key"] for r in records(items + missing)] + ["x"]),
                        "item": np.array([r["item"] for r in records(items + missing)] + ["{damaged"])})
    finally:
        answerer.model.close()
        rows.unlink()
    assert set(out) == set(batch.base_row(items[0]))
    assert len(out["key"]) == 6 and all(out["key"])  # every row keyed, the damaged record too
    assert out["key"][:5] == [i.key for i in items + missing]
    errors = [e and e["class"] for e in out["error"]]
    assert errors == ["MediaError", None, None, None, "MediaError", "JSONDecodeError"]
    assert "gone.png does not exist" in out["error"][4]["message"]
    assert all(isinstance(a, str) for a in out["answer"][1:4])



@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> str:
    """A real local Ray cluster: a head node and one worker node, one CPU each; stopped at the end."""
    pytest.importorskip("ray", reason="Ray is not installed here (pip install 'gguf-mcv[ray]'); "
                                      "the Ray batch job cannot be tested")
    address, _ = raycluster.start(request, "ray")
    return address


@pytest.mark.slow  # about 35 s, most of it starting and stopping the two Ray nodes
def test_ray_job_on_two_nodes_gives_the_local_rows(cluster: str, tiny, folder: Path, tmp_path: Path) -> None:
    import gguf_mcv

    options = {"max_tokens": 3, "temperature": 0.0}
    local = tmp_path / "local.jsonl"
    with gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=4096,
                       n_threads=1) as model:
        batch.run(model, folder, local, prompts=PROMPTS, options=options, progress=False)

    out = tmp_path / "ray.jsonl"
    cli = [sys.executable, "-m", "gguf_mcv", "batch", str(tiny.quants["Q4_K_M"]), "--mmproj", str(tiny.mmproj),
           str(folder), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--out", str(out), "--max-tokens", "3",
           "--temperature", "0", "--threads", "1", "--no-progress", "--ray", cluster, "--workers", "2"]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "8 answered (2 errors)" in done.stderr
    rows = _rows(out)
    assert len(rows) == 8 and set(rows[0]) == set(_rows(local)[0])
    # the same answers; under other keys, since a Ray job's name the load it asks for (docs/batch.md)
    assert sorted(_answers(rows).values()) == sorted(_answers(_rows(local)).values())
    assert not set(_answers(rows)) & set(_answers(_rows(local)))
    assert sum(r["error"] is None for r in rows) == 6

    again = subprocess.run(cli, capture_output=True, text=True, timeout=300)  # resumable: nothing left to do
    assert again.returncode == 0 and "0 answered (0 errors), 8 already" in again.stderr
    assert len(_rows(out)) == 8

    # workers that need more CPUs than any node has would wait forever: refused instead
    greedy = [*cli[: cli.index("--out") + 1], str(tmp_path / "more.jsonl"), *cli[cli.index("--out") + 2:]]
    greedy[greedy.index("--threads") + 1] = "2"
    refused = subprocess.run(greedy, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 1 and "reserves --threads 2 CPUs" in refused.stderr, refused.stderr[-2000:]


@pytest.mark.parametrize("address", ["127.0.0.1:{dead}", "ray://127.0.0.1:{dead}", "no-port", "host:abc"])
def test_unreachable_or_bad_address_is_refused_fast_before_writing(folder: Path, tmp_path: Path,
                                                                   address: str) -> None:
    pytest.importorskip("ray", reason="Ray is not installed here (pip install 'gguf-mcv[ray]')")
    from gguf_mcv.errors import ClusterError
    from gguf_mcv.jobs import batch_ray

    items = batch.collect(folder, prompts=PROMPTS[:1])
    out = tmp_path / "out.jsonl"
    with pytest.raises(ClusterError):
        # nothing listens on a port whose probe socket was closed; Ray itself would wait minutes
        batch_ray.run_items(address.format(dead=free_port()), {"model": "x"}, items, out, progress=False)
    assert not out.exists()  # refused before the results file was touched


def test_workers_must_be_positive(folder: Path, tmp_path: Path) -> None:
    from gguf_mcv.errors import ConfigError
    from gguf_mcv.jobs import batch_ray

    for bad in (0, -1, 1.5):
        with pytest.raises(ConfigError, match="workers"):
            batch_ray.run_items("auto", {}, [], tmp_path / "o.jsonl", workers=bad, progress=False)  # type: ignore[arg-type]


def test_without_ray_the_job_says_how_to_get_it(folder: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from gguf_mcv.errors import ConfigError
    from gguf_mcv.jobs import batch_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ConfigError, match=r"gguf-mcv\[ray\]"):
        batch_ray.run_items("auto", {}, batch.collect(folder, prompts=["q"]), tmp_path / "o.jsonl", progress=False)
    assert not (tmp_path / "o.jsonl").exists()


def test_a_ray_job_keys_the_files_or_the_name_and_the_vision_settings_asked_for(tiny) -> None:
    from gguf_mcv.jobs.batch_input import model_identity
    from gguf_mcv.jobs.batch_ray import load_identity

    local = dict(model_path=str(tiny.quants["Q4_K_M"]), mmproj_path=str(tiny.mmproj), n_threads=1)
    assert load_identity(local).startswith(model_identity(tiny.quants["Q4_K_M"], tiny.mmproj) + "+")
    assert load_identity({**local, "n_threads": 4}) == load_identity(local)  # threads do not change answers
    assert load_identity({**local, "vision_backend": "auto"}) == load_identity(local)  # the default, spelled out
    named = [load_identity(dict(model="minicpm-v-2.6", quant=q, n_threads=1)) for q in ("Q4_K_M", "Q8_0", None)]
    encoders = [load_identity({**local, "vision_backend": b}) for b in ("onnx-int8", "onnx-fp32", "llama.cpp")]
    others = [load_identity({**local, k: v}) for k, v in (("mmproj_precision", "bf16"), ("chat_template", "chatml"),
                                                          ("n_ctx", 2048), ("vision_gpu", True))]
    assert len({*named, *encoders, *others, load_identity(local)}) == 11
