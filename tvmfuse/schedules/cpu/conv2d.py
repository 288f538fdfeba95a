"""Direct Conv2D (NCHW, OIHW weights, any stride/dilation/padding) with its epilogue on x86/ARM CPUs.

Matches, after folding elementwise blocks, one reduction block

    conv[n, f, y, x] += data[n, c(f, rc), y*sh + ry*dh, x*sw + rx*dw] * W[f, rc, ry, rx]

(four spatial iterators n, f, y, x and three reduction iterators rc, ry, rx; ``data`` usually the padding
block ``pad_temp``, else a parameter) followed by at most one elementwise epilogue block reading ``conv``
at its own indices: the folded BatchNorm shift (bias add), ReLU, the residual add.  Channel blocks of
grouped convolutions are allowed; depthwise ones (one input channel per output channel) go to
``depthwise.py``.

Schedule (register-blocked direct convolution, vectorized along the output row): the epilogue is tiled
into [oc_tile output channels x oh_tile rows x ow_tile columns]; the convolution is computed on each
tile, so ``conv`` shrinks to an accumulator of that size (registers), with the reduction over rc/ry/rx
inside; per reduction step one weight per output channel is broadcast and one vector of the padded input
row is loaded per row.  The epilogue runs on the accumulator before anything is stored.  The padded
input is computed per band of output rows (all channels, the rows the band's windows touch), inside the
parallel loop over (n, row band [, channel block]), so it stays in L1/L2 and is never materialized whole;
or (``shared_pad``, the default where the channel blocks are in the parallel loop: else each block copied
the band again) once for the whole input before the tiles, in its own parallel loop.
Weights stay in their OIHW parameter layout (the calling convention is unchanged).  The batch may be
symbolic (a model exported with a dynamic batch): it is never split, only fused into the parallel loop,
so the kernel has the static tiles and vector loops at every batch (``analyze_conv``).

Small planes (7x7, 15x15: an output row narrower than, or not a multiple of, a vector) waste most lanes of
a row-wide register tile.  There the ``im2col`` knob copies the band's windows into a buffer laid out
[channel, ky, kx, row, column] (the padding folded into that copy): each window offset's rows are then one
contiguous run of pixels, so the tile's full-width rows are vectorized as one loop (``fuse_rows``) as for
a 1x1 conv (a 3x3 plane: 9 pixels in one vector instead of three 3-wide ones).  The copy costs 1/F of the
FMAs.  A row wider than a vector and not a multiple of it (31 columns: SqueezeNet's stem) makes LLVM split
an odd-sized vector into pieces and spill its accumulators (about 1000 stack accesses in the kernel);
``pad_width`` pads the copied columns with zeros up to whole vectors (``pad_einsum`` on the conv, which
im2col makes an einsum), computes the padded row in the register tile and stores only the valid columns
(whole vectors, then the rest as one narrower vector).
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import multiply_accumulate, var_names
from ...target import cpu_info, template_defaults
from ..base import Config, KnobSpace, Match, Template, knob
from ..buckets import BatchBuckets
from . import common as U

OC_TILES = (1, 2, 3, 4, 6, 8, 12, 16)     # output channels of the register tile (broadcast weights)
MAX_OW_VECTORS = 4                        # widest register-tile row, in vectors
OH_TILES = (1, 2, 3, 4)                   # output rows of the register tile
IC_TILES = (1, 2, 4)                      # input channels per innermost (unrolled) reduction step
UNROLL = (0, 1, 2)                        # reduction loops unrolled: none, kw, kh and kw
PARALLEL_DEPTH = (1, 2)                   # 1: parallel over (n, row band); 2: also over channel blocks
FUSE_ROWS = (False, True)                 # pointwise or im2col conv: the tile's full-width rows as one pixel vector
IM2COL = (False, True)                    # KxK conv: the band's windows copied into [c, ky, kx, rows, cols] first
PAD_WIDTH = (False, True)                 # im2col: the columns padded up to whole vectors (pad_einsum)
SHARED_PAD = (False, True)                # the padded input once before the tiles, not per parallel iteration
MAX_FUSED_ROW_VECTORS = 8                 # widest run of pixels (in vectors) of a fused-rows register tile
# Measured slowdown of a register-tile row wider than a vector that is not a multiple of it (56x56:
# 14 or 28 columns ran 4x slower than 8; 28x28: 14 ran 2x slower than 7).
SPLIT_ROW_PENALTY = 4


def batch_size(info: dict) -> int:
    """The batch a conv's defaults assume: its N, or over a symbolic batch (``info["N"]`` None) the size
    bucket's (``ConvTemplate.bucket_match``), else ``common.SYMBOLIC_BATCH_NOMINAL``."""
    return info.get("bucket_batch", U.SYMBOLIC_BATCH_NOMINAL) if info["N"] is None else info["N"]


def batch_work(info: dict) -> int:
    """Multiply-adds of one batch of the conv (``find_conv``'s info; a depthwise conv's RC is 1)."""
    return info["F"] * info["OH"] * info["OW"] * info["RC"] * info["KH"] * info["KW"]


def conv_work(info: dict) -> int | None:
    """Multiply-adds of the conv, the work the shared parallel rule (``common.parallel_why_not``) weighs;
    over a symbolic batch at the size bucket's batch (``BatchBuckets.bucket_match``), None outside a bucket
    (grows with the batch)."""
    if info["N"] is None:
        return info["bucket_batch"] * batch_work(info) if "bucket_batch" in info else None
    return info["N"] * batch_work(info)


def set_batch_bounds(info: dict, target: C.Target) -> None:
    """Over a symbolic batch: the largest batch whose multiply-adds stay under the target's fork/join cost
    (``common.serial_batches``), the bound of a serial size bucket (``BatchBuckets``): a static build at
    those batches runs the conv serial, and so does that nest."""
    if info["N"] is None:
        info["serial_batches_work"] = U.serial_batches(batch_work(info), target)


@dataclass(frozen=True)
class Conv2DConfig(Config):
    """The knobs of ``cpu.conv2d_epilogue``: the register tile, the reduction's unrolling, the parallel loop
    and the input layouts (every combination legal: see the knob docs)."""

    oc_tile: int = knob("output channels per register tile")
    ow_tile: int = knob("output columns per register tile (vectorized)")
    lanes: int = knob("float32 lanes per vector (the target's vector width)")
    oh_tile: int = knob("output rows per register tile")
    ic_tile: int = knob("input channels per unrolled reduction step")
    unroll: int = knob("window loops unrolled (0 none, 1 kw, 2 kh+kw)")
    parallel_depth: int = knob("outer loops fused into the parallel loop", PARALLEL_DEPTH)
    parallel: bool = U.parallel_knob()
    fuse_rows: bool = knob("1x1 stride-1 conv or im2col: the tile's rows (ow_tile = OW) vectorized as one run of "
                           "pixels")
    deinterleave: bool = knob("strided conv without im2col: padded input stored by column phase (contiguous "
                              "vector loads)")
    im2col: bool = knob("conv with a window: the band's windows copied as [c, ky, kx, rows, cols] (rows fusable)")
    pad_width: bool = knob("im2col, rows not fused, a row not a multiple of the vector: columns padded to whole "
                           "vectors (the register tile is then the whole padded row, whatever ow_tile)")
    shared_pad: bool = knob("a conv with a window or a stride, no im2col: the padded input computed once, before the "
                            "tiles, in its own parallel loop (not per parallel iteration: per row band, and with "
                            "parallel_depth 2 again per channel block)", SHARED_PAD, before=False)


def _weight_index_names(indices, f) -> tuple:
    """The names of a weight load's index variables; a blocked output channel ``f // B``, ``f % B`` (one
    constant B) as ``"o//"``, ``"o%"``."""
    blocks = {int(i.b) for i in indices if isinstance(i, (C.FloorDiv, C.FloorMod))
              and i.a.same_as(f) and isinstance(i.b, C.IntImm)}
    if len(blocks) > 1:
        return ()

    def name(i):
        if isinstance(i, C.FloorDiv) and i.a.same_as(f) and isinstance(i.b, C.IntImm):
            return "o//"
        if isinstance(i, C.FloorMod) and i.a.same_as(f) and isinstance(i.b, C.IntImm):
            return "o%"
        return getattr(i, "name", None)

    return tuple(name(i) for i in indices)


def analyze_conv(sch: C.Schedule, block) -> dict | None:
    """The roles of a reduction block if it is a direct NCHW conv2d; None otherwise (raises nothing).

    The batch extent may be symbolic (``N`` None): the schedules only fuse the batch loop into their
    parallel loop, never split it; every other extent must be static."""
    blk = sch.get(block)
    store = blk.body
    if U.iter_kinds(sch, block) != "SSSSRRR" or not isinstance(store, C.BufferStore):
        return None
    ops = multiply_accumulate(blk)
    if ops is None or sorted(len(o.indices) for o in ops) not in ([4, 4], [4, 5]):
        return None
    n, f, y, x, rc, ry, rx = [iv.var for iv in blk.iter_vars]
    names = [str(v.name) for v in (n, f, y, x, rc, ry, rx)]
    if [getattr(i, "name", None) for i in store.indices] != names[:4]:
        return None
    # OIHW weights, IHWO (constant weights stored [ci, ky, kx, co]) or OIHWo (constant weights blocked
    # [co // B, ci, ky, kx, co % B]: passes.rewrites.TransposePointwiseWeights)
    layouts = {(names[1], names[4], names[5], names[6]): "OIHW", (names[4], names[5], names[6], names[1]): "IHWO",
               ("o//", names[4], names[5], names[6], "o%"): "OIHWo"}
    weights = [o for o in ops if _weight_index_names(o.indices, f) in layouts]
    if len(weights) != 1:
        return None
    w = weights[0]
    weight_layout = layouts[_weight_index_names(w.indices, f)]
    d = ops[1] if ops[0] is w else ops[0]
    if len(d.indices) != 4:
        return None
    d_vars = [var_names(i) for i in d.indices]
    n_, f_, y_, x_, rc_, ry_, rx_ = names
    if d_vars[0] != {n_} or rc_ not in d_vars[1] or not d_vars[1] <= {f_, rc_} \
            or d_vars[2] != {y_, ry_} or d_vars[3] != {x_, rx_}:
        return None
    ext = [iv.dom.extent for iv in blk.iter_vars]
    if not all(isinstance(e, C.tirx.IntImm) for e in ext[1:]):
        return None      # only the batch may be symbolic: the tiles split the channels, rows and columns
    F, OH, OW, RC, KH, KW = [int(e) for e in ext[1:]]
    N = int(ext[0]) if isinstance(ext[0], C.tirx.IntImm) else None     # None: a symbolic batch
    coef = C.detect_linear_equation(d.indices[3], [x])      # [stride along x, rest]
    batch = {} if N is not None else {"batch": ext[0]}      # the symbolic batch extent (size buckets)
    return {**batch,
        "N": N, "F": F, "OH": OH, "OW": OW, "RC": RC, "KH": KH, "KW": KW,
        "depthwise": f_ in d_vars[1] and RC == 1,
        "grouped": f_ in d_vars[1],                         # the input channel follows the output channel
        "data_buffer": str(d.source.name),
        "data_hw": [int(e) if isinstance(e, C.tirx.IntImm) else -1 for e in list(d.source.shape)[2:]],
        "weight_buffer": str(w.source.name),
        "weight_layout": weight_layout,
        "weight_block": int(w.indices[0].b) if weight_layout == "OIHWo" else None,
        "conv_buffer": str(store.buffer.name),
        "stride_w": int(coef[0]) if len(coef) == 2 and isinstance(coef[0], C.tirx.IntImm) else 0,
    }


def find_conv(func: C.PrimFunc, depthwise: bool) -> dict | None:
    """Shared match of the conv templates: the conv block, its data producer (padding), its epilogue.

    The padding block is kept out of the elementwise folding (it is computed per tile by the schedule);
    every other spatial block folds into the epilogue.  Returns the template's match info or None.
    """
    def analyze(sch, block):
        info = analyze_conv(sch, block)
        return info if info is not None and info["depthwise"] == depthwise else None

    found = U.window_reduction(func, analyze)
    if found is None:
        return None
    sch, conv_name, info, pad, left = found
    conv = sch.get_sblock(conv_name)
    epi = U.own_index_consumer(sch, conv, info["conv_buffer"])
    if epi is None:
        return None
    epi_name = None if epi == "none" else U.block_name(sch, epi)
    outputs = U.output_names(sch)
    if epi_name is not None and epi_name not in outputs:
        return None
    if epi_name is None and conv_name not in outputs:
        return None
    others = [b for b in left if b not in (conv_name, epi_name, pad)]
    if others:
        return None          # extra independent kernels in the group: not this family's structure
    info.update(reduction=conv_name, epilogue=epi_name, pad=pad)
    # 1x1, stride 1, no padding (the input or its identity pad has the output plane shape): several rows are one
    # contiguous run of pixels (a matmul over pixels: weights x [channels, pixels])
    info["pointwise"] = info["KH"] == info["KW"] == 1 and \
        info["data_hw"] == [info["OH"], info["OW"]]
    return info


def im2col_choices(info: dict) -> tuple:
    """Knob choices of ``im2col``: (False, True) for a conv with a window (not 1x1 stride 1) whose input
    channels are shared by all output channels, else (False,): a grouped conv's copy would be indexed by
    the output channel too (one copy per group member); a 1x1 strided conv has no window to copy.  Nor
    does a conv with any unit window or output axis (Inception v3's 1x7 / 7x1 / 1x3 / 3x1 convs, a 3x3 conv
    on a 1x1 map): ``reindex`` drops the axis from the copy and ``im2col``'s 6-D layout map fails ("args.size()
    == initial_indices_orig.size()"), which sent 7 of inception_v3's convs to cpu.generic / the fallback
    (benchmarks/notes/corpus10.md)."""
    unit = 1 in (info["KH"], info["KW"], info["OH"], info["OW"])   # reindex drops unit axes of the copy
    return (False,) if info.get("pointwise") or info.get("grouped") or unit else IM2COL


def deinterleave_choices(info: dict) -> tuple:
    """Knob choices of ``deinterleave``: (False, True) for a strided conv whose padded input the schedule
    computes (a padding block) with a width the stride divides, else (False,)."""
    s, wp = info.get("stride_w", 0), info["data_hw"][1]
    return (False, True) if info["pad"] and s > 1 and wp > 0 and wp % s == 0 else (False,)


def deinterleave_default(info: dict, choices: tuple) -> bool:
    """On where offered and the windows overlap (KW > stride: each copied input column is read by several
    windows); a patchify conv (KW == stride, ViT's 8x8 stride 8) reads each input once, where the copy
    cost more than the gathers (158 vs 85 us, measured under load)."""
    return True in choices and info["KW"] > info.get("stride_w", 0)


def deinterleave_pad(sch: C.Schedule, info: dict) -> None:
    """Store the padded input column-phase-major: pad[n, c, y, x] at [n, c, y, x % s, x // s] for a
    column stride s.  The window's column x*s + rx then reads [rx % s, x + rx // s]: consecutive output
    columns read consecutive addresses, one vector load instead of a strided gather per vector
    (a 7x7 stride-2 stem ran 20x faster)."""
    s = info["stride_w"]
    sch.transform_layout(sch.get_sblock(info["pad"]), ("write", 0),
                         lambda n, c, y, x: (n, c, y, x % s, x // s))


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def row_tiles(width: int, lanes: int) -> tuple:
    """Legal register-tile widths along the output row: the divisors of ``width`` up to
    ``MAX_OW_VECTORS`` vectors.  A tile that does not divide the row leaves a predicated tail inside the
    vectorized loop, which TVM scalarizes (8x slower measured), so only divisors are offered; a width
    that is not a multiple of the lanes is legalized by LLVM into full vectors plus a narrower one.
    """
    return tuple(d for d in range(1, min(width, MAX_OW_VECTORS * lanes) + 1) if width % d == 0)


def row_lane_use(width: int, lanes: int) -> float:
    """The share of the vector lanes the direct template's best register-tile row fills on an output row of
    ``width`` columns: the widest of ``row_tiles`` that is one vector or whole vectors (a row split into
    odd-sized pieces spills: SPLIT_ROW_PENALTY), its columns over its lanes.  56 or 28 columns on 16 lanes:
    14-column tiles, 0.875; 16, 32 or 64 columns: 1.0.  ``conv_lanes.plane_why`` asks it of a large plane."""
    fills = [d / (ceil_div(d, lanes) * lanes) for d in row_tiles(width, lanes) if whole_vectors(d, lanes)]
    return max(fills)


def _oh_tiles(info: dict, lanes: int) -> tuple:
    """Rows per register tile: OH_TILES, and where rows can be fused (a pointwise conv, or any conv through
    im2col) the divisors of OH whose rows fit in MAX_FUSED_ROW_VECTORS vectors as one run of pixels (4 rows
    of a 28x28 plane: 112 pixels, 7 vectors of 16 where a 28-wide row splits into 16 + 12)."""
    base = U.choices_upto(OH_TILES, info["OH"])
    if not (info.get("pointwise") or True in im2col_choices(info)):
        return base
    extra = [d for d in range(1, info["OH"] + 1)
             if info["OH"] % d == 0 and d * info["OW"] <= MAX_FUSED_ROW_VECTORS * lanes]
    return tuple(sorted(set(base) | set(extra)))


def padded_width(info: dict, lanes: int) -> int | None:
    """The row width the ``pad_width`` knob pads to (whole vectors), where it applies: a row wider than a
    vector, not a multiple of it, whose padded row fits one register-tile row (MAX_OW_VECTORS); else None."""
    ow = info["OW"]
    padded = ceil_div(ow, lanes) * lanes
    return padded if ow > lanes and ow % lanes and padded <= MAX_OW_VECTORS * lanes else None


def shared_copy_fits(info: dict, padded: int, target: C.Target) -> bool:
    """Whether the whole im2col copy of a conv with rows padded to ``padded`` columns (all row bands, every
    window element: RC x KH x KW x OH x padded floats per batch) fits the target's
    ``template_defaults["cpu.conv2d_epilogue"]["shared_copy_l2_share"]`` of L2: then the default copies it
    once, before the register tiles, in its own parallel loop (``parallel_depth`` 2: tiles over row bands x
    channel blocks), not per row band inside the tiles' loop.  SqueezeNet's stem (3->64, 3x3/2, 31x31
    out, 107 kB copy), one core, CPU time, interleaved, under load (benchmarks/conv_kernel_ab.py, 3 runs):
    41.2-41.4 vs 46.7-48.8 us per call with the copy per band."""
    share = float(template_defaults(target, "cpu.conv2d_epilogue")["shared_copy_l2_share"])
    floats = batch_size(info) * info["RC"] * info["KH"] * info["KW"] * info["OH"] * padded
    return floats * 4 <= share * cpu_info(target).l2_bytes


def pad_width_choices(info: dict, lanes: int) -> tuple:
    return PAD_WIDTH if True in im2col_choices(info) and padded_width(info, lanes) else (False,)


def _fused_rows_ok(info: dict, ow: int, oh: int, im2col: bool = False) -> bool:
    """The tile's rows form one contiguous run of pixels (a pointwise conv's input, or the im2col copy)
    with no predicated tail."""
    return bool(info.get("pointwise") or im2col) and ow == info["OW"] and info["OH"] % oh == 0


def im2col_default(info: dict, lanes: int, oh: int, target: C.Target) -> bool:
    """im2col by default where the output row wastes lanes (not a multiple of the vector), F shares the
    copy and one band's copy is small: ``template_defaults["cpu.conv2d_epilogue"]``'s
    ``im2col_min_channels`` and ``im2col_max_band_kib`` (im2col copies RC*KH*KW values per output pixel,
    once for all F output channels: 1/F of the FMAs; the copy of one band, float32, stays in L2)."""
    d = template_defaults(target, "cpu.conv2d_epilogue")
    band = info["RC"] * info["KH"] * info["KW"] * oh * info["OW"] * 4
    return True in im2col_choices(info) and info["OW"] % lanes != 0 \
        and info["F"] >= int(d["im2col_min_channels"]) and band <= int(d["im2col_max_band_kib"]) * 1024


def whole_vectors(width: int, lanes: int) -> bool:
    """A run of ``width`` pixels LLVM keeps in whole registers: one vector (a narrower one is widened) or a
    multiple of vectors.  Other widths (49: a 7x7 plane) become odd-sized vectors whose accumulators LLVM
    spills and reassembles lane by lane (about 750 stack accesses in a 3x3 conv kernel, 10x slower)."""
    return width <= lanes or width % lanes == 0


def _load_pieces(width: int, lanes: int) -> int:
    """Loads of a run of ``width`` floats: whole vectors, and the rest in power-of-two pieces."""
    return width // lanes + bin(width % lanes).count("1")


def concat_parts(sch: C.Schedule, data_block: str) -> list[int]:
    """The channels of each operand, in order, when the conv's data producer is a channel concat (several
    inputs [n, c_i, h, w]: ``passes.rules.check_concat_prologue``), else []."""
    block = sch.get(sch.get_sblock(data_block))
    params = [str(p.name) for p in sch.mod["main"].params]
    reads = [str(r.source.name) for r in block.reads]
    if len(reads) < 2 or not all(r in params for r in reads):
        return []
    shapes = {str(r.source.name): C.tensor_shape(r.source) for r in block.reads}
    parts = [int(shapes[r][1]) for r in sorted(reads, key=params.index)]
    # a per-channel scale (rule scale_prologue: x [n, C, H, W] * g [n, C, 1, 1]) reads its operands whole:
    # only a concat's operand channels add up to its output's
    return parts if sum(parts) == int(C.tensor_shape(block.writes[0].source)[1]) else []


def prepare_conv(sch: C.Schedule, info: dict, deinterleave: bool):
    """Steps shared by the conv templates: the elementwise chain folded into one epilogue block (the padding
    block stays), the padded input deinterleaved if asked, and without an epilogue a cache block to
    accumulate in.  Returns (conv block, epilogue block)."""
    U.inline_elementwise(sch, keep=frozenset({info["pad"]} if info["pad"] else ()))
    if deinterleave:
        deinterleave_pad(sch, info)
    conv = sch.get_sblock(info["reduction"])
    epi = sch.cache_write(conv, 0, "global") if info["epilogue"] is None else sch.get_sblock(info["epilogue"])
    return conv, epi


def finish_conv(sch: C.Schedule, conv, first_reduction_loop, input_block: str | None, band, lanes: int,
                parallel: bool = True, unroll_rows: bool = False) -> None:
    """Steps shared by the conv templates, after the register tile: the accumulator in registers,
    initialized (vectorized) before ``first_reduction_loop``; the input block (padding or im2col copy)
    computed per parallel iteration ``band``, vectorized along its rows, or (``band`` None) once for the
    whole kernel before it, in its own parallel loop (serial where ``parallel`` is False: the kernel is, or
    the copy is under the fork/join cost, ``shared_pad_parallel``).
    ``unroll_rows``: the per-band copy's row loop unrolled too (:func:`unroll_copy_rows`)."""
    # the accumulator stays in the "global" scope: on the stack where it fits (common.MAX_STACK_ALLOCA_BYTES)
    init = sch.decompose_reduction(conv, first_reduction_loop)
    sch.vectorize(sch.get_loops(init)[-1])
    if input_block and band is None:
        block = sch.get_sblock(input_block)
        loops = sch.get_loops(block)
        if parallel:
            sch.parallel(sch.fuse(*loops[:-1]))
        U.vectorize_inner(sch, block, lanes)
    elif input_block:
        block = sch.get_sblock(input_block)
        sch.compute_at(block, band, preserve_unit_loops=True)
        rows = sch.get_loops(block)[-2] if unroll_rows else None     # before vectorize_inner may partition
        U.vectorize_inner(sch, block, lanes)
        if rows is not None:
            sch.unroll(rows)


def unroll_copy_rows(sch: C.Schedule, info: dict, lanes: int) -> bool:
    """Whether a conv over a symbolic batch (``info["N"]`` None) unrolls its per-band padded copy's row loop:
    where the padded plane's rows times the vectors of a row stay within ``common.MAX_UNROLLED_COPIES``.  Its
    indices are then int64 (TVM narrows no index of a kernel with a symbolic extent), and LLVM vectorized
    the copy loop across rows instead, 16 rows a step with 64-bit gathers and scatters (mobilenet_v2_dyn's
    48 x 16x16 stride-2 depthwise conv: 7.5 us against the static kernel's 1.5; unrolled 1.85,
    benchmarks/notes/symconv11.md).  A static kernel's int32 copy is left as it is."""
    if info["N"] is not None or not info["pad"]:
        return False
    rows, cols = [int(iv.dom.extent) for iv in sch.get(sch.get_sblock(info["pad"])).iter_vars[-2:]]
    return rows * ceil_div(cols, lanes) <= U.MAX_UNROLLED_COPIES


def shared_pad_parallel(sch: C.Schedule, info: dict, block: str) -> bool:
    """Whether a padded input computed once before the tiles (``shared_pad``) gets its own parallel loop: its
    elements (a symbolic batch at ``batch_size``) over the target's fork/join cost
    (``common.min_parallel_work``, kept in the match info), else it is copied serially before the tiles' parallel loop: a second
    fork/join of the pool (2-3 us on 2 threads) for a copy of a few thousand floats would cost more than the
    copies per channel block it replaces (resnet18's 8-channel 16x16 stage: 8 x 18 x 18 floats)."""
    n = 1
    for d in sch.get(sch.get_sblock(block)).writes[0].source.shape:
        n *= int(d) if isinstance(d, C.tirx.IntImm) else batch_size(info)
    return n >= info["min_parallel_work"]


def pad_columns(sch: C.Schedule, conv, col: str, width: int) -> str:
    """The im2col'd conv's column domain padded to ``width`` (``pad_einsum``: the copy's padded twin, the
    accumulator padded, a crop block); the copy folded into its padded twin, the crop into its consumer.
    Returns the padded copy's block name."""
    before = {U.block_name(sch, b) for b in U.top_blocks(sch)}
    padding = [1] * len(sch.get(conv).iter_vars)
    padding[3] = width
    sch.pad_einsum(conv, padding)
    new = [b for b in U.top_blocks(sch) if U.block_name(sch, b) not in before]
    conv_name = U.block_name(sch, conv)
    crop = [b for b in new if any(U.block_name(sch, p) == conv_name for p in sch.get_producers(b))]
    pads = [b for b in new if b not in crop]
    if len(crop) != 1 or len(pads) != 1:
        raise ValueError(f"pad_einsum of {conv_name} made {len(new)} blocks, expected a copy pad and a crop")
    pad_name = U.block_name(sch, pads[0])
    sch.compute_inline(crop[0])
    sch.compute_inline(sch.get_sblock(col))
    return pad_name


def store_valid_columns(sch: C.Schedule, loop, width: int, lanes: int) -> None:
    """The epilogue's padded row (``loop``, predicated to ``width`` columns): its whole vectors and the rest
    as one narrower vector, each vectorized (``loop_partition``; the padding columns are not stored)."""
    main = width // lanes * lanes
    factors = [main, width - main, None] if main else [width - main, None]
    parts = sch.loop_partition(loop, factors=factors)
    for part in parts[:len(factors) - 1]:
        sch.vectorize(part)


def im2col(sch: C.Schedule, conv, info: dict) -> str:
    """The conv's input read through a copy ``col[n, c, ky, kx, y, x]`` (``reindex`` of the window read,
    laid out with the output pixel innermost); the padding block is folded into it.  Returns its name."""
    reads = [str(r.source.name) for r in sch.get(conv).reads]
    col = sch.reindex(conv, ("read", reads.index(info["data_buffer"])))
    # reindex orders the copy by the conv's iterators that index the read: (n, y, x, c, ky, kx)
    order = lambda n, y, x, c, ky, kx: (n, c, ky, kx, y, x)  # noqa: E731
    sch.transform_layout(col, ("write", 0), order)
    sch.transform_block_layout(col, order)        # its loops in that order too: the columns innermost
    if info["pad"]:
        sch.compute_inline(sch.get_sblock(info["pad"]))
    return U.block_name(sch, col)


class ConvTemplate(BatchBuckets, Template):
    """What the conv templates share: the LLVM targets and the match (``find_conv``), for depthwise convs
    or the others (``depthwise``)."""
    target_kinds = ("llvm",)
    depthwise = False

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        info = find_conv(func, depthwise=self.depthwise)
        if info is None:
            return None
        match = Match(self.family, info)
        info["min_parallel_work"] = U.min_parallel_work(target)     # (shared_pad_parallel)
        if info["N"] is None:
            # a symbolic batch: the largest batch whose parallel loop (batch x the default's parallel units
            # per batch) is too short for the cores without the second parallel level (parallel_depth 2)
            need = self.min_parallel_per_core(target) * cpu_info(target).cores
            info["small_batches"] = (need - 1) // self.parallel_units(match, self.default_config(match, target))
            set_batch_bounds(info, target)
        return match

    # ------------------------------------------------------------------ size buckets
    def min_parallel_per_core(self, target: C.Target) -> int:
        """Parallel iterations per core below which the default adds the second parallel level (fewer leave
        cores idle on the tail): the family's ``template_defaults[...]["min_parallel_per_core"]``."""
        return int(template_defaults(target, self.family)["min_parallel_per_core"])

    def parallel_units(self, match: Match, config: dict) -> int:
        """Parallel iterations per batch at ``parallel_depth`` 1."""
        raise NotImplementedError

    # buckets (BatchBuckets): over a symbolic batch, where the smallest batches need the second parallel
    # level and larger ones do not, one nest each (the static default's ``parallel_depth`` at every batch;
    # the depth-2 nest recomputes the padded input per channel block, or copies the im2col windows of the
    # whole batch before the tiles)
    def batch_info(self, match: Match, batch: int) -> dict:
        return {"bucket_batch": batch}

    def target_numbers(self, match: Match, target: C.Target) -> tuple:
        """(the target's CPU facts, its vector registers, the knob choices by name) for default_config."""
        info = cpu_info(target)
        return info, U.Registers.for_bits(info.vector_bits).count, \
            {k.name: k.choices for k in self.space(match, target).knobs}


class Conv2DEpilogue(ConvTemplate):
    family = "cpu.conv2d_epilogue"
    config_type = Conv2DConfig

    def parallel_units(self, match: Match, config: dict) -> int:
        return ceil_div(match.info["OH"], config["oh_tile"])       # row bands

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        i = match.info
        lanes = cpu_info(target).float32_lanes
        return Conv2DConfig.space(
            oc_tile=U.choices_upto(OC_TILES, i["F"]), ow_tile=row_tiles(i["OW"], lanes), lanes=(lanes,),
            oh_tile=_oh_tiles(i, lanes), ic_tile=U.choices_upto(IC_TILES, i["RC"]), unroll=U.choices_upto(UNROLL, 2),
            fuse_rows=FUSE_ROWS if i.get("pointwise") or True in im2col_choices(i) else (False,),
            deinterleave=deinterleave_choices(i), im2col=im2col_choices(i), pad_width=pad_width_choices(i, lanes),
            shared_pad=SHARED_PAD if i["pad"] and not i.get("pointwise") else (False,))

    def default_config(self, match: Match, target: C.Target) -> dict:
        info, regs, ch = self.target_numbers(match, target)
        i, lanes = match.info, info.float32_lanes

        # register tile: accumulators that leave room for the broadcast weights and one input vector;
        # then tiles that divide the channels and rows (a tail tile is predicated); then the fewest
        # loads per useful FMA: each reduction step broadcasts oc_tile weights (shared by the rows) and
        # loads oh_tile x vectors inputs (shared by the channels) -- oc 4 x oh 2 ran 1.4x faster than
        # oc 8 x oh 1 at the same accumulator count; a row wider than a vector that is not a multiple
        # of it is split into narrow pieces by LLVM (SPLIT_ROW_PENALTY)
        # a windowed conv's direct tile keeps OH_TILES rows (the other row counts are for im2col's fused rows)
        direct_rows = _oh_tiles(i, lanes) if i.get("pointwise") else U.choices_upto(OH_TILES, i["OH"])
        # with a short reduction per tile (under stack_tile_below_steps steps: a stem's 3x3x3, a 1x1 conv of
        # 8 channels) a tile on the stack (under common.MAX_STACK_ALLOCA_BYTES) first: a larger one costs a
        # workspace allocation and a memset per tile, which few FMAs do not amortize (squeezenet's stem, one
        # thread, CPU time under load: 8 x 32 accumulators 81 us, 4 x 32 on the stack 65 us)
        short = i["RC"] * i["KH"] * i["KW"] < template_defaults(target, self.family)["stack_tile_below_steps"]

        def on_stack(floats: int) -> bool:
            return not short or floats * 4 < U.MAX_STACK_ALLOCA_BYTES

        def score(oc, ow, oh, fused):
            if (fused and not _fused_rows_ok(i, ow, oh)) or (not fused and oh not in direct_rows):
                return (False, False, False, float("-inf"), 0, 0)
            nv = ceil_div(oh * ow, lanes) if fused else oh * ceil_div(ow, lanes)    # vectors per channel
            width = oh * ow if fused else ow
            acc = oc * nv
            fits = acc + min(oc, nv) + 1 <= regs
            split = SPLIT_ROW_PENALTY if width > lanes and width % lanes else 1
            cost = (oc + nv) * split / (oc * oh * ow)
            return (fits, on_stack(oc * oh * ow), i["F"] % oc == 0 and i["OH"] % oh == 0, -cost, acc, -oh)

        # im2col where several full-width rows fill whole vectors (a row alone wastes lanes) and fused
        # into one run of pixels;
        # the fewest vector instructions per useful multiply-add: oc x nv FMAs, oc broadcasts and the
        # input loads (a partial last vector is loaded by LLVM in power-of-two pieces: _load_pieces)
        def col_score(oc, oh):
            nv = ceil_div(oh * i["OW"], lanes)
            acc = oc * nv
            fits = acc + min(oc, nv) + 1 <= regs
            cost = (acc + oc + _load_pieces(oh * i["OW"], lanes)) / (oc * oh * i["OW"])
            return (fits, on_stack(oc * oh * i["OW"]), i["F"] % oc == 0, -cost, acc)

        col_rows = [oh for oh in ch["oh_tile"] if True in ch["fuse_rows"] and True in ch["im2col"]
                    and _fused_rows_ok(i, i["OW"], oh, True) and im2col_default(i, lanes, oh, target)
                    and whole_vectors(oh * i["OW"], lanes) and (oh > 1 or i["OH"] == 1)
                    and i["OW"] < lanes]   # rows narrower than a vector only: measured alone (skx, 2 cores),
        # 3x3 conv+BN+ReLU+residual, im2col'd fused rows vs direct: 32ch@28x28 0.88 vs 0.22 ms, 64ch@56x56
        # 6.4 vs 1.15 ms (the copy dominates), 128ch@7x7 0.147 vs 0.205 ms (im2col wins)
        col = bool(col_rows)
        # im2col with padded rows where a row is an odd number of lanes wider than a vector
        # and one row's window copy fits the table's pad_width_l1_share of L1 (a quarter; skx, 2 cores: the
        # 31x31 stem of 3 channels 746 -> 225 us with it, measured under load; alone: 64ch@56x56, a 144 kB
        # row copy, 1.1 -> 2.0 ms with it; 32ch@28x28, 32 kB, 0.23 -> 0.31 ms)
        padded = padded_width(i, lanes) if True in ch["pad_width"] and im2col_default(i, lanes, 1, target) \
            and i["RC"] * i["KH"] * i["KW"] * i["OW"] * 4 <= \
            float(template_defaults(target, self.family)["pad_width_l1_share"]) * info.l1d_bytes else None

        def pad_score(oc, oh):
            nv = oh * padded // lanes
            acc = oc * nv
            fits = acc + min(oc, nv) + 1 <= regs
            return (fits, on_stack(oc * oh * padded), i["F"] % oc == 0 and i["OH"] % oh == 0,
                    -(acc + oc + nv) / (oc * oh * i["OW"]), acc)

        if col:
            oc, oh = max(((a, c) for a in ch["oc_tile"] for c in col_rows), key=lambda t: col_score(*t))
            ow, fused = i["OW"], True
        elif padded:
            oc, oh = max(((a, c) for a in ch["oc_tile"] for c in direct_rows), key=lambda t: pad_score(*t))
            ow, fused, col = i["OW"], False, True
        else:
            oc, ow, oh, fused = max(((a, b, c, d) for a in ch["oc_tile"] for b in ch["ow_tile"]
                                     for c in ch["oh_tile"] for d in ch["fuse_rows"]), key=lambda t: score(*t))
        bands = batch_size(i) * ceil_div(i["OH"], oh)
        depth = 1 if bands >= self.min_parallel_per_core(target) * info.cores else 2
        if padded and not fused and shared_copy_fits(i, padded, target):
            depth = 2     # the padded copy once, before the tiles (shared_copy_fits)
        # with the channel blocks in the parallel loop (parallel_depth 2) the padded input once, before the
        # tiles: computed per (row band, channel block) it was copied F / oc_tile times (64->64 on 16x16, 16
        # channel blocks: 118 vs 86 us at parallel_depth 1, one core, under load: benchmarks/notes/conv11.md)
        shared_pad = depth > 1 and not col and True in ch["shared_pad"]
        return Conv2DConfig(oc_tile=oc, ow_tile=ow, lanes=lanes, oh_tile=oh,
                            ic_tile=U.nearest_choice(ch["ic_tile"], 1), unroll=max(ch["unroll"]),
                            parallel_depth=depth, parallel=U.parallel_default(conv_work(i), target), fuse_rows=fused,
                            deinterleave=deinterleave_default(i, ch["deinterleave"]) and not col, im2col=col,
                            pad_width=bool(padded) and not fused, shared_pad=shared_pad).asdict()

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, Conv2DConfig.from_dict(config)
        oc_t, oh_t = cfg.oc_tile, cfg.oh_tile
        ow_t = cfg.ow_tile
        # the knobs that apply together (every combination of the space is legal; see their docs):
        # im2col replaces the padded input deinterleave would lay out; pad_width pads im2col's unfused rows
        col = cfg.im2col
        fused = cfg.fuse_rows and _fused_rows_ok(info, ow_t, oh_t, col)
        padded = padded_width(info, cfg.lanes) if cfg.pad_width and col and not fused \
            else None
        deinterleave = cfg.deinterleave and not col

        # Step 1. Fold the elementwise chain into one epilogue block (the padding block stays); without an
        # epilogue, accumulate into a cache block and write back from it; im2col: the windows' copy.  A
        # pointwise conv's channel concat (rule concat_prologue: a 1x1 conv with OIHW weights, SqueezeNet's
        # classifier) is read through the conv's input loads, not copied per parallel iteration.
        conv, epi = prepare_conv(sch, info, deinterleave)
        parts = concat_parts(sch, info["pad"]) if info["pad"] and info.get("pointwise") else []
        if parts:
            sch.compute_inline(sch.get_sblock(info["pad"]))
        input_block = im2col(sch, conv, info) if col else (None if parts else info["pad"])
        if padded:
            input_block = pad_columns(sch, conv, input_block, padded)
            ow_t = padded          # one tile of the padded row; the epilogue stores the valid columns

        # Step 2. Tile the epilogue: (n, row band, channel block, column block) x register tile.
        n, f, y, x = sch.get_loops(epi)
        f0, f1 = sch.split(f, factors=[None, oc_t])
        y0, y1 = sch.split(y, factors=[None, oh_t])
        x0, x1 = sch.split(x, factors=[None, ow_t])
        sch.reorder(n, y0, f0, x0, *((f1, y1) if fused else (y1, f1)), x1)
        band = sch.fuse(n, y0, f0) if cfg.parallel_depth > 1 else sch.fuse(n, y0)
        if cfg.parallel:              # a conv under the target's fork/join cost stays serial (common.py)
            sch.parallel(band)

        # Step 3. The convolution on each register tile: conv shrinks to an accumulator tile; full-width
        # rows of contiguous pixels (pointwise input or im2col copy) are vectorized as one loop (fuse_rows).
        sch.compute_at(conv, x0, preserve_unit_loops=True)
        c_n, c_f, c_y, c_x, rc, ry, rx = sch.get_loops(conv)[-7:]
        rc0, rc1 = sch.split(rc, factors=[None, cfg.ic_tile])
        if fused:
            sch.reorder(rc0, ry, rx, rc1, c_n, c_f, c_y, c_x)
            sch.vectorize(sch.fuse(c_y, c_x))
        else:
            sch.reorder(rc0, ry, rx, rc1, c_n, c_y, c_f, c_x)
            sch.vectorize(c_x)
            sch.unroll(c_y)
        sch.unroll(c_f)
        sch.unroll(c_n)
        # the reduction steps unrolled within a bound on the copies of the tile (code size, LLVM time)
        tile_copies = oc_t * (ceil_div(oh_t * ow_t, cfg.lanes) if fused
                              else oh_t * ceil_div(ow_t, cfg.lanes))
        U.unroll_bounded(sch, ([rc1] if cfg.ic_tile > 1 else []) + [rx, ry][:cfg.unroll],
                         tile_copies)

        # Step 4. The epilogue on the accumulator tile: vectorized along the columns (the pixels); a padded
        # row stores its valid columns only (last step: the partition replaces the epilogue block).
        if not padded:
            sch.vectorize(sch.fuse(y1, x1) if fused else x1)

        # Step 5. Accumulator in registers, initialized before the reduction; the padded input (or the
        # im2col copy) per row band (all channels, the rows its windows read), in the band; an im2col copy
        # of a band split over channel blocks (parallel_depth 2) once before the tiles, not per block, and so
        # the padded input with shared_pad.
        shared_pad = cfg.shared_pad and not col and input_block is not None
        shared = (col and cfg.parallel_depth > 1) or shared_pad
        finish_conv(sch, conv, rc0, input_block, None if shared else band, cfg.lanes,
                    cfg.parallel and (not shared_pad or shared_pad_parallel(sch, info, input_block)))
        # a concat read through the input loads: the input-channel loop cut at the concat's boundaries, so
        # that each part reads one operand (TVM's simplifier then drops the select per load)
        if len(parts) > 1 and all(c % cfg.ic_tile == 0 for c in parts):
            sch.loop_partition(rc0, [c // cfg.ic_tile for c in parts[:-1]] + [None])
        if padded:
            store_valid_columns(sch, x1, info["OW"], cfg.lanes)
