"""One error hierarchy; each class carries the exit code the CLI maps it to.

Exit-code contract shared by every command:

    0  success, or nothing to do
    1  a check mode found work to do
    2  bad usage or unusable input (missing file, not an ONNX model, invalid model)
    3  the numerics check failed
    4  an internal error in fuser or in a rule
"""

from __future__ import annotations

from pathlib import Path

EXIT_OK = 0
EXIT_WORK_FOUND = 1
EXIT_USAGE = 2
EXIT_MISMATCH = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130  # 128 + SIGINT: what shells and CI runners report for a command Ctrl-C ended


class FuserError(Exception):
    """Base of every error fuser reports; `str(error)` is the one-line message."""

    exit_code = EXIT_INTERNAL


class UsageError(FuserError):
    """The user asked for something that cannot be done as asked."""

    exit_code = EXIT_USAGE


class InputError(FuserError):
    """The input model is missing, unreadable, not ONNX, or invalid."""

    exit_code = EXIT_USAGE


class OutputPathError(UsageError, OSError):
    """The output cannot be written where asked (its folder is a file, a full or read-only disk).

    Also an OSError, so callers of Model.save that catch OSError keep working."""

    @classmethod
    def refused(cls, where: str | Path, error: OSError) -> OutputPathError:
        """The system refused to write at `where`, or to look there: its own words say why."""
        return cls(f"{where}: cannot write there ({error.strerror or error})")


class UnsafePathError(InputError):
    """An external-data reference points outside the model's folder."""


class NumericsMismatch(FuserError):
    """The optimized model disagrees with the original beyond tolerance."""

    exit_code = EXIT_MISMATCH

    def __init__(self, message: str, evidence: dict | None = None):
        super().__init__(message)
        self.evidence = evidence or {}


class RuleError(FuserError):
    """A rule crashed or broke an invariant: a bug in that rule.

    rule: the Rule (or just its name); cause: the exception the rule raised; at: the file:line
    of the fault when known (otherwise the deepest frame of `cause` in the rule's file). A
    built-in rule's error asks for a bug report against fuser; a user's rule (a rule file or a
    plugin) is named with its file:line for its author to fix.
    """

    exit_code = EXIT_INTERNAL

    def __init__(self, rule, message: str, cause: BaseException | None = None, at: str | None = None):
        self.rule_name = getattr(rule, "name", rule)
        defined = getattr(rule, "source", None)
        if at is None and cause is not None and defined is not None:
            at = _deepest_frame_in(cause, defined.path)
        place = f" at {at}" if at else ""
        if getattr(rule, "builtin", True):
            advice = "(this is a bug in the rule; please report it with the model attached)"
        else:
            advice = f"(the rule is defined at {defined}: fix it there; --debug shows the traceback)"
        super().__init__(f"rule '{self.rule_name}' failed: {message}{place} {advice}")


def _deepest_frame_in(error: BaseException, path: str) -> str | None:
    frame = error.__traceback__
    found = None
    while frame is not None:
        if frame.tb_frame.f_code.co_filename == path:
            found = f"{path}:{frame.tb_lineno}"
        frame = frame.tb_next
    return found


class RewriteLimitExceeded(FuserError):
    """The rewrite loop did not reach a fixed point, usually two rules undoing each other."""

    exit_code = EXIT_INTERNAL
