"""Every user error, in every entry point, is one `error: ...` line and a non-zero exit; a traceback
only with `--debug` (or POSTTRAIN_DEBUG=1). Override values YAML reads specially never crash the
parser; bytes that are not UTF-8 name the file and line."""

import subprocess
import sys
from pathlib import Path

import pytest

from helpers.tiny_run import tiny_overrides
from posttrain.cli import main
from posttrain.trainer import main_ppo

REPO = Path(__file__).resolve().parents[1]
GRPO_SCRIPT = str(REPO / "examples" / "grpo_deepseek7b_gsm8k.sh")


def _one_line(capsys, rc, expected_rc, *needles):
    err = capsys.readouterr().err
    assert rc == expected_rc, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) >= 1 and lines[-1].startswith("error: "), err
    assert "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def test_data_reward_model_and_checkpoint_errors_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    base = tiny_overrides(tmp_path)
    cases = [
        ([f"data.train_files={tmp_path / 'none.parquet'}"], 2, "does not exist"),
        (["actor_rollout_ref.model.path=/no/such/model"], 2, "/no/such/model does not exist"),
        ([f"custom_reward_function.path={tmp_path / 'r.py'}"], 2, "custom_reward_function.path="),
        (["actor_rollout_ref.actor.ppo_mini_batch_size=-2"], 2, "ppo_mini_batch_size=-2 must be >= 1"),
    ]
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"data_source": "x", "prompt": "not a list", "reward_model": {"ground_truth": "1"}}\n' * 8)
    cases.append(([f"data.train_files={bad}"], 1, "rows.jsonl row 0: field 'prompt' must be a list"))
    for extra, rc_expected, needle in cases:
        rc = main(["train", *base, *extra])
        _one_line(capsys, rc, rc_expected, needle)
        rc = main_ppo.main([*base, *extra])  # python -m posttrain.trainer.main_ppo
        _one_line(capsys, rc, rc_expected, needle)


def test_debug_flag_and_env_show_the_traceback(tmp_path, capsys, monkeypatch):
    base = tiny_overrides(tmp_path)
    rc = main(["train", "--debug", *base, "actor_rollout_ref.model.path=/no/such/model"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: ")
    monkeypatch.setenv("POSTTRAIN_DEBUG", "1")
    rc = main(["config", "data.train_batch_size=@x"])
    assert rc == 2 and "Traceback" in capsys.readouterr().err


def test_top_level_help_lists_debug_and_the_flag_does_what_it_says(capsys, monkeypatch):
    from posttrain.cli import COMMANDS

    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "usage: posttrain <command> [args] [--debug]" in out
    assert "  --debug  print the Python traceback of a user error too (same as POSTTRAIN_DEBUG=1)" in out
    assert all(f"\n  {name:8s} " in out for name in COMMANDS)
    # used where the usage line puts it (after the command's arguments): the traceback, then the error line
    assert main(["config", "data.train_batch_size=@x", "--debug"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: ")
    # negative control: without it, one line
    assert main(["config", "data.train_batch_size=@x"]) == 2
    _one_line(capsys, 2, 2, "data.train_batch_size")


@pytest.mark.parametrize("value", ["@x", "`cmd`", "%d", ":", "&a", "*b", "!t", "{a", "'q"])
def test_yaml_special_override_values_never_crash(value, capsys, monkeypatch):
    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    # a string key takes the text as it is
    assert main(["config", "--builtin", f"trainer.experiment_name={value}"]) == 0
    assert "experiment_name: " in capsys.readouterr().out
    # a number key is refused with the key named, in every command that reads overrides
    for argv in (["config", "--builtin", f"data.train_batch_size={value}"],
                 ["train", f"data.train_batch_size={value}"],
                 ["plan", GRPO_SCRIPT, f"data.train_batch_size={value}"],
                 ["diff", GRPO_SCRIPT, f"data.train_batch_size={value}"]):
        rc = main(argv)
        shell_quoting = argv[0] == "diff" and "'" in value  # diff reads its argument as shell words
        _one_line(capsys, rc, 2, "cannot parse" if shell_quoting else "data.train_batch_size")


@pytest.mark.parametrize("word", ["off", "on", "yes", "no", "Off"])
def test_a_text_key_takes_yaml_boolean_words_as_written(word):
    """YAML 1.1 reads `off` as False, which a string key turned into 'False': `host_paging=off`, a documented
    value, was refused as not one of auto/on/off. A boolean key still reads them as booleans; true/false stay
    booleans everywhere (a free-form dict's `log=False` is the boolean, as in Hydra)."""
    from posttrain.config.load import parse_override_value

    key = "actor_rollout_ref.actor.fsdp_config.host_paging"
    assert parse_override_value(key, word, "override") == word
    assert parse_override_value("trainer.val_before_train", word, "override") is (word in ("on", "yes"))
    assert parse_override_value("reward_model.reward_kwargs.overlong_buffer_cfg.log", "False", "override") is False


def test_host_paging_off_override_loads():
    from posttrain import BUILTIN_CONFIG
    from posttrain.config import load_config

    cfg = load_config(None, ["actor_rollout_ref.actor.fsdp_config.host_paging=off"], base=BUILTIN_CONFIG)
    assert cfg.actor_rollout_ref.actor.fsdp_config.host_paging == "off"


def test_non_utf8_launch_script_and_yaml_name_the_line(tmp_path, capsys):
    script = tmp_path / "run.sh"
    script.write_bytes(b"python3 -m verl.trainer.main_ppo \\\n  trainer.experiment_name=caf\xe9 \\\n  data.train_batch_size=8\n")
    for argv in (["plan", str(script)], ["diff", str(script), GRPO_SCRIPT]):
        _one_line(capsys, main(argv), 2, f"{script}:2: not UTF-8 text (byte 0xe9")
    cfg = tmp_path / "c.yaml"
    cfg.write_bytes(b"trainer:\n  project_name: x\n  experiment_name: caf\xe9\n")
    _one_line(capsys, main(["config", "--config", str(cfg)]), 2, f"{cfg}:3: not UTF-8 text")


def test_console_script_exit_codes():
    """The real console entry: one line on stderr, exit 2, no traceback."""
    out = subprocess.run([sys.executable, "-m", "posttrain.cli", "config", "--builtin", "trainer.total_training_steps=0"],
                         capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 2 and out.stderr.strip() == "error: trainer.total_training_steps=0 must be >= 1"
