"""Prompt datasets in verl's RL schema, the resumable prompt loader, data preparation and the
built-in arithmetic task.

- :class:`RLHFDataset` / :func:`collate_prompts` (``rl_dataset``)
- :class:`PromptLoader`, :class:`StatefulSampler`, :func:`build_train_loader`, :func:`build_val_loader` (``loader``)
- :class:`DataError`, :func:`read_rows`, :func:`write_rows` (``schema``)
- ``prep.main(argv)``: ``posttrain prep gsm8k|math|arithmetic``
- ``arithmetic``: the built-in task
"""

from posttrain.data.loader import PromptLoader, StatefulSampler, build_train_loader, build_val_loader
from posttrain.data.rl_dataset import RLHFDataset, collate_prompts, encode_prompts, render_prompt
from posttrain.data.schema import DataError, read_rows, validate_row, write_rows

__all__ = [
    "RLHFDataset",
    "collate_prompts",
    "encode_prompts",
    "render_prompt",
    "PromptLoader",
    "StatefulSampler",
    "build_train_loader",
    "build_val_loader",
    "DataError",
    "read_rows",
    "write_rows",
    "validate_row",
]
