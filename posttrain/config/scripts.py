"""Read verl-style launch scripts: `python3 -m verl.trainer.main_ppo key=value \\` lines.

Line continuations and comments are handled, quotes removed as a shell would, and `$HOME`-style
variables are kept as text (nothing is executed or expanded).
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from pathlib import Path

from posttrain.config.load import ConfigError


@dataclass(frozen=True)
class ScriptOverride:
    text: str
    """The override as the trainer receives it, e.g. `trainer.logger=[console,wandb]`."""
    line: int
    """1-based line of the script where it appears."""


def _logical_lines(text: str) -> list[tuple[int, str]]:
    """Join backslash-continued lines; each logical line keeps the number of its first line."""
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.rstrip()
        if not buf:
            start = number
        if stripped.endswith("\\"):
            buf += stripped[:-1] + f" \x00{number + 1} "
            continue
        out.append((start, buf + stripped))
        buf = ""
    if buf:
        out.append((start, buf))
    return out


def parse_launch_script(text: str, source: str = "<script>") -> list[ScriptOverride]:
    """The `key=value` arguments of every `python ... main_ppo` command in a shell script."""
    found: list[ScriptOverride] = []
    for start, line in _logical_lines(text):
        if "main_ppo" not in line and "posttrain train" not in line:
            continue
        try:
            lexer = shlex.shlex(line, posix=True, punctuation_chars=False)
            lexer.whitespace_split = True
            lexer.commenters = "#"
            tokens = list(lexer)
        except ValueError as err:
            raise ConfigError(f"{source}:{start}: cannot parse shell line ({err})") from None
        current = start
        for token in tokens:
            if token.startswith("\x00"):
                current = int(token[1:])
                continue
            if "=" in token and not token.startswith("-") and "." in token.split("=", 1)[0]:
                found.append(ScriptOverride(token, current))
    if not found:
        raise ConfigError(f"{source}: no `python -m ... main_ppo key=value` command found")
    return found


def read_launch_script(path: str | Path) -> list[ScriptOverride]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"launch script {path} does not exist")
    return parse_launch_script(path.read_text(), str(path))
