"""`posttrain prep pairs`: pair choice on hand-built samples, argument errors, and a run with a tiny
random model whose samples a custom reward scores (chosen rewarded, rejected not, read back as DPO data)."""

import re

import pytest

from helpers.tiny_run import tiny_model_dir
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.commands import prep
from posttrain.data.arithmetic import write_arithmetic_parquet
from posttrain.commands.pairs import PairCounts, Sample, choose_pairs, sample_pairs
from posttrain.data.preference import PreferenceDataset
from posttrain.data.schema import DataError, read_rows, write_rows
from posttrain.errors import ConfigError

PARITY_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(sum(map(ord, solution_str)) % 2 == 0)
'''


def _parity(text: str) -> float:
    return float(sum(map(ord, text)) % 2 == 0)


def test_choose_pairs_by_hand():
    s = [Sample("a", 0.0), Sample("b", 1.0, finished=False), Sample("c", 1.0), Sample("a", 0.0), Sample(" ", 0.0),
         Sample("d", 0.5)]
    # correct: c (finished) before b; wrong: a, d (the repeated "a" and the empty reply left out)
    assert choose_pairs(s, threshold=1.0) == [(Sample("c", 1.0), Sample("a", 0.0))]
    assert choose_pairs(s, threshold=1.0, max_pairs=5) == [(Sample("c", 1.0), Sample("a", 0.0)),
                                                           (Sample("b", 1.0, False), Sample("d", 0.5))]
    assert choose_pairs(s, threshold=0.5, max_pairs=5) == [(Sample("c", 1.0), Sample("a", 0.0))]  # d is correct now
    assert choose_pairs([Sample("x", 1.0), Sample("y", 1.0)], threshold=1.0) == []
    assert choose_pairs([Sample("x", 0.0), Sample("y", 0.0)], threshold=1.0) == []


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    root = tmp_path_factory.mktemp("pairs")
    write_arithmetic_parquet(str(root / "data"), n_train=8, n_test=2, digits=1, ops=("+",), seed=0)
    reward = root / "parity.py"
    reward.write_text(PARITY_REWARD)
    return {"data": str(root / "data" / "train.parquet"), "model": str(tiny_model_dir(root)), "reward": str(reward),
            "root": root}


@pytest.mark.parametrize("flag, value, match", [
    # numeric flags: argparse's error from posttrain.cli_args (exit 2 before anything loads)
    ("--n", "1", "argument --n: 1 is not valid: must be a whole number >= 2"),
    ("--temperature", "0", "argument --temperature: 0 is not valid: must be a finite number > 0"),
    ("--max-new-tokens", "0", "argument --max-new-tokens: 0 is not valid: must be a whole number >= 1"),
    ("--batch-size", "0", "argument --batch-size: 0 is not valid: must be a whole number >= 1"),
    ("--pairs-per-prompt", "0", "argument --pairs-per-prompt: 0 is not valid: must be a whole number >= 1"),
    ("--limit", "0", "argument --limit: 0 is not valid: must be a whole number >= 1"),
    ("--top-p", "1.5", r"argument --top-p: 1.5 is not valid: must be a number in \(0, 1\]"),
    ("--output", "pairs.csv", "--output pairs.csv: give a .parquet or .jsonl file name"),
])
def test_bad_arguments_are_one_clear_error(task, capsys, flag, value, match):
    argv = ["pairs", "--input", task["data"], "--model", task["model"], "--output", "out.parquet", flag, value]
    try:
        code = prep.main(argv)
    except SystemExit as stop:  # argparse's own error
        code = stop.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1].startswith("posttrain prep pairs: error: ")
    assert re.search(match, err), err


def test_the_python_api_checks_the_same_values(task):
    from posttrain.config import ConfigError
    from posttrain.commands.pairs import sample_pairs

    with pytest.raises(ConfigError, match="--n 1: a pair needs at least 2 samples per prompt"):
        sample_pairs(task["model"], task["data"], n=1)


def test_unknown_data_source_fails_before_generating(task, tmp_path):
    rows = read_rows(task["data"])
    for row in rows:
        row["data_source"] = "my/task"
    write_rows(rows, str(tmp_path / "mine.parquet"))
    with pytest.raises(DataError, match=r"no built-in reward for data_source=\['my/task'\].*--reward-path"):
        sample_pairs(task["model"], str(tmp_path / "mine.parquet"), n=2, max_new_tokens=2)


def test_pairs_from_a_tiny_model_scored_by_a_custom_reward(task, tmp_path, capsys):
    out = tmp_path / "pairs.parquet"
    argv = ["pairs", "--input", task["data"], "--model", task["model"], "--output", str(out), "--n", "4",
            "--max-new-tokens", "6", "--reward-path", task["reward"], "--param-dtype", "fp32", "--seed", "1"]
    assert prep.main(argv) == 0
    printed = capsys.readouterr().out
    rows = read_rows(str(out))
    prompts = read_rows(task["data"])
    assert "8 prompts, 32 samples" in printed and f"wrote {len(rows)} pairs to {out}" in printed
    assert len(rows) >= 3  # parity of random replies: most prompts have both kinds
    for row in rows:
        source = prompts[row["extra_info"]["index"]]
        assert row["prompt"] == source["prompt"] and row["reward_model"] == source["reward_model"]
        assert row["data_source"] == "posttrain/arithmetic"
        chosen, rejected = row["chosen"][0]["content"], row["rejected"][0]["content"]
        assert row["chosen"][0]["role"] == row["rejected"][0]["role"] == "assistant"
        assert _parity(chosen) == 1.0 == row["extra_info"]["chosen_score"]
        assert _parity(rejected) == 0.0 == row["extra_info"]["rejected_score"]
    # the file is DPO data as it stands
    ds = PreferenceDataset(str(out), build_tiny_tokenizer(), max_length=None)
    assert len(ds) == len(rows)


def test_counts_add_up_and_reward_key_names_the_scorers_fields(task):
    rows, counts = sample_pairs(task["model"], task["data"], n=3, max_new_tokens=4, reward_path=task["reward"],
                                param_dtype="fp32", limit=5, pairs_per_prompt=2, seed=2)
    assert isinstance(counts, PairCounts) and counts.prompts == 5 and counts.samples == 15
    assert counts.all_correct + counts.all_wrong + counts.mixed == 5
    # 3 samples make at most one pair (one reply of the rarer kind), even with --pairs-per-prompt 2
    assert counts.pairs == len(rows) <= counts.mixed
    with pytest.raises(ConfigError, match=r"--reward-key flexible_acc: the scorer returns no such field"):
        sample_pairs(task["model"], task["data"], n=2, max_new_tokens=2, reward_path=task["reward"],
                     param_dtype="fp32", limit=1, reward_key="flexible_acc")


def test_the_built_in_scorer_and_its_fields(task):
    """The arithmetic scorer on a random model: nothing is right, so no pairs, every prompt all wrong;
    its flexible_acc field can be the deciding key."""
    rows, counts = sample_pairs(task["model"], task["data"], n=2, max_new_tokens=3, param_dtype="fp32", limit=3)
    assert rows == [] and counts.all_wrong == 3 and counts.correct_samples == 0
    rows, counts = sample_pairs(task["model"], task["data"], n=2, max_new_tokens=3, param_dtype="fp32", limit=3,
                                reward_key="flexible_acc")
    assert counts.prompts == 3
