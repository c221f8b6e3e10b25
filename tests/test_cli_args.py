"""Every count and size on every command line is checked where argparse reads it (issue 24): a
negative count never reaches a Python slice (`rows[:-3]` silently drops rows).

The flags are found by walking the parser each sub-command really builds (captured when it parses),
so a flag added later is covered without touching this file: a numeric flag must use one of
`posttrain.cli_args`'s types, and each refuses -1 (a score threshold, where -1 is valid, refuses nan).
"""

import argparse
import re
from unittest import mock

import pytest

from posttrain import cli
from posttrain.cli_args import (NUMERIC_TYPES, PATH_TYPES, finite_float, int_at_least, memory_size, non_negative_int,
                                positive_int, probability)

ROUTES = [[name] for name in cli.COMMANDS] + [["plan", "sft"], ["plan", "dpo"]]  # plan's own SFT / DPO parsers


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _parser_of(route: list[str]) -> argparse.ArgumentParser:
    """The parser a sub-command builds, caught at its first parse (nothing after it runs)."""
    def capture(parser, *args, **kwargs):
        raise _Captured(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", capture):
        try:
            cli.main(list(route))
        except _Captured as caught:
            return caught.parser
    raise AssertionError(f"posttrain {' '.join(route)} parsed no arguments")


def _flags(parser: argparse.ArgumentParser):
    """(parser, flag, action) for every option that takes a value, sub-parsers included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from _flags(sub)
        elif action.option_strings and action.nargs != 0:
            yield parser, action.option_strings[0], action


PARSERS = {" ".join(route): _parser_of(route) for route in ROUTES}
FLAGS = [(parser.prog, flag, parser, action) for top in PARSERS.values() for parser, flag, action in _flags(top)]
NUMERIC = [f for f in FLAGS if f[3].type is not None and f[3].type not in PATH_TYPES]


def test_the_walk_finds_the_flags_of_every_command():
    found = {(prog, flag) for prog, flag, _, _ in NUMERIC}
    for expected in [("posttrain eval", "--n"), ("posttrain eval", "--batch-size"), ("posttrain eval", "--show"),
                     ("posttrain prep arithmetic", "--n-train"), ("posttrain prep arithmetic-sft", "--n-test"),
                     ("posttrain prep pairs", "--temperature"), ("posttrain prep pairs", "--limit"),
                     ("posttrain plan", "--params"), ("posttrain plan", "--gpu-memory"), ("posttrain plan", "--layers")]:
        assert expected in found, sorted(found)
    assert {p.prog for p in PARSERS.values()} >= {"posttrain train", "posttrain config", "posttrain export",
                                                   "posttrain diff", "posttrain sft", "posttrain dpo", "posttrain eval"}


@pytest.mark.parametrize("prog,flag,parser,action", FLAGS, ids=[f"{p}:{f}" for p, f, _, _ in FLAGS])
def test_numeric_flags_use_the_checked_types(prog, flag, parser, action):
    numeric_default = isinstance(action.default, (int, float)) and not isinstance(action.default, bool)
    if action.type is None:
        assert not numeric_default, f"{prog} {flag}: a numeric default without type= reads any text"
        return
    assert action.type in NUMERIC_TYPES | PATH_TYPES, (
        f"{prog} {flag}: type={action.type!r}; use posttrain.cli_args (positive_int, non_negative_int, positive_float, "
        "probability, ..., file_to_read, folder_to_write, ...)")


@pytest.mark.parametrize("prog,flag,parser,action", NUMERIC, ids=[f"{p}:{f}" for p, f, _, _ in NUMERIC])
def test_every_numeric_flag_refuses_minus_one(prog, flag, parser, action, capsys):
    bad = "nan" if action.type is finite_float else "-1"  # -1 is a valid score threshold
    with pytest.raises(SystemExit) as stop:
        parser.parse_args([flag, bad])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert f"error: argument {flag}: {bad} is not valid: must be " in err, err


def test_the_types_by_hand():
    assert positive_int("3") == 3 and non_negative_int("0") == 0 and int_at_least(2)("2") == 2
    assert probability("1") == 1.0 and finite_float("-1.5") == -1.5 and memory_size("2GiB") == 2 * 1024**3
    refusals = [(positive_int, "0", "a whole number >= 1"), (positive_int, "2.5", "a whole number >= 1"),
                (non_negative_int, "-1", "a whole number >= 0"), (int_at_least(2), "1", "a whole number >= 2"),
                (probability, "0", "a number in (0, 1]"), (probability, "1.5", "a number in (0, 1]"),
                (finite_float, "inf", "a finite number"), (memory_size, "0", "a memory size > 0"),
                (memory_size, "lots", "a memory size > 0")]
    for parse, text, valid in refusals:
        with pytest.raises(argparse.ArgumentTypeError, match=re.escape(f"is not valid: must be {valid}")):
            parse(text)


def test_the_reported_examples_are_refused_before_any_work(tmp_path, capsys):
    # `posttrain eval --n -3` scored 5 of 8 prompts; `prep arithmetic --n-train -1` wrote 141 rows
    with pytest.raises(SystemExit) as stop:
        cli.main(["eval", "--model", str(tmp_path / "no_model"), "--n", "-3"])
    assert stop.value.code == 2
    assert "argument --n: -3 is not valid: must be a whole number >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:
        cli.main(["prep", "arithmetic", "--output", str(tmp_path / "out"), "--n-train", "-1"])
    assert stop.value.code == 2 and not (tmp_path / "out").exists()
    assert "argument --n-train: -1 is not valid: must be a whole number >= 1" in capsys.readouterr().err
    # negative control: a valid count writes exactly that many rows
    from posttrain.data.schema import read_rows

    assert cli.main(["prep", "arithmetic", "--output", str(tmp_path / "out"), "--n-train", "5", "--n-test", "3"]) == 0
    assert len(read_rows(str(tmp_path / "out" / "train.parquet"))) == 5
    assert len(read_rows(str(tmp_path / "out" / "test.parquet"))) == 3


def test_the_python_api_refuses_negative_counts_too():
    from posttrain.config import ConfigError
    from posttrain.data.arithmetic import generate_problems
    from posttrain.trainer.evaluate import evaluate

    with pytest.raises(ValueError, match=r"n_train=-1 must be a whole number >= 0"):
        generate_problems(-1, 8)
    with pytest.raises(ValueError, match=r"digits=0 must be a whole number >= 1"):
        generate_problems(8, 8, digits=0)
    with pytest.raises(ConfigError, match=r"limit=-3: the number of prompts to evaluate must be >= 1"):
        evaluate("/no/such/model", limit=-3)


# Flags that name a path to read or write and take it as it is (issue 59: `train --config <a folder>` said the
# folder "does not exist"). Model paths (--model, --tokenizer, serve's MODEL: folders, .gguf files, hub ids), eval's
# --data (which also takes key=value items) and the flags that take a file or a folder (plan --model-config,
# prep math --input) are checked where they are read, naming the flag.
PATH_DESTS = {"config", "script", "model_config", "input", "output", "chat_template", "token_file", "tool_config",
              "reward_path"}
CHECKED_LATER = {("posttrain prep gsm8k", "--output"), ("posttrain prep math", "--output"),
                 ("posttrain prep arithmetic", "--output"), ("posttrain prep arithmetic-sft", "--output"),
                 ("posttrain prep tool-arithmetic", "--output"), ("posttrain prep pairs", "--output"),
                 ("posttrain export", "--output"), ("posttrain compare", "--out"),
                 ("posttrain plan", "--model-config"), ("posttrain prep math", "--input")}
"""Output paths `posttrain.data.prep` checks before any work (`_check_output`), the commands other issues own, and
the flags that take either kind of path."""
PATHS = [f for f in FLAGS if f[3].dest in PATH_DESTS and (f[0], f[1]) not in CHECKED_LATER]


def test_the_walk_finds_the_path_flags():
    found = {(prog, flag) for prog, flag, _, _ in PATHS}
    assert found >= {("posttrain train", "--config"), ("posttrain config", "--config"), ("posttrain sft", "--config"),
                     ("posttrain dpo", "--config"), ("posttrain plan", "--script"),
                     ("posttrain plan sft", "--config"), ("posttrain prep gsm8k", "--input"),
                     ("posttrain prep pairs", "--input"), ("posttrain eval", "--output"),
                     ("posttrain serve", "--chat-template"), ("posttrain sandbox serve", "--token-file")}, sorted(found)


@pytest.mark.parametrize("prog,flag,parser,action", PATHS, ids=[f"{p}:{f}" for p, f, _, _ in PATHS])
def test_path_flags_say_what_they_found(prog, flag, parser, action, tmp_path, capsys):
    assert action.type in PATH_TYPES, f"{prog} {flag}: use posttrain.cli_args' file_to_read, folder_to_write, ..."
    a_file = tmp_path / "a_file.txt"
    a_file.write_text("x\n")
    wrong, found = {  # the wrong kind of path for each type, and what its refusal says
        "file_to_read": (tmp_path, f"{tmp_path} is a folder, not "),
        "file_to_write": (tmp_path, f"{tmp_path} is a folder, not "),
        "folder_to_read": (a_file, f"{a_file} is a file, not "),
        "folder_to_write": (a_file / "sub", f"{a_file} (a folder above {a_file / 'sub'}) is a file"),
    }[action.type.__name__]
    with pytest.raises(SystemExit) as stop:
        parser.parse_args([flag, str(wrong)])
    err = capsys.readouterr().err
    assert stop.value.code == 2
    assert f"error: argument {flag}: {found}" in err, err
    # the right kind, and a path a script's earlier line will write, are taken as given
    right = a_file if action.type.__name__.startswith("file") else tmp_path
    assert action.type(str(right)) == str(right) and action.type(str(tmp_path / "not_yet")) == str(tmp_path / "not_yet")


def test_the_reported_folder_given_as_a_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(["train", "--config", str(tmp_path)])
    assert stop.value.code == 2
    assert f"argument --config: {tmp_path} is a folder, not a YAML config file" in capsys.readouterr().err
    # the Python API and positional sources say it too
    from posttrain.config import ConfigError, load_config
    from posttrain.config.scripts import read_source

    with pytest.raises(ConfigError, match=f"config file {tmp_path} is a folder, not a YAML file"):
        load_config(str(tmp_path))
    with pytest.raises(ConfigError, match=f"{tmp_path} is a folder; give a launch script"):
        read_source(str(tmp_path))
    # a file where a folder is expected
    a_file = tmp_path / "train.jsonl"
    a_file.write_text("{}\n")
    with pytest.raises(SystemExit):
        cli.main(["prep", "gsm8k", "--input", str(a_file), "--output", str(tmp_path / "out")])
    assert f"argument --input: {a_file} is a file, not a folder with train.jsonl and test.jsonl" in capsys.readouterr().err
