"""CUDA: row-reduction chains (LayerNorm, RMSNorm, Softmax, InstanceNorm):
one thread block per row (or per few rows, ``threadIdx.y``), the threads of a row cooperating on every
reduction of the chain through TVM's cross-thread allreduce (warp shuffles, then one shared-memory
step across warps), the row's elementwise epilogue written by the same block.

Matches a PrimFunc whose reductions all reduce the innermost axes of the same rows, whose other blocks
are spatial, and whose outputs all enumerate those rows, every reduction feeding one of them: a
normalization chain (one output), or several outputs of the same rows (mean and variance, the variance
reading the mean), written by the same block: their row loops are merged into one.  Which loops of an
output enumerate the rows is read off how it indexes the reductions' results (``output_row_axes``), not
off equal extents: ConvNeXt's LayerNorm over the channels of an NCHW tensor writes (n, c, h, w) from
sums over (n, h, w), its row loops (n, h, w) are moved outermost; a single row (the pooled head's norm)
gets a unit row loop.  A kernel whose rows cannot be told that way is declined (``match`` returns None).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from math import prod

from ... import _compat as C
from ...analysis import CONTRACTION, REDUCTION, const_int, multiply_accumulate, nearest
from ..base import Config, KnobSpace, Match, knob
from ._common import WARP, CudaTemplate, arch_of, bind, divisors_among, fuse_all, inline_glue, pow2_upto

ROWS_PER_BLOCK = (1, 2, 4)
log = logging.getLogger("tvmfuse.schedule")


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
        # which loops of each output enumerate the rows: found from how it reads the reductions' results
        # (after the glue is inlined, as ``apply`` does), not from equal extents alone: ConvNeXt's LayerNorm
        # over the channels of a [1, 16, 16, 16] NCHW tensor writes (n, c, h, w) from sums over (n, h, w)
        row_axes = output_row_axes(func, [b.name for b in g.blocks], [r.name for r in reds],
                                   [o.name for o in outs])
        if isinstance(row_axes, str):
            log.debug("cuda_row_reduction declines the kernel: %s", row_axes)
            return None
        red_len = max(prod(r.extents[r.kinds.count("S"):]) for r in reds)
        per_row = [prod(e for i, e in enumerate(o.extents) if i not in row_axes[o.name]) for o in outs]
        return Match(self.family, {
            "blocks": [b.name for b in g.blocks], "reductions": [r.name for r in reds],
            "outputs": [o.name for o in outs], "sink": sink.name,
            "output_row_axes": row_axes, "rows": rows, "reduce_extent": red_len, "row_extent": max(per_row),
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
        nested = []                                      # (block, its row axes), sink last
        for name in outputs:
            blk = sch.get_sblock(name)
            if name != info["sink"] and sch.get_consumers(blk):
                copy = sch.cache_write(blk, 0, "global", consumer_blocks=sch.get_consumers(blk))
                nested.append((copy, info["output_row_axes"][name]))   # the copy iterates the output's dims
            else:
                nested.append((blk, info["output_row_axes"][name]))
        # Step 3. Each output: its row loops first (an output may enumerate the rows in another order or
        #         interleaved with per-row axes: a transposed layout), fused and split into
        #         (blockIdx.x, threadIdx.y), the row's elements -> threadIdx.x; several outputs: their row
        #         loops merged, one block per row group writes them all.
        nests = []
        for blk, axes in nested:
            row_ls, inner_ls = _row_and_inner_loops(sch, blk, axes)
            if not row_ls:                               # a single row (rows == 1): a unit row loop
                loops = sch.get_loops(blk)
                row_ls = [sch.add_unit_loop(loops[0] if loops else blk)]
            row = fuse_all(sch, row_ls)
            inner = fuse_all(sch, inner_ls or [sch.add_unit_loop(blk)])
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


# --------------------------------------------------------------------------- which loops are the rows
def output_row_axes(func: C.PrimFunc, blocks: list[str], reductions: list[str],
                    outputs: list[str]) -> dict[str, list[int]] | str:
    """For each output block: the positions of its iterators that enumerate the reductions' rows, in the
    order of the rows' own (non-unit) axes; or why they cannot be told (a str).

    Found as ``apply`` sees the kernel, the glue inlined: an output block reads the reductions' results
    (sum[n, h, w]) at its own iterators (out[n, c, h, w]: positions 0, 2, 3), every non-unit index a
    plain iterator of the same extent (``i % 64`` over i < 64 counts as ``i``), and every such read at the
    same positions; an output that is a reduction: its own spatial axes; an output the reductions read
    (the residual sum a LayerNorm normalizes): the axes they read it at.  Each output must write its
    buffer at its own iterators in order (a copy of it iterates the same axes), and a reduction reading
    another's result reads it at its own row."""
    sch = C.Schedule(func)
    inline_glue(sch, blocks, set(reductions) | set(outputs))
    results = {}
    for r in reductions:
        blk = sch.get(sch.get_sblock(r))
        results[str(blk.writes[0].source.name)] = [int(iv.dom.extent) for iv in blk.iter_vars
                                                   if int(iv.iter_type) == int(C.IterVarKind.DataPar)]
    out = {}
    for name in list(reductions) + list(outputs):
        blk = sch.get(sch.get_sblock(name))
        ivs = list(blk.iter_vars)
        if name in outputs and not _writes_in_place(blk):
            return f"output {name} is not written at its own iterators in order"
        axes = _reads_rows_at(blk, results)
        if isinstance(axes, str):
            return f"{name}: {axes}"
        if name in reductions:
            own = [i for i, iv in enumerate(ivs) if int(iv.iter_type) == int(C.IterVarKind.DataPar)
                   and int(iv.dom.extent) != 1]
            if axes is not None and axes != own:
                return f"reduction {name} reads another reduction's result off its own row"
            axes = own
        elif axes is None:          # an output the reductions read (a residual sum): its rows as they read it
            axes = _rows_read_by(sch, name, reductions)
            if isinstance(axes, str):
                return f"output {name}: {axes}"
        if name in outputs:
            out[name] = axes
    return out


def _writes_in_place(blk) -> bool:
    """Whether the block's (single) store indexes its buffer by its spatial iterators, in order."""
    store = blk.body
    ivs = [iv.var for iv in blk.iter_vars if int(iv.iter_type) == int(C.IterVarKind.DataPar)]
    return isinstance(store, C.BufferStore) and len(store.indices) == len(ivs) and \
        all(i.same_as(v) for i, v in zip(store.indices, ivs))


def _reads_rows_at(blk, results: dict) -> list[int] | None | str:
    """The positions of ``blk``'s iterators at which it reads the buffers of ``results`` (name -> the
    extents of their row axes); None when it reads none; a str when a read is not at plain iterators or
    two reads disagree."""
    ivs = list(blk.iter_vars)
    ana = C.Analyzer()
    for iv in ivs:
        ana.bind(iv.var, iv.dom)
    found: list = []

    def visit(node):
        if not (isinstance(node, C.TensorLoad) and str(node.source.name) in results):
            return
        axes = []
        for idx, ext in zip(node.indices, results[str(node.source.name)]):
            if ext == 1:
                continue                                 # a keepdims / unit axis: no row to enumerate
            idx = _in_range(ana, ana.simplify(idx))
            pos = [i for i, iv in enumerate(ivs) if idx.same_as(iv.var)]
            if not pos or const_int(ivs[pos[0]].dom.extent) != ext:
                found.append(f"reads {node.source.name} at {idx}, not at an iterator of extent {ext}")
                return
            axes.append(pos[0])
        found.append(axes)

    C.post_order_visit(blk.body, visit)
    if not found:
        return None
    bad = [f for f in found if isinstance(f, str)]
    if bad:
        return bad[0]
    if any(f != found[0] for f in found) or len(set(found[0])) != len(found[0]):
        return f"reads the reductions' results at different iterators {found}"
    return found[0]


def _rows_read_by(sch: C.Schedule, name: str, reductions: list[str]) -> list[int] | str:
    """The positions of the buffer written by block ``name`` at which the reductions read it at their
    own (non-unit) row iterators, in their order; a str when none reads it or two disagree."""
    buf = str(sch.get(sch.get_sblock(name)).writes[0].source.name)
    found: list = []
    for r in reductions:
        blk = sch.get(sch.get_sblock(r))
        rows = [iv.var for iv in blk.iter_vars
                if int(iv.iter_type) == int(C.IterVarKind.DataPar) and int(iv.dom.extent) != 1]

        def visit(node, rows=rows):
            if isinstance(node, C.TensorLoad) and str(node.source.name) == buf:
                pos = [[k for k, i in enumerate(node.indices) if i.same_as(v)] for v in rows]
                found.append([p[0] for p in pos] if all(pos) else "a reduction reads it off its rows")

        C.post_order_visit(blk.body, visit)
    if not found:
        return "reads no reduction result and no reduction reads it: its rows cannot be told"
    if any(f != found[0] for f in found):
        return f"the reductions read it at different positions {found}"
    return found[0]


def _in_range(ana: C.Analyzer, index):
    """``a % m`` as ``a`` where ``0 <= a < m`` is provable (a reshape's ``i % 64`` over i < 64)."""
    if isinstance(index, C.tirx.FloorMod) and ana.can_prove(index.a >= 0) and ana.can_prove(index.a < index.b):
        return index.a
    return index


def _row_and_inner_loops(sch: C.Schedule, blk, axes: list[int]) -> tuple[list, list]:
    """The loops of ``blk`` over its row iterators ``axes`` (in that order) and over the others, the row
    loops reordered outermost."""
    loops = sch.get_loops(blk)
    loop_vars = [sch.get(lp).loop_var for lp in loops]
    realize = _realize_of(sch, blk)
    loop_of = {}
    for pos, value in enumerate(realize.iter_values):
        hit = [k for k, v in enumerate(loop_vars) if value.same_as(v)]
        if hit:
            loop_of[pos] = hit[0]
    missing = [a for a in axes if a not in loop_of]
    if missing:
        raise ValueError(f"row iterators {missing} of block {realize.block.name_hint} are not bound to loops")
    rows = [loops[loop_of[a]] for a in axes]
    taken = {loop_of[a] for a in axes}
    inner = [lp for k, lp in enumerate(loops) if k not in taken]
    if rows and [loop_of[a] for a in axes] != list(range(len(axes))):
        sch.reorder(*rows, *inner)
    return rows, inner


def _realize_of(sch: C.Schedule, blk):
    name = sch.get(blk).name_hint
    found = []
    C.post_order_visit(sch.mod["main"].body,
                       lambda n: found.append(n) if isinstance(n, C.SBlockRealize) and n.block.name_hint == name
                       else None)
    return found[0]
