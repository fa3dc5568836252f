"""Skills: folders with a SKILL.md, offered to the model through one ``load_skill``
tool whose description lists them; a skill's instructions reach the model only
when it calls that tool."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import pytest

from fleetbus.agents import Agent
from fleetbus.errors import ConfigError, ToolDefinitionError
from fleetbus.protocol import ChatMessage, ToolResultBlock
from fleetbus.testing import ScriptedModel
from fleetbus.tools_workers import SkillTool, Toolkit, load_skills, load_toolkit, read_skill, tool
from fleetbus.tools_workers.skills import (
    DEFAULT_MAX_CHARS,
    MAX_DESCRIPTION_CHARS,
    MAX_FILES,
    MAX_SKILLS,
    SKILLS_ENV,
)

SECRET = "Always answer in rhyming couplets."


def make_skill(
    parent: Path,
    folder: str,
    *,
    name: str | None = None,
    description: str = "Does a thing. Use it for things.",
    body: str = "Follow these steps.\n",
    files: dict[str, str] | None = None,
) -> Path:
    directory = parent / folder
    directory.mkdir(parents=True)
    (directory / "SKILL.md").write_text(
        f"---\nname: {name or folder}\ndescription: {description}\n---\n\n{body}"
    )
    for relative, text in (files or {}).items():
        (directory / relative).parent.mkdir(parents=True, exist_ok=True)
        (directory / relative).write_text(text)
    return directory


@pytest.fixture
def skills(tmp_path: Path) -> Path:
    root = tmp_path / "skills"
    make_skill(
        root,
        "poetry",
        description="Write answers as poems. Use when the user asks for verse.",
        body=f"# Poetry\n\n{SECRET}\nRun scripts/meter.py to check the meter.\n",
        files={"scripts/meter.py": "print('ok')\n", "reference/forms.md": "Sonnet: 14 lines\n"},
    )
    make_skill(root, "csv-report", description="Summarize a CSV file as a table.")
    return root


def tool_result(messages: Sequence[ChatMessage]) -> ToolResultBlock:
    return next(
        block
        for message in messages
        for block in message.content
        if isinstance(block, ToolResultBlock)
    )


async def test_the_instructions_reach_the_model_only_after_it_chooses_the_skill(
    skills: Path,
) -> None:
    model = ScriptedModel(
        [ScriptedModel.call("load_skill", {"skill": "poetry"}), ScriptedModel.text("Roses…")]
    )
    agent = Agent("poet", "You help.", model, toolkit=Toolkit(skills=[skills]))
    answer = await agent.reply("Tell me about the sea, in verse.")
    assert answer.finished_reason == "completed"
    first, second = model.requests
    assert SECRET not in repr(first)  # not in the system prompt, the messages or the tools
    assert SECRET in repr(second)
    result = tool_result(second.messages)
    assert result.name == "load_skill"
    assert result.state == "success"
    assert isinstance(result.output, str)
    assert SECRET in result.output
    assert "- reference/forms.md\n- scripts/meter.py" in result.output
    assert "SKILL.md" not in result.output.split("## Files of the skill")[1].split("\n\n")[0]
    folder = os.path.relpath(skills / "poetry", Path.cwd())
    if not folder.startswith(".."):
        assert f"Folder: {folder} " in result.output
    else:
        assert f"Folder: {(skills / 'poetry').resolve()} " in result.output


def test_the_tool_spec_lists_every_skill_by_name_and_description(skills: Path) -> None:
    spec = Toolkit(skills=skills).get("load_skill").spec()
    assert "- csv-report: Summarize a CSV file as a table." in spec.description
    assert "- poetry: Write answers as poems. Use when the user asks for verse." in spec.description
    assert SECRET not in spec.description
    skill = spec.parameters["properties"]["skill"]
    assert skill["enum"] == ["csv-report", "poetry"]
    assert spec.parameters["required"] == ["skill"]


def test_a_single_skill_folder_its_skill_md_and_a_folder_of_skills(
    skills: Path, tmp_path: Path
) -> None:
    extra = make_skill(tmp_path, "extra")
    loaded = load_skills([skills, extra / "SKILL.md"])
    assert [s.name for s in loaded] == ["csv-report", "poetry", "extra"]
    assert loaded[1].files == ("reference/forms.md", "scripts/meter.py")
    assert loaded[1].directory == (skills / "poetry").resolve()
    assert read_skill(extra).instructions == "Follow these steps."


def test_front_matter_values_in_block_quoted_and_nested_forms(tmp_path: Path) -> None:
    directory = tmp_path / "pdf-forms"
    directory.mkdir()
    (directory / "SKILL.md").write_text(
        "\ufeff---\n"
        "name: 'pdf-forms'\n"
        "description: >\n"
        "  Fill PDF forms.\n"
        "  Use when a PDF has fields.  # not a comment inside a block\n"
        "license: Apache-2.0  # a comment\n"
        "metadata:\n"
        '  version: "1.0"\n'
        "  author: example-org\n"
        "allowed-tools: Bash(python3:*) Read\n"
        "tags: [pdf, 'forms, fields']\n"
        "steps:\n"
        "  - one\n"
        "  - two\n"
        "---\n"
        "Body text.\n"
    )
    skill = read_skill(directory)
    assert skill.name == "pdf-forms"
    assert skill.description == (
        "Fill PDF forms. Use when a PDF has fields. # not a comment inside a block"
    )
    assert skill.instructions == "Body text."
    assert dict(skill.metadata) == {
        "license": "Apache-2.0",
        "metadata": {"version": "1.0", "author": "example-org"},
        "allowed-tools": "Bash(python3:*) Read",
        "tags": ["pdf", "forms, fields"],
        "steps": ["one", "two"],
    }
    text = (directory / "SKILL.md").read_text()
    assert text[skill.instructions_offset :].startswith("Body text.")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("# Just markdown\n", "does not open with front matter"),
        ("---\nname: x\ndescription: y\n", "not closed by a line '---'"),
        ("---\ndescription: y\n---\n", "has no name"),
        ("---\nname: x\n---\n", "has no description"),
        ("---\nname: x\ndescription:\n---\n", "has no description"),
        ("---\nname: PDF-Tools\ndescription: y\n---\n", "'PDF-Tools' is not usable"),
        ("---\nname: pdf--tools\ndescription: y\n---\n", "'pdf--tools' is not usable"),
        ("---\nname: -pdf\ndescription: y\n---\n", "'-pdf' is not usable"),
        ("---\nname: my tool\ndescription: y\n---\n", "'my tool' is not usable"),
        (f"---\nname: {'a' * 65}\ndescription: y\n---\n", "is not usable"),
        ("---\nname: [a, b]\ndescription: y\n---\n", "name must be text, not a list"),
        (
            f"---\nname: x\ndescription: {'d' * (MAX_DESCRIPTION_CHARS + 1)}\n---\n",
            f"at most {MAX_DESCRIPTION_CHARS}",
        ),
        ("---\nname: x\nname: y\ndescription: z\n---\n", "line 3: the key 'name' is given twice"),
        ("---\n  name: x\ndescription: y\n---\n", "line 2: unexpected indentation"),
        ("---\nname: &anchor x\ndescription: y\n---\n", "line 2: anchors"),
        ("---\nname: x\ndescription: 'open\n---\n", "line 3: a quoted value is not closed"),
        ("---\nname: x\nmeta:\n  a:\n    b: c\n---\n", "line 4"),
        ("---\nthis is not yaml\n---\n", "line 2: expected 'key: value'"),
    ],
)
def test_a_bad_skill_md_is_a_config_error_naming_the_file(
    tmp_path: Path, content: str, expected: str
) -> None:
    directory = tmp_path / "x"
    directory.mkdir()
    (directory / "SKILL.md").write_text(content)
    with pytest.raises(ConfigError) as raised:
        Toolkit(skills=[directory])
    assert str(directory / "SKILL.md") in str(raised.value)
    assert expected in str(raised.value)


def test_a_skill_md_that_is_not_utf8_text(tmp_path: Path) -> None:
    directory = tmp_path / "x"
    directory.mkdir()
    (directory / "SKILL.md").write_bytes(b"---\nname: x\ndescription: \xff\xfe\n---\n")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        read_skill(directory)


def test_folders_without_skills_and_duplicate_names(skills: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_skills(tmp_path / "missing")
    (tmp_path / "empty" / "notes").mkdir(parents=True)
    with pytest.raises(ConfigError, match=r"no skill in .*empty: neither it nor a folder"):
        load_skills(tmp_path / "empty")
    (tmp_path / "file.txt").write_text("x")
    with pytest.raises(ConfigError, match="is not a folder"):
        load_skills(tmp_path / "file.txt")
    twin = make_skill(tmp_path / "other", "poems", name="poetry")
    with pytest.raises(ConfigError) as raised:
        Toolkit(skills=[skills, twin])
    message = str(raised.value)
    assert "two skills are named 'poetry'" in message
    assert str((skills / "poetry" / "SKILL.md").resolve()) in message
    assert str(twin.resolve() / "SKILL.md") in message


def test_at_most_max_skills_in_one_tool(tmp_path: Path) -> None:
    root = tmp_path / "many"
    for i in range(MAX_SKILLS + 1):
        make_skill(root, f"s{i}")
    with pytest.raises(ConfigError, match=f"one tool offers at most {MAX_SKILLS}"):
        load_skills(root)


async def test_a_huge_skill_md_is_cut_with_a_note_and_the_rest_can_be_read(
    tmp_path: Path,
) -> None:
    lines = "".join(f"step {i}: do thing number {i}.\n" for i in range(20_000))
    directory = make_skill(tmp_path, "huge", body=lines)
    kit = Toolkit(skills=[directory])
    skill = read_skill(directory)
    assert skill.truncated
    assert len(skill.instructions) <= DEFAULT_MAX_CHARS
    loaded = await kit.run("load_skill", {"skill": "huge"})
    assert loaded.status == "success"
    assert isinstance(loaded.content, str)
    assert len(loaded.content) < DEFAULT_MAX_CHARS + 1_000
    offset = skill.instructions_offset + len(skill.instructions)
    assert f"file='SKILL.md', offset={offset})" in loaded.content
    # Reading on from the note gives the text that follows the cut, exactly.
    rest = await kit.run("load_skill", {"skill": "huge", "file": "SKILL.md", "offset": offset})
    assert isinstance(rest.content, str)
    text = (directory / "SKILL.md").read_text()
    piece = rest.content.split("\n\n", 1)[1].split("\n\n[")[0]
    assert piece == text[offset : offset + DEFAULT_MAX_CHARS]
    end = offset + DEFAULT_MAX_CHARS
    assert f"(characters {offset} to {end} of {len(text)})" in rest.content
    assert rest.content.endswith(f"more characters: read on with offset={end}.]")


@pytest.mark.parametrize("pad", ["", "x"])  # one of the two cuts falls inside a character
def test_a_cut_read_does_not_split_a_character(tmp_path: Path, pad: str) -> None:
    directory = make_skill(tmp_path, "wide", description=f"Wide{pad}.", body="é" * 100_000)
    skill = read_skill(directory, max_chars=10)
    assert skill.instructions == "é" * 10
    assert skill.truncated


async def test_files_are_listed_up_to_a_bound_hidden_and_outside_ones_left_out(
    tmp_path: Path,
) -> None:
    files = {f"data/{i:03}.txt": "x" for i in range(MAX_FILES + 5)}
    files |= {".hidden": "x", "__pycache__/m.pyc": "x", "scripts/run.sh": "echo hi\n"}
    directory = make_skill(tmp_path, "big", files=files)
    (tmp_path / "outside.txt").write_text("secret")
    (directory / "link.txt").symlink_to(tmp_path / "outside.txt")
    skill = read_skill(directory)
    assert len(skill.files) == MAX_FILES
    assert skill.more_files
    assert skill.files[0] == "data/000.txt"
    assert not any(f.startswith((".", "__pycache__")) or f == "link.txt" for f in skill.files)
    few = read_skill(make_skill(tmp_path, "few", files={"a.txt": "x"}))
    assert few.files == ("a.txt",)
    assert not few.more_files
    loaded = await Toolkit(skills=[directory]).run("load_skill", {"skill": "big"})
    assert isinstance(loaded.content, str)
    assert "- … (more files, not listed)" in loaded.content


async def test_reading_a_file_of_a_skill(skills: Path, tmp_path: Path) -> None:
    kit = Toolkit(skills=[skills])
    (tmp_path / "secret.txt").write_text("outside")
    (skills / "poetry" / "logo.png").write_bytes(b"\x89PNG\xff\xfe\x00")
    read = await kit.run("load_skill", {"skill": "poetry", "file": "reference/forms.md"})
    assert read.content == "poetry/reference/forms.md\n\nSonnet: 14 lines\n"
    failures = {
        "unknown skill": ({"skill": "nope"}, "no skill named 'nope'; the skills are: "),
        "escape": ({"skill": "poetry", "file": "../../secret.txt"}, "is not in the folder"),
        "absolute": ({"skill": "poetry", "file": str(tmp_path / "secret.txt")}, "not in the"),
        "absent": ({"skill": "poetry", "file": "nope.md"}, "has no file 'nope.md'"),
        "binary": ({"skill": "poetry", "file": "logo.png"}, "is not UTF-8 text"),
        "offset alone": ({"skill": "poetry", "offset": 3}, "give file too"),
        "past the end": (
            {"skill": "poetry", "file": "reference/forms.md", "offset": 99},
            "past the end",
        ),
    }
    for case, (parameters, expected) in failures.items():
        outcome = await kit.run("load_skill", parameters)
        assert outcome.status == "error", case
        assert outcome.error_detail is not None
        assert expected in outcome.error_detail.message, (case, outcome.error_detail.message)
    negative = await kit.run("load_skill", {"skill": "poetry", "file": "x", "offset": -1})
    assert negative.error_detail is not None
    assert negative.error_detail.code == "invalid_parameters"


def test_add_skills_gives_the_one_tool_more_skills(skills: Path, tmp_path: Path) -> None:
    kit = Toolkit(skills=[skills])
    kit.add_skills(make_skill(tmp_path, "later"))
    found = kit.get("load_skill")
    assert isinstance(found, SkillTool)
    assert list(found.skills) == ["csv-report", "poetry", "later"]
    assert kit.names == ["load_skill"]
    assert kit.groups == {"skills": ["load_skill"]}
    assert "- later: " in found.spec().description
    other = kit.add_skills(make_skill(tmp_path, "apart"), name="load_other_skill")
    assert list(other.skills) == ["apart"]

    @tool
    def load_skill(skill: str) -> str:
        """Not a skill tool."""
        return skill

    plain = Toolkit([load_skill])
    with pytest.raises(ToolDefinitionError, match="already in the toolkit"):
        plain.add_skills(skills)


def test_served_by_a_worker_from_the_environment(
    skills: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(SKILLS_ENV, f"{skills / 'poetry'}{os.pathsep}{skills / 'csv-report'}")
    kit = load_toolkit("fleetbus.tools_workers.skills")
    assert kit.names == ["load_skill"]
    found = kit.get("load_skill")
    assert isinstance(found, SkillTool)
    assert list(found.skills) == ["poetry", "csv-report"]
    monkeypatch.setenv(SKILLS_ENV, "")
    with pytest.raises(ConfigError, match=f"set {SKILLS_ENV} to the skill folders"):
        load_toolkit("fleetbus.tools_workers.skills")


def test_folders_are_shown_relative_to_the_root(skills: Path, tmp_path: Path) -> None:
    loaded = load_skills(skills)
    inside = SkillTool(loaded, root=tmp_path)
    assert inside.folder(inside.skills["poetry"]) == "skills/poetry"
    elsewhere = SkillTool(loaded, root=tmp_path / "skills" / "csv-report")
    assert elsewhere.folder(elsewhere.skills["poetry"]) == str((skills / "poetry").resolve())
    with pytest.raises(ConfigError, match="at least one skill"):
        SkillTool([])
