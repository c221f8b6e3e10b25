"""Build a config: verl's defaults, then an optional YAML file, then Hydra-style overrides.

Overrides are written as verl launch scripts write them: `a.b=c`, `trainer.logger=[console,wandb]`,
`x=null`, quoted strings, and `+a.new=1` / `++a.b=1` for entries under free-form dict keys
(`override_config`, `engine_kwargs`, ...). Values are parsed with OmegaConf's YAML rules.
Every error names the full dotted key (and the file or override it came from).
"""

from __future__ import annotations

import copy
import difflib
import functools
import io
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from posttrain.config import verl_keys
from posttrain.config.docs import all_keys, leaf_type
from posttrain.errors import ConfigError, read_utf8
from posttrain.config.schema import PostTrainConfig

# Keys verl's YAML files carry that describe Hydra plumbing, not settings.
_HYDRA_ONLY_KEYS = {"_target_", "defaults", "hydra"}


@dataclass(frozen=True)
class Tree:
    """A config tree the loader fills: the RL tree by default; the SFT and DPO trees
    (`posttrain.config.sft_load`) name themselves in errors and say when a key is another tree's."""

    root: type = PostTrainConfig
    name: str = ""
    """How errors name the tree: ``unknown SFT config key ...``."""
    foreign: Callable[[str], str] | None = None
    """Text added to the error for an unknown key (e.g. that it is an RL key)."""
    aliases: tuple[tuple[str, str], ...] = verl_keys.PPO_ALIASES
    """verl 0.9 spellings of this tree's keys (`posttrain.config.verl_keys`)."""
    no_effect: tuple[verl_keys.VerlRule, ...] = verl_keys.NO_EFFECT
    """verl 0.9 keys this tree reads but does not act on, or refuses unless off."""

    def keys(self) -> dict:
        return all_keys(self.root)

    def leaf_type(self, key: str) -> Any:
        return leaf_type(key, self.root)


RL_TREE = Tree()


def _suggest(key: str, tree: Tree) -> str:
    """'did you mean' text: keys that end with what was typed (a missing section prefix), then
    keys that are spelled closely."""
    keys = tree.keys()
    suffix = [k for k in keys if k.endswith("." + key)]
    close = difflib.get_close_matches(key, list(keys), n=3, cutoff=0.6)
    leaf = key.rsplit(".", 1)[-1]
    close_leaf = [k for k in keys if difflib.SequenceMatcher(None, k.rsplit(".", 1)[-1], leaf).ratio() > 0.85]
    picks = list(dict.fromkeys(suffix + close + close_leaf))[:3]
    return f"; did you mean {', '.join(picks)}?" if picks else ""


def _is_free_dict(hint: Any) -> bool:
    return typing.get_origin(hint) is dict or hint is dict


def _route(key: str, where: str, allow_new: bool, tree: Tree = RL_TREE) -> tuple[str, verl_keys.VerlRule | None]:
    """Where a key goes: (the schema key to set, None), or (verl's key, the rule that gives it no effect here).
    A verl 0.9 alias is rewritten to posttrain's key first. Raises ConfigError for an unknown key."""
    keys = tree.keys()
    if key not in keys:
        key = verl_keys.alias_of(key, keys, tree.aliases) or key
    if key in keys:
        return key, None
    parts = key.split(".")
    for i in range(len(parts) - 1, 0, -1):
        parent = ".".join(parts[:i])
        if parent in keys and not keys[parent].is_section:
            if _is_free_dict(tree.leaf_type(parent)):
                return key, None  # entries of dict-valued keys (override_config, ...) are free-form
            raise ConfigError(f"{where}: '{parent}' is a value, not a section, so '{key}' cannot be set")
    rule = verl_keys.rule_for(key, tree.no_effect)
    if rule is not None:
        return key, rule
    foreign = tree.foreign(key) if tree.foreign is not None else ""
    hint = "" if allow_new else _suggest(key, tree)
    raise ConfigError(f"{where}: unknown {tree.name}config key '{key}'{foreign}{hint}")


def verl_key_status(key: str, tree: Tree = RL_TREE) -> tuple[str, str]:
    """How posttrain reads one of verl's keys: (status, detail). Status: ``honoured`` (a field, verl's meaning),
    ``alias`` (detail: posttrain's key), ``free-form entry`` (detail: the dict key it sits under), ``no effect``
    or ``refused unless off`` (detail: the reason), or ``unknown``."""
    try:
        routed, rule = _route(key, "", False, tree)
    except ConfigError:
        return "unknown", ""
    if rule is not None:
        return ("no effect" if rule.accepts is None else "refused unless off"), rule.reason
    if routed != key:
        return "alias", routed
    if routed in tree.keys():
        return "honoured", ""
    parents = [".".join(routed.split(".")[:i]) for i in range(routed.count("."), 0, -1)]
    return "free-form entry", next(p for p in parents if p in tree.keys())


def _type_name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def parse_value(text: str) -> Any:
    """A value as Hydra/OmegaConf read it: YAML scalars, `[a,b]` lists, `null`, quoted strings.

    Raises ConfigError when YAML cannot read it (``@x``, a backtick, ``%``, an unclosed quote...)."""
    if text == "":
        return ""
    try:
        node = OmegaConf.from_dotlist([f"v={text}"])
        return OmegaConf.to_container(node, resolve=False)["v"]
    except (yaml.YAMLError, OmegaConfBaseException, ValueError, TypeError) as err:
        raise ConfigError(f"cannot read {text!r} as a value ({str(err).splitlines()[0]})") from None


# Characters that YAML reserves or reads specially at the start of a plain value.
_YAML_INDICATORS = tuple("@`%&*!|>?")


def _takes_text(key: str, tree: Tree) -> bool:
    """True for a key whose value is a string (or an entry of a free-form dict), so odd text is taken
    literally."""
    keys = tree.keys()
    if key not in keys:
        return True  # under a free-form dict key (checked by _route)
    if keys[key].is_section:
        return False
    hint = tree.leaf_type(key)
    args = [a for a in getattr(hint, "__args__", ()) if a is not type(None)]
    return hint in (str, Any) or args == [str]


def parse_override_value(key: str, text: str, where: str, tree: Tree = RL_TREE) -> Any:
    """An override's value: YAML rules, except that text YAML reads specially (``@x``, backticks,
    ``%``, ``&``, ``*``, ``!`` ..., and YAML 1.1's booleans ``off``, ``on``, ``yes``, ``no``) is the literal string
    for string keys, and refused naming the key (with the fix: quote it) for the others."""
    text_key = _takes_text(key, tree)
    if text_key and text.startswith(_YAML_INDICATORS):
        return text
    try:
        value = parse_value(text)
    except ConfigError as err:
        if text_key:
            return text
        raise ConfigError(f"{where}: {key}: {err}; expected {_type_name(tree.leaf_type(key))}") from None
    if text_key and isinstance(value, dict) and not text.lstrip().startswith("{"):
        return text  # `name=a: b` is text, not a mapping
    if text_key and isinstance(value, bool) and text.strip().lower() not in ("true", "false"):
        return text.strip()  # YAML 1.1 reads off/on/yes/no as booleans; Hydra, and `host_paging=off`, mean the word
    return value


def split_override(item: str) -> tuple[str, str, bool]:
    """'++a.b=c' -> ('a.b', 'c', True). Raises ConfigError on a malformed item."""
    if "=" not in item:
        raise ConfigError(f"override '{item}' is not of the form key=value")
    key, value = item.split("=", 1)
    plus = key.startswith("+")
    key = key.lstrip("+").strip()
    if not key or key.startswith("~"):
        raise ConfigError(f"override '{item}': deleting keys with '~' is not supported; set key=null instead")
    return key, value, plus


def _set(cfg: DictConfig, key: str, value: Any, where: str, tree: Tree = RL_TREE) -> None:
    keys = tree.keys()
    if key in keys:
        info = keys[key]
        if info.is_section and value is not None and not isinstance(value, dict):
            raise ConfigError(f"{where}: '{key}' is a section of keys ({info.type}); set its keys instead, e.g. {key}.<name>=...")
        if not info.is_section and _is_list(tree.leaf_type(key)) and isinstance(value, (str, int, float)):
            value = [value]  # `trainer.logger=console` means a list of one
    try:
        OmegaConf.update(cfg, key, value, merge=True, force_add=False)
    except OmegaConfBaseException as err:
        expected = _type_name(tree.leaf_type(key)) if key in keys and not keys[key].is_section else "a section"
        raise ConfigError(
            f"{where}: {key}={value!r} has the wrong type: expected {expected} ({str(err).splitlines()[0]})"
        ) from None


def _is_list(hint: Any) -> bool:
    """A list, or an optional one."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] if typing.get_origin(hint) is typing.Union else []
    return typing.get_origin(hint) is list or (len(args) == 1 and typing.get_origin(args[0]) is list)


def _flatten(node: Any, tree: Tree = RL_TREE, prefix: str = "") -> Iterable[tuple[str, Any]]:
    """Dotted (key, value) pairs of a nested dict, stopping at free-form dict keys."""
    for name, value in node.items():
        if name in _HYDRA_ONLY_KEYS:
            continue
        key = f"{prefix}{name}"
        info = tree.keys().get(key)
        if isinstance(value, dict) and value and (info is None or info.is_section):
            yield from _flatten(value, tree, key + ".")
        else:
            yield key, value


def _apply_yaml(cfg: DictConfig, path: str | Path, tree: Tree = RL_TREE) -> None:
    path = Path(path).expanduser()
    if path.is_dir() or not path.exists():
        found = "is a folder, not a YAML file" if path.is_dir() else "does not exist"
        raise ConfigError(f"config file {path} {found}; give a YAML file of config keys")
    text = read_utf8(path, ConfigError)
    try:
        raw = OmegaConf.to_container(OmegaConf.load(io.StringIO(text)), resolve=False) or {}
    except (yaml.YAMLError, OmegaConfBaseException) as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(raw).__name__}")
    lines = _key_lines(text)
    for key, value in _flatten(raw, tree):
        where = f"{path}" + (f":{lines[key]}" if key in lines else "")
        _place(cfg, key, value, where, False, tree)


def _place(cfg: DictConfig, key: str, value: Any, where: str, allow_new: bool, tree: Tree) -> None:
    """Set a schema key, or keep a verl key that has no effect here in ``no_effect`` (refusing a value
    its rule refuses)."""
    key, rule = _route(key, where, allow_new, tree)
    if rule is None:
        _set(cfg, key, value, where, tree)
        return
    if rule.refuses(value):
        raise ConfigError(f"{where}: {rule.refusal(key, value)}")
    if "no_effect" in cfg:
        kept = [item for item in cfg.no_effect if item.split("=", 1)[0] != key]
        cfg.no_effect = kept + [f"{key}={value}"]


def _key_lines(text: str) -> dict[str, int]:
    """Line number of each dotted key in a YAML file's text (for error messages)."""
    node = yaml.compose(text)
    found: dict[str, int] = {}

    def walk(n: Any, prefix: str) -> None:
        if isinstance(n, yaml.MappingNode):
            for k, v in n.value:
                key = f"{prefix}{k.value}"
                found[key] = k.start_mark.line + 1
                walk(v, key + ".")

    walk(node, "")
    return found


def apply_overrides(cfg: DictConfig, overrides: Iterable[str], source: str = "override", tree: Tree = RL_TREE) -> None:
    for item in overrides:
        key, text, plus = split_override(item)
        where = f"{source} '{item}'"
        routed, _ = _route(key, where, allow_new=plus, tree=tree)
        _place(cfg, key, parse_override_value(routed, text, where, tree), where, plus, tree)


@functools.lru_cache(maxsize=None)
def _defaults(root: type) -> DictConfig:
    """``root``'s defaults as an OmegaConf tree, built once: building it walks every dataclass (~0.1 s),
    a copy of it is a fifth of that. Callers copy it; it is never changed."""
    return OmegaConf.structured(root)


def load_raw(path: str | Path | None = None, overrides: Iterable[str] = (), base: str | Path | None = None,
             tree: Tree = RL_TREE) -> DictConfig:
    """The merged OmegaConf tree (interpolations unresolved), before validation: ``tree``'s defaults
    <- ``base`` YAML <- ``path`` YAML <- dotted overrides."""
    cfg = copy.deepcopy(_defaults(tree.root))
    for layer in (base, path):
        if layer is not None:
            _apply_yaml(cfg, layer, tree)
    apply_overrides(cfg, list(overrides), tree=tree)
    return cfg


def to_dataclass(cfg: DictConfig) -> Any:
    """Resolve interpolations and build the typed tree."""
    try:
        return OmegaConf.to_object(cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as err:
        full_key = getattr(err, "full_key", "?")
        raise ConfigError(f"config key '{full_key}': {str(err).splitlines()[0]}") from None


def to_rl_config(cfg: DictConfig) -> PostTrainConfig:
    """The typed RL tree of a merged config, with verl 0.9's spellings that need the whole tree mapped: the trainer
    mode (`posttrain.config.async_training.apply_trainer_mode`) and the reward loop's served scorer
    (`posttrain.config.reward_tree.disrm_from_reward_loop`)."""
    from posttrain.config.async_training import apply_trainer_mode
    from posttrain.config.reward_tree import disrm_from_reward_loop

    name_builtin_variant(cfg)
    config = to_dataclass(cfg)
    apply_trainer_mode(config)
    disrm_from_reward_loop(config)  # verl 0.9's served scorer without a function: posttrain's DisRM
    return config


def name_builtin_variant(cfg: DictConfig) -> None:
    """A variant of the built-in run (`posttrain train key=value`) gets its own folders: where the experiment
    keeps the built-in run's name, it names the algorithm, LoRA and the rollout mode instead
    (``arithmetic_gae_smollm2``, ``arithmetic_grpo_lora_smollm2``, ``arithmetic_grpo_colocate_async_smollm2``),
    and ``trainer.default_local_dir`` / ``trainer.run_dir`` follow it, so one variant never writes its model
    and metrics into another's folders. The plain built-in run keeps its name."""
    trainer, arr = cfg.trainer, cfg.actor_rollout_ref
    if trainer.experiment_name != _builtin_experiment_name():
        return
    kind = [str(cfg.algorithm.adv_estimator)] + (["lora"] if arr.model.lora_rank else [])
    mode = trainer.v1.trainer_mode if trainer.use_v1 else "sync"
    kind += [mode] if mode != "sync" else ([] if arr.hybrid_engine else ["async"])
    trainer.experiment_name = f"arithmetic_{'_'.join(kind)}_smollm2"


@functools.lru_cache(maxsize=None)
def _builtin_experiment_name() -> str:
    from posttrain.config import BUILTIN_CONFIG

    return yaml.safe_load(BUILTIN_CONFIG.read_text(encoding="utf-8"))["trainer"]["experiment_name"]


def to_yaml(config: PostTrainConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(config))


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    *,
    base: str | Path | None = None,
    validate: bool = True,
) -> PostTrainConfig:
    """Defaults (verl's) <- `base` YAML <- `path` YAML <- dotted overrides; then validated.

    The starting point is verl's defaults (a GSM8K run from ~/data/rlhf/gsm8k), as for `posttrain train
    --config FILE` and ``python -m posttrain.trainer.main_ppo``, so a YAML written for verl means the same
    here; without a path, overrides land on those defaults too. The built-in run (what `posttrain train`
    with no --config runs) is ``base=posttrain.BUILTIN_CONFIG``, or a copy of that file as ``path``:
    `posttrain config --builtin-yaml > my_run.yaml` writes one to edit, and
    ``load_config(path="my_run.yaml")`` then gives exactly the built-in run.

    Raises ConfigError, before any model loads, for unknown keys, wrong types, unknown choices
    and inconsistent settings.
    """
    config = to_rl_config(load_raw(path, overrides, base))
    if validate:
        from posttrain.config.validate import validate_config

        validate_config(config)
    return config
