"""The ``fault_tolerance`` argument: the :class:`FaultTolerance` dataclass, its environment defaults, and its checks.

Each replica group is its own torch world (its own ``torchrun``); the groups meet at one lighthouse and average their
gradients through torchft. The values come from the argument first and the environment second:

===================== ============================ ==================================================================
field                 environment (when None)      meaning
===================== ============================ ==================================================================
``replica_id``        ``REPLICA_GROUP_ID``         this group's number, ``0 .. num_replica_groups - 1`` (the name
                                                   torchft's own launcher, ``torchft.torchx``, sets)
``num_replica_groups`` ``NUM_REPLICA_GROUPS``      how many groups the data is cut for (a group that is absent
                                                   leaves its share unread)
``lighthouse``        ``TORCHFT_LIGHTHOUSE``       the lighthouse's address, ``http://host:port``
===================== ============================ ==================================================================

Nothing here imports torchft: the package imports without it, and only a strategy that turns fault tolerance on
asks for it (the ``[ft]`` extra).
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from datetime import timedelta
from typing import Any, Optional, Union
from urllib.parse import urlsplit

from lightning_fsdp._base.errors import bad_argument

__all__ = [
    "FaultTolerance",
    "FaultToleranceError",
    "FaultToleranceInput",
    "LIGHTHOUSE_ENV",
    "NUM_REPLICA_GROUPS_ENV",
    "REPLICA_ID_ENV",
    "parse_fault_tolerance",
    "require_torchft",
    "unreachable_lighthouse",
]

REPLICA_ID_ENV = "REPLICA_GROUP_ID"
NUM_REPLICA_GROUPS_ENV = "NUM_REPLICA_GROUPS"
LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
# torchft lets these override the Manager's arguments (torchft/manager.py, get_timeout): a user who set one would see
# timeouts other than the strategy's, so the parse warns when one differs.
_TORCHFT_TIMEOUT_ENVS = {
    "timeout": "TORCHFT_TIMEOUT_SEC",
    "quorum_timeout": "TORCHFT_QUORUM_TIMEOUT_SEC",
    "connect_timeout": "TORCHFT_CONNECT_TIMEOUT_SEC",
}
_START_LIGHTHOUSE = (
    "start one with `lightning-fsdp lighthouse --min-replicas 1` (or torchft's `torchft_lighthouse --min_replicas 1`)"
    f" and export the {LIGHTHOUSE_ENV}=http://<host>:<port> it serves on, or pass"
    " `fault_tolerance={'lighthouse': 'http://head-node:29510'}`"
)


class FaultToleranceError(RuntimeError):
    """Fault tolerance cannot go on in this group: the lighthouse is gone or unreachable, no quorum formed within
    ``quorum_timeout``, or too many steps in a row were not committed. The group should exit (its launcher may
    restart it, and it heals from a live group when it rejoins)."""


@dataclass(frozen=True)
class FaultTolerance:
    """Per-step fault tolerance across replica groups (torchft).

    Each field left ``None`` is read from the environment (see the module's table). Timeouts are in seconds.

    Args:
        replica_id: this group's number in ``[0, num_replica_groups)``; default ``$REPLICA_GROUP_ID``.
        num_replica_groups: how many groups the job has at most; default ``$NUM_REPLICA_GROUPS``.
        lighthouse: the lighthouse's ``http://host:port``; default ``$TORCHFT_LIGHTHOUSE``.
        min_replicas: groups needed to commit a step.
        timeout: bound of a cross-group all-reduce, the vote and a heal transfer.
        quorum_timeout: bound of the wait for a quorum; longer than a step.
        connect_timeout: bound of connecting to the lighthouse and the group's manager.
        max_uncommitted_steps: raise after more than this many votes in a row that did not commit (None: never).
        init_sync: let torchft copy a primary group's state to the others at step 0 (off: every group must start
            from the same seed or checkpoint).
    """

    replica_id: Optional[int] = None
    num_replica_groups: Optional[int] = None
    lighthouse: Optional[str] = None
    min_replicas: int = 1
    timeout: float = 60.0
    quorum_timeout: float = 60.0
    connect_timeout: float = 10.0
    max_uncommitted_steps: Optional[int] = None
    init_sync: bool = False

    def delta(self, name: str) -> timedelta:
        """One of the three timeouts (``"timeout"``, ``"quorum_timeout"``, ``"connect_timeout"``) as the
        ``timedelta`` torchft takes."""
        return timedelta(seconds=float(getattr(self, name)))


FaultToleranceInput = Union[None, FaultTolerance, Mapping[str, Any]]
_FIELDS = tuple(f.name for f in fields(FaultTolerance))
_ALLOWED = "None (off), a lightning_fsdp.FaultTolerance, or a dict of its fields (" + ", ".join(_FIELDS) + ")"


def parse_fault_tolerance(value: Any, environ: Optional[Mapping[str, str]] = None, *,
                          sharding_strategy: Any = None) -> Optional[FaultTolerance]:
    """Check ``fault_tolerance`` and fill its ``None`` fields from ``environ`` (default: ``os.environ``); refuse a
    ``sharding_strategy`` that replicates inside a group.

    Returns ``None`` (off) or a :class:`FaultTolerance` whose ``replica_id``, ``num_replica_groups`` and
    ``lighthouse`` are set. Raises ``TypeError``/``ValueError`` naming the field, and ``ModuleNotFoundError`` when
    torchft is not installed. The lighthouse is not contacted here (that happens once processes are up)."""
    if value is None:
        return None
    _check_sharding(sharding_strategy)
    env = os.environ if environ is None else environ
    if isinstance(value, Mapping):
        unknown = sorted(str(k) for k in value if k not in _FIELDS)
        if unknown:
            raise TypeError(bad_argument(
                "fault_tolerance", dict(value), _ALLOWED, f"Drop or rename {', '.join(map(repr, unknown))}.",
                problem=f"Unknown field(s) {', '.join(map(repr, unknown))}",
            ))
        value = FaultTolerance(**value)
    elif not isinstance(value, FaultTolerance):
        raise TypeError(bad_argument(
            "fault_tolerance", value, _ALLOWED,
            "Pass e.g. `fault_tolerance={'num_replica_groups': 2, 'lighthouse': 'http://head-node:29510'}`.",
        ))
    num_groups = _count("num_replica_groups", value.num_replica_groups, env, NUM_REPLICA_GROUPS_ENV, minimum=1)
    replica_id = _count("replica_id", value.replica_id, env, REPLICA_ID_ENV, minimum=0)
    if replica_id >= num_groups:
        raise ValueError(bad_argument(
            "fault_tolerance.replica_id", replica_id, f"an int in [0, {num_groups}) for num_replica_groups={num_groups}",
            f"Number the groups 0 to {num_groups - 1} (set {REPLICA_ID_ENV} per group), or raise num_replica_groups.",
        ))
    _check_int("min_replicas", value.min_replicas, 1, num_groups,
               "At least one group must take part in a step; more than all groups can never commit.")
    for name in ("timeout", "quorum_timeout", "connect_timeout"):
        _check_seconds(name, getattr(value, name))
    if value.max_uncommitted_steps is not None:
        _check_int("max_uncommitted_steps", value.max_uncommitted_steps, 0, None,
                   "Pass None to never give up, or e.g. 10.")
    if not isinstance(value.init_sync, bool):
        raise TypeError(bad_argument("fault_tolerance.init_sync", value.init_sync, "True or False",
                                     "Pass `init_sync=True` only when the groups do not start from the same seed."))
    lighthouse = _lighthouse(value.lighthouse, env)
    resolved = replace(value, replica_id=replica_id, num_replica_groups=num_groups, lighthouse=lighthouse)
    _warn_torchft_overrides(resolved, env)
    require_torchft()
    return resolved


def _check_sharding(sharding_strategy: Any) -> None:
    """Refuse a replicate axis inside a replica group: the groups themselves are the replicate axis, and the hook
    that averages across them sits on the reduce-scatter of a 1-D shard mesh."""
    name = getattr(sharding_strategy, "value", sharding_strategy)
    if name in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        raise ValueError(bad_argument(
            "sharding_strategy", name, "'FULL_SHARD' or 'SHARD_GRAD_OP' under fault_tolerance",
            "Use sharding_strategy='FULL_SHARD' in each group and launch one group per replica (its own torchrun or"
            " job, fault_tolerance.replica_id set per group): the replica groups are the replicate axis.",
            problem="Hybrid sharding replicates inside a group, and fault_tolerance replicates across groups",
        ))


def require_torchft() -> None:
    """Raise, with the install line, when torchft cannot be imported (checked without importing it: its import
    starts threads and pulls in opentelemetry)."""
    if importlib.util.find_spec("torchft") is None:
        raise ModuleNotFoundError(
            "`fault_tolerance` needs torchft, which is not installed. HINT: pip install 'lightning-fsdp[ft]' (or"
            " `pip install torchft==0.2.0`), or pass `fault_tolerance=None`.",
            name="torchft",
        )


def unreachable_lighthouse(address: str, seconds: float, error: BaseException) -> str:
    """The message for a lighthouse that did not answer within ``connect_timeout``."""
    return (
        f"The lighthouse at {address} did not answer within connect_timeout={seconds:g} s ({error})."
        f" HINT: {_START_LIGHTHOUSE}; check that this host can reach it (host name, port, firewall)."
    )


def _count(name: str, value: Any, env: Mapping[str, str], variable: str, *, minimum: int) -> int:
    argument = f"fault_tolerance.{name}"
    if value is None:
        raw = env.get(variable)
        if raw is None or not raw.strip():
            raise ValueError(bad_argument(
                argument, None, f"an int >= {minimum}, or the environment variable {variable}",
                f"Set {variable} in each group's environment (e.g. `{variable}=0 torchrun ...`) or pass"
                f" `fault_tolerance={{{name!r}: {max(minimum, 1)}}}`.",
                problem=f"It is not given and {variable} is not set",
            ))
        try:
            value = int(raw.strip())
        except ValueError:
            raise ValueError(bad_argument(
                argument, raw, f"an int >= {minimum}", f"Set {variable} to a whole number, e.g. {variable}=0.",
                problem=f"The environment variable {variable}={raw!r} is not a whole number",
            )) from None
        if value < minimum:
            raise ValueError(bad_argument(argument, value, f"an int >= {minimum}", f"Set {variable} to {minimum} or more.",
                                          problem=f"It comes from the environment variable {variable}"))
        return value
    _check_int(name, value, minimum, None, f"Pass e.g. `{name}={max(minimum, 1)}`.")
    return value


def _check_int(name: str, value: Any, low: int, high: Optional[int], fix: str) -> None:
    allowed = f"an int in [{low}, {high}]" if high is not None else f"an int >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(bad_argument(f"fault_tolerance.{name}", value, allowed, fix))
    if value < low or (high is not None and value > high):
        raise ValueError(bad_argument(f"fault_tolerance.{name}", value, allowed, fix))


def _check_seconds(name: str, value: Any) -> None:
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if is_number and math.isfinite(value) and value > 0:
        return
    raise (ValueError if is_number else TypeError)(bad_argument(
        f"fault_tolerance.{name}", value, "a number of seconds (int or float) greater than 0",
        f"Pass e.g. `{name}={FaultTolerance.__dataclass_fields__[name].default:g}`.",
    ))


def _lighthouse(value: Any, env: Mapping[str, str]) -> str:
    source = "argument"
    if value is None:
        value, source = env.get(LIGHTHOUSE_ENV) or None, f"environment variable {LIGHTHOUSE_ENV}"
    allowed = "an address 'http://host:port' (or https)"
    if value is None:
        raise ValueError(bad_argument("fault_tolerance.lighthouse", None, allowed, _START_LIGHTHOUSE + ".",
                                      problem=f"It is not given and {LIGHTHOUSE_ENV} is not set"))
    if not isinstance(value, str):
        raise TypeError(bad_argument("fault_tolerance.lighthouse", value, allowed, _START_LIGHTHOUSE + "."))
    try:
        parts = urlsplit(value.strip())
        port = parts.port
    except ValueError:
        parts, port = None, None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname or port is None:
        raise ValueError(bad_argument(
            "fault_tolerance.lighthouse", value, allowed,
            "Write the scheme and the port, e.g. 'http://head-node:29510' (the address the lighthouse prints).",
            problem=f"It came from the {source}" if source != "argument" else "",
        ))
    return value.strip()


def _warn_torchft_overrides(ft: FaultTolerance, env: Mapping[str, str]) -> None:
    for name, variable in _TORCHFT_TIMEOUT_ENVS.items():
        raw = env.get(variable)
        if raw is not None and raw.strip() and raw.strip() != f"{getattr(ft, name):g}":
            warnings.warn(
                f"{variable}={raw!r} is set and torchft lets it override `fault_tolerance.{name}="
                f"{getattr(ft, name):g}`. HINT: unset {variable}, or pass the same value to both.",
                stacklevel=3,
            )
