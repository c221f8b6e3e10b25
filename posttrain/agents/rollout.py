"""The rollout phase of a run whose agent is a program: the policy served at an OpenAI-compatible endpoint
(over the run's own engine, so with its current weights), one episode per row and sample, and the
episodes' calls assembled into the batch every estimator and loss reads.

:class:`AgentRollout` has the engines' interface (``generate(prompts, sampling) -> Batch``) and is chosen
by the actor beside the multi-turn loop when ``actor_rollout_ref.rollout.agent.episode`` names a program.
Per call of ``generate``: each prompt row gets ``n`` episodes (a GRPO group is the episodes of one row),
each its own API key (`posttrain.agents.sessions`); they run at most ``max_concurrent`` at once
(`posttrain.agents.episode`), their requests decoded together by the server's batcher; then every key is
revoked and the engine lock is held until the next rollout (nothing decodes while weights change).

The batch (keys of `posttrain.rollout.base`): one row per training sequence of an episode
(`posttrain.agents.assemble`: one per episode unless its harness rewrote history), its prompt the ids of
the sequence's first call, its response every token after it up to the last sampled one, ``response_mask``
1 exactly where the policy sampled, ``rollout_log_probs`` the engine's there. A row's non-tensor columns
are its prompt row's, plus ``agent/reward`` (what the episode returned; 0 when it failed),
``agent/failed``, ``agent/episode`` and ``agent/sequence``. A failed episode's rows, and an episode that
made no call (one row: its data prompt, no response), have no loss weight. ``meta_info["agent_metrics"]``
holds each episode's counts, which :func:`agent_step_metrics` sums: ``agent/retokenized_tokens``, ``agent/splits/<reason>``,
``agent/failures/<cause>`` and the rest.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from posttrain.agents.assemble import SPLIT_REASONS, Sequence, assemble
from posttrain.agents.episode import FAILURES, Outcome, load_episode_program, plain, run_episodes
from posttrain.agents.sessions import SESSION_COUNTS, Episode, EpisodeSessions
from posttrain.batch import Batch
from posttrain.rollout.base import SamplingParams, with_uids

__all__ = ["AgentRollout", "agent_scores", "agent_step_metrics", "gather_agent_batches", "is_agent_batch",
           "old_log_probs_from", "METRICS_KEY"]

METRICS_KEY = "agent_metrics"
PAD_KEY = "agent_pad_token_id"  # the ranks' gather left-pads prompts with it


class AgentRollout:
    """Agent episodes over ``engine`` (module docstring).

    Args:
        engine: the rollout engine (``hf`` or ``vllm``); served as it is, so with the actor's weights.
        tokenizer: the policy's tokenizer (chat template, tool calls).
        rollout_config: ``actor_rollout_ref.rollout`` (``agent.episode.*``, the sampling keys).
        reuse_history: `posttrain.agents.sessions.EpisodeSessions`'s (tests turn it off as a control).
    """

    def __init__(self, engine: Any, tokenizer: Any, rollout_config: Any, *, reuse_history: bool = True,
                 max_batch_rows: int = 64):
        self.engine, self.tokenizer = engine, tokenizer
        self.config = rollout_config.agent.episode
        self.program = load_episode_program(self.config)
        self.sessions = EpisodeSessions(reuse_history=reuse_history)
        self.max_batch_rows = max_batch_rows
        self.server = None
        self.last_outcomes: list[Outcome] = []
        self.last_episodes: list[Episode] = []
        self.pad_token_id = getattr(engine, "pad_token_id", None)
        if self.pad_token_id is None:
            self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id

    def start(self) -> "AgentRollout":
        """Start the endpoint (on first use); its engine lock is held from here to the first rollout."""
        if self.server is None:
            from posttrain.serve.server import CompletionServer

            s = self.sessions
            self.server = CompletionServer(self.engine, self.tokenizer, model_name=self.config.model_name,
                                           api_key=s.check_key, recorder=s.record, hook=s, admit=s.admit,
                                           max_batch_rows=self.max_batch_rows).start()
            s.max_model_len = self.server.batcher.max_model_len
            self.server.engine_lock.acquire()
        return self

    def close(self) -> None:
        if self.server is not None:
            self.server.engine_lock.release()
            self.server.stop()
            self.server = None

    def generate(self, prompts: Batch, sampling: SamplingParams) -> Batch:
        """``N`` prompt rows -> the training sequences of ``N * sampling.n`` episodes (module docstring)."""
        self.start()
        prompts = with_uids(prompts)  # the n episodes of a row share its uid: a GRPO group
        rows = prompts.repeat(sampling.n, interleave=True) if sampling.n > 1 else prompts
        episodes = self.sessions.open(len(rows), sampling)
        jobs = [(e.key, _row_dict(rows, i)) for i, e in enumerate(episodes)]
        self.server.engine_lock.release()
        try:
            outcomes = run_episodes(self.program, jobs, url=self.server.url, model=self.config.model_name,
                                    timeout_s=self.config.timeout_s, max_concurrent=self.config.max_concurrent)
        finally:
            self.sessions.close()  # keys revoked: an abandoned episode's later calls are refused
            self.server.engine_lock.acquire()  # waits for a decode under way; held until the next rollout
        for e, o in zip(episodes, outcomes):  # a raise after a refused model name is that cause
            if o.failure == "raised" and e.counts["refused/model_not_found"]:
                o.failure = "wrong_model"
        self.last_outcomes, self.last_episodes = outcomes, episodes
        return build_batch(rows, episodes, outcomes, sampling.response_length, self.pad_token_id,
                           sampling.calculate_log_probs)


def _row_dict(rows: Batch, i: int) -> dict:
    """Row ``i``'s columns as plain Python; its chat (``raw_prompt``) as ``prompt``."""
    row = {k: plain(v[i]) for k, v in rows.non_tensor_batch.items()}
    if "raw_prompt" in row:
        row["prompt"] = row.pop("raw_prompt")
    return row


def build_batch(rows: Batch, episodes: list[Episode], outcomes: list[Outcome], response_length: int, pad: int,
                with_log_probs: bool = True) -> Batch:
    """The rollout batch of the episodes' training sequences (module docstring)."""
    entries: list[tuple[int, int, Sequence, bool]] = []  # (episode, sequence, it, trained)
    counts: list[dict] = []  # per episode: what the step's metrics sum
    for i, (episode, outcome) in enumerate(zip(episodes, outcomes)):
        assembly = assemble(episode.calls, response_length)
        sequences = assembly.sequences
        if not sequences:  # no call answered: its data prompt, nothing to train on
            sequences = [Sequence(rows["input_ids"][i][rows["attention_mask"][i].bool()].tolist())]
        entries += [(i, j, s, outcome.failure is None) for j, s in enumerate(sequences)]
        counts.append(_episode_counts(episode, outcome, assembly, len(sequences)))
    m, width = len(entries), max(len(s.prompt) for _, _, s, _ in entries)
    prompt_ids = torch.full((m, width), pad, dtype=torch.long)
    prompt_mask = torch.zeros((m, width), dtype=torch.long)
    responses = torch.full((m, response_length), pad, dtype=torch.long)
    mask = torch.zeros((m, response_length), dtype=torch.long)
    filled = torch.zeros((m, response_length), dtype=torch.long)
    log_probs = torch.zeros((m, response_length), dtype=torch.float32)
    for r, (_, _, s, trained) in enumerate(entries):
        p, n = len(s.prompt), len(s.tokens)
        prompt_ids[r, width - p:] = torch.tensor(s.prompt, dtype=torch.long)
        prompt_mask[r, width - p:] = 1
        if n:
            responses[r, :n] = torch.tensor(s.tokens, dtype=torch.long)
            filled[r, :n] = 1
            mask[r, :n] = torch.tensor(s.mask, dtype=torch.long) * int(trained)
            log_probs[r, :n] = torch.tensor(s.log_probs, dtype=torch.float32)
    prompt_pos = (prompt_mask.cumsum(-1) - 1).clamp(min=0)
    tensors = {
        "prompts": prompt_ids, "responses": responses, "response_mask": mask,
        "input_ids": torch.cat([prompt_ids, responses], dim=1),
        "attention_mask": torch.cat([prompt_mask, filled], dim=1),
        "position_ids": torch.cat([prompt_pos, prompt_pos[:, -1:] + torch.arange(1, response_length + 1)], dim=1),
    }
    if with_log_probs:
        tensors["rollout_log_probs"] = log_probs * mask
    dev = rows["input_ids"].device
    tensors = {k: v.to(dev) for k, v in tensors.items()}
    pick = [i for i, _, _, _ in entries]
    non_tensors = {k: v[pick] for k, v in rows.non_tensor_batch.items()}
    rewards = [outcomes[i].reward if outcomes[i].failure is None else 0.0 for i in pick]
    non_tensors.update({
        "agent/reward": np.asarray(rewards, dtype=np.float64),
        "agent/failed": np.asarray([outcomes[i].failure is not None for i in pick], dtype=np.float64),
        "agent/episode": np.asarray(pick, dtype=np.float64),
        "agent/sequence": np.asarray([j for _, j, _, _ in entries], dtype=np.float64),
    })
    meta = dict(rows.meta_info)
    meta[METRICS_KEY] = counts
    meta[PAD_KEY] = int(pad)
    return Batch.from_dict(tensors, non_tensors, meta)


def _episode_counts(episode: Episode, outcome: Outcome, assembly: Any, sequences: int) -> dict:
    c = Counter({"agent/episodes": 1, "agent/sequences": sequences, "agent/failed": int(outcome.failure is not None),
                 "agent/retokenized_tokens": assembly.retokenized_tokens,
                 "agent/truncated_tokens": assembly.truncated_tokens, "agent/episode_s_total": outcome.seconds})
    c.update({f"agent/splits/{r}": n for r, n in assembly.splits.items()})
    for key, value in episode.counts.items():
        c[f"agent/refused_requests/{key[8:]}" if key.startswith("refused/") else f"agent/{key}"] += value
    if outcome.failure is not None:
        c[f"agent/failures/{outcome.failure}"] += 1
    return dict(c)


def agent_step_metrics(batch: Batch) -> dict[str, float]:
    """The step's ``agent/*`` counts, summed over its episodes (taken off the batch: they are the step's,
    not a row's), with ``agent/calls_per_episode`` and ``agent/episode_s_mean``; {} for any other batch."""
    batch.meta_info.pop(PAD_KEY, None)
    per_episode = batch.meta_info.pop(METRICS_KEY, None)
    if not per_episode:
        return {}
    out = Counter({"agent/retokenized_tokens": 0, "agent/truncated_tokens": 0,
                   **{f"agent/splits/{r}": 0 for r in SPLIT_REASONS}, **{f"agent/failures/{c}": 0 for c in FAILURES},
                   **{f"agent/{k}": 0 for k in SESSION_COUNTS}})
    for counts in per_episode:
        out.update(counts)
    episodes = max(1, out["agent/episodes"])
    out["agent/calls_per_episode"] = out["agent/calls"] / episodes
    out["agent/episode_s_mean"] = out.pop("agent/episode_s_total") / episodes
    return {k: float(v) for k, v in out.items()}


def gather_agent_batches(outputs: list[Batch], prompts_per_rank: int, pad_prompts: int) -> Batch:
    """The ranks' agent rollouts (rank ``r`` had prompts ``[r * prompts_per_rank, ...)``, the last
    ``pad_prompts`` of them copies that pad the batch) as one: the padding prompts' episodes dropped,
    episode indices made global, prompts left-padded to the widest, the counts summed."""
    width = max(b["prompts"].shape[1] for b in outputs)
    parts, counts, offset = [], [], 0
    for r, out in enumerate(outputs):
        per_episode = out.meta_info.pop(METRICS_KEY)
        pad_token_id = out.meta_info.pop(PAD_KEY)
        episodes = np.asarray(out.non_tensor_batch["agent/episode"], dtype=np.int64)
        per_prompt = int(episodes.max()) + 1 if len(episodes) else 0
        per_prompt //= max(1, prompts_per_rank)  # episodes per prompt (rollout.n)
        real = prompts_per_rank - (pad_prompts if r == len(outputs) - 1 else 0)
        keep = torch.as_tensor(np.nonzero(episodes < real * per_prompt)[0])
        counts += per_episode[:real * per_prompt]
        out = _left_padded(out.index_select(keep), width, pad_token_id)
        out.non_tensor_batch["agent/episode"] = out.non_tensor_batch["agent/episode"] + offset
        offset += real * per_prompt
        parts.append(out)
    merged = Batch.concat(parts)
    merged.meta_info[METRICS_KEY] = counts
    return merged


def _left_padded(batch: Batch, width: int, pad_token_id: int) -> Batch:
    """``batch`` with its prompts left-padded to ``width`` columns (input ids, masks and positions too)."""
    extra = width - batch["prompts"].shape[1]
    if extra <= 0:
        return batch
    rows = len(batch)
    fill = {"prompts": pad_token_id, "input_ids": pad_token_id, "attention_mask": 0, "position_ids": 0}
    for key, value in fill.items():
        t = batch[key]
        batch[key] = torch.cat([torch.full((rows, extra), value, dtype=t.dtype, device=t.device), t], dim=1)
    return batch


def is_agent_batch(batch: Any) -> bool:
    return isinstance(batch, Batch) and "agent/episode" in batch.non_tensor_batch


def old_log_probs_from(batch: Batch, configured: str) -> str:
    """``configured`` (`posttrain.config.DerivedSizes.old_log_probs_from`), except that an agent batch with
    more rows than episodes (a harness rewrote history: splits) no longer fits the one mini-batch whose own
    forward would give the old log-probs: they are recomputed."""
    if configured == "update" and is_agent_batch(batch):
        if len(batch) > len(set(batch.non_tensor_batch["agent/episode"].tolist())):
            return "recompute"
    return configured


def agent_scores(batch: Batch) -> tuple[torch.Tensor, dict] | None:
    """``(token_level_scores [N, R], extra)`` of an agent rollout: each row's episode reward on its last
    response token (`posttrain.rewards.manager.place_on_last_token`); None for any other batch."""
    from posttrain.rewards.manager import place_on_last_token

    rewards = batch.non_tensor_batch.get("agent/reward")
    if rewards is None:
        return None
    values = torch.as_tensor(np.asarray(rewards, dtype=np.float64), dtype=torch.float32)
    return place_on_last_token(values, batch["response_mask"]), {"agent/reward": np.asarray(rewards, dtype=np.float64)}
