"""CUDA: depthwise NCHW Conv2D (groups == input channels, each output channel reading one input channel)
with its epilogue (folded BatchNorm, ReLU, residual add).

No channel reduction, so nothing to share across output channels: a thread block owns one channel plane
of one image and a ``threads_y`` x ``threads_x * micro_x`` tile of its output pixels (2-D, so the input
window of the tile is a rectangle of constant size); the padded input rows and columns the tile needs are
staged once per block in shared memory (the padding computed while staging: no padded copy in global
memory); each thread holds the channel's ``kh x kw`` weights in registers, reused over its ``micro_x``
pixels (``threads_x`` apart: a warp stores consecutive pixels), each pixel accumulated in a register and
the epilogue applied to it there before the one store.

Matches one block ``out[n, f, y, x] += data[n, g(f) (+ rc), y*s + ry*d, x*s + rx*d] * w[f, (rc,) ry, rx]``
whose data channel index is a function of the output channel ``f`` (any reduction over input channels
has extent 1), the other blocks all spatial.  Dense and grouped convolutions are the conv2d template's.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import coef, index_vars, multiply_accumulate, nearest
from ..base import Config, KnobSpace, Match, knob
from ._common import (CudaTemplate, accumulate_in_registers, arch_of, bind, data_producer, group_anchor, inline_glue,
                      single_anchor, stage_cooperatively, stage_window)

THREADS_X = (8, 16, 32, 64, 128)   # threads along output columns (threadIdx.x)
THREADS_Y = (1, 2, 4, 8)           # threads along output rows (threadIdx.y): at most 128 x 8 = 1024 threads
MICRO_X = (1, 2, 4)                # output pixels per thread along a row (its weights in registers reused)
F32 = 4


@dataclass(frozen=True)
class DepthwiseConfig(Config):
    """The knobs of a depthwise conv: the 2-D pixel tile of a block and the pixels per thread."""

    threads_x: int = knob("threads along output columns (threadIdx.x)")
    threads_y: int = knob("threads along output rows (threadIdx.y)")
    micro_x: int = knob("output pixels per thread along a row (reusing its weights in registers)")


def depthwise_anchor(g, block) -> dict | None:
    """Roles of a depthwise-convolution block (NCHW, kinds SSSS + [R] + RR, the data channel a function
    of the output channel); else None."""
    if block.kinds not in ("SSSSRR", "SSSSRRR"):
        return None
    if block.kinds == "SSSSRRR" and block.extents[4] != 1:
        return None                          # a reduction over input channels: not depthwise
    mac = multiply_accumulate(block.stmt)
    if mac is None:
        return None
    window = [any(len(v) > 1 for v in index_vars(ld.indices)) and len(ld.indices) == 4 for ld in mac]
    if window.count(True) != 1:
        return None
    data, weight = (mac[0], mac[1]) if window[0] else (mac[1], mac[0])
    ivs = [iv.var for iv in block.stmt.iter_vars]
    f = ivs[1]
    chan = index_vars([data.indices[1]])[0]
    if not any(v.same_as(f) for v in chan):
        return None                          # the data channel does not follow the output channel
    rows, cols = index_vars([data.indices[2]])[0], index_vars([data.indices[3]])[0]
    ry, rx = ivs[-2], ivs[-1]
    if not (any(v.same_as(ry) for v in rows) and any(v.same_as(rx) for v in cols)):
        return None
    in_shape = [int(d) for d in C.tensor_shape(data.source)]
    n, f_ext, oh, ow = block.extents[:4]
    kh, kw = block.extents[-2], block.extents[-1]
    return {"data_operand": 0 if window[0] else 1, "pad": data_producer(g, block, data),
            "batch": n, "f": f_ext, "oh": oh, "ow": ow, "pixels": oh * ow, "kh": kh, "kw": kw,
            "in_h": in_shape[2], "in_w": in_shape[3],
            # input rows per output row (stride) and rows of one window (dilated kh), from the row index;
            # an index of another form: the whole plane (the footprint bound stays an upper bound)
            "stride": coef(data.indices[2], ivs[2]) or in_shape[2],
            "window_rows": ((coef(data.indices[2], ry) or in_shape[2]) * (kh - 1) + 1),
            "stride_x": coef(data.indices[3], ivs[3]) or in_shape[3],
            "window_cols": ((coef(data.indices[3], rx) or in_shape[3]) * (kw - 1) + 1)}


class CudaDepthwiseConv2d(CudaTemplate, family="cuda_depthwise_conv2d", config=DepthwiseConfig):
    def match_graph(self, g, func: C.PrimFunc, target: C.Target) -> Match | None:
        anchor = single_anchor(g)
        roles = depthwise_anchor(g, anchor) if anchor is not None else None
        if roles is None:
            return None
        m = Match(self.family, {"blocks": [b.name for b in g.blocks], "anchor": anchor.name, **roles})
        if not self._choices(m, target)[2]:
            return None
        return m

    def accepts(self, group, target: C.Target) -> str | None:
        g, anchor, why = group_anchor(group)
        if why is not None:
            return why
        roles = depthwise_anchor(g, anchor)
        if roles is None:
            return "the anchor is not a depthwise NCHW conv2d"
        if not self._choices(Match(self.family, roles), target)[2]:
            return "not even the smallest output tile's input window fits the arch's shared memory"
        return None

    # ----------------------------------------------------------------------------------- knob space
    def stage_bytes(self, info: dict, rows: int, cols: int) -> int:
        """The shared input window of a ``rows`` x ``cols`` output tile (clipped to the padded input)."""
        in_rows = min(info["in_h"], (rows - 1) * info["stride"] + info["window_rows"])
        in_cols = min(info["in_w"], (cols - 1) * info["stride_x"] + info["window_cols"])
        return F32 * in_rows * in_cols

    def _choices(self, match: Match, target: C.Target):
        """Per-knob choices such that every combination stays legal: the largest tile of the space must
        fit the arch's static shared memory; shrink the largest choices until it does."""
        info, arch = match.info, arch_of(target)
        tx = [t for t in THREADS_X if t == THREADS_X[0] or t // 2 < info["ow"]]
        ty = [t for t in THREADS_Y if t == 1 or t // 2 < info["oh"]]
        ux = [u for u in MICRO_X if u == 1 or (u // 2) * min(tx) < info["ow"]]
        while self.stage_bytes(info, max(ty), max(tx) * max(ux)) > arch.max_shared_bytes:
            longest = max((len(c), i) for i, c in enumerate((ux, tx, ty)))[1]
            choice = (ux, tx, ty)[longest]
            if len(choice) == 1:
                return tx, ty, []            # not even the smallest tile fits: not this template's
            choice.pop()
        return tx, ty, ux

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        tx, ty, ux = self._choices(match, target)
        return DepthwiseConfig.space(threads_x=tx, threads_y=ty, micro_x=ux)

    def default_config(self, match: Match, target: C.Target) -> dict:
        arch = arch_of(target)
        sp = {k.name: k.choices for k in self.space(match, target).knobs}
        info = match.info
        # a row's columns across threadIdx.x (at most a warp), up to the arch's pixels per thread: the
        # widest tile whose last one wastes at most a quarter of a row, then the most pixels per thread
        ow = info["ow"]
        pairs = [(t, u) for t in sp["threads_x"] if t <= 32 for u in sp["micro_x"] if u <= arch.dw_micro]
        pairs = pairs or [(min(sp["threads_x"]), min(sp["micro_x"]))]
        tx, micro = min(pairs, key=lambda tu: (max(0, -(-ow // (tu[0] * tu[1])) * tu[0] * tu[1] - ow - ow // 4),
                                               -tu[0] * tu[1], -tu[1]))
        ty = nearest(sp["threads_y"], max(1, arch.dw_threads // tx))
        return DepthwiseConfig(threads_x=tx, threads_y=ty, micro_x=micro).asdict()

    # ----------------------------------------------------------------------------------- schedule
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, DepthwiseConfig.from_dict(config)
        tx_n, ty_n, ux_n = cfg.threads_x, cfg.threads_y, cfg.micro_x
        keep = {info["anchor"]} | ({info["pad"]} if info["pad"] else set())
        # Step 1. Inline the epilogue glue (BN scale/shift, ReLU, residual add) into one block.
        left = inline_glue(sch, info["blocks"], keep)
        epilogue = [n for n in left if n not in keep]
        conv = sch.get_sblock(info["anchor"])
        # Step 2. (n, f) -> blockIdx.x (one channel plane per block); the output tile: y -> (tile,
        #         threadIdx.y), x -> (tile, pixels per thread, threadIdx.x); the two tile loops fused
        #         -> blockIdx.y.  Per thread, its pixels one after another, each through the window.
        loops = sch.get_loops(conv)
        n, f, y, x = loops[:4]
        red = loops[4:]
        nf = sch.fuse(n, f)
        yo, ty = sch.split(y, [None, ty_n], preserve_unit_iters=True)
        xo, ux, tx = sch.split(x, [None, ux_n, tx_n], preserve_unit_iters=True)
        sch.reorder(nf, yo, xo, ty, tx, ux, *red)
        tile = sch.fuse(yo, xo)
        bind(sch, blockIdx_x=nf, blockIdx_y=tile, threadIdx_y=ty, threadIdx_x=tx)
        # Step 3. The accumulator in a register, the epilogue applied to it per pixel.
        accumulate_in_registers(sch, conv, epilogue, ux)
        # Step 4. The tile's input window, padded while staging, in shared memory once per block,
        #         loaded by all its threads.
        data = stage_window(sch, conv, info["pad"], info["data_operand"], tile)
        stage_cooperatively(sch, data, 2, ty_n, tx_n)
        # Step 5. The channel's kh x kw weights in registers, loaded once per thread.
        weight = sch.cache_read(conv, 1 - info["data_operand"], "local", consumer_blocks=[conv])
        sch.compute_at(weight, tx, preserve_unit_loops=True)
        # Step 6. Initialize the accumulators before the window loops.
        sch.decompose_reduction(conv, red[0])
