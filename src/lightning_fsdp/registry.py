"""The strategy names this package puts into Lightning's registries.

``import lightning_fsdp`` registers them for Fabric and the Trainer, overriding Lightning's own FSDP entries, so that
``Fabric(strategy="fsdp")`` builds our strategy. Lightning's connector still refuses the *string* ``"fsdp"`` on a
CPU accelerator before it looks at the registry; pass an instance there.
"""

from __future__ import annotations

from typing import Any

STRATEGY_NAMES = {
    "fsdp": ("Fully Sharded Data Parallel on FSDP2 (lightning-fsdp)", {}),
    "fsdp_cpu_offload": ("FSDP2 with parameters, gradients and optimizer state offloaded to CPU (lightning-fsdp)",
                         {"cpu_offload": True}),
    "hsdp": ("Hybrid sharding on FSDP2: shard within a node, replicate across nodes (lightning-fsdp)",
             {"sharding_strategy": "HYBRID_SHARD"}),
}


def register_into(registry: Any, strategy_cls: type) -> None:
    for name, (description, init_params) in STRATEGY_NAMES.items():
        registry.register(name, strategy_cls, description=description, override=True, **init_params)
