"""The built-in arithmetic task: determinism, disjoint splits, answers, rows, the cached default."""

import os

import pytest

from posttrain.data import RLHFDataset, read_rows
from helpers.data import make_data_config
from posttrain.data.arithmetic import (
    DATA_SOURCE,
    Problem,
    default_dataset_files,
    demo_problem,
    generate_problems,
    make_messages,
    make_rows,
)
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.rewards import default_compute_score


def test_problem_answers():
    assert Problem(47, "+", 38).answer == 85 and Problem(47, "+", 38).question == "What is 47 + 38?"
    assert Problem(3, "-", 8) == (8, "-", 3) and Problem(3, "-", 8).answer == 5  # never negative
    assert Problem(7, "*", 6).answer == 42


def test_deterministic_and_disjoint():
    a = generate_problems(200, 50, digits=2, ops="+-*", seed=1)
    b = generate_problems(200, 50, digits=2, ops="+-*", seed=1)
    c = generate_problems(200, 50, digits=2, ops="+-*", seed=2)
    assert a == b and a != c
    train, test = a
    assert len(train) == 200 and len(test) == 50
    assert len({p.question for p in test}) == 50
    assert not {p.question for p in train} & {p.question for p in test}
    assert all(10 <= x <= 99 for p in train + test for x in (p[0], p[2]))
    assert {p[1] for p in train} == {"+", "-", "*"}


def test_small_space_repeats_train_but_never_leaks_test():
    # 1-digit addition has 81 distinct questions, minus the few-shot demo (3 + 4): 64 test leave 16
    train, test = generate_problems(100, 64, digits=1, ops="+", seed=0)
    assert len(train) == 100 and len({p.question for p in train}) == 16
    assert demo_problem(1) == (3, "+", 4) and demo_problem(1) not in train + test
    assert not {p.question for p in train} & {p.question for p in test}
    with pytest.raises(ValueError, match="n_test=81 exceeds the 80 distinct"):
        generate_problems(1, 81, digits=1, ops="+")
    with pytest.raises(ValueError, match="ops must be a non-empty subset"):
        generate_problems(1, 1, ops="/")


def test_large_space_sampling():
    train, test = generate_problems(300, 100, digits=4, ops="+", seed=0)  # 81M questions: sampled
    assert len({p.question for p in train}) == 300
    assert not {p.question for p in train} & {p.question for p in test}


def test_rows_score_with_the_default_scorer():
    train, _ = generate_problems(3, 1, digits=2, ops="+", seed=0)
    rows = make_rows(train, "train")
    r = rows[0]
    assert r["data_source"] == DATA_SOURCE == "posttrain/arithmetic"
    assert r["reward_model"]["ground_truth"] == str(train[0].answer)
    assert r["prompt"][-1]["content"].startswith(train[0].question)
    assert r["extra_info"] == {"split": "train", "index": 0, "question": train[0].question}
    good = f"{train[0].question[8:-1]} = {train[0].answer}\n#### {train[0].answer}"
    assert default_compute_score(r["data_source"], good, r["reward_model"]["ground_truth"])["score"] == 1.0
    assert make_messages(Problem(12, "*", 34), "fewshot") == [
        {"role": "user", "content": "What is 31 + 45?"},
        {"role": "assistant", "content": "31 + 45 = 76\n#### 76"},
        {"role": "user", "content": "What is 12 * 34?"},
    ]
    assert make_messages(Problem(1, "+", 2), "instruct") == [
        {"role": "user", "content": "What is 1 + 2? End with #### and the answer."}
    ]
    with pytest.raises(ValueError, match="prompt_style='chatty'"):
        make_messages(train[0], "chatty")


def test_default_dataset_is_cached(tmp_path):
    train, test = default_dataset_files(str(tmp_path), n_train=32, n_test=8)
    mtime = (tmp_path / train).stat().st_mtime_ns
    assert default_dataset_files(str(tmp_path), n_train=32, n_test=8) == (train, test)
    assert (tmp_path / train).stat().st_mtime_ns == mtime  # not rewritten
    assert len(read_rows(train)) == 32 and len(read_rows(test)) == 8
    ds = RLHFDataset(train, build_tiny_tokenizer(), make_data_config(max_prompt_length=512))
    assert len(ds) == 32
    with pytest.raises(TypeError, match="unknown arithmetic knob"):
        default_dataset_files(str(tmp_path), n_trian=3)


def test_the_built_in_data_goes_to_posttrain_cache_dir(tmp_path, monkeypatch):
    """POSTTRAIN_CACHE_DIR moves the built-in RL and SFT data as it moves the other caches; nothing lands in
    ~/.cache/posttrain (HOME is a folder of its own here, and stays empty: the negative control)."""
    from posttrain.data.prep_sft import default_arithmetic_sft_files

    home, cache = tmp_path / "home", tmp_path / "cache"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("POSTTRAIN_CACHE_DIR", str(cache))
    rl = default_dataset_files(n_train=8, n_test=4)
    sft = default_arithmetic_sft_files(n_train=8, n_test=4)
    for path in (*rl, *sft):
        assert path.startswith(str(cache)) and os.path.exists(path), path
    assert rl[0].startswith(str(cache / "arithmetic")) and sft[0].startswith(str(cache / "arithmetic_sft"))
    assert list(home.iterdir()) == []
    monkeypatch.delenv("POSTTRAIN_CACHE_DIR")
    assert default_dataset_files(n_train=8, n_test=4)[0].startswith(str(home / ".cache" / "posttrain" / "arithmetic"))


def test_the_widest_operand_is_one_bound_for_the_generator_and_the_config():
    from posttrain.config import ConfigError, load_config
    from posttrain.config.ranges import LEAF_RANGES
    from posttrain.data.arithmetic import MAX_DIGITS, generate_problems

    assert LEAF_RANGES["digits"].high == MAX_DIGITS == 18
    train, test = generate_problems(2, 1, digits=MAX_DIGITS)
    assert len(str(train[0][0])) == MAX_DIGITS
    with pytest.raises(ValueError, match="digits must be a whole number from 1 to 18, got 19"):
        generate_problems(2, 1, digits=19)  # range(10**18, 10**19) is too long for random.choice
    with pytest.raises(ConfigError, match=r"data.arithmetic.digits=5000 must be in \[1, 18\]"):
        load_config(overrides=["data.arithmetic.digits=5000"])
