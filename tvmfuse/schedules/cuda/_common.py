"""What the CUDA templates share: per-architecture numbers, the block graph of a PrimFunc, and the few
schedule moves every family makes (inline the elementwise glue, bind a loop nest to threads).

Matching is by structure (iteration kinds, access patterns, who reads whom), never by block names:
the names come from legalization and change with the graph passes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C

WARP = 32


# --------------------------------------------------------------------------- per-architecture numbers
@dataclass(frozen=True)
class CudaArch:
    """The numbers a CUDA template derives its untuned defaults and its legal choices from."""

    name: str
    sm_count: int
    max_threads_per_block: int
    max_shared_bytes: int          # static shared memory per block (no opt-in): what the kernels may use
    regs_per_thread: int           # register budget per thread the defaults aim to stay under
    # untuned defaults (each is clamped to the workload's legal choices)
    mm_threads: tuple[int, int]    # threads per block along (rows, cols) of the output tile
    mm_micro: tuple[int, int]      # outputs per thread along (rows, cols): the register tile
    mm_tile_k: int                 # reduction slice staged in shared memory per step
    mm_vec: int                    # lanes of the global->shared loads
    red_threads: int               # threads cooperating on one row of a row reduction
    ew_threads: int                # threads per block of an elementwise kernel
    ew_vec: int                    # lanes of the elementwise loads/stores (4 x fp32 = 128-bit)
    dw_threads: int = 128          # threads per block of a depthwise conv (pixels x channel planes)
    dw_micro: int = 2              # output pixels per thread of a depthwise conv (weights reused over them)


ARCHS = {
    # A100: 108 SMs, 48 KB static shared memory per block (164 KB with opt-in), 64K regs/SM
    "sm_80": CudaArch("sm_80", 108, 1024, 48 * 1024, 128, (16, 16), (4, 4), 16, 4, 256, 256, 4,
                      dw_threads=128, dw_micro=2),
    # H100/H200: 132 SMs, 48 KB static (227 KB opt-in); more SMs: prefer smaller tiles for more blocks
    # depthwise: 4 pixels per thread on sm_90 (its higher DRAM bandwidth per SM makes the weight loads
    # per output the cost to amortize); an unmeasured guess, as every default here until a GPU tunes it
    "sm_90": CudaArch("sm_90", 132, 1024, 48 * 1024, 128, (16, 16), (4, 4), 32, 4, 256, 256, 4,
                      dw_threads=128, dw_micro=4),
}


def arch_of(target: C.Target) -> CudaArch:
    """The target's ``arch`` (sm_XY); an unknown one takes the newest known arch not newer than it."""
    arch = str(target.attrs["arch"]) if "arch" in target.attrs else "sm_80"
    if arch in ARCHS:
        return ARCHS[arch]
    try:
        num = int(arch.split("_")[1].rstrip("a"))
    except (IndexError, ValueError):
        raise ValueError(f"cuda target arch {arch!r} is not of the form sm_XY") from None
    known = sorted((int(k.split("_")[1]), k) for k in ARCHS)
    older = [k for n, k in known if n <= num]
    return ARCHS[older[-1] if older else known[0][1]]


# --------------------------------------------------------------------------- the block graph
@dataclass
class BlockNode:
    """One block under the root, as far as the templates care."""

    name: str
    kinds: str                     # one letter per iter var: S spatial, R reduction, O other
    extents: tuple[int, ...]       # per iter var
    reads: list                    # buffers read (not counting its own output)
    writes: list                   # buffers written
    is_output: bool                # writes a buffer of the function's signature
    stmt: object                   # the SBlock

    @property
    def is_spatial(self) -> bool:
        return set(self.kinds) == {"S"} or self.kinds == ""

    @property
    def is_reduction(self) -> bool:
        return "R" in self.kinds and "O" not in self.kinds


@dataclass
class BlockGraph:
    blocks: list[BlockNode]        # in program order
    producers: dict                # block name -> names of blocks whose output it reads
    consumers: dict                # block name -> names of blocks reading its output

    def by_name(self, name: str) -> BlockNode:
        return next(b for b in self.blocks if b.name == name)

    @property
    def outputs(self) -> list[BlockNode]:
        return [b for b in self.blocks if b.is_output]

    def ancestors(self, name: str) -> set[str]:
        seen, todo = set(), [name]
        while todo:
            for p in self.producers[todo.pop()]:
                if p not in seen:
                    seen.add(p)
                    todo.append(p)
        return seen

    def components(self) -> list[list[str]]:
        """Blocks connected through intermediates (shared function inputs do not connect)."""
        comp: dict[str, int] = {}
        groups: list[list[str]] = []
        for b in self.blocks:
            if b.name in comp:
                continue
            idx, todo = len(groups), [b.name]
            groups.append([])
            comp[b.name] = idx
            while todo:
                n = todo.pop()
                groups[idx].append(n)
                for m in list(self.producers[n]) + list(self.consumers[n]):
                    if m not in comp:
                        comp[m] = idx
                        todo.append(m)
        order = {b.name: i for i, b in enumerate(self.blocks)}
        return [sorted(g, key=order.get) for g in groups]


def _int(x) -> int | None:
    return int(x.value) if isinstance(x, C.IntImm) else None


def block_graph(func: C.PrimFunc) -> BlockGraph | None:
    """The root's child blocks of ``func`` with their producers/consumers; None if the function is not a
    flat list of static-shaped blocks under one root (already scheduled, opaque, or dynamic shapes)."""
    sch = C.Schedule(func)
    root = func.body
    if not isinstance(root, C.SBlockRealize):
        return None
    local = list(root.block.alloc_buffers)      # everything else a block writes is an output
    blocks: list[BlockNode] = []
    for rv in sch.get_child_blocks(sch.get_sblock(root.block.name_hint)):
        blk = sch.get(rv)
        loops = sch.get_loops(rv)
        if len(loops) != len(blk.iter_vars) and blk.iter_vars:
            return None
        kinds, extents = "", []
        for iv in blk.iter_vars:
            ext = _int(iv.dom.extent)
            if ext is None:
                return None
            kinds += {C.IterVarKind.DataPar: "S", C.IterVarKind.CommReduce: "R"}.get(int(iv.iter_type), "O")
            extents.append(ext)
        writes = [w.source for w in blk.writes]
        reads = [r.source for r in blk.reads if not any(r.source.same_as(w) for w in writes)]
        is_out = any(not any(w.same_as(b) for b in local) for w in writes)
        blocks.append(BlockNode(str(blk.name_hint), kinds, tuple(extents), reads, writes, is_out, blk))
    producers = {b.name: [] for b in blocks}
    consumers = {b.name: [] for b in blocks}
    for b in blocks:
        for other in blocks:
            if other is b:
                continue
            if any(any(r.same_as(w) for w in other.writes) for r in b.reads):
                producers[b.name].append(other.name)
                consumers[other.name].append(b.name)
    return BlockGraph(blocks, producers, consumers)


# --------------------------------------------------------------------------- access-pattern helpers
def index_vars(indices) -> list[set]:
    """For each index expression of an access, the block iter vars it uses."""
    out = []
    for e in indices:
        vs = set()
        C.post_order_visit(e, lambda n, vs=vs: vs.add(n) if isinstance(n, C.Var) else None)
        out.append(vs)
    return out


def buffer_loads(expr) -> list:
    found = []
    C.post_order_visit(expr, lambda n: found.append(n) if isinstance(n, C.TensorLoad) else None)
    return found


def multiply_accumulate(block) -> tuple | None:
    """``out[...] = out[...] + a[...] * b[...]`` (operands possibly cast): the two loads, else None."""
    body = block.body
    if not isinstance(body, C.BufferStore) or block.init is None:
        return None
    val = body.value
    if not isinstance(val, C.Add):
        return None
    lhs, rhs = val.a, val.b
    if isinstance(rhs, C.TensorLoad) and rhs.source.same_as(body.buffer):
        lhs, rhs = rhs, lhs
    if not (isinstance(lhs, C.TensorLoad) and lhs.source.same_as(body.buffer)):
        return None
    if not isinstance(rhs, C.Mul):
        return None
    ops = []
    for side in (rhs.a, rhs.b):
        while isinstance(side, C.Cast):
            side = side.value
        if not isinstance(side, C.TensorLoad):
            return None
        ops.append(side)
    return ops[0], ops[1]


# --------------------------------------------------------------------------- schedule moves
def inline_glue(sch: C.Schedule, names: list[str], keep: set[str]) -> list[str]:
    """Inline every block of ``names`` not in ``keep`` into its consumers (or, failing that, into its
    producer); returns the blocks left standing, in program order.  A block that neither inlining
    accepts (it writes an output read by another block, say) stays and is scheduled on its own."""
    left = []
    for name in reversed(names):
        if name in keep:
            left.append(name)
            continue
        blk = sch.get_sblock(name)
        if _try(lambda: sch.compute_inline(blk)):
            continue
        left.append(name)
    # second chance: epilogue blocks that are outputs fold into their single producer
    final = []
    for name in reversed(left):
        if name in keep:
            final.append(name)
            continue
        blk = sch.get_sblock(name)
        if _try(lambda: sch.reverse_compute_inline(blk)):
            continue
        final.append(name)
    return final


def _try(move) -> bool:
    """Run one schedule primitive; False when TVM rejects it as not applicable (ScheduleError)."""
    try:
        move()
        return True
    except C.ScheduleError:
        return False


def bind_elementwise(sch: C.Schedule, name: str, threads: int, vec: int, max_blocks: int = 1 << 30):
    """Fuse the loops of one spatial block, split into (blocks, threads, vector lanes), bind, vectorize."""
    blk = sch.get_sblock(name)
    loops = sch.get_loops(blk)
    if not loops:
        loops = [sch.add_unit_loop(blk)]
    fused = sch.fuse(*loops) if len(loops) > 1 else loops[0]
    total = _int(sch.get(fused).extent)
    if total is not None and total % vec:
        vec = 1
    if vec > 1:
        bx, tx, v = sch.split(fused, [None, threads, vec], preserve_unit_iters=True)
        sch.vectorize(v)
    else:
        bx, tx = sch.split(fused, [None, threads], preserve_unit_iters=True)
    sch.bind(bx, "blockIdx.x")
    sch.bind(tx, "threadIdx.x")


def pow2_upto(lo: int, hi: int) -> list[int]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return out


def nearest(choices, want):
    """The choice closest to ``want`` (ties: the smaller); defaults must be legal choices."""
    return min(choices, key=lambda c: (abs(c - want), c))


def divisors_among(n: int, cands) -> list[int]:
    return [c for c in cands if n % c == 0]


def verification_target(target: C.Target) -> C.Target:
    """The cuda target with the limits TVM's GPU code verification checks (threads per block, static
    shared memory per block), taken from the arch's numbers when the target does not state them."""
    arch = arch_of(target)
    spec = {"kind": "cuda", "arch": arch.name,
            "max_shared_memory_per_block": int(target.attrs.get("max_shared_memory_per_block",
                                                                arch.max_shared_bytes)),
            "max_threads_per_block": int(target.attrs.get("max_threads_per_block", arch.max_threads_per_block)),
            "thread_warp_size": WARP}
    return C.Target(spec)


def verify_gpu_schedule(sch: C.Schedule, target: C.Target) -> bool:
    """MetaSchedule's VerifyGPUCode check of a scheduled function (threads per block, shared memory,
    vector bytes), after the same lowering it applies when tuning."""
    ms = C.meta_schedule
    post = ms.postproc.VerifyGPUCode()
    post._initialize_with_tune_context(ms.TuneContext(mod=sch.mod, target=target))
    return bool(post.apply(sch))
