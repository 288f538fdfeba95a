"""CUDA: the attention rule's kernel (``AttentionSpec``, schedules/cpu/attention.py) as one online-softmax
kernel, the scores never in global memory:

    for (batch, query block) in blockIdx.x:                 # one thread block per `rows` query rows
        Qs = Q[block rows]^T                                # shared, [d, rows]: a warp reads 32 banks
        for row in threadIdx.x:                             # one thread per query row
            m = -inf, l = 0, acc[dv] = 0                    # registers
            for key block:
                Ks, Vs = K[block], V[block]                 # shared, loaded by all threads together
                s[kb] = scale * Qs[row] . Ks^T + mask  (-inf: past the keys, causal)     # registers
                m' = max(m, max(s)); p = exp(s - m'); alpha = exp(m - m')
                l = l * alpha + sum(p); acc = acc * alpha + p @ Vs; m = m'
            out[row] = acc / l   (0 where the guard is set, or no key was seen with zero_empty_rows)

The loops over the keys of a block and over the value dim are unrolled (the head-dim loop of the scores
is not: it holds the key loop), so that ``s`` and ``acc`` live in registers; TVM's lowering puts the barriers between the shared-memory stages and their readers.  The
knobs are the query rows per thread block (threads) and the keys per block; the defaults are per
architecture (``CudaArch.attn_rows``, ``attn_k_block``), the space limited by the shared memory and the
threads per block of the arch.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ... import _compat as C
from ..base import Config, KnobSpace, Match, Template, knob
from ..cpu.attention import ATTR, NEG_INF, AttentionSpec, batch_env, operand_index, unravel
from ._common import arch_of

ROWS = (32, 64, 128)            # query rows (= threads) per thread block: whole warps
K_BLOCKS = (8, 16, 32, 64)      # keys staged in shared memory per online-softmax step
MAX_UNROLLED = 64 * 128         # largest kb * dv the unrolled P @ V loop may hold (code size / registers)
FLOAT_BYTES = 4


@dataclass(frozen=True)
class AttentionConfig(Config):
    """The knobs of the CUDA attention kernel."""

    rows: int = knob("query rows per thread block, one thread each (threadIdx.x)")
    k_block: int = knob("keys per online-softmax step, their K and V rows staged in shared memory")


def shared_bytes(spec: AttentionSpec, rows: int, kb: int) -> int:
    """Shared memory of one thread block: the query rows, the K and V tiles."""
    return FLOAT_BYTES * (rows * spec.d + kb * (spec.d + spec.dv))


class CudaAttention(Template):
    family = "cuda_attention"
    target_kinds = ("cuda",)
    config_type = AttentionConfig

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        if func.attrs is None or ATTR not in func.attrs:
            return None
        spec = AttentionSpec.from_json(str(func.attrs[ATTR]))
        if not spec.is_static():
            return None      # symbolic batch/sequence: this kernel is built for static extents
        shapes = [tuple(s) for s, _ in C.prim_func_params(func)]
        if shapes != [tuple(op.shape) for _, op in spec.inputs()] + [tuple(spec.out.shape)]:
            return None      # not the kernel the spec describes (another pass changed its signature)
        if not self.space(Match(self.family, {"spec": spec}), target).knobs[1].choices:
            return None
        return Match(self.family, {"spec": spec})

    def accepts(self, group, target: C.Target) -> str | None:
        return "attention kernels are formed by the attention pass, not by the pairwise rules"

    # Step 0. The knob space: what fits the arch's shared memory and threads, and the unroll limit.
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        spec, arch = match.info["spec"], arch_of(target)
        width = spec.dv
        rows = [r for r in ROWS if r <= arch.max_threads_per_block]
        kbs = [k for k in K_BLOCKS if k * width <= MAX_UNROLLED and (k == K_BLOCKS[0] or k < 2 * spec.sk)
               and shared_bytes(spec, rows[0], k) <= arch.max_shared_bytes]
        rows = [r for r in rows if kbs and shared_bytes(spec, r, kbs[0]) <= arch.max_shared_bytes]
        return AttentionConfig.space(rows=rows, k_block=kbs if rows else [])

    def default_config(self, match: Match, target: C.Target) -> dict:
        spec, arch = match.info["spec"], arch_of(target)
        space = self.space(match, target)
        rows_c, kb_c = space.knobs[0].choices, space.knobs[1].choices
        kb = max([k for k in kb_c if k <= arch.attn_k_block] or [kb_c[0]])
        fit = [r for r in rows_c if shared_bytes(spec, r, kb) <= arch.max_shared_bytes]
        # fewer rows per block for short sequences, so that every SM gets a block
        blocks = max(1, math.prod(spec.batch))
        want = [r for r in fit if r <= arch.attn_rows and blocks * -(-spec.sq // r) >= arch.sm_count] or fit[:1]
        return AttentionConfig(rows=max(want), k_block=kb).asdict()

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        spec = match.info["spec"]
        cfg = AttentionConfig.from_dict(config)
        root = sch.get_sblock("root")
        func = sch.mod["main"]
        # Step 1. The loop nest for this configuration, over the kernel's own buffers.
        new_root = _cuda_root(spec, list(func.params), cfg.rows, cfg.k_block)
        # Step 2. It replaces the reference stages (scores, softmax, P @ V) wholesale.
        old = sch.get(root)
        sch.state.replace(sch.get_sref(root), new_root, {old: new_root})


def _cuda_root(spec: AttentionSpec, params: list, rows: int, kb: int):
    """The root block of the CUDA kernel (see the module docstring)."""
    T, IRBuilder, tir = C.tir_builder, C.IRBuilder, C.tirx
    names = [n for n, _ in spec.inputs()] + ["out"]
    buf = dict(zip(names, params))
    f32 = "float32"
    nb_total = max(1, math.prod(spec.batch))
    nqb = -(-spec.sq // rows)
    nkb = -(-spec.sk // kb)
    ext = spec.extents()
    scale = tir.const(spec.scale, f32)
    neg_inf, zero = tir.const(NEG_INF, f32), tir.const(0.0, f32)

    def load(name, env):
        op = getattr(spec, name)
        return buf[name][tuple(operand_index(op, env, ext))]

    def cooperative(total: int):
        """The loop over the ``total`` elements of a tile, ``rows`` threads at a time."""
        return T.serial(0, -(-total // rows))

    def whole(b, shape):
        return b[tuple(slice(0, n) for n in shape)]

    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            for n in names:
                T.arg(n, buf[n])
            with T.thread_binding(0, nb_total * nqb, thread="blockIdx.x") as bx:
                with T.sblock("attention_cuda"):
                    t = T.axis.spatial(nb_total * nqb, bx)
                    T.reads(*[buf[n][tuple(slice(0, s) for s in op.shape)] for n, op in spec.inputs()])
                    T.writes(buf["out"][tuple(slice(0, s) for s in spec.out.shape)])
                    qs = T.sblock_alloc_buffer((spec.d, rows), f32, scope="shared")
                    ks = T.sblock_alloc_buffer((kb, spec.d), f32, scope="shared")
                    vs = T.sblock_alloc_buffer((kb, spec.dv), f32, scope="shared")
                    bidx = unravel(tir.floordiv(t, nqb), list(spec.batch)) if spec.batch else []
                    benv = batch_env(spec, bidx)
                    q0 = tir.floormod(t, nqb) * rows
                    n_blocks = nkb
                    if spec.causal_offset is not None:     # the key blocks the block's last row can see
                        last_key = q0 + (rows - 1) + spec.causal_offset
                        n_blocks = tir.max(tir.min(tir.floordiv(last_key, kb) + 1, nkb), 0)
                    with T.thread_binding(0, rows, thread="threadIdx.x") as tx:
                        with T.sblock("attention_row"):
                            r = T.axis.spatial(rows, tx)
                            T.reads(*[whole(buf[n], op.shape) for n, op in spec.inputs()],
                                    whole(qs, (spec.d, rows)), whole(ks, (kb, spec.d)), whole(vs, (kb, spec.dv)))
                            T.writes(whole(buf["out"], spec.out.shape), whole(qs, (spec.d, rows)),
                                     whole(ks, (kb, spec.d)), whole(vs, (kb, spec.dv)))
                            st = T.sblock_alloc_buffer((4,), f32, scope="local")   # m, m', l, 1/l
                            s = T.sblock_alloc_buffer((kb,), f32, scope="local")
                            acc = T.sblock_alloc_buffer((spec.dv,), f32, scope="local")
                            i = q0 + r
                            ic = tir.min(i, spec.sq - 1)
                            # Step 1. Stage the block's query rows, transposed (loads coalesced over the
                            # head dim; the score loop's reads of a warp hit 32 banks).
                            with cooperative(rows * spec.d) as it:
                                idx = it * rows + r
                                with T.If(idx < rows * spec.d):
                                    with T.Then():
                                        qr, qd = tir.floordiv(idx, spec.d), tir.floormod(idx, spec.d)
                                        T.buffer_store(qs, load("q", {**benv, "i": tir.min(q0 + qr, spec.sq - 1),
                                                                      "d": qd}), [qd, qr])
                            T.buffer_store(st, neg_inf, [0])
                            T.buffer_store(st, zero, [2])
                            with T.unroll(0, spec.dv) as e:
                                T.buffer_store(acc, zero, [e])
                            with T.serial(0, n_blocks) as ko:
                                j0 = ko * kb
                                # Step 2. Stage the K and V rows of the key block (all threads).
                                for tile, name, width, lab in ((ks, "k", spec.d, "d"), (vs, "v", spec.dv, "e")):
                                    with cooperative(kb * width) as it:
                                        idx = it * rows + r
                                        with T.If(idx < kb * width):
                                            with T.Then():
                                                jj, dd = tir.floordiv(idx, width), tir.floormod(idx, width)
                                                jc = tir.min(j0 + jj, spec.sk - 1)
                                                T.buffer_store(tile, load(name, {**benv, "j": jc, lab: dd}),
                                                               [jj, dd])
                                # Step 3. Scores of the thread's row (registers), scaled and masked.
                                with T.unroll(0, kb) as jj:
                                    T.buffer_store(s, zero, [jj])
                                with T.serial(0, spec.d) as dd:       # the key loop unrolled inside
                                    with T.unroll(0, kb) as jj:
                                        T.buffer_store(s, s[jj] + qs[dd, r] * ks[jj, dd], [jj])
                                with T.unroll(0, kb) as jj:
                                    j = j0 + jj
                                    x = s[jj] * scale
                                    if spec.mask is not None:
                                        x = x + load("mask", {**benv, "i": ic, "j": tir.min(j, spec.sk - 1)})
                                    valid = j < spec.sk
                                    if spec.causal_offset is not None:
                                        valid = tir.And(valid, j <= ic + spec.causal_offset)
                                    T.buffer_store(s, tir.Select(valid, x, neg_inf), [jj])
                                # Step 4. Online softmax: new max, probabilities, rescaled sum and accumulator.
                                T.buffer_store(st, st[0], [1])
                                with T.unroll(0, kb) as jj:
                                    T.buffer_store(st, tir.max(st[1], s[jj]), [1])
                                safe = tir.Select(st[1] == neg_inf, zero, st[1])
                                alpha = tir.exp(st[0] - safe)
                                T.buffer_store(st, st[2] * alpha, [2])
                                with T.unroll(0, spec.dv) as e:
                                    T.buffer_store(acc, acc[e] * alpha, [e])
                                T.buffer_store(st, st[1], [0])
                                with T.unroll(0, kb) as jj:
                                    T.buffer_store(s, tir.exp(s[jj] - safe), [jj])
                                    T.buffer_store(st, st[2] + s[jj], [2])
                                # Step 5. acc += p @ Vs (registers; Vs read by every thread: a broadcast).
                                with T.unroll(0, kb) as jj:
                                    with T.unroll(0, spec.dv) as e:
                                        T.buffer_store(acc, acc[e] + s[jj] * vs[jj, e], [e])
                            # Step 6. Normalize and store the thread's row.
                            with T.If(i < spec.sq):
                                with T.Then():
                                    total = st[2]
                                    with T.unroll(0, spec.dv) as e:
                                        val = acc[e] / total
                                        if spec.zero_empty_rows:
                                            val = tir.Select(total > zero, val, zero)
                                        if spec.guard is not None:
                                            val = tir.Select(load("guard", {**benv, "i": i}), zero, val)
                                        T.buffer_store(buf["out"], val,
                                                       operand_index(spec.out, {**benv, "i": i, "e": e}, ext))
    return ib.get().body.block
