"""The commands a user types from the README and the example scripts, found, expanded and planned.

`readme_commands` reads the fenced code blocks under some README headings and returns each command
line (backslash continuations joined) that starts with ``posttrain ``, ``bash examples/`` or
``python -m posttrain``. `script_invocations` runs an example script with ``posttrain``/``python``
replaced by a recorder, so the commands the script would run (its variables expanded, its
defaults applied) are read without running them. `plan_invocation` loads one such command's config
the way the command itself does (built-in run, or verl's defaults with ``--config`` and the
``python -m`` entry points), validated, and returns it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
COMMAND_STARTS = ("posttrain ", "bash examples/", "python -m posttrain")
TRAINING = {"train", "sft", "dpo"}
MODULES = {"posttrain.trainer.main_ppo": "train-verl", "posttrain.trainer.fsdp_sft_trainer": "sft-verl"}


@dataclass
class Command:
    section: str
    block: int  # index of its code block in the README
    text: str  # the line as written (continuations joined, comment kept)

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.text, comments=True)

    @property
    def placeholder(self) -> bool:
        """Written with a stand-in for what the reader supplies (``...``, ``/path/to/...``): planned, not run."""
        return any(t == "..." or t.endswith("=...") or "/path/to/" in t for t in self.argv)


def readme_commands(headings: tuple[str, ...], text: str | None = None) -> list[Command]:
    """The commands in the fenced blocks (not python/yaml) under each ``## heading`` (its ### parts too)."""
    text = README.read_text(encoding="utf-8") if text is None else text
    out: list[Command] = []
    for heading in headings:
        start = text.index(f"\n{heading}\n")
        end = text.find("\n## ", start + len(heading) + 2)
        body = text[start:end if end != -1 else len(text)]
        for block_index, match in enumerate(re.finditer(r"```([a-z]*)\n(.*?)```", body, re.S)):
            if match.group(1) in ("python", "yaml", "json"):
                continue
            out += [Command(heading, block_index, line) for line in _joined_lines(match.group(2))
                    if line.startswith(COMMAND_STARTS)]
    return out


def _joined_lines(block: str) -> list[str]:
    lines, current = [], ""
    for raw in block.splitlines():
        current += raw.strip() if current else raw.rstrip()
        if current.endswith("\\"):
            current = current[:-1].rstrip() + " "
            continue
        lines.append(current.strip())
        current = ""
    return [line for line in lines + [current.strip()] if line]


def recorder_bin(folder: Path) -> Path:
    """``posttrain``, ``python`` and ``python3`` that append their argv (JSON) to $RECORDED and exit 0."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in ("posttrain", "python", "python3"):
        path = folder / name
        path.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c 'import json, os, sys; "
                        "open(os.environ[\"RECORDED\"], \"a\").write(json.dumps(sys.argv[1:]) + \"\\n\")' "
                        f"{name} \"$@\"\n")
        path.chmod(0o755)
    return folder


def example_workdir(folder: Path) -> Path:
    """A folder laid out like the repository root for the scripts (examples/, benchmarks/ linked) and
    ``../shared`` (the README's data paths), where their outputs land instead of the checkout."""
    work = folder / "main"
    work.mkdir(parents=True, exist_ok=True)
    for name in ("examples", "benchmarks"):
        if not (work / name).exists():
            (work / name).symlink_to(REPO / name)
    shared = REPO.parent / "shared"
    if shared.is_dir() and not (folder / "shared").exists():
        (folder / "shared").symlink_to(shared)
    return work


def script_invocations(argv: list[str], folder: Path, env: dict[str, str] | None = None) -> list[list[str]]:
    """What ``bash examples/X.sh ARGS`` would run: each posttrain/python command as an argv list
    (``posttrain``'s and ``python -m``'s, the program name first), in order."""
    work, log = example_workdir(folder), folder / "recorded.jsonl"
    log.unlink(missing_ok=True)
    environ = {**os.environ, **(env or {}), "RECORDED": str(log),
               "PATH": f"{recorder_bin(folder / 'bin')}:{os.environ['PATH']}"}
    proc = subprocess.run(argv, cwd=work, env=environ, capture_output=True, text=True, timeout=60)
    # a script may end by showing what its commands wrote (`cat`), which the recorder did not write
    shown_only = proc.stderr.rstrip().splitlines()[-1:] and proc.stderr.rstrip().splitlines()[-1].startswith("cat: ")
    assert proc.returncode == 0 or shown_only, f"{argv}: {proc.stderr[-2000:]}"
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return [_named(call) for call in calls]


def _named(call: list[str]) -> list[str]:
    if call and call[0] == "python3":
        call = ["python", *call[1:]]
    return call


def stage_of(argv: list[str]) -> str | None:
    """train / sft / dpo (the built-in runs), train-verl / sft-verl (verl's defaults), or None."""
    if argv[0] == "posttrain" and len(argv) > 1 and argv[1] in TRAINING:
        return argv[1] if "--config" not in argv else f"{argv[1]}-file"
    if argv[0] == "python" and len(argv) > 2 and argv[1] == "-m":
        return MODULES.get(argv[2])
    return None


def split_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """(--config FILE, key=value overrides) of a training command; flags and placeholders dropped."""
    rest = argv[2:] if argv[0] == "posttrain" else argv[3:]
    config, overrides, i = None, [], 0
    while i < len(rest):
        token = rest[i]
        if token == "--config":
            config, i = rest[i + 1], i + 2
            continue
        if "=" in token and not token.startswith("-") and not token.endswith("=..."):
            overrides.append(token)
        i += 1
    return config, overrides


def plan_invocation(argv: list[str]):
    """The validated config the training command ``argv`` would run, loaded as that command loads it."""
    from posttrain.config import BUILTIN_CONFIG, load_config
    from posttrain.config.sft_load import BUILTIN_DPO, BUILTIN_SFT, load_dpo_config, load_sft_config

    stage = stage_of(argv)
    config, overrides = split_args(argv)
    if stage in ("train", "train-file", "train-verl"):
        return load_config(config, overrides, base=BUILTIN_CONFIG if stage == "train" else None)
    if stage in ("sft", "sft-file", "sft-verl"):
        return load_sft_config(config, overrides, base=BUILTIN_SFT if stage == "sft" else None)
    if stage in ("dpo", "dpo-file"):
        return load_dpo_config(config, overrides, base=BUILTIN_DPO if stage == "dpo" else None)
    raise ValueError(f"not a training command: {argv}")


def ranks_of(config) -> int:
    t = config.trainer
    return t.nnodes * t.n_gpus_per_node
