"""Moving checkpoint bytes: ``readers`` and ``writers`` (every format, streamed), ``full_writer`` (one full file,
tensor by tensor), ``atomic`` (a save is committed whole or not at all), ``staging`` (what a background save copies
first), ``in_flight`` (background saves and their commit), ``memory`` (how much a stream may hold).

May import: ``checkpoint.integrity``, ``checkpoint.formats``, ``lightning_fsdp._base``, torch. Not the operations.
"""
