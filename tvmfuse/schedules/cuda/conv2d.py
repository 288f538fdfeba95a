"""CUDA: direct NCHW Conv2D anchors with their epilogue (folded BatchNorm, ReLU, residual add).

Thread-block tiling over (output channels) x (output pixels, H*W flattened), ``blockIdx.z`` over the
batch; each step stages a ``tile_c``-channel slice of the padded input window and of the weights in
shared memory (the padding is computed while staging: no padded copy in global memory); each thread
accumulates a ``micro_f x micro_p`` register tile and applies the epilogue to it in registers.

Matches one contraction ``out[n, f, y, x] += data[n, c, y*s + ry*d, x*s + rx*d] * w[f, c, ry, rx]`` (the
data operand read through a window, the weight operand not), whose other blocks are all spatial.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import index_vars, multiply_accumulate, nearest
from ..base import Config, KnobSpace, Match, knob
from .depthwise import depthwise_anchor
from ._common import (CudaTemplate, accumulate_in_registers, arch_of, bind_tile, blocks_of_tile, data_producer,
                      divisors_among, group_anchor, inline_glue, single_anchor, stage_cooperatively, stage_window)

THREADS_F = (4, 8, 16)          # threads along output channels
THREADS_P = (8, 16, 32, 64)     # threads along output pixels: at most 16 x 64 = 1024
MICRO = (1, 2)                  # outputs per thread per axis
TILE_C = (1, 2, 4, 8)           # input channels staged per step


@dataclass(frozen=True)
class Conv2dConfig(Config):
    """The knobs of a direct conv: the (channels x pixels) thread tile, each thread's register tile, and
    the channel slice staged per step."""

    threads_f: int = knob("threads along output channels (threadIdx.y)")
    threads_p: int = knob("threads along output pixels (threadIdx.x)")
    micro_f: int = knob("output channels per thread")
    micro_p: int = knob("output pixels per thread")
    tile_c: int = knob("input channels staged in shared memory per step")


def conv_anchor(g, block) -> dict | None:
    """Roles of a direct-convolution block (4 spatial, 3 reduction iters, NCHW/OIHW); else None."""
    if block.kinds != "SSSSRRR":
        return None
    mac = multiply_accumulate(block.stmt)
    if mac is None:
        return None
    window = [any(len(v) > 1 for v in index_vars(ld.indices)) for ld in mac]
    if window.count(True) != 1:
        return None
    data = mac[0] if window[0] else mac[1]
    f, c = block.extents[1], block.extents[4]
    return {"data_operand": 0 if window[0] else 1, "pad": data_producer(g, block, data),
            "batch": block.extents[0], "f": f, "pixels": block.extents[2] * block.extents[3],
            "width": block.extents[3], "c": c, "kernel": block.extents[5] * block.extents[6]}


def row_aligned(tile: int, width: int) -> bool:
    """A pixel tile (of the flattened output rows) that starts each block at a row boundary or inside one
    row: whole rows (``tile % width == 0``) or a divisor of the row.  Only then does TVM's region analysis
    bound the staged input window to the tile's rows; a tile that straddles rows at varying offsets
    stages the whole padded input (all channels: 1.7 MB of shared memory at 128 x 56 x 56)."""
    return tile % width == 0 or width % tile == 0


def aligned_threads(width: int) -> list[int]:
    """The two largest multiples of the output row width in [16, 64] (threads along pixels that cover
    whole rows): 56 for rows of 56 or 28, 56 and 42 for rows of 14; none for rows wider than 64."""
    return sorted(k * width for k in range(1, 65) if 16 <= k * width <= max(THREADS_P))[-2:]


class CudaConv2d(CudaTemplate, family="cuda_conv2d", config=Conv2dConfig):
    def match_graph(self, g, func: C.PrimFunc, target: C.Target) -> Match | None:
        anchor = single_anchor(g)
        roles = conv_anchor(g, anchor) if anchor is not None else None
        if roles is None or depthwise_anchor(g, anchor) is not None:
            return None                     # depthwise: the depthwise template's (no channel reduction)
        return Match(self.family, {"blocks": [b.name for b in g.blocks], "anchor": anchor.name, **roles})

    def accepts(self, group, target: C.Target) -> str | None:
        g, anchor, why = group_anchor(group)
        if why is None and (conv_anchor(g, anchor) is None or depthwise_anchor(g, anchor) is not None):
            why = "the anchor is not a dense/grouped NCHW conv2d"
        return why

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        info = match.info
        per_c = 32 * info["kernel"] * 4            # weight bytes per staged channel at the widest tile
        stage = arch_of(target).max_shared_bytes // 2   # the weight slice: at most half the static shared memory
        tc = [t for t in divisors_among(info["c"], TILE_C) if t * per_c <= stage] or [1]
        # never more pixel threads than pixels, and the whole image as one tile when it fits one block: a
        # 1 x 1 map (squeeze-excite) on 8 pixel threads had 7 idle threads store their empty accumulators
        # over the one output (the epilogue carries no pixel predicate when the pixel index is constant),
        # and 7 x 7 had no row-aligned count among 8 / 16 / 32 (TVM then failed to stage the window)
        pixels = info["pixels"]
        tp = sorted({t for t in THREADS_P if t <= pixels} |
                    {t for t in aligned_threads(info.get("width", 0) or 1) if t <= pixels} |
                    ({pixels} if pixels <= max(THREADS_P) else set()))
        return Conv2dConfig.space(threads_f=[t for t in THREADS_F if t <= max(THREADS_F[0], info["f"])],
                                  threads_p=tp, micro_f=MICRO, micro_p=MICRO, tile_c=tc)

    def default_config(self, match: Match, target: C.Target) -> dict:
        arch = arch_of(target)
        sp = {k.name: k.choices for k in self.space(match, target).knobs}
        info = match.info
        cfg = {"threads_f": nearest(sp["threads_f"], 8), "threads_p": nearest(sp["threads_p"], 32),
               "micro_f": 2, "micro_p": 2, "tile_c": nearest(sp["tile_c"], 8)}
        blocks = blocks_of_tile(info["f"], info["pixels"], cfg["threads_f"] * 2, cfg["threads_p"] * 2)
        if blocks * info["batch"] < arch.sm_count:      # small layers: one output per thread, more blocks
            cfg["micro_f"] = cfg["micro_p"] = 1
        width = info.get("width", 0)
        if width and not row_aligned(cfg["threads_p"] * cfg["micro_p"], width):
            # the pixel tile nearest the default's that is row-aligned (a tight input window), if any
            cands = [(tp, mp) for tp in sp["threads_p"] for mp in sp["micro_p"]
                     if mp <= cfg["micro_p"] and row_aligned(tp * mp, width)]
            if cands:
                want = cfg["threads_p"] * cfg["micro_p"]
                cfg["threads_p"], cfg["micro_p"] = min(cands, key=lambda c: (abs(c[0] * c[1] - want), -c[0]))
        return Conv2dConfig(**cfg).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, Conv2dConfig.from_dict(config)
        keep = {info["anchor"]} | ({info["pad"]} if info["pad"] else set())
        # Step 1. Inline the epilogue glue (BN scale/shift, ReLU, residual add) into one block.
        left = inline_glue(sch, info["blocks"], keep)
        epilogue = [n for n in left if n not in keep]
        conv = sch.get_sblock(info["anchor"])
        # Step 2. Tiles: n -> blockIdx.z, f -> (by, ty, uf), y*x -> (bx, tx, up), c -> (co, ci).
        n, f, y, x, rc, ry, rx = sch.get_loops(conv)
        p = sch.fuse(y, x)
        by, ty, fi = sch.split(f, [None, cfg.threads_f, cfg.micro_f], preserve_unit_iters=True)
        bx, tx, pi = sch.split(p, [None, cfg.threads_p, cfg.micro_p], preserve_unit_iters=True)
        co, ci = sch.split(rc, [None, cfg.tile_c], preserve_unit_iters=True)
        sch.reorder(n, by, bx, ty, tx, co, ci, ry, rx, fi, pi)
        bind_tile(sch, n, by, bx, ty, tx)
        # Step 3. Accumulators in registers, epilogue applied per thread on its output tile.
        accumulate_in_registers(sch, conv, epilogue, tx)
        # Step 4. Stage the padded input window (computed while loading) and the weights per step.
        data = stage_window(sch, conv, info["pad"], info["data_operand"], co)
        weight = sch.cache_read(conv, 1 - info["data_operand"], "shared", consumer_blocks=[conv])
        sch.compute_at(weight, co, preserve_unit_loops=True)
        for stage in (data, weight):
            stage_cooperatively(sch, stage, 6, cfg.threads_f, cfg.threads_p)
        # Step 5. Initialize the accumulators before the channel loop.
        sch.decompose_reduction(conv, co)
