"""verl 0.9.1's `distillation.*` tree (on-policy distillation, its `distillation/distillation.yaml`) and its start-up checks.

With ``distillation.enabled`` a frozen teacher (or several, one per value of the rows' ``teacher_key`` column)
scores every token the student samples, and the student learns from that signal
(`posttrain.algorithms.distillation`): a divergence back-propagated as a supervised loss, or, with
``distillation_loss.use_policy_gradient``, the per-token reverse KL as the advantage of the PPO loss; beside the
task rewards' PPO loss when ``use_task_rewards``.

``teacher_models`` is a mapping of named entries, as in verl: the one default entry ``teacher_model`` is the
single teacher (every row goes to it); entries added beside it make a multi-teacher run, where each entry's
``key`` is a value of the rows' ``teacher_key`` column and ``teacher_model`` is dropped (verl drops it
silently; here it is refused when it names a model). Each entry's keys are `TeacherModelConfig`'s.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field, fields, replace
from typing import Any, Iterable, Optional

from posttrain.config.actor_rollout_ref import _cfg

__all__ = ["DEFAULT_TEACHER", "DistillationConfig", "DistillationLossConfig", "TeacherInferenceConfig",
           "TeacherModelConfig", "distillation_enabled", "distillation_problems", "distillation_warnings",
           "resolve_teachers", "teacher_specs", "uses_topk"]

DEFAULT_TEACHER = "teacher_model"
"""verl's name of the single-teacher entry of ``distillation.teacher_models``."""

SINGLE_TEACHER_KEY = "default"
"""The routing key verl gives the single teacher (every row goes to it, whatever its ``teacher_key``)."""

_FOLLOWS_ROLLOUT = ("name", "dtype", "prompt_length", "response_length", "temperature")
"""Inference keys whose null (verl: ``${oc.select:actor_rollout_ref.rollout.<key>}``) follows the student's rollout."""


@_cfg()
class DistillationLossConfig:
    loss_mode: str = "k3"
    """Per-token divergence to the teacher: k1/kl, abs, k2/mse, k3/low_var_kl (single-sample reverse-KL estimates on the sampled tokens), or forward_kl_topk (KL(teacher || student) over the teacher's top-k tokens)."""
    topk: Optional[int] = 32
    """Teacher tokens per position for forward_kl_topk (the teacher's top-k log-probs are scored on every sampled position)."""
    use_task_rewards: bool = True
    """Also train on the task rewards (the PPO loss of algorithm.adv_estimator's advantages), with distillation_loss_coef x the distillation loss added; false: the distillation loss alone."""
    distillation_loss_coef: float = 1.0
    """Weight of the distillation loss beside the task rewards' loss (1 without task rewards)."""
    loss_max_clamp: Optional[float] = None
    """Clamp each token's distillation loss to [-this, this] (null: no clamp); the share clamped is logged as distillation/clamped_frac."""
    log_prob_min_clamp: Optional[float] = None
    """forward_kl_topk: clamp the teacher's and the student's top-k log-probs below at this (e.g. -10; null: no clamp)."""
    use_policy_gradient: bool = False
    """The per-token loss, negated and detached, is the advantage of a policy-gradient loss (Thinking Machines' on-policy distillation; use loss_mode k1); false: the loss is back-propagated directly (GKD; use k3 or forward_kl_topk)."""
    policy_loss_mode: str = "vanilla"
    """Policy loss with use_policy_gradient (verl 0.9.1: vanilla only)."""
    clip_ratio: float = 0.2
    """PPO clip epsilon of that policy loss (default of the two below)."""
    clip_ratio_low: float = 0.2
    """Its lower clip epsilon."""
    clip_ratio_high: float = 0.2
    """Its upper clip epsilon."""
    use_chunked_topk: bool = False
    """verl's memory switch for the student's top-k log-probs at long context (its dataclass key); posttrain always computes them chunk by chunk, so it has no effect."""
    chunked_topk_chunk_size: int = 4096
    """Tokens per chunk of verl's chunked top-k path (its dataclass key; no effect here, see use_chunked_topk)."""


@_cfg()
class TeacherInferenceConfig:
    """verl serves a teacher with its rollout engine; posttrain scores with the teacher's own forward pass
    in the trainer's process (a frozen role like the reference), so these keys describe verl's server."""

    name: Optional[str] = None
    """Engine serving the teacher in verl (null: actor_rollout_ref.rollout.name); posttrain scores with the teacher's forward pass whatever the student's engine."""
    dtype: Optional[str] = None
    """Serving dtype in verl (null: the rollout's); posttrain's teacher computes in actor_rollout_ref.ref.fsdp_config.mixed_precision.param_dtype."""
    gpu_memory_utilization: float = 0.5
    """vLLM memory share of the teacher's server (no effect here)."""
    enforce_eager: bool = True
    """vLLM eager mode of the teacher's server (no effect here)."""
    cudagraph_capture_sizes: Optional[list[int]] = None
    """vLLM CUDA-graph sizes (no effect here)."""
    free_cache_engine: bool = True
    """vLLM frees its cache between uses (no effect here)."""
    data_parallel_size: int = 1
    """Data-parallel size of one teacher replica in verl (no effect here)."""
    expert_parallel_size: int = 1
    """Expert-parallel size of one replica (no effect here)."""
    tensor_model_parallel_size: int = 2
    """Tensor-parallel size of one replica (no effect here: the teacher is sharded like the reference)."""
    max_num_batched_tokens: int = 8192
    """vLLM's token budget per batch (no effect here; actor_rollout_ref.ref.log_prob_* sizes the teacher's passes)."""
    max_model_len: Optional[int] = None
    """Longest sequence the teacher takes (null: no limit); must hold prompt_length + response_length + 1, as verl checks."""
    max_num_seqs: int = 1024
    """vLLM's sequences per batch (no effect here)."""
    load_format: str = "auto"
    """vLLM's weight format (no effect here)."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """Engine options (no effect here)."""
    limit_images: Optional[int] = None
    """Images per prompt for a multimodal teacher (no effect here)."""
    enable_chunked_prefill: bool = True
    """vLLM chunked prefill (no effect here)."""
    enable_prefix_caching: bool = True
    """vLLM prefix caching (no effect here)."""
    disable_log_stats: bool = True
    """vLLM statistics logging (no effect here)."""
    skip_tokenizer_init: bool = True
    """vLLM tokenizer start-up (no effect here)."""
    prompt_length: Optional[int] = None
    """Prompt tokens the teacher sees (null: actor_rollout_ref.rollout.prompt_length)."""
    response_length: Optional[int] = None
    """Response tokens the teacher scores (null: actor_rollout_ref.rollout.response_length)."""
    temperature: Optional[float] = None
    """Ignored, as in verl: the teacher's log-probs are always at temperature 1 (a forward pass samples nothing)."""


@_cfg()
class TeacherModelConfig:
    """One entry of ``distillation.teacher_models``."""

    key: Optional[str] = None
    """The value of the rows' teacher_key column this teacher scores (several teachers); one teacher scores every row."""
    model_path: Optional[str] = None
    """The teacher model: a Hugging Face folder, a .gguf file, a hub id or smollm2-135m-instruct; it must share the student's tokenizer."""
    num_replicas: int = 0
    """Inference replicas of this teacher in verl's teacher pool (no effect here: one frozen copy, sharded like the reference)."""
    inference: TeacherInferenceConfig = field(default_factory=TeacherInferenceConfig)
    """verl's serving settings of this teacher."""


def _default_teachers() -> dict[str, Any]:
    return {DEFAULT_TEACHER: {"key": None, "model_path": None, "num_replicas": 0, "inference": {}}}


@_cfg()
class DistillationConfig:
    enabled: bool = False
    """On-policy distillation: frozen teachers score every sampled token and the student learns from that dense signal (posttrain.algorithms.distillation)."""
    distillation_loss: DistillationLossConfig = field(default_factory=DistillationLossConfig)
    """The divergence and how it trains the student."""
    n_gpus_per_node: int = 8
    """Devices per node of verl's teacher pool; posttrain places the teacher on the student's ranks (as the reference), so no pool is reserved."""
    nnodes: int = 0
    """Nodes of verl's teacher pool (0: none; posttrain places the teacher on the student's ranks)."""
    teacher_models: dict[str, Any] = field(default_factory=_default_teachers)
    """Teachers by entry name, each with key, model_path, num_replicas, inference.* (posttrain.config.distillation.TeacherModelConfig): teacher_model alone is the single teacher; entries beside it are routed by their key (teacher_model then unused)."""
    teacher_key: str = "data_source"
    """Row column whose value picks each row's teacher when there are several (verl: data_source)."""


# ------------------------------------------------------------------------------------------ reading


def distillation_enabled(config: Any) -> bool:
    section = getattr(config, "distillation", None)
    return bool(section is not None and section.enabled)


def uses_topk(config: Any) -> bool:
    """Whether the run's loss mode reads the teacher's top-k tokens (not the sampled token's log-prob alone)."""
    from posttrain.algorithms.distillation import distillation_loss_spec

    return distillation_enabled(config) and distillation_loss_spec(config.distillation.distillation_loss.loss_mode).use_topk


def _entry(name: str, raw: Any, rollout: Any) -> TeacherModelConfig:
    """One ``teacher_models`` entry as a `TeacherModelConfig`: inference nulls follow the student's rollout.
    Raises ValueError naming the key (unknown keys with a 'did you mean')."""
    where = f"distillation.teacher_models.{name}"
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be a mapping of key, model_path, num_replicas, inference, got {raw!r}")
    _known(where, raw, TeacherModelConfig, "a teacher entry")
    if not isinstance(raw.get("inference") or {}, dict):
        raise ValueError(f"{where}.inference must be a mapping of verl's rollout keys, got {raw['inference']!r}")
    inference = dict(raw.get("inference") or {})
    _known(f"{where}.inference", inference, TeacherInferenceConfig, "a teacher's inference section")
    for key in _FOLLOWS_ROLLOUT:
        if inference.get(key) is None and rollout is not None:
            inference[key] = getattr(rollout, key, None)
    fixed = {k: v for k, v in raw.items() if k != "inference"}
    return TeacherModelConfig(**fixed, inference=TeacherInferenceConfig(**inference))


def _known(where: str, raw: dict, cls: type, what: str) -> None:
    names = [f.name for f in fields(cls)]
    for key in raw:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=2)
            hint = f"; did you mean {', '.join(f'{where}.{c}' for c in close)}?" if close else ""
            raise ValueError(f"unknown config key '{where}.{key}' ({what} has {', '.join(names)}){hint}")


def resolve_teachers(config: Any) -> dict[str, TeacherModelConfig]:
    """The run's teachers by routing key (verl's ``DistillationConfig._resolve_teacher_models``): the single
    entry under key ``default`` (it scores every row), or every entry beside ``teacher_model`` under its own
    ``key``. Raises ValueError with one line naming the key at fault."""
    section = config.distillation
    rollout = config.actor_rollout_ref.rollout
    raw = dict(section.teacher_models or {})
    if not raw:
        raise ValueError("distillation.teacher_models is empty; set distillation.teacher_models.teacher_model."
                         "model_path to the teacher model")
    entries = {name: _entry(name, value, rollout) for name, value in raw.items()}
    if len(entries) == 1:
        (teacher,) = entries.values()
        return {SINGLE_TEACHER_KEY: replace(teacher, key=SINGLE_TEACHER_KEY)}
    default = entries.pop(DEFAULT_TEACHER, None)
    if default is not None and default.model_path is not None:
        raise ValueError(f"distillation.teacher_models.{DEFAULT_TEACHER}.model_path={default.model_path} is set beside "
                         f"other teachers ({', '.join(sorted(entries))}), and verl drops that entry when others are "
                         f"added; give it another name (e.g. distillation.teacher_models.teacher_model1.*)")
    out: dict[str, TeacherModelConfig] = {}
    for name, teacher in entries.items():
        if teacher.key is None:
            raise ValueError(f"distillation.teacher_models.{name}.key is not set: with several teachers each names the "
                             f"value of the rows' {section.teacher_key} column it scores")
        if teacher.key in out:
            raise ValueError(f"distillation.teacher_models.{name}.key={teacher.key!r}: another teacher has that key")
        out[teacher.key] = teacher
    return out


def teacher_entry_names(config: Any) -> dict[str, str]:
    """{routing key: the entry's config key prefix} for error messages."""
    raw = dict(config.distillation.teacher_models or {})
    if len(raw) == 1:
        return {SINGLE_TEACHER_KEY: f"distillation.teacher_models.{next(iter(raw))}"}
    return {str(v.get("key")): f"distillation.teacher_models.{k}" for k, v in raw.items()
            if isinstance(v, dict) and k != DEFAULT_TEACHER}


@dataclass
class TeacherSpecs:
    """What the worker builder reads to build the teachers (`posttrain.workers.build`): plain dataclasses of
    config sections, so they travel to Ray ranks as they are."""

    models: dict[str, Any]
    """Routing key -> the teacher's model section: the actor's (``actor_rollout_ref.model``) with its path."""
    fsdp: Any
    """``actor_rollout_ref.ref.fsdp_config``: the teachers are placed as the reference is."""
    section: Any
    """``actor_rollout_ref.ref``: their log-prob micro-batches (per rank)."""
    topk: Optional[int]
    """K for a top-k loss mode, else None."""
    teacher_key: str
    remove_padding: bool


def teacher_specs(config: Any) -> Optional[TeacherSpecs]:
    """The teachers of a distillation run (None otherwise), from a config whose batch sizes are per rank."""
    if not distillation_enabled(config):
        return None
    arr, section = config.actor_rollout_ref, config.distillation
    models = {key: replace(arr.model, path=teacher.model_path) for key, teacher in resolve_teachers(config).items()}
    return TeacherSpecs(models, arr.ref.fsdp_config, arr.ref, section.distillation_loss.topk if uses_topk(config)
                        else None, section.teacher_key, bool(arr.model.use_remove_padding))


# ------------------------------------------------------------------------------------------ checks


def distillation_problems(config: Any) -> Iterable[str]:
    """Start-up errors of the ``distillation.*`` keys, one line each naming the key (only when enabled)."""
    if not distillation_enabled(config):
        return
    from posttrain.algorithms.distillation import distillation_loss_spec, registered_distillation_losses

    loss = config.distillation.distillation_loss
    try:
        spec = distillation_loss_spec(loss.loss_mode)
    except ValueError:
        spec = None
        close = difflib.get_close_matches(str(loss.loss_mode), registered_distillation_losses(), n=1)
        yield (f"distillation.distillation_loss.loss_mode={loss.loss_mode!r} is not one of: "
               f"{', '.join(registered_distillation_losses())}" + (f"; did you mean {close[0]}?" if close else ""))
    if loss.topk is not None and (isinstance(loss.topk, bool) or not isinstance(loss.topk, int) or loss.topk <= 0):
        yield f"distillation.distillation_loss.topk={loss.topk!r} must be a positive number of teacher tokens"
    elif spec is not None and spec.use_topk and loss.topk is None:
        yield f"distillation.distillation_loss.topk=None: loss_mode={loss.loss_mode} needs the teacher's top-k; set it"
    if loss.policy_loss_mode != "vanilla":
        yield (f"distillation.distillation_loss.policy_loss_mode={loss.policy_loss_mode!r}: verl 0.9.1 distils with "
               "the vanilla PPO loss only; set it to vanilla")
    if loss.loss_max_clamp is not None and not loss.loss_max_clamp > 0:
        yield f"distillation.distillation_loss.loss_max_clamp={loss.loss_max_clamp!r} must be > 0 (null: no clamp)"
    if loss.loss_mode in ("k1", "kl") and not loss.use_policy_gradient:
        yield (f"distillation.distillation_loss.loss_mode={loss.loss_mode} with use_policy_gradient=False: the "
               "gradient of k1 does not depend on the teacher (verl refuses it); set use_policy_gradient=True, "
               "or loss_mode=k3")
    try:
        teachers = resolve_teachers(config)
    except ValueError as err:
        yield str(err)
        return
    prefixes = teacher_entry_names(config)
    for key, teacher in teachers.items():
        where = prefixes.get(key, "distillation.teacher_models")
        if teacher.model_path is None:
            yield f"{where}.model_path is not set: the teacher model (a folder, a .gguf file or a hub id)"
        inf = teacher.inference
        if inf.max_model_len is not None and inf.prompt_length is not None and inf.response_length is not None:
            need = int(inf.prompt_length) + int(inf.response_length) + 1
            if need > inf.max_model_len:
                yield (f"{where}.inference.max_model_len={inf.max_model_len} is shorter than the prompt, the response "
                       f"and one more token ({need}); raise it or set it to null")
    if not getattr(config.actor_rollout_ref, "hybrid_engine", True):
        yield ("distillation.enabled=True with actor_rollout_ref.hybrid_engine=False: the asynchronous trainer does "
               "not distil; set actor_rollout_ref.hybrid_engine=True")


def distillation_warnings(config: Any) -> list[str]:
    """What a distillation run's keys do differently here (printed at start-up and by `posttrain plan`)."""
    if not distillation_enabled(config):
        return []
    out = []
    section = config.distillation
    if section.nnodes:
        out.append(f"distillation.nnodes={section.nnodes}, n_gpus_per_node={section.n_gpus_per_node}: posttrain places "
                   "the teacher on the student's ranks (sharded like the reference), not in a pool of its own")
    loss = section.distillation_loss
    if loss.use_policy_gradient and loss.loss_mode == "forward_kl_topk":
        out.append("distillation.distillation_loss.loss_mode=forward_kl_topk with use_policy_gradient=True: the "
                   "update reads only the sampled token's log-prob, so the top-k signal is mostly unused (verl warns "
                   "alike); use_policy_gradient=False back-propagates it")
    return out
