"""litgpt's command line with one name rebound, as a user would run it (docs/guides/huggingface.md, "litgpt's scripts").

``python as_user.py finetune_lora CHECKPOINT_DIR --devices 2 ...`` runs litgpt's own script unchanged, except that the
``FSDPStrategy`` name its ``from lightning.fabric.strategies import FSDPStrategy`` line bound now means this package's
strategy: exactly what editing that one import would do. Under torchrun each rank runs this file.

``LITGPT_AS_USER_STRATEGY=ddp`` binds the name to a factory for Lightning's ``DDPStrategy`` instead (dropping the FSDP
keywords litgpt passes), for the reference rounding: the same script on the same ranks with plain data parallelism.
"""

import atexit
import os
import sys

import litgpt.finetune.adapter
import litgpt.finetune.full
import litgpt.finetune.lora
import litgpt.pretrain

SCRIPTS = (litgpt.finetune.full, litgpt.finetune.lora, litgpt.finetune.adapter, litgpt.pretrain)


class ddp_strategy:
    """Called with litgpt's FSDP keywords, gives Lightning's plain ``DDPStrategy``. A class (``isinstance`` needs one)
    whose instances are never made, so litgpt's ``isinstance(strategy, FSDPStrategy)`` answers False as for DDP.

    Two settings make DDP a fair reference where litgpt assumes FSDP: ``find_unused_parameters`` (the adapter's
    prompts get no gradient while its gating factor is still 0), and real initialization under litgpt's
    ``init_module(empty_init=True)``: FSDP initializes what it materializes, but DDP would leave the weights that the
    base checkpoint lacks (LoRA's, the adapter's) as uninitialized memory.
    """

    def __new__(cls, **fsdp_keywords):
        from lightning.fabric.strategies import DDPStrategy

        class InitializingDDP(DDPStrategy):
            def module_init_context(self, empty_init=None):
                return super().module_init_context(empty_init=False)

        return InitializingDDP(find_unused_parameters=True)


def _destroy_process_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


if os.environ.get("LITGPT_AS_USER_STRATEGY", "ours") == "ddp":
    strategy = ddp_strategy
    # Lightning's DDPStrategy leaves its gloo group to the interpreter's exit, where a background thread of it was
    # seen to abort a rank ("terminate called without an active exception", exit -6) in 2 of about 20 runs. This
    # package's strategy tears its group down itself; the reference run is given the same clean end.
    atexit.register(_destroy_process_group)
else:
    from lightning_fsdp.fabric import FSDPStrategy as strategy

for script in SCRIPTS:
    script.FSDPStrategy = strategy  # exactly what the edited import line would bind

if __name__ == "__main__" and len(sys.argv) > 1:
    from litgpt.__main__ import main

    main()
