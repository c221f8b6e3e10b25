"""Tool schemas in OpenAI's function format, the response a tool returns, and the checks on both.

A tool schema is ``{"type": "function", "function": {"name", "description", "parameters"}}`` where
``parameters`` is a JSON Schema of an object (``properties``, ``required``). :func:`check_tool_schema`
refuses a malformed one at start-up (with the installed ``jsonschema`` package, when there is one,
also checking ``parameters`` against the JSON Schema meta-schema); :func:`argument_problem` checks a
call's arguments against the schema at run time, so a wrong call becomes a message to the model.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from posttrain.errors import ConfigError

__all__ = ["OpenAIFunctionToolSchema", "ToolResponse", "check_tool_schema", "argument_problem"]

_JSON_TYPES = {
    "string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,),
    "array": (list,), "object": (dict,), "null": (type(None),),
}


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
    """The installed ``jsonschema``'s verdict on ``params`` as a JSON Schema (None when not installed)."""
    try:
        import jsonschema
    except ImportError:
        return None
    try:
        jsonschema.Draft202012Validator.check_schema(params)
    except jsonschema.SchemaError as err:
        path = ".".join(str(p) for p in err.absolute_path)
        return f"function.parameters is not a valid JSON Schema{' at ' + path if path else ''}: {err.message}"
    return None


def argument_problem(schema: OpenAIFunctionToolSchema, arguments: Any) -> str | None:
    """Why ``arguments`` do not fit the tool's parameters (missing, unknown, wrong JSON type), or None."""
    fn = schema.function
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    props = fn.parameters.get("properties", {})
    missing = [r for r in fn.parameters.get("required", []) if r not in arguments]
    if missing:
        return f"missing required argument(s) {missing} for {fn.name}"
    unknown = [a for a in arguments if a not in props]
    if unknown and fn.parameters.get("additionalProperties", False) is False:
        return f"unknown argument(s) {unknown} for {fn.name}; it takes {sorted(props)}"
    for name, value in arguments.items():
        expected = props.get(name, {}).get("type")
        if expected is None:
            continue
        names = expected if isinstance(expected, list) else [expected]
        ok = any(isinstance(value, _JSON_TYPES.get(t, object)) and not (t in ("integer", "number") and isinstance(value, bool))
                 for t in names)
        if not ok:
            return f"argument {name!r} of {fn.name} must be {' or '.join(names)}, got {type(value).__name__} {value!r}"
    return None
