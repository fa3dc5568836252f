"""The committed JSON Schemas are what the code generates."""

from __future__ import annotations

import json
from pathlib import Path

from fleetbus.cli import main
from fleetbus.protocol import MESSAGE_TYPES, message_schemas, render_schemas

DOCS = Path(__file__).resolve().parents[2] / "docs" / "protocol"


def test_committed_schemas_match_the_code() -> None:
    rendered = render_schemas()
    on_disk = {p.name: p.read_text() for p in DOCS.glob("*.json")}
    assert sorted(on_disk) == sorted(rendered), "run 'fleetbus schema' and commit docs/protocol"
    for name, text in rendered.items():
        assert on_disk[name] == text, f"{name} is stale: run 'fleetbus schema'"


def test_every_message_type_has_a_schema_with_its_tag() -> None:
    schemas = message_schemas()
    for tag, cls in MESSAGE_TYPES.items():
        schema = schemas[f"{tag}.json"]
        definition = schema["$defs"][cls.__name__]
        assert definition["properties"]["type"] == {"enum": [tag]}
        assert "version" in definition["properties"]
    union = schemas["messages.json"]
    assert union["discriminator"]["propertyName"] == "type"
    assert set(union["discriminator"]["mapping"]) == set(MESSAGE_TYPES)


def test_schema_command_writes_and_checks(tmp_path: Path) -> None:
    assert main(["schema", "--out", str(tmp_path)]) == 0
    assert main(["schema", "--out", str(tmp_path), "--check"]) == 0
    (tmp_path / "tool_call.json").write_text("{}")
    assert main(["schema", "--out", str(tmp_path), "--check"]) == 1
    written = json.loads((tmp_path / "messages.json").read_text())
    assert written["$schema"].startswith("https://json-schema.org/")
