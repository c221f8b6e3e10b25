"""docs/config.md is generated from the schema's doc strings and must stay in step with them."""

from pathlib import Path

import pytest

from posttrain.config.docs import iter_keys, markdown_reference

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_committed_reference_is_up_to_date():
    # Regenerate with: python -m posttrain.cli config --markdown > docs/config.md
    assert DOC.read_text() == markdown_reference(), "docs/config.md is stale; regenerate it (see this test)"


def test_every_key_is_documented_once_with_default_and_type():
    text = DOC.read_text()
    leaves = [k for k in iter_keys() if not k.is_section]
    assert len(leaves) > 250  # verl's tree: every leaf is listed
    for info in leaves:
        assert info.doc.strip(), f"{info.key} has no doc string"
        assert text.count(f"| `{info.key}` |") == 1, info.key
    row = next(line for line in text.splitlines() if line.startswith("| `actor_rollout_ref.rollout.n` |"))
    assert row.split(" | ")[1:3] == ["int", "`1`"]


def test_documented_defaults_are_the_loaded_defaults():
    from posttrain.config import load_config

    config = load_config(validate=False)
    wrong = []
    for info in iter_keys():
        if info.is_section or (isinstance(info.default, str) and "${" in info.default):
            continue  # interpolated defaults follow another key
        value = config
        for part in info.key.split("."):
            value = getattr(value, part)
        if value != info.default:
            wrong.append((info.key, info.default, value))
    assert wrong == []
