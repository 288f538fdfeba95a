"""CUDA: MatMul / batch MatMul anchors with their elementwise epilogue (bias, GELU, residual add...).

Thread-block tiling: each block computes a ``(threads_m*micro_m) x (threads_n*micro_n)`` output tile
(``blockIdx.z`` over the batch), staging ``tile_k``-deep slices of both operands in shared memory with
vectorized cooperative loads; each thread accumulates a ``micro_m x micro_n`` register tile and applies
the epilogue to it in registers before the one store of the output.

Matches one contraction ``C[b.., i, j] += A[b.., i, k] * B[b.., k, j]`` (any operand layout; batch axes
possibly broadcast) whose other blocks are all spatial; the epilogue is everything after it.
"""
from __future__ import annotations

from dataclasses import dataclass

from ... import _compat as C
from ...analysis import index_vars, multiply_accumulate, nearest
from ..base import Config, KnobSpace, Match, knob
from ._common import (CudaArch, CudaTemplate, accumulate_in_registers, arch_of, bind_tile, blocks_of_tile, group_anchor,
                      inline_glue,
                      stage_cooperatively, tile_contraction)

THREADS = (4, 8, 16, 32)       # per output-tile axis; 32 x 32 = 1024 threads at most
MICRO = (1, 2, 4)              # outputs per thread per axis: a register tile of up to 4 x 4
TILE_K = (4, 8, 16, 32)        # shared slice depth: (4*32 + 4*32) * 32 * 4 B = 32 KB at most
VEC = (1, 2, 4)                # lanes of the global -> shared loads


@dataclass(frozen=True)
class MatmulConfig(Config):
    """The knobs of a tiled contraction (the matmul and the sibling-matmul families)."""

    threads_m: int = knob("threadIdx.y extent")
    threads_n: int = knob("threadIdx.x extent")
    micro_m: int = knob("output rows per thread and anchor (register tile)")
    micro_n: int = knob("output columns per thread and anchor (register tile)")
    tile_k: int = knob("reduction depth staged in shared memory per step")
    vec: int = knob("lanes of the cooperative global->shared loads")


def matmul_space(info: dict, threads, tile_k) -> KnobSpace:
    """The legal choices of a contraction of ``info``'s (m, n, k) with ``tile_k`` depths (dividing k)."""
    m, n, k = info["m"], info["n"], info["k"]
    vec = [v for v in VEC if v <= min(tile_k) and m % v == 0 and n % v == 0 and k % v == 0] or [1]
    return MatmulConfig.space(threads_m=[t for t in threads if t <= max(threads[0], m)],
                              threads_n=[t for t in threads if t <= max(threads[0], n)],
                              micro_m=MICRO, micro_n=MICRO, tile_k=tile_k, vec=vec)


def matmul_default(space: KnobSpace, info: dict, arch: CudaArch) -> dict:
    """The arch's tile clamped to the legal choices; small outputs shrink the register tile until there
    are enough thread blocks for the SMs."""
    sp = {k.name: k.choices for k in space.knobs}
    cfg = {"threads_m": nearest(sp["threads_m"], arch.mm_threads[0]),
           "threads_n": nearest(sp["threads_n"], arch.mm_threads[1]),
           "micro_m": nearest(sp["micro_m"], arch.mm_micro[0]), "micro_n": nearest(sp["micro_n"], arch.mm_micro[1]),
           "tile_k": nearest(sp["tile_k"], arch.mm_tile_k), "vec": nearest(sp["vec"], arch.mm_vec)}
    while True:
        blocks = blocks_of_tile(info["m"], info["n"], cfg["threads_m"] * cfg["micro_m"],
                                cfg["threads_n"] * cfg["micro_n"])
        if blocks * info["batch_size"] >= arch.sm_count or (cfg["micro_m"] == 1 and cfg["micro_n"] == 1):
            break
        axis = "micro_m" if cfg["micro_m"] >= cfg["micro_n"] else "micro_n"
        cfg[axis] //= 2
    return MatmulConfig(**cfg).asdict()


def matmul_anchor(block) -> dict | None:
    """The roles of the iter vars of a contraction block: batch, i (A only), j (B only), k; else None."""
    if block.kinds.count("R") != 1 or "O" in block.kinds or not block.kinds.endswith("R"):
        return None
    mac = multiply_accumulate(block.stmt)
    if mac is None or mac[0].source.same_as(mac[1].source):
        return None
    ivs = [iv.var for iv in block.stmt.iter_vars]
    k = ivs[-1]

    def used(load):
        vs = index_vars(load.indices)
        if any(len(v) > 1 for v in vs):          # a sum of iterators (a window): not a matmul operand
            return None
        return {x for v in vs for x in v}

    a, b = used(mac[0]), used(mac[1])
    if a is None or b is None or not (_has(a, k) and _has(b, k)):
        return None
    spatial = ivs[:-1]
    if len(spatial) < 2:
        return None
    # (batch.., i, j), the legalized order: i read by one operand only, j by the other only; a batch
    # axis may be read by both (A[b] @ B[b]), by one (activations [B, S, K] @ a shared weight), or be
    # broadcast (a constant index)
    i, j = len(spatial) - 2, len(spatial) - 1
    vi, vj = spatial[i], spatial[j]
    if not ((_has(a, vi) and not _has(b, vi) and _has(b, vj) and not _has(a, vj)) or
            (_has(b, vi) and not _has(a, vi) and _has(a, vj) and not _has(b, vj))):
        return None
    batch_size = 1
    for e in block.extents[:-3]:
        batch_size *= e
    return {"batch": len(spatial) - 2, "batch_size": batch_size, "m": block.extents[i], "n": block.extents[j],
            "k": block.extents[-1]}


def _has(vars_, v) -> bool:
    return any(x.same_as(v) for x in vars_)


class CudaMatmul(CudaTemplate, family="cuda_matmul", config=MatmulConfig):
    def match_graph(self, g, func: C.PrimFunc, target: C.Target) -> Match | None:
        return self.match_blocks(g, [b.name for b in g.blocks])

    def match_blocks(self, g, names: list[str]) -> Match | None:
        """Match on a subset of the blocks (one sibling of a multi-output kernel)."""
        blocks = [g.by_name(n) for n in names]
        anchors = [(b, matmul_anchor(b)) for b in blocks if "R" in b.kinds]
        if len(anchors) != 1 or anchors[0][1] is None or not all(b.is_spatial for b in blocks
                                                                   if b is not anchors[0][0]):
            return None
        anchor, roles = anchors[0]
        return Match(self.family, {"blocks": names, "anchor": anchor.name, **roles})

    def accepts(self, group, target: C.Target) -> str | None:
        _, anchor, why = group_anchor(group)
        if why is None and matmul_anchor(anchor) is None:
            why = "the anchor is not a matmul (a window or reshaped operand index, or no i/j axes)"
        return why

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return matmul_space(match.info, THREADS, [t for t in TILE_K if match.info["k"] % t == 0] or [1])

    def default_config(self, match: Match, target: C.Target) -> dict:
        return matmul_default(self.space(match, target), match.info, arch_of(target))

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, MatmulConfig.from_dict(config)
        # Step 1. Inline the producers' glue (transposes, reshapes) into the operand reads, and the
        #         epilogue into one block that reads the accumulator.
        left = inline_glue(sch, info["blocks"], keep={info["anchor"]})
        epilogue = [n for n in left if n != info["anchor"]]
        mm = sch.get_sblock(info["anchor"])
        # Step 2. Output tile: (batch) x (by, ty, ui) x (bx, tx, uj); reduction k -> (ko, ki).
        batch, by, bx, ty, tx, ko = tile_contraction(sch, mm, info["batch"], cfg.threads_m, cfg.threads_n,
                                                     cfg.micro_m, cfg.micro_n, cfg.tile_k)
        bind_tile(sch, batch, by, bx, ty, tx)
        # Step 3. The accumulator lives in registers; the epilogue (or a plain store) runs on it per
        #         thread, so the only global write is the final output tile.
        accumulate_in_registers(sch, mm, epilogue, tx)
        # Step 4. Stage both operands' k-slices in shared memory, loaded by all threads with vectors.
        for operand in (0, 1):
            stage = sch.cache_read(mm, operand, "shared", consumer_blocks=[mm])
            sch.compute_at(stage, ko, preserve_unit_loops=True)
            stage_cooperatively(sch, stage, 6, cfg.threads_m, cfg.threads_n, cfg.vec)
        # Step 5. Initialize the accumulator before the k loop.
        sch.decompose_reduction(mm, ko)
