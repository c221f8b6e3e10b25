"""verl's tool loader at its renamed path (``verl.tools.utils.tool_registry``), so a verl user's script
that builds its tools from a tool config YAML runs unchanged after the module rename.

It is a thin name over :func:`posttrain.tools.registry.load_tools_config`: one parser, one set of
start-up checks (class imports, schema, unique names, each tool's own config checks).
"""

from __future__ import annotations

from posttrain.tools.base_tool import BaseTool
from posttrain.tools.registry import load_tools_config

__all__ = ["initialize_tools_from_config"]


def initialize_tools_from_config(tools_config_file: str) -> list[BaseTool]:
    """The tool instances the YAML at ``tools_config_file`` names (``tools: [{class_name, config,
    tool_schema}]``), in file order; a ConfigError naming the file, entry and key otherwise."""
    return load_tools_config(tools_config_file)
