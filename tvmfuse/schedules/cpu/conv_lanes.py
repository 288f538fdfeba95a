"""KxK Conv2D (NCHW, groups 1, any stride/padding/dilation) on a small plane, with its epilogue, scheduled
with the output channels on the vector lanes: ``cpu.conv1x1``'s register tile for convs with a window.

Matches what ``conv2d.find_conv`` matches (one conv block, its padding block, at most one elementwise
epilogue: bias / folded BatchNorm, ReLU, residual add) when the conv has a window (not 1x1 stride 1: that
is ``cpu.conv1x1``), is not grouped, its output plane has fewer pixels than the target table's
``plane_pixels_below`` (``template_defaults["cpu.conv2d_lanes"]``; or fewer than ``wide_plane_pixels_below``
where the direct template's rows leave its vectors partly empty: ``plane_why``), a vector width (the target's or half)
divides the output channels, and its weights are stored with the output channels last: blocked
``[co // B, ci, ky, kx, co % B]`` (kernel layout ``OIHW<B>o``, B the default register tile's channels:
``weight_block``) or [ci, ky, kx, co] (IHWO).  Constant weights come blocked from the graph rewrite
(``passes.rewrites.TransposePointwiseWeights`` asks ``plane_why`` and ``weight_block``), so that each register
tile reads its weights as one contiguous run.

Why: on a 7x7, 3x3 or 2x2 plane the direct template vectorizes along an output row of 7, 3 or 2 pixels
(most lanes idle, or odd-sized vectors), while these convs have 64-512 output channels.  SqueezeNet's fire
modules (3x3 expand convs on 15x15 / 7x7 / 3x3 planes) and ResNet's late stages ran 1.5-2.5x slower than
onnxruntime per kernel (benchmarks/gaps_cnn.md, measured under load).

Schedule: the epilogue is tiled [channel block x row band x column block] in one parallel loop x a register
tile of ``oh_tile x ow_tile`` pixels x ``nvec`` vectors of output channels (``ow_tile`` divides the row;
several rows only as whole rows, so a pixel's row and column are loop variables, never a division); the
conv is computed on each tile (its output shrinks to an accumulator in registers, laid out [n, y, x, co]
so that a vector of channels is contiguous), with the reduction (ci, ky, kx) outside the tile: per step one
input value per pixel is broadcast and ``nvec`` vectors of weights are loaded.  The padded input (small on
these planes) is computed once per call in its own parallel loop before the tiles.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...target import cpu_info, template_defaults
from ..base import Config, KnobSpace, Match, knob
from . import common as U
from .conv1x1 import ChannelLanesConv, channel_lanes
from .conv2d import conv_work, row_lane_use
from .matmul import NVEC_CHOICES, lane_choices

FAMILY = "cpu.conv2d_lanes"
# Pixels of a register tile (broadcast input values, unrolled): a whole 3x3 plane at most.
MAX_TILE_PIXELS = 9


@dataclass(frozen=True)
class ConvLanesConfig(Config):
    """The knobs of ``cpu.conv2d_lanes``: a register tile of ``oh_tile x ow_tile`` pixels x ``nvec`` vectors
    of output channels."""

    oh_tile: int = knob("output rows of the register tile (applies where ow_tile spans the row, else 1)")
    ow_tile: int = knob("output columns of the register tile (a divisor of the row)")
    nvec: int = knob("vectors of output channels per register-tile pixel", NVEC_CHOICES)
    lanes: int = knob("float32 lanes per vector (the target's width, or half)")
    pad_in_loads: bool = knob("where the register tile spans the whole plane: the zero padding read in the "
                              "loads (no padded copy) and the window unrolled, so the multiply-adds of taps "
                              "on the padding fold away (see folds_padding)", (True, False))
    parallel: bool = U.parallel_knob()


def pads_input(func: C.PrimFunc, pad: str | None) -> bool:
    """Whether the padding block ``pad`` (``conv2d.find_conv``'s) adds rows or columns: TVM's conv has one
    even without padding, a copy of the input's shape."""
    if not pad:
        return False
    sch = C.Schedule(func)
    blk = sch.get(sch.get_sblock(pad))
    out = [int(d) if isinstance(d, C.tirx.IntImm) else -1 for d in blk.writes[0].source.shape]
    return any([int(d) if isinstance(d, C.tirx.IntImm) else -1 for d in r.source.shape] != out for r in blk.reads)


def fold_window(info: dict) -> int:
    """The window's taps (KH x KW) of a padded conv, 0 for an unpadded one (``default_tile``)."""
    return info["KH"] * info["KW"] if info["padded"] else 0


def folds_padding(info: dict, oh_t: int, ow_t: int, nvec: int) -> bool:
    """Whether a tile of ``oh_t x ow_t`` pixels x ``nvec`` vectors reads the padding in its loads
    (``pad_in_loads``): the conv is padded, the tile spans the plane (each pixel's row and column, and so
    whether a tap falls on the padding, are constants once the window is unrolled: TVM's simplifier drops
    ``acc + 0 * w``) and the unrolled window stays within MAX_UNROLLED_COPIES before that folding.  A 3x3
    window on a 3x3 plane with padding 1 keeps 49 of its 81 pixel-tap pairs."""
    return info["padded"] and oh_t == info["OH"] and ow_t == info["OW"] and \
        oh_t * ow_t * nvec * info["KH"] * info["KW"] <= U.MAX_UNROLLED_COPIES


def wide_plane(oh: int, ow: int, target: C.Target) -> bool:
    """A plane of ``plane_pixels_below`` pixels or more (``template_defaults["cpu.conv2d_lanes"]``): this family
    takes it only where the direct template's rows waste lanes (``plane_why``), with its own tile rule
    (``pick_tile``'s ``wide``)."""
    return oh * ow >= template_defaults(target, FAMILY)["plane_pixels_below"]


def plane_why(oh: int, ow: int, out_channels: int, in_channels: int, target: C.Target) -> str | None:
    """None when a KxK conv with an ``oh x ow`` output plane, ``out_channels`` and ``in_channels`` is one this
    family takes on ``target`` (given IHWO weights), else why not.  Also asked by the graph rewrite that
    stores such a conv's constant weights [ci, ky, kx, co] (``passes.rewrites.TransposePointwiseWeights``).

    A plane of ``plane_pixels_below`` pixels or more stays with the direct template (vectorized along the
    output row) unless it has fewer than ``wide_plane_pixels_below`` pixels and that template's best row tile
    fills fewer than ``wide_lane_use_below`` of the vector lanes (``conv2d.row_lane_use``: 28 columns on
    AVX-512's 16 lanes, 14-column tiles, 0.875) and the default tile has ``wide_min_accumulators``: there the
    output channels on the lanes fill them all.  One
    core, CPU time, under load (``benchmarks/notes/conv11.md``): bench_cpu's resnet_block (two 32->32 convs on
    28x28, the second with the residual add) 0.94x the direct template's time; on rows the vector divides the
    direct template stays far ahead (64->64 on 32x32, kernel only: 355 vs 967 us, every store of a channel
    vector 4 KiB apart), and on 56x56 the lanes lose with a residual add (conv3x3_bn_relu_res, 64 channels:
    1.03-1.07x the direct template's time; its stores and residual loads a 12 KiB plane apart)."""
    d = template_defaults(target, FAMILY)
    if wide_plane(oh, ow, target):
        if oh * ow >= d["wide_plane_pixels_below"]:
            return (f"plane of {oh * ow} pixels (vectorized along the pixels from {d['plane_pixels_below']} on, "
                    f"and from {d['wide_plane_pixels_below']} on whatever its rows)")
        lanes = cpu_info(target).float32_lanes
        use = row_lane_use(ow, lanes)
        if use >= float(d["wide_lane_use_below"]):
            return (f"plane of {oh * ow} pixels (vectorized along the pixels from {d['plane_pixels_below']} on: "
                    f"its {ow}-column rows fill {use:.0%} of the {lanes} lanes, at least wide_lane_use_below "
                    f"{float(d['wide_lane_use_below']):.0%})")
    if in_channels < d["min_in_channels"]:
        return (f"{in_channels} input channels (a stem: fewer than {d['min_in_channels']}, the direct template "
                f"with deinterleaved rows)")
    if not channel_lanes(out_channels, target):
        lanes = lane_choices(cpu_info(target).float32_lanes)
        return f"{out_channels} output channels: no vector width of {lanes} divides them"
    a, b, v, _ = default_tile(oh, ow, out_channels, target)     # (the fewest accumulators of any window)
    if wide_plane(oh, ow, target) and a * b * v < d["wide_min_accumulators"]:
        # measured on the wide planes: tiles of 8 or more (1 x 7 x 2 on AVX-512, 1 x 4 x 2 on AVX2) only
        return (f"a register tile of {a * b * v} accumulators on the {oh}x{ow} plane (fewer than "
                f"wide_min_accumulators {d['wide_min_accumulators']} on a plane of {d['plane_pixels_below']} "
                f"pixels or more)")
    if a * b * v < d["min_accumulators"]:
        return (f"a register tile of {a * b * v} accumulators on the {oh}x{ow} plane (fewer than "
                f"{d['min_accumulators']}: one FMA chain waits on the last)")
    return None


def default_tile(oh: int, ow: int, out_channels: int, target: C.Target,
                 fold_window: int = 0) -> tuple[int, int, int, int]:
    """(oh_tile, ow_tile, nvec, lanes) of the default register tile on an ``oh x ow`` plane with
    ``out_channels`` (some vector width divides them: ``channel_lanes``); ``fold_window``: the window's taps
    (KH x KW) of a padded conv, 0 unpadded (see pick_tile).  From shapes alone, so the graph rewrite stores
    the weights in blocks of the tile's channels (``weight_block``)."""
    info = cpu_info(target)
    widths = channel_lanes(out_channels, target)
    lanes = max(widths)
    regs = U.Registers.for_bits(info.vector_bits).count
    nvecs = [v for v in U.choices_upto(NVEC_CHOICES, out_channels // min(widths))
             if out_channels % (v * lanes) == 0]
    cap = int(template_defaults(target, FAMILY)["max_accumulators"])
    wide = int(template_defaults(target, FAMILY)["wide_min_accumulators"]) if wide_plane(oh, ow, target) else None
    a, b, v = pick_tile(oh, ow, out_channels, lanes, regs, nvecs, cap, fold_window, wide)
    return a, b, v, lanes


def weight_block(oh: int, ow: int, out_channels: int, target: C.Target, fold_window: int = 0) -> int:
    """Output channels per block of the constant weights (kernel layout ``OIHW<B>o``): the default register
    tile's channels, so that a tile reads its weights as one contiguous run (stored [ci, ky, kx, co], each
    reduction step of a tile read nr channels a whole row of co apart: in the model, with the weights out of
    the caches, squeezenet's 3x3 fire convs on 3x3 planes ran 6-9x their warm time, measured under load)."""
    _, _, nvec, lanes = default_tile(oh, ow, out_channels, target, fold_window)
    return nvec * lanes


def small_plane_why(info: dict, target: C.Target) -> str | None:
    """None when the conv (``conv2d.find_conv``'s info) is one this family takes, else why not."""
    if info.get("pointwise"):
        return "a 1x1 stride-1 conv without padding (cpu.conv1x1)"
    if info.get("grouped"):
        return "a grouped conv"
    if info["weight_layout"] not in ("IHWO", "OIHWo"):
        return "weights not stored [ci, ky, kx, co] or blocked (only constant weights are rewritten so)"
    return plane_why(info["OH"], info["OW"], info["F"], info["RC"], target)


def pixel_tiles(oh: int, ow: int) -> list[tuple[int, int]]:
    """(oh_tile, ow_tile) pairs: a divisor of the row, or several whole rows (a divisor of OH), at most
    MAX_TILE_PIXELS pixels."""
    tiles = [(1, d) for d in range(1, ow + 1) if ow % d == 0 and d <= MAX_TILE_PIXELS]
    tiles += [(r, ow) for r in range(2, oh + 1) if oh % r == 0 and r * ow <= MAX_TILE_PIXELS]
    return tiles


def pick_tile(oh: int, ow: int, f: int, lanes: int, regs: int, nvecs, max_acc: int,
              fold_window: int = 0, wide: int | None = None) -> tuple[int, int, int]:
    """(oh_tile, ow_tile, nvec): accumulators + weight vectors + one broadcast fit in the registers, and at most
    ``max_acc`` accumulators (the target table's ``max_accumulators``); the channel block divides F; most
    accumulators; then, for a padded conv (``fold_window``: its KH x KW taps), a tile that spans the plane and
    so drops the taps on the padding (``pad_in_loads``, :func:`folds_padding`); fewest loads per FMA (pixels +
    nvec per reduction step).

    The folding tie-break: haswell's 16 registers give the 48->192 3x3-plane conv 9 accumulators either as
    1 x 3 pixels x 3 vectors (fewer loads) or 3 x 3 x 1 (the plane, 49 of 81 pixel-tap pairs); haswell code on
    this host, one core, CPU time, 11 interleaved rounds, under load: 30.0 vs 20.3 us (the 64->256 conv's
    3 x 3 x 1 default: 31.8 us folded vs 45.0 copied).

    ``wide`` (a plane of ``plane_pixels_below`` pixels or more, ``wide_plane``: the table's
    ``wide_min_accumulators``, else None): tiles of at least that many accumulators first (enough independent
    FMA chains for two FMA pipes of 4-5 cycles' latency), then the most pixels, then the most accumulators.
    There a tile's weights (RC x KH x KW x its channels) come from L2 for every tile of the plane, so more
    pixels per weight vector win over more accumulators: one core, CPU time, under load
    (``benchmarks/notes/conv11.md``), AVX-512, 64->64 on 56x56: 1 x 7 x 2 1163, 1 x 8 x 2 1207, 1 x 4 x 4 (the
    small-plane rule's pick) 1304 us; 128->128 on 28x28: 1 x 7 x 2 1104, 1 x 4 x 4 1241 us; AVX2 (haswell),
    32->32 on 28x28: 1 x 4 x 2 162, 1 x 7 x 1 (7 chains) 174 us.

    The cap: with 32 vector registers, squeezenet's 15x15 default was 1 x 5 pixels x 4 vectors (20
    accumulators) and its 48->192 3x3-plane default 3 x 3 x 3 (27); one core, CPU time, interleaved, under
    load (benchmarks/conv_kernel_ab.py): 1 x 3 x 4 (12) ran 34-40 vs 38-46 us in 3 of 4 runs (53.8 vs 51.6,
    slower, in the fourth), 3 x 3 x 2 (18) 10.8-14.2 vs 13.3-16.6 us in 2 of 2; the 18-accumulator 3 x 3 x 2 tile of the
    64->256 conv stays the best of its space.  With 16 registers the fit allows at most 14: no change."""
    cands = [(a, b, v) for a, b in pixel_tiles(oh, ow) for v in nvecs]
    fitting = [c for c in cands if c[0] * c[1] * c[2] + c[2] + 1 <= regs and c[0] * c[1] * c[2] <= max_acc] \
        or [min(cands, key=lambda c: c[0] * c[1] * c[2])]

    def score(c):
        a, b, v = c
        folds = fold_window > 0 and (a, b) == (oh, ow) and a * b * v * fold_window <= U.MAX_UNROLLED_COPIES
        size = (a * b * v >= wide, a * b, a * b * v) if wide is not None else (a * b * v,)
        return (f % (v * lanes) == 0, *size, folds, -(a * b + v), b)

    return max(fitting, key=score)


class ConvLanes(ChannelLanesConv, family=FAMILY, config=ConvLanesConfig):
    def why_not(self, info: dict, target: C.Target) -> str | None:
        return small_plane_why(info, target)

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        m = super().match(func, target)
        if m is not None:
            m.info["padded"] = pads_input(func, m.info["pad"])      # (pad_in_loads, the default tile)
        return m

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        i = match.info
        lanes = channel_lanes(i["F"], target)
        tiles = pixel_tiles(i["OH"], i["OW"])
        return ConvLanesConfig.space(oh_tile=tuple(sorted({a for a, _ in tiles})),
                                     ow_tile=tuple(sorted({b for _, b in tiles})),
                                     nvec=U.choices_upto(NVEC_CHOICES, i["F"] // min(lanes)),
                                     lanes=tuple(lanes), pad_in_loads=(True, False), parallel=U.PARALLEL)

    def default_config(self, match: Match, target: C.Target) -> dict:
        i = match.info
        oh_t, ow_t, nvec, lanes = default_tile(i["OH"], i["OW"], i["F"], target, fold_window(i))
        return ConvLanesConfig(oh_tile=oh_t, ow_tile=ow_t, nvec=nvec, lanes=lanes, pad_in_loads=True,
                               parallel=U.parallel_default(conv_work(i), target)).asdict()

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, ConvLanesConfig.from_dict(config)
        lanes, nr = cfg.lanes, cfg.nvec * cfg.lanes
        # every combination of the space is legal: several rows only where the tile spans the row (a pixel's
        # row and column stay loop variables); a tile that does not divide the plane (a record of another
        # shape) would put a predicate on every pixel of the register tile
        oh_t = cfg.oh_tile if cfg.ow_tile == info["OW"] else 1
        if info["OW"] % cfg.ow_tile or info["OH"] % oh_t:
            raise ValueError(f"{FAMILY}: tile {oh_t}x{cfg.ow_tile} does not divide the "
                             f"{info['OH']}x{info['OW']} plane (see pixel_tiles)")

        # Step 1. Fold the elementwise chain into one epilogue block (the padding block stays); without an
        # epilogue, accumulate into a cache block and write back from it.
        U.inline_elementwise(sch, keep=frozenset({info["pad"]} if info["pad"] else ()))
        # pad_in_loads: the padding block folded into the conv's loads (no copy; steps 4 and 6)
        in_loads = cfg.pad_in_loads and folds_padding(info, oh_t, cfg.ow_tile, cfg.nvec)
        if in_loads:
            sch.compute_inline(sch.get_sblock(info["pad"]))
        conv = sch.get_sblock(info["reduction"])
        epi = sch.cache_write(conv, 0, "global") if info["epilogue"] is None else sch.get_sblock(info["epilogue"])

        # Step 2. The accumulator stored [n, y, x, co]: a vector of channels contiguous in it.
        sch.transform_layout(conv, ("write", 0), lambda n, f, y, x: (n, y, x, f))

        # Step 3. Tile the epilogue: (n, channel block, row band, column block) in one parallel loop x
        # register tile [oh_tile x ow_tile pixels x nr channels].
        n, f, y, x = sch.get_loops(epi)
        f0, f1 = sch.split(f, factors=[None, nr])
        y0, y1 = sch.split(y, factors=[None, oh_t])
        x0, x1 = sch.split(x, factors=[None, cfg.ow_tile])
        sch.reorder(n, f0, y0, x0, y1, x1, f1)
        band = sch.fuse(n, f0, y0, x0)
        if cfg.parallel:              # a conv under the target's fork/join cost stays serial (common.py)
            sch.parallel(band)

        # Step 4. The conv on each register tile: the reduction (ci, ky, kx) outermost, kx unrolled, then
        # the pixels (unrolled, broadcast inputs) and the channel vectors (unrolled, lanes); the accumulator
        # in registers, initialized (vectorized) before the reduction.
        sch.compute_at(conv, band, preserve_unit_loops=True)
        c_n, c_f, c_y, c_x, rc, ry, rx = sch.get_loops(conv)[-7:]
        fo, fv = sch.split(c_f, factors=[None, lanes])
        sch.reorder(rc, ry, rx, c_n, c_y, c_x, fo, fv)
        sch.vectorize(fv)
        for loop in (fo, c_x, c_y, c_n):
            sch.unroll(loop)
        if in_loads:
            # the whole window unrolled over constant pixels: a tap on the padding reads if_then_else(False,
            # ..., 0), and its multiply-add folds away in TVM's simplifier after the unrolling
            sch.unroll(rx)
            sch.unroll(ry)
        else:
            U.unroll_bounded(sch, [rx], oh_t * cfg.ow_tile * cfg.nvec)
        # the accumulator stays in the "global" scope: on the stack where it fits (common.MAX_STACK_ALLOCA_BYTES)
        init = sch.decompose_reduction(conv, rc)
        sch.vectorize(sch.get_loops(init)[-1])

        # Step 5. The epilogue on the accumulator tile, vectorized along the channels (stores a plane apart).
        _, e_fv = sch.split(f1, factors=[None, lanes])
        sch.vectorize(e_fv)

        # Step 6. The padded input once per call, before the tiles, in its own parallel loop.
        if info["pad"] and not in_loads:
            block = sch.get_sblock(info["pad"])
            if cfg.parallel:
                sch.parallel(sch.fuse(*sch.get_loops(block)[:-1]))
            U.vectorize_inner(sch, block, lanes)
