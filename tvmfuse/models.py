"""Built-in example ONNX models, made in code (no file needed): the demo models and one small graph
per fusion pattern of the seed.  Each builder takes sizes and a seed and returns an onnx.ModelProto."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 18


class _G:
    """A tiny graph builder: nodes, constant weights, inputs and outputs."""

    def __init__(self, name: str, seed: int = 0):
        self.name, self.nodes, self.inits, self.inputs, self.outputs = name, [], [], [], []
        self.rng = np.random.default_rng(seed)
        self._n = 0

    def input(self, name, shape, dtype=TensorProto.FLOAT):
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def const(self, value, name=None) -> str:
        name = name or f"c{len(self.inits)}"
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, shape, scale=None, name=None) -> str:
        scale = scale if scale is not None else 1.0 / np.sqrt(max(1, int(np.prod(shape[1:])) if len(shape) > 1
                                                                else shape[0]))
        return self.const((self.rng.standard_normal(shape) * scale).astype(np.float32), name)

    def op(self, op_type, *inputs, n_out=1, **attrs):
        self._n += 1
        outs = [f"{op_type.lower()}_{self._n}" + (f"_{i}" if n_out > 1 else "") for i in range(n_out)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=f"{op_type}_{self._n}", **attrs))
        return outs[0] if n_out == 1 else outs

    def output(self, name, shape=None, dtype=TensorProto.FLOAT):
        self.outputs.append(helper.make_tensor_value_info(name, dtype, list(shape) if shape else None))

    def model(self) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="tvmfuse")
        m.ir_version = 8
        onnx.checker.check_model(m)
        return m

    def rename_last(self, out_name: str, shape=None) -> str:
        """Make the last node's output a graph output named ``out_name``."""
        node = self.nodes[-1]
        old = node.output[0]
        node.output[0] = out_name
        for n in self.nodes:
            for i, x in enumerate(n.input):
                if x == old:
                    n.input[i] = out_name
        self.output(out_name, shape)
        return out_name


# --------------------------------------------------------------------------- building blocks
def _gelu_erf(g: _G, x: str) -> str:
    s = g.op("Div", x, g.const(np.float32(np.sqrt(2.0))))
    e = g.op("Erf", s)
    a = g.op("Add", e, g.const(np.float32(1.0)))
    m = g.op("Mul", x, a)
    return g.op("Mul", m, g.const(np.float32(0.5)))


def _gelu_tanh(g: _G, x: str) -> str:
    x3 = g.op("Mul", g.op("Mul", x, x), x)
    inner = g.op("Mul", g.op("Add", x, g.op("Mul", x3, g.const(np.float32(0.044715)))),
                 g.const(np.float32(np.sqrt(2.0 / np.pi))))
    t = g.op("Tanh", inner)
    return g.op("Mul", g.op("Mul", x, g.op("Add", t, g.const(np.float32(1.0)))), g.const(np.float32(0.5)))


def _layernorm_decomposed(g: _G, x: str, d: int) -> str:
    mean = g.op("ReduceMean", x, g.const(np.array([-1], np.int64)), keepdims=1)
    xc = g.op("Sub", x, mean)
    var = g.op("ReduceMean", g.op("Mul", xc, xc), g.const(np.array([-1], np.int64)), keepdims=1)
    inv = g.op("Sqrt", g.op("Add", var, g.const(np.float32(1e-5))))
    y = g.op("Div", xc, inv)
    y = g.op("Mul", y, g.const(np.ones(d, np.float32) + g.rng.standard_normal(d).astype(np.float32) * 0.1))
    return g.op("Add", y, g.const(g.rng.standard_normal(d).astype(np.float32) * 0.1))


def _softmax_decomposed(g: _G, x: str) -> str:
    mx = g.op("ReduceMax", x, g.const(np.array([-1], np.int64)), keepdims=1)
    e = g.op("Exp", g.op("Sub", x, mx))
    s = g.op("ReduceSum", e, g.const(np.array([-1], np.int64)), keepdims=1)
    return g.op("Div", e, s)


def _matmul_bias(g: _G, x: str, k: int, n: int) -> str:
    return g.op("Add", g.op("MatMul", x, g.weight((k, n))), g.weight((n,), 0.1))


# --------------------------------------------------------------------------- demo models
def transformer_block(seq: int | str = 64, hidden: int = 128, heads: int = 4, ffn: int = 512, seed: int = 0):
    """A pre-norm transformer encoder block: LayerNorm, Q/K/V, attention softmax, MatMul+Bias+GELU.

    ``seq`` may be a name (``"sequence"``): a symbolic dim; the reshapes then copy it (ONNX Reshape 0)."""
    g = _G("transformer_block", seed)
    x = g.input("x", (seq, hidden))
    dh = hidden // heads
    rows = 0 if isinstance(seq, str) else seq
    h = g.op("LayerNormalization", x, g.const(np.ones(hidden, np.float32)), g.const(np.zeros(hidden, np.float32)),
             axis=-1, epsilon=1e-5)

    def heads_of(t):  # [seq, hidden] -> [heads, seq, dh]
        r = g.op("Reshape", t, g.const(np.array([rows, heads, dh], np.int64)))
        return g.op("Transpose", r, perm=[1, 0, 2])

    q = heads_of(_matmul_bias(g, h, hidden, hidden))
    k = heads_of(_matmul_bias(g, h, hidden, hidden))
    v = heads_of(_matmul_bias(g, h, hidden, hidden))
    scores = g.op("Mul", g.op("MatMul", q, g.op("Transpose", k, perm=[0, 2, 1])),
                  g.const(np.float32(1.0 / np.sqrt(dh))))
    p = g.op("Softmax", scores, axis=-1)
    ctx = g.op("Transpose", g.op("MatMul", p, v), perm=[1, 0, 2])
    ctx = g.op("Reshape", ctx, g.const(np.array([rows, hidden], np.int64)))
    x1 = g.op("Add", x, _matmul_bias(g, ctx, hidden, hidden))
    h2 = _layernorm_decomposed(g, x1, hidden)
    f = _gelu_erf(g, _matmul_bias(g, h2, hidden, ffn))
    g.op("Add", x1, _matmul_bias(g, f, ffn, hidden))
    g.rename_last("y", (seq, hidden))
    return g.model()


def _conv_bn(g: _G, x: str, cin: int, cout: int, k: int = 3, group: int = 1) -> str:
    w = g.weight((cout, cin // group, k, k))
    c = g.op("Conv", x, w, kernel_shape=[k, k], pads=[k // 2] * 4, group=group)
    return g.op("BatchNormalization", c, g.const(1 + 0.1 * g.rng.standard_normal(cout).astype(np.float32)),
                g.const(0.1 * g.rng.standard_normal(cout).astype(np.float32)),
                g.const(0.1 * g.rng.standard_normal(cout).astype(np.float32)),
                g.const(1 + 0.1 * np.abs(g.rng.standard_normal(cout)).astype(np.float32)), epsilon=1e-5)


def resnet_block(channels: int = 32, size: int = 28, batch: int | str = 1, seed: int = 0):
    """A ResNet basic block: Conv+BN+ReLU, Conv+BN, residual Add, ReLU (``batch`` may be a symbolic name)."""
    g = _G("resnet_block", seed)
    x = g.input("x", (batch, channels, size, size))
    h = g.op("Relu", _conv_bn(g, x, channels, channels))
    h = _conv_bn(g, h, channels, channels)
    g.op("Relu", g.op("Add", h, x))
    g.rename_last("y", (batch, channels, size, size))
    return g.model()


DEMO_MODELS = {"transformer_block": transformer_block, "resnet_block": resnet_block}


# --------------------------------------------------------------------------- one graph per fusion pattern
def elementwise_chain(n: int = 4096, seed: int = 0):
    """sigmoid((a + b) * c)."""
    g = _G("elementwise_chain", seed)
    a, b, c = g.input("a", (n,)), g.input("b", (n,)), g.input("c", (n,))
    g.op("Sigmoid", g.op("Mul", g.op("Add", a, b), c))
    g.rename_last("y", (n,))
    return g.model()


def matmul_bias_gelu(m: int = 64, k: int = 96, n: int = 128, form: str = "erf", seed: int = 0):
    g = _G(f"matmul_bias_gelu_{form}", seed)
    x = g.input("x", (m, k))
    y = _matmul_bias(g, x, k, n)
    {"erf": _gelu_erf, "tanh": _gelu_tanh}[form](g, y)
    g.rename_last("y", (m, n))
    return g.model()


def matmul_bias_act(m: int = 64, k: int = 96, n: int = 128, act: str = "Relu", seed: int = 0):
    g = _G(f"matmul_bias_{act.lower()}", seed)
    x = g.input("x", (m, k))
    y = _matmul_bias(g, x, k, n)
    if act == "SiLU":
        g.op("Mul", y, g.op("Sigmoid", y))
    else:
        g.op(act, y)
    g.rename_last("y", (m, n))
    return g.model()


def gemm_bias_relu(m: int = 32, k: int = 64, n: int = 48, seed: int = 0):
    g = _G("gemm_relu", seed)
    x = g.input("x", (m, k))
    g.op("Relu", g.op("Gemm", x, g.weight((n, k)), g.weight((n,), 0.1), transB=1))
    g.rename_last("y", (m, n))
    return g.model()


def conv_bn_relu_residual(channels: int = 16, size: int = 14, seed: int = 0, depthwise: bool = False):
    g = _G("conv_bn_relu_residual" + ("_dw" if depthwise else ""), seed)
    x = g.input("x", (1, channels, size, size))
    h = _conv_bn(g, x, channels, channels, group=channels if depthwise else 1)
    g.op("Add", g.op("Relu", h), x)
    g.rename_last("y", (1, channels, size, size))
    return g.model()


def layernorm(rows: int = 32, d: int = 96, decomposed: bool = True, seed: int = 0):
    g = _G("layernorm" + ("_decomposed" if decomposed else ""), seed)
    x = g.input("x", (rows, d))
    if decomposed:
        _layernorm_decomposed(g, x, d)
    else:
        g.op("LayerNormalization", x, g.weight((d,), 1.0), g.weight((d,), 0.1), axis=-1, epsilon=1e-5)
    g.rename_last("y", (rows, d))
    return g.model()


def softmax(rows: int = 32, d: int = 96, decomposed: bool = True, seed: int = 0):
    g = _G("softmax" + ("_decomposed" if decomposed else ""), seed)
    x = g.input("x", (rows, d))
    if decomposed:
        _softmax_decomposed(g, x)
    else:
        g.op("Softmax", x, axis=-1)
    g.rename_last("y", (rows, d))
    return g.model()


def layernorm_softmax(rows: int = 32, d: int = 96, seed: int = 0):
    g = _G("layernorm_softmax", seed)
    x = g.input("x", (rows, d))
    _softmax_decomposed(g, _layernorm_decomposed(g, x, d))
    g.rename_last("y", (rows, d))
    return g.model()


def mean_variance(rows: int = 32, d: int = 96, seed: int = 0):
    """Mean and variance (E[x^2] - E[x]^2) of one tensor: two outputs."""
    g = _G("mean_variance", seed)
    x = g.input("x", (rows, d))
    ax = g.const(np.array([-1], np.int64))
    g.op("ReduceMean", x, ax, keepdims=1)
    mean = g.rename_last("mean", (rows, 1))
    sq = g.op("ReduceMean", g.op("Mul", x, x), ax, keepdims=1)
    g.op("Sub", sq, g.op("Mul", mean, mean))
    g.rename_last("var", (rows, 1))
    return g.model()


def qkv_projection(seq: int = 32, hidden: int = 64, weights_as_inputs: bool = False, seed: int = 0):
    g = _G("qkv_projection", seed)
    x = g.input("x", (seq, hidden))
    for name in ("q", "k", "v"):
        w = g.input(f"w{name}", (hidden, hidden)) if weights_as_inputs else g.weight((hidden, hidden))
        g.op("MatMul", x, w)
        g.rename_last(name, (seq, hidden))
    return g.model()


def swiglu(seq: int = 32, hidden: int = 64, ffn: int = 96, seed: int = 0):
    g = _G("swiglu", seed)
    x = g.input("x", (seq, hidden))
    gate = g.op("MatMul", x, g.weight((hidden, ffn)))
    up = g.op("MatMul", x, g.weight((hidden, ffn)))
    g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), up)
    g.rename_last("y", (seq, ffn))
    return g.model()


def rmsnorm(rows: int = 32, d: int = 96, seed: int = 0):
    g = _G("rmsnorm", seed)
    x = g.input("x", (rows, d))
    ms = g.op("ReduceMean", g.op("Mul", x, x), g.const(np.array([-1], np.int64)), keepdims=1)
    r = g.op("Sqrt", g.op("Add", ms, g.const(np.float32(1e-6))))
    g.op("Mul", g.op("Div", x, r), g.weight((d,), 1.0))
    g.rename_last("y", (rows, d))
    return g.model()


def instancenorm_silu(channels: int = 8, size: int = 12, seed: int = 0):
    g = _G("instancenorm_silu", seed)
    x = g.input("x", (1, channels, size, size))
    h = g.op("InstanceNormalization", x, g.weight((channels,), 1.0), g.weight((channels,), 0.1), epsilon=1e-5)
    g.op("Mul", h, g.op("Sigmoid", h))
    g.rename_last("y", (1, channels, size, size))
    return g.model()


NORMS = ("layernorm", "layernorm_decomposed", "rmsnorm", "rmsnorm_reciprocal")


def _norm(g: _G, x: str, d: int, norm: str, bias: bool) -> str:
    """One normalisation of the last axis of ``x`` (``d`` features) as a model exports it: ONNX's
    LayerNormalization op, LayerNorm decomposed (mean, sub, pow, mean, add eps, sqrt, div, scale [+ bias]),
    RMSNorm as x / sqrt(mean(x*x) + eps) * scale or as HF Llama's x * reciprocal(sqrt(mean(x^2) + eps))."""
    axes = g.const(np.array([-1], np.int64))
    scale = g.const((1 + 0.1 * g.rng.standard_normal(d)).astype(np.float32))
    beta = g.const((0.1 * g.rng.standard_normal(d)).astype(np.float32)) if bias else None
    if norm == "layernorm":
        return g.op("LayerNormalization", x, scale, *([beta] if bias else []), axis=-1, epsilon=1e-5)
    if norm == "layernorm_decomposed":
        xc = g.op("Sub", x, g.op("ReduceMean", x, axes, keepdims=1))
        var = g.op("ReduceMean", g.op("Pow", xc, g.const(np.float32(2.0))), axes, keepdims=1)
        y = g.op("Mul", g.op("Div", xc, g.op("Sqrt", g.op("Add", var, g.const(np.float32(1e-5))))), scale)
    elif norm == "rmsnorm":
        ms = g.op("ReduceMean", g.op("Mul", x, x), axes, keepdims=1)
        y = g.op("Mul", g.op("Div", x, g.op("Sqrt", g.op("Add", ms, g.const(np.float32(1e-6))))), scale)
    elif norm == "rmsnorm_reciprocal":
        ms = g.op("ReduceMean", g.op("Pow", x, g.const(np.float32(2.0))), axes, keepdims=1)
        inv = g.op("Reciprocal", g.op("Sqrt", g.op("Add", ms, g.const(np.float32(1e-6)))))
        y = g.op("Mul", scale, g.op("Mul", x, inv))
    else:
        raise ValueError(f"unknown norm {norm!r}; one of {NORMS}")
    return g.op("Add", y, beta) if bias else y


def norm_matmul(rows: int = 32, d: int = 96, n: int = 64, norm: str = "layernorm", batch: int | None = None,
                heads: int = 1, bias: bool = True, matmul_bias: bool = True, act: str | None = None,
                swiglu: bool = False, norm_output: bool = False, seed: int = 0):
    """A LayerNorm / RMSNorm (``norm``, one of ``NORMS``) of [rows, d] (or [batch, rows, d]) activations
    feeding ``heads`` matmuls to ``n`` columns each (1: one projection; 3: Q/K/V), optionally with a bias,
    an activation (``act``: an ONNX op name such as "Relu", or "gelu" for erf GELU), or as SwiGLU's
    gate/up pair (``swiglu``: silu(x W_g) * (x W_u)).  ``norm_output``: the normalised tensor is also a
    graph output (it must then be written to memory)."""
    g = _G(f"{norm}_matmul", seed)
    shape = (rows, d) if batch is None else (batch, rows, d)
    x = g.input("x", shape)
    h = _norm(g, x, d, norm, bias)
    if norm_output:
        g.op("Identity", h)
        g.rename_last("normed", shape)
    oshape = shape[:-1] + (n,)
    if swiglu:
        gate = g.op("MatMul", h, g.weight((d, n)))
        g.op("Mul", g.op("Mul", gate, g.op("Sigmoid", gate)), g.op("MatMul", h, g.weight((d, n))))
        g.rename_last("y", oshape)
        return g.model()
    for i in range(heads):
        y = _matmul_bias(g, h, d, n) if matmul_bias else g.op("MatMul", h, g.weight((d, n)))
        if act == "gelu":
            _gelu_erf(g, y)
        elif act is not None:
            g.op(act, y)
        g.rename_last(f"y{i}", oshape)
    return g.model()


PATTERN_MODELS = {
    "elementwise_chain": elementwise_chain,
    "matmul_bias_gelu": matmul_bias_gelu,
    "conv_bn_relu_residual": conv_bn_relu_residual,
    "layernorm_decomposed": layernorm,
    "softmax_decomposed": softmax,
    "layernorm_softmax": layernorm_softmax,
    "mean_variance": mean_variance,
    "qkv_projection": qkv_projection,
    "swiglu": swiglu,
    "rmsnorm": rmsnorm,
    "instancenorm_silu": instancenorm_silu,
}


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Normally distributed inputs for every graph input of a (statically shaped) model."""
    rng = np.random.default_rng(seed)
    inits = {i.name for i in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        t = vi.type.tensor_type
        shape = [d.dim_value for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def reference_outputs(model: onnx.ModelProto, feeds: dict) -> dict[str, np.ndarray]:
    """Outputs of onnx's ReferenceEvaluator (the unfused, op-by-op reference)."""
    from onnx.reference import ReferenceEvaluator

    ev = ReferenceEvaluator(model)
    names = [o.name for o in model.graph.output]
    return dict(zip(names, ev.run(None, feeds)))
