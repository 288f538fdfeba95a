"""CUDA: row-reduction chains (LayerNorm, RMSNorm, Softmax, InstanceNorm):
one thread block per row (or per few rows, ``threadIdx.y``), the threads of a row cooperating on every
reduction of the chain through TVM's cross-thread allreduce (warp shuffles, then one shared-memory
step across warps), the row's elementwise epilogue written by the same block.

Matches a PrimFunc whose reductions all reduce the innermost axes of the same rows, whose other blocks
are spatial, and whose outputs all enumerate those rows, every reduction feeding one of them: a
normalization chain (one output), or several outputs of the same rows (mean and variance, the variance
reading the mean), written by the same block: their row loops are merged into one.
"""
from __future__ import annotations

from ... import _compat as C
from ..base import Knob, KnobSpace, Match, Template
from ._common import WARP, arch_of, block_graph, divisors_among, inline_glue, multiply_accumulate, nearest, pow2_upto

ROWS_PER_BLOCK = (1, 2, 4)


def _prod(xs) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


class CudaRowReduction(Template):
    family = "cuda_row_reduction"
    target_kinds = ("cuda",)

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        g = block_graph(func)
        if g is None:
            return None
        reds = [b for b in g.blocks if "R" in b.kinds]
        if not reds or any("O" in b.kinds for b in g.blocks):
            return None
        rows = None
        for r in reds:
            s = r.kinds.count("S")
            if r.kinds != "S" * s + "R" * (len(r.kinds) - s):      # reduce the innermost axes only
                return None
            mac = multiply_accumulate(r.stmt)
            if mac is not None and not mac[0].source.same_as(mac[1].source):
                return None                                      # a contraction: matmul/conv templates
            n = _prod(r.extents[:s])
            if rows is not None and n != rows:
                return None
            rows = n
        outs = g.outputs
        if not outs:
            return None
        # the last output is the sink; every reduction must feed some output (no dead chains)
        sink = outs[-1]
        feeding = set()
        for o in outs:
            feeding |= g.ancestors(o.name) | {o.name}
        if any(r.name not in feeding for r in reds):
            return None
        # every output's leading loops must enumerate the same rows: one row loop serves them all
        row_loops = {}
        for o in outs:
            prefix, n = 0, 1
            while prefix < len(o.extents) and n < rows:
                n *= o.extents[prefix]
                prefix += 1
            if n != rows:
                return None
            row_loops[o.name] = prefix
        red_len = max(_prod(r.extents[r.kinds.count("S"):]) for r in reds)
        return Match(self.family, {
            "blocks": [b.name for b in g.blocks], "reductions": [r.name for r in reds],
            "outputs": [o.name for o in outs], "sink": sink.name, "row_loops": row_loops[sink.name],
            "output_row_loops": row_loops, "rows": rows, "reduce_extent": red_len,
            "row_extent": max(_prod(o.extents[row_loops[o.name]:]) for o in outs),
        })

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        arch = arch_of(target)
        rpb = divisors_among(match.info["rows"], ROWS_PER_BLOCK)
        longest = max(match.info["reduce_extent"], match.info["row_extent"])
        cap = max(WARP, 1 << max(0, (longest - 1).bit_length()))      # no more threads than elements
        threads = pow2_upto(WARP, min(cap, arch.max_threads_per_block // max(rpb)))
        return KnobSpace((
            Knob("threads", tuple(threads), "threads cooperating on one row (threadIdx.x)"),
            Knob("rows_per_block", tuple(rpb), "rows per thread block (threadIdx.y)"),
        ))

    def default_config(self, match: Match, target: C.Target) -> dict:
        arch = arch_of(target)
        sp = self.space(match, target)
        threads = nearest(sp.knobs[0].choices, arch.red_threads)
        # few rows: one row per block so that more SMs work; many short rows: pack rows into blocks
        rows, want = match.info["rows"], 1
        if rows >= 4 * arch.sm_count and threads <= 64:
            want = 4
        return {"threads": threads, "rows_per_block": nearest(sp.knobs[1].choices, want)}

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info = match.info
        threads, rpb = config["threads"], config["rows_per_block"]
        outputs = info["outputs"]
        keep = set(info["reductions"]) | set(outputs)
        # Step 1. Inline the elementwise glue (x - mean, exp, rsqrt, scale/shift) into its readers.
        left = inline_glue(sch, info["blocks"], keep)
        # Step 2. An output that another block reads (mean, read by the variance): it computes into a
        #         row buffer its readers use, and a copy block writes the output (an output block
        #         cannot move under another block's loops; its copy, read by no one, can be nested).
        nested = []                                      # (block, its row loop count), sink last
        for name in outputs:
            blk = sch.get_sblock(name)
            if name != info["sink"] and sch.get_consumers(blk):
                copy = sch.cache_write(blk, 0, "global", consumer_blocks=sch.get_consumers(blk))
                nested.append((copy, info["output_row_loops"][name]))
            else:
                nested.append((blk, info["output_row_loops"][name]))
        # Step 3. Each output: rows -> (blockIdx.x, threadIdx.y), the row's elements -> threadIdx.x;
        #         several outputs: their row loops merged, one block per row group writes them all.
        nests = []
        for blk, k in nested:
            loops = sch.get_loops(blk)
            row = sch.fuse(*loops[:k]) if k > 1 else loops[0]
            rest = loops[k:]
            inner = (sch.fuse(*rest) if len(rest) > 1 else rest[0]) if rest else sch.add_unit_loop(blk)
            bx, ty = sch.split(row, [None, rpb], preserve_unit_iters=True)
            _, tx = sch.split(inner, [None, threads], preserve_unit_iters=True)
            sch.bind(tx, "threadIdx.x")
            nests.append((bx, ty))
        if len(nests) > 1:
            bx, ty = sch.merge(*[n[0] for n in nests]), sch.merge(*[n[1] for n in nests])
        else:
            bx, ty = nests[0]
        sch.bind(bx, "blockIdx.x")
        sch.bind(ty, "threadIdx.y")
        # Step 4. Every other block, last first, moves under the row it serves; its per-row loops
        #         (the reduction axes for a reduction) go to threadIdx.x: a cross-thread reduction,
        #         its per-row result in shared memory where every thread of the row reads it.
        nested_names = {str(sch.get(b).name_hint) for b, _ in nested}
        for name in reversed([n for n in left if n not in nested_names]):
            blk = sch.get_sblock(name)
            sch.compute_at(blk, ty)
            sch.set_scope(blk, 0, "shared")
            _bind_row_loops(sch, blk, threads)


def _bind_row_loops(sch: C.Schedule, blk, threads: int) -> None:
    """The loops of ``blk`` below (blockIdx.x, threadIdx.y): fused, threads of the row on threadIdx.x."""
    own = sch.get_loops(blk)[2:]
    if not own:
        own = [sch.add_unit_loop(blk)]
    fused = sch.fuse(*own) if len(own) > 1 else own[0]
    _, tx = sch.split(fused, [None, threads], preserve_unit_iters=True)
    sch.bind(tx, "threadIdx.x")
