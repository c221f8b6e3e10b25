"""RewardManager, BatchRewardFn and custom reward functions."""

import pickle
import textwrap

import numpy as np
import pytest
import torch

from posttrain.batch import Batch
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.rewards import BatchRewardFn, RewardError, RewardManager, load_custom_reward_fn


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


def make_batch(tok, replies, truths, sources=None, width=16):
    """Right-padded responses; each reply ends with <|im_end|> (special, skipped when decoding)."""
    n = len(replies)
    responses = torch.zeros((n, width), dtype=torch.long)
    mask = torch.zeros((n, width), dtype=torch.long)
    for i, text in enumerate(replies):
        ids = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        responses[i, : len(ids)] = torch.tensor(ids)
        mask[i, : len(ids)] = 1
    return Batch.from_dict(
        {"responses": responses, "response_mask": mask},
        {
            "data_source": sources or ["posttrain/arithmetic"] * n,
            "reward_model": [{"style": "rule", "ground_truth": t} for t in truths],
            "extra_info": [{"index": i} for i in range(n)],
        },
    )


def write_fn(tmp_path, body, name="reward.py"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_scores_on_last_valid_token(tok):
    # lengths incl. eos: "#### 9" -> 7, "#### 3" -> 7, "9" -> 2
    b = make_batch(tok, ["#### 9", "#### 3", "9"], ["9", "4", "9"])
    scores, extra = RewardManager(tok)(b)
    assert scores.dtype == torch.float32 and scores.shape == (3, 16)
    assert scores[0, 6].item() == 1.0 and scores[0].sum().item() == 1.0
    assert scores[1].abs().sum().item() == 0.0
    assert scores[2].abs().sum().item() == 0.0  # no #### -> strict arithmetic scorer gives 0
    assert extra["reward/errors"].tolist() == [0.0, 0.0, 0.0]
    # without response_mask the response part of attention_mask is used
    attention = torch.cat([torch.ones(3, 4, dtype=torch.long), b["response_mask"]], 1)
    b2 = Batch.from_dict(
        {"responses": b["responses"], "attention_mask": attention},
        {k: b[k] for k in ("data_source", "reward_model")},
    )
    assert torch.equal(RewardManager(tok)(b2)[0], scores)


def test_dict_scores_and_reward_fn_key(tmp_path, tok):
    path = write_fn(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
            ok = solution_str.strip().endswith(ground_truth)
            return {"score": float(ok) + bonus, "acc": ok, "source": data_source, "row": extra_info["index"]}
        """,
    )
    fn = load_custom_reward_fn(path, "compute_score", reward_kwargs={"bonus": 0.5})
    b = make_batch(tok, ["#### 9", "#### 3"], ["9", "4"])
    b["task"] = ["t1", "t2"]
    scores, extra = RewardManager(tok, compute_score=fn, reward_fn_key="task")(b)
    assert scores[0, 6].item() == 1.5 and scores[1, 6].item() == 0.5
    assert extra["score"].tolist() == [1.5, 0.5]
    assert extra["acc"].tolist() == [1.0, 0.0]
    assert extra["source"].tolist() == ["t1", "t2"]
    assert extra["row"].tolist() == [0.0, 1.0]


def test_errors_raise_or_zero(tmp_path, tok):
    path = write_fn(
        tmp_path,
        """
        def boom(data_source, solution_str, ground_truth, extra_info=None):
            if ground_truth == "4":
                raise ZeroDivisionError("bad row")
            return 1.0
        """,
    )
    fn = load_custom_reward_fn(path, "boom")
    b = make_batch(tok, ["a", "b", "c"], ["1", "4", "2"], sources=["s0", "s1", "s2"])
    with pytest.raises(RewardError, match=r"row 1 \(data_source='s1', extra_info.index=1\): ZeroDivisionError: bad row \(at .*reward.py:4\)"):
        RewardManager(tok, compute_score=fn)(b)
    scores, extra = RewardManager(tok, compute_score=fn, on_error="zero")(b)
    assert scores.sum(1).tolist() == [1.0, 0.0, 1.0]
    assert extra["reward/errors"].tolist() == [0.0, 1.0, 0.0]


def test_bad_return_values(tmp_path, tok):
    path = write_fn(
        tmp_path,
        """
        def as_text(data_source, solution_str, ground_truth, extra_info=None):
            return "1.0"
        def no_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"acc": 1}
        """,
    )
    b = make_batch(tok, ["a"], ["1"])
    with pytest.raises(RewardError, match="row 0 .* returned str, expected a float or a dict"):
        RewardManager(tok, compute_score=load_custom_reward_fn(path, "as_text"))(b)
    with pytest.raises(RewardError, match=r"row 0 .* no 'score' key: \['acc'\]"):
        RewardManager(tok, compute_score=load_custom_reward_fn(path, "no_score"))(b)
    with pytest.raises(KeyError, match="no non-tensor key 'reward_model'"):
        RewardManager(tok)(b.select(non_tensor_batch_keys=["data_source"]))


def test_worker_pool_matches_serial(tmp_path, tok):
    path = write_fn(
        tmp_path,
        """
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return {"score": len(solution_str) / 10 + (solution_str.endswith(ground_truth)), "n": len(solution_str)}
        """,
    )
    fn = load_custom_reward_fn(path, None)  # name defaults to compute_score
    replies = [f"#### {i % 7}" + "x" * (i % 3) for i in range(24)]
    b = make_batch(tok, replies, [str(i % 5) for i in range(24)])
    serial_scores, serial_extra = RewardManager(tok, compute_score=fn)(b)
    pool = RewardManager(tok, compute_score=fn, num_workers=2)
    try:
        pool_scores, pool_extra = pool(b)
        assert torch.equal(serial_scores, pool_scores)
        assert serial_extra.keys() == pool_extra.keys()
        for k in serial_extra:
            np.testing.assert_array_equal(serial_extra[k], pool_extra[k])
        assert pool(b)[0].sum().item() == serial_scores.sum().item()  # the pool is reused
    finally:
        pool.close()


def test_batch_reward_fn(tok):
    b = make_batch(tok, ["ab", "abcd"], ["1", "2"])  # lengths 3 and 5 with eos

    def by_length(batch):
        return batch["response_mask"].sum(-1).float()

    scores, extra = BatchRewardFn(by_length)(b)
    assert scores[0, 2].item() == 3.0 and scores[1, 4].item() == 5.0 and scores.sum().item() == 8.0
    assert extra == {}
    with pytest.raises(ValueError, match=r"returned shape \[3\], expected \[2\]"):
        BatchRewardFn(lambda batch: torch.zeros(3))(b)


def test_empty_response_keeps_score_in_row(tok):
    b = make_batch(tok, ["a"], ["1"])
    b["response_mask"] = torch.zeros_like(b["response_mask"])
    scores, _ = BatchRewardFn(lambda batch: torch.tensor([2.0]))(b)
    assert scores[0, 0].item() == 2.0 and scores.sum().item() == 2.0


def test_custom_loading_errors(tmp_path):
    assert load_custom_reward_fn(None, "x") is None
    with pytest.raises(FileNotFoundError, match=r"custom_reward_function.path='.*missing.py': file not found"):
        load_custom_reward_fn(str(tmp_path / "missing.py"), "f")
    path = write_fn(
        tmp_path,
        """
        def two_args(solution_str, ground_truth):
            return 0.0
        def needs_more(data_source, solution_str, ground_truth, extra_info, tokenizer):
            return 0.0
        def flexible(**kwargs):
            return 1.0
        async def asynchronous(data_source, solution_str, ground_truth, extra_info=None):
            return 0.0
        """,
    )
    with pytest.raises(AttributeError, match=r"custom_reward_function.name='nope' is not defined .* callables there: "):
        load_custom_reward_fn(path, "nope")
    with pytest.raises(TypeError, match=r"does not accept \['data_source', 'extra_info'\]"):
        load_custom_reward_fn(path, "two_args")
    with pytest.raises(TypeError, match=r"requires \['tokenizer'\]"):
        load_custom_reward_fn(path, "needs_more")
    with pytest.raises(TypeError, match="is async"):
        load_custom_reward_fn(path, "asynchronous")
    fn = load_custom_reward_fn(path, "flexible")
    assert fn(data_source="a", solution_str="b", ground_truth="c") == 1.0
    clone = pickle.loads(pickle.dumps(fn))
    assert clone(data_source="a", solution_str="b", ground_truth="c") == 1.0
    broken = write_fn(tmp_path, "import not_a_real_module_xyz\n", name="broken.py")
    with pytest.raises(RuntimeError, match="importing it failed: ModuleNotFoundError"):
        load_custom_reward_fn(broken, "f")
