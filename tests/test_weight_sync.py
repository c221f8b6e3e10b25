"""Trainer -> rollout weight transfer (`posttrain.distributed.weight_sync`, issue 39).

Processes are forked (no re-import: under a second each) and join a gloo `WeightSyncGroup`; rank 0
plays trainer rank 0, ranks 1.. the rollout workers. Each process returns what it received (or the
error it raised) through a ``torch.save`` file. References are independent: the sender's own
tensors, and for models an identical copy built in the test process.
"""

from __future__ import annotations

import json
import os
import socket
import tempfile
import threading
import traceback

import pytest
import torch
import torch.multiprocessing as torch_mp
import peft  # noqa: F401  (imported before forking, as transformers: children do not import them again)
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.distributed.weight_sync import (
    FileWeightSync,
    WeightSyncError,
    WeightSyncGroup,
    load_weights,
    push_trainer_weights,
    receive_into,
    stage_weights,
    trainer_weights,
)
from posttrain.models.lora import LoraSettings, apply_lora

TIMEOUT_S = 30.0


# --------------------------------------------------------------------------- helpers
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _child(rank: int, fn, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    try:
        result = fn(rank, *args)
    except Exception as err:  # the test asserts on it
        result = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(fn, nprocs: int, *args) -> list:
    """``fn(rank, *args)`` in ``nprocs`` forked processes; what each returned (or its error dict)."""
    with tempfile.TemporaryDirectory(prefix="weight-sync-test-") as out_dir:
        torch_mp.start_processes(_child, nprocs=nprocs, join=True, start_method="fork", args=(fn, out_dir, args))
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=True) for r in range(nprocs)]


def mixed_tensors(version: int) -> list[tuple[str, torch.Tensor]]:
    """fp32, bf16, int64 and bool tensors, one larger than the test's bucket, values depending on ``version``."""
    g = torch.Generator().manual_seed(version)
    return [("layer.weight", torch.randn(40, 30, generator=g)),
            ("layer.bias", torch.randn(30, generator=g)),
            ("half.weight", torch.randn(17, 5, generator=g).to(torch.bfloat16)),
            ("counts", torch.randint(-2**40, 2**40, (9,), generator=g)),
            ("mask", torch.rand(6, generator=g) > 0.5),
            ("scalar", torch.tensor(float(version))),
            ("big", torch.randn(3000, generator=g)),
            ("empty", torch.zeros(0, 4))]


def tiny_llama(seed: int, tied: bool = False):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=tied)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms start at 1 in every model: make every tensor depend on the seed
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    model.register_buffer("steps_seen", torch.tensor([seed, 10 * seed + 1]))  # a persistent int64 buffer
    return model.eval()


def lora_model(base_seed: int, adapter_seed: int, trained: bool):
    """A tiny Llama with rank-4 LoRA adapters on every linear layer; ``trained``: non-zero ``lora_B``."""
    settings = LoraSettings(rank=4, alpha=8.0, target_modules="all-linear", exclude_modules=None,
                            adapter_path=None, section="actor_rollout_ref.model")
    adapter = apply_lora(tiny_llama(base_seed), settings, seed=adapter_seed)
    if trained:
        g = torch.Generator().manual_seed(adapter_seed + 100)
        with torch.no_grad():
            for name, p in adapter.model.named_parameters():
                if ".lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return adapter.model.eval()


def logits(model) -> torch.Tensor:
    ids = torch.arange(3, 3 + 2 * 7).view(2, 7) % 96
    with torch.no_grad():
        return model(input_ids=ids).logits


def state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- collective: mixed dtypes
def _mixed_rank(rank: int, port: int, world: int):
    group = WeightSyncGroup.create("127.0.0.1", port, rank, world, "gloo", timeout_s=TIMEOUT_S)
    results = []
    for version in (1, 2):
        if rank == 0:
            results.append(group.send(iter(mixed_tensors(version)), version, bucket_bytes=1024))
        else:
            got: dict = {}
            received = group.receive(lambda named: got.update((n, t.clone()) for n, t in named))
            results.append({"version": received, "tensors": got})
    group.close()
    return results


def test_mixed_dtypes_arrive_bit_equal_with_their_versions():
    results = run_ranks(_mixed_rank, 3, free_port(), 3)
    assert not any("error" in r for r in results if isinstance(r, dict)), results
    for version in (1, 2):
        sent = dict(mixed_tensors(version))
        metrics = results[0][version - 1]
        assert metrics["weight_sync/version"] == version
        assert metrics["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in sent.values())
        assert metrics["weight_sync/tensors"] == len(sent)
        assert metrics["weight_sync/buckets"] >= 5  # 4 dtypes, fp32 over several 1 KiB buckets
        for rank in (1, 2):
            got = results[rank][version - 1]
            assert got["version"] == version
            assert list(got["tensors"]) != [] and set(got["tensors"]) == set(sent)
            for name, tensor in sent.items():
                assert got["tensors"][name].dtype == tensor.dtype, name
                assert got["tensors"][name].shape == tensor.shape, name
                assert torch.equal(got["tensors"][name], tensor), name
    # negative control: the two versions differ, so receiving a stale or repeated bucket would fail above
    assert not torch.equal(dict(mixed_tensors(1))["big"], dict(mixed_tensors(2))["big"])


# --------------------------------------------------------------------------- collective: a tiny Llama
def _llama_rank(rank: int, port: int):
    group = WeightSyncGroup.create("127.0.0.1", port, rank, 2, "gloo", timeout_s=TIMEOUT_S)
    model = tiny_llama(seed=0 if rank == 0 else 1, tied=True)
    if rank == 0:
        result = push_trainer_weights(group, model, 5, bucket_bytes=16 << 10)
    else:
        result = {"version": receive_into(group, model), "state": state(model), "logits": logits(model)}
    group.close()
    return result


def test_tiny_llama_full_weights_tied_and_buffers():
    trainer, rollout = run_ranks(_llama_rank, 2, free_port())
    assert "error" not in trainer and "error" not in rollout, (trainer, rollout)
    reference, stale = tiny_llama(0, tied=True), tiny_llama(1, tied=True)
    assert rollout["version"] == 5 and trainer["weight_sync/version"] == 5
    expected = state(reference)
    assert set(rollout["state"]) == set(expected)
    for name, tensor in expected.items():
        assert torch.equal(rollout["state"][name], tensor), name
        if tensor.numel() > 1:  # negative control: the receiver started from other values everywhere
            assert not torch.equal(state(stale)[name], tensor), name
    assert torch.equal(rollout["state"]["lm_head.weight"], rollout["state"]["model.embed_tokens.weight"])
    unique = {n: p for n, p in reference.named_parameters()}  # tied twin once
    assert trainer["weight_sync/tensors"] == len(unique) + 1  # + the int64 buffer
    assert trainer["weight_sync/bytes"] == sum(p.numel() * 4 for p in unique.values()) + 16
    assert torch.equal(rollout["logits"], logits(reference))


def _staged_rank(rank: int, port: int):
    """The rollout worker receives on a second thread (as a Ray concurrency group would) while its main
    thread keeps running forwards, stages the weights checked, and loads them afterwards."""
    model = tiny_llama(seed=0 if rank == 0 else 1)
    group = WeightSyncGroup.create("127.0.0.1", port, rank, 2, "gloo", timeout_s=TIMEOUT_S)
    if rank == 0:
        result = push_trainer_weights(group, model, 3)
    else:
        staged: dict = {}
        versions: list = []
        receiver = threading.Thread(target=lambda: versions.append(
            group.receive(lambda named: staged.update(stage_weights(model, named)))))
        receiver.start()
        during = [logits(model) for _ in range(3)]  # generation goes on meanwhile, on the old weights
        receiver.join(TIMEOUT_S)
        unchanged = all(torch.equal(x, during[0]) for x in during)
        loaded = load_weights(model, staged.items())
        result = {"versions": versions, "unchanged": unchanged, "loaded": loaded, "state": state(model)}
    group.close()
    return result


def test_receive_on_a_second_thread_stages_then_loads():
    trainer, rollout = run_ranks(_staged_rank, 2, free_port())
    assert "error" not in trainer and "error" not in rollout, (trainer, rollout)
    assert rollout["versions"] == [3] and rollout["unchanged"]
    assert rollout["loaded"] == trainer["weight_sync/tensors"]
    for name, tensor in state(tiny_llama(0)).items():
        assert torch.equal(rollout["state"][name], tensor), name


# --------------------------------------------------------------------------- collective: LoRA adapters only
def _lora_rank(rank: int, port: int):
    group = WeightSyncGroup.create("127.0.0.1", port, rank, 2, "gloo", timeout_s=TIMEOUT_S)
    # same base (seed 0); the rollout copy's adapters start elsewhere (other lora_A, zero lora_B)
    model = lora_model(0, adapter_seed=3 if rank == 0 else 4, trained=rank == 0)
    if rank == 0:
        result = push_trainer_weights(group, model, 2, lora_only=True)
    else:
        before = logits(model)
        result = {"version": receive_into(group, model, lora_only=True), "logits": logits(model), "before": before,
                  "merged": dict(trainer_weights(model))}
    group.close()
    return result


def test_lora_adapter_only_sync_is_small_and_merges_to_the_trainers_output():
    trainer, rollout = run_ranks(_lora_rank, 2, free_port())
    assert "error" not in trainer and "error" not in rollout, (trainer, rollout)
    reference = lora_model(0, adapter_seed=3, trained=True)
    full_bytes = sum(t.numel() * t.element_size() for _, t in trainer_weights(reference))
    adapter = [(n, p) for n, p in reference.named_parameters() if ".lora_" in n]
    assert trainer["weight_sync/tensors"] == len(adapter) > 0
    assert trainer["weight_sync/bytes"] == sum(p.numel() * 4 for _, p in adapter)
    assert trainer["weight_sync/bytes"] < 0.25 * full_bytes
    assert rollout["version"] == 2
    expected = logits(reference)
    assert not torch.allclose(rollout["before"], expected, atol=1e-3)  # negative control: adapters mattered
    assert torch.allclose(rollout["logits"], expected, rtol=0, atol=1e-6)
    for name, tensor in trainer_weights(reference):  # merged base-name weights, as a vLLM engine would get
        assert torch.allclose(rollout["merged"][name], tensor, rtol=0, atol=1e-6), name


# --------------------------------------------------------------------------- collective: FSDP2 trainer ranks
def _fsdp_rank(rank: int, sync_port: int, default_port: int):
    """Ranks 0 and 1: FSDP2 trainer ranks on their own default gloo group; rank 2: the rollout worker."""
    import torch.distributed as dist

    from posttrain.distributed.fsdp import build_mesh, init_distributed, shard_model

    model = tiny_llama(seed=0 if rank < 2 else 1)
    if rank < 2:
        os.environ.update(RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(default_port))
        init_distributed("gloo", timeout_s=TIMEOUT_S)
        shard_model(model, build_mesh("cpu", 2), {})
    group = None
    if rank in (0, 2):
        group = WeightSyncGroup.create("127.0.0.1", sync_port, min(rank, 1), 2, "gloo", timeout_s=TIMEOUT_S)
    if rank < 2:
        result = push_trainer_weights(group, model, 1, bucket_bytes=8 << 10)
        dist.destroy_process_group()
    else:
        result = {"version": receive_into(group, model), "state": state(model)}
    if group is not None:
        group.close()
    return result


def test_fsdp2_trainer_ranks_all_gather_and_rank0_sends():
    ranks = run_ranks(_fsdp_rank, 3, free_port(), free_port())
    assert not any("error" in r for r in ranks), ranks
    assert ranks[1] == {} and ranks[0]["weight_sync/version"] == 1
    reference = state(tiny_llama(0))
    assert ranks[2]["version"] == 1 and set(ranks[2]["state"]) == set(reference)
    for name, tensor in reference.items():
        assert torch.equal(ranks[2]["state"][name], tensor), name


# --------------------------------------------------------------------------- collective: errors
def _mismatch_rank(rank: int, port: int):
    group = WeightSyncGroup.create("127.0.0.1", port, rank, 3, "gloo", timeout_s=TIMEOUT_S)
    model = tiny_llama(seed=0 if rank == 0 else 1)
    outcome = []
    bad = "model.layers.1.mlp.up_proj.weights"
    for attempt in ("renamed", "dropped", "good"):
        named = trainer_weights(model)
        if attempt == "renamed":
            named = ((bad if n == "model.layers.1.mlp.up_proj.weight" else n, t) for n, t in named)
        elif attempt == "dropped":  # a whole bucket never sent
            named = ((n, t) for n, t in named if not n.startswith("model.layers.0.self_attn"))
        try:
            if rank == 0:
                group.send(named, 7, bucket_bytes=4 << 10)
            else:
                receive_into(group, model)
            outcome.append("ok")
        except WeightSyncError as err:
            outcome.append(str(err))
    group.close()
    return {"outcome": outcome, "state": state(model)}


def test_name_mismatch_and_dropped_bucket_fail_on_both_sides_and_the_group_survives():
    ranks = run_ranks(_mismatch_rank, 3, free_port())
    trainer = ranks[0]["outcome"]
    assert "rank 1:" in trainer[0] and "rank 2:" in trainer[0] and "model.layers.1.mlp.up_proj.weights" in trainer[0]
    for rank in (1, 2):
        renamed, dropped, good = ranks[rank]["outcome"]
        assert "'model.layers.1.mlp.up_proj.weights'" in renamed and "is not a parameter" in renamed
        assert "never arrived" in dropped and "model.layers.0.self_attn" in dropped
        assert good == "ok"
    assert "never arrived" in trainer[1] and trainer[2] == "ok"
    reference = state(tiny_llama(0))
    for name, tensor in reference.items():  # after the good attempt the rollout copies are right
        assert torch.equal(ranks[1]["state"][name], tensor), name


def test_rank_that_never_joins_fails_within_timeout_naming_the_address():
    port = free_port()
    with pytest.raises(WeightSyncError) as trainer_side:
        WeightSyncGroup.create("127.0.0.1", port, 0, 3, "gloo", timeout_s=1.0)
    message = str(trainer_side.value)
    assert f"127.0.0.1:{port}" in message and "gloo" in message
    assert "1 of 3 ranks joined" in message and "missing [1, 2]" in message
    with pytest.raises(WeightSyncError) as worker_side:  # nobody serves the store
        WeightSyncGroup.create("127.0.0.1", free_port(), 2, 3, "gloo", timeout_s=1.0)
    assert "could not reach the rendezvous store at 127.0.0.1:" in str(worker_side.value)
    assert "0 of 3 ranks joined" in str(worker_side.value)


def test_bad_arguments_are_refused():
    with pytest.raises(WeightSyncError, match="valid backends are 'gloo'"):
        WeightSyncGroup.create("127.0.0.1", free_port(), 0, 2, "mpi", timeout_s=1.0)
    with pytest.raises(WeightSyncError, match="at least one rollout worker"):
        WeightSyncGroup.create("127.0.0.1", free_port(), 0, 1, "gloo", timeout_s=1.0)
    with pytest.raises(WeightSyncError, match="no LoRA adapters"):
        next(trainer_weights(tiny_llama(0), lora_only=True))


# --------------------------------------------------------------------------- load_weights on its own
def test_load_weights_names_the_first_unknown_missing_or_misshapen_tensor():
    source = dict(trainer_weights(tiny_llama(0)))
    target = tiny_llama(1)
    missing = {k: v for k, v in source.items() if k != "model.norm.weight"}
    with pytest.raises(WeightSyncError, match=r"'model.norm.weight' \(shape \[32\]\) never arrived \(1 of"):
        load_weights(target, missing.items())
    with pytest.raises(WeightSyncError, match=r"'model.norm.weight' arrived with shape \[31\], .* holds \[32\]"):
        load_weights(target, {**source, "model.norm.weight": torch.ones(31)}.items())
    with pytest.raises(WeightSyncError, match="'extra.weight' .* is not a parameter or buffer"):
        load_weights(target, {**source, "extra.weight": torch.ones(1)}.items())
    lora_target = lora_model(0, adapter_seed=1, trained=False)
    with pytest.raises(WeightSyncError, match="carries LoRA adapters"):
        load_weights(lora_target, source.items())
    with pytest.raises(WeightSyncError, match=r"stage_weights: 'model.norm.weight' \(shape \[32\]\) never arrived"):
        stage_weights(target, missing.items())
    target = tiny_llama(1)  # the failed loads above copied what came before their error
    staged = stage_weights(target, source.items())
    assert not torch.equal(target.model.norm.weight, source["model.norm.weight"])  # staging copies nothing in
    assert load_weights(target, staged.items()) == len(source)
    assert torch.equal(target.model.norm.weight, source["model.norm.weight"])


# --------------------------------------------------------------------------- files
def test_file_weight_sync_round_trip_versions_and_clean_up(tmp_path):
    sender, receiver = FileWeightSync(tmp_path / "w", keep=2), FileWeightSync(tmp_path / "w")
    got: dict = {}
    done: list = []
    waiter = threading.Thread(target=lambda: done.append(receiver.receive(
        lambda named: got.update((n, t.clone()) for n, t in named), timeout_s=TIMEOUT_S)))
    waiter.start()  # waits for a version that does not exist yet
    metrics = sender.send(iter(mixed_tensors(1)), 1, bucket_bytes=1024)
    waiter.join(TIMEOUT_S)
    assert done == [1] and metrics["weight_sync/version"] == 1 and metrics["weight_sync/buckets"] > 1
    sent = dict(mixed_tensors(1))
    assert set(got) == set(sent)
    for name, tensor in sent.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    for version in (2, 3, 4):
        sender.send(iter(mixed_tensors(version)), version)
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == ["v00000003", "v00000004", "version"]
    got.clear()
    assert receiver.receive(lambda named: got.update(named)) == 4  # the newest, skipping 2 and 3
    assert torch.equal(got["big"], dict(mixed_tensors(4))["big"])
    with pytest.raises(WeightSyncError, match="no weight version newer than 4 within 0.2 s"):
        receiver.receive(lambda named: None, timeout_s=0.2)


def test_file_weight_sync_checks_files_against_the_manifest(tmp_path):
    sender = FileWeightSync(tmp_path)
    sender.send(iter(mixed_tensors(1)), 1)
    manifest_path = tmp_path / "v00000001" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tensors"][0][2] = [40, 31]  # layer.weight is [40, 30] in the file
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(WeightSyncError, match=r"'layer.weight' has shape \[40, 30\], the manifest says \[40, 31\]"):
        FileWeightSync(tmp_path).receive(lambda named: list(named), timeout_s=1.0)


def test_file_weight_sync_into_a_model_with_lora_adapters(tmp_path):
    trainer = lora_model(0, adapter_seed=3, trained=True)
    rollout = lora_model(0, adapter_seed=4, trained=False)
    metrics = push_trainer_weights(FileWeightSync(tmp_path), trainer, 1, lora_only=True)
    assert metrics["weight_sync/tensors"] == sum(".lora_" in n for n, _ in trainer.named_parameters())
    assert not torch.allclose(logits(rollout), logits(trainer), atol=1e-3)  # negative control
    assert receive_into(FileWeightSync(tmp_path), rollout, lora_only=True, timeout_s=1.0) == 1
    assert torch.allclose(logits(rollout), logits(trainer), rtol=0, atol=1e-6)
