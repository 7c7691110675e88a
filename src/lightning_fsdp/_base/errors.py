"""One format for every user-facing argument error.

Each message names the argument, shows the value received, lists what is allowed and ends with a fix the
user can paste. Keeping the format in one place keeps the wording the same across the engine and both fronts.
"""

from __future__ import annotations

from typing import Any


def bad_argument(argument: str, value: Any, allowed: str, fix: str, *, problem: str = "") -> str:
    """Build the message for an invalid ``argument``.

    ``problem`` is an optional sentence that explains what is wrong when "not allowed" is not obvious
    (for example, a dotted name that failed to import).
    """
    shown = repr(value)
    if len(shown) > 200:
        shown = shown[:197] + "..."
    parts = [f"Invalid `{argument}={shown}`."]
    if problem:
        parts.append(problem.rstrip(".") + ".")
    parts.append(f"Allowed: {allowed}.")
    parts.append(f"HINT: {fix}")
    return " ".join(parts)
