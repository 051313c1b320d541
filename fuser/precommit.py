"""`fuser check` over several models, for the pre-commit hook (.pre-commit-hooks.yaml).

pre-commit passes the hook's `args` and then every staged file: the arguments ending in
`.onnx` are the models, the others are options for `fuser check` (`--target onnxruntime`,
`--disable RULE`, ...). Each model is checked in turn; the exit code is the worst one, so a
model with fusions left (1) or an unusable one (2) fails the commit.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from fuser.cli import run
    from fuser.errors import EXIT_INTERRUPTED

    argv = list(sys.argv[1:] if argv is None else argv)
    models = [a for a in argv if a.endswith(".onnx")]
    options = [a for a in argv if not a.endswith(".onnx")]
    worst = 0
    for model in models:
        code = run(["check", model, *options])
        if code == EXIT_INTERRUPTED:  # Ctrl-C stops the hook, not only this model's check
            return code
        worst = max(worst, code)
    return worst


if __name__ == "__main__":
    from fuser.cli import end, stop_on_sigterm

    stop_on_sigterm()
    end(main())
