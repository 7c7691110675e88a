"""Each replica group's share of the data, and a position that a heal or a resume can move.

The data is cut into ``num_replica_groups x group_size`` shares, one per rank of the whole job: rank ``r`` of group
``g`` reads share ``g * group_size + r`` (the numbering of torchft's ``torchft.data.DistributedSampler``). A group that
is absent leaves its shares unread: its batches are skipped, not handed to the live groups, so that every group's
share is the same whichever groups are alive, and a group that comes back reads its own again.

Where the position lives: in a :class:`DataCursor` (the epoch and how many samples of this rank's share the epoch
has handed out), which the strategy owns and keeps across data loaders, saves with its checkpoints and sends to a
healing group as plain ints. :class:`CursorSampler` reads it for every index it yields, so moving the cursor moves a
loader that is already running; Lightning's own loop cannot resume a plain map-style loader mid-epoch, the cursor can.
A loader with ``num_workers > 0`` has already fetched up to ``prefetch_factor * num_workers`` batches when the cursor
moves: those still come from the old position.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any, Optional

from torch.utils.data import Dataset, DistributedSampler, Sampler, SequentialSampler

from lightning_fsdp._base.errors import bad_argument

__all__ = ["CursorSampler", "DataCursor", "fault_tolerant_sampler", "order_fixed_by_epoch", "replica_sampler_kwargs",
           "sampler_name"]


class DataCursor:
    """The data position of one rank: ``epoch``, and ``position``, the number of samples of this rank's share of
    that epoch handed out so far (the next index yielded is the share's ``position``-th)."""

    def __init__(self, epoch: int = 0, position: int = 0) -> None:
        self.epoch = 0
        self.position = 0
        self.jump(epoch, position)

    def jump(self, epoch: int, position: int) -> None:
        """Move to ``position`` of ``epoch``; a sampler iterating another epoch ends at its next index."""
        _check_count("epoch", epoch)
        _check_count("position", position)
        self.epoch, self.position = epoch, position

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or set(state) != {"epoch", "position"}:
            raise ValueError(bad_argument(
                "data cursor state", state, "a dict with exactly the int keys 'epoch' and 'position'",
                "Load the dict that `DataCursor.state_dict()` (or `CursorSampler.state_dict()`) returned.",
            ))
        self.jump(state["epoch"], state["position"])

    def __repr__(self) -> str:
        return f"DataCursor(epoch={self.epoch}, position={self.position})"


def replica_sampler_kwargs(replica_id: int, num_replica_groups: int, group_rank: int, group_size: int) -> dict[str, int]:
    """``num_replicas`` and ``rank`` for a ``DistributedSampler`` over every rank of every group."""
    for name, value, low in (("replica_id", replica_id, 0), ("num_replica_groups", num_replica_groups, 1),
                             ("group_rank", group_rank, 0), ("group_size", group_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ValueError(bad_argument(name, value, f"an int >= {low}", "Pass the values of the running group."))
    if replica_id >= num_replica_groups or group_rank >= group_size:
        raise ValueError(bad_argument(
            "replica_id, group_rank", (replica_id, group_rank),
            f"replica_id < num_replica_groups={num_replica_groups} and group_rank < group_size={group_size}",
            "Pass the values of the running group.",
        ))
    return {"num_replicas": num_replica_groups * group_size, "rank": replica_id * group_size + group_rank}


class CursorSampler(Sampler[int]):
    """Yields ``sampler``'s indices for the cursor's epoch from the cursor's position on, advancing the cursor by one
    per index.

    An iteration belongs to the epoch it started in: it ends when the share is exhausted or when the cursor is moved
    to another epoch (the next iteration then starts there). An iteration that starts on an exhausted epoch first
    moves to the next one, so a loop that never calls :meth:`set_epoch` still sees each epoch's own order.
    ``sampler`` is usually a ``DistributedSampler`` over every rank of every group (:func:`fault_tolerant_sampler`);
    its ``set_epoch`` picks each epoch's order.
    """

    def __init__(self, sampler: Sampler[int], cursor: Optional[DataCursor] = None) -> None:
        if not isinstance(sampler, Sized):
            raise TypeError(bad_argument(
                "sampler", sampler, "a sampler with a length (a map-style dataset's sampler)",
                "Use a map-style dataset; an IterableDataset cannot be cut into shares by index.",
            ))
        if not order_fixed_by_epoch(sampler):
            # The Trainer refuses such a loader (`_fronts.trainer_heal`); a Fabric script builds this class itself.
            raise ValueError(bad_argument(
                "sampler", sampler_name(sampler),
                "a sampler whose order depends only on the epoch: SequentialSampler, DistributedSampler (torchft's"
                " is one), or Lightning's DistributedSamplerWrapper over one of these",
                "build it with `fault_tolerant_sampler(dataset, ..., shuffle=True, seed=...)`, which shuffles by"
                " seed and epoch, or wrap a DistributedSampler(dataset, shuffle=True, seed=...)",
                problem="A healed group draws the sampler's order anew at the heal, and only an order fixed by the"
                        " epoch is the live groups' order there (a random sampler's depends on its generator's past"
                        " draws): it would train on other samples than theirs",
            ))
        self.sampler = sampler
        self.cursor = cursor if cursor is not None else DataCursor()
        self._order_epoch: Optional[int] = None
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self.sampler)  # type: ignore[arg-type]

    def set_epoch(self, epoch: int) -> None:
        """The loop starts ``epoch``: the cursor moves to its start, unless it already stands in it (a resume or a
        heal placed it mid-epoch)."""
        if epoch != self.cursor.epoch:
            self.cursor.jump(epoch, 0)

    def seek(self, epoch: int, position: int) -> None:
        """Move the cursor to ``position`` samples into ``epoch``; a position at or past the end of the share is
        carried into the following epochs (a heal adds the window's samples to a position near an epoch's end)."""
        self.cursor.jump(epoch, position)
        length = len(self)
        if length:
            epoch, position = epoch + position // length, position % length
            self.cursor.jump(epoch, position)

    def __iter__(self) -> Iterator[int]:
        cursor = self.cursor
        if cursor.position >= len(self):
            cursor.jump(cursor.epoch + 1, 0)
        epoch = cursor.epoch
        while cursor.epoch == epoch:
            order = self._order_of(epoch)
            position = cursor.position
            if position >= len(order):
                return
            cursor.position = position + 1
            yield order[position]

    def state_dict(self) -> dict[str, int]:
        """The cursor, and the share's length, which a resume checks: the same position in another cut of the data
        names other samples."""
        return {**self.cursor.state_dict(), "samples_per_epoch": len(self)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or "samples_per_epoch" not in state:
            raise ValueError(bad_argument(
                "sampler state", state, "the dict `CursorSampler.state_dict()` returned",
                "Load the state saved by the same kind of sampler.",
            ))
        if state["samples_per_epoch"] != len(self):
            raise ValueError(bad_argument(
                "sampler state", dict(state), f"samples_per_epoch={len(self)} (this rank's share now)",
                "Resume with the same dataset and the same num_replica_groups x group size, or start the epoch over"
                " with `sampler.seek(epoch, 0)`.",
                problem="The saved position counts samples of a share of another length",
            ))
        self.cursor.load_state_dict({k: v for k, v in state.items() if k != "samples_per_epoch"})

    def _order_of(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            set_epoch = getattr(self.sampler, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
            self._order = list(iter(self.sampler))
            self._order_epoch = epoch
        return self._order


def order_fixed_by_epoch(sampler: Any) -> bool:
    """Whether ``sampler``'s order is a function of the epoch alone (its ``set_epoch``), the same on every group
    and whenever it is drawn. A cursor position names the same samples in two groups only then: a random sampler's
    order also depends on its generator's state, which differs between a live group and one that heals mid-epoch.

    Accepted: ``SequentialSampler``, ``DistributedSampler`` (its order is ``seed`` and ``epoch``; torchft's is one),
    Lightning's ``DistributedSamplerWrapper`` over an accepted sampler, and a :class:`CursorSampler` over one.
    A subclass that replaces ``__iter__`` draws its own order and is not accepted."""
    if isinstance(sampler, CursorSampler):
        return order_fixed_by_epoch(sampler.sampler)
    if isinstance(sampler, SequentialSampler):
        return type(sampler).__iter__ is SequentialSampler.__iter__
    if not isinstance(sampler, DistributedSampler):
        return False
    if type(sampler).__iter__ is DistributedSampler.__iter__:
        return True
    # Lightning wraps a custom sampler so each rank reads a share of its order: the order is the wrapped sampler's.
    from lightning.fabric.utilities.distributed import DistributedSamplerWrapper

    if type(sampler).__iter__ is not DistributedSamplerWrapper.__iter__:
        return False
    return order_fixed_by_epoch(getattr(sampler.dataset, "_sampler", None))


def fault_tolerant_sampler(
    dataset: Dataset,
    *,
    replica_id: int,
    num_replica_groups: int,
    group_rank: int,
    group_size: int,
    cursor: Optional[DataCursor] = None,
    shuffle: bool = True,
    seed: int = 0,
    drop_last: bool = False,
) -> CursorSampler:
    """A :class:`CursorSampler` over this rank's share: the indices torchft's ``DistributedSampler`` gives the same
    group and rank."""
    kwargs = replica_sampler_kwargs(replica_id, num_replica_groups, group_rank, group_size)
    base = DistributedSampler(dataset, shuffle=shuffle, seed=seed, drop_last=drop_last, **kwargs)
    return CursorSampler(base, cursor)


def sampler_name(sampler: Any) -> str:
    """The sampler's class, with the ones it wraps: what an error shows of a sampler (its repr is an address)."""
    inner = getattr(getattr(sampler, "dataset", None), "_sampler", None)  # Lightning's DistributedSamplerWrapper
    return f"{type(sampler).__name__}({sampler_name(inner)})" if inner is not None else type(sampler).__name__


def _check_count(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(bad_argument(f"data cursor {name}", value, "an int >= 0",
                                      "Pass the epoch and the number of samples of this rank's share read in it."))
