"""Read the places a config comes from: verl-style launch scripts, YAML files, override lists.

A launch script is a shell script with `python3 -m verl.trainer.main_ppo key=value \\` lines.
Line continuations and comments are handled, quotes removed as a shell would, and `$HOME`-style
variables are kept as text (nothing is executed or expanded). `read_source` accepts any of
a script, a YAML file, a file of `key=value` lines, inline `key=value ...` text or the word
`defaults`; `load_source` turns one into a config whose errors name the file and line.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import yaml

from posttrain.config.docs import all_keys
from posttrain.errors import read_utf8
from posttrain.config.load import ConfigError, apply_overrides, load_raw, split_override, to_rl_config
from posttrain.config.schema import PostTrainConfig

# `${NAME}` with a plain identifier is a shell variable (the shell would expand it); Hydra
# interpolations always name a dotted key (`${data.max_prompt_length}`) or a resolver (`${oc.env:X}`).
_SHELL_VAR = re.compile(r"(?<!\\)\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


@dataclass(frozen=True)
class ScriptOverride:
    text: str
    """The override as the trainer receives it, e.g. `trainer.logger=[console,wandb]`."""
    line: int
    """1-based line of the script where it appears (0: the command line)."""
    source: str = ""
    """File it was read from ("" for the command line)."""

    @property
    def where(self) -> str:
        """`file:line` for error messages, or "override" for the command line."""
        return f"{self.source}:{self.line}" if self.source else "override"

    @property
    def key(self) -> str:
        return split_override(self.text)[0]


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


def _keep_shell_vars(token: str) -> str:
    """`${HOME}/x` -> `\\${HOME}/x`, so OmegaConf keeps the text instead of resolving a key HOME."""
    return _SHELL_VAR.sub(r"\\${\1}", token)


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
                found.append(ScriptOverride(_keep_shell_vars(token), current, source))
    if not found:
        raise ConfigError(f"{source}: no `python -m ... main_ppo key=value` command found")
    return found


def read_launch_script(path: str | Path) -> list[ScriptOverride]:
    path = Path(path)
    if path.is_dir() or not path.exists():
        raise ConfigError(f"launch script {path} {'is a folder' if path.is_dir() else 'does not exist'}; give the "
                          "shell script that runs `python -m ... main_ppo key=value ...`")
    return parse_launch_script(read_utf8(path, ConfigError), str(path))


def parse_override_list(text: str, source: str = "") -> list[ScriptOverride]:
    """`key=value` items separated by whitespace or newlines; `#` starts a comment; quotes as in a shell."""
    found: list[ScriptOverride] = []
    for number, line in enumerate(text.splitlines(), start=1):
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError as err:
            raise ConfigError(f"{source or 'overrides'}:{number}: cannot parse ({err})") from None
        for token in tokens:
            if "=" not in token:
                raise ConfigError(f"{source or 'overrides'}:{number}: '{token}' is not of the form key=value")
            found.append(ScriptOverride(_keep_shell_vars(token), number if source else 0, source))
    return found


@dataclass(frozen=True)
class ConfigSource:
    """One side of a comparison or one `plan` input: an optional YAML file, then overrides."""

    label: str
    """What the user named (a path, `defaults`, or the inline text)."""
    kind: str
    """script, yaml, overrides or defaults."""
    yaml_path: Path | None = None
    """YAML file layered over the defaults."""
    overrides: tuple[ScriptOverride, ...] = ()
    """Overrides applied after the YAML file, each with its file and line."""
    base: Path | None = None
    """A YAML file between verl's defaults and `yaml_path`: the built-in run's for `posttrain plan`
    given only overrides, as `posttrain train` does; None: verl's defaults."""


def _looks_like_script(path: Path, text: str) -> bool:
    return path.suffix in (".sh", ".bash") or text.startswith("#!") or "main_ppo" in text


def read_source(spec: str) -> ConfigSource:
    """A launch script, YAML file, `key=value` list file, inline `key=value ...` text, or `defaults`."""
    path = Path(spec).expanduser()
    if path.is_file():
        text = read_utf8(path, ConfigError)
        if path.suffix in (".yaml", ".yml"):
            return ConfigSource(spec, "yaml", yaml_path=path)
        if _looks_like_script(path, text):
            return ConfigSource(spec, "script", overrides=tuple(parse_launch_script(text, str(path))))
        return ConfigSource(spec, "overrides", overrides=tuple(parse_override_list(text, str(path))))
    if spec == "defaults":
        return ConfigSource(spec, "defaults")
    if "=" in spec:
        return ConfigSource(spec, "overrides", overrides=tuple(parse_override_list(spec)))
    found = "is a folder" if path.is_dir() else "does not exist" if not path.exists() else "is not a file"
    raise ConfigError(f"{spec} {found}; give a launch script, a YAML file, a file of key=value lines, inline "
                      "key=value overrides, or `defaults`")


def load_source(source: ConfigSource, extra: Iterable[str] = (), *, validate: bool = True) -> PostTrainConfig:
    """Defaults <- the source's base YAML <- YAML <- the source's overrides <- `extra` command-line overrides.

    Errors (unknown key, wrong type, unparsable value) name the file and line they came from.
    """
    cfg = load_raw(source.yaml_path, base=source.base)
    for item in source.overrides:
        apply_overrides(cfg, [item.text], source=item.where)
    apply_overrides(cfg, list(extra))
    config = to_rl_config(cfg)
    if validate:
        from posttrain.config.validate import validate_config

        validate_config(config)
    return config


def _flatten_yaml(node: Any, prefix: str = "") -> Iterable[str]:
    for name, value in node.items():
        key = f"{prefix}{name}"
        info = all_keys().get(key)
        if isinstance(value, dict) and value and (info is None or info.is_section):
            yield from _flatten_yaml(value, key + ".")
        elif key in all_keys():
            yield key


def explicit_keys(source: ConfigSource) -> dict[str, str]:
    """{dotted key: where it is set} for every schema key the source sets itself."""
    found: dict[str, str] = {}
    if source.yaml_path is not None:
        raw = yaml.safe_load(read_utf8(source.yaml_path, ConfigError)) or {}
        if isinstance(raw, dict):
            found.update({key: str(source.yaml_path) for key in _flatten_yaml(raw)})
    for item in source.overrides:
        key = item.key
        # an entry under a free-form dict key (`+...override_config.x=1`) counts as setting the dict
        while key not in all_keys() and "." in key:
            key = key.rsplit(".", 1)[0]
        found[key] = item.where
    return found
