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
from ..base import Config, KnobSpace, Match, knob
from . import common as U
from .conv2d import (SPLIT_ROW_PENALTY, ConvTemplate, batch_size, ceil_div, deinterleave_choices,
                     conv_work, deinterleave_default, finish_conv, prepare_conv, row_tiles)

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


class DepthwiseConv2DEpilogue(ConvTemplate):
    family = "cpu.depthwise_conv2d_epilogue"
    config_type = DepthwiseConfig
    depthwise = True

    def parallel_units(self, match: Match, config: dict) -> int:
        return match.info["F"]          # channel planes

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        i = match.info
        lanes = cpu_info(target).float32_lanes
        return DepthwiseConfig.space(ow_tile=row_tiles(i["OW"], lanes), lanes=(lanes,),
                                     oh_tile=U.choices_upto(OH_TILES, i["OH"]), deinterleave=deinterleave_choices(i))

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
        return DepthwiseConfig(ow_tile=ow, lanes=lanes, oh_tile=oh, unroll=max(ch["unroll"]), parallel_depth=depth,
                               parallel=U.parallel_default(conv_work(i), target),
                               deinterleave=deinterleave_default(i, ch["deinterleave"])).asdict()

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, DepthwiseConfig.from_dict(config)
        oh_t = cfg.oh_tile
        ow_t = cfg.ow_tile

        # Step 1. Fold the elementwise chain into one epilogue block (the padding block stays); without an
        # epilogue, accumulate into a cache block and write back from it.
        conv, epi = prepare_conv(sch, info, cfg.deinterleave)

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
        finish_conv(sch, conv, rc, info["pad"], plane, cfg.lanes, cfg.parallel)
