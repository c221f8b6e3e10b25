"""`posttrain prep`: GSM8K (real files), MATH (a small file written here), arithmetic."""

import json
import os

import pytest

from posttrain.data import read_rows
from posttrain.commands.prep import main  # `posttrain prep` as the command line runs it (pairs included)

GSM8K_DIR = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "data", "gsm8k")


@pytest.mark.skipif(not os.path.exists(os.path.join(GSM8K_DIR, "train.jsonl")), reason="needs ../shared/data/gsm8k")
def test_gsm8k_real_files(tmp_path):
    assert main(["gsm8k", "--input", GSM8K_DIR, "--output", str(tmp_path)]) == 0
    train, test = read_rows(str(tmp_path / "train.parquet")), read_rows(str(tmp_path / "test.parquet"))
    assert (len(train), len(test)) == (7473, 1319)
    r = train[0]
    q = (
        "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?"
    )
    assert r["data_source"] == "openai/gsm8k"
    assert r["prompt"] == [
        {"role": "user", "content": q + ' Let\'s think step by step and output the final answer after "####".'}
    ]
    assert r["ability"] == "math"
    assert r["reward_model"] == {"style": "rule", "ground_truth": "72"}
    assert r["extra_info"]["split"] == "train" and r["extra_info"]["index"] == 0
    assert r["extra_info"]["question"] == q and r["extra_info"]["answer"].endswith("#### 72")
    assert test[5]["extra_info"] == {**test[5]["extra_info"], "split": "test", "index": 5}
    # commas are removed from ground truths ("#### 1,000" style answers exist in GSM8K)
    assert all("," not in row["reward_model"]["ground_truth"] for row in train)


def test_gsm8k_missing_input(tmp_path, capsys):
    assert main(["gsm8k", "--input", str(tmp_path), "--output", str(tmp_path / "o")]) == 2
    assert "train.jsonl: file not found" in capsys.readouterr().err


def test_math_prep(tmp_path, capsys):
    src = tmp_path / "train.jsonl"
    recs = [
        {"problem": "What is $1+1$?", "solution": "We add: $1+1=\\boxed{2}$."},
        {"problem": "Simplify $\\frac{2}{4}$.", "solution": "Divide: $\\boxed{\\frac{1}{2}}$"},
        {"problem": "No box here.", "solution": "The answer is 3."},
        {"problem": "Area?", "solution": "It is $\\fbox{4\\pi}$"},
    ]
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    out = tmp_path / "out"
    assert main(["math", "--input", str(src), "--output", str(out)]) == 0
    assert "skipped 1 without a \\boxed answer: rows [2]" in capsys.readouterr().out
    rows = read_rows(str(out / "train.parquet"))
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["2", "\\frac{1}{2}", "4\\pi"]
    assert rows[0]["data_source"] == "DigitalLearningGmbH/MATH-lighteval"
    assert rows[0]["prompt"][0]["content"] == (
        "What is $1+1$? Let's think step by step and output the final answer within \\boxed{}."
    )
    assert rows[2]["extra_info"] == {"split": "train", "index": 3}


def test_math_prep_bad_record(tmp_path, capsys):
    src = tmp_path / "test.jsonl"
    src.write_text(json.dumps({"question": "x"}) + "\n")
    assert main(["math", "--input", str(src), "--output", str(tmp_path)]) == 2
    assert "test.jsonl row 0: missing string field 'problem'" in capsys.readouterr().err


def test_arithmetic_prep(tmp_path):
    args = ["arithmetic", "--output", str(tmp_path), "--n-train", "40", "--n-test", "8", "--digits", "2"]
    assert main(args + ["--ops", "+-"]) == 0
    train, test = read_rows(str(tmp_path / "train.parquet")), read_rows(str(tmp_path / "test.parquet"))
    assert (len(train), len(test)) == (40, 8)
    assert {r["data_source"] for r in train} == {"posttrain/arithmetic"}
    assert not {r["extra_info"]["question"] for r in train} & {r["extra_info"]["question"] for r in test}


# ---------------------------------------------------------------------- issue 24: outputs that cannot be written
def test_output_of_the_wrong_kind_is_one_error_before_any_work(tmp_path, capsys):
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    for dataset in ("arithmetic", "arithmetic-sft"):
        assert main([dataset, "--output", str(a_file), "--n-train", "4", "--n-test", "2"]) == 2
        err = capsys.readouterr().err
        assert (f"posttrain prep {dataset}: error: --output {a_file}: {a_file} is a file, so it cannot hold files; "
                f"prep {dataset} writes train.parquet and test.parquet into a folder") in err, err
    assert main(["arithmetic", "--output", str(a_file / "sub")]) == 2
    assert f"{a_file} (a folder above {a_file / 'sub'}) is a file" in capsys.readouterr().err
    # pairs writes one file: a folder there is refused before the model loads
    argv = ["pairs", "--input", str(a_file), "--model", "no_model", "--output", str(tmp_path)]
    assert main(argv) == 2
    assert f"--output {tmp_path} is a folder; prep pairs writes one file" in capsys.readouterr().err
    assert a_file.read_text() == "x"  # nothing was written over it


def test_a_full_disk_while_writing_rows_names_the_file_and_leaves_none(tmp_path, capsys, monkeypatch):
    import errno

    import pyarrow.parquet as pq

    from posttrain.cli import main as cli_main

    monkeypatch.delenv("POSTTRAIN_DEBUG", raising=False)
    real = pq.write_table

    def full_disk(table, where, *args, **kwargs):
        real(table, where, *args, **kwargs)  # a partial file exists when the disk fills up
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(pq, "write_table", full_disk)
    out = tmp_path / "out"
    assert cli_main(["prep", "arithmetic", "--output", str(out), "--n-train", "5", "--n-test", "3"]) == 1
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == (f"error: writing 5 rows failed: cannot write {out / 'train.parquet'}: Error writing bytes to file. "
                    "Detail: [errno 28] No space left on device (ENOSPC: the disk is full); free space there, or choose "
                    "an output folder on another disk"), last
    assert list(out.iterdir()) == []  # no half-written file that looks complete


# ---------------------------------------------------------------------- issue 59: counts and widths checked up front
@pytest.mark.parametrize("dataset", ["arithmetic", "arithmetic-sft", "tool-arithmetic"])
def test_an_operand_width_out_of_range_is_refused_naming_the_flag(dataset, tmp_path, capsys):
    """`--digits 5000` was an OverflowError traceback (range() cannot hold 10**5000 numbers)."""
    with pytest.raises(SystemExit) as stop:
        main([dataset, "--output", str(tmp_path / "out"), "--digits", "5000"])
    assert stop.value.code == 2
    assert "argument --digits: 5000 is not valid: must be a whole number from 1 to 18" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("dataset,flags,space", [
    ("arithmetic", [], 206),  # 1-digit '+-*': 81 + 45 + 81 questions, less the few-shot demo 3 + 4
    ("arithmetic-sft", ["--digits", "1", "--ops", "+"], 80),
    ("tool-arithmetic", ["--digits", "1", "--tools", "calculator"], 81),
])
def test_more_distinct_questions_than_exist_are_refused_before_writing(dataset, flags, space, tmp_path, capsys):
    """`--n-train 100000000` on 1-digit questions ran on, writing the same 142 train questions over and over."""
    out = tmp_path / "out"
    assert main([dataset, "--output", str(out), *flags, "--n-train", "100000000", "--n-test", "10"]) == 2
    err = capsys.readouterr().err
    assert ("error: --n-train 100000000 + --n-test 10 asks for 100,000,010 distinct questions, but 1-digit operands "
            "with '") in err, err
    assert f"make only {space} (test questions never appear in train): ask for at most {space} in all" in err, err
    assert not out.exists()
    # the largest request that fits is written, every question once
    assert main([dataset, "--output", str(out), *flags, "--n-train", str(space - 10), "--n-test", "10"]) == 0
    train = read_rows(str(out / "train.parquet"))
    questions = [r["extra_info"].get("question") or json.dumps(r["prompt"]) for r in train]
    assert len(train) == space - 10 == len(set(questions))
