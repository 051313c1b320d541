"""`--fix-shapes`: write the model for the input sizes the user gives, so what depends on them folds.

A symbolic dimension (`batch`, `height`) keeps shape arithmetic alive: Shape -> Gather ->
Concat -> Reshape chains that constant folding cannot evaluate because the value is not
known until the model runs. With --fix-shapes, the sizes given by --dim NAME=SIZE and
--input-shape INPUT:D1,D2,... are written into the model: a symbol becomes that size
wherever it appears (every input, output and annotation of every graph, since one symbol
means one size), and an unnamed dim of an --input-shape input becomes its given size. Shape
inference then knows the shapes and the simplification rules fold what depended on them.

The result is a specialised model: it accepts only those sizes. That is why this is a
separate, explicit choice rather than what --dim and --input-shape do on their own (they only
pick the shapes of the numerics check).
"""

from __future__ import annotations

from onnx import ValueInfoProto

from fuser.errors import UsageError
from fuser.graph import all_graph_protos
from fuser.model import Model


def fix_shapes(
    model: Model, dims: dict[str, int], shapes: dict[str, tuple]
) -> tuple[Model, dict[str, list], dict[str, int]]:
    """`model` with the given sizes written in, {input: its new dims} for each input that changed,
    and {symbol: size} for every symbol bound (the numerics check must feed those sizes too)."""
    if not dims and not shapes:
        raise UsageError("--fix-shapes fixes the sizes that --dim and --input-shape give; give at least one")
    proto = model.to_proto(in_place=True)
    fed = {value.name for value in model.interface().graph.input}
    inputs = {value.name: value for value in proto.graph.input if value.name in fed}
    symbols = dict(dims)
    positional: dict[str, dict[int, int]] = {}
    for name, sizes in shapes.items():
        if name not in inputs:
            raise UsageError(
                f"--input-shape: the model has no input {name} (its inputs: {', '.join(inputs) or 'none'})"
            )
        positional[name] = _bind_input(inputs[name], tuple(sizes), symbols)
    known = {d.dim_param for value in inputs.values() for d in _dims(value) if d.HasField("dim_param")}
    unknown = sorted(set(dims) - known)
    if unknown:
        raise UsageError(
            f"--dim: the model's inputs have no symbolic dimension {', '.join(unknown)} "
            f"(symbolic dimensions: {', '.join(sorted(known)) or 'none'})"
        )
    before = {name: _text(value) for name, value in inputs.items()}
    for graph in all_graph_protos(proto.graph):
        for value in (*graph.input, *graph.output, *graph.value_info):
            for dim in _dims(value):
                if dim.HasField("dim_param") and dim.dim_param in symbols:
                    dim.dim_value = symbols[dim.dim_param]
    for name, sizes in positional.items():
        for index, size in sizes.items():
            _dims(inputs[name])[index].dim_value = size
    fixed = {name: _text(value) for name, value in inputs.items() if _text(value) != before[name]}
    return Model(proto, base_dir=model.base_dir, path=model.path, tensors=model.tensors), fixed, symbols


def _dims(value: ValueInfoProto):
    if not value.type.HasField("tensor_type") or not value.type.tensor_type.HasField("shape"):
        return []
    return value.type.tensor_type.shape.dim


def _text(value: ValueInfoProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in _dims(value)]


def _bind_input(value: ValueInfoProto, sizes: tuple, symbols: dict[str, int]) -> dict[int, int]:
    """Record in `symbols` the sizes `sizes` gives the input's symbols; returns {index: size} for
    its unnamed dims. A size that contradicts a fixed dim or an earlier binding is a usage error."""
    if not value.type.HasField("tensor_type"):
        raise UsageError(f"--input-shape: input {value.name} is not a tensor")
    if not value.type.tensor_type.HasField("shape"):  # no shape recorded: it gets the one given
        for _ in sizes:
            value.type.tensor_type.shape.dim.add()
    dims = _dims(value)
    if len(dims) != len(sizes):
        raise UsageError(f"--input-shape: input {value.name} has {len(dims)} dimensions, not {len(sizes)}")
    positional = {}
    for index, (dim, size) in enumerate(zip(dims, sizes)):
        if size < 1:
            raise UsageError(f"--input-shape: sizes of {value.name} must be positive, not {size}")
        if dim.HasField("dim_value"):
            if dim.dim_value != size:
                raise UsageError(
                    f"--input-shape: dimension {index} of {value.name} is fixed at {dim.dim_value}, not {size}"
                )
        elif dim.HasField("dim_param") and dim.dim_param:
            bound = symbols.setdefault(dim.dim_param, size)
            if bound != size:
                raise UsageError(
                    f"--fix-shapes: dimension '{dim.dim_param}' would be both {bound} and {size} "
                    f"(it appears in {value.name} and elsewhere)"
                )
        else:
            positional[index] = size
    return positional
