"""Bounded walks of nested user and checkpoint data: the one place that descends into dicts, lists and tuples.

Unpickling keeps shared objects shared: ``L = [L_prev, L_prev]`` sixty times over is a 2.6 KB file, but a walk
that follows every reference visits 2**60 nodes, and a walk that recurses once per level dies at a few hundred
levels with a ``RecursionError``. Both come from bytes a checkpoint file chooses, so every walk of such data here:

- visits each container once, however many references lead to it, and gives every reference to it the same
  result (a shared list stays one shared list, a cycle stays a cycle);
- stops with :class:`TreeLimitError`, naming what it walked and where, past :data:`MAX_DEPTH` levels of nesting
  or :data:`MAX_NODES` containers and leaves.

With every container visited once, a walk costs as much as the pickle that made the data, which is bounded by the
file's size; the node bound only turns a pathological file into an error instead of minutes of work.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, Optional

__all__ = ["TreeLimitError", "MAX_DEPTH", "MAX_NODES", "map_leaves", "leaves", "any_leaf"]

MAX_DEPTH = 100
"""Levels of nesting a walk follows. Real checkpoints nest about ten deep (a Trainer's loop state); Python's own
recursion limit (about a thousand frames) must never be what stops a walk."""
MAX_NODES = 10_000_000
"""Containers and leaves a walk visits. A 7B model with Adam state has a few thousand tensors."""

Path = tuple


class TreeLimitError(ValueError):
    """Nested data that is too deep or too large to walk, or whose shared references form a cycle through a
    tuple (which no walk can rebuild)."""


def _where(path: Path) -> str:
    shown = "".join(f"[{step!r}]" for step in path[:8])
    return shown + ("..." if len(path) > 8 else "") or "the top level"


def _is_tuple(value: Any) -> bool:
    return type(value) is tuple


class _Walk:
    def __init__(self, what: str, leaf: Callable[[Any, Path], Any], descend_into: Callable[[Any], bool]) -> None:
        self.what, self.leaf, self.descend_into = what, leaf, descend_into
        self.done: dict[int, Any] = {}  # id of a container visited -> its result
        self.open: set[int] = set()  # tuples being walked: meeting one again is a cycle
        self.keep: list[Any] = []  # the containers visited, alive so that their ids stay theirs
        self.nodes = 0

    def visit(self, value: Any, path: Path) -> Any:
        self.nodes += 1
        if self.nodes > MAX_NODES:
            raise TreeLimitError(f"{self.what} holds more than {MAX_NODES:,} nested entries, so it was not walked."
                                 " HINT: a checkpoint of model and optimizer state holds far fewer; if this file is"
                                 " yours, save such data apart from the checkpoint.")
        if not self.descend_into(value):
            return self.leaf(value, path)
        key = id(value)
        if key in self.done:
            return self.done[key]
        if key in self.open:
            raise TreeLimitError(f"{self.what} holds a tuple that contains itself (at {_where(path)}), which cannot"
                                 " be rebuilt. HINT: a checkpoint save never writes one; the file was not written"
                                 " by a save, or is damaged.")
        if len(path) >= MAX_DEPTH:
            raise TreeLimitError(f"{self.what} nests containers more than {MAX_DEPTH} levels deep (at {_where(path)}),"
                                 " so it was not walked. HINT: a checkpoint of model and optimizer state nests a few"
                                 " levels; if this file is yours, flatten such data before saving it.")
        self.keep.append(value)
        if isinstance(value, dict):
            out: Any = {}
            self.done[key] = out  # registered before its children: a cycle back to it gets it
            for k, v in value.items():
                out[k] = self.visit(v, (*path, k))
            return out
        if type(value) is list:
            out = self.done[key] = []
            for i, v in enumerate(value):
                out.append(self.visit(v, (*path, i)))
            return out
        if type(value) is not tuple:  # a caller's `descend_into` chose another container: a tuple of its items
            value = tuple(value)
        self.open.add(key)
        out = tuple(self.visit(v, (*path, i)) for i, v in enumerate(value))
        self.open.discard(key)
        self.done[key] = out
        return out


def _containers(value: Any) -> bool:
    # Dicts of any type (an OrderedDict is rebuilt as a dict), and exactly lists and tuples (a named tuple is a
    # leaf), as the callers always did.
    return isinstance(value, dict) or type(value) in (list, tuple)


def map_leaves(value: Any, fn: Callable[[Any, Path], Any], *, what: str,
               descend_into: Optional[Callable[[Any], bool]] = None) -> Any:
    """A copy of ``value`` with every leaf replaced by ``fn(leaf, path)`` (``path``: the keys and indices that
    first lead to it). Dicts (subclasses too) become dicts, lists lists, plain tuples tuples; each shared container
    is copied once and stays shared in the copy. ``what`` names the data in errors, e.g. ``"'ckpt.pt'"``."""
    return _Walk(what, fn, descend_into or _containers).visit(value, ())


def leaves(value: Any, *, what: str) -> Iterator[tuple[Path, Any]]:
    """Each leaf of ``value`` with its path, in order; the leaves of a shared container once."""
    found: list[tuple[Path, Any]] = []
    map_leaves(value, lambda leaf, path: found.append((path, leaf)), what=what)
    return iter(found)


def any_leaf(value: Any, predicate: Callable[[Any], bool], *, what: str) -> bool:
    """Whether any leaf of ``value`` satisfies ``predicate`` (each shared container looked at once)."""
    return any(predicate(leaf) for _, leaf in leaves(value, what=what))
