"""Issue 12: every user mistake is found before any model loads and ends in one clear error, and
nothing is ever lost: one writer per checkpoint folder, a predictable rule for a folder holding
another run's checkpoints, content-checked manifests, changed settings named on resume."""

import json
import re
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers.tiny_run import one_thread, tiny_overrides
from posttrain.checkpoint import CheckpointError, CheckpointManager, verify_checkpoint
from posttrain.config import ConfigError, load_config
from posttrain.trainer import setup
from posttrain.trainer.trainer import RLTrainer


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    with one_thread():
        yield


@pytest.fixture
def no_models(monkeypatch):
    """Fail the test if the run gets as far as building its workers (loading its models)."""
    def refuse(*args, **kwargs):
        raise AssertionError("the models were loaded before the mistake was found")

    monkeypatch.setattr(setup, "build_workers", refuse)


def _config(tmp_path, extra=()):
    return load_config(overrides=tiny_overrides(tmp_path, list(extra)))


def test_paths_and_files_are_checked_before_any_model_loads(tmp_path, no_models):
    cases = {
        "actor_rollout_ref.model.path=/nowhere/model": "actor_rollout_ref.model.path=/nowhere/model: /nowhere/model does not exist",
        f"data.train_files={tmp_path / 'missing.parquet'}": f"data.train_files: {tmp_path / 'missing.parquet'} does not exist",
        f"data.val_files={tmp_path}": "is a folder",
        f"custom_reward_function.path={tmp_path / 'nope.py'}": "custom_reward_function.path=",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as err:
            RLTrainer(_config(tmp_path, [override]))
        assert message in str(err.value), (override, str(err.value))
    reward = tmp_path / "reward.py"
    reward.write_text("def other(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    with pytest.raises(ConfigError, match="custom_reward_function.name='compute_score' is not defined"):
        RLTrainer(_config(tmp_path, [f"custom_reward_function.path={reward}"]))
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_bytes(b'{"x": 1}\n{"data_source": "caf\xe9"}\n')
    with pytest.raises(Exception, match=r"bad.jsonl:2: not UTF-8 text \(byte 0xe9"):
        RLTrainer(_config(tmp_path, [f"data.train_files={bad_rows}"]))


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write anywhere")
def test_unwritable_checkpoint_folder_is_found_at_start_up(tmp_path, no_models):
    locked = tmp_path / "ro"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(ConfigError, match="trainer.default_local_dir=.*cannot create or write"):
            RLTrainer(_config(tmp_path, [f"trainer.default_local_dir={locked / 'ckpt'}"]))
    finally:
        locked.chmod(0o700)


def test_checkpoint_folder_that_is_a_file_is_found_at_start_up(tmp_path, no_models):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match=r"trainer.default_local_dir=.*/file/ckpt: .*/file \(a folder above .*/file/ckpt\) "
                                          r"is a file, so it cannot hold files; set it to a folder"):
        RLTrainer(_config(tmp_path, [f"trainer.default_local_dir={tmp_path / 'file' / 'ckpt'}"]))


HOLDER = """
import sys, time
from posttrain.checkpoint import CheckpointManager
CheckpointManager(sys.argv[1]).lock()
print("locked", flush=True)
time.sleep(600)
"""


def test_a_second_run_on_a_folder_in_use_is_refused_naming_the_other(tmp_path, no_models):
    root = tmp_path / "ckpt"
    other = subprocess.Popen([sys.executable, "-c", HOLDER, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "locked"
        with pytest.raises(CheckpointError, match=rf"checkpoint folder {root} is in use by another run \(pid "
                                                  rf"{other.pid} on host "):
            RLTrainer(_config(tmp_path))
    finally:
        other.kill()
        other.wait()
    CheckpointManager(root).lock()  # the lock died with its process (as with kill -9)
    CheckpointManager(root).unlock()


def _fake_checkpoint(root: Path, step: int, complete: bool = True) -> Path:
    manager = CheckpointManager(root)
    if complete:
        import torch

        from posttrain.checkpoint import RoleState

        return manager.save(step, {"actor": RoleState(model={"w": torch.ones(2)})}, {"global_step": step})
    path = root / f"global_step_{step}"
    path.mkdir(parents=True)
    (path / "extra_state.json").write_text("{}")
    return path


def test_disable_in_a_folder_with_another_runs_checkpoints_is_refused(tmp_path, no_models):
    root = tmp_path / "ckpt"
    _fake_checkpoint(root, 6)
    with pytest.raises(ConfigError, match=r"trainer.resume_mode=disable, but trainer.default_local_dir=.* holds another "
                                          r"run's checkpoints \(global_step_6\).*trainer.start_over=True"):
        RLTrainer(_config(tmp_path, ["trainer.resume_mode=disable"]))
    assert (root / "global_step_6").is_dir()  # nothing was touched


def test_no_complete_checkpoint_is_an_error_not_a_silent_fresh_start(tmp_path, no_models):
    root = tmp_path / "ckpt"
    _fake_checkpoint(root, 2, complete=False)
    _fake_checkpoint(root, 4, complete=False)
    with pytest.raises(ConfigError, match=r"holds checkpoints but none is complete:\n  .*global_step_2 has no "
                                          r"readable COMPLETE marker.*\n  .*global_step_4"):
        RLTrainer(_config(tmp_path))


def test_start_over_moves_the_old_run_aside_and_never_mixes_steps(tmp_path):
    root = tmp_path / "ckpt"
    _fake_checkpoint(root, 6)
    trainer = RLTrainer(_config(tmp_path, ["trainer.resume_mode=disable", "trainer.start_over=True",
                                           "trainer.save_freq=1", "trainer.max_actor_ckpt_to_keep=2",
                                           "trainer.total_training_steps=3"]))
    trainer.fit()
    manager = CheckpointManager(root)
    assert [p.name for p in manager.step_dirs()] == ["global_step_2", "global_step_3"]  # pruning kept this run's
    assert manager.latest() == manager.step_dir(3)
    old = [p for p in root.iterdir() if p.name.startswith("previous_run_")]
    assert len(old) == 1 and (old[0] / "global_step_6" / "COMPLETE").exists()


def test_same_size_corruption_is_refused(tmp_path):
    path = _fake_checkpoint(tmp_path / "ckpt", 1)
    weights = path / "actor" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other content
    weights.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"is corrupt: .*model.safetensors has the size the manifest records but "
                                              r"not its content"):
        verify_checkpoint(path)
    manifest = json.loads((path / "COMPLETE").read_text())
    assert set(manifest["sha256"]) == set(manifest["files"])


def test_resume_names_changed_settings(tmp_path, capsys):
    RLTrainer(_config(tmp_path, ["trainer.save_freq=1", "trainer.total_training_steps=1"])).fit()
    capsys.readouterr()
    trainer = RLTrainer(_config(tmp_path, ["trainer.total_training_steps=2", "actor_rollout_ref.actor.optim.lr=5e-4"]))
    trainer.fit()
    out = capsys.readouterr().out
    assert "note: resuming with settings that differ from the run that saved the checkpoint" in out
    assert "actor_rollout_ref.actor.optim.lr: 0.001 -> 0.0005" in out
    assert "trainer.total_training_steps: 1 -> 2" in out


def test_nan_reward_is_reported_at_its_step_with_the_row(tmp_path):
    import torch

    from posttrain.rewards import RewardError

    trainer = RLTrainer(_config(tmp_path, ["trainer.total_training_steps=2"]))
    calls = []

    def reward(batch):
        calls.append(1)
        scores = torch.ones(len(batch))
        if len(calls) == 2:
            scores[3] = float("nan")
        return scores

    trainer.reward_fn = reward
    with pytest.raises(RewardError, match=r"step 2: batch reward function reward returned a non-finite reward on 1 "
                                          r"of 8 rows: row 3 \(data_source='posttrain/arithmetic', "
                                          r"extra_info.index=\d+\) = nan"):
        trainer.fit()
    assert [row["step"] for row in trainer.history] == [1]


def test_resume_path_from_elsewhere_into_a_folder_with_other_checkpoints_is_refused(tmp_path, no_models):
    _fake_checkpoint(tmp_path / "ckpt", 6)
    other = _fake_checkpoint(tmp_path / "elsewhere", 2)
    with pytest.raises(ConfigError, match=r"trainer.resume_from_path=.*elsewhere/global_step_2 is outside "
                                          r"trainer.default_local_dir=.*ckpt, which holds another run's checkpoints"):
        RLTrainer(_config(tmp_path, ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={other}"]))


def test_a_model_folder_without_a_tokenizer_is_one_clear_error(tmp_path, no_models):
    folder = tmp_path / "no_tokenizer"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigError, match=rf"actor_rollout_ref.model.path={folder}: cannot load its tokenizer"):
        RLTrainer(_config(tmp_path, [f"actor_rollout_ref.model.path={folder}"]))


def test_resume_path_equal_to_the_checkpoint_root_names_the_latest_step(tmp_path, no_models):
    # before: refused as "outside trainer.default_local_dir", which it is not
    root = tmp_path / "ckpt"
    _fake_checkpoint(root, 2)
    _fake_checkpoint(root, 4)
    _fake_checkpoint(root, 6, complete=False)  # the newest is unfinished: the latest complete one is named
    for given in (root, tmp_path / "." / "ckpt"):
        with pytest.raises(ConfigError) as err:
            RLTrainer(_config(tmp_path, ["trainer.resume_mode=resume_path", f"trainer.resume_from_path={given}"]))
        message = str(err.value)
        assert "is the checkpoint root (the folder holding global_step_2, global_step_4, global_step_6)" in message
        assert f"set trainer.resume_from_path={root / 'global_step_4'} (its latest complete checkpoint)" in message
        assert "trainer.resume_mode=auto" in message and "outside" not in message
    # negative control: the step folder itself is accepted (the run starts building its models)
    with pytest.raises(AssertionError, match="the models were loaded"):
        RLTrainer(_config(tmp_path, ["trainer.resume_mode=resume_path",
                                     f"trainer.resume_from_path={root / 'global_step_4'}"]))


# ---------------------------------------------------------------------- issue 24: writes that fail, folders of the wrong kind
ENOSPC_TEXT = r"No space left on device \(ENOSPC: the disk is full\); free space there"


def _full_disk_safetensors(*args, **kwargs):
    """safetensors' own error type and text on a full disk (what its Rust writer reports)."""
    from safetensors import SafetensorError

    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _full_disk_torch_save(obj, f, *args, **kwargs):
    """torch.save's behaviour on a full disk: the file's OSError turns into a RuntimeError without errno."""
    import errno

    try:
        raise OSError(errno.ENOSPC, "No space left on device")
    except OSError:
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")


def _quota_json(path, data):
    import errno

    raise OSError(errno.EDQUOT, "Disk quota exceeded", str(path))


@pytest.mark.parametrize("target,replacement,meaning", [
    ("safetensors.torch.save_file", _full_disk_safetensors, ENOSPC_TEXT),
    ("torch.save", _full_disk_torch_save, ENOSPC_TEXT),
    ("posttrain.checkpoint.layout._write_bytes", _quota_json, r"Disk quota exceeded \(EDQUOT: your disk quota is used up\)"),
])
def test_a_failed_checkpoint_write_names_the_path_and_keeps_the_previous_one(tmp_path, monkeypatch, target, replacement,
                                                                             meaning):
    from posttrain.checkpoint import CheckpointWriteError
    from posttrain.host.disk import DiskWriteError

    root = tmp_path / "ckpt"
    first = _fake_checkpoint(root, 1)
    module, name = target.rsplit(".", 1)
    monkeypatch.setattr(__import__(module, fromlist=[name]), name, replacement)
    with pytest.raises(CheckpointWriteError) as err:
        _fake_checkpoint(root, 2)
    message = str(err.value)
    assert re.search(rf"^saving the checkpoint of step 2 failed: cannot write {re.escape(str(root))}\S*: {meaning}", message), message
    assert f"or set trainer.default_local_dir to a folder on another disk; the previous checkpoint in {root} is intact" in message
    assert isinstance(err.value, DiskWriteError) and err.value.exit_code == 1
    monkeypatch.undo()
    assert CheckpointManager(root).latest() == first and verify_checkpoint(first)  # untouched, still loads
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".lock")) == [
        "global_step_1", "latest_checkpointed_iteration.txt"]  # no half-written folder left behind


def test_a_full_disk_during_a_run_is_one_error_line(tmp_path, capsys, monkeypatch):
    from posttrain.cli import main

    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    overrides = tiny_overrides(tmp_path, ["trainer.save_freq=1", "trainer.total_training_steps=1"])
    monkeypatch.setattr("safetensors.torch.save_file", _full_disk_safetensors)
    rc = main(["train", *overrides])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" not in err, err
    last = err.strip().splitlines()[-1]
    assert re.match(rf"error: saving the actor checkpoint on rank 0 failed: cannot write {re.escape(str(tmp_path))}/ckpt/"
                    rf"\.tmp_global_step_1_\d+/actor/model\.safetensors: {ENOSPC_TEXT}, or set trainer.default_local_dir", last), last


def test_run_dir_and_checkpoint_dir_that_are_files_are_found_at_start_up(tmp_path, no_models):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match=rf"trainer.run_dir={a_file}: {a_file} is a file, so it cannot hold files; "
                                          r"set trainer.run_dir to a folder"):
        RLTrainer(_config(tmp_path, [f"trainer.run_dir={a_file}"]))
    with pytest.raises(ConfigError, match=rf"trainer.run_dir={a_file}/run: {a_file} \(a folder above {a_file}/run\) "
                                          "is a file"):
        RLTrainer(_config(tmp_path, [f"trainer.run_dir={a_file / 'run'}"]))
    with pytest.raises(ConfigError, match=rf"trainer.default_local_dir={a_file}: {a_file} is a file, so it cannot hold "
                                          r"files; set it to a folder"):
        RLTrainer(_config(tmp_path, [f"trainer.default_local_dir={a_file}"]))


def test_resuming_onto_a_model_of_another_shape_names_the_parameter_and_both_shapes(tmp_path):
    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer
    from posttrain.cli import main

    RLTrainer(_config(tmp_path, ["trainer.save_freq=1", "trainer.total_training_steps=1"])).fit()
    tok = build_tiny_tokenizer()
    narrow = tmp_path / "narrow_model"
    tiny_llama(tok, hidden_size=32, intermediate_size=64).save_pretrained(narrow)
    tok.save_pretrained(narrow)
    other = [f"actor_rollout_ref.model.path={narrow}", f"critic.model.path={narrow}", "trainer.total_training_steps=2"]
    with pytest.raises(ConfigError) as err:
        RLTrainer(_config(tmp_path, other)).fit()
    message = str(err.value)
    saved = tmp_path / "ckpt" / "global_step_1" / "actor" / "model.safetensors"
    assert message.startswith(f"{saved}: saved from a model of another shape: parameter "), message
    assert re.search(rf"parameter model\.embed_tokens\.weight has shape \[{len(tok)}, 64\] in the checkpoint but "
                     rf"\[{len(tok)}, 32\] in this model \(\d+ more parameters differ\)", message), message
    assert "trainer.start_over=True" in message


def test_sharded_weights_of_another_shape_are_refused_before_reading(tmp_path):
    from helpers.tiny_models import tiny_llama
    from helpers.tokenizer import build_tiny_tokenizer
    from posttrain.checkpoint.dcp import load_sharded, save_sharded

    tok = build_tiny_tokenizer()
    save_sharded(tmp_path / "dcp", tiny_llama(tok, num_hidden_layers=3))
    with pytest.raises(CheckpointError, match=rf"{tmp_path / 'dcp'}: saved from a model of another shape: the checkpoint "
                                              r"holds 9 parameters this model lacks \(e.g. \['model.layers.2"):
        load_sharded(tmp_path / "dcp", tiny_llama(tok))
    wide = tiny_llama(tok, num_hidden_layers=3)
    load_sharded(tmp_path / "dcp", wide)  # negative control: the same shape loads


def test_a_data_source_without_a_scorer_is_found_before_any_model_loads(tmp_path, no_models):
    """Issue 59: an unknown data_source was found at step 1, after the models loaded and a rollout ran."""
    from posttrain.data.schema import read_rows, write_rows
    from posttrain.errors import DataError

    _config(tmp_path)  # writes the tiny data
    rows = read_rows(str(tmp_path / "data" / "train.parquet"))
    rows[5]["data_source"] = "my/own_task"
    mixed = tmp_path / "mixed.parquet"
    write_rows(rows, str(mixed))
    with pytest.raises(DataError) as err:
        RLTrainer(_config(tmp_path, [f"data.train_files={mixed}"]))
    assert str(err.value).startswith(f"{mixed} row 5: data_source='my/own_task' has no built-in scorer (known: "
                                     "openai/gsm8k, "), str(err.value)
    assert "set custom_reward_function.path and .name" in str(err.value) and "\n" not in str(err.value)
    # negative control: a reward function given with the trainer scores those rows, so the check lets them by
    # (the trainer goes on to load its models: here, the `no_models` refusal)
    with pytest.raises(AssertionError, match="the models were loaded"):
        RLTrainer(_config(tmp_path, [f"data.train_files={mixed}"]), reward_fn=lambda batch: batch["responses"][:, 0])
