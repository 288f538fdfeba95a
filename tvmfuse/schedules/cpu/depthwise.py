"""Depthwise Conv2D (NCHW, groups == channels, any stride/dilation/padding) with its epilogue on CPUs.

Matches, after folding elementwise blocks, one reduction block

    conv[n, f, y, x] += data[n, f (+ rc), y*sh + ry*dh, x*sw + rx*dw] * W[f, rc, ry, rx]     (rc: extent 1)

(the input channel follows the output channel; the reduction is over the window only), followed by at
most one elementwise epilogue block reading ``conv`` at its own indices (folded BN shift, ReLU, residual).

Schedule: parallel over (n, channel [, row band]); the channel's padded plane (the rows its windows read)
is computed inside that loop, so it stays in L1/L2; the output is tiled into [oh_tile rows x ow_tile
columns]; on each tile the window sum is accumulated in registers (the window loops unrolled, one
broadcast weight and one input vector per step, vectorized along the columns) and the epilogue runs on
the accumulator before it is stored.  The full-size conv result is never materialized.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...target import cpu_info
from ...target import template_defaults
from ..base import Config, KnobSpace, Match, knob
from . import common as U
from .conv1x1 import channel_lanes as lane_widths
from .conv2d import (SPLIT_ROW_PENALTY, ConvTemplate, batch_size, ceil_div, deinterleave_choices,
                     conv_work, deinterleave_default, finish_conv, prepare_conv, row_tiles, unroll_copy_rows)

OH_TILES = (1, 2, 4)              # output rows per register tile
UNROLL = (0, 1, 2)                # window loops unrolled: none, kw, kh and kw
PARALLEL_DEPTH = (1, 2)           # 1: parallel over (n, channel); 2: also over row bands


@dataclass(frozen=True)
class DepthwiseConfig(Config):
    """The knobs of ``cpu.depthwise_conv2d_epilogue``: the register tile, the window's unrolling, the parallel
    loop and the strided input's layout."""

    ow_tile: int = knob("output columns per register tile (vectorized)")
    lanes: int = knob("float32 lanes per vector (the target's vector width)")
    oh_tile: int = knob("output rows per register tile")
    unroll: int = knob("window loops unrolled (0 none, 1 kw, 2 kh+kw)", UNROLL)
    parallel_depth: int = knob("outer loops fused into the parallel loop", PARALLEL_DEPTH)
    parallel: bool = U.parallel_knob()
    deinterleave: bool = knob("strided conv: padded input stored by column phase (contiguous vector loads)")
    channel_lanes: int = knob("0: the output columns on the vector lanes; else this many output channels on "
                              "the lanes (a vector width dividing the channels; the tile is then oh_tile x "
                              "ow_tile pixels, several rows only where ow_tile spans the row)", before=0)


def lanes_tile(info: dict, oh_t: int, ow_t: int) -> tuple[int, int]:
    """The (rows, columns) of a ``channel_lanes`` register tile: several rows only where the columns span
    the row (a pixel's row and column stay loop variables)."""
    return (oh_t if ow_t == info["OW"] else 1), ow_t


def folds_padding(info: dict, oh_t: int, ow_t: int) -> bool:
    """Whether a ``channel_lanes`` tile of ``oh_t x ow_t`` pixels reads the padding in its loads: the conv
    is padded (its input is a padding block), the tile spans the plane, and the fully unrolled window
    (pixels x taps copies) stays within ``common.MAX_UNROLLED_COPIES``."""
    return bool(info["pad"]) and (oh_t, ow_t) == (info["OH"], info["OW"]) and \
        oh_t * ow_t * info["KH"] * info["KW"] <= U.MAX_UNROLLED_COPIES


def stack_tile_pixels(info: dict, channel_lanes: int, target: C.Target) -> int:
    """The most pixels of a ``channel_lanes`` register tile whose accumulator stays on the stack (under
    ``common.MAX_STACK_ALLOCA_BYTES``) where the kernel has a parallel loop: its own nest is parallel
    (``common.parallel_default`` of its work), or its batch is symbolic (the size buckets' nests share one
    function, and one of them is parallel).  TVM makes a larger tile a workspace allocation; with the
    parameters captured by the parallel lambda LLVM cannot tell that workspace from the input, and every
    strided input and weight gather is redone per tap (3-4x slower kernels: schedules/cpu_targets.json,
    ``stack_tile_when_parallel``).  Unbounded (a large number) otherwise, or where the table turns it off."""
    if not template_defaults(target, "cpu.depthwise_conv2d_epilogue")["stack_tile_when_parallel"]:
        return 1 << 30
    if info["N"] is not None and not U.parallel_default(conv_work(info), target):
        return 1 << 30
    return (U.MAX_STACK_ALLOCA_BYTES - 1) // (channel_lanes * 4)       # float32 accumulators


class DepthwiseConv2DEpilogue(ConvTemplate):
    family = "cpu.depthwise_conv2d_epilogue"
    config_type = DepthwiseConfig
    depthwise = True

    def parallel_units(self, match: Match, config: dict) -> int:
        # channel planes, or blocks of channel_lanes channels (a record from before the knob: planes)
        return match.info["F"] // (config.get("channel_lanes") or 1)

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        i = match.info
        lanes = cpu_info(target).float32_lanes
        return DepthwiseConfig.space(ow_tile=row_tiles(i["OW"], lanes), lanes=(lanes,),
                                     oh_tile=U.choices_upto(OH_TILES, i["OH"]), deinterleave=deinterleave_choices(i),
                                     channel_lanes=(0, *lane_widths(i["F"], target)))

    def default_config(self, match: Match, target: C.Target) -> dict:
        info, regs, ch = self.target_numbers(match, target)
        i, lanes = match.info, info.float32_lanes

        # register tile: rows x vectors of accumulators, half the registers (the rest: inputs, weights);
        # tiles that divide the plane first (a tail tile is predicated), then the fewest wasted lanes
        # (a row wider than a vector that is not a multiple of it is split by LLVM: SPLIT_ROW_PENALTY),
        # then the most accumulators (independent FMA chains)
        def score(oh, ow):
            nv = ceil_div(ow, lanes)
            acc = oh * nv
            fits = 2 * acc <= regs
            split = SPLIT_ROW_PENALTY if ow > lanes and ow % lanes else 1
            return (fits, i["OH"] % oh == 0, -split * nv * lanes / ow, acc)

        oh, ow = max(((a, b) for a in ch["oh_tile"] for b in ch["ow_tile"]), key=lambda t: score(*t))
        planes = batch_size(i) * i["F"]
        depth = 1 if planes >= self.min_parallel_per_core(target) * info.cores else 2  # else add the row bands
        cl = self.default_channel_lanes(match, target)
        if cl:
            # channel_lanes: a pixel tile of at most lanes_max_pixels accumulators (and half the registers: the
            # rest hold the weight vector and the inputs); among those, tiles that divide the rows (a tail tile
            # is predicated: 7x7 plane, 1 x 7 ran 3.1 us, 2 x 7 3.9, benchmarks/notes/cnn10.md), then one that
            # spans the plane and folds the padding, then the most pixels, then the widest.  Parallel over
            # channel blocks, with the row bands too where the blocks are few per core (a single band where the
            # tile spans the rows: the same loop, so a symbolic batch's size buckets differ in this knob as
            # the column nest's do)
            cap = min(int(template_defaults(target, self.family)["lanes_max_pixels"]), regs // 2,
                      stack_tile_pixels(i, cl, target))

            def lscore(t):
                a, b = lanes_tile(i, *t)
                fits = a * b <= cap
                return (fits, i["OH"] % a == 0, folds_padding(i, a, b), a * b if fits else -a * b, b)

            oh, ow = max(((a, b) for a in ch["oh_tile"] for b in ch["ow_tile"]), key=lscore)
            oh, ow = lanes_tile(i, oh, ow)
            blocks = batch_size(i) * i["F"] // cl
            depth = 1 if blocks >= self.min_parallel_per_core(target) * info.cores else 2
        return DepthwiseConfig(ow_tile=ow, lanes=lanes, oh_tile=oh, unroll=max(ch["unroll"]), parallel_depth=depth,
                               parallel=U.parallel_default(conv_work(i), target),
                               deinterleave=deinterleave_default(i, ch["deinterleave"]) and not cl,
                               channel_lanes=cl).asdict()

    def default_channel_lanes(self, match: Match, target: C.Target) -> int:
        """The default ``channel_lanes``: the widest vector dividing the channels where the output plane has
        fewer pixels than the target table's ``lanes_plane_pixels_below``
        (``template_defaults["cpu.depthwise_conv2d_epilogue"]``), else 0 (columns on the lanes)."""
        i = match.info
        widths = lane_widths(i["F"], target)
        below = int(template_defaults(target, self.family)["lanes_plane_pixels_below"])
        return max(widths) if widths and i["OH"] * i["OW"] < below else 0

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, DepthwiseConfig.from_dict(config)
        if cfg.channel_lanes:
            self.apply_channel_lanes(sch, info, cfg)
            return
        oh_t = cfg.oh_tile
        ow_t = cfg.ow_tile

        # Step 1. Fold the elementwise chain into one epilogue block (the padding block stays); without an
        # epilogue, accumulate into a cache block and write back from it.
        conv, epi = prepare_conv(sch, info, cfg.deinterleave)
        unroll_rows = unroll_copy_rows(sch, info, cfg.lanes)

        # Step 2. Tile the epilogue: (n, channel [, row band]) parallel, then (rows x columns) tiles.
        n, f, y, x = sch.get_loops(epi)
        y0, y1 = sch.split(y, factors=[None, oh_t])
        x0, x1 = sch.split(x, factors=[None, ow_t])
        sch.reorder(n, f, y0, x0, y1, x1)
        plane = sch.fuse(n, f, y0) if cfg.parallel_depth > 1 else sch.fuse(n, f)
        if cfg.parallel:              # a conv under the target's fork/join cost stays serial (common.py)
            sch.parallel(plane)

        # Step 3. The window sum on each tile, in an accumulator tile (registers).
        sch.compute_at(conv, x0, preserve_unit_loops=True)
        c_n, c_f, c_y, c_x, rc, ry, rx = sch.get_loops(conv)[-7:]
        sch.reorder(rc, ry, rx, c_n, c_f, c_y, c_x)
        sch.vectorize(c_x)
        for loop in (c_y, c_f, c_n):
            sch.unroll(loop)
        # the window unrolled within a bound on the copies of the tile (code size, LLVM time)
        U.unroll_bounded(sch, [rx, ry][:cfg.unroll], oh_t * ceil_div(ow_t, cfg.lanes))

        # Step 4. The epilogue on the accumulator tile, vectorized along the columns.
        sch.vectorize(x1)

        # Step 5. Accumulator in registers, initialized before the window loops; the channel's padded
        # plane (rows of this band) inside the parallel loop.
        finish_conv(sch, conv, rc, info["pad"], plane, cfg.lanes, cfg.parallel, unroll_rows)

    def apply_channel_lanes(self, sch: C.Schedule, info: dict, cfg: DepthwiseConfig) -> None:
        """``channel_lanes``: the output channels on the vector lanes (module docstring, "Small planes")."""
        nr = cfg.channel_lanes
        if info["F"] % nr:
            raise ValueError(f"{self.family}: channel_lanes {nr} does not divide the {info['F']} channels")
        oh_t, ow_t = lanes_tile(info, cfg.oh_tile, cfg.ow_tile)
        in_loads = folds_padding(info, oh_t, ow_t)

        # Step 1. Fold the elementwise chain into one epilogue block (the padding block stays, or is read in
        # the conv's loads where the tile folds the padding); without an epilogue, a cache block.
        U.inline_elementwise(sch, keep=frozenset({info["pad"]} if info["pad"] else ()))
        if in_loads:
            sch.compute_inline(sch.get_sblock(info["pad"]))
        conv = sch.get_sblock(info["reduction"])
        epi = sch.cache_write(conv, 0, "global") if info["epilogue"] is None else sch.get_sblock(info["epilogue"])

        # Step 2. The accumulator and the padded input stored channel-last: a vector of channels contiguous.
        sch.transform_layout(conv, ("write", 0), lambda n, f, y, x: (n, y, x, f))
        if info["pad"] and not in_loads:
            sch.transform_layout(sch.get_sblock(info["pad"]), ("write", 0), lambda n, c, y, x: (n, y, x, c))

        # Step 3. Tile the epilogue: (n, channel block [, row band]) parallel, then (rows x columns) tiles of
        # one vector of channels each.
        n, f, y, x = sch.get_loops(epi)
        f0, f1 = sch.split(f, factors=[None, nr])
        y0, y1 = sch.split(y, factors=[None, oh_t])
        x0, x1 = sch.split(x, factors=[None, ow_t])
        sch.reorder(n, f0, y0, x0, y1, x1, f1)
        band = sch.fuse(n, f0, y0) if cfg.parallel_depth > 1 else sch.fuse(n, f0)
        if cfg.parallel:              # a conv under the target's fork/join cost stays serial (common.py)
            sch.parallel(band)

        # Step 4. The window sum on each tile: the taps outermost (one weight vector per tap for all the
        # tile's pixels), the pixels unrolled, the channels on the lanes; where the padding is read in the
        # loads the whole window is unrolled over constant pixels (taps on the padding fold away).
        sch.compute_at(conv, x0, preserve_unit_loops=True)
        c_n, c_f, c_y, c_x, rc, ry, rx = sch.get_loops(conv)[-7:]
        sch.reorder(rc, ry, rx, c_n, c_y, c_x, c_f)
        sch.vectorize(c_f)
        for loop in (c_x, c_y, c_n):
            sch.unroll(loop)
        if in_loads:
            sch.unroll(rx)
            sch.unroll(ry)
        else:
            U.unroll_bounded(sch, [rx, ry][:cfg.unroll], oh_t * ow_t)
        init = sch.decompose_reduction(conv, rc)
        sch.vectorize(sch.get_loops(init)[-1])

        # Step 5. The epilogue on the accumulator tile, vectorized along the channels (stores a plane apart).
        sch.vectorize(f1)

        # Step 6. The channel block's padded input (the rows of its band), channel-last, in the parallel loop.
        if info["pad"] and not in_loads:
            block = sch.get_sblock(info["pad"])
            sch.compute_at(block, band, preserve_unit_loops=True)
            p_n, p_c, p_y, p_x = sch.get_loops(block)[-4:]
            sch.reorder(p_n, p_y, p_x, p_c)
            sch.vectorize(p_c)
