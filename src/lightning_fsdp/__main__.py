"""``python -m lightning_fsdp``: the ``lightning-fsdp`` command (see :mod:`lightning_fsdp.cli`)."""

from lightning_fsdp.cli import main

raise SystemExit(main())
