"""Graph passes: pure functions ir.Model -> SurgeryResult, one rewrite per module.

Each module ends with `PASS = register(Pass(name, apply, switch))`; importing this package imports every
module in it, so a new pass is one new module: the switchboard and the history know it by its name.
"""

import importlib
import pkgutil

from surgery.passes.ablate import BRANCHES, MODES, ablate
from surgery.passes.common import PASSES, Change, Fix, Pass, SurgeryResult, register
from surgery.passes.compensate import compensate
from surgery.passes.fuse import fuse
from surgery.passes.parallel import parallelize

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["BRANCHES", "MODES", "PASSES", "Change", "Fix", "Pass", "SurgeryResult", "compensate", "fuse", "parallelize", "ablate", "register"]
