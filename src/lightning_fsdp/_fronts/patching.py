"""Wrapping a function of Lightning's in place, once: the one way this package changes Lightning's behaviour.

A wrapper is marked, so wrapping again (``import lightning_fsdp`` twice, a second registration) is a no-op rather
than a wrapper around a wrapper, and it keeps the original as ``__wrapped__``, so tests and users can reach it.
Every site that is wrapped is listed where it is wrapped (:mod:`~lightning_fsdp._fronts.registry`, :mod:`~lightning_fsdp._fronts.dropin`), with what it does.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["wrap_once"]

_MARK = "_lightning_fsdp_wrapper"


def wrap_once(owner: Any, name: str, make: Callable[[Any], Callable[..., Any]]) -> None:
    """Replace ``owner.<name>`` with ``make(original)``, unless it is already one of this package's wrappers."""
    original = getattr(owner, name)
    if getattr(original, _MARK, False):
        return
    wrapper = make(original)
    setattr(wrapper, _MARK, True)
    wrapper.__wrapped__ = original  # type: ignore[attr-defined]
    setattr(owner, name, wrapper)
