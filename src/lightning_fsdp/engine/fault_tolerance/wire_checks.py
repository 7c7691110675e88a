"""Checks of a received heal header that need nothing of the wire itself (transport.py applies them and raises).

:func:`layout_difference` words a layout mismatch. :func:`manager_tree_problem` checks the tree torchft's Manager
hands to a checkpoint transport, ``{"user": {key: state}, "torchft": {"step": s, "batches_committed": n}}``, in its
header form (transport.py's node forms), so that a bad one is refused before any tensor byte moves: torchft assigns
the ``torchft`` counters to itself as soon as ``recv_checkpoint`` returns (unchecked; the next checkpoint would then
store them, or fail to), and looks each registered key up in ``user`` only later, in the training thread.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

COUNTERS = ("step", "batches_committed")


def layout_difference(ours: Any, theirs: Any) -> str:
    """What differs between two layouts (``{"digest", "entries"}`` as heal.layout_of makes, or any JSON), for the
    error: the first entry that differs, shown from both sides."""
    if type(ours) is dict and type(theirs) is dict and type(ours.get("entries")) is list \
            and type(theirs.get("entries")) is list:
        a, b = ours["entries"], theirs["entries"]
        for i in range(max(len(a), len(b))):
            here = a[i] if i < len(a) else "(nothing)"
            there = b[i] if i < len(b) else "(nothing)"
            if here != there:
                where = f"entry {i} of {len(a)} here and {len(b)} in the sender"
                return (f"The heal payload was made for another layout ({where}): here {here!r:.300}, in the sender"
                        f" {there!r:.300}. HINT: a replica group heals only from a group of the same size, model,"
                        " sharding, optimizers and LR schedulers; start every group with the same settings")
    return (f"The heal payload was made for another layout: here {ours!r:.300}, in the sender {theirs!r:.300}. HINT:"
            " start every replica group with the same settings")


def manager_tree_problem(node: Any, step: int, user_keys: Optional[Sequence[str]], max_count: int) -> Optional[str]:
    """What is wrong with torchft's tree in header form (a node the transport has already checked for its forms),
    or None: exactly the keys ``user`` and ``torchft``; ``user`` a dict, with exactly ``user_keys`` when given;
    ``torchft`` exactly the two counters, ints in [0, ``max_count``), its step the header's ``step``."""
    top = _entries(node, ("user", "torchft"))
    if top is None:
        return f"the tree is not a dict with exactly the keys 'user' and 'torchft': {node!r:.200}"
    if _entries(top["user"], user_keys) is None:
        wanted = f"exactly the keys {sorted(user_keys)}" if user_keys is not None else "a dict"
        return f"the tree's `user` part is not {wanted}: {top['user']!r:.200}"
    counters = _entries(top["torchft"], COUNTERS)
    if counters is None or any(type(v) is not int or not 0 <= v < max_count for v in counters.values()):
        return (f"the tree's `torchft` part is not {{'step', 'batches_committed'}} with ints in [0, {max_count}):"
                f" {top['torchft']!r:.200}")
    if counters["step"] != step:
        return f"the tree's torchft step {counters['step']} is not the header's step {step}"
    return None


def _entries(node: Any, keys: Optional[Sequence[str]]) -> Optional[dict]:
    """A dict node's entries by key, or None when ``node`` is no dict node or (``keys`` given) has other keys."""
    pairs = node.get("d") if type(node) is dict and len(node) == 1 else None
    if type(pairs) is not list:
        return None
    entries = dict(pairs)  # the transport's node check made each a [key, node] pair, keys distinct
    return entries if keys is None or set(entries) == set(keys) else None
