"""Graph passes: per-block rewrites with typed arguments, one pass per module, run by one driver.

Each module defines a Pass subclass and registers one instance (`register(...)`); importing this package imports
every module in it, so a new pass is one new module: the driver, the switchboard, the history and `inspect` know
it by its name (surgery.passes.common says what a pass declares, surgery.passes.driver what the driver does).
"""

import importlib
import pkgutil

from surgery.passes.ablate import BRANCHES, MODES, Ablation, ablate
from surgery.passes.common import PASSES, Change, Pass, SurgeryResult, register
from surgery.passes.compensate import COMPENSATE, Compensation, compensate
from surgery.passes.driver import apply_pass
from surgery.passes.fix import Fix
from surgery.passes.fuse import Fusion, fuse
from surgery.passes.parallel import parallelize

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["BRANCHES", "COMPENSATE", "MODES", "PASSES", "Ablation", "Change", "Compensation", "Fix", "Fusion", "Pass", "SurgeryResult",
           "ablate", "apply_pass", "compensate", "fuse", "parallelize", "register"]
