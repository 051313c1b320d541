"""Where rules come from: the built-in `fuser.rules` package, rule files, installed plugins.

A rule file is any Python file; every `Rule` object it defines at module level is
registered, in definition order. Installed plugins expose rules through the
`fuser.rules` entry-point group: an entry point may name a Rule, a list of Rules, or a
module holding Rules.
"""

from __future__ import annotations

import fnmatch
import importlib
import importlib.util
import pkgutil
import sys
import traceback
import types
from importlib.metadata import entry_points
from pathlib import Path

from fuser.errors import UsageError
from fuser.rule import TARGETS, Rule

ENTRY_POINT_GROUP = "fuser.rules"


def rules_in(namespace) -> list[Rule]:
    if isinstance(namespace, Rule):
        return [namespace]
    if isinstance(namespace, (list, tuple)):
        return [r for item in namespace for r in rules_in(item)]
    if isinstance(namespace, types.ModuleType):
        return [v for v in vars(namespace).values() if isinstance(v, Rule)]
    return []


def builtin_rules() -> list[Rule]:
    """The rules shipped in `fuser.rules`, in the package's ORDER (rules/__init__.py); a module
    missing from it comes last, in name order."""
    package = importlib.import_module("fuser.rules")
    names = [info.name for info in pkgutil.iter_modules(package.__path__) if not info.name.startswith("_")]
    position = {name: index for index, name in enumerate(package.ORDER)}
    names.sort(key=lambda name: (position.get(name, len(position)), name))
    return [r for name in names for r in rules_in(importlib.import_module(f"fuser.rules.{name}"))]


def load_rule_file(path: str | Path) -> list[Rule]:
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"rule file {path}: no such file")
    module_name = f"fuser_user_rules_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise UsageError(f"rule file {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    folder = str(path.resolve().parent)
    before = set(sys.modules)
    sys.path.insert(0, folder)  # its own modules beside it import, as a script's do
    try:
        spec.loader.exec_module(module)
    except Exception as error:  # noqa: BLE001 - the user's file: report, don't crash
        raise UsageError(f"rule file {_where(path, error)}: {type(error).__name__}: {error}") from error
    finally:
        sys.path.remove(folder)
        _forget_neighbours(folder, before)
    found = rules_in(module)
    if not found:
        raise UsageError(f"rule file {path}: defines no rules (decorate functions with @fuser.rule)")
    return found


def _forget_neighbours(folder: str, before: set[str]) -> None:
    """Take the modules a rule file imported from its own folder out of sys.modules (the rule
    file keeps them): another folder's rule file may have a module of the same name."""
    for name in set(sys.modules) - before:
        where = getattr(sys.modules[name], "__file__", None)
        if where and Path(where).resolve().parent == Path(folder):
            del sys.modules[name]


def _where(path: Path, error: BaseException) -> str:
    """`path`, with the line of it the error came from (the innermost one in the file)."""
    if isinstance(error, SyntaxError) and error.lineno:
        return f"{path}:{error.lineno}"
    resolved = path.resolve()
    frames = traceback.extract_tb(error.__traceback__)
    lines = [frame.lineno for frame in frames if Path(frame.filename).resolve() == resolved]
    return f"{path}:{lines[-1]}" if lines else str(path)


def plugin_rules() -> list[Rule]:
    found: list[Rule] = []
    for entry in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            found.extend(rules_in(entry.load()))
        except Exception as error:  # noqa: BLE001 - a broken plugin must not break fuser
            raise UsageError(f"rule plugin '{entry.name}' failed to load: {error}") from error
    return found


def all_rules(rule_files: list[str | Path] = ()) -> list[Rule]:
    # The user's own rules come first: for a node several rules could rewrite, theirs win.
    rules = [r for path in rule_files for r in load_rule_file(path)] + plugin_rules() + builtin_rules()
    seen: dict[str, Rule] = {}
    for candidate in rules:
        if candidate.name in seen and seen[candidate.name] is not candidate:
            raise UsageError(
                f"two rules are named '{candidate.name}' ({seen[candidate.name].source} and {candidate.source})"
            )
        seen[candidate.name] = candidate
    return rules


def select(rules: list[Rule], target: str = "onnx", enable: list[str] = (), disable: list[str] = ()) -> list[Rule]:
    """Rules for `target`: the portable ones always, onnxruntime's only for that target.

    enable/disable name rules, or shell-style patterns of names ('nchwc-*'). Naming a rule
    beats a pattern: disable=['nchwc-*'], enable=['nchwc-pool'] keeps that one rule.
    """
    if target not in TARGETS:
        raise UsageError(f"unknown target '{target}'; choose one of: {', '.join(TARGETS)}")
    names = [r.name for r in rules]
    enabled, disabled = _expand(enable, names), _expand(disable, names)
    named_on = set(enable) - set(disable)
    chosen = []
    for candidate in rules:
        if candidate.target == "onnxruntime" and target != "onnxruntime":
            continue
        on = candidate.enabled_by_default or candidate.name in enabled
        if candidate.name in disabled and candidate.name not in named_on:
            on = False
        if on:
            chosen.append(candidate)
    return chosen


def left_out(
    rules: list[Rule], target: str = "onnx", enable: list[str] = (), disable: list[str] = ()
) -> dict[str, str]:
    """Why select() leaves out those of `rules` that `disable` does not name: {name: reason}."""
    names = [r.name for r in rules]
    chosen = {r.name for r in select(rules, target, enable, disable)}
    disabled = _expand(disable, names) - (set(enable) - set(disable))
    reasons = {}
    for candidate in rules:
        if candidate.name in chosen or candidate.name in disabled:
            continue
        if candidate.target == "onnxruntime" and target != "onnxruntime":
            reasons[candidate.name] = "onnxruntime's rule (target='onnxruntime')"
        else:
            reasons[candidate.name] = "off by default (enable= names it)"
    return reasons


def _expand(patterns, names: list[str]) -> set[str]:
    found: set[str] = set()
    for pattern in patterns:
        matching = fnmatch.filter(names, pattern)
        if not matching:
            raise UsageError(f"unknown rule '{pattern}' (see `fuser rules`)")
        found.update(matching)
    return found
