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
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "validation failed"
        raise ModelLoadError(f"malformed ONNX model: {first}") from None
    return model


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
    register_onnx_converters()
    supported = C.onnx_frontend_module()._get_convert_map()
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
    register_onnx_converters()
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


# --------------------------------------------------------------------------- converters tvmfuse adds
# TVM 0.27's importer lacks ONNX Attention-23 (its "Attention" is com.microsoft's), returns constant
# placeholders for LayerNormalization's Mean/InvStdDev outputs, and its RMSNormalization fails to compile
# when the normalized axes are all axes.  These converters emit plain Relax ops (correct under any
# pipeline) in the forms tvmfuse's rules fuse: the attention chain of ``passes/attention.py`` and the
# row reductions of ``rules``.  ``register_onnx_converters`` installs them into TVM's converter map.
_REGISTERED = False


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
    axes = _norm_axes(int(attr.get("axis", -1)), len(_shape_of(x)), "LayerNormalization")
    eps = C.relax.const(float(attr.get("epsilon", 1e-5)), "float32")
    xf = x if dtype == "float32" else bb.normalize(R.astype(x, "float32"))
    mean = bb.normalize(R.mean(xf, axes, keepdims=True))
    centered = bb.normalize(R.subtract(xf, mean))
    var = R.mean(R.multiply(centered, centered), axes, keepdims=True)
    inv_std = bb.normalize(R.rsqrt(R.add(var, eps)))
    norm_shape = _shape_of(x)[axes[0]:]
    if dtype == "float32" and _shape_of(scale) == norm_shape and (bias is None or _shape_of(bias) == norm_shape):
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
    axes = _norm_axes(int(attr.get("axis", -1)), len(_shape_of(x)), "RMSNormalization")
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
    fe = C.onnx_frontend_module()
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
