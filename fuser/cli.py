"""The `fuser` command line: a thin layer over fuser.api that maps errors to exit codes.

Messages for people go to stderr; data (JSON) goes to stdout.
"""

from __future__ import annotations

import atexit
import fnmatch
import math
import os
import re
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

import click
import onnx

import fuser
from fuser import api, explain, verify
from fuser import jobs as jobs_module
from fuser import report as report_module
from fuser.blame import MISMATCH_ACTIONS
from fuser.config import default_map
from fuser.context import NCHWC_CHOICES, resolve_nchwc_block
from fuser.errors import (
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_MISMATCH,
    EXIT_OK,
    EXIT_USAGE,
    EXIT_WORK_FOUND,
    FuserError,
    OutputPathError,
    UsageError,
)
from fuser.model import (
    EXTERNAL_DATA_MODES,
    Model,
    external_data_files,
    external_data_path,
    load_for_sessions,
    write_bytes_atomically,
)
from fuser.progress import UNITS
from fuser.registry import all_rules, select
from fuser.verify import CheckOptions, load_inputs

EXIT_CODES_HELP = """\b
Exit codes (every command):
  0  success, or nothing to do
  1  check mode found work to do
  2  bad usage or unusable input (missing file, not ONNX, invalid model)
  3  the numerics check failed
  4  internal error in fuser or a rule (please report it)
  130  interrupted (Ctrl-C, or SIGTERM): the process ends by that signal
With several models, the worst model's code.
"""


class Context:
    def __init__(self, debug: bool):
        self.debug = debug


def _say(message: str, quiet: bool = False) -> None:
    if not quiet:
        click.echo(message, err=True)


def _fail(error: BaseException, debug: bool, source: Path | None = None) -> int:
    if isinstance(error, BrokenPipeError):  # the reader of our output went away (`| head`)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    code, messages = jobs_module.describe_error(error, debug, source)
    for message in messages:
        click.echo(message, err=True)
    return code


class Tolerance(click.FloatRange):
    """A tolerance of the check: a finite number in the range (click's own lets nan and inf
    through, and a check with either would say nothing true)."""

    name = "finite float range"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value} is not a finite number", param, ctx)
        return number


def _once_each(option: str, pairs: list[tuple[str, object]]) -> dict:
    """{name: value} of an option given once per name (again with the same value is the same)."""
    chosen: dict = {}
    for name, value in pairs:
        if name in chosen and chosen[name] != value:
            raise UsageError(f"{option} gives {name} two values, {chosen[name]} and {value}")
        chosen[name] = value
    return chosen


def _parse_dims(values: tuple[str, ...]) -> dict[str, int]:
    pairs = []
    for value in values:
        name, sep, number = value.partition("=")
        if not sep or not number.strip().isdigit():
            raise UsageError(f"--dim expects NAME=SIZE, got '{value}'")
        pairs.append((name.strip(), int(number)))  # 0 too: a KV cache's empty past is a size models take
    return _once_each("--dim", pairs)


def _parse_shapes(values: tuple[str, ...]) -> dict[str, tuple]:
    pairs = []
    for value in values:
        name, sep, dims = value.rpartition(":")
        try:
            shape = tuple(int(d) for d in dims.split(",") if d.strip())
        except ValueError:
            shape = None
        if not sep or not name or shape is None:
            raise UsageError(f"--input-shape expects NAME:D1,D2,..., got '{value}'")
        if any(d < 0 for d in shape):
            raise UsageError(f"--input-shape {value}: a size is 0 or more")
        pairs.append((name, shape))
    return _once_each("--input-shape", pairs)


def _parse_ranges(values: tuple[str, ...]) -> dict[str, tuple[float, float]]:
    pairs = []
    for value in values:
        name, sep, bounds = value.rpartition(":")
        parts = bounds.split(",")
        try:
            low, high = (float(p) for p in parts)
        except ValueError:
            low = high = None
        if not sep or not name or low is None or not low < high or not math.isfinite(high - low):
            raise UsageError(f"--input-range expects NAME:LO,HI with LO < HI, got '{value}'")
        pairs.append((name, (low, high)))
    return _once_each("--input-range", pairs)


def _out(text: str, nl: bool = True) -> None:
    """Data on stdout (a report, the rules, the schema). Where the system cannot take it (a full
    disk, /dev/full) it is the output's error, not fuser's; a reader gone away (`| head`) is
    told apart by _fail."""
    try:
        click.echo(text, nl=nl)
    except BrokenPipeError:
        raise
    except OSError as error:
        raise OutputPathError(f"cannot write to standard output ({error.strerror or error})") from error


def _shows_json(report_path: str | None, fmt: str) -> bool:
    """Whether the run's report goes out as JSON, the one form that carries the files' digests."""
    return bool(report_path) or fmt == "json"


def _emit_report(data: dict, report_path: str | None, fmt: str, *also: Path) -> None:
    paths = ([Path(report_path)] if report_path else []) + list(also)
    # Serialized only when written or shown: a large model's report takes a noticeable while.
    text = report_module.dumps(data) if paths or fmt == "json" else ""
    for path in paths:
        write_text_atomically(path, text)
    if fmt == "json":
        _out(text)
    elif fmt == "markdown":
        _out(report_module.markdown(data), nl=False)


def write_text_atomically(path: Path, text: str) -> None:
    data = (text + "\n").encode()
    if path.is_symlink():
        path = _linked_file(path) or path
    if path.is_symlink() or (path.exists() and not path.is_file()):
        # /dev/stdout, a pipe, a link to one or to nothing yet: written through, never replaced by a
        # file; appended to, as stdout may be open on a log (`>> log`) that opening it anew would empty
        try:
            with open(path, "ab") as stream:
                stream.write(data)
        except OSError as error:
            raise ReportPathError(f"{path}: cannot write there ({error.strerror or error})") from error
        return
    try:
        write_bytes_atomically(path, data)
    except FuserError as error:
        raise ReportPathError(str(error)) from error


MAX_LINKS = 40  # as the system follows at most


def _linked_file(path: Path) -> Path | None:
    """The regular file a link the user made names, to be replaced as any report is (the link
    kept), as a shell's `>` follows a link; None for a link to anything else or to nothing yet,
    and for one that passes through /proc: /dev/stdout, /dev/fd/N stand for a stream fuser was
    handed, which may be open on a file (a log appended to) and is written through."""
    current = path
    try:
        for _ in range(MAX_LINKS):
            if os.path.realpath(current.parent).startswith("/proc/"):
                return None
            if not current.is_symlink():
                return current if current.is_file() else None
            link = Path(os.readlink(current))
            current = link if link.is_absolute() else current.parent / link
    except OSError:
        pass
    return None


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
    click.option("--atol", type=Tolerance(0), help="Absolute tolerance (default: per dtype)."),
    click.option("--rtol", type=Tolerance(0), help="Relative tolerance (default: per dtype)."),
]


def _unused_beside_inputs(inputs_path, dims, shapes, ranges, fix_shapes: bool = False) -> str | None:
    """A warning for the sizes and ranges the command line gives beside --inputs: they choose the
    inputs the check synthesizes, and --inputs gives it its own (--fix-shapes still writes the sizes)."""
    context = click.get_current_context()
    given = [
        flag
        for flag, name, value in (
            ("--dim", "dims", dims),
            ("--input-shape", "shapes", shapes),
            ("--input-range", "ranges", ranges),
        )
        if value
        and context.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE
        and not (fix_shapes and name in ("dims", "shapes"))
    ]
    if not inputs_path or not given:
        return None
    return f"fuser: warning: {' and '.join(given)} not used: the check runs on the inputs --inputs gives"


def with_check_options(function):
    for option in reversed(check_options):
        function = option(function)
    return function


def _check_options(seed, runs, inputs_path, dims, shapes, ranges, atol, rtol) -> CheckOptions:
    return CheckOptions(
        seed=seed,
        runs=runs,
        inputs=load_inputs(inputs_path) if inputs_path else None,
        dims=_parse_dims(dims),
        shapes=_parse_shapes(shapes),
        ranges=_parse_ranges(ranges),
        atol=atol,
        rtol=rtol,
    )


def _from_config() -> frozenset[str]:
    """The check settings naming inputs that come from [tool.fuser], which serves every model of a
    project: they apply to the models that have those names (names typed on the command line must exist)."""
    context = click.get_current_context()
    source = context.get_parameter_source
    return frozenset(p for p in ("dims", "shapes", "ranges") if source(p) == click.core.ParameterSource.DEFAULT_MAP)


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
@click.argument("models", nargs=-1, required=True, type=click.Path(dir_okay=True))
@click.option(
    "-o",
    "--output",
    type=click.Path(),
    help="One model: the output file (default: MODEL.fused.onnx beside MODEL), or a folder that exists or whose "
    "name ends in a slash. Several: a folder, created if missing, that gets them under their own names (default: "
    "each MODEL.fused.onnx beside its input).",
)
@click.option("--force", is_flag=True, help="Replace output files that exist.")
@click.option(
    "-j",
    "--jobs",
    type=click.IntRange(1),
    help="With several models: how many to optimize at once, each in its own process "
    "(default: one per core, as many as the available memory holds).",
)
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
    type=click.Choice(MISMATCH_ACTIONS),
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
@click.option(
    "--report", "report_path", type=click.Path(dir_okay=False), help="Write the JSON report (of every model) here."
)
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
    models,
    output,
    force,
    jobs,
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
    """Optimize each MODEL and write the result (the inputs are never modified).

    MODELS are .onnx files, folders (their *.onnx files, not those of subfolders, leaving out
    *.fused.onnx) or quoted glob patterns. Several models are optimized in parallel, each in a
    process of its own: one summary line each, one report for all, and the exit code of the
    worst one.
    """
    try:
        sources, several = jobs_module.expand_models(models)
        destinations = jobs_module.plan_outputs(sources, output, several)
        reads = (*rule_files, *([inputs_path] if inputs_path else []))
        _claim_report_path(report_path, tuple(sources), tuple(destinations), reads=reads)
        options = _check_options(seed, runs, inputs_path, dims, shapes, ranges, atol, rtol)
        unused = _unused_beside_inputs(inputs_path, dims, shapes, ranges, fix_shapes)
        _say(unused or "", quiet=quiet or unused is None)
        from_config = _from_config()
        planned = [
            jobs_module.OptimizeJob(
                source=source,
                destination=destination,
                force=force,
                external_data=external_data,
                target=target,
                opset=opset,
                rule_files=tuple(rule_files),
                enable=tuple(enable),
                disable=tuple(_disable_list(enable, disable)),
                check=not no_check,
                on_mismatch=on_mismatch,
                options=options,
                from_config=from_config,
                measure=measure,
                measure_threads=measure_threads,
                nchwc_block=nchwc_block,
                fix_shapes=fix_shapes,
                verbose=verbose,
                debug=ctx.debug,
                digests=_shows_json(report_path, fmt),
            )
            for source, destination in zip(sources, destinations)
        ]
        if several and output is not None:
            _make_folder(Path(output))
    except Exception as error:  # noqa: BLE001 - mapped to the exit-code contract
        return _fail_with_report("optimize", error, ctx.debug, report_path, fmt)
    if no_check:
        _say("fuser: warning: --no-check: the optimized model is NOT verified in onnxruntime", quiet)
    if several:
        return _optimize_many(planned, jobs, report_path, fmt, verbose, quiet)
    return _optimize_one(planned[0], report_path, fmt, quiet)


def _optimize_one(job: jobs_module.OptimizeJob, report_path, fmt, quiet) -> int:
    terminal = _terminal_progress(quiet)
    before = _file_identity(job.destination)
    try:
        try:
            notice = terminal.echo if terminal is not None else (lambda line: _say(line, quiet))
            outcome = jobs_module.optimize_file(job, progress=terminal, last=_ends_process, notice=notice)
        finally:
            if terminal is not None:
                terminal.close()
    except KeyboardInterrupt:
        written = _written_since(job.destination, before)
        entry = _interrupted_entry("optimize", job.source, _shows_json(report_path, fmt), written)
        _report_interrupted("optimize", [entry], report_path, fmt, several=False)
        raise
    for message in outcome.messages:
        click.echo(message, err=True)
    if outcome.error is None or outcome.report["verdict"] == "mismatch" or report_path or fmt == "json":
        try:
            _emit_report(outcome.report, report_path, fmt)
        except (OSError, FuserError) as error:
            if outcome.error is None:
                return _fail(error, job.debug)
            # else the report's own path is unusable; the one-line error above already said why
    if outcome.error is None and fmt == "text":
        _say("\n".join(outcome.summary), quiet)
    return outcome.code


def _optimize_many(planned: list[jobs_module.OptimizeJob], jobs, report_path, fmt, verbose, quiet) -> int:
    started = time.perf_counter()
    workers = min(jobs or jobs_module.default_jobs(planned), len(planned))
    _say(f"fuser: {report_module.models_text(len(planned))}, {workers} at a time", quiet)
    terminal = _terminal_progress(quiet)
    say = terminal.echo if terminal is not None else (lambda line: click.echo(line, err=True))
    finished_outcomes: list[jobs_module.Outcome] = []
    before = {job.destination: _file_identity(job.destination) for job in planned}

    def show(outcome: jobs_module.Outcome) -> None:
        """One line as each model finishes (its traceback first under --debug; its summary with -v)."""
        finished_outcomes.append(outcome)
        finished = len(finished_outcomes)
        lines = [*outcome.messages[:-1], outcome.line()] if outcome.error is not None else [outcome.line()]
        if verbose and outcome.error is None:
            lines += [f"  {line}" for line in outcome.summary[:-1]]
        if outcome.error is not None or not quiet:
            for line in lines:
                say(line)
        if terminal is not None:
            terminal("models", finished, len(planned))

    try:
        try:
            if terminal is not None:
                terminal("models", 0, len(planned))
            outcomes = jobs_module.run_jobs(planned, workers, show, notice=lambda line: None if quiet else say(line))
        finally:
            if terminal is not None:
                terminal.close()
    except KeyboardInterrupt:
        done = {outcome.source: outcome.report for outcome in finished_outcomes}
        shows_json = _shows_json(report_path, fmt)
        reports = [
            done.get(str(job.source))
            or _interrupted_entry(
                "optimize", job.source, shows_json, _written_since(job.destination, before[job.destination])
            )
            for job in planned
        ]
        seconds = time.perf_counter() - started
        _report_interrupted("optimize", reports, report_path, fmt, several=True, jobs=workers, seconds=seconds)
        raise
    code = max(outcome.code for outcome in outcomes)
    failed = sum(outcome.error is not None for outcome in outcomes)
    elapsed = time.perf_counter() - started
    _say(
        f"{report_module.models_text(len(outcomes))}: {len(outcomes) - failed} written, {failed} failed (exit {code}); "
        f"{workers} at a time, {elapsed:.1f} s",
        quiet and not failed,
    )
    combined = report_module.batch_envelope("optimize", [o.report for o in outcomes], jobs=workers, seconds=elapsed)
    try:
        _emit_report(combined, report_path, fmt)
    except (OSError, FuserError) as error:
        return max(code, _fail(error, planned[0].debug))
    return code


def _make_folder(folder: Path) -> None:
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"-o {folder}: cannot create the folder ({error.strerror or error})") from error


INTERRUPTED = "interrupted before it was done"


def _interrupted_entry(command: str, source: Path, digest: bool, written: Path | None = None) -> dict:
    """The report of a model whose work Ctrl-C (or SIGTERM) stopped: named by its input entry,
    as every model's report is (with its digest in a JSON report, as for any error). `written`:
    its output, put in place before the stop came, which its report names."""
    entry = report_module.input_entry(source, digest=digest)
    if written is None:
        return report_module.envelope(command, "error", EXIT_INTERRUPTED, error=f"{source}: {INTERRUPTED}", input=entry)
    return report_module.envelope(
        command,
        "error",
        EXIT_INTERRUPTED,
        error=f"{source}: interrupted once {written} was written, before its report was done",
        input=entry,
        output=report_module.regular_file_entry(written, digest=digest),
    )


def _file_identity(path: Path) -> tuple | None:
    """What tells the file at `path` from one put there later; None where there is none."""
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino, status.st_mtime_ns, status.st_size


def _written_since(path: Path, before: tuple | None) -> Path | None:
    """`path`, where the run put a file there: an output is only ever renamed into place whole."""
    now = _file_identity(path)
    return path if now is not None and now != before else None


def _report_interrupted(command: str, reports: list[dict], report_path, fmt, several: bool, **fields) -> None:
    """Write the report of a run Ctrl-C (or SIGTERM) stopped where a failed run's report would be
    written: the models done before, and the others as interrupted."""
    if not (_shows_json(report_path, fmt) or (several and fmt == "markdown")):
        return
    combined = reports[0]
    if several:
        combined = report_module.batch_envelope(command, reports, **fields)
        unfinished = sum(r["exit_code"] == EXIT_INTERRUPTED for r in reports)
        combined["error"] = f"{INTERRUPTED}: {unfinished} of {report_module.models_text(len(reports))} not done"
    try:
        _emit_report(combined, report_path, fmt)
    except KeyboardInterrupt:
        pass  # interrupted again: the run ends without its report (an earlier run's is gone already)
    except (OSError, FuserError) as error:
        _fail(error, debug=False)  # the run still ends as interrupted


def _fail_with_report(command: str, error: BaseException, debug: bool, report_path, fmt, **models: Path) -> int:
    """Map the error to its exit code and, when a report was asked for, say so in it too, with
    the entries of the `models` it is about (input=, output=)."""
    code = _fail(error, debug)
    if isinstance(error, ReportPathError):
        report_path = None
    if (report_path or fmt == "json") and not isinstance(error, BrokenPipeError):
        try:
            entries = {field: report_module.input_entry(path) for field, path in models.items()}
            _emit_report(report_module.envelope(command, "error", code, error=str(error), **entries), report_path, fmt)
        except (OSError, FuserError):
            pass  # the report's own path is unusable; the one-line error above already said why
    return code


def _disable_list(enable: tuple[str, ...], disable: tuple[str, ...]) -> tuple[str, ...]:
    """A rule named by --enable on the command line wins over a `disable` from [tool.fuser]."""
    context = click.get_current_context()
    if context.get_parameter_source("disable") == click.core.ParameterSource.DEFAULT_MAP:
        return tuple(name for name in disable if name not in enable)
    return disable


def _terminal_progress(quiet: bool) -> TerminalProgress | None:
    """Progress bars on stderr when it is a terminal; nothing in CI logs and with -q. Some CI
    runners give the job a pseudo-terminal; they all set CI, and their logs keep every redraw."""
    if quiet or not sys.stderr.isatty() or _in_ci():
        return None
    return TerminalProgress()


def _in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


class TerminalProgress:
    """Draws `progress(stage, done, total)` (fuser/progress.py) on stderr: the stage's name while
    its total is unknown, then a bar with the counts and the rate."""

    LABELS = {
        "load": "loading",
        "upgrade": "upgrading the opset",
        "fix-shapes": "fixing the input sizes",
        "measure": "timing in onnxruntime",
        "rewrite": "rewriting",
        "match": "looking for fusions",
        "check": "checking numerics",
        "blame": "finding the guilty rewrites",
        "write": "writing",
        "models": "optimizing",
    }

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.stage: str | None = None
        self.bar = None
        self.clock = clock
        self.started = 0.0
        self.origin = 0  # the count the bar started at

    def __call__(self, stage: str, done: int, total: int | None) -> None:
        label = f"fuser: {self.LABELS.get(stage, stage)}"
        if stage != self.stage:
            self.close()
            self.stage, self.started = stage, self.clock()
            click.echo(f"\r\033[K{label}...", err=True, nl=False)
        if total is None:
            return
        if self.bar is None:
            # The rate counts from the first count: the stage's work before it (parsing the file
            # before its nodes are read into the graph, the passes before the first visit) is
            # not counted work, and counts come every thousand units, the first with some done.
            self.started, self.origin = self.clock(), done
            self.bar = click.progressbar(
                length=max(total, 1),
                label=label,
                show_pos=True,
                show_eta=False,
                item_show_func=lambda rate: rate,
                file=sys.stderr,
            )
            self.bar.__enter__()
        if max(total, done) > self.bar.length:  # more work found (rewrites queue nodes): the bar goes on
            self.bar.length, self.bar.finished = max(total, done), False
        elapsed, counted = self.clock() - self.started, done - self.origin
        rate = f"{counted / elapsed:,.1f} {UNITS.get(stage, stage)}/s" if counted > 0 and elapsed > 0 else ""
        self.bar.update(done - self.bar.pos, rate)

    def echo(self, line: str) -> None:
        """A line above the bar, which is drawn again below it."""
        click.echo(f"\r\033[K{line}", err=True)
        if self.bar is not None:
            self.bar.render_progress()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.render_finish()
        elif self.stage is not None:
            click.echo("", err=True)
        self.bar, self.stage = None, None


class ReportPathError(UsageError):
    """The report path is unusable, so the error report must not be written there either."""


# A name a model or its external data goes by (m.onnx, m.onnx.data, m.onnx_data): never a report's,
# whose writing would replace a model that is not the run's own.
MODEL_FILE_NAME = re.compile(r"\.onnx(\.data|_data)?$", re.IGNORECASE)


def _require_writable_folder(path: Path, report_path: str) -> None:
    """Refuse, before the long work, a report that could not be created: its folder is read-only,
    or one where no file can be made (/proc). A path that exists is written through or replaced,
    which writing the report checks; a folder still to be made is made then."""
    folder = path.parent
    try:
        if path.exists() or path.is_symlink():
            return
        while not folder.exists() and folder != folder.parent:  # made when the report is written
            folder = folder.parent
        if not folder.is_dir():
            return  # check_folder refused it already
        handle, probe = tempfile.mkstemp(dir=folder, prefix=".fuser-report-")
    except OSError as error:
        why = error.strerror or str(error)
        raise ReportPathError(f"--report {report_path}: cannot write in {folder} ({why})") from error
    os.close(handle)
    os.unlink(probe)


def _claim_report_path(
    report_path: str | None, inputs: tuple[Path, ...], outputs: tuple[Path, ...] = (), reads: tuple = ()
) -> None:
    """Make sure the report never lands on a file the run reads or writes: a model, its external
    data, its --inputs or --rules (`--report model.onnx` would destroy it; `--report out.onnx.data`
    would leave the written model without its weights), nor on any file named as a model or its
    data are, and that it can be made (_require_writable_folder). Then remove a report an earlier run left
    at the path: a run that ends before it writes its own (killed, or stopped while writing it)
    must not leave that one to be read as its own. Only a fuser report is removed; anything else
    there is left to the report's write, as it always was."""
    if report_path is None:
        return
    path = Path(report_path)
    try:
        jobs_module.check_folder(path)
        target = path.resolve()
    except UsageError as error:
        raise ReportPathError(f"--report {error}") from error
    except (OSError, RuntimeError) as error:  # a loop of symbolic links
        raise ReportPathError(f"--report {report_path}: cannot follow the path ({error})") from error
    for model in (*inputs, *outputs):
        if target == Path(model).resolve():
            raise ReportPathError(f"--report {report_path} names a model file; choose another report path")
    for output in outputs:
        if target == external_data_path(Path(output)).resolve():
            raise ReportPathError(
                f"--report {report_path} names the file {output} keeps its weights in when written with "
                "external data; choose another report path"
            )
    for name in reads:
        if target == Path(name).resolve():
            raise ReportPathError(f"--report {report_path} names a file this run reads; choose another report path")
    stale = report_module.is_report_file(path)
    if not stale and target.is_file():
        # Only a file that exists can be a model's external data; the models are scanned for
        # the files they name only then (a report path is seldom anything but a report).
        for model in inputs:
            if target in external_data_files(Path(model)):
                raise ReportPathError(
                    f"--report {report_path} names the external data of {model}; choose another report path"
                )
    if MODEL_FILE_NAME.search(path.name):
        raise ReportPathError(
            f"--report {report_path} names a model file (.onnx, .onnx.data or .onnx_data); "
            "a report is JSON: choose another report path"
        )
    _require_writable_folder(path, report_path)
    if stale:
        try:
            path.unlink()
        except OSError:
            pass  # writing the report will say what is wrong with the path


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("models", nargs=-1, required=True, type=click.Path(dir_okay=True))
@with_rule_options
@click.option("--exit-zero", is_flag=True, help="Exit 0 even when there is work to do.")
@click.option("--report", "report_path", type=click.Path(dir_okay=False), help="Write the JSON report here.")
@click.option("--format", "fmt", type=click.Choice(["text", "json", "markdown"]), default="text", show_default=True)
@click.option("-q", "--quiet", is_flag=True)
@click.pass_obj
def check(
    ctx: Context, models, target, opset, rule_files, enable, disable, nchwc_block, exit_zero, report_path, fmt, quiet
):
    """List the fusions the enabled rules would make in each MODEL; write nothing.

    Exits 1 when there is at least one (a gate for "the exported model is fully fused"). MODELS
    are files, folders or glob patterns as for `optimize`; with several, the worst exit code wins.
    """
    try:
        sources, several = jobs_module.expand_models(models)
        _claim_report_path(report_path, tuple(sources), reads=rule_files)
        disable = _disable_list(enable, disable)
        block = resolve_nchwc_block(nchwc_block)
    except Exception as error:  # noqa: BLE001
        return _fail_with_report("check", error, ctx.debug, report_path, fmt)
    reports: list[dict] = []
    run_started = time.perf_counter()
    terminal = _terminal_progress(quiet)
    try:
        for source in sources:
            started = time.perf_counter()
            try:
                try:
                    result = api.find_opportunities(
                        source,
                        target=target,
                        enable=enable,
                        disable=disable,
                        rule_files=rule_files,
                        opset=opset,
                        nchwc_block=block,
                        progress=terminal,
                    )
                finally:
                    if terminal is not None:
                        terminal.close()  # the model's lines go below its bars
            except Exception as error:  # noqa: BLE001
                if not several:
                    return _fail_with_report("check", error, ctx.debug, report_path, fmt, input=source)
                code = _fail(error, ctx.debug, source)
                entry = report_module.input_entry(source)
                seconds = time.perf_counter() - started
                reports.append(
                    report_module.envelope("check", "error", code, error=str(error), input=entry, seconds=seconds)
                )
                continue
            found = result.opportunities
            code = EXIT_WORK_FOUND if found and not exit_zero else EXIT_OK
            reports.append(
                report_module.envelope(
                    "check",
                    "work-found" if found else "fully-fused",
                    code,
                    # A pipe was read by the load.
                    input=report_module.input_entry(source, digest=_shows_json(report_path, fmt)),
                    target=target,
                    nchwc_block=block,
                    opportunities=[o.to_dict() for o in found],
                    skipped_rules=result.skipped_rules,
                    seconds=time.perf_counter() - started,
                )
            )
            if fmt == "text" and not quiet:
                for item in found:
                    _say(f"{source}: {item.rule} [{item.scope}] {', '.join(item.nodes)}")
                name = f"{source}: " if several else ""
                _say(f"{name}{len(found)} fusion opportunit{'y' if len(found) == 1 else 'ies'}")
    except KeyboardInterrupt:
        shows_json = _shows_json(report_path, fmt)
        rest = [_interrupted_entry("check", source, shows_json) for source in sources[len(reports) :]]
        _report_interrupted("check", reports + rest, report_path, fmt, several)
        raise
    try:
        seconds = time.perf_counter() - run_started
        combined = report_module.batch_envelope("check", reports, seconds=seconds) if several else reports[0]
        _emit_report(combined, report_path, fmt)
    except Exception as error:  # noqa: BLE001
        return _fail(error, ctx.debug)
    return combined["exit_code"]


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
        _claim_report_path(report_path, (Path(first), Path(second)), reads=(inputs_path,) if inputs_path else ())
        # No graph is built: nothing is rewritten (two graphs of a million nodes take 7.6 GB).
        (a, a_folder), (b, b_folder) = load_for_sessions([first, second])
        options = _check_options(seed, runs, inputs_path, dims, shapes, ranges, atol, rtol)
        unused = _unused_beside_inputs(inputs_path, dims, shapes, ranges)
        _say(unused or "", quiet=unused is None)
        options = jobs_module.options_for(a, options, _from_config())
        reference, notes = _runnable_here(a, a_folder, first)
        candidate, more_notes = _runnable_here(b, b_folder, second)
        del a, b
        # The reference is the Checker's own, run once: a large one starts in pieces, as the
        # candidate does (the 100k-node MLP stack against its optimized model: 15.6 s at 1.63 GB
        # with the reference's session whole, 11.9 to 12.2 s at 1.42 GB in pieces).
        checker = Checker(reference, options, base_dir=a_folder, own=True)
        verdict = checker.check(candidate, exact, base_dir=b_folder)
        notes += more_notes
        code = EXIT_OK if verdict.passed else EXIT_MISMATCH
        _emit_report(
            report_module.envelope(
                "compare",
                "match" if verdict.passed else "mismatch",
                code,
                input=report_module.file_entry(first),
                output=report_module.file_entry(second),
                numerics=verdict.to_dict(),
                notes=notes,
            ),
            report_path,
            fmt,
        )
        if fmt == "text":
            _say("\n".join(f"note: {note}" for note in notes), quiet=not notes)
            _say(f"checked on {verdict.inputs_text()}")
            _say("\n".join(f"warning: {warning}" for warning in verdict.warnings), quiet=not verdict.warnings)
            if verdict.load_error:
                _say(verdict.summary())
            for o in verdict.outputs:
                _say(
                    f"{o.name:<24} {o.status:<10} max abs {o.max_abs_error:.3g}  max rel {o.max_rel_error:.3g}"
                    f"  out of tolerance {o.fraction_out_of_tolerance:.2%}"
                )
            _say("\n".join(o.rounding_text() for o in verdict.rounded), quiet=not verdict.rounded)
        return code
    except KeyboardInterrupt:
        digest = _shows_json(report_path, fmt)
        entry = report_module.envelope(
            "compare",
            "error",
            EXIT_INTERRUPTED,
            error=f"{first} against {second}: {INTERRUPTED}",
            input=report_module.input_entry(first, digest=digest),
            output=report_module.input_entry(second, digest=digest),
        )
        _report_interrupted("compare", [entry], report_path, fmt, several=False)
        raise
    except Exception as error:  # noqa: BLE001
        return _fail_with_report("compare", error, ctx.debug, report_path, fmt, input=first, output=second)


def _runnable_here(proto: onnx.ModelProto, folder: Path, path) -> tuple:
    """The model as onnxruntime here can run it (its weights read from `folder`): one written for
    another machine's NCHWc block (whose guard would stop it) with its NCHWc operators lowered to
    standard ones."""
    from fuser.context import machine_nchwc_block
    from fuser.nchwc import lower, written_block
    from fuser.tensors import uses_external_data
    from fuser.verify import with_inline_weights

    block, machine = written_block(proto), machine_nchwc_block()
    if block is None or block == machine:
        return proto, []
    if any(uses_external_data(t) for t in proto.graph.initializer):
        proto = with_inline_weights(proto, folder)  # the lowering reads NCHWc filters as arrays
    note = (
        f"{path} is written for NCHWc block {block}, this machine's is {machine or 'none'}: its NCHWc "
        "operators ran as standard ones computing the same values (fuser/nchwc.py)"
    )
    return lower(proto, block), [note]


@cli.command(name="rules", epilog=EXIT_CODES_HELP)
@click.option(
    "--target", type=click.Choice(["onnx", "onnxruntime"]), default=None, help="Only rules that run for this target."
)
@click.option("--rules", "rule_files", multiple=True, type=click.Path(dir_okay=False))
@click.option("--format", "fmt", type=click.Choice(["text", "json"]), default="text", show_default=True)
@click.option("--selftest", is_flag=True, help="Run each rule on random instances of its own pattern and check them.")
@click.option("--rule", "only", multiple=True, metavar="NAME", help="With --selftest: only this rule (repeatable).")
@click.option(
    "--seed", type=click.IntRange(0), default=0, show_default=True, help="With --selftest: seed of the instances."
)
@click.option("--instances", type=click.IntRange(1), default=4, show_default=True, help="With --selftest: per rule.")
@click.option(
    "--save-dir",
    type=click.Path(file_okay=False),
    default="fuser-selftest",
    show_default=True,
    help="With --selftest: where failing models go.",
)
@click.pass_obj
def list_rules(ctx: Context, target, rule_files, fmt, selftest, only, seed, instances, save_dir):
    """List the registered rules: name, target, on by default, description.

    With --selftest, check them instead: exit 3 if a rewrite fails the numerics check, 4 if a
    rule fails."""
    import json

    try:
        if only and not selftest:
            raise UsageError("--rule picks the rules of --selftest; without it every rule is listed")
        rules = all_rules(list(rule_files))
        if selftest:
            return _selftest(rules, target, only, seed, instances, save_dir, fmt)
        if target:
            names = {r.name for r in select(rules, target, enable=[r.name for r in rules])}
            rules = [r for r in rules if r.name in names]
        if fmt == "json":
            _out(
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
            _out(f"{r.name:<{width}}  {r.target:<11}  {default:<3}  {r.description}")
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
        _out(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        width = max((len(r.rule) for r in results), default=0)
        for r in results:
            _out(f"{r.rule:<{width}}  {r.summary()}")
            for reason, count in r.declined.most_common():
                _out(f"  {count:>5} x declined: {reason}")
            for problem in r.failures + r.errors:
                _out(f"  FAILED {problem}")
    if any(r.errors for r in results):
        return EXIT_INTERNAL
    return EXIT_MISMATCH if any(r.failures for r in results) else EXIT_OK


def main(argv: list[str] | None = None) -> int:
    """The command line as a function (sys.argv's arguments when `argv` is None): it ends by
    raising SystemExit with the exit code, which the caller may catch."""
    sys.exit(run(argv))


# onnxruntime's opt-out of its telemetry, read as it is first imported (onnxruntime 1.29 and later).
ORT_TELEMETRY_SWITCH = "ORT_DISABLE_TELEMETRY"

# Whether the process ends with this command (the `fuser` program; not main, called by other code).
_ends_process = False


def program() -> None:
    """The `fuser` command (and `python -m fuser`): main, in a process that ends with it. It ends
    at once when its output is out, without freeing what it made (fuser/jobs.py: optimize_file's
    `last`), unless a tracer, a profiler or a coverage tool is attached."""
    global _ends_process
    _ends_process = not _watched()
    # onnxruntime 1.29 and later send usage telemetry from Linux too: they keep a device id and
    # an event queue in the home folder, and warn at every start where they cannot write there
    # (a CI container's user). The command opts out, unless the environment says otherwise.
    os.environ.setdefault(ORT_TELEMETRY_SWITCH, "1")
    stop_on_sigterm()
    end(run(None))


# The signal that stopped the run early, Ctrl-C's SIGINT or a supervisor's SIGTERM: the process
# ends by it (end), as a program that signal stopped ends.
_stopped_by = signal.SIGINT


def stop_on_sigterm() -> None:
    """Make SIGTERM (a CI job's timeout or cancellation, `kill`) stop the run as Ctrl-C does: the
    workers end, nothing half-written stays, the report says the run was interrupted, and the
    process ends by SIGTERM. Python's own SIGTERM ends the process at once, leaving the workers
    of `-j` running, and writing their models, after it."""
    if os.name != "posix":
        return

    def stop(number, frame) -> None:
        global _stopped_by
        _stopped_by = signal.Signals(number)
        # A second SIGTERM ends at once a run whose cleanup native code holds up (a long
        # onnxruntime call); Python runs this handler only between its own instructions.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def end(code: int) -> NoReturn:
    """End the process with `code`: at once when it ends with the `fuser` program (see program),
    and after an interruption (EXIT_INTERRUPTED) by the signal that stopped it (SIGINT, or
    SIGTERM), as a program that signal stopped ends: a shell running fuser in a loop then stops
    the loop as well (an exit code of 130 would not), and reports 130 (143)."""
    if code == EXIT_INTERRUPTED and os.name == "posix" and not _watched():
        _run_exit_handlers()
        signal.signal(_stopped_by, signal.SIG_DFL)
        os.kill(os.getpid(), _stopped_by)
    if _ends_process:
        _exit_at_once(code)
    sys.exit(code)


def run(argv: list[str] | None) -> int:
    """The command line (sys.argv's arguments when `argv` is None), run in this process: its
    errors told on stderr as the command tells them; returns the exit code."""
    argv = _debug_first(list(sys.argv[1:] if argv is None else argv))
    try:
        code = cli.main(args=argv, prog_name="fuser", standalone_mode=False)
    except click.exceptions.Exit as done:
        code = done.exit_code
    except click.ClickException as error:
        click.echo(f"fuser: error: {error.format_message()} (see fuser --help)", err=True)
        code = EXIT_USAGE
    except click.exceptions.Abort as abort:
        if isinstance(abort.__cause__, KeyboardInterrupt):
            click.echo("fuser: interrupted" if _stopped_by == signal.SIGINT else "fuser: terminated", err=True)
            code = EXIT_INTERRUPTED
        else:
            click.echo("fuser: aborted", err=True)
            code = EXIT_USAGE
    return code if isinstance(code, int) else EXIT_OK


def _exit_at_once(code: int) -> None:
    """End the process now, with its exit handlers run and its output flushed, without freeing
    what it made or tearing its modules down."""
    if not _run_exit_handlers():
        code = code or 120
    os._exit(code)


def _run_exit_handlers() -> bool:
    """Run what other code asked to run at the end, as the interpreter would, and flush the
    output; False when output was lost (a full disk, a stream closed), as Python's own end says."""
    atexit._run_exitfuncs()
    flushed = True
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # closed when the process started (`>&-`)
            continue
        try:
            stream.flush()
        except BrokenPipeError:  # the reader went away (`| head`): what it left unread is not lost to it
            pass
        except (OSError, ValueError):
            flushed = False
    return flushed


def _watched() -> bool:
    """Whether a tracer, a profiler or a coverage tool is attached: those write what they found
    as the interpreter ends, which ending the process at once would lose."""
    if sys.gettrace() is not None or sys.getprofile() is not None:
        return True
    monitoring = getattr(sys, "monitoring", None)  # Python 3.12+
    return monitoring is not None and any(monitoring.get_tool(tool) is not None for tool in range(6))


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
        for name in only:  # known (resolve_rules said so), but left out by the target or --disable
            if not fnmatch.filter([r.name for r in chosen], name):
                everything = api.resolve_rules(None, "onnxruntime", enable, (), rule_files)
                onnxruntimes = [r.name for r in everything if r.target == "onnxruntime"]
                if target != "onnxruntime" and fnmatch.filter(onnxruntimes, name):
                    raise UsageError(f"--rule {name}: onnxruntime's rules are explained with --target onnxruntime")
                raise UsageError(f"--rule {name}: turned off by --disable")
        _, result = api.optimize(
            Model.load(Path(model)),
            rules=chosen,
            target=target,
            enable=[r.name for r in chosen],  # chosen already: those off by default that --rule or --enable turned on
            check=False,
            trace=True,
            opset=opset,
            nchwc_block=nchwc_block,
            weights_apart=True,  # the model is not needed: no copy of its weights
        )
        explained = explain.explain(result.engine, chosen)
        if only:
            explained = [e for e in explained if any(fnmatch.fnmatchcase(e.rule, name) for name in only)]
        unmatched = [r for r in chosen if any(e.rule == r.name and not e.matched and not e.skipped for e in explained)]
        if unmatched:
            # Where each would have rewritten the input on its own: another rule may have been first.
            alone = api.find_opportunities(
                Path(model),
                rules=unmatched,
                target=target,
                enable=[r.name for r in unmatched],
                opset=opset,
                nchwc_block=nchwc_block,
            )
            explain.note_taken_places(explained, alone.opportunities, result.engine)
        if fmt == "json":
            _out(
                json.dumps({"model": str(model), "target": target, "rules": [e.to_dict() for e in explained]}, indent=2)
            )
        else:
            _out("\n".join(explain.render(explained)))
        return EXIT_OK
    except Exception as error:  # noqa: BLE001
        return _fail(error, ctx.debug)


@cli.command(name="schema", epilog=EXIT_CODES_HELP)
@click.pass_obj
def print_schema(ctx: Context):
    """Print the JSON Schema of the reports (--report, --format json), for pipelines to validate them."""
    from importlib.resources import files

    try:
        _out(files("fuser").joinpath("report.schema.json").read_text(), nl=False)
        return EXIT_OK
    except Exception as error:  # noqa: BLE001
        return _fail(error, ctx.debug)


if __name__ == "__main__":
    program()
