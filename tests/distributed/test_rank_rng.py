"""Per-rank random state in checkpoints (posttrain/checkpoint/rank_rng.py): each rank gets its own
state back, a resume at another world size says which ranks are reseeded and with which seeds, and
a one-process run resuming a 2-rank checkpoint says so on the console and keeps training.
The bit-exact 2-rank resume through Ray is tests/distributed/test_rank_rng_resume.py (slow)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from posttrain.checkpoint import CheckpointError
from posttrain.checkpoint.rank_rng import (describe_rank_rng_plan, fresh_seed, load_rank_rng, rank_rng_file,
                                           rank_rng_plan, save_rank_rng, saved_rank_count)


def draws() -> tuple:
    """One draw from each generator a rank's state holds."""
    return torch.rand(4), random.random(), float(np.random.rand())


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def save_two_ranks(folder, shuffle: torch.Generator) -> dict[int, tuple]:
    """Rank r's state = everything seeded 100 + r, its shuffle generator 200 + r, after one draw of
    each; returns each rank's next draws (what a resumed rank must draw)."""
    expected = {}
    for rank in (0, 1):
        seed_all(100 + rank)
        shuffle.manual_seed(200 + rank)
        draws(), torch.randperm(5, generator=shuffle)  # states in mid-stream, not fresh seeds
        save_rank_rng(folder, rank, {"actor": shuffle})
        expected[rank] = (*draws(), torch.randperm(5, generator=shuffle))
    return expected


def assert_same(a: tuple, b: tuple) -> None:
    assert torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2] and torch.equal(a[3], b[3])


def test_each_rank_restores_its_own_state(tmp_path):
    shuffle = torch.Generator()
    expected = save_two_ranks(tmp_path, shuffle)
    assert saved_rank_count(tmp_path) == 2
    for rank in (1, 0):
        seed_all(0)
        shuffle.manual_seed(0)
        assert load_rank_rng(tmp_path, rank, 2, {"actor": shuffle}, seed=7, step=3) == "restored"
        assert_same((*draws(), torch.randperm(5, generator=shuffle)), expected[rank])
    # negative control: rank 0's state is not rank 1's
    assert not torch.equal(expected[0][0], expected[1][0])


def test_a_rank_without_saved_state_is_reseeded_from_seed_rank_and_step(tmp_path):
    shuffle = torch.Generator()
    save_two_ranks(tmp_path, shuffle)
    shuffle.manual_seed(11)
    before = shuffle.get_state()
    assert load_rank_rng(tmp_path, 2, 3, {"actor": shuffle}, seed=7, step=3) == "reseeded"
    got = draws()
    seed_all(fresh_seed(7, 2, 3))
    assert_same((*got, torch.zeros(1)), (*draws(), torch.zeros(1)))
    assert torch.equal(shuffle.get_state(), before)  # the role folder's shuffle state stays
    # the fresh seed is reproducible, and none of the start-up seeds (seed + rank)
    assert fresh_seed(7, 2, 3) == fresh_seed(7, 2, 3) != fresh_seed(7, 2, 4)
    assert fresh_seed(7, 2, 3) not in {7 + r for r in range(64)}


def test_world_size_change_messages():
    assert describe_rank_rng_plan(rank_rng_plan(2, 2), seed=7, step=3) is None
    assert describe_rank_rng_plan(rank_rng_plan(0, 1), seed=7, step=3) is None  # older one-process checkpoint

    shrink = describe_rank_rng_plan(rank_rng_plan(2, 1), seed=7, step=3)
    assert shrink == ("note: the checkpoint was saved by 2 ranks and resumes on 1 rank; rank 0 continues its own "
                      "saved RNG state; the saved state of rank 1 is not used")

    grow = describe_rank_rng_plan(rank_rng_plan(2, 4), seed=7, step=3)
    assert grow.startswith("note: the checkpoint was saved by 2 ranks and resumes on 4 ranks; ranks 0, 1 continue "
                           "their own saved RNG state; ranks 2, 3 have no saved state and are reseeded from "
                           "(trainer.seed=7, rank, step=3)")
    assert f"rank 2: {fresh_seed(7, 2, 3)}, rank 3: {fresh_seed(7, 3, 3)}" in grow
    assert "not used" not in grow

    old = describe_rank_rng_plan(rank_rng_plan(0, 2), seed=7, step=3)
    assert "no per-rank RNG state" in old and "ranks 0, 1 have no saved state and are reseeded" in old


def test_a_gap_in_the_rank_files_is_refused(tmp_path):
    save_rank_rng(tmp_path, 0, {})
    save_rank_rng(tmp_path, 2, {})
    with pytest.raises(CheckpointError, match=r"ranks \[0, 2\].*rank_0.pt to rank_<W-1>.pt"):
        saved_rank_count(tmp_path)


def test_a_file_that_is_not_a_rank_state_is_refused(tmp_path):
    save_rank_rng(tmp_path, 0, {})
    torch.save({"something": torch.zeros(2)}, rank_rng_file(tmp_path, 0))
    with pytest.raises(CheckpointError, match="rank_0.pt is not a rank's RNG state"):
        load_rank_rng(tmp_path, 0, 1, {}, seed=0, step=1)


def test_one_process_resuming_a_two_rank_checkpoint_says_what_is_reseeded(tmp_path, capsys):
    """A one-process checkpoint, given a second rank's state (as a 2-rank run writes it): the resume
    says rank 1's state is not used, rank 0 draws on from its own saved state, and the run goes on."""
    from posttrain.checkpoint import MARKER, _seal, verify_checkpoint
    from helpers.tiny_run import one_thread, tiny_trainer

    with one_thread():
        tiny_trainer(tmp_path, ["trainer.total_training_steps=1", "trainer.save_freq=1"]).fit()
        step_dir = tmp_path / "ckpt" / "global_step_1"
        saved_rank0 = torch.load(rank_rng_file(step_dir, 0), weights_only=True)
        seed_all(5)
        save_rank_rng(step_dir, 1, {})
        roles = verify_checkpoint(step_dir)["roles"]
        (step_dir / MARKER).unlink()
        _seal(step_dir, 1, roles)
        resumed = tiny_trainer(tmp_path, ["trainer.total_training_steps=2", "trainer.save_freq=1"])
        seen = {}
        step = resumed.train_step

        def record(prompts):
            seen["torch"] = torch.get_rng_state()
            return step(prompts)

        resumed.train_step = record
        rows = resumed.fit()
    out = capsys.readouterr().out
    assert "saved by 2 ranks and resumes on 1 rank; rank 0 continues its own saved RNG state; the saved state of " \
           "rank 1 is not used" in out
    assert [r["step"] for r in rows] == [2]
    assert torch.equal(seen["torch"], saved_rank0["process"]["torch"])  # rank 0's own, not rank 1's


def test_the_fresh_seeds_step_comes_from_the_manifest_the_folder_name_or_zero(tmp_path):
    from posttrain.checkpoint import CheckpointManager
    from posttrain.checkpoint.rank_rng import checkpoint_step

    manager = CheckpointManager(tmp_path / "root")
    sealed = manager.save(5, _writer, {"x": 1})
    assert checkpoint_step(sealed) == 5
    (tmp_path / "global_step_9").mkdir()
    assert checkpoint_step(tmp_path / "global_step_9") == 9
    loose = tmp_path / "roles"  # role folders written by a worker group alone (no manifest)
    loose.mkdir()
    save_rank_rng(loose, 0, {})
    assert checkpoint_step(loose) == 0
    assert load_rank_rng(loose, 1, 2, {}, seed=3) == "reseeded"
    got = torch.rand(2)
    seed_all(fresh_seed(3, 1, 0))
    assert torch.equal(got, torch.rand(2))
    manager.unlock()


def _writer(folder):
    """A worker group's save: one role folder and rank 0's RNG state."""
    from posttrain.checkpoint import RoleState, write_role

    write_role(folder / "actor", RoleState(model={"w": torch.zeros(2)}))
    save_rank_rng(folder, 0, {})
    return ["actor"]
