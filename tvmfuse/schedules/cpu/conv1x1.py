"""1x1 stride-1 Conv2D (NCHW, groups 1) on a small plane, with its epilogue, scheduled as a matmul with the
output channels on the vector lanes.

Matches what ``conv2d.find_conv`` matches (one conv block, its identity padding block, at most one
elementwise epilogue: bias / folded BatchNorm, ReLU, residual add) when the conv is pointwise (1x1, stride 1,
no padding), not grouped, its plane has fewer pixels than the target table's ``plane_pixels_below``
(``template_defaults["cpu.conv1x1"]``) and a register-tile width (a vector or half of one) divides the
output channels.

Why: ``out[co, p] = sum_ci W[co, ci] * x[ci, p]`` is a matmul over the P = H x W pixels.  The direct conv
template vectorizes along the pixels, which wastes lanes on a small plane (2x2: 4 of 16 lanes) or leaves an
odd-sized vector (7x7: 49 pixels, 15x15: 225).  Here the register tile is ``mr`` pixels x ``nvec`` vectors of
output channels: per input channel, ``mr`` pixels are broadcast and ``nvec`` vectors of weights loaded.

Schedule: the conv and its epilogue iterate over the flattened pixel index p = y * W + x
(``transform_block_layout``); the epilogue is tiled [co block x pixel block] x register tile and the conv is
computed on each tile (its output shrinks to an accumulator in registers); the epilogue runs on the
accumulator and stores each vector of channels P floats apart.  The weights are read with co contiguous:
constant weights come blocked ``[co // B, ci, 1, 1, co % B]`` from the graph rewrite (B the default tile's
channels: ``weight_block``; each tile's weights one contiguous run); others (OIHW) are packed transposed once
per call in their own parallel loop (CO x CI copies, amortized over the P pixels each weight multiplies).
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...target import cpu_info, template_defaults
from ..base import Config, KnobSpace, Match, knob
from . import common as U
from ..buckets import BatchBuckets
from .conv2d import batch_size, find_conv, set_batch_bounds
from .matmul import K_UNROLL, MR_CHOICES, NVEC_CHOICES, lane_choices, pick_register_tile, stack_accumulator_vectors

FAMILY = "cpu.conv1x1"


@dataclass(frozen=True)
class Conv1x1Config(Config):
    """The knobs of ``cpu.conv1x1``: a register tile of ``mr`` pixels x ``nvec`` vectors of output channels."""

    mr: int = knob("pixels of the register tile (broadcast inputs)", MR_CHOICES)
    nvec: int = knob("vectors of output channels per register-tile row", NVEC_CHOICES)
    lanes: int = knob("float32 lanes per vector (the target's width, or half)")
    k_unroll: int = knob("unroll of the input-channel (reduction) loop", K_UNROLL)
    parallel: bool = U.parallel_knob()


def pixels(info: dict) -> int:
    return info["OH"] * info["OW"]


def plane_why(plane: int, out_channels: int, target: C.Target) -> str | None:
    """None when a pointwise conv with ``plane`` output pixels and ``out_channels`` is one this family takes
    on ``target``, else why not.  Also asked by the graph rewrite that stores such a conv's constant weights
    [ci, 1, 1, co] (``passes.rewrites.TransposePointwiseWeights``)."""
    limit = template_defaults(target, FAMILY)["plane_pixels_below"]
    if plane >= limit:
        return f"plane of {plane} pixels (vectorized along the pixels from {limit} on)"
    lanes = cpu_info(target).float32_lanes
    if not any(out_channels % w == 0 for w in lane_choices(lanes)):
        return f"{out_channels} output channels: no vector width of {lane_choices(lanes)} divides them"
    return None


def default_tile(plane: int, out_channels: int, in_channels: int, target: C.Target) -> tuple[int, int, int]:
    """(mr, nvec, lanes) of the default register tile of a pointwise conv (some vector width divides the
    output channels: ``plane_why``); from shapes alone, so the graph rewrite stores the weights in blocks of
    the tile's channels (``weight_block``)."""
    info, d = cpu_info(target), template_defaults(target, FAMILY)
    widths = channel_lanes(out_channels, target)
    lanes = max(widths)
    regs = U.Registers.for_bits(info.vector_bits).count
    nvecs = [v for v in U.choices_upto(NVEC_CHOICES, out_channels // min(widths))
             if out_channels % (v * lanes) == 0]
    # with a short reduction (fewer input channels than stack_tile_below_steps) a tile on the stack: a larger
    # one is a workspace allocation per tile (common.MAX_STACK_ALLOCA_BYTES; 24->144 on 4x4, one thread, CPU
    # time under load: 8 x 3 vectors 3.3 us, 4 x 3 on the stack 2.8 us; 16->96 on 8x8 7.6 -> 6.5 us)
    on_stack = stack_accumulator_vectors(lanes) if in_channels < d["stack_tile_below_steps"] else None
    mr, nvec = pick_register_tile(plane, out_channels, lanes, regs, U.choices_upto(MR_CHOICES, plane), nvecs,
                                  on_stack)
    return mr, nvec, lanes


def weight_block(plane: int, out_channels: int, in_channels: int, target: C.Target) -> int:
    """Output channels per block of the constant weights (kernel layout ``OIHW<B>o``): the default register
    tile's channels, so that a tile reads its weights as one contiguous run (stored [ci, 1, 1, co], each input
    channel's nr weights lay a row of co apart)."""
    _, nvec, lanes = default_tile(plane, out_channels, in_channels, target)
    return nvec * lanes


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


def small_plane_why(info: dict, target: C.Target) -> str | None:
    """None when the conv (``conv2d.find_conv``'s info) is one this family takes, else why not."""
    if not info.get("pointwise"):
        return "not a 1x1 stride-1 conv without padding"
    if info.get("grouped"):
        return "a grouped conv"
    return plane_why(pixels(info), info["F"], target)


def macs(info: dict) -> int:
    """Multiply-adds of the conv (a symbolic batch counted as its nominal size)."""
    return batch_size(info) * pixels(info) * info["F"] * info["RC"]


def parallel_why_not(info: dict, target: C.Target) -> str | None:
    """None when the conv is worth a parallel loop on ``target``, else why it runs serial: the shared rule
    of the CPU families (``common.parallel_why_not``) on its multiply-adds.  Over a symbolic batch the work
    grows with the batch: each size bucket decides at its batch (``BatchBuckets``: serial up to the largest batch
    under the fork/join cost), a nest outside a bucket is parallel (the batch is in the parallel loop)."""
    over = info["N"] is None and "bucket_batch" not in info    # outside a size bucket (BatchBuckets)
    return U.parallel_why_not(None if over else macs(info), target, "multiply-adds")


def channel_lanes(out_channels: int, target: C.Target) -> list[int]:
    """The vector widths (the target's, or narrower) that divide ``out_channels``: the lanes knob of the
    families that put the output channels on the vector lanes."""
    return [w for w in lane_choices(cpu_info(target).float32_lanes) if out_channels % w == 0]


class ChannelLanesConv(BatchBuckets, U.CpuTemplate):
    """A conv family with the output channels on the vector lanes (``cpu.conv1x1``, ``cpu.conv2d_lanes``):
    it matches what ``conv2d.find_conv`` matches where the family's ``why_not`` finds nothing against it.
    Over a symbolic batch: a serial nest for the batches under the fork/join cost (``BatchBuckets``)."""

    def batch_info(self, match: Match, batch: int) -> dict:
        return {"bucket_batch": batch}

    def why_not(self, info: dict, target: C.Target) -> str | None:
        raise NotImplementedError

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        info = find_conv(func, depthwise=False)
        if info is None or self.why_not(info, target) is not None:
            return None
        set_batch_bounds(info, target)
        return Match(self.family, info)


class Conv1x1(ChannelLanesConv, family=FAMILY, config=Conv1x1Config):
    def why_not(self, info: dict, target: C.Target) -> str | None:
        return small_plane_why(info, target)

    # ------------------------------------------------------------------ knobs
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        i = match.info
        lanes = channel_lanes(i["F"], target)
        vectors = i["F"] // min(lanes)
        return Conv1x1Config.space(mr=U.choices_upto(MR_CHOICES, pixels(i)),
                                   nvec=U.choices_upto(NVEC_CHOICES, vectors),
                                   lanes=tuple(lanes), k_unroll=U.choices_upto(K_UNROLL, i["RC"]),
                                   parallel=U.PARALLEL)

    def default_config(self, match: Match, target: C.Target) -> dict:
        d, i = self.table_defaults(target), match.info
        ch = {kb.name: kb.choices for kb in self.space(match, target).knobs}
        mr, nvec, lanes = default_tile(pixels(i), i["F"], i["RC"], target)
        unroll = d["k_unroll"]
        return Conv1x1Config(mr=mr, nvec=nvec, lanes=lanes,
                             k_unroll=U.nearest_choice(ch["k_unroll"], unroll if i["RC"] % unroll == 0 else 1),
                             parallel=parallel_why_not(i, target) is None).asdict()

    # ------------------------------------------------------------------ apply
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, Conv1x1Config.from_dict(config)
        lanes, nr, ow = cfg.lanes, cfg.nvec * cfg.lanes, info["OW"]
        # Step 1. Fold the elementwise chain into one epilogue block and the identity padding into the conv;
        # without an epilogue, accumulate into a cache block and write back from it.
        U.inline_elementwise(sch, keep=frozenset({info["pad"]} if info["pad"] else ()))
        parts = concat_parts(sch, info["pad"]) if info["pad"] else []
        if info["pad"]:
            sch.compute_inline(sch.get_sblock(info["pad"]))   # an identity pad, or a concat (concat_prologue)
        conv = sch.get_sblock(info["reduction"])
        epi = sch.cache_write(conv, 0, "global") if info["epilogue"] is None else sch.get_sblock(info["epilogue"])

        # Step 2. Weights read with co contiguous: constant weights come blocked [co // B, ci, 1, 1, B] from the
        # graph (TransposePointwiseWeights); others (OIHW) are packed transposed per call, in their own parallel
        # loop over vectors of output channels (CO x CI gathers: slower than the pixel-vectorized conv on the
        # 2x2 planes, measured under load; the rewrite avoids it).
        if info["weight_layout"] == "OIHW":
            reads = [str(r.source.name) for r in sch.get(conv).reads]
            pack = sch.cache_read(conv, reads.index(info["weight_buffer"]), "global")
            sch.transform_layout(pack, ("write", 0), lambda f, c, ky, kx: (c, ky, kx, f))
            pf, pc, pky, pkx = sch.get_loops(pack)
            pf0, pf1 = sch.split(pf, factors=[None, lanes])
            sch.reorder(pf0, pc, pky, pkx, pf1)
            if cfg.parallel:
                sch.parallel(pf0)
            sch.vectorize(pf1)

        # Step 3. The conv and the epilogue over the flattened pixel index p = y * W + x; the conv's output
        # (the accumulator) stored [n, p, co]: a vector of channels is contiguous in it (laid out [co, p], each
        # accumulator vector would be loaded and stored lane by lane: 15x slower measured).
        sch.transform_layout(conv, ("write", 0), lambda n, f, y, x: (n, y * ow + x, f))
        sch.transform_block_layout(conv, lambda n, f, y, x, c, ky, kx: (n, f, y * ow + x, c, ky, kx))
        sch.transform_block_layout(epi, lambda n, f, y, x: (n, f, y * ow + x))

        # Step 4. Tile the epilogue: (n, channel block, pixel block) in one parallel loop x register tile
        # [mr pixels x nr channels].
        n, f, p = sch.get_loops(epi)
        f0, f1 = sch.split(f, factors=[None, nr])
        p0, p1 = sch.split(p, factors=[None, cfg.mr])
        sch.reorder(n, f0, p0, p1, f1)
        band = sch.fuse(n, f0, p0)
        if cfg.parallel:                  # a tiny conv stays serial: parallel_why_not
            sch.parallel(band)

        # Step 5. The conv on each register tile: input channels outermost (unrolled by k_unroll), then the
        # pixels (unrolled, broadcast) and the channel vectors (unrolled, lanes); the accumulator in
        # registers, initialized (vectorized) before the reduction.
        sch.compute_at(conv, band, preserve_unit_loops=True)
        c_n, c_f, c_p, rc, ry, rx = sch.get_loops(conv)[-6:]
        k0, k1 = sch.split(rc, factors=[None, cfg.k_unroll])
        fo, fv = sch.split(c_f, factors=[None, lanes])
        sch.reorder(k0, k1, ry, rx, c_n, c_p, fo, fv)
        sch.vectorize(fv)
        sch.unroll(fo)
        sch.unroll(c_p)
        sch.unroll(c_n)
        if cfg.k_unroll > 1:
            sch.unroll(k1)
        # the accumulator stays in the "global" scope: on the stack where it fits (common.MAX_STACK_ALLOCA_BYTES)
        init = sch.decompose_reduction(conv, k0)
        sch.vectorize(sch.get_loops(init)[-1])
        # a concat read through the input loads (rule concat_prologue): the input-channel loop cut at the
        # concat's boundaries, so that each part reads one operand (no select per load once simplified)
        if len(parts) > 1 and all(c % cfg.k_unroll == 0 for c in parts):
            sch.loop_partition(k0, [c // cfg.k_unroll for c in parts[:-1]] + [None])

        # Step 6. The epilogue on the accumulator tile, vectorized along the channels (stores P floats apart).
        e_fo, e_fv = sch.split(f1, factors=[None, lanes])
        sch.vectorize(e_fv)
