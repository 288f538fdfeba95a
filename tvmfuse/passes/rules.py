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

A rule names the pair of kinds it fuses (``edge`` rules: producer -> consumer, optionally only when the
producer's group holds a kind, as ``norm_prologue`` needs a row reduction; ``sibling`` rules: two
consumers of one tensor; ``horizontal`` rules: two independent groups, each reading outputs of one
kernel; ``chain`` rules: a multi-op pattern matched on Relax ops before legalization by its
own pass, e.g. ``attention`` in passes/attention.py, whose checks are the ``check_attention_*`` functions
below; grouping then sees its kernel as one opaque op), its own check (``check(members)``: a reason or None) and the template family that
must schedule the group.  Whether a fusion happens is decided in one place, ``grouping._BlockGraph.decide``:
legality (the merged group stays acyclic in the group graph; shapes are known, static or symbolic), the
checks of every rule that formed the merged group (``check_rules``: profitability) and target support
(group size limits, then ``check_template``: some template family of the target ``accepts`` the group,
asked before FuseTIR from the ops' ``NodeInfo``).  Each check returns None when it passes, else the reason
a user reads; a template refusal names the family that declined.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .. import _compat as C
from ..analysis import (CONTRACTION, ELEMWISE, INJECTIVE, OPAQUE, REDUCTION, GroupInfo, NodeInfo,  # noqa: F401
                        analyze_reductions, is_sum_reduction, reduced_axes, reduction_blocks)

_MOVABLE = (ELEMWISE, INJECTIVE)
# Elements: a constant at least this large (and of rank 2 or more) read by two fusable ops makes them
# siblings as a tensor would (shared_table); 64: below it a constant is a scalar, a bias or a small vector
SHARED_TABLE_MIN_ELEMENTS = 64


@dataclass(frozen=True)
class Rule:
    """One fusion rule: what it matches, its own check and the template family that must schedule the group.

    ``check(members)`` sees every op of the merged group and returns None or the reason the rule does
    not hold for it; ``decide`` runs the checks of every rule that formed either group plus this one, so
    an op that a later rule brings in is checked against the anchors already there.  ``template`` names
    the family (a part of its name: ``matmul`` matches ``cuda_matmul``) the rule builds groups for; the
    family's ``accepts`` is asked first and named in a refusal."""

    name: str
    kind: str          # "edge" (producer -> consumer), "sibling" (two readers of one tensor) or "horizontal"
    #                    (two independent groups reading outputs of one kernel)
    first: tuple       # kinds allowed for the producer (edge) / the first sibling
    second: tuple      # kinds allowed for the consumer (edge) / the second sibling
    why: str           # one line: what it buys, and the test that needs it
    check: object = None   # Callable[[list[NodeInfo]], str | None]: the rule's own condition on the group
    template: str = ""     # the template family that must accept the group on the target
    same_input: bool = False   # sibling rule: both read the shared tensor as their data operand
    producer_group: tuple = ()  # edge rule: kinds of which the producer's group must hold one (a norm's reduction)
    # the group stands only if a family of ``template`` accepts it (where the target's families declare
    # ``accepts``): another schedule would undo what the rule buys (a norm recomputed a row at a time, or
    # the generic schedule of a matmul)
    needs_family: bool = False
    # edge rule: what the producer itself must be (``channel_scale``) for the rule to cover the pair at all;
    # other pairs of its kinds stay "no rule" refusals
    producer: object = None   # Callable[[NodeInfo], bool]

    def matches(self, a: NodeInfo, b: NodeInfo, a_group_kinds=None) -> bool:
        """Whether the rule covers ``a`` and ``b``; ``a_group_kinds``: the kinds in ``a``'s group so far."""
        if a.kind not in self.first or b.kind not in self.second:
            return False
        if self.producer is not None and not self.producer(a):
            return False
        if self.producer_group and not set(self.producer_group) & set(a_group_kinds or (a.kind,)):
            return False
        return not self.same_input or (a.data_arg is not None and a.data_arg.same_as(b.data_arg))


# --------------------------------------------------------------------------- the rules' own checks
def check_anchors(members: list[NodeInfo]) -> str | None:
    """A matmul/conv group: several anchors only as siblings of one input (same output shape, matmuls),
    no row reduction beside them, and an epilogue of elementwise ops only."""
    contractions = [m for m in members if m.kind == CONTRACTION]
    reason = _no_reduction_beside_anchors(members)
    if reason is not None or not contractions:
        return reason
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
    before = {id(m) for m in prologue_of(members)}
    wider = check_epilogue_within_anchor(first, [m for m in members if id(m) not in before])
    if wider:
        return wider
    # a channel concat before the conv is the concat_prologue rule's (check_concat_prologue decides)
    injective = [m for m in members if m.kind == INJECTIVE and not (id(m) in before and channel_concat(m))]
    if injective:
        return (f"layout op {injective[0].name} in a matmul/conv group: the anchor's epilogue takes "
                "elementwise/broadcast ops only")
    return None


def _static_dims(buffer) -> list[int] | None:
    dims = list(buffer.shape)
    return [int(d) for d in dims] if all(isinstance(d, C.IntImm) for d in dims) else None


def buffer_shapes(func) -> list[list]:
    """The shapes of a PrimFunc's buffer parameters, in order (a symbolic scalar parameter, ``batch`` for a
    PrimFunc sized ``batch * 16`` only, has none and is left out)."""
    return [list(p.shape) for p in func.params if C.is_buffer_var(p)]


def channel_concat(m: NodeInfo) -> bool:
    """Whether ``m`` is a concat of NCHW tensors along the channels: TVM's ``concatenate`` PrimFunc, several
    inputs [n, c_i, h, w] and one output [n, sum c_i, h, w], static but for the batch n (symbolic: one shared
    extent, as a model exported with a dynamic batch has)."""
    func = m.func
    if m.kind != INJECTIVE or func is None or not m.name.startswith("concatenate"):
        return False
    dims = buffer_shapes(func)
    if len(dims) < 3:
        return False
    if any(len(d) != 4 or not all(isinstance(x, C.IntImm) for x in d[1:]) for d in dims):
        return False
    analyzer = C.Analyzer()
    if not all(analyzer.can_prove_equal(d[0], dims[-1][0]) for d in dims[:-1]):
        return False
    *ins, out = [[int(x) for x in d[1:]] for d in dims]
    return all(sh[1:] == out[1:] for sh in ins) and sum(sh[0] for sh in ins) == out[0]


def _read_only_by_the_conv(m: NodeInfo, conv: NodeInfo, what: str) -> str | None:
    """None when ``m`` (a conv's prologue op, ``what`` it makes) is the conv's data operand and read by
    nothing else (it is never written to memory), else why not."""
    if m.var is None or conv.data_arg is None or not conv.data_arg.same_as(m.var):
        return f"{conv.name} does not read {what} {m.name} as its data operand"
    outside = [r for r in m.readers if r is None or r is not conv]
    if outside:
        reader = "the function's result" if outside[0] is None else outside[0].name
        return f"{what} {m.name} is also read by {reader}: it would have to be written to memory"
    return None


def check_concat_prologue(members: list[NodeInfo]) -> str | None:
    """A channel concat read by one pointwise conv with constant weights, blocked (``cpu.conv1x1``) or OIHW
    (``cpu.conv2d_epilogue``: output channels no vector divides, SqueezeNet's 512 -> 10 classifier); both inline
    it into their input loads and cut the input-channel loop at its boundaries: the concat is never written to
    memory, so nothing outside the group may read it (its branches may have other readers: they are written
    anyway).  (SqueezeNet's fire modules: the two expand branches concatenated, then the next squeeze conv.)"""
    anchors = [m for m in members if m.kind == CONTRACTION]
    prologue = prologue_of(members)
    if len(anchors) != 1 or not prologue:
        return None
    conv = anchors[0]
    for m in prologue:
        if not channel_concat(m):
            return f"{m.name} before the conv is not a channel concat (the conv's prologue takes a concat only)"
        why = _read_only_by_the_conv(m, conv, "the concat")
        if why is not None:
            return why
    weight = [_static_dims(p) for p in conv.func.params[1:2]]
    if conv.reduce_axes != 3 or not weight or weight[0] is None or len(weight[0]) not in (4, 5) \
            or weight[0][2:4] != [1, 1]:
        return (f"{conv.name} is not a 1x1 conv with constant weights (cpu.conv1x1, blocked weights, and "
                "cpu.conv2d_epilogue, OIHW, read a pointwise conv's concat through their input loads)")
    concat_plane = buffer_shapes(prologue[-1].func)[-1][2:]     # its output (a symbol passed as a scalar: none)
    if conv.out_shape is None or len(conv.out_shape) != 4 or \
            list(conv.out_shape[2:]) != [int(d) for d in concat_plane]:
        return (f"{conv.name} does not read the concat's plane pixel for pixel (a strided or padded 1x1 conv): "
                "the templates read a concat through the loads of a stride-1 unpadded 1x1 conv only")
    return None


def check_sibling_copies(members: list[NodeInfo]) -> str | None:
    """Copy and elementwise kernels only: two independent groups of layout and elementwise ops (each
    reading outputs of one kernel) share one kernel, one loop nest per output, no loop fused across them;
    a reduction or matmul in either keeps its own schedule."""
    other = [m for m in members if m.kind not in _MOVABLE]
    if other:
        return (f"{other[0].name} ({other[0].kind}) in the group: the rule joins copy and elementwise "
                "kernels only")
    return None


def channel_scale(m: NodeInfo) -> bool:
    """Whether ``m`` is a per-channel scale of an NCHW tensor: TVM's ``multiply`` PrimFunc of x [n, C, H, W]
    and a gate [n or 1, C, 1, 1] (squeeze-excitation's ``x * sigmoid(fc(pool(x)))``), static but for the
    batch n (symbolic: one shared extent)."""
    func = m.func
    if m.kind != ELEMWISE or func is None or not m.name.startswith("multiply"):
        return False
    dims = buffer_shapes(func)
    if len(dims) != 3 or any(len(d) != 4 for d in dims):
        return False
    *ins, out = dims
    if not all(isinstance(x, C.IntImm) for x in out[1:]) or int(out[2]) * int(out[3]) == 1:
        return False
    analyzer = C.Analyzer()
    whole = [d for d in ins if all(analyzer.can_prove_equal(a, b) for a, b in zip(d, out))]
    gate = [d for d in ins if d is not (whole[0] if whole else None)]
    if len(whole) != 1 or len(gate) != 1:
        return False
    g = gate[0]
    return (all(isinstance(x, C.IntImm) for x in g[1:]) and [int(x) for x in g[1:]] == [int(out[1]), 1, 1]
            and (isinstance(g[0], C.IntImm) and int(g[0]) == 1 or analyzer.can_prove_equal(g[0], out[0])))


def _blocked_pointwise(conv: NodeInfo) -> bool:
    """A 1x1 conv whose constant weights the graph rewrite stored blocked (``OIHW<B>o``, 5-D): the pointwise
    convs ``cpu.conv1x1`` takes (``passes.rewrites.TransposePointwiseWeights`` blocks only those)."""
    weight = [_static_dims(p) for p in conv.func.params[1:2]]
    return conv.reduce_axes == 3 and bool(weight) and weight[0] is not None and len(weight[0]) == 5 \
        and weight[0][2:4] == [1, 1]


def check_scale_prologue(members: list[NodeInfo]) -> str | None:
    """A per-channel scale (``channel_scale``) read by one pointwise conv with blocked constant weights
    (``cpu.conv1x1``, which inlines it into its input loads: one multiply per broadcast input element): the
    scaled tensor is never written to memory, so nothing outside the group may read it, and the scale is the
    only op before the conv (a costlier prologue would be recomputed for every block of output channels)."""
    anchors = [m for m in members if m.kind == CONTRACTION]
    prologue = [m for m in prologue_of(members) if not channel_concat(m)]
    if len(anchors) != 1 or not prologue:
        return None
    conv = anchors[0]
    if len(prologue) > 1:
        return (f"{len(prologue)} ops before {conv.name} ({', '.join(m.name for m in prologue)}): the conv's input "
                "loads take one per-channel scale")
    m = prologue[0]
    if not channel_scale(m):
        return (f"{m.name} before the conv is not a per-channel scale of its input (x [n, C, H, W] * "
                "g [n, C, 1, 1]): the conv's input loads take that one")
    why = _read_only_by_the_conv(m, conv, "the scaled tensor")
    if why is not None:
        return why
    if not _blocked_pointwise(conv):
        return (f"{conv.name} is not a 1x1 conv with blocked constant weights (cpu.conv1x1, the family that "
                "scales its input loads, takes those)")
    return None


def check_rows(members: list[NodeInfo]) -> str | None:
    """A row-reduction group: every reduction over the same rows, and no matmul/conv anchor beside them."""
    reason = _no_reduction_beside_anchors(members)
    if reason is not None:
        return reason
    keys = set()
    for r in members:
        if r.kind == REDUCTION:
            keys |= r.row_keys
    if len(keys) > 1:
        return "reductions over different rows (shape or axes differ) cannot share one pass over a row"
    return None


def _no_reduction_beside_anchors(members: list[NodeInfo]) -> str | None:
    """No row reduction in a matmul/conv group, unless every reduction is part of a norm prologue of the
    matmuls (``check_norm_prologue`` then decides)."""
    contractions = [m for m in members if m.kind == CONTRACTION]
    reductions = [m for m in members if m.kind == REDUCTION]
    if contractions and reductions:
        before = {id(m) for m in prologue_of(members)}
        after = [r for r in reductions if id(r) not in before]
        if not after:
            return check_norm_prologue(members)
        return (f"a row reduction ({after[0].name}) and a matmul/conv ({contractions[0].name}) would "
                "share a kernel: the reduction needs whole rows of the tiled anchor output")
    return None


def prologue_of(members: list[NodeInfo]) -> list[NodeInfo]:
    """The members from which a matmul/conv of the group is reached through members (in member order):
    what the group computes before its anchors.  Empty when the ops do not know their readers."""
    ids = {id(m): m for m in members}
    up: set[int] = set()
    changed = True
    while changed:
        changed = False
        for m in members:
            if id(m) in up or m.kind == CONTRACTION:
                continue
            if any(r is not None and id(r) in ids and (r.kind == CONTRACTION or id(r) in up) for r in m.readers):
                up.add(id(m))
                changed = True
    return [m for m in members if id(m) in up]


def check_norm_prologue(members: list[NodeInfo]) -> str | None:
    """A row normalisation (LayerNorm, RMSNorm: row sums, elementwise ops) before the matmul(s) of the
    group, computed per row block into their packed A panel (``cpu.norm_matmul``): the matmuls read the
    normalised tensor as their data operand and nothing else reads it (it is never written to memory);
    the norm's reductions are sums over the last axis of the normalised rows; nothing after the matmuls
    reads the norm's intermediates; a static row length K and static matmul columns N (the A panel and
    the register tiles; the row count may be symbolic: batch x sequence)."""
    anchors = [m for m in members if m.kind == CONTRACTION]
    prologue = prologue_of(members)
    if not anchors or not prologue:
        return None
    inside = {id(m) for m in members}
    before = {id(m) for m in prologue}
    anchor_ids = {id(a) for a in anchors}
    after, todo = set(), list(anchors)          # what the anchors' results reach inside the group
    while todo:
        for r in todo.pop().readers:
            if r is not None and id(r) in inside and id(r) not in after:
                after.add(id(r))
                todo.append(r)
    chained = [m for m in members if id(m) in after and (id(m) in before or id(m) in anchor_ids)]
    if chained:
        return (f"{chained[0].name} is computed from a matmul and feeds a matmul of the same group: a kernel "
                "tiles one set of sibling matmuls, with a norm before them and elementwise ops after them")
    for a in anchors:
        if a.reduce_axes != 1:
            return f"{a.name} reduces {a.reduce_axes} axes (a conv): the norm prologue feeds matmuls only"
    normed = [m for m in prologue if m.var is not None and anchors[0].data_arg is not None
              and m.var.same_as(anchors[0].data_arg)]
    if not normed:
        return (f"{anchors[0].name} reads the ops before it through its weight operand, not as its data "
                "(A) operand: only the A panel is normalised while packing")
    normed = normed[0]
    for m in prologue:
        if m.kind not in (REDUCTION, ELEMWISE):
            return f"{m.name} ({m.kind}) before the matmul: the norm prologue takes row sums and elementwise ops"
        for r in m.readers:
            if r is None or id(r) not in inside:
                what = "the function's result" if r is None else r.name
                if m is normed:
                    return (f"the normalised tensor {m.name} is also read by {what}: it would have to be written "
                            "to memory (the prologue computes it per row block into the matmul's A panel only)")
                return f"{m.name} (part of the norm before the matmul) is also read by {what} outside the group"
            if id(r) in anchor_ids and m is not normed:
                return f"{r.name} reads {m.name} besides the normalised tensor: only its A operand is normalised"
            if id(r) not in before and id(r) not in anchor_ids:
                return f"{r.name} after the matmul reads {m.name} of the norm before it"
    for a in anchors:
        if a.data_arg is None or not a.data_arg.same_as(normed.var):
            return f"{a.name} is not a matmul reading the normalised tensor {normed.name} as its A operand"
    reductions = [m for m in prologue if m.kind == REDUCTION]
    if not reductions:
        return f"{normed.name} is not a row normalisation (no row reduction before the matmul)"
    rows = normed.out_shape
    # symbolic rows (batch x sequence) are fine (cpu.symbolic_norm_matmul); the row length K and each
    # matmul's columns N are the register tiles' and the A panel's extents: static
    if not isinstance(rows, tuple) or not rows or not isinstance(rows[-1], int):
        return (f"symbolic shapes: the normalised rows of {normed.name} have a symbolic length "
                f"{list(rows) if isinstance(rows, tuple) else rows}: the A panel holds whole rows of static K")
    for a in anchors:
        if not isinstance(a.out_shape, tuple) or not a.out_shape or not isinstance(a.out_shape[-1], int):
            return f"symbolic shapes: {a.name} has a symbolic column count (the register tiles need a static N)"
    for r in reductions:
        if not is_sum_reduction(r.func):
            return (f"{r.name} is not a sum over the rows (a max: softmax?): the norm prologue takes mean, "
                    "variance and mean-square statistics")
        if any(not _same_key_shape(shape, rows) or axes != (len(rows) - 1,) for shape, axes in r.row_keys):
            return (f"{r.name} does not reduce the last axis of the normalised rows {list(rows)}: the "
                    "matmul's A panel holds whole rows")
    return None


def _same_key_shape(key_shape: tuple, shape: tuple) -> bool:
    """A row key's shape (``analysis.analyze_reductions``: ints, symbolic extents by name) against a relax
    shape (ints and TIR expressions): the same rank, equal static extents, the same symbolic names."""
    if len(key_shape) != len(shape):
        return False
    for k, d in zip(key_shape, shape):
        if isinstance(k, int) != isinstance(d, int) or (k != d if isinstance(d, int) else k != str(d)):
            return False
    return True


# One row per rule.  Order matters only for which rule name a group reports (the first that fused it).
RULES: tuple[Rule, ...] = (
    Rule("elementwise_chain", "edge", _MOVABLE, _MOVABLE,
         "chains of elementwise/broadcast/injective ops in one loop; test_fusion_patterns[elementwise_chain]",
         None, "elementwise"),
    Rule("contraction_epilogue", "edge", (CONTRACTION,), (ELEMWISE,),
         "bias, activation and residual add computed on the matmul/conv output tile; "
         "test_fusion_patterns[matmul_bias_gelu], [conv_bn_relu_residual]", check_anchors, "matmul"),
    Rule("concat_prologue", "edge", (INJECTIVE,), (CONTRACTION,),
         "a channel concat read by a 1x1 conv: the conv reads each input channel from its concat operand, the "
         "concat is no copy kernel (SqueezeNet's fire modules and classifier); test_schedules_cpu_concat_prologue",
         check_concat_prologue, "conv1x1"),
    Rule("norm_prologue", "edge", (REDUCTION, ELEMWISE), (CONTRACTION,),
         "LayerNorm/RMSNorm rows normalised while packing the A panel of the matmul(s) they feed (Q/K/V, "
         "gate/up): the normalised tensor never reaches memory; test_norm_prologue", check_norm_prologue,
         "norm_matmul", producer_group=(REDUCTION,), needs_family=True),
    Rule("scale_prologue", "edge", (ELEMWISE,), (CONTRACTION,),
         "squeeze-excitation's per-channel scale read by the next 1x1 conv: the conv scales each input "
         "element as it loads it, the scaled activation is never written (regnet_y, efficientnet_b0); "
         "test_fusion_rules_scale_prologue", check_scale_prologue, "conv1x1", producer=channel_scale),
    Rule("reduction_prologue", "edge", _MOVABLE, (REDUCTION,),
         "the producer of a reduction computed inside the reduction loop (x*x -> mean); "
         "test_fusion_patterns[rmsnorm]", check_rows, "reduction"),
    Rule("reduction_epilogue", "edge", (REDUCTION,), _MOVABLE,
         "the ops after a reduction read the row it just reduced; test_fusion_patterns[layernorm_decomposed]",
         check_rows, "reduction"),
    Rule("reduction_chain", "edge", (REDUCTION,), (REDUCTION,),
         "one row reduction feeding another over the same rows (max -> sum of exp); "
         "test_fusion_patterns[layernorm_softmax]", check_rows, "reduction"),
    Rule("sibling_contractions", "sibling", (CONTRACTION,), (CONTRACTION,),
         "Q/K/V or gate/up projections of one input: the input is read once for all; "
         "test_fusion_patterns[qkv_projection], [swiglu]", check_anchors, "sibling", same_input=True),
    Rule("sibling_reductions", "sibling", (REDUCTION,), (REDUCTION,),
         "two reductions over the same rows of one input in one pass; test_fusion_patterns[mean_variance]",
         check_rows, "reduction"),
    Rule("sibling_elementwise", "sibling", (ELEMWISE,), (ELEMWISE,),
         "independent elementwise ops reading one tensor (LSTM gates): one read, several outputs; "
         "test_fusion_rules::test_sibling_elementwise", None, "elementwise"),
    Rule("sibling_copies", "horizontal", _MOVABLE, _MOVABLE,
         "the copy/elementwise kernels that each read an output of one kernel (deberta's Q, K and V "
         "re-laid-out to heads) as one kernel: one call instead of one per output; "
         "test_fusion_rules_sibling_copies", check_sibling_copies, "elementwise"),
    # A multi-node rule: matched on Relax ops before legalization (passes/attention.py), where softmax is
    # one op and K^T one permute_dims; after it they are six PrimFuncs a pairwise rule cannot join.
    Rule("attention", "chain", (CONTRACTION,), (REDUCTION, CONTRACTION),
         "softmax(scale*Q@K^T+mask)@V as one online-softmax kernel: the SxS scores never reach memory "
         "(matched on Relax ops: pairwise rules refuse reduction+matmul); test_attention", None, "attention"),
)

RULES_BY_NAME = {r.name: r for r in RULES}


@dataclass(frozen=True)
class TargetLimits:
    """Per target family: how large a fused group its schedules are built for."""

    max_ops: int                     # call_tir ops in one group
    max_outputs: int                 # outputs of one (multi-output) group
    multi_output_reductions: bool    # may a group with a row reduction have several outputs?
    # A norm prologue computes its rows per row block, so every row block (one or more per core) reads all
    # of its matmuls' weights; fused, they must stay in cache between row blocks.  1 MiB: half the 2 MiB L2
    # of the CI host (Emerald Rapids).  Measured under load there: 128 rows x 768 -> Q/K/V (7 MB of
    # weights) 1.3x slower fused than LayerNorm + sibling matmuls (each packed weight panel read once);
    # the demo block's 196 KB Q/K/V and 256 KB FFN-up no slower.  To re-measure alone.
    prologue_weight_bytes: int = 1 << 20


# CPU: the schedules stage's fallback (dlight cpu.Reduction) fails with a ScheduleError on a reduction
# kernel with several outputs (ONNX conformance node/test_unsqueeze_*: compute-at on an output block),
# so on CPU such groups are refused until that fallback handles them.
_LIMITS = {"cpu": TargetLimits(max_ops=64, max_outputs=8, multi_output_reductions=True,
                               prologue_weight_bytes=1 << 20),
           "gpu": TargetLimits(max_ops=48, max_outputs=8, multi_output_reductions=True,
                               prologue_weight_bytes=0)}    # no GPU template takes a norm prologue


def limits_for(target) -> TargetLimits:
    from ..target import is_gpu

    return _LIMITS["gpu" if target is not None and is_gpu(target) else "cpu"]


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


def _sym_vars(shape) -> set[str]:
    """Names of the symbolic variables in a shape from ``_shape_of`` (nested for tuples)."""
    names: set[str] = set()

    def visit(node):
        if isinstance(node, C.tirx.Var):
            names.add(str(node.name))

    for d in shape or ():
        if _is_shape(d):
            names |= _sym_vars(d)
        elif not isinstance(d, int):
            C.post_order_visit(d, visit)
    return names


def shape_vars(ty) -> set[str]:
    """Names of the symbolic variables in a tensor (or tuple) type's shape, or in a shape type's values
    (``R.Shape([n])`` of a match_cast); empty when static or unknown."""
    values = getattr(ty, "values", None)
    if not isinstance(ty, (C.TensorType, C.TupleType)) and values is not None:
        return _sym_vars(tuple(int(d.value) if isinstance(d, C.IntImm) else d for d in values))
    return _sym_vars(_shape_of(ty))


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


def symbolic_injective(func) -> bool:
    """A PrimFunc that TVM's AnnotateTIROpPattern calls opaque only because its indices hold a symbolic
    extent (a reshape over ``seq``: ``x[(v0 + ...) % seq, ...]``; the static version is injective): one
    block, spatial iterators only, storing to its output at exactly its iterators a value made of loads
    and arithmetic (no calls).  Such a func is injective; FuseTIR merges it like any other."""
    if not any(not isinstance(d, C.IntImm) for p in func.params for d in getattr(p, "shape", ())):
        return False
    return _one_store_of_loads(func) is not None


def gather_injective(func) -> bool:
    """A gather (``take``: an embedding lookup ``table[ids[i], j]``) that AnnotateTIROpPattern calls opaque
    because an index is loaded from a buffer: otherwise ``symbolic_injective``'s shape (one spatial block
    storing loads and arithmetic at its iterators).  Each output element reads one table element, so it
    fuses as an injective op, over static or symbolic extents alike: the static and symbolic builds of a
    model then get the same groups (bert's embedding gather, lookups and norm: one kernel in both)."""
    value = _one_store_of_loads(func)
    if value is None:
        return False
    gathered = []

    def visit(n):
        if isinstance(n, C.TensorLoad):
            for i in n.indices:
                C.post_order_visit(i, lambda m: gathered.append(m) if isinstance(m, C.TensorLoad) else None)
    C.post_order_visit(value, visit)
    return bool(gathered)


def _one_store_of_loads(func):
    """The stored value of a PrimFunc that is one spatial block storing, at exactly its iterators, loads
    and arithmetic (no calls); None for any other PrimFunc."""
    try:
        sch = C.Schedule(func)
        blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
    except C.TVMError:  # no root block: not analyzable
        return None
    if len(blocks) != 1 or sch.get_child_blocks(blocks[0]):
        return None
    blk = sch.get(blocks[0])
    if any(int(iv.iter_type) != C.IterVar.DataPar for iv in blk.iter_vars) or blk.init is not None:
        return None
    body = blk.body
    if not isinstance(body, C.BufferStore) or len(body.indices) != len(blk.iter_vars) or not all(
            isinstance(i, C.tirx.Var) and i.same_as(iv.var) for i, iv in zip(body.indices, blk.iter_vars)):
        return None
    calls = []
    C.post_order_visit(body.value, lambda n: calls.append(n) if isinstance(n, C.Call) else None)
    return None if calls else body.value


def shared_table(const) -> bool:
    """Whether a constant argument is a table worth reading once for its sibling readers (grouping's step 2):
    a tensor of at least ``SHARED_TABLE_MIN_ELEMENTS`` elements, e.g. the rotary cos/sin tables a static
    build folds, read by the Q and K rotary kernels (the symbolic build computes them per call, a tensor
    both read, and joined the two already: phi/qwen2 had fewer kernels symbolic than static, session 13;
    test_fusion_rules::test_siblings_reading_one_constant_table).  Scalars and small vectors (epsilons, a
    bias) are not: each op reading its own copy of 1.0 is no shared tensor."""
    shape = getattr(C.type_of(const), "shape", None)
    values = getattr(shape, "values", None)
    if values is None or not all(isinstance(d, C.IntImm) for d in values):
        return False
    dims = [int(d) for d in values]
    return len(dims) >= 2 and math.prod(dims) >= SHARED_TABLE_MIN_ELEMENTS


def scalar_arg(arg) -> bool:
    """Whether a ``call_tir`` argument is a symbolic scalar, not a tensor: LegalizeOps passes ``batch`` to a
    PrimFunc whose buffers are sized ``batch * 16`` only (Swin's windows over a symbolic batch), since no
    buffer shape defines it.  Such an argument is no tensor the group reads: it stays in the group's
    function, with its symbols from the group's shape parameter (``grouping._undefined_symbols``)."""
    return (C.is_prim_expr(arg) and isinstance(C.type_of(arg), C.PrimType)
            and "int" in str(C.type_of(arg).dtype))   # an extent, never a float constant


def _is_view(func, call, out_shape) -> bool:
    """Whether RewriteDataflowReshape makes ``call`` (bound to a dataflow var: ``grouping`` checks that) a free
    view: its PrimFunc has TVM's reshape pattern and it reads one tensor with as many elements as it writes
    (a slice from the start, ``x[:, :sequence]``, has the pattern too but is a copy)."""
    tensors = [a for a in call.args[1].fields if not scalar_arg(a)]
    if len(tensors) != 1 or out_shape is None or any(_is_shape(d) for d in out_shape):
        return False
    in_shape = _shape_of(C.type_of(tensors[0]))
    if in_shape is None or not C.has_reshape_pattern(func):
        return False
    count_in, count_out = 1, 1
    for d in in_shape:
        count_in = count_in * d
    for d in out_shape:
        count_out = count_out * d
    return same_shape(count_in, count_out)


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
    if attrs is not None and "tvmfuse.rule" in attrs:
        info.why_opaque = f"one kernel already (the {attrs['tvmfuse.rule']} rule); nothing more fuses into it"
        return info
    if attrs is None or "op_pattern" not in attrs:
        info.why_opaque = "PrimFunc has no op_pattern"
        return info
    pattern = int(attrs["op_pattern"])
    if pattern == 8 and (symbolic_injective(func) or gather_injective(func)):
        pattern = 2
    info.pattern = pattern
    # a reshape (a transpose that moves unit axes only is one too): alone, RewriteDataflowReshape makes it a
    # free view (vm.builtin.reshape); it fuses like any injective op, but a group of such ops only is split
    # back into views (grouping, Step 3: ``views_only``)
    info.view = pattern <= 2 and _is_view(func, call, out_shape)
    if out_shape is None or any(_shape_of(C.type_of(a)) is None for a in call.args[1].fields
                                if not scalar_arg(a)):
        # symbolic extents are fine (FuseTIR makes symbolic PrimFuncs); an unknown rank is not
        info.why_opaque = "unknown shape or rank (no shape expression to check a fusion against)"
        return info
    if pattern <= 1:
        info.kind, info.func = ELEMWISE, func
    elif pattern == 2:
        info.kind, info.func = INJECTIVE, func
    elif pattern in (3, 4):
        found = analyze_reductions(func)
        if found is None:
            info.why_opaque = f"op pattern {pattern} without an analyzable reduction block"
            return info
        contraction, keys = found
        info.kind = CONTRACTION if contraction else REDUCTION
        info.row_keys = keys
        info.func = func
        if contraction:
            info.data_arg = call.args[1].fields[0]
            info.reduce_axes = reduced_axes(func)
    else:
        info.why_opaque = f"op pattern {pattern} (opaque/extern) is never fused"
    return info


# --------------------------------------------------------------------------- the three checks
def check_rules(rules: list[Rule], members: list[NodeInfo]) -> str | None:
    """Profitability: the own check of every rule that formed the group (each once); None or the first
    reason, prefixed with the rule's name."""
    for rule in dict.fromkeys(rules):
        reason = rule.check(members) if rule.check is not None else None
        if reason is not None:
            return reason
    return None


def check_template(rule: Rule, group: GroupInfo, target, formed: tuple = ()) -> tuple[str | None, str | None, str]:
    """Target support by a schedule: (the family that accepts the group, None, "") or (None, why not, ""),
    the family the rule names asked first and named in the refusal; a group no family accepts but the CPU
    generic schedule takes: (None, None, why the families of ``rule`` and of the rules that ``formed`` the
    group declined) for the report."""
    if target is None:
        return None, None, ""
    from ..schedules import template_gate

    named = tuple(dict.fromkeys(r.template for r in (*formed, rule)))
    family, reason, declined = template_gate(group, target, prefer=rule.template, named=named)
    own = [r.template for r in (*formed, rule) if r.needs_family]
    if own and reason is None and (family is None and declined or family is not None
                                   and not any(t in family for t in own)):
        from ..schedules import declares_accepts, templates_for

        why = [f"{t.family}: {t.accepts(group, target)}" for t in templates_for(target)
               if declares_accepts(t) and any(o in t.family for o in own)]
        why += [f"{family} would take it" if family else "only the generic schedule would take it"]
        return None, f"no {'/'.join(dict.fromkeys(own))} family schedules the group ({'; '.join(why)})", ""
    return family, reason, declined


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
    if limits.prologue_weight_bytes and any(m.kind == REDUCTION for m in prologue_of(members)):
        size = sum(weight_bytes(m) for m in members if m.kind == CONTRACTION)
        if size > limits.prologue_weight_bytes:
            return (f"the norm before the matmuls is computed per row block, and every row block reads all "
                    f"their weights ({size / 2**20:.2f} MiB): over the target's limit of "
                    f"{limits.prologue_weight_bytes / 2**20:.2f} MiB (unfused, each weight panel is read once)")
    return None


def weight_bytes(anchor: NodeInfo) -> int:
    """Bytes of a matmul anchor's weight operand: K x N float32 (K: its reduced extent, N: its last output
    axis); 0 when unknown (symbolic)."""
    blocks = reduction_blocks(anchor.func) if anchor.func is not None else None
    if not blocks or not anchor.out_shape or not isinstance(anchor.out_shape[-1], int):
        return 0
    k = 1
    for iv in blocks[0][0].iter_vars:
        if int(iv.iter_type) == C.IterVar.CommReduce:
            if not isinstance(iv.dom.extent, C.IntImm):
                return 0
            k *= int(iv.dom.extent.value)
    return 4 * k * anchor.out_shape[-1]


def views_only(members: list[NodeInfo]) -> str | None:
    """Profitability of a finished group: one made of reshapes only (``NodeInfo.view``: a reshape, or a
    transpose that moves unit axes) would be a copy kernel where each op alone is a free view
    (RewriteDataflowReshape: ``vm.builtin.reshape``); such a group is split back into its ops.  A reshape
    between other ops stays in their group (one kernel, not two: Swin's window reshapes around the shifted
    window mask, tests/test_symbolic_symbol_args.py)."""
    if len(members) >= 2 and all(m.view for m in members):
        return ("reshapes only: each op alone is a free view (RewriteDataflowReshape), as one group a copy "
                "kernel")
    return None


def check_final_group(members: list[NodeInfo], n_outputs: int, limits: TargetLimits) -> str | None:
    """Target support of a finished group (groups pass through multi-output states while they grow)."""
    if n_outputs > 1 and not limits.multi_output_reductions and any(m.kind == REDUCTION for m in members):
        return "a row-reduction kernel with several outputs: the target's reduction schedules take one output"
    return None


# --------------------------------------------------------------------------- the attention chain
ATTENTION_DTYPES = ("float32",)     # the kernel's arithmetic (and its template) is float32


def check_attention_operands(exprs: list, target) -> str | None:
    """Legality of an attention chain's tensors: known shapes (symbolic batch/sequence extents are
    checked by the kernel spec: plain symbols, static head dims) and float32 (a bool row guard)."""
    for e in exprs:
        ty = C.type_of(e)
        shape = _shape_of(ty)
        if shape is None:
            return "unknown shape (the attention kernel needs every operand's rank and extents)"
        dtype = str(ty.dtype)
        if dtype not in ATTENTION_DTYPES and dtype != "bool":
            return f"dtype {dtype}: the attention kernel computes in {', '.join(ATTENTION_DTYPES)}"
    return None


def check_attention_target(target) -> str | None:
    """Target support: the attention kernel has CPU and CUDA templates (no other GPU kind)."""
    from ..target import is_gpu

    if target is not None and is_gpu(target) and target.kind.name != "cuda":
        return f"not supported by the target: the attention kernel has no {target.kind.name} template (the " \
               "chain stays as separate kernels)"
    return None
