"""DAPO dynamic sampling (`algorithm.filter_groups`), checked by hand and end to end:

- which groups a score table keeps (mixed, all equal, groups of one), in batch order;
- the loop draws more prompt batches while too few groups are kept, cuts the batch to exactly
  train_batch_size groups, stops with an error after max_num_gen_batches rounds (verl), and counts
  rounds and groups;
- rounds with different prompt widths are joined by left-padding;
- bad keys are refused at start-up, naming the key;
- a tiny model trains with filter_groups + overlong buffer; a run stopped after step 2 and resumed
  equals the uninterrupted one (the loader position saved after a step counts every batch drawn);
  without trainer.total_training_steps the run ends when trainer.total_epochs are used up.
"""

import math

import numpy as np
import pytest
import torch

from helpers.tiny_run import tiny_overrides
from posttrain.batch import Batch
from posttrain.config import ConfigError, find_problems, load_config
from posttrain.errors import PosttrainError
from posttrain.trainer.dynamic_sampling import (DynamicSampling, DynamicSamplingStalled, GenerationLimitError,
                                                concat_rounds, kept_group_rows, metric_values)
from posttrain.trainer.trainer import RLTrainer


# ---------------------------------------------------------------------- which groups are kept
def test_kept_groups_by_hand():
    #        a a a | b b b | c c c | d | e e e
    uids = np.array(list("aaabbbcccdeee"), dtype=object)
    values = np.array([1, 0, 1,   # a: mixed -> kept
                       1, 1, 1,   # b: all 1 -> dropped
                       0, 0, 0,   # c: all 0 -> dropped
                       0,         # d: a group of one -> kept (verl: nothing to compare, so kept)
                       0.5, 0.5, 0.25], dtype=np.float64)  # e: mixed scores -> kept
    rows, kept, dropped = kept_group_rows(uids, values)
    assert rows.tolist() == [0, 1, 2, 9, 10, 11, 12]  # batch order
    assert (kept, dropped) == (3, 2)


def test_interleaved_uids_keep_batch_order():
    uids = np.array(["x", "y", "x", "y"], dtype=object)
    rows, kept, dropped = kept_group_rows(uids, np.array([0.0, 1.0, 1.0, 1.0]))
    assert rows.tolist() == [0, 2] and (kept, dropped) == (1, 1)


def test_nan_metric_drops_the_group():
    rows, kept, dropped = kept_group_rows(np.array(["a", "a"], dtype=object), np.array([np.nan, 1.0]))
    assert rows.tolist() == [] and (kept, dropped) == (0, 1)


def test_metric_values():
    scores = torch.zeros(3, 4)
    scores[0, 1], scores[1, 3], scores[2, 0] = 1.0, -0.5, 0.25
    batch = Batch.from_dict({"token_level_scores": scores})
    extra = {"acc": np.array([1.0, 0.0, 1.0]), "reward/errors": np.zeros(3)}
    assert metric_values(batch, extra, "seq_reward").tolist() == [1.0, -0.5, 0.25]
    assert metric_values(batch, extra, "seq_final_reward").tolist() == [1.0, -0.5, 0.25]
    assert metric_values(batch, extra, "acc").tolist() == [1.0, 0.0, 1.0]
    with pytest.raises(PosttrainError, match=r"metric=score: the reward has no 'score' field \(its fields: \['acc'\]\)"):
        metric_values(batch, extra, "score")


# ---------------------------------------------------------------------- the collection loop
N = 2  # responses per prompt


def _prompts(ids: list[int], width: int = 3) -> Batch:
    """A prompt batch: prompt k is ``[k] * width`` (its id is its token)."""
    return Batch.from_dict({"input_ids": torch.tensor([[k] * width for k in ids]),
                            "attention_mask": torch.ones(len(ids), width, dtype=torch.long),
                            "position_ids": torch.arange(width).repeat(len(ids), 1)},
                           {"data_source": ["t"] * len(ids)})


class FakeRounds:
    """Generates N responses per prompt whose acc comes from ``table[prompt id]`` and records the
    uids it was given."""

    def __init__(self, table: dict[int, list[float]]):
        self.table, self.uid_starts = table, []

    def __call__(self, prompts: Batch, first_uid: int):
        self.uid_starts.append(first_uid)
        ids = prompts["input_ids"][:, -1].tolist()
        rep = prompts.repeat(N)
        p = rep["input_ids"]
        out = Batch.from_dict({"prompts": p, "responses": torch.zeros(len(rep), 2, dtype=torch.long),
                               "input_ids": torch.cat([p, torch.zeros(len(rep), 2, dtype=torch.long)], 1),
                               "attention_mask": torch.cat([rep["attention_mask"], torch.ones(len(rep), 2, dtype=torch.long)], 1),
                               "position_ids": torch.cat([rep["position_ids"], torch.tensor([[3, 4]] * len(rep))], 1),
                               "token_level_scores": torch.zeros(len(rep), 2)},
                              {"uid": np.repeat([f"p{first_uid + i}" for i in range(len(ids))], N)})
        acc = np.array([v for k in ids for v in self.table[k]])
        return out, {"acc": acc, "reward/errors": np.zeros(len(acc))}


def _draws(*batches):
    it = iter(batches)
    drawn = []

    def draw():
        drawn.append(1)
        return next(it)
    return draw, drawn


MIXED, ONES, ZEROS = [0.0, 1.0], [1.0, 1.0], [0.0, 0.0]


def test_collect_draws_until_full_and_truncates():
    # train_batch_size 3 groups; gen batches of 2 prompts. Round 1 keeps 1 (prompt 1), round 2 keeps 0,
    # round 3 keeps 2 (prompts 5, 6) -> 3 groups: exactly full, nothing cut.
    table = {1: MIXED, 2: ONES, 3: ZEROS, 4: ONES, 5: MIXED, 6: [1.0, 0.0], 7: MIXED, 8: MIXED}
    gen = FakeRounds(table)
    draw, drawn = _draws(_prompts([3, 4]), _prompts([5, 6]), _prompts([7, 8]))
    ds = DynamicSampling("acc", train_batch_size=3, n=N, max_rounds=0, pad_token_id=0)
    batch, extra, metrics = ds.collect(_prompts([1, 2]), draw, gen)
    assert len(drawn) == 2  # the third prompt batch stays in the loader
    assert gen.uid_starts == [0, 2, 4]  # uids unique across the rounds of the step
    assert batch["prompts"][:, -1].tolist() == [1, 1, 5, 5, 6, 6] and len(batch) == 3 * N
    assert batch["uid"].tolist() == ["p0", "p0", "p4", "p4", "p5", "p5"]
    assert metrics == {"train/num_gen_batches": 3.0, "train/num_groups_kept": 3.0, "train/num_groups_dropped": 3.0}
    # the reward's extra output covers every response generated in the step (3 rounds x 2 prompts x N)
    assert extra["acc"].tolist() == [v for k in (1, 2, 3, 4, 5, 6) for v in table[k]]


def test_surplus_groups_are_cut_to_train_batch_size():
    # one round keeps 3 groups but the step needs 2: the third kept group (prompt 4) is discarded (verl)
    gen = FakeRounds({1: MIXED, 2: ONES, 3: MIXED, 4: MIXED})
    draw, drawn = _draws()
    ds = DynamicSampling("acc", train_batch_size=2, n=N, max_rounds=0, pad_token_id=0)
    batch, _, metrics = ds.collect(_prompts([1, 2, 3, 4]), draw, gen)
    assert drawn == [] and batch["prompts"][:, -1].tolist() == [1, 1, 3, 3]
    assert metrics == {"train/num_gen_batches": 1.0, "train/num_groups_kept": 3.0, "train/num_groups_dropped": 1.0}


def test_limit_of_generation_rounds_stops_with_verls_error():
    # max_num_gen_batches=2: after the second round only 1 of 2 groups is kept -> error (verl raises)
    gen = FakeRounds({1: MIXED, 2: ONES, 3: ZEROS, 4: ZEROS, 5: MIXED, 6: MIXED})
    draw, drawn = _draws(_prompts([3, 4]), _prompts([5, 6]))
    ds = DynamicSampling("acc", train_batch_size=2, n=N, max_rounds=2, pad_token_id=0)
    with pytest.raises(GenerationLimitError, match=r"2 generation rounds \(4 prompts\) kept 1 groups.*"
                       r"data.train_batch_size=2 \(algorithm.filter_groups.max_num_gen_batches=2\)"):
        ds.collect(_prompts([1, 2]), draw, gen)
    assert len(drawn) == 1 and gen.uid_starts == [0, 2]
    # the same data with one more round allowed fills the batch in round 3
    gen = FakeRounds({1: MIXED, 2: ONES, 3: ZEROS, 4: ZEROS, 5: MIXED, 6: MIXED})
    draw, drawn = _draws(_prompts([3, 4]), _prompts([5, 6]))
    batch, _, metrics = DynamicSampling("acc", 2, N, 3, 0).collect(_prompts([1, 2]), draw, gen)
    assert batch["prompts"][:, -1].tolist() == [1, 1, 5, 5] and metrics["train/num_gen_batches"] == 3.0


def test_no_limit_of_rounds_still_ends_after_an_epoch_and_logs_every_round():
    # max_num_gen_batches=0 (verl's "no limit") and a reward that never varies: every group is dropped.
    # An epoch holds 6 prompts (3 batches of 2); after 3 rounds the step stops with one clear error.
    table = {k: ONES for k in range(1, 9)}
    lines = []
    draw, drawn = _draws(_prompts([3, 4]), _prompts([5, 6]), _prompts([7, 8]))
    ds = DynamicSampling("acc", train_batch_size=2, n=N, max_rounds=0, pad_token_id=0, epoch_prompts=6, step=7,
                         log=lines.append)
    with pytest.raises(DynamicSamplingStalled) as err:
        ds.collect(_prompts([1, 2]), draw, FakeRounds(table))
    assert len(drawn) == 2  # rounds 2 and 3 drew; the fourth batch was never drawn
    message = str(err.value)
    for needle in ("step 7: 3 generation rounds drew 6 prompts, a whole epoch of the 6 training prompts",
                   "kept only 0 groups", "data.train_batch_size=2", "acc values seen: 1)",
                   "algorithm.filter_groups.max_num_gen_batches=K"):
        assert needle in message, message
    assert isinstance(err.value, GenerationLimitError) and err.value.exit_code == 1
    assert lines == [f"dynamic sampling: step 7 round {r}: 0/2 groups kept so far ({2 * r} prompts drawn, {r * 2} "
                     "groups dropped with equal acc); drawing more prompts" for r in (1, 2, 3)]
    # negative control: one varying group per round fills the batch in round 2, before the epoch ends
    lines.clear()
    draw, drawn = _draws(_prompts([3, 4]))
    ds.collect(_prompts([1, 2]), draw, FakeRounds({**table, 1: MIXED, 3: MIXED}))
    assert lines[-1].endswith("round 2: 2/2 groups kept so far (4 prompts drawn, 2 groups dropped with equal acc); "
                              "the batch is full") and len(lines) == 2


def test_a_positive_limit_of_rounds_keeps_verls_meaning_beyond_an_epoch():
    # max_num_gen_batches=3 allows 3 rounds even when that is more than an epoch (2 prompts here)
    gen = FakeRounds({1: ONES, 2: ONES, 3: ZEROS, 4: ZEROS, 5: MIXED, 6: MIXED})
    draw, drawn = _draws(_prompts([3, 4]), _prompts([5, 6]))
    ds = DynamicSampling("acc", 2, N, max_rounds=3, pad_token_id=0, epoch_prompts=2, log=lambda line: None)
    batch, _, metrics = ds.collect(_prompts([1, 2]), draw, gen)
    assert batch["prompts"][:, -1].tolist() == [5, 5, 6, 6] and metrics["train/num_gen_batches"] == 3.0


def test_groups_of_one_are_all_kept():
    ds = DynamicSampling("acc", train_batch_size=2, n=1, max_rounds=1, pad_token_id=0)

    def gen(prompts, first_uid):
        out = Batch.from_dict({"prompts": prompts["input_ids"], "token_level_scores": torch.zeros(len(prompts), 1)},
                              {"uid": [f"p{first_uid + i}" for i in range(len(prompts))]})
        return out, {"acc": np.ones(len(prompts))}
    batch, _, metrics = ds.collect(_prompts([1, 2, 3]), lambda: None, gen)
    assert batch["prompts"][:, -1].tolist() == [1, 2]
    assert metrics["train/num_groups_kept"] == 3.0 and metrics["train/num_groups_dropped"] == 0.0


def test_rounds_of_different_prompt_widths_are_left_padded():
    a = FakeRounds({1: MIXED})(_prompts([1], width=2), 0)[0]
    b = FakeRounds({2: MIXED})(_prompts([2], width=4), 1)[0]
    joined = concat_rounds([a, b], pad_token_id=9)
    assert joined["prompts"].tolist() == [[9, 9, 1, 1], [9, 9, 1, 1], [2, 2, 2, 2], [2, 2, 2, 2]]
    assert joined["input_ids"][0].tolist() == [9, 9, 1, 1, 0, 0]
    assert joined["attention_mask"][0].tolist() == [0, 0, 1, 1, 1, 1]
    assert joined["position_ids"][0].tolist() == [0, 0, 0, 1, 3, 4]
    assert joined["attention_mask"][2].tolist() == [1] * 6 and joined["uid"].tolist() == ["p0", "p0", "p1", "p1"]


# ---------------------------------------------------------------------- start-up checks
BASE = ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "algorithm.adv_estimator=grpo",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "trainer.n_gpus_per_node=1"]
ON = ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc", "reward_model.reward_manager=dapo"]


@pytest.mark.parametrize("overrides, message", [
    (ON[:1] + ["algorithm.filter_groups.metric=accuracy"],
     "algorithm.filter_groups.metric='accuracy' is not valid; with algorithm.filter_groups.enable=True it must be one "
     "of: acc, score, seq_reward, seq_final_reward"),
    (ON[:1], "algorithm.filter_groups.metric is not set"),
    (ON + ["algorithm.filter_groups.max_num_gen_batches=-1"],
     "algorithm.filter_groups.max_num_gen_batches=-1 must be >= 0 (0: no limit"),
    (["data.gen_batch_size=512"], "data.gen_batch_size=512 differs from data.train_batch_size=1024"),
    (ON[:1] + ["algorithm.filter_groups.metric=seq_final_reward", "algorithm.use_kl_in_reward=True"],
     "seq_final_reward with algorithm.use_kl_in_reward=True"),
    (ON + ["reward_model.enable=True", "reward_model.micro_batch_size_per_gpu=4"],
     "algorithm.filter_groups.metric=acc with reward_model.enable=True and reward_model.combine=replace"),
])
def test_bad_filter_groups_keys_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=BASE + overrides)
    assert message in str(err.value)


def test_good_settings_load_and_warnings():
    c = load_config(overrides=BASE + ON + ["data.gen_batch_size=3072", "algorithm.filter_groups.max_num_gen_batches=10"])
    assert c.data.gen_batch_size == 3072 and c.algorithm.filter_groups.max_num_gen_batches == 10
    assert load_config(overrides=BASE).data.gen_batch_size == 1024  # follows data.train_batch_size
    _, warnings = find_problems(load_config(overrides=BASE + ON + ["actor_rollout_ref.rollout.n=1"], validate=False))
    assert any("rollout.n=1" in w and "nothing is filtered" in w for w in warnings)
    gae = ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size_per_gpu=4"]
    _, warnings = find_problems(load_config(overrides=BASE + ON + gae, validate=False))
    assert any("adv_estimator=gae" in w for w in warnings)
    _, warnings = find_problems(load_config(overrides=BASE + ON, validate=False))
    assert warnings == []


# ---------------------------------------------------------------------- end to end, tiny model
REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """Even answers: always 1 (the group carries no signal); odd: the parity of the reply's length."""
    if int(ground_truth) % 2 == 0:
        return 1.0
    return float(len(solution_str) % 2)
'''
DAPO = ["algorithm.filter_groups.enable=True", "algorithm.filter_groups.metric=acc", "reward_model.reward_manager=dapo",
        "data.gen_batch_size=3", "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "reward_model.overlong_buffer.enable=True", "reward_model.overlong_buffer.len=4",
        "reward_model.overlong_buffer.penalty_factor=0.5", "reward_model.overlong_buffer.log=True",
        "actor_rollout_ref.actor.clip_ratio_high=0.28", "actor_rollout_ref.actor.loss_agg_mode=token-mean"]


def _dapo_trainer(tmp_path, extra=(), n_train=64):
    tmp_path.mkdir(parents=True, exist_ok=True)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    return RLTrainer(load_config(overrides=tiny_overrides(
        tmp_path, [*DAPO, f"custom_reward_function.path={reward}", *extra], n_train=n_train)))


def _acc_and_penalty(trainer, batch):
    """Each row's acc and overlong penalty, recomputed outside the manager: the reward function on the
    decoded reply, and verl's min(-(L - (8 - 4)) / 4 * 0.5, 0) with L the reply's tokens (EOS included)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("reward_copy", trainer.config.custom_reward_function.path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    acc, penalty = [], []
    for i in range(len(batch)):
        mask = batch["response_mask"][i].bool()
        text = trainer.tokenizer.decode(batch["responses"][i][mask].tolist(), skip_special_tokens=True)
        acc.append(mod.compute_score("x", text, batch["reward_model"][i]["ground_truth"]))
        penalty.append(min(-(int(mask.sum()) - 4) / 4 * 0.5, 0.0))
    return np.array(acc), np.array(penalty)


def test_dapo_end_to_end(tmp_path, monkeypatch):
    from posttrain.data.arithmetic import write_arithmetic_parquet
    from posttrain.data.schema import read_rows, write_rows
    from posttrain.trainer import dynamic_sampling

    # prompts of different lengths (0-4 extra characters), so rounds are left-padded when joined
    data = tmp_path / "data"
    write_arithmetic_parquet(str(data), n_train=64, n_test=8, digits=1, ops=("+",), seed=0)
    rows = read_rows(str(data / "train.parquet"))
    for i, row in enumerate(rows):
        row["prompt"][-1]["content"] += "?" * (i % 5)
    write_rows(rows, str(data / "train.parquet"))
    widened = []
    pad = dynamic_sampling._left_pad_prompts
    monkeypatch.setattr(dynamic_sampling, "_left_pad_prompts",
                        lambda b, width, pad_id: widened.append(width - b["prompts"].shape[1]) or pad(b, width, pad_id))
    # two mini-batches, so the old log-probs are recomputed on the joined batch in a separate pass
    trainer = _dapo_trainer(tmp_path, ["actor_rollout_ref.actor.ppo_mini_batch_size=2"])
    history = trainer.fit()
    assert any(w > 0 for w in widened)
    # the engine's log-probs (narrower prompts) equal the trainer's on the left-padded rows (fp32)
    assert max(r["training/rollout_actor_probs_diff_max"] for r in history) < 1e-4
    assert [r["step"] for r in history] == [1, 2, 3]
    loader_batches = trainer.data.train_loader.state_dict()["position"]
    assert sum(r["train/num_gen_batches"] for r in history) == loader_batches  # every drawn batch was generated
    for row in history:
        assert row["train/num_groups_kept"] >= 4 and row["train/num_gen_batches"] >= 1
        assert row["train/num_groups_kept"] + row["train/num_groups_dropped"] == 3 * row["train/num_gen_batches"]
        assert 0 <= row["reward/overlong/mean"] <= 1 and row["reward/overlong_reward/mean"] <= 0
        assert all(math.isfinite(v) for v in row.values())
        assert "actor/pg_loss" in row and row["training/epoch"] == 0
    # even answers always score 1, so their groups are dropped: at least one dropped in 3 steps
    assert sum(r["train/num_groups_dropped"] for r in history) > 0
    last = trainer.last_batch
    assert len(last) == 4 * 4  # exactly train_batch_size groups of n, each group's rows together
    uids = last["uid"].tolist()
    assert len(set(uids)) == 4 and all(len(set(uids[i:i + 4])) == 1 for i in range(0, 16, 4))
    # every kept group differs in acc; every score is acc + the overlong penalty, recomputed by hand
    acc, penalty = _acc_and_penalty(trainer, last)
    assert all(acc[i:i + 4].std() > 0 for i in range(0, 16, 4))
    seq = last["token_level_scores"].sum(-1).numpy()
    assert seq.tolist() == pytest.approx((acc + penalty).tolist(), abs=1e-6)
    assert (penalty < 0).any()  # the tiny model runs long, so the penalty is exercised
    assert history[-1]["critic/score/mean"] == pytest.approx(float(seq.mean()), abs=1e-6)


def test_a_metric_the_reward_lacks_stops_the_first_step(tmp_path):
    # the test's reward returns plain numbers; the naive manager records no acc for them (verl's neither)
    trainer = _dapo_trainer(tmp_path, ["reward_model.reward_manager=naive", "reward_model.overlong_buffer.enable=False"])
    with pytest.raises(PosttrainError, match=r"metric=acc: the reward has no 'acc' field .*reward_manager=dapo"):
        trainer.fit()
    assert trainer.global_step == 1 and not list((tmp_path / "ckpt").glob("global_step_*"))


COMPARED = ("actor/", "critic/", "response_length/", "train/", "reward/")


def test_dapo_resume_is_exact(tmp_path):
    common = ["trainer.save_freq=2", "trainer.resume_mode=auto"]
    full = _dapo_trainer(tmp_path / "full", [*common, "trainer.total_training_steps=4"])
    full_rows = full.fit()
    _dapo_trainer(tmp_path / "split", [*common, "trainer.total_training_steps=2"]).fit()
    resumed = _dapo_trainer(tmp_path / "split", [*common, "trainer.total_training_steps=4"])
    resumed_rows = resumed.fit()
    assert [r["step"] for r in resumed_rows] == [3, 4]
    assert resumed.data.train_loader.state_dict() == full.data.train_loader.state_dict()
    for a, b in zip(full_rows[2:], resumed_rows):
        keys = sorted(k for k in a if k.startswith(COMPARED))
        assert keys == sorted(k for k in b if k.startswith(COMPARED)) and len(keys) > 10
        bad = {k: (a[k], b[k]) for k in keys if not math.isclose(a[k], b[k], rel_tol=1e-5, abs_tol=1e-7)}
        assert bad == {}, f"step {a['step']}: {bad}"
    assert torch.equal(resumed.last_batch["responses"], full.last_batch["responses"])
    # more than one batch per step was drawn, so the saved loader position is not just the step count
    assert sum(r["train/num_gen_batches"] for r in full_rows[:2]) > 2


def test_run_ends_when_the_epochs_are_used_up(tmp_path, capsys):
    # 12 prompts, batches of 3: 4 batches per epoch; 1 epoch; each step needs >= 1 batch (about 2)
    trainer = _dapo_trainer(tmp_path, ["trainer.total_training_steps=null", "trainer.total_epochs=1",
                                       "trainer.save_freq=1"], n_train=12)
    assert trainer.total_steps == 4  # verl's count: batches per epoch x epochs, an upper bound here
    history = trainer.fit()
    steps = len(history)
    assert 1 <= steps < 4 and trainer.total_steps == steps == trainer.global_step
    assert all(r["training/epoch"] == 0 for r in history)
    assert "used up the 1 epochs of prompts" in capsys.readouterr().out
    # the last finished step is saved and exported
    assert (tmp_path / "ckpt" / f"global_step_{steps}").is_dir()
    assert (tmp_path / "ckpt" / "hf_model" / "config.json").exists()
    # the loader stands where the last finished step left it (the unfinished step's draws are undone)
    state = trainer.data.train_loader.state_dict()
    assert state["epoch"] * 4 + state["position"] == sum(r["train/num_gen_batches"] for r in history)


CONSTANT_REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return 1.0
"""


def test_a_reward_that_never_varies_stops_the_run_instead_of_looping(tmp_path, capsys, monkeypatch):
    # verl's default max_num_gen_batches=0 and a step count set: without the epoch bound this never ends
    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    from posttrain.cli import main

    reward = tmp_path / "constant.py"
    reward.write_text(CONSTANT_REWARD)
    overrides = tiny_overrides(tmp_path, [*DAPO, f"custom_reward_function.path={reward}",
                                          "algorithm.filter_groups.max_num_gen_batches=0",
                                          "reward_model.overlong_buffer.enable=False",
                                          "trainer.total_training_steps=100"], n_train=12)
    rc = main(["train", *overrides])
    captured = capsys.readouterr()
    assert rc == 1, captured.err
    rounds = [line for line in captured.out.splitlines() if line.startswith("dynamic sampling: step 1 round")]
    assert len(rounds) == 4  # 12 prompts in batches of 3: one epoch, then the error
    assert rounds[-1].startswith("dynamic sampling: step 1 round 4: 0/4 groups kept so far (12 prompts drawn")
    assert captured.err.strip().splitlines()[-1].startswith("error: dynamic sampling: step 1: 4 generation rounds "
                                                            "drew 12 prompts, a whole epoch of the 12 training prompts")


# ---------------------------------------------------------------------- posttrain plan
def test_plan_describes_dynamic_sampling():
    from posttrain.plan.flow import build_flow
    from posttrain.plan.report import render_flow

    config = load_config(overrides=BASE + ON + ["data.gen_batch_size=1536", "data.train_batch_size=512",
                                                "algorithm.filter_groups.max_num_gen_batches=10"])
    flow = build_flow(config, train_size=10_000)
    assert flow.dynamic_sampling == ("dynamic sampling: rounds of data.gen_batch_size=1536 prompts x 4 until 512 groups "
                                     "whose acc differs are kept; at most 10 rounds = 15360 prompts per step, then an error")
    assert any(flow.dynamic_sampling in line for line in render_flow(flow))
    # steps: only a bound is known (10000 // 1536 = 6 batches per epoch, 30 epochs)
    assert flow.steps_per_epoch is None and flow.total_steps == 6 * 30 and "at most 6 = 10000 prompts" in flow.dataset_note
    assert build_flow(load_config(overrides=BASE), train_size=10_000).dynamic_sampling is None


# ---------------------------------------------------------------------- the recipe in examples/
@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_dapo_example_runs_two_steps(tmp_path, ranks):
    """examples/dapo_smollm2_arithmetic.sh unchanged but for the model (a tiny local one), the data, the
    reward (the tiny model never answers right, so a reward that varies), the device and the sizes."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from helpers.tiny_run import tiny_model_dir
    from posttrain.data.arithmetic import write_arithmetic_parquet

    if ranks > 1:
        pytest.importorskip("ray")
    root = Path(__file__).resolve().parents[2]
    write_arithmetic_parquet(str(tmp_path / "data"), n_train=32, n_test=4, digits=1, ops=("+",), seed=0)
    (tmp_path / "reward.py").write_text(REWARD)
    model = tiny_model_dir(tmp_path)
    shrunk = [f"data.train_files={tmp_path / 'data' / 'train.parquet'}", f"data.val_files={tmp_path / 'data' / 'test.parquet'}",
              f"actor_rollout_ref.model.path={model}", f"custom_reward_function.path={tmp_path / 'reward.py'}",
              "trainer.device=cpu", f"trainer.n_gpus_per_node={ranks}", "trainer.total_training_steps=2",
              "data.train_batch_size=4", "data.gen_batch_size=6", "data.max_prompt_length=192",
              "data.max_response_length=8", "reward_model.overlong_buffer.len=4",
              "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2",
              "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
              "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=fp32",
              "trainer.logger=[console,file]", "trainer.val_before_train=False", "trainer.test_freq=-1",
              "trainer.save_freq=2", f"trainer.default_local_dir={tmp_path / 'ckpt'}", f"trainer.run_dir={tmp_path / 'run'}"]
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(["bash", str(root / "examples" / "dapo_smollm2_arithmetic.sh"), *shrunk], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["train/num_groups_kept"] >= 4 and row["train/num_gen_batches"] >= 1
        assert row["train/num_groups_kept"] + row["train/num_groups_dropped"] == 6 * row["train/num_gen_batches"]
        assert "reward/overlong/mean" in row and "actor/pg_loss" in row and "actor/kl_loss" not in row
    assert (tmp_path / "ckpt" / "hf_model" / "config.json").exists()
