"""docs/configuration.md is generated from the settings model and cannot drift from it."""
from __future__ import annotations

import socket
from pathlib import Path

import pytest

from omniflow.config import Settings
from omniflow.ops.config_docs import missing_descriptions, render

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
REGENERATE = "regenerate it: python -m omniflow.ops.config_docs > docs/configuration.md"


def test_every_setting_has_a_description() -> None:
    assert not missing_descriptions(), f"add Field(description=...) to: {missing_descriptions()}"


def test_configuration_doc_matches_the_settings_model() -> None:
    assert DOC.read_text() == render(), f"docs/configuration.md is out of date; {REGENERATE}"


def test_host_id_defaults_to_the_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMNIFLOW_HOST_ID", raising=False)
    assert Settings().host_id == socket.gethostname()
    monkeypatch.setenv("OMNIFLOW_HOST_ID", "rack7-node3")
    assert Settings().host_id == "rack7-node3"
