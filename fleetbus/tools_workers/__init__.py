"""Tools as Python functions, and the worker process that serves them.

``@tool`` makes a typed function a tool; a :class:`Toolkit` holds tools by
name and group; :class:`ToolWorker` serves a toolkit on the bus. The built-in
tools are in :mod:`fleetbus.tools_workers.builtin`; :class:`MCPTools` makes
the tools of an MCP server fleetbus tools (with the ``mcp`` extra), and
:class:`A2ATools` remote A2A agents (with the ``a2a`` extra);
:class:`SkillTool` offers skill folders (``Toolkit(skills=[...])``);
:class:`ToolSettings` is what the tool workers read from the environment.
"""

from fleetbus.tools_workers.a2a import A2AAgentTool, A2ATools
from fleetbus.tools_workers.mcp import MCPTool, MCPTools
from fleetbus.tools_workers.remote import AgentTool, RemoteToolProxy
from fleetbus.tools_workers.settings import ToolSettings
from fleetbus.tools_workers.skills import Skill, SkillTool, load_skills, read_skill
from fleetbus.tools_workers.tool import DEFAULT_GROUP, Tool, tool, tool_failure
from fleetbus.tools_workers.toolkit import Toolkit, ToolLike, load_toolkit
from fleetbus.tools_workers.worker import ToolWorker

__all__ = [
    "DEFAULT_GROUP",
    "A2AAgentTool",
    "A2ATools",
    "AgentTool",
    "MCPTool",
    "MCPTools",
    "RemoteToolProxy",
    "Skill",
    "SkillTool",
    "Tool",
    "ToolLike",
    "ToolSettings",
    "ToolWorker",
    "Toolkit",
    "load_skills",
    "load_toolkit",
    "read_skill",
    "tool",
    "tool_failure",
]
