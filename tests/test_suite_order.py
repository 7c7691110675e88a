"""The order this session runs its tests in is the one ``conftest.py`` promises (CONTRIBUTING.md, "The time budget"):
the suite's time depends on it, since each group is placed where it leaves no core idle. Checked on this session's
own tests, whatever the selection: a broken order fails here, not only as a slower suite."""

from __future__ import annotations

import pytest

import launch

pytestmark = pytest.mark.single_process


def _module(item) -> str:
    return getattr(getattr(item, "module", None), "__name__", "")


def _runs_first(item) -> bool:
    """Marked single_process and waits for no pool."""
    return bool(item.get_closest_marker("single_process")) and not launch.reads_a_pool(item)


def _reads_pools(item) -> bool:
    """Of a file with a pooled script, and not of the first group."""
    return _module(item) in launch.POOL_FIXTURES and not _runs_first(item)


def test_single_process_first_then_the_rest_then_pool_readers_then_both_cores(request):
    items = request.session.items
    first = [i for i, item in enumerate(items) if _runs_first(item)]
    pooled_files = [i for i, item in enumerate(items) if _reads_pools(item)]
    others = [i for i in range(len(items)) if i not in set(first) | set(pooled_files)]
    both = [i for i in others if items[i].get_closest_marker("fills_both_cores")]
    plain = [i for i in others if i not in set(both)]
    assert request.node in [items[i] for i in first], "this test is not in the first group"
    for earlier, later, what in ((first, others + pooled_files, "single_process tests"),
                                 (plain, both + pooled_files, "tests that leave a core idle"),
                                 (pooled_files, both, "the pool readers")):
        if earlier and later:
            assert max(earlier) < min(later), (
                f"{what} should all run before {items[min(later)].nodeid}, but {items[max(earlier)].nodeid} runs after")


def test_pool_readers_run_in_the_order_their_pools_end(request):
    items = [item for item in request.session.items if _reads_pools(item)]
    ends = [launch.last_pool_of(_module(it)) for it in items]
    assert ends == sorted(ends), [(it.nodeid, end) for it, end in zip(items, ends)][:5]


def test_a_file_is_split_only_by_its_marked_tests(request):
    """A module-scoped fixture shared by tests of two groups would be set up twice: a file's tests that are neither
    single_process nor fills_both_cores run one after another."""
    runs: list[str] = []
    for item in request.session.items:
        marked = item.get_closest_marker("single_process") or item.get_closest_marker("fills_both_cores")
        path = item.nodeid.split("::")[0]
        if not marked and (not runs or runs[-1] != path):
            runs.append(path)
        elif marked:
            runs.append("")  # a marked test between two unmarked ones of a file splits it
    split = sorted({path for path in runs if path and runs.count(path) > 1})
    assert not split, f"the unmarked tests of these files do not run together: {split}"
