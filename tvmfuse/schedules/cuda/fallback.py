"""The last resort of a GPU kernel no template scheduled: nothing unscheduled, ever, and always legal.

``schedule_fallback`` tries dlight's generic GPU rules one at a time, in ``RULES`` order, and keeps the
first result that TVM's TIR lowering accepts (``lowers``: the lowering passes without code generation, so
no nvcc run).  A dlight rule may misjudge a kernel (it raises, or its schedule fails to lower); when every
rule fails, ``serial_schedule`` runs each root block in a launch of one thread: slow, but legal for any
kernel (symbolic or non-divisible extents, reductions over any axes, several outputs) because it neither
splits, reorders nor moves a loop, and puts no buffer in shared memory.  The record says which one
scheduled the kernel and why the others did not.
"""
from __future__ import annotations

from ... import _compat as C


def dlight_rules() -> list:
    """dlight's GPU rules, most specific first; ``Fallback`` (a thread per output element) applies to
    almost any kernel, ``serial_schedule`` answers the rest."""
    dl = C.dlight
    return [dl.gpu.Matmul(), dl.gpu.GEMV(), dl.gpu.Reduction(), dl.gpu.GeneralReduction(), dl.gpu.Fallback()]


def lowering_error(func: C.PrimFunc, target: C.Target) -> str | None:
    """None when ``func`` (scheduled) goes through TVM's TIR lowering for ``target`` and fits the block's
    shared memory, else the first line of the error: a block under no thread binding (TVM would lower it
    as host code), a loop variable used before its definition, a shared-memory stage over the limit, ..."""
    outside = unbound_blocks(func)
    if outside:         # TVM lowers such a block as host code, which reads device memory: not legal
        return f"blocks {outside} are under no thread binding"
    why = scratch_read_before_write(func) or stale_thread_index(func)
    if why:             # TVM lowers both silently into kernels that compute wrong numbers
        return why
    mod = C.IRModule({"main": func.with_attr("global_symbol", "main")})
    try:
        lowered = C.lower_tir(mod, target)
    except C.TVM_PASS_ERRORS as e:
        return _first_line(e)
    return shared_memory_error(lowered, target)


def shared_memory_error(lowered: C.IRModule, target: C.Target) -> str | None:
    """None when every kernel of the lowered module allocates at most the block's static shared memory
    (the target's ``max_shared_memory_per_block``, else the arch's), else which kernel asks for how much:
    such a kernel lowers and generates code, but ptxas rejects it, or, built as PTX, it fails at launch."""
    from ._common import verification_target

    limit = int(verification_target(target).attrs["max_shared_memory_per_block"])
    for gv, f in lowered.functions.items():
        used = int(C.allocated_bytes(f).get("main", {}).get("shared", 0))
        if used > limit:
            return f"kernel {gv.name_hint} uses {used} bytes of shared memory per block, the limit is {limit}"
    return None


SCRATCH_SCOPES = ("local", "shared", "shared.dyn", "warp")


def _blocks_in_order(func: C.PrimFunc, visit) -> None:
    """Call ``visit(block, loops)`` for every block of ``func`` (the root aside) in program order, with
    the loops around it, outermost first."""
    def walk(stmt, loops: list) -> None:
        if isinstance(stmt, C.tirx.SeqStmt):
            for s in stmt.seq:
                walk(s, loops)
        elif isinstance(stmt, C.tirx.For):
            walk(stmt.body, loops + [stmt])
        elif isinstance(stmt, C.SBlockRealize):
            walk(stmt.block, loops)
            if stmt.block.name_hint != "root":
                visit(stmt, loops)
        elif isinstance(stmt, C.SBlock):
            walk(stmt.body, loops)
        elif isinstance(stmt, C.tirx.IfThenElse):
            walk(stmt.then_case, loops)
            if stmt.else_case is not None:
                walk(stmt.else_case, loops)
        elif hasattr(stmt, "body"):
            walk(stmt.body, loops)

    walk(func.body, [])


def scratch_read_before_write(func: C.PrimFunc) -> str | None:
    """A block reading a register / shared-memory buffer that no block before it (in program order) wrote:
    the value read is whatever the memory held (seen on a GPU: the sibling-matmul template stored its
    accumulators ahead of the k loop). A buffer the block itself writes is not counted (a reduction's init,
    or a block built in TIR whose body fills and reads it)."""
    written: set = set()
    found: list[str] = []

    def visit(realize, _loops) -> None:
        block = realize.block
        own = {C.region_tensor(w) for w in block.writes}
        for r in block.reads:
            buf = C.region_tensor(r)
            if buf.scope() in SCRATCH_SCOPES and buf not in written and buf not in own and not found:
                found.append(f"block {block.name_hint} reads {buf.scope()} buffer {C.var_name(buf)} before any "
                             "block writes it")
        written.update(C.region_tensor(w) for w in block.writes)

    _blocks_in_order(func, visit)
    return found[0] if found else None


def stale_thread_index(func: C.PrimFunc) -> str | None:
    """A block under two loops bound to the same thread axis whose indices use the outer one. Lowering
    makes both the same thread index, so the block no longer computes what the loop nest says (seen on a
    GPU: a conv's padded window computed under a thread loop and then loaded by all threads, each
    thread loading one element of its own window instead of the block's window)."""
    found: list[str] = []

    def visit(realize, loops) -> None:
        tags: dict[str, list] = {}
        for lp in loops:
            if int(lp.kind) == int(C.ForKind.THREAD_BINDING) and lp.thread_binding is not None:
                tags.setdefault(str(lp.thread_binding.thread_tag), []).append(lp.loop_var)
        stale = {v for vs in tags.values() for v in vs[:-1]}
        if not stale or found:
            return
        used = set()
        for value in list(realize.iter_values) + [realize.predicate]:
            C.post_order_visit(value, lambda n: used.add(n) if isinstance(n, C.tirx.Var) else None)
        for v in stale:
            if v in used:
                found.append(f"block {realize.block.name_hint} indexes by {v.name}, a thread loop that a loop "
                             "inside it binds again")
                return

    _blocks_in_order(func, visit)
    return found[0] if found else None


def unbound_blocks(func: C.PrimFunc) -> list[str]:
    """The blocks of ``func`` (the root aside) under no loop bound to a thread axis, in program order
    (a block nested in such a block is listed too, before it)."""
    found: list[str] = []

    def visit(realize, loops) -> None:
        if not any(int(lp.kind) == int(C.ForKind.THREAD_BINDING) for lp in loops):
            found.append(str(realize.block.name_hint))

    _blocks_in_order(func, visit)
    return found


def serial_schedule(func: C.PrimFunc) -> C.PrimFunc:
    """Every block under the root in its own launch of one block of one thread (two unit loops bound to
    blockIdx.x and threadIdx.x above its loops): the loop nest as written, run by one thread."""
    sch = C.Schedule(func)
    root = sch.get_sblock(func.body.block.name_hint)
    for blk in sch.get_child_blocks(root):
        loops = sch.get_loops(blk)
        tx = sch.add_unit_loop(loops[0] if loops else blk)
        bx = sch.add_unit_loop(tx)
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
    return sch.mod["main"]


def schedule_fallback(func: C.PrimFunc, target: C.Target, rules: list | None = None) -> tuple[C.PrimFunc, str, str]:
    """(scheduled func with ``tirx.is_scheduled``, who scheduled it: ``"dlight.<Rule>"`` or ``"serial"``,
    why the rules before it did not: "" when the first that applied lowered).  Raises only when the serial
    schedule itself does not lower: a broken invariant of this module, named in the message."""
    notes = []
    for rule in (dlight_rules() if rules is None else rules):
        name = type(rule).__name__
        try:
            with target:
                done = C.dlight.ApplyDefaultSchedule(rule)(C.IRModule({"main": func}))["main"]
        except C.TVM_PASS_ERRORS + (AssertionError,) as e:   # a rule that misjudges the kernel (dlight
            # states its own preconditions as asserts): the next one is tried
            notes.append(f"dlight.{name} raised: {_first_line(e)}")
            continue
        if done.attrs is None or "tirx.is_scheduled" not in done.attrs:
            continue                       # the rule does not apply to this kernel
        why = lowering_error(done, target)
        if why is None:
            return done, f"dlight.{name}", "; ".join(notes)
        notes.append(f"dlight.{name} does not lower: {why}")
    done = serial_schedule(func).with_attr("tirx.is_scheduled", True)
    why = lowering_error(done, target)
    if why is not None:
        raise RuntimeError(f"the serial last-resort schedule does not lower ({why}): it must for any kernel")
    return done, "serial", "; ".join(notes) or "no dlight rule applies"


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    # TVM's messages end with the check that failed; Python ones start with it
    text = lines[-1] if lines and isinstance(e, C.InternalError) else (lines[0] if lines else type(e).__name__)
    return text[:200]
