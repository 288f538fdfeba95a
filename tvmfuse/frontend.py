"""ONNX in: validate, fold run-time shape computations when input shapes are static, import to Relax."""
from __future__ import annotations

import logging
import os
import re

import numpy as np
import onnx
from onnx import numpy_helper, shape_inference

from . import _compat as C
from .errors import ModelLoadError, UnsupportedOpError

log = logging.getLogger("tvmfuse.frontend")

# Ops never folded at compile time: random, or with side effects.
_NEVER_FOLD = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
               "Bernoulli", "If", "Loop", "Scan"}
# A folded tensor larger than this many elements stays a computation (ConstantOfShape of an activation
# size would otherwise bloat the model with a constant).
MAX_FOLDED_ELEMENTS = 1 << 20


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


def _static_shape(vi) -> tuple[int, ...] | None:
    t = vi.type.tensor_type
    if not t.HasField("shape"):
        return None
    dims = []
    for d in t.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(d.dim_value)
    return tuple(dims)


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


def fold_static_shapes(model: onnx.ModelProto) -> tuple[onnx.ModelProto, int]:
    """Fold Shape nodes of statically shaped tensors and every node whose inputs are then all constants.

    PyTorch exports compute reshape targets at run time (Shape -> Gather -> Div -> Concat -> Reshape);
    TVM's importer fails on some of these chains. With static input shapes they are constants.
    Returns the new model and the number of folded nodes.
    """
    graph = model.graph
    if any(_static_shape(i) is None for i in graph.input):
        return model, 0
    try:
        inferred = shape_inference.infer_shapes(model)
    except Exception as e:  # shape inference can fail on custom domains; fold nothing then
        log.debug("shape inference failed, not folding: %s", e)
        return model, 0
    shapes = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.input) + list(inferred.graph.output):
        s = _static_shape(vi)
        if s is not None:
            shapes[vi.name] = s
    consts = {init.name: numpy_helper.to_array(init) for init in graph.initializer}
    opsets = list(model.opset_import)
    kept, folded = [], 0
    new_inits = []
    for node in graph.node:
        if node.domain not in ("", "ai.onnx") or node.op_type in _NEVER_FOLD:
            kept.append(node)
            continue
        vals = None
        if node.op_type == "Shape" and node.input[0] in shapes and node.input[0] not in consts:
            vals = _eval_node(node, {node.input[0]: np.zeros(shapes[node.input[0]], np.float32)}, opsets)
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
    used = {i for n in kept for i in n.input} | {o.name for o in graph.output}
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


def _unsupported_ops(model: onnx.ModelProto) -> dict[str, list[str]]:
    supported = C.onnx_convert_map()
    missing: dict[str, list[str]] = {}
    for node in model.graph.node:
        if node.op_type not in supported:
            missing.setdefault(node.op_type, []).append(node.name or f"#{list(model.graph.node).index(node)}")
    return missing


def load_onnx(path_or_model, *, keep_params_in_input: bool = False, fold_shapes: bool = True,
              shape_dict: dict[str, list[int]] | None = None) -> C.IRModule:
    """Import an ONNX model (path, bytes or ModelProto) as a Relax IRModule.

    Weights become constants (so constant folding and batch-norm folding can work) unless
    ``keep_params_in_input``; run-time shape subgraphs are folded first when input shapes are static.
    """
    model = read_model(path_or_model)
    if fold_shapes:
        model, n = fold_static_shapes(model)
        if n:
            log.info("folded %d constant/shape nodes before import", n)
    missing = _unsupported_ops(model)
    if missing:
        op, nodes = next(iter(missing.items()))
        raise UnsupportedOpError(op, nodes, detail=f"{len(missing)} unsupported op type(s): {sorted(missing)}")
    try:
        mod = C.from_onnx(model, shape_dict=shape_dict, keep_params_in_input=keep_params_in_input)
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
