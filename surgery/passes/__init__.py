"""Graph passes: pure functions ir.Model -> SurgeryResult, one rewrite per module."""

from surgery.passes.common import Change, SurgeryResult
from surgery.passes.fuse import fuse
from surgery.passes.parallel import parallelize
from surgery.passes.project import BRANCHES, MODES, project

__all__ = ["BRANCHES", "MODES", "Change", "SurgeryResult", "fuse", "parallelize", "project"]
