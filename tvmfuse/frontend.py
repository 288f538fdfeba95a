"""ONNX in: validate, pin input shapes on request, fold the shape computations that do not depend on a
symbolic dim, import to Relax (with tvmfuse's converters for PyTorch's dynamic-shape subgraphs)."""
from __future__ import annotations

import logging
import os
import re

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from . import _compat as C
from .errors import InputError, ModelLoadError, UnsupportedOpError

log = logging.getLogger("tvmfuse.frontend")

# Ops never folded at compile time: random, or with side effects.
_NEVER_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
               "Bernoulli", "If", "Loop", "Scan"}
# A folded tensor larger than this many elements stays a computation (ConstantOfShape of an activation
# size would otherwise bloat the model with a constant).
MAX_FOLDED_ELEMENTS = 1 << 20
# The range the frontend assumes for a symbolic dim when it normalizes slice bounds over it: an empty batch
# or sequence is no size a model is compiled for, and one axis of 2**31 elements or more is none either.
SYMBOLIC_DIM_MAX = (1 << 31) - 1


def read_model(path_or_model) -> onnx.ModelProto:
    """An onnx.ModelProto from a path, bytes or a ModelProto, checked by onnx.checker."""
    if isinstance(path_or_model, onnx.ModelProto):
        model = path_or_model
    elif isinstance(path_or_model, (str, os.PathLike)):
        path = os.fspath(path_or_model)
        if not os.path.exists(path):
            raise ModelLoadError(f"model file not found: {path}")
        try:
            model = onnx.load(path)
        except Exception as e:  # protobuf raises DecodeError and friends on garbage
            raise ModelLoadError(f"{path} is not a valid ONNX file: {type(e).__name__}: {e}") from None
    elif isinstance(path_or_model, (bytes, bytearray)):
        try:
            model = onnx.load_from_string(bytes(path_or_model))
        except Exception as e:
            raise ModelLoadError(f"bytes are not a valid ONNX model: {e}") from None
    else:
        raise ModelLoadError(f"cannot read a model from {type(path_or_model).__name__}")
    if len(model.graph.node) == 0 and len(model.graph.output) == 0:
        raise ModelLoadError("the ONNX model has an empty graph (not an ONNX model?)")
    return check_model(model)


# onnx.checker complaints that do not stop an import: a graph output without a type or a shape (exporters
# leave them out; onnxruntime and TVM's importer infer them).  They become a warning, and onnx shape
# inference fills what it can.
TOLERATED_CHECKER_ERRORS = (
    "Field 'shape' of 'type' is required but missing",
    "Field 'type' of 'value_info' is required but missing",
)


def _first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else "validation failed"


def _untyped_outputs(model: onnx.ModelProto) -> list[str]:
    return [o.name for o in model.graph.output
            if not o.type.HasField("tensor_type") or not o.type.tensor_type.HasField("shape")
            or not o.type.tensor_type.elem_type]


def _fill_output_types(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of ``model`` whose untyped/unshaped graph outputs take the types onnx shape inference finds."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception as e:  # inference can fail (custom domains, bad attributes); the checker then says why
        log.debug("onnx shape inference failed: %s", e)
        return out
    known = {vi.name: vi for vi in list(inferred.graph.value_info) + list(inferred.graph.output)
             if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape")
             and vi.type.tensor_type.elem_type}
    missing = set(_untyped_outputs(out))
    for o in out.graph.output:
        if o.name in missing and o.name in known:
            o.type.CopyFrom(known[o.name].type)
    return out


def check_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` if onnx.checker accepts it; with a complaint of ``TOLERATED_CHECKER_ERRORS``, a copy whose
    graph outputs have the types onnx shape inference finds (a warning on the ``tvmfuse`` logger says
    so); any other complaint is a ModelLoadError naming it."""
    try:
        onnx.checker.check_model(model)
        return model
    except onnx.checker.ValidationError as e:
        complaint = _first_line(e)
    if not any(t in complaint for t in TOLERATED_CHECKER_ERRORS):
        raise ModelLoadError(f"malformed ONNX model: {complaint}")
    filled = _fill_output_types(model)
    left = _untyped_outputs(filled)
    # check everything else: outputs inference could not type get a placeholder type in a throwaway copy
    probe = onnx.ModelProto()
    probe.CopyFrom(filled)
    for o in probe.graph.output:
        if o.name in left:
            o.type.tensor_type.elem_type = o.type.tensor_type.elem_type or onnx.TensorProto.FLOAT
            o.type.tensor_type.shape.SetInParent()
    try:
        onnx.checker.check_model(probe)
    except onnx.checker.ValidationError as e:
        raise ModelLoadError(f"malformed ONNX model: {_first_line(e)}") from None
    filled_names = sorted(set(_untyped_outputs(model)) - set(left))
    log.warning("onnx.checker: %s; continuing (%s)", complaint,
                "; ".join(p for p in (f"onnx shape inference typed output(s) {filled_names}" if filled_names
                                      else "", f"output(s) {left} left for the importer to infer" if left
                                      else "") if p))
    return filled


def _eval_node(node: onnx.NodeProto, inputs: dict[str, np.ndarray], opset_imports) -> list[np.ndarray] | None:
    from onnx.reference import ReferenceEvaluator

    try:
        ev = ReferenceEvaluator(onnx.helper.make_model(
            onnx.helper.make_graph([node], "fold", [
                onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                for n, v in inputs.items()], [onnx.helper.make_empty_tensor_value_info(o) for o in node.output]),
            opset_imports=opset_imports))
        return list(ev.run(None, inputs))
    except Exception as e:  # the reference evaluator lacks some ops; then the node simply stays
        log.debug("not folding %s (%s): %s", node.name or node.op_type, node.op_type, e)
        return None


def _known_dims(vi) -> list | None:
    """Dims of an inferred tensor: an int where static, None where symbolic; None if the rank is unknown."""
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]


def _shape_slice(node: onnx.NodeProto, dims: list) -> list:
    """The part of ``dims`` an ONNX Shape node returns (opset 15 ``start``/``end``)."""
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    start, end = attrs.get("start", 0), attrs.get("end", len(dims))
    return dims[slice(start, end)]


def _static_dims_gathered(node: onnx.NodeProto, dims: list, indices: np.ndarray) -> list[np.ndarray] | None:
    """The value of ``Gather(Shape(x), indices)`` when every dim it picks is static, else None."""
    axis = next((onnx.helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    if axis not in (0, -1) or not np.issubdtype(indices.dtype, np.integer):
        return None
    picked = [dims[int(i)] if -len(dims) <= int(i) < len(dims) else None for i in indices.reshape(-1)]
    if any(d is None for d in picked):
        return None
    return [np.array(picked, np.int64).reshape(indices.shape)]


def fold_static_shapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Fold Shape nodes of statically shaped tensors and every node whose inputs are then all constants.

    PyTorch exports compute reshape targets at run time (Shape -> Gather -> Div -> Concat -> Reshape);
    TVM's importer fails on some of these chains. With static shapes they are constants.  With symbolic
    input dims, what does not depend on them still folds (a Shape of a static intermediate, a
    ConstantOfShape of a constant shape); the rest is imported as symbolic shape computations.
    Returns the new model and the number of folded nodes.
    """
    graph = model.graph
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception as e:  # shape inference can fail on custom domains; fold nothing then
        log.debug("shape inference failed, not folding: %s", e)
        return model, 0
    shapes = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        dims = _known_dims(vi)
        if dims is not None:
            shapes[vi.name] = dims
    consts = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    opsets = list(model.opset_import)
    kept, folded = [], 0
    new_inits = []
    partial = {}     # output of a Shape kept (a symbolic dim in it) -> its dims, None where symbolic
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER_FOLD:
            kept.append(node)
            continue
        vals = None
        if node.op_type == "Shape" and node.input[0] in shapes and node.input[0] not in consts:
            part = _shape_slice(node, shapes[node.input[0]])
            if all(d is not None for d in part):
                vals = [np.array(part, np.int64)]
            else:
                partial[node.output[0]] = part
        elif node.op_type == "Gather" and node.input[0] in partial and node.input[1] in consts:
            # a static dim read from the shape of a tensor with a symbolic one (Swin's H, W of an NHWC
            # activation with a symbolic batch: the pads to a multiple of the window are then constants)
            vals = _static_dims_gathered(node, partial[node.input[0]], consts[node.input[1]])
        elif node.op_type == "Constant":
            vals = _eval_node(node, {}, opsets)
        elif node.input and all(i == "" or i in consts for i in node.input) and any(
                i in consts for i in node.input):
            produces_shape_data = all(consts[i].size <= MAX_FOLDED_ELEMENTS for i in node.input if i)
            if produces_shape_data:
                vals = _eval_node(node, {i: consts[i] for i in node.input if i}, opsets)
        if vals is None or any(v.size > MAX_FOLDED_ELEMENTS for v in vals):
            kept.append(node)
            continue
        folded += 1
        for name, v in zip(node.output, vals):
            if name:
                consts[name] = np.asarray(v)
                new_inits.append(numpy_helper.from_array(np.asarray(v), name))
    if folded == 0:
        return model, 0
    # an initializer also listed as a graph input (IR version < 4 lists every weight there) stays: without
    # it, the input would become one the caller has to feed
    used = {i for n in kept for i in n.input} | {o.name for o in graph.output} | {i.name for i in graph.input}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    out.graph.node.extend(kept)
    existing = {i.name for i in out.graph.initializer}
    out.graph.initializer.extend(t for t in new_inits if t.name in used and t.name not in existing)
    # drop initializers nothing reads any more (e.g. a Shape-chain's index constants)
    keep_inits = [t for t in out.graph.initializer if t.name in used]
    del out.graph.initializer[:]
    out.graph.initializer.extend(keep_inits)
    return out, folded


def tile_leading_repeats(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Tile(x, Concat(r0, 1, .., 1)) -- a run-time repeat count on axis 0 only (BLOOM's ALiBi slopes
    tiled by the batch: [heads, 1, seq] x [batch, 1, 1]) -- as Reshape(Expand(Unsqueeze(x, 0),
    Concat(r0, 1, .., 1)), Concat(-1, Shape(x)[1:])): TVM's importer refuses a Tile whose repeats are a shape
    of symbols ("cannot handle ShapeExpr inputs"), while Unsqueeze, Expand, Shape, Slice, Concat and Reshape
    take them.  Repeats whose other elements are not constant 1s stay a Tile.  Returns the model and the
    number of Tiles rewritten."""
    if not any(n.op_type == "Tile" for n in model.graph.node):
        return model, 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    model, graph = out, out.graph
    consts = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    for n in graph.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    producer = {o: n for n in graph.node for o in n.output}
    nodes, count = [], 0
    for node in graph.node:
        reps = producer.get(node.input[1]) if node.op_type == "Tile" and len(node.input) == 2 else None
        parts = list(reps.input) if reps is not None and reps.op_type == "Concat" else []
        rest = [consts.get(p) for p in parts[1:]]
        if len(parts) < 2 or parts[0] in consts or any(
                v is None or v.size != 1 or int(v.reshape(-1)[0]) != 1 for v in rest):
            nodes.append(node)
            continue
        count += 1
        x, out, tag = node.input[0], node.output[0], f"{node.output[0]}__tile0"
        n_axes = len(parts)
        inits = {f"{tag}_axes0": np.array([0], np.int64), f"{tag}_ones": np.ones(n_axes, np.int64),
                 f"{tag}_minus1": np.array([-1], np.int64), f"{tag}_from1": np.array([1], np.int64),
                 f"{tag}_to": np.array([n_axes], np.int64)}
        graph.initializer.extend(numpy_helper.from_array(v, k) for k, v in inits.items())
        H = onnx.helper
        nodes += [
            H.make_node("Unsqueeze", [x, f"{tag}_axes0"], [f"{tag}_u"]),
            H.make_node("Concat", [parts[0], f"{tag}_ones"], [f"{tag}_target"], axis=0),   # [r0, 1, .., 1]
            H.make_node("Expand", [f"{tag}_u", f"{tag}_target"], [f"{tag}_e"]),
            H.make_node("Shape", [x], [f"{tag}_shape"]),
            H.make_node("Slice", [f"{tag}_shape", f"{tag}_from1", f"{tag}_to"], [f"{tag}_tail"]),
            H.make_node("Concat", [f"{tag}_minus1", f"{tag}_tail"], [f"{tag}_newshape"], axis=0),
            H.make_node("Reshape", [f"{tag}_e", f"{tag}_newshape"], [out]),
        ]
    if not count:
        return model, 0
    del graph.node[:]
    graph.node.extend(nodes)
    return model, count


# How many rounds ``fold_static_shapes_fully`` runs at most: each round's shape inference sees the shapes the
# previous round's constants made static (ONNX's function-expanded Attention reshapes Q by a Shape -> Concat
# target, then reads Shape of the result: one round folds the target, the next the Shape after it).  Four
# rounds cover the deepest chain in ONNX's backend suite (two); more only costs shape inferences.
MAX_FOLD_ROUNDS = 4


def fold_static_shapes_fully(model: onnx.ModelProto, max_rounds: int | None = MAX_FOLD_ROUNDS
                             ) -> tuple[onnx.ModelProto, int]:
    """``fold_static_shapes`` again on its own result until a round folds nothing (at most ``max_rounds``
    rounds; ``None``: no limit, which terminates since every round but the last removes a node).  Returns
    the new model and the number of folded nodes over all rounds."""
    if max_rounds is not None and max_rounds < 1:
        raise ValueError(f"fold_static_shapes_fully: max_rounds must be >= 1 or None, got {max_rounds}")
    total, rounds = 0, 0
    while max_rounds is None or rounds < max_rounds:
        model, n = fold_static_shapes(model)
        total, rounds = total + n, rounds + 1
        if n == 0:
            break
    return model, total


# --------------------------------------------------------------------------- pinning input shapes
SHAPE_HELP = ("pin an input's shape (x=1,128) or a symbolic dimension (batch=8) before import; repeatable. "
              "Symbolic dims left open compile to kernels that take any size")


def parse_shape_args(items, option: str = "--shape") -> dict[str, list[int]]:
    """``["x=1,128", "batch=8"]`` (the CLI's ``--shape``, or ``option``) -> ``{"x": [1, 128], "batch": [8]}``."""
    out: dict[str, list[int]] = {}
    for item in items or []:
        name, sep, dims = str(item).partition("=")
        name = name.strip()
        if not sep or not name or not dims.strip():
            raise InputError(f"{option} {item!r}: expected NAME=D1,D2,... (an input) or NAME=N (a symbolic dim)")
        try:
            values = [int(d) for d in dims.split(",")]
        except ValueError:
            raise InputError(f"{option} {item!r}: dimensions must be integers, got {dims!r}") from None
        if name in out:
            raise InputError(f"{option} gives {name!r} twice")
        out[name] = values
    return out


def _dims(vi) -> list:
    """Dims of a graph input: an int, a dim_param name, or None (unknown)."""
    t = vi.type.tensor_type
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]


def symbolic_dims(model: onnx.ModelProto) -> dict[str, list[tuple[str, int]]]:
    """Each symbolic dim (ONNX dim_param) of the graph inputs -> the (input, axis) places it sizes."""
    inits = {i.name for i in model.graph.initializer}
    out: dict[str, list[tuple[str, int]]] = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        for axis, d in enumerate(_dims(vi)):
            if isinstance(d, str):
                out.setdefault(d, []).append((vi.name, axis))
    return out


def _positive(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
        raise InputError(f"input_shapes[{name!r}]: dimensions must be positive integers, got {value!r}")
    return int(value)


def resolve_input_shapes(model: onnx.ModelProto, input_shapes: dict) -> tuple[dict, dict[str, int]]:
    """(input -> its shape after pinning, symbolic dim -> its size) for what ``input_shapes`` pins (a dim
    of an input left symbolic stays a name), or an InputError naming what is wrong (an unknown name, a wrong rank, a size that contradicts a static dim or another pin)."""
    if not isinstance(input_shapes, dict):
        raise InputError(f"input_shapes must be a dict of input name or symbolic dim -> shape, got "
                         f"{type(input_shapes).__name__}")
    inits = {i.name for i in model.graph.initializer}
    inputs = {vi.name: _dims(vi) for vi in model.graph.input if vi.name not in inits}
    syms = symbolic_dims(model)
    dim_values: dict[str, int] = {}
    dim_source: dict[str, str] = {}

    def bind(dim: str, value: int, source: str) -> None:
        if dim in dim_values and dim_values[dim] != value:
            raise InputError(f"symbolic dim {dim!r} is {dim_values[dim]} by {dim_source[dim]} but {value} by "
                             f"{source}")
        dim_values[dim], dim_source[dim] = value, source

    pinned: dict[str, list[int]] = {}
    for name, value in input_shapes.items():
        if name in inputs:
            if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
                value = [value]
            if not isinstance(value, (list, tuple)):
                raise InputError(f"input_shapes[{name!r}] must be a list of ints, got {type(value).__name__}")
            shape = [_positive(name, v) for v in value]
            dims = inputs[name]
            if len(shape) != len(dims):
                raise InputError(f"input {name!r} has rank {len(dims)} ({dims}), input_shapes gives rank "
                                 f"{len(shape)} ({shape})")
            for axis, (d, v) in enumerate(zip(dims, shape)):
                if isinstance(d, int) and d != v:
                    raise InputError(f"input {name!r}: input_shapes gives {v} for axis {axis}, which the model "
                                     f"fixes to {d} (shape {dims})")
                if isinstance(d, str):
                    bind(d, v, f"input_shapes[{name!r}]")
            pinned[name] = shape
        elif name in syms:
            if isinstance(value, (list, tuple)):
                if len(value) != 1:
                    raise InputError(f"symbolic dim {name!r} takes one size, got {list(value)}")
                value = value[0]
            bind(name, _positive(name, value), f"input_shapes[{name!r}]")
        else:
            raise InputError(f"input_shapes names {name!r}, which is neither an input of the model "
                             f"({sorted(inputs)}) nor one of its symbolic dims ({sorted(syms)})")
    # every input that a pinned symbolic dim sizes gets it
    for name, dims in inputs.items():
        if name in pinned:
            continue
        if any(isinstance(d, str) and d in dim_values for d in dims):
            pinned[name] = [dim_values[d] if isinstance(d, str) and d in dim_values else d for d in dims]
    return pinned, dim_values


def specialize_inputs(model: onnx.ModelProto, input_shapes: dict) -> onnx.ModelProto:
    """A copy of ``model`` with the pinned input dims (by input name or symbolic dim name) written into the
    graph inputs, the same dim_params fixed everywhere else, and shapes inferred again, so that
    ``fold_static_shapes`` sees static shapes.  Inputs with a dim left open keep it symbolic."""
    pinned, dim_values = resolve_input_shapes(model, input_shapes)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    by_name = {vi.name: vi for vi in out.graph.input}
    for name, shape in pinned.items():
        for d, v in zip(by_name[name].type.tensor_type.shape.dim, shape):
            if isinstance(v, int):
                d.Clear()
                d.dim_value = v
    for vi in list(out.graph.output) + list(out.graph.value_info):
        t = vi.type.tensor_type
        if not t.HasField("shape"):
            continue
        for d in t.shape.dim:
            if d.HasField("dim_param") and d.dim_param in dim_values:
                v = dim_values[d.dim_param]
                d.Clear()
                d.dim_value = v
    # old inferred shapes of intermediates may still hold other (derived) dim_params: infer them afresh
    del out.graph.value_info[:]
    try:
        out = shape_inference.infer_shapes(out)
    except Exception as e:  # onnx raises InferenceError and friends; the pinned inputs still stand
        log.info("shape inference after pinning input shapes failed: %s", e)
    return out


# --------------------------------------------------------------------------- converter overrides
# TVM's importer turns the shape subgraphs PyTorch emits for symbolic dims into Relax shape computations,
# but two of its converters lose the symbols or fail; tvmfuse replaces them for its imports (one row per op,
# with why).  Each falls back to TVM's own converter for the cases it does not change.
def _prim_dtype(expr) -> str:
    # 0.27: a TIR var's dtype is in its type (``.dtype`` is for buffer vars); other expressions have .dtype
    return str(getattr(expr, "dtype", None) or expr.ty)


def _scalar_of(value, params):
    """A Range/ConstantOfShape operand as a Python number or an integer TIR expression; None if neither."""
    F = C.onnx_frontend()
    value = F.get_constant(value, params)
    if C.is_prim_expr(value):
        return value if "int" in _prim_dtype(value) else None
    if isinstance(value, C.GenericConst):
        arr = value.value.numpy()
        return arr.reshape(()).item() if arr.size == 1 else None
    return None


def _converter_overrides() -> dict:
    F = C.onnx_frontend()

    class SymbolicRange(F.OnnxOpConverter):
        """Range(0, seq, 1) over a symbolic ``seq`` as ``arange(0, seq)`` of shape [seq]: TVM's converter
        computes the length into a fresh var, so positions no longer broadcast against [batch, seq, d]."""

        @classmethod
        def _impl_v11(cls, bb, inputs, attr, params):
            start, limit, delta = (_scalar_of(x, params) for x in inputs)
            known = all(v is not None and not isinstance(v, (float, bool)) for v in (start, limit, delta))
            if not known or not any(C.is_prim_expr(v) for v in (start, limit)) or not isinstance(delta, int) \
                    or delta == 0:
                return F.Range.get_converter(12)(bb, inputs, attr, params)
            dtype = next(_prim_dtype(v) for v in (start, limit) if C.is_prim_expr(v))
            return C.relax.op.arange(start, limit, delta, dtype)

    class ScalarSafeConstantOfShape(F.OnnxOpConverter):
        """ConstantOfShape with its 1-element ``value`` taken as a scalar: TVM's converter broadcasts the
        [1]-shaped value, which fails for an empty (rank-0) shape ("broadcast_to expects the input shape to
        have the number of ndim at least as the input tensor's")."""

        @classmethod
        def _impl_v9(cls, bb, inputs, attr, params):
            value = attr.get("value")
            arr = numpy_helper.to_array(value).reshape(()) if value is not None else np.zeros((), np.float32)
            shape = F.get_constant(inputs[0], params)
            if isinstance(shape, C.GenericConst):
                dims = [int(d) for d in shape.value.numpy().reshape(-1)]
                if int(np.prod(dims)) <= MAX_FOLDED_ELEMENTS:
                    return C.relax.const(np.full(dims, arr, arr.dtype), str(arr.dtype))
                shape = C.relax.ShapeExpr(dims)
            if not isinstance(shape, C.relax.ShapeExpr):
                ty = C.type_of(shape)
                length = ty.shape.values[0] if getattr(ty, "shape", None) is not None and \
                    isinstance(ty.shape, C.relax.ShapeExpr) and len(ty.shape.values) == 1 else None
                if not isinstance(length, C.IntImm):
                    raise ValueError("ConstantOfShape: the length of its shape input is not known at import")
                shape = F._tensor_to_shape_expr(bb, shape, int(length), "const_of_shape")
            return C.relax.op.full(shape, C.relax.const(arr, str(arr.dtype)), str(arr.dtype))

    class StaticShapeGather(F.OnnxOpConverter):
        """Gather from a shape with constant indices that pick static dims only (``x.chunk(2, dim=1)`` on
        [batch, c, h, w] exports Shape -> Gather([1]) -> Div -> Slice) as a constant: TVM's converter
        gathers a 1-element index at run time, so the Slice and everything after it lose their shapes."""

        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            data, indices = inputs[0], inputs[1]
            if isinstance(data, C.relax.ShapeExpr) and isinstance(indices, C.GenericConst) \
                    and int(attr.get("axis", 0)) == 0:
                idx = indices.value.numpy().astype(np.int64)
                dims = list(data.values)
                picked = [dims[int(i)] for i in idx.reshape(-1) if -len(dims) <= int(i) < len(dims)]
                if idx.ndim > 0 and len(picked) == idx.size and all(isinstance(d, C.IntImm) for d in picked):
                    return C.relax.const(np.array([int(d.value) for d in picked], np.int64).reshape(idx.shape),
                                         "int64")
            taken = _constant_index_take(data, indices, int(attr.get("axis", 0)))
            if taken is not None:
                return taken
            return F.Gather.get_converter(13)(bb, inputs, attr, params)

    class SymbolicBoundSlice(F.OnnxOpConverter):
        """Slice with a symbolic start or end (T5's ``bias[:, :, -seq:, :]``: start ``-sequence``) made
        non-negative and clamped against the axis extent the ONNX way; TVM's converter takes the symbolic
        bound as in range, so the result's extent becomes ``sequence + 2**63 - 1``."""

        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            bounds = _symbolic_slice_bounds(F, inputs, params)
            if bounds is None:
                return F.Slice.get_converter(13)(bb, inputs, attr, params)
            axes, begin, end = bounds
            return C.relax.op.strided_slice(inputs[0], axes, [C.relax.prim_value(b) for b in begin],
                                            [C.relax.prim_value(e) for e in end], assume_inbound=True)

    class SymbolicDataExpand(F.OnnxOpConverter):
        """Expand to a constant shape of data with a symbolic dim (BLOOM's ALiBi: [batch * heads, 1, seq]
        expanded to [1, 1, 1]-style constant shapes): TVM's converter reads ``dim.value`` of every data dim
        and fails on a symbol ("'Var' object has no attribute 'value'"). Here ONNX's right-aligned
        broadcast is resolved per dim (``expand_shape``) and the data broadcast to it; static data goes to
        TVM's converter."""

        @classmethod
        def _impl_v13(cls, bb, inputs, attr, params):
            data, shape = inputs[0], F.get_constant(inputs[1], params)
            ty = C.type_of(data)
            dims = list(ty.shape.values) if getattr(ty, "shape", None) is not None and \
                isinstance(ty.shape, C.relax.ShapeExpr) else None
            if not isinstance(shape, C.GenericConst) or dims is None or all(isinstance(d, C.IntImm) for d in dims):
                return F.Expand.get_converter(13)(bb, inputs, attr, params)
            target = expand_shape(dims, [int(v) for v in shape.value.numpy().reshape(-1)])
            if len(target) == len(dims) and all(t.same_as(d) if not isinstance(t, int) else
                                                isinstance(d, C.IntImm) and int(d) == t
                                                for t, d in zip(target, dims)):
                return data
            return C.relax.op.broadcast_to(data, C.relax.ShapeExpr(target))

    return {"Range": SymbolicRange, "ConstantOfShape": ScalarSafeConstantOfShape, "Gather": StaticShapeGather,
            "Slice": SymbolicBoundSlice, "Expand": SymbolicDataExpand}


def expand_shape(data_dims: list, shape: list[int]) -> list:
    """ONNX Expand's output shape (numpy broadcasting, right-aligned) of data dims (ints or TIR
    expressions) and a constant target ``shape``: per dim the data dim where the target is 1 or -1 (or the
    data dim equals it), the target where the data dim is 1 or symbolic (a symbolic dim must then be the
    target or 1 at run time, as broadcasting requires).  A static mismatch is a ValueError naming both."""
    n = max(len(data_dims), len(shape))
    data = [1] * (n - len(data_dims)) + list(data_dims)
    want = [1] * (n - len(shape)) + list(shape)
    out = []
    for i, (d, t) in enumerate(zip(data, want)):
        static = int(d) if isinstance(d, (int, C.IntImm)) else None
        if t in (1, -1) or static == t:
            out.append(d)
        elif static == 1 or static is None:
            if t < 1:
                raise ValueError(f"Expand: target dim {t} at axis {i} of {shape} (dims must be >= 1)")
            out.append(C.IntImm("int64", t))
        else:
            raise ValueError(f"Expand: data dims {[str(x) for x in data_dims]} do not broadcast to {shape} "
                             f"(axis {i}: {static} vs {t})")
    return [C.IntImm("int64", x) if isinstance(x, int) else x for x in out]


def _constant_index_take(data, indices, axis: int):
    """``take(data, indices, axis)`` with the constant indices normalised at import when the sign of every
    index is known against the axis extent (non-negative, or negative against a static extent); None
    otherwise.  TVM's Gather converter normalises negative indices at run time from ``shape_of(data)``;
    over a tensor with a symbolic dim (Swin's ``qkv[0]`` of [3, batch * 16, ...]) that computed index is no
    constant, so the take is an opaque gather instead of the static build's slice (one kernel per take)."""
    if not isinstance(indices, C.GenericConst) or isinstance(data, C.GenericConst) or C.is_prim_expr(data):
        return None
    ty = C.type_of(data)
    if not isinstance(ty, C.TensorType) or not isinstance(ty.shape, C.relax.ShapeExpr):
        return None
    idx = indices.value.numpy()
    if not np.issubdtype(idx.dtype, np.integer):
        return None
    dims = list(ty.shape.values)
    if not -len(dims) <= axis < len(dims):
        return None
    extent = dims[axis]
    if (idx < 0).any():
        if not isinstance(extent, C.IntImm):
            return None
        idx = np.where(idx < 0, idx + int(extent.value), idx)
    if isinstance(extent, C.IntImm) and (idx >= int(extent.value)).any() or (idx < 0).any():
        return None     # out of range: TVM's converter (and its error) decides
    return C.relax.op.take(data, C.relax.const(idx.astype(indices.value.numpy().dtype)), axis)


def _symbolic_slice_bounds(F, inputs, params) -> tuple | None:
    """(axes, begins, ends) of a unit-step Slice of a tensor of known shape whose start or end is symbolic,
    each bound in [0, extent] (a negative bound counts from the end); None when the Slice has no symbolic
    bound, a step other than 1, or a bound whose sign the analyzer cannot prove."""
    data = inputs[0]
    ty = C.type_of(data)
    if not isinstance(ty, C.TensorType) or not isinstance(ty.shape, C.relax.ShapeExpr):
        return None
    dims = list(ty.shape.values)
    raw = [inputs[i] if i < len(inputs) else None for i in range(1, 5)]     # starts, ends, axes, steps
    parts = [F.get_constant(x, params) if x is not None else None for x in raw]
    lists = []
    for part in parts:
        if part is None:
            lists.append(None)
        elif isinstance(part, C.relax.ShapeExpr):
            lists.append(list(part.values))
        elif isinstance(part, C.GenericConst):
            lists.append([int(v) for v in part.value.numpy().reshape(-1)])
        else:
            return None
    starts, ends, axes, steps = lists
    if starts is None or ends is None or len(starts) != len(ends):
        return None
    if not any(not isinstance(v, (int, C.IntImm)) for v in starts + ends):
        return None
    if steps is not None and any(not isinstance(v, (int, C.IntImm)) or int(v) != 1 for v in steps):
        return None
    axes = [int(a) % len(dims) for a in (axes if axes is not None else range(len(starts)))]
    ana = C.Analyzer()
    # a symbolic dim is in [1, SYMBOLIC_DIM_MAX]: the sign of ``-sequence`` is then known, and an end of
    # INT32_MAX / INT64_MAX ("to the end") is past every extent
    for v in starts + ends + dims:
        if not isinstance(v, (int, C.IntImm)):
            C.post_order_visit(v, lambda x: ana.update(x, C.ConstIntBound(1, SYMBOLIC_DIM_MAX), True)
                               if isinstance(x, C.tirx.Var) else None)

    def bound(v, n):
        v = C.tirx.IntImm("int64", v) if isinstance(v, int) else v
        n = C.tirx.IntImm("int64", int(n)) if isinstance(n, int) else n
        if ana.can_prove(v < 0):
            v = ana.simplify(v + n)
            if not ana.can_prove(v >= 0):
                return None       # -v may exceed the extent: the clamp to 0 is not provable
        elif not ana.can_prove(v >= 0):
            return None
        return n if ana.can_prove(v >= n) else ana.simplify(v)

    begin, end = [], []
    for a, s0, e0 in zip(axes, starts, ends):
        b, e = bound(s0, dims[a]), bound(e0, dims[a])
        if b is None or e is None:
            return None
        begin.append(b)
        end.append(e)
    return axes, begin, end


def _unsupported_ops(model: onnx.ModelProto) -> dict[str, list[str]]:
    register_onnx_converters()
    supported = C.onnx_frontend()._get_convert_map()
    missing: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.op_type not in supported:
            missing.setdefault(node.op_type, []).append(node.name or f"#{list(model.graph.node).index(node)}")
    return missing


def load_onnx(path_or_model, *, keep_params_in_input: bool = False, fold_shapes: bool = True,
              shape_dict: dict[str, list[int]] | None = None, input_shapes: dict | None = None) -> C.IRModule:
    """Import an ONNX model (path, bytes or ModelProto) as a Relax IRModule.

    Weights become constants (so constant folding and batch-norm folding can work) unless
    ``keep_params_in_input``; ``input_shapes`` (input name -> shape, or symbolic dim -> size) pins shapes
    before import; run-time shape subgraphs are folded first when input shapes are then static.
    """
    model = read_model(path_or_model)
    if input_shapes:
        model = specialize_inputs(model, input_shapes)
    if fold_shapes:
        # to a fixed point: a shape computed after a Pad whose pads are themselves computed from shapes
        # (torchvision's Swin: pad to a multiple of the window, per block) only becomes static once the
        # round before has folded those pads (ONNX shape inference does not infer a Pad with run-time pads)
        model, n = fold_static_shapes_fully(model, max_rounds=None)
        if n:
            log.info("folded %d constant/shape nodes before import", n)
    model, n = tile_leading_repeats(model)
    if n:
        log.info("rewrote %d Tile(s) of a run-time leading repeat as Unsqueeze/Expand/Reshape", n)
    missing = _unsupported_ops(model)
    if missing:
        op, nodes = next(iter(missing.items()))
        raise UnsupportedOpError(op, nodes, detail=f"{len(missing)} unsupported op type(s): {sorted(missing)}")
    register_onnx_converters()
    try:
        mod = C.from_onnx(model, shape_dict=shape_dict, keep_params_in_input=keep_params_in_input,
                          converters=_converter_overrides())
    except Exception as e:  # the importer raises many kinds; name the node when we can
        msg = str(e).strip().splitlines()
        raise ModelLoadError(f"TVM's ONNX importer failed: {type(e).__name__}: {msg[-1] if msg else ''}") from None
    return mod


def onnx_io(model: onnx.ModelProto) -> tuple[list[dict], list[dict]]:
    """Input and output names, shapes and dtypes of the graph (initializers are not inputs)."""
    inits = {i.name for i in model.graph.initializer}

    def desc(vi):
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in t.shape.dim]
        dtype = str(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)) if t.elem_type else "float32"
        return {"name": vi.name, "shape": shape, "dtype": dtype}

    ins = [desc(i) for i in model.graph.input if i.name not in inits]
    outs = [desc(o) for o in model.graph.output]
    return ins, outs


def sanitize(name: str) -> str:
    """The name TVM's importer gives an input (it sanitizes names into identifiers)."""
    return re.sub(r"[^0-9a-zA-Z_]", "_", name)


# --------------------------------------------------------------------------- converters tvmfuse adds
# TVM 0.27's importer lacks ONNX Attention-23 (its "Attention" is com.microsoft's), returns constant
# placeholders for LayerNormalization's Mean/InvStdDev outputs, and its RMSNormalization fails to compile
# when the normalized axes are all axes.  These converters emit plain Relax ops (correct under any
# pipeline) in the forms tvmfuse's rules fuse: the attention chain of ``passes/attention.py`` and the
# row reductions of ``rules``.  ``register_onnx_converters`` installs them into TVM's converter map.
_REGISTERED = False


def _dims_of(expr) -> list:
    """A tensor's dims: ints where static, TIR expressions where symbolic (``batch``, ``seq``)."""
    ty = C.type_of(expr)
    if not isinstance(ty, C.TensorType) or not isinstance(ty.shape, C.relax.ShapeExpr):
        raise UnsupportedOpError("(converter)", [], detail="tvmfuse's converters need input shapes of known rank")
    return [int(d.value) if isinstance(d, C.IntImm) else d for d in ty.shape.values]


def _shape_of(expr) -> list[int]:
    ty = C.type_of(expr)
    if not isinstance(ty, C.TensorType) or not isinstance(ty.shape, C.relax.ShapeExpr) or \
            not all(isinstance(d, C.IntImm) for d in ty.shape.values):
        raise UnsupportedOpError("(converter)", [], detail="tvmfuse's converters need static input shapes")
    return [int(d.value) for d in ty.shape.values]


def _dtype_of(expr) -> str:
    return str(C.type_of(expr).dtype)


def _norm_axes(axis: int, ndim: int, op: str) -> list[int]:
    if not -ndim <= axis < ndim:
        raise ValueError(f"{op}: axis {axis} out of range for a rank-{ndim} input")
    return list(range(axis % ndim, ndim))


def _layer_norm(bb, inputs, attr):
    """Y, Mean, InvStdDev of ONNX LayerNormalization-17 (statistics in float32, stash_type 1)."""
    R = C.relax.op
    x, scale = inputs[0], inputs[1]
    bias = inputs[2] if len(inputs) > 2 else None
    dtype = _dtype_of(x)
    dims = _dims_of(x)   # batch/sequence may be symbolic; the normalized axes usually are not
    axes = _norm_axes(int(attr.get("axis", -1)), len(dims), "LayerNormalization")
    eps = C.relax.const(float(attr.get("epsilon", 1e-5)), "float32")
    xf = x if dtype == "float32" else bb.normalize(R.astype(x, "float32"))
    mean = bb.normalize(R.mean(xf, axes, keepdims=True))
    centered = bb.normalize(R.subtract(xf, mean))
    var = R.mean(R.multiply(centered, centered), axes, keepdims=True)
    inv_std = bb.normalize(R.rsqrt(R.add(var, eps)))
    norm_shape = dims[axes[0]:]
    static_norm = all(isinstance(d, int) for d in norm_shape)
    if dtype == "float32" and static_norm and _dims_of(scale) == norm_shape and \
            (bias is None or _dims_of(bias) == norm_shape):
        # Y as TVM's own layer_norm op (one legalized kernel); Mean/InvStdDev stay dead unless read
        beta = bias if bias is not None else C.relax.const(np.zeros(norm_shape, np.float32))
        y = R.nn.layer_norm(x, scale, beta, axes, float(attr.get("epsilon", 1e-5)))
    else:
        y = R.multiply(R.multiply(centered, inv_std), scale if dtype == "float32" else R.astype(scale, "float32"))
        if bias is not None:
            y = R.add(y, bias if dtype == "float32" else R.astype(bias, "float32"))
        if dtype != "float32":
            y = R.astype(y, dtype)
    return C.relax.Tuple([bb.normalize(y), mean, inv_std])


def _rms_norm(bb, inputs, attr):
    """ONNX RMSNormalization-23: x / sqrt(mean(x^2) + eps) * scale, statistics in float32."""
    R = C.relax.op
    x, scale = inputs[0], inputs[1]
    dtype = _dtype_of(x)
    axes = _norm_axes(int(attr.get("axis", -1)), len(_dims_of(x)), "RMSNormalization")
    eps = C.relax.const(float(attr.get("epsilon", 1e-5)), "float32")
    xf = x if dtype == "float32" else bb.normalize(R.astype(x, "float32"))
    ms = R.mean(R.multiply(xf, xf), axes, keepdims=True)
    y = R.multiply(R.multiply(xf, R.rsqrt(R.add(ms, eps))),
                   scale if _dtype_of(scale) == "float32" else R.astype(scale, "float32"))
    if dtype != "float32":
        y = R.astype(y, dtype)
    return bb.normalize(y)


def _heads(bb, x, heads: int, what: str):
    """[B, S, heads*h] -> [B, heads, S, h]."""
    R = C.relax.op
    b, s, hidden = _shape_of(x)
    if heads <= 0 or hidden % heads:
        raise ValueError(f"Attention: {what} hidden size {hidden} is not a multiple of {heads} heads")
    return bb.normalize(R.permute_dims(R.reshape(x, [b, s, heads, hidden // heads]), [0, 2, 1, 3]))


def _attention(bb, inputs, attr):
    """ONNX Attention-23/24: Y, present_key, present_value, qk_matmul_output (as onnx.reference computes
    them; float16 inputs are computed in float32 and rounded once at the end)."""
    R = C.relax.op
    inputs = list(inputs) + [None] * (7 - len(inputs))
    q, k, v, mask, past_k, past_v, nonpad = inputs[:7]
    if (past_k is None) != (past_v is None):
        raise ValueError("Attention: past_key and past_value must be given together")
    if nonpad is not None and past_k is not None:
        raise ValueError("Attention: nonpad_kv_seqlen cannot be combined with past_key/past_value")
    if float(attr.get("softcap", 0.0)) < 0:
        raise ValueError("Attention: softcap must be >= 0")
    dtype = _dtype_of(q)
    f32 = "float32"
    rank3 = len(_shape_of(q)) == 3
    if rank3:
        if "q_num_heads" not in attr or "kv_num_heads" not in attr:
            raise ValueError("Attention: 3-D inputs need the q_num_heads and kv_num_heads attributes")
        q = _heads(bb, q, int(attr["q_num_heads"]), "Q")
        k = _heads(bb, k, int(attr["kv_num_heads"]), "K")
        v = _heads(bb, v, int(attr["kv_num_heads"]), "V")
    past_len = 0
    if past_k is not None:
        past_len = _shape_of(past_k)[2]
        k = bb.normalize(R.concat([past_k, k], axis=2))
        v = bb.normalize(R.concat([past_v, v], axis=2))
    present_k, present_v = k, v
    if dtype != f32:
        q, k, v = (bb.normalize(R.astype(t, f32)) for t in (q, k, v))
    bq, hq, sq, d = _shape_of(q)
    hk, sk = _shape_of(k)[1], _shape_of(k)[2]
    dv = _shape_of(v)[3]
    gqa = hq != hk
    if gqa:
        # grouped-query: query head h reads key/value head h // r; as a broadcast over a [kv heads, r]
        # split of the head axis (no repeated copy of K and V; the attention kernel reads them in place)
        if hk <= 0 or hq % hk:
            raise ValueError(f"Attention: {hq} query heads are not a multiple of {hk} key/value heads")
        r = hq // hk
        q = bb.normalize(R.reshape(q, [bq, hk, r, sq, d]))
        k = bb.normalize(R.reshape(k, [bq, hk, 1, sk, d]))
        v = bb.normalize(R.reshape(v, [bq, hk, 1, sk, dv]))
    scale = attr.get("scale")
    scale = float(1.0 / np.sqrt(d)) if scale is None else float(scale)
    neg_inf, zero = C.relax.const(float("-inf"), f32), C.relax.const(0.0, f32)
    # Step 1. The bias: run-time terms (mask, key padding) summed into one tensor, compile-time terms
    # (causal, sliding window) into one constant.
    bias = None
    if mask is not None:
        mshape = _shape_of(mask)
        if _dtype_of(mask) == "bool":
            mask = R.where(mask, zero, neg_inf)
        elif _dtype_of(mask) != f32:
            mask = R.astype(mask, f32)
        if mshape[-1] < sk:
            pad = np.full(mshape[:-1] + [sk - mshape[-1]], -np.inf, np.float32)
            mask = R.concat([mask, C.relax.const(pad)], axis=-1)
        bias = bb.normalize(mask)
    ii, jj = np.arange(sq)[:, None], np.arange(sk)[None, :]
    allowed = np.ones((sq, sk), bool)
    causal = bool(int(attr.get("is_causal", 0)))
    left, right = int(attr.get("left_window_size", -1)), int(attr.get("right_window_size", -1))
    if nonpad is not None:
        # key padding: j < nonpad[b]; the causal / window frontier moves by nonpad[b] - sq per batch
        lens = bb.normalize(R.reshape(R.astype(nonpad, "int32"), [bq, 1, 1, 1]))
        j_idx = C.relax.const(np.arange(sk, dtype=np.int32).reshape(1, 1, 1, sk))
        ok = R.less(j_idx, lens)
        diff = C.relax.const((ii - jj).astype(np.int32).reshape(1, 1, sq, sk))   # i - j
        shifted = R.add(diff, R.subtract(lens, C.relax.const(sq, "int32")))    # i + offset_b - j
        if causal:
            ok = R.logical_and(ok, R.greater_equal(shifted, C.relax.const(0, "int32")))
        if left >= 0:
            ok = R.logical_and(ok, R.less_equal(shifted, C.relax.const(left, "int32")))
        if right >= 0:
            ok = R.logical_and(ok, R.less_equal(R.negative(shifted), C.relax.const(right, "int32")))
        pad = bb.normalize(R.where(ok, zero, neg_inf))
        bias = pad if bias is None else bb.normalize(R.add(bias, pad))
    else:
        diff = ii + past_len - jj
        if causal:
            allowed &= diff >= 0
        if left >= 0:
            allowed &= diff <= left
        if right >= 0:
            allowed &= -diff <= right
    const_bias = None if allowed.all() else np.where(allowed, 0.0, -np.inf).astype(np.float32)
    pure_causal = const_bias is not None and causal and left < 0 and right < 0
    if const_bias is not None and not pure_causal and bias is not None:
        bias = bb.normalize(R.add(bias, C.relax.const(const_bias)))   # one mask operand for the kernel
        const_bias = None
    if gqa and bias is not None:
        bshape = [1] * (4 - len(_shape_of(bias))) + _shape_of(bias)
        if bshape[1] not in (1, hq):
            raise ValueError(f"Attention: the mask's head axis ({bshape[1]}) is neither 1 nor {hq}")
        heads = [hk, hq // hk] if bshape[1] == hq else [1, 1]
        bias = bb.normalize(R.reshape(bias, [bshape[0]] + heads + bshape[2:]))
    # Step 2. softmax(scale * Q @ K^T [softcap] + bias) @ V, the chain tvmfuse's attention rule fuses.
    rank = len(_shape_of(k))
    kt = R.permute_dims(k, list(range(rank - 2)) + [rank - 1, rank - 2])
    scores = bb.normalize(R.multiply(R.matmul(q, kt), C.relax.const(scale, f32)))
    softcap = float(attr.get("softcap", 0.0))
    if softcap > 0:
        cap = C.relax.const(softcap, f32)
        scores = bb.normalize(R.multiply(R.tanh(R.divide(scores, cap)), cap))
    logits = scores
    if bias is not None:
        logits = bb.normalize(R.add(logits, bias))
    if const_bias is not None:
        logits = bb.normalize(R.add(logits, C.relax.const(const_bias)))
    mode = int(attr.get("qk_matmul_output_mode", 0))
    qk_out = logits if mode == 2 else scores
    probs = bb.normalize(R.nn.softmax(logits, axis=-1))
    # Step 3. A row whose bias is -inf everywhere is 0 (onnx.reference decides it on the bias).
    if bias is not None or (const_bias is not None and (~allowed).all(axis=-1).any()):
        total = bias
        if const_bias is not None:
            total = C.relax.const(const_bias) if total is None else R.add(total, C.relax.const(const_bias))
        # (a count of allowed keys: TVM's max starts at the lowest finite float, never -inf)
        n_allowed = R.sum(R.astype(R.not_equal(total, neg_inf), "int32"), axis=[-1], keepdims=True)
        guard = bb.normalize(R.equal(n_allowed, C.relax.const(0, "int32")))
        probs = bb.normalize(R.where(guard, zero, probs))
    if mode == 3:
        qk_out = probs
    y = bb.normalize(R.matmul(probs, v))
    if gqa:
        y = bb.normalize(R.reshape(y, [bq, hq, sq, dv]))
        qk_out = R.reshape(qk_out, [bq, hq, sq, sk])
    if rank3:
        y = bb.normalize(R.reshape(R.permute_dims(y, [0, 2, 1, 3]), [bq, sq, hq * dv]))
    if dtype != f32:
        y, qk_out = bb.normalize(R.astype(y, dtype)), bb.normalize(R.astype(qk_out, dtype))
    return C.relax.Tuple([y, present_k, present_v, qk_out])


def register_onnx_converters() -> None:
    """Install tvmfuse's converters into TVM's ONNX converter map (idempotent).

    ``load_onnx`` calls this; so does ``tvmfuse.conformance`` (the suite calls TVM's importer itself).
    """
    global _REGISTERED
    if _REGISTERED:
        return
    fe = C.onnx_frontend()
    base_attention = fe._get_convert_map()["Attention"]   # com.microsoft Attention (opset-free, v1)

    class Attention(base_attention):
        @classmethod
        def _impl_v23(cls, bb, inputs, attr, params):
            if "num_heads" in attr:     # com.microsoft's Attention (its required attribute)
                return base_attention._impl_v1(bb, inputs, attr, params)
            return _attention(bb, inputs, attr)

        _impl_v24 = _impl_v23     # + nonpad_kv_seqlen
        _impl_v25 = _impl_v23     # + left/right_window_size

    class LayerNormalization(fe.OnnxOpConverter):
        @classmethod
        def _impl_v17(cls, bb, inputs, attr, params):
            return _layer_norm(bb, inputs, attr)

    class RMSNormalization(fe.OnnxOpConverter):
        @classmethod
        def _impl_v23(cls, bb, inputs, attr, params):
            return _rms_norm(bb, inputs, attr)

    ours = {"Attention": Attention, "LayerNormalization": LayerNormalization,
            "RMSNormalization": RMSNormalization}
    original = fe._get_convert_map

    def _get_convert_map():
        table = original()
        table.update(ours)
        return table

    fe._get_convert_map = _get_convert_map
    _REGISTERED = True
