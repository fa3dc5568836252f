"""Skills: folders of instructions, and scripts, that a model loads when it needs them.

A skill follows the Agent Skills convention: a folder holding a
``SKILL.md``, whose front matter names the skill and says what it is for,
and whose Markdown body is the instructions; any other files beside it
(scripts, references, templates) come with it::

    skills/
      rot13/
        SKILL.md           ---
        scripts/rot13.py   name: rot13
                           description: Encode or decode ROT13 text.
                           ---
                           Run `python3 scripts/rot13.py TEXT` from this folder…

:func:`load_skills` reads skill folders, or folders of them.
:class:`SkillTool` offers them to a model as one tool, ``load_skill``: its
description lists each skill's name and description, and only a call of it
brings a skill's instructions (with the list of its files) into the
conversation. ``Toolkit(skills=["./skills"])`` adds that tool to a toolkit.

Serve skills on the bus with ``FLEETBUS_SKILLS=./skills fleetbus worker
fleetbus.tools_workers.skills`` (:func:`toolkit`); the agents of the fleet
find ``load_skill`` there like any other tool.

Sizes are bounded: a name has at most 64 characters, a description 1,024, a
tool at most 100 skills; the instructions and a file read through the tool
are cut at ``max_chars`` (16,000) with a note saying how to read on, and at
most 100 files are listed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Final

from pydantic import BaseModel, Field

from fleetbus.errors import ConfigError
from fleetbus.tools_workers._frontmatter import FrontMatterError, parse_front_matter
from fleetbus.tools_workers.sandbox import FileSandbox
from fleetbus.tools_workers.settings import ToolSettings, check_ranges
from fleetbus.tools_workers.tool import Tool

__all__ = [
    "DEFAULT_MAX_CHARS",
    "MAX_DESCRIPTION_CHARS",
    "MAX_FILES",
    "MAX_NAME_CHARS",
    "MAX_SKILLS",
    "SKILLS_ENV",
    "SKILLS_GROUP",
    "SKILL_FILE",
    "SKILL_TOOL_NAME",
    "Skill",
    "SkillTool",
    "load_skills",
    "read_skill",
    "toolkit",
]

SKILL_FILE: Final = "SKILL.md"
"""The file that makes a folder a skill."""

SKILLS_ENV: Final = "FLEETBUS_SKILLS"
"""The variable of :attr:`~fleetbus.tools_workers.settings.ToolSettings.skills`."""

SKILL_TOOL_NAME: Final = "load_skill"
"""The name of the tool that loads skills, unless told otherwise."""

SKILLS_GROUP: Final = "skills"
"""The toolkit group of that tool."""

MAX_NAME_CHARS: Final = 64
"""Longest skill name (as the Agent Skills convention says)."""

MAX_DESCRIPTION_CHARS: Final = 1024
"""Longest skill description (as the Agent Skills convention says)."""

MAX_SKILLS: Final = 100
"""Most skills one tool offers: every description is in every model call."""

MAX_FILES: Final = 100
"""Most files of a skill listed with its instructions."""

DEFAULT_MAX_CHARS: Final = 16_000
"""Characters of instructions, or of a file, one call returns: under the
agent's default ``tool_result_limit`` (20,000), with room for the file list."""

MAX_READ_BYTES: Final = 4 * 1024 * 1024
"""Largest file of a skill the tool reads (in pieces of ``max_chars``)."""


class _Limits(BaseModel):
    max_chars: int = Field(ge=1)


_NAME = re.compile(r"[a-z0-9]+(?:-[a-z0-9]+)*\Z")
_SKIPPED_DIRS: Final = frozenset({"__pycache__", "node_modules"})
_FRONT_MATTER_BYTES: Final = 64 * 1024
"""Bytes of ``SKILL.md`` read beyond four a character of the instructions kept."""


@dataclass(frozen=True, slots=True)
class Skill:
    """One skill, read from its folder by :func:`read_skill`.

    Attributes:
        name: its name: lowercase letters, digits and hyphens.
        description: what it does and when to use it (whitespace collapsed).
        directory: its folder (absolute).
        instructions: the body of ``SKILL.md``, at most ``max_chars`` of it.
        truncated: whether the instructions were cut.
        instructions_offset: where the instructions start in ``SKILL.md``
            (in characters), to read on from the cut.
        files: the other files of the folder, relative to it, sorted (hidden
            files and ``__pycache__`` left out; at most ``MAX_FILES``).
        more_files: whether there are files beyond those listed.
        metadata: the other keys of the front matter (``license``,
            ``allowed-tools``, ``metadata``…), as written.
    """

    name: str
    description: str
    directory: Path
    instructions: str
    truncated: bool = False
    instructions_offset: int = 0
    files: tuple[str, ...] = ()
    more_files: bool = False
    metadata: Mapping[str, Any] = field(default_factory=dict)

    @property
    def source(self) -> Path:
        """Its ``SKILL.md``."""
        return self.directory / SKILL_FILE


def read_skill(folder: str | Path, *, max_chars: int = DEFAULT_MAX_CHARS) -> Skill:
    """The skill in ``folder`` (or of the ``SKILL.md`` file named).

    Args:
        folder: the skill's folder, or its ``SKILL.md``.
        max_chars: characters of the instructions kept; the rest is left to
            be read through the tool.

    Raises:
        ConfigError: no such folder, no ``SKILL.md``, a file that is not
            UTF-8 text, front matter missing or unreadable, or a missing or
            unusable name or description; the message names the file.
    """
    check_ranges(_Limits, "read_skill", max_chars=max_chars)
    path = Path(folder).expanduser()
    if path.name == SKILL_FILE and path.is_file():
        path = path.parent
    if not path.is_dir():
        raise ConfigError(
            f"skill folder {path} {'is not a folder' if path.exists() else 'does not exist'}"
        )
    directory = path.resolve()
    source = directory / SKILL_FILE
    if not source.is_file():
        raise ConfigError(f"{path} holds no {SKILL_FILE}")
    budget = _FRONT_MATTER_BYTES + 4 * max_chars
    try:
        with source.open("rb") as f:
            data = f.read(budget + 1)
    except OSError as exc:
        raise ConfigError(f"cannot read {source}: {exc.strerror or exc}") from exc
    whole = len(data) <= budget
    text = _decode(data[:budget], whole=whole, source=source)
    try:
        front, end = parse_front_matter(text)
    except FrontMatterError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    name = _name(front.pop("name", None), source)
    description = _description(front.pop("description", None), source)
    body = text[end:]
    start = end + len(body) - len(body.lstrip())
    body = body.strip()
    files, more = _files(directory)
    return Skill(
        name=name,
        description=description,
        directory=directory,
        instructions=body[:max_chars].rstrip(),
        truncated=not whole or len(body) > max_chars,
        instructions_offset=start,
        files=files,
        more_files=more,
        metadata=front,
    )


def load_skills(
    paths: str | Path | Iterable[str | Path], *, max_chars: int = DEFAULT_MAX_CHARS
) -> list[Skill]:
    """The skills in ``paths``: each a skill folder (it holds a ``SKILL.md``)
    or a folder of skill folders (each of its subfolders holding a ``SKILL.md``
    is a skill; hidden ones are skipped), in the order given, then by folder name.

    Raises:
        ConfigError: a path does not exist or holds no skill, a ``SKILL.md``
            is invalid (see :func:`read_skill`), two skills have the same
            name, or there are more than ``MAX_SKILLS``.
    """
    items = [paths] if isinstance(paths, str | Path) else list(paths)
    skills: list[Skill] = []
    for item in items:
        path = Path(item).expanduser()
        if (path / SKILL_FILE).is_file() or path.name == SKILL_FILE:
            skills.append(read_skill(path, max_chars=max_chars))
            continue
        if not path.is_dir():
            raise ConfigError(
                f"skill folder {path} {'is not a folder' if path.exists() else 'does not exist'}"
            )
        try:
            subfolders = sorted(path.iterdir())
        except OSError as exc:
            raise ConfigError(f"cannot list {path}: {exc.strerror or exc}") from exc
        found = [
            read_skill(sub, max_chars=max_chars)
            for sub in subfolders
            if not _skipped(sub.name) and (sub / SKILL_FILE).is_file()
        ]
        if not found:
            raise ConfigError(
                f"no skill in {path}: neither it nor a folder in it holds a {SKILL_FILE}"
            )
        skills.extend(found)
    _by_name(skills)
    return skills


class SkillTool(Tool):
    """The tool that offers skills to a model: ``load_skill(skill, file=None, offset=0)``.

    Its description lists each skill's name and description. Called with a
    skill's name, it returns the skill's instructions, its folder, and the
    list of its files (relative to the folder, so that a shell or file tool
    can run or read them); with ``file``, the text of one of those files
    (``offset``: the character to start at).

    Args:
        skills: the skills offered.
        name: the tool's name.
        root: folders are shown relative to it when they are inside it (so
            that coding tools rooted there can use the paths); the working
            directory by default.
        max_chars: characters of a file one call returns.
        group: the toolkit group the tool joins.

    Raises:
        ConfigError: no skills, more than ``MAX_SKILLS``, or two with the same name.
        ToolDefinitionError: ``name`` cannot be a tool name.
    """

    def __init__(
        self,
        skills: Iterable[Skill],
        *,
        name: str = SKILL_TOOL_NAME,
        root: str | Path | None = None,
        max_chars: int = DEFAULT_MAX_CHARS,
        group: str = SKILLS_GROUP,
    ) -> None:
        check_ranges(_Limits, "SkillTool", max_chars=max_chars)
        self.skills: dict[str, Skill] = _by_name(list(skills))
        if not self.skills:
            raise ConfigError("a skill tool needs at least one skill")
        self.root = Path(root if root is not None else os.getcwd()).expanduser().resolve()
        self.max_chars = max_chars

        def load_skill(
            skill: str, file: str | None = None, offset: Annotated[int, Field(ge=0)] = 0
        ) -> str:
            """Load a skill.

            Args:
                skill: the name of the skill.
                file: a file of the skill to read instead, relative to its folder.
                offset: with file, the character of the file to start reading at.
            """
            return self.load(skill, file, offset)

        super().__init__(
            load_skill,
            name=name,
            description=_tool_description(self.skills.values()),
            timeout=30.0,
            group=group,
        )
        self.parameters["properties"]["skill"]["enum"] = list(self.skills)

    def with_skills(self, skills: Iterable[Skill]) -> SkillTool:
        """A tool like this one offering ``skills`` too.

        Raises:
            ConfigError: a name is taken, or there would be more than ``MAX_SKILLS``.
        """
        return SkillTool(
            [*self.skills.values(), *skills],
            name=self.name,
            root=self.root,
            max_chars=self.max_chars,
            group=self.group,
        )

    def load(self, skill: str, file: str | None = None, offset: int = 0) -> str:
        """What the tool returns: the skill's instructions, or a piece of one of its files.

        Raises:
            ValueError: no such skill, a path outside the skill's folder, a
                file that is not UTF-8 text or is too big, or an offset
                without a file.
            FileNotFoundError: the skill has no such file.
        """
        found = self.skills.get(skill)
        if found is None:
            raise ValueError(f"no skill named {skill!r}; the skills are: {', '.join(self.skills)}")
        if file is not None:
            return self._read(found, file, offset)
        if offset:
            raise ValueError("offset is for reading a file of the skill: give file too")
        return self._instructions(found)

    def folder(self, skill: Skill) -> str:
        """The skill's folder as shown to the model: relative to ``root`` when inside it."""
        if skill.directory.is_relative_to(self.root):
            return skill.directory.relative_to(self.root).as_posix()
        return str(skill.directory)

    def _instructions(self, skill: Skill) -> str:
        folder = self.folder(skill)
        parts = [
            f"# Skill {skill.name}",
            f"Folder: {folder} (the paths below are relative to it)",
            skill.instructions or f"(Its {SKILL_FILE} holds no instructions.)",
        ]
        if skill.truncated:
            offset = skill.instructions_offset + len(skill.instructions)
            parts.append(
                f"[The instructions are cut here. Read on with {self.name}(skill={skill.name!r}, "
                f"file={SKILL_FILE!r}, offset={offset}).]"
            )
        if skill.files:
            listed = "\n".join(f"- {path}" for path in skill.files)
            more = "\n- … (more files, not listed)" if skill.more_files else ""
            parts.append(
                f"## Files of the skill\n{listed}{more}\n\n"
                f"Read one with {self.name}(skill={skill.name!r}, file=PATH); run a script "
                f"in the folder {folder} with a shell tool, if you have one."
            )
        else:
            parts.append(f"The skill has no files besides its {SKILL_FILE}.")
        return "\n\n".join(parts)

    def _read(self, skill: Skill, file: str, offset: int) -> str:
        try:
            target = FileSandbox(skill.directory).resolve(file)
        except PermissionError as exc:
            raise ValueError(f"{file!r} is not in the folder of the skill {skill.name}") from exc
        if not target.is_file():
            raise FileNotFoundError(
                f"the skill {skill.name} has no file {file!r}; its files are listed "
                f"when it is loaded"
            )
        size = target.stat().st_size
        if size > MAX_READ_BYTES:
            raise ValueError(f"{file!r} has {size} bytes; at most {MAX_READ_BYTES} are read")
        try:
            text = target.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{file!r} is not UTF-8 text") from None
        end = min(len(text), offset + self.max_chars)
        if offset >= len(text) and text:
            raise ValueError(
                f"offset {offset} is past the end of {file!r} ({len(text)} characters)"
            )
        piece = text[offset:end]
        header = f"{skill.name}/{file}"
        if offset or end < len(text):
            header += f" (characters {offset} to {end} of {len(text)})"
        note = f"\n\n[{len(text) - end} more characters: read on with offset={end}.]"
        return f"{header}\n\n{piece}" + (note if end < len(text) else "")


def toolkit() -> SkillTool:
    """What ``fleetbus worker fleetbus.tools_workers.skills`` serves: the
    ``load_skill`` tool of the skill folders named by ``FLEETBUS_SKILLS``
    (separated by ``os.pathsep``), which
    :func:`~fleetbus.tools_workers.toolkit.load_toolkit` puts in a toolkit of
    its own. It is a tool, not a :class:`~fleetbus.tools_workers.Toolkit`,
    because the toolkit module imports this one (``Toolkit(skills=…)``).

    Raises:
        ConfigError: ``FLEETBUS_SKILLS`` is unset or empty, or names no usable skills.
    """
    paths = ToolSettings().skill_folders
    if not paths:
        raise ConfigError(
            f"set {SKILLS_ENV} to the skill folders to serve (separated by {os.pathsep!r}), "
            f"e.g. {SKILLS_ENV}=./skills"
        )
    return SkillTool(load_skills(paths))


def _decode(data: bytes, *, whole: bool, source: Path) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        # A cut read may end inside a character: drop that character, not the file.
        if not whole and exc.start >= len(data) - 3 and exc.reason == "unexpected end of data":
            return data[: exc.start].decode("utf-8")
        raise ConfigError(f"{source} is not UTF-8 text (byte {exc.start})") from None


def _name(value: Any, source: Path) -> str:
    if value is None or value == "":
        raise ConfigError(f"{source}: the front matter has no name")
    if not isinstance(value, str):
        raise ConfigError(f"{source}: name must be text, not a {type(value).__name__}")
    if len(value) > MAX_NAME_CHARS or not _NAME.match(value):
        raise ConfigError(
            f"{source}: the skill name {value[:80]!r} is not usable: it must be 1 to "
            f"{MAX_NAME_CHARS} lowercase letters, digits and hyphens, with no hyphen at "
            "either end nor two in a row (like pdf-forms)"
        )
    return value


def _description(value: Any, source: Path) -> str:
    if not isinstance(value, str | None):
        raise ConfigError(f"{source}: description must be text, not a {type(value).__name__}")
    text = " ".join((value or "").split())
    if not text:
        raise ConfigError(f"{source}: the front matter has no description")
    if len(text) > MAX_DESCRIPTION_CHARS:
        raise ConfigError(
            f"{source}: the description has {len(text)} characters; "
            f"at most {MAX_DESCRIPTION_CHARS} are allowed"
        )
    return text


def _by_name(skills: list[Skill]) -> dict[str, Skill]:
    by_name: dict[str, Skill] = {}
    for skill in skills:
        taken = by_name.get(skill.name)
        if taken is not None:
            raise ConfigError(
                f"two skills are named {skill.name!r}: {taken.source} and {skill.source}"
            )
        by_name[skill.name] = skill
    if len(by_name) > MAX_SKILLS:
        raise ConfigError(f"{len(by_name)} skills; one tool offers at most {MAX_SKILLS}")
    return by_name


def _tool_description(skills: Iterable[Skill]) -> str:
    listed = "\n".join(f"- {skill.name}: {skill.description}" for skill in skills)
    return (
        "Load a skill: instructions for a kind of task, with the files (scripts, "
        "references) that come with it. When the task matches a skill below, call this "
        "with the skill's name before doing anything else, then follow the instructions "
        "it returns. With file, read one of the skill's files.\n\n"
        f"Skills:\n{listed}"
    )


def _files(directory: Path) -> tuple[tuple[str, ...], bool]:
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(directory):
        dirnames[:] = sorted(d for d in dirnames if not _skipped(d))
        here = Path(dirpath)
        for filename in sorted(filenames):
            path = here / filename
            relative = path.relative_to(directory).as_posix()
            if filename.startswith(".") or relative == SKILL_FILE:
                continue
            if path.is_symlink() and not path.resolve().is_relative_to(directory):
                continue
            if len(found) == MAX_FILES:
                return tuple(found), True
            found.append(relative)
    return tuple(found), False


def _skipped(name: str) -> bool:
    return name.startswith(".") or name in _SKIPPED_DIRS
