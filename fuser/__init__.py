"""fuser: operator fusion for ONNX models, with every rewrite checked in onnxruntime.

Public API for users and rule authors:

    fuser.optimize(model_or_path, ...) -> (onnx.ModelProto, Report)
    fuser.CheckOptions                               the numerics check's settings
    fuser.rule, fuser.op, fuser.var, fuser.const     to write rules
    fuser.sweep, fuser.Change                        rules that look at a whole graph
    fuser.Match, fuser.Builder, fuser.Decline        what a rule's function works with
"""

import importlib.util
import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

from fuser.api import find_opportunities, optimize
from fuser.match import Decline, Match
from fuser.model import Model
from fuser.pattern import const, op, var
from fuser.report import Report
from fuser.rule import Builder, Change, Rule, rule, sweep
from fuser.verify import CheckOptions


def _source_checkout_rules() -> None:
    """Installed, the built-in rules/ folder is the `fuser.rules` package (pyproject's
    package-dir). Run from a source checkout (`python -m fuser` in the repository, where
    this folder shadows the installed package), map it here the same way."""
    folder = Path(__file__).resolve().parent.parent / "rules"
    if "fuser.rules" in sys.modules or not (folder / "__init__.py").is_file():
        return
    if importlib.util.find_spec("fuser.rules") is not None:
        return
    spec = importlib.util.spec_from_file_location(
        "fuser.rules", folder / "__init__.py", submodule_search_locations=[str(folder)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["fuser.rules"] = module
    spec.loader.exec_module(module)


_source_checkout_rules()

try:
    __version__ = version("onnx-fuser")
except PackageNotFoundError:  # running from a source tree without installing
    __version__ = "0+unknown"

__all__ = [
    "Builder",
    "Change",
    "CheckOptions",
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
    "sweep",
    "var",
]
