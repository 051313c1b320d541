"""The `fuser` command line: a thin layer over fuser.api that maps errors to exit codes.

Messages for people go to stderr; data (JSON) goes to stdout.
"""

from __future__ import annotations

import fnmatch
import os
import sys
import traceback
from pathlib import Path

import click
import onnx

import fuser
from fuser import api, explain, verify, report as report_module
from fuser.errors import (
    EXIT_INTERNAL,
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_USAGE,
    EXIT_WORK_FOUND,
    FuserError,
    NumericsMismatch,
    UsageError,
)
from fuser.model import (
    EXTERNAL_DATA_MODES,
    Model,
    external_data_path,
    refuse_input_data_file,
    write_bytes_atomically,
    write_model,
    writes_external_data,
)
from fuser.config import default_map
from fuser.context import NCHWC_CHOICES, resolve_nchwc_block
from fuser.graph import all_graph_protos
from fuser.registry import all_rules, select
from fuser.tensors import external_data_fields, uses_external_data
from fuser.verify import check_names, input_names

EXIT_CODES_HELP = """\b
Exit codes (every command):
  0  success, or nothing to do
  1  check mode found work to do
  2  bad usage or unusable input (missing file, not ONNX, invalid model)
  3  the numerics check failed
  4  internal error in fuser or a rule (please report it)
"""


class Context:
    def __init__(self, debug: bool):
        self.debug = debug


def _say(message: str, quiet: bool = False) -> None:
    if not quiet:
        click.echo(message, err=True)


def _fail(error: BaseException, debug: bool) -> int:
    if isinstance(error, BrokenPipeError):  # the reader of our output went away (`| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    if debug:
        traceback.print_exception(error)
    if isinstance(error, FuserError):
        click.echo(f"fuser: error: {error}", err=True)
        return error.exit_code
    click.echo(
        f"fuser: internal error: {type(error).__name__}: {error} "
        "(this is a bug in fuser; please report it, rerun with --debug for details)",
        err=True,
    )
    return EXIT_INTERNAL


def _parse_dims(values: tuple[str, ...]) -> dict[str, int]:
    dims = {}
    for value in values:
        name, sep, number = value.partition("=")
        if not sep or not number.strip().isdigit():
            raise UsageError(f"--dim expects NAME=SIZE, got '{value}'")
        dims[name.strip()] = int(number)
    return dims


def _parse_shapes(values: tuple[str, ...]) -> dict[str, tuple]:
    shapes = {}
    for value in values:
        name, sep, dims = value.rpartition(":")
        try:
            shape = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            shape = None
        if not sep or not name or shape is None:
            raise UsageError(f"--input-shape expects NAME:D1,D2,..., got '{value}'")
        shapes[name] = shape
    return shapes


def _parse_ranges(values: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    ranges = {}
    for value in values:
        name, sep, bounds = value.rpartition(":")
        parts = bounds.split(",")
        try:
            low, high = (float(p) for p in parts)
        except ValueError:
            low = high = None
        if not sep or not name or low is None or not low < high:
            raise UsageError(f"--input-range expects NAME:LO,HI with LO < HI, got '{value}'")
        ranges[name] = (low, high)
    return ranges


def _emit_report(data: dict, report_path: str | None, fmt: str, *also: Path) -> None:
    text = report_module.dumps(data)
    for path in ([Path(report_path)] if report_path else []) + list(also):
        write_text_atomically(path, text)
    if fmt == "json":
        click.echo(text)
    elif fmt == "markdown":
        click.echo(report_module.markdown(data), nl=False)


def write_text_atomically(path: Path, text: str) -> None:
    try:
        write_bytes_atomically(path, (text + "\n").encode())
    except FuserError as error:
        raise ReportPathError(str(error)) from error


rule_options = [
    click.option(
        "--target",
        type=click.Choice(["onnx", "onnxruntime"]),
        default="onnx",
        show_default=True,
        help="onnx: standard operators only; onnxruntime: may use com.microsoft fused ops.",
    ),
    click.option(
        "--opset",
        type=click.IntRange(min=1),
        default=None,
        help="Upgrade the model to this opset first (onnx's version converter, checked), so newer fused ops apply.",
    ),
    click.option(
        "--rules",
        "rule_files",
        multiple=True,
        type=click.Path(dir_okay=False),
        help="A Python file defining extra rules (repeatable).",
    ),
    click.option("--enable", multiple=True, metavar="RULE", help="Turn on a rule that is off by default."),
    click.option(
        "--disable", multiple=True, metavar="RULE", help="Turn off a rule; a pattern ('nchwc-*') turns off several."
    ),
    click.option(
        "--nchwc-block",
        type=click.Choice(NCHWC_CHOICES),
        default="auto",
        show_default=True,
        help="Block size of onnxruntime's NCHWc layout (--target onnxruntime) to write for: auto is this machine's.",
    ),
]


check_options = [
    click.option(
        "--seed", type=click.IntRange(0), default=0, show_default=True, help="Seed for synthesized check inputs."
    ),
    click.option(
        "--check-runs",
        "runs",
        type=click.IntRange(1),
        default=1,
        show_default=True,
        help="Number of input sets to check with.",
    ),
    click.option(
        "--inputs",
        "inputs_path",
        type=click.Path(exists=False),
        help="Real inputs: a .npz file, or a folder of input_*.pb (onnx test-data layout).",
    ),
    click.option(
        "--dim",
        "dims",
        multiple=True,
        metavar="NAME=SIZE",
        help="Value of a symbolic dimension (default: batch 1, others a size the model runs on).",
    ),
    click.option("--input-shape", "shapes", multiple=True, metavar="NAME:D1,D2", help="Shape of one input."),
    click.option(
        "--input-range",
        "ranges",
        multiple=True,
        metavar="NAME:LO,HI",
        help="Value range of one input (integers default to their embedding table's rows, else [0, 10)).",
    ),
    click.option("--atol", type=click.FloatRange(0), help="Absolute tolerance (default: per dtype)."),
    click.option("--rtol", type=click.FloatRange(0), help="Relative tolerance (default: per dtype)."),
]


def with_check_options(function):
    for option in reversed(check_options):
        function = option(function)
    return function


def _check_settings(seed, runs, inputs_path, dims, shapes, ranges, atol, rtol) -> dict:
    from fuser.verify import load_inputs

    return {
        "seed": seed,
        "runs": runs,
        "inputs": load_inputs(inputs_path) if inputs_path else None,
        "dims": _parse_dims(dims),
        "shapes": _parse_shapes(shapes),
        "ranges": _parse_ranges(ranges),
        "atol": atol,
        "rtol": rtol,
    }


def _check_names(model, settings: dict) -> None:
    """Names typed on the command line must exist in the model; names from [tool.fuser], which
    serves every model of a project, apply to the models that have them."""
    names, symbols = input_names(model)
    context = click.get_current_context()
    for parameter, known in (("dims", symbols), ("shapes", names), ("ranges", names)):
        if context.get_parameter_source(parameter) == click.core.ParameterSource.DEFAULT_MAP:
            settings[parameter] = {k: v for k, v in settings[parameter].items() if k in known}
    check_names(model, **{k: settings[k] for k in ("dims", "shapes", "ranges", "inputs")})


def with_rule_options(function):
    for option in reversed(rule_options):
        function = option(function)
    return function


@click.group(epilog=EXIT_CODES_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(fuser.__version__, prog_name="fuser")
@click.option("--debug", is_flag=True, help="Show Python tracebacks for errors.")
@click.pass_context
def cli(ctx: click.Context, debug: bool) -> None:
    """Fuse operators in ONNX models; every rewrite is checked in onnxruntime.

    Settings can live in [tool.fuser] of the nearest pyproject.toml; flags override them.
    """
    ctx.obj = Context(debug)
    verify.LOG_SEVERITY = 2 if debug else verify.QUIET  # under --debug, onnxruntime's warnings and errors too
    try:
        ctx.default_map = default_map(Path.cwd())
    except FuserError as error:
        ctx.exit(_fail(error, debug))


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("model", type=click.Path(dir_okay=True))
@click.option("-o", "--output", type=click.Path(), help="Where to write (default: MODEL.fused.onnx beside MODEL).")
@click.option("--force", is_flag=True, help="Replace the output file if it exists.")
@click.option(
    "--external-data",
    type=click.Choice(EXTERNAL_DATA_MODES),
    default="auto",
    show_default=True,
    help="Weights in a file beside the output (OUT.onnx.data): auto = when the input did or over 2 GB.",
)
@with_rule_options
@click.option("--no-check", is_flag=True, help="Skip the onnxruntime numerics check (not recommended).")
@click.option(
    "--on-mismatch",
    type=click.Choice(["fail", "drop"]),
    default="fail",
    show_default=True,
    help="fail: write nothing, keep the evidence; drop: leave out the guilty rewrites.",
)
@with_check_options
@click.option(
    "--fix-shapes",
    is_flag=True,
    help="Write the sizes --dim and --input-shape give into the model, so shape arithmetic depending on "
    "them folds; the output accepts only those sizes.",
)
@click.option(
    "--measure",
    type=click.Choice(["off", "basic", "extended", "all"]),
    help="Time original and result in onnxruntime at this optimization level; leave out a phase that slows it.",
)
@click.option("--measure-threads", type=click.IntRange(1), default=1, show_default=True, help="Threads for --measure.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["text", "json", "markdown"]),
    default="text",
    show_default=True,
    help="json: print the report on stdout.",
)
@click.option("-v", "--verbose", is_flag=True, help="List every rewrite.")
@click.option("-q", "--quiet", is_flag=True, help="Print errors only.")
@click.pass_obj
def optimize(
    ctx: Context,
    model,
    output,
    force,
    external_data,
    target,
    opset,
    rule_files,
    enable,
    disable,
    nchwc_block,
    no_check,
    on_mismatch,
    seed,
    runs,
    inputs_path,
    dims,
    shapes,
    ranges,
    atol,
    rtol,
    fix_shapes,
    measure,
    measure_threads,
    report_path,
    fmt,
    verbose,
    quiet,
):
    """Optimize MODEL and write the result (the input is never modified)."""
    source = Path(model)
    destination = Path(output) if output else source.with_name(_fused_name(source.name))
    data: dict = {"input": None, "output": None}
    try:
        _check_destination(source, destination, force)
        _check_report_path(report_path, source, destination)
        loaded = Model.load(source)
        data["input"] = report_module.file_entry(source)
        settings = _check_settings(seed, runs, inputs_path, dims, shapes, ranges, atol, rtol)
        size_before = _size_on_disk(source, loaded)
        _check_names(loaded.to_proto(weights=False), settings)
        if writes_external_data(loaded, external_data):  # fail before the long work
            refuse_input_data_file(external_data_path(destination), loaded.initializers(), loaded.tensors)
            _check_destination(source, external_data_path(destination), force)
            external_data = "always"  # weights the input kept outside stay outside, whatever the rewrites made
        if no_check:
            _say("fuser: warning: --no-check: the optimized model is NOT verified in onnxruntime", quiet)
        optimized, result = api.optimize(
            loaded,
            target=target,
            opset=opset,
            enable=enable,
            disable=_disable_list(enable, disable),
            rule_files=rule_files,
            check=not no_check,
            on_mismatch=on_mismatch,
            trace=True,  # the report and -v list every decline
            progress=_progress(quiet),
            measure=measure,
            measure_threads=measure_threads,
            nchwc_block=nchwc_block,
            fix_shapes=fix_shapes,
            **settings,
        )
        written = write_model(optimized, destination, source_dir=source.parent, external_data=external_data)
        result.output_path = str(destination)
        body = result.to_dict()
        size_after = sum(path.stat().st_size for path in written)
        body.update(
            input=data["input"],
            output=report_module.file_entry(destination),
            size_before=size_before,
            size_after=size_after,
        )
        verdict = "optimized" if result.rewrites or result.fixed_shapes else "unchanged"
        _emit_report(report_module.envelope("optimize", verdict, EXIT_OK, **body), report_path, fmt)
        if fmt == "text":
            _print_summary(result, destination, verbose, quiet, (size_before, size_after))
        return EXIT_OK
    except NumericsMismatch as error:
        folder = _keep_evidence(error, source)
        code = _fail(NumericsMismatch(f"{error}; nothing written, evidence kept in {folder}"), ctx.debug)
        body = error.evidence["report"].to_dict() if "report" in error.evidence else {}
        body.update(input=data["input"], output=None, evidence=str(folder))
        _emit_report(
            report_module.envelope("optimize", "mismatch", code, error=str(error), **body),
            report_path,
            fmt,
            folder / "report.json",
        )
        return code
    except Exception as error:  # noqa: BLE001 - mapped to the exit-code contract
        code = _fail(error, ctx.debug)
        if isinstance(error, ReportPathError):
            report_path = None
        if report_path or fmt == "json":
            try:
                _emit_report(
                    report_module.envelope("optimize", "error", code, error=str(error), **data), report_path, fmt
                )
            except (OSError, FuserError):
                pass  # the report's own path is unusable; the one-line error above already said why
        return code


def _fail_with_report(command: str, error: BaseException, debug: bool, report_path, fmt) -> int:
    """Map the error to its exit code and, when a report was asked for, say so in it too."""
    code = _fail(error, debug)
    if isinstance(error, ReportPathError):
        report_path = None
    if (report_path or fmt == "json") and not isinstance(error, BrokenPipeError):
        try:
            _emit_report(report_module.envelope(command, "error", code, error=str(error)), report_path, fmt)
        except (OSError, FuserError):
            pass  # the report's own path is unusable; the one-line error above already said why
    return code


TOP_OP_TYPES = 8


def _op_type_table(before: dict[str, int], after: dict[str, int]) -> list[str]:
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


def _bytes_text(size: int) -> str:
    if size < 1024:
        return f"{size} B"
    for unit in ("KB", "MB", "GB"):
        size /= 1024
        if size < 1024 or unit == "GB":
            break
    return f"{size:.1f} {unit}"


def _disable_list(enable: tuple[str, ...], disable: tuple[str, ...]) -> tuple[str, ...]:
    """A rule named by --enable on the command line wins over a `disable` from [tool.fuser]."""
    context = click.get_current_context()
    if context.get_parameter_source("disable") == click.core.ParameterSource.DEFAULT_MAP:
        return tuple(name for name in disable if name not in enable)
    return disable


def _progress(quiet: bool):
    """Stage messages on stderr when it is a terminal; silent in CI logs and with -q."""
    if quiet or not sys.stderr.isatty():
        return None
    return lambda message: click.echo(f"fuser: {message}...", err=True)


def _keep_evidence(error: NumericsMismatch, source: Path) -> Path:
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"fuser-mismatch-{source.stem}-"))
    for name in ("original", "optimized"):
        if name not in error.evidence:
            continue
        try:
            write_model(error.evidence[name], folder / f"{name}.onnx", source_dir=source.parent)
        except FuserError as reason:  # evidence is a courtesy: a model that cannot be copied must not hide the mismatch
            (folder / f"{name}.onnx.txt").write_text(f"not copied: {reason}\n")
    return folder


def _fused_name(name: str) -> str:
    stem = name[: -len(".onnx")] if name.endswith(".onnx") else name
    return f"{stem}.fused.onnx"


class ReportPathError(UsageError):
    """The report path is unusable, so the error report must not be written there either."""


def _check_report_path(report_path: str | None, *models: Path) -> None:
    """The report never lands on a model: `--report model.onnx` would destroy it."""
    if report_path is None:
        return
    try:
        _check_folder(Path(report_path))
    except UsageError as error:
        raise ReportPathError(f"--report {error}") from error
    target = Path(report_path).resolve()
    for model in models:
        if target == model.resolve():
            raise ReportPathError(f"--report {report_path} names a model file; choose another report path")


def _size_on_disk(path: Path, model: Model | None = None) -> int:
    """The model file plus the external data files it references (each counted once)."""
    files = {path.resolve()}
    if model is None:
        if external_data_path(path).exists():  # maybe stale from an earlier run: count it only if referenced
            written = onnx.load(path, load_external_data=False)
            referenced = {
                external_data_fields(t).get("location", "")
                for g in all_graph_protos(written.graph)
                for t in g.initializer
                if uses_external_data(t)
            }
            files |= {(path.parent / location).resolve() for location in referenced}
    else:
        files |= {
            model.tensors.resolve(external_data_fields(t).get("location", ""))
            for t in model.initializers()
            if uses_external_data(t)
        }
    return sum(f.stat().st_size for f in files)


def _check_folder(path: Path) -> None:
    """Refuse early a path that cannot be written: an existing ancestor of it is not a folder."""
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise UsageError(f"{path}: cannot write there, {folder} is not a folder")


def _check_destination(source: Path, destination: Path, force: bool) -> None:
    _check_folder(destination)
    if destination.exists() and source.exists() and destination.resolve() == source.resolve():
        raise UsageError(f"{destination}: refusing to overwrite the input model; choose another -o")
    if destination.exists() and not force:
        raise UsageError(f"{destination} already exists; pass --force to replace it")
    if destination.exists() and destination.is_dir():
        raise UsageError(f"{destination} is a directory")


def _print_summary(result: api.Report, destination: Path, verbose: bool, quiet: bool, sizes=None) -> None:
    if quiet:
        return
    lines = [f"nodes: {result.nodes_before} -> {result.nodes_after}"]
    if result.counts:
        width = max(len(n) for n in result.counts)
        lines += [f"  {name:<{width}}  {count:>5}" for name, count in sorted(result.counts.items())]
    else:
        lines.append("  no rule applied: nothing to fuse")
    skipped = result.engine.skipped_rules
    if verbose:
        lines += [f"  skipped {name}: {reason}" for name, reason in skipped.items()]
    else:
        newer = result.engine.need_newer_opset
        if newer:
            lines.append(f"  need a newer opset: {', '.join(newer)} (--opset N upgrades; -v says which)")
    advice = result.engine.advice
    if advice:
        lines.append(f"  kept as is: {len(advice)} pattern(s); {advice[0].message}")
        if verbose:
            lines += [f"    {a.rule} [{a.scope}] {', '.join(a.nodes)}" for a in advice]
    lines += _op_type_table(result.op_types_before, result.op_types_after)
    if sizes is not None:
        lines.append(f"size on disk: {_bytes_text(sizes[0])} -> {_bytes_text(sizes[1])}")
    if result.verdict is not None:
        stabilized = result.verdict.stabilized
        status = "passed" + (f" (stabilized: {', '.join(stabilized)})" if stabilized else "")
        worst = max((o.max_abs_error for o in result.verdict.outputs), default=0.0)
        on = f" on {result.verdict.inputs_text()}" if result.verdict.input_shapes else ""
        lines.append(f"numerics check: {status}{on}, {len(result.verdict.outputs)} outputs, max abs error {worst:.3g}")
        lines += [f"  warning: {warning}" for warning in result.verdict.warnings]
    elif result.rewrites:
        lines.append("numerics check: SKIPPED")
    if result.target == "onnxruntime":
        lines.append(f"NCHWc block: {result.context.nchwc_block or 'none (onnxruntime here has no NCHWc kernels)'}")
    lines += [f"  note: {note}" for note in result.notes]
    for rewrite in result.dropped:
        lines.append(f"  dropped {rewrite.rule} on {', '.join(rewrite.matched)}: it failed the numerics check")
    if verbose:
        for rewrite in result.rewrites:
            lines.append(
                f"  #{rewrite.index} {rewrite.rule} [{rewrite.scope}] {', '.join(rewrite.matched)} -> "
                f"{', '.join(rewrite.created)}"
            )
    if verbose:
        lines += explain.decline_lines(result.engine.unique_declines())
    lines.append(f"wrote {destination}")
    _say("\n".join(lines))


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("model", type=click.Path(dir_okay=True))
@with_rule_options
@click.option("--exit-zero", is_flag=True, help="Exit 0 even when there is work to do.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text", show_default=True)
@click.option("-q", "--quiet", is_flag=True)
@click.pass_obj
def check(
    ctx: Context, model, target, opset, rule_files, enable, disable, nchwc_block, exit_zero, report_path, fmt, quiet
):
    """List the fusions the enabled rules would make in MODEL; write nothing.

    Exits 1 when there is at least one (a gate for "the exported model is fully fused").
    """
    try:
        _check_report_path(report_path, Path(model))
        disable = _disable_list(enable, disable)
        block = resolve_nchwc_block(nchwc_block)
        result = api.find_opportunities(
            model, target=target, enable=enable, disable=disable, rule_files=rule_files, opset=opset, nchwc_block=block
        )
        found = result.opportunities
        code = EXIT_WORK_FOUND if found and not exit_zero else EXIT_OK
        _emit_report(
            report_module.envelope(
                "check",
                "work-found" if found else "fully-fused",
                code,
                input=report_module.file_entry(model),
                target=target,
                nchwc_block=block,
                opportunities=[o.to_dict() for o in found],
                skipped_rules=result.skipped_rules,
            ),
            report_path,
            fmt,
        )
        if fmt == "text" and not quiet:
            for item in found:
                _say(f"{model}: {item.rule} [{item.scope}] {', '.join(item.nodes)}")
            _say(f"{len(found)} fusion opportunit{'y' if len(found) == 1 else 'ies'}")
        return code
    except Exception as error:  # noqa: BLE001
        return _fail_with_report("check", error, ctx.debug, report_path, fmt)


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("first", type=click.Path(dir_okay=False))
@click.argument("second", type=click.Path(dir_okay=False))
@with_check_options
@click.option("--exact", is_flag=True, help="Require bit-identical outputs.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text", show_default=True)
@click.pass_obj
def compare(
    ctx: Context, first, second, seed, runs, inputs_path, dims, shapes, ranges, atol, rtol, exact, report_path, fmt
):
    """Run FIRST and SECOND on the same inputs and compare every output (exit 3 if they differ)."""
    from fuser.verify import Checker

    try:
        _check_report_path(report_path, Path(first), Path(second))
        a, b = Model.load(first), Model.load(second)
        settings = _check_settings(seed, runs, inputs_path, dims, shapes, ranges, atol, rtol)
        _check_names(a.to_proto(), settings)
        verdict = Checker(a.to_proto(), base_dir=a.base_dir, **settings).check(b.to_proto(), exact, base_dir=b.base_dir)
        code = EXIT_OK if verdict.passed else EXIT_MISMATCH
        _emit_report(
            report_module.envelope(
                "compare",
                "match" if verdict.passed else "mismatch",
                code,
                input=report_module.file_entry(first),
                output=report_module.file_entry(second),
                numerics=verdict.to_dict(),
            ),
            report_path,
            fmt,
        )
        if fmt == "text":
            _say(f"checked on {verdict.inputs_text()}")
            _say("\n".join(f"warning: {warning}" for warning in verdict.warnings), quiet=not verdict.warnings)
            if verdict.load_error:
                _say(verdict.summary())
            for o in verdict.outputs:
                _say(
                    f"{o.name:<24} {o.status:<10} max abs {o.max_abs_error:.3g}  max rel {o.max_rel_error:.3g}"
                    f"  out of tolerance {o.fraction_out_of_tolerance:.2%}"
                )
        return code
    except Exception as error:  # noqa: BLE001
        return _fail_with_report("compare", error, ctx.debug, report_path, fmt)


@cli.command(name="rules")
@click.option(
    "--target", type=click.Choice(["onnx", "onnxruntime"]), default=None, help="Only rules that run for this target."
)
@click.option("--rules", "rule_files", multiple=True, type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--selftest", is_flag=True, help="Run each rule on random instances of its own pattern and check them.")
@click.option("--rule", "only", multiple=True, metavar="NAME", help="With --selftest: only this rule (repeatable).")
@click.option("--seed", type=int, default=0, show_default=True, help="With --selftest: seed of the instances.")
@click.option("--instances", type=click.IntRange(1), default=4, show_default=True, help="With --selftest: per rule.")
@click.option(
    "--save-dir", default="fuser-selftest", show_default=True, help="With --selftest: where failing models go."
)
@click.pass_obj
def list_rules(ctx: Context, target, rule_files, fmt, selftest, only, seed, instances, save_dir):
    """List the registered rules: name, target, on by default, description.

    With --selftest, check them instead: exit 3 if a rewrite fails the numerics check, 4 if a
    rule fails."""
    import json

    try:
        rules = all_rules(list(rule_files))
        if selftest:
            return _selftest(rules, target, only, seed, instances, save_dir, fmt)
        if target:
            names = {r.name for r in select(rules, target, enable=[r.name for r in rules])}
            rules = [r for r in rules if r.name in names]
        if fmt == "json":
            click.echo(
                json.dumps(
                    [
                        {
                            "name": r.name,
                            "target": r.target,
                            "default": r.enabled_by_default,
                            "exact": r.exact,
                            "description": r.description,
                            "source": str(r.source),
                        }
                        for r in rules
                    ],
                    indent=2,
                )
            )
            return EXIT_OK
        if not rules:
            _say("no rules registered")
        width = max((len(r.name) for r in rules), default=0)
        for r in rules:
            default = "on" if r.enabled_by_default else "off"
            click.echo(f"{r.name:<{width}}  {r.target:<11}  {default:<3}  {r.description}")
        return EXIT_OK
    except Exception as error:  # noqa: BLE001
        return _fail(error, ctx.debug)


def _debug_first(argv: list[str]) -> list[str]:
    """`--debug` is an option of the group; accept it anywhere, as the error messages suggest."""
    end = argv.index("--") if "--" in argv else len(argv)
    if "--debug" not in argv[:end]:
        return argv
    return ["--debug", *(a for i, a in enumerate(argv) if not (a == "--debug" and i < end))]


def _selftest(rules, target, only, seed, instances, save_dir, fmt) -> int:
    import json

    from fuser.selftest import selftest

    if only:
        names = select(rules, "onnxruntime", enable=list(only))  # unknown names are usage errors
        rules = [r for r in names if any(fnmatch.fnmatchcase(r.name, n) for n in only)]
    if target:
        rules = [r for r in rules if r.target == "onnx" or target == "onnxruntime"]
    results = selftest(rules, seed=seed, instances=instances, save_dir=save_dir)
    if fmt == "json":
        click.echo(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        width = max((len(r.rule) for r in results), default=0)
        for r in results:
            click.echo(f"{r.rule:<{width}}  {r.summary()}")
            for reason, count in r.declined.most_common():
                click.echo(f"  {count:>5} x declined: {reason}")
            for problem in r.failures + r.errors:
                click.echo(f"  FAILED {problem}")
    if any(r.errors for r in results):
        return EXIT_INTERNAL
    return EXIT_MISMATCH if any(r.failures for r in results) else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    argv = _debug_first(list(sys.argv[1:] if argv is None else argv))
    try:
        code = cli.main(args=argv, prog_name="fuser", standalone_mode=False)
    except click.exceptions.Exit as done:
        code = done.exit_code
    except click.ClickException as error:
        click.echo(f"fuser: error: {error.format_message()} (see fuser --help)", err=True)
        code = EXIT_USAGE
    except click.exceptions.Abort:
        click.echo("fuser: aborted", err=True)
        code = EXIT_USAGE
    sys.exit(code if isinstance(code, int) else EXIT_OK)


@cli.command(name="explain", epilog=EXIT_CODES_HELP)
@click.argument("model", type=click.Path(dir_okay=True))
@with_rule_options
@click.option(
    "--rule", "only", multiple=True, metavar="NAME", help="Explain only this rule (turned on if it is off by default)."
)
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.pass_obj
def explain_rules(ctx: Context, model, target, opset, rule_files, enable, disable, nchwc_block, only, fmt):
    """Say why each rule did or did not fire in MODEL: what it matched, applied and declined,
    grouped by reason, with the rule's file:line. Writes nothing; the numerics check is not run."""
    import fnmatch
    import json

    try:
        enable = tuple(enable) + tuple(only)
        chosen = api.resolve_rules(None, target, enable, _disable_list(enable, disable), rule_files)
        _, result = api.optimize(
            Model.load(Path(model)),
            rules=chosen,
            target=target,
            check=False,
            trace=True,
            opset=opset,
            nchwc_block=nchwc_block,
        )
        explained = explain.explain(result.engine, chosen)
        if only:
            explained = [e for e in explained if any(fnmatch.fnmatchcase(e.rule, name) for name in only)]
        if fmt == "json":
            click.echo(
                json.dumps({"model": str(model), "target": target, "rules": [e.to_dict() for e in explained]}, indent=2)
            )
        else:
            click.echo("\n".join(explain.render(explained)))
        return EXIT_OK
    except Exception as error:  # noqa: BLE001
        return _fail(error, ctx.debug)


@cli.command(name="schema")
@click.pass_obj
def print_schema(ctx: Context):
    """Print the JSON Schema of the reports (--report, --format json), for pipelines to validate them."""
    from importlib.resources import files

    try:
        click.echo(files("fuser").joinpath("report.schema.json").read_text(), nl=False)
        return EXIT_OK
    except Exception as error:  # noqa: BLE001
        return _fail(error, ctx.debug)


if __name__ == "__main__":
    main()
