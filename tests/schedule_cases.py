"""Small ONNX graphs of the layouts real exports produce (matmuls over 3-D activations, batched and
transposed matmuls, pooling, reductions over any axis, layout ops, convs of every kind), and helpers that
look at scheduled TIR: the kernels tvmfuse's graph stage makes, lowering up to vectorization, unrolled
extents.  Shared by test_schedules_cpu_matmul_general.py, test_schedules_cpu_generic.py and
test_schedules_cpu_conv_general.py."""
import random

import numpy as np
import onnx
from onnx import TensorProto, helper

import tvmfuse
from tvmfuse import _compat as C
from tvmfuse.models import OPSET, _G
from tvmfuse.pipeline import PipelineOptions, graph_stage
from tvmfuse.schedules.base import schedule_with

# named targets of the structural tests: AVX2 (8 float lanes) and AVX-512 (16), 2 cores
# (`llvm -mtriple=x86_64-linux-gnu -mcpu=haswell -num-cores=2` in TVM 0.27's JSON form)
HASWELL = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "haswell", "num-cores": 2}'
SKYLAKE = '{"kind": "llvm", "mtriple": "x86_64-linux-gnu", "mcpu": "skylake-avx512", "num-cores": 2}'
NAMED_TARGETS = (HASWELL, SKYLAKE)


def finish(g: _G, out: str = "out") -> onnx.ModelProto:
    """Make the last node's output the graph output ``out``, its shape and type from shape inference."""
    node = g.nodes[-1]
    node.output[0] = out
    graph = helper.make_graph(g.nodes, g.name, g.inputs,
                              [helper.make_tensor_value_info(out, TensorProto.UNDEFINED, None)], g.inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    m.ir_version = 8
    inferred = onnx.shape_inference.infer_shapes(m)
    vi = [v for v in list(inferred.graph.value_info) + list(inferred.graph.output) if v.name == out][-1]
    t = vi.type.tensor_type
    g.output(out, [d.dim_value for d in t.shape.dim], t.elem_type)
    return g.model()


def _ints(*v):
    return np.array(v, np.int64)


# ----------------------------------------------------------------------------- matmul family
def matmul_3d(b=2, s=37, k=45, n=67, act="Relu"):
    """[B, S, K] @ a shared weight [K, N] + bias, activation: every exported transformer's projection."""
    g = _G("matmul_3d")
    y = g.op("Add", g.op("MatMul", g.input("x", [b, s, k]), g.weight([k, n])), g.weight([n]))
    if act:
        y = g.op(act, y)
    return finish(g)


def batched_matmul(b=3, m=17, k=19, n=23, scale=0.125):
    """A[b] @ B[b] (attention context), scaled."""
    g = _G("batched_matmul")
    y = g.op("MatMul", g.input("a", [b, m, k]), g.input("b", [b, k, n]))
    g.op("Mul", y, g.const(np.float32(scale)))
    return finish(g)


def broadcast_matmul(b=2, h=3, m=17, k=19, n=23):
    """[B, H, M, K] @ [1, H, K, N]: a batch dim broadcast on the second operand."""
    g = _G("broadcast_matmul")
    g.op("MatMul", g.input("a", [b, h, m, k]), g.input("b", [1, h, k, n]))
    return finish(g)


def scores_matmul(h=3, s=21, d=16):
    """Q @ K^T (attention scores): K transposed by a Transpose node, then scaled."""
    g = _G("scores")
    kt = g.op("Transpose", g.input("k", [h, s, d]), perm=[0, 2, 1])
    g.op("Mul", g.op("MatMul", g.input("q", [h, s, d]), kt), g.const(np.float32(0.25)))
    return finish(g)


def gemm_transb(m=33, k=41, n=29, alpha=0.5, beta=2.0):
    """ONNX Gemm with transB=1, alpha and beta (a Linear layer export)."""
    g = _G("gemm")
    g.op("Gemm", g.input("x", [m, k]), g.weight([n, k]), g.weight([n]), transB=1, alpha=alpha, beta=beta)
    return finish(g)


def gemv(k=100, n=77):
    """M = 1 (a classifier head on one pooled vector)."""
    g = _G("gemv")
    g.op("Add", g.op("MatMul", g.input("x", [1, k]), g.weight([k, n])), g.weight([n]))
    return finish(g)


def qkv_3d(b=2, s=19, h=40):
    """Q/K/V projections of one [B, S, H] input (three outputs)."""
    g = _G("qkv_3d")
    x = g.input("x", [b, s, h])
    for name in "qkv":
        g.op("Add", g.op("MatMul", x, g.weight([h, h])), g.weight([h]))
        g.rename_last(name, [b, s, h])
    return g.model()


def swiglu_3d(b=2, s=13, h=24, f=37):
    """silu(x @ Wg) * (x @ Wu) over [B, S, H] activations."""
    g = _G("swiglu_3d")
    x = g.input("x", [b, s, h])
    gate = g.op("MatMul", x, g.weight([h, f]))
    up = g.op("MatMul", x, g.weight([h, f]))
    g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    return finish(g)


def vit_block(s=50, d=96, h=3, f=192):
    """A ViT encoder block over [1, S, D] activations: LayerNorm, Q/K/V, scores Q @ K^T per head, softmax,
    context, projection + residual, LayerNorm, MLP with a sigmoid-GELU, residual."""
    g = _G("vit_block")
    x = g.input("x", [1, s, d])
    dh = d // h

    def layernorm(t):
        c = g.op("Sub", t, g.op("ReduceMean", t, g.const(_ints(-1)), keepdims=1))
        v = g.op("ReduceMean", g.op("Mul", c, c), g.const(_ints(-1)), keepdims=1)
        y = g.op("Div", c, g.op("Sqrt", g.op("Add", v, g.const(np.float32(1e-6)))))
        return g.op("Add", g.op("Mul", y, g.weight([d])), g.weight([d]))

    def heads(t):
        return g.op("Transpose", g.op("Reshape", t, g.const(_ints(1, s, h, dh))), perm=[0, 2, 1, 3])

    y = layernorm(x)
    q, k, v = [heads(g.op("Add", g.op("MatMul", y, g.weight([d, d])), g.weight([d]))) for _ in range(3)]
    scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 1, 3, 2])), g.const(np.float32(dh ** -0.5)))
    ctx = g.op("MatMul", g.op("Softmax", scores, axis=-1), v)
    ctx = g.op("Reshape", g.op("Transpose", ctx, perm=[0, 2, 1, 3]), g.const(_ints(1, s, d)))
    x2 = g.op("Add", x, g.op("Add", g.op("MatMul", ctx, g.weight([d, d])), g.weight([d])))
    hid = g.op("Add", g.op("MatMul", layernorm(x2), g.weight([d, f])), g.weight([f]))
    hid = g.op("Mul", hid, g.op("Sigmoid", g.op("Mul", hid, g.const(np.float32(1.702)))))
    g.op("Add", x2, g.op("Add", g.op("MatMul", hid, g.weight([f, d])), g.weight([d])))
    return finish(g)


# ----------------------------------------------------------------------------- generic family
def symbolic_dims(model: onnx.ModelProto, names=("batch", "sequence")) -> onnx.ModelProto:
    """``model`` with the leading dims of its inputs and outputs made symbolic (``names``, in order)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for vi in list(out.graph.input) + list(out.graph.output):
        for d, name in zip(vi.type.tensor_type.shape.dim, names):
            d.Clear()
            d.dim_param = name
    return out


def rmsnorm_matmul_symbolic_k(n=16):
    """y = rmsnorm(x) @ w with x [rows, k], w [k, n]: the normalised rows' length k is symbolic (w is an
    input: a constant weight would fix k); the norm_prologue rule must not fire (test_norm_prologue,
    test_symbolic_norm_prologue)."""
    g = _G("rmsnorm_matmul_symbolic_k")
    x = g.input("x", ("rows", "k"))
    w = g.input("w", ("k", n))
    ms = g.op("ReduceMean", g.op("Mul", x, x), g.const(np.array([-1], np.int64)), keepdims=1)
    h = g.op("Div", x, g.op("Sqrt", g.op("Add", ms, g.const(np.float32(1e-6)))))
    g.op("MatMul", h, w)
    g.rename_last("y", ("rows", n))
    return g.model()


def maxpool(c=5, h=17, w=19, k=3, s=2):
    g = _G("maxpool")
    g.op("MaxPool", g.input("x", [1, c, h, w]), kernel_shape=[k, k], strides=[s, s], pads=[1, 1, 1, 1])
    return finish(g)


def avgpool(c=5, h=17, w=19):
    g = _G("avgpool")
    g.op("AveragePool", g.input("x", [1, c, h, w]), kernel_shape=[3, 3], strides=[2, 2], pads=[1, 1, 1, 1],
         count_include_pad=0)
    return finish(g)


def global_avgpool(n=2, c=37, h=7, w=7):
    g = _G("gap")
    g.op("GlobalAveragePool", g.input("x", [n, c, h, w]))
    return finish(g)


def channel_layernorm(c=24, h=9, w=11):
    """LayerNorm over the channels of NCHW (ConvNeXt), decomposed as exported."""
    g = _G("channel_ln")
    x = g.input("x", [1, c, h, w])
    d = g.op("Sub", x, g.op("ReduceMean", x, g.const(_ints(1)), keepdims=1))
    v = g.op("ReduceMean", g.op("Mul", d, d), g.const(_ints(1)), keepdims=1)
    y = g.op("Div", d, g.op("Sqrt", g.op("Add", v, g.const(np.float32(1e-6)))))
    g.op("Mul", y, g.weight([1, c, 1, 1]))
    return finish(g)


def transposed_layernorm(c=16, size=16):
    """ConvNeXt's stem norm: NCHW -> NHWC, LayerNorm over the channels, back to NCHW; with c == h == w the
    output's leading loops (n, c, h) have the extents of the rows (n, h, w) but are not them."""
    g = _G("transposed_ln")
    t = g.op("Transpose", g.input("x", [1, c, size, size]), perm=[0, 2, 3, 1])
    ln = g.op("LayerNormalization", t, g.weight([c]), g.weight([c]), axis=-1, epsilon=1e-6)
    g.op("Transpose", ln, perm=[0, 3, 1, 2])
    return finish(g)


def pooled_layernorm_flatten(c=128):
    """ConvNeXt's head: LayerNorm of the pooled [1, 1, 1, c] features, to NCHW and flattened: one row,
    no output loop enumerates it."""
    g = _G("pooled_ln_flatten")
    ln = g.op("LayerNormalization", g.input("x", [1, 1, 1, c]), g.weight([c]), g.weight([c]), axis=-1,
              epsilon=1e-6)
    g.op("Reshape", g.op("Transpose", ln, perm=[0, 3, 1, 2]), g.const(_ints(1, c)))
    return finish(g)


def residual_layernorm(rows=32, d=64):
    """GPT-2's block input: the residual sum is an output (the next residual) and the LayerNorm's input;
    the norm's output reshaped (the kernel's two outputs: one the reductions read, one reading them)."""
    g = _G("residual_ln")
    a = g.op("Add", g.input("x", [1, rows, d]), g.input("r", [1, rows, d]))
    ln = g.op("LayerNormalization", a, g.weight([d]), g.weight([d]), axis=-1, epsilon=1e-5)
    y = g.op("Reshape", ln, g.const(_ints(rows, d)))
    g.output(a, [1, rows, d])
    g.output(y, [rows, d])
    return g.model()


def mean_hw(n=2, c=13, h=10, w=12):
    g = _G("mean_hw")
    g.op("ReduceMean", g.input("x", [n, c, h, w]), g.const(_ints(2, 3)), keepdims=0)
    return finish(g)


def embedding(vocab=50, d=33, s=7):
    g = _G("embedding")
    g.op("Gather", g.weight([vocab, d]), g.input("ids", [2, s], TensorProto.INT64), axis=0)
    return finish(g)


def layout_ops(n=2, c=6, h=5, w=7):
    """transpose, concat, slice, where, cast, reduce-max, expand, add."""
    g = _G("layout_ops")
    t = g.op("Transpose", g.input("x", [n, c, h, w]), perm=[0, 2, 3, 1])
    cc = g.op("Concat", t, g.op("Transpose", g.input("y", [n, c, h, w]), perm=[0, 2, 3, 1]), axis=3)
    sl = g.op("Slice", cc, g.const(_ints(1)), g.const(_ints(5)), g.const(_ints(3)))
    cast = g.op("Cast", g.op("Cast", sl, to=TensorProto.INT32), to=TensorProto.FLOAT)
    wh = g.op("Where", g.op("Greater", sl, g.const(np.float32(0))), sl, cast)
    ex = g.op("Expand", g.op("ReduceMax", wh, g.const(_ints(3)), keepdims=1), g.const(_ints(n, h, w, 4)))
    g.op("Add", wh, ex)
    return finish(g)


def resize(c=3, h=7, w=9):
    g = _G("resize")
    g.op("Resize", g.input("x", [1, c, h, w]), "", g.const(np.array([1, 1, 2, 2], np.float32)), mode="linear")
    return finish(g)


def softmax_channels(n=2, c=19, h=6, w=8):
    g = _G("softmax_channels")
    g.op("Softmax", g.input("x", [n, c, h, w]), axis=1)
    return finish(g)


# ----------------------------------------------------------------------------- conv family
def conv(cin=8, cout=16, h=15, w=17, k=3, s=1, pads=None, dil=1, group=1, act="Relu", bias=True):
    g = _G("conv")
    pads = list(pads) if pads is not None else [k // 2 * dil] * 4
    ins = [g.input("x", [1, cin, h, w]), g.weight([cout, cin // group, k, k])] + ([g.weight([cout])] if bias else [])
    y = g.op("Conv", *ins, kernel_shape=[k, k], strides=[s, s], pads=pads, dilations=[dil, dil], group=group)
    if act:
        g.op(act, y)
    return finish(g)


def conv_relu_weights_input(cin: int, cout: int, hw: int, k: int) -> onnx.ModelProto:
    """Conv (k x k, same padding, no bias) + Relu on [1, cin, hw, hw] whose weights ``w`` [cout, cin, k, k] are
    a graph input, not a constant (so no pass rewrites their layout); opset 18."""
    p = k // 2
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[k, k], pads=[p] * 4),
             helper.make_node("Relu", ["c"], ["y"])]
    g = helper.make_graph(nodes, "conv_w_input",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, cin, hw, hw]),
                           helper.make_tensor_value_info("w", TensorProto.FLOAT, [cout, cin, k, k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, cout, hw, hw])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    return model


def conv_with_shortcut_conv(cin=8, cout=16, h=14, w=14):
    """A downsampling block's 3x3 stride-2 conv plus its 1x1 stride-2 shortcut conv, added, ReLU."""
    g = _G("shortcut")
    x = g.input("x", [1, cin, h, w])
    a = g.op("Conv", x, g.weight([cout, cin, 3, 3]), g.weight([cout]), kernel_shape=[3, 3], strides=[2, 2],
             pads=[1, 1, 1, 1])
    b = g.op("Conv", x, g.weight([cout, cin, 1, 1]), g.weight([cout]), kernel_shape=[1, 1], strides=[2, 2])
    g.op("Relu", g.op("Add", a, b))
    return finish(g)


# ----------------------------------------------------------------------------- TIR helpers
def graph_funcs(model, target) -> dict:
    """The fused PrimFuncs tvmfuse's graph stage (default fusion) makes of ``model`` for ``target``."""
    target = tvmfuse.parse_target(target) if isinstance(target, str) else target
    mod = tvmfuse.load_onnx(model)
    with target:
        mod = C.Sequential(graph_stage(target, PipelineOptions()))(mod)
    return {str(gv.name_hint): f for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}


def lowered_vectorized(func):
    """``func`` lowered through TVM's vectorizer (the form LLVM receives, before unrolling): a vectorized
    loop TVM had to scalarize shows up as a serial loop whose variable ends in ``_s``."""
    st, tx = C.s_tir.transform, C.tirx.transform
    mod = C.IRModule({"main": func})
    return C.Sequential([st.LowerInitBlock(), st.PlanAndUpdateBufferAllocationLocation(),
                         st.ConvertBlocksToOpaque(), st.CompactBufferAllocation(), st.LowerMatchBuffer(),
                         st.LowerOpaqueBlock(), tx.FlattenBuffer(), tx.VectorizeLoop(True)])(mod)["main"]


def store_lanes(func, target) -> dict[str, set[int]]:
    """{buffer name: set of lanes of its stores} after TVM's CPU lowering up to and including VectorizeLoop
    (loops canonicalized, simplified, indices narrowed to 32 bits as the build does)."""
    st, tx = C.s_tir.transform, C.tirx.transform
    mod = C.IRModule({"main": func.with_attr("global_symbol", "main").with_attr("target", target)})
    passes = [st.CanonicalizeLoop(), st.LowerInitBlock(), st.PlanAndUpdateBufferAllocationLocation(),
              st.ConvertBlocksToOpaque(), st.CompactBufferAllocation(), st.LowerMatchBuffer(), st.StmtSimplify(),
              st.LowerOpaqueBlock(), tx.FlattenBuffer(), tx.NarrowDataType(32), tx.VectorizeLoop(True)]
    with target:
        mod = C.Sequential(passes)(mod)
    lanes = {}
    C.post_order_visit(mod["main"].body, lambda s: lanes.setdefault(str(s.buffer.name), set()).add(
        int(s.value.ty.dtype.lanes)) if isinstance(s, C.BufferStore) else None)
    return lanes


def compacted(func):
    """``func`` with its blocks lowered and its intermediate buffers compacted to the region each loop nest
    uses (the allocation sizes the structural tests of fused kernels check)."""
    st = C.s_tir.transform
    mod = C.IRModule({"main": func})
    return C.Sequential([st.LowerInitBlock(), st.PlanAndUpdateBufferAllocationLocation(),
                         st.ConvertBlocksToOpaque(), st.CompactBufferAllocation()])(mod)["main"]


def numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def nodes(func) -> list:
    out = []
    C.post_order_visit(func.body, out.append)
    return out


def loops(func) -> list:
    return [n for n in nodes(func) if isinstance(n, C.tirx.For)]


def scalarized_loops(func) -> list[str]:
    """Loops TVM's vectorizer turned into scalar code (a predicated or unvectorizable body)."""
    return [str(f.loop_var.name) for f in loops(lowered_vectorized(func)) if str(f.loop_var.name).endswith("_s")]


def is_vector(expr) -> bool:
    return not expr.ty.is_scalar()         # e.g. float32x16


def kinds(func) -> set[int]:
    return {int(f.kind) for f in loops(func)}


def max_unrolled_copies(func) -> int:
    """Largest product of the extents of nested unrolled loops (copies of a body after unrolling)."""
    best = 1

    def walk(stmt, copies):
        nonlocal best
        if isinstance(stmt, C.tirx.For):
            if int(stmt.kind) == int(C.ForKind.UNROLLED):
                copies *= int(stmt.extent)
                best = max(best, copies)
        for attr in ("body", "then_case", "else_case", "block", "init"):
            child = getattr(stmt, attr, None)
            if child is not None and not isinstance(child, (str, int)) and hasattr(child, "same_as") \
                    and not hasattr(child, "ty"):
                walk(child, copies)
        for child in getattr(stmt, "seq", ()) or ():
            walk(child, copies)

    walk(func.body, 1)
    return best


def random_args(func, rng, n_out: int = 1) -> list:
    args = []
    for p in func.params[:len(func.params) - n_out]:
        shape, dtype = [int(d) for d in p.shape], str(p.dtype)
        if "float" in dtype:
            args.append(rng.standard_normal(shape).astype(dtype))
        else:
            args.append(rng.integers(0, 5, shape).astype(dtype))
    return args


def run_func(func, target, args, n_out: int = 1) -> list:
    lib = C.build_prim_module(C.IRModule({"main": func.with_attr("global_symbol", "main")}), target)
    outs = [C.tensor(np.zeros([int(d) for d in p.shape], str(p.dtype))) for p in func.params[-n_out:]]
    lib["main"](*[C.tensor(a) for a in args], *outs)
    return [o.numpy() for o in outs]


def vector_lanes(func) -> set[int]:
    """The extents of ``func``'s vectorized loops."""
    return {int(f.extent) for f in loops(func) if int(f.kind) == int(C.ForKind.VECTORIZED)}


# Sampled configs come from a fixed seed (inputs stay fresh): every run checks the same points of a space, so a
# CI run cannot fail on a point no earlier run tried (session 6's CI did). Wider exploration of the spaces is
# benchmarks/space_fuzz.py's job, whose failures become fixed-config regression tests.
CONFIG_SEED = 0


def assert_sampled_configs_compute_the_unscheduled(t, match, func, target, rng, samples: int = 3) -> None:
    """Template ``t``'s default and ``samples`` sampled configs (each in its space) compute what the
    unscheduled ``func`` computes, on fresh random inputs."""
    space = t.space(match, target)
    sampler = random.Random(CONFIG_SEED)
    configs = [t.default_config(match, target)] + [space.sample(sampler) for _ in range(samples)]
    args = random_args(func, rng)
    want = run_func(func, target, args)[0]
    for cfg in configs:
        assert space.contains(cfg), cfg
        got = run_func(schedule_with(t, match, func, cfg), target, args)[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(cfg))


def stmts_with_loops(body):
    """Every statement of a TIR ``body`` with the loops around it (outermost first), depth first."""
    out = []

    def walk(s, loops):
        if isinstance(s, C.tirx.For):
            loops = loops + [s]
        out.append((s, loops))
        for attr in ("body", "then_case", "else_case", "block"):
            child = getattr(s, attr, None)
            if child is not None and hasattr(child, "same_as") and not hasattr(child, "ty"):
                walk(child, loops)
        for child in getattr(s, "seq", ()) or ():
            walk(child, loops)

    walk(body, [])
    return out
