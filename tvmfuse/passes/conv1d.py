"""Conv1d as a conv2d over a plane one row high, with its elementwise epilogue moved to 4-D (CPU).

No CPU template matches a conv1d anchor (three spatial iterators, two reduction ones), so a Whisper-style
``Conv1d + bias + GELU`` ran on ``cpu.generic``.  ``Conv1dAsConv2d`` rewrites, before legalization,

    y = conv1d(x, W)             ->  x4 = reshape(x, [N, C, 1, W_in])          (a view: a kernel alone)
    z = gelu(y + b)                  y4 = conv2d(x4, W[:, :, None, :])         (the tuned conv templates)
                                     z4 = gelu(y4 + b[..., None, :])           (the epilogue, still 4-D)
                                     z  = reshape(z4, [N, F, W_out])           (a view, outside the group)

The elementwise ops after the conv are rewritten in 4-D (``ELEMENTWISE``: every tensor operand a 4-D value
of this pass or a constant, the output of the conv's shape), so the squeeze comes after the whole epilogue:
the grouping refuses a layout op inside a conv group (``rules.check_anchors``), so a squeeze right after the
conv would have cut the epilogue into a kernel of its own.  A conv1d reading another's 4-D output takes it
directly (Whisper's two front-end convs).  The 3-D reshapes nobody reads are left to DeadCodeElimination;
those still read (a transpose, a residual add of another shape) become views (``pipeline.reshape_view_passes``).
A conv whose epilogue's value is a dataflow block's output (the function's result) is rewritten too: after
the grouping, ``rewrites.OutputReshapeView`` binds the reshape back to 3-D to a dataflow var of its own, so
RewriteDataflowReshape (dataflow vars only) makes it a view there as well.  Outside a dataflow block the conv
is left a conv1d (``SKIP_OUTPUT_WHY``): the reshape there would be a copy kernel, one more than before.
Tests: tests/test_passes_conv1d.py.
"""
from __future__ import annotations

import numpy as np

from .. import _compat as C
from ..explain import record_refusal

# elementwise ops moved into 4-D after a conv1d: one output element per operand element (the broadcast of a
# constant operand aside), so inserting a unit axis changes no value
ELEMENTWISE = frozenset({
    "relax.add", "relax.subtract", "relax.multiply", "relax.divide", "relax.power", "relax.maximum",
    "relax.minimum", "relax.erf", "relax.tanh", "relax.sigmoid", "relax.exp", "relax.sqrt", "relax.negative",
    "relax.nn.relu", "relax.nn.gelu", "relax.nn.gelu_tanh", "relax.nn.silu", "relax.clip",
})


def _shape_values(expr) -> list | None:
    ty = C.type_of(expr)
    if not isinstance(ty, C.TensorType) or not isinstance(ty.shape, C.relax.ShapeExpr):
        return None
    return list(ty.shape.values)


def _static_but_batch(dims: list) -> bool:
    return all(isinstance(d, C.IntImm) for d in dims[1:])


def conv1d_why_not(call) -> str | None:
    """None when ``call`` (a ``relax.nn.conv1d``) is one ``Conv1dAsConv2d`` rewrites, else why not."""
    a = call.attrs
    if (str(a.data_layout), str(a.kernel_layout), str(a.out_layout)) != ("NCW", "OIW", "NCW"):
        return f"layout {a.data_layout}/{a.kernel_layout}/{a.out_layout}: only NCW/OIW/NCW is rewritten"
    x, w = call.args
    w_ty = C.type_of(w)
    if not isinstance(w, C.Constant) or not str(w_ty.dtype).startswith(("float", "bfloat")):
        return "the weights are not float constants"
    for name, e in (("input", x), ("output", call)):
        dims = _shape_values(e)
        if dims is None or len(dims) != 3 or not _static_but_batch(dims):
            return f"the {name} shape is not [batch, channels, width] with static channels and width"
    return None


# a conv whose epilogue's value is bound outside a dataflow block: the reshape back to 3-D would be a copy
# kernel there (RewriteDataflowReshape makes views of dataflow vars only), one kernel more than the conv1d group
SKIP_OUTPUT_WHY = ("its epilogue's result is bound outside a dataflow block: the reshape back to [N, C, W] would "
                   "be a copy kernel of its own there (a view only for a dataflow var)")


def _unsqueeze_const(arr: np.ndarray) -> np.ndarray:
    """A constant operand of a 3-D [N, F, W] elementwise op, broadcast the same way against [N, F, 1, W]."""
    if arr.ndim == 0:
        return arr
    full = arr.reshape((1,) * (3 - arr.ndim) + arr.shape)
    return full.reshape(full.shape[:2] + (1,) + full.shape[2:])


def _with_unit_row(dims: list) -> list:
    return dims[:2] + [C.IntImm("int64", 1)] + dims[2:]


@C.mutator
class _Conv1dMutator(C.PyExprMutator):
    def __init__(self, mod, skip: frozenset = frozenset()):
        super().__init__(mod)
        self.skip = skip        # the conv1d calls (by their order in the module) left as they are
        self.convs = 0          # conv1d calls seen so far
        self.own: list = []     # (4-D var this pass emitted, the conv1d calls its value comes from)
        self.refused: list = []  # (producer, reason) of each conv1d left as it is

    def _four_d(self, expr):
        """The 4-D var of this pass that ``expr`` (a 3-D view ``reshape(v4)``) reshapes, else None."""
        if not isinstance(expr, C.relax.Var):
            return None
        bound = self.lookup_binding(expr)
        if not (isinstance(bound, C.relax.Call) and isinstance(bound.op, C.Op) and bound.op.name == "relax.reshape"):
            return None
        src = bound.args[0]
        return src if self.roots(src) else None

    def roots(self, v4) -> frozenset:
        """The conv1d calls (by order) whose epilogue the 4-D var ``v4`` of this pass holds; empty for any
        other expression."""
        return next((r for v, r in self.own if v.same_as(v4)), frozenset())

    def _constant(self, expr) -> np.ndarray | None:
        """The value of a constant operand: a Constant, or a var bound to a static reshape of one (the ONNX
        importer's conv bias, ``reshape(b, [1, F, 1])``), else None."""
        if isinstance(expr, C.Constant):
            return C.const_value(expr)
        bound = self.lookup_binding(expr) if isinstance(expr, C.relax.Var) else None
        if not (isinstance(bound, C.relax.Call) and isinstance(bound.op, C.Op) and bound.op.name == "relax.reshape"
                and isinstance(bound.args[0], C.Constant)):
            return None
        dims = _shape_values(bound)
        if dims is None or not all(isinstance(d, C.IntImm) for d in dims):
            return None
        return C.const_value(bound.args[0]).reshape([int(d) for d in dims])

    def _view(self, v4, dims3, roots: frozenset):
        self.own.append((v4, roots))
        return C.relax.op.reshape(v4, C.relax.ShapeExpr(dims3))

    def visit_call_(self, call):
        call = self.visit_expr_post_order(call)
        if not (isinstance(call, C.relax.Call) and isinstance(call.op, C.Op)):
            return call
        name = call.op.name
        if name == "relax.nn.conv1d":
            new = self._conv(call)
        elif name in ELEMENTWISE:
            new = self._elementwise(call)
        else:
            return call
        return call if new is None else new

    def _conv(self, call):
        index, self.convs = self.convs, self.convs + 1
        why = conv1d_why_not(call) or (SKIP_OUTPUT_WHY if index in self.skip else None)
        if why is not None:
            self.refused.append((C.var_name(call.args[0]) if isinstance(call.args[0], C.relax.Var) else "conv1d", why))
            return None
        x, w = call.args
        a = call.attrs
        x4 = self._four_d(x)
        if x4 is None:
            x4 = self.builder_.emit(C.relax.op.reshape(x, C.relax.ShapeExpr(_with_unit_row(_shape_values(x)))))
        w_arr = C.const_value(w)
        w4 = C.relax.const(np.ascontiguousarray(w_arr.reshape(w_arr.shape[:2] + (1,) + w_arr.shape[2:])))
        (left, right), (s,), (d,) = [int(p) for p in a.padding], [int(v) for v in a.strides], \
            [int(v) for v in a.dilation]
        y4 = self.builder_.emit(C.relax.op.nn.conv2d(
            x4, w4, strides=(1, s), padding=(0, left, 0, right), dilation=(1, d), groups=int(a.groups),
            data_layout="NCHW", kernel_layout="OIHW", out_layout="NCHW", out_dtype=str(C.type_of(call).dtype)))
        return self._view(y4, _shape_values(call), frozenset({index}))

    def _elementwise(self, call):
        out = _shape_values(call)
        if out is None or len(out) != 3:
            return None
        args, roots = [], frozenset()
        for arg in call.args:
            v4 = self._four_d(arg)
            if v4 is not None:
                if not C.structural_equal(C.type_of(arg), C.type_of(call)):
                    return None                  # the view is broadcast to a larger tensor
                args.append(v4)
                roots |= self.roots(v4)
                continue
            ty = C.type_of(arg)
            if not isinstance(ty, C.TensorType):
                args.append(arg)                 # a PrimValue / shape attribute operand
                continue
            arr = self._constant(arg)
            if arr is None:
                return None                      # another tensor: its own layout, left 3-D
            args.append(C.relax.const(np.ascontiguousarray(_unsqueeze_const(arr))))
        if not roots:
            return None
        y4 = self.builder_.emit(C.relax.Call(call.op, args, call.attrs, call.ty_args))
        return self._view(y4, out, roots)

    def output_views(self, func) -> frozenset:
        """The conv1d calls whose 3-D view ``func`` (this mutator's result) binds in a binding block outside
        any dataflow block: a copy kernel there, not a view (in a dataflow block, a view bound to an output var
        is made a view by ``rewrites.OutputReshapeView``)."""
        bindings = [b for block in func.body.blocks if not isinstance(block, C.relax.DataflowBlock)
                    for b in block.bindings]

        def resolve(value):      # through var aliases (``gv = lv``, what the mutator binds an output to)
            while isinstance(value, C.relax.Var):
                value = next((b.value for b in bindings if b.var.same_as(value)), None)
            return value

        hit = frozenset()
        for b in bindings:
            v = resolve(b.value)
            if (not isinstance(b.var, C.relax.DataflowVar) and isinstance(v, C.relax.Call)
                    and isinstance(v.op, C.Op) and v.op.name == "relax.reshape"):
                hit |= self.roots(v.args[0])
        return hit


@C.module_pass(opt_level=0, name="tvmfuse.Conv1dAsConv2d")
class Conv1dAsConv2d:
    """CPU: ``conv1d`` (NCW/OIW, constant weights) as a ``conv2d`` one row high, its elementwise epilogue in
    4-D and one reshape after it, so the conv templates take the conv and its epilogue (module docstring)."""

    def transform_module(self, mod, _ctx):
        skip = frozenset()
        while True:      # each round leaves out more convs (at most one round per conv1d, plus one)
            m = _Conv1dMutator(mod, skip)
            out = frozenset()
            for gv, func in mod.functions.items():
                if isinstance(func, C.relax.Function) and not (func.attrs and "Primitive" in func.attrs):
                    new = m.visit_expr(func)
                    out |= m.output_views(new)
                    m.builder_.update_func(gv, new)
            if not out - skip:
                for producer, why in m.refused:
                    record_refusal(producer, "conv1d", why, "conv1d_as_conv2d")
                return m.builder_.get()
            skip |= out
