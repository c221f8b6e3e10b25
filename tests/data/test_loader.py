"""StatefulSampler / PromptLoader: batches, epochs, drop_last, seeding and exact resume."""

import json

import pytest
import torch

from posttrain.data import PromptLoader, StatefulSampler, build_train_loader, build_val_loader
from helpers.data import make_data_config


class ListDataset:
    def __init__(self, n):
        self.items = list(range(n))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]

    def collate_fn(self, items):
        return list(items)


def take(sampler, k):
    return [sampler.next_indices() for _ in range(k)]


def test_sequential_epochs_and_drop_last():
    s = StatefulSampler(num_samples=7, batch_size=3, shuffle=False)
    assert len(s) == 2  # 7 // 3, the last prompt is dropped each epoch
    assert list(s) == [[0, 1, 2], [3, 4, 5]]
    assert s.epoch == 1 and s.position == 0
    assert list(s) == [[0, 1, 2], [3, 4, 5]]
    keep = StatefulSampler(num_samples=7, batch_size=3, shuffle=False, drop_last=False)
    assert list(keep) == [[0, 1, 2], [3, 4, 5], [6]]


def test_shuffle_is_seeded_and_differs_per_epoch():
    a = StatefulSampler(10, 5, shuffle=True, seed=3)
    b = StatefulSampler(10, 5, shuffle=True, seed=3)
    c = StatefulSampler(10, 5, shuffle=True, seed=4)
    ea, eb, ec = take(a, 4), take(b, 4), take(c, 4)
    assert ea == eb and ea != ec
    assert sorted(ea[0] + ea[1]) == list(range(10))  # an epoch is a permutation
    assert ea[:2] != ea[2:]  # epoch 1 is ordered differently from epoch 0
    g = torch.Generator()
    g.manual_seed(3 * 1_000_003 + 0)
    assert ea[0] + ea[1] == torch.randperm(10, generator=g).tolist()


@pytest.mark.parametrize("consumed", [0, 1, 2, 3, 5])
def test_resume_gives_the_same_remaining_batches(consumed):
    # 3 batches per epoch; consumed=3 is exactly the epoch boundary
    ref = StatefulSampler(10, 3, shuffle=True, seed=11)
    expected = take(ref, 9)
    run = StatefulSampler(10, 3, shuffle=True, seed=11)
    take(run, consumed)
    state = json.loads(json.dumps(run.state_dict()))  # JSON round trip
    resumed = StatefulSampler(10, 3, shuffle=True, seed=999)
    resumed.load_state_dict(state)
    assert take(resumed, 9 - consumed) == expected[consumed:]


def test_resume_after_last_batch_of_epoch_starts_next_epoch():
    loader = PromptLoader(ListDataset(6), batch_size=2, shuffle=True, seed=0)
    epoch0 = list(loader)
    assert len(epoch0) == 3
    state = loader.state_dict()
    assert (state["epoch"], state["position"], state["seed"]) == (1, 0, 0)
    epoch1 = list(loader)
    fresh = PromptLoader(ListDataset(6), batch_size=2, shuffle=True, seed=0)
    fresh.load_state_dict(state)
    assert fresh.epoch == 1
    assert list(fresh) == epoch1
    assert epoch1 != epoch0


def test_unseeded_loader_records_its_seed():
    a = PromptLoader(ListDataset(8), 4, shuffle=True, seed=None)
    first = a.next_batch()
    b = PromptLoader(ListDataset(8), 4, shuffle=True, seed=None)
    b.load_state_dict(a.state_dict())
    assert b.next_batch() == a.next_batch()
    assert isinstance(a.state_dict()["seed"], int) and len(first) == 4


def test_errors():
    with pytest.raises(ValueError, match=r"3 prompts, fewer than one batch of 4 \(data.train_batch_size\)"):
        StatefulSampler(3, 4)
    s = StatefulSampler(8, 4, seed=1)
    with pytest.raises(ValueError, match="checkpoint has batch_size=2, this run has batch_size=4"):
        s.load_state_dict({**s.state_dict(), "batch_size": 2})


def test_build_loaders_from_data_config():
    cfg = make_data_config(train_batch_size=4, val_batch_size=None, shuffle=False, seed=5)
    train = build_train_loader(ListDataset(10), cfg)
    assert list(train) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    val = build_val_loader(ListDataset(10), cfg)
    assert list(val) == [list(range(10))]
    val3 = build_val_loader(ListDataset(7), make_data_config(val_batch_size=3))
    assert list(val3) == [[0, 1, 2], [3, 4, 5], [6]]
