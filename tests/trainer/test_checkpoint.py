"""CheckpointManager: round trip, pruning, atomicity (simulated crashes and real SIGKILLs), safe loading."""

from __future__ import annotations

import importlib.util
import hashlib
import json
import logging
import os
import pickle
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from posttrain.checkpoint import layout as ckpt
from posttrain.checkpoint import CheckpointError, CheckpointManager, RoleState, restore_rng
from posttrain.trainer.resume import check_compatible, config_fingerprint, resolve_resume

HERE = Path(__file__).parent


def _writer_module():
    spec = importlib.util.spec_from_file_location("ckpt_writer", HERE / "ckpt_writer.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _small_roles(step: int) -> dict[str, RoleState]:
    """Tiny roles whose every tensor holds ``step``."""
    v = float(step)
    actor = RoleState(model={"w": torch.full((4, 4), v), "b": torch.full((4,), v)},
                      optimizer={"state": {0: {"exp_avg": torch.full((4, 4), v)}},
                                 "param_groups": [{"lr": v, "params": [0]}]},
                      scheduler={"last_epoch": step})
    critic = RoleState(model={"v": torch.full((2,), v)})
    return {"actor": actor, "critic": critic}


def _assert_consistent(loaded: ckpt.LoadedCheckpoint) -> None:
    """Every number in the checkpoint equals the step it claims (the writers store step everywhere)."""
    step = loaded.step
    assert loaded.extra["step"] == step
    assert loaded.path.name.endswith(f"global_step_{step}") or f"global_step_{step}_" in loaded.path.name
    for role in loaded.roles.values():
        for tensor in role.model.values():
            assert torch.equal(tensor, torch.full_like(tensor, step))
        if role.optimizer is not None:
            for tensor in role.optimizer["state"][0].values():
                assert torch.equal(tensor, torch.full_like(tensor, step))
        if role.scheduler is not None:
            assert role.scheduler["last_epoch"] == step


# ---------------------------------------------------------------------- round trip
def test_round_trip_restores_model_optimizer_scheduler_extra_and_rng(tmp_path):
    from transformers import LlamaConfig

    from helpers.tokenizer import build_tiny_tokenizer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    model[1].weight = model[0].weight  # tied embeddings share storage
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    scheduler.step()
    generator = torch.Generator().manual_seed(7)
    tok = build_tiny_tokenizer()
    hf_config = LlamaConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=64)
    role = RoleState(model=model.state_dict(), optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                     generator=generator.get_state(), hf_config=hf_config, tokenizer=tok)
    extra = {"step": 3, "sampler": {"epoch": 1, "index": 17}, "kl_ctrl": {"value": 0.05},
             "config_fingerprint": {"adv_estimator": "grpo", "critic": False}, "np": np.float32(0.5)}
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.normal(), torch.rand(1)  # numpy now holds a cached gaussian

    manager = CheckpointManager(tmp_path)
    path = manager.save(3, {"actor": role}, extra)
    expected_draws = (random.random(), np.random.normal(), torch.rand(3))

    assert path == tmp_path / "global_step_3"
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "3"
    assert sorted(p.name for p in (path / "actor").iterdir()) == [
        "generator.pt", "huggingface", "lr_scheduler.pt", "model.safetensors", "optimizer.pt"]
    loaded = manager.load(manager.latest(), hf=True)
    assert loaded.step == 3 and loaded.path == path
    actor = loaded.roles["actor"]
    for key, value in model.state_dict().items():
        assert torch.equal(actor.model[key], value), key
    fresh = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))
    fresh[1].weight = fresh[0].weight
    fresh.load_state_dict(actor.model)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    fresh_opt.load_state_dict(actor.optimizer)
    assert torch.equal(fresh_opt.state_dict()["state"][0]["exp_avg"], optimizer.state_dict()["state"][0]["exp_avg"])
    assert fresh_opt.state_dict()["param_groups"] == optimizer.state_dict()["param_groups"]
    assert actor.scheduler == scheduler.state_dict()
    assert torch.equal(actor.generator, generator.get_state())
    assert actor.hf_config.hidden_size == 32 and actor.tokenizer.encode("1+2") == tok.encode("1+2")
    assert loaded.extra == {**extra, "np": 0.5}

    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    restore_rng(loaded.rng)
    assert random.random() == expected_draws[0]
    assert np.random.normal() == expected_draws[1]
    assert torch.equal(torch.rand(3), expected_draws[2])


def test_save_rejects_unjsonable_extra(tmp_path):
    with pytest.raises(CheckpointError, match="extra_state.json.*JSON"):
        CheckpointManager(tmp_path).save(1, _small_roles(1), {"bad": object()})
    assert CheckpointManager(tmp_path).latest() is None
    assert list(tmp_path.iterdir()) == []  # the half-written temp folder is gone


# ---------------------------------------------------------------------- pruning
def test_pruning_keeps_newest_per_role_and_the_tracked_checkpoint(tmp_path):
    manager = CheckpointManager(tmp_path, max_actor_ckpt_to_keep=2, max_critic_ckpt_to_keep=1)
    for step in (1, 2, 3, 4):
        manager.save(step, _small_roles(step), {"step": step})
    # actor kept at 3, 4; critic at 4; steps 1 and 2 hold neither and go whole.
    assert [p.name for p in manager.step_dirs()] == ["global_step_3", "global_step_4"]
    assert sorted(p.name for p in (tmp_path / "global_step_3").iterdir()) == [
        "COMPLETE", "actor", "extra_state.json", "rng_state.pt"]  # critic gone, no leftovers
    only_actor = manager.load(3)
    assert list(only_actor.roles) == ["actor"]
    _assert_consistent(only_actor)
    assert list(manager.load(4).roles) == ["actor", "critic"]
    # Resuming from an earlier step: the tracked (just saved) step 2 survives although older than 3 and 4.
    manager.save(2, _small_roles(2), {"step": 2})
    assert [p.name for p in manager.step_dirs()] == ["global_step_2", "global_step_3", "global_step_4"]
    assert manager.latest() == tmp_path / "global_step_2"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_no_limit_keeps_everything(tmp_path):
    manager = CheckpointManager(tmp_path, max_actor_ckpt_to_keep=None, max_critic_ckpt_to_keep=0)
    for step in (1, 2, 3):
        manager.save(step, _small_roles(step), {"step": step})
    assert len(manager.step_dirs()) == 3


# ---------------------------------------------------------------------- finding the latest
def test_latest_skips_incomplete_and_falls_back_with_a_warning(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    assert manager.latest() is None
    for step in (1, 2, 3):
        manager.save(step, _small_roles(step), {"step": step})
    # step 3 truncated, step 4 never finished, a stale temp folder lies around, the tracker says 4.
    with open(tmp_path / "global_step_3" / "actor" / "model.safetensors", "r+b") as f:
        f.truncate(10)
    (tmp_path / "global_step_4" / "actor").mkdir(parents=True)
    (tmp_path / ".tmp_global_step_5_999").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("4")
    with caplog.at_level(logging.WARNING):
        assert manager.latest() == tmp_path / "global_step_2"
    assert "says step 4" in caplog.text
    with pytest.raises(CheckpointError, match="model.safetensors has 10 bytes"):
        manager.load(3)
    manager.save(5, _small_roles(5), {"step": 5})
    assert not (tmp_path / ".tmp_global_step_5_999").exists()
    assert manager.latest() == tmp_path / "global_step_5"


def test_resaving_a_step_replaces_it(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(3, _small_roles(3), {"step": 3})
    roles = _small_roles(3)
    roles["actor"].model["extra"] = torch.full((2,), 3.0)
    manager.save(3, roles, {"step": 3})
    loaded = manager.load(manager.latest())
    assert "extra" in loaded.roles["actor"].model
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", "latest_checkpointed_iteration.txt"]


class _Crash(Exception):
    pass


@pytest.mark.parametrize("resave", [False, True], ids=["new-step", "same-step"])
def test_a_crash_at_every_rename_or_delete_leaves_old_or_new_complete(tmp_path, monkeypatch, resave):
    """Dies before the k-th os.replace / rmtree of a save, for every k; the next save recovers."""
    real_replace, real_rmtree = os.replace, ckpt.shutil.rmtree
    k = 0
    while True:
        root = tmp_path / f"k{k}"
        manager = CheckpointManager(root, max_actor_ckpt_to_keep=1)
        manager.save(1, _small_roles(1), {"step": 1})
        target = 1 if resave else 2
        calls = 0

        def dying(real):
            def wrapper(*args, **kwargs):
                nonlocal calls
                calls += 1
                if calls == k + 1:
                    raise _Crash
                return real(*args, **kwargs)
            return wrapper

        monkeypatch.setattr(os, "replace", dying(real_replace))
        monkeypatch.setattr(ckpt.shutil, "rmtree", dying(real_rmtree))
        try:
            manager.save(target, _small_roles(target), {"step": target})
            finished = True
        except _Crash:
            finished = False
        monkeypatch.undo()
        latest = manager.latest()
        assert latest is not None, f"crash before call {k + 1}: no checkpoint"
        loaded = manager.load(latest)
        assert loaded.step in (1, target)
        _assert_consistent(loaded)
        manager.save(3, _small_roles(3), {"step": 3})  # recovers and cleans up
        assert manager.latest() == root / "global_step_3"
        assert not [p for p in root.iterdir() if p.name.startswith(".")]
        if finished:
            break
        k += 1
    assert k >= 3  # rename into place, tracker, prune (and the move-aside when resaving)


# ---------------------------------------------------------------------- kill -9
def _wait_for(condition, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "the writer made no progress"
        time.sleep(0.005)


def test_sigkill_at_random_moments_leaves_a_complete_consistent_checkpoint(tmp_path):
    writer = subprocess.Popen([sys.executable, str(HERE / "ckpt_writer.py"), str(tmp_path)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(HERE.parents[1])})
    manager = CheckpointManager(tmp_path)
    rand = random.Random(1234)
    manager.save(1, _writer_module().roles_for(1), {"step": 1})
    steps_seen = []
    try:
        for kill in range(5):
            latest_step = manager.load(manager.latest()).step
            start = latest_step if kill % 2 else latest_step + 1  # odd kills re-save the tracked step
            writer.stdin.write(f"{start}\n")
            writer.stdin.flush()
            pid = int(writer.stdout.readline())
            if kill % 2 == 0:  # let this one land a save first, so the run provably makes progress
                _wait_for(lambda: (manager.tracked_step() or 0) >= start)
            time.sleep(rand.uniform(0.02, 0.5))
            os.kill(pid, signal.SIGKILL)
            assert writer.stdout.readline().strip() == "reaped"
            latest = manager.latest()
            assert latest is not None
            loaded = manager.load(latest)
            _assert_consistent(loaded)
            steps_seen.append(loaded.step)
    finally:
        writer.stdin.close()
        writer.kill()
        writer.wait()
    assert steps_seen[0] >= 2 and max(steps_seen) >= 4, steps_seen


# ---------------------------------------------------------------------- safe loading
class _Payload:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plant(step_dir: Path, name: str, marker: Path, zip_format: bool) -> None:
    path = step_dir / name
    if zip_format:
        torch.save({"state": _Payload(marker)}, path)
    else:
        path.write_bytes(pickle.dumps({"state": _Payload(marker)}, protocol=2))  # legacy format
    manifest = json.loads((step_dir / "COMPLETE").read_text())
    manifest["files"][name] = path.stat().st_size  # an attacker fixes the manifest too
    manifest["sha256"][name] = hashlib.sha256(path.read_bytes()).hexdigest()
    (step_dir / "COMPLETE").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name,zip_format", [("actor/optimizer.pt", True), ("rng_state.pt", False)])
def test_a_planted_pickle_is_refused_and_never_runs(tmp_path, name, zip_format):
    manager = CheckpointManager(tmp_path / "ckpt")
    path = manager.save(1, _small_roles(1), {"step": 1})
    marker = tmp_path / "pwned"
    _plant(path, name, marker, zip_format)

    with pytest.raises(CheckpointError, match=rf"refusing to load .*{Path(name).name}.*system"):
        manager.load(path)
    assert not marker.exists()

    # The payload is live: an unsafe load would have run it.
    control = tmp_path / "control.pt"
    torch.save({"state": _Payload(tmp_path / "control-ran")}, control)
    torch.load(control, weights_only=False)
    assert (tmp_path / "control-ran").exists()


# ---------------------------------------------------------------------- resume
def test_a_checkpoint_from_another_config_is_refused():
    saved = {"config_fingerprint": {"model_path": "m", "adv_estimator": "gae", "critic": True, "vocab_size": 64}}
    check_compatible(saved, {"model_path": "m", "adv_estimator": "gae", "critic": True, "vocab_size": 64})
    with pytest.raises(CheckpointError) as err:
        check_compatible(saved, {"model_path": "m", "adv_estimator": "grpo", "critic": False, "vocab_size": 64})
    assert "checkpoint was saved with algorithm.adv_estimator=gae, this run has grpo" in str(err.value)
    assert "critic.enable=True, this run has False" in str(err.value)
    assert "vocab_size" not in str(err.value)


def test_config_fingerprint_reads_the_config():
    from posttrain.config import load_config

    config = load_config(None, ["algorithm.adv_estimator=grpo", "actor_rollout_ref.model.path=/m"], validate=False)
    fingerprint = config_fingerprint(config, vocab_size=64)
    settings = fingerprint.pop("settings")
    assert fingerprint == {"model_path": "/m", "adv_estimator": "grpo", "critic": False, "vocab_size": 64,
                           "async_rollouts": False}
    assert settings["actor_rollout_ref.actor.optim.lr"] == 1e-6 and settings["data.train_batch_size"] == 1024


def test_resolve_resume_modes(tmp_path):
    def trainer(mode, path=None):
        return SimpleNamespace(resume_mode=mode, resume_from_path=path, default_local_dir=str(tmp_path))

    assert resolve_resume(trainer("auto")) is None
    manager = CheckpointManager(tmp_path)
    manager.save(1, _small_roles(1), {"step": 1})
    manager.save(2, _small_roles(2), {"step": 2})
    assert resolve_resume(trainer("auto")) == tmp_path / "global_step_2"
    assert resolve_resume(SimpleNamespace(trainer=trainer("auto"))) == tmp_path / "global_step_2"
    assert resolve_resume(trainer("disable")) is None
    assert resolve_resume(trainer("resume_path", str(tmp_path / "global_step_1"))) == tmp_path / "global_step_1"
    with pytest.raises(CheckpointError, match=r"is the checkpoint root \(the folder holding global_step_1, "
                                              r"global_step_2\), not one checkpoint: set trainer.resume_from_path="
                                              r".*global_step_2 \(its latest complete checkpoint\)"):
        resolve_resume(trainer("resume_path", str(tmp_path)))
    with pytest.raises(CheckpointError, match=r"=.*global_step_1/actor must be a global_step_N folder$"):
        resolve_resume(trainer("resume_path", str(tmp_path / "global_step_1" / "actor")))
    with pytest.raises(CheckpointError, match="global_step_9 does not exist"):
        resolve_resume(trainer("resume_path", str(tmp_path / "global_step_9")))
    with pytest.raises(CheckpointError, match="needs trainer.resume_from_path"):
        resolve_resume(trainer("resume_path"))
    with pytest.raises(CheckpointError, match="valid modes are auto, disable, resume_path"):
        resolve_resume(trainer("latest"))


# --------------------------------------------------------------------------- loading a role one tensor at a time
def _role_folder(tmp_path, model, optimizer, scheduler):
    folder = tmp_path / "actor"
    ckpt.write_role(folder, RoleState(model={k: v.clone() for k, v in model.state_dict().items()},
                                      optimizer=optimizer.state_dict(), scheduler=scheduler.state_dict(),
                                      generator=torch.Generator().manual_seed(3).get_state()))
    return folder


def _trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 50, bias=False))
    model[2].weight = model[0].weight  # tied, as a causal LM's head: saved under both names
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def test_a_role_loads_one_saved_tensor_at_a_time_with_the_same_result(tmp_path, monkeypatch):
    """A one-process role restores the same weights, optimizer, schedule and generator as a full
    ``load_state_dict``, with at most one tensor read from the file alive at once (the whole-file reader, the
    negative control, holds all of them together)."""
    from posttrain.checkpoint import role as role_mod

    saved = _trained(0)
    folder = _role_folder(tmp_path, *saved)
    alive, most = set(), [0]
    real_open = role_mod.open_tensors

    class Counting:
        def __init__(self, path):
            self.file = real_open(path)

        def __enter__(self):
            self.inner = self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            import weakref
            tensor = self.inner.get_tensor(name)
            alive.add(id(tensor))
            weakref.finalize(tensor, alive.discard, id(tensor))
            most[0] = max(most[0], len(alive))
            return tensor

    monkeypatch.setattr(role_mod, "open_tensors", Counting)
    model, optimizer, scheduler = _trained(1)
    generator = torch.Generator()
    role_mod.load_role_state(folder, model, optimizer, scheduler, generator)
    assert most[0] == 1
    for (name, want), got in zip(saved[0].state_dict().items(), model.state_dict().values()):
        assert torch.equal(got, want), name
    assert model[2].weight is model[0].weight
    for (key, want), got in zip(saved[1].state_dict()["state"].items(), optimizer.state_dict()["state"].values()):
        assert all(torch.equal(got[k], want[k]) for k in want), key
    assert scheduler.state_dict()["last_epoch"] == saved[2].state_dict()["last_epoch"]
    assert torch.equal(generator.get_state(), torch.Generator().manual_seed(3).get_state())
    whole = ckpt.load_role(folder)  # the negative control: every tensor in memory at once
    assert len(whole.model) == len(saved[0].state_dict()) > 1


def test_a_role_of_another_shape_is_refused_before_any_weight_changes(tmp_path):
    from posttrain.checkpoint import role as role_mod

    folder = _role_folder(tmp_path, *_trained(0))
    torch.manual_seed(1)
    other = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 4), torch.nn.Linear(4, 50, bias=False))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    optimizer = torch.optim.AdamW(other.parameters())
    with pytest.raises(CheckpointError, match=r"1\.weight has shape \[8, 8\] in the checkpoint but \[4, 8\]"):
        role_mod.load_role_state(folder, other, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1),
                                 torch.Generator())
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
