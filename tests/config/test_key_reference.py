"""docs/config.md is generated from the schema's doc strings and must stay in step with them."""

from pathlib import Path

import pytest

from posttrain.config.docs import iter_keys
from posttrain.config.reference import markdown_reference

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


def _columns(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split(" | ")]


def test_verl_default_and_built_in_run_value_sit_in_separate_columns(capsys):
    from posttrain.cli import main

    rows = {line.split(" | ")[0]: line for line in DOC.read_text().splitlines() if line.startswith("| `")}
    # builtin.yaml: data.train_files null (the built-in task), rollout.n 4, and critic.rollout_n follows rollout.n
    assert _columns(rows["| `data.train_files`"])[:4] == [
        "`data.train_files`", "Any", "`~/data/rlhf/gsm8k/train.parquet`", "`null`"]
    assert _columns(rows["| `actor_rollout_ref.rollout.n`"])[2:4] == ["`1`", "`4`"]
    assert _columns(rows["| `critic.rollout_n`"])[2:4] == ["`${actor_rollout_ref.rollout.n}`", "`4`"]
    # negative control: a key builtin.yaml leaves alone has an empty built-in column
    assert _columns(rows["| `data.prompt_key`"])[2:4] == ["`prompt`", ""]

    assert main(["config", "--keys"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("key "))
    column = header.index("built-in run")
    assert header.index("verl default") < column
    row = next(line for line in lines if line.startswith("data.train_files "))
    assert row.split() == ["data.train_files", "~/data/rlhf/gsm8k/train.parquet", "null"] and row.index("null") == column
    assert next(line for line in lines if line.startswith("data.prompt_key ")).split() == ["data.prompt_key", "prompt"]
