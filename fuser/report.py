"""What a run did, and its three renderings: `Report` (what `fuser.optimize` returns), the
summary a person reads after one model (`summary_lines`), and the report every command can
write (`--report FILE`, `--format json|markdown`).

The JSON report's schema is versioned (SCHEMA_VERSION) and described in REPORT_SCHEMA, a JSON
Schema document; tests validate real reports against it.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from fuser import explain
from fuser.context import Context
from fuser.progress import STAGES

if TYPE_CHECKING:
    from fuser.engine import EngineResult, Rewrite
    from fuser.measure import Timing
    from fuser.verify import Verdict

SCHEMA_VERSION = 9  # 2: declines; 3: nchwc_block; 4: several models in one report (`models`), stage times by stage;
# 5: 16-bit float outputs weighed against float32 twins (status "rounding", the twins' errors);
# 6: blamed and dropped rewrites say why (`failure`); 7: each output's largest expected magnitude;
# 8: every model's wall-clock `seconds`; an input that could not be read is named, its sha256 null;
# 9: a float32 output computed through a 16-bit float says which (`computed_in`), whose tolerance it gets

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
        "status": {"enum": ["ok", "mismatch", "stabilized", "rounding"]},
        "max_abs_error": {"type": "number"},
        "max_rel_error": {"type": "number"},
        "max_abs_expected": {"type": "number"},
        "fraction_out_of_tolerance": {"type": "number"},
        "worst_index": {"type": ["array", "null"], "items": {"type": "integer"}},
        "rtol": {"type": "number"},
        "atol": {"type": "number"},
        "stabilized_elements": {"type": "integer"},
        "nonfinite_mismatches": {"type": "integer"},
        "reference_error": {"type": ["number", "null"]},
        "original_reference_error": {"type": ["number", "null"]},
        "twins_error": {"type": ["number", "null"]},
        "computed_in": {"enum": ["float16", "bfloat16", None]},
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
                "padded_masks": {
                    "type": "array",
                    "description": "attention-mask inputs the check also ran with their last row half padded",
                    "items": {"type": "string"},
                },
                "warnings": {"type": "array", "items": {"type": "string"}},
            },
        },
        "timings": {
            "type": "object",
            "description": "seconds per stage: load, upgrade, measure, rewrite, check, blame, write (those that ran)",
            "additionalProperties": {"type": "number"},
        },
        "models": {
            "type": "array",
            "description": "a run over several models: each one's own report; the top level has the worst exit code",
            "items": {"$ref": "#"},
        },
        "jobs": {"type": "integer", "description": "how many models were optimized at once"},
        "seconds": {
            "type": "number",
            "description": (
                "wall-clock time of the run; of a model among several (in models), that model's own "
                "(none: the run was stopped before it)"
            ),
        },
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
                "failure": {"type": "string"},
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
            "properties": {
                "path": {"type": "string"},
                "sha256": {
                    "type": ["string", "null"],
                    "description": "null: a model that could not be read as a file (missing, a pipe)",
                },
            },
        },
    },
}


@dataclass
class Report:
    """What an optimization did: rewrites, per-rule counts, node counts, numerics, timings."""

    target: str
    rules: list[str]
    nodes_before: int
    nodes_after: int
    engine: EngineResult
    verdict: Verdict | None = None
    timings: dict[str, float] = field(default_factory=dict)
    input_path: str | None = None
    output_path: str | None = None
    blamed: list[Rewrite] = field(default_factory=list)
    dropped: list[Rewrite] = field(default_factory=list)
    blame_checks: int = 0
    notes: list[str] = field(default_factory=list)
    op_types_before: dict[str, int] = field(default_factory=dict)
    op_types_after: dict[str, int] = field(default_factory=dict)
    latency: Timing | None = None
    context: Context = field(default_factory=Context)
    fixed_shapes: dict[str, list] | None = None  # --fix-shapes: input -> the dims written into the model
    # What a check of the result asks of its outputs (Checker.check): bit-identical where every
    # rewrite applied is exact, and whether a rewrite made it more stable than the original.
    exact: bool = True
    stabilizing: bool = False

    @property
    def rewrites(self):
        return self.engine.rewrites

    @property
    def counts(self) -> dict[str, int]:
        return self.engine.counts()

    @property
    def checked(self) -> bool:
        return self.verdict is not None

    def to_dict(self) -> dict:
        return {
            "target": self.target,
            "rules": self.rules,
            **self.context.to_dict(),
            "input": self.input_path,
            "output": self.output_path,
            "nodes_before": self.nodes_before,
            "nodes_after": self.nodes_after,
            "op_types_before": self.op_types_before,
            "op_types_after": self.op_types_after,
            "rule_counts": self.counts,
            "rewrites": [r.to_dict() for r in self.rewrites],
            "skipped_rules": self.engine.skipped_rules,
            "advice": [a.to_dict() for a in self.engine.advice],
            "declines": [d.to_dict() for d in self.engine.unique_declines()],
            "notes": self.notes,
            "numerics": None if self.verdict is None else self.verdict.to_dict(),
            "blamed": [r.to_dict() for r in self.blamed],
            "dropped": [r.to_dict() for r in self.dropped],
            "timings": {stage: self.timings[stage] for stage in STAGES if stage in self.timings},
            "latency": None if self.latency is None else self.latency.to_dict(),
            "fixed_shapes": self.fixed_shapes,
        }


# ------------------------------------------------------------------------ the summary

TOP_OP_TYPES = 8


def summary_lines(result: Report, destination: Path, sizes=None, verbose: bool = False) -> list[str]:
    """What a person reads after one model: counts, op types, sizes, the check, notes, times."""
    lines = [f"nodes: {result.nodes_before} -> {result.nodes_after}"]
    if result.counts:
        width = max(len(n) for n in result.counts)
        lines += [f"  {name:<{width}}  {count:>5}" for name, count in sorted(result.counts.items())]
    elif result.dropped:
        lines.append(f"  none left: the check dropped every rewrite ({len(result.dropped)})")
    else:
        lines.append("  no rule applied: nothing to fuse")
    skipped = result.engine.skipped_rules
    newer = result.engine.need_newer_opset
    lines += [f"  skipped {name}: {reason}" for name, reason in skipped.items()] if verbose else []
    if newer and not verbose:
        lines.append(f"  need a newer opset: {', '.join(newer)} (--opset N upgrades; -v says which)")
    advice = result.engine.advice
    if advice:
        lines.append(f"  kept as is: {len(advice)} pattern(s); {advice[0].message}")
        if verbose:
            lines += [f"    {a.rule} [{a.scope}] {', '.join(a.nodes)}" for a in advice]
    lines += op_type_table(result.op_types_before, result.op_types_after)
    if sizes is not None:
        lines.append(f"size on disk: {bytes_text(sizes[0])} -> {bytes_text(sizes[1])}")
    if result.verdict is not None:
        stabilized = result.verdict.stabilized
        status = "passed" + (f" (stabilized: {', '.join(stabilized)})" if stabilized else "")
        worst = max(result.verdict.outputs, key=lambda o: o.max_abs_error, default=None)
        error = worst.max_abs_error if worst is not None else 0.0
        # A large error on large outputs is a rounding: say how large they are.
        scale = f" (outputs up to {worst.max_abs_expected:.3g})" if error >= 1e-3 and worst.max_abs_expected > 1 else ""
        on = f" on {result.verdict.inputs_text()}" if result.verdict.input_shapes else ""
        lines.append(
            f"numerics check: {status}{on}, {len(result.verdict.outputs)} outputs, max abs error {error:.3g}{scale}"
        )
        lines += [f"  {o.rounding_text()}" for o in result.verdict.rounded]
        for computed_in in dict.fromkeys(o.computed_in for o in result.verdict.outputs if o.computed_in):
            named = ", ".join(f"'{o.name}'" for o in result.verdict.outputs if o.computed_in == computed_in)
            lines.append(
                f"  float32 output(s) {named} compared at {computed_in}'s tolerance: computed through {computed_in}"
            )
        lines += [f"  warning: {warning}" for warning in result.verdict.warnings]
    elif result.rewrites:
        lines.append("numerics check: SKIPPED")
    if result.target == "onnxruntime":
        lines.append(f"NCHWc block: {result.context.nchwc_block or 'none (onnxruntime here has no NCHWc kernels)'}")
    lines += [f"  note: {note}" for note in result.notes]
    for rewrite in result.dropped:
        lines.append(f"  dropped {rewrite.rule} on {', '.join(rewrite.matched)}: {rewrite.failure}")
    if verbose:
        for rewrite in result.rewrites:
            lines.append(
                f"  #{rewrite.index} {rewrite.rule} [{rewrite.scope}] {', '.join(rewrite.matched)} -> "
                f"{', '.join(rewrite.created)}"
            )
        lines += explain.decline_lines(result.engine.unique_declines())
    lines.append(stage_times(result.timings))
    lines.append(f"wrote {destination}")
    return lines


def stage_times(timings: dict[str, float]) -> str:
    """`time: load 0.12 s, rewrite 0.40 s, check 0.31 s, write 0.05 s`."""
    return "time: " + ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in timings.items())


def op_type_table(before: dict[str, int], after: dict[str, int]) -> list[str]:
    """The op types that changed most, before -> after, largest first (at most TOP_OP_TYPES)."""
    changed = [name for name in dict.fromkeys([*before, *after]) if before.get(name, 0) != after.get(name, 0)]
    if not changed:
        return []
    changed.sort(key=lambda name: (-max(before.get(name, 0), after.get(name, 0)), name))
    shown = changed[:TOP_OP_TYPES]
    width = max(len(name) for name in shown)
    lines = [f"  {name:<{width}}  {before.get(name, 0):>6} -> {after.get(name, 0)}" for name in shown]
    if len(changed) > len(shown):
        lines.append(f"  ... and {len(changed) - len(shown)} more op types changed")
    return ["op types:", *lines]


def models_text(count: int) -> str:
    """`count` models, as a person says it: "1 model", "3 models"."""
    return f"{count} model" if count == 1 else f"{count} models"


def bytes_text(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    for unit in ("KB", "MB", "GB"):
        size /= 1024
        if size < 1024 or unit == "GB":
            break
    return f"{size:.1f} {unit}"


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


def is_report_file(path: Path) -> bool:
    """Whether `path` is a regular file (not a link) holding a fuser report, by its first bytes:
    what `dumps` writes starts with the schema version."""
    try:
        if path.is_symlink() or not path.is_file():
            return False
        with open(path, "rb") as stream:
            head = stream.read(64)
    except OSError:
        return False
    return head.replace(b" ", b"").replace(b"\n", b"").startswith(b'{"schema_version":')


def regular_file_entry(path: str | Path, digest: bool = True) -> dict | None:
    """file_entry(path) for a regular file; None for anything else (a pipe is read once, by the
    load) and for a path that cannot be read, which whatever reads it reports. Without `digest`,
    the path alone: for a report shown only as text or Markdown, which name files but not their
    digests (reading and hashing a 500 MB model takes 0.5 s)."""
    try:
        if not Path(path).is_file():
            return None
        return file_entry(path) if digest else {"path": str(path)}
    except OSError:
        return None


def input_entry(path: str | Path, digest: bool = True) -> dict:
    """The entry of a model a report is about: regular_file_entry(path), or where that is None
    (a missing file, a pipe the load read once) the path with a null digest, so that every model
    of a run over several is named in its report."""
    return regular_file_entry(path, digest=digest) or {"path": str(path), "sha256": None}


def file_entry_soon(path: str | Path) -> Callable[[], dict | None]:
    """regular_file_entry(path), worked out in a thread of its own while the caller goes on:
    reading a file and hashing it let go of Python's lock, and the hash of a large model (0.3 s
    for GPT-2's 500 MB) need not hold up the work. The function returned waits for the entry.
    Not before a model's load: the load forks its check only from a process running no other
    thread (fuser/validation.py)."""
    found: list[dict | None] = [None]

    def work() -> None:
        found[0] = regular_file_entry(path)

    thread = threading.Thread(target=work, name="fuser-hash", daemon=True)
    thread.start()

    def entry() -> dict | None:
        thread.join()
        return found[0]

    return entry


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


def batch_envelope(command: str, reports: list[dict], **fields) -> dict:
    """One report over several models: theirs in `models`, and at the top the worst exit code and
    its verdict (among successes, "optimized" if any model was)."""
    code = max(r["exit_code"] for r in reports)
    worst = [r for r in reports if r["exit_code"] == code]
    verdicts = {r["verdict"] for r in worst}
    if "optimized" in verdicts or "work-found" in verdicts:
        verdict = "optimized" if "optimized" in verdicts else "work-found"
    else:
        verdict = worst[0]["verdict"]
    failed = [r for r in reports if r["verdict"] in ("error", "mismatch")]
    error = f"{len(failed)} of {models_text(len(reports))} failed" if failed else None
    return envelope(command, verdict, code, error=error, **fields, models=reports)


def _plain(value):
    try:
        return value.item()
    except AttributeError:
        return str(value)


def dumps(report: dict) -> str:
    """The report as JSON, indented two spaces, with each entry of its logs on a line of its own:
    a list of flat objects (a rewrite, a decline: no object or list of objects inside; the first
    one decides) puts one per line, and a list of plain values stays on one line. Those are
    written by json's C encoder: the pure-Python one that indenting takes spent 2.7 s on the 333k
    rewrites of a million-node model's report (0.27 s for 100k nodes; 0.14 s written this way)."""
    parts: list[str] = []
    _dump(report, "", parts)
    return "".join(parts)


_ONE_LINE = json.JSONEncoder(separators=(", ", ": "), allow_nan=False, default=_plain)


def _dump(value, indent: str, parts: list[str]) -> None:
    inner = indent + "  "
    if isinstance(value, dict) and value:
        parts.append("{")
        for index, (key, item) in enumerate(value.items()):
            parts.append(("\n" if index == 0 else ",\n") + inner + json.dumps(str(key)) + ": ")
            _dump(item, inner, parts)
        parts.append("\n" + indent + "}")
    elif isinstance(value, (list, tuple)) and any(isinstance(item, (dict, list, tuple)) for item in value):
        parts.append("[\n" + inner)
        if _flat(value[0]):
            parts.append((",\n" + inner).join(map(_ONE_LINE.encode, value)))
        else:
            for index, item in enumerate(value):
                if index:
                    parts.append(",\n" + inner)
                _dump(item, inner, parts)
        parts.append("\n" + indent + "]")
    else:
        parts.append(_ONE_LINE.encode(value))


def _flat(value) -> bool:
    """An object whose values are plain values or lists of them, or such a list: one line."""
    values = value.values() if isinstance(value, dict) else [value]
    for item in values:
        if isinstance(item, dict):
            return False
        if isinstance(item, (list, tuple)) and any(isinstance(i, (dict, list, tuple)) for i in item):
            return False
    return True


def schema_text() -> str:
    """REPORT_SCHEMA as the JSON file shipped in the package (fuser/report.schema.json, which
    `fuser schema` prints); regenerate that file with `python -m fuser.report` after a change."""
    return json.dumps(REPORT_SCHEMA, indent=2) + "\n"


if __name__ == "__main__":
    (Path(__file__).parent / "report.schema.json").write_text(schema_text())


def _code(text) -> str:
    """`text` as a Markdown code span, whatever backticks it holds (a file may be named a`b.onnx)."""
    text = str(text)
    fence = "`" * (max((len(run) for run in re.findall("`+", text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def _cell(text) -> str:
    """`text` in a table cell: GitHub's tables split cells at a pipe, in a code span too, unless escaped."""
    return str(text).replace("|", "\\|")


def markdown(report: dict, title: str | None = None) -> str:
    """The report as Markdown, for a CI job summary (`--format markdown >> $GITHUB_STEP_SUMMARY`)."""
    if "models" in report:
        return _batch_markdown(report)
    lines = [title or f"### fuser {report['command']}: {report['verdict']}", ""]
    if report.get("error"):
        lines += [f"**Error:** {report['error']}", ""]
    files = [_code(report[k]["path"]) for k in ("input", "output") if report.get(k)]
    if files:
        lines += [" → ".join(files), ""]
    if "nodes_before" in report:
        lines += [f"Nodes: {report['nodes_before']} → {report['nodes_after']}", ""]
    if report.get("target") == "onnxruntime" and "nchwc_block" in report:
        lines += [f"NCHWc block: {report['nchwc_block'] or 'none'}", ""]
    counts = report.get("rule_counts") or {}
    if counts:
        lines += ["| rule | rewrites |", "| --- | ---: |"]
        lines += [f"| {_cell(_code(name))} | {count} |" for name, count in sorted(counts.items())]
        lines.append("")
    opportunities = report.get("opportunities")
    if opportunities is not None:
        lines += [f"Fusion opportunities: {len(opportunities)}", ""]
        if opportunities:
            lines += ["| rule | scope | nodes |", "| --- | --- | --- |"]
            lines += [
                f"| {_cell(_code(o['rule']))} | {_cell(o['scope'])} | {_cell(', '.join(o['nodes']))} |"
                for o in opportunities
            ]
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
                f"| {_cell(_code(o['name']))} | {o['status']} | {o['max_abs_error']:.3g} | {o['max_rel_error']:.3g} "
                f"| {o['fraction_out_of_tolerance']:.2%} |"
                for o in numerics["outputs"]
            ]
            lines.append("")
    for key, title in (("blamed", "Blamed rewrites"), ("dropped", "Dropped rewrites")):
        if report.get(key):
            lines += [f"{title}:", ""]
            lines += [
                f"- `{r['rule']}` on {', '.join(r['matched'])}" + (f": {r['failure']}" if r.get("failure") else "")
                for r in report[key]
            ]
            lines += [""]
    declines = report.get("declines") or []
    if declines:
        reasons = Counter((d["rule"], d["reason"]) for d in declines)
        lines += [f"<details><summary>{len(declines)} declined match(es)</summary>", ""]
        lines += ["| rule | reason | count |", "| --- | --- | ---: |"]
        lines += [
            f"| {_cell(_code(rule))} | {_cell(reason)} | {count} |" for (rule, reason), count in reasons.most_common()
        ]
        lines += ["", "</details>", ""]
    lines += [f"- {note}" for note in report.get("notes") or []]
    lines += [f"- `{a['rule']}`: {a['message']} ({', '.join(a['nodes'])})" for a in report.get("advice") or []]
    timings = report.get("timings") or {}
    if timings:
        lines += ["", "Time: " + ", ".join(f"{stage} {seconds:.2f} s" for stage, seconds in timings.items())]
    return "\n".join(lines).rstrip() + "\n"


def _batch_markdown(report: dict) -> str:
    """A table of the models, then each model's own section."""
    models = report["models"]
    lines = [f"## fuser {report['command']}: {models_text(len(models))}, exit {report['exit_code']}", ""]
    if report["command"] == "check":  # nothing is rewritten, checked in onnxruntime or timed per stage
        lines += ["| model | verdict | exit | opportunities | seconds |", "| --- | --- | ---: | ---: | ---: |"]
    else:
        lines += [
            "| model | verdict | exit | nodes | rewrites | numerics | seconds |",
            "| --- | --- | ---: | --- | ---: | --- | ---: |",
        ]
    for model in models:
        path = (model.get("input") or {}).get("path", "?")
        verdict, code = model["verdict"], model["exit_code"]
        seconds = "" if model.get("seconds") is None else f"{model['seconds']:.2f}"  # none: interrupted
        if report["command"] == "check":
            found = "" if verdict == "error" else len(model.get("opportunities") or [])
            lines.append(f"| {_cell(_code(path))} | {verdict} | {code} | {found} | {seconds} |")
            continue
        nodes = f"{model['nodes_before']} → {model['nodes_after']}" if "nodes_before" in model else ""
        rewrites = len(model.get("rewrites") or [])
        numerics = model.get("numerics")
        passed = "" if not numerics else ("passed" if numerics["passed"] else "FAILED")
        lines.append(f"| {_cell(_code(path))} | {verdict} | {code} | {nodes} | {rewrites} | {passed} | {seconds} |")
    lines.append("")
    for model in models:
        path = (model.get("input") or {}).get("path", "?")
        lines.append(markdown(model, title=f"### {_code(path)}: {model['verdict']}"))
    return "\n".join(lines).rstrip() + "\n"
