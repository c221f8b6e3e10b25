"""The batch flow of one training step, as numbers: prompts -> responses -> ranks -> rollout
workers -> log-prob rounds -> PPO mini-batches -> micro-batches -> optimizer steps.

Per-rank mini/micro sizes come from `derive_sizes` (verl's normalisation); this module adds what
a user asks next: how many rollout workers, how many forward rounds, how many steps in the run.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

from posttrain.config.derived import RoleSizes, SizeError, derive_sizes, kl_loss_active, uses_critic, uses_reference
from posttrain.config.distillation import distillation_enabled, resolve_teachers
from posttrain.config.schema import PostTrainConfig

GSM8K_TRAIN_SIZE = 7473
"""Prompts in GSM8K's train split (openai/gsm8k, `main` config)."""

ENGINE_TENSOR_PARALLEL = 1
"""Tensor-parallel size every rollout engine here runs with, whatever rollout.tensor_model_parallel_size
says: the vllm engine is built with tensor_parallel_size=1 on every rank (`posttrain.rollout.vllm_engine`)
and the hf engine decodes with the rank's whole (gathered) module."""


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class ForwardPass:
    """A no-gradient pass over all of a rank's responses: old log-probs, reference log-probs, values."""

    name: str
    key: str
    """The micro-batch key that sets its size."""
    micro_batch: Optional[int]
    """Responses per forward on one rank (None: packed by tokens)."""
    rounds: Optional[int]
    """Forward passes per rank per training step (0: skipped, see `DerivedSizes.old_log_probs_from`)."""


@dataclass(frozen=True)
class RoleUpdate:
    """The PPO update of a trained role (actor or critic), per rank."""

    role: str
    mini_batch_prompts: int
    """ppo_mini_batch_size, in prompts."""
    mini_batch_responses: int
    """x rollout.n."""
    mini_batch_per_rank: int
    """/ data-parallel ranks."""
    mini_batches: int
    """Mini-batches per pass over the training batch."""
    epochs: int
    """ppo_epochs."""
    micro_batch: Optional[int]
    """Responses per forward/backward on one rank (None: packed by tokens)."""
    grad_accum: Optional[int]
    """Micro-batches accumulated into one optimizer step."""
    optimizer_steps: int
    """Optimizer steps per training step = epochs x mini_batches."""
    forward_backward: Optional[int]
    """Forward/backward passes per rank per training step."""


@dataclass(frozen=True)
class Flow:
    nnodes: int
    gpus_per_node: int
    world_size: int
    sequence_parallel: int
    """Ulysses sequence-parallel group size (ranks that share one sequence)."""
    dp_size: int
    """Data-parallel ranks = world / sequence_parallel."""
    prompts_per_step: int
    n: int
    responses_per_step: int
    responses_per_rank: int
    """Responses each data-parallel rank holds in the log-prob and update phases."""
    prompt_length: int
    response_length: int
    max_tokens_per_step: int
    """responses x (max prompt + max response length): the padded upper bound."""
    rollout_engine: str
    rollout_tp: int
    """Tensor-parallel size the engine really runs with: always `ENGINE_TENSOR_PARALLEL` (1)."""
    rollout_tp_requested: int
    """actor_rollout_ref.rollout.tensor_model_parallel_size as configured (read, not applied)."""
    rollout_workers: int
    """Inference-engine instances: one full replica per rank, so the world size."""
    responses_per_worker: int
    prompts_per_worker: int
    forward_passes: tuple[ForwardPass, ...]
    actor: Optional[RoleUpdate]
    critic: Optional[RoleUpdate]
    dataset_size: Optional[int]
    dataset_note: str
    steps_per_epoch: Optional[int]
    total_epochs: int
    total_steps: Optional[int]
    total_steps_note: str
    size_error: Optional[str]
    """Why the per-rank sizes could not be derived (the config's error), else None."""
    dynamic_sampling: Optional[str] = None
    """How a step draws its prompts with algorithm.filter_groups.enable (DAPO), else None."""
    multi_turn: Optional[str] = None
    """The turn and length budget of a trajectory with rollout.multi_turn.enable, else None."""
    async_pools: Optional[str] = None
    """With actor_rollout_ref.hybrid_engine=False: the trainer and rollout pools, the queue window and the
    staleness budget (posttrain.config.async_training), else None."""
    rollouts_on_disk: Optional[str] = None
    """What trainer.rollout_data_dir / validation_data_dir write, bounded (posttrain.trainer.rollout_dump), else None."""
    distillation: Optional[str] = None
    """With distillation.enabled: what the teachers score and how the student learns from it, else None."""
    cpu_threads: Optional[int] = None
    """A run on a CPU: torch's threads in each process (the plan says processes and threads, not GPUs); None on GPUs."""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _count_rows(path: Path) -> Optional[int]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    if path.suffix in (".jsonl", ".json"):
        with path.open("rb") as f:
            return sum(1 for line in f if line.strip())
    return None


def dataset_size(config: PostTrainConfig, given: Optional[int] = None) -> tuple[Optional[int], str]:
    """Training prompts, and where the number comes from."""
    if given is not None:
        return given, "given by --train-size"
    files = config.data.train_files
    if files is None:
        return config.data.arithmetic.n_train, "the built-in arithmetic task's questions (data.arithmetic.n_train)"
    files = [files] if isinstance(files, str) else list(files)
    total, missing = 0, []
    for name in files:
        path = Path(os.path.expandvars(str(name))).expanduser()
        rows = _count_rows(path) if path.is_file() else None
        if rows is None:
            missing.append(str(name))
        else:
            total += rows
    filtered = " (before filter_overlong_prompts)" if config.data.filter_overlong_prompts else ""
    if not missing:
        return total, f"rows of {', '.join(map(str, files))}{filtered}"
    if len(files) == 1 and "gsm8k" in files[0].lower() and "train" in Path(files[0]).name.lower():
        return GSM8K_TRAIN_SIZE, (f"assumed: GSM8K's train split has {GSM8K_TRAIN_SIZE} prompts "
                                  f"({files[0]} is not here){filtered}")
    return None, f"{', '.join(missing)} not found here; pass --train-size to count steps"


def _role_update(role: str, prompts: int, n: int, dp: int, sizes: RoleSizes, per_rank: int, epochs: int) -> RoleUpdate:
    mini_batches = _ceil_div(per_rank, sizes.mini_batch)
    fb = None if sizes.grad_accum is None else epochs * _ceil_div(per_rank, sizes.micro_batch)
    return RoleUpdate(role, prompts, prompts * n, sizes.mini_batch, mini_batches, epochs, sizes.micro_batch,
                      sizes.grad_accum, epochs * mini_batches, fb)


def _forward(name: str, key: str, micro: Optional[int], per_rank: int) -> ForwardPass:
    """A rank's forward in rounds of ``micro`` responses; a rank holding fewer runs them in one smaller round."""
    if not micro:
        return ForwardPass(name, key, micro, None)
    return ForwardPass(name, key, min(micro, per_rank) if per_rank > 0 else micro, _ceil_div(per_rank, micro))


REWARD_MODEL_PASS = "reward model score"
TEACHER_PASS = "teacher log-prob"


def _reward_model_micro(rm: Any, dp: int) -> Optional[int]:
    """Rows per reward-model forward on one rank (verl divides the deprecated global size by the ranks)."""
    if rm.use_dynamic_bsz:
        return None
    return max(1, rm.micro_batch_size // dp) if rm.micro_batch_size is not None else rm.micro_batch_size_per_gpu


def build_flow(config: PostTrainConfig, train_size: Optional[int] = None) -> Flow:
    """All numbers of one training step; per-rank sizes are None-free only when the config is consistent."""
    arr, trainer = config.actor_rollout_ref, config.trainer
    world = max(1, trainer.nnodes * trainer.n_gpus_per_node)
    sp = max(1, arr.actor.ulysses_sequence_parallel_size)
    dp = max(1, world // sp)
    n, prompts = arr.rollout.n, config.data.train_batch_size
    responses = prompts * n
    per_rank = responses // dp
    # Both engines generate on every rank with the whole model: hf on the actor's own module, vllm on
    # an in-process engine built with tensor_parallel_size=1 (posttrain/rollout/vllm_engine.py).
    tp = ENGINE_TENSOR_PARALLEL
    workers = world
    p_len, r_len = config.data.max_prompt_length, config.data.max_response_length

    actor = critic = None
    size_error = None
    passes: list[ForwardPass] = []
    try:
        sizes = derive_sizes(config)
    except SizeError as err:
        size_error = str(err)
    else:
        old = _forward("old log-prob (actor)", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu",
                       sizes.rollout_log_prob_micro_batch, per_rank)
        # skipped (0 rounds) when the on-policy update or the rollout engine supplies them
        passes.append(old if sizes.old_log_probs_from == "recompute" else replace(old, rounds=0))
        if uses_reference(config):
            passes.append(_forward("reference log-prob", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                                   sizes.ref_log_prob_micro_batch, per_rank))
        if distillation_enabled(config):  # every teacher scores its rows, in the reference's micro-batches
            passes.append(_forward(TEACHER_PASS, "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu",
                                   sizes.ref_log_prob_micro_batch or sizes.rollout_log_prob_micro_batch, per_rank))
        actor = _role_update("actor", arr.actor.ppo_mini_batch_size, n, dp, sizes.actor, per_rank, arr.actor.ppo_epochs)
        if sizes.critic is not None:
            c = config.critic
            fwd = c.forward_micro_batch_size_per_gpu or sizes.critic.micro_batch
            passes.append(_forward("critic values", "critic.forward_micro_batch_size_per_gpu", fwd, per_rank))
            critic = _role_update("critic", c.ppo_mini_batch_size, n, dp, sizes.critic, per_rank, c.ppo_epochs)
        if config.reward_model.enable:
            passes.append(_forward(REWARD_MODEL_PASS, "reward_model.micro_batch_size_per_gpu",
                                   _reward_model_micro(config.reward_model, dp), per_rank))

    size, note = dataset_size(config, train_size)
    steps_per_epoch = None if size is None else size // prompts  # drop_last, as verl's train loader
    total = None if steps_per_epoch is None else steps_per_epoch * trainer.total_epochs
    total_note = f"{trainer.total_epochs} epochs x steps per epoch"
    sampling = None
    if config.algorithm.filter_groups.enable:
        steps_per_epoch, note, total, total_note, sampling = _dynamic_sampling(config, size, note)
    if trainer.total_training_steps is not None:
        total, total_note = trainer.total_training_steps, "trainer.total_training_steps"
    return Flow(
        trainer.nnodes, trainer.n_gpus_per_node, world, sp, dp, prompts, n, responses, per_rank, p_len, r_len,
        responses * (p_len + r_len), arr.rollout.name, tp, arr.rollout.tensor_model_parallel_size, workers,
        responses // workers, prompts // workers,
        tuple(passes), actor, critic, size, note, steps_per_epoch, trainer.total_epochs, total, total_note, size_error,
        sampling, multi_turn_budget(arr.rollout), async_pools(config), rollouts_on_disk(config, total),
        distillation_flow(config),
    )


def rollouts_on_disk(config: PostTrainConfig, total_steps: Optional[int]) -> Optional[str]:
    from posttrain.trainer.rollout_dump import describe

    return describe(config, total_steps)


def async_pools(config: PostTrainConfig) -> Optional[str]:
    """The two pools, the in-flight window and the staleness budget of an asynchronous run, else None."""
    from posttrain.config.async_training import async_budget, async_enabled, rollout_workers

    if not async_enabled(config):
        return None
    r, t = config.actor_rollout_ref.rollout, config.trainer
    return (f"asynchronous: trainer pool {t.nnodes} x {t.n_gpus_per_node} device(s); rollout pool "
            f"{r.nnodes} x {r.n_gpus_per_node} = {rollout_workers(config)} {r.name} worker(s) (on CPU: each its own "
            f"cores), work units of {config.data.gen_batch_size} prompts; " + async_budget(config).describe()
            + ("; partial rollouts: a push lands between two decoding steps" if config.async_training.partial_rollout
               and config.async_training.staleness_threshold > 0 else ""))


def rollout_description(f: Flow) -> str:
    """What generates a step's responses, as it will run (the engine, its copies, the work of each)."""
    share = f"{f.responses_per_worker} responses each ({f.prompts_per_worker} prompts x {f.n})"
    if f.async_pools:
        return f.async_pools
    if f.rollout_engine == "hf":
        return f"hf on each of the {f.world_size} ranks (the actor's own weights): {share}"
    return f"one {f.rollout_engine} engine per rank ({f.world_size} ranks, each with the full weights): {share}"


def tensor_parallel_note(f: Flow) -> Optional[str]:
    """The sentence saying that rollout.tensor_model_parallel_size is not applied, when it asks for more than 1
    on an engine that would use it (verl's hf rollout ignores the key too, so hf gets no note)."""
    if f.rollout_engine == "hf" or f.rollout_tp_requested == f.rollout_tp:
        return None
    return (f"tensor_model_parallel_size={f.rollout_tp_requested} requested; this build runs each {f.rollout_engine} "
            f"engine with TP {f.rollout_tp} on its own rank, so the key is not applied")


def multi_turn_budget(rollout: Any) -> Optional[str]:
    """One line on a multi-turn trajectory's limits (``rollout.multi_turn.*``), or None when it is off."""
    mt = rollout.multi_turn
    if not mt.enable:
        return None
    turns = lambda n, what: f"at most {n} {what}" if n else f"any number of {what}"  # noqa: E731
    return (f"multi-turn: {turns(mt.max_assistant_turns, 'assistant turns')} and "
            f"{turns(mt.max_user_turns, 'tool/user turns')} per trajectory, all within the {rollout.response_length}-token response (model "
            f"tokens trained on, tool/user tokens masked out)" + (
                f"; tool answers cut to {mt.max_tool_response_length} characters ({mt.tool_response_truncate_side}); "
                f"{mt.max_parallel_calls} tool call(s) at once" if mt.tool_config_path else ""))


def _dynamic_sampling(config: PostTrainConfig, size: Optional[int], note: str) -> tuple:
    """(steps per epoch, dataset note, total steps, its note, description) with DAPO's dynamic sampling: a
    step draws one or more batches of data.gen_batch_size prompts, so only upper bounds are known."""
    fg, gen, epochs = config.algorithm.filter_groups, config.data.gen_batch_size, config.trainer.total_epochs
    rounds = (f"at most {fg.max_num_gen_batches} rounds = {fg.max_num_gen_batches * gen} prompts per step, then an error"
              if fg.max_num_gen_batches > 0 else "no limit on rounds (max_num_gen_batches=0)")
    text = (f"dynamic sampling: rounds of data.gen_batch_size={gen} prompts x {config.actor_rollout_ref.rollout.n} "
            f"until {config.data.train_batch_size} groups whose {fg.metric} differs are kept; {rounds}")
    if size is None:
        return None, note, None, "", text
    bound = size // gen
    note = f"at most {bound} = {size} prompts // data.gen_batch_size={gen} (a step draws one or more batches); {note}"
    return None, note, bound * epochs, f"at most: {epochs} epochs x {bound} batches; the run ends when they are used up", text


def distillation_flow(config: PostTrainConfig) -> Optional[str]:
    """One line: the teachers' signal and how the student's update uses it (on-policy distillation), else None."""
    if not distillation_enabled(config):
        return None
    from posttrain.algorithms.distillation import distillation_loss_spec

    loss = config.distillation.distillation_loss
    try:
        teachers, topk = resolve_teachers(config), distillation_loss_spec(loss.loss_mode).use_topk
    except ValueError as err:
        return f"not plannable: {err}"
    who = (f"{len(teachers)} teachers, each row's picked by its {config.distillation.teacher_key}" if len(teachers) > 1
           else "the teacher")
    what = (f"its top-{loss.topk} tokens and their log-probs at every response position" if topk
            else "its log-prob of every sampled token")
    how = ("the per-token loss, negated, is the advantage of the vanilla PPO loss (policy gradient)"
           if loss.use_policy_gradient else "the per-token loss is back-propagated (supervised)")
    task = (f"plus the task rewards' PPO loss, distillation x {loss.distillation_loss_coef}" if loss.use_task_rewards
            else "task rewards logged, not trained on")
    return f"{who} scores ({what}); loss_mode={loss.loss_mode}: {how}; {task}"


def _reward_model_why(config: PostTrainConfig) -> str:
    rm = config.reward_model
    use = ("its score replaces the rule-based reward (verl)" if rm.combine == "replace"
           else "its score is added to the rule-based reward (combine=sum)")
    reads = ("re-renders each chat with its own template" if rm.model.input_tokenizer is not None
             else "reads the actor's tokens (input_tokenizer=null)")
    return f"because reward_model.enable=True: frozen, scores every response; {use}; {reads}; validation is rule-based"


def uses_models(config: PostTrainConfig) -> list[dict[str, Any]]:
    """Which models are loaded, and why (or why not)."""
    arr, algo = config.actor_rollout_ref, config.algorithm
    out = [{"role": "actor", "loaded": True, "model": arr.model.path,
            "why": "the trained policy; it also generates the responses (rollout engine "
                   f"{arr.rollout.name}, sharing its weights)"}]
    if uses_reference(config):
        reasons = []
        if kl_loss_active(arr.actor):
            reasons.append(f"actor.use_kl_loss=True (KL loss, coef {arr.actor.kl_loss_coef}, {arr.actor.kl_loss_type})")
        if algo.use_kl_in_reward:
            reasons.append(f"algorithm.use_kl_in_reward=True (KL penalty in the reward, {algo.kl_penalty})")
        why = "because " + " and ".join(reasons)
    elif arr.actor.use_kl_loss:  # (no in-reward KL here: uses_reference would be True)
        why = "actor.kl_loss_coef=0: the KL loss weighs nothing, so no reference is loaded (as TRL at beta=0)"
    else:
        why = "no KL term: actor.use_kl_loss=False and algorithm.use_kl_in_reward=False"
    loaded = uses_reference(config)
    if loaded and (arr.model.lora_rank > 0 or arr.model.lora_adapter_path):
        loaded, why = False, ("LoRA: the reference is the actor with its adapters disabled (verl's ref in actor), "
                              "no second copy; needed " + why)
    out.append({"role": "reference", "loaded": loaded, "model": arr.model.path, "why": why})
    if uses_critic(config):
        why = ("because critic.enable=True" if config.critic.enable
               else f"because algorithm.adv_estimator={algo.adv_estimator} learns values (GAE needs a critic)")
    elif config.critic.enable is False:
        why = "critic.enable=False"
    else:
        why = f"algorithm.adv_estimator={algo.adv_estimator} is critic-free"
    out.append({"role": "critic", "loaded": uses_critic(config), "model": config.critic.model.path, "why": why})
    if config.reward_model.enable:
        rm = {"loaded": True, "model": config.reward_model.model.path, "why": _reward_model_why(config)}
    elif config.reward.reward_model.enable:  # a generative judge (posttrain.plan.reward: where and its limits)
        url = str(config.reward.reward_model.model_path or "").startswith(("http://", "https://"))
        rm = {"loaded": not url, "model": config.reward.reward_model.model_path,
              "why": ("GenRM: the scoring function asks the endpoint " + str(config.reward.reward_model.model_path)) if url
              else "because reward.reward_model.enable=True: a generative judge served by posttrain serve (see Reward)"}
    else:
        scorer = config.custom_reward_function.path or f"built-in scorers chosen by data.{config.data.reward_fn_key}"
        rm = {"loaded": False, "model": None, "why": f"rule-based reward: {scorer}"}
    out.append({"role": "reward model", **rm})
    if distillation_enabled(config):
        try:
            teachers = resolve_teachers(config)
        except ValueError:
            teachers = {}
        for key, teacher in teachers.items():
            routed = "every row" if len(teachers) == 1 else f"the rows whose {config.distillation.teacher_key} is {key}"
            out.append({"role": "teacher" if len(teachers) == 1 else f"teacher {key}", "loaded": True,
                        "model": teacher.model_path,
                        "why": f"because distillation.enabled=True: frozen, scores the sampled tokens of {routed}; "
                               "placed like the reference (actor_rollout_ref.ref.fsdp_config)"})
    return out
