"""The settings the tool workers and the models read from the environment:
read in one settings module per layer, each variable documented once; and
the ranges of their numbers, checked by pydantic constraints."""

from __future__ import annotations

import ast
import inspect
import itertools
import os
import sys
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

import fleetbus
from fleetbus.errors import ConfigError
from fleetbus.models import (
    EspeakSpeech,
    ModelWorker,
    OfflineModel,
    default_model,
    describe_default_model,
)
from fleetbus.models.settings import ModelEnvironment, ModelSettings
from fleetbus.tools_workers import (
    Toolkit,
    ToolWorker,
    builtin,
    coding,
    knowledge,
    load_toolkit,
    memory,
    skills,
)
from fleetbus.tools_workers.knowledge import KnowledgeIndex
from fleetbus.tools_workers.settings import ToolSettings

PACKAGE = Path(fleetbus.__file__).parent

PASSED_THROUGH = {("tools_workers/coding.py", "PATH")}
"""Variables read to hand on, not settings: ``Bash`` commands get the worker's PATH."""


def _environment_reads(path: Path) -> list[str]:
    """What ``path`` reads from ``os.environ`` / ``os.getenv``, as the key's
    source text."""
    reads = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        key: ast.expr | None = None
        if isinstance(node, ast.Subscript) and _is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            func = node.func
            if (func.attr == "getenv" and _is_os(func.value)) or (
                func.attr in ("get", "__getitem__") and _is_environ(func.value)
            ):
                key = node.args[0] if node.args else None
        if key is not None:
            reads.append(str(key.value) if isinstance(key, ast.Constant) else ast.unparse(key))
    return reads


def _is_os(node: ast.expr) -> bool:
    return isinstance(node, ast.Name) and node.id == "os"


def _is_environ(node: ast.expr) -> bool:
    return isinstance(node, ast.Attribute) and node.attr == "environ" and _is_os(node.value)


@pytest.mark.parametrize("layer", ["tools_workers", "models"])
def test_a_layer_reads_the_environment_only_through_its_settings(layer: str) -> None:
    offenders = [
        f"{path.relative_to(PACKAGE)}: {key}"
        for path in sorted((PACKAGE / layer).glob("*.py"))
        if path.name != "settings.py"
        for key in _environment_reads(path)
        if (path.relative_to(PACKAGE).as_posix(), key) not in PASSED_THROUGH
    ]
    assert offenders == []


def test_the_scan_finds_a_read(tmp_path: Path) -> None:
    source = tmp_path / "reader.py"
    source.write_text(
        "import os\n"
        "a = os.environ.get('FLEETBUS_A')\n"
        "b = os.environ['FLEETBUS_B']\n"
        "c = os.getenv(NAME)\n",
        encoding="utf-8",
    )
    assert _environment_reads(source) == ["FLEETBUS_A", "FLEETBUS_B", "NAME"]


def _variables(settings: type[BaseSettings]) -> dict[str, str]:
    """Field -> the environment variable it is read from."""
    prefix = settings.model_config.get("env_prefix", "")
    return {
        name: str(field.validation_alias or prefix + name.upper())
        for name, field in settings.model_fields.items()
    }


def _field_docs(settings: type[BaseSettings]) -> dict[str, str]:
    """Field -> its attribute docstring."""
    module = ast.parse(Path(inspect.getfile(settings)).read_text(encoding="utf-8"))
    docs: dict[str, str] = {}
    for node in ast.walk(module):
        if isinstance(node, ast.ClassDef) and node.name == settings.__name__:
            body = node.body
            for statement, following in itertools.pairwise(body):
                if (
                    isinstance(statement, ast.AnnAssign)
                    and isinstance(statement.target, ast.Name)
                    and isinstance(following, ast.Expr)
                    and isinstance(following.value, ast.Constant)
                ):
                    docs[statement.target.id] = str(following.value.value)
    return docs


@pytest.mark.parametrize("settings", [ToolSettings, ModelEnvironment])
def test_each_variable_is_documented_on_its_field(settings: type[BaseSettings]) -> None:
    docs = _field_docs(settings)
    for field, variable in _variables(settings).items():
        assert docs.get(field, "").startswith(f"``{variable}``: "), field


def test_the_modules_name_the_variables_their_settings_read() -> None:
    variables = _variables(ToolSettings)
    assert variables["files_root"] == builtin.FILES_ROOT_ENV
    assert variables["coding_root"] == coding.CODING_ROOT_ENV
    assert variables["memory_db"] == memory.MEMORY_DB_ENV
    assert variables["knowledge_dir"] == knowledge.KNOWLEDGE_DIR_ENV
    assert variables["knowledge_tool"] == knowledge.KNOWLEDGE_TOOL_ENV
    assert variables["knowledge_index"] == knowledge.KNOWLEDGE_INDEX_ENV
    assert variables["skills"] == skills.SKILLS_ENV
    assert _variables(ModelSettings)["timeout"] == "FLEETBUS_MODEL_TIMEOUT"


def test_tool_settings_come_from_the_environment_when_a_toolkit_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEETBUS_FILES_ROOT", str(tmp_path / "files"))
    monkeypatch.setenv("FLEETBUS_MEMORY_DB", "")
    kit = builtin.builtin_toolkit()
    assert "read_file" in kit
    assert memory.SQLiteMemory().path.endswith(memory.DEFAULT_MEMORY_DB)
    monkeypatch.setenv("FLEETBUS_MEMORY_DB", str(tmp_path / "m.db"))
    assert memory.SQLiteMemory().path == str(tmp_path / "m.db")
    assert ToolSettings().files_root == str(tmp_path / "files")


def test_the_skills_worker_serves_one_load_skill_tool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "rot13"
    folder.mkdir()
    (folder / "SKILL.md").write_text(
        "---\nname: rot13\ndescription: Encode ROT13.\n---\nRun it.\n", encoding="utf-8"
    )
    monkeypatch.setenv("FLEETBUS_SKILLS", f"{folder}{os.pathsep}{os.pathsep} ")
    assert ToolSettings().skill_folders == [str(folder)]
    made = skills.toolkit()
    assert isinstance(made, skills.SkillTool)
    assert load_toolkit("fleetbus.tools_workers.skills").names == [skills.SKILL_TOOL_NAME]


def test_model_environment_strips_and_treats_empty_as_unset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("FLEETBUS_MODEL", "   ")
    monkeypatch.setenv("OPENAI_BASE_URL", "")
    monkeypatch.setenv("OPENAI_API_KEY", " sk-test ")
    env = ModelEnvironment()
    assert not env.model
    assert env.openai_base_url is None
    assert env.api_key == "sk-test"
    assert "sk-test" not in repr(env)
    assert describe_default_model().startswith("built-in offline model")
    assert type(default_model()).__name__ == "OfflineModel"


def test_ranges_are_checked_by_pydantic_constraints_and_named(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError,
        match=r"^ModelWorker: concurrency: Input should be greater than or equal to 1, not 0$",
    ):
        ModelWorker(None, OfflineModel(), concurrency=0)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"tokens_per_minute: Input should be greater than or equal to 1"
    ):
        ModelWorker(None, OfflineModel(), tokens_per_minute=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"call_timeout: Input should be greater than 0, not nan"):
        ModelWorker(None, OfflineModel(), call_timeout=float("nan"))  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError,
        match=r"^EspeakSpeech: pitch: Input should be less than or equal to 99, not 100$",
    ):
        EspeakSpeech(executable=sys.executable, pitch=100)
    with pytest.raises(
        ValueError, match=r"^ToolWorker: concurrency: Input should be greater than or equal to 1"
    ):
        ToolWorker(None, Toolkit(), concurrency=0)  # type: ignore[arg-type]
    with pytest.raises(
        ConfigError, match=r"chunk_chars: Input should be greater than or equal to 100, not 10"
    ):
        KnowledgeIndex(tmp_path, chunk_chars=10)
    with pytest.raises(
        ConfigError, match=r"^SkillTool: max_chars: Input should be greater than or equal to 1"
    ):
        skills.SkillTool([], max_chars=0)


async def test_memory_refuses_out_of_range_calls_with_a_short_message() -> None:
    store = memory.SQLiteMemory(":memory:")
    with pytest.raises(
        ConfigError, match=r"^SQLiteMemory.record: texts: Input should be less than"
    ):
        await store.record("helper", "k", ["x"] * (memory.MAX_TEXTS + 1))
    with pytest.raises(
        ConfigError, match=r"^SQLiteMemory.retrieve: key: String should have at most"
    ) as refused:
        await store.retrieve("helper", "k" * 100_000, "garden")
    assert len(str(refused.value)) < 300
    with pytest.raises(
        ConfigError, match=r"limit: Input should be less than or equal to 50, not 51"
    ):
        await store.retrieve("helper", "k", "garden", limit=memory.MAX_LIMIT + 1)
