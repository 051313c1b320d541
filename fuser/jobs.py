"""Optimizing model files: one in this process, or many at once, each in a worker process of its own.

`optimize_file` takes one model from file to file (load, rewrite, check, write) and returns an
`Outcome`: the exit code, the report, the lines of its summary. It never prints and never exits,
so the command line decides what to show, and a worker process can send the Outcome back.
`run_jobs` runs several at a time, each in a fresh process: a crash, or the system killing a
worker when memory runs out, is that model's failure, reported as such; the others go on.
"""

from __future__ import annotations

import dataclasses
import gc
import glob
import importlib
import mmap
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
import pickle
import pkgutil
import select
import signal
import stat
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.connection import wait
from pathlib import Path

import onnx

from fuser import api, ending, stops, validation, verify
from fuser import report as report_module
from fuser.errors import EXIT_INTERNAL, EXIT_OK, FuserError, InputError, NumericsMismatch, OutputPathError, UsageError
from fuser.graph import paused_gc
from fuser.leftovers import StagingFolder, remove_left
from fuser.model import (
    Model,
    external_data_files,
    external_data_path,
    found_as_external_data,
    put_in_place,
    refuse_input_data_file,
    require_model_file,
    write_bytes_atomically,
    write_model,
    writes_external_data,
)
from fuser.progress import STAGES, Progress, silent
from fuser.report import bytes_text
from fuser.tensors import TensorStore, names_a_file_inside
from fuser.verify import CheckOptions, check_names, input_names
from fuser.wire import Census
from fuser.wire import census as wire_census

FUSED_SUFFIX = ".fused.onnx"


@dataclass(frozen=True)
class OptimizeJob:
    """Everything one model's optimization needs; plain data, so it can go to a worker process.

    from_config: the check settings (of "dims", "shapes", "ranges") that came from [tool.fuser],
    which serves every model of a project: each model keeps the names it has of those.
    """

    source: Path
    destination: Path
    force: bool = False
    external_data: str = "auto"
    target: str = "onnx"
    opset: int | None = None
    rule_files: tuple[str, ...] = ()
    enable: tuple[str, ...] = ()
    disable: tuple[str, ...] = ()
    check: bool = True
    on_mismatch: str = "fail"
    options: CheckOptions = CheckOptions()
    from_config: frozenset[str] = frozenset()
    measure: str | None = None
    measure_threads: int = 1
    nchwc_block: str | int = "auto"
    fix_shapes: bool = False
    verbose: bool = False
    debug: bool = False
    threads: int = 0  # of the check's onnxruntime sessions; 0: onnxruntime's default (every core)
    # The report's sha256 of the input and the output, which only a JSON report shows: reading and
    # hashing a 500 MB model takes 0.5 s, a quarter of GPT-2's run, for a report no one reads.
    digests: bool = True


@dataclass
class Outcome:
    """What became of one model: its exit code, its report, and what to tell a person."""

    source: str
    code: int
    report: dict
    summary: list[str] = field(default_factory=list)  # the full summary, ending with "wrote ..."
    messages: list[str] = field(default_factory=list)  # the error line (and a traceback under --debug)
    error: str | None = None
    written: str | None = None
    seconds: float = 0.0

    def line(self) -> str:
        """One line for this model among many."""
        if self.error is not None:
            return f"FAILED {self.source} (exit {self.code}): {self.error.removeprefix(f'{self.source}: ')}"
        nodes = f"nodes {self.report.get('nodes_before')} -> {self.report.get('nodes_after')}"
        rewrites = len(self.report.get("rewrites") or [])
        numerics = self.report.get("numerics")
        dropped = len(self.report.get("dropped") or [])
        if numerics is not None:
            # --on-mismatch drop: what the check left out is said here, not only under -v
            check = f"check passed after dropping {dropped} rewrite(s)" if dropped else "check passed"
        elif rewrites:
            check = "check SKIPPED"
        else:
            check = "nothing to check"
        return f"{self.source} -> {self.written}: {nodes}, {rewrites} rewrites, {check}, {self.seconds:.1f} s"


def options_for(model: onnx.ModelProto, options: CheckOptions, from_config: frozenset[str]) -> CheckOptions:
    """`options` for this model: settings from [tool.fuser] narrowed to the names it has, the rest checked."""
    names, symbols = input_names(model)
    known = {"dims": symbols, "shapes": names, "ranges": names}
    narrowed = {name: {k: v for k, v in getattr(options, name).items() if k in known[name]} for name in from_config}
    options = options.replace(**narrowed)
    check_names(model, options)
    return options


def optimize_file(
    job: OptimizeJob,
    progress: Progress | None = None,
    *,
    last: bool = False,
    notice: Callable[[str], None] | None = None,
) -> Outcome:
    """Optimize job.source into job.destination: the report and summary of it, or of its failure.

    notice: told at once what a person should know before the long work, not at its end (the
    check may need more memory than there is: the system would stop the process without a word).

    last: the process ends soon after this job (the `fuser` command, a -j worker). Its models are
    then kept once written, not freed as this returns, and the cyclic collector stays off: the
    system takes the process's memory back at once, where Python frees a graph object by object
    (0.2 s at 100k nodes, seconds at a million), and the collector, back on, would scan every
    object the job made and kept."""
    # The cyclic collector waits for the end of the job. A graph is millions of objects that hold
    # no reference cycles, freed by reference counting as the job drops them; collected as they
    # aged, each was scanned three times, about a twentieth of the job's time at 100k nodes. What
    # cycles the job itself makes wait for its end: 6 MB on the deepest export measured.
    if last:
        gc.disable()
        ending.ends_soon()
        return _optimize_file(job, progress, notice)
    with paused_gc():
        return _optimize_file(job, progress, notice)


def _optimize_file(
    job: OptimizeJob,
    progress: Progress | None,
    notice: Callable[[str], None] | None = None,
    lean: bool = True,
    spent: dict[str, float] | None = None,
    started: float | None = None,
) -> Outcome:
    """optimize_file's work. lean: where the check may not fit beside the rewritten graph, it may
    run once the result is written and the graph let go (_check_written). spent, started: the
    seconds per stage of an earlier attempt at the same job, and when it started: the report's
    times are the job's, not this attempt's."""
    started = time.perf_counter() if started is None else started
    spent = spent or {}
    source, destination = job.source, job.destination
    progress = progress or silent
    loaded = None
    hashing = None  # the input's entry for the report, worked out beside the rewrite
    try:
        require_model_file(source)  # what is wrong with the input first, then with the output
        check_destination(source, destination, job.force)
        progress("load", 0, None)
        loading = time.perf_counter()
        # Returned while onnx's check of a large model may still run beside the rewrite: whatever
        # fails, a model the check refuses is said to be one (_refused).
        loaded = Model.load(source, progress=progress, validated=False)
        if job.digests:  # after the load, which forks only a process of one thread
            hashing = report_module.file_entry_soon(source)
        load_seconds = time.perf_counter() - loading
        read = files_read(source, loaded)
        refuse_to_write_over(destination, source, read)
        size_before = sum(_size(f) for f in read)
        warning = None
        if job.check:
            lean = lean and _checks_after_writing(job)
            warning = check_memory_warning(source, loaded.node_count(), size_before, available_memory(), lean)
        lean = lean and warning is not None
        if warning and notice is not None:
            notice(warning)
        options = options_for(loaded.interface(), job.options, job.from_config)
        external_data = job.external_data
        if writes_external_data(loaded, external_data):  # fail before the long work
            refuse_input_data_file(external_data_path(destination), read)
            check_destination(source, external_data_path(destination), job.force)
            external_data = "always"  # weights the input kept outside stay outside, whatever the rewrites made
        optimized, result = api.optimize(
            loaded,
            target=job.target,
            opset=job.opset,
            enable=job.enable,
            disable=job.disable,
            rule_files=job.rule_files,
            check=job.check and not lean,
            on_mismatch=job.on_mismatch,
            trace=True,  # the report and -v list every decline
            progress=progress,
            measure=job.measure,
            measure_threads=job.measure_threads,
            nchwc_block=job.nchwc_block,
            fix_shapes=job.fix_shapes,
            check_options=options,
            weights_apart=True,  # written from the loaded model's own weights, not a copy
        )
        progress("write", 0, None)
        writing = time.perf_counter()
        digests: dict[Path, str] | None = {} if job.digests else None
        checked_after = lean and bool(result.rewrites)
        _remove_left(destination, notice)
        # Written beside the output and moved into place once the check passed.
        staging = _staging_folder(destination) if checked_after else None
        passed = True
        try:
            written = write_model(
                optimized,
                destination if staging is None else staging.path / destination.name,
                source_dir=source.parent,
                external_data=external_data,
                progress=progress,
                tensors=loaded.tensors,
                digests=digests,
            )
            write_seconds = time.perf_counter() - writing
            if staging is not None:
                optimized = loaded = None  # the graph is let go: the check's sessions take its place
                # The report's records of the rewrites were made among the graph's objects, and keep
                # the memory they share from going back to the system: copied afresh, they do not
                # (the 100k-node ResNet stack's run held 364 MB once its graph was let go, 269 MB
                # with its records copied, 216 MB without them).
                result.engine = pickle.loads(pickle.dumps(result.engine))
                verify.return_freed_memory()
                checking = time.perf_counter()
                passed = _check_written(job, result, options, written[0], progress)
                moving = time.perf_counter()
                result.timings["check"] = moving - checking
                if passed:
                    written, digests = _moved_into_place(written, digests, destination.parent, staging)
                    write_seconds += time.perf_counter() - moving  # putting the files in place ends the write
                else:
                    staging.discard()
        except BaseException:
            if staging is not None:
                staging.discard()  # whatever failed, nothing of the staging is left, nor a folder it made
            raise
        if not passed:
            if notice is not None:
                notice(
                    f"fuser: {source}: the check after writing did not pass; optimizing again with the "
                    "check beside the rewrite, which finds the rewrites to blame"
                )
            # Warned once is enough.
            first = _in_stage_order(result.timings, {"load": load_seconds, "write": write_seconds})
            return _optimize_file(job, progress, None, lean=False, spent=first, started=started)
        result.timings = _in_stage_order(result.timings, {"load": load_seconds, "write": write_seconds}, spent)
        result.output_path = str(destination)
        body = result.to_dict()
        sizes = (size_before, sum(path.stat().st_size for path in written))
        body.update(
            input=_input_entry(source, hashing, digest=job.digests),
            output=_output_entry(destination, digests),
            size_before=sizes[0],
            size_after=sizes[1],
        )
        verdict = "optimized" if result.rewrites or result.fixed_shapes else "unchanged"
        if loaded is not None:
            ending.keep(loaded, optimized)
        seconds = time.perf_counter() - started
        return Outcome(
            source=str(source),
            code=EXIT_OK,
            report=report_module.envelope("optimize", verdict, EXIT_OK, **body, seconds=seconds),
            summary=report_module.summary_lines(result, destination, sizes, job.verbose),
            written=str(destination),
            seconds=seconds,
        )
    except NumericsMismatch as error:
        folder = keep_evidence(error, source, loaded.tensors)
        told = NumericsMismatch(f"{error}; nothing written, evidence kept in {folder}")
        code, messages = describe_error(told, job.debug)
        body = error.evidence["report"].to_dict() if "report" in error.evidence else {}
        if "report" in error.evidence:
            body["timings"] = _in_stage_order(body["timings"], {"load": load_seconds}, spent)
        seconds = time.perf_counter() - started
        body.update(input=_input_entry(source, hashing), output=None, evidence=str(folder), seconds=seconds)
        report = report_module.envelope("optimize", "mismatch", code, error=str(error), **body)
        write_bytes_atomically(folder / "report.json", (report_module.dumps(report) + "\n").encode())
        told = f"{error}; evidence kept in {folder}"
        return Outcome(str(source), code, report, messages=messages, error=told, seconds=seconds)
    except Exception as error:  # noqa: BLE001 - mapped to the exit-code contract
        error = _refused(loaded, error)
        code, messages = describe_error(error, job.debug)
        seconds = time.perf_counter() - started
        report = report_module.envelope(
            "optimize",
            "error",
            code,
            error=str(error),
            input=_input_entry(source, hashing),
            output=None,
            seconds=seconds,
        )
        told = _error_text(error)
        return Outcome(str(source), code, report, messages=messages, error=told, seconds=seconds)


def _checks_after_writing(job: OptimizeJob) -> bool:
    """Whether the job's check can run once its result is written (_check_written): a mismatch is
    then found again by a run that checks beside the rewrite, which alone can blame, drop or
    keep the evidence. Not for a model the check needs as it was changed before the rewrite (an
    opset upgrade, fixed shapes), one written for another machine's NCHWc block, or --measure."""
    return (
        job.on_mismatch == "fail"
        and job.opset is None
        and not job.fix_shapes
        and job.measure is None
        and job.nchwc_block == "auto"
    )


def _check_written(job: OptimizeJob, result, options, written: Path, progress: Progress) -> bool:
    """Check the written result against the job's source (verify.check_written), the verdict in
    `result`; whether it passed."""
    try:
        progress("check", 0, None)
        options = api.options_for_bodies(options, result)
        verdict = verify.check_written(
            job.source,
            written,
            options,
            result.exact,
            result.stabilizing,
            progress=lambda name, done, total: progress("check", done, total),
        )
    except Exception:  # noqa: BLE001 - the run that checks beside the rewrite meets it again, and says it
        return False
    result.verdict = verdict if verdict.passed else None
    return verdict.passed


def _remove_left(destination: Path, notice: Callable[[str], None] | None) -> None:
    """Remove what runs killed while writing left beside `destination` (fuser/leftovers.py), and
    say so."""
    removed = remove_left(destination.parent, [destination.name, external_data_path(destination).name])
    if removed and notice is not None:
        listed = ", ".join(f"{name} ({bytes_text(size)})" for name, size in removed)
        notice(f"fuser: removed what an interrupted run left in {destination.parent}: {listed}")


def _staging_folder(destination: Path) -> StagingFolder:
    """A new hidden folder beside `destination`, to write the result into before it is checked."""
    try:
        return StagingFolder(destination.parent)
    except OSError as error:
        raise OutputPathError.refused(destination, error) from error


def _moved_into_place(
    written: list[Path], digests: dict[Path, str] | None, folder: Path, staging: StagingFolder
) -> tuple[list[Path], dict[Path, str] | None]:
    """The files written into `staging` (the model, then any data file), moved into `folder` as
    write_model puts files in place: the model last, as it names its data file; the staging
    folder removed."""
    put_in_place([(path, folder / path.name) for path in [*written[1:], written[0]]])
    staging.remove()
    moved = [folder / path.name for path in written]
    if digests is not None:
        digests = {folder / path.name: digest for path, digest in digests.items()}
    return moved, digests


def _input_entry(source: Path, hashing: Callable[[], dict | None] | None, digest: bool = True) -> dict:
    """The report's entry of the input, even when it cannot be read as a model: the one `hashing`
    worked out, if it was started, else with its digest if `digest` (an error's report has it)."""
    entry = hashing() if hashing is not None else None
    return entry or report_module.input_entry(source, digest=digest)


def _output_entry(destination: Path, digests: dict[Path, str] | None) -> dict | None:
    """The report's entry of the output: with the digest its write worked out, if asked for one."""
    if digests is None:
        return report_module.regular_file_entry(destination, digest=False)
    digest = digests.get(Path(destination))
    return report_module.file_entry(destination) if digest is None else {"path": str(destination), "sha256": digest}


def _refused(model: Model | None, error: Exception) -> Exception:
    """The InputError of onnx's check of `model` if it refused the model, else `error`: a rule
    or a step tripping on an invalid model is not what the user needs to hear."""
    if model is None:
        return error
    try:
        model.validate()
    except InputError as refusal:
        return refusal
    return error


def _in_stage_order(timings: dict[str, float], *more: dict[str, float]) -> dict[str, float]:
    """`timings` with the seconds per stage of `more` added, the stages in the order they run."""
    combined = dict(timings)
    for seconds_by_stage in more:
        for stage, seconds in seconds_by_stage.items():
            combined[stage] = combined.get(stage, 0.0) + seconds
    return {stage: combined[stage] for stage in STAGES if stage in combined}


def describe_error(error: BaseException, debug: bool, source: Path | None = None) -> tuple[int, list[str]]:
    """The exit code of `error` and the lines that tell a person (the traceback first under --debug);
    the line names `source`, the model among several it is about, where the error does not."""
    messages = ["".join(traceback.format_exception(error)).rstrip()] if debug else []
    text = _error_text(error)
    if source is not None and not text.startswith(f"{source}: "):
        text = f"{source}: {text}"
    if isinstance(error, FuserError):
        return error.exit_code, [*messages, f"fuser: error: {text}"]
    return EXIT_INTERNAL, [*messages, f"fuser: internal error: {text}"]


def _error_text(error: BaseException) -> str:
    if isinstance(error, FuserError):
        return str(error)
    return f"{type(error).__name__}: {error} (this is a bug in fuser; please report it, rerun with --debug for details)"


# ------------------------------------------------------------------------ files and folders


def fused_name(name: str) -> str:
    return name.removesuffix(".onnx") + FUSED_SUFFIX


def expand_models(arguments: Iterable[str]) -> tuple[list[Path], bool]:
    """The model files the arguments name, and whether they are several (more than one argument,
    or a folder or a glob pattern, whatever it matched).

    A folder stands for its *.onnx files, not those of its subfolders nor hidden ones, leaving out fuser's own
    outputs (*.fused.onnx) so that a second run over the folder does not optimize them again. A
    pattern with * ? or [ that names no file is expanded (for shells that leave it as it is). A
    file named twice is optimized once. A name that does not exist is kept: it fails as that model's error.
    """
    arguments = list(arguments)
    several = len(arguments) > 1
    found: list[Path] = []
    for argument in arguments:
        path = Path(argument)
        try:
            folder, exists = path.is_dir(), path.exists()
        except OSError:  # a folder on the way that may not be searched: reading the model says so
            folder, exists = False, True
        if folder:
            several = True
            matches = sorted(
                p
                for p in path.glob("*.onnx")
                if p.is_file() and not p.name.endswith(FUSED_SUFFIX) and not p.name.startswith(".")
            )
            if not matches:
                raise UsageError(f"{argument}: no .onnx files in this folder")
            found += matches
        elif not exists and glob.has_magic(argument):
            several = True
            matches = sorted(Path(p) for p in glob.glob(argument) if Path(p).is_file())
            if not matches:
                raise UsageError(f"{argument}: no file matches this pattern")
            found += matches
        else:
            found.append(path)
    unique: dict[Path, Path] = {}
    for path in found:
        unique.setdefault(_resolved(path), path)
    return list(unique.values()), several


def _resolved(path: Path) -> Path:
    """The path with its links followed; as it is where they loop (Python before 3.13 raises),
    which reading the model then reports."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def plan_outputs(sources: list[Path], output: str | None, several: bool) -> list[Path]:
    """Where each model goes. One model: `output`, else MODEL.fused.onnx beside it; an existing
    folder, or a name ending in a slash, is a folder it goes into under its own name. Several: into
    the folder `output` under their own names, else each beside its input as MODEL.fused.onnx.
    Refused before any work: -o naming a file with several models, two models going to one
    file, and an output that is one of the inputs."""
    if output == "":
        raise UsageError("-o names no file or folder")
    into_folder = output is not None and (several or _names_a_folder(output))
    if output is None:
        for source in sources:
            _require_a_folder_beside(source)
    if not several and not into_folder:
        source = sources[0]
        return [Path(output) if output else source.with_name(fused_name(source.name))]
    if into_folder:
        folder = Path(output)
        try:
            exists, is_folder = folder.exists(), folder.is_dir()
        except OSError as error:  # a folder on the way that may not be searched, a name too long
            raise OutputPathError.refused(f"-o {output}", error) from error
        why = "with several models -o names a folder" if several else "-o ending in a slash names a folder"
        if exists and not is_folder:
            raise UsageError(f"-o {output}: {why}, and {output} is a file")
        if not exists and folder.suffix == ".onnx":
            raise UsageError(f"-o {output}: {why} (created if missing), not a .onnx file")
        destinations = [folder / source.name for source in sources]
    else:
        destinations = [source.with_name(fused_name(source.name)) for source in sources]
    by_destination: dict[Path, list[Path]] = {}
    for source, destination in zip(sources, destinations):
        by_destination.setdefault(_resolved(destination), []).append(source)
    clashes = [f"{', '.join(map(str, group))}" for group in by_destination.values() if len(group) > 1]
    if clashes:
        raise UsageError(
            f"several models would be written to the same file ({'; '.join(clashes)}): "
            "optimize them in separate runs or into separate -o folders"
        )
    inputs = {_resolved(source): source for source in sources}
    for source, destination in zip(sources, destinations):
        if _resolved(destination) in inputs:
            raise UsageError(
                f"{source} would be written to {destination}, which is one of the input models; "
                "choose another -o folder"
            )
    # Each worker refuses to write over its own input's data, not over another's.
    data_files = {source: external_data_files(source) for source in sources}
    for source, destination in zip(sources, destinations):
        for written in (destination, external_data_path(destination)):
            readers = [other for other, files in data_files.items() if other != source and _resolved(written) in files]
            if readers:
                raise UsageError(
                    f"{source} would be written to {written}, which {readers[0]} reads its data from; "
                    "choose another -o folder"
                )
    return destinations


def _names_a_folder(output: str) -> bool:
    """Whether -o with one model names a folder to write into: one that exists, or a name ending
    in a slash (a shell's glob that matched one file makes a run of one model)."""
    if output.endswith(("/", os.sep)):
        return True
    try:
        return Path(output).is_dir()
    except OSError:
        return False  # said when the output is checked


def check_folder(path: Path) -> None:
    """Refuse early a path that cannot be written: an existing ancestor of it is not a folder."""
    folder = path.parent
    try:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent
        is_folder = folder.is_dir()
    except OSError as error:  # a folder on the way that may not be searched, a name too long
        raise OutputPathError.refused(path, error) from error
    if not is_folder:
        raise UsageError(f"{path}: cannot write there, {folder} is not a folder")


# The system's folders of streams: a model read from one (/dev/stdin, /dev/fd/63 of a shell's
# <(...), /proc/self/fd/0) has no folder of its own to be written beside. Files in a folder below
# /dev (/dev/shm) are files like any other.
STREAM_FOLDERS = (Path("/dev"), Path("/dev/fd"))


def _require_a_folder_beside(source: Path) -> None:
    """Refuse the default output, MODEL.fused.onnx beside MODEL, for a model read from a stream."""
    try:
        regular = source.is_file()
        exists = source.exists()
    except OSError:
        return  # reading the model says what is wrong with it
    absolute = source.absolute()
    streamed = absolute.parent in STREAM_FOLDERS or absolute.is_relative_to("/proc")
    if exists and (streamed or not regular):
        raise UsageError(f"{source} is a stream or a device, not a model file to write beside: give the output with -o")


# What a path that is not a regular file is, said where -o names one.
_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFLNK: "a symbolic link",
    stat.S_IFIFO: "a named pipe",
    stat.S_IFCHR: "a device",
    stat.S_IFBLK: "a device",
    stat.S_IFSOCK: "a socket",
}


def check_destination(source: Path, destination: Path, force: bool) -> None:
    """Refuse an output that may not be written: one whose folder cannot be, the input, an
    existing file without `force`, and whatever is not a regular file, `force` or not (a model
    is written into a file of its own: replacing /dev/null or a link with one is never meant)."""
    check_folder(destination)
    try:
        mode = destination.lstat().st_mode
    except FileNotFoundError:
        return
    except OSError as error:  # a folder on the way that may not be searched, a name too long
        raise OutputPathError.refused(destination, error) from error
    if _resolved(destination) == _resolved(source):
        raise UsageError(f"{destination}: refusing to overwrite the input model; choose another -o")
    if not stat.S_ISREG(mode):
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise UsageError(f"{destination} is {kind}: a model is written only to a regular file; choose another -o")
    if not force:
        raise UsageError(f"{destination} already exists; pass --force to replace it")


def files_read(path: Path, model: Model) -> set[Path]:
    """The model file and the files it read its data from, resolved."""
    return {path.resolve()} | model.data_files()


def refuse_to_write_over(destination: Path, source: Path, read: set[Path]) -> None:
    """The output must never replace a file the input reads (--force or not): its external data."""
    if _resolved(destination) in read:
        raise UsageError(
            f"{destination}: refusing to overwrite the input's external data ({source} reads its weights from it); "
            "choose another -o"
        )


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except (OSError, ValueError):  # a pipe has no size on disk; a name with a NUL byte names no file
        return 0


def keep_evidence(error: NumericsMismatch, source: Path, tensors: TensorStore) -> Path:
    """The models of a mismatch, written into a new temporary folder (returned); `tensors`: the
    store their weights are read from (the input Model's)."""
    import tempfile

    folder = Path(tempfile.mkdtemp(prefix=f"fuser-mismatch-{source.stem}-"))
    for name in ("original", "optimized"):
        if name not in error.evidence:
            continue
        try:
            write_model(error.evidence[name], folder / f"{name}.onnx", source_dir=source.parent, tensors=tensors)
        except FuserError as reason:  # evidence is a courtesy: a model that cannot be copied must not hide the mismatch
            (folder / f"{name}.onnx.txt").write_text(f"not copied: {reason}\n")
    return folder


# ------------------------------------------------------------------------ many models at once


# A worker's peak memory, from what its model holds (fuser.wire.Census), fitted to the peaks
# `python bench/peaks.py` measured on a 2-core machine for 35 models (real exports, the light model
# zoo, stacks of 1k to 100k nodes), both targets, with and without the check (140 runs), and
# rounded up: the estimate is at or above every one of them, by 1.01 to 3.84 times. The check's
# share is onnxruntime's: two sessions, their activations and any weights made at run time.
@dataclass(frozen=True)
class PeakModel:
    base: int  # Python, onnx, onnxruntime and fuser imported; the check's activations
    per_node: int
    per_weight_byte: float  # weights left in their file until read: read in place, or external data
    per_weight_byte_read_whole: float  # weights parsed into memory (small ones; all before IR 4 or through a link)
    per_filter_byte: float  # convolution filters, more with --target onnxruntime (NCHWc reorders them)
    per_filter_byte_nchwc: float
    per_computed_byte: float  # ConstantOfShape results: onnxruntime makes them in each session


PEAKS = {
    True: PeakModel(350 << 20, 28 << 10, 1.3, 2.5, 0.5, 5.0, 2.3),  # with the check
    False: PeakModel(180 << 20, 12 << 10, 0.2, 2.5, 0.3, 1.5, 1.2),
}


# What the check adds to a run's peak: onnxruntime's sessions of the original and of the
# optimized model (and the child that runs the original's, fuser/check_apart.py) beside what a run
# without it holds. bench/scale.py, the check's `tree GB` over `--no-check`'s `fuser GB`: 6.4 KB
# per node for the million-node MLP stack, 7.3 and 9 KB for the 100k MLP and ResNet stacks, 4.5 KB
# for the 96-layer GPT-2; 0.8 and 0.94 times the weights for GPT-2's 498 MB and the 500 MB stack.
CHECK_BYTES_PER_NODE = 6_000
CHECK_BYTES_PER_WEIGHT_BYTE = 0.8


def check_memory_need(nodes: int, weight_bytes: int) -> int:
    """About what the check of a model of `nodes` nodes and `weight_bytes` of weights adds to the
    memory a run holds, in bytes."""
    return int(nodes * CHECK_BYTES_PER_NODE + weight_bytes * CHECK_BYTES_PER_WEIGHT_BYTE)


def check_memory_warning(
    source: Path, nodes: int, weight_bytes: int, available: int | None, after_writing: bool = False
) -> str | None:
    """What to say before a check that needs more memory than is `available` (bytes, None where
    unknown), once the model is loaded; None where it fits. Said, not refused: the need is an
    estimate, and a run without the check is the user's choice to make. after_writing: the check
    is to run once the result is written and its graph let go (_check_written)."""
    need = check_memory_need(nodes, weight_bytes)
    if available is None or need <= available:
        return None
    what = f"the check of its {nodes:,} node{'s' * (nodes != 1)} needs about {bytes_text(need)} more"
    advice = "--no-check optimizes without the check; `fuser compare` checks the result where there is the memory"
    if after_writing:
        return (
            f"fuser: warning: {source}: {what} beside the rewrite and {bytes_text(available)} is available: "
            f"it runs once the result is written and its graph let go, which holds less (should the system "
            f"still stop fuser for want of memory: {advice})"
        )
    return (
        f"fuser: warning: {source}: {what} and {bytes_text(available)} is available: "
        f"the system may stop fuser when memory runs out ({advice})"
    )


def default_jobs(planned: list[OptimizeJob], cores: int | None = None, memory: int | None = None) -> int:
    """How many models to optimize at once: one per core, no more than the available memory holds
    at the estimated peak of the largest models, and at least one. `cores` and `memory` (bytes)
    default to this machine's."""
    cores = cores or available_cores()
    memory = memory or available_memory()
    count = max(1, min(cores, len(planned)))
    if memory is None or count == 1:
        return count
    peaks = sorted((estimated_peak(job) for job in planned), reverse=True)[:count]
    fitting, total = 0, 0
    for peak in peaks:
        total += peak
        if total > memory:
            break
        fitting += 1
    return max(1, fitting)


def estimated_peak(job: OptimizeJob) -> int:
    """The memory optimizing the job's model is expected to take at its peak, in bytes, from its
    census; a file that is no model this reader follows weighs its size (its own run says why)."""
    fit = PEAKS[job.check or job.measure is not None]  # measuring latency opens sessions too
    found = model_census(job.source)
    if found is None:
        return fit.base + int(fit.per_weight_byte_read_whole * _size(job.source))
    census, whole = found
    unsized = sum(_size(job.source.parent / name) for name in census.unsized if name and names_a_file_inside(name))
    left_on_disk = 0 if whole else census.weight_bytes - census.held_bytes + unsized
    read = census.weight_bytes + unsized - left_on_disk
    per_filter_byte = fit.per_filter_byte_nchwc if job.target == "onnxruntime" else fit.per_filter_byte
    return int(
        fit.base
        + fit.per_node * census.nodes
        + fit.per_weight_byte * left_on_disk
        + fit.per_weight_byte_read_whole * read
        + per_filter_byte * census.filter_bytes
        + fit.per_computed_byte * census.computed_bytes
    )


def model_census(source: Path) -> tuple[Census, bool] | None:
    """What the model file holds, and whether loading it reads its weights whole (they are read
    in place otherwise); None if it cannot be read as a model."""
    try:
        if not stat.S_ISREG(source.stat().st_mode):
            return None  # a pipe's bytes are its model's run's to read
        with (
            open(source, "rb") as handle,
            mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as mapped,
            memoryview(mapped) as view,
        ):
            census = wire_census(view)
    except (OSError, ValueError, BufferError):  # an empty or unmappable file
        return None
    if census is None:
        return None
    return census, census.ir_version < 4 or not found_as_external_data(source)


def available_cores(root: str = "/") -> int:
    """The cores this process may use: its CPU affinity, or fewer under a cgroup's CPU quota (a
    container's, a systemd slice's; `root`: where the system's files are read from)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    for folder, version in _cgroup_folders(root, "cpu"):
        if version == 2:  # "max 100000", or "200000 100000": 2 cores' time per period
            quota = (_read_first(os.path.join(folder, "cpu.max")) or "max").split()
            limit, period = quota[0], quota[1] if len(quota) > 1 else "100000"
        else:  # a quota of -1: none
            limit = _read_first(os.path.join(folder, "cpu.cfs_quota_us")) or "-1"
            period = _read_first(os.path.join(folder, "cpu.cfs_period_us")) or "100000"
        if limit.isdigit() and period.isdigit() and int(period) > 0:
            cores = min(cores, max(1, -(-int(limit) // int(period))))
    return max(1, cores)


def available_memory(root: str = "/") -> int | None:
    """Bytes this process may still use: the system's available memory, or less under a cgroup's
    limit (a container's, a systemd slice's; `root`: where the system's files are read from)."""
    available = None
    meminfo = _read_first(os.path.join(root, "proc/meminfo"), whole=True)
    for line in (meminfo or "").splitlines():
        if line.startswith("MemAvailable:"):
            available = int(line.split()[1]) * 1024
    if available is None:
        if root != "/":
            return None
        try:
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    for folder, version in _cgroup_folders(root, "memory"):
        if version == 2:
            names = ("memory.max", "memory.current", "inactive_file")
        else:
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        limit, used = (_read_first(os.path.join(folder, name)) for name in names[:2])
        if not (limit and limit.isdigit() and used and used.isdigit()) or int(limit) >= _NO_LIMIT:
            continue  # "max", or cgroup v1's largest page multiple: no limit here
        # Files the kernel drops before it runs short count as used, as a container's working
        # set leaves them out: a CI job that has just written its models would seem full.
        stat = _read_first(os.path.join(folder, "memory.stat"), whole=True) or ""
        cache = next((int(line.split()[1]) for line in stat.splitlines() if line.startswith(names[2] + " ")), 0)
        available = min(available, max(0, int(limit) - max(0, int(used) - cache)))
    return available


_NO_LIMIT = 1 << 62  # cgroup v1 writes "no limit" as the largest multiple of the page size


def _cgroup_folders(root: str, controller: str) -> list[tuple[str, int]]:
    """The folders of this process's cgroup and of each enclosing one that hold `controller`'s
    limits, with the cgroup version: a limit set on any of them holds for this process. Where the
    cgroup's own folder is not there, its hierarchy's root folder stands for it: a container sees
    its own cgroup there, under the host's name for it in /proc/self/cgroup."""
    listed = _read_first(os.path.join(root, "proc/self/cgroup"), whole=True)
    folders = []
    for line in (listed or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: one hierarchy for every controller
            mount, version = os.path.join(root, "sys/fs/cgroup"), 2
        elif controller in controllers.split(","):
            mount, version = os.path.join(root, "sys/fs/cgroup", controllers), 1
        else:
            continue
        if version == 1 and not os.path.isdir(mount):
            mount = os.path.join(root, "sys/fs/cgroup", controller)  # mounted as "cpu", linked as "cpu,cpuacct"
        parts = [part for part in path.split("/") if part and part != "."]
        if ".." in parts or not os.path.isdir(os.path.join(mount, *parts)):
            parts = []  # a cgroup outside this namespace's view, or not mounted here
        for depth in range(len(parts), -1, -1):
            folders.append((os.path.join(mount, *parts[:depth]), version))
    return folders


def _read_first(path: str, whole: bool = False) -> str | None:
    try:
        with open(path) as handle:
            return handle.read() if whole else handle.readline().strip()
    except (OSError, ValueError):
        return None


def run_jobs(
    jobs: list[OptimizeJob],
    workers: int,
    done: Callable[[Outcome], None] = lambda outcome: None,
    notice: Callable[[str], None] = lambda line: None,
):
    """Optimize every job, at most `workers` at a time, each in a process of its own; `done` hears
    of each model as it finishes, `notice` what a worker says before its long work (optimize_file).
    Outcomes come back in the order of `jobs`."""
    context = _process_context()
    _start_fork_server(context)
    threads = max(1, available_cores() // workers)  # the workers share the cores out
    waiting = [(index, dataclasses.replace(job, threads=threads)) for index, job in enumerate(jobs)]
    running: dict[int, tuple] = {}
    outcomes: list[Outcome | None] = [None] * len(jobs)
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                index, job = waiting.pop(0)
                receiver, sender = context.Pipe(duplex=False)
                process = context.Process(target=_work, args=(job, sender), name=f"fuser {job.source.name}")
                with stops.held():  # a Ctrl-C or SIGTERM now is taken once the worker is known, to be ended
                    process.start()
                    running[index] = (job, process, receiver, time.perf_counter())
                sender.close()  # the worker holds the only sending end: its death closes the pipe
            ready = set(wait([r for _, _, r, _ in running.values()] + [p.sentinel for _, p, _, _ in running.values()]))
            for index, (job, process, receiver, started) in list(running.items()):
                if receiver not in ready and process.sentinel not in ready:
                    continue
                outcome = None
                if receiver.poll():
                    try:
                        outcome = receiver.recv()
                    except (EOFError, OSError):
                        outcome = None
                    if isinstance(outcome, str):  # a notice; the outcome comes later, if at all
                        notice(outcome)
                        continue
                elif process.is_alive():
                    continue
                process.join()
                receiver.close()
                del running[index]
                if outcome is None:
                    outcome = _crashed(job, process.exitcode, time.perf_counter() - started)
                outcomes[index] = outcome
                done(outcomes[index])
    finally:
        for _, process, _, _ in running.values():
            process.terminate()
        for _, process, _, _ in running.values():
            process.join()
    return outcomes


def _work(job: OptimizeJob, sender) -> None:
    # Ctrl-C reaches the whole process group: the parent alone handles it, by ending the workers,
    # whose SIGTERM unwinds like an exception so that no temporary file is left half-written.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stops.end_on_sigterm()
    sent = _end_with_fuser(sender)
    verify.LOG_SEVERITY = 2 if job.debug else verify.QUIET
    verify.SESSION_THREADS = job.threads
    validation.CORES = job.threads
    # The worker ends once the outcome is sent (forkserver's with os._exit).
    outcome = optimize_file(job, last=True, notice=sender.send)
    sender.send(outcome)
    sent.set()
    sender.close()


def _end_with_fuser(sender) -> threading.Event:
    """End this worker, as SIGTERM from fuser would, once fuser has gone without ending it: killed
    by SIGKILL (a CI job's hard timeout, the out-of-memory killer), it cannot pass anything on, and
    the worker ran to its end, writing its model after the run was over. The worker's side of the
    pipe the outcome goes back through tells: when nothing reads it any more, the system reports
    an error on it (on Linux; where poll reports nothing of the kind, as on macOS, or there is
    no poll, the worker runs on as before). Returns the event to set once the outcome is sent:
    fuser then closes its end."""
    sent = threading.Event()
    if not hasattr(select, "poll"):
        return sent
    watch = select.poll()
    watch.register(sender.fileno(), 0)  # an error or hang-up is always reported, asked or not

    def end_when_alone() -> None:
        events = watch.poll()
        if not sent.is_set() and any(event & (select.POLLERR | select.POLLHUP) for _, event in events):
            os.kill(os.getpid(), signal.SIGTERM)

    watcher = threading.Thread(target=end_when_alone, name="fuser-end-with-fuser", daemon=True)
    watcher.waits_only = True  # the load may still fork its check beside it (validation._running_alone)
    watcher.start()
    return sent


def _crashed(job: OptimizeJob, exitcode: int | None, seconds: float) -> Outcome:
    if exitcode is not None and exitcode < 0:
        name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else str(-exitcode)
        how = f"was killed by signal {name}"
        if -exitcode == getattr(signal, "SIGKILL", None):  # what the system's out-of-memory killer sends
            how += (
                " (the system does this when memory runs out: try fewer models at once, -j, "
                "or --no-check for a model too large to check here)"
            )
    else:
        how = f"ended with exit code {exitcode} before reporting"
    error = f"the worker process optimizing {job.source} {how}"
    entry = report_module.input_entry(job.source)
    report = report_module.envelope(
        "optimize", "error", EXIT_INTERNAL, error=error, input=entry, output=None, seconds=seconds
    )
    return Outcome(
        str(job.source), EXIT_INTERNAL, report, messages=[f"fuser: error: {error}"], error=error, seconds=seconds
    )


def _start_fork_server(context) -> None:
    """Start the fork server with Ctrl-C held back from it: it takes a second or more importing
    onnxruntime and the rules, and a Ctrl-C to the process group meanwhile printed its traceback
    below fuser's own message (once those are in, it ignores Ctrl-C, and so do the workers).
    The resource tracker comes first: starting it lets Ctrl-C through again."""
    if context.get_start_method() != "forkserver" or not hasattr(signal, "pthread_sigmask"):
        return
    multiprocessing.resource_tracker.ensure_running()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def _process_context():
    """Workers start from a server process that has imported fuser, onnx and onnxruntime once
    (forkserver), or as fresh interpreters where there is none (spawn); never by forking this
    process, whose threads and state a fork would copy half-way."""
    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        builtin = importlib.import_module("fuser.rules")  # the package only; each worker would import every rule
        rules = [f"fuser.rules.{module.name}" for module in pkgutil.iter_modules(builtin.__path__)]
        context.set_forkserver_preload(["fuser.jobs", "onnxruntime", *rules])
        return context
    return multiprocessing.get_context("spawn")
