"""One replica group's part in fault tolerance: its torchft Manager, the cross-group average, the per-step vote.

A replica group is one torch world that shards the model with FSDP2. :class:`ReplicaGroup` joins it to the others:

- **setup** (every rank of the group, collectively): group rank 0 checks that the lighthouse answers within
  ``connect_timeout`` and starts a fresh ``TCPStore`` on a free port for this attempt; the port is broadcast over the
  group as a tensor. A fresh store, not the launcher's: torchft's Manager keeps its server's address in the store
  unprefixed, and torchrun's store outlives a restarted group, so a restarted rank could read the dead attempt's
  address. Then each rank builds its ``torchft.Manager`` (rank 0's also talks to the lighthouse) with a cross-group
  process group of torchft's (gloo on CPU, NCCL on CUDA) that the Manager reconfigures at each new quorum.
- :meth:`ReplicaGroup.install`: an all-reduce hook on every FSDP unit (``FSDPModule.set_all_reduce_hook``). FSDP
  calls it on each unit's reduce-scatter output, before its own division by the group size, so the groups average
  gradient shards, not full gradients, and clipping afterwards sees averaged gradients.
- :meth:`ReplicaGroup.begin_window` once per optimizer step (per accumulation window): starts the quorum, which runs
  in torchft's thread while the forward runs. :meth:`ReplicaGroup.commit` after the last backward: the vote; step
  the optimizer only when it is True.
- A peer that dies mid-step makes the cross-group all-reduce fail; torchft then turns every later all-reduce of the
  step into a no-op, so the hook raises :class:`StepAborted` to stop the wasted backward. :meth:`ReplicaGroup.aborting`
  catches it, resets FSDP's iteration state (``reset_iter_state``), drops the gradients, and the vote is False.
- A quorum that fails (the lighthouse gone, fewer than ``min_replicas`` groups within ``quorum_timeout``) is sticky
  in torchft and ends the group: :class:`~lightning_fsdp.engine.fault_tolerance.config.FaultToleranceError`.

torchft is imported when a group is built, never at import.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.nn import Module

from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp.engine.fault_tolerance.config import (
    FaultTolerance,
    FaultToleranceError,
    require_torchft,
    unreachable_lighthouse,
)

__all__ = ["ReplicaGroup", "StepAborted", "fsdp_roots"]

_OK, _UNREACHABLE, _FAILED = 0, 1, 2


class StepAborted(RuntimeError):
    """A cross-group all-reduce of this step failed (a peer group died): the rest of the backward is skipped and the
    step will not commit. :meth:`ReplicaGroup.aborting` handles it; it never reaches user code."""


class ReplicaGroup:
    """This group's torchft Manager and everything a step asks of it. Build it on every rank of the group, after the
    group's process group exists; ``group`` is that process group (default: the default one; none in a world of
    one process). ``transport`` makes the heal transport from the cross-group process group (e.g.
    ``lambda pg: HealTransport(pg, layout=...)``); without one, a group that would have to heal fails its step."""

    def __init__(
        self,
        config: FaultTolerance,
        *,
        group: Optional[Any] = None,
        transport: Optional[Callable[[Any], Any]] = None,
        backend: Optional[str] = None,
        device: Optional[torch.device] = None,
    ) -> None:
        require_torchft()
        from torchft.manager import Manager

        self.config = config
        self._group = group
        distributed = dist.is_available() and dist.is_initialized()
        self.group_rank = dist.get_rank(group) if distributed else 0
        self.group_size = dist.get_world_size(group) if distributed else 1
        self.device = device or _group_device(group if distributed else None, distributed)
        self.hook_calls = 0  # cross-group all-reduces started by the hook, for tests and diagnostics
        self.aborted_steps = 0
        self.committed: Optional[bool] = None  # the last vote
        self._roots: list[Module] = []
        self._window_open = False
        self._store: Optional[dist.TCPStore] = None
        self.manager: Any = None
        self.cross_group_pg: Any = None  # torchft's process group across the groups, reconfigured at each new quorum
        host = advertised_host(config.lighthouse)  # type: ignore[arg-type]
        status, port, error = _OK, 0, None
        if self.group_rank == 0:
            status, error = self._probe_lighthouse()
            if status == _OK:
                try:
                    self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False,
                                                timeout=config.delta("connect_timeout"))
                    port = self._store.port
                    self.manager = self._new_manager(Manager, host, port, transport, backend)
                except Exception as err:  # noqa: BLE001 - agreed over the group, then raised on every rank
                    status, error = _FAILED, err
        # Rank 0 builds its Manager first (the others read its server's address from the store): the others then
        # never wait on a store that rank 0 failed to fill.
        status, port = self._share(status, port)
        if status == _UNREACHABLE:
            self.close()
            raise FaultToleranceError(unreachable_lighthouse(
                config.lighthouse, config.connect_timeout,  # type: ignore[arg-type]
                error if error is not None else "group rank 0 could not connect; its log has the cause",
            )) from error
        if status == _FAILED:
            self.close()
            raise FaultToleranceError(
                f"Replica group {config.replica_id} could not start its torchft manager on group rank 0:"
                f" {error if error is not None else 'see the log of group rank 0'}. HINT: fix the error group rank 0"
                " reports; it is not about the lighthouse, which answered."
            ) from error
        if self.group_rank != 0:
            try:
                self.manager = self._new_manager(Manager, host, port, transport, backend)
            except Exception as err:
                raise self._fatal("the start of its torchft manager", err) from err

    # --- setup -------------------------------------------------------------------------------------------------

    def install(self, module: Module) -> None:
        """Put the cross-group average on every FSDP unit of ``module``, whose units must have one root."""
        roots = fsdp_roots(module)
        if len(roots) != 1:
            names = [name or "<the model>" for name, _ in roots]
            raise ValueError(bad_argument(
                "fault_tolerance", self.config, "a model with exactly one FSDP root (the unit all others sit in)",
                "Shard the model so that one module contains every unit (e.g. wrap the top-level module too).",
                problem=(f"The model has {len(roots)} FSDP roots ({', '.join(names)})" if roots else
                         "The model has no FSDP units"),
            ))
        for name, unit in module.named_modules():
            if not isinstance(unit, FSDPModule):
                continue
            try:
                unit.set_all_reduce_hook(self._average)
            except ValueError as err:  # torch refuses the hook on a unit with several parameter groups
                raise ValueError(bad_argument(
                    "fault_tolerance", self.config, "FSDP units with one parameter group each",
                    "Do not give this unit's parameters a mesh of their own (shard_placement_fn / per-parameter"
                    " meshes, e.g. MoE experts) while fault tolerance is on.",
                    problem=f"The unit {name or '<the model>'!r} cannot take the cross-group hook: {err}",
                )) from err
            # A unit that gets no gradient in one backward skips its reduce, and with it the hook: the groups' cross-
            # group all-reduces would then no longer pair up. Reduce zeros instead.
            unit.set_reduce_scatter_unused_params(True, recurse=False)
        self._roots.append(roots[0][1])

    # --- the step ----------------------------------------------------------------------------------------------

    def begin_window(self) -> None:
        """Start this optimizer step's quorum (once per accumulation window; a second call in the window does
        nothing). It runs in torchft's thread while the forward runs."""
        if self._window_open:
            return
        try:
            self.manager.start_quorum()
        except Exception as err:
            raise self._fatal("the start of a quorum", err) from err
        self._window_open = True
        self.committed = None

    @contextmanager
    def aborting(self) -> Iterator[None]:
        """Around a forward and backward: a step aborted by a failed cross-group all-reduce ends here, with FSDP's
        iteration state reset and the gradients dropped; the vote will be False."""
        try:
            yield
        except StepAborted as err:
            self.abort(err)
        except FaultToleranceError:
            self._reset()  # the group ends; FSDP is left clean for its exit (a final save, the hooks at exit)
            raise

    def abort(self, error: BaseException) -> None:
        """Give up this step after ``error`` interrupted its forward or backward."""
        self.aborted_steps += 1
        if self.manager.errored() is None:
            self.manager.report_error(error if isinstance(error, Exception) else RuntimeError(str(error)))
        self._reset()

    def _reset(self) -> None:
        for root in self._roots:
            root.reset_iter_state()  # type: ignore[operator]
            for param in root.parameters():
                param.grad = None

    def commit(self) -> bool:
        """The vote, after the window's last backward: True when every rank of the group finished the step and
        enough groups took part; only then step the optimizer (and the LR scheduler, and the step counter)."""
        if not self._window_open:
            raise RuntimeError("ReplicaGroup.commit() was called outside a window. HINT: call begin_window() at the"
                               " start of every optimizer step's window, before its first forward.")
        self._window_open = False
        try:
            committed = bool(self.manager.should_commit())
        except Exception as err:
            raise self._fatal("the vote on the step", err) from err
        self.committed = committed
        return committed

    def check_step(self, committed_steps: int) -> None:
        """The invariant: torchft counts as many committed steps as the loop (a gating bug shows at its first step,
        not as drift between groups)."""
        step = self.manager.current_step()
        if step != committed_steps:
            raise FaultToleranceError(
                f"Replica group {self.config.replica_id}: torchft has committed {step} steps and the training loop"
                f" {committed_steps}. HINT: step the optimizer (and count the step) only when `commit()` is True."
            )

    @property
    def window_open(self) -> bool:
        """Whether an optimizer step's window is open (its quorum asked, its vote not yet taken)."""
        return self._window_open

    @property
    def current_step(self) -> int:
        return self.manager.current_step()

    def state_dict(self) -> dict[str, int]:
        """torchft's counters for a checkpoint: ``step`` (the committed steps) and ``batches_committed``."""
        return {key: int(value) for key, value in self.manager.state_dict().items()}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Set torchft's counters from a checkpoint (checked by the caller), between windows. Groups restarted from
        the same checkpoint then meet at its step, and none heals from another; a group that loads an older one than
        its live peers heals from them at its next window."""
        if self._window_open:  # the quorum in flight was asked with the old step
            raise RuntimeError("ReplicaGroup.load_state_dict() was called inside a window. HINT: load the checkpoint"
                               " before the step's first forward (after `fabric.setup`, or between steps).")
        self.manager.load_state_dict({"step": int(state["step"]),
                                      "batches_committed": int(state["batches_committed"])})

    def participating_rank(self) -> Optional[int]:
        """This group's rank in the current quorum (None while it heals); waits for the quorum."""
        try:
            return self.manager.participating_rank()
        except Exception as err:
            raise self._fatal("waiting for the quorum", err) from err

    def register_state(self, key: str, load: Callable[[Any], None], produce: Callable[[], Any]) -> None:
        """Name a piece of state a healing group receives (``produce`` on the sender, ``load`` on the healer)."""
        self.manager.register_state_dict_fn(key, load, produce)

    def close(self) -> None:
        """Stop the manager's threads and server; the group leaves the quorum (idempotent)."""
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.shutdown(wait=True)
        self._store = None

    def __enter__(self) -> "ReplicaGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # --- inside ------------------------------------------------------------------------------------------------

    def _average(self, reduce_output: Tensor) -> None:
        manager = self.manager
        if manager.errored() is not None:
            raise _aborted(manager)
        self.hook_calls += 1
        try:
            from torch.distributed import ReduceOp

            work = manager.allreduce(reduce_output, reduce_op=ReduceOp.AVG)
        except Exception as err:  # the quorum's own failure, re-raised by torchft's wait for it
            raise self._fatal("the cross-group gradient average", err) from err
        work.wait()  # a failure is recorded in the manager, not raised
        if manager.errored() is not None:
            raise _aborted(manager)

    def _new_manager(self, manager_class: Any, host: str, port: int, transport: Optional[Callable[[Any], Any]],
                     backend: Optional[str]) -> Any:
        from torchft.process_group import ProcessGroupGloo, ProcessGroupNCCL

        config = self.config
        backend = backend or ("nccl" if self.device.type == "cuda" else "gloo")
        pg_class = ProcessGroupNCCL if backend == "nccl" else ProcessGroupGloo
        self.cross_group_pg = pg = pg_class(timeout=config.delta("timeout"))
        return manager_class(
            pg=pg,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=config.min_replicas,
            use_async_quorum=True,
            timeout=config.delta("timeout"),
            quorum_timeout=config.delta("quorum_timeout"),
            connect_timeout=config.delta("connect_timeout"),
            rank=self.group_rank,
            world_size=self.group_size,
            store_addr=host,
            store_port=port,
            lighthouse_addr=config.lighthouse,
            # torchft numbers the ranks of the whole job from the id's trailing digits, and appends a uuid per attempt.
            replica_id=f"lightning_fsdp_{config.replica_id}",
            hostname=host,
            checkpoint_transport=transport(pg) if transport is not None else _NoHealTransport(),
            init_sync=config.init_sync,
            max_retries=config.max_uncommitted_steps,
        )

    def _probe_lighthouse(self) -> tuple[int, Optional[BaseException]]:
        from torchft.coordination import LighthouseClient

        try:
            LighthouseClient(self.config.lighthouse, connect_timeout=self.config.delta("connect_timeout"))
        except Exception as err:  # noqa: BLE001 - torchft raises RuntimeError with the connect error's text
            return _UNREACHABLE, err
        return _OK, None

    def _share(self, status: int, port: int) -> tuple[int, int]:
        """Group rank 0's setup status and store port, to every rank (a tensor, nothing pickled)."""
        if self.group_size == 1:
            return status, port
        box = torch.tensor([status, port], dtype=torch.int64, device=self.device)
        dist.broadcast(box, group_src=0, group=self._group)
        return int(box[0]), int(box[1])

    def _fatal(self, phase: str, err: BaseException) -> FaultToleranceError:
        cause = getattr(err, "original_exception", err)
        text = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
        if isinstance(cause, TimeoutError):  # torchft's RPC timeouts say only "Timeout expired"
            text += f" (no quorum or answer within quorum_timeout={self.config.quorum_timeout:g} s)"
        config = self.config
        if "max_retries" in text:
            hint = (f"the group failed to commit more than max_uncommitted_steps={config.max_uncommitted_steps} steps"
                    " in a row; the log of each group says why (a peer died, a heal failed). Raise"
                    " `fault_tolerance.max_uncommitted_steps` to keep trying longer.")
        else:
            hint = (f"check that the lighthouse at {config.lighthouse} is running (start one with `lightning-fsdp"
                    f" lighthouse --min-replicas {config.min_replicas}`) and that at least min_replicas="
                    f"{config.min_replicas} groups are up; if a step takes longer than quorum_timeout="
                    f"{config.quorum_timeout:g} s, raise `fault_tolerance.quorum_timeout`.")
        return FaultToleranceError(
            f"Fault tolerance failed in {phase} (replica group {config.replica_id}, group rank {self.group_rank},"
            f" lighthouse {config.lighthouse}): {type(cause).__name__}: {text}. This group cannot go on and should"
            f" exit; its launcher may restart it, and it heals when it rejoins. HINT: {hint}"
        )


def _group_device(group: Any, distributed: bool) -> torch.device:
    """Where the setup broadcast's tensor lives: NCCL takes CUDA tensors only."""
    if distributed and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _aborted(manager: Any) -> StepAborted:
    cause = getattr(manager.errored(), "original_exception", manager.errored())
    return StepAborted(f"A cross-group all-reduce of this step failed ({cause}); the step will not commit. HINT: run"
                       " the forward and backward inside `ReplicaGroup.aborting()`, which skips the step and goes on.")


def fsdp_roots(module: Module) -> list[tuple[str, Module]]:
    """The FSDP units of ``module`` that sit in no other unit, with their names."""
    roots: list[tuple[str, Module]] = []
    inside: set[int] = set()
    for name, sub in module.named_modules():
        if id(sub) in inside or not isinstance(sub, FSDPModule):
            continue
        roots.append((name, sub))
        inside.update(id(m) for m in sub.modules())
    return roots


def advertised_host(lighthouse: str) -> str:
    """The name other groups reach this host by: its host name when it resolves, otherwise the address of the
    interface that routes to the lighthouse (a UDP socket's connect sends nothing)."""
    host = socket.gethostname()
    try:
        socket.getaddrinfo(host, None)
        return host
    except OSError:
        pass
    target = urlsplit(lighthouse)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((target.hostname or "127.0.0.1", target.port or 29510))
        return probe.getsockname()[0]


class _NoHealTransport:
    """Stands in for torchft's default transport, which unpickles what a peer sends: with no safe transport given,
    a group that would need to heal fails its step instead (the error names the fix)."""

    def metadata(self) -> str:
        return "lightning-fsdp:no-heal"

    def send_checkpoint(self, dst_ranks: Any, step: int, state_dict: Any, timeout: Any) -> None:
        raise FaultToleranceError(_NO_HEAL)

    def recv_checkpoint(self, src_rank: int, metadata: str, step: int, timeout: Any) -> Any:
        raise FaultToleranceError(_NO_HEAL)

    def disallow_checkpoint(self) -> None:
        pass

    def shutdown(self, wait: bool = True) -> None:
        pass


_NO_HEAL = ("A replica group needs to heal, and this ReplicaGroup was built without a heal transport. HINT: pass"
            " `transport=` (the strategy passes its own, which runs no pickled code); start every group from the same"
            " seed or checkpoint so that none heals at step 0.")
