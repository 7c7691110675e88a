"""torch's ``FSDPMemTracker``, with its per-op peak bookkeeping made proportional to the modules that are running.

After every op, torch's tracker walks *every* module it has seen so far and asks whether that module is running
(``MemTracker._update_peak_stats``). That is O(ops x modules), and each step of the walk resolves a weak reference
whose ``hasattr`` check goes through ``nn.Module.__getattr__``, twice for a module wrapped for activation
checkpointing. Planning a 32-layer, 6.5B-parameter GPT with checkpointing spent a third of its time there.

:class:`StepMemTracker` does the same bookkeeping from the other side: it keeps the modules' statistics by name and
visits only the names that are running now (``ModTracker.parents``, a handful). Every statistic it updates, and the
value it updates it to, are the ones torch's walk updates: the walk's test is "this module's name is among the
running names", so visiting the running names finds exactly the same modules. ``tests/test_planner.py`` checks that
plans made with either tracker are identical.
"""

from __future__ import annotations

from copy import deepcopy
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary

from lightning_fsdp._base.compat import planner_tools, tracker_total_key

__all__ = ["StepMemTracker", "TorchMemTracker"]

TorchMemTracker = planner_tools()[2]
_TOTAL_KEY = tracker_total_key()


class _CountedWeakIdKeyDictionary(WeakIdKeyDictionary):
    """Counts the insertions, removals and clears made through it, so a cache built from it can tell it is stale."""

    def __init__(self) -> None:
        super().__init__()
        self.changes = 0

    def __setitem__(self, key: Any, value: Any) -> None:
        self.changes += 1
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self.changes += 1
        super().__delitem__(key)

    def clear(self) -> None:
        self.changes += 1
        super().clear()


class StepMemTracker(TorchMemTracker):
    """``FSDPMemTracker`` whose peak bookkeeping visits the running modules only (see the module's docstring)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        counted = _CountedWeakIdKeyDictionary()
        for module, stats in self.memory_tracking.items():
            counted[module] = stats
        self.memory_tracking = counted
        self._by_name: dict[str, list[Any]] = {}
        # A module that dies leaves the dictionary without going through it: its size is part of the key too.
        self._by_name_key: tuple[int, int] = (-1, -1)

    def _update_peak_stats(self, peak_state: Any) -> None:
        tracking = self.memory_tracking
        key = (tracking.changes, len(tracking.data))
        if key != self._by_name_key:
            by_name: dict[str, list[Any]] = {}
            for stats in tracking.values():
                by_name.setdefault(stats.mod_fqn, []).append(stats)
            self._by_name, self._by_name_key = by_name, key
        current = self._curr_mem_snap
        for name in self._mod_tracker.parents:
            for stats in self._by_name.get(name, ()):
                if peak_state not in stats.snapshots:
                    continue
                for device, snapshot in current.items():
                    if stats.local_peak.get(device, 0) < snapshot[_TOTAL_KEY]:
                        stats.local_peak[device] = snapshot[_TOTAL_KEY]
                        stats.snapshots[peak_state][-1][device] = deepcopy(snapshot)
        for device, snapshot in current.items():
            if self._peak_mem.get(device, 0) < snapshot[_TOTAL_KEY]:
                self._peak_mem[device] = snapshot[_TOTAL_KEY]
                self._peak_mem_snap[device] = deepcopy(snapshot)
