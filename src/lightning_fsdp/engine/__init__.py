"""The engine: everything that turns a model into FSDP2 units, and knows nothing about Lightning's two fronts
or about files.

- ``core``: :class:`~lightning_fsdp.engine.core.FSDPEngine`, what both fronts call (set up, step, clip, sync);
- ``config``: every user argument turned into torch objects, validated once (policies, mesh, precision, ...);
- ``mesh``: process groups and DeviceMesh; ``policy``: the one policy language for wrapping and checkpointing;
- ``sharding``: every ``fully_shard`` decision (units, roots, order); ``resharding``, ``prefetch``: per-unit controls;
- ``meta_init``: meta-device materialization; ``activation_checkpointing``; ``precision``: the precision plugin;
- ``grads``: clipping over shards; ``at_rest``: every unit is sharded whenever user code runs;
- ``full_state_load``: a full state dict into the shards.

May import: ``lightning_fsdp._base``, torch. Never ``checkpoint``, the features or the fronts. A new parallel
dimension (tensor parallelism) goes here, beside ``sharding``.
"""
