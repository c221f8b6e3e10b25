"""LoRA on 2 gloo ranks (FSDP2: frozen base and trainable adapters sharded alike) vs 1 process:
the rank workers build the actor as a run does (`RankWorker`: adapters injected before sharding,
the reference = the actor with adapters disabled, no second model), and their reference
log-probs, adapter update and checkpoint equal the one-process ones; the base stays bit-identical.

Batch: 8 responses of varied length; rank r holds rows ``UPDATE_ROWS[r]`` (the one process all 8).
One mini-batch (one optimizer step), micro-batches of 2 rows, KL loss on: every term of the loss.
"""

from __future__ import annotations

import pytest
import torch

from posttrain.batch import Batch
from posttrain.config import derive_sizes, worker_config
from posttrain.config.roles import rl_role_specs
from posttrain.distributed.fsdp import run_local_ranks
from helpers.tiny_run import tiny_config
from helpers.tokenizer import build_tiny_tokenizer

UPDATE_ROWS = ([0, 1, 5, 6], [2, 3, 4, 7])
PROMPT_LEN, RESP_LEN = 6, 10
LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.1",
        "data.train_batch_size=4", "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2", "actor_rollout_ref.actor.optim.lr=5e-2",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=2"]


def make_batch(vocab: int, pad: int) -> dict[str, torch.Tensor]:
    """8 left-padded prompts ``[8, 6]`` + right-padded responses ``[8, 10]`` with PPO fields."""
    g = torch.Generator().manual_seed(0)
    p_lens = torch.tensor([6, 3, 5, 2, 4, 6, 3, 5])
    r_lens = torch.tensor([10, 9, 10, 8, 9, 2, 3, 1])
    attn = torch.cat([torch.arange(PROMPT_LEN) >= PROMPT_LEN - p_lens[:, None],
                      torch.arange(RESP_LEN) < r_lens[:, None]], 1).long()
    ids = torch.randint(6, vocab, (8, PROMPT_LEN + RESP_LEN), generator=g).masked_fill(attn == 0, pad)
    mask = attn[:, PROMPT_LEN:]
    return {"input_ids": ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
            "responses": ids[:, PROMPT_LEN:], "response_mask": mask,
            "old_log_probs": (0.3 * torch.randn(8, RESP_LEN, generator=g) - 4.0) * mask,
            "advantages": torch.randn(8, RESP_LEN, generator=g) * mask}


def as_batch(tensors: dict, rows=None) -> Batch:
    idx = torch.as_tensor(rows if rows is not None else range(8), dtype=torch.long)
    return Batch.from_dict({k: v[idx] for k, v in tensors.items()})


def per_rank_specs(workdir, ranks: int):
    config = tiny_config(workdir, LORA + [f"trainer.n_gpus_per_node={ranks}"])
    return rl_role_specs(worker_config(config, derive_sizes(config)))


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def step(actor, ref, batch: Batch) -> dict:
    """Reference log-probs, one update with the KL loss against them, the log-probs after it."""
    out = {"ref": ref.compute_ref_log_prob(batch)}
    batch.batch["ref_log_prob"] = out["ref"]
    out["metrics"] = actor.update_policy(batch)
    out["after"] = actor.compute_log_prob(batch, calculate_entropy=False)[0]
    out["ref_after"] = ref.compute_ref_log_prob(batch)
    return out


def _rank_job(rank: int, world: int, workdir: str, ckpt: str, one_process_ckpt: str) -> dict:
    from posttrain.distributed.rank import RankWorker

    tok = build_tiny_tokenizer()
    worker = RankWorker(per_rank_specs(workdir, world), 0, tok, "cpu")
    initial = {n: full(p) for n, p in worker.actor.module.named_parameters() if not p.requires_grad}
    out = step(worker.actor, worker.ref, as_batch(make_batch(len(tok), tok.pad_token_id), UPDATE_ROWS[rank]))
    out["metrics"] = {k: torch.tensor(v) for k, v in out["metrics"].items()}
    params = {n: full(p) for n, p in worker.actor.module.named_parameters()}
    out["adapters"] = {n: t for n, t in params.items() if ".lora_" in n}
    out["base_changed"] = [n for n, t in initial.items() if not torch.equal(t, params[n])]
    out["ref_is_lora_reference"] = type(worker.ref).__name__ == "LoraReference"
    worker.save_checkpoint(ckpt)
    worker.load_checkpoint(one_process_ckpt)  # the other direction: a one-process checkpoint into the shards
    out["loaded"] = {n: full(p) for n, p in worker.actor.module.named_parameters() if ".lora_" in n}
    return out


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def one_process(tmp_path_factory, tok):
    """The same step in one process; its checkpoint (``<folder>/actor``) for the ranks to load."""
    from posttrain.trainer.setup import build_local_group

    work = tmp_path_factory.mktemp("one")
    group = build_local_group(per_rank_specs(work, 1), torch.device("cpu"), 0, tokenizer=tok)
    result = step(group.actor, group.ref, as_batch(make_batch(len(tok), tok.pad_token_id)))
    (work / "ckpt").mkdir()
    group.save_checkpoint(work / "ckpt")
    return group, result, work / "ckpt"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory, one_process):
    workdir, ckpt = tmp_path_factory.mktemp("ranks"), tmp_path_factory.mktemp("ckpt") / "global_step_1"
    ckpt.mkdir()
    per_rank_specs(workdir, 2)  # writes the tiny model and data once, before the ranks read them
    return run_local_ranks(_rank_job, 2, str(workdir), str(ckpt), str(one_process[2]), timeout_s=180), ckpt


def _rows(result: dict, key: str) -> torch.Tensor:
    """The ranks' per-row results put back in the one-process row order."""
    out = torch.zeros(8, RESP_LEN)
    for rank, rows in enumerate(UPDATE_ROWS):
        out[rows] = result[rank][key]
    return out


def test_ranks_use_the_actor_as_reference_and_keep_the_base_bit_identical(two_ranks):
    results, _ = two_ranks
    for r in results:
        assert r["ref_is_lora_reference"] and r["base_changed"] == []


def test_reference_log_probs_equal_one_process_and_stay_the_base(two_ranks, one_process):
    results, _ = two_ranks
    _, single, _ = one_process
    torch.testing.assert_close(_rows(results, "ref"), single["ref"], rtol=0, atol=1e-6)
    torch.testing.assert_close(_rows(results, "ref_after"), single["ref"], rtol=0, atol=1e-6)  # base: unchanged
    assert (_rows(results, "after") - _rows(results, "ref_after")).abs().max() > 1e-3  # the adapters moved


def test_adapter_update_equals_one_process(two_ranks, one_process):
    results, _ = two_ranks
    group, single, _ = one_process
    want = {n: p.detach() for n, p in group.actor.module.named_parameters() if ".lora_" in n}
    assert results[0]["adapters"].keys() == want.keys()
    for name, value in want.items():
        assert torch.equal(results[0]["adapters"][name], results[1]["adapters"][name]), name
        torch.testing.assert_close(results[0]["adapters"][name], value, rtol=1e-4, atol=1e-6, msg=name)
    torch.testing.assert_close(_rows(results, "after"), single["after"], rtol=0, atol=1e-5)
    grad_norm = results[0]["metrics"]["actor/grad_norm"].item()
    assert grad_norm == pytest.approx(single["metrics"]["actor/grad_norm"], rel=1e-4)


def test_checkpoint_of_two_ranks_loads_into_one_process(two_ranks, tmp_path, tok):
    from posttrain.trainer.setup import build_local_group

    results, ckpt = two_ranks
    assert (ckpt / "actor" / "dcp").is_dir() and (ckpt / "actor" / "lora_adapter" / "adapter_config.json").exists()
    group = build_local_group(per_rank_specs(tmp_path, 1), torch.device("cpu"), 0, tokenizer=tok)
    group.actor.load_checkpoint(ckpt / "actor")
    for name, p in group.actor.module.named_parameters():
        if ".lora_" in name:
            assert torch.equal(p.detach(), results[0]["adapters"][name]), name
    assert len(group.actor.optimizer.state) == len(results[0]["adapters"])  # AdamW moments came along


def test_checkpoint_of_one_process_loads_into_two_ranks(two_ranks, one_process):
    results, _ = two_ranks
    group, _, _ = one_process
    for name, p in group.actor.module.named_parameters():
        if ".lora_" in name:
            for rank in results:
                assert torch.equal(rank["loaded"][name], p.detach()), name
