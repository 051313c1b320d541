"""Settings a pipeline keeps in its repository: `[tool.fuser]` in the nearest pyproject.toml.

    [tool.fuser]
    target = "onnxruntime"
    disable = ["log-sum-exp"]
    rules = ["tools/our_rules.py"]        # relative to the pyproject.toml
    atol = 1e-4
    rtol = 1e-3
    seed = 0
    check-runs = 3
    on-mismatch = "fail"
    dims = { batch = 8 }
    input-shapes = { image = [1, 3, 224, 224] }
    input-ranges = { token_ids = [0, 30000] }

Flags on the command line override these.
"""

from __future__ import annotations

import sys
from pathlib import Path

from fuser.errors import UsageError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

# key -> (expected type, commands it applies to)
KEYS: dict[str, tuple[type | tuple, tuple[str, ...]]] = {
    "target": (str, ("optimize", "check")),
    "enable": (list, ("optimize", "check")),
    "disable": (list, ("optimize", "check")),
    "rules": (list, ("optimize", "check", "rules")),
    "atol": ((int, float), ("optimize", "compare")),
    "rtol": ((int, float), ("optimize", "compare")),
    "seed": (int, ("optimize", "compare")),
    "check-runs": (int, ("optimize", "compare")),
    "on-mismatch": (str, ("optimize",)),
    "dims": (dict, ("optimize", "compare")),
    "input-shapes": (dict, ("optimize", "compare")),
    "input-ranges": (dict, ("optimize", "compare")),
}
# config key -> the click parameter it sets
PARAMETERS = {
    "rules": "rule_files",
    "check-runs": "runs",
    "on-mismatch": "on_mismatch",
    "input-shapes": "shapes",
    "input-ranges": "ranges",
}


def find_pyproject(start: Path) -> Path | None:
    for folder in [start, *start.parents]:
        candidate = folder / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def load_settings(start: Path) -> tuple[Path | None, dict]:
    path = find_pyproject(start.resolve())
    if path is None:
        return None, {}
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as error:
        raise UsageError(f"{path}: cannot read [tool.fuser]: {error}") from error
    settings = data.get("tool", {}).get("fuser", {})
    if not isinstance(settings, dict):
        raise UsageError(f"{path}: [tool.fuser] must be a table")
    for key, value in settings.items():
        if key not in KEYS:
            raise UsageError(f"{path}: unknown key '{key}' in [tool.fuser] (known: {', '.join(sorted(KEYS))})")
        expected = KEYS[key][0]
        if not isinstance(value, expected) or isinstance(value, bool):
            raise UsageError(f"{path}: [tool.fuser] {key} has the wrong type ({type(value).__name__})")
    return path, settings


def default_map(start: Path) -> dict[str, dict]:
    """click's default_map built from [tool.fuser]: command -> parameter -> default."""
    path, settings = load_settings(start)
    defaults: dict[str, dict] = {"optimize": {}, "check": {}, "compare": {}, "rules": {}}
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
        for command in KEYS[key][1]:
            defaults[command][parameter] = value
    return defaults
