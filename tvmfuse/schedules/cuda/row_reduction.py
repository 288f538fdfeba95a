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

from dataclasses import dataclass
from math import prod

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION, multiply_accumulate, nearest
from ..base import Config, KnobSpace, Match, knob
from ._common import WARP, CudaTemplate, arch_of, bind, divisors_among, fuse_all, inline_glue, pow2_upto

ROWS_PER_BLOCK = (1, 2, 4)


@dataclass(frozen=True)
class RowReductionConfig(Config):
    """The knobs of a row-reduction chain: threads per row (the cross-thread allreduce) and rows per
    thread block."""

    threads: int = knob("threads cooperating on one row (threadIdx.x)")
    rows_per_block: int = knob("rows per thread block (threadIdx.y)")


class CudaRowReduction(CudaTemplate, family="cuda_row_reduction", config=RowReductionConfig):
    def match_graph(self, g, func: C.PrimFunc, target: C.Target) -> Match | None:
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
            n = prod(r.extents[:s])
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
        red_len = max(prod(r.extents[r.kinds.count("S"):]) for r in reds)
        return Match(self.family, {
            "blocks": [b.name for b in g.blocks], "reductions": [r.name for r in reds],
            "outputs": [o.name for o in outs], "sink": sink.name, "row_loops": row_loops[sink.name],
            "output_row_loops": row_loops, "rows": rows, "reduce_extent": red_len,
            "row_extent": max(prod(o.extents[row_loops[o.name]:]) for o in outs),
        })

    def accepts(self, group, target: C.Target) -> str | None:
        """The reductions' (shape read, axes reduced) keys: the innermost axes of the same rows; every
        output's leading dims enumerate those rows."""
        if not group.is_static():
            return "symbolic extents (the CUDA templates are built for static shapes)"
        if group.of_kind(CONTRACTION):
            return "a matmul/conv anchor (the matmul/conv templates' kernel)"
        keys = {k for m in group.of_kind(REDUCTION) for k in m.row_keys}
        if not keys:
            return "no row reduction"
        rows = set()
        for shape, axes in keys:
            if axes != tuple(range(len(shape) - len(axes), len(shape))):
                return f"a reduction over axes {list(axes)} of {list(shape)}, not the innermost ones"
            rows.add(prod(shape[:len(shape) - len(axes)]))
        if len(rows) != 1:
            return f"reductions over different numbers of rows {sorted(rows)}"
        n = rows.pop()
        for out in group.outputs:
            done, lead = 1, iter(out.out_shape)
            while done < n:
                done *= next(lead, n + 1)
            if done != n:
                return f"output {out.name} {list(out.out_shape)} does not enumerate the {n} rows first"
        return None

    def space(self, match: Match, target: C.Target) -> KnobSpace:
        arch = arch_of(target)
        rpb = divisors_among(match.info["rows"], ROWS_PER_BLOCK)
        longest = max(match.info["reduce_extent"], match.info["row_extent"])
        cap = max(WARP, 1 << max(0, (longest - 1).bit_length()))      # no more threads than elements
        threads = pow2_upto(WARP, min(cap, arch.max_threads_per_block // max(rpb)))
        return RowReductionConfig.space(threads=threads, rows_per_block=rpb)

    def default_config(self, match: Match, target: C.Target) -> dict:
        arch = arch_of(target)
        sp = self.space(match, target)
        threads = nearest(sp.knobs[0].choices, arch.red_threads)
        # few rows: one row per block so that more SMs work; many short rows: pack rows into blocks
        rows, want = match.info["rows"], 1
        if rows >= 4 * arch.sm_count and threads <= 64:
            want = 4
        return RowReductionConfig(threads=threads, rows_per_block=nearest(sp.knobs[1].choices, want)).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        info, cfg = match.info, RowReductionConfig.from_dict(config)
        threads, rpb = cfg.threads, cfg.rows_per_block
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
            row = fuse_all(sch, loops[:k])
            inner = fuse_all(sch, loops[k:] or [sch.add_unit_loop(blk)])
            bx, ty = sch.split(row, [None, rpb], preserve_unit_iters=True)
            _, tx = sch.split(inner, [None, threads], preserve_unit_iters=True)
            bind(sch, threadIdx_x=tx)
            nests.append((bx, ty))
        if len(nests) > 1:
            bx, ty = sch.merge(*[n[0] for n in nests]), sch.merge(*[n[1] for n in nests])
        else:
            bx, ty = nests[0]
        bind(sch, blockIdx_x=bx, threadIdx_y=ty)
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
    fused = fuse_all(sch, sch.get_loops(blk)[2:] or [sch.add_unit_loop(blk)])
    _, tx = sch.split(fused, [None, threads], preserve_unit_iters=True)
    bind(sch, threadIdx_x=tx)
