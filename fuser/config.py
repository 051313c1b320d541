"""Settings a pipeline keeps in its repository: `[tool.fuser]` in the nearest pyproject.toml.

    [tool.fuser]
    target = "onnxruntime"
    nchwc-block = 16                      # or "auto" (this machine's), 8
    disable = ["log-sum-exp"]
    rules = ["tools/our_rules.py"]        # relative to the pyproject.toml
    atol = 1e-4
    rtol = 1e-3
    seed = 0
    check-runs = 3
    on-mismatch = "fail"
    external-data = "auto"
    dims = { batch = 8 }
    input-shapes = { image = [1, 3, 224, 224] }
    input-ranges = { token_ids = [0, 30000] }
    fix-shapes = true                     # write the dims and input-shapes above into the model

Flags on the command line override these.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from fuser.blame import MISMATCH_ACTIONS
from fuser.context import NCHWC_CHOICES
from fuser.errors import UsageError
from fuser.model import EXTERNAL_DATA_MODES
from fuser.rule import TARGETS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# key -> (expected type, commands it applies to)
KEYS: dict[str, tuple[type | tuple, tuple[str, ...]]] = {
    "target": (str, ("optimize", "check", "explain")),
    "opset": (int, ("optimize", "check", "explain")),
    "nchwc-block": ((str, int), ("optimize", "check", "explain")),
    "enable": (list, ("optimize", "check", "explain")),
    "disable": (list, ("optimize", "check", "explain")),
    "rules": (list, ("optimize", "check", "rules", "explain")),
    "atol": ((int, float), ("optimize", "compare")),
    "rtol": ((int, float), ("optimize", "compare")),
    "seed": (int, ("optimize", "compare")),
    "check-runs": (int, ("optimize", "compare")),
    "on-mismatch": (str, ("optimize",)),
    "external-data": (str, ("optimize",)),
    "dims": (dict, ("optimize", "compare")),
    "input-shapes": (dict, ("optimize", "compare")),
    "input-ranges": (dict, ("optimize", "compare")),
    "fix-shapes": (bool, ("optimize",)),
}
# config key -> the click parameter it sets
PARAMETERS = {
    "rules": "rule_files",
    "check-runs": "runs",
    "on-mismatch": "on_mismatch",
    "external-data": "external_data",
    "input-shapes": "shapes",
    "input-ranges": "ranges",
    "nchwc-block": "nchwc_block",
    "fix-shapes": "fix_shapes",
}


def load_settings(start: Path) -> tuple[Path | None, dict]:
    """[tool.fuser] of the nearest pyproject.toml that has one (searching upwards)."""
    for folder in [start.resolve(), *start.resolve().parents]:
        path = folder / "pyproject.toml"
        if not path.is_file():
            continue
        try:
            data = tomllib.loads(path.read_text())
        except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
            raise UsageError(f"{path}: cannot read it: {error}") from error
        settings = data.get("tool", {}).get("fuser")
        if settings is None:
            continue
        if not isinstance(settings, dict):
            raise UsageError(f"{path}: [tool.fuser] must be a table")
        for key, value in settings.items():
            _validate(path, key, value)
        return path, settings
    return None, {}


def _validate(path: Path, key: str, value) -> None:
    if key not in KEYS:
        raise UsageError(f"{path}: unknown key '{key}' in [tool.fuser] (known: {', '.join(sorted(KEYS))})")
    expected = KEYS[key][0]

    def number(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool)

    good = isinstance(value, expected) and (expected is bool or not isinstance(value, bool))
    if good and key in ("enable", "disable", "rules"):
        good = all(isinstance(v, str) for v in value)
    elif good and key == "dims":
        good = all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value.values())
    elif good and key == "input-shapes":
        good = all(
            isinstance(v, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in v)
            for v in value.values()
        )
    elif good and key == "input-ranges":
        good = all(isinstance(v, list) and len(v) == 2 and all(number(d) for d in v) for v in value.values())
    elif good and key == "nchwc-block":
        good = str(value) in NCHWC_CHOICES
    if not good:
        raise UsageError(f"{path}: [tool.fuser] {key} has the wrong type or shape: {value!r}")
    wanted = _value_problem(key, value)
    if wanted is not None:  # said here, not as the flag it stands for ("Invalid value for '--target'")
        raise UsageError(f"{path}: [tool.fuser] {key} must be {wanted}, not {value!r}")


# The values a setting takes, where its type alone does not say (the flags' own choices and ranges).
CHOICES = {"target": TARGETS, "on-mismatch": MISMATCH_ACTIONS, "external-data": EXTERNAL_DATA_MODES}


def _value_problem(key: str, value) -> str | None:
    """What `value` of `key` must be, where it is not; None where it fits."""
    if key in CHOICES and value not in CHOICES[key]:
        return "one of " + ", ".join(CHOICES[key])
    least = {"opset": 1, "seed": 0, "check-runs": 1}.get(key)
    if least is not None and value < least:
        return f"{least} or more"
    if key in ("atol", "rtol") and not (math.isfinite(value) and value >= 0):
        return "a finite number, 0 or more"
    if key == "input-shapes" and any(d < 0 for dims in value.values() for d in dims):
        return "shapes of sizes 0 or more"
    if key == "input-ranges" and not all(math.isfinite(high - low) and low < high for low, high in value.values()):
        return "[low, high] pairs of finite numbers with low < high"
    return None


def default_map(start: Path) -> dict[str, dict]:
    """click's default_map built from [tool.fuser]: command -> parameter -> default."""
    path, settings = load_settings(start)
    defaults: dict[str, dict] = {"optimize": {}, "check": {}, "compare": {}, "rules": {}, "explain": {}}
    for key, value in settings.items():
        parameter = PARAMETERS.get(key, key)
        if key == "rules":
            value = [str((path.parent / v).resolve()) for v in value]
        elif key == "dims":
            value = [f"{name}={size}" for name, size in value.items()]
        elif key == "input-shapes":
            value = [f"{name}:{','.join(str(d) for d in dims)}" for name, dims in value.items()]
        elif key == "input-ranges":
            value = [f"{name}:{low},{high}" for name, (low, high) in value.items()]
        elif key == "nchwc-block":
            value = str(value)
        for command in KEYS[key][1]:
            defaults[command][parameter] = value
    return defaults
