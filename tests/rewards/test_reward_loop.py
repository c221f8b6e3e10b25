"""verl 0.9's reward loop in posttrain (posttrain.rewards.loop): the managers naive, dapo, limit, remote, the
registry, sync and async reward functions, time-outs and on_error, signature checks before the first step."""

from __future__ import annotations

import asyncio
import os
import textwrap
import time

import numpy as np
import pytest
import torch

from helpers.tokenizer import build_tiny_tokenizer

from posttrain.batch import Batch
from posttrain.errors import ConfigError
from posttrain.rewards.custom import RewardSignatureError
from posttrain.rewards.functions import RewardFunction, load_reward_function
from posttrain.rewards.loop import (REWARD_MANAGERS, RewardManagerBase, build_reward_manager, register,
                                    resolve_reward_manager_cls)
from posttrain.rewards.manager import OverlongBuffer, RewardError, RewardManager

R = 16


def make_batch(texts: list[str], truths: list[str], source: str = "posttrain/arithmetic") -> Batch:
    """Prompts of 3 tokens and right-padded responses of ``R`` tokens (char-level tokenizer)."""
    tok = build_tiny_tokenizer()
    n = len(texts)
    responses = torch.full((n, R), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros(n, R, dtype=torch.long)
    for i, t in enumerate(texts):
        ids = tok(t, add_special_tokens=False)["input_ids"][:R]
        responses[i, :len(ids)] = torch.tensor(ids)
        mask[i, :len(ids)] = 1
    prompts = torch.ones(n, 3, dtype=torch.long) * 20
    attention = torch.cat([torch.ones(n, 3, dtype=torch.long), mask], dim=1)
    return Batch.from_dict(
        {"prompts": prompts, "responses": responses, "response_mask": mask, "attention_mask": attention,
         "input_ids": torch.cat([prompts, responses], 1)},
        {"data_source": np.array([source] * n, dtype=object),
         "reward_model": np.array([{"ground_truth": g} for g in truths], dtype=object),
         "extra_info": np.array([{"index": i} for i in range(n)], dtype=object)})


def write(tmp_path, name: str, code: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(code))
    return str(path)


TEXTS = ["the answer is 12", "13", "no idea", "it is 7 or 12"]
TRUTHS = ["12", "13", "5", "12"]


def test_naive_matches_the_existing_manager_on_the_built_in_scorer():
    tok = build_tiny_tokenizer()
    batch = make_batch(TEXTS, TRUTHS)
    scores, extra = build_reward_manager(tok, name="naive")(batch)
    want, _ = RewardManager(tok)(batch)
    assert torch.equal(scores, want)
    # one score per row, on its last valid response token (lengths 16, 2, 7, 13 -> columns 15, 1, 6, 12)
    assert scores.nonzero()[:, 1].tolist() == [c for c, s in zip([15, 1, 6, 12], scores.sum(1)) if s != 0]
    assert extra["reward/errors"].tolist() == [0.0] * 4


def test_sync_and_async_functions_give_the_same_scores_and_extras(tmp_path):
    tok = build_tiny_tokenizer()
    path = write(tmp_path, "fns.py", """
        import asyncio

        def plain(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": float(ground_truth in solution_str), "chars": len(solution_str)}

        async def waits(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
            await asyncio.sleep(0.01)
            return {"score": float(ground_truth in solution_str), "chars": len(solution_str)}
    """)
    sync_fn, async_fn = RewardFunction(path, "plain"), RewardFunction(path, "waits")
    assert (sync_fn.is_async, async_fn.is_async) == (False, True)
    batch = make_batch(TEXTS, TRUTHS)
    a, ea = build_reward_manager(tok, compute_score=sync_fn)(batch)
    b, eb = build_reward_manager(tok, compute_score=async_fn)(batch)
    assert torch.equal(a, b) and a.sum(1).tolist() == [1.0, 1.0, 0.0, 1.0]
    assert ea["chars"].tolist() == eb["chars"].tolist() == [16.0, 2.0, 7.0, 13.0]


def test_dapo_overlong_penalty_by_hand():
    tok = build_tiny_tokenizer()
    # limit 16, buffer 4: responses up to 12 tokens are free, each token past costs 1/4 of the factor 1.0
    buffer = OverlongBuffer(length=4, penalty_factor=1.0, max_response_length=16, log=True)
    batch = make_batch(["x" * 16, "x" * 14, "x" * 12, "x" * 3], ["1"] * 4)
    scores, extra = build_reward_manager(tok, name="dapo", compute_score=lambda **kw: 1.0, overlong=buffer)(batch)
    assert scores.sum(1).tolist() == pytest.approx([0.0, 0.5, 1.0, 1.0])  # 1 - 4/4, 1 - 2/4, 1, 1
    assert extra["overlong_reward"].tolist() == pytest.approx([-1.0, -0.5, 0.0, 0.0])
    assert extra["overlong"].tolist() == [1.0, 1.0, 0.0, 0.0] and extra["acc"].tolist() == [1.0] * 4


class _Gauge:
    def __init__(self):
        self.now = self.most = 0

    async def __call__(self, data_source, solution_str, ground_truth, extra_info=None):
        self.now += 1
        self.most = max(self.most, self.now)
        await asyncio.sleep(0.3)
        self.now -= 1
        return 1.0


def test_rows_run_concurrently_and_limit_bounds_them():
    tok = build_tiny_tokenizer()
    batch = make_batch(["a"] * 8, ["1"] * 8)
    gauge = _Gauge()
    start = time.monotonic()
    build_reward_manager(tok, compute_score=gauge)(batch)
    assert gauge.most == 8 and time.monotonic() - start < 0.3 * 8 / 2  # all eight at once: ~0.3 s
    gauge = _Gauge()
    start = time.monotonic()
    scores, _ = build_reward_manager(tok, name="limit", compute_score=gauge, limits={"max_concurrent": 2})(batch)
    assert gauge.most == 2 and time.monotonic() - start >= 0.3 * 8 / 2 - 0.05 and scores.sum().item() == 8.0
    # verl's rate limit: 120 requests a minute = 2 a second, a bucket of 2 (the first two start at once)
    gauge = _Gauge()
    start = time.monotonic()
    build_reward_manager(tok, name="rate_limited", compute_score=gauge,
                         limits={"max_concurrent": 8, "max_rpm": 120})(make_batch(["a"] * 4, ["1"] * 4))
    assert 1.0 - 0.05 <= time.monotonic() - start < 2.5  # rows 3 and 4 wait 0.5 s each


async def _never(data_source, solution_str, ground_truth, extra_info=None):
    await asyncio.sleep(3600)


def test_a_hanging_function_costs_its_time_out_and_on_error_decides():
    tok = build_tiny_tokenizer()
    batch = make_batch(TEXTS, TRUTHS)
    for name in ("naive", "limit"):
        manager = build_reward_manager(tok, name=name, compute_score=_never, timeout_s=0.4, on_error="zero",
                                       limits={"max_concurrent": 4})
        start = time.monotonic()
        scores, extra = manager(batch)
        assert time.monotonic() - start < 0.4 + 1.0
        assert scores.abs().sum() == 0 and extra["reward/errors"].tolist() == [1.0] * 4
        assert manager.step_metrics()["reward/timeouts"] == 4 and manager.step_metrics()["reward/timeouts"] == 0
    strict = build_reward_manager(tok, compute_score=_never, timeout_s=0.2, on_error="raise")
    with pytest.raises(RewardError, match=r"row 0 \(data_source='posttrain/arithmetic'\).*timed out after 0.2 s"):
        strict(batch)


def test_bad_results_are_errors_per_row():
    tok = build_tiny_tokenizer()
    values = iter([float("nan"), {"no_score": 1}, "high", 2.5])
    manager = build_reward_manager(tok, compute_score=lambda **kw: next(values), on_error="zero", timeout_s=None)
    scores, extra = manager.configure(max_threads=1)(make_batch(TEXTS, TRUTHS))
    assert extra["reward/errors"].tolist() == [1.0, 1.0, 1.0, 0.0] and scores.sum().item() == 2.5


def test_remote_scores_in_worker_processes_and_ends_a_hang(tmp_path):
    tok = build_tiny_tokenizer()
    path = write(tmp_path, "cpu.py", """
        import os, time

        def score(data_source, solution_str, ground_truth, extra_info=None):
            if solution_str == "hang":
                time.sleep(3600)
            return {"score": float(ground_truth in solution_str), "pid": os.getpid()}

        async def not_here(data_source, solution_str, ground_truth, extra_info=None):
            return 1.0
    """)
    batch = make_batch(TEXTS + ["hang"], TRUTHS + ["1"])
    manager = build_reward_manager(tok, name="remote", compute_score=RewardFunction(path, "score"), num_workers=2,
                                   timeout_s=1.5, on_error="zero")
    try:
        scores, extra = manager(batch)
    finally:
        manager.close()
    assert scores.sum(1).tolist() == [1.0, 1.0, 0.0, 1.0, 0.0] and extra["reward/errors"].tolist() == [0] * 4 + [1]
    assert os.getpid() not in {int(p) for p in extra["pid"][:4]}  # scored in the workers
    with pytest.raises(ConfigError, match="async"):
        build_reward_manager(tok, name="remote", compute_score=RewardFunction(path, "not_here"))


def test_registry_register_importlib_and_errors(tmp_path):
    tok = build_tiny_tokenizer()
    path = write(tmp_path, "my_manager.py", """
        from posttrain.rewards.loop import RewardManagerBase, register

        @register("length_bonus")
        class LengthBonus(RewardManagerBase):
            async def run_single(self, data):
                data_item = data[-1]  # verl's docs: the last (only) row
                length = int(data_item.batch["attention_mask"][-data_item.batch["responses"].shape[-1]:].sum())
                truth = data_item.non_tensor_batch["reward_model"]["ground_truth"]
                return {"reward_score": float(length), "reward_extra_info": {"truth": truth}}

        class NotRegistered(LengthBonus):
            pass
    """)
    batch = make_batch(TEXTS, TRUTHS)
    manager = build_reward_manager(tok, name="length_bonus", module_path=path)
    scores, extra = manager(batch)
    assert scores.sum(1).tolist() == [16.0, 2.0, 7.0, 13.0] and extra["truth"].tolist() == TRUTHS
    cls = resolve_reward_manager_cls("importlib", name="naive", module_path=path, module_name="NotRegistered")
    assert cls.__name__ == "NotRegistered" and "NotRegistered" not in REWARD_MANAGERS
    # verl 0.9.1 reads the class from reward_manager.name: a default module.name falls back to it
    assert resolve_reward_manager_cls("importlib", "NotRegistered", path, "custom_reward_manager") is cls
    with pytest.raises(ConfigError, match=r"'no_such'.*registered: \[.*'dapo'.*'limit'.*'naive'.*'remote'"):
        resolve_reward_manager_cls("register", "no_such")
    with pytest.raises(ConfigError, match="defines neither"):
        resolve_reward_manager_cls("importlib", "Nope", path, "custom_reward_manager")
    with pytest.raises(ConfigError, match="file not found"):
        resolve_reward_manager_cls("register", "naive", str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match="already registered"):
        register("naive")(type("Other", (RewardManagerBase,), {}))


def test_signatures_are_checked_when_loaded(tmp_path):
    tok = build_tiny_tokenizer()
    path = write(tmp_path, "sigs.py", """
        def two_args(solution_str, ground_truth):
            return 1.0

        async def genrm(data_source, solution_str, ground_truth, extra_info, reward_router_address,
                        reward_model_tokenizer):
            return 1.0
    """)
    with pytest.raises(RewardSignatureError, match=r"'two_args'.*does not accept \['data_source', 'extra_info'\]"):
        load_reward_function(path, "two_args")
    with pytest.raises(RewardSignatureError, match="reward.reward_model.enable=True"):
        load_reward_function(path, "genrm")
    fn = load_reward_function(path, "genrm", genrm=True)
    assert fn.is_async
    with pytest.raises(ConfigError, match="serve a reward model"):
        build_reward_manager(tok, compute_score=fn)
    with pytest.raises(ConfigError, match="reward.on_error='skip'"):
        build_reward_manager(tok, on_error="skip")
