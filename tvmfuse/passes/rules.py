"""The fusion rules of tvmfuse, as data, and the three checks that decide a fusion.

A *node* is one ``call_tir`` of the legalized module; its *kind* comes from the PrimFunc it calls
(``op_pattern`` from AnnotateTIROpPattern, refined by looking at its reduction blocks):

- ``elemwise``     op_pattern 0/1: elementwise and broadcast ops;
- ``injective``    op_pattern 2: reshape, transpose, concat, slices;
- ``reduction``    op_pattern 3/4 whose reductions read one tensor per reduced element (sum, mean, max,
                   variance, softmax, layer norm): a *row reduction*, keyed by (shape read, axes reduced);
- ``contraction``  op_pattern 3/4 whose reduction multiplies two tensors indexed by the reduced axis
                   (matmul, conv): the anchor a schedule template tiles;
- ``opaque``       anything else (extern, call_dps_packed, unknown rank, tir_vars): never fused.

Shapes may be symbolic (``[batch, 64]``): extents are kept as TIR expressions and compared by what
``tvm.arith.Analyzer`` can prove equal, so a model with symbolic batch/sequence gets the groups of its
static version.

A rule names the pair of kinds it fuses (``edge`` rules: producer -> consumer; ``sibling`` rules: two
consumers of one tensor).  Whether a fusion happens is decided in one place, ``decide``: legality (the
merged group stays acyclic in the group graph; shapes are known, static or symbolic), profitability (the anchors of the
merged group can share one loop nest) and target support (group size limits of the target family).
Each check returns None when it passes, else the reason a user reads.
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import _compat as C

ELEMWISE, INJECTIVE, REDUCTION, CONTRACTION, OPAQUE = "elemwise", "injective", "reduction", "contraction", \
    "opaque"
_MOVABLE = (ELEMWISE, INJECTIVE)


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str          # "edge" (producer -> consumer) or "sibling" (two readers of one tensor)
    first: tuple       # kinds allowed for the producer (edge) / the first sibling
    second: tuple      # kinds allowed for the consumer (edge) / the second sibling
    why: str           # one line: what it buys, and the test that needs it

    def matches(self, a: "NodeInfo", b: "NodeInfo") -> bool:
        if a.kind not in self.first or b.kind not in self.second:
            return False
        if self.kind == "sibling" and a.kind == CONTRACTION:
            return a.data_arg is not None and a.data_arg.same_as(b.data_arg)
        return True


# One row per rule.  Order matters only for which rule name a group reports (the first that fused it).
RULES: tuple[Rule, ...] = (
    Rule("elementwise_chain", "edge", _MOVABLE, _MOVABLE,
         "chains of elementwise/broadcast/injective ops in one loop; test_fusion_patterns[elementwise_chain]"),
    Rule("contraction_epilogue", "edge", (CONTRACTION,), (ELEMWISE,),
         "bias, activation and residual add computed on the matmul/conv output tile; "
         "test_fusion_patterns[matmul_bias_gelu], [conv_bn_relu_residual]"),
    Rule("reduction_prologue", "edge", _MOVABLE, (REDUCTION,),
         "the producer of a reduction computed inside the reduction loop (x*x -> mean); "
         "test_fusion_patterns[rmsnorm]"),
    Rule("reduction_epilogue", "edge", (REDUCTION,), _MOVABLE,
         "the ops after a reduction read the row it just reduced; test_fusion_patterns[layernorm_decomposed]"),
    Rule("reduction_chain", "edge", (REDUCTION,), (REDUCTION,),
         "one row reduction feeding another over the same rows (max -> sum of exp); "
         "test_fusion_patterns[layernorm_softmax]"),
    Rule("sibling_contractions", "sibling", (CONTRACTION,), (CONTRACTION,),
         "Q/K/V or gate/up projections of one input: the input is read once for all; "
         "test_fusion_patterns[qkv_projection], [swiglu]"),
    Rule("sibling_reductions", "sibling", (REDUCTION,), (REDUCTION,),
         "two reductions over the same rows of one input in one pass; test_fusion_patterns[mean_variance]"),
    Rule("sibling_elementwise", "sibling", (ELEMWISE,), (ELEMWISE,),
         "independent elementwise ops reading one tensor (LSTM gates): one read, several outputs; "
         "test_fusion_rules::test_sibling_elementwise"),
)

RULES_BY_NAME = {r.name: r for r in RULES}


@dataclass(frozen=True)
class TargetLimits:
    """Per target family: how large a fused group its schedules are built for."""

    max_ops: int                     # call_tir ops in one group
    max_outputs: int                 # outputs of one (multi-output) group
    multi_output_reductions: bool    # may a group with a row reduction have several outputs?


# CPU: the schedules stage's fallback (dlight cpu.Reduction) fails with a ScheduleError on a reduction
# kernel with several outputs (ONNX conformance node/test_unsqueeze_*: compute-at on an output block),
# so on CPU such groups are refused until that fallback handles them.
_LIMITS = {"cpu": TargetLimits(max_ops=64, max_outputs=8, multi_output_reductions=True),
           "gpu": TargetLimits(max_ops=48, max_outputs=8, multi_output_reductions=True)}


def limits_for(target) -> TargetLimits:
    from ..target import is_gpu

    return _LIMITS["gpu" if target is not None and is_gpu(target) else "cpu"]


@dataclass
class NodeInfo:
    """What the rules need to know about one call_tir."""

    name: str                   # "<prim func>(<var>)", for the report
    kind: str
    pattern: int
    row_keys: frozenset = frozenset()   # (shape read, axes reduced) of each row reduction
    data_arg: object = None             # contraction: the relax var of its data operand
    reduce_axes: int = 0                # contraction: reduced axes (1: a matmul; 3: a conv's rc, ry, rx)
    out_shape: tuple | None = None      # ints and symbolic TIR expressions (see same_shape)
    why_opaque: str = ""


# --------------------------------------------------------------------------- PrimFunc analysis
def _shape_of(ty) -> tuple | None:
    """The shape of a tensor (nested for a tuple): ints for static extents, TIR expressions for symbolic
    ones (``batch``, ``seq * 4``); None when the rank or shape is unknown."""
    if isinstance(ty, C.TupleType):
        parts = [_shape_of(f) for f in ty.fields]
        return None if any(p is None for p in parts) else tuple(parts)
    if not isinstance(ty, C.TensorType) or ty.shape is None or not isinstance(ty.shape, C.relax.ShapeExpr):
        return None
    return tuple(int(d.value) if isinstance(d, C.IntImm) else d for d in ty.shape.values)


def _is_shape(x) -> bool:
    return isinstance(x, tuple)


def same_shape(a, b) -> bool:
    """Are two shapes (from ``_shape_of``) provably equal?  Symbolic extents are compared by what the
    arithmetic analyzer can prove (``batch`` == ``batch``; ``batch`` != ``seq`` unless proven)."""
    if a is None or b is None:
        return False
    if _is_shape(a) or _is_shape(b):
        return _is_shape(a) and _is_shape(b) and len(a) == len(b) and all(same_shape(x, y) for x, y in zip(a, b))
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return bool(C.Analyzer().can_prove_equal(a, b))


def is_symbolic(shape) -> bool:
    """Does a shape (from ``_shape_of``) have a symbolic extent?"""
    if _is_shape(shape):
        return any(is_symbolic(d) for d in shape)
    return not isinstance(shape, int)


def _reduction_blocks(func):
    """(block, reduce vars) of every block with a reduction iterator; None if the func has no root block."""
    try:
        sch = C.Schedule(func)
        root = sch.get_sblock("root")
    except C.TVMError:  # a PrimFunc without a root block: not analyzable, treated as opaque
        return None
    out = []
    stack = list(sch.get_child_blocks(root))
    while stack:
        rv = stack.pop()
        blk = sch.get(rv)
        rvars = [iv.var for iv in blk.iter_vars if int(iv.iter_type) == C.IterVar.CommReduce]
        if rvars:
            out.append((blk, rvars))
        stack.extend(sch.get_child_blocks(rv))
    return out


def _uses(expr, vars_) -> bool:
    used = C.tirx.analysis.undefined_vars(expr, [])
    return any(u.same_as(v) for u in used for v in vars_)


def reduced_axes(func) -> int:
    """Most reduction iterators of one block of ``func`` (1 for a matmul, 3 for a conv2d)."""
    return max((len(rvars) for _, rvars in _reduction_blocks(func) or []), default=0)


def analyze_reductions(func) -> tuple[bool, frozenset] | None:
    """(is_contraction, row keys) of a PrimFunc with reductions; None when it cannot be analyzed."""
    blocks = _reduction_blocks(func)
    if not blocks:
        return None
    contraction, keys = False, set()
    for blk, rvars in blocks:
        written = [C.region_tensor(w) for w in blk.writes]
        reduced, bufs = [], []
        for r in blk.reads:
            buf = C.region_tensor(r)
            if any(buf.same_as(w) for w in written):
                continue
            axes = tuple(i for i, rng in enumerate(r.region) if _uses(rng.min, rvars))
            if axes:
                shape = tuple(int(s) if isinstance(s, C.IntImm) else str(s) for s in C.tensor_shape(buf))
                reduced.append((shape, axes))
                if not any(b.same_as(buf) for b in bufs):
                    bufs.append(buf)
        if len(bufs) >= 2:  # two tensors indexed by the reduced axis: a matmul/conv
            contraction = True
        keys.update(reduced)
    return contraction, frozenset(keys)


def symbolic_injective(func) -> bool:
    """A PrimFunc that TVM's AnnotateTIROpPattern calls opaque only because its indices hold a symbolic
    extent (a reshape over ``seq``: ``x[(v0 + ...) % seq, ...]``; the static version is injective): one
    block, spatial iterators only, storing to its output at exactly its iterators a value made of loads
    and arithmetic (no calls).  Such a func is injective; FuseTIR merges it like any other."""
    if not any(not isinstance(d, C.IntImm) for p in func.params for d in getattr(p, "shape", ())):
        return False
    try:
        sch = C.Schedule(func)
        blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
    except C.TVMError:  # no root block: not analyzable
        return False
    if len(blocks) != 1 or sch.get_child_blocks(blocks[0]):
        return False
    blk = sch.get(blocks[0])
    if any(int(iv.iter_type) != C.IterVar.DataPar for iv in blk.iter_vars) or blk.init is not None:
        return False
    body = blk.body
    if not isinstance(body, C.BufferStore) or len(body.indices) != len(blk.iter_vars) or not all(
            isinstance(i, C.tirx.Var) and i.same_as(iv.var) for i, iv in zip(body.indices, blk.iter_vars)):
        return False
    calls = []
    C.post_order_visit(body.value, lambda n: calls.append(n) if isinstance(n, C.Call) else None)
    return not calls


def classify(func, call, var_ty) -> NodeInfo:
    """The NodeInfo of ``var = call_tir(func, args)``."""
    name = str(call.args[0].name_hint)
    out_shape = _shape_of(var_ty)
    info = NodeInfo(name=name, kind=OPAQUE, pattern=-1, out_shape=out_shape)
    if not isinstance(func, C.PrimFunc):
        info.why_opaque = "calls a function that is not a TIR PrimFunc"
        return info
    if len(call.args) > 2:
        info.why_opaque = "call_tir with symbolic tir_vars"
        return info
    attrs = func.attrs
    if attrs is None or "op_pattern" not in attrs:
        info.why_opaque = "PrimFunc has no op_pattern"
        return info
    pattern = int(attrs["op_pattern"])
    if pattern == 8 and symbolic_injective(func):
        pattern = 2
    info.pattern = pattern
    if out_shape is None or any(_shape_of(C.type_of(a)) is None for a in call.args[1].fields):
        # symbolic extents are fine (FuseTIR makes symbolic PrimFuncs); an unknown rank is not
        info.why_opaque = "unknown shape or rank (no shape expression to check a fusion against)"
        return info
    if pattern <= 1:
        info.kind = ELEMWISE
    elif pattern == 2:
        info.kind = INJECTIVE
    elif pattern in (3, 4):
        found = analyze_reductions(func)
        if found is None:
            info.why_opaque = f"op pattern {pattern} without an analyzable reduction block"
            return info
        contraction, keys = found
        info.kind = CONTRACTION if contraction else REDUCTION
        info.row_keys = keys
        if contraction:
            info.data_arg = call.args[1].fields[0]
            info.reduce_axes = reduced_axes(func)
    else:
        info.why_opaque = f"op pattern {pattern} (opaque/extern) is never fused"
    return info


# --------------------------------------------------------------------------- the three checks
def check_profitable(members: list[NodeInfo]) -> str | None:
    """Can the merged group's anchors share one loop nest?  None if yes, else why not."""
    contractions = [m for m in members if m.kind == CONTRACTION]
    reductions = [m for m in members if m.kind == REDUCTION]
    if contractions and reductions:
        return (f"a row reduction ({reductions[0].name}) and a matmul/conv ({contractions[0].name}) would "
                "share a kernel: the reduction needs whole rows of the tiled anchor output")
    if contractions:
        first = contractions[0]
        for c in contractions[1:]:
            if not (c.data_arg is not None and c.data_arg.same_as(first.data_arg)):
                return f"matmul/conv anchors {first.name} and {c.name} do not read the same input"
            if not same_shape(c.out_shape, first.out_shape):
                return f"sibling anchors {first.name} and {c.name} have different output shapes"
            if max(first.reduce_axes, c.reduce_axes) > 1:
                # a block's conv and its strided shortcut conv added: no template tiles two conv anchors
                return (f"two conv anchors {first.name} and {c.name} in one kernel: the conv templates "
                        "(cpu.conv2d_epilogue, cuda conv2d) take one conv, cpu.sibling_matmuls takes "
                        "matmuls only; each conv keeps its own kernel")
        wider = check_epilogue_within_anchor(contractions[0], members)
        if wider:
            return wider
        injective = [m for m in members if m.kind == INJECTIVE]
        if injective:
            return (f"layout op {injective[0].name} in a matmul/conv group: the anchor's epilogue takes "
                    "elementwise/broadcast ops only")
    if reductions:
        keys = set()
        for r in reductions:
            keys |= r.row_keys
        if len(keys) > 1:
            return "reductions over different rows (shape or axes differ) cannot share one pass over a row"
    return None


def _static_numel(shape) -> int | None:
    if shape is None or not all(isinstance(d, int) for d in shape):
        return None
    n = 1
    for d in shape:
        n *= d
    return n


def _broadcasts_past(anchor_shape, shape) -> bool:
    """Whether ``shape`` is a broadcast of ``anchor_shape`` to a larger tensor: same rank with an axis of
    extent 1 in the anchor and not in it (static or symbolic, so ``[batch, C, H, W]`` against
    ``[batch, C, 1, 1]`` decides as the static shapes do), or more elements (static shapes of other ranks)."""
    if anchor_shape is None or shape is None:
        return False
    if len(shape) == len(anchor_shape):
        return any(isinstance(a, int) and a == 1 and not (isinstance(b, int) and b == 1)
                   for a, b in zip(anchor_shape, shape))
    n, base = _static_numel(shape), _static_numel(anchor_shape)
    return n is not None and base is not None and n > base


def check_epilogue_within_anchor(anchor: NodeInfo, members: list[NodeInfo]) -> str | None:
    """An elementwise op of a matmul/conv group whose output is larger than the anchor's (a broadcast of
    the anchor's output: squeeze-excite's scale [1, C, 1, 1] times the feature map [1, C, H, W]) has no
    place in the anchor's tiles: no template (cpu.conv2d_epilogue, cpu.matmul_epilogue) takes it, and the
    kernel went to dlight's fallback.  None when every member fits the anchor's output."""
    for m in members:
        if m.kind == ELEMWISE and _broadcasts_past(anchor.out_shape, m.out_shape):
            return (f"{m.name} broadcasts the output of {anchor.name} {list(anchor.out_shape)} to a larger "
                    f"tensor {list(m.out_shape)}: the matmul/conv templates (cpu.conv2d_epilogue, "
                    "cpu.matmul_epilogue) compute the epilogue on the anchor's tiles only")
    return None


def check_supported(members: list[NodeInfo], n_outputs: int, limits: TargetLimits) -> str | None:
    if len(members) > limits.max_ops:
        return f"group would have {len(members)} ops, over the target's limit of {limits.max_ops}"
    if n_outputs > limits.max_outputs:
        return f"group would have {n_outputs} outputs, over the target's limit of {limits.max_outputs}"
    return None


def check_final_group(members: list[NodeInfo], n_outputs: int, limits: TargetLimits) -> str | None:
    """Target support of a finished group (groups pass through multi-output states while they grow)."""
    if n_outputs > 1 and not limits.multi_output_reductions and any(m.kind == REDUCTION for m in members):
        return "a row-reduction kernel with several outputs: the target's reduction schedules take one output"
    return None
