"""Structured output: schema → grammar → parsed value, on the random-weight tiny model.

Its unconstrained output is noise, so every answer that parses and validates is the
grammar's doing. Strings are bounded with ASCII patterns where a test needs answers to
end well within max_tokens (random weights close a free string late); free strings and
maxLength are tested on a model whose vocabulary is the 256 bytes (``byte_model``).
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Annotated, Literal, Optional

import pydantic
import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.output import structured

SEEDS = range(6)
#: Qwen3's template with the think block opened by the prompt (as some templates do)
_THINK_OPENED = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] "
                 "+ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
                 "{% if enable_thinking is not defined or enable_thinking %}{{ '<think>\\n' }}{% endif %}{% endif %}")


class Item(pydantic.BaseModel):
    name: str = pydantic.Field(pattern=r"^[a-z ]{1,8}$")
    qty: int = pydantic.Field(ge=1, le=9)


class Receipt(pydantic.BaseModel):
    shop: Literal["north", "south"]
    items: list[Item] = pydantic.Field(max_length=3)
    total: float = pydantic.Field(ge=0, le=100)
    note: Optional[str] = pydantic.Field(default=None, pattern=r"^[a-z]{0,6}$")


@dataclasses.dataclass
class Door:
    person: bool
    count: int


NESTED = {
    "type": "object",
    "properties": {
        "meter": {"type": "object", "properties": {
            "reading": {"type": "number", "minimum": -5, "maximum": 5},
            "unit": {"enum": ["kWh", "m3"]},
        }, "required": ["reading", "unit"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "minItems": 1,
                 "maxItems": 3},
        "level": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 4},
        "ok": {"type": "boolean"},
    },
    "required": ["meter", "tags", "level"],
    "additionalProperties": False,
}
SCHEMAS = {
    "nested": NESTED,
    "enum": {"type": "object", "properties": {"colour": {"enum": ["red", "green", 3, None]}},
             "required": ["colour"]},
    "bounded": {"type": "object", "properties": {
        "x": {"type": "number", "minimum": 0.5, "maximum": 2.5},
        "n": {"type": "integer", "minimum": 0},
        "m": {"type": "integer", "minimum": -3, "maximum": -1},
    }, "required": ["x", "n", "m"]},
    "array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 4},
    "optional": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "null"},
                                                  "c": {"type": ["integer", "boolean"]}}},
}


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_every_constrained_answer_parses_and_validates(tiny_model, name) -> None:
    schema = SCHEMAS[name]
    for seed in SEEDS:
        reply = tiny_model.ask("Fill it in.", schema=schema, seed=seed, max_tokens=300)
        assert reply.parse_error is None, (seed, str(reply))
        assert reply.parsed == json.loads(reply)
        structured.validate(reply.parsed, schema)


def test_a_pydantic_class_gives_an_instance_streaming_too(tiny_model) -> None:
    for seed in SEEDS:
        reply = tiny_model.ask("Read the receipt.", schema=Receipt, seed=seed, max_tokens=400)
        assert isinstance(reply.parsed, Receipt), (seed, str(reply), reply.parse_error)
        stream = tiny_model.ask("Read the receipt.", schema=Receipt, seed=seed, max_tokens=400, stream=True)
        pieces = list(stream)
        assert stream.reply is not None and isinstance(stream.reply.parsed, Receipt)
        assert Receipt.model_validate_json("".join(pieces)) == stream.reply.parsed


def test_a_dataclass_gives_a_dataclass_and_format_json_any_object(tiny_model) -> None:
    for seed in SEEDS:
        door = tiny_model.ask("Is there a person?", schema=Door, seed=seed, max_tokens=100)
        assert isinstance(door.parsed, Door), (str(door), door.parse_error)
    finished = 0
    for seed in SEEDS:  # any object: free strings may outlast max_tokens, never as half a value
        free = tiny_model.ask("Anything.", format="json", seed=seed, max_tokens=300)
        if free.finish_reason == "stop":
            finished += 1
            assert isinstance(free.parsed, dict) and free.parsed == json.loads(free)
        else:
            assert free.parsed is None and "max_tokens" in free.parse_error
    assert finished >= 1


def test_chat_turns_with_a_schema_reuse_the_cache(tiny_model) -> None:
    chat = tiny_model.chat(system="Answer in JSON.")
    first = chat.send("Is there a person?", schema=Door, seed=1, max_tokens=100)
    second = chat.send("And now?", schema=Door, seed=2, max_tokens=100)
    assert isinstance(first.parsed, Door) and isinstance(second.parsed, Door)
    assert second.usage.cached_tokens >= first.usage.prompt_tokens
    assert chat.history[1]["content"] == str(first)


def test_chat_completion_takes_a_schema(tiny_model) -> None:
    reply = tiny_model.chat_completion([{"role": "user", "content": "Count."}], schema=SCHEMAS["array"],
                                       max_tokens=100, seed=4)
    assert isinstance(reply.parsed, list)


def test_max_length_strings_give_a_valid_value_or_say_why(tiny_model) -> None:
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 5}}, "required": ["s"]}
    for seed in SEEDS:
        reply = tiny_model.ask("?", schema=schema, seed=seed, max_tokens=100)
        if reply.finish_reason == "stop":
            assert reply.parse_error is None and len(reply.parsed["s"]) <= 5, str(reply)


def test_json_cut_by_max_tokens_is_never_parsed(tiny_model) -> None:
    reply = tiny_model.ask("Long.", schema=Receipt, seed=0, max_tokens=3)
    assert reply.finish_reason == "length"
    assert reply.parsed is None and "max_tokens" in reply.parse_error


@pytest.mark.parametrize("template", ["qwen3", _THINK_OPENED])
def test_thinking_stays_free_and_the_answer_is_constrained(tiny, template) -> None:
    import gguf_mcv

    model = gguf_mcv.load(model_path=tiny.quants["Q4_K_M"], mmproj_path=tiny.mmproj, n_ctx=2048,
                          n_threads=2, chat_template=template)
    try:
        assert model.info.can_think
        reasoned = 0
        for seed in range(12):
            reply = model.ask("Think, then answer.", schema=Door, thinking=True, seed=seed, max_tokens=300)
            reasoned += bool(reply.reasoning)
            if reply.finish_reason == "stop":
                assert isinstance(reply.parsed, Door), (str(reply), reply.reasoning[:80])
            else:  # the reasoning (free) ran past max_tokens: nothing half-parsed
                assert reply.parsed is None and reply.parse_error
        assert reasoned  # some answers did reason first, unconstrained
    finally:
        model.close()


@pytest.mark.parametrize("schema, part", [
    ({"type": "object", "properties": {"a": {"type": "strnig"}}}, "$.properties.a.type"),
    ({"type": "object", "properties": []}, "$.properties"),
    ({"type": "object", "required": "a"}, "$.required"),
    ({"enum": []}, "$.enum"),
    ({"type": "string", "maxLength": -1}, "$.maxLength"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "minItems"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "$.properties.a uses not"),
    ({"type": "number", "minimum": float("nan")}, "$.minimum"),
    ({"type": "integer", "minimum": 10**400}, "$.minimum"),
    ({"type": "number", "exclusiveMaximum": -1e300}, "$.exclusiveMaximum"),
    ({"type": "integer", "exclusiveMinimum": 3, "exclusiveMaximum": 4}, "$.exclusiveMinimum"),
    ({"type": "number", "minimum": 2, "maximum": 1}, "$.minimum"),
    ({"type": "integer", "multipleOf": 0}, "$.multipleOf"),
    ({"type": "string", "format": 5}, "$.format"),
    ({"$ref": "https://example.com/s.json"}, "$.$ref"),
    ({"$ref": "#/$defs/missing"}, "points to nothing"),
    ({"type": "string", "pattern": "("}, "$.pattern"),
    ({"anyOf": [True]}, "$.anyOf[0]"),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "x": {1, 2}}, "not JSON"),
    ("not a schema", "schema must be"),
    (int, "schema must be"),
])
def test_invalid_schemas_are_config_errors_naming_the_part(tiny_model, schema, part) -> None:
    with pytest.raises(ConfigError) as err:
        tiny_model.ask("?", schema=schema)
    assert part in str(err.value)


def test_format_and_schema_are_checked(tiny_model) -> None:
    with pytest.raises(ConfigError, match="format"):
        tiny_model.ask("?", format="yaml")
    with pytest.raises(ConfigError, match="not both"):
        tiny_model.ask("?", schema=Door, format="json")


def test_hostile_schemas_are_refused_or_bounded(tiny_model) -> None:
    deep: dict = {"type": "string"}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ConfigError, match="nests deeper"):
        tiny_model.ask("?", schema=deep)
    huge = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(5000)}}
    with pytest.raises(ConfigError, match="bytes"):
        tiny_model.ask("?", schema=huge)
    many = {"enum": [f"value-{i}" for i in range(20000)]}
    with pytest.raises(ConfigError, match="bytes"):
        tiny_model.ask("?", schema=many)
    loop = {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}
    with pytest.raises(ConfigError):  # `a ::= a`: llama.cpp refuses left recursion (NULL, no abort)
        tiny_model.ask("?", schema=loop)


def test_a_recursive_schema_gives_a_bounded_answer(tiny_model) -> None:
    node = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "next": {"$ref": "#/$defs/node"}}, "required": ["v", "next"]}}, "$ref": "#/$defs/node"}
    start = time.monotonic()
    reply = tiny_model.ask("?", schema=node, seed=0, max_tokens=60)
    assert time.monotonic() - start < 60
    assert reply.finish_reason == "length" and reply.parsed is None  # a required `next` never ends


def test_a_grammar_llama_cpp_cannot_parse_is_a_config_error(tiny_model) -> None:
    constraint = structured.grammar_constraint('root ::= "a" undefined-rule')
    with pytest.raises(ConfigError, match="llama.cpp could not use the grammar"):
        tiny_model.chat_completion([{"role": "user", "content": "?"}], grammar=constraint)
    assert tiny_model.ask("still fine?", max_tokens=2)  # the process and the model live on


def test_bounded_number_rules() -> None:
    assert structured.bounded_number_rule({"type": "integer", "minimum": 2, "maximum": 4}) == "[2-4] space"
    wide = structured.bounded_number_rule({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1})
    assert wide is not None and len(wide) < 2000  # digit by digit, not 2**64 alternatives
    assert structured.bounded_number_rule({"type": "number", "minimum": 0.25, "maximum": 0.75}) is not None
    assert structured.bounded_number_rule({"type": "string", "minimum": 1}) is None
    assert structured.bounded_number_rule({"type": "integer"}) is None


class Meter(pydantic.BaseModel):
    reading: int = pydantic.Field(ge=0, le=9999)


def test_a_meter_reading_from_0_to_9999_is_always_in_range(byte_model) -> None:
    # the byte vocabulary makes every byte equally likely: only the grammar keeps the value in range
    for seed in range(10):  # before digit-wise ranges, 5 of these 10 were out of range
        reply = byte_model.ask("?", schema=Meter, seed=seed, max_tokens=60)
        assert reply.finish_reason == "stop" and reply.parse_error is None, (seed, str(reply), reply.parse_error)
        assert isinstance(reply.parsed, Meter) and 0 <= reply.parsed.reading <= 9999


@pytest.mark.parametrize("schema", [
    {"type": "integer", "minimum": 1_000_000, "maximum": 2_000_000_000},
    {"type": "integer", "minimum": -40, "maximum": -3},
    {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
    {"type": "number", "minimum": 0.5, "maximum": 0.7},
    {"type": "number", "minimum": -40.5, "maximum": -3.25},
    {"type": ["integer", "null"], "exclusiveMinimum": 9, "maximum": 12},
    {"type": "string", "format": "date"},
    {"type": "string", "format": "ipv4"},
])
def test_bounds_and_formats_hold_on_a_byte_vocabulary(byte_model, schema) -> None:
    wrapped = {"type": "object", "properties": {"v": schema}, "required": ["v"]}
    finished = 0
    for seed in range(4):
        reply = byte_model.ask("?", schema=wrapped, seed=seed, max_tokens=120)
        if reply.finish_reason == "stop":
            finished += 1
            assert reply.parse_error is None, (seed, str(reply), reply.parse_error)
            structured.validate(reply.parsed, wrapped)
    assert finished >= 3


def test_keywords_the_grammar_cannot_enforce_are_warned_and_named_in_parse_error(byte_model) -> None:
    schema = {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99, "multipleOf": 7},
        "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2}, "uniqueItems": True},
        "u": {"type": "string", "format": "uri", "maxLength": 8}}, "required": ["n"]}
    with pytest.warns(structured.SchemaWarning) as caught:
        made = structured.constraint(schema)
    said = " ".join(str(w.message) for w in caught)
    assert "multipleOf at $.properties.n" in said and "uniqueItems at $.properties.xs" in said
    assert "'uri' at $.properties.u" in said
    assert made is not None and len(made.unenforced) == 3
    refused = 0
    with pytest.warns(structured.SchemaWarning):
        for seed in range(12):
            reply = byte_model.ask("?", schema=schema, seed=seed, max_tokens=120)
            if reply.finish_reason != "stop":
                continue
            if reply.parsed is None:
                refused += 1
                assert "cannot enforce multipleOf at $.properties.n" in reply.parse_error, reply.parse_error
            else:
                assert reply.parsed["n"] % 7 == 0 and len(set(reply.parsed.get("xs", []))) == len(
                    reply.parsed.get("xs", []))
    assert refused  # 1 value in 7 is a multiple: the grammar alone would not hold it
    value, why = made.parse('{"n": 8}')
    assert value is None and "multipleOf" in why


def test_a_schema_without_unenforced_keywords_does_not_warn() -> None:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        structured.constraint(Receipt)
        structured.constraint({"type": "object", "properties": {"d": {"type": "string", "format": "date-time"}}})


def test_a_date_past_the_month_end_is_never_parsed() -> None:
    made = structured.constraint({"type": "object", "properties": {"d": {"type": "string", "format": "date"}}})
    assert made is not None
    value, why = made.parse('{"d": "7909-06-31"}')
    assert value is None and "date" in why


def test_validate_says_what_does_not_match() -> None:
    with pytest.raises(ValueError, match="'ft' is not one of"):
        structured.validate({"meter": {"reading": 1, "unit": "ft"}, "tags": ["a"], "level": 1}, NESTED)
    with pytest.raises(ValueError, match="'z' was unexpected"):
        structured.validate({"meter": {"reading": 1, "unit": "m3"}, "tags": ["a"], "level": 1, "z": 0}, NESTED)


# -- the llama-cpp-python chat handler ----------------------------------------------


@pytest.fixture(scope="module")
def handler_llama(tiny):
    from gguf_mcv import MiniCPMVChatHandler, checked_llama

    llama = checked_llama(str(tiny.quants["Q4_K_M"]), n_ctx=2048, verbose=False,
                          chat_handler=MiniCPMVChatHandler(str(tiny.mmproj)))
    yield llama
    llama.close()


def test_the_chat_handler_takes_response_format_and_grammar(handler_llama) -> None:
    from llama_cpp.llama_grammar import LlamaGrammar

    messages = [{"role": "user", "content": "Door?"}]
    door = structured.schema_of(Door)
    for response_format in ({"type": "json_object", "schema": door},
                            {"type": "json_schema", "json_schema": {"name": "door", "schema": door}}):
        out = handler_llama.create_chat_completion(messages=messages, response_format=response_format,
                                                   max_tokens=100, seed=1)
        Door(**json.loads(out["choices"][0]["message"]["content"]))
    chunks = handler_llama.create_chat_completion(messages=messages, max_tokens=100, seed=2, stream=True,
                                                  response_format={"type": "json_object", "schema": door})
    Door(**json.loads("".join(c["choices"][0]["delta"].get("content", "") for c in chunks)))
    out = handler_llama.create_chat_completion(messages=messages, max_tokens=20, seed=3,
                                               grammar=LlamaGrammar.from_string('root ::= "yes" | "no"'))
    assert out["choices"][0]["message"]["content"] in ("yes", "no")
    with pytest.raises(ConfigError, match="response_format"):
        handler_llama.create_chat_completion(messages=messages, response_format={"type": "xml"})



# -- strict UTF-8 under a grammar ---------------------------------------------------


class Note(pydantic.BaseModel):
    note: str = pydantic.Field(max_length=24)


class Card(pydantic.BaseModel):
    code: str = pydantic.Field(pattern=r"^.{3}$")
    title: str = pydantic.Field(max_length=6)
    lines: list[Note] = pydantic.Field(max_length=1)
    tags: list[Annotated[str, pydantic.StringConstraints(max_length=4)]] = pydantic.Field(max_length=2)


@pytest.mark.parametrize("target", [Note, Card])
def test_constrained_answers_on_a_byte_vocabulary_are_strict_utf8(byte_model, target) -> None:
    finished = 0
    for seed in range(20):
        reply = byte_model.ask("?", schema=target, seed=seed, max_tokens=400)
        if reply.finish_reason != "stop":
            continue
        finished += 1
        text = str(reply)
        assert "\ufffd" not in text, (seed, text)  # invalid bytes would have decoded to U+FFFD
        assert reply.parse_error is None, (seed, text, reply.parse_error)
        json.loads(text.encode("utf-8").decode("utf-8", errors="strict"))
        assert isinstance(reply.parsed, target)
        structured.validate(json.loads(text), structured.schema_of(target))
    assert finished >= 15


# -- hostile and odd schemas ---------------------------------------------------------


def _within(seconds: float, fn, *args, **kwargs):
    """``fn(*args, **kwargs)``'s result, or a failure if it is not back within ``seconds``."""
    import threading

    out: dict = {}

    def run() -> None:
        try:
            out["value"] = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            out["error"] = exc

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert not worker.is_alive(), f"still running after {seconds} s"
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_schemas_never_make_validation_fetch_a_url(tiny_model) -> None:
    import http.server
    import threading

    hits: list[str] = []

    class Recorder(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            hits.append(self.path)
            body = b'{"type": "string"}'
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/s.json"
    try:
        for schema in ({"$dynamicRef": url},
                       {"type": "object", "properties": {"a": {"type": "integer"}}, "x-extra": {"$ref": url}},
                       {"$id": url, "type": "object", "properties": {"a": {"$ref": "s.json"}}},
                       {"$schema": url, "type": "object"},
                       {"type": "array", "items": {"$dynamicRef": url}}):
            with pytest.raises(ConfigError):
                tiny_model.ask("?", schema=schema, max_tokens=20)
        for schema in ({"$dynamicRef": url}, {"$ref": url}, {"allOf": [{"$ref": url}]}):
            with pytest.raises(ValueError):  # straight to validation, past check_schema
                structured.validate("x", schema)
        assert structured.constraint({"$schema": "https://json-schema.org/draft/2020-12/schema",
                                      "type": "object"}) is not None  # a dialect jsonschema knows
    finally:
        server.shutdown()
        server.server_close()
    assert hits == []


@pytest.mark.parametrize("pattern", ["^[a-z]{1,4}]$", "^a}$", "^[a-z]{1,3}}]$"])
def test_stray_closing_brackets_in_a_pattern_are_literals(tiny_model, pattern) -> None:
    import re

    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    made = _within(10, structured.constraint, schema)
    assert made is not None
    for seed in range(3):
        reply = tiny_model.ask("?", schema=schema, seed=seed, max_tokens=60)
        if reply.finish_reason == "stop":
            assert reply.parse_error is None and re.fullmatch(pattern[1:-1], reply.parsed["s"]), str(reply)


def test_validating_a_catastrophic_pattern_takes_no_time(tiny_model) -> None:
    import subprocess
    import sys

    schema = {"type": "string", "const": "a" * 40 + "!", "pattern": "^(a+)+$"}
    code = ("from gguf_mcv.output import structured\n"
            f"schema = {schema!r}\n"
            "for check in (structured.validate,):\n"
            "    try:\n"
            "        check(schema['const'], schema)\n"
            "    except ValueError:\n"
            "        pass\n"
            "    else:\n"
            "        raise SystemExit('matched')\n")
    subprocess.run([sys.executable, "-c", code], timeout=30, check=True)
    reply = _within(30, tiny_model.ask, "?", schema=schema, seed=0, max_tokens=60)
    assert reply.parsed is None and reply.parse_error


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 100_000_000}}},
    {"type": "array", "items": {"type": "integer"}, "maxItems": 10_000_000},
    {"type": "array", "items": {"type": "string", "maxLength": 9000}, "minItems": 9000, "maxItems": 9000},
    {"type": "string", "pattern": "^(a{1000}){1000}$"},
])
def test_amplifying_schemas_are_refused_at_once(schema) -> None:
    start = time.monotonic()
    with pytest.raises(ConfigError, match=r"at most"):
        structured.constraint(schema)
    assert time.monotonic() - start < 30  # generous: expanding any of these takes minutes or all memory


def test_numbers_stay_finite(tiny_model) -> None:
    schema = {"type": "array", "items": {"type": "number"}}
    for seed in range(20):
        reply = tiny_model.ask("?", schema=schema, seed=seed, max_tokens=120)
        if reply.parse_error is None and reply.finish_reason == "stop":
            assert all(math.isfinite(x) for x in reply.parsed), str(reply)
    for schema in ({"const": 1e999}, {"type": "object", "properties": {"n": {"enum": [float("nan")]}}}):
        with pytest.raises(ConfigError, match="JSON cannot carry"):
            tiny_model.ask("?", schema=schema)
    made = structured.constraint({"type": "array", "items": {"type": "number"}})
    assert made is not None
    for text in ("[Infinity]", "[1e999]", "[NaN]"):
        value, why = made.parse(text)
        assert value is None and why


@pytest.mark.parametrize("pattern, check", [
    ("^.{5}$", lambda s: len(s) == 5),
    ("^\\d{2}\\w\\s[^a-z]$", lambda s: len(s) == 5 and s[:2].isdigit()),
    ('^["\\\\]{2}$', lambda s: set(s) <= {'"', "\\"} and len(s) == 2),
])
def test_pattern_answers_are_json_and_match(tiny_model, pattern, check) -> None:
    import re

    schema = {"type": "object", "properties": {"s": {"type": "string", "pattern": pattern}}, "required": ["s"]}
    for seed in range(8):
        reply = tiny_model.ask("?", schema=schema, seed=seed, max_tokens=60)
        assert reply.finish_reason == "stop" and reply.parse_error is None, (seed, str(reply), reply.parse_error)
        assert re.search(pattern, reply.parsed["s"]) and check(reply.parsed["s"]), str(reply)


def test_anchors_inside_a_pattern_are_refused(tiny_model) -> None:
    with pytest.raises(ConfigError, match=r"\$\.properties\.s\.pattern"):
        tiny_model.ask("?", schema={"type": "object", "properties": {"s": {"type": "string", "pattern": "^a|$"}}})


@pytest.mark.parametrize("schema", [
    {"type": "number", "minimum": -10**400, "maximum": 10**400},
    {"type": "object", "properties": {'a"b\\c': {"type": "boolean"}, "n\u0000l": {"type": "boolean"},
                                      "t\tab": {"type": "boolean"}}, "required": ['a"b\\c', "n\u0000l", "t\tab"]},
    {"type": "object", "properties": {"x": {"$ref": "#/definitions/X"}}, "required": ["x"],
     "definitions": {"X": {"type": "string", "pattern": "^\\w{1,4}$"}}},
])
def test_odd_but_valid_schemas_give_valid_answers(tiny_model, schema) -> None:
    finished = 0
    for seed in range(4):
        reply = tiny_model.ask("?", schema=schema, seed=seed, max_tokens=80)
        if reply.finish_reason == "stop":
            finished += 1
            assert reply.parse_error is None, (seed, str(reply), reply.parse_error)
            structured.validate(reply.parsed, schema)
    assert finished
