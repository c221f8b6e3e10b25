"""A resumable, epoch-aware prompt loader.

``state_dict()`` is small JSON (epoch, position within the epoch, seed). It always describes the
*next* batch to produce: after the last batch of epoch 0 it reads ``epoch=1, position=0``, so a run
resumed from that checkpoint continues with epoch 1's first batch.

Epoch ``e``'s order is ``torch.randperm`` from a ``torch.Generator`` seeded by a function of
``(data.seed, e)``, so any epoch can be rebuilt without replaying earlier ones. With
``data.seed=None`` a seed is drawn once and kept in the state, so resuming still reproduces.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Iterator, Sequence

import torch

__all__ = ["StatefulSampler", "PromptLoader", "build_train_loader", "build_val_loader"]

_EPOCH_STRIDE = 1_000_003  # keeps (seed, epoch) pairs from colliding for small seeds


class StatefulSampler:
    """Yields lists of dataset indices, ``batch_size`` at a time, epoch after epoch.

    ``iter(sampler)`` runs through the rest of the current epoch; :meth:`next_indices` crosses
    epoch boundaries. ``drop_last=True`` (verl's train loader) drops the incomplete final batch.
    """

    def __init__(
        self, num_samples: int, batch_size: int, shuffle: bool = True, seed: int | None = None, drop_last: bool = True
    ):
        if batch_size <= 0:
            raise ValueError(f"batch_size must be positive, got {batch_size}")
        if num_samples <= 0:
            raise ValueError(f"cannot sample from an empty dataset (num_samples={num_samples})")
        if drop_last and num_samples < batch_size:
            raise ValueError(
                f"the dataset has {num_samples} prompts, fewer than one batch of {batch_size} "
                "(data.train_batch_size); lower the batch size or add data"
            )
        self.num_samples = num_samples
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.seed = int(seed) if seed is not None else random.SystemRandom().randrange(2**31)
        self.epoch = 0
        self.position = 0  # index of the next batch within the epoch
        self._perm_epoch: int | None = None
        self._perm: list[int] = []

    def __len__(self) -> int:
        """Batches per epoch."""
        if self.drop_last:
            return self.num_samples // self.batch_size
        return -(-self.num_samples // self.batch_size)

    def epoch_order(self, epoch: int) -> list[int]:
        """The dataset indices of ``epoch`` in sampling order."""
        if self._perm_epoch != epoch:
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed((self.seed * _EPOCH_STRIDE + epoch) % (2**63))
                self._perm = torch.randperm(self.num_samples, generator=g).tolist()
            else:
                self._perm = list(range(self.num_samples))
            self._perm_epoch = epoch
        return self._perm

    def next_indices(self) -> list[int]:
        """The next batch's indices; advances the state (rolling into the next epoch after the last batch)."""
        order = self.epoch_order(self.epoch)
        start = self.position * self.batch_size
        indices = order[start : start + self.batch_size]
        self.position += 1
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        return indices

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        while self.epoch == epoch:
            yield self.next_indices()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples,
            "batch_size": self.batch_size,
            "drop_last": self.drop_last,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key in ("num_samples", "batch_size", "drop_last", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the prompt loader: checkpoint has {key}={state[key]!r}, "
                    f"this run has {key}={getattr(self, key)!r}"
                )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._perm_epoch = None
        if not 0 <= self.position < len(self):
            raise ValueError(f"checkpoint position {self.position} is outside 0..{len(self) - 1}")


class PromptLoader:
    """Batches of prompts from a dataset: ``for batch in loader`` runs the rest of the current epoch.

    Args:
        dataset: indexable, ``len()``-able (e.g. :class:`RLHFDataset`).
        batch_size: prompts per batch (``data.train_batch_size``).
        collate_fn: list of items -> batch (defaults to ``dataset.collate_fn``).
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = True,
        collate_fn: Callable[[Sequence[Any]], Any] | None = None,
    ):
        self.dataset = dataset
        self.sampler = StatefulSampler(len(dataset), batch_size, shuffle=shuffle, seed=seed, drop_last=drop_last)
        self.collate_fn = collate_fn if collate_fn is not None else dataset.collate_fn

    @property
    def epoch(self) -> int:
        """The epoch of the next batch."""
        return self.sampler.epoch

    def __len__(self) -> int:
        return len(self.sampler)

    def next_batch(self):
        """The next batch, crossing epoch boundaries (for step-counted loops)."""
        return self.collate_fn([self.dataset[i] for i in self.sampler.next_indices()])

    def __iter__(self):
        for indices in self.sampler:
            yield self.collate_fn([self.dataset[i] for i in indices])

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)


def build_train_loader(dataset, data_config) -> PromptLoader:
    """verl's train loader: ``data.train_batch_size`` prompts, ``data.shuffle`` with ``data.seed``,
    drop_last. (``data.dataloader_num_workers`` is not used: prompts are pre-tokenized in memory.)"""
    return PromptLoader(
        dataset, data_config.train_batch_size, shuffle=data_config.shuffle, seed=data_config.seed, drop_last=True
    )


def build_val_loader(dataset, data_config) -> PromptLoader:
    """verl's validation loader: in order, ``data.val_batch_size`` prompts (all when None), no drop."""
    size = data_config.val_batch_size or len(dataset)
    return PromptLoader(dataset, size, shuffle=False, seed=0, drop_last=False)
