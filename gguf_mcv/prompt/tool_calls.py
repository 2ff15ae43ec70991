"""Tool calling: declared functions → a prompt, a grammar for the call, and the calls read back.

Tools are OpenAI-style ``{"type": "function", "function": {"name", "description",
"parameters"}}`` dicts (Ollama sends the same shape). They are described to the model
in a system turn the way Qwen2.5/Qwen3 templates (MiniCPM-V 4.x) do — ``<tools>`` with
one JSON signature per line, calls as ``<tool_call>{"name": …, "arguments": …}</tool_call>``,
results as ``<tool_response>`` in a user turn — whatever the GGUF's template (this
prompt is the fallback for every template; the template's own tools block is not used).
The call is generated under a grammar that admits only the declared names with their
argument schemas: from the first token when a call is required, else once the model
has written ``<tool_call>``. One call per answer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from ..errors import ConfigError
from ..output import structured

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
#: Tools per request, and their JSON size in all: each becomes grammar rules and prompt text.
MAX_TOOLS = 128
MAX_TOOLS_BYTES = 2 * structured.MAX_SCHEMA_BYTES
_CALL_BLOCK = re.compile(re.escape(CALL_OPEN) + r"\s*(.*?)\s*" + re.escape(CALL_CLOSE), re.S)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made: its id, the function's name and its arguments."""

    id: str
    name: str
    arguments: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The OpenAI ``tool_calls`` entry (arguments as a JSON string)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.dumps(self.arguments)}}


@dataclass(frozen=True)
class Toolbox:
    """Checked tools and the choice: ``auto`` (the model decides), ``required`` or one ``name``."""

    functions: tuple[dict[str, Any], ...]
    choice: str = "auto"

    @property
    def names(self) -> list[str]:
        return [f["name"] for f in self.functions]

    def system_prompt(self) -> str:
        """The tools block of the system turn."""
        lines = "\n".join(json.dumps({"type": "function", "function": f}, ensure_ascii=False)
                          for f in self.functions)
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                f"<tools>\n{lines}\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')

    def constraint(self) -> structured.Constraint:
        """The grammar of one call: the tag, a declared name with its arguments, the closing tag."""
        required = self.choice != "auto"
        json_rules = structured.schema_grammar(self.call_schema()).replace("root ::= ", "tool-call-json ::= ", 1)
        opening = f'"{CALL_OPEN}" ' if required else ""
        root = f'root ::= {opening}"\\n"? tool-call-json "\\n"? "{CALL_CLOSE}"'
        return structured.Constraint(f"{json_rules}\n{root}", json=False,
                                     after=None if required else CALL_OPEN, tools=self)

    def call_schema(self) -> dict[str, Any]:
        """A JSON schema admitting ``{"name": n, "arguments": …}`` for the allowed functions."""
        allowed = [f for f in self.functions if self.choice in ("auto", "required", f["name"])]
        defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
        alternatives = []
        for f in allowed:
            parameters = dict(f.get("parameters") or {"type": "object", "properties": {}})
            for where in defs:  # "#/$defs/X" in the parameters points at the call schema's root
                for key, value in (parameters.pop(where, None) or {}).items():
                    if key in defs[where] and defs[where][key] != value:
                        raise ConfigError(f"Two tools define a different {key!r} in {where}: rename one.")
                    defs[where][key] = value
            alternatives.append({"type": "object", "properties": {"name": {"const": f["name"]},
                                 "arguments": parameters}, "required": ["name", "arguments"]})
        schema: dict[str, Any] = {"anyOf": alternatives} if len(alternatives) > 1 else alternatives[0]
        return {**schema, **{where: found for where, found in defs.items() if found}}

    def calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """The answer's text without its call blocks, and the calls to declared functions in it."""
        rest, found, _ = self.read(text)
        return rest, found

    def read(self, text: str) -> tuple[str, list[ToolCall], str | None]:
        """:meth:`calls`, and why a call block was left out (as ``parse_error`` says it): not
        JSON, an undeclared name, or arguments that do not match the function's parameters.
        Calls come back only when every block is a valid call."""
        found, problem = [], None
        for block in _CALL_BLOCK.findall(text):
            call, why = self._call(block)
            if call is None:
                problem = problem or why
            else:
                found.append(call)
        if problem is not None:
            return text, [], problem
        return _CALL_BLOCK.sub("", text).strip() if found else text, found, None

    def _call(self, block: str) -> tuple[ToolCall | None, str]:
        try:
            value = structured.parse_json(block)
        except ValueError as exc:
            return None, f"A tool call is not valid JSON ({exc})."
        if not isinstance(value, dict) or value.get("name") not in self.names:
            return None, f"A tool call names no declared function ({str(value)[:60]})."
        arguments = value.get("arguments")
        parameters = next(f for f in self.functions if f["name"] == value["name"])["parameters"]
        try:
            structured.validate(arguments, parameters)
        except ValueError as exc:
            return None, f"The arguments of the call to {value['name']} do not match its parameters: {exc}"
        if not isinstance(arguments, dict):
            return None, f"The arguments of the call to {value['name']} are not an object."
        return ToolCall("call_" + uuid.uuid4().hex[:24], value["name"], arguments), ""


def toolbox(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any = None) -> Toolbox | None:
    """Checked tools (None when there are none, or ``tool_choice`` is ``"none"``); ConfigError
    naming the tool and the part at fault otherwise."""
    if not tools or tool_choice == "none":
        return None
    if isinstance(tools, (str, bytes, Mapping)) or not isinstance(tools, Sequence):
        raise ConfigError("tools must be a list of {'type': 'function', 'function': {...}} dicts.")
    if len(tools) > MAX_TOOLS:
        raise ConfigError(f"{len(tools)} tools given; at most {MAX_TOOLS}.")
    try:
        size = len(json.dumps(list(tools)))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"tools are not JSON: {exc}.") from None
    if size > MAX_TOOLS_BYTES:
        raise ConfigError(f"The tools are {size} bytes as JSON; at most {MAX_TOOLS_BYTES} are allowed.")
    functions = tuple(_function(tool, i) for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise ConfigError(f"Tool names must be unique: {names}.")
    return Toolbox(functions, _choice(tool_choice, names))


def _function(tool: Any, index: int) -> dict[str, Any]:
    spec = tool.get("function") if isinstance(tool, Mapping) else None
    if not isinstance(spec, Mapping) or tool.get("type", "function") != "function":
        raise ConfigError(f"tools[{index}] must be {{'type': 'function', 'function': {{'name': ..., "
                          "'parameters': {...}}}}.")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(f"tools[{index}].function.name must be 1-64 letters, digits, '_', '.' or '-', "
                          f"not {name!r}.")
    parameters = spec.get("parameters")
    if parameters is None or parameters == {}:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise ConfigError(f"tools[{index}] ({name}).function.parameters must be a JSON schema of an object "
                          f"(type 'object'), not {parameters!r:.60}.")
    try:
        structured.check_schema(parameters)
    except ConfigError as exc:
        raise ConfigError(f"tools[{index}] ({name}): {exc}") from None
    description = spec.get("description")
    return {"name": name, **({"description": str(description)} if description else {}),
            "parameters": parameters}


def _choice(choice: Any, names: list[str]) -> str:
    if choice in (None, "auto", "required"):
        return choice or "auto"
    name: Any = None
    if isinstance(choice, Mapping):
        function = choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else choice.get("name")
    if not isinstance(name, str):
        raise ConfigError(f"tool_choice must be 'auto', 'none', 'required' or "
                          f"{{'type': 'function', 'function': {{'name': ...}}}}, not {choice!r:.80}.")
    if name not in names:
        raise ConfigError(f"tool_choice names {name!r}, which is not among the tools ({', '.join(names)}).")
    return name


def plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI/Ollama tool messages as the turns the prompt shows: an assistant's ``tool_calls``
    as call blocks in its text, a ``tool`` result as a ``<tool_response>`` user turn."""
    plain = []
    for message in messages:
        if not isinstance(message, Mapping):
            plain.append(message)
            continue
        role = message.get("role")
        if role == "tool":
            plain.append({"role": "user", "content": f"<tool_response>\n{_text(message.get('content'))}\n"
                                                      "</tool_response>"})
        elif role == "assistant" and message.get("tool_calls"):
            calls = message["tool_calls"]
            if not isinstance(calls, (list, tuple)):
                raise ConfigError("An assistant message's tool_calls must be a list of calls.")
            blocks = "\n".join(render_call(call) for call in calls)
            text = _text(message.get("content"))
            plain.append({"role": "assistant", "content": f"{text}\n{blocks}".strip()})
        else:
            plain.append({k: v for k, v in message.items() if k != "tool_calls"})
    return plain


def render_call(call: Any) -> str:
    """A call (a :class:`ToolCall`, or an OpenAI/Ollama ``tool_calls`` entry) as the model writes it."""
    name: Any
    arguments: Any
    if isinstance(call, ToolCall):
        name, arguments = call.name, call.arguments
    else:
        function = call.get("function") if isinstance(call, Mapping) else None
        if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
            raise ConfigError(f"A tool call must be {{'function': {{'name': ..., 'arguments': {{...}}}}}}, "
                              f"not {call!r:.80}.")
        name, arguments = function["name"], function.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except ValueError:
                raise ConfigError(f"The arguments of tool call {name!r} are not JSON.") from None
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CALL_CLOSE}"


def prompt_messages(messages: Any, box: Toolbox | None) -> Any:
    """OpenAI/Ollama ``messages`` as the prompt shows them: tool calls and results as turns
    (:func:`plain_messages`) and, with ``box``, its tools block in the system message. Anything
    but a list or tuple is returned as it is (the message converter refuses it)."""
    if not isinstance(messages, (list, tuple)):
        return messages
    plain = plain_messages(messages)
    return with_tools_prompt(plain, box) if box is not None else plain


def with_tools_prompt(messages: list[dict[str, Any]], box: Toolbox) -> list[dict[str, Any]]:
    """``messages`` with the tools block added to (or as) the system message."""
    if messages and messages[0].get("role") == "system" and isinstance(messages[0].get("content"), str):
        head = {**messages[0], "content": f"{messages[0]['content']}\n\n{box.system_prompt()}"}
        return [head, *messages[1:]]
    return [{"role": "system", "content": box.system_prompt()}, *messages]


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return json.dumps(content, ensure_ascii=False)
