"""The fault-tolerant data cut (engine/fault_tolerance/data.py): every rank of every replica group reads its own
share, the shares are torchft's, and the cursor moves a running iteration (a heal or a resume)."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, SequentialSampler

from lightning_fsdp.engine.fault_tolerance.data import (
    CursorSampler,
    DataCursor,
    fault_tolerant_sampler,
    replica_sampler_kwargs,
)

pytestmark = pytest.mark.single_process

DATA = list(range(53))  # not a multiple of 6: the shares are padded, as torch's DistributedSampler pads them


def _sampler(group: int, rank: int, groups: int = 3, size: int = 2, **kw) -> CursorSampler:
    return fault_tolerant_sampler(DATA, replica_id=group, num_replica_groups=groups, group_rank=rank, group_size=size, **kw)


@pytest.mark.parametrize("shuffle", [True, False])
def test_every_group_and_rank_reads_what_torchfts_sampler_gives_it(shuffle):
    from torchft.data import DistributedSampler as TorchftSampler

    seen = []
    for group in range(3):
        for rank in range(2):
            for epoch in (0, 1):
                ours = _sampler(group, rank, shuffle=shuffle, seed=7)
                ours.set_epoch(epoch)
                theirs = TorchftSampler(DATA, replica_rank=group, num_replica_groups=3, group_rank=rank, num_replicas=2,
                                        shuffle=shuffle, seed=7)
                theirs.set_epoch(epoch)
                assert list(ours) == list(theirs), (group, rank, epoch)
                if epoch == 0:
                    seen += list(_sampler(group, rank, shuffle=shuffle, seed=7))
    assert set(seen) == set(DATA)  # together the six shares cover the data (padded by repeats to 6 x 9)
    assert len(seen) == 54


def test_an_absent_groups_share_is_not_handed_to_the_others():
    # Group 1 of 3 is down: groups 0 and 2 read exactly what they read when all three are up.
    alive = {g: list(_sampler(g, 0, shuffle=False)) for g in (0, 2)}
    assert alive == {g: list(_sampler(g, 0, shuffle=False)) for g in (0, 2)}
    assert not set(alive[0] + alive[2]) & set(_sampler(1, 0, shuffle=False))
    assert replica_sampler_kwargs(2, 3, 1, 2) == {"num_replicas": 6, "rank": 5}


def test_a_cursor_moved_mid_iteration_moves_the_loader():
    cursor = DataCursor()
    sampler = CursorSampler(SequentialSampler(range(10)), cursor)
    loader = DataLoader(range(10), batch_size=2, sampler=sampler)
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    assert cursor.state_dict() == {"epoch": 0, "position": 2}
    cursor.jump(0, 6)  # a heal: the live groups are 3 batches further
    assert [b.tolist() for b in it] == [[6, 7], [8, 9]]
    # The epoch was read to its end: the next pass is epoch 1, from its start.
    assert next(iter(loader)).tolist() == [0, 1] and cursor.epoch == 1


def test_a_jump_into_the_next_epoch_ends_this_epochs_iteration_and_the_next_starts_there():
    reference = _sampler(0, 0, groups=1, size=1, seed=3)  # shuffled per epoch by set_epoch
    epoch0 = list(reference)
    reference.set_epoch(1)
    epoch1 = list(reference)
    assert epoch0 != epoch1
    sampler = _sampler(0, 0, groups=1, size=1, seed=3)
    it = iter(sampler)
    assert [next(it) for _ in range(5)] == epoch0[:5]
    sampler.seek(0, 53 + 4)  # past the end of epoch 0: carried into epoch 1, position 4
    assert sampler.cursor.state_dict() == {"epoch": 1, "position": 4}
    assert list(it) == []  # epoch 0's iteration ends
    assert list(sampler) == epoch1[4:]  # the next one is epoch 1's order from position 4
    sampler.set_epoch(1)  # the loop reaching the epoch the cursor stands in keeps the position
    assert sampler.cursor.state_dict() == {"epoch": 1, "position": 53}
    sampler.set_epoch(2)
    assert sampler.cursor.state_dict() == {"epoch": 2, "position": 0}


def test_a_resume_restores_the_position_and_refuses_another_cut_of_the_data():
    sampler = _sampler(1, 1)
    sampler.set_epoch(3)
    it = iter(sampler)
    [next(it) for _ in range(4)]
    state = sampler.state_dict()
    assert state == {"epoch": 3, "position": 4, "samples_per_epoch": 9}
    resumed = _sampler(1, 1)
    resumed.load_state_dict(state)
    resumed.set_epoch(3)  # what the loop calls on resume: same epoch, position kept
    assert list(resumed) == list(it)
    other = fault_tolerant_sampler(DATA, replica_id=1, num_replica_groups=2, group_rank=1, group_size=2)
    with pytest.raises(ValueError, match=r"samples_per_epoch=14 .*HINT: Resume with the same dataset"):
        other.load_state_dict(state)


@pytest.mark.parametrize(("call", "match"), [
    (lambda: DataCursor(-1, 0), r"Invalid `data cursor epoch=-1`.*HINT"),
    (lambda: DataCursor(0, 1.5), r"Invalid `data cursor position=1.5`"),
    (lambda: DataCursor().load_state_dict({"epoch": 1}), r"exactly the int keys 'epoch' and 'position'"),
    (lambda: replica_sampler_kwargs(2, 2, 0, 1), r"replica_id < num_replica_groups=2"),
    (lambda: replica_sampler_kwargs(0, 0, 0, 1), r"Invalid `num_replica_groups=0`"),
    (lambda: _sampler(0, 0).load_state_dict({"epoch": 0}), r"Invalid `sampler state="),
])
def test_bad_positions_and_shares_are_refused_with_a_hint(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_an_iterable_without_length_is_refused():
    with pytest.raises(TypeError, match=r"map-style dataset"):
        CursorSampler(iter(range(3)))
