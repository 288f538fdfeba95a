"""tvmfuse's Relax pipeline: graph passes -> fused PrimFuncs -> schedules -> TVM's lowering.

``Stages(target, options)`` is the one place the stages are assembled: ``graph()`` (rewrites,
legalization, grouping, FuseTIR), ``schedule()`` (templates, fallback, fast math) and ``lower()`` (TVM's
own lowering), each a plain pass list so that ``compile()`` can stop between them (to report what fusion
did), ``explain`` and the tuner can take the graph stage alone.  ``pipeline(target)`` chains them into one
named pass that ``tvm.compile(mod, target, relax_pipeline=...)`` takes; importing tvmfuse also registers it
under the name ``"tvmfuse"``.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import numpy as np

from . import _compat as C
from .errors import InputError
from .explain import Recorder, record_group, record_refusal, retract_groups
from .report import groups_in
from .target import is_gpu, parse_target

log = logging.getLogger("tvmfuse.pipeline")


@dataclass(frozen=True)
class PipelineOptions:
    """Switches of the pipeline; every stage reads its settings from here (no environment flags)."""

    fusion: bool = True        # tvmfuse's graph-level fusion rules (False: TVM's FuseOps only)
    attention: bool = True     # the attention rule (False: the chain goes through the pairwise rules, the
                               # scores in memory: the "unfused attention" baseline of bench_attention.py)
    schedules: bool = True     # tvmfuse's schedule templates (False: TVM's defaults)
    fast_math: bool = True     # vectorizable exp/erf/tanh/sigmoid approximations in fused kernels
    tuning_log: str | None = None   # None: untuned target defaults; "shipped": the shipped records; a log path
    # CPU kernels assume their tensor arguments aligned to the element size only (as numpy's arrays are), not
    # to TVM's 64 bytes, so run() reads numpy inputs in place (tvmfuse.io); False: TVM's 64-byte assumption
    element_aligned_args: bool = True
    # symbolic dim -> the largest size run() accepts ({"batch": 64}); Relax's memory planner then sizes every
    # intermediate for that bound and allocates it once per call from fixed-size storage (TVM's
    # ``tir_var_upper_bound``) instead of one storage per intermediate sized at run time; a larger size is an
    # InputError.  None (the default): no bound, any size, storage sized per call (from the VM's pool)
    shape_upper_bounds: dict | None = None
    extra: dict = field(default_factory=dict)


def pre_legalize_passes(target: C.Target, options: PipelineOptions) -> list:
    """Graph cleanups and rewrites on high-level Relax ops (before they become TIR)."""
    if not options.fusion:
        return []
    from .passes import pre_legalize_passes as graph_pre

    return graph_pre(target, options)


def legalize_passes(target: C.Target, fold_constants: bool = True) -> list:
    """TVM's library dispatch, then every op lowered to its own PrimFunc with its op pattern (TVM's
    legalizations but for those of passes.legalize: reshapes over symbolic extents), then (``fold_constants``)
    TVM's FoldConstant, which builds and runs every call on constants only; the calls numpy folds exactly
    (``passes.fold.CONSTANT_FOLDS``: bias reshapes, Clip bounds, transposed weights) are folded before
    legalization, so FoldConstant builds no LLVM module for them (most of a CNN's compile time before)."""
    from .passes.fold import FoldConstantsNumpy
    from .passes.legalize import custom_legalize

    return ([FoldConstantsNumpy()] if fold_constants else []) + C.backend_passes(target, "library_dispatch") + [
        C.relax_transform.LegalizeOps(customize_legalize_map=custom_legalize(target)),
        C.relax_transform.AnnotateTIROpPattern(),
    ] + ([C.relax_transform.FoldConstant()] if fold_constants else [])


def grouping_passes(target: C.Target, options: PipelineOptions) -> list:
    """tvmfuse's grouping (``options.fusion``): each group becomes a Relax function marked Primitive."""
    from .passes import grouping_passes as graph_grouping

    return graph_grouping(target, options)


def fuse_tir_passes(target: C.Target, options: PipelineOptions) -> list:
    """Merge each group's PrimFuncs into one PrimFunc (one kernel)."""
    return [C.relax_transform.FuseTIR()]


def schedule_passes(target: C.Target, options: PipelineOptions) -> list:
    """Schedule every fused PrimFunc: a tuned record, else the target's template default."""
    from .schedules import schedule_passes as sched

    return sched(target, options)


def lowering_passes(target: C.Target, options: PipelineOptions | None = None) -> list:
    """TVM's own dataflow lowering and VM finalization for the target (with
    ``tvmfuse.share_symbolic_storage`` before its KillAfterLastUse, ``tvmfuse.share_shapes`` and
    ``tvmfuse.drop_unused_tuples`` before its VMShapeLower), then (``element_aligned_args``, CPU targets)
    every kernel's tensor arguments declared element-aligned."""
    options = options or PipelineOptions()
    passes = ([_shape_upper_bounds_pass(options.shape_upper_bounds)] + C.backend_passes(target, "dataflow_lower")
              + before_pass(before_pass(before_pass(C.backend_passes(target, "finalize"), "KillAfterLastUse",
                                                    _share_symbolic_storage),
                                        "VMShapeLower", _share_shapes),
                            "VMShapeLower", _drop_unused_tuples))
    passes.append(_restrict_shape_funcs)
    if options.element_aligned_args and takes_element_aligned_args(target):
        passes.append(_element_aligned_args)
    return passes


def before_pass(passes: list, name: str, extra) -> list:
    """``passes`` with ``extra`` inserted before the pass named ``name``; an error if there is none (TVM
    renamed or dropped it: the pipeline must not silently lose ``extra``)."""
    names = [p.info.name for p in passes]
    if name not in names:
        raise RuntimeError(f"TVM's pass list has no {name!r} to put {extra.info.name} before: {names}")
    i = names.index(name)
    return passes[:i] + [extra] + passes[i:]


@C.module_pass(opt_level=0, name="tvmfuse.share_shapes")
def _share_shapes(mod, _ctx):
    """Each symbolic shape or scalar a Relax function passes to the VM (the shapes of its allocations,
    ``SHAPE_SHARING_OPS``, and of ``SHAPE_SHARING_BUILTINS``; a kernel's symbolic scalars) computed once
    per call, not once per use.

    Why: VMShapeLower turns every ``R.shape([1, n, 64])`` argument into its own ``vm.builtin.make_shape``
    call and every symbolic scalar argument of a kernel (``call_tir``'s ``tir_vars``: ``batch``,
    ``sequence`` of a matmul over ``[batch * sequence, 64]`` rows) into its own
    ``vm.builtin.make_prim_value``, each a VM instruction and an object per call of the model (a static
    build makes none: its shapes and scalars are constants).  A symbolic BERT's ``main`` made 28 shapes per
    call for 6 distinct ones; a symbolic GPT-2's 24 scalars for 2 (``batch``, ``sequence``) and 11 shapes
    for 9.  Here the values equal after simplification (``2048 * batch`` and ``4 * batch * 8 * 8 * 8``) are
    bound once to a variable, before the first binding that uses them, and that variable is passed
    instead; VMShapeLower then makes one ``make_shape`` / ``make_prim_value`` per distinct value.
    Only the function body's top-level bindings are rewritten (every later binding of the body sees a
    variable bound there); nested scopes (an ``If``'s branches) keep their own."""
    kernels = {gv for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}
    for gv, func in list(mod.functions.items()):
        if isinstance(func, C.relax.Function) and isinstance(func.body, C.relax.SeqExpr):
            body = _shared_shape_body(func, kernels)
            if body is not None:
                mod[gv] = C.relax.Function(func.params, body, C.ret_type(func), func.is_pure, func.attrs,
                                           func.span)
    return mod


@C.module_pass(opt_level=0, name="tvmfuse.drop_unused_tuples")
def _drop_unused_tuples(mod, _ctx):
    """Each top-level binding of a Relax function to a tuple no one reads dropped.

    Why: CallTIRRewrite binds the outputs of a kernel with several outputs to a tuple
    (``t = (alloc, alloc1)``) and rewrites their readers to the allocations themselves, so the tuple is
    never read, but the VM still builds it (``vm.builtin.make_tuple``) every call: 6 per call of GPT-2
    (static and symbolic builds alike), each a VM instruction and an object.  A tuple's construction has
    no effect, so dropping it changes nothing else; TVM's DeadCodeElimination is not used here, as after
    lowering it would have to tell kernel calls (which write their outputs) from pure ones."""
    for gv, func in list(mod.functions.items()):
        if not (isinstance(func, C.relax.Function) and isinstance(func.body, C.relax.SeqExpr)):
            continue
        seq = func.body
        used: set = set()

        def visit(node):
            if isinstance(node, C.relax.Var):
                used.add(node)

        for block in seq.blocks:
            for b in block.bindings:
                C.post_order_visit(b.value, visit)
        C.post_order_visit(seq.body, visit)
        blocks, changed = [], False
        for block in seq.blocks:
            kept = [b for b in block.bindings
                    if not (isinstance(b, C.relax.VarBinding) and isinstance(b.value, C.relax.Tuple)
                            and b.var not in used)]
            changed |= len(kept) != len(block.bindings)
            blocks.append(block if len(kept) == len(block.bindings) else type(block)(kept))
        if changed:
            mod[gv] = C.relax.Function(func.params, C.relax.SeqExpr(blocks, seq.body, seq.span),
                                       C.ret_type(func), func.is_pure, func.attrs, func.span)
    return mod


# the VM's allocations, whose shape arguments become plain registers; a Relax op's shape argument
# (``R.reshape``'s) is left as it is: its type and its legalization read the literal
SHAPE_SHARING_OPS = frozenset({"relax.vm.alloc_storage", "relax.vm.alloc_tensor"})
# the VM builtins called by name (``R.call_packed``) whose shape arguments are plain registers: the view
# RewriteDataflowReshape leaves between GPT-2's attention and its Gemm
SHAPE_SHARING_BUILTINS = frozenset({"vm.builtin.reshape"})


def _callee(call, kernels) -> str | None:
    """What ``_share_shapes`` shares in ``call``'s arguments: "shape" (symbolic shapes), "scalar" (a
    kernel's symbolic scalars), or None (nothing)."""
    op = call.op
    if getattr(op, "name", None) in SHAPE_SHARING_OPS:
        return "shape"
    if isinstance(op, C.relax.ExternFunc) and str(op.global_symbol) in SHAPE_SHARING_BUILTINS:
        return "shape"
    if op in kernels:
        return "scalar"
    return None


def _shared_shape_body(func, kernels=frozenset()):
    """``func``'s body with its top-level symbolic arguments shared (``_share_shapes``); None if unchanged."""
    seq = func.body
    analyzer = C.Analyzer()
    bound: list[tuple[str, tuple, object]] = []  # ("shape" or "scalar", simplified dims or (scalar,), its var)
    # Relax variables (parameters, bindings) pass as registers already; a symbolic scalar is a TIR var
    relax_vars = set(func.params)
    for block in seq.blocks:
        relax_vars.update(b.var for b in block.bindings)
    changed = False
    blocks = []

    def shared(bindings: list, kind: str, values, make):
        """The variable holding ``values`` (simplified), bound in ``bindings`` at its first use."""
        dims = tuple(analyzer.simplify(v) for v in values)
        var = next((v for k, d, v in bound if k == kind and len(d) == len(dims)
                    and all(C.structural_equal(x, y) for x, y in zip(d, dims))), None)
        if var is None:
            var = make(dims, len(bound))
            bindings.append(C.relax.VarBinding(var, C.relax.ShapeExpr(list(dims)) if kind == "shape"
                                               else dims[0]))
            bound.append((kind, dims, var))
        return var

    for block in seq.blocks:
        if isinstance(block, C.relax.DataflowBlock):   # not at this point of the pipeline: left as it is
            blocks.append(block)
            continue
        bindings = []
        for b in block.bindings:
            value = b.value if isinstance(b, C.relax.VarBinding) else None
            kind = _callee(value, kernels) if isinstance(value, C.relax.Call) else None
            symbolic = _symbolic_shape if kind == "shape" else (lambda a: _symbolic_scalar(a, relax_vars))
            if kind is None or not any(symbolic(a) for a in value.args):
                bindings.append(b)
                continue
            args = []
            for a in value.args:
                if not symbolic(a):
                    args.append(a)
                elif kind == "shape":
                    args.append(shared(bindings, "shape", a.values,
                                       lambda d, i: C.relax.Var(f"shape{i}", C.relax.ShapeType(list(d)))))
                else:
                    args.append(shared(bindings, "scalar", [a],
                                       lambda d, i, a=a: C.relax.Var(f"scalar{i}", C.type_of(a))))
            bindings.append(C.relax.VarBinding(b.var, C.relax.Call(value.op, args, value.attrs, value.ty_args,
                                                                    value.span, ret_ty=C.type_of(value))))
            changed = True
        blocks.append(C.relax.BindingBlock(bindings))
    return C.relax.SeqExpr(blocks, seq.body, seq.span) if changed else None


def _symbolic_scalar(expr, relax_vars) -> bool:
    """A kernel's scalar argument known only at run time: an integer expression of the function's symbolic
    dims (``batch``, ``batch * sequence``), not a Relax variable nor a constant."""
    ty = C.type_of(expr) if hasattr(expr, "ty") else None
    if not isinstance(ty, C.PrimType) or isinstance(expr, (C.IntImm, C.Constant)) or expr in relax_vars:
        return False
    return "int" in str(ty.dtype)


def _symbolic_shape(expr) -> bool:
    """A shape literal with a dim known only at run time (``R.shape([1, n, 64])``)."""
    return isinstance(expr, C.relax.ShapeExpr) and not all(isinstance(v, C.IntImm) for v in expr.values)


@C.module_pass(opt_level=0, name="tvmfuse.restrict_shape_funcs")
def _restrict_shape_funcs(mod, _ctx):
    """The VM's shape functions (``shape_func``, made by VMShapeLower for symbolic shapes) marked
    ``tirx.noalias`` like every kernel.

    Why: TVM 0.27's LLVM code generator lets the "no alias" choice of one function of a module leak into
    the others: a module holding one PrimFunc without ``tirx.noalias`` that sorts after the kernels (as
    ``shape_func`` sorts after ``fused_*``) compiles *every* kernel without ``noalias`` arguments and with
    its compute function inlined, so LLVM must assume that outputs alias inputs (fewer vector ops; the
    kernels of a symbolic resnet18 ran 1.5-3x slower inside the model than compiled alone, while a static
    model has no shape function).  A shape function takes one pointer (the VM's shape heap), so "no
    alias" holds for it trivially; a host function with more pointers is left as it is.
    """
    for gv, func in list(mod.functions.items()):
        if (isinstance(func, C.PrimFunc) and func.attrs is not None and func.attrs.get(C.HOST_FUNC_ATTR)
                and not func.attrs.get(C.NOALIAS_ATTR) and C.pointer_param_count(func) <= 1):
            mod[gv] = func.with_attr(C.NOALIAS_ATTR, True)
    return mod


UPPER_BOUND_ATTR = "tir_var_upper_bound"   # Relax function attribute read by StaticPlanBlockMemory


def signature_vars(func) -> set[str]:
    """Names of the symbolic dims in a Relax function's parameter shapes (``batch``, ``sequence``)."""
    names = set()
    for p in func.params:
        shape = getattr(C.type_of(p), "shape", None)
        for d in getattr(shape, "values", None) or ():
            if isinstance(d, C.Var):
                names.add(str(d.name))
    return names


def check_upper_bounds(bounds: dict | None, symbolic: set[str] | None = None) -> dict[str, int]:
    """``bounds`` as {dim name: int >= 1}, or an InputError naming the bad entry; with ``symbolic`` (the
    model's symbolic dims), every name must be one of them."""
    out: dict[str, int] = {}
    for name, value in (bounds or {}).items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or int(value) < 1:
            raise InputError(f"shape_upper_bounds[{name!r}] = {value!r}: a bound is an integer >= 1")
        if symbolic is not None and name not in symbolic:
            raise InputError(f"shape_upper_bounds names {name!r}, which is not a symbolic dim of the model's "
                             f"inputs (its symbolic dims: {sorted(symbolic) or 'none'})")
        out[str(name)] = int(value)
    return out


def upper_bounds_of(func) -> dict[str, int]:
    """The ``tir_var_upper_bound`` attribute of a Relax function ({} when it has none)."""
    attr = func.attrs.get(UPPER_BOUND_ATTR) if func.attrs is not None else None
    return {str(k): int(v) for k, v in (attr or {}).items()}


def _shape_upper_bounds_pass(bounds: dict | None) -> C.ir_transform.Pass:
    """Each Relax function whose signature has a dim of ``bounds`` gets it in ``tir_var_upper_bound``
    (merged over the bounds the module already gives; the user's win), before memory planning."""
    wanted = check_upper_bounds(bounds)

    @C.module_pass(opt_level=0, name="tvmfuse.shape_upper_bounds")
    def _annotate(mod, _ctx):
        if not wanted:
            return mod
        for gv, func in list(mod.functions.items()):
            if not isinstance(func, C.relax.Function):
                continue
            mine = {k: v for k, v in wanted.items() if k in signature_vars(func)}
            if mine:
                mod[gv] = func.with_attr(UPPER_BOUND_ATTR, {**upper_bounds_of(func), **mine})
        return mod

    return _annotate


def takes_element_aligned_args(target: C.Target) -> bool:
    """Whether ``element_aligned_args`` applies to ``target``: CPU code (a GPU's inputs are copied to the
    device anyway, and its vector loads keep TVM's alignment)."""
    return parse_target(target).kind.name in ("llvm", "c")


@C.module_pass(opt_level=0, name="tvmfuse.element_aligned_args")
def _element_aligned_args(mod, _ctx):
    """Each PrimFunc's buffer parameters aligned to their element size (C.with_element_aligned_params)."""
    for gv, func in list(mod.functions.items()):
        if isinstance(func, C.PrimFunc):
            new = C.with_element_aligned_params(func)
            if new is not func:
                mod[gv] = new
    return mod


def guarded(tvm_passes: list, name: str, own_passes: list = ()) -> C.ir_transform.Pass:
    """Run tvmfuse's ``own_passes``, then TVM's ``tvm_passes``; if TVM fails inside its passes, keep the
    module as it was before both, forget the groups recorded meanwhile, and record why.

    TVM's own FuseOps/FuseTIR still fail on some graphs (e.g. the shape functions of a dynamic strided
    slice); the model then compiles unfused instead of not at all, and the report says so.  Only TVM's
    error types are caught, and only around TVM's passes: an error in tvmfuse's own passes is a bug and
    propagates.
    """

    @C.module_pass(opt_level=0, name=f"tvmfuse.guarded.{name}")
    def _guarded(mod, _ctx):
        with Recorder() as step:
            staged = C.Sequential(list(own_passes), name=f"{name}.tvmfuse")(mod) if own_passes else mod
            try:
                return C.Sequential(tvm_passes, name=name)(staged)
            except C.TVM_PASS_ERRORS as e:
                first = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
                log.warning("%s failed (%s: %s); this module is compiled without it", name, type(e).__name__,
                            first)
                retract_groups({g["kernel"] for g in step.groups})
                record_refusal("<module>", "<module>", f"{name} failed inside TVM ({type(e).__name__}: {first}); "
                               "module left unfused", rule=name)
                return mod

    return _guarded


@C.module_pass(opt_level=0, name="tvmfuse.record_fuse_ops_groups")
def _record_fuse_ops_groups(mod, _ctx):
    """Record the groups TVM's FuseOps formed (tvmfuse's own grouping records its groups itself)."""
    for g in groups_in(mod):
        record_group(g["kernel"], g["ops"], g["rule"], g["outputs"])
    return mod


def fusion_passes(target: C.Target, options: PipelineOptions) -> list:
    """Grouping and FuseTIR as one guarded step: either both apply or the module stays unfused."""
    if not options.fusion:
        return [guarded([C.relax_transform.FuseOps(), _record_fuse_ops_groups]
                        + fuse_tir_passes(target, options), "fusion")]
    return [guarded(fuse_tir_passes(target, options), "fusion", own_passes=grouping_passes(target, options)),
            *reshape_view_passes()]


def reshape_view_passes() -> list:
    """A kernel left alone that only reshapes (a call_tir of a PrimFunc with TVM's reshape pattern: a
    symbolic GPT-2's attention output [batch, sequence, 768] -> [batch * sequence, 768] before its Gemm,
    which the static build's attention kernel writes flat) becomes ``R.reshape``, a view of its input
    without a copy.  TVM's dataflow lowering (RewriteDataflowReshape) does the same later; done here, the
    report counts the kernels that run and no schedule is made for a kernel that never does.  Then the
    PrimFuncs no call reads are dropped.  test_symbolic_token_models::test_reshape_kernel_becomes_a_view
    ``OutputReshapeView`` first: a reshape of a kernel's output bound to the function's result is bound to a
    dataflow var, which RewriteDataflowReshape rewrites (test_passes_conv1d::test_output_conv_takes_the_conv_template)"""
    from .passes.rewrites import OutputReshapeView

    return [OutputReshapeView(), C.relax_transform.RewriteDataflowReshape(), C.relax_transform.DeadCodeElimination()]


class Stages:
    """The stages of tvmfuse's pipeline for one target and one set of options, each a list of passes.

    compile(), explain, the tuner's task extraction, ``pipeline()`` and the benchmarks all take their
    passes from here; run them under the target (``with stages.target:``).
    """

    def __init__(self, target=None, options: PipelineOptions | None = None):
        self.target = parse_target(target)
        self.options = options if options is not None else PipelineOptions()

    def unfused(self) -> list:
        """Every op lowered to its own PrimFunc (one kernel per op): the baseline the report compares to."""
        return legalize_passes(self.target)

    def unfused_view(self) -> list:
        """``unfused`` for counting only (the report's and explain's baseline): without FoldConstant, which
        builds every call on constants with LLVM to run it (mobilenet_v2's batch-norm constants: 10 of its
        18 CPU seconds of compile); ``report.graph_stats(mod, fold_constant_calls=True)`` counts that module
        as FoldConstant would leave it (FoldConstant's result also drops the unused bindings: DCE here)."""
        return legalize_passes(self.target, fold_constants=False) + [C.relax_transform.DeadCodeElimination()]

    def graph(self) -> list:
        """Rewrites, legalization, then the fusion groups as fused (unscheduled) PrimFuncs."""
        return (pre_legalize_passes(self.target, self.options) + legalize_passes(self.target)
                + fusion_passes(self.target, self.options))

    def schedule(self) -> list:
        """Schedule every PrimFunc: a tuned record, else the target's template default, else the fallback."""
        return schedule_passes(self.target, self.options)

    def lower(self) -> list:
        """TVM's own dataflow lowering and VM finalization."""
        return lowering_passes(self.target, self.options)

    def dlight(self) -> list:
        """TVM's own schedule rules instead of tvmfuse's (the baseline a TVM user builds without tuning):
        ``dlight.ApplyDefaultSchedule`` with the rules TVM 0.27 ships for the target's family (CPU:
        ``cpu.GEMV``, ``cpu.Reduction``; a kernel neither matches keeps TVM's default loop nest; GPU:
        Matmul, GEMV, Reduction, GeneralReduction, Fallback)."""
        return [C.dlight.ApplyDefaultSchedule(*dlight_rules(self.target))]

    def all(self) -> list:
        return self.graph() + self.schedule() + self.lower()


def graph_stage(target: C.Target, options: PipelineOptions) -> list:
    return Stages(target, options).graph()


def _stages_pass(target, options: PipelineOptions, name: str, stages=Stages.all) -> C.ir_transform.Pass:
    """``stages`` of Stages as one named pass; without ``target``, the target tvm.compile enters."""
    fixed = parse_target(target) if target is not None else None

    @C.module_pass(opt_level=0, name=name)
    def _run(mod, _ctx):
        tgt = fixed or C.current_target() or parse_target(None)
        with tgt:
            return C.Sequential(stages(Stages(tgt, options)), name=f"{name}.stages")(mod)

    return _run


def pipeline(target=None, tuning_log: str | None = None, **option_overrides) -> C.ir_transform.Pass:
    """The whole tvmfuse Relax pipeline as one pass, for ``tvm.compile(..., relax_pipeline=...)``.

    ``target`` may be omitted: the pass then reads the target that tvm.compile enters (``with target:``).
    """
    options = replace(PipelineOptions(tuning_log=tuning_log), **option_overrides)
    return _stages_pass(target, options, "tvmfuse.pipeline")


def stock_pipeline(target=None) -> C.ir_transform.Pass:
    """TVM's own fusion (LegalizeOps + FuseOps + FuseTIR) with no schedule (TVM's default loop nests on a
    CPU): how much fusion alone gives; no one deploys it on a CPU (``dlight_pipeline`` is TVM's untuned route)."""
    return pipeline(target, fusion=False, schedules=False, fast_math=False, element_aligned_args=False)


def dlight_rules(target: C.Target) -> list:
    """dlight's rules for ``target`` as TVM ships them (``tvm.s_tir.dlight.cpu`` / ``.gpu``)."""
    if is_gpu(target):
        from .schedules.cuda.fallback import dlight_rules as gpu_rules

        return gpu_rules()
    return [C.dlight.cpu.GEMV(), C.dlight.cpu.Reduction()]


def dlight_pipeline(target=None) -> C.ir_transform.Pass:
    """TVM's own fusion (LegalizeOps + FuseOps + FuseTIR), every kernel then scheduled by dlight's rules for
    the target (``Stages.dlight``), then TVM's lowering: what a TVM user deploys without tuning."""
    options = PipelineOptions(fusion=False, schedules=False, fast_math=False, element_aligned_args=False)
    return _stages_pass(target, options, "tvmfuse.dlight_pipeline",
                        lambda st: st.graph() + st.dlight() + st.lower())


def register() -> None:
    """Make ``tvm.compile(mod, target, relax_pipeline="tvmfuse")`` work (TVM calls it with no arguments)."""
    C.register_relax_pipeline("tvmfuse", lambda **kw: pipeline(None, **kw))


@C.module_pass(opt_level=0, name="tvmfuse.share_symbolic_storage")
def _share_symbolic_storage(mod, _ctx):
    """The tensors a Relax function allocates in storages of symbolic size (``alloc_storage(R.shape([8192 *
    batch]))``) re-planned: tensors whose lifetimes do not overlap share a storage, sized the largest of
    them (provably, for any size of the symbols; else their ``max``).

    Why: TVM's StaticPlanBlockMemory reuses a storage of symbolic size only for a tensor of *equal* size
    expression, so a CNN over a symbolic batch, whose activations shrink stage by stage (``32768 * batch``,
    ``8192 * batch``, ... bytes), allocates a storage per distinct size every call: 15 ``alloc_storage`` per
    call of resnet18_dyn and 35 of mobilenet_v3_small_dyn against 5 and 7 in their static builds (4 and 5
    after this pass; tests/test_symbolic_storage.py, benchmarks/notes/symcnn8.md).  Runs after the planning
    (StaticPlanBlockMemory, LowerAllocTensor), before KillAfterLastUse.  Conservative: a storage's tensors
    are re-planned only when the storage is used by nothing but ``memory.alloc_tensor`` bindings of its
    binding block, none of its tensors (or anything that may alias them: every binding that reads one,
    except a kernel call, which writes its outputs in place and returns nothing; a field read from a kernel's
    output tuple aliases that field's tensor only) reaches a later block or
    the function's result, and its size reads only the function signature's symbolic dims."""
    kernels = {gv for gv, f in mod.functions.items() if isinstance(f, C.PrimFunc)}
    for gv, func in list(mod.functions.items()):
        if isinstance(func, C.relax.Function) and isinstance(func.body, C.relax.SeqExpr):
            body = _shared_storage_body(func, kernels)
            if body is not None:
                mod[gv] = C.relax.Function(func.params, body, C.ret_type(func), func.is_pure, func.attrs,
                                           func.span)
    return mod


def _op_name(value) -> str | None:
    return getattr(value.op, "name", None) if isinstance(value, C.relax.Call) else None


def _symbolic_storage(binding, signature_vars: set):
    """(size, group key) of a top-level ``memory.alloc_storage`` binding sized by an expression of the
    signature's symbolic dims; None for any other binding (constant sizes are TVM's own planning)."""
    value = binding.value if isinstance(binding, C.relax.VarBinding) else None
    if _op_name(value) != "relax.memory.alloc_storage" or not isinstance(value.args[0], C.relax.ShapeExpr):
        return None
    (size,) = value.args[0].values
    if isinstance(size, C.IntImm):
        return None
    names = []
    C.post_order_visit(size, lambda n: names.append(n) if isinstance(n, C.Var) else None)
    if not names or any(v not in signature_vars for v in names):
        return None
    return size, tuple(str(a) for a in value.args[1:])


def _shared_storage_body(func, kernels):
    """``func``'s body with its symbolic storages shared (``_share_symbolic_storage``); None if unchanged."""
    signature_vars = set()
    for p in func.params:
        signature_vars.update(C.relax.analysis.definable_tir_vars_in_type(C.type_of(p)))
    if not signature_vars:
        return None
    seq = func.body
    blocks, changed = [], False
    later_free: list[set] = []          # the relax vars read after each block (later blocks and the result)
    free = set(C.relax_free_vars(seq.body))
    for block in reversed(seq.blocks):
        later_free.append(set(free))
        for b in block.bindings:
            free.update(C.relax_free_vars(b.value))
    later_free.reverse()
    for block, after in zip(seq.blocks, later_free):
        new = _share_block_storage(list(block.bindings), after, signature_vars, kernels)
        changed |= new is not None
        blocks.append(block if new is None else type(block)(new))
    return C.relax.SeqExpr(blocks, seq.body, seq.span) if changed else None


def _share_block_storage(bindings, read_after: set, signature_vars: set, kernels):
    """One binding block's ``bindings`` with its symbolic storages' tensors re-planned: each tensor (a
    ``memory.alloc_tensor`` of a symbolic storage) live from its allocation to the last binding reading it
    (or anything that may alias it), tensors assigned greedily in order to shared storages free by then,
    each shared storage allocated before its first tensor.  None if nothing changes."""
    storages = {}                     # storage var -> (size, key)
    tensors = {}                      # alloc_tensor binding index -> its storage var
    aliases: dict = {}                # var -> the tensors (binding indices) whose memory it may hold
    fields: dict = {}                 # tuple var -> the aliases of each of its fields
    last: dict = {}                   # tensor -> index of the last binding reading its memory
    pinned: set = set()               # storages left as they are
    for i, b in enumerate(bindings):
        found = _symbolic_storage(b, signature_vars)
        if found is not None:
            storages[b.var] = found
            continue
        read = C.relax_free_vars(b.value)
        value = b.value
        if _op_name(value) == "relax.memory.alloc_tensor" and value.args[0] in storages:
            read = [v for v in read if not v.same_as(value.args[0])]
            tensors[i] = value.args[0]
            aliases[b.var] = {i}
            last[i] = i
        held = set()
        for v in read:
            if v in storages:
                pinned.add(v)                        # a storage var used some other way
            held |= aliases.get(v, set())
        for t in held:
            last[t] = i
        is_kernel_call = isinstance(value, C.relax.Call) and value.op in kernels
        if held and not is_kernel_call:
            aliases[b.var] = aliases.get(b.var, set()) | held
        if isinstance(value, C.relax.Tuple):
            fields[b.var] = [set(aliases.get(f, set())) if isinstance(f, C.relax.Var) else held
                             for f in value.fields]
        elif isinstance(value, C.relax.TupleGetItem) and value.tuple_value in fields:
            # a field of a kernel's output tuple holds that field's memory only, not its siblings' (without
            # this, reading one output kept every output of the kernel alive: llama_dyn, 11 storages)
            aliases[b.var] = set(fields[value.tuple_value][value.index])
    for v in read_after:
        pinned |= {tensors[t] for t in aliases.get(v, set())} | ({v} if v in storages else set())
    units = sorted(t for t, s in tensors.items() if s not in pinned)
    moved = {tensors[t] for t in units}
    if len(units) < 2:
        return None
    ana = C.Analyzer()
    for v in signature_vars:
        ana.update(v, C.ConstIntBound(0, C.ConstIntBound.POS_INF), True)
    pools: list[dict] = []           # {"first": tensor index, "size", "key", "end"}
    pool_of = {}                     # tensor -> its pool
    for t in units:
        size, key = storages[tensors[t]]
        free = [p for p in pools if p["key"] == key and p["end"] < t]
        if not free:
            pools.append({"first": t, "size": size, "key": key, "end": last[t]})
            pool_of[t] = pools[-1]
            continue
        fits = [p for p in free if ana.can_prove(size <= p["size"])]
        pool = fits[0] if fits else free[-1]
        if not fits:
            pool["size"] = size if ana.can_prove(pool["size"] <= size) else C.tirx.max(pool["size"], size)
        pool["end"] = last[t]
        pool_of[t] = pool
    if len(pools) >= len(moved):
        return None                  # no fewer storages than TVM's plan
    out = []
    for i, b in enumerate(bindings):
        if b.var in moved:
            continue
        if i in pool_of:
            pool, value = pool_of[i], b.value
            if pool["first"] == i:
                proto = bindings[[j for j, c in enumerate(bindings) if c.var.same_as(tensors[i])][0]]
                pool["var"] = C.relax.Var(f"shared_storage{len(out)}", C.type_of(proto.var))
                alloc = proto.value
                out.append(C.relax.VarBinding(pool["var"], C.relax.Call(
                    alloc.op, [C.relax.ShapeExpr([pool["size"]]), *alloc.args[1:]], alloc.attrs, alloc.ty_args,
                    alloc.span)))
            b = C.relax.VarBinding(b.var, C.relax.Call(value.op, [pool["var"], *value.args[1:]], value.attrs,
                                                       value.ty_args, value.span), b.span)
        out.append(b)
    return out
