"""MatMul / Dense / batch-matmul with its epilogue (bias, activation, residual) on x86/ARM CPUs.

Matches, after folding elementwise blocks, one reduction block ``C[b.., i, j] += A[.., i/k ..] * B[.., k/j ..]``
(one reduction axis ``k``; ``C``'s last two axes ``i, j``, ``i`` read by A only and ``j`` by B only; the
leading batch axes read by A only (activations [B, S, K] @ a shared weight), by both (A[b] @ B[b]) or
broadcast (a constant index on one operand)) followed by at most one elementwise epilogue block reading
``C`` at its own indices.

Schedule (register-blocked GEMM, BLIS-style): the epilogue block is tiled into macro tiles (``mc`` x ``nc``,
sized to L2) and micro tiles (``mr`` x ``nr``, sized to the vector registers); the matmul is computed at
the micro tile, so ``C`` shrinks to an ``mr x nr`` accumulator in registers and the epilogue (bias, GELU,
residual...) runs on it before anything is stored.  Optionally the B panel of a macro column is packed
contiguously once per macro tile.  When no register-tile width divides N, the j domain is padded
(``pad_n``: ``pad_einsum``, B's panel zero-padded per panel, C padded) so the register tile runs without a
per-lane predicate, which TVM's vectorizer would turn into scalar code.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION, epilogue_of, multiply_accumulate
from ...target import CPUInfo, cpu_info
from ..base import Config, Exclusion, KnobSpace, Match, knob
from . import common as U

MR_CHOICES = (1, 2, 3, 4, 5, 6, 7, 8)    # rows of the register tile (5, 7: M = 65, 49, 35 divide)
NVEC_CHOICES = (1, 2, 3, 4)              # vectors per row of the register tile (nr = nvec * lanes)
MC_TILES = (1, 2, 4, 8, 16, 32)          # register tiles per macro tile, along i
NC_TILES = (1, 2, 4, 8, 16)              # register tiles per macro tile, along j
K_UNROLL = (1, 2, 4, 8)
ORDERS = ("ij", "ji")                    # macro loop order: i outer (A panel reuse) or j outer (B panel)
PARALLEL_DEPTH = (1, 2)                  # how many macro loops are fused into the parallel loop
# A register tile that divides M is preferred if it keeps at least this fraction of the accumulators of
# the largest tile that fits (below that, the tail iterations cost less than the lost register reuse).
MIN_TILE_FILL = 0.5
PACK_B = (False, True)                   # copy the B panel of a macro tile into a contiguous buffer
PAD_N = (True, False)                    # N not a multiple of nr: zero-pad j (True) or predicate each lane
FLATTEN_BATCH = (True, False)            # shared weight: batch rows flattened into M
PAD_M = (True, False)                    # static rows not a multiple of mr: zero-pad i (A's rows) or predicate
# Half-width vectors instead of padding when they divide N and fewer rows than this many full vectors'
# lanes share each padded B panel: the padded path costs one (scalar) copy per B element plus a scalar
# epilogue tail, the half-width path half the FMA throughput, i.e. M*K*N/(2*lanes) more FMA cycles vs
# K*N copies: half width wins below M = 2 * lanes.
HALF_LANES_BELOW_ROWS_PER_LANE = 2
# A register tile left predicated (pad_n False, N not a multiple of nr) is scalar code: each of its
# mr x nr lanes under its own predicate, k_unroll times per unrolled k step.  LLVM's build time grows faster
# than that body: mr=7, nr=32, k_unroll=8 (1792 predicated lanes) took 31 s to build (cpu.norm_matmul,
# 19x40 @ 40x43) and 13 s (cpu.matmul_epilogue, same shape), 896 lanes 9 s, 512 lanes 4.4-4.7 s, the
# padded tile 0.4-0.9 s (CPU seconds, under load).  Bigger predicated tiles are not in the space: a tuner
# would spend that build on each such candidate, for scalar code that the padded tile beats.
MAX_PREDICATED_TILE_LANES = 512


def pad_rows_knob():
    """The ``pad_m`` field (static rows): with a row count that the chosen ``mr`` does not divide, the
    matmul's i domain is zero-padded up to a multiple of ``mr`` (``pad_rows_and_columns``: A's rows copied
    per register-row tile, the padded rows never stored), so the k loop of every register tile runs without
    a "row exists" predicate.  Without it the predicate is on every tile: ``partition_row_tiles``'s hint
    does nothing on a static kernel (TVM 0.27's NarrowDataType gives the loops new int32 variables and
    leaves the hint's AttrStmt on the old int64 one), and LLVM keeps a predicated tile's accumulators in
    memory.  ``before=False``: records written before the knob ran predicated; families that never pad
    (symbolic rows) construct the config without it (default False)."""
    f = knob("rows not a multiple of mr (static): pad i (A's rows zero-padded per register-row tile) "
             "instead of a per-row predicate inside the k loop", PAD_M, before=False)
    f.default = False
    return f


@dataclass(frozen=True)
class RegisterTileConfig(Config):
    """The knobs of a register-blocked GEMM shared by the CPU matmul families (BLIS-style tiles)."""

    mr: int = knob("rows of the register tile", MR_CHOICES)
    nvec: int = knob("vectors per register-tile row", NVEC_CHOICES)
    lanes: int = knob("float32 lanes per vector (the target's width, or half)")
    mc_tiles: int = knob("register tiles per macro tile along i (the rows)", MC_TILES)
    nc_tiles: int = knob("register tiles per macro tile along j", NC_TILES)
    k_unroll: int = knob("unroll of the reduction loop", K_UNROLL)


@dataclass(frozen=True)
class MatmulConfig(RegisterTileConfig):
    """The knobs of ``cpu.matmul_epilogue`` (and ``cpu.symbolic_matmul``)."""

    order: str = knob("macro loop order: 'ij' (A panel reuse) or 'ji' (B panel reuse)", ORDERS)
    parallel_depth: int = knob("macro loops fused into the parallel loop", PARALLEL_DEPTH)
    pack_b: bool = knob("pack B's macro panel contiguously", PACK_B)
    pad_n: bool = knob("columns not a multiple of the register tile: pad j (B panel zero-padded) instead of "
                       "a per-lane predicate (scalar code) on the register tile", PAD_N)
    flatten_batch: bool = knob("a weight shared by the batches: their rows as one M (each B panel read once)",
                               FLATTEN_BATCH)
    parallel: bool = U.parallel_knob(default=True)
    pad_m: bool = pad_rows_knob()


def register_tile_choices(m: int, n: int, k: int, lanes: int) -> dict:
    """The legal choices of the ``RegisterTileConfig`` knobs for ``m`` rows, ``n`` columns and depth ``k``
    on ``lanes``-wide vectors."""
    vectors = max(1, -(-n // lanes))
    return {"mr": U.choices_upto(MR_CHOICES, m), "nvec": U.choices_upto(NVEC_CHOICES, vectors),
            "lanes": lane_choices(lanes), "mc_tiles": U.choices_upto(MC_TILES, max(1, m)),
            "nc_tiles": U.choices_upto(NC_TILES, vectors), "k_unroll": U.choices_upto(K_UNROLL, k)}


def unpadded_rows_exclusion(m) -> Exclusion:
    """``pad_m`` True with an ``mr`` that divides the ``m`` rows pads nothing: the same kernel as False,
    left out so the tuner does not measure it twice."""
    def nothing_padded(mr: int, pad_m: bool) -> str | None:
        if pad_m and isinstance(m, int) and m % mr == 0:
            return f"pad_m with mr {mr} dividing the {m} rows pads nothing (the pad_m False kernel)"
        return None

    return Exclusion(("mr", "pad_m"), nothing_padded)


def predicated_tile_exclusion(ns) -> Exclusion:
    """The register tiles (``RegisterTileConfig`` knobs with ``pad_n``) left out of a space for matmuls of
    ``ns`` columns: a predicated tile (no padding, some N not a multiple of nr) of more than
    ``MAX_PREDICATED_TILE_LANES`` lanes per unrolled k step."""
    ns = tuple(ns)

    def predicated_tile(mr: int, nvec: int, lanes: int, k_unroll: int, pad_n: bool) -> str | None:
        nr = nvec * lanes
        if pad_n or all(n % nr == 0 for n in ns):
            return None
        body = mr * nr * k_unroll
        if body > MAX_PREDICATED_TILE_LANES:
            return f"predicated register tile of {mr}x{nr} lanes x k_unroll {k_unroll} = {body} scalar lanes " \
                   f"per k step (over {MAX_PREDICATED_TILE_LANES}: slow to build)"
        return None

    return Exclusion(("mr", "nvec", "lanes", "k_unroll", "pad_n"), predicated_tile)


def register_tile_default(m: int, n: int, k: int, lanes: int, info: CPUInfo, choices: dict,
                          defaults: dict, max_acc_vectors: int | None = None, whole_rows: bool = False) -> dict:
    """The untuned ``RegisterTileConfig`` values: the register tile that fits the target's vector registers
    (``pick_register_tile``), macro tiles sized to its L2 (``pick_macro_tiles``) and the table's
    ``k_unroll`` where it divides K (``defaults``: the family's row of schedules/cpu_targets.json).
    ``whole_rows``: static rows, see ``pick_register_tile``."""
    regs = U.Registers.for_bits(info.vector_bits).count
    mr, nvec = pick_register_tile(m, n, lanes, regs, choices["mr"], choices["nvec"], max_acc_vectors, whole_rows)
    mc_tiles, nc_tiles = pick_macro_tiles(k, mr, nvec * lanes, info.l2_bytes, choices["mc_tiles"],
                                          choices["nc_tiles"])
    unroll = defaults["k_unroll"]
    return {"mr": mr, "nvec": nvec, "lanes": lanes, "mc_tiles": mc_tiles, "nc_tiles": nc_tiles,
            "k_unroll": U.nearest_choice(choices["k_unroll"], unroll if k % unroll == 0 else 1)}


def rows_macro_tiles(m: int, tile: dict, choices: dict) -> int:
    """The default's register tiles per macro tile along the rows: the L2-sized choice (``tile``), at most
    as many as ``m`` rows fill (a taller macro tile only adds register tiles whose every row is predicated
    off, each still running its k loop: BERT's FFN at 17 rows ran 16 tiles of 6 rows, 13 of them empty, at
    2x the time of the symbolic kernel's, measured under load)."""
    fill = -(-m // tile["mr"])
    return min(tile["mc_tiles"], max([c for c in choices["mc_tiles"] if c <= fill] or [min(choices["mc_tiles"])]))


def rows_for_tasks(m: int, mr: int, mc_tiles: int, other_tasks: int, want: int, choices: dict,
                   cores: int = 1) -> int:
    """``mc_tiles`` (register tiles per row block) for the parallel loop: from the given (L2-sized) one down
    through ``choices["mc_tiles"]`` while the row blocks times ``other_tasks`` (the loop's other iterations:
    batches, column panels) are fewer than ``want`` tasks; of those visited, the one with the least work on
    the busiest core, larger blocks on ties. TVM's parallel loop gives each of the ``cores`` threads one
    contiguous chunk of ceil(tasks / cores) tasks, so the busiest core runs that many row blocks of
    ``mc_tiles`` register tiles (17 rows of 6-row tiles: 2 blocks of 2 tiles or 3 of 1 both cost 2 tiles on 2
    cores; 136 rows of 4-row tiles: 32-tile blocks 32, 8-tile blocks 24). A count already reached keeps
    ``mc_tiles``."""
    tiles = -(-m // mr)

    def busiest(c: int) -> int:
        return -(-(other_tasks * -(-tiles // c)) // max(1, cores)) * c

    seen = [mc_tiles]
    while mc_tiles > min(choices["mc_tiles"]) and other_tasks * -(-tiles // mc_tiles) < want:
        mc_tiles = max(c for c in choices["mc_tiles"] if c < mc_tiles)
        seen.append(mc_tiles)
    return min(seen, key=lambda c: (busiest(c), -c))


def one_matmul_anchor(group, static: bool) -> str | None:
    """For ``accepts``: None when the group (``analysis.GroupInfo``) has ``static`` (or, False, symbolic)
    extents, exactly one matmul/conv anchor, a matmul, no row reduction and, when static, an anchor PrimFunc
    that ``analyze_matmul`` reads as ``C += A * B``; else why not."""
    if group.is_static() != static:
        return ("symbolic extents (cpu.symbolic_matmul and cpu.symbolic_rows take those)" if static
                else "static extents (cpu.matmul_epilogue takes those)")
    anchors, contractions = U.matmul_anchors(group), group.of_kind(CONTRACTION)
    if len(anchors) != 1 or len(contractions) != 1:
        return f"{len(contractions)} matmul/conv anchors, {len(anchors)} of them matmuls (this family tiles one matmul)"
    if group.of_kind(REDUCTION):
        return "a row reduction beside the matmul"
    if static and matmul_roles(anchors[0].func) is None:
        return f"{anchors[0].name} is not C += A * B with one i, j and k axis (a window, strided or reshaped " \
               "operand index)"
    return None


def lane_choices(lanes: int) -> tuple:
    """Vector widths of the register tile: the target's, and half of it (a divisor of more N)."""
    return (lanes, lanes // 2) if lanes >= 8 else (lanes,)


def column_lanes(n: int, lanes: int) -> int:
    """The vector width of the blocks whose columns stop at N (the epilogue or write-back on the register
    tile, the zero-padded B copy): ``lanes`` when it divides N, else the widest power of two under it that
    does.  Their predicate ``j < N`` then tests whole vectors; with a lane-level predicate TVM's
    VectorizeLoop runs the whole loop scalar (SwiGLU's 172 columns: every sigmoid of the epilogue and every
    element of the per-row-block B copy one at a time, llama's static gate/up kernel ~3x the symbolic one,
    measured under load)."""
    width = lanes
    while width > 1 and n % width:
        width //= 2
    return width


def pick_lanes(m: int, n: int, lanes: int) -> int:
    """The target's vector width, or half of it when it divides N where the full one does not and the
    padded path would not pay off (``HALF_LANES_BELOW_ROWS_PER_LANE``): GEMV over 1000 classes on AVX-512."""
    half = lanes // 2
    if lanes >= 8 and n % lanes and n % half == 0 and m < HALF_LANES_BELOW_ROWS_PER_LANE * lanes:
        return half
    return lanes


def _plain_vars(indices) -> list | None:
    out = []
    for e in indices:
        if not isinstance(e, C.tirx.Var):
            return None
        out.append(e)
    return out


def _vars_or_consts(indices) -> list | None:
    """The index variables of an operand read, constants (a broadcast batch dim: ``w[0, h, k, j]``)
    skipped; None when an index is any other expression (a shifted or strided read)."""
    out = []
    for e in indices:
        if isinstance(e, C.tirx.Var):
            out.append(e)
        elif not isinstance(e, C.tirx.IntImm):
            return None
    return out


def mac_operands(sch: C.Schedule, block, operand_consts: bool = True) -> tuple | None:
    """``(block, a, b, c_idx, a_idx, b_idx)`` of a block ``C[...] += A[...] * B[...]`` with one reduction
    axis and plain-variable output indices (operand indices may hold constants unless ``operand_consts``
    is False), else None.  Shared by ``analyze_matmul`` and the symbolic matmul template."""
    blk = sch.get(block)
    store = blk.body
    if not isinstance(store, C.BufferStore) or U.iter_kinds(sch, block).count("R") != 1:
        return None
    mac = multiply_accumulate(blk)
    if mac is None:
        return None
    a, b = mac
    operand = _vars_or_consts if operand_consts else _plain_vars
    c_idx, a_idx, b_idx = _plain_vars(store.indices), operand(a.indices), operand(b.indices)
    if c_idx is None or a_idx is None or b_idx is None or len(c_idx) < 2:
        return None
    return blk, a, b, c_idx, a_idx, b_idx


def analyze_matmul(sch: C.Schedule, block) -> dict | None:
    """The roles of a reduction block if it is ``C += A * B`` with one i, one j and one k axis."""
    found = mac_operands(sch, block)
    if found is None:
        return None
    blk, a, b, c_idx, a_idx, b_idx = found
    ivs = blk.iter_vars
    red = [iv.var for iv in ivs if int(iv.iter_type) == U.REDUCE]
    k = red[0]
    names = lambda vs: {v.name for v in vs}  # noqa: E731
    if k.name not in names(a_idx) or k.name not in names(b_idx) or k.name in names(c_idx):
        return None
    if not (names(a_idx) | names(b_idx)) <= names(c_idx) | {k.name}:
        return None
    # C's last two axes are (i, j): i read by one operand only (the data, "A"), j by the other (the
    # weight, "B"); the leading axes are batch axes read by A, B, both (A[b] @ B[b]) or by A only
    # (activations [B, S, K] @ a shared weight [K, N]); a constant index is a broadcast batch dim.
    i_var, j_var = c_idx[-2], c_idx[-1]
    in_a, in_b = names(a_idx), names(b_idx)
    if i_var.name in in_b and i_var.name not in in_a and j_var.name in in_a and j_var.name not in in_b:
        a, b, a_idx, b_idx, in_a, in_b = b, a, b_idx, a_idx, in_b, in_a     # operands written B * A
    if not (i_var.name in in_a and i_var.name not in in_b and j_var.name in in_b and j_var.name not in in_a):
        return None
    batch_vars = c_idx[:-2]
    dom = {iv.var.name: iv.dom.extent for iv in ivs}
    if not all(isinstance(dom[v.name], C.tirx.IntImm) for v in c_idx + [k]):
        return None
    b_pos = [getattr(e, "name", None) for e in b.indices]     # None at a constant (broadcast) index
    return {
        "M": int(dom[i_var.name]), "N": int(dom[j_var.name]), "K": int(dom[k.name]),
        "batch": [int(dom[v.name]) for v in batch_vars],
        # which batch axes the weight follows: none (a shared weight), or some/all (batched matmul)
        "b_batch": [v.name in in_b for v in batch_vars],
        "b_buffer": str(b.source.name),
        "b_contiguous_j": b_pos[-1] == j_var.name,
        "b_j_pos": b_pos.index(j_var.name), "b_k_pos": b_pos.index(k.name), "b_ndim": len(b_pos),
        "a_buffer": str(a.source.name),
        "c_buffer": str(blk.body.buffer.name),
        "j_iter": [iv.var.name for iv in ivs].index(j_var.name),
        "n_iters": len(ivs),
        "iters_ordered": [iv.var.name for iv in ivs] == [v.name for v in c_idx] + [k.name],
    }


def matmul_roles(func: C.PrimFunc, analyze=None) -> dict | None:
    """``analyze`` (``analyze_matmul`` unless given: ``(sch, block) -> dict | None``) of the one reduction
    block of ``func`` (its elementwise blocks folded first, as ``MatmulEpilogue.match`` does); None when it
    has several or none."""
    sch = C.Schedule(func)
    U.inline_elementwise(sch)
    reds = [b for b in U.top_blocks(sch) if not U.is_spatial(sch, b)]
    if len(reds) != 1 or not U.is_reduction(sch, reds[0]):
        return None
    return (analyze or analyze_matmul)(sch, reds[0])


def stack_accumulator_vectors(lanes: int, bytes_per_lane: int = 4) -> int:
    """The most ``lanes``-wide float32 vectors a register tile's accumulator may hold and stay a stack array
    (LLVM keeps it in registers): TVM serves an allocation of ``C.MAX_STACK_ALLOCA_BYTES`` or more from
    its workspace allocator, and inside a compiled model LLVM then stores every partial sum to that
    buffer and reloads A's broadcast after each FMA (cpu.symbolic_matmul's 4 x 4-vector AVX-512 tile,
    exactly 1 KiB: BERT's FFN kernels at 51 rows 2-3x the static ones)."""
    return (C.MAX_STACK_ALLOCA_BYTES - 1) // (lanes * bytes_per_lane)


def table_accumulator_cap(defaults: dict, lanes: int) -> int | None:
    """The default register tile's accumulator cap from the family's table row (``defaults``): on the stack
    (``stack_accumulator_vectors``) when its ``stack_accumulator`` is set, else None (any tile that fits
    the vector registers: AVX-512's 4 x 4-vector tile is exactly 1 KiB, a workspace allocation per tile)."""
    return stack_accumulator_vectors(lanes) if defaults["stack_accumulator"] else None


def pick_register_tile(m: int, n: int, lanes: int, regs: int, mr_choices, nvec_choices,
                       max_acc_vectors: int | None = None, whole_rows: bool = False) -> tuple[int, int]:
    """(mr, nvec) of the register tile (at most ``max_acc_vectors`` accumulator vectors when given).

    A tile that does not divide the problem leaves a predicate on every iteration of the register tile
    (measured on the transformer block's 64x512x128 matmul: 10x slower with a tail along j, 2x along i),
    so in order: the tile fits in the vector registers (accumulators + B vectors + one broadcast of A);
    it divides N; it divides M while keeping at least ``MIN_TILE_FILL`` of the largest accumulator count;
    most accumulators; fewest loads per FMA (mr broadcasts + nvec vectors per k step); more rows.
    ``whole_rows`` (a static row count, no loop partition of the row tiles): a tile dividing M at any fill;
    the predicate of a partial row tile sits in the k loop of every tile and LLVM then keeps all their
    accumulators in memory (GPT-2's matmuls at 17 rows: a 1 x 4-vector tile 8.9 us, 3 x 4 10.3 us and the
    6 x 4 default 17.9 us, kernel-only, one thread, under load).
    """
    pairs = [(a, b) for a in mr_choices for b in nvec_choices]
    if max_acc_vectors is not None:
        pairs = [p for p in pairs if p[0] * p[1] <= max_acc_vectors] or [min(pairs, key=lambda p: p[0] * p[1])]
    fitting = [p for p in pairs if p[0] * p[1] + p[1] + 1 <= regs] or [min(pairs, key=lambda p: p[0] * p[1])]
    most = max(a * b for a, b in fitting)

    def score(p):
        mr, nv = p
        acc = mr * nv
        divides_m = m % mr == 0 and (whole_rows or acc >= MIN_TILE_FILL * most)
        return (n % (nv * lanes) == 0, divides_m, acc, -(mr + nv), mr)

    return max(fitting, key=score)


def pick_macro_tiles(k: int, mr: int, nr: int, l2_bytes: int, mc_choices, nc_choices) -> tuple[int, int]:
    """(mc_tiles, nc_tiles): the A block (mc x K) and the B panel (K x nc) each take at most half of L2."""
    half_l2 = l2_bytes // 2
    mc_want = max(1, half_l2 // max(1, k * 4 * mr))
    nc_want = max(1, half_l2 // max(1, k * 4 * nr))
    mc_tiles = max([c for c in mc_choices if c <= mc_want] or [min(mc_choices)])
    nc_tiles = max([c for c in nc_choices if c <= nc_want] or [min(nc_choices)])
    return mc_tiles, nc_tiles


def compute_on_register_tile(sch: C.Schedule, red, at_loop, lanes: int, k_unroll: int) -> None:
    """Move the matmul block ``red`` under ``at_loop`` (the loop over register tiles of its consumer):
    C shrinks to an mr x nr accumulator; k outermost, then the tile rows (unrolled) and the vectors of
    a row (unrolled, vector lanes); the accumulator is initialized before the k loop, vectorized."""
    sch.compute_at(red, at_loop, preserve_unit_loops=True)
    r_loops = sch.get_loops(red)
    ri, rj, rk = r_loops[-3], r_loops[-2], r_loops[-1]
    k0, k1 = sch.split(rk, factors=[None, k_unroll])
    jo, jv = sch.split(rj, factors=[None, lanes])
    sch.reorder(k0, k1, ri, jo, jv)
    sch.vectorize(jv)
    sch.unroll(jo)
    sch.unroll(ri)
    if k_unroll > 1:
        sch.unroll(k1)
    init = sch.decompose_reduction(red, k0)
    sch.vectorize(sch.get_loops(init)[-1])


def _pad_einsum_blocks(sch: C.Schedule, red, padding: list[int], n_pads: int) -> tuple:
    """``sch.pad_einsum(red, padding)`` and the blocks it made: (the crop block, the operand pad blocks).
    Any other outcome than one crop and ``n_pads`` pads is a broken invariant of the callers."""
    before = {U.block_name(sch, b) for b in U.top_blocks(sch)}
    sch.pad_einsum(red, padding)
    new = [b for b in U.top_blocks(sch) if U.block_name(sch, b) not in before]
    crop = [b for b in new if sch.get_producers(b) and any(U.block_name(sch, p) == U.block_name(sch, red)
                                                           for p in sch.get_producers(b))]
    pads = [b for b in new if b not in crop]
    if len(crop) != 1 or len(pads) != n_pads:
        raise ValueError(f"pad_einsum of {U.block_name(sch, red)} made {len(new)} blocks, expected {n_pads} "
                         "operand pad(s) and a crop")
    return crop[0], pads


def pad_columns(sch: C.Schedule, red, info: dict, nr: int):
    """Pad the matmul's column domain (j) up to a multiple of the register-tile width ``nr``.

    ``pad_einsum`` gives B a zero-padded copy (``<B>_pad``, scheduled by the caller: per B panel),
    C a padded buffer, and a crop block copying C_pad back; the crop is folded into the epilogue or, without
    one, is itself the write-back.  The register tile then runs without a per-lane predicate (TVM turns a
    vectorized loop with one into scalar code, and an unrolled register tile of it into thousands of scalar
    statements); only the epilogue's last columns keep a predicate.  Returns (write-back or epilogue block
    name or None, B_pad block).
    """
    padding = [1] * info["n_iters"]
    padding[info["j_iter"]] = nr
    crop, pads = _pad_einsum_blocks(sch, red, padding, 1)
    crop_name, pad_name = U.block_name(sch, crop), U.block_name(sch, pads[0])
    if crop_name in U.output_names(sch):
        return crop_name, pad_name
    sch.compute_inline(crop)
    return None, pad_name


def pad_rows_and_columns(sch: C.Schedule, red, info: dict, mr: int, nr: int | None):
    """``pad_columns`` with the row domain (i) padded to a multiple of ``mr`` as well (``nr`` None: rows
    only): A gets a zero-padded copy (``<A>_pad``, scheduled by the caller: per register-row tile), C a
    padded buffer, the crop is folded into the epilogue or is the write-back.  Returns (write-back or
    None, {"a" | "b": pad block name})."""
    padding = [1] * info["n_iters"]
    padding[info["j_iter"] - 1] = mr           # C's axes end (i, j): i is the iterator before j
    if nr is not None:
        padding[info["j_iter"]] = nr
    crop, pads = _pad_einsum_blocks(sch, red, padding, 1 + (nr is not None))
    roles = {info["a_buffer"]: "a", info["b_buffer"]: "b"}
    pad_names = {}
    for b in pads:
        read = [str(r.source.name) for r in sch.get(b).reads]
        role = next((roles[n] for n in read if n in roles), None)
        if role is None:
            raise ValueError(f"pad_einsum of {U.block_name(sch, red)}: pad block {U.block_name(sch, b)} reads "
                             f"{read}, neither A ({info['a_buffer']}) nor B ({info['b_buffer']})")
        pad_names[role] = U.block_name(sch, b)
    crop_name = U.block_name(sch, crop)
    if crop_name in U.output_names(sch):
        return crop_name, pad_names
    sch.compute_inline(crop)
    return None, pad_names


def pads_rows(info: dict, mr: int, pad_m: bool) -> bool:
    """Whether ``cpu.matmul_epilogue`` pads the rows (``pad_m``): static rows not a multiple of ``mr`` in
    one batch (a batch product of 1: the flattened rows are the matmul's own; padding each of several
    batches would break the affine (b, i) -> row map of ``flatten_rows``)."""
    batch = 1
    for b in info["batch"]:
        batch *= b
    return pad_m and batch == 1 and isinstance(info["M"], int) and info["M"] % mr != 0


def pads_symbolic_rows(info: dict, cfg) -> bool:
    """Whether the matmul's symbolic row count is padded to the register tile (``pad_m`` on a kernel whose
    rows are known at run time only: ``cpu.symbolic_matmul``'s row-tiled nest).  Without it the last register
    tile keeps a "this row exists" predicate inside its k loop, its partial sums in memory: bert_dyn's FFN
    at 17 rows and mr 6 (5 rows on that path) 1.7x the static kernel, one thread, measured under load
    (benchmarks/notes/padrows12.md).  With it A's rows are copied per register tile (zeros past the end),
    the k loop runs unpredicated, and only the epilogue's stores keep the predicate.
    tests/test_symbolic_pad_rows.py"""
    rows = [info["M"], *info["batch"]]
    return bool(cfg.pad_m) and cfg.mr > 1 and not all(isinstance(e, int) for e in rows) \
        and (not info["batch"] or (cfg.flatten_batch and flattenable(info))) \
        and not rows_divide(rows, cfg.mr)


def rows_divide(rows: list, mr: int) -> bool:
    """Whether the product of the row extents (ints or TIR expressions) is provably a multiple of ``mr``:
    then the register tiles cover the rows exactly and there is nothing to pad (swin_dyn's window rows,
    ``batch * 16`` windows of 16 tokens, in tiles of 4: pad_einsum made no block, and the template refused the
    kernel, left to ``cpu.symbolic_rows``).  tests/test_symbolic_pad_rows.py"""
    expr = math.prod(C.tirx.const(e, "int64") if isinstance(e, int) else e for e in rows)
    return bool(C.Analyzer().can_prove(C.tirx.floormod(expr, mr) == 0))


def pad_epilogue(sch: C.Schedule, epi, nr: int):
    """The epilogue ``epi`` of matmuls whose columns were padded (``pad_columns``) computed over the padded
    columns too (``pad_einsum``: its j domain a multiple of ``nr``, into a padded buffer), and a crop block
    writing the N real columns to the output: the epilogue on the register tile then has no predicate
    ``j < N`` (TVM's VectorizeLoop runs a loop with a lane-level predicate scalar, or at the narrower
    ``column_lanes``: llama's SwiGLU epilogue at N = 172, sigmoid on 4-lane vectors, was ~40% of the static
    gate/up kernel, measured under load) and the crop, a plain copy, gets whole vectors and a short tail.

    Only when every j-indexed operand of the epilogue is a padded accumulator (its padded copy is an
    identity copy, folded back into the epilogue); an epilogue that also reads a bias or residual would
    read it under a lane-level ``if_then_else``.  Returns the crop block's name, or None (nothing changed)."""
    j_iter = len(sch.get(epi).iter_vars) - 1
    if U.static_extent(sch, sch.get_loops(epi)[j_iter]) is None:
        return None
    trial = C.Schedule(sch.mod["main"])
    made = _pad_epilogue_blocks(trial, trial.get_sblock(U.block_name(sch, epi)), j_iter, nr)
    if made is None:
        return None
    return _pad_epilogue_blocks(sch, epi, j_iter, nr)


def _pad_epilogue_blocks(sch: C.Schedule, epi, j_iter: int, nr: int) -> str | None:
    """``pad_epilogue`` on ``sch``: the crop block's name, or None when an operand copy is not an identity
    copy (``sch`` is then left changed: callers try it on a copy first)."""
    padding = [1] * len(sch.get(epi).iter_vars)
    padding[j_iter] = nr
    before = {U.block_name(sch, b) for b in U.top_blocks(sch)}
    try:
        sch.pad_einsum(epi, padding)
    except C.ScheduleError:
        return None
    new = [b for b in U.top_blocks(sch) if U.block_name(sch, b) not in before]
    outputs = U.output_names(sch)
    crop = [b for b in new if U.block_name(sch, b) in outputs]
    copies = [b for b in new if b not in crop]
    if len(crop) != 1 or any(not isinstance(sch.get(b).body.value, C.TensorLoad) for b in copies):
        return None
    for b in copies:
        sch.compute_inline(b)
    return U.block_name(sch, crop[0])


def flattenable(info: dict) -> bool:
    """Batch axes read by A only (a weight shared by every batch) in (batch.., i, j, k) order: the rows
    of all batches form one M = B x M (one pass over each B panel instead of one per batch)."""
    return bool(info["batch"]) and not any(info["b_batch"]) and info["iters_ordered"]


def row_map(info: dict, trailing: int):
    """IndexMap (b.., i, *rest) -> (b * M + i, *rest) with ``trailing`` axes after i."""
    nb, m, dims = len(info["batch"]), info["M"], info["batch"]

    def mapping(*a):
        r = a[0]
        for d, v in zip(dims[1:], a[1:nb]):
            r = r * d + v
        return (r * m + a[nb], *a[nb + 1:])

    return C.IndexMap.from_func(mapping, ndim=nb + 1 + trailing)


def flatten_matmul(sch: C.Schedule, red, info: dict) -> None:
    """The matmul block and its C buffer made 2-D: (b.., i) -> one row index b * M + i (A read at
    [row // M, row % M, k])."""
    sch.transform_layout(red, ("write", 0), row_map(info, 1))
    sch.transform_block_layout(red, row_map(info, 2))


def flat_operand(sch: C.Schedule, red, info: dict) -> tuple[str, str]:
    """After ``flatten_matmul``: A read through a copy block whose buffer has the flattened layout
    ([rows, K], written at [b * M + i, k]), so the matmul reads it at [row, k].  Returns (the copy block's
    name, its buffer's name)."""
    reads = [str(r.source.name) for r in sch.get(red).reads]
    copy = sch.cache_read(red, reads.index(info["a_buffer"]), "global")
    sch.transform_layout(copy, ("write", 0), row_map(info, 1))
    return U.block_name(sch, copy), str(sch.get(copy).writes[0].source.name)


def flatten_rows(sch: C.Schedule, red, epi, info: dict) -> None:
    """``flatten_matmul``, and the epilogue (or write-back) block iterated over the same rows (the output
    written at [row // M, row % M, j])."""
    flatten_matmul(sch, red, info)
    sch.transform_block_layout(epi, row_map(info, 1))


def is_contraction(sch: C.Schedule, block) -> bool:
    """Whether a reduction block multiplies two different tensors indexed by its reduced axes (a matmul
    or a conv: ``acc + f(A[.., k]) * g(B[.., k])``), as opposed to a row reduction such as sum(x * x)."""
    blk = sch.get(block)
    store = blk.body
    if not isinstance(store, C.BufferStore):
        return False
    rvars = {str(iv.var.name) for iv in blk.iter_vars if int(iv.iter_type) == U.REDUCE}
    if not rvars:
        return False

    def reduced_loads(expr) -> set:
        out = set()

        def visit(node):
            if isinstance(node, C.TensorLoad) and not node.source.same_as(store.buffer):
                used = set()
                for idx in node.indices:
                    C.post_order_visit(idx, lambda v: used.add(str(v.name)) if isinstance(v, C.tirx.Var)
                                       else None)
                if used & rvars:
                    out.add(str(node.source.name))

        C.post_order_visit(expr, visit)
        return out

    found = []

    def visit_mul(node):
        if isinstance(node, C.Mul):
            a, b = reduced_loads(node.a), reduced_loads(node.b)
            if a and b and not (a & b):
                found.append(node)

    C.post_order_visit(store.value, visit_mul)
    return bool(found)


class MatmulEpilogue(U.CpuTemplate, family="cpu.matmul_epilogue", config=MatmulConfig):
    # ------------------------------------------------------------------ match
    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        sch = C.Schedule(func)
        left = U.inline_elementwise(sch)
        reductions = [b for b in U.top_blocks(sch) if not U.is_spatial(sch, b)]
        if len(reductions) != 1 or not U.is_reduction(sch, reductions[0]):
            return None
        red = reductions[0]
        info = self.analyze(sch, red, target)
        if info is None:
            return None
        epi = epilogue_of(sch, red, info["c_buffer"])
        if epi is None:
            return None
        red_name = U.block_name(sch, red)
        epi_name = None if epi == "none" else U.block_name(sch, epi)
        if epi_name is not None and epi_name not in U.output_names(sch):
            return None
        others = [n for n in left if n not in (red_name, epi_name)]
        # leftover blocks must be independent elementwise producers (scheduled on their own)
        for n in others:
            if not U.is_spatial(sch, sch.get_sblock(n)):
                return None
        info.update(reduction=red_name, epilogue=epi_name, others=others)
        return self.finish(func, info, target)

    def analyze(self, sch: C.Schedule, red, target: C.Target) -> dict | None:
        """The roles of the kernel's one reduction block (a subclass matches other extents)."""
        return analyze_matmul(sch, red)

    def finish(self, func: C.PrimFunc, info: dict, target: C.Target) -> Match | None:
        """The match from the analysed roles: the rows the register tiles run over."""
        rows = info["M"]
        for b in info["batch"]:
            rows *= b
        info["rows"] = rows if flattenable(info) else info["M"]
        return Match(self.family, info)

    def accepts(self, group, target: C.Target) -> str | None:
        """One static matmul anchor (``analyze_matmul`` on its PrimFunc), an elementwise epilogue (the
        contraction_epilogue rule's check) and no row reduction."""
        return one_matmul_anchor(group, static=True)

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        m, n, k = match.info.get("rows", match.info["M"]), match.info["N"], match.info["K"]
        batch = 1
        for b in match.info["batch"]:
            batch *= b
        return MatmulConfig.space(**register_tile_choices(m, n, k, cpu_info(target).float32_lanes),
                                  **({} if flattenable(match.info) else {"flatten_batch": (False,)}),
                                  # padded rows: static rows of one batch (pads_rows)
                                  **({} if batch == 1 and isinstance(match.info["M"], int)
                                     else {"pad_m": (False,)}),
                                  exclusions=(predicated_tile_exclusion([n]), unpadded_rows_exclusion(m)))

    def default_config(self, match: Match, target: C.Target) -> dict:
        info, d = cpu_info(target), self.table_defaults(target)
        ch = {kb.name: kb.choices for kb in self.space(match, target).knobs}
        flat = flattenable(match.info)
        m, n, k = match.info.get("rows", match.info["M"]) if flat else match.info["M"], match.info["N"], \
            match.info["K"]
        lanes = pick_lanes(m, n, info.float32_lanes)
        # rows padded to the tile (pad_m, the table's default; one batch): any tile, the fill rule of
        # pick_register_tile; else a tile that divides the rows at any fill (whole_rows)
        pad_m = d["pad_m"] and "pad_m" in ch and True in ch["pad_m"]
        tile = register_tile_default(m, n, k, lanes, info, ch, d, table_accumulator_cap(d, lanes),
                                     whole_rows=not self.buckets(match, target) and not pad_m)
        nr = tile["nvec"] * tile["lanes"]
        n_macro_j = -(-n // (nr * tile["nc_tiles"]))
        mc_tiles = rows_macro_tiles(m, tile, ch)
        batch = 1
        for b in ([] if flat else match.info["batch"]):
            batch *= b
        work = match.info["M"] * n * k
        for b in match.info["batch"]:
            work *= b
        parallel = U.parallel_default(work, target)
        # the macro tiles are the parallel tasks (batch x column panels x row blocks, parallel_depth 2 where
        # the panels alone are too few): aim at the table's row_blocks_per_core tasks per core, least work on
        # the busiest core (rows_for_tasks).  L2-sized row blocks alone left BERT's 128-row FFN one task (mr 4
        # x 32 tiles = 128 rows, one 256-column panel): the whole kernel on one core (notes/staticmm13b.md)
        mc_tiles = rows_for_tasks(m, tile["mr"], mc_tiles, batch * n_macro_j,
                                  d["row_blocks_per_core"] * info.cores if parallel else 1, ch, info.cores)
        n_macro_i = -(-m // (tile["mr"] * mc_tiles))
        # B panels are reused across all of i when j is the outer macro loop: pack them when K is long
        depth = 1 if batch * n_macro_j >= 2 * info.cores else 2
        pack = n_macro_i > 1 and k * nr * 4 > info.l1d_bytes // 2
        return MatmulConfig(**{**tile, "mc_tiles": mc_tiles}, order=d["order"],
                            parallel_depth=depth, pack_b=pack and depth == 1,
                            pad_n=d["pad_n"], flatten_batch=flat,
                            parallel=parallel,
                            pad_m=pads_rows(match.info, tile["mr"], pad_m)).asdict()

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, MatmulConfig.from_dict(config)
        mr, lanes = cfg.mr, cfg.lanes
        nr = cfg.nvec * lanes
        nbatch = len(info["batch"])

        # Step 1. Fold the elementwise chain into one epilogue block (same folding as match()).
        U.inline_elementwise(sch)
        red = sch.get_sblock(info["reduction"])

        # Step 2. Columns not a multiple of the register tile: pad the matmul's j domain (B and C padded,
        # B per panel in Step 7), so the register tile has no per-lane predicate.  Static rows not a
        # multiple of mr (pad_m): pad its i domain too (A's rows per register-row tile in Step 7), so the
        # k loop has no per-row predicate.
        # Step 2b. Without an epilogue, accumulate into a cache block and write back from it.
        b_pad = a_pad = None
        pad_cols = bool(cfg.pad_n and info["N"] % nr)
        flattened = False
        if pads_symbolic_rows(info, cfg):
            # symbolic rows (cpu.symbolic_matmul): the batch rows flattened first (Step 2c), then the one
            # row axis padded to a multiple of mr (pad_einsum takes a symbolic extent: ceil(rows / mr) x mr)
            epi = sch.get_sblock(info["epilogue"]) if info["epilogue"] is not None \
                else sch.cache_write(red, 0, "global")
            flat_info = info
            a_flat = None
            if cfg.flatten_batch and flattenable(info):
                flatten_rows(sch, red, epi, info)
                # A read through a copy with the flattened layout (A[row // M, row % M, k] is no einsum
                # access for pad_einsum); the copy is folded into A's padded copy below
                a_flat = flat_operand(sch, red, info)
                flat_info = {**info, "n_iters": 3, "j_iter": 1, "a_buffer": a_flat[1]}
                flattened = True
            writeback, pads = pad_rows_and_columns(sch, red, flat_info, mr, nr if pad_cols else None)
            a_pad, b_pad = pads.get("a"), pads.get("b")
            if a_flat is not None:
                sch.compute_inline(sch.get_sblock(a_flat[0]))
            epi = sch.get_sblock(writeback) if writeback is not None else epi
        elif pads_rows(info, mr, cfg.pad_m):
            writeback, pads = pad_rows_and_columns(sch, red, info, mr, nr if pad_cols else None)
            a_pad, b_pad = pads.get("a"), pads.get("b")
            epi = sch.get_sblock(writeback or info["epilogue"])
        elif pad_cols:
            writeback, b_pad = pad_columns(sch, red, info, nr)
            epi = sch.get_sblock(writeback or info["epilogue"])
        elif info["epilogue"] is None:
            epi = sch.cache_write(red, 0, "global")   # the write-back block; red now writes the cache
        else:
            epi = sch.get_sblock(info["epilogue"])

        # Step 2c. A weight shared by the batches: the batch rows flattened into M (2-D from here on).
        # (Rows padded: the matmul's rows are M rounded up to mr, the epilogue's M; one batch, so both
        # maps are the identity on the rows.)
        if flattened:
            nbatch = 0
        elif cfg.flatten_batch and flattenable(info):
            if a_pad is not None:
                flatten_matmul(sch, red, {**info, "M": -(-info["M"] // mr) * mr})
                sch.transform_block_layout(epi, row_map(info, 1))
            else:
                flatten_rows(sch, red, epi, info)
            nbatch = 0

        # Step 3. Tile the epilogue: batch, macro tiles (mc x nc), register tiles (mr x nr).
        loops = sch.get_loops(epi)
        b_loops, i_loop, j_loop = loops[:nbatch], loops[nbatch], loops[nbatch + 1]
        i0, i1, i2 = sch.split(i_loop, factors=[None, cfg.mc_tiles, mr])
        j0, j1, j2 = sch.split(j_loop, factors=[None, cfg.nc_tiles, nr])
        outer = [j0, i0] if cfg.order == "ji" else [i0, j0]
        sch.reorder(*b_loops, *outer, i1, j1, i2, j2)
        par = sch.fuse(*b_loops, *outer[:cfg.parallel_depth]) if (b_loops or cfg.parallel_depth > 1) else outer[0]
        if cfg.parallel:              # a matmul under the target's fork/join cost stays serial (common.py)
            sch.parallel(par)
        # B's macro panel (K x nc) is fixed by j0: pack it once per iteration of the loop holding j0
        j0_fused = j0 in outer[:cfg.parallel_depth] or (b_loops and outer[0] is j0)
        pack_at = par if j0_fused else j0

        # Step 4. Compute the matmul on each register tile: C shrinks to an mr x nr accumulator.
        # Step 5. Initialize the accumulator before the k loop, vectorized.
        compute_on_register_tile(sch, red, j1, lanes, cfg.k_unroll)

        # Step 6. The epilogue on the register tile: vectorized along j.
        e_jo, e_jv = sch.split(j2, factors=[None, column_lanes(info["N"], lanes)])
        sch.vectorize(e_jv)

        # Step 7. B's panel for this macro tile: zero-padded (Step 2) or optionally packed, contiguous.
        if b_pad is not None:
            pack = sch.get_sblock(b_pad)
            sch.compute_at(pack, pack_at, preserve_unit_loops=True)
            U.vectorize_inner(sch, pack, column_lanes(info["N"], lanes))
        elif cfg.pack_b:
            if not info["b_contiguous_j"] and not info["b_buffer"]:
                raise ValueError("pack_b needs a B operand buffer")
            b_index = [str(r.source.name) for r in sch.get(red).reads].index(info["b_buffer"])
            pack = sch.cache_read(red, b_index, "global")
            sch.compute_at(pack, pack_at, preserve_unit_loops=True)
            U.vectorize_inner(sch, pack, lanes)

        # Step 7b. A's rows padded (Step 2): the register-row tile's rows (mr x K, zeros past M) copied
        # once per row tile, before its column tiles read them.
        if a_pad is not None:
            pack_a = sch.get_sblock(a_pad)
            sch.compute_at(pack_a, i1, preserve_unit_loops=True)
            U.vectorize_inner(sch, pack_a, column_lanes(info["K"], lanes))

        # Step 8. Leftover elementwise producers: fused, parallel (as the matmul), vectorized on their own.
        for name in info["others"]:
            U.schedule_injective(sch, sch.get_sblock(name), lanes, parallel=cfg.parallel)

        # Step 9. Rows not a multiple of the macro tile: the whole register tiles split from the predicated
        # ones (a symbolic row count: cpu.symbolic_matmul's apply does the same).
        static = all(isinstance(e, int) for e in (info["M"], *info["batch"]))
        rows = info.get("rows", info["M"]) if cfg.flatten_batch and flattenable(info) else info["M"]
        if static and rows % (mr * cfg.mc_tiles):
            partition_row_tiles(sch)


def partition_row_tiles(sch: C.Schedule, parallel_too: bool = False) -> None:
    """A row-tiled nest's predicate ("this row exists") sits on every row of the register tile inside
    the k loop: LLVM then keeps the accumulators in memory (a load, FMA and store per step: 211 us against
    36 us with the hint for the FFN-down kernel at 136 rows, measured under load).  A loop-partition hint
    on the matmul's serial loops makes TVM's LoopPartition split the register tiles whose rows all exist
    (no predicate: register accumulators) from the last one; on the k loops, whose variables the
    predicate does not hold, it does nothing.

    Not on a parallel loop unless ``parallel_too`` (a macro tile of one register tile: no serial row loop
    inside it to split): LoopPartition splits a hinted parallel loop into two parallel loops (the whole
    macro tiles, then the last one), i.e. two launches of the thread pool per call, the second for one
    task.  gpt2_dyn's 17 x 64 @ 64 x 64 at 2 threads: 15.3 -> 8.3 us with the hint on the serial loops
    only (the row-tile loop inside each macro tile is split instead), 1.28 -> 1.20 us at one thread
    (kernel-only, under load, benchmarks/notes/symmm11.md);
    tests/test_symbolic_matmul_rows.py::test_row_tiled_nest_launches_the_thread_pool_once."""
    func = sch.mod["main"]
    names = []
    C.post_order_visit(func.body, lambda n: names.append(str(n.name_hint))
                       if isinstance(n, C.SBlock) and str(n.name_hint) != "root" else None)
    # every matmul's loops (sibling matmuls' loops have the same names: none is skipped by name; a loop
    # that several blocks share is annotated again, which changes nothing)
    for name in names:
        block = sch.get_sblock(name)
        if not U.is_reduction(sch, block):
            continue
        columns = _column_loop_vars(sch, block)
        for loop in sch.get_loops(block):
            kind = sch.get(loop).kind
            if str(sch.get(loop).loop_var.name) in columns:
                continue
            if kind == C.ForKind.SERIAL or (parallel_too and kind == C.ForKind.PARALLEL):
                sch.annotate(loop, "pragma_loop_partition_hint", 1)


def _column_loop_vars(sch: C.Schedule, block) -> set[str]:
    """Names of the loop variables bound to ``block``'s last spatial iterator (the matmul's N columns) and
    to no other, and in its predicate.  partition_row_tiles leaves them without the hint: a column macro
    tile that N does not divide (N = 192, 12 vectors of 16 in macro tiles of 8) has a column predicate, and
    TVM 0.27's LoopPartition, splitting an int64 loop on it, writes its start as an int32 0 added to int64 values
    (``T.Add(0, T.int64(1))``); a later simplification then fails with "LT: mismatched types int32 vs
    int64" (gpt2_dyn's 64 x 192 kernel with a 4 x 2 tile; tests/test_symbolic_matmul_rows.py::
    test_column_predicate_with_row_tiles_builds).  The rows' predicate is what the hint is for."""
    loops = sch.get_loops(block)
    realize = sch.get(loops[-1]).body if loops else None
    if not isinstance(realize, C.SBlockRealize):
        return set()
    uses: list[set] = []
    spatial: list[int] = []
    for i, (iv, value) in enumerate(zip(sch.get(block).iter_vars, realize.iter_values)):
        names: set[str] = set()
        C.post_order_visit(value, lambda n, out=names: out.add(str(n.name)) if isinstance(n, C.tirx.Var) else None)
        uses.append(names)
        if int(iv.iter_type) == U.SPATIAL:
            spatial.append(i)
    if not spatial:
        return set()
    last = spatial[-1]
    others = set().union(*(u for i, u in enumerate(uses) if i != last))
    predicated: set[str] = set()
    C.post_order_visit(realize.predicate, lambda n: predicated.add(str(n.name)) if isinstance(n, C.tirx.Var) else None)
    return (uses[last] - others) & predicated
