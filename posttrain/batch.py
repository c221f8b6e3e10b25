"""The batch object that travels between training stages (verl's ``DataProto`` in spirit).

A :class:`Batch` holds ``N`` rows in three parts:

- ``batch``: a :class:`tensordict.TensorDict` with ``batch_size == [N]``; every tensor's first
  dimension is the row.
- ``non_tensor_batch``: ``dict[str, np.ndarray]``, each array of length ``N`` (dtype ``object``
  for strings, dicts and lists; any dtype is allowed).
- ``meta_info``: a plain ``dict`` of per-batch values (temperature, metrics, ...), not per row.

Standard keys (``P`` = prompt length, ``R`` = response length, both padded):

=====================  ==============  ======================================================
key                    shape / type    meaning
=====================  ==============  ======================================================
input_ids              [N, P+R] long   prompt (left-padded) followed by response (right-padded)
attention_mask         [N, P+R] long   1 on real tokens
position_ids           [N, P+R] long   cumsum(attention_mask) - 1, clipped at 0
prompts                [N, P] long     the prompt part of ``input_ids``
responses              [N, R] long     the generated tokens
response_mask          [N, R]          1 on valid response tokens (float or long)
rollout_log_probs      [N, R] float    log-probs reported by the rollout engine
old_log_probs          [N, R] float    log-probs of the policy that generated the responses
ref_log_prob           [N, R] float    log-probs of the reference policy
values                 [N, R] float    critic values (GAE only)
token_level_scores     [N, R] float    reward score, placed on the last valid response token
token_level_rewards    [N, R] float    scores minus in-reward KL penalty (if any)
advantages             [N, R] float
returns                [N, R] float
---------------------  --------------  ------------------------------------------------------
data_source            [N] object str  selects the scorer (``default_compute_score``)
reward_model           [N] object      dict with ``ground_truth`` (and ``style``)
extra_info             [N] object      dict (split, index, ...)
uid                    [N] object str  prompt id; the ``n`` responses of a prompt share it
raw_prompt             [N] object      list of ``{"role", "content"}`` messages
index                  [N] object      row index from ``extra_info["index"]``
=====================  ==============  ======================================================

Differences from verl: ``b["key"]`` reads a tensor or an array directly, ``b["key"] = value``
stores one with a length check, and every inconsistency raises ``ValueError``/``KeyError`` naming
the key and the lengths instead of a bare ``assert``.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from tensordict import TensorDict

__all__ = ["Batch", "BatchItem", "DataProto", "to_object_array", "pad_to_divisor", "response_mask_of", "unpad"]


def response_mask_of(batch: Any) -> torch.Tensor:
    """``response_mask`` ``[N, R]`` of a `Batch` or a dict of tensors, or the response part of
    ``attention_mask`` when it is absent."""
    if "response_mask" in batch:
        return batch["response_mask"]
    if "attention_mask" in batch and "responses" in batch:
        return batch["attention_mask"][:, -batch["responses"].shape[1] :]
    raise KeyError(f"the batch needs 'response_mask' (or 'attention_mask' and 'responses'); keys: {list(batch.keys())}")


def to_object_array(values: Iterable[Any]) -> np.ndarray:
    """A 1-D ``object`` array with one element per item, even when items are lists or dicts.

    ``np.array(list_of_lists, dtype=object)`` would build a 2-D array; this never does.
    """
    values = list(values)
    out = np.empty(len(values), dtype=object)
    for i, v in enumerate(values):
        out[i] = v
    return out


def _as_row_array(key: str, value: Any) -> np.ndarray:
    if isinstance(value, np.ndarray):
        if value.ndim == 0:
            raise ValueError(f"non-tensor key {key!r}: expected an array of rows, got a 0-d array")
        return value
    if isinstance(value, (list, tuple)):
        return to_object_array(value)
    raise TypeError(f"non-tensor key {key!r}: expected np.ndarray, list or tuple, got {type(value).__name__}")


def _values_equal(a: Any, b: Any) -> bool:
    """Deep equality for meta_info / object-array elements (NaN equals NaN, arrays compared by value)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and bool(
            torch.equal(a, b)
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)) or a.shape != b.shape:
            return False
        if a.dtype != object and b.dtype != object:
            return bool(np.array_equal(a, b, equal_nan=a.dtype.kind == "f" and b.dtype.kind == "f"))
        return all(_values_equal(x, y) for x, y in zip(a.flat, b.flat))
    if isinstance(a, float) and isinstance(b, float) and a != a and b != b:
        return True
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_values_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_values_equal(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (ValueError, TypeError):
        return False


def _merge_meta(target: dict, other: dict, where: str) -> dict:
    for key, val in other.items():
        if key in target and not _values_equal(target[key], val):
            raise ValueError(f"{where}: meta_info key {key!r} differs ({target[key]!r} vs {val!r})")
        target[key] = val
    return target


@dataclass
class BatchItem:
    """One row of a :class:`Batch` (what ``batch[i]`` returns, like verl's ``DataProtoItem``)."""

    batch: TensorDict
    non_tensor_batch: dict[str, Any]
    meta_info: dict = field(default_factory=dict)


class Batch:
    """``N`` rows of tensors and per-row arrays plus batch-level ``meta_info``; see the module docstring."""

    def __init__(
        self,
        batch: TensorDict | None = None,
        non_tensor_batch: dict[str, np.ndarray] | None = None,
        meta_info: dict | None = None,
    ):
        non_tensor_batch = {k: _as_row_array(k, v) for k, v in (non_tensor_batch or {}).items()}
        if batch is None:
            n = len(next(iter(non_tensor_batch.values()))) if non_tensor_batch else 0
            batch = TensorDict({}, batch_size=[n])
        self.batch: TensorDict = batch
        self.non_tensor_batch: dict[str, np.ndarray] = non_tensor_batch
        self.meta_info: dict = dict(meta_info or {})
        self.check_consistency()

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(
        cls,
        tensors: dict[str, torch.Tensor] | None = None,
        non_tensors: dict[str, Any] | None = None,
        meta_info: dict | None = None,
    ) -> "Batch":
        """Build from ``{key: tensor [N, ...]}`` and ``{key: array or list of length N}``."""
        tensors = dict(tensors or {})
        non_tensors = {k: _as_row_array(k, v) for k, v in (non_tensors or {}).items()}
        for k, v in tensors.items():
            if not isinstance(v, torch.Tensor):
                raise TypeError(f"tensor key {k!r}: expected torch.Tensor, got {type(v).__name__}")
            if v.dim() == 0:
                raise ValueError(f"tensor key {k!r} is a scalar; every tensor needs a row dimension [N, ...]")
        lengths = {f"tensor {k!r}": int(v.shape[0]) for k, v in tensors.items()}
        lengths.update({f"non-tensor {k!r}": len(v) for k, v in non_tensors.items()})
        if len(set(lengths.values())) > 1:
            raise ValueError(f"inconsistent lengths: {_describe(lengths)}")
        n = next(iter(lengths.values())) if lengths else 0
        td = TensorDict(tensors, batch_size=[n])
        return cls(batch=td, non_tensor_batch=non_tensors, meta_info=meta_info)

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> "Batch":
        """Split one dict by value type: tensors go to ``batch``, everything else to ``non_tensor_batch``."""
        tensors = {k: v for k, v in data.items() if isinstance(v, torch.Tensor)}
        non_tensors = {k: v for k, v in data.items() if not isinstance(v, torch.Tensor)}
        return cls.from_dict(tensors, non_tensors, meta_info)

    def check_consistency(self) -> None:
        """Raise ``ValueError`` naming the key when a part's length differs from the batch's."""
        if not isinstance(self.batch, TensorDict):
            raise TypeError(f"Batch.batch must be a TensorDict, got {type(self.batch).__name__}")
        if len(self.batch.batch_size) != 1:
            raise ValueError(f"Batch.batch must have one batch dimension, got batch_size={list(self.batch.batch_size)}")
        n = self.batch.batch_size[0]
        for key, val in self.non_tensor_batch.items():
            if len(val) != n:
                raise ValueError(f"non-tensor key {key!r} has length {len(val)}, but the batch has {n} rows")
        clash = set(self.batch.keys()) & set(self.non_tensor_batch)
        if clash:
            raise ValueError(f"keys {sorted(clash)} are both tensor and non-tensor keys")

    # ------------------------------------------------------------------ access
    def __len__(self) -> int:
        return int(self.batch.batch_size[0])

    def keys(self) -> list[str]:
        """Tensor keys, then non-tensor keys."""
        return list(self.batch.keys()) + list(self.non_tensor_batch.keys())

    def __contains__(self, key: str) -> bool:
        return key in self.non_tensor_batch or key in self.batch.keys()

    def __getitem__(self, item):
        if isinstance(item, str):
            if item in self.non_tensor_batch:
                return self.non_tensor_batch[item]
            if item in self.batch.keys():
                return self.batch[item]
            raise KeyError(f"no key {item!r} in batch; keys: {self.keys()}")
        if isinstance(item, slice):
            return self.slice(item.start, item.stop, item.step)
        if isinstance(item, (int, np.integer)):
            n = len(self)
            if not -n <= item < n:
                raise IndexError(f"row {item} out of range for a batch of {n} rows")
            return BatchItem(
                batch=self.batch[int(item)],
                non_tensor_batch={k: v[item] for k, v in self.non_tensor_batch.items()},
                meta_info=self.meta_info,
            )
        if isinstance(item, (list, np.ndarray, torch.Tensor)):
            return self.index_select(item)
        raise TypeError(f"cannot index a Batch with {type(item).__name__}")

    def __setitem__(self, key: str, value: Any) -> None:
        """Store a tensor (into ``batch``) or an array/list (into ``non_tensor_batch``) of ``len(self)`` rows."""
        if isinstance(value, torch.Tensor):
            if value.dim() == 0 or value.shape[0] != len(self):
                shape = list(value.shape)
                raise ValueError(f"cannot set tensor {key!r} of shape {shape}: the batch has {len(self)} rows")
            if key in self.non_tensor_batch:
                raise ValueError(f"key {key!r} already holds a non-tensor array; pop it first")
            self.batch[key] = value
        else:
            arr = _as_row_array(key, value)
            if len(arr) != len(self):
                raise ValueError(f"cannot set non-tensor {key!r} of length {len(arr)}: the batch has {len(self)} rows")
            if key in self.batch.keys():
                raise ValueError(f"key {key!r} already holds a tensor; pop it first")
            self.non_tensor_batch[key] = arr

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {list(v.shape)} {str(v.dtype)[6:]}" for k, v in self.batch.items())
        arrays = ", ".join(f"{k}: {v.dtype}" for k, v in self.non_tensor_batch.items())
        meta = list(self.meta_info)
        return f"Batch(len={len(self)}, tensors={{{tensors}}}, non_tensors={{{arrays}}}, meta_info={meta})"

    # ------------------------------------------------------------------ sub-batches
    def select(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
        deepcopy: bool = False,
    ) -> "Batch":
        """A new Batch with only the named keys (``None`` keeps all of that part)."""
        td = self.batch
        if batch_keys is not None:
            _require(batch_keys, list(self.batch.keys()), "tensor")
            td = self.batch.select(*batch_keys)
        nt = self.non_tensor_batch
        if non_tensor_batch_keys is not None:
            _require(non_tensor_batch_keys, list(nt), "non-tensor")
            nt = {k: nt[k] for k in non_tensor_batch_keys}
        meta = self.meta_info
        if meta_info_keys is not None:
            _require(meta_info_keys, list(meta), "meta_info")
            meta = {k: meta[k] for k in meta_info_keys}
        if deepcopy:
            nt, meta = copy.deepcopy(nt), copy.deepcopy(meta)
        return Batch(batch=td, non_tensor_batch=dict(nt), meta_info=meta)

    def slice(self, start: int | None = None, end: int | None = None, step: int | None = None) -> "Batch":
        """Rows ``start:end:step`` as a new Batch (tensors are views)."""
        s = slice(start, end, step)
        return Batch(
            batch=self.batch[s],
            non_tensor_batch={k: v[s] for k, v in self.non_tensor_batch.items()},
            meta_info=self.meta_info,
        )

    def index_select(self, idx) -> "Batch":
        """Rows at ``idx`` (int list/array/tensor, or a boolean mask of length N) as a new Batch."""
        idx_np = idx.detach().cpu().numpy() if isinstance(idx, torch.Tensor) else np.asarray(idx)
        if idx_np.dtype == bool:
            if idx_np.shape != (len(self),):
                raise ValueError(f"boolean mask of shape {idx_np.shape} does not match {len(self)} rows")
            idx_np = np.nonzero(idx_np)[0]
        idx_np = idx_np.astype(np.int64).reshape(-1)
        if idx_np.size and (idx_np.max() >= len(self) or idx_np.min() < -len(self)):
            raise IndexError(f"indices {idx_np.tolist()} out of range for a batch of {len(self)} rows")
        idx_t = torch.from_numpy(idx_np)
        td = TensorDict(
            {k: v[idx_t.to(v.device)] for k, v in self.batch.items()},
            batch_size=[len(idx_np)],
            device=self.batch.device,
        )
        return Batch(
            batch=td,
            non_tensor_batch={k: v[idx_np] for k, v in self.non_tensor_batch.items()},
            meta_info=self.meta_info,
        )

    def reorder(self, indices) -> None:
        """Permute rows in place: row ``i`` becomes old row ``indices[i]`` (like verl)."""
        if len(indices) != len(self):
            raise ValueError(f"reorder needs {len(self)} indices, got {len(indices)}")
        new = self.index_select(indices)
        self.batch, self.non_tensor_batch = new.batch, new.non_tensor_batch

    def chunk(self, chunks: int) -> list["Batch"]:
        """Split into ``chunks`` equal parts; ``len(self)`` must be divisible by ``chunks``."""
        if chunks <= 0 or len(self) % chunks != 0:
            raise ValueError(f"cannot chunk a batch of {len(self)} rows into {chunks} equal parts")
        size = len(self) // chunks
        return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

    def split(self, split_size: int) -> list["Batch"]:
        """Consecutive parts of ``split_size`` rows (the last may be shorter)."""
        if split_size <= 0:
            raise ValueError(f"split_size must be positive, got {split_size}")
        return [self.slice(i, i + split_size) for i in range(0, len(self), split_size)]

    @staticmethod
    def concat(batches: Sequence["Batch"]) -> "Batch":
        """Rows of all batches in order. Key sets must match; shared meta_info keys must agree, except
        ``metrics``, merged as verl's ``DataProto.concat`` merges them: each batch's metrics dict (or
        list of dicts) is collected, batches without metrics are skipped, and the result is a dict of
        lists, ``{"loss": [worker0, worker1, ...]}``."""
        if not batches:
            raise ValueError("Batch.concat needs at least one batch")
        first = batches[0]
        tkeys, nkeys = set(first.batch.keys()), set(first.non_tensor_batch)
        meta: dict = {}
        metrics: list = []
        for i, b in enumerate(batches):
            if set(b.batch.keys()) != tkeys or set(b.non_tensor_batch) != nkeys:
                raise ValueError(
                    f"Batch.concat: batch {i} has keys {sorted(b.keys())}, batch 0 has {sorted(first.keys())}"
                )
            for k, v in b.meta_info.items():
                if k == "metrics":
                    if v is not None:
                        metrics.extend(v if isinstance(v, list) else [v])
                else:
                    _merge_meta(meta, {k: v}, f"Batch.concat (batch {i})")
        if metrics:
            meta["metrics"] = _dict_of_lists(metrics)
        if tkeys:
            td = torch.cat([b.batch for b in batches], dim=0)
        else:
            td = TensorDict({}, batch_size=[sum(len(b) for b in batches)])
        nt = {k: np.concatenate([b.non_tensor_batch[k] for b in batches], axis=0) for k in first.non_tensor_batch}
        return Batch(batch=td, non_tensor_batch=nt, meta_info=meta)

    def repeat(self, repeat_times: int = 2, interleave: bool = True) -> "Batch":
        """Each row ``repeat_times`` times: ``interleave=True`` gives a a b b (the n responses of a prompt are
        adjacent and keep its ``uid``), ``False`` gives a b a b."""
        if repeat_times < 1:
            raise ValueError(f"repeat_times must be >= 1, got {repeat_times}")
        n = len(self)
        if interleave:
            order = np.repeat(np.arange(n), repeat_times)
        else:
            order = np.tile(np.arange(n), repeat_times)
        return self.index_select(order)

    def union(self, other: "Batch") -> "Batch":
        """Add ``other``'s keys to this batch in place and return it. A key present in both must hold
        equal values; otherwise ``ValueError`` names it."""
        if len(other) != len(self):
            raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
        for k, v in other.batch.items():
            if k in self.non_tensor_batch:
                raise ValueError(f"union: key {k!r} is a non-tensor here and a tensor in the other batch")
            if k in self.batch.keys():
                mine = self.batch[k]
                if mine.shape != v.shape or not torch.equal(mine, v.to(mine.device)):
                    raise ValueError(f"union: tensor key {k!r} holds different values in the two batches")
        for k, v in other.non_tensor_batch.items():
            if k in self.batch.keys():
                raise ValueError(f"union: key {k!r} is a tensor here and a non-tensor in the other batch")
            if k in self.non_tensor_batch and not _values_equal(self.non_tensor_batch[k], v):
                raise ValueError(f"union: non-tensor key {k!r} holds different values in the two batches")
        for k, v in other.batch.items():
            if k not in self.batch.keys():
                self.batch[k] = v
        for k, v in other.non_tensor_batch.items():
            self.non_tensor_batch.setdefault(k, v)
        _merge_meta(self.meta_info, other.meta_info, "union")
        return self

    def pop(
        self,
        batch_keys: Sequence[str] | None = None,
        non_tensor_batch_keys: Sequence[str] | None = None,
        meta_info_keys: Sequence[str] | None = None,
    ) -> "Batch":
        """Remove the named keys from this batch and return them as a new Batch of the same length."""
        _require(batch_keys or [], list(self.batch.keys()), "tensor")
        _require(non_tensor_batch_keys or [], list(self.non_tensor_batch), "non-tensor")
        _require(meta_info_keys or [], list(self.meta_info), "meta_info")
        td = TensorDict({k: self.batch.pop(k) for k in batch_keys or []}, batch_size=[len(self)])
        nt = {k: self.non_tensor_batch.pop(k) for k in non_tensor_batch_keys or []}
        meta = {k: self.meta_info.pop(k) for k in meta_info_keys or []}
        return Batch(batch=td, non_tensor_batch=nt, meta_info=meta)

    def rename(self, old_keys: Sequence[str], new_keys: Sequence[str]) -> "Batch":
        """Rename tensor keys in place."""
        if len(old_keys) != len(new_keys):
            raise ValueError(f"rename: {len(old_keys)} old keys but {len(new_keys)} new keys")
        _require(old_keys, list(self.batch.keys()), "tensor")
        for old, new in zip(old_keys, new_keys):
            self.batch.rename_key_(old, new)
        return self

    def to(self, device: str | torch.device) -> "Batch":
        """Move the tensors to ``device`` (in place) and return self."""
        self.batch = self.batch.to(device)
        return self


def pad_to_divisor(batch: Batch, divisor: int) -> tuple[Batch, int]:
    """``(padded, pad_size)``: rows from the start repeated at the end until ``len`` divides ``divisor``
    (so a batch splits evenly across workers); undo with :func:`unpad`."""
    if divisor <= 0:
        raise ValueError(f"divisor must be positive, got {divisor}")
    if len(batch) == 0:
        raise ValueError("cannot pad an empty batch")
    pad = -len(batch) % divisor
    if pad == 0:
        return batch, 0
    extra = batch.index_select(np.arange(pad) % len(batch))
    return Batch.concat([batch, extra]), pad


def unpad(batch: Batch, pad_size: int) -> Batch:
    """Drop the last ``pad_size`` rows added by :func:`pad_to_divisor`."""
    return batch.slice(0, len(batch) - pad_size) if pad_size else batch


def _require(keys: Iterable[str], available: list[str], kind: str) -> None:
    missing = [k for k in keys if k not in available]
    if missing:
        raise KeyError(f"missing {kind} key(s) {missing}; available: {available}")


def _describe(lengths: dict[str, int]) -> str:
    return ", ".join(f"{name} has {n}" for name, n in lengths.items())


DataProto = Batch


def _dict_of_lists(rows: list[dict]) -> dict[str, list]:
    """``[{"loss": 1}, {"loss": 2}]`` -> ``{"loss": [1, 2]}`` (verl's ``list_of_dict_to_dict_of_list``:
    the first dict's keys, each later dict may not add new ones)."""
    out: dict[str, list] = {key: [] for key in rows[0]}
    for i, row in enumerate(rows):
        for key, value in row.items():
            if key not in out:
                raise ValueError(f"Batch.concat: metrics {i} has key {key!r}, which metrics 0 does not have")
            out[key].append(value)
    return out
