"""DCP checkpoints (posttrain/checkpoint/dcp.py): resharding 2 ranks <-> 1 plain module, HF export,
and loads that refuse to execute code planted in a checkpoint."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from posttrain.config.actor_rollout_ref import OptimConfig
from helpers.tokenizer import build_tiny_tokenizer
from posttrain.checkpoint.dcp import (SafeFileSystemReader, UnsafeCheckpointError, full_state_dict_for_export,
                                       load_sharded, save_sharded)
from posttrain.distributed.fsdp import build_mesh, run_local_ranks, shard_model
from posttrain.optim.build import build_optimizer
from helpers.tiny_models import tiny_llama, tiny_worker_configs

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01)


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone()


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, scale: float) -> None:
    """A deterministic optimizer step (gradients from the weights themselves): non-trivial Adam state."""
    for p in model.parameters():
        p.grad = p.detach() * scale + 0.01
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def role_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Full parameters and AdamW state by parameter name (collective for sharded models)."""
    out = {f"param/{n}": full(p) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        for key, value in optimizer.state[p].items():
            out[f"optim/{n}/{key}"] = full(value)
    return out


def new_role(tok, seed: int, world: int | None):
    model = tiny_llama(tok, seed=seed)
    if world is not None:
        model = shard_model(model, build_mesh("cpu", world), tiny_worker_configs().actor.fsdp_config)
    return model, build_optimizer(model.parameters(), OPTIM)


def _dcp_job(rank: int, world: int, from_one: str, to_one: str) -> dict:
    tok = build_tiny_tokenizer()
    model, optimizer = new_role(tok, seed=5, world=world)  # different weights: the load must overwrite them
    extra = load_sharded(from_one, model, optimizer, extra={"meta": {"step": 0, "lr": 0.0}})
    out = {"loaded": role_state(model, optimizer), "extra": extra}
    model, optimizer = new_role(tok, seed=1, world=world)
    train_step(model, optimizer, 0.1)
    train_step(model, optimizer, -0.2)
    save_sharded(to_one, model, optimizer, extra={"meta": {"step": 2, "lr": 0.25}})
    out["saved"] = role_state(model, optimizer)
    out["export"] = full_state_dict_for_export(model)
    out["files"] = sorted(os.listdir(to_one)) if rank == 0 else []
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def tok():
    return build_tiny_tokenizer()


@pytest.fixture(scope="module")
def resharded(tok, tmp_path_factory):
    """1 process saves; 2 ranks load it, then save their own; returns (one-process state, ranks' outputs, dir)."""
    root = tmp_path_factory.mktemp("dcp")
    model, optimizer = new_role(tok, seed=3, world=None)
    train_step(model, optimizer, 0.3)
    save_sharded(root / "from_one", model, optimizer, extra={"meta": {"step": 1, "lr": 0.5}})
    ranks = run_local_ranks(_dcp_job, 2, str(root / "from_one"), str(root / "to_one"), timeout_s=120)
    return role_state(model, optimizer), ranks, root


def assert_equal_states(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def test_one_process_to_two_ranks(resharded):
    one, ranks, _ = resharded
    for r in ranks:
        assert_equal_states(r["loaded"], one)
        assert r["extra"] == {"meta": {"step": 1, "lr": 0.5}}


def test_two_ranks_to_one_plain_module(resharded, tok):
    _, ranks, root = resharded
    assert ranks[0]["saved"].keys() == ranks[1]["saved"].keys()
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= set(ranks[0]["files"])  # each rank wrote its part
    model, optimizer = new_role(tok, seed=7, world=None)  # plain nn.Module, no process group
    extra = load_sharded(root / "to_one", model, optimizer, extra={"meta": {"step": 0, "lr": 0.0}})
    assert_equal_states(role_state(model, optimizer), ranks[0]["saved"])
    assert extra == {"meta": {"step": 2, "lr": 0.25}}


def test_export_gathers_full_weights_on_rank_zero(resharded):
    _, ranks, _ = resharded
    export, saved = ranks[0]["export"], ranks[0]["saved"]
    assert export.keys() == {k.removeprefix("param/") for k in saved if k.startswith("param/")}
    for name, tensor in export.items():
        assert tensor.device.type == "cpu" and torch.equal(tensor, saved[f"param/{name}"])
    assert ranks[1]["export"] == {}


# --------------------------------------------------------------------------- malicious checkpoints
class _Planted:
    """Unpickling this runs ``os.system``: what a crafted checkpoint would do."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _plain_checkpoint(tok, path) -> None:
    model, optimizer = new_role(tok, seed=0, world=None)
    train_step(model, optimizer, 0.1)
    save_sharded(path, model, optimizer, extra={"meta": {"step": 1, "lr": 0.5}})


def test_planted_pickle_in_metadata_is_refused(tok, tmp_path):
    marker = tmp_path / "pwned"
    _plain_checkpoint(tok, tmp_path / "ckpt")
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    model, optimizer = new_role(tok, seed=0, world=None)
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata.*refusing to unpickle (posix|os|nt)\.system"):
        load_sharded(tmp_path / "ckpt", model, optimizer)
    assert not marker.exists()


def test_planted_object_inside_valid_metadata_is_refused(tok, tmp_path):
    marker = tmp_path / "pwned"
    _plain_checkpoint(tok, tmp_path / "ckpt")
    metadata = SafeFileSystemReader(tmp_path / "ckpt").read_metadata()
    metadata.planner_data = {"x": _Planted(marker)}  # a real Metadata object carrying a payload
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(metadata))
    with pytest.raises(UnsafeCheckpointError, match="refusing to unpickle"):
        SafeFileSystemReader(tmp_path / "ckpt").read_metadata()
    assert not marker.exists()


def test_planted_pickle_in_a_non_tensor_entry_is_refused(tok, tmp_path):
    """Non-tensor entries (here ``extra.meta.lr``) are stored as torch.save bytes; DCP's default
    planner would load them with weights_only=False."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    _plain_checkpoint(tok, ckpt)
    metadata = SafeFileSystemReader(ckpt).read_metadata()
    index = next(i for i in metadata.storage_data if i.fqn == "extra.meta.lr")
    info = metadata.storage_data[index]
    data_file = ckpt / info.relative_path
    payload_path = tmp_path / "payload.pt"
    torch.save(_Planted(marker), payload_path)
    payload = payload_path.read_bytes()
    info.offset, info.length = data_file.stat().st_size, len(payload)
    with open(data_file, "ab") as f:
        f.write(payload)
    (ckpt / ".metadata").write_bytes(pickle.dumps(metadata))
    model, optimizer = new_role(tok, seed=0, world=None)
    with pytest.raises(UnsafeCheckpointError, match=r"entry .extra.meta.lr. is not plain data"):
        load_sharded(ckpt, model, optimizer, extra={"meta": {"step": 0, "lr": 0.0}})
    assert not marker.exists()
