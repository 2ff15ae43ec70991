"""Every finished answer validates, for generated schemas, on the byte-vocabulary model.

Its 256 byte tokens are equally likely under random weights, so the grammar alone decides
what is written: any keyword the docs call enforced that the grammar lets slip shows up
as an answer that does not validate. Schemas are drawn from the enforced keywords (bounds
of any size, negative, exclusive and fractional; formats; counts; nesting of objects in
arrays in objects). The same is checked through the real ``openai`` and ``ollama``
clients against the server.
"""

from __future__ import annotations

from typing import Any, Iterator

import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gguf_mcv.output import formats, structured

MODEL_PROPERTY = settings(max_examples=12, deadline=None, derandomize=True, database=None,
                          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
GRAMMAR_PROPERTY = settings(max_examples=60, deadline=None, derandomize=True, database=None,
                            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
SEEDS = (0, 1)


def _bounds(draw: Any, kind: str) -> dict[str, Any]:
    if kind == "integer":
        ends = draw(st.sampled_from([st.integers(-(2**63), 2**63 - 1), st.integers(-60, 60),
                                     st.integers(10**6, 2 * 10**9), st.integers(-(2**31), 0)]))
    else:
        scale = draw(st.sampled_from([0, 1, 2, 3]))
        ends = st.integers(-(10**6), 10**6).map(lambda n: n / 10**scale)
    low, high = sorted([draw(ends), draw(ends)])
    schema: dict[str, Any] = {"type": kind}
    low_key = draw(st.sampled_from(["minimum", "exclusiveMinimum", None]))
    high_key = draw(st.sampled_from(["maximum", "exclusiveMaximum", None]))
    if low_key and high_key and "exclusive" in low_key + high_key and high - low < 2:
        high = low + 2  # keep a value inside
    if low_key:
        schema[low_key] = low
    if high_key:
        schema[high_key] = high
    return schema


@st.composite
def leaves(draw: Any) -> dict[str, Any]:
    kind = draw(st.sampled_from(["integer", "number", "format", "boolean", "enum", "short"]))
    if kind in ("integer", "number"):
        return _bounds(draw, kind)
    if kind == "format":
        return {"type": "string", "format": draw(st.sampled_from(sorted(formats.GRAMMARS)))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": draw(st.lists(st.sampled_from(["a", "b", 3, None, True]), min_size=1, max_size=3,
                                      unique=True))}
    return {"type": "string", "maxLength": draw(st.integers(0, 6))}


def _objects(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(props: dict[str, Any], required: list[bool]) -> dict[str, Any]:
        names = sorted(props)
        return {"type": "object", "properties": props, "additionalProperties": False,
                "required": [n for n, r in zip(names, required[:len(names)], strict=True) if r]}

    return st.builds(build, st.dictionaries(st.sampled_from(["a", "b", "c"]), children, min_size=1, max_size=3),
                     st.lists(st.booleans(), min_size=3, max_size=3))


def _arrays(children: st.SearchStrategy) -> st.SearchStrategy:
    def build(items: dict[str, Any], low: int, extra: int) -> dict[str, Any]:
        return {"type": "array", "items": items, "minItems": low, "maxItems": low + extra}

    return st.builds(build, children, st.integers(0, 2), st.integers(0, 2))


#: objects in arrays in objects, at most three levels deep
SCHEMAS = st.recursive(leaves(), lambda inner: st.one_of(_objects(inner), _arrays(inner)), max_leaves=5).map(
    lambda s: s if s.get("type") == "object" else {"type": "object", "properties": {"v": s}, "required": ["v"]})


@MODEL_PROPERTY
@given(schema=SCHEMAS)
def test_every_finished_answer_validates(byte_model, schema) -> None:
    for seed in SEEDS:
        reply = byte_model.ask("?", schema=schema, seed=seed, max_tokens=300)
        if reply.finish_reason != "stop":
            continue
        assert reply.parse_error is None, (schema, seed, str(reply), reply.parse_error)
        structured.validate(reply.parsed, schema)


@GRAMMAR_PROPERTY
@given(schema=SCHEMAS)
def test_every_generated_schema_makes_a_grammar_llama_cpp_parses(byte_model, schema) -> None:
    made = structured.constraint(schema)
    assert made is not None and not made.unenforced
    byte_model.engine.check_grammar(made.grammar)


# -- the same through the real clients --------------------------------------------


class Meter(pydantic.BaseModel):
    reading: int = pydantic.Field(ge=0, le=9999)


@pytest.fixture(scope="module")
def byte_server(byte_model) -> Iterator[Any]:
    pytest.importorskip("openai")
    pytest.importorskip("ollama")
    from test_server import Running

    from gguf_mcv import server

    running = Running(server.build_app(byte_model, api_key=""))
    yield running
    running.stop()


def _served(running: Any) -> str:
    import requests

    return requests.get(running.url + "/health", timeout=10).json()["model"]


def test_openai_parse_gives_a_meter_in_range(byte_server) -> None:
    import openai

    client = openai.OpenAI(base_url=byte_server.url + "/v1", api_key="none", max_retries=0, timeout=120)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in range(8):  # before digit-wise ranges, some of these were out of range
        r = parse(model=_served(byte_server), messages=[{"role": "user", "content": "?"}],
                  response_format=Meter, max_tokens=60, seed=seed)
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        assert isinstance(r.choices[0].message.parsed, Meter), r.choices[0].message.content


def test_ollama_format_gives_a_meter_in_range(byte_server) -> None:
    import ollama

    client = ollama.Client(host=byte_server.url, timeout=120)
    for seed in range(8):  # before digit-wise ranges, some of these were out of range
        r = client.chat(model=_served(byte_server), messages=[{"role": "user", "content": "?"}],
                        format=Meter.model_json_schema(), options={"num_predict": 60, "seed": seed})
        Meter.model_validate_json(r.message.content)
