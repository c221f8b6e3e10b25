"""`posttrain --help` names what each command really offers (issue 59: it listed 3 of the 6 prep datasets)."""

import argparse

from posttrain import cli
from posttrain.commands import PREP_DATASETS


def test_the_help_lists_every_prep_sub_command_the_parser_has():
    from posttrain.commands.prep import build_parser

    subs = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert sorted(subs.choices) == sorted(PREP_DATASETS)  # a sub-command added to the parser is added here too
    prep_line = next(line for line in cli.top_level_help().splitlines() if line.strip().startswith("prep "))
    assert prep_line.split("prepare datasets: ")[1] == ", ".join(PREP_DATASETS), prep_line


def test_the_help_lists_every_command(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    listed = {line.split()[0] for line in out.split("commands:")[1].split("options")[0].splitlines() if line.strip()}
    assert listed == set(cli.COMMANDS)
