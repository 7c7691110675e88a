"""The base layer: what every other layer may use, and which uses none of them.

- ``compat``: every name torch and Lightning do not export publicly, and every version gate, in one place;
- ``errors``: the one way to write a bad-argument message (argument, value, allowed values, fix);
- ``failures``: collective failures, turned into one clear error on every rank;
- ``names``: dotted names resolved to objects, including classes of the running script;
- ``per_world``: objects built once per default process group and shared (device meshes);
- ``process_exit``: what must run before the interpreter exits (background saves, process groups).
- ``secrets``: which ``storage_options`` are credentials, and how they are masked wherever options are shown.

May import: torch, Lightning, the standard library. Nothing of ``lightning_fsdp`` outside ``_base``.
"""
