"""Transformer exports side by side: the original, fuser's targets and two peer fusers.

    python bench/transformers.py [--size tiny|real] [--runs 30] [--threads 2] [--models bert_legacy,...]
                                 [--sequence N] [--past N]

The *_past models take a KV cache: `--sequence 1 --past 512` times one decoding step after 512
cached tokens.

Reads the corpus `tests/data/make_transformers.py` writes: tiny models from
tests/data/transformers/ (checked in), real-size ones from bench/models/ (make them first with
`python tests/data/make_transformers.py --size real --out bench/models/`). For each model the
columns are:

    orig        the export as written
    onnx        fuser --target onnx
    onnx23      fuser --target onnx --opset 23 (n/a while fuser.optimize has no `opset` option)
    ort         fuser --target onnxruntime
    ort-opt     onnxruntime.transformers.optimizer.optimize_model (opt_level 0: its fusions only)
    onnxscript  onnxscript.rewriter.ort_fusions.optimize_for_ort (n/a when not installed)

and the tables: nodes left; decomposed patterns left (LayerNorm/RMSNorm/GELU/SiLU/attention/rotary,
counted by bench/patterns_left.py); the largest absolute difference from the original's output
on the same realistic inputs (token ids in the vocabulary, token types in [0, 2), an attention
mask of ones), every model run with onnxruntime's optimizations disabled; onnxruntime CPU
latency medians (ms) with graph optimizations disabled ("off") and fully enabled ("all"); and
each latency as a ratio to the original's at "all".

fuser checks its output against the original on those same inputs. When the check fails (or
fuser raises), the cell is made again without the check and marked `!`; the reason is listed
under the tables. Latencies are timed round-robin over every column at both levels, so that
the machine's drift hits them alike (real size: one level at a time, each round also timing the
original at "all" for the ratios, since twelve sessions of a real-size model need too much
memory); machines are noisy, so compare within one run of this script.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time

import numpy as np
import onnx
from onnx.external_data_helper import load_external_data_for_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

from latency import medians_ms, session
from patterns_left import PATTERNS, patterns_left

import fuser
from tests.data.make_transformers import SIZES

FOLDERS = {"tiny": os.path.join(ROOT, "tests", "data", "transformers"), "real": os.path.join(HERE, "models")}
DEFAULT_MODELS = [
    f"{kind}_{exporter}" for kind in ("bert", "gpt2", "vit", "llama") for exporter in ("legacy", "dynamo")
]
SHAPES = {"tiny": (2, 16), "real": (1, 128)}  # batch, sequence
COLUMNS = ("orig", "onnx", "onnx23", "ort", "ort-opt", "onnxscript")
# onnxruntime's optimizer has no Llama model type; its GPT-2 type runs the decoder fusions.
NO_OPSET = "fuser.optimize has no `opset` option"
ORT_MODEL_TYPES = {"bert": "bert", "gpt2": "gpt2", "vit": "vit", "llama": "gpt2"}


class Cell:
    """One column of one model: the rewritten model, or why there is none."""

    def __init__(self, model: onnx.ModelProto | None = None, missing: str = "", unchecked: str = ""):
        self.model = model
        self.missing = missing  # why the column is n/a
        self.unchecked = unchecked  # why fuser's own check was skipped


def family(name: str) -> str:
    return name.split("_")[0]


def dimensions(kind: str, size: str) -> tuple[int, int, int]:
    """(vocabulary, heads, hidden) of a corpus model."""
    config = SIZES[size][kind]
    if kind == "gpt2":
        return config["vocab_size"], config["n_head"], config["n_embd"]
    return config.get("vocab_size", 0), config["num_attention_heads"], config["hidden_size"]


def realistic_inputs(model: onnx.ModelProto, kind: str, size: str, batch: int, sequence: int, past: int = 0) -> dict:
    """Inputs for `sequence` new tokens; for a model with a KV cache (past_key_values.*), after
    `past` cached ones, which the attention mask then spans too."""
    rng = np.random.default_rng(0)
    vocabulary, _, _ = dimensions(kind, size)
    cached = any(value.name.startswith("past_key_values") for value in model.graph.input)
    feeds = {}
    for value in model.graph.input:
        tensor = value.type.tensor_type
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim]
        if value.name == "pixel_values":
            shape = [batch] + dims[1:]
            dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor.elem_type)
            feeds[value.name] = rng.standard_normal(shape).astype(dtype)
        elif value.name == "input_ids":
            feeds[value.name] = rng.integers(0, vocabulary, (batch, sequence), dtype=np.int64)
        elif value.name == "token_type_ids":
            feeds[value.name] = rng.integers(0, 2, (batch, sequence), dtype=np.int64)
        elif value.name == "attention_mask":
            feeds[value.name] = np.ones((batch, sequence + past if cached else sequence), dtype=np.int64)
        elif value.name.startswith("past_key_values"):
            feeds[value.name] = rng.standard_normal((batch, dims[1], past, dims[3])).astype(np.float32)
        else:
            raise SystemExit(f"bench/transformers.py: no realistic value for input '{value.name}'")
    return feeds


def first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:160]


def fuser_cell(path: str, feeds: dict, **options) -> Cell:
    try:
        optimized, _ = fuser.optimize(path, inputs=feeds, **options)
        return Cell(with_weights(optimized, path))
    except Exception as error:  # noqa: BLE001 - a failing cell is reported, not fatal
        reason = first_line(error)
    try:
        optimized, _ = fuser.optimize(path, check=False, **options)
        return Cell(with_weights(optimized, path), unchecked=reason)
    except Exception as error:  # noqa: BLE001
        return Cell(missing=f"{reason}; without the check: {first_line(error)}")


def with_weights(model: onnx.ModelProto, path: str) -> onnx.ModelProto:
    """fuser's output refers to the input's external data file; read it in, for sessions built from bytes."""
    load_external_data_for_model(model, os.path.dirname(path))
    return model


def ort_optimizer_cell(model: onnx.ModelProto, kind: str, size: str) -> Cell:
    try:
        from onnxruntime.transformers.optimizer import optimize_model
    except ImportError as error:
        return Cell(missing=first_line(error))
    _, heads, hidden = dimensions(kind, size)
    try:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        optimized = optimize_model(
            copy, model_type=ORT_MODEL_TYPES[kind], num_heads=heads, hidden_size=hidden, opt_level=0
        )
        return Cell(optimized.model)
    except Exception as error:  # noqa: BLE001
        return Cell(missing=first_line(error))


def onnxscript_cell(model: onnx.ModelProto) -> Cell:
    try:
        import onnx_ir as ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort
    except ImportError as error:
        return Cell(missing=first_line(error))
    try:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)  # ir.from_proto takes parts of the proto it is given
        optimized, _ = optimize_for_ort(ir.from_proto(copy))
        return Cell(ir.to_proto(optimized))
    except Exception as error:  # noqa: BLE001
        return Cell(missing=first_line(error))


def opset_supported() -> bool:
    return "opset" in inspect.signature(fuser.optimize).parameters


def make_cells(path: str, original: onnx.ModelProto, kind: str, size: str, feeds: dict) -> dict[str, Cell]:
    cells = {"orig": Cell(original)}
    cells["onnx"] = fuser_cell(path, feeds, target="onnx")
    if opset_supported():
        cells["onnx23"] = fuser_cell(path, feeds, target="onnx", opset=23)
    else:
        cells["onnx23"] = Cell(missing=NO_OPSET)
    cells["ort"] = fuser_cell(path, feeds, target="onnxruntime")
    cells["ort-opt"] = ort_optimizer_cell(original, kind, size)
    cells["onnxscript"] = onnxscript_cell(original)
    return cells


def node_count(model: onnx.ModelProto) -> int:
    count = 0
    stack = [model.graph]
    while stack:
        graph = stack.pop()
        count += len(graph.node)
        for node in graph.node:
            for attribute in node.attribute:
                stack.extend([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH else attribute.graphs)
    return count


def max_abs_diff(cells: dict[str, Cell], feeds: dict, threads: int) -> dict[str, float | str]:
    expected = session(cells["orig"].model, "off", threads).run(None, feeds)
    diffs = {}
    for name, cell in cells.items():
        if cell.model is None:
            continue
        try:
            actual = session(cell.model, "off", threads).run(None, feeds)
        except Exception as error:  # noqa: BLE001
            cell.missing, cell.model = f"does not run: {first_line(error)}", None
            continue
        diffs[name] = max(
            float(np.max(np.abs(a.astype(np.float64) - e.astype(np.float64)))) for a, e in zip(actual, expected)
        )
    return diffs


def latencies(cells: dict[str, Cell], feeds: dict, threads: int, runs: int, split: bool) -> dict:
    """Medians per (column, level) and the original's at "all" they are compared with, per level.

    In one round-robin over every column at both levels by default; with `split`, one level at a
    time (half the sessions alive at once: real-size models need that much less memory), the
    original at "all" timed in both rounds so that every ratio compares samples taken side by side.
    The models are let go once their sessions exist, so that only the sessions hold weights."""
    present = [name for name, cell in cells.items() if cell.model is not None]
    rounds = [["off", "all"]] if not split else [["off"], ["all"]]
    medians, baselines = {}, {}
    for levels in rounds:
        keys = [(name, level) for name in present for level in levels]
        if ("orig", "all") not in keys:
            keys.append(("orig", "all"))
        sessions = {key: session(cells[key[0]].model, key[1], threads) for key in keys}
        if levels == rounds[-1]:
            for cell in cells.values():
                cell.model = None
        timed = medians_ms(sessions, feeds, runs)
        del sessions
        for level in levels:
            baselines[level] = timed[("orig", "all")]
        medians.update({key: value for key, value in timed.items() if key[1] in levels})
    return {"medians": medians, "baselines": baselines}


def table(title: str, rows: dict[str, dict[str, str]]) -> str:
    lines = [f"\n### {title}\n", "| model | " + " | ".join(COLUMNS) + " |", "|---|" + "---:|" * len(COLUMNS)]
    for model, cells in rows.items():
        lines.append(f"| {model} | " + " | ".join(cells.get(c, "n/a") for c in COLUMNS) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(FOLDERS), default="tiny")
    parser.add_argument("--dir", default=None, help="corpus folder (default: the one for --size)")
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS), help="file names without .onnx")
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=None)
    parser.add_argument("--sequence", type=int, default=None)
    parser.add_argument("--past", type=int, default=128, help="cached tokens given to the *_past models")
    parser.add_argument(
        "--split-levels",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="time one optimization level at a time (half the memory); default: for --size real only",
    )
    args = parser.parse_args(argv)
    folder = args.dir or FOLDERS[args.size]
    batch = args.batch or SHAPES[args.size][0]
    sequence = args.sequence or SHAPES[args.size][1]
    names = args.models.split(",")
    missing = [n for n in names if not os.path.exists(os.path.join(folder, f"{n}.onnx"))]
    if missing:
        print(f"bench/transformers.py: no {', '.join(missing)} in {folder}", file=sys.stderr)
        if args.size == "real":
            print(
                "make them with: python tests/data/make_transformers.py --size real --out bench/models/"
                + (" --past" if any(n.endswith("_past") for n in missing) else ""),
                file=sys.stderr,
            )
        return 2

    print(
        f"size {args.size}, batch {batch}, sequence {sequence} (after {args.past} cached for *_past), "
        f"{args.runs} runs, {args.threads} threads"
    )
    tables = {key: {} for key in ("nodes", "patterns", "diff", "off", "all", "ratio_off", "ratio_all")}
    notes = []
    for name in names:
        path = os.path.join(folder, f"{name}.onnx")
        kind = family(name)
        started = time.perf_counter()
        original = onnx.load(path)
        feeds = realistic_inputs(original, kind, args.size, batch, sequence, args.past)
        cells = make_cells(path, original, kind, args.size, feeds)
        diffs = max_abs_diff(cells, feeds, args.threads)
        for rows in tables.values():
            rows[name] = {}
        timed = []
        for column, cell in cells.items():
            if cell.missing:
                where = column if cell.missing == NO_OPSET else f"{name} {column}"  # the same for every model
                if f"{where}: n/a, {cell.missing}" not in notes:
                    notes.append(f"{where}: n/a, {cell.missing}")
            if cell.model is None:
                continue
            timed.append(column)
            mark = "!" if cell.unchecked else ""
            if cell.unchecked:
                notes.append(f"{name} {column}: `!` fuser's check failed, made with check=False ({cell.unchecked})")
            left = patterns_left(cell.model)
            tables["nodes"][name][column] = f"{node_count(cell.model)}{mark}"
            tables["patterns"][name][column] = "/".join(str(left[p]) for p in PATTERNS) + mark
            tables["diff"][name][column] = f"{diffs[column]:.1e}{mark}"
        del original
        split = args.split_levels if args.split_levels is not None else args.size == "real"
        timing = latencies(cells, feeds, args.threads, args.runs, split)
        for column in timed:
            mark = "!" if cells[column].unchecked else ""
            for level in ("off", "all"):
                median = timing["medians"][(column, level)]
                tables[level][name][column] = f"{median:.3f}{mark}"
                tables[f"ratio_{level}"][name][column] = f"{median / timing['baselines'][level]:.2f}{mark}"
        print(f"{name}: {time.perf_counter() - started:.0f} s", file=sys.stderr)
        sys.stderr.flush()

    print(table("Nodes", tables["nodes"]))
    print(table("Decomposed patterns left: LayerNorm/RMSNorm/GELU/SiLU/attention (Softmax)/rotary", tables["patterns"]))
    print(table("Max abs difference from the original (onnxruntime, optimizations off)", tables["diff"]))
    print(table("Latency median, ms, onnxruntime optimizations off", tables["off"]))
    print(table("Latency median, ms, onnxruntime optimizations all", tables["all"]))
    print(table("Latency ratio to the original at all, for optimizations off (lower is faster)", tables["ratio_off"]))
    print(table("Latency ratio to the original at all, for optimizations all (lower is faster)", tables["ratio_all"]))
    if notes:
        print("\nNotes:\n" + "\n".join(f"- {note}" for note in notes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
