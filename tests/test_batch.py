"""Batch: construction, indexing, sub-batches, concat/repeat/union, errors naming keys and lengths."""

import numpy as np
import pytest
import torch

from posttrain.batch import Batch, DataProto, pad_to_divisor, to_object_array, unpad


def make(n=4):
    # rows r: ids = [10r, 10r+1], score = r/2, uid = "u<r>"
    ids = torch.tensor([[10 * r, 10 * r + 1] for r in range(n)])
    return Batch.from_dict(
        tensors={"input_ids": ids, "score": torch.arange(n, dtype=torch.float32) / 2},
        non_tensors={
            "uid": [f"u{r}" for r in range(n)],
            "reward_model": [{"ground_truth": str(r)} for r in range(n)],
        },
        meta_info={"temperature": 1.0},
    )


def test_from_dict_and_access():
    b = make()
    assert DataProto is Batch
    assert len(b) == 4
    assert b.batch.batch_size == torch.Size([4])
    assert b["input_ids"].tolist() == [[0, 1], [10, 11], [20, 21], [30, 31]]
    assert b["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    assert b["reward_model"][2] == {"ground_truth": "2"}
    assert b.keys() == ["input_ids", "score", "uid", "reward_model"]
    assert "uid" in b and "nope" not in b
    with pytest.raises(KeyError, match="'nope'"):
        b["nope"]


def test_list_of_lists_stays_one_dimensional():
    msgs = [[{"role": "user", "content": "a"}], [{"role": "user", "content": "b"}]]
    b = Batch.from_dict(non_tensors={"raw_prompt": msgs})
    assert b["raw_prompt"].shape == (2,)
    assert b["raw_prompt"][1] == [{"role": "user", "content": "b"}]
    assert len(b) == 2
    assert to_object_array([[1, 2], [3, 4]]).shape == (2,)


def test_inconsistent_lengths_name_keys():
    with pytest.raises(ValueError, match=r"tensor 'a' has 3, non-tensor 'uid' has 2"):
        Batch.from_dict({"a": torch.zeros(3)}, {"uid": ["x", "y"]})
    with pytest.raises(ValueError, match=r"tensor 'a' has 3, tensor 'b' has 2"):
        Batch.from_dict({"a": torch.zeros(3), "b": torch.zeros(2, 5)})
    b = make()
    with pytest.raises(ValueError, match=r"'advantages' of shape \[3, 2\]: the batch has 4 rows"):
        b["advantages"] = torch.zeros(3, 2)
    with pytest.raises(ValueError, match=r"non-tensor 'x' of length 5: the batch has 4 rows"):
        b["x"] = list(range(5))


def test_setitem():
    b = make()
    b["advantages"] = torch.ones(4, 2)
    b["acc"] = np.array([1.0, 0.0, 1.0, 1.0])
    assert b["advantages"].sum().item() == 8.0
    assert b["acc"].dtype == np.float64 and b["acc"].tolist() == [1.0, 0.0, 1.0, 1.0]
    with pytest.raises(ValueError, match="'uid' already holds a non-tensor"):
        b["uid"] = torch.zeros(4)


def test_select_pop():
    b = make()
    s = b.select(batch_keys=["score"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert s.keys() == ["score", "uid"] and s.meta_info == {}
    assert s["score"].tolist() == [0.0, 0.5, 1.0, 1.5]
    with pytest.raises(KeyError, match=r"missing tensor key\(s\) \['bogus'\]"):
        b.select(batch_keys=["bogus"])
    p = b.pop(batch_keys=["score"], non_tensor_batch_keys=["reward_model"], meta_info_keys=["temperature"])
    assert p.keys() == ["score", "reward_model"] and p.meta_info == {"temperature": 1.0}
    assert b.keys() == ["input_ids", "uid"] and b.meta_info == {}
    assert len(p) == 4


def test_slice_index_reorder():
    b = make()
    s = b[1:3]
    assert s["input_ids"][:, 0].tolist() == [10, 20] and s["uid"].tolist() == ["u1", "u2"]
    assert b.slice(0, 4, 2)["uid"].tolist() == ["u0", "u2"]
    sel = b.index_select(torch.tensor([3, 0]))
    assert sel["score"].tolist() == [1.5, 0.0] and sel["uid"].tolist() == ["u3", "u0"]
    mask = b.index_select(np.array([True, False, False, True]))
    assert mask["uid"].tolist() == ["u0", "u3"]
    assert b[[2]]["uid"].tolist() == ["u2"]
    row = b[2]
    assert row.batch["input_ids"].tolist() == [20, 21] and row.non_tensor_batch["uid"] == "u2"
    b.reorder(torch.tensor([3, 2, 1, 0]))  # in place
    assert b["uid"].tolist() == ["u3", "u2", "u1", "u0"]
    assert b["input_ids"][:, 0].tolist() == [30, 20, 10, 0]
    with pytest.raises(IndexError, match="out of range for a batch of 4 rows"):
        b.index_select([4])


def test_chunk_concat():
    b = make()
    parts = b.chunk(2)
    assert [p["uid"].tolist() for p in parts] == [["u0", "u1"], ["u2", "u3"]]
    assert parts[1].meta_info == {"temperature": 1.0}
    with pytest.raises(ValueError, match="4 rows into 3 equal parts"):
        b.chunk(3)
    back = Batch.concat(parts)
    assert back["input_ids"].tolist() == b["input_ids"].tolist()
    assert back["uid"].tolist() == ["u0", "u1", "u2", "u3"]
    assert [len(p) for p in b.split(3)] == [3, 1]
    # metrics are merged as verl's DataProto.concat merges them (a dict of lists, batches without
    # metrics skipped, list-valued metrics flattened), other meta keys must agree
    parts[0].meta_info["metrics"] = {"a": 1, "loss": 0.5}
    parts[1].meta_info["metrics"] = [{"a": 2, "loss": 0.25}]
    merged = Batch.concat(parts).meta_info["metrics"]
    assert merged == {"a": [1, 2], "loss": [0.5, 0.25]} and merged["loss"] == [0.5, 0.25]
    del parts[1].meta_info["metrics"]
    assert Batch.concat(parts).meta_info["metrics"] == {"a": [1], "loss": [0.5]}
    parts[1].meta_info = {"temperature": 0.5}
    with pytest.raises(ValueError, match="'temperature' differs"):
        Batch.concat(parts)
    with pytest.raises(ValueError, match="batch 1 has keys"):
        Batch.concat([b.select(batch_keys=["score"]), b])


def test_repeat_keeps_uid():
    b = make(2)
    r = b.repeat(3, interleave=True)
    assert r["uid"].tolist() == ["u0", "u0", "u0", "u1", "u1", "u1"]
    assert r["input_ids"][:, 0].tolist() == [0, 0, 0, 10, 10, 10]
    t = b.repeat(2, interleave=False)
    assert t["uid"].tolist() == ["u0", "u1", "u0", "u1"]
    assert t["score"].tolist() == [0.0, 0.5, 0.0, 0.5]
    # repeated dicts are the same objects per row, as in verl
    assert r["reward_model"][0] == {"ground_truth": "0"}


def test_union():
    b = make()
    other = Batch.from_dict(
        {"score": torch.arange(4, dtype=torch.float32) / 2, "values": torch.full((4, 2), 7.0)},
        {"uid": ["u0", "u1", "u2", "u3"], "acc": [1, 0, 1, 0]},
        {"step": 3},
    )
    out = b.union(other)
    assert out is b
    assert b["values"][0].tolist() == [7.0, 7.0] and b["acc"].tolist() == [1, 0, 1, 0]
    assert b.meta_info == {"temperature": 1.0, "step": 3}
    bad = Batch.from_dict({"score": torch.zeros(4)})
    with pytest.raises(ValueError, match="tensor key 'score' holds different values"):
        make().union(bad)
    bad_nt = Batch.from_dict(non_tensors={"uid": ["u0", "u1", "u2", "X"]})
    with pytest.raises(ValueError, match="non-tensor key 'uid' holds different values"):
        make().union(bad_nt)
    with pytest.raises(ValueError, match="4 and 2 rows"):
        make().union(make(2))


def test_to_and_empty():
    b = make().to("cpu")
    assert b["input_ids"].device.type == "cpu"
    e = Batch.from_dict(non_tensors={"uid": ["a", "b", "c"]})
    assert len(e) == 3 and list(e.batch.keys()) == []
    assert len(Batch()) == 0


def test_pad_to_divisor():
    b = make(5)
    padded, pad = pad_to_divisor(b, 4)
    assert pad == 3 and len(padded) == 8
    assert padded["uid"].tolist() == ["u0", "u1", "u2", "u3", "u4", "u0", "u1", "u2"]
    assert [len(c) for c in padded.chunk(4)] == [2, 2, 2, 2]
    assert unpad(padded, pad)["uid"].tolist() == b["uid"].tolist()
    same, zero = pad_to_divisor(b, 5)
    assert zero == 0 and same is b
    assert pad_to_divisor(make(1), 3)[0]["uid"].tolist() == ["u0", "u0", "u0"]
