"""Answers a program can use: a JSON schema (or ``format="json"``) → a llama.cpp grammar → the parsed value.

A :class:`Constraint` is made once per question, before anything is evaluated: the
schema (a dict, a pydantic model class or a dataclass) is checked keyword by
keyword, converted to GBNF by llama-cpp-python's own converter
(``llama_cpp.llama_grammar.SchemaConverter``) and, after generation, parses and
validates the answer. The converter does not enforce numeric bounds or most formats;
this module adds them (digit-wise ranges from :mod:`gguf_mcv.output.ranges`, formats from
:mod:`gguf_mcv.output.formats`; see :class:`_Converter`), everything else is the converter's.
Keywords the grammar cannot enforce but validation checks (:data:`CHECKED_AFTER`) are
named in a :class:`SchemaWarning` when the schema is given.

Validation: pydantic for model classes and dataclasses; ``jsonschema`` for dict
schemas (with a registry that retrieves nothing, patterns matched in linear time by
:mod:`gguf_mcv.output.patterns`, and the formats of :mod:`gguf_mcv.output.formats` checked).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import warnings
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Iterator

from ..errors import ConfigError
from . import formats, patterns, ranges

#: A schema larger than this (as JSON) is a mistake, not a request.
MAX_SCHEMA_BYTES = 64 * 1024
#: Nesting of dicts and lists in a schema (pydantic models nest a handful of levels).
MAX_DEPTH = 48
#: A grammar larger than this makes every sampled token slow (llama.cpp walks it per token).
MAX_GRAMMAR_BYTES = 256 * 1024
#: minLength, maxLength, minItems and maxItems, each and all together: the converter spells
#: every counted repetition out, and a count of 1e8 took gigabytes before any limit applied.
MAX_COUNT = 10_000
MAX_COUNTS_TOTAL = 20_000

#: A character inside a JSON string, as llama.cpp's own converter (C++) spells it, and only
#: Unicode scalar values, raw or escaped (llama.cpp's grammar decodes surrogates and code
#: points past U+10FFFF; a "\\uD800" escape is a lone surrogate Python keeps but pydantic refuses).
JSON_CHAR = r'[^"\\\x7F\x00-\x1F\uD800-\uDFFF\U00110000-\U001FFFFF] | ' + patterns.JSON_ESCAPE
#: The converter's primitives replaced here: strings without raw control characters (strict
#: JSON parsers refuse them) and numbers whose exponent stays finite (at most 99).
_PRIMITIVES = {
    "char": (JSON_CHAR, []),
    "number": ('("-"? integral-part) ("." decimal-part)? ([eE] [-+]? [0-9]{1,2})? space',
               ["integral-part", "decimal-part"]),
}
_GBNF_LITERAL_ESCAPE = re.compile(r'[\x00-\x1F"\\\x7F]')
TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")
#: Keywords the grammar cannot enforce and that would change what a valid answer looks like
#: too much to leave to validation: refused rather than silently ignored.
UNSUPPORTED = frozenset({
    "not", "if", "then", "else", "patternProperties", "dependentRequired", "dependentSchemas",
    "dependencies", "minProperties", "maxProperties", "contains", "minContains",
    "maxContains", "propertyNames", "unevaluatedProperties", "unevaluatedItems", "additionalItems",
})
#: Keywords the grammar cannot enforce that validation checks: named in a SchemaWarning.
CHECKED_AFTER = frozenset({"multipleOf", "uniqueItems"})
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_COUNTS = ("minItems", "maxItems", "minLength", "maxLength")
#: Keywords whose values are data, not schemas: a "$ref" key inside them is just a name.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "description", "title"})
#: Keywords naming other documents; "$ref" is checked apart (it must point inside the schema).
_URL_KEYWORDS = ("$id", "$schema", "$dynamicRef", "$recursiveRef", "$dynamicAnchor", "$recursiveAnchor")
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
#: Keywords that decide a subschema's grammar before its type does (the converter's order).
_LEFT_TO_THE_CONVERTER = ("$ref", "anyOf", "oneOf", "const", "enum")


class SchemaWarning(UserWarning):
    """A schema keyword the grammar cannot enforce: an answer may break it, and then
    ``reply.parsed`` is None and ``reply.parse_error`` names the keyword."""


@dataclass(frozen=True)
class Constraint:
    """What an answer must look like: a GBNF ``grammar``, and how to read the answer back.

    ``schema`` is None for ``format="json"`` (any JSON object) and for a raw grammar;
    ``target`` is the pydantic model class or dataclass the parsed value becomes.
    """

    grammar: str
    schema: dict[str, Any] | None = None
    target: Any = None
    json: bool = True  #: the answer is JSON (False for a caller's own grammar)
    after: str | None = None  #: the grammar starts once this text was generated (a tool call's tag)
    tools: Any = None  #: the :class:`~gguf_mcv.prompt.tool_calls.Toolbox` whose calls the answer may hold
    #: what the grammar does not enforce ("multipleOf at $.properties.n"), checked only after
    unenforced: tuple[str, ...] = ()

    def parse(self, text: str, finish_reason: str = "stop") -> tuple[Any, str | None]:
        """``(value, None)`` for a valid answer, ``(None, why)`` otherwise; never half a value."""
        if not self.json:
            return None, None
        cut = ("The answer was cut off by max_tokens (or the context) before its JSON was complete: "
               "raise max_tokens.")
        try:
            value = parse_json(text)
        except ValueError as exc:
            if finish_reason == "length":
                return None, cut
            return None, f"The answer is not valid JSON ({exc}); was it cut by a stop string?"
        if finish_reason == "length" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return None, cut  # a number cut short still parses (and may even validate)
        try:
            return self._validated(value), None
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            why = f"The answer does not match the schema: {exc}"
            if self.unenforced:
                why += (f" (the grammar cannot enforce {'; '.join(self.unenforced)}: those are checked only "
                        "after generation)")
            return None, why

    def _validated(self, value: Any) -> Any:
        if self.target is not None:
            return _type_adapter(self.target).validate_python(value)
        if self.schema is not None:
            validate(value, self.schema)
        elif not isinstance(value, dict):
            raise ValueError("format='json' asks for a JSON object")
        return value


def parse_json(text: str) -> Any:
    """``text`` as JSON, as answers are read: ValueError for invalid JSON and for numbers that
    are not finite (``NaN``, ``Infinity``, ``1e999``)."""
    return json.loads(text, parse_constant=_not_finite, parse_float=_finite_float)


def _not_finite(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text:.40} is too large for a number")
    return value


def constraint(schema: Any = None, format: str | dict[str, Any] | None = None) -> Constraint | None:
    """The constraint for ``schema`` (dict, pydantic model class or dataclass) or ``format``.

    ``format`` is ``"json"`` (any JSON object), a schema dict (as Ollama sends it) or
    None. Raises :class:`ConfigError` naming the offending part of an invalid schema.
    """
    if schema is not None and format not in (None, ""):
        raise ConfigError("Give schema= or format=, not both (a schema already implies JSON).")
    if isinstance(format, dict):
        schema, format = format, None
    if schema is None:
        if format in (None, ""):
            return None
        if format != "json":
            raise ConfigError(f"format must be 'json' or a JSON schema, not {format!r}.")
        return Constraint(schema_grammar({"type": "object"}))
    target = schema if isinstance(schema, type) else None
    as_dict = schema_of(schema)
    check_schema(as_dict)
    return Constraint(schema_grammar(as_dict), schema=as_dict, target=target, unenforced=unenforced(as_dict))


def grammar_constraint(grammar: Any) -> Constraint:
    """A caller's own GBNF (a string or a ``llama_cpp.LlamaGrammar``); the answer is not parsed."""
    text = getattr(grammar, "_grammar", grammar)
    if not isinstance(text, str) or not text.strip():
        raise ConfigError("grammar must be GBNF text or a llama_cpp.LlamaGrammar.")
    if len(text.encode()) > MAX_GRAMMAR_BYTES:
        raise ConfigError(f"The grammar is larger than {MAX_GRAMMAR_BYTES} bytes.")
    return Constraint(text, json=False)


def schema_of(schema: Any) -> dict[str, Any]:
    """The JSON schema of a dict, a pydantic model class or a dataclass."""
    if isinstance(schema, dict):
        return schema
    if isinstance(schema, type) and (hasattr(schema, "model_json_schema") or dataclasses.is_dataclass(schema)):
        try:
            return _type_adapter(schema).json_schema()
        except ConfigError:
            raise
        except Exception as exc:  # pydantic refuses some types (callables, arbitrary classes)
            raise ConfigError(f"pydantic cannot make a JSON schema of {schema.__name__}: {exc}") from None
    raise ConfigError(f"schema must be a JSON-schema dict, a pydantic model class or a dataclass, "
                      f"not {type(schema).__name__}.")


def _type_adapter(target: type) -> Any:
    from pydantic import TypeAdapter  # lazy: only model-class and dataclass schemas need it

    return TypeAdapter(target)


# -- checking a schema ------------------------------------------------------------


def check_schema(schema: dict[str, Any]) -> None:
    """Raise :class:`ConfigError` unless ``schema`` is one this module can turn into a grammar;
    warn (:class:`SchemaWarning`) naming each keyword the grammar will not enforce."""
    _check_shape(schema)
    try:
        size = len(json.dumps(schema))
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"The schema is not JSON: {exc}.") from None
    if size > MAX_SCHEMA_BYTES:
        raise ConfigError(f"The schema is {size} bytes as JSON; at most {MAX_SCHEMA_BYTES} are allowed.")
    _check_references(schema, "$", schema)
    counts = 0
    for path, node in _nodes(schema, "$"):
        _check_node(node, path, schema)
        counts += sum(node.get(key, 0) for key in _COUNTS)
    if counts > MAX_COUNTS_TOTAL:
        raise ConfigError(f"The schema's minLength, maxLength, minItems and maxItems add up to {counts} "
                          f"(at most {MAX_COUNTS_TOTAL}): the grammar spells each one out.")
    for what in unenforced(schema):
        warnings.warn(f"The grammar cannot enforce {what}: an answer may break it, and is then not parsed "
                      "(reply.parse_error says why).", SchemaWarning, stacklevel=3)


def unenforced(schema: dict[str, Any]) -> tuple[str, ...]:
    """What in a checked ``schema`` the grammar does not enforce, each named with its path
    (``"multipleOf at $.properties.n"``): :data:`CHECKED_AFTER` keywords and unknown formats."""
    found = []
    for path, node in _nodes(schema, "$"):
        found += [f"{key} at {path}" for key in sorted(CHECKED_AFTER & node.keys())]
        kind = node.get("format")
        if kind is None or node.get("type") not in (None, "string"):
            continue
        if kind not in formats.GRAMMARS:
            found.append(f"format {kind!r} at {path} (neither written nor checked)")
        elif "pattern" in node or "minLength" in node or "maxLength" in node:
            found.append(f"format {kind!r} beside pattern/minLength/maxLength at {path} (the format is checked only)")
    return tuple(found)


def _check_shape(value: Any) -> None:
    """Bounded nesting and finite numbers, checked without recursion (a hostile schema may
    nest thousands deep)."""
    stack = [(value, 1, "$")]
    while stack:
        item, depth, path = stack.pop()
        if depth > MAX_DEPTH:
            raise ConfigError(f"The schema nests deeper than {MAX_DEPTH} levels.")
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"The schema at {path} holds {item}, which JSON cannot carry: use a finite number.")
        if isinstance(item, dict):
            stack.extend((child, depth + 1, f"{path}.{key}") for key, child in item.items())
        elif isinstance(item, list):
            stack.extend((child, depth + 1, f"{path}[{i}]") for i, child in enumerate(item))


def _check_references(node: Any, path: str, root: dict[str, Any]) -> None:
    """Every ``$ref`` anywhere (not only where :func:`_nodes` looks) points inside the schema,
    and nothing names another document: validation must never fetch a URL."""
    if isinstance(node, list):
        for i, item in enumerate(node):
            _check_references(item, f"{path}[{i}]", root)
        return
    if not isinstance(node, dict):
        return
    if "$ref" in node:
        _resolve(node["$ref"], root, path)
    for key in _URL_KEYWORDS:
        if key in node and not _known_dialect(key, node[key]):
            raise ConfigError(f"{path}.{key} ({node[key]!r:.80}) names another document or a dynamic "
                              "reference, which is not supported: use $ref to '#/$defs/Name' inside the schema.")
    for key, child in node.items():
        if key not in _DATA_KEYWORDS:
            _check_references(child, f"{path}.{key}", root)


def _known_dialect(key: str, value: Any) -> bool:
    """A ``$schema`` naming a JSON Schema draft jsonschema knows without fetching it."""
    if key != "$schema" or not isinstance(value, str):
        return False
    return value.rstrip("#") in {
        "http://json-schema.org/draft-04/schema", "http://json-schema.org/draft-06/schema",
        "http://json-schema.org/draft-07/schema", "https://json-schema.org/draft/2019-09/schema",
        "https://json-schema.org/draft/2020-12/schema"}


def _nodes(node: Any, path: str) -> Iterator[tuple[str, Any]]:
    """Every subschema in ``node`` with its path (``$.properties.name``), ``node`` first."""
    yield path, node
    if not isinstance(node, dict):
        return
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield from _nodes(sub, f"{path}.{key}.{name}")
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield from _nodes(sub, f"{path}.{key}[{i}]")
    items = node.get("items")
    if isinstance(items, list):
        for i, sub in enumerate(items):
            yield from _nodes(sub, f"{path}.items[{i}]")
    elif items is not None:
        yield from _nodes(items, f"{path}.items")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _nodes(node["additionalProperties"], f"{path}.additionalProperties")


def _check_node(node: Any, path: str, root: dict[str, Any]) -> None:
    if not isinstance(node, dict):
        raise ConfigError(f"The schema at {path} must be an object (a dict), not {type(node).__name__} "
                          f"{node!r:.40}.")
    unsupported = sorted(UNSUPPORTED & node.keys())
    if unsupported:
        raise ConfigError(f"The schema at {path} uses {', '.join(unsupported)}, which the grammar cannot "
                          "enforce: remove it (and check that rule in your code).")
    _check_type(node.get("type", "object"), path)
    for key in _SUBSCHEMA_MAPS:
        if key in node and not isinstance(node[key], dict):
            raise ConfigError(f"{path}.{key} must map names to schemas.")
    for key in (*_SUBSCHEMA_LISTS, "enum"):
        if key in node and (not isinstance(node[key], list) or not node[key]):
            raise ConfigError(f"{path}.{key} must be a non-empty list.")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ConfigError(f"{path}.required must be a list of property names.")
    if "additionalProperties" in node and not isinstance(node["additionalProperties"], (bool, dict)):
        raise ConfigError(f"{path}.additionalProperties must be true, false or a schema.")
    _check_numbers(node, path)
    if "pattern" in node:
        patterns.check(node["pattern"], path)


def _check_type(kind: Any, path: str) -> None:
    kinds = kind if isinstance(kind, list) else [kind]
    if not kinds or not all(isinstance(k, str) and k in TYPES for k in kinds):
        raise ConfigError(f"{path}.type must be one of {', '.join(TYPES)} (or a list of them), not {kind!r}.")


def _check_numbers(node: dict[str, Any], path: str) -> None:
    for key in _COUNTS:
        if key in node and (isinstance(node[key], bool) or not isinstance(node[key], int) or node[key] < 0):
            raise ConfigError(f"{path}.{key} must be a non-negative integer, not {node[key]!r}.")
        if node.get(key, 0) > MAX_COUNT:
            raise ConfigError(f"{path}.{key} is {node[key]}; at most {MAX_COUNT} (the grammar spells every "
                              "repetition out).")
    for low, high in (("minItems", "maxItems"), ("minLength", "maxLength")):
        if node.get(low, 0) > node.get(high, math.inf):
            raise ConfigError(f"{path}: {low} is larger than {high}, so no value can match.")
    for key in (k for k in _BOUNDS if k in node):
        if not ranges.is_finite_bound(node[key]):
            raise ConfigError(f"{path}.{key} must be a finite number, not {node[key]!r:.40}.")
    declared = node.get("type")
    kinds: list[Any] = declared if isinstance(declared, list) else [declared]
    for kind in ("integer", "number"):
        if kind in kinds and ranges.has_bounds({**node, "type": kind}):
            ranges.bounds_range({**node, "type": kind}, path)  # raises when no value fits
    if "multipleOf" in node and (not ranges.is_finite_bound(node["multipleOf"]) or node["multipleOf"] <= 0):
        raise ConfigError(f"{path}.multipleOf must be a positive number, not {node['multipleOf']!r:.40}.")
    if "format" in node and not isinstance(node["format"], str):
        raise ConfigError(f"{path}.format must be a string, not {node['format']!r:.40}.")


def _resolve(ref: Any, root: dict[str, Any], path: str) -> Any:
    if not isinstance(ref, str) or not ref.startswith("#/"):
        raise ConfigError(f"{path}.$ref must point inside the schema ('#/$defs/Name'), not {ref!r}.")
    target: Any = root
    for part in ref[2:].split("/"):
        part = part.replace("~1", "/").replace("~0", "~")
        if not isinstance(target, dict) or part not in target:
            raise ConfigError(f"{path}.$ref {ref!r} points to nothing in the schema.")
        target = target[part]
    return target


# -- schema → grammar -------------------------------------------------------------


def schema_grammar(schema: dict[str, Any]) -> str:
    """GBNF for ``schema`` from llama-cpp-python's converter (with numeric bounds enforced);
    the same schema again (the server converts before a request waits) is not converted again."""
    return _gbnf_of(json.dumps(schema))


@lru_cache(maxsize=64)
def _gbnf_of(text: str) -> str:
    from llama_cpp import llama_grammar

    converter = _converter_class(llama_grammar)(prop_order={}, allow_fetch=False, dotall=False,
                                                 raw_pattern=False)
    try:
        # a copy: the converter rewrites $ref values in place
        resolved = converter.resolve_refs(_root_inlined(json.loads(text)), "input")
        converter.visit(resolved, "")
        grammar = converter.format_grammar()
    except RecursionError:
        raise ConfigError("The schema refers to itself in a way the grammar converter cannot unfold.") from None
    except Exception as exc:  # the converter asserts and indexes freely on odd schemas
        raise ConfigError(f"This schema cannot be turned into a grammar: {type(exc).__name__}: {exc}"[:400]) from None
    if len(grammar) > MAX_GRAMMAR_BYTES:
        raise ConfigError(f"The schema makes a grammar of {len(grammar)} bytes (at most {MAX_GRAMMAR_BYTES}): "
                          "use fewer enum values, shorter bounded ranges or a smaller schema.")
    return grammar


def _root_inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with a ``$ref`` at its root replaced by what it points to (the converter
    does not look for further ``$ref``s beside a root one)."""
    for _ in range(8):
        if "$ref" not in schema:
            return schema
        target = _resolve(schema["$ref"], schema, "$")
        if not isinstance(target, dict):
            break
        defs: dict[str, Any] = {k: schema[k] for k in ("$defs", "definitions") if k in schema}
        schema = {**target, **defs}
    raise ConfigError("The schema's root $ref leads only to other $refs: point it at a real schema.")


_CONVERTER: type | None = None


def _converter_class(llama_grammar: Any) -> type:
    """llama-cpp-python's ``SchemaConverter``, taught numeric bounds (it leaves them as a TODO)."""
    global _CONVERTER
    if _CONVERTER is None:
        base = llama_grammar.SchemaConverter

        class _Converter(base):  # type: ignore[misc, valid-type]
            def _add_primitive(self, name: str, rule: Any) -> Any:
                for kind, (content, deps) in _PRIMITIVES.items():  # see _PRIMITIVES
                    if rule is llama_grammar.PRIMITIVE_RULES[kind]:  # at the root, name is "root"
                        rule = llama_grammar.BuiltinRule(content, deps)
                return super()._add_primitive(name, rule)

            def _format_literal(self, literal: str) -> str:
                # the port escapes only CR, LF and '"': a backslash or control character in a
                # property name or const would end or break the GBNF literal
                return '"' + _GBNF_LITERAL_ESCAPE.sub(lambda m: f"\\x{ord(m.group()):02X}", literal) + '"'

            def _visit_pattern(self, pattern: str, name: str) -> Any:
                # the port's own reader loops forever on a stray ']' or '}', lets '.' write raw
                # quotes and control characters, and knows no \d, \w or \s
                return self._add_rule(name, '"\\"" ' + patterns.to_gbnf(pattern) + ' "\\"" space')

            def visit(self, schema: Any, name: str) -> Any:
                if not isinstance(schema, dict) or any(k in schema for k in _LEFT_TO_THE_CONVERTER):
                    return super().visit(schema, name)
                rule_name = name + "-" if name in llama_grammar.RESERVED_NAMES else name or "root"
                kind = schema.get("type")
                if isinstance(kind, list):  # the port keeps only the type of each ({"type": t}), losing bounds
                    alternatives = [self.visit({**schema, "type": t}, f"{name}{'-' if name else ''}{t}") for t in kind]
                    return self._add_rule(rule_name, " | ".join(alternatives))
                rule = bounded_number_rule(schema)
                if rule is not None:
                    return self._add_rule(rule_name, rule)
                text_format = schema.get("format")
                if kind in (None, "string") and text_format in formats.GRAMMARS and "pattern" not in schema:
                    return self._add_rule(rule_name, f'"\\"" {formats.GRAMMARS[text_format]} "\\"" space')
                return super().visit(schema, name)

        _CONVERTER = _Converter
    return _CONVERTER


def bounded_number_rule(schema: dict[str, Any]) -> str | None:
    """A GBNF rule for an integer or number schema with bounds, None when it has none.

    Built digit by digit (:mod:`gguf_mcv.output.ranges`): a few dozen alternatives for any
    64-bit integer range; bounded numbers are written without an exponent. Raises
    :class:`ConfigError` when no value the grammar can write fits the bounds.
    """
    if not ranges.has_bounds(schema):
        return None
    return f"{ranges.range_rule(ranges.bounds_range(schema))} space"


# -- validating an answer ---------------------------------------------------------


def validate(value: Any, schema: dict[str, Any]) -> None:
    """Raise ``ValueError`` unless ``value`` matches ``schema`` (jsonschema, with a registry that
    retrieves nothing, ``pattern`` matched in linear time and the formats of
    :data:`gguf_mcv.output.formats.CHECKS` checked)."""
    import jsonschema  # lazy: only answers under a schema need it
    import referencing

    kind = jsonschema.validators.validator_for(schema)
    safe = jsonschema.validators.extend(kind, {"pattern": _pattern_keyword})
    checker = safe(schema, registry=referencing.Registry(), format_checker=_format_checker())
    try:
        error = jsonschema.exceptions.best_match(checker.iter_errors(value))
    except referencing.exceptions.Unresolvable as exc:  # never fetched: the registry retrieves nothing
        raise ValueError(f"The schema refers to {exc} outside itself") from None
    if error is not None:
        raise ValueError(error.message)


@lru_cache(maxsize=1)
def _format_checker() -> Any:
    return formats.format_checker()


def _pattern_keyword(validator: Any, pattern: str, instance: Any, schema: Any) -> Iterator[Any]:
    """jsonschema's ``pattern``, matched in linear time (its own runs ``re.search``)."""
    import jsonschema

    if validator.is_type(instance, "string") and not patterns.matches(pattern, instance):
        yield jsonschema.ValidationError(f"{instance!r:.60} does not match {pattern!r}")
