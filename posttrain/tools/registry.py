"""Tools from verl's tool config YAML (``tools: [{class_name, config, tool_schema}]``) or from Python
objects, with every problem reported at start-up naming the file, entry and key."""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterable

from posttrain.errors import ConfigError
from posttrain.tools.base_tool import BaseTool
from posttrain.tools.schemas import OpenAIFunctionToolSchema

__all__ = ["import_class", "checked_class", "load_tools_config", "build_tools", "read_yaml_list", "TOOL_METHODS"]

# The documented tool protocol (``posttrain.tools.base_tool``): a class that does not subclass BaseTool
# must define all of these to be accepted.
TOOL_METHODS = ("create", "execute", "calc_reward", "release")


def import_class(dotted: Any, where: str) -> type:
    """The class at ``package.module.Class``; ConfigError naming ``where`` when it does not import."""
    if not isinstance(dotted, str) or "." not in dotted:
        raise ConfigError(f"{where}: class_name must be 'package.module.Class', got {dotted!r}")
    module_name, _, attr = dotted.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # ImportError, or any error the module raises while importing
        raise ConfigError(f"{where}: class_name {dotted}: cannot import module {module_name} "
                          f"({type(err).__name__}: {err})") from None
    cls = getattr(module, attr, None)
    if not isinstance(cls, type):
        raise ConfigError(f"{where}: class_name {dotted}: module {module_name} has no class {attr}")
    return cls


def checked_class(dotted: Any, where: str, base: type, methods: tuple[str, ...], kind: str) -> type:
    """The class at ``dotted``, refused (ConfigError naming ``where``) unless it subclasses ``base`` or
    defines every one of ``methods`` (the documented protocol). The check reads the class only: nothing
    is constructed or called before it passes, so a config naming e.g. ``subprocess.Popen`` runs nothing."""
    cls = import_class(dotted, where)
    if issubclass(cls, base):
        return cls
    missing = [m for m in methods if not callable(getattr(cls, m, None))]
    if missing:
        raise ConfigError(f"{where}: class_name {dotted} is not {kind}: it is not a subclass of "
                          f"{base.__module__}.{base.__qualname__} and lacks the method(s) {', '.join(missing)} of "
                          f"the protocol ({', '.join(methods)}); nothing was constructed")
    return cls


def read_yaml_list(path: str, top_key: str) -> list:
    """The list under ``top_key`` of the YAML file at ``path`` (ConfigError naming the file otherwise).

    No interpolation is resolved: a tool or interaction YAML is often shared, and ``${oc.env:HF_TOKEN}`` in
    one would hand this process's secrets to whatever the YAML names (a server URL, a tool's config). A
    value with ``${...}`` is refused, naming its key; ``\\${`` writes a literal ``${``."""
    from omegaconf import OmegaConf

    from posttrain.errors import read_utf8

    text = read_utf8(path, ConfigError)
    try:
        data = OmegaConf.to_container(OmegaConf.create(text), resolve=False)
    except Exception as err:
        raise ConfigError(f"{path}: not valid YAML ({err})") from None
    if not isinstance(data, dict) or not isinstance(data.get(top_key), list):
        raise ConfigError(f"{path}: expected a top-level '{top_key}:' list")
    return _literal(data[top_key], f"{path}: {top_key}")


def _literal(value: Any, where: str) -> Any:
    """``value`` with every string checked for an interpolation (refused) and ``\\${`` made ``${``."""
    if isinstance(value, dict):
        return {key: _literal(item, f"{where}.{key}") for key, item in value.items()}
    if isinstance(value, list):
        return [_literal(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if isinstance(value, str) and "${" in value.replace("\\${", ""):
        raise ConfigError(f"{where}={value!r}: tool and interaction YAMLs resolve no interpolation (a shared YAML "
                          "could read this process's environment and secrets); write the value itself, or \\${ "
                          "for a literal ${")
    return value.replace("\\${", "${") if isinstance(value, str) else value


def load_tools_config(path: str) -> list[BaseTool]:
    """The tools a tool config YAML names, built and checked (class imports, schema, unique names)."""
    tools = []
    for i, entry in enumerate(read_yaml_list(path, "tools")):
        where = f"{path} tools[{i}]"
        if not isinstance(entry, dict) or "class_name" not in entry:
            raise ConfigError(f"{where}: each tool needs class_name (and config, tool_schema)")
        cls = checked_class(entry["class_name"], where, BaseTool, TOOL_METHODS, "a tool")
        schema = entry.get("tool_schema")
        schema = OpenAIFunctionToolSchema.from_dict(schema, f"{where}.tool_schema") if schema is not None else None
        config = entry.get("config") or {}
        if config.get("type", "native") != "native":
            raise ConfigError(f"{where}.config.type={config.get('type')!r}: only native tools are supported "
                              "(MCP tools are not)")
        try:
            tool = cls(config, schema)
        except ConfigError as err:  # the tool checked its own config: its message names the key
            raise ConfigError(f"{where}: {err}") from None
        except Exception as err:
            raise ConfigError(f"{where}: {entry['class_name']}(config, tool_schema) failed: "
                              f"{type(err).__name__}: {err}") from None
        if not isinstance(getattr(tool, "name", None), str) or getattr(tool, "tool_schema", None) is None:
            raise ConfigError(f"{where}: {entry['class_name']} built a tool without a name and tool_schema "
                              "(give the entry a tool_schema, or subclass posttrain.tools.base_tool.BaseTool)")
        tools.append(tool)
    return _unique(tools, path)


def build_tools(tools: Iterable[Any], source: str = "trainer.tools") -> list[BaseTool]:
    """``BaseTool`` objects from tools and plain functions (``FunctionTool``), names unique."""
    from posttrain.tools.function_tool import FunctionTool

    built = [t if isinstance(t, BaseTool) else FunctionTool(_callable(t, source)) for t in tools]
    return _unique(built, source)


def _callable(obj: Any, source: str) -> Callable:
    if not callable(obj):
        raise ConfigError(f"{source}: {obj!r} is neither a tool nor a function")
    return obj


def _unique(tools: list[BaseTool], source: str) -> list[BaseTool]:
    seen = set()
    for tool in tools:
        if tool.name in seen:
            raise ConfigError(f"{source}: two tools are named {tool.name!r}; tool names must be unique")
        seen.add(tool.name)
    return tools
