"""The built-in rules are tried in the one ordered list in rules/__init__.py (ORDER)."""

from __future__ import annotations

import importlib
import pkgutil

import fuser.rules
from fuser.registry import builtin_rules, rules_in


def _rule_modules() -> list[str]:
    return sorted(info.name for info in pkgutil.iter_modules(fuser.rules.__path__) if not info.name.startswith("_"))


def test_every_rule_module_is_listed_once():
    assert sorted(fuser.rules.ORDER) == _rule_modules()


def test_no_module_keeps_an_order_of_its_own():
    """A PRIORITY constant (the way rules were ordered before ORDER) would be silently ignored."""
    keeping = [name for name in _rule_modules() if hasattr(importlib.import_module(f"fuser.rules.{name}"), "PRIORITY")]
    assert keeping == []


def test_the_rules_come_in_the_listed_order():
    expected = [r.name for name in fuser.rules.ORDER for r in rules_in(importlib.import_module(f"fuser.rules.{name}"))]
    assert [r.name for r in builtin_rules()] == expected


def test_advice_comes_after_the_fusions_rooted_at_the_same_node():
    """residual-add-relu and nchwc-region report what the fusions left; tried before them, they
    would report patterns the fusions then rewrite."""
    names = [r.name for r in builtin_rules()]
    assert names.index("residual-add-relu") > names.index("fused-conv-residual")
    assert names.index("nchwc-region") > max(names.index("nchwc-conv"), names.index("nchwc-fused-conv"))
