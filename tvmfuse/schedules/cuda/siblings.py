"""CUDA: several MatMul anchors of one shape in one kernel, sharing one load of their common input:
Q/K/V projections of one X (independent outputs), SwiGLU's gate and up projections of one X joined
by one ``silu(gate) * up`` epilogue, and matmul siblings next to independent elementwise outputs.

One thread block computes the same ``(threads_m*micro_m) x (threads_n*micro_n)`` output tile of every
anchor: the anchors are tiled alike and their block, thread and ``k``-step loops merged into one loop
nest.  Per ``k`` step, an operand buffer that several anchors read the same way (X of Q/K/V: same
buffer, same roles of its indices) is staged ONCE in shared memory and every anchor's inner product reads
that one tile; the other operands (the weights) get a shared stage each.  Each thread keeps one
``micro_m x micro_n`` register accumulator per anchor; an epilogue of one anchor (bias add) and an
epilogue joining several (gate * up) both run on those registers before the only global store.

Matches a PrimFunc whose reductions are all matmul contractions of one (batch, m, n, k), whose other
blocks are spatial, with two or more anchors or with independent elementwise outputs beside them.  The
single-anchor kernel is the matmul template's.
"""
from __future__ import annotations

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION, block_graph, buffer_loads
from ..base import KnobSpace, Match
from ._common import (CudaTemplate, arch_of, bind_elementwise, bind_tile, inline_glue, single_anchor,
                      stage_cooperatively, store_in_registers, tile_contraction)
from .elementwise import VECTOR_LANES
from .matmul import MICRO, TILE_K, MatmulConfig, matmul_anchor, matmul_default, matmul_space

THREADS = (4, 8, 16)     # per output-tile axis: at most 256 threads, so every thread may hold 255 registers
# matmul.MICRO per anchor: a micro_m x micro_n accumulator, 3 anchors x 16 = 48 registers at most
EW_THREADS = 256
F32 = 4


def _roles_of(block, loads) -> list[tuple]:
    """Per operand load of a contraction: (buffer, index roles): each index the position of the block
    iter var it is (a plain var), "c" for a constant, None for anything else (a reshaped index)."""
    ivs = [iv.var for iv in block.iter_vars]
    out = []
    for ld in loads:
        roles = []
        for e in ld.indices:
            if isinstance(e, C.Var):
                pos = [p for p, v in enumerate(ivs) if v.same_as(e)]
                roles.append(pos[0] if pos else None)
            elif isinstance(e, C.IntImm):
                roles.append("c")
            else:
                roles.append(None)
        out.append((ld.source, tuple(roles), tuple(int(d) for d in C.tensor_shape(ld.source))))
    return out


def operand_stages(sch: C.Schedule, anchors: list[str]) -> list[dict]:
    """The shared-memory stages of the anchors' operands, as (buffer, consumers, footprint roles).

    An operand buffer read by several anchors with the same index roles gets one stage that all of them
    read; any other operand read gets a stage of its own.  Call after the glue has been inlined."""
    stages: list[dict] = []
    for name in anchors:
        blk = sch.get(sch.get_sblock(name))
        out = blk.body.buffer
        loads = [ld for ld in buffer_loads(blk.body.value) if not ld.source.same_as(out)]
        seen = []
        for src, roles, shape in _roles_of(blk, loads):
            if any(src.same_as(s) for s in seen):
                continue                         # the same buffer twice in one anchor: one stage
            seen.append(src)
            shareable = None not in roles
            for st in stages:
                if shareable and st["roles"] == roles and st["buffer"].same_as(src):
                    st["consumers"].append(name)
                    break
            else:
                stages.append({"buffer": src, "roles": roles, "shape": shape, "consumers": [name]})
    return stages


def stage_floats(stage: dict, ndim: int, tile_m: int, tile_n: int, tile_k: int) -> int:
    """Elements of one stage's shared tile for one k step: i -> tile_m, j -> tile_n, k -> tile_k,
    batch / constant -> 1, an index that is not a plain var -> the whole dimension (an upper bound)."""
    i, j, k = ndim - 3, ndim - 2, ndim - 1
    n = 1
    for role, dim in zip(stage["roles"], stage["shape"]):
        if role is None:
            n *= dim
        elif role == i:
            n *= min(dim, tile_m)
        elif role == j:
            n *= min(dim, tile_n)
        elif role == k:
            n *= min(dim, tile_k)
    return n


class CudaSiblings(CudaTemplate, family="cuda_siblings", config=MatmulConfig):
    def match_graph(self, g, func: C.PrimFunc, target: C.Target) -> Match | None:
        reds = [b for b in g.blocks if not b.is_spatial]
        if not reds or any(not b.is_reduction for b in reds):
            return None
        roles = [matmul_anchor(b) for b in reds]
        if any(r is None for r in roles):
            return None
        keys = {(r["batch"], r["batch_size"], r["m"], r["n"], r["k"]) for r in roles}
        if len(keys) != 1:
            return None                            # one tile must fit every anchor
        anchor_names = {b.name for b in reds}
        matmul_blocks, ew_parts = [], []
        for names in g.components():
            blocks = [g.by_name(n) for n in names]
            if not any(b.is_output for b in blocks):
                return None                        # dead chain: not a sibling
            if anchor_names & set(names):
                matmul_blocks += names
                continue
            outs = [b for b in blocks if b.is_output]
            lanes = max(v for v in VECTOR_LANES if all((b.extents[-1] if b.extents else 1) % v == 0
                                                       for b in outs))
            ew_parts.append({"blocks": names, "outputs": [b.name for b in outs], "vec": lanes})
        if len(reds) < 2 and not ew_parts:
            return None                            # one matmul alone: the matmul template's kernel
        order = {b.name: i for i, b in enumerate(g.blocks)}
        anchors = [b.name for b in reds]
        # the operand stages as apply will make them (after the glue is inlined): the space's bound
        sch = C.Schedule(func)
        inline_glue(sch, sorted(matmul_blocks, key=order.get), keep=set(anchors))
        stages = operand_stages(sch, anchors)
        info = {"anchors": anchors, "matmul_blocks": sorted(matmul_blocks, key=order.get),
                "elementwise": ew_parts, **roles[0],
                "stage_roles": [list(s["roles"]) for s in stages], "stage_shapes": [list(s["shape"]) for s in stages],
                "shared_stages": sum(len(s["consumers"]) > 1 for s in stages)}
        m = Match(self.family, info)
        if not self._tile_k_choices(m, target):
            return None                            # not even the smallest tiles fit in shared memory
        return m

    def accepts(self, group, target: C.Target) -> str | None:
        if not group.is_static():
            return "symbolic extents (the CUDA templates are built for static shapes)"
        if group.of_kind(REDUCTION):
            return "a row reduction beside the matmuls"
        anchors = group.of_kind(CONTRACTION)
        if len(anchors) < 2:
            return f"{len(anchors)} matmul anchor(s) (one alone is the matmul template's kernel)"
        keys = set()
        for a in anchors:
            anchor = single_anchor(block_graph(a.func))
            roles = matmul_anchor(anchor) if anchor is not None else None
            if roles is None:
                return f"{a.name} is not a matmul"
            keys.add((roles["batch"], roles["batch_size"], roles["m"], roles["n"], roles["k"]))
        return None if len(keys) == 1 else "matmuls of different (batch, m, n, k): one tile must fit every anchor"

    # ----------------------------------------------------------------------------------- knob space
    def _stage_bytes(self, info: dict, tile_m: int, tile_n: int, tile_k: int) -> int:
        ndim = info["batch"] + 3
        return F32 * sum(stage_floats({"roles": tuple(r), "shape": tuple(s)}, ndim, tile_m, tile_n, tile_k)
                         for r, s in zip(info["stage_roles"], info["stage_shapes"]))

    def _tile_k_choices(self, match: Match, target: C.Target) -> list[int]:
        """Reduction depths whose stages fit the arch's shared memory at the widest tile of the space."""
        info, arch = match.info, arch_of(target)
        widest = max(THREADS) * max(MICRO)
        tk = [t for t in TILE_K if info["k"] % t == 0] or [1]
        return [t for t in tk if self._stage_bytes(info, widest, widest, t) <= arch.max_shared_bytes]

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        return matmul_space(match.info, THREADS, self._tile_k_choices(match, target))

    def default_config(self, match: Match, target: C.Target) -> dict:
        return matmul_default(self.space(match, target), match.info, arch_of(target))

    # ----------------------------------------------------------------------------------- schedule
    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, MatmulConfig.from_dict(config)
        anchors = info["anchors"]
        # Step 1. Inline the glue (operand transposes/reshapes into the anchors' reads, epilogue
        #         arithmetic into as few blocks as possible).
        left = inline_glue(sch, info["matmul_blocks"], keep=set(anchors))
        epilogue = [n for n in left if n not in anchors]
        feeds = _anchor_feeds(sch, epilogue, set(anchors))
        # Step 2. Tile every anchor alike: (batch) x (by, ty, ui) x (bx, tx, uj), k -> (ko, ki).
        nests = {}
        for name in anchors:
            nests[name] = tile_contraction(sch, sch.get_sblock(name), info["batch"], cfg.threads_m, cfg.threads_n,
                                           cfg.micro_m, cfg.micro_n, cfg.tile_k)
        # Step 3. Merge the anchors' nests level by level: one grid, one thread block computing the
        #         same output tile of every anchor, one k loop.  (Merging moves the merged loops to the
        #         last anchor's place: a store placed under one anchor's loops before the merge would
        #         end up ahead of the k loop, writing the accumulators before they are computed.)
        if len(anchors) > 1:
            batch, by, bx, ty, tx, ko = (sch.merge(*[nests[a][d] for a in anchors]) for d in range(6))
        else:
            batch, by, bx, ty, tx, ko = nests[anchors[0]]
        bind_tile(sch, batch, by, bx, ty, tx)
        # Step 4. Accumulators in registers, stored after the k loop by the thread that computed them; an
        #         anchor's own epilogue (bias add) is inlined into that store. (Moved under the merged
        #         thread loop by itself, a first anchor's epilogue got the region of the whole output:
        #         each thread read every accumulator, all but its own never written; gpu22.md.)
        for name in anchors:
            mm = sch.get_sblock(name)
            own = [e for e in epilogue if feeds[e] == {name}]
            joint = any(len(feeds[e]) > 1 and name in feeds[e] for e in epilogue)
            if not joint:
                store_in_registers(sch, mm, tx)
                for e in own:
                    sch.reverse_compute_inline(sch.get_sblock(e))
                continue
            for e in own:
                sch.reverse_compute_at(sch.get_sblock(e), tx, preserve_unit_loops=True)
            sch.set_scope(mm, 0, "local")
        # Step 5. An epilogue joining several anchors (silu(gate) * up) runs on their registers.
        for e in epilogue:
            if len(feeds[e]) > 1:
                sch.reverse_compute_at(sch.get_sblock(e), tx, preserve_unit_loops=True)
        # Step 6. Per k step, one shared tile per distinct operand: the common input (X) once, read
        #         by every anchor; each anchor's own operand (its weights) beside it.
        for st in operand_stages(sch, anchors):
            consumers = [sch.get_sblock(n) for n in st["consumers"]]
            first = sch.get(consumers[0])
            idx = next(p for p, r in enumerate(first.reads) if C.region_tensor(r).same_as(st["buffer"]))
            stage = sch.cache_read(consumers[0], idx, "shared", consumer_blocks=consumers)
            sch.compute_at(stage, ko, preserve_unit_loops=True)
            stage_cooperatively(sch, stage, 6, cfg.threads_m, cfg.threads_n, cfg.vec)
        # Step 7. Initialize every accumulator before the merged k loop.
        for name in anchors:
            sch.decompose_reduction(sch.get_sblock(name), ko)
        # Step 8. Independent elementwise outputs: inline their glue, flatten, vectorize.
        for part in info["elementwise"]:
            for name in inline_glue(sch, part["blocks"], keep=set(part["outputs"])):
                bind_elementwise(sch, name, EW_THREADS, part["vec"])


def _anchor_feeds(sch: C.Schedule, epilogue: list[str], anchors: set[str]) -> dict:
    """For each epilogue block (program order), the anchors it reads, directly or through other
    epilogue blocks."""
    feeds: dict[str, set] = {}
    for name in epilogue:
        got = set()
        for p in sch.get_producers(sch.get_sblock(name)):
            pn = str(sch.get(p).name_hint)
            if pn in anchors:
                got.add(pn)
            else:
                got |= feeds.get(pn, set())
        feeds[name] = got
    return feeds
