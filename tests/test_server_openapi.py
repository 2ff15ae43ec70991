"""The server against its own OpenAPI schema (schemathesis): every route, generated requests, no
500, no hang, every response as its route declares (status, content type, body shape).

A fixed seed, derandomized, a few examples per route; answers are capped at 2 tokens."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("fastapi")
schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.specs.openapi.checks import positive_data_acceptance  # noqa: E402
from test_server import Running  # noqa: E402

import gguf_mcv  # noqa: E402
from gguf_mcv import server  # noqa: E402


@pytest.fixture(scope="module")
def running(tiny) -> Iterator[Running]:
    model = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=1024, n_threads=2)
    srv = Running(server.build_app(model, api_key=""))
    yield srv
    srv.stop()
    model.close()


@pytest.fixture(scope="module")
def api(running: Running) -> Any:
    return schemathesis.openapi.from_dict(running.server.config.app.openapi())


def _short(body: Any) -> Any:
    """At most 2 tokens per generated answer, so the run fits the suite."""
    if isinstance(body, dict):
        body = {**body, "max_tokens": 2, "max_completion_tokens": 2}
        options = body.get("options")
        body["options"] = {**options, "num_predict": 2} if isinstance(options, dict) else {"num_predict": 2}
    return body


def test_every_route_answers_as_its_schema_declares(api: Any, running: Running) -> None:
    operations = [result.ok() for result in api.get_all_operations()]
    assert len(operations) >= 11  # every route: /health, /metrics, the OpenAI and the Ollama ones

    for operation in operations:
        @given(case=operation.as_strategy())
        @settings(max_examples=15, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        def check(case: Any) -> None:
            if isinstance(case.body, dict):
                case.body = _short(case.body)
            # the bodies are declared as JSON objects; what fits is the routes' pydantic models' to
            # say (a 400 in the API's shape otherwise), so a generated object may rightly be refused
            excluded = [positive_data_acceptance] if case.operation.body else []
            case.call_and_validate(base_url=running.url, timeout=120, excluded_checks=excluded)

        check()
