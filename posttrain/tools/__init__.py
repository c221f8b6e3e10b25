"""Tools a model can call in a multi-turn rollout (verl's ``verl.tools`` at ``posttrain.tools``)."""

from posttrain.tools.base_tool import BaseTool
from posttrain.tools.registry import build_tools, load_tools_config
from posttrain.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

__all__ = ["BaseTool", "OpenAIFunctionToolSchema", "ToolResponse", "build_tools", "load_tools_config"]
