"""With fault tolerance off, a user's own ``fault_tolerance`` entry in a checkpoint is theirs (review of this
session's diff, 2026-11-29): the load took every entry of that name out of what it hands back, so a run without
fault tolerance lost it from ``fabric.load``'s remainder and the Trainer's ``on_load_checkpoint``. Only a value of
exactly torchft's counters (a fault-tolerant run's checkpoint, loaded without it) is the strategy's."""

from __future__ import annotations

import pytest

from lightning_fsdp._fronts.replica_checkpoint import STATE_KEY, restore_replica_state

pytestmark = pytest.mark.single_process


@pytest.mark.parametrize("users", [{"mine": 1}, {"step": 5, "batches_committed": "9"}, [1, 2], "on"])
def test_a_users_entry_of_the_name_stays_in_the_remainder_without_fault_tolerance(users):
    remainder = {STATE_KEY: users, "other": 2}
    restore_replica_state(None, remainder, "ckpt")
    assert remainder == {STATE_KEY: users, "other": 2}


def test_the_counters_of_a_fault_tolerant_run_are_still_taken_out_without_it():
    remainder = {STATE_KEY: {"step": 5, "batches_committed": 9}, "other": 2}
    restore_replica_state(None, remainder, "ckpt")
    assert remainder == {"other": 2}
