"""Graph passes: pure functions ir.Model -> SurgeryResult, one rewrite per module."""

from surgery.passes.common import Change, Fix, SurgeryResult
from surgery.passes.compensate import compensate
from surgery.passes.fuse import fuse
from surgery.passes.parallel import parallelize
from surgery.passes.project import BRANCHES, MODES, project

__all__ = ["BRANCHES", "MODES", "Change", "Fix", "SurgeryResult", "compensate", "fuse", "parallelize", "project"]
