"""Command-line work that draws on several rooms, so it sits above them all: ``posttrain prep``
(`prep`: the data room's preparations plus ``prep pairs``, which samples a model and scores the
samples, `pairs`). `posttrain.cli` routes here; each room below keeps only its own work.
"""

__all__ = ["PREP_DATASETS"]

PREP_DATASETS = ("gsm8k", "math", "arithmetic", "arithmetic-sft", "tool-arithmetic", "pairs")
"""Every ``posttrain prep`` sub-command, named here so that ``posttrain --help`` lists them without building
the prep parser (which imports torch: seconds); tests/test_cli_help.py holds this to the parser's choices."""
