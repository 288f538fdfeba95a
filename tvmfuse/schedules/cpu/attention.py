"""Attention as one CPU kernel: online (flash-style) softmax, the S x S scores never in memory.

The kernel contract is ``AttentionSpec`` (what ``tvmfuse.passes.attention`` found in the graph): for
every logical batch index (batch, heads...) and query row i,

    out[i, e] = sum_j softmax_j(scale * sum_d Q[i, d] K[j, d] + mask[i, j] + causal[i, j]) V[j, e]

with ``causal[i, j] = -inf`` where ``j > i + causal_offset`` and, with a ``guard`` operand (a bool per
row), ``out[i, :] = 0`` where the guard is true (ONNX Attention's fully-masked rows).  A row whose logits
are all -inf gives NaN, as softmax does (0/0), or 0 with ``zero_empty_rows`` (``where(isnan(P), 0, P) @ V``,
as PyTorch's SDPA exports write it: the softmax's sum is not positive).  Each operand is a buffer whose axes carry logical labels
(``Operand.axes``): ``b<k>`` (batch axis k), ``i`` (query), ``j`` (key), ``d`` (q/k feature), ``e`` (value
feature) or ``1`` (broadcast); an axis may hold several of them row-major (a composite: [seq, heads*dim]
before the head split) or a digit of one (``("%", label, stride, extent)``: K/V heads shared by groups of
query heads), so transposed K, head split/merge reshapes and transposes, grouped-query K/V and broadcast
masks are read in place.

``reference_prim_func(spec)`` is the unscheduled kernel (scores, max, exp, sum, P @ V as te stages: any
target can lower it).  The CPU template ``Attention`` replaces its body with the online-softmax loop nest
for a (query block, key block, register tiles) configuration; the scores are held transposed, a vector
over the query rows, so that the row statistics are vector operations:

    for (batch, q_blocks query blocks) in parallel:
        Kp, Vp = K[keys], V[keys]      # pack_kv: the keys the task's rows see, copied once, contiguous
      for query block of the task:
        qT = (Q[rows] * scale)^T                                  # [d, qb] local, once per block
        m = -inf, l = 0, acc = 0                                  # per query row, local buffers
        for key block:
            (prefetch: a few rows of the next block's Q, this block's out, the next task's K/V, into L2)
            sT = K[block] @ qT + mask  (-inf: past the keys, causal)   # [kb, qb], vector over rows;
            m' = max(m, colmax(sT))                                    # both in the score tile's registers
            p = exp(min(sT - m', 0));  alpha = exp(min(m - m', 0))     # args <= 0: fastmath's cheap exp
            l  = l * alpha + colsum(p);  acc = acc * alpha + p^T @ V[block]    # vector over the head dim
                                                      # (the rescale in the first key's multiply-add)
            m  = m'
        out[rows] = acc / l   (0 where the guard is set)

With the ``exp2`` knob (the target table's default) the exps are powers of 2: p = 2^(sT log2(e) - m2), one
multiply-add for the argument, where m2 = m' log2(e) rounded up (every argument <= 0) and kept per key block,
so that the rescale factors 2^(m2_old - m2) use the very offsets the exps used: m2's rounding scales the sums
and the accumulators alike and cancels in acc / l (logits near 1e4 keep the base-e kernel's accuracy; a query
scale of scale x log2(e) did not: Q x 0.125 is exact, Q x 0.18 is not).  tvmfuse.fastmath expands 2^x of an
argument <= 0 without the ln 2 reduction: 13 vector instructions per vector of scores (argument and min
included) instead of 15-17.  The two multiply-add loops run at the FMA ports' rate, so the instructions
around them are what is left to cut.

The query block is sized so that its transposed queries, scores and accumulators fit L1 (the target's
``l1_share_query_block``): the K/V rows of a key block are then re-read from L2 by each query block.
In place, K/V rows of a heads-interleaved tensor ([seq, heads * dim]) are heads x dim floats apart and fall
into few cache sets (at S=2048 one head's K and V overflow their L2 sets); a static key length therefore
packs them by default (``pack_kv``: a task's rows in the target's ``l2_share_kv`` of L2) and gives each task
``q_blocks`` query blocks to share the copy (measured kernel-only, one thread, under load, Emerald Rapids,
12 heads x 64: S=2048 1.4x, S=512 within noise, causal S=512/2048 1.03x/1.05-1.15x).
Those copies, the Q transposes and the output stores still miss the caches (rows 3 KiB apart, read once per
task): with a static sequence the kernel prefetches (``prefetch``, a target table level) the rows the next
query block reads and this one writes, and (packed K/V) the next task's K/V rows, a few per row of score
tiles, into L2 (at S=512 their share of a one-thread profile went from ~15% to ~6%, under load).

Batch and sequence extents may be symbolic (TIR vars: one kernel for every size); the blocks then loop
over the symbolic sequence with a tail, and the last query block computes only the row groups that hold
existing rows, its row indices clamped to the last row; the blocks before it (``q0 + qb <= sequence``) run
a body of their own without the clamps (``query_block``: a clamp per lane of the mask gather made albert_dyn's
kernel 1.33x its static one at sequence 128).  Loop counts that would always equal a static number stay
static, as in the static kernel
(row groups whose unit is the whole query block; a single query or key block where the nest's size bucket
bounds the sequence by the block), so a bucket's nest has the static kernel's loops.

The shortest symbolic sequences (up to the target table's ``row_nest_max_seq``) get a nest of their own,
the row nest (``_row_root``, config ``q_block`` 1): a query block of a vector of rows would compute mostly
rows past the end there, so each task is one query row, its scores dot products over the head dim (a
vector of products, summed by shuffles), its keys in blocks sized to the sequence (the bucket bounds them:
one block, no key past the end or above the diagonal computed), and the task loop over (batch x heads x
rows) runs serial where the kernel's multiply-adds are under the target's fork/join cost (``serial_work``:
a run-time branch, the batch being symbolic):

    for (batch, row) in serial/parallel:
        m = -inf, l = 0, acc = 0
        for key block (one where the bucket bounds the keys):
            s[j] = scale * Q[row] . K[j] (+ mask)  for the row's visible keys;  m' = max(m, max_j s)
            alpha = exp(min(m - m', 0));  p = exp(min(s - m', 0));  l = l * alpha + sum(p)
            acc = acc * alpha + p @ V[block];  m = m'
        out[row] = acc / l   (0 where the guard is set)

(bert_dyn at sequence 1: its attention kernel 2.3 -> 0.2 us a call, one thread, under load.)
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass, replace

from ... import _compat as C
from ...target import cpu_info, template_defaults
from ..base import Config, KnobSpace, Match, Template, knob
from ..buckets import Bucket
from . import common as U

ATTR = "tvmfuse.attention"          # PrimFunc attribute holding the spec (JSON)
RULE_ATTR = "tvmfuse.rule"          # the rule that formed the kernel (for the report)
# query rows per task: they share each K/V row a key block loads (more rows amortize those loads; fewer keep
# the block's transposed queries, scores and accumulators in L1)
Q_BLOCK_VECTORS = (1, 2, 4, 8, 16)  # query rows per task, in float32 vectors of the target
K_BLOCK_VECTORS = (1, 2, 4, 8)      # keys per block, in float32 vectors of the target
TILE_KEYS = (2, 4, 8)               # keys of a score register tile
TILE_QVECS = (1, 2, 4)              # row vectors of a score register tile
Q_TASK_BLOCKS = (1, 2, 4, 8, 16, 32, 64)   # query blocks per parallel task (sharing its packed K/V rows)
# The default blocks' thresholds are the target's (``template_defaults["cpu.attention"]`` in
# schedules/cpu_targets.json): l1_share_kv, the share of L1 for the K/V rows of one key block (a causal
# kernel's: causal_l1_share_kv; 48 KiB-L1 server cores take 64-key blocks for the plain kernel);
# l1_share_query_block, for the query block's transposed queries, accumulators, scores and running sums
# (each row group's share is in registers meanwhile; measured under load on Emerald Rapids, S=128..2048, head
# dim 64: 64 rows per task 1.1-1.3x faster than the 128-256 rows an L2-sized block gave); a causal kernel
# skips the key blocks past its query block's last row, so its block is at most causal_q_block_share of the
# sequence; min_tasks_per_core parallel tasks (batch x query blocks) per core before rows per task grow.
ROW_GROUPS = (1, 2, 4, 8)           # query rows whose P @ V accumulators are in registers together
# Vector registers of the ISA by the target's vector width: AVX-512 32 zmm, AVX/AVX2 16 ymm; 128-bit: 16
# (SSE's count; NEON has 32, so this is safe there).
VECTOR_REGISTERS = {512: 32, 256: 16, 128: 16}
# acc_register_share (cpu_targets.json): the accumulators of a row group and a score tile may fill this
# share of the vector registers (the rest: the broadcast query/probability values and the K/V vectors).
# The size the default blocks assume for a symbolic extent (the kernel is correct at every size): a
# symbolic batch axis may be 1 at run time, so it adds no tasks; a symbolic sequence is taken as a
# typical encoder length.
SYMBOLIC_BATCH_HINT = 1
SYMBOLIC_SEQ_HINT = 128
# Size buckets over a symbolic sequence (``schedules.buckets``): one nest per bound, each with the blocks a
# static build of that length gets (a 128-row query block and 128-key blocks at sequence 1 compute 128x
# the scores: measured 30-70x slower than static at sequence 1, bert_dyn, under load); the last, open
# bucket takes the blocks for SYMBOLIC_OPEN_HINT rows.
SEQ_BUCKETS = (16, 32, 64, 128)
# Below them, the row nest's bucket (``_row_root``): sequences up to the target table's row_nest_max_seq
# (cpu_targets.json) run one query row per task, each score a dot product over the head dim, keys in blocks
# sized to the sequence, serial over (batch x heads x rows) under the target's fork/join cost: at sequence 1
# the seq<=16 nest computed a whole 16-row query block and 16-key block and forked the thread pool (bert_dyn's
# attention 2.3 us a call vs its static build's ~0.3 us, one thread, under load).
ROW_BUCKET = "row_nest:seq"
SYMBOLIC_OPEN_HINT = 256
NEG_INF = float("-inf")
LOG2E = 1.4426950408889634      # log2(e): the exp2 knob computes e^(x - m) as 2^(x log2(e) - m log2(e))
# Software prefetch (the ``prefetch`` knob): one per 64-byte cache line (16 float32), with LLVM's locality
# hint 2 (x86: prefetcht1, into L2, not L1: L1 holds the query block's working set meanwhile).
LINE_FLOATS = 16
PREFETCH_LOCALITY = 2
# The storage scope of a task's buffers (running max / sum rows, scores, transposed queries, accumulators,
# packed K/V): in "global" TVM puts one under MAX_STACK_ALLOCA_BYTES on the stack (a "local" one is always a
# TVMBackendAllocWorkspace call per task, tests/test_schedules_cpu_stack_audit.py); larger ones are a
# workspace allocation either way, once per task.
BUFFER_SCOPE = "global"


@dataclass(frozen=True)
class Operand:
    axes: tuple          # logical label per buffer axis
    shape: tuple         # the buffer's shape: ints, a symbolic extent as a TIR var (its name in JSON)
    dtype: str = "float32"


@dataclass(frozen=True)
class AttentionSpec:
    """What the kernel computes.  Extents are ints or, for symbolic batch/sequence axes, TIR vars (one
    symbol per extent: ``batch``, ``sequence``); the JSON form holds a var's name, and ``bind`` puts the
    kernel's own vars back (``Attention.match``).  An operand's extent may also be a sum or product of
    symbols and ints when each of its symbols is some operand's plain extent (``_EXTENT_OPS``: LeViT's
    subsampled queries ``[batch * 4, 32]``); JSON holds it as ``["*", "batch", 4]``.  The head dims
    ``d``/``dv`` are static."""
    batch: tuple         # logical batch extents (b0, b1, ...)
    sq: object           # int or a TIR var
    sk: object
    d: int
    dv: int
    q: Operand
    k: Operand
    v: Operand
    out: Operand
    mask: Operand | None = None
    guard: Operand | None = None
    scale: float = 1.0
    causal_offset: int | None = None
    zero_empty_rows: bool = False    # a row without any positive weight (all logits -inf) gives 0, not NaN

    def inputs(self) -> list[tuple[str, Operand]]:
        ops = [("q", self.q), ("k", self.k), ("v", self.v)]
        if self.mask is not None:
            ops.append(("mask", self.mask))
        if self.guard is not None:
            ops.append(("guard", self.guard))
        return ops

    def extents(self) -> dict:
        ext = {f"b{k}": n for k, n in enumerate(self.batch)}
        ext.update({"i": self.sq, "j": self.sk, "d": self.d, "e": self.dv, "1": 1})
        return ext

    def to_json(self) -> str:
        return json.dumps(asdict(self.map_dims(_dim_json)), sort_keys=True)

    @staticmethod
    def from_json(text: str) -> "AttentionSpec":
        """The spec of a kernel's attribute; symbolic extents are var names until ``bind``."""
        d = json.loads(text)
        ops = {k: (Operand(tuple(_as_label(a) for a in v["axes"]), tuple(_dim_from_json(n) for n in v["shape"]),
                           v["dtype"]) if v is not None else None)
               for k, v in d.items() if k in ("q", "k", "v", "out", "mask", "guard")}
        rest = {k: v for k, v in d.items() if k not in ops}
        rest["batch"] = tuple(_dim_from_json(n) for n in rest["batch"])
        rest["sq"], rest["sk"] = _dim_from_json(rest["sq"]), _dim_from_json(rest["sk"])
        return AttentionSpec(**rest, **ops)

    def map_dims(self, f) -> "AttentionSpec":
        """The spec with ``f`` applied to every extent (batch, sq, sk, d, dv, operand shapes)."""
        def op(o):
            return None if o is None else Operand(o.axes, tuple(f(n) for n in o.shape), o.dtype)
        return replace(self, batch=tuple(f(n) for n in self.batch), sq=f(self.sq), sk=f(self.sk),
                       d=f(self.d), dv=f(self.dv), q=op(self.q), k=op(self.k), v=op(self.v), out=op(self.out),
                       mask=op(self.mask), guard=op(self.guard))

    def symbols(self) -> dict:
        """Name -> TIR var of every symbolic extent."""
        found = {}

        def walk(n):
            if isinstance(n, C.tirx.Var):
                found.setdefault(str(n.name), n)
            elif _extent_op(n) is not None:
                walk(n.a)
                walk(n.b)
            return n
        self.map_dims(walk)
        return found

    def is_static(self) -> bool:
        """Whether every extent is an int (no symbol: a TIR var, or its name as ``from_json`` reads it)."""
        found = []
        self.map_dims(lambda n: n if isinstance(n, int) else found.append(n))
        return not found

    def bind(self, symbols: dict) -> "AttentionSpec":
        """The spec with each symbol (a var name, as ``from_json`` reads it, or a var) replaced by
        ``symbols[name]`` (a TIR var); KeyError names a symbol ``symbols`` lacks."""
        def sub(n):
            if isinstance(n, str):
                return symbols[n]
            if isinstance(n, C.tirx.Var):
                return symbols[str(n.name)]
            if isinstance(n, tuple):             # an expression as from_json reads it: (op, a, b)
                return _EXTENT_OPS[n[0]][1](sub(n[1]), sub(n[2]))
            op = _extent_op(n)
            return _EXTENT_OPS[op][1](sub(n.a), sub(n.b)) if op is not None else n
        return self.map_dims(sub)

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistency between labels and extents."""
        for what, n in (("head dim d", self.d), ("value head dim dv", self.dv)):
            if not isinstance(n, int):
                raise ValueError(f"attention {what} is symbolic ({n}): the kernel tiles it, it must be static")
        plain = [n for n in (*self.batch, self.sq, self.sk) if not isinstance(n, int)]
        for o in [o for _, o in self.inputs()] + [self.out]:
            plain += [n for n in o.shape if not isinstance(n, int)]
            for lab in o.axes:
                for part in axis_parts(lab):
                    if isinstance(part, tuple) and not all(isinstance(x, int) for x in part[2:]):
                        raise ValueError(f"attention: a split axis {part} has a symbolic stride or extent")
        named = {n if isinstance(n, str) else str(n.name)
                 for o in [o for _, o in self.inputs()] + [self.out] for n in o.shape
                 if isinstance(n, (str, C.tirx.Var))}
        for n in plain:
            if isinstance(n, (str, C.tirx.Var)):
                continue
            names = _dim_names(n)
            if names is None:
                raise ValueError(f"attention: symbolic extent {n} is not a plain symbol (batch, sequence)")
            if not names <= named:
                raise ValueError(f"attention: symbolic extent {n} is not a plain symbol, and its symbols "
                                 f"{sorted(names)} are no operand's plain extent")
        ext = self.extents()
        allowed = {"q": "id", "k": "jd", "v": "je", "out": "ie", "mask": "ij", "guard": "i"}
        for name, op in self.inputs() + [("out", self.out)]:
            if len(op.axes) != len(op.shape):
                raise ValueError(f"attention operand {name}: {len(op.axes)} labels for rank {len(op.shape)}")
            flat, plain = [], []
            for lab, n in zip(op.axes, op.shape):
                parts = axis_parts(lab)
                for part in parts:
                    sub = _part_base(part)
                    if not (sub == "1" or sub in ext and (sub.startswith("b") or sub in allowed[name])):
                        raise ValueError(f"attention operand {name}: label {sub!r} not allowed")
                    if isinstance(part, tuple) and name == "out":
                        raise ValueError("attention output: a split (digit) axis is not allowed")
                    flat.append(sub)
                    if not isinstance(part, tuple):
                        plain.append(sub)
                want = math.prod(_part_extent(part, ext) for part in parts)
                if not same_extent(want, n):
                    raise ValueError(f"attention operand {name}: axis {lab} has extent {n}, expected {want}")
            real = [x for x in plain if x != "1"]
            if len(real) != len(set(real)):
                raise ValueError(f"attention operand {name}: a label appears twice in {op.axes}")
            need = set(allowed[name]) - ({"i"} if name in ("mask", "guard") else set())
            need -= {"j"} if name == "mask" else set()
            missing = need - set(flat)
            if missing:
                raise ValueError(f"attention operand {name}: no axis for {sorted(missing)}")
        out_flat = {_part_base(x) for lab in self.out.axes for x in axis_parts(lab) if x != "1"}
        if out_flat != {f"b{k}" for k in range(len(self.batch))} | {"i", "e"}:
            raise ValueError(f"attention output axes {self.out.axes} must hold every batch axis, i and e")


# The expressions an operand's extent may be beyond a symbol (``AttentionSpec``): JSON operator -> (TIR node
# type, its constructor).  The kernel only needs the value call_tir binds each symbol to.
_EXTENT_OPS = {"*": (C.tirx.Mul, lambda a, b: a * b), "+": (C.tirx.Add, lambda a, b: a + b)}


def _extent_op(n) -> str | None:
    """The JSON operator of a sum or product extent, None for anything else."""
    return next((op for op, (ty, _) in _EXTENT_OPS.items() if isinstance(n, ty)), None)


def _dim_json(n):
    """An extent as JSON: an int, the name of its symbol, or ``[op, a, b]`` for a sum or product."""
    if isinstance(n, (int, str)):
        return n
    if isinstance(n, C.IntImm):
        return int(n.value)
    if isinstance(n, C.tirx.Var):
        return str(n.name)
    if isinstance(n, tuple):
        return [n[0], _dim_json(n[1]), _dim_json(n[2])]
    op = _extent_op(n)
    if op is not None:
        return [op, _dim_json(n.a), _dim_json(n.b)]
    raise ValueError(f"attention: symbolic extent {n} is not a plain symbol (batch, sequence)")


def _dim_from_json(x):
    """An extent from JSON (``_dim_json``): an expression ``[op, a, b]`` becomes the tuple ``(op, a, b)``
    until ``AttentionSpec.bind`` builds it over the kernel's vars; a ValueError names an unknown operator."""
    if not isinstance(x, list):
        return x
    if len(x) != 3 or x[0] not in _EXTENT_OPS:
        raise ValueError(f"attention spec: extent {x} is not [op, a, b] with op in {sorted(_EXTENT_OPS)}")
    return (x[0], _dim_from_json(x[1]), _dim_from_json(x[2]))


def _dim_names(n) -> set | None:
    """The symbol names of a symbolic extent built by ``_EXTENT_OPS`` from symbols and ints; None when it
    holds anything else (a division, a max: not an extent the spec takes)."""
    if isinstance(n, int) or isinstance(n, C.IntImm):
        return set()
    if isinstance(n, str):
        return {n}
    if isinstance(n, C.tirx.Var):
        return {str(n.name)}
    if isinstance(n, tuple):
        parts = [_dim_names(n[1]), _dim_names(n[2])]
    elif _extent_op(n) is not None:
        parts = [_dim_names(n.a), _dim_names(n.b)]
    else:
        return None
    return None if None in parts else parts[0] | parts[1]


def static(n) -> int | None:
    """An extent's value when it is static, else None."""
    return n if isinstance(n, int) else (int(n.value) if isinstance(n, C.IntImm) else None)


def same_extent(a, b) -> bool:
    """Are two extents (ints, TIR expressions or symbol names) provably equal?"""
    if isinstance(a, (int, str)) and isinstance(b, (int, str)):
        return a == b
    if isinstance(a, str) or isinstance(b, str):
        return False
    return bool(C.Analyzer().can_prove_equal(a, b))


def _ceil_div(n, b: int):
    return -(-n // b) if isinstance(n, int) else C.tirx.floordiv(n + (b - 1), b)


def _hint(n, default: int) -> int:
    return n if isinstance(n, int) else default


def _seq_symbol(spec: AttentionSpec):
    """The symbolic sequence extent size buckets dispatch on: the query length, else the key length;
    None when both are static."""
    for n in (spec.sq, spec.sk):
        if static(n) is None:
            return n
    return None


def _size(n, match: Match, default):
    """The size the blocks are chosen for: a static extent's value; the bucket's size for the extent the
    buckets dispatch on (its bound, or the open bucket's hint: ``default`` then in the knob space, where
    only a bound limits the choices); ``default`` for any other symbolic extent."""
    if static(n) is not None:
        return static(n)
    if "seq_size" in match.info and same_extent(n, _seq_symbol(match.info["spec"])):
        if match.info["seq_bounded"] or default is not None:
            return match.info["seq_size"]
    return default


def axis_parts(lab) -> list:
    """The parts of an axis label, most significant first: a plain label, a digit ``("%", base, stride,
    extent)`` (the axis holds ``base // stride % extent``: a head axis split into [kv heads, group]) or
    a composite (a tuple of those: one axis holding several logical ones, row-major)."""
    if isinstance(lab, tuple) and (not lab or lab[0] != "%"):
        return list(lab)
    return [lab]


def _part_extent(part, ext: dict) -> int:
    return part[3] if isinstance(part, tuple) else ext[part]


def _part_base(part) -> str:
    return part[1] if isinstance(part, tuple) else part


def _part_value(part, env: dict):
    if isinstance(part, tuple):
        return C.tirx.floormod(C.tirx.floordiv(env[part[1]], part[2]), part[3])
    return 0 if part == "1" else env[part]


def _index(op: Operand, env: dict, ext: dict) -> list:
    """Buffer indices of ``op`` for the logical index values ``env``."""
    out = []
    for lab in op.axes:
        idx = None
        for part in axis_parts(lab):
            v = _part_value(part, env)
            idx = v if idx is None else idx * _part_extent(part, ext) + v
        out.append(idx)
    return out


# the operand indexing shared with the CUDA template (schedules/cuda/attention.py)
def operand_index(op: Operand, env: dict, ext: dict) -> list:
    return _index(op, env, ext)


def part_extent(part, ext: dict):
    return _part_extent(part, ext)


def batch_env(spec: AttentionSpec, bidx) -> dict:
    return _batch_env(spec, bidx)


def unravel(flat, extents):
    return _unravel(flat, extents)


def _as_label(x):
    return tuple(_as_label(y) for y in x) if isinstance(x, list) else x


def _batch_env(spec: AttentionSpec, bidx) -> dict:
    return {f"b{k}": bidx[k] for k in range(len(spec.batch))}


# --------------------------------------------------------------------------- the unscheduled kernel
def reference_prim_func(spec: AttentionSpec) -> C.PrimFunc:
    """The attention as te stages (scores, logits, max, exp, sum, P @ V, output): the kernel before
    scheduling, correct on any target; ``Attention.apply`` replaces its body on CPUs."""
    spec.validate()
    te, tir = C.te, C.tirx
    nb = len(spec.batch)
    ext = spec.extents()
    ph = {name: te.placeholder(op.shape, op.dtype, name=name) for name, op in spec.inputs()}
    Q, K, V = ph["q"], ph["k"], ph["v"]
    rd = te.reduce_axis((0, spec.d), name="rd")

    def scores(*ix):
        env = _batch_env(spec, ix[:nb])
        return te.sum(Q[tuple(_index(spec.q, {**env, "i": ix[nb], "d": rd}, ext))]
                      * K[tuple(_index(spec.k, {**env, "j": ix[nb + 1], "d": rd}, ext))], axis=rd)

    shape_s = (*spec.batch, spec.sq, spec.sk)
    S = te.compute(shape_s, scores, name="attn_scores")
    neg_inf = tir.const(NEG_INF, "float32")

    def logits(*ix):
        x = S[ix] * tir.const(spec.scale, "float32")
        if spec.mask is not None:
            env = {**_batch_env(spec, ix[:nb]), "i": ix[nb], "j": ix[nb + 1]}
            x = x + ph["mask"][tuple(_index(spec.mask, env, ext))]
        if spec.causal_offset is not None:
            x = tir.Select(ix[nb + 1] > ix[nb] + spec.causal_offset, neg_inf, x)
        return x

    X = te.compute(shape_s, logits, name="attn_logits")
    rj = te.reduce_axis((0, spec.sk), name="rj")
    M = te.compute((*spec.batch, spec.sq), lambda *ix: te.max(X[(*ix, rj)], axis=rj), name="attn_max")
    E = te.compute(shape_s, lambda *ix: te.exp(X[ix] - M[ix[:-1]]), name="attn_exp")
    rs = te.reduce_axis((0, spec.sk), name="rs")
    L = te.compute((*spec.batch, spec.sq), lambda *ix: te.sum(E[(*ix, rs)], axis=rs), name="attn_sum")
    re = te.reduce_axis((0, spec.sk), name="re")

    def pv(*ix):
        env = {**_batch_env(spec, ix[:nb]), "j": re, "e": ix[nb + 1]}
        return te.sum(E[(*ix[:nb + 1], re)] * V[tuple(_index(spec.v, env, ext))], axis=re)

    O = te.compute((*spec.batch, spec.sq, spec.dv), pv, name="attn_pv")
    def out(*z):
        val_of = {}
        for lab, zi in zip(spec.out.axes, z):      # buffer index -> logical indices (composites: div/mod)
            subs = axis_parts(lab)
            rest = zi
            for sub in reversed(subs):
                n = ext[sub]
                val_of[sub] = tir.floormod(rest, n) if len(subs) > 1 else rest
                rest = tir.floordiv(rest, n) if len(subs) > 1 else rest
        bidx = [val_of[f"b{k}"] for k in range(nb)]
        i, e = val_of["i"], val_of["e"]
        val = O[(*bidx, i, e)] / L[(*bidx, i)]
        if spec.zero_empty_rows:     # all logits -inf: L is NaN (exp(-inf - -inf)); not > 0
            val = tir.Select(L[(*bidx, i)] > zero, val, zero)
        if spec.guard is not None:
            g = ph["guard"][tuple(_index(spec.guard, {**_batch_env(spec, bidx), "i": i}, ext))]
            val = tir.Select(g, tir.const(0.0, "float32"), val)
        return val

    zero = tir.const(0.0, "float32")
    Y = te.compute(spec.out.shape, out, name="attn_out")
    func = te.create_prim_func([ph[n] for n, _ in spec.inputs()] + [Y])
    if func.attrs is not None and "global_symbol" in func.attrs:
        func = func.without_attr("global_symbol")   # private: the module names it
    return func.with_attr({ATTR: spec.to_json(), RULE_ATTR: "attention", "op_pattern": 8})


# --------------------------------------------------------------------------- the CPU template
def sk_rows(spec: AttentionSpec, kb: int) -> int:
    """The rows of a task's packed K (and V): the static key length rounded up to whole key blocks."""
    return -(-static(spec.sk) // kb) * kb


def _unravel(flat, extents):
    """Indices of ``flat`` in a row-major index space of ``extents`` (outermost first)."""
    out, rest = [], flat
    for n in reversed(extents):
        unit = static(n) == 1
        out.append(0 if unit else C.tirx.floormod(rest, n))
        rest = rest if unit else C.tirx.floordiv(rest, n)
    return list(reversed(out))


def _param_shapes(func: C.PrimFunc) -> list[tuple]:
    """Each parameter's shape: ints, TIR expressions for symbolic extents."""
    return [tuple(int(d.value) if isinstance(d, C.IntImm) else d for d in C.tensor_shape(p)) for p in func.params]


def _rows_are_vectors(op: Operand, label: str, extent: int, lanes: int) -> bool:
    """Whether ``lanes`` consecutive values of ``label`` are consecutive elements of ``op`` (its last axis
    ends with the plain label) and the label's extent is a whole number of such vectors (> 1 lane)."""
    last = axis_parts(op.axes[-1])[-1]
    return lanes > 1 and last == label and extent % lanes == 0


def _transpose_vectors(rows: list, lanes: int) -> list:
    """The columns of a lanes x lanes block given as its row vectors, by log2(lanes) stages of two-vector
    shuffles: stage b swaps bit b of the row index with bit b of the lane index (for rows r0 < r1 = r0 | b,
    r0 takes the lanes of r1 whose index has bit b set and gives it its own such lanes)."""
    t = C.tirx
    vecs, b = list(rows), 1
    while b < lanes:
        nxt = list(vecs)
        for r0 in range(lanes):
            if r0 & b:
                continue
            r1 = r0 | b
            lo = [c if not c & b else lanes + c - b for c in range(lanes)]
            hi = [c + b if not c & b else lanes + c for c in range(lanes)]
            nxt[r0] = t.Shuffle([vecs[r0], vecs[r1]], [t.const(x, "int32") for x in lo])
            nxt[r1] = t.Shuffle([vecs[r0], vecs[r1]], [t.const(x, "int32") for x in hi])
        vecs, b = nxt, b * 2
    return vecs


@contextlib.contextmanager
def _vector_tiles(T, extent: int, lanes: int):
    """Like ``_vector_loop`` with the loop over the vectors unrolled (register tiles: each element's
    address is fixed in the unrolled body); yields the element index."""
    if extent % lanes == 0 and extent > lanes:
        with T.unroll(0, extent // lanes) as o:
            with T.vectorized(0, lanes) as v:
                yield o * lanes + v
    else:
        with _vector_loop(T, extent, lanes) as v:
            yield v


@contextlib.contextmanager
def _vector_loop(T, extent: int, lanes: int):
    """A loop over ``extent`` elements, vectorized by ``lanes`` where they divide it (else one vector of
    ``extent`` lanes when it is short, else a serial loop); yields the element index."""
    if extent % lanes == 0 and extent > lanes:
        with T.serial(0, extent // lanes) as o:
            with T.vectorized(0, lanes) as v:
                yield o * lanes + v
    elif extent <= 2 * lanes:
        with T.vectorized(0, extent) as v:
            yield v
    else:
        with T.serial(0, extent) as v:
            yield v


@dataclass(frozen=True)
class AttentionConfig(Config):
    """The knobs of the CPU attention kernel (choices and defaults from the target: ``cpu_info``)."""

    q_block: int = knob("query rows per parallel task, a multiple of the vector width (the rows are the "
                        "vector axis of the scores); 1: the row nest of the small-sequence bucket (one query "
                        "row per task, each score a dot product over the head dim)")
    k_block: int = knob("keys per online-softmax step")
    lanes: int = knob("float32 lanes per vector (target)")
    rows: int = knob("query rows whose P @ V accumulators are in registers together")
    tile_keys: int = knob("keys of a score register tile")
    tile_qvecs: int = knob("row vectors of a score register tile (at most q_block / lanes)")
    # before=: the kernel built before the knob existed (a tuning record of then lacks it; schedules'
    # _with_new_knobs gives it this value, the behaviour it was measured with, not today's default)
    q_blocks: int = knob("query blocks per parallel task (one after the other, sharing the task's packed K/V)",
                         before=1)
    pack_kv: int = knob("1: each task first copies the K and V rows it reads into contiguous local rows "
                        "(static key length only); 0: K and V are read in place", before=0)
    prefetch: int = knob("software prefetches into L2 during each key block (static sequence only): 0 none; "
                         "1 the next query block's Q rows and this block's output rows; 2 also the next "
                         "task's K and V rows (packed K/V)", before=0)
    exp2: int = knob("1: the softmax's exps as powers of 2 (2^(x log2(e) - m log2(e)), the offset rounded up "
                     "and shared with the rescale factors: tvmfuse.fastmath's exp2 of arguments <= 0, no ln 2 "
                     "reduction); 0: e^(x - m)", before=0)
    serial_work: int = knob("the row nest (q_block 1) runs its (batch x heads x rows) loop serial when the "
                            "kernel's multiply-adds at run time are fewer than this (the target's fork/join "
                            "cost); 0: always parallel", before=0)


class Attention(Template):
    family = "cpu.attention"
    target_kinds = ("llvm",)
    config_type = AttentionConfig

    def match(self, func: C.PrimFunc, target: C.Target) -> Match | None:
        if func.attrs is None or ATTR not in func.attrs:
            return None
        spec = AttentionSpec.from_json(str(func.attrs[ATTR]))
        shapes = _param_shapes(func)
        symbols = {str(d.name): d for shape in shapes for d in shape if isinstance(d, C.tirx.Var)}
        try:
            spec = spec.bind(symbols)
        except KeyError:
            return None      # a symbol of the spec is no extent of the kernel's buffers
        want = [op.shape for _, op in spec.inputs()] + [spec.out.shape]
        if len(shapes) != len(want) or not all(
                len(a) == len(b) and all(same_extent(x, y) for x, y in zip(a, b)) for a, b in zip(shapes, want)):
            return None      # not the kernel the spec describes (another pass changed its signature)
        return Match(self.family, {"spec": spec})

    # Step 0. The knob space: rows per task, keys per block, rows per register group.
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        spec = match.info["spec"]
        lanes = cpu_info(target).float32_lanes
        if match.info.get("row_nest"):
            return AttentionConfig.space(q_block=(1,), k_block=_row_key_blocks(spec, match, lanes), lanes=(lanes,),
                                         rows=(1,), tile_keys=(1,), tile_qvecs=(1,), q_blocks=(1,), pack_kv=(0,),
                                         prefetch=(0,), exp2=(0,), serial_work=(U.min_parallel_work(target), 0))
        sq, sk = _size(spec.sq, match, None), _size(spec.sk, match, None)   # None: any block may serve
        qb = tuple(lanes * v for v in Q_BLOCK_VECTORS if v == 1 or sq is None or lanes * v < 2 * sq)
        kb = tuple(lanes * v for v in K_BLOCK_VECTORS if v == 1 or sk is None or lanes * v < 2 * sk)
        # several query blocks per task, and the packed K/V rows they share: a static sequence only (the
        # packed rows are a local buffer of the key length)
        static_seq = static(spec.sq) is not None and static(spec.sk) is not None
        qbs = tuple(v for v in Q_TASK_BLOCKS if v == 1 or static_seq and v * lanes < 2 * static(spec.sq))
        return AttentionConfig.space(q_block=qb, k_block=kb, lanes=(lanes,), rows=ROW_GROUPS,
                                     tile_keys=TILE_KEYS, tile_qvecs=TILE_QVECS, q_blocks=qbs,
                                     pack_kv=(0, 1) if static_seq else (0,),
                                     prefetch=(0, 1, 2) if static_seq else (0,), exp2=(0, 1), serial_work=(0,))

    def default_config(self, match: Match, target: C.Target) -> dict:
        spec, info = match.info["spec"], cpu_info(target)
        table = template_defaults(target, self.family)
        space = {k.name: k.choices for k in self.space(match, target).knobs}
        if match.info.get("row_nest"):
            # the row nest: every choice is single but the key block (the largest: one block where the
            # bucket bounds the keys) and the serial threshold (the target's fork/join cost)
            return {name: choices[-1] if name == "k_block" else choices[0] for name, choices in space.items()}
        blocks = self._blocks(spec, match, target, table, space, info, in_place=False)
        share_in_place = table.get("l1_share_kv_in_place")
        if not blocks["pack"] and spec.causal_offset is None and share_in_place is not None:
            # K/V read in place (rows heads x dim apart, in few cache sets): the in-place share of L1
            blocks = self._blocks(spec, match, target, table, space, info, in_place=True)
        kb, qb, rows, keys, qvecs = blocks["kb"], blocks["qb"], blocks["rows"], blocks["keys"], blocks["qvecs"]
        pack, q_blocks, lanes = blocks["pack"], blocks["q_blocks"], info.float32_lanes
        # software prefetch (the target table's "prefetch" level, where the sequence is static): the rows
        # the next query block reads and this one writes; with packed K/V, the next task's K/V rows too
        # where both tasks' rows fit the L2 share (else they would evict the rows being read)
        prefetch = 0
        if 1 in space["prefetch"]:
            prefetch = min(int(table["prefetch"]), 2)
            both = 2 * sk_rows(spec, kb) * (spec.d + spec.dv) * 4 <= table["l2_share_kv"] * info.l2_bytes
            if prefetch == 2 and not (pack and both):
                prefetch = 1
        return AttentionConfig(q_block=qb, k_block=kb, lanes=lanes, rows=rows, tile_keys=keys,
                               tile_qvecs=qvecs, q_blocks=q_blocks, pack_kv=pack, prefetch=prefetch,
                               exp2=int(table["exp2"]), serial_work=0).asdict()

    @staticmethod
    def _blocks(spec, match: Match, target: C.Target, table: dict, space: dict, info, in_place: bool) -> dict:
        """The default blocks, register tiles and K/V packing (``default_config``); ``in_place``: the key
        block from the table's ``l1_share_kv_in_place`` and no packing (K/V rows read where they are)."""
        # the K tile and the V rows of one key block in a share of L1 (a causal kernel's own share: its
        # query block is at most its key block or a small share of the sequence, see below)
        kv_share = table["l1_share_kv" if spec.causal_offset is None else "causal_l1_share_kv"]
        if in_place:
            kv_share = table["l1_share_kv_in_place"]
        kb = space["k_block"][0]
        for c in space["k_block"]:
            if (spec.d + spec.dv) * c * 4 <= kv_share * info.l1d_bytes:
                kb = c
        # query rows: transposed queries + accumulators + scores in a share of L1, enough tasks for every
        # core, and (causal) a small share of the sequence; a symbolic extent is taken at its hint
        tasks_rows = max(1, math.prod(_hint(n, SYMBOLIC_BATCH_HINT) for n in spec.batch))
        sq = _size(spec.sq, match, SYMBOLIC_SEQ_HINT)
        qb = space["q_block"][0]
        for c in space["q_block"]:
            fits = c * (spec.d + spec.dv + kb + 5) * 4 <= table["l1_share_query_block"] * info.l1d_bytes
            tasks = tasks_rows * math.ceil(sq / c)
            causal_ok = spec.causal_offset is None or c <= max(kb, table["causal_q_block_share"] * sq)
            if fits and causal_ok and tasks >= table["min_tasks_per_core"] * info.cores:
                qb = c
        # register tiles within the registers' accumulator share: P @ V rows (dv / lanes vectors each),
        # scores (keys x row vectors)
        lanes = info.float32_lanes
        registers = VECTOR_REGISTERS.get(info.vector_bits, min(VECTOR_REGISTERS.values()))
        budget = table["acc_register_share"] * registers
        per_row = -(-spec.dv // lanes)
        rows = max([r for r in ROW_GROUPS if r * per_row <= budget and qb % r == 0] or [1])
        # scores: of the tiles within the budget, the fewest loads per multiply-add (a tile of k keys x v
        # row vectors loads k broadcasts and v vectors for k * v FMAs; measured kernel-only under load,
        # AVX-512, S=512: 4 x 4 1.04-1.08x faster than 8 x 2), ties to more keys
        tiles = [(k, v) for k in TILE_KEYS for v in TILE_QVECS
                 if k * v <= budget and kb % k == 0 and (qb // lanes) % v == 0]
        keys, qvecs = min(tiles, key=lambda kv: ((kv[0] + kv[1]) / (kv[0] * kv[1]), -kv[0]),
                          default=(TILE_KEYS[0], 1))
        # packed K/V: the task's rows in a share of L2, copied once for as many query blocks as leave
        # enough tasks for every core (a task of one query block: no packing, it would copy as much as it
        # reads)
        pack, q_blocks = 0, 1
        if not in_place and 1 in space["pack_kv"] and \
                sk_rows(spec, kb) * (spec.d + spec.dv) * 4 <= table["l2_share_kv"] * info.l2_bytes:
            nqb = math.ceil(static(spec.sq) / qb)
            for c in space["q_blocks"]:
                if c <= nqb and tasks_rows * math.ceil(nqb / c) >= table["min_tasks_per_core"] * info.cores:
                    q_blocks = c
            # a task of one query block would copy as much as it reads; below the table's
            # pack_kv_min_q_blocks the copy costs more than it saves
            pack = int(q_blocks > 1 and q_blocks >= table["pack_kv_min_q_blocks"])
            if not pack:
                q_blocks = 1
        return {"kb": kb, "qb": qb, "rows": rows, "keys": keys, "qvecs": qvecs, "pack": pack, "q_blocks": q_blocks}

    # ------------------------------------------------------------------ size buckets (symbolic sequence)
    def buckets(self, match: Match, target: C.Target) -> tuple[Bucket, ...]:
        """A symbolic query (else key) sequence: the row nest's bucket (sequences up to the target table's
        ``row_nest_max_seq``, ``ROW_BUCKET``), one nest per ``SEQ_BUCKETS`` bound and one open nest; a static
        sequence: none (one nest)."""
        if _seq_symbol(match.info["spec"]) is None:
            return ()
        small = int(template_defaults(target, self.family)["row_nest_max_seq"])
        rows = (Bucket(f"{ROW_BUCKET}<={small}", small),) if small >= 1 else ()
        return (*rows, *(Bucket(f"seq<={b}", b) for b in SEQ_BUCKETS if b > small),
                Bucket(f"seq>{SEQ_BUCKETS[-1]}", None))

    def bucket_match(self, match: Match, bucket: Bucket) -> Match:
        """The bucket's sequence size: its bound, or ``SYMBOLIC_OPEN_HINT`` for the open one (``_size``);
        the row nest's bucket says so (``row_nest``)."""
        size = bucket.max_extent if bucket.max_extent is not None else SYMBOLIC_OPEN_HINT
        return Match(self.family, {**match.info, "bucket": bucket.name, "seq_size": size,
                                   "seq_bounded": bucket.max_extent is not None,
                                   "row_nest": bucket.name.startswith(ROW_BUCKET)})

    def dispatch_extent(self, match: Match):
        return _seq_symbol(match.info["spec"])

    def bucket_sizes(self, match: Match, bucket: Bucket, target: C.Target) -> dict[str, int]:
        """The shape variables a tuner binds to measure ``bucket``'s nest: the sequence at the bucket's
        size, every other symbol (batch) at 1."""
        spec, bm = match.info["spec"], self.bucket_match(match, bucket)
        seq = _seq_symbol(spec)
        return {name: (bm.info["seq_size"] if same_extent(var, seq) else 1)
                for name, var in spec.symbols().items()}

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        spec = match.info["spec"]
        root = sch.get_sblock("root")
        func = sch.mod["main"]
        # Step 1. The online-softmax loop nest for this configuration, over the kernel's own buffers.
        cfg = AttentionConfig.from_dict(config)
        qb, kb, lanes = cfg.q_block, cfg.k_block, cfg.lanes
        seq_bound = match.info["seq_size"] if match.info.get("seq_bounded") else None
        if qb == 1:      # the row nest (the small-sequence bucket's)
            new_root = _row_root(spec, list(func.params), kb, lanes, seq_bound, cfg.serial_work)
            old = sch.get(root)
            sch.state.replace(sch.get_sref(root), new_root, {old: new_root})
            return
        if cfg.serial_work:
            raise ValueError("cpu.attention: serial_work is a knob of the row nest (q_block 1) only")
        # the register tiles divide the blocks (every choice is a power of two)
        rows = math.gcd(cfg.rows, qb)
        tile_keys, tile_qvecs = math.gcd(cfg.tile_keys, kb), math.gcd(cfg.tile_qvecs, qb // lanes)
        if cfg.pack_kv and static(spec.sk) is None:
            raise ValueError("cpu.attention: pack_kv needs a static key length (its rows are a local buffer)")
        if cfg.prefetch and (static(spec.sk) is None or static(spec.sq) is None):
            raise ValueError("cpu.attention: prefetch needs a static sequence (its rows per key block are static)")
        # a bounded size bucket's nest runs only for sequences up to its bound (schedules.buckets)
        new_root = _flash_root(spec, list(func.params), qb, kb, lanes, rows, tile_keys, tile_qvecs,
                               cfg.q_blocks, bool(cfg.pack_kv), seq_bound, cfg.prefetch, bool(cfg.exp2))
        # Step 2. It replaces the reference stages (scores, softmax, P @ V) wholesale.
        old = sch.get(root)
        sch.state.replace(sch.get_sref(root), new_root, {old: new_root})


def _block_count(spec: AttentionSpec, n, block: int, seq_bound: int | None):
    """Blocks of ``block`` rows over the extent ``n``: 1, a static count, where ``n`` is the sequence the
    size buckets dispatch on and the nest's bucket bounds it by ``block`` (BERT at 17 in seq<=32: one query
    and one key block, as in the static kernel, instead of loops over run-time counts that are 1)."""
    if seq_bound is not None and static(n) is None and seq_bound <= block and \
            same_extent(n, _seq_symbol(spec)):
        return 1
    return _ceil_div(n, block)


def _flash_root(spec: AttentionSpec, params: list, qb: int, kb: int, lanes: int, rows: int,
                tile_keys: int, tile_qvecs: int, q_blocks: int = 1, pack_kv: bool = False,
                seq_bound: int | None = None, prefetch: int = 0, exp2: bool = False):
    """The root block of the online-softmax kernel (see the module docstring).

    The scores are computed transposed, ``sT[key, query row]``, a vector over the query rows: the query
    block is transposed once per task (``qT[d, qb]``) and K is read in place (a broadcast of one element per
    key and head-dim step), so no K tile is packed per key block; the running max, sum and rescale
    factors are vectors over the rows (no horizontal reductions).  Register tiles: the scores of
    ``tile_keys`` keys x ``tile_qvecs`` row vectors (summed over the head dim), the accumulators of
    ``rows`` rows x dv / lanes vectors (summed over the keys; each V vector loaded once for the rows):
    their loops are unrolled, so each element has a fixed address there and LLVM keeps it in a register.
    """
    T, IRBuilder, tir = C.tir_builder, C.IRBuilder, C.tirx
    names = [n for n, _ in spec.inputs()] + ["out"]
    buf = dict(zip(names, params))
    f32 = "float32"
    nb_total = math.prod(spec.batch) if spec.batch else 1
    nqb, nkb = _block_count(spec, spec.sq, qb, seq_bound), _block_count(spec, spec.sk, kb, seq_bound)
    ntq = _ceil_div(nqb, q_blocks)      # parallel tasks per batch index
    # A symbolic sequence: the last query block computes only the row groups that hold existing rows (a
    # static one clamps its rows past the end to the last row).  The unit: the larger of a score tile's
    # rows and a P @ V row group (powers of two that divide qb), so every loop below covers whole units.
    # A unit of the whole block (every bucket's default on AVX-512 up to 128 rows, BERT's seq<=32: 32 rows
    # in score tiles of 2 x 16) always holds an existing row: the counts are then static, as in the
    # static kernel, instead of run-time expressions of the sequence that always equal them.
    unit = max(tile_qvecs * lanes, rows)
    q_tail = static(spec.sq) is None and unit < qb
    # keys past the end exist in the last key block only where the block does not divide the keys
    key_tail = static(spec.sk) is None or static(spec.sk) % kb != 0
    scale = tir.const(spec.scale, f32)
    neg_inf, zero = tir.const(NEG_INF, f32), tir.const(0.0, f32)
    ext = spec.extents()
    # exp2: log2(e), and the margin that rounds m log2(e) up: |m| log2(e) 2^-22 exceeds the product's rounding
    # error (2^-24 relative) and the sum's
    log2e, log2e_up = tir.const(LOG2E, f32), tir.const(LOG2E * 2.0 ** -22, f32)

    def load(name, op, env):
        return buf[name][tuple(_index(op, env, ext))]

    def prefetch_rows(name, op, env, row, first, count, limit, feat, n_feat, write):
        """Prefetch (into L2) ``count`` rows of ``op`` from row ``first`` (clamped to the last row below
        ``limit``), one prefetch per cache line of each row's ``n_feat`` features; none where the features
        are not the operand's contiguous last axis (a prefetch per element would cost more than it saves)."""
        if axis_parts(op.axes[-1])[-1] != feat:
            return
        with T.serial(0, count) as r:
            env_r = {**env, row: tir.min(first + r, limit - 1)}
            for f in range(0, n_feat, LINE_FLOATS):
                addr = tir.address_of(tir.BufferLoad(buf[name], _index(op, {**env_r, feat: f}, ext)))
                T.evaluate(tir.call_intrin("void", "tirx.prefetch", addr, int(write), PREFETCH_LOCALITY, 1))

    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            for n in names:
                T.arg(n, buf[n])
            with T.parallel(0, nb_total * ntq) as task:
                with T.sblock("attention_flash"):
                    t = T.axis.spatial(nb_total * ntq, task)
                    T.reads(*[buf[n][tuple(slice(0, s) for s in op.shape)] for n, op in spec.inputs()])
                    T.writes(buf["out"][tuple(slice(0, s) for s in spec.out.shape)])
                    m = T.sblock_alloc_buffer((qb,), f32, scope=BUFFER_SCOPE)       # running max
                    mn = T.sblock_alloc_buffer((qb,), f32, scope=BUFFER_SCOPE)      # the block's new max
                    sf = T.sblock_alloc_buffer((qb,), f32, scope=BUFFER_SCOPE)      # new max, 0 for -inf
                    al = T.sblock_alloc_buffer((qb,), f32, scope=BUFFER_SCOPE)      # rescale factor
                    if exp2:     # the previous key block's base-2 offset (its max x log2(e), rounded up)
                        ml = T.sblock_alloc_buffer((qb,), f32, scope=BUFFER_SCOPE)
                    lsum = T.sblock_alloc_buffer((qb,), f32, scope=BUFFER_SCOPE)
                    acc = T.sblock_alloc_buffer((qb, spec.dv), f32, scope=BUFFER_SCOPE)
                    st = T.sblock_alloc_buffer((kb, qb), f32, scope=BUFFER_SCOPE)
                    qt = T.sblock_alloc_buffer((spec.d, qb), f32, scope=BUFFER_SCOPE)
                    if pack_kv:      # the task's K and V rows, contiguous (key blocks past the end: padded)
                        kp = T.sblock_alloc_buffer((nkb * kb, spec.d), f32, scope=BUFFER_SCOPE)
                        vp = T.sblock_alloc_buffer((nkb * kb, spec.dv), f32, scope=BUFFER_SCOPE)
                    bidx = _unravel(tir.floordiv(t, ntq), list(spec.batch)) if spec.batch else []
                    benv = _batch_env(spec, bidx)
                    tq = tir.floormod(t, ntq)           # the task's first query block: tq * q_blocks

                    def key_blocks(q0):
                        """The key blocks the rows from q0 see (a causal kernel stops after the last one
                        its rows can see)."""
                        if spec.causal_offset is None:
                            return nkb
                        last_key = q0 + (qb - 1) + spec.causal_offset
                        return tir.max(tir.min(tir.floordiv(last_key, kb) + 1, nkb), 0)

                    # Step 0. Packing: every K and V row the task's query blocks see, copied once into
                    # contiguous rows (in place, rows of heads-interleaved tensors are heads x dim apart and
                    # fall into few cache sets); the query blocks then read them from L2/L1.
                    if pack_kv:
                        last_q0 = tir.min(tq * q_blocks + (q_blocks - 1), nqb - 1) * qb
                        with T.serial(0, key_blocks(last_q0) * kb) as j:
                            for dst, name, op, feat, n in ((kp, "k", spec.k, "d", spec.d),
                                                           (vp, "v", spec.v, "e", spec.dv)):
                                with _vector_loop(T, n, lanes) as f:
                                    T.buffer_store(dst, load(name, op, {**benv, "j": tir.min(j, spec.sk - 1),
                                                                        feat: f}), [j, f])

                    # prefetches per row of score tiles: a query block's rows spread over its key blocks' tile
                    # rows, the next task's K/V rows over all the task's
                    if prefetch:
                        steps = static(nkb) * (kb // tile_keys)    # score-tile rows per query block
                        rows_pk = -(-qb // steps)
                        kv_pk = -(-static(spec.sk) // (q_blocks * steps))
                    if prefetch >= 2:
                        t_next = tir.min(t + 1, nb_total * ntq - 1)
                        benv_next = _batch_env(spec, _unravel(tir.floordiv(t_next, ntq), list(spec.batch))
                                               if spec.batch else [])

                    def block_body(q0, qblk=0, full=False):
                        """One query block: rows q0 .. q0 + qb - 1 (the task's ``qblk``-th); ``full``: every
                        row exists (a symbolic sequence's blocks before its last), so no row index is
                        clamped to the last row and no row is tested against the sequence."""
                        def row(i):       # a query row's index for the loads: clamped where it may not exist
                            return i if full else tir.min(i, spec.sq - 1)

                        if q_tail and not full:
                            live = tir.floordiv(tir.min(qb, spec.sq - q0) + (unit - 1), unit) * unit

                            def n_groups(size):      # groups of `size` rows that hold existing rows
                                return tir.floordiv(live, size)
                        else:
                            def n_groups(size):
                                return qb // size
                        # Step 1. The query block, transposed and scaled (the logits' scale folded into Q);
                        # running max, sum and accumulator per row.
                        if _rows_are_vectors(spec.q, "d", spec.d, lanes):
                            # lanes x lanes blocks: row vectors of Q in, transposed by shuffles in registers
                            with T.serial(0, qb // lanes) as qo:
                                with T.serial(0, spec.d // lanes) as do:
                                    rows_in = []
                                    for r in range(lanes):
                                        idx = _index(spec.q, {**benv, "i": row(q0 + qo * lanes + r),
                                                              "d": do * lanes}, ext)
                                        idx[-1] = tir.Ramp(idx[-1], 1, lanes)
                                        rows_in.append(tir.BufferLoad(buf["q"], idx))
                                    for c, col in enumerate(_transpose_vectors(rows_in, lanes)):
                                        T.buffer_store(qt, col * tir.Broadcast(scale, lanes),
                                                       [do * lanes + c, tir.Ramp(qo * lanes, 1, lanes)])
                        else:
                            with T.serial(0, spec.d) as dd:
                                with _vector_loop(T, qb, lanes) as qi:
                                    T.buffer_store(qt, load("q", spec.q, {**benv, "i": row(q0 + qi),
                                                                           "d": dd}) * scale, [dd, qi])
                        with _vector_loop(T, qb, lanes) as qi:
                            T.buffer_store(m, neg_inf, [qi])
                            if exp2:
                                T.buffer_store(ml, neg_inf, [qi])
                            T.buffer_store(lsum, zero, [qi])
                        with T.serial(0, qb) as qi:
                            with _vector_loop(T, spec.dv, lanes) as e:
                                T.buffer_store(acc, zero, [qi, e])
                        if q_tail and not full:
                            # The score tile's last column, written once: the live row groups touch only
                            # columns below a run-time bound, and TVM's CompactBufferAllocation shrank the
                            # tile to it (a run-time sized stack buffer with a run-time row stride: qwen2_dyn's
                            # kernel at 17 rows 1.8x its static one, one thread).  This store keeps the tile
                            # [kb, qb] (it is overwritten before any read where that row exists).
                            T.buffer_store(st, zero, [0, qb - 1])
                        # Step 2. Key blocks; a causal kernel stops after the last block its rows can see.
                        with T.serial(0, key_blocks(q0)) as ko:
                            j0 = ko * kb
                            # Step 2a. Scores, tile by tile (registers): sT[key, rows] += K[key, d] * qT[d, rows];
                            # then, still in registers, the logits (mask; -inf past the last key and above the
                            # diagonal) and the block's running max, vectors over the rows.
                            with _vector_loop(T, qb, lanes) as qi:
                                T.buffer_store(mn, m[qi], [qi])
                            with T.serial(0, kb // tile_keys) as kg:
                                if prefetch:    # rows a later step reads (Q, K/V) or writes (out), into L2,
                                    step = ko * (kb // tile_keys) + kg     # a few per score tile row
                                    last = tir.min(q0 + 2 * qb, spec.sq)
                                    prefetch_rows("q", spec.q, benv, "i", q0 + qb + step * rows_pk, rows_pk, last,
                                                  "d", spec.d, False)
                                    prefetch_rows("out", spec.out, benv, "i", q0 + step * rows_pk, rows_pk,
                                                  tir.min(q0 + qb, spec.sq), "e", spec.dv, True)
                                if prefetch >= 2:
                                    first = (qblk * static(nkb) * (kb // tile_keys) + step) * kv_pk
                                    prefetch_rows("k", spec.k, benv_next, "j", first, kv_pk, spec.sk, "d", spec.d, False)
                                    prefetch_rows("v", spec.v, benv_next, "j", first, kv_pk, spec.sk, "e", spec.dv, False)
                                with T.serial(0, n_groups(tile_qvecs * lanes)) as qg:
                                    # the first head-dim step stores the products (no zero-fill of the tile)
                                    def tile_step(dd, first):
                                        with T.unroll(0, tile_keys) as kk:
                                            jj = kg * tile_keys + kk
                                            kv = (kp[j0 + jj, dd] if pack_kv else
                                                  load("k", spec.k, {**benv, "j": tir.min(j0 + jj, spec.sk - 1), "d": dd}))
                                            with _vector_tiles(T, tile_qvecs * lanes, lanes) as qq:
                                                qi = qg * tile_qvecs * lanes + qq
                                                prod = kv * qt[dd, qi]
                                                T.buffer_store(st, prod if first else st[jj, qi] + prod, [jj, qi])

                                    tile_step(0, True)
                                    if spec.d > 1:
                                        with T.serial(1, spec.d) as dd:
                                            tile_step(dd, False)
                                    with T.unroll(0, tile_keys) as kk:
                                        with _vector_tiles(T, tile_qvecs * lanes, lanes) as qq:
                                            jj = kg * tile_keys + kk
                                            qi = qg * tile_qvecs * lanes + qq
                                            x = st[jj, qi]
                                            j = j0 + jj
                                            ic = row(q0 + qi)
                                            if spec.mask is not None:
                                                x = x + load("mask", spec.mask,
                                                             {**benv, "i": ic, "j": tir.min(j, spec.sk - 1)})
                                            valid = j < spec.sk if key_tail else None
                                            if spec.causal_offset is not None:
                                                below = j <= ic + spec.causal_offset
                                                valid = below if valid is None else tir.And(valid, below)
                                            if valid is not None:
                                                x = tir.Select(valid, x, neg_inf)
                                            T.buffer_store(st, x, [jj, qi])
                                            T.buffer_store(mn, tir.max(mn[qi], st[jj, qi]), [qi])   # (read back)
                            with T.serial(0, n_groups(lanes)) as qvec:
                                # Step 2c. Rescale factors (a max of -inf stays -inf: the exps use 0), the
                                # probabilities and the rescaled sums.  Every exp's argument is <= 0 (a score or
                                # the old max minus the new max); min(., 0) says so to tvmfuse.fastmath, which
                                # then takes its cheaper exp.
                                # exp2: base 2, e^(x - m) = 2^(x log2(e) - m'), m' = m log2(e) rounded up (so
                                # every argument stays <= 0) and kept per block (ml): the rescale factors use
                                # the offsets the exps used, so m''s rounding scales the sums and accumulators
                                # alike and cancels in acc / sum; x log2(e) - m' is one multiply-add.
                                with T.vectorized(0, lanes) as ln:
                                    qi = qvec * lanes + ln
                                    new = tir.Select(mn[qi] == neg_inf, zero, mn[qi])
                                    if exp2:
                                        new = new * log2e + tir.abs(new) * log2e_up
                                        T.buffer_store(sf, new, [qi])
                                        T.buffer_store(al, tir.exp2(tir.min(ml[qi] - sf[qi], zero)), [qi])
                                        T.buffer_store(ml, sf[qi], [qi])
                                    else:
                                        T.buffer_store(sf, new, [qi])
                                        T.buffer_store(al, tir.exp(tir.min(m[qi] - sf[qi], zero)), [qi])
                                    T.buffer_store(lsum, lsum[qi] * al[qi], [qi])
                                    T.buffer_store(m, mn[qi], [qi])
                                with T.serial(0, kb) as jj:
                                    with T.vectorized(0, lanes) as ln:
                                        qi = qvec * lanes + ln
                                        p = tir.exp2(tir.min(st[jj, qi] * log2e - sf[qi], zero)) if exp2 else \
                                            tir.exp(tir.min(st[jj, qi] - sf[qi], zero))
                                        T.buffer_store(st, p, [jj, qi])
                                        T.buffer_store(lsum, lsum[qi] + st[jj, qi], [qi])
                            # Step 2d. acc = acc * alpha + p @ V[block], `rows` rows at a time (registers);
                            # the first key's step rescales (acc * alpha + p * V: no pass of its own over
                            # the accumulators, which would load and store them once more per key block).
                            with T.serial(0, n_groups(rows)) as g:
                                def pv_step(jj, first):
                                    jc = tir.min(j0 + jj, spec.sk - 1)
                                    with T.unroll(0, rows) as r:
                                        qi = g * rows + r
                                        with _vector_tiles(T, spec.dv, lanes) as e:
                                            vv = vp[j0 + jj, e] if pack_kv else load("v", spec.v, {**benv, "j": jc, "e": e})
                                            old = acc[qi, e] * al[qi] if first else acc[qi, e]
                                            T.buffer_store(acc, old + st[jj, qi] * vv, [qi, e])

                                pv_step(0, True)
                                if kb > 1:
                                    with T.serial(1, kb) as jj:
                                        pv_step(jj, False)
                        # Step 3. Normalize and store the rows of this block that exist: one division per
                        # row (1 / sum, a vector over the rows, into the rescale factors' buffer), then
                        # products (0 * inf = NaN keeps a row without weight NaN, as acc / 0 does).
                        with _vector_loop(T, qb, lanes) as qi:
                            T.buffer_store(al, tir.const(1.0, f32) / lsum[qi], [qi])
                        def store_row(qi, i):
                            total = lsum[qi]
                            with _vector_loop(T, spec.dv, lanes) as e:
                                val = acc[qi, e] * al[qi]
                                if spec.zero_empty_rows:     # no key seen: the sum stayed 0
                                    val = tir.Select(total > zero, val, zero)
                                if spec.guard is not None:
                                    g = load("guard", spec.guard, {**benv, "i": i})
                                    val = tir.Select(g, zero, val)
                                T.buffer_store(buf["out"], val, _index(spec.out, {**benv, "i": i, "e": e}, ext))

                        with T.serial(0, qb) as qi:
                            if full:
                                store_row(qi, q0 + qi)
                            else:
                                with T.If(q0 + qi < spec.sq):
                                    with T.Then():
                                        store_row(qi, q0 + qi)

                    def query_block(q0, qblk=0):
                        """A query block; over a symbolic sequence of more than one block, the blocks whose rows
                        all exist take a nest without the row clamps (each lane of a mask read or a Q transpose
                        clamped to the last row made albert_dyn's attention 1.33x its static kernel at sequence
                        128, kernel-only, one thread, under load; notes/albert14.md), the last block the
                        clamped one."""
                        if static(spec.sq) is None and static(nqb) != 1:
                            with T.If(q0 + qb <= spec.sq):
                                with T.Then():
                                    block_body(q0, qblk, full=True)
                                with T.Else():
                                    block_body(q0, qblk)
                        else:
                            block_body(q0, qblk)

                    if q_blocks == 1:
                        query_block(tq * qb)
                    else:
                        with T.serial(0, q_blocks) as qblk:
                            qbi = tq * q_blocks + qblk
                            if static(nqb) is not None and static(nqb) % q_blocks == 0:
                                query_block(qbi * qb, qblk)
                            else:
                                with T.If(qbi < nqb):
                                    with T.Then():
                                        query_block(qbi * qb, qblk)
    return ib.get().body.block


# --------------------------------------------------------------------------- the row nest (small sequences)
def _row_key_blocks(spec: AttentionSpec, match: Match, lanes: int) -> tuple:
    """The row nest's key block choices: where the bucket bounds the keys (the dispatch symbol is the key
    length), one block of the bound (every key of a row in one softmax step); else the vector multiples
    ``K_BLOCK_VECTORS`` (a static key length: those under twice it)."""
    if match.info.get("seq_bounded") and static(spec.sk) is None and same_extent(spec.sk, _seq_symbol(spec)):
        return (int(match.info["seq_size"]),)
    sk = static(spec.sk)
    return tuple(lanes * v for v in K_BLOCK_VECTORS if v == 1 or sk is None or lanes * v < 2 * sk)


def _dot_width(d: int, lanes: int) -> int:
    """The vector width of the row nest's dot products: the largest power of two up to ``lanes`` that
    divides the head dim (1: scalar)."""
    w = 1
    while 2 * w <= lanes and d % (2 * w) == 0:
        w *= 2
    return w


def _lane_sum(vec, width: int):
    """The sum of a ``width``-lane vector expression by halving shuffles (log2(width) adds)."""
    t = C.tirx
    n = width
    while n > 1:
        h = n // 2
        lo = t.Shuffle([vec], [t.const(x, "int32") for x in range(h)])
        hi = t.Shuffle([vec], [t.const(x, "int32") for x in range(h, n)])
        vec, n = lo + hi, h
    return vec


@contextlib.contextmanager
def _lanes(T, width: int):
    """A vectorized loop of ``width`` lanes (yields its index), or the index 0 for one lane."""
    if width > 1:
        with T.vectorized(0, width) as ln:
            yield ln
    else:
        yield 0


def _int64(n):
    return C.tirx.const(n, "int64") if isinstance(n, int) else C.tirx.Cast("int64", n)


def _row_root(spec: AttentionSpec, params: list, kb: int, lanes: int, seq_bound: int | None,
              serial_work: int):
    """The root block of the row nest: one task per (batch, heads, query row), for the small-sequence bucket
    (``ROW_BUCKET``), where the block nest's query block of a vector of rows computes mostly rows past the
    end.  Per row: for each block of ``kb`` keys (the row's visible keys: a causal row stops at its
    diagonal, so no key is masked), the scores as dot products over the head dim (``_dot_width`` lanes of
    products, summed by halving shuffles) into a row of ``kb`` scores, their max, the exps and the P @ V
    multiply-adds as vectors over the value dim; the online softmax rescales between blocks.  Where the
    bucket bounds the keys by ``kb`` the block loop is a single block.  With ``serial_work`` > 0 the task
    loop is serial when the kernel's multiply-adds (rows x keys x (d + dv)) are fewer, else parallel (a
    run-time branch over the same body)."""
    T, IRBuilder, tir = C.tir_builder, C.IRBuilder, C.tirx
    names = [n for n, _ in spec.inputs()] + ["out"]
    buf = dict(zip(names, params))
    f32 = "float32"
    ext = spec.extents()
    nb_total = math.prod(spec.batch) if spec.batch else 1
    rows_total = nb_total * spec.sq
    w = _dot_width(spec.d, lanes)
    one_block = static(_block_count(spec, spec.sk, kb, seq_bound)) == 1
    scale = tir.const(spec.scale, f32)
    neg_inf, zero = tir.const(NEG_INF, f32), tir.const(0.0, f32)

    def load(name, op, env):
        return buf[name][tuple(_index(op, env, ext))]

    def tasks(loop, block_name):
        with loop(0, rows_total) as task:
            with T.sblock(block_name):
                t = T.axis.spatial(rows_total, task)
                T.reads(*[buf[n][tuple(slice(0, s) for s in op.shape)] for n, op in spec.inputs()])
                T.writes(buf["out"][tuple(slice(0, s) for s in spec.out.shape)])
                sc = T.sblock_alloc_buffer((kb,), f32, scope=BUFFER_SCOPE)     # a key block's scores, then exps
                ps = T.sblock_alloc_buffer((w,), f32, scope=BUFFER_SCOPE)      # a dot product's lanes
                acc = T.sblock_alloc_buffer((spec.dv,), f32, scope=BUFFER_SCOPE)
                # running max, running sum, the block's new max, rescale factor (then 1 / sum)
                m, lsum, mn, al = (T.sblock_alloc_buffer((1,), f32, scope=BUFFER_SCOPE) for _ in range(4))
                if static(spec.sq) == 1:
                    i, flat = 0, t
                else:
                    i, flat = tir.floormod(t, spec.sq), tir.floordiv(t, spec.sq)
                benv = _batch_env(spec, _unravel(flat, list(spec.batch))) if spec.batch else {}
                env_i = {**benv, "i": i}
                visible = spec.sk if spec.causal_offset is None else \
                    tir.max(tir.min(spec.sk, i + (spec.causal_offset + 1)), 0)
                T.buffer_store(m, neg_inf, [0])
                T.buffer_store(lsum, zero, [0])
                with _vector_loop(T, spec.dv, lanes) as e:
                    T.buffer_store(acc, zero, [e])
                # the scores' last slot, written once: the loops below touch the row's visible keys only,
                # and TVM's CompactBufferAllocation would shrink the buffer to them (a run-time sized stack
                # buffer per task; the block nest's score tile: _flash_root)
                T.buffer_store(sc, zero, [kb - 1])
                with T.serial(0, 1 if one_block else _ceil_div(visible, kb)) as ko:
                    j0 = ko * kb
                    count = visible if one_block else tir.min(kb, visible - j0)
                    T.buffer_store(mn, m[0], [0])
                    # scores: scale * Q[i] . K[j] (+ mask), and their max
                    with T.serial(0, count) as jj:
                        env_j = {**env_i, "j": j0 + jj}
                        with _lanes(T, w) as ln:
                            T.buffer_store(ps, load("q", spec.q, {**env_j, "d": ln}) *
                                           load("k", spec.k, {**env_j, "d": ln}), [ln])
                        if spec.d > w:
                            with T.serial(1, spec.d // w) as do:
                                with _lanes(T, w) as ln:
                                    dd = do * w + ln
                                    T.buffer_store(ps, ps[ln] + load("q", spec.q, {**env_j, "d": dd}) *
                                                   load("k", spec.k, {**env_j, "d": dd}), [ln])
                        x = (_lane_sum(tir.BufferLoad(ps, [tir.Ramp(0, 1, w)]), w) if w > 1 else ps[0]) * scale
                        if spec.mask is not None:
                            x = x + load("mask", spec.mask, env_j)
                        T.buffer_store(sc, x, [jj])
                        T.buffer_store(mn, tir.max(mn[0], sc[jj]), [0])
                    # the rescale of the running sum and accumulators (a max of -inf: the exps use 0; every
                    # exp's argument is <= 0, min(., 0) says so to tvmfuse.fastmath)
                    sf = tir.Select(mn[0] == neg_inf, zero, mn[0])
                    T.buffer_store(al, tir.exp(tir.min(m[0] - sf, zero)), [0])
                    T.buffer_store(lsum, lsum[0] * al[0], [0])
                    with _vector_loop(T, spec.dv, lanes) as e:
                        T.buffer_store(acc, acc[e] * al[0], [e])
                    with T.serial(0, count) as jj:
                        T.buffer_store(sc, tir.exp(tir.min(sc[jj] - sf, zero)), [jj])
                        T.buffer_store(lsum, lsum[0] + sc[jj], [0])
                    T.buffer_store(m, mn[0], [0])
                    # P @ V: vectors over the value dim
                    with T.serial(0, count) as jj:
                        with _vector_tiles(T, spec.dv, lanes) as e:
                            T.buffer_store(acc, acc[e] + sc[jj] * load("v", spec.v, {**env_i, "j": j0 + jj, "e": e}),
                                           [e])
                # the row: acc / sum (0 * inf = NaN keeps a row without weight NaN, as acc / 0 does)
                T.buffer_store(al, tir.const(1.0, f32) / lsum[0], [0])
                with _vector_loop(T, spec.dv, lanes) as e:
                    val = acc[e] * al[0]
                    if spec.zero_empty_rows:
                        val = tir.Select(lsum[0] > zero, val, zero)
                    if spec.guard is not None:
                        val = tir.Select(load("guard", spec.guard, env_i), zero, val)
                    T.buffer_store(buf["out"], val, _index(spec.out, {**env_i, "e": e}, ext))

    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            for n in names:
                T.arg(n, buf[n])
            if serial_work > 0:
                work = _int64(rows_total) * _int64(spec.sk) * (spec.d + spec.dv)
                with T.If(work < tir.const(serial_work, "int64")):
                    with T.Then():
                        tasks(T.serial, "attention_rows_serial")
                    with T.Else():
                        tasks(T.parallel, "attention_rows")
            else:
                tasks(T.parallel, "attention_rows")
    return ib.get().body.block
