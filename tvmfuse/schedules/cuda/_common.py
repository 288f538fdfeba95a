"""What the CUDA templates share: per-architecture numbers (``ARCHS``), the family base ``CudaTemplate``
(gated on cuda, matched on ``analysis.block_graph``), what ``accepts`` asks of a graph-level group
(``group_anchor``), and the steps every family takes: inline the elementwise glue, tile a contraction and
bind its tile (``tile_contraction``, ``bind_tile``, ``bind``), accumulate in registers with the epilogue
on them (``accumulate_in_registers``), stage an operand or a padded window cooperatively in shared memory
(``stage_window``, ``stage_cooperatively``), flatten an elementwise block onto threads and vectors.

Matching is by structure (iteration kinds, access patterns, who reads whom), never by block names:
the names come from legalization and change with the graph passes.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION, BlockGraph, BlockNode, GroupInfo, block_graph, const_int
from ..base import Match, Template

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
    attn_rows: int = 64            # query rows (one thread each) per block of the attention kernel
    attn_k_block: int = 32         # keys per online-softmax step of the attention kernel (K/V tiles in shared)


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


# --------------------------------------------------------------------------- matching
class CudaTemplate(Template):
    """A CUDA family: gated on the cuda target kind, matched on the kernel's block graph.  A subclass
    names itself in the class line: ``class CudaMatmul(CudaTemplate, family=..., config=MatmulConfig)``."""

    target_kinds = ("cuda",)

    def __init_subclass__(cls, family: str = "", config: type | None = None, **kw):
        super().__init_subclass__(**kw)
        cls.family, cls.config_type = family, config

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        g = block_graph(func)
        return None if g is None else self.match_graph(g, func, target)

    def match_graph(self, g: BlockGraph, func: C.PrimFunc, target: C.Target) -> Match | None:
        raise NotImplementedError


def single_anchor(g: BlockGraph | None) -> BlockNode | None:
    """The one reduction block of a kernel whose other blocks are all spatial (its epilogue and glue);
    None for any other kernel (or no block graph)."""
    if g is None:
        return None
    reds = [b for b in g.blocks if "R" in b.kinds]
    if len(reds) != 1 or not all(b.is_spatial for b in g.blocks if b is not reds[0]):
        return None
    return reds[0]


def group_anchor(group: GroupInfo) -> tuple[BlockGraph | None, BlockNode | None, str | None]:
    """For ``accepts``: (block graph of the anchor op's PrimFunc, its anchor block, None) when a graph-level
    group has static shapes, one matmul/conv anchor and no row reduction; else (None, None, why not)."""
    if not group.is_static():
        return None, None, "symbolic extents (the CUDA templates are built for static shapes)"
    anchors = group.of_kind(CONTRACTION)
    if len(anchors) != 1:
        return None, None, f"{len(anchors)} matmul/conv anchors (this family tiles one)"
    if group.of_kind(REDUCTION):
        return None, None, "a row reduction beside the anchor"
    g = block_graph(anchors[0].func)
    anchor = single_anchor(g)
    if anchor is None:
        return None, None, f"{anchors[0].name} is not one reduction block with spatial glue"
    return g, anchor, None


def data_producer(g: BlockGraph, block: BlockNode, data) -> str | None:
    """The block of the kernel that writes the buffer of load ``data`` (a conv's padding), else None."""
    producer = [p for p in g.producers[block.name] if any(w.same_as(data.source) for w in g.by_name(p).writes)]
    return producer[0] if producer else None


# --------------------------------------------------------------------------- schedule moves
def inline_glue(sch: C.Schedule, names: list[str], keep: set[str]) -> list[str]:
    """Inline every block of ``names`` not in ``keep`` into its consumers (or, failing that, into its
    producer); returns the blocks left standing, in program order.  A block that neither inlining
    accepts (it writes an output read by another block, say) stays and is scheduled on its own."""
    standing = list(names)
    # last block first into its consumers; then, second chance in program order, epilogue blocks that
    # are outputs fold into their single producer (each pass reverses the order: program order at the end)
    for move in (sch.compute_inline, sch.reverse_compute_inline):
        standing = [n for n in reversed(standing) if n in keep or not _try(lambda n=n: move(sch.get_sblock(n)))]
    return standing


def _try(move) -> bool:
    """Run one schedule primitive; False when TVM rejects it as not applicable (ScheduleError)."""
    try:
        move()
        return True
    except C.ScheduleError:
        return False


def fuse_all(sch: C.Schedule, loops):
    """One loop over ``loops`` (the loop itself when there is one)."""
    return sch.fuse(*loops) if len(loops) > 1 else loops[0]


def bind(sch: C.Schedule, **loops) -> None:
    """Bind each loop to the thread axis named by its keyword (``blockIdx_x=bx, threadIdx_y=ty``)."""
    for axis, loop in loops.items():
        sch.bind(loop, axis.replace("_", "."))


def has_bool_buffer(g: BlockGraph) -> bool:
    """Whether any block of the kernel reads or writes a bool buffer (TVM 0.27's CUDA codegen cannot
    vectorize those: ``cuda_elementwise`` keeps such kernels scalar)."""
    return any(str(getattr(getattr(buf, "ty", None), "dtype", "")) == "bool"
               for b in g.blocks for buf in list(b.reads) + list(b.writes))


def bind_elementwise(sch: C.Schedule, name: str, threads: int, vec: int):
    """Fuse the loops of one spatial block, split into (blocks, threads, vector lanes), bind, vectorize."""
    blk = sch.get_sblock(name)
    loops = sch.get_loops(blk)
    fused = fuse_all(sch, loops or [sch.add_unit_loop(blk)])
    total = const_int(sch.get(fused).extent)
    if total is not None and total % vec:
        vec = 1
    if vec > 1:
        bx, tx, v = sch.split(fused, [None, threads, vec], preserve_unit_iters=True)
        sch.vectorize(v)
    else:
        bx, tx = sch.split(fused, [None, threads], preserve_unit_iters=True)
    bind(sch, blockIdx_x=bx, threadIdx_x=tx)


def tile_contraction(sch: C.Schedule, block, nb: int, tm: int, tn: int, um: int, un: int, tile_k: int) -> tuple:
    """A (batch.., i, j, k) contraction's output tile: (batch) x (by, ty, ui) x (bx, tx, uj), k -> (ko, ki),
    reordered so that each thread's ``um x un`` register tile is innermost; returns (batch, by, bx, ty, tx, ko)
    unbound (siblings merge them first)."""
    loops = sch.get_loops(block)
    batch = (sch.fuse(*loops[:nb]) if nb > 1 else loops[0]) if nb else sch.add_unit_loop(loops[0])
    i, j, k = loops[nb], loops[nb + 1], loops[nb + 2]
    by, ty, ui = sch.split(i, [None, tm, um], preserve_unit_iters=True)
    bx, tx, uj = sch.split(j, [None, tn, un], preserve_unit_iters=True)
    ko, ki = sch.split(k, [None, tile_k], preserve_unit_iters=True)
    sch.reorder(batch, by, bx, ty, tx, ko, ki, ui, uj)
    return batch, by, bx, ty, tx, ko


def bind_tile(sch: C.Schedule, batch, by, bx, ty, tx) -> None:
    """The grid (batch -> blockIdx.z, tile rows/cols -> blockIdx.y/x) and the block's 2-D threads."""
    bind(sch, blockIdx_z=batch, blockIdx_y=by, blockIdx_x=bx, threadIdx_y=ty, threadIdx_x=tx)


def accumulate_in_registers(sch: C.Schedule, anchor, epilogue: list[str], at) -> None:
    """The anchor's accumulator in registers: its epilogue blocks (or, with none, a plain store) run per
    thread under loop ``at`` on the registers, so the only global write is the final output."""
    if epilogue:
        for name in epilogue:
            sch.reverse_compute_at(sch.get_sblock(name), at, preserve_unit_loops=True)
        sch.set_scope(anchor, 0, "local")
    else:
        store_in_registers(sch, anchor, at)


def store_in_registers(sch: C.Schedule, anchor, at) -> None:
    """The anchor accumulates in a register copy, stored to its output under loop ``at``."""
    store = sch.cache_write(anchor, 0, "local")
    sch.reverse_compute_at(store, at, preserve_unit_loops=True)


def stage_window(sch: C.Schedule, anchor, pad: str | None, operand: int, at):
    """A conv's input window in shared memory under loop ``at``: the padding block itself (the padding is
    computed while staging, no padded copy in global memory) or, without one, a copy of the operand."""
    if pad:
        data = sch.get_sblock(pad)
        # shared before compute_at: compute_at sizes the staged region by the buffer's scope (a shared
        # buffer covers every thread of the block; a global one only the thread's own window, which the
        # block's threads then load cooperatively: each element staged once, most never)
        sch.set_scope(data, 0, "shared")
        sch.compute_at(data, at, preserve_unit_loops=True)
        return data
    data = sch.cache_read(anchor, operand, "shared", consumer_blocks=[anchor])
    sch.compute_at(data, at, preserve_unit_loops=True)
    return data


def stage_cooperatively(sch: C.Schedule, stage, outer: int, ty: int, tx: int, vec: int | None = None) -> None:
    """All threads of the block load one stage: its loops below the first ``outer`` fused, split over
    (threadIdx.y, threadIdx.x) and, given ``vec``, ``vec``-lane vectors."""
    fused = fuse_all(sch, sch.get_loops(stage)[outer:])
    if vec is not None:
        _, cty, ctx, cv = sch.split(fused, [None, ty, tx, vec], preserve_unit_iters=True)
        sch.vectorize(cv)
    else:
        _, cty, ctx = sch.split(fused, [None, ty, tx], preserve_unit_iters=True)
    bind(sch, threadIdx_y=cty, threadIdx_x=ctx)


# --------------------------------------------------------------------------- choices
def blocks_of_tile(m: int, n: int, tile_m: int, tile_n: int) -> int:
    """Thread blocks covering an ``m x n`` output with ``tile_m x tile_n`` tiles."""
    return (-(-m // tile_m)) * (-(-n // tile_n))


def pow2_upto(lo: int, hi: int) -> list[int]:
    out, x = [], lo
    while x <= hi:
        out.append(x)
        x *= 2
    return out


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
    post = C.meta_schedule.postproc.VerifyGPUCode()
    # a bare context: TuneContext() would first import MetaSchedule's tensor intrinsics (30-40 s once per
    # process), which the check never uses
    post._initialize_with_tune_context(C.bare_tune_context(target, sch.mod, "tvmfuse.schedules.cuda"))
    return bool(post.apply(sch))
