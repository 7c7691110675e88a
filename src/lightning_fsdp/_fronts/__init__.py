"""What the two fronts (``lightning_fsdp.fabric``, ``lightning_fsdp.trainer``) share, and how the package plugs into
Lightning: ``mixin`` (the strategy code both fronts have), ``registry`` (the strategy names), ``dropin`` (counting as
Lightning's ``FSDPStrategy`` at its ``isinstance`` sites), ``patching`` (wrapping a Lightning function once),
``fabric_load`` (``Fabric.load``'s ``weights_only`` on every Lightning version, and ``storage_options``),
``last_checkpoint`` (the Trainer's ``ckpt_path="last"`` in a bucket), ``callback_filesystem`` (the strategy's
``storage_options`` in a ``ModelCheckpoint``'s filesystem).

May import: every layer below the fronts (features, checkpoint, engine, base) and Lightning. The fronts themselves
import this package; it imports them only inside functions that run after both are loaded.
"""
