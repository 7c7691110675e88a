"""The strategy names this package puts into Lightning's registries, and what makes them usable on any device.

``import lightning_fsdp`` registers them for Fabric and the Trainer, overriding Lightning's own FSDP entries, so that
``Fabric(strategy="fsdp")`` and ``Trainer(strategy="fsdp")`` build our strategy.

Lightning's connectors refuse the *strings* ``"fsdp"`` (and the Trainer any name registered by its own FSDP class)
unless the accelerator is CUDA: "FSDP is only available on GPU". That is true of Lightning's FSDP1 strategy, not of
this one, which runs on CPU with gloo. :func:`accept_names_on_every_accelerator` teaches the connectors to build a
name that resolves to this package's strategy before that check runs; every other name, and every strategy
instance, meets the check as before. It is the only place that relies on Lightning's connector internals
(``_check_strategy_and_fallback`` and ``_strategy_flag``); ``tests/test_registry.py`` fails loudly if a Lightning
release changes them.
"""

from __future__ import annotations

from typing import Any

from lightning_fsdp._base.compat import CONNECTOR_STRATEGY_CHECK
from lightning_fsdp._fronts.patching import wrap_once

STRATEGY_NAMES = {
    "fsdp": ("Fully Sharded Data Parallel on FSDP2 (lightning-fsdp)", {}),
    "fsdp_cpu_offload": ("FSDP2 with parameters, gradients and optimizer state offloaded to CPU (lightning-fsdp)",
                         {"cpu_offload": True}),
    "hsdp": ("Hybrid sharding on FSDP2: shard within a node, replicate across nodes (lightning-fsdp)",
             {"sharding_strategy": "HYBRID_SHARD"}),
}

_OURS: set[type] = set()  # the strategy classes registered under these names: the fronts' `FSDPStrategy`s


def register_into(registry: Any, strategy_cls: type) -> None:
    _OURS.add(strategy_cls)
    for name, (description, init_params) in STRATEGY_NAMES.items():
        registry.register(name, strategy_cls, description=description, override=True, **init_params)


def accept_names_on_every_accelerator(connector_cls: type, registry: Any) -> None:
    """Make ``connector_cls`` build a registered name of this package's strategy before its GPU-only FSDP check."""

    def make(original: Any) -> Any:
        def check_strategy_and_fallback(self: Any) -> None:
            flag = self._strategy_flag
            if isinstance(flag, str) and _is_ours(registry, flag):
                # An instance, exactly what `_init_strategy` would build from the name a moment later.
                self._strategy_flag = registry.get(flag)
            original(self)

        return check_strategy_and_fallback

    wrap_once(connector_cls, CONNECTOR_STRATEGY_CHECK, make)


def _is_ours(registry: Any, name: str) -> bool:
    entry = registry[name] if name in registry else None
    return entry is not None and isinstance(entry["strategy"], type) and issubclass(entry["strategy"], tuple(_OURS))
