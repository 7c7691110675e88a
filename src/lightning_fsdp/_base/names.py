"""Import the module of a dotted name given as a string (``"train.Block"``, ``"mypkg.init.init_fn"``).

A script run as ``python train.py`` (or by torchrun, or by Fabric's launcher, which re-runs it) is the module
``__main__``, not ``train``. Importing ``train`` from a strategy argument would run the whole script a second time,
inside the call that reads the argument, and give a second copy of every class in it, which no module of the model
is an instance of. So a name whose module is the running script's file name answers with ``__main__`` itself.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType


def import_module_of(module_name: str) -> ModuleType:
    """The module ``module_name``, or the running script when that is the script's own name. Raises what
    :func:`importlib.import_module` raises."""
    if module_name not in sys.modules:
        main = sys.modules.get("__main__")
        main_file = getattr(main, "__file__", None)
        if main is not None and main_file and "." not in module_name and Path(main_file).stem == module_name:
            return main
    return importlib.import_module(module_name)
