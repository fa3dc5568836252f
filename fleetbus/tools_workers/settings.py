"""What the tool workers read from the environment, each variable documented
once: on its field of :class:`ToolSettings`; and :func:`check_ranges`, which
checks the numbers the tools are made with against pydantic constraints.

Each field is read from ``FLEETBUS_<FIELD>`` (``files_root`` from
``FLEETBUS_FILES_ROOT``); an empty variable counts as unset. The toolkits
read the settings when they are made — :func:`~fleetbus.tools_workers.builtin.builtin_toolkit`,
:class:`~fleetbus.tools_workers.memory.SQLiteMemory`,
:func:`~fleetbus.tools_workers.knowledge.knowledge_toolkit`,
:func:`fleetbus.tools_workers.skills.toolkit` — so a value given in code wins
and a test can set a variable before it makes one.
"""

from __future__ import annotations

import os

from pydantic_settings import BaseSettings, SettingsConfigDict

from fleetbus._ranges import check_ranges

__all__ = ["ToolSettings", "check_ranges"]


class ToolSettings(BaseSettings):
    """The environment of the tool workers (see the module docstring)."""

    model_config = SettingsConfigDict(
        env_prefix="FLEETBUS_", env_ignore_empty=True, extra="forbid", frozen=True
    )

    files_root: str = "workspace"
    """``FLEETBUS_FILES_ROOT``: the directory the built-in file tools
    (``read_file``, ``write_file``, ``list_dir``) may not leave; relative to
    the working directory, created on first use."""
    coding_root: str | None = None
    """``FLEETBUS_CODING_ROOT``: the directory the coding tools
    (:mod:`fleetbus.tools_workers.coding`) work in; the working directory
    when unset. Read when that module is imported."""
    memory_db: str = "fleetbus-memory.db"
    """``FLEETBUS_MEMORY_DB``: the SQLite file of the long-term memory the
    memory worker serves; relative to the working directory."""
    knowledge_dir: str | None = None
    """``FLEETBUS_KNOWLEDGE_DIR``: the folder of text and Markdown files the
    knowledge worker serves; it has no default."""
    knowledge_tool: str = "knowledge_search"
    """``FLEETBUS_KNOWLEDGE_TOOL``: the name of the knowledge worker's tool."""
    knowledge_index: str | None = None
    """``FLEETBUS_KNOWLEDGE_INDEX``: a SQLite file the knowledge worker keeps
    its index in, so a restart indexes only what changed; in memory when
    unset."""
    skills: str = ""
    """``FLEETBUS_SKILLS``: the skill folders the skills worker serves,
    separated by ``os.pathsep`` (``:`` on POSIX)."""

    @property
    def skill_folders(self) -> list[str]:
        """The folders of :attr:`skills`, blanks left out."""
        return [p for p in self.skills.split(os.pathsep) if p.strip()]
