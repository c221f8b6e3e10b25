"""Per-batch sampling seeds (``actor_rollout_ref.rollout.seed_per_batch``): a batch's draws depend on its
seed alone, not on what the process drew before, and the process's own random stream is left as it was."""

from __future__ import annotations

import pytest
import torch

from helpers.tiny_models import tiny_llama, tiny_prompt_batch, tiny_worker_configs
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.rollout.seeding import SEED_KEY, batch_seed, seeded_sampling
from posttrain.workers.actor import ActorWorker


@pytest.fixture(scope="module")
def actor():
    tok = build_tiny_tokenizer()
    cfg = tiny_worker_configs(response_length=12)
    return ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=tiny_llama(tok, seed=3), tokenizer=tok)


def _prompts(actor, seed=None):
    batch = tiny_prompt_batch(actor.tokenizer, ["1+1=", "hello 2*3=", "7+2="])
    batch.meta_info["temperature"] = 1.0
    if seed is not None:
        batch.meta_info[SEED_KEY] = seed
    return batch


def test_the_same_seed_draws_the_same_responses_whatever_was_drawn_before(actor):
    seed = batch_seed(0, 3, 0)
    torch.manual_seed(1)
    first = actor.generate_sequences(_prompts(actor, seed))
    torch.rand(1000)  # the process's stream moves on; the batch's draws must not
    again = actor.generate_sequences(_prompts(actor, seed))
    assert torch.equal(first["responses"], again["responses"])
    assert SEED_KEY not in first.meta_info  # batches joined later (units, rounds) each had their own
    other = actor.generate_sequences(_prompts(actor, batch_seed(0, 4, 0)))  # negative control: the next step
    assert not torch.equal(first["responses"], other["responses"])


def test_without_a_seed_the_process_stream_decides(actor):
    torch.manual_seed(1)
    first = actor.generate_sequences(_prompts(actor))
    second = actor.generate_sequences(_prompts(actor))
    assert not torch.equal(first["responses"], second["responses"])
    torch.manual_seed(1)
    assert torch.equal(actor.generate_sequences(_prompts(actor))["responses"], first["responses"])


def test_seeded_sampling_leaves_the_process_stream_where_it_was():
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    with seeded_sampling({SEED_KEY: 123}):
        inside = torch.rand(3)
    assert torch.equal(torch.rand(3), expected)  # as if the seeded block had not run
    with seeded_sampling({SEED_KEY: 123}):
        assert torch.equal(torch.rand(3), inside)


def test_batch_seeds_differ_by_run_step_and_first_prompt():
    seeds = {batch_seed(r, s, f) for r in (0, 1) for s in (1, 2) for f in (0, 8)}
    assert len(seeds) == 8
    assert batch_seed(0, 1, 0) == batch_seed(0, 1, 0)
    assert all(0 <= s < 1 << 63 for s in seeds)
