"""Tool calling on the random-weight tiny model: the grammar admits only declared calls."""

from __future__ import annotations

import json

import pytest

from gguf_mcv.errors import ConfigError
from gguf_mcv.prompt import tool_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "pattern": "^[a-z]{1,8}$"}, "unit": {"enum": ["c", "f"]}},
        "required": ["city"]}}}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]


def test_a_required_call_is_always_a_declared_function_with_valid_arguments(tiny_model) -> None:
    for seed in range(6):
        reply = tiny_model.chat_completion([{"role": "user", "content": "Weather?"}], tools=TOOLS,
                                           tool_choice="required", seed=seed, max_tokens=100)
        assert reply.finish_reason == "tool_calls" and len(reply.tool_calls) == 1, str(reply)
        call = reply.tool_calls[0]
        assert call.name in ("get_weather", "now")
        if call.name == "get_weather":
            assert set(call.arguments) <= {"city", "unit"} and call.arguments["city"].isalpha()


def test_a_named_tool_choice_calls_that_function(tiny_model) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    reply = tiny_model.chat_completion([{"role": "user", "content": "?"}], tools=TOOLS, tool_choice=choice,
                                       seed=1, max_tokens=100)
    assert [c.name for c in reply.tool_calls] == ["get_weather"]


def test_a_round_trip_in_a_chat_reuses_the_cache(tiny_model) -> None:
    chat = tiny_model.chat(system="Use the tools.")
    call = chat.send("Weather in Paris?", tools=TOOLS, tool_choice="required", seed=2, max_tokens=100)
    assert call.tool_calls
    answer = chat.send(json.dumps({"temperature": 21}), tools=TOOLS, tool_choice="none",
                       tool_result=True, seed=3, max_tokens=8)
    assert not answer.tool_calls and answer.finish_reason in ("stop", "length")
    assert "<tool_call>" in chat.history[1]["content"]
    assert "<tool_response>" in chat.history[2]["content"]


def test_tool_messages_come_back_as_turns(tiny_model) -> None:
    first = tiny_model.chat_completion([{"role": "user", "content": "Now?"}], tools=TOOLS,
                                       tool_choice="required", seed=4, max_tokens=100)
    messages = [{"role": "user", "content": "Now?"},
                {"role": "assistant", "content": None, "tool_calls": [c.openai() for c in first.tool_calls]},
                {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": "12:00"}]
    reply = tiny_model.chat_completion(messages, tools=TOOLS, seed=5, max_tokens=6)
    assert reply.usage.cached_tokens > 0


@pytest.mark.parametrize("given, choice, message", [
    ([{"type": "function", "function": {"name": "bad name!"}}], None, "function.name"),
    ([{"type": "retrieval"}], None, "tools[0]"),
    ([WEATHER, WEATHER], None, "unique"),
    (TOOLS, {"type": "function", "function": {"name": "missing"}}, "not among the tools"),
    (TOOLS, "sometimes", "tool_choice"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}], None, "tools[0] (f)"),
])
def test_bad_tools_are_config_errors(tiny_model, given, choice, message) -> None:
    with pytest.raises(ConfigError) as err:
        tiny_model.chat_completion([{"role": "user", "content": "?"}], tools=given, tool_choice=choice)
    assert message in str(err.value)


def test_calls_are_read_back_only_for_declared_names() -> None:
    box = tool_calls.toolbox(TOOLS)
    assert box is not None
    text, calls = box.calls('Sure. <tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>')
    assert text == "Sure." and [c.name for c in calls] == ["now"]
    assert box.calls('<tool_call>{"name": "rm", "arguments": {}}</tool_call>')[1] == []


# -- arguments checked, bad tools refused ---------------------------------------------

COUNT = {"type": "function", "function": {"name": "count", "parameters": {"type": "object", "properties": {
    "n": {"type": "integer", "minimum": 0, "maximum": 5},
    "xs": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 3}, "uniqueItems": True,
           "maxItems": 4},
    "x": {"type": "number"}}, "required": ["n", "xs"]}}}


@pytest.mark.parametrize("arguments", ['{"n": 9, "xs": []}', '{"n": 1, "xs": [2, 2]}', '{"xs": []}', "[1]",
                                       '{"n": 1, "xs": [], "x": Infinity}', '{"n": 1, "xs": [], "x": 1e999}'])
def test_calls_whose_arguments_break_the_parameters_are_not_calls(arguments) -> None:
    box = tool_calls.toolbox([COUNT])
    assert box is not None
    text = f'<tool_call>{{"name": "count", "arguments": {arguments}}}</tool_call>'
    rest, calls, problem = box.read(text)
    assert calls == [] and rest == text and problem
    assert box.read('<tool_call>{"name": "count", "arguments": {"n": 5, "xs": [0, 3]}}</tool_call>')[1]


def test_every_call_the_model_makes_has_valid_arguments_or_says_why(tiny_model) -> None:
    from gguf_mcv.output import structured

    calls = 0
    for seed in range(8):
        reply = tiny_model.chat_completion([{"role": "user", "content": "Count."}], tools=[COUNT],
                                           tool_choice="required", seed=seed, max_tokens=120)
        if reply.finish_reason == "tool_calls":
            calls += 1
            assert reply.parse_error is None
            for call in reply.tool_calls:
                structured.validate(call.arguments, COUNT["function"]["parameters"])
                assert len(set(call.arguments["xs"])) == len(call.arguments["xs"])
        else:
            assert not reply.tool_calls and (reply.finish_reason == "length" or reply.parse_error), str(reply)
    assert calls


def test_tool_parameters_may_use_definitions(tiny_model) -> None:
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"c": {"$ref": "#/definitions/Colour"}}, "required": ["c"],
        "definitions": {"Colour": {"enum": ["red", "blue"]}}}}}
    for seed in range(3):
        reply = tiny_model.chat_completion([{"role": "user", "content": "?"}], tools=[tool], tool_choice="required",
                                           seed=seed, max_tokens=150)
        assert reply.finish_reason == "tool_calls" and reply.tool_calls[0].arguments["c"] in ("red", "blue")


@pytest.mark.parametrize("given, choice, message", [
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}], None, "parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], None, "parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "x"}}], None, "parameters"),
    ([{"type": "function", "function": {"name": "f\n"}}], None, "function.name"),
    (TOOLS, {"type": "function", "function": "get_weather"}, "tool_choice"),
    (TOOLS, {"type": "function", "function": None}, "tool_choice"),
    ([NOW] * 1000, None, "at most"),
])
def test_more_bad_tools_are_config_errors(tiny_model, given, choice, message) -> None:
    with pytest.raises(ConfigError) as err:
        tiny_model.chat_completion([{"role": "user", "content": "?"}], tools=given, tool_choice=choice)
    assert message in str(err.value)


@pytest.mark.parametrize("tool_calls", ["x", 5, [{"function": "x"}], [{"function": {"arguments": {}}}], [None]])
def test_malformed_tool_calls_in_messages_are_config_errors(tiny_model, tool_calls) -> None:
    messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": tool_calls},
                {"role": "tool", "content": "1"}]
    with pytest.raises(ConfigError, match="tool"):
        tiny_model.chat_completion(messages, tools=TOOLS, max_tokens=4)
