"""`fuser check` over several models, for the pre-commit hook (.pre-commit-hooks.yaml).

pre-commit passes the hook's `args` and then every staged file: the arguments ending in
`.onnx` are the models, the others are options for `fuser check` (`--target onnxruntime`,
`--disable RULE`, ...). Each model is checked in turn; the exit code is the worst one, so a
model with fusions left (1) or an unusable one (2) fails the commit.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from fuser.cli import cli

    argv = list(sys.argv[1:] if argv is None else argv)
    models = [a for a in argv if a.endswith(".onnx")]
    options = [a for a in argv if not a.endswith(".onnx")]
    worst = 0
    for model in models:
        try:
            code = cli.main(args=["check", model, *options], prog_name="fuser", standalone_mode=False)
        except SystemExit as done:  # --help and --version exit this way
            code = done.code
        except Exception as error:  # noqa: BLE001 - click's usage errors: say them the way fuser does
            print(f"fuser: error: {error}", file=sys.stderr)
            code = 2
        worst = max(worst, code if isinstance(code, int) else 0)
    return worst


if __name__ == "__main__":
    sys.exit(main())
