"""Precision for FSDP2: what each Lightning precision setting means for sharded training.

======================= ===================== ===================== ============== =============
precision               stored (sharded)      compute               grad reduce    loss scaling
======================= ===================== ===================== ============== =============
``32-true``             fp32                  fp32                  fp32           no
``bf16-mixed``          fp32                  bf16 (+ autocast)     fp32           no
``16-mixed``            fp32                  fp16 (+ autocast)     fp32           yes
``bf16-true``           bf16                  bf16                  bf16           no
``16-true``             fp16                  fp16                  fp16           no
======================= ===================== ===================== ============== =============

The mixed settings keep fp32 master weights in the shards and let ``MixedPrecisionPolicy`` cast the gathered
parameters; autocast on the real device type keeps numerically sensitive ops (softmax, norms) in fp32.
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import AbstractContextManager, ExitStack, nullcontext
from typing import Any, Literal, Optional, TypeVar, cast

import torch
import torch.distributed as dist
from lightning.fabric.plugins.precision import Precision
from lightning.fabric.utilities.types import Optimizable
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from torch.nn import Module
from torch.optim import Optimizer

from lightning_fsdp._base.compat import DtypeContextManager, amp_unscale_and_check_, convert_fp_tensor
from lightning_fsdp._base.errors import bad_argument
from lightning_fsdp._base.failures import explain_collective_failure

__all__ = ["FSDPPrecision", "PrecisionName", "SUPPORTED_PRECISION", "DTensorGradScaler", "as_fsdp_precision"]

PrecisionName = Literal["32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true"]
SUPPORTED_PRECISION: tuple[str, ...] = ("32-true", "bf16-mixed", "16-mixed", "bf16-true", "16-true")
# Lightning spells some settings in other ways; they mean the same thing here.
_ALIASES = {"32": "32-true", 32: "32-true", "bf16": "bf16-mixed", "16": "16-mixed", 16: "16-mixed"}


def _parse_precision(value: Any) -> str:
    name = _ALIASES.get(value, value) if isinstance(value, (str, int)) else value
    if name in SUPPORTED_PRECISION:
        return cast(str, name)
    raise ValueError(
        bad_argument(
            "precision", value, ", ".join(repr(p) for p in SUPPORTED_PRECISION),
            "Use e.g. `Fabric(precision='bf16-mixed')`.",
            problem="FSDP2 in this package has no such precision setting",
        )
    )


class DTensorGradScaler(torch.amp.GradScaler):
    """The default loss scaler for ``16-mixed``.

    Each rank only sees its own shards, so an overflow can show up on one rank alone. This scaler checks the local
    shards and all-reduces the found-inf flag over every rank, so all ranks skip (or take) the step together. It
    does so explicitly, rather than relying on DTensor's own reduction of the flag, so gradients that are plain
    tensors (parameters outside any unit's mesh) are covered too.
    """

    def _unscale_grads_(
        self, optimizer: Optimizer, inv_scale: Tensor, found_inf: Tensor, allow_fp16: bool
    ) -> dict[torch.device, Tensor]:
        grads: dict[tuple[torch.device, torch.dtype], list[Tensor]] = defaultdict(list)
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.grad is None:
                        continue
                    grad = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients. HINT: keep the parameters in fp32 and let"
                                         " `precision='16-mixed'` cast them for compute.")
                    grads[(grad.device, grad.dtype)].append(grad)
            total = torch.zeros_like(found_inf)
            for (device, _), tensors in grads.items():
                found = torch.zeros_like(found_inf, device=device)
                amp_unscale_and_check_(tensors, found, inv_scale.to(device))
                total += found.to(total.device)
            if dist.is_available() and dist.is_initialized():
                dist.all_reduce(total, op=dist.ReduceOp.MAX)
        found_inf.copy_(total)
        return {found_inf.device: found_inf}


class FSDPPrecision(Precision):
    """The precision plugin of :class:`lightning_fsdp.fabric.FSDPStrategy`.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``, ``"16-true"``.
        scaler: a loss scaler for ``"16-mixed"``; defaults to :class:`DTensorGradScaler`.
    """

    def __init__(self, precision: PrecisionName = "32-true", scaler: Optional[torch.amp.GradScaler] = None) -> None:
        self.precision = _parse_precision(precision)  # type: ignore[assignment]
        if scaler is not None and self.precision != "16-mixed":
            raise ValueError(
                bad_argument(
                    "scaler", scaler, "a scaler only with precision='16-mixed'",
                    "Drop the scaler; only fp16 mixed precision needs loss scaling.",
                )
            )
        self.device_type = "cpu"
        self._scaler = scaler

    # --- what the precision means ---------------------------------------------------------------------------

    @property
    def low_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision.startswith("bf16") else torch.float16

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the matrix multiplications run in (what a FLOP counter should count): the low dtype, except
        for ``32-true``."""
        return torch.float32 if self.precision == "32-true" else self.low_dtype

    @property
    def is_mixed(self) -> bool:
        return self.precision.endswith("-mixed")

    @property
    def is_true_half(self) -> bool:
        return self.precision in ("bf16-true", "16-true")

    def mixed_precision_policy(self) -> Optional[MixedPrecisionPolicy]:
        """The ``MixedPrecisionPolicy`` for ``fully_shard``; ``None`` when parameters keep their stored dtype."""
        if self.is_mixed:
            return MixedPrecisionPolicy(param_dtype=self.low_dtype, reduce_dtype=torch.float32)
        return None

    @property
    def scaler(self) -> Optional[torch.amp.GradScaler]:
        if self.precision == "16-mixed" and self._scaler is None:
            self._scaler = DTensorGradScaler(self.device_type)
        return self._scaler

    def set_device_type(self, device_type: str) -> None:
        """Called by the strategy once the device is known; autocast and the scaler follow it."""
        self.device_type = device_type

    # --- Lightning's precision-plugin interface --------------------------------------------------------------

    def convert_module(self, module: Module) -> Module:
        return module.to(dtype=self.low_dtype) if self.is_true_half else module

    def tensor_init_context(self) -> AbstractContextManager:
        return DtypeContextManager(self.low_dtype) if self.is_true_half else nullcontext()

    def module_init_context(self) -> AbstractContextManager:
        return self.tensor_init_context()

    def forward_context(self) -> AbstractContextManager:
        # Forward is where FSDP all-gathers parameters, and this context is the one hook Lightning wraps around it,
        # so a failed all-gather is explained here too.
        stack = ExitStack()
        stack.enter_context(explain_collective_failure("forward"))
        if self.is_mixed:
            stack.enter_context(torch.autocast(self.device_type, dtype=self.low_dtype))
        else:
            stack.enter_context(self.tensor_init_context())
        return stack

    def convert_input(self, data: Any) -> Any:
        if self.is_true_half:
            return apply_to_collection(data, Tensor, convert_fp_tensor, dst_type=self.low_dtype)
        return data

    def convert_output(self, data: Any) -> Any:
        # Outputs come back in the default dtype, as with Lightning's own plugins, so losses are reduced in fp32.
        if self.precision == "32-true":
            return data
        return apply_to_collection(data, Tensor, convert_fp_tensor, dst_type=torch.get_default_dtype())

    def backward(self, tensor: Tensor, model: Optional[Module], *args: Any, **kwargs: Any) -> None:
        # Lightning ignores what `pre_backward` returns, so the loss is scaled here, right before autograd runs.
        scaler = self.scaler
        if scaler is not None:
            tensor = scaler.scale(tensor)
        super().backward(tensor, model, *args, **kwargs)

    def optimizer_step(self, optimizer: Optimizable, **kwargs: Any) -> Any:
        scaler = self.scaler
        if scaler is None:
            return optimizer.step(**kwargs)
        step_output = scaler.step(optimizer, **kwargs)  # type: ignore[arg-type]
        scaler.update()
        return step_output

    def unscale_gradients(self, optimizer: Optimizer) -> None:
        scaler = self.scaler
        if scaler is not None:
            scaler.unscale_(optimizer)

    def state_dict(self) -> dict[str, Any]:
        scaler = self.scaler
        return scaler.state_dict() if scaler is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        scaler = self.scaler
        if scaler is not None and state_dict:
            scaler.load_state_dict(state_dict)


P = TypeVar("P", bound=FSDPPrecision)


def as_fsdp_precision(plugin: Optional[Precision], cls: type[P] = FSDPPrecision) -> P:  # type: ignore[assignment]
    """Translate whatever precision plugin Lightning's connector built into ours (``cls``: the front's class of it)."""
    if plugin is None:
        return cls()
    if isinstance(plugin, cls):
        return plugin
    name = getattr(plugin, "precision", None)
    if type(plugin) is Precision:
        name = "32-true"
    if name is None or name not in SUPPORTED_PRECISION and name not in _ALIASES:
        raise ValueError(
            bad_argument(
                "precision", plugin, ", ".join(repr(p) for p in SUPPORTED_PRECISION),
                "Use e.g. `Fabric(precision='bf16-mixed')` and no custom precision plugin.",
                problem=f"{type(plugin).__name__} cannot drive FSDP2 sharded training",
            )
        )
    # Keep the scaler the user configured (its init_scale, growth_interval, ...). torch's GradScaler also agrees on
    # overflow across ranks: DTensor reduces `found_inf` over the gradients' mesh.
    scaler = getattr(plugin, "scaler", None)
    return cls(name, scaler=scaler if isinstance(scaler, torch.amp.GradScaler) else None)
