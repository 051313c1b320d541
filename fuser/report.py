"""The JSON report every command can write (`--report FILE`, `--format json`).

The schema is versioned (SCHEMA_VERSION) and described in REPORT_SCHEMA, a JSON Schema
document; tests validate real reports against it.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

SCHEMA_VERSION = 3  # 2: declines; 3: nchwc_block

_OUTPUT_CHECK = {
    "type": "object",
    "required": [
        "name",
        "dtype",
        "shape",
        "status",
        "max_abs_error",
        "max_rel_error",
        "fraction_out_of_tolerance",
        "worst_index",
        "rtol",
        "atol",
    ],
    "properties": {
        "name": {"type": "string"},
        "dtype": {"type": "string"},
        "shape": {"type": "array", "items": {"type": "integer"}},
        "status": {"enum": ["ok", "mismatch", "stabilized"]},
        "max_abs_error": {"type": "number"},
        "max_rel_error": {"type": "number"},
        "fraction_out_of_tolerance": {"type": "number"},
        "worst_index": {"type": ["array", "null"], "items": {"type": "integer"}},
        "rtol": {"type": "number"},
        "atol": {"type": "number"},
        "stabilized_elements": {"type": "integer"},
        "nonfinite_mismatches": {"type": "integer"},
    },
}

REPORT_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "fuser report",
    "type": "object",
    "required": ["schema_version", "command", "verdict", "exit_code", "versions"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "command": {"enum": ["optimize", "check", "compare"]},
        "verdict": {"enum": ["optimized", "unchanged", "work-found", "fully-fused", "match", "mismatch", "error"]},
        "exit_code": {"type": "integer"},
        "error": {"type": ["string", "null"]},
        "versions": {
            "type": "object",
            "required": ["fuser", "onnx", "onnxruntime"],
            "properties": {k: {"type": "string"} for k in ("fuser", "onnx", "onnxruntime")},
        },
        "input": {"$ref": "#/$defs/file"},
        "output": {"$ref": "#/$defs/file"},
        "target": {"type": "string"},
        "rules": {"type": "array", "items": {"type": "string"}},
        "nchwc_block": {
            "enum": [0, 8, 16],
            "description": "the block of onnxruntime's NCHWc layout the run wrote the model for (--nchwc-block); "
            "0: none (onnxruntime on the machine that ran 'auto' has no NCHWc kernels)",
        },
        "nodes_before": {"type": "integer"},
        "nodes_after": {"type": "integer"},
        "op_types_before": {"type": "object", "additionalProperties": {"type": "integer"}},
        "op_types_after": {"type": "object", "additionalProperties": {"type": "integer"}},
        "size_before": {"type": "integer", "description": "bytes on disk: the model file and its external data"},
        "size_after": {"type": "integer"},
        "rule_counts": {"type": "object", "additionalProperties": {"type": "integer"}},
        "rewrites": {"type": "array", "items": {"$ref": "#/$defs/rewrite"}},
        "blamed": {"type": "array", "items": {"$ref": "#/$defs/rewrite"}},
        "dropped": {"type": "array", "items": {"$ref": "#/$defs/rewrite"}},
        "evidence": {"type": ["string", "null"]},
        "opportunities": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["rule", "scope", "nodes"],
                "properties": {
                    "rule": {"type": "string"},
                    "scope": {"type": "string"},
                    "nodes": {"type": "array", "items": {"type": "string"}},
                },
            },
        },
        "skipped_rules": {"type": "object", "additionalProperties": {"type": "string"}},
        "notes": {"type": "array", "items": {"type": "string"}},
        "advice": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["rule", "scope", "nodes", "message"],
                "properties": {
                    "rule": {"type": "string"},
                    "scope": {"type": "string"},
                    "nodes": {"type": "array", "items": {"type": "string"}},
                    "message": {"type": "string"},
                },
            },
        },
        "declines": {"type": "array", "items": {"$ref": "#/$defs/decline"}},
        "numerics": {
            "type": ["object", "null"],
            "required": ["passed", "outputs"],
            "properties": {
                "passed": {"type": "boolean"},
                "load_error": {"type": ["string", "null"]},
                "outputs": {"type": "array", "items": _OUTPUT_CHECK},
                "input_shapes": {
                    "type": "object",
                    "additionalProperties": {"type": "array", "items": {"type": "integer"}},
                },
                "warnings": {"type": "array", "items": {"type": "string"}},
            },
        },
        "timings": {"type": "object", "additionalProperties": {"type": "number"}},
        "latency": {
            "type": ["object", "null"],
            "required": ["original_ms", "optimized_ms", "ratio", "noise", "slower", "rounds", "threads", "level"],
        },
        "fixed_shapes": {
            "type": ["object", "null"],
            "additionalProperties": {"type": "array", "items": {"type": ["integer", "string"]}},
        },
    },
    "$defs": {
        "rewrite": {
            "type": "object",
            "required": ["index", "rule", "scope", "matched", "created"],
            "properties": {
                "index": {"type": "integer"},
                "rule": {"type": "string"},
                "scope": {"type": "string"},
                "matched": {"type": "array", "items": {"type": "string"}},
                "created": {"type": "array", "items": {"type": "string"}},
            },
        },
        "decline": {
            "type": "object",
            "required": ["rule", "scope", "node", "nodes", "reason", "source"],
            "properties": {
                "rule": {"type": "string"},
                "scope": {"type": "string"},
                "node": {"type": "string"},
                "nodes": {"type": "array", "items": {"type": "string"}},
                "reason": {"type": "string"},
                "source": {"type": ["string", "null"]},
            },
        },
        "file": {
            "type": ["object", "null"],
            "required": ["path", "sha256"],
            "properties": {"path": {"type": "string"}, "sha256": {"type": "string"}},
        },
    },
}


def versions() -> dict[str, str]:
    import onnx
    import onnxruntime

    import fuser

    return {"fuser": fuser.__version__, "onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def file_entry(path: str | Path | None) -> dict | None:
    if path is None:
        return None
    path = Path(path)
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return {"path": str(path), "sha256": digest.hexdigest()}


def envelope(command: str, verdict: str, exit_code: int, **fields) -> dict:
    report = {
        "schema_version": SCHEMA_VERSION,
        "command": command,
        "verdict": verdict,
        "exit_code": exit_code,
        "error": fields.pop("error", None),
        "versions": versions(),
    }
    report.update(fields)
    return report


def dumps(report: dict) -> str:
    return json.dumps(report, indent=2, sort_keys=False, allow_nan=False, default=_plain)


def _plain(value):
    try:
        return value.item()
    except AttributeError:
        return str(value)


def schema_text() -> str:
    """REPORT_SCHEMA as the JSON file shipped in the package (fuser/report.schema.json, which
    `fuser schema` prints); regenerate that file with `python -m fuser.report` after a change."""
    return json.dumps(REPORT_SCHEMA, indent=2) + "\n"


if __name__ == "__main__":
    (Path(__file__).parent / "report.schema.json").write_text(schema_text())


def markdown(report: dict) -> str:
    """The report as Markdown, for a CI job summary (`--format markdown >> $GITHUB_STEP_SUMMARY`)."""
    lines = [f"### fuser {report['command']}: {report['verdict']}", ""]
    if report.get("error"):
        lines += [f"**Error:** {report['error']}", ""]
    files = [f"`{report[k]['path']}`" for k in ("input", "output") if report.get(k)]
    if files:
        lines += [" → ".join(files), ""]
    if "nodes_before" in report:
        lines += [f"Nodes: {report['nodes_before']} → {report['nodes_after']}", ""]
    if report.get("target") == "onnxruntime" and "nchwc_block" in report:
        lines += [f"NCHWc block: {report['nchwc_block'] or 'none'}", ""]
    counts = report.get("rule_counts") or {}
    if counts:
        lines += ["| rule | rewrites |", "| --- | ---: |"]
        lines += [f"| `{name}` | {count} |" for name, count in sorted(counts.items())]
        lines.append("")
    opportunities = report.get("opportunities")
    if opportunities is not None:
        lines += [f"Fusion opportunities: {len(opportunities)}", ""]
        if opportunities:
            lines += ["| rule | scope | nodes |", "| --- | --- | --- |"]
            lines += [f"| `{o['rule']}` | {o['scope']} | {', '.join(o['nodes'])} |" for o in opportunities]
            lines.append("")
    numerics = report.get("numerics")
    if numerics:
        lines += [f"Numerics check: **{'passed' if numerics['passed'] else 'FAILED'}**", ""]
        if numerics.get("load_error"):
            lines += [f"onnxruntime could not load the optimized model: {numerics['load_error']}", ""]
        if numerics["outputs"]:
            lines += [
                "| output | status | max abs error | max rel error | out of tolerance |",
                "| --- | --- | ---: | ---: | ---: |",
            ]
            lines += [
                f"| `{o['name']}` | {o['status']} | {o['max_abs_error']:.3g} | {o['max_rel_error']:.3g} "
                f"| {o['fraction_out_of_tolerance']:.2%} |"
                for o in numerics["outputs"]
            ]
            lines.append("")
    for key, title in (("blamed", "Blamed rewrites"), ("dropped", "Dropped rewrites")):
        if report.get(key):
            lines += [f"{title}:", ""] + [f"- `{r['rule']}` on {', '.join(r['matched'])}" for r in report[key]] + [""]
    declines = report.get("declines") or []
    if declines:
        reasons = Counter((d["rule"], d["reason"]) for d in declines)
        lines += [f"<details><summary>{len(declines)} declined match(es)</summary>", ""]
        lines += ["| rule | reason | count |", "| --- | --- | ---: |"]
        lines += [
            f"| `{rule}` | {reason.replace('|', chr(92) + '|')} | {count} |"
            for (rule, reason), count in reasons.most_common()
        ]
        lines += ["", "</details>", ""]
    lines += [f"- {note}" for note in report.get("notes") or []]
    lines += [f"- `{a['rule']}`: {a['message']} ({', '.join(a['nodes'])})" for a in report.get("advice") or []]
    timings = report.get("timings") or {}
    if timings:
        lines += ["", "Time: " + ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in timings.items())]
    return "\n".join(lines).rstrip() + "\n"
