"""docs/writing-rules.md must work as written: its code blocks are this test's code.

* ```python blocks run in order in one namespace (tracebacks point at the doc's lines);
  a block titled title="NAME.py" is also appended to the file NAME.py in a scratch
  directory, which is the working directory and on sys.path while the blocks run.
* ```console blocks: every `$ command` runs in that directory through bash (`fuser` and
  `python` mean this interpreter's fuser and Python); it must exit 0, and each output
  line shown under it must appear in its output (numbers may differ; `...` skips).
* The ```toml block is the plugin's pyproject.toml: setuptools turns it into package
  metadata, and fuser must then find the rules through the entry point alone.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import onnx
import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "writing-rules.md"
FENCE = re.compile(r"^```([\w-]*)([^\n]*)\n(.*?)^```[ \t]*$", re.S | re.M)
TITLE = re.compile(r'title="([^"]+)"')
NUMBER = re.compile(r"^[-+]?\d[\d.,e+-]*%?$")
TUTORIAL_MODULES = ("my_rules", "make_model", "test_my_rules")
ENV = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}


@dataclass
class Block:
    language: str
    title: str | None
    code: str
    line: int  # line of the doc where the code starts


def doc_blocks() -> list[Block]:
    text = DOC.read_text()
    found = []
    for fence in FENCE.finditer(text):
        title = TITLE.search(fence.group(2))
        line = text.count("\n", 0, fence.start(3)) + 1
        found.append(Block(fence.group(1), title.group(1) if title else None, fence.group(3), line))
    return found


def python_blocks() -> list[Block]:
    return [b for b in doc_blocks() if b.language == "python" and not (b.title or "").startswith("pyproject")]


def files() -> dict[str, str]:
    """The files the tutorial builds up, from its titled blocks: {"my_rules.py": source, ...}."""
    sources: dict[str, list[str]] = {}
    for block in python_blocks():
        if block.title:
            sources.setdefault(block.title, []).append(block.code)
    return {name: "\n\n".join(parts) for name, parts in sources.items()}


def shell(command: str, cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    assert shutil.which("bash"), "the console examples in the tutorial run in bash"
    python = shlex.quote(sys.executable)
    prelude = f'fuser() {{ {python} -m fuser.cli "$@"; }}\npython() {{ {python} "$@"; }}\n'
    return subprocess.run(
        ["bash", "-c", prelude + command],
        cwd=cwd,
        env=env or ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )


def line_pattern(expected: str) -> str:
    """A regex for one shown output line: any run of spaces matches any, numbers match any token."""
    return r"\s+".join(r"\S+" if NUMBER.match(t) else re.escape(t) for t in expected.split())


@pytest.fixture(scope="module")
def tutorial(tmp_path_factory):
    """Run every Python block of the tutorial in a scratch directory; yield (namespace, directory)."""
    directory = tmp_path_factory.mktemp("tutorial")
    for name, source in files().items():
        (directory / name).write_text(source)
    namespace = {"__name__": "tutorial"}
    previous = os.getcwd()
    for name in TUTORIAL_MODULES:
        sys.modules.pop(name, None)
    sys.path.insert(0, str(directory))
    os.chdir(directory)
    try:
        for block in python_blocks():
            # Pad with blank lines so that tracebacks name the line in the doc.
            code = compile("\n" * (block.line - 1) + block.code, str(DOC), "exec")
            exec(code, namespace)
        yield namespace, directory
    finally:
        os.chdir(previous)
        sys.path.remove(str(directory))
        for name in TUTORIAL_MODULES:
            sys.modules.pop(name, None)


def test_the_doc_has_the_expected_blocks():
    names = files()
    assert {"my_rules.py", "make_model.py", "test_my_rules.py"} <= set(names)
    assert [b for b in doc_blocks() if b.language == "toml"], "the plugin's pyproject.toml block is missing"
    assert [b for b in doc_blocks() if b.language == "console"], "the CLI examples are missing"


def test_python_blocks_run(tutorial):
    namespace, directory = tutorial
    assert namespace["report"].counts == {"hard-swish-clip": 1}
    assert (directory / "before.onnx").is_file()


def test_the_tutorials_own_tests_pass(tutorial):
    namespace, _ = tutorial
    tests = [value for name, value in namespace.items() if name.startswith("test_") and callable(value)]
    assert len(tests) >= 2, "the tutorial should show a positive and a negative test"
    for test in tests:
        test()


def test_rule_file_with_the_real_cli(tutorial):
    _, directory = tutorial
    rule_file = directory / "cli_rules.py"
    rule_file.write_text(files()["my_rules.py"])
    output = directory / "cli_out.onnx"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "fuser.cli",
            "optimize",
            str(directory / "before.onnx"),
            "--rules",
            str(rule_file),
            "--disable",
            "hardswish-*",
            "-o",
            str(output),
        ],
        cwd=directory,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "hard-swish-clip" in result.stderr
    assert [n.op_type for n in onnx.load(str(output)).graph.node] == ["HardSwish"]


def test_console_blocks(tutorial):
    _, directory = tutorial
    for block in (b for b in doc_blocks() if b.language == "console"):
        command, shown = None, []
        for line in block.code.splitlines() + ["$ "]:
            if not line.startswith("$ "):
                shown.append(line)
                continue
            if command:
                result = shell(command, directory)
                assert result.returncode == 0, f"`{command}` exited {result.returncode}:\n{result.stdout}"
                for expected in shown:
                    if expected.strip() and expected.strip() != "...":
                        assert re.search(line_pattern(expected), result.stdout), (
                            f"`{command}` did not print\n  {expected}\nit printed:\n{result.stdout}"
                        )
            command, shown = line[2:].strip(), []


def test_plugin_entry_point(tutorial):
    """The doc's pyproject.toml, turned into package metadata by setuptools, registers the rules."""
    import setuptools  # noqa: F401 - a test extra; the plugin metadata needs it

    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    _, directory = tutorial
    (toml_block,) = [b for b in doc_blocks() if b.language == "toml"]
    config = tomllib.loads(toml_block.code)
    assert "fuser.rules" in config["project"]["entry-points"]
    project = directory / "plugin"
    project.mkdir()
    (project / "pyproject.toml").write_text(toml_block.code)
    (project / "my_rules.py").write_text(files()["my_rules.py"])
    built = subprocess.run(
        [sys.executable, "-c", "import setuptools; setuptools.setup()", "-q", "egg_info", "--egg-base", "."],
        cwd=project,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert built.returncode == 0, built.stderr
    # Like an editable install: the metadata and the module are on the path, no --rules given.
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [str(project), ENV.get("PYTHONPATH")]))}
    listed = shell("fuser rules", directory, env)
    assert listed.returncode == 0, listed.stdout
    assert re.search(r"^hard-swish\s", listed.stdout, re.M) and re.search(r"^hard-swish-clip\s", listed.stdout, re.M)
    optimized = shell("fuser optimize before.onnx -o plugin.onnx", directory, env)
    assert optimized.returncode == 0, optimized.stdout
    assert [n.op_type for n in onnx.load(str(directory / "plugin.onnx")).graph.node] == ["HardSwish"]
    # The doc warns that loading the installed rules again from the file is an error.
    twice = shell("fuser optimize before.onnx --rules my_rules.py -o twice.onnx", directory, env)
    assert twice.returncode == 2 and "two rules are named 'hard-swish'" in twice.stdout, twice.stdout
