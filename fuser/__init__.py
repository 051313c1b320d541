"""fuser: operator fusion for ONNX models, with every rewrite checked in onnxruntime.

Public API for users and rule authors:

    fuser.optimize(model_or_path, ...) -> (onnx.ModelProto, Report)
    fuser.rule, fuser.op, fuser.var, fuser.const     to write rules
    fuser.Match, fuser.Builder, fuser.Decline        what a rule's function works with
"""

from importlib.metadata import PackageNotFoundError, version

from fuser.api import Report, find_opportunities, optimize
from fuser.match import Decline, Match
from fuser.model import Model
from fuser.pattern import const, op, var
from fuser.rule import Builder, Rule, rule

try:
    __version__ = version("fuser")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

__all__ = [
    "Builder",
    "Decline",
    "Match",
    "Model",
    "Report",
    "Rule",
    "const",
    "find_opportunities",
    "op",
    "optimize",
    "rule",
    "var",
]
