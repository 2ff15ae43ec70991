"""fleet: the HTTP API on Ray Serve, on a real two-node local Ray cluster, two replicas of the tiny model."""

from __future__ import annotations

import base64
import io
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import PIL.Image
import pytest

REPO = Path(__file__).resolve().parent.parent
REPLICA_HEADER = "x-gguf-mcv-replica"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _data_uri(seed: int) -> str:
    out = io.BytesIO()
    PIL.Image.fromarray(np.random.default_rng(seed).integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(out, "PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def fleet(request: pytest.FixtureRequest, tiny) -> str:
    """A head node and a worker node (one CPU each), the fleet deployed on them; its base URL."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed here (pip install 'gguf-mcv[cluster]'); "
                                            "the fleet cannot be tested")
    ray_cli = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]
    temp = tempfile.mkdtemp(prefix="rayf", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])}

    def stop() -> None:
        import ray

        ray.shutdown()
        subprocess.run([*ray_cli, "stop", "--force"], env=env, capture_output=True, timeout=120)
        shutil.rmtree(temp, ignore_errors=True)

    request.addfinalizer(stop)
    address = f"127.0.0.1:{_free_port()}"
    node = ["--num-cpus=1", f"--temp-dir={temp}", "--object-store-memory=80000000", "--disable-usage-stats"]
    for args in (["--head", f"--port={address.rsplit(':', 1)[1]}", "--node-ip-address=127.0.0.1",
                  "--include-dashboard=false"], [f"--address={address}", "--node-ip-address=127.0.0.1"]):
        started = subprocess.run([*ray_cli, "start", *args, *node], env=env, capture_output=True, text=True,
                                 timeout=180)
        if started.returncode != 0:
            pytest.skip("A local Ray cluster could not start here: " + (started.stdout + started.stderr)[-800:])
    from gguf_mcv.fleet import deploy

    load = dict(model_path=str(tiny.quants["Q4_K_M"]), mmproj_path=str(tiny.mmproj), n_ctx=2048, n_threads=1)
    return deploy(address, load, replicas=2, port=_free_port(), app_kwargs={"api_key": ""})


def test_a_three_turn_image_conversation_stays_on_one_replica_and_reuses_its_cache(fleet: str) -> None:
    import openai

    client = openai.OpenAI(base_url=fleet + "/v1", api_key="none", max_retries=0)
    messages: list = [{"role": "user", "content": [{"type": "text", "text": "What is it?"},
                                                   {"type": "image_url", "image_url": {"url": _data_uri(1)}}]}]
    replicas, usages = [], []
    for turn in range(3):
        raw = client.chat.completions.with_raw_response.create(model="ggml-model-Q4_K_M", messages=messages, max_tokens=3,
                                                               temperature=0)
        replicas.append(raw.headers[REPLICA_HEADER])
        reply = raw.parse()
        usages.append(reply.usage)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": f"And {turn}?"}]
    assert len(set(replicas)) == 1, replicas
    assert all(u.prompt_tokens_details.cached_tokens > 0 for u in usages[1:]), usages

