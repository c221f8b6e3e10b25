"""Tool schemas in OpenAI's function format, the response a tool returns, and the checks on both.

A tool schema is ``{"type": "function", "function": {"name", "description", "parameters"}}`` where
``parameters`` is a JSON Schema of an object (``properties``, ``required``). :func:`check_tool_schema`
refuses a malformed one at start-up (a shape check with messages in OpenAI's terms, then ``jsonschema``'s
check of ``parameters`` against the JSON Schema meta-schema); :func:`argument_problem` validates a call's
arguments with ``jsonschema`` at run time, so a wrong call becomes a one-line message to the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from posttrain.errors import ConfigError

__all__ = ["OpenAIFunctionToolSchema", "ToolResponse", "check_tool_schema", "argument_problem"]

_JSON_TYPES = ("string", "integer", "number", "boolean", "array", "object", "null")


@dataclass
class _FunctionView:
    name: str
    description: str
    parameters: dict


@dataclass
class OpenAIFunctionToolSchema:
    """A checked tool schema; ``.function.name`` as in verl, ``model_dump()`` gives the dict back."""

    raw: dict

    @property
    def function(self) -> _FunctionView:
        fn = self.raw["function"]
        return _FunctionView(fn["name"], fn.get("description", ""), fn.get("parameters") or {})

    def model_dump(self, **_: Any) -> dict:
        return copy.deepcopy(self.raw)

    @classmethod
    def from_dict(cls, schema: Any, where: str = "tool_schema") -> "OpenAIFunctionToolSchema":
        check_tool_schema(schema, where)
        return cls(copy.deepcopy(dict(schema)))


@dataclass
class ToolResponse:
    """What a tool's ``execute`` returns as its first element (a plain string is accepted too)."""

    text: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def of(cls, value: Any) -> "ToolResponse":
        """A ToolResponse from a ToolResponse, a string, a dict with ``text`` or anything with ``.text``."""
        if isinstance(value, ToolResponse):
            return value
        if isinstance(value, str):
            return cls(value)
        if isinstance(value, dict):
            return cls(str(value.get("text") or ""))
        text = getattr(value, "text", None)
        return cls(str(text) if text is not None else str(value))


def check_tool_schema(schema: Any, where: str) -> None:
    """ConfigError naming ``where`` and the field when ``schema`` is not an OpenAI function schema."""
    problem = _schema_problem(schema)
    if problem:
        raise ConfigError(f"{where}: {problem}; expected {{type: function, function: {{name, description, "
                          "parameters: {type: object, properties: {...}, required: [...]}}}}")


def _schema_problem(schema: Any) -> str | None:
    if not isinstance(schema, dict):
        return f"a tool schema must be a mapping, got {type(schema).__name__}"
    if schema.get("type") != "function":
        return f"type must be 'function', got {schema.get('type')!r}"
    fn = schema.get("function")
    if not isinstance(fn, dict):
        return "function must be a mapping"
    if not isinstance(fn.get("name"), str) or not fn["name"].strip():
        return "function.name must be a non-empty string"
    params = fn.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(params, dict):
        return "function.parameters must be a mapping"
    return _parameters_problem(params) or _meta_schema_problem(params)


def _parameters_problem(params: dict) -> str | None:
    if params.get("type", "object") != "object":
        return f"function.parameters.type must be 'object', got {params.get('type')!r}"
    props = params.get("properties", {})
    if not isinstance(props, dict):
        return "function.parameters.properties must be a mapping of argument name -> schema"
    for name, spec in props.items():
        if not isinstance(spec, dict):
            return f"function.parameters.properties.{name} must be a mapping (a JSON Schema)"
        types = spec.get("type")
        for t in types if isinstance(types, list) else ([types] if types is not None else []):
            if t not in _JSON_TYPES:
                return f"function.parameters.properties.{name}.type={t!r} is not a JSON Schema type ({', '.join(_JSON_TYPES)})"
    required = params.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "function.parameters.required must be a list of argument names"
    missing = [r for r in required if r not in props]
    if missing:
        return f"function.parameters.required names {missing}, which are not in properties ({sorted(props)})"
    return None


def _meta_schema_problem(params: dict) -> str | None:
    """``jsonschema``'s verdict on ``params`` as a JSON Schema (of the draft it declares, else 2020-12)."""
    try:
        _validator_class(params).check_schema(params)
    except jsonschema.SchemaError as err:
        path = ".".join(str(p) for p in err.absolute_path)
        return f"function.parameters is not a valid JSON Schema{' at ' + path if path else ''}: {err.message}"
    return None


def _validator_class(params: dict) -> type:
    draft = jsonschema.validators.validator_for(params, default=jsonschema.Draft202012Validator)
    # JSON Schema counts 1.0 as an integer; a Python tool hinted ``int`` must get an int.
    strict_int = draft.TYPE_CHECKER.redefine(
        "integer", lambda _, value: isinstance(value, int) and not isinstance(value, bool))
    return jsonschema.validators.extend(draft, type_checker=strict_int)


# Missing and unknown arguments are reported before a wrong value: the model has the call's shape wrong.
_REPORT_FIRST = ("required", "additionalProperties")


def argument_problem(schema: OpenAIFunctionToolSchema, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the tool's parameters (missing, unknown, wrong type or value), as one
    line for the model, or None."""
    fn = schema.function
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    # Unknown arguments are refused unless the schema allows them (tools are called with keywords).
    params = {"additionalProperties": False, **fn.parameters}
    errors = list(_validator_class(params)(params).iter_errors(arguments))
    if not errors:
        return None
    first = min(errors, key=lambda e: _REPORT_FIRST.index(e.validator) if e.validator in _REPORT_FIRST else 2)
    return _describe(first, fn.name, arguments, params.get("properties", {}))


def _describe(err: jsonschema.ValidationError, tool: str, arguments: dict, props: dict) -> str:
    if err.path:
        return _describe_argument(err, tool)
    if err.validator == "required":
        missing = [r for r in err.validator_value if r not in arguments]
        return f"missing required argument(s) {missing} for {tool}"
    unknown = [a for a in arguments if a not in props]
    if err.validator == "additionalProperties" and unknown:
        return f"unknown argument(s) {unknown} for {tool}; it takes {sorted(props)}"
    return f"the arguments of {tool}: {err.message}"


def _describe_argument(err: jsonschema.ValidationError, tool: str) -> str:
    name, *inside = err.path
    where = repr(str(name) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in inside))
    if err.validator == "type":
        expected = err.validator_value if isinstance(err.validator_value, list) else [err.validator_value]
        return (f"argument {where} of {tool} must be {' or '.join(expected)}, "
                f"got {type(err.instance).__name__} {err.instance!r}")
    return f"argument {where} of {tool}: {err.message}"
