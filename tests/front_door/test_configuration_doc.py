"""docs/configuration.md is generated from the run file's pydantic models; it must be what they make now."""

from __future__ import annotations

import pathlib

from services.front_door.config_reference import configuration_markdown
from services.front_door.run_file import RunFile

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_configuration_doc_is_current():
    assert DOC.read_text() == configuration_markdown(), (
        "docs/configuration.md is stale: run `python -m services.front_door.config_reference > docs/configuration.md`"
    )


def test_the_doc_lists_every_field_of_every_section():
    doc = configuration_markdown()
    sections = {"": RunFile}
    for name, field in RunFile.model_fields.items():
        if isinstance(field.annotation, type) and hasattr(field.annotation, "model_fields"):
            sections[name] = field.annotation
    for at, model in sections.items():
        if at:
            assert f"## `{at}`" in doc
        for name in model.model_fields:
            assert f"| `{name}` |" in doc, (at, name)
