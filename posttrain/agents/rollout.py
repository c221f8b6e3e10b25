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
holds the step's counts (:func:`agent_step_metrics`): ``agent/retokenized_tokens``, ``agent/splits/<reason>``,
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

__all__ = ["AgentRollout", "agent_scores", "agent_step_metrics", "METRICS_KEY"]

METRICS_KEY = "agent_metrics"


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
    metrics: Counter = Counter()
    for i, (episode, outcome) in enumerate(zip(episodes, outcomes)):
        assembly = assemble(episode.calls, response_length)
        sequences = assembly.sequences
        if not sequences:  # no call answered: its data prompt, nothing to train on
            sequences = [Sequence(rows["input_ids"][i][rows["attention_mask"][i].bool()].tolist())]
        entries += [(i, j, s, outcome.failure is None) for j, s in enumerate(sequences)]
        metrics["agent/retokenized_tokens"] += assembly.retokenized_tokens
        metrics["agent/truncated_tokens"] += assembly.truncated_tokens
        metrics.update({f"agent/splits/{r}": n for r, n in assembly.splits.items()})
        metrics.update({f"agent/{k}": v for k, v in episode.counts.items() if not k.startswith("refused/")})
        metrics.update({f"agent/refused_requests/{k[8:]}": v for k, v in episode.counts.items()
                        if k.startswith("refused/")})
        if outcome.failure is not None:
            metrics[f"agent/failures/{outcome.failure}"] += 1
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
    meta[METRICS_KEY] = _step_metrics(metrics, episodes, outcomes, m)
    return Batch.from_dict(tensors, non_tensors, meta)


def _step_metrics(counts: Counter, episodes: list[Episode], outcomes: list[Outcome], sequences: int) -> dict:
    out = {"agent/episodes": float(len(episodes)), "agent/sequences": float(sequences),
           "agent/failed": float(sum(o.failure is not None for o in outcomes)),
           "agent/retokenized_tokens": 0.0, "agent/truncated_tokens": 0.0,
           **{f"agent/splits/{r}": 0.0 for r in SPLIT_REASONS}, **{f"agent/failures/{c}": 0.0 for c in FAILURES},
           **{f"agent/{k}": 0.0 for k in SESSION_COUNTS}}
    out.update({k: float(v) for k, v in counts.items()})
    done = [o.reward for o in outcomes if o.failure is None]
    out["agent/reward_mean"] = float(np.mean(done)) if done else 0.0
    out["agent/episode_s_mean"] = float(np.mean([o.seconds for o in outcomes])) if outcomes else 0.0
    out["agent/calls_per_episode"] = out["agent/calls"] / max(1, len(episodes))
    return out


def agent_step_metrics(batch: Batch) -> dict[str, float]:
    """The rollout's ``agent/*`` counts (taken off the batch: they are the step's, not a row's); {} otherwise."""
    return batch.meta_info.pop(METRICS_KEY, None) or {}


def agent_scores(batch: Batch) -> tuple[torch.Tensor, dict] | None:
    """``(token_level_scores [N, R], extra)`` of an agent rollout: each row's episode reward on its last
    response token (`posttrain.rewards.manager.place_on_last_token`); None for any other batch."""
    from posttrain.rewards.manager import place_on_last_token

    rewards = batch.non_tensor_batch.get("agent/reward")
    if rewards is None:
        return None
    values = torch.as_tensor(np.asarray(rewards, dtype=np.float64), dtype=torch.float32)
    return place_on_last_token(values, batch["response_mask"]), {"agent/reward": np.asarray(rewards, dtype=np.float64)}
