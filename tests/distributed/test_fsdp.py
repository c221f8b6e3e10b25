"""FSDP2 on 2 gloo ranks vs 1 process, tiny random Llama, fp32 (posttrain/distributed/fsdp.py).

One forked 2-rank job runs every scenario (process start-up dominates on 2 cores); each test
compares one part of its output with the same computation in this (1-process, unsharded) process.

Batch: 8 responses; rows 0-4 have long responses, rows 5-7 short ones. Ranks hold different
rows, so data-dependent micro-batch splits differ per rank.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.algorithms import agg_loss
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.distributed.fsdp import (build_mesh, fsdp_units, gathered_for_generation, init_distributed,
                                        run_local_ranks, shard_model)
from posttrain.models.logprobs import compute_response_logprobs, response_logprobs
from posttrain.models.microbatch import (equal_micro_batch_count, micro_batch_indices, split_for_padding,
                                         zero_loss_weight)
from posttrain.models.value_model import value_model_from_lm
from posttrain.rollout import SamplingParams
from posttrain.rollout.hf import HFRolloutEngine
from posttrain.workers import ActorWorker, CriticWorker, RefWorker
from posttrain.workers.common import global_batch_info
from helpers.tiny_models import tiny_llama, tiny_prompt_batch, tiny_worker_configs

TEMP = 0.8
PROMPT_LEN, RESP_LEN = 6, 10
LP_BUDGET = 16  # log-prob token budget: a long row alone, the short rows together -> unequal counts
UPDATE_BUDGET = 40  # update token budget: 2 groups on each rank (4 long rows / 4 short ones)
LOGPROB_ROWS = ([0, 1, 2, 3, 4], [5, 6, 7])  # unequal rows too: rank 1 needs padding micro-batches
UPDATE_ROWS = ([0, 1, 5, 6], [2, 3, 4, 7])  # equal rows per rank, as the dispatch guarantees
GEN_TEXTS = (["1+1=", "hello 2*3="], ["x", "what is 7-5?", "9*9="])
GEN_LENGTHS = (3, 9)  # different decode steps per rank
ACTOR_VARIANTS = {
    "rows": {},
    "dynamic": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": UPDATE_BUDGET},
    "rmpad": {"use_remove_padding": True, "loss_agg_mode": "seq-mean-token-mean"},
    "dynamic_rmpad": {"use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": UPDATE_BUDGET,
                      "use_remove_padding": True},
}
ACTOR_COMMON = {"use_kl_loss": True, "kl_loss_coef": 0.1, "entropy_coeff": 0.01}
LR = 1e-3


# --------------------------------------------------------------------------- shared scenario code
def make_batch(vocab: int, pad: int) -> dict[str, torch.Tensor]:
    """8 left-padded prompts (``[8, 6]``) + right-padded responses (``[8, 10]``) with PPO fields."""
    g = torch.Generator().manual_seed(0)
    n = 8
    p_lens = torch.tensor([6, 3, 5, 2, 4, 6, 3, 5])
    r_lens = torch.tensor([10, 9, 10, 8, 9, 2, 3, 1])
    cols_p, cols_r = torch.arange(PROMPT_LEN), torch.arange(RESP_LEN)
    attn = torch.cat([cols_p >= PROMPT_LEN - p_lens[:, None], cols_r < r_lens[:, None]], 1).long()
    ids = torch.randint(6, vocab, (n, PROMPT_LEN + RESP_LEN), generator=g).masked_fill(attn == 0, pad)
    mask = attn[:, PROMPT_LEN:]
    noise = lambda scale: scale * torch.randn(n, RESP_LEN, generator=g) * mask  # noqa: E731
    return {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT_LEN:], "response_mask": mask,
            "old_log_probs": noise(0.3) - 4.0 * mask, "ref_log_prob": noise(0.3) - 4.0 * mask,
            "advantages": noise(1.0), "values": noise(0.5), "returns": noise(1.0)}


def take(batch: dict, rows) -> dict:
    idx = torch.as_tensor(rows, dtype=torch.long)
    return {k: v[idx] for k, v in batch.items()}


def full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a (possibly FSDP-sharded) parameter or gradient: a collective for DTensors."""
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def capture_grads(optimizer: torch.optim.Optimizer, module: torch.nn.Module) -> list[dict]:
    """Gradients as the optimizer sees them, before each step (a list, one dict per step)."""
    names = {p: n for n, p in module.named_parameters()}
    steps: list[dict] = []

    def hook(opt, args, kwargs):
        steps.append({names[p]: full(p.grad) for group in opt.param_groups for p in group["params"]
                      if p.grad is not None})

    optimizer.register_step_pre_hook(hook)
    return steps


def actor_update(module, tok, batch: dict, variant: str, mini: int) -> dict:
    """One ``update_policy`` (one mini-batch) -> metrics, gradients before the step, parameters after."""
    cfg = tiny_worker_configs(temperature=TEMP, mini_batch_size=mini, micro_batch_size=2, lr=LR,
                              actor={**ACTOR_COMMON, **ACTOR_VARIANTS[variant]})
    actor = ActorWorker(cfg.model, cfg.actor, cfg.rollout, device="cpu", module=module, tokenizer=tok)
    grads = capture_grads(actor.optimizer, actor.module)
    metrics = actor.update_policy(batch)
    return {"metrics": metrics, "grads": grads[0], "params": {n: full(p) for n, p in actor.module.named_parameters()}}


def critic_update(module, batch: dict, mini: int) -> dict:
    cfg = tiny_worker_configs(mini_batch_size=mini, micro_batch_size=2, lr=LR)
    critic = CriticWorker(cfg.critic, device="cpu", module=module)
    grads = capture_grads(critic.optimizer, critic.module)
    values = critic.compute_values(batch)
    metrics = critic.update_critic(batch)
    return {"values": values, "metrics": metrics, "grads": grads[0],
            "params": {n: full(p) for n, p in critic.module.named_parameters()}}


def accumulate_grads(model, batch: dict, budget: int, sync: bool) -> dict:
    """The update loop as a worker runs it under FSDP: global normalisers, micro-batches of a token
    budget made equal in count over ranks (``sync``), padding entries with zero loss weight."""
    info = global_batch_info(batch["response_mask"])
    groups = micro_batch_indices(batch["attention_mask"], None, True, budget, sort_by_length=True)
    plan = equal_micro_batch_count(groups) if sync else [(g, False) for g in groups]
    for rows, padding in plan:
        mb = take(batch, rows)
        mb = zero_loss_weight(mb) if padding else mb
        lp, _ = response_logprobs(model, mb["input_ids"], mb["attention_mask"], mb["position_ids"],
                                  mb["responses"], temperature=TEMP)
        agg_loss(-lp * mb["advantages"], mb["response_mask"], "token-mean", **info).backward()
    return {"grads": {n: full(p.grad) for n, p in model.named_parameters()}, "micro_batches": len(plan),
            "padding": sum(bool(p) for _, p in plan)}


def generate(model, tok, texts: list[str], length: int) -> dict:
    """Greedy hf-engine decode; counts forward steps (lm_head calls)."""
    calls = []
    handle = model.lm_head.register_forward_hook(lambda *a: calls.append(1))
    engine = HFRolloutEngine(model, tok)
    out = engine.generate(tiny_prompt_batch(tok, texts), SamplingParams(do_sample=False, response_length=length))
    handle.remove()
    return {"responses": out["responses"], "log_probs": out["rollout_log_probs"], "steps": len(calls)}


def sharded(module, fsdp_config=None, **kw):
    cfg = fsdp_config if fsdp_config is not None else tiny_worker_configs().actor.fsdp_config
    return shard_model(module, build_mesh("cpu", dist.get_world_size()), cfg, **kw)


# --------------------------------------------------------------------------- the 2-rank job
def _two_rank_job(rank: int, world: int) -> dict:
    tok = build_tiny_tokenizer()
    batch = make_batch(len(tok), tok.pad_token_id)
    out: dict = {}
    model = sharded(tiny_llama(tok))
    with torch.no_grad(), gathered_for_generation(model):  # first use of the model: FSDP not yet initialised
        out["gen"] = generate(model, tok, GEN_TEXTS[rank], GEN_LENGTHS[rank])
    out["gen_resharded"] = all(isinstance(p, DTensor) for p in model.parameters())
    part = take(batch, LOGPROB_ROWS[rank])
    out["logprobs"] = compute_response_logprobs(model, part, None, TEMP, True, use_dynamic_bsz=True,
                                                max_token_len=LP_BUDGET)
    out["sum_pi_squared"] = compute_response_logprobs(model, part, None, TEMP, False, use_dynamic_bsz=True,
                                                      max_token_len=LP_BUDGET, calculate_sum_pi_squared=True)[2]
    empty = take(batch, [0, 1, 2] if rank == 0 else [])  # rank 1 holds no rows at all
    out["logprobs_empty_rank"] = compute_response_logprobs(model, empty, 1, TEMP)[0]
    out["accumulate"] = accumulate_grads(sharded(tiny_llama(tok)), take(batch, LOGPROB_ROWS[rank]), LP_BUDGET, True)
    for variant in ACTOR_VARIANTS:
        out[f"actor_{variant}"] = actor_update(sharded(tiny_llama(tok)), tok, take(batch, UPDATE_ROWS[rank]),
                                               variant, mini=4)
    options = dataclasses.replace(tiny_worker_configs().actor.fsdp_config, fsdp_size=1, forward_prefetch=True,
                                  reshard_after_forward=False)  # HSDP mesh (2 replicas x 1 shard)
    out["actor_fsdp_options"] = actor_update(sharded(tiny_llama(tok), options, gradient_checkpointing=True), tok,
                                             take(batch, UPDATE_ROWS[rank]), "rows", mini=4)
    tied = sharded(tiny_llama(tok, tie_word_embeddings=True))  # the root unit owns the shared weight
    out["tied_units"] = len(fsdp_units(tied))
    out["actor_tied"] = actor_update(tied, tok, take(batch, UPDATE_ROWS[rank]), "rows", mini=4)
    ref_cfg = dataclasses.replace(tiny_worker_configs().ref.fsdp_config, param_offload=True)
    ref = RefWorker(sharded(tiny_llama(tok), ref_cfg, forward_only=True), tiny_worker_configs().ref,
                    tiny_worker_configs(temperature=TEMP).rollout, device="cpu")
    out["ref_logprobs"] = ref.compute_ref_log_prob(take(batch, LOGPROB_ROWS[rank]))
    broken = sharded(tiny_llama(tok), gradient_divide_factor=1.0)  # summed, not averaged, over ranks
    out["actor_broken"] = actor_update(broken, tok, take(batch, UPDATE_ROWS[rank]), "rows", mini=4)
    critic = sharded(value_model_from_lm(tiny_llama(tok)), tiny_worker_configs().critic.model.fsdp_config)
    out["critic"] = critic_update(critic, take(batch, UPDATE_ROWS[rank]), mini=4)
    out["units"] = len(fsdp_units(model))
    return out


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    return make_batch(len(tok), tok.pad_token_id)


@pytest.fixture(scope="module")
def ranks():
    return run_local_ranks(_two_rank_job, 2, timeout_s=120)


def assert_close_dicts(got: dict, want: dict, rtol=1e-5, atol=1e-6):
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


# --------------------------------------------------------------------------- tests
def test_sharding_units(ranks):
    # 2 decoder layers + untied embedding + lm_head + root
    assert ranks[0]["units"] == 5


def test_generation_gathered_runs_different_step_counts_without_collectives(ranks, tok):
    steps = [r["gen"]["steps"] for r in ranks]
    assert steps[0] != steps[1]  # each rank ran its own number of forwards inside the block
    for rank, r in enumerate(ranks):
        ref = generate(tiny_llama(tok), tok, GEN_TEXTS[rank], GEN_LENGTHS[rank])
        assert torch.equal(r["gen"]["responses"], ref["responses"])
        torch.testing.assert_close(r["gen"]["log_probs"], ref["log_probs"], rtol=1e-5, atol=1e-5)
        assert r["gen_resharded"]


def test_logprobs_split_over_ranks_equal_one_process(ranks, tok, batch):
    ref_lp, ref_ent = compute_response_logprobs(tiny_llama(tok), batch, None, TEMP, True, use_dynamic_bsz=True,
                                                max_token_len=LP_BUDGET)
    lp = torch.cat([r["logprobs"][0] for r in ranks])
    ent = torch.cat([r["logprobs"][1] for r in ranks])
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    # the two ranks' own splits differ (5 long rows alone vs 3 short rows together)
    counts = [len(micro_batch_indices(take(batch, rows)["attention_mask"], None, True, LP_BUDGET))
              for rows in LOGPROB_ROWS]
    assert counts[0] > len(LOGPROB_ROWS[1]) >= counts[1]


def test_sum_pi_squared_split_over_ranks_equals_one_process(ranks, tok, batch):
    """The old-log-prob pass's sum of pi^2 (optimal_token_baseline) from FSDP2-sharded ranks."""
    ref = compute_response_logprobs(tiny_llama(tok), batch, None, TEMP, False, use_dynamic_bsz=True,
                                    max_token_len=LP_BUDGET, calculate_sum_pi_squared=True)[2]
    torch.testing.assert_close(torch.cat([r["sum_pi_squared"] for r in ranks]), ref, rtol=1e-5, atol=1e-6)
    assert bool((ref > 0).any())


def test_logprobs_with_a_rank_holding_no_rows(ranks, tok, batch):
    ref, _ = compute_response_logprobs(tiny_llama(tok), take(batch, [0, 1, 2]), 1, TEMP)
    torch.testing.assert_close(ranks[0]["logprobs_empty_rank"], ref, rtol=1e-5, atol=1e-5)
    assert ranks[1]["logprobs_empty_rank"].shape == (0, RESP_LEN)


def test_padding_micro_batches_add_zero_gradient(ranks, tok, batch):
    acc = [r["accumulate"] for r in ranks]
    assert acc[0]["micro_batches"] == acc[1]["micro_batches"] == 5
    assert (acc[0]["padding"], acc[1]["padding"]) == (0, 2)
    want = accumulate_grads(tiny_llama(tok), take(batch, [*LOGPROB_ROWS[0], *LOGPROB_ROWS[1]]), LP_BUDGET, False)
    assert_close_dicts(acc[0]["grads"], want["grads"])


@pytest.mark.parametrize("variant", list(ACTOR_VARIANTS))
def test_actor_update_equals_one_process(ranks, tok, batch, variant):
    rows = [*UPDATE_ROWS[0], *UPDATE_ROWS[1]]
    want = actor_update(tiny_llama(tok), tok, take(batch, rows), variant, mini=8)
    got = [r[f"actor_{variant}"] for r in ranks]
    assert_close_dicts(got[0]["grads"], want["grads"])
    # AdamW's first step is ~lr * sign(grad): near-zero gradients may round either way
    assert_close_dicts(got[0]["params"], want["params"], rtol=0, atol=2.5 * LR)
    m = [g["metrics"] for g in got]
    assert m[0]["actor/grad_norm"] == pytest.approx(want["metrics"]["actor/grad_norm"], rel=1e-5)
    assert m[1]["actor/grad_norm"] == pytest.approx(m[0]["actor/grad_norm"], rel=1e-6)
    # each rank's loss is its token share times W: the ranks' mean is the 1-process loss
    for key in ("actor/pg_loss", "actor/kl_loss", "actor/entropy"):
        assert (m[0][key] + m[1][key]) / 2 == pytest.approx(want["metrics"][key], rel=1e-5, abs=1e-7)


def test_hsdp_prefetch_no_reshard_checkpointing_update_equals_one_process(ranks, tok, batch):
    want = actor_update(tiny_llama(tok), tok, take(batch, [*UPDATE_ROWS[0], *UPDATE_ROWS[1]]), "rows", mini=8)
    got = ranks[0]["actor_fsdp_options"]
    assert_close_dicts(got["grads"], want["grads"])
    assert got["metrics"]["actor/grad_norm"] == pytest.approx(want["metrics"]["actor/grad_norm"], rel=1e-5)


def test_tied_embeddings_update_equals_one_process(ranks, tok, batch):
    assert ranks[0]["tied_units"] == 3  # 2 layers + root (embedding and lm_head share one weight)
    model = tiny_llama(tok, tie_word_embeddings=True)
    want = actor_update(model, tok, take(batch, [*UPDATE_ROWS[0], *UPDATE_ROWS[1]]), "rows", mini=8)
    assert_close_dicts(ranks[0]["actor_tied"]["grads"], want["grads"])


def test_forward_only_reference_equals_one_process(ranks, tok, batch):
    cfg = tiny_worker_configs(temperature=TEMP)
    want = RefWorker(tiny_llama(tok), cfg.ref, cfg.rollout, device="cpu").compute_ref_log_prob(batch)
    got = torch.cat([r["ref_logprobs"] for r in ranks])
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_update_micro_batch_counts_are_equal_per_rank(batch):
    """The update scenarios above do not rely on the workers equalising counts."""
    for rows_mode in (False, True):
        counts = {len(split_for_padding(take(batch, rows)["attention_mask"],
                                        micro_batch_indices(take(batch, rows)["attention_mask"], 2, rows_mode,
                                                            UPDATE_BUDGET, sort_by_length=True)))
                  for rows in UPDATE_ROWS}
        assert len(counts) == 1


def test_negative_control_sum_instead_of_average_is_caught(ranks, tok, batch):
    """Summed gradients (what gloo's AVG did in pytorch#162338, or a missing 1/W) fail the comparison."""
    want = actor_update(tiny_llama(tok), tok, take(batch, [*UPDATE_ROWS[0], *UPDATE_ROWS[1]]), "rows", mini=8)
    got = ranks[0]["actor_broken"]
    with pytest.raises(AssertionError):
        assert_close_dicts(got["grads"], want["grads"])
    name = "model.layers.0.mlp.up_proj.weight"
    torch.testing.assert_close(got["grads"][name], 2 * want["grads"][name], rtol=1e-5, atol=1e-6)


def test_critic_update_equals_one_process(ranks, tok, batch):
    rows = [*UPDATE_ROWS[0], *UPDATE_ROWS[1]]
    want = critic_update(value_model_from_lm(tiny_llama(tok)), take(batch, rows), mini=8)
    got = [r["critic"] for r in ranks]
    torch.testing.assert_close(torch.cat([g["values"] for g in got]), want["values"], rtol=1e-5, atol=1e-6)
    assert_close_dicts(got[0]["grads"], want["grads"])
    assert_close_dicts(got[0]["params"], want["params"], rtol=0, atol=2.5 * LR)
    m = [g["metrics"] for g in got]
    assert m[0]["critic/grad_norm"] == pytest.approx(want["metrics"]["critic/grad_norm"], rel=1e-5)
    assert (m[0]["critic/vf_loss"] + m[1]["critic/vf_loss"]) / 2 == pytest.approx(want["metrics"]["critic/vf_loss"],
                                                                                   rel=1e-5)


def test_equal_micro_batch_count_without_process_group():
    groups = [torch.tensor([0, 1, 2]), torch.tensor([3])]
    plan = equal_micro_batch_count(groups)
    assert [(p.rows.tolist(), p.padding) for p in plan] == [([0, 1, 2], False), ([3], False)]
    mb = zero_loss_weight({"response_mask": torch.ones(2, 3), "advantages": torch.ones(2, 3)})
    assert mb["response_mask"].sum() == 0 and mb["advantages"].sum() == 6


def test_init_distributed_names_missing_launcher_variables(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(RuntimeError, match=r"\['WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT'\]"):
        init_distributed()
