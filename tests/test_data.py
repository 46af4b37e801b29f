"""fxspeed.data: each rank's slice of a global batch, and sharded DataLoaders."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from fxspeed.data import iterate_local, local_batch, shard_loader
from fxspeed.errors import ConfigError


def test_local_batch_gives_each_rank_its_contiguous_slice_of_a_tensor() -> None:
    x = torch.arange(12).reshape(6, 2)
    parts = [local_batch(x, r, 3) for r in range(3)]
    assert [p.shape for p in parts] == [(2, 2)] * 3
    assert torch.equal(torch.cat(parts), x)
    assert torch.equal(parts[1], x[2:4])


def test_local_batch_slices_every_tensor_of_tuples_lists_and_dicts_and_keeps_their_structure() -> None:
    x, y = torch.arange(8), torch.arange(8) * 10
    batch = {"input_ids": x, "extra": (y, [y.float()]), "flag": True, "scale": torch.tensor(2.0)}
    got = local_batch(batch, 1, 2)
    assert set(got) == set(batch) and isinstance(got["extra"], tuple) and isinstance(got["extra"][1], list)
    assert torch.equal(got["input_ids"], x[4:]) and torch.equal(got["extra"][0], y[4:])
    assert torch.equal(got["extra"][1][0], y[4:].float())
    assert got["flag"] is True and torch.equal(got["scale"], torch.tensor(2.0))  # scalars are shared
    a, b = local_batch((x, y), 0, 2)
    assert torch.equal(a, x[:4]) and torch.equal(b, y[:4])


def test_a_batch_not_divisible_by_the_number_of_ranks_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match=r"global batch of 7 rows cannot be split evenly across 2 ranks"):
        local_batch((torch.zeros(7, 3), torch.zeros(7)), 0, 2)


def test_one_process_without_a_group_keeps_the_whole_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    x = torch.arange(5)
    assert torch.equal(local_batch(x), x)


def test_before_the_group_is_joined_the_launchers_environment_decides_the_slice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # `fxspeed run` / torchrun set RANK and WORLD_SIZE; scripts split the example batch before compile().
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert torch.equal(local_batch(torch.arange(8)), torch.tensor([2, 3]))
    with pytest.raises(ConfigError, match="across 4 ranks"):
        local_batch(torch.arange(6))


def test_a_rank_outside_the_world_is_rejected() -> None:
    with pytest.raises(ConfigError, match="rank 2 is not a rank of a world of 2"):
        local_batch(torch.arange(4), 2, 2)


def test_iterate_local_slices_each_batch_of_a_stream() -> None:
    batches = [torch.arange(4) + 10 * i for i in range(3)]
    assert [b.tolist() for b in iterate_local(batches, 1, 2)] == [[2, 3], [12, 13], [22, 23]]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("drop_last", [False, True])
def test_shard_loader_gives_each_rank_an_equal_share_of_the_dataset_and_keeps_the_loaders_last_batch(
        shuffle: bool, drop_last: bool) -> None:
    """drop_last was forced on: 22 rows in batches of 4 on 2 ranks trained on 16, and a rank with
    fewer rows than a batch got no batch at all. Now, as DDP's DistributedSampler does, the
    loader's drop_last=False repeats a few rows so every rank gets as many."""
    data = TensorDataset(torch.arange(20))
    loader = DataLoader(data, batch_size=3, shuffle=shuffle, drop_last=drop_last)
    world = 3
    shards = [[int(v) for (b,) in shard_loader(loader, r, world, seed=7) for v in b] for r in range(world)]
    assert len({len(s) for s in shards}) == 1  # equal share: every rank runs the same number of steps
    seen = [v for s in shards for v in s]
    if drop_last:  # 6 rows a rank (two batches of 3), disjoint
        assert len(seen) == len(set(seen)) == 18
    else:  # 7 rows a rank: every row, one repeated
        assert set(seen) == set(range(20)) and len(seen) == 21
    # every rank sees batches of the same shapes (so their compiled programs agree)
    sizes = [[len(b) for (b,) in shard_loader(loader, r, world, seed=7)] for r in range(world)]
    assert all(s == sizes[0] for s in sizes) and sizes[0] == ([3, 3] if drop_last else [3, 3, 1])


def test_shard_loader_follows_the_loaders_order_and_refuses_what_it_cannot_split() -> None:
    data = TensorDataset(torch.arange(8))
    in_order = [b.tolist() for (b,) in shard_loader(DataLoader(data, batch_size=2), 0, 2)]
    assert in_order == [[0, 2], [4, 6]]  # shuffle=False kept (it was always shuffled)
    weighted = DataLoader(data, batch_size=2, sampler=torch.utils.data.WeightedRandomSampler([1.0] * 8, 8))
    with pytest.raises(ConfigError, match="WeightedRandomSampler"):
        shard_loader(weighted, 0, 2)
    with pytest.raises(ConfigError, match="batch_sampler"):
        shard_loader(DataLoader(data, batch_sampler=[[0, 1], [2, 3]]), 0, 2)

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(4))

    with pytest.raises(ConfigError, match="IterableDataset"):
        shard_loader(DataLoader(Stream(), batch_size=2), 0, 2)


def test_shard_loader_is_deterministic_for_a_seed_and_keeps_the_collate_function() -> None:
    data = TensorDataset(torch.arange(16))
    loader = DataLoader(data, batch_size=2, collate_fn=lambda rows: torch.stack([r[0] for r in rows]) * 2)
    a = [b.tolist() for b in shard_loader(loader, 0, 2, seed=3)]
    b = [b.tolist() for b in shard_loader(loader, 0, 2, seed=3)]
    assert a == b and all(v % 2 == 0 for batch in a for v in batch)
