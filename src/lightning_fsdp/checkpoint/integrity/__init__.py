"""That what is read is what was saved, and that every rank agrees when it is not.

- checksums, in parts: ``digests`` (the error, save ids, algorithms; the design note), ``sharded_write`` and
  ``sharded_read`` (DCP directories), ``zipfiles`` (full files and ``meta.pt``), ``verify`` (a whole checkpoint);
- ``safe_pickle``: the allow-list unpickler, the only way checkpoint files are unpickled;
- ``tree``: bounded walks over loaded data; ``agreement``: one error on every rank for a failure on any;
  ``write_errors``: a failed write turned into that error.

May import: ``checkpoint.formats``, ``lightning_fsdp._base``, torch. Not ``checkpoint.io`` nor the operations.
"""
