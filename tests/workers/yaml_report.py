"""A Trainer callback for ``tests/test_docs.py``'s YAML snippets: what the strategy did to the model, as JSON.

Added to a LightningCLI run with ``--trainer.callbacks+=yaml_report.StrategyReport``; each rank writes
``$LFSDP_YAML_REPORT.rank<N>.json`` when training starts, after the strategy has sharded the model, so the test can
check the effect of each option of the YAML (not only that the run exits 0).
"""

from __future__ import annotations

import json
import os

from lightning.pytorch.callbacks import Callback
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

from lightning_fsdp._base.compat import CheckpointWrapper


def _class_name(unit) -> str:
    """The user's class of a unit: fully_shard renames it to FSDP<Class>; a checkpointed block sits in a wrapper."""
    inner = unit._checkpoint_wrapped_module if isinstance(unit, CheckpointWrapper) else unit
    return type(inner).__name__.removeprefix("FSDP")


class StrategyReport(Callback):
    def on_train_start(self, trainer, pl_module) -> None:
        strategy = trainer.strategy
        mesh = strategy.device_mesh
        units = [m for m in pl_module.modules() if isinstance(m, FSDPModule)]
        groups = [u._get_fsdp_state()._fsdp_param_group for u in units]  # test-only look at FSDP's own record
        report = {
            "strategy": type(strategy).__module__ + "." + type(strategy).__name__,
            "mesh_shape": list(mesh.shape),
            "mesh_dim_names": list(mesh.mesh_dim_names or ()),
            "precision": trainer.precision_plugin.precision,
            "unit_classes": sorted({_class_name(u) for u in units}),
            "offloaded_units": sum(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups if g is not None),
            "units_with_params": sum(g is not None for g in groups),
            "checkpointed_classes": sorted({type(m._checkpoint_wrapped_module).__name__ for m in pl_module.modules()
                                            if isinstance(m, CheckpointWrapper)}),
            "state_dict_type": strategy.config.state_dict_type if hasattr(strategy, "config") else None,
        }
        path = f"{os.environ['LFSDP_YAML_REPORT']}.rank{trainer.global_rank}.json"
        with open(path, "w") as f:
            json.dump(report, f)
