"""CUDA: direct NCHW Conv2D anchors with their epilogue (folded BatchNorm, ReLU, residual add).

Thread-block tiling over (output channels) x (output pixels, H*W flattened), ``blockIdx.z`` over the
batch; each step stages a ``tile_c``-channel slice of the padded input window and of the weights in
shared memory (the padding is computed while staging: no padded copy in global memory); each thread
accumulates a ``micro_f x micro_p`` register tile and applies the epilogue to it in registers.

Matches one contraction ``out[n, f, y, x] += data[n, c, y*s + ry*d, x*s + rx*d] * w[f, c, ry, rx]`` (the
data operand read through a window, the weight operand not), whose other blocks are all spatial.
"""
from __future__ import annotations

from ... import _compat as C
from ..base import Knob, KnobSpace, Match, Template
from .depthwise import depthwise_anchor
from ._common import arch_of, block_graph, divisors_among, index_vars, inline_glue, multiply_accumulate, nearest

THREADS_F = (4, 8, 16)          # threads along output channels
THREADS_P = (8, 16, 32, 64)     # threads along output pixels: at most 16 x 64 = 1024
MICRO = (1, 2)                  # outputs per thread per axis
TILE_C = (1, 2, 4, 8)           # input channels staged per step
WEIGHT_STAGE_BYTES = 24 * 1024  # at most half the static shared memory for the weight slice


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
    data, weight = (mac[0], mac[1]) if window[0] else (mac[1], mac[0])
    producer = [p for p in g.producers[block.name]
                if any(w.same_as(data.source) for w in g.by_name(p).writes)]
    f, c = block.extents[1], block.extents[4]
    return {"data_operand": 0 if window[0] else 1, "pad": producer[0] if producer else None,
            "batch": block.extents[0], "f": f, "pixels": block.extents[2] * block.extents[3],
            "c": c, "kernel": block.extents[5] * block.extents[6]}


class CudaConv2d(Template):
    family = "cuda_conv2d"
    target_kinds = ("cuda",)

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        g = block_graph(func)
        if g is None:
            return None
        reds = [b for b in g.blocks if "R" in b.kinds]
        if len(reds) != 1 or not all(b.is_spatial for b in g.blocks if b is not reds[0]):
            return None
        roles = conv_anchor(g, reds[0])
        if roles is None or depthwise_anchor(g, reds[0]) is not None:
            return None                     # depthwise: the depthwise template's (no channel reduction)
        return Match(self.family, {"blocks": [b.name for b in g.blocks], "anchor": reds[0].name, **roles})

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        info = match.info
        per_c = 32 * info["kernel"] * 4            # weight bytes per staged channel at the widest tile
        tc = [t for t in divisors_among(info["c"], TILE_C) if t * per_c <= WEIGHT_STAGE_BYTES] or [1]
        return KnobSpace((
            Knob("threads_f", tuple(t for t in THREADS_F if t <= max(THREADS_F[0], info["f"])),
                 "threads along output channels (threadIdx.y)"),
            Knob("threads_p", tuple(t for t in THREADS_P if t <= max(THREADS_P[0], info["pixels"])),
                 "threads along output pixels (threadIdx.x)"),
            Knob("micro_f", MICRO, "output channels per thread"),
            Knob("micro_p", MICRO, "output pixels per thread"),
            Knob("tile_c", tuple(tc), "input channels staged in shared memory per step"),
        ))

    def default_config(self, match: Match, target: C.Target) -> dict:
        arch = arch_of(target)
        sp = {k.name: k.choices for k in self.space(match, target).knobs}
        info = match.info
        cfg = {"threads_f": nearest(sp["threads_f"], 8), "threads_p": nearest(sp["threads_p"], 32),
               "micro_f": 2, "micro_p": 2, "tile_c": nearest(sp["tile_c"], 8)}
        blocks = (-(-info["f"] // (cfg["threads_f"] * 2))) * (-(-info["pixels"] // (cfg["threads_p"] * 2)))
        if blocks * info["batch"] < arch.sm_count:      # small layers: one output per thread, more blocks
            cfg["micro_f"] = cfg["micro_p"] = 1
        return cfg

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info = match.info
        tf, tp, uf, up = config["threads_f"], config["threads_p"], config["micro_f"], config["micro_p"]
        keep = {info["anchor"]} | ({info["pad"]} if info["pad"] else set())
        # Step 1. Inline the epilogue glue (BN scale/shift, ReLU, residual add) into one block.
        left = inline_glue(sch, info["blocks"], keep)
        epilogue = [n for n in left if n not in keep]
        conv = sch.get_sblock(info["anchor"])
        # Step 2. Tiles: n -> blockIdx.z, f -> (by, ty, uf), y*x -> (bx, tx, up), c -> (co, ci).
        n, f, y, x, rc, ry, rx = sch.get_loops(conv)
        p = sch.fuse(y, x)
        by, ty, fi = sch.split(f, [None, tf, uf], preserve_unit_iters=True)
        bx, tx, pi = sch.split(p, [None, tp, up], preserve_unit_iters=True)
        co, ci = sch.split(rc, [None, config["tile_c"]], preserve_unit_iters=True)
        sch.reorder(n, by, bx, ty, tx, co, ci, ry, rx, fi, pi)
        sch.bind(n, "blockIdx.z")
        sch.bind(by, "blockIdx.y")
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        sch.bind(tx, "threadIdx.x")
        # Step 3. Accumulators in registers, epilogue applied per thread on its output tile.
        if epilogue:
            for name in epilogue:
                sch.reverse_compute_at(sch.get_sblock(name), tx, preserve_unit_loops=True)
            sch.set_scope(conv, 0, "local")
        else:
            store = sch.cache_write(conv, 0, "local")
            sch.reverse_compute_at(store, tx, preserve_unit_loops=True)
        # Step 4. Stage the padded input window (computed while loading) and the weights per step.
        if info["pad"]:
            data = sch.get_sblock(info["pad"])
            sch.compute_at(data, co, preserve_unit_loops=True)
            sch.set_scope(data, 0, "shared")
        else:
            data = sch.cache_read(conv, info["data_operand"], "shared", consumer_blocks=[conv])
            sch.compute_at(data, co, preserve_unit_loops=True)
        weight = sch.cache_read(conv, 1 - info["data_operand"], "shared", consumer_blocks=[conv])
        sch.compute_at(weight, co, preserve_unit_loops=True)
        for stage in (data, weight):
            own = sch.get_loops(stage)[6:]
            fused = sch.fuse(*own) if len(own) > 1 else own[0]
            _, cty, ctx = sch.split(fused, [None, tf, tp], preserve_unit_iters=True)
            sch.bind(cty, "threadIdx.y")
            sch.bind(ctx, "threadIdx.x")
        # Step 5. Initialize the accumulators before the channel loop.
        sch.decompose_reduction(conv, co)
