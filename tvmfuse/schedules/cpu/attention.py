"""Attention as one CPU kernel: online (flash-style) softmax, the S x S scores never in memory.

The kernel contract is ``AttentionSpec`` (what ``tvmfuse.passes.attention`` found in the graph): for
every logical batch index (batch, heads...) and query row i,

    out[i, e] = sum_j softmax_j(scale * sum_d Q[i, d] K[j, d] + mask[i, j] + causal[i, j]) V[j, e]

with ``causal[i, j] = -inf`` where ``j > i + causal_offset`` and, with a ``guard`` operand (a bool per
row), ``out[i, :] = 0`` where the guard is true (ONNX Attention's fully-masked rows).  A row whose logits
are all -inf gives NaN, as softmax does (0/0).  Each operand is a buffer whose axes carry logical labels
(``Operand.axes``): ``b<k>`` (batch axis k), ``i`` (query), ``j`` (key), ``d`` (q/k feature), ``e`` (value
feature) or ``1`` (broadcast); an axis may hold several of them row-major (a composite: [seq, heads*dim]
before the head split) or a digit of one (``("%", label, stride, extent)``: K/V heads shared by groups of
query heads), so transposed K, head split/merge reshapes and transposes, grouped-query K/V and broadcast
masks are read in place.

``reference_prim_func(spec)`` is the unscheduled kernel (scores, max, exp, sum, P @ V as te stages: any
target can lower it).  The CPU template ``Attention`` replaces its body with the online-softmax loop nest
for a (query block, key block) configuration:

    for (batch, query block) in parallel:
        m = -inf, l = 0, acc = 0                                  # per query row, local buffers
        for key block:
            kt = K[block]^T                                       # [d, kb] local tile
            s  = scale * Q[rows] @ kt + mask  (-inf: past the keys, causal)    # [qb, kb], vector over kb
            m' = max(m, rowmax(s));  p = exp(s - m');  alpha = exp(m - m')
            l  = l * alpha + rowsum(p);  acc = acc * alpha + p @ V[block]      # vector over the head dim
            m  = m'
        out[rows] = acc / l   (0 where the guard is set)
"""
from __future__ import annotations

import contextlib
import json
import math
from dataclasses import asdict, dataclass, replace

from ... import _compat as C
from ...target import cpu_info
from ..base import Knob, KnobSpace, Match, Template

ATTR = "tvmfuse.attention"          # PrimFunc attribute holding the spec (JSON)
RULE_ATTR = "tvmfuse.rule"          # the rule that formed the kernel (for the report)
Q_BLOCKS = (1, 2, 4, 8, 16)         # query rows per task (share each K/V tile)
K_BLOCK_VECTORS = (1, 2, 4, 8)      # keys per block, in float32 vectors of the target
# Fractions of the caches the default blocks aim at: the K/V tiles of one key block in L1, the query
# block's accumulators and scores next to them.
L1_SHARE_KV = 0.5
L1_SHARE_ACC = 0.25
MIN_TASKS_PER_CORE = 2              # parallel tasks (batch x query blocks) per core before rows per task grow
# The size the default blocks assume for a symbolic extent (the kernel is correct at every size): a
# symbolic batch axis may be 1 at run time, so it adds no tasks; a symbolic sequence is taken as a
# typical encoder length.
SYMBOLIC_BATCH_HINT = 1
SYMBOLIC_SEQ_HINT = 128
NEG_INF = float("-inf")


@dataclass(frozen=True)
class Operand:
    axes: tuple          # logical label per buffer axis
    shape: tuple         # the buffer's shape: ints, a symbolic extent as a TIR var (its name in JSON)
    dtype: str = "float32"


@dataclass(frozen=True)
class AttentionSpec:
    """What the kernel computes.  Extents are ints or, for symbolic batch/sequence axes, TIR vars (one
    symbol per extent: ``batch``, ``sequence``); the JSON form holds a var's name, and ``bind`` puts the
    kernel's own vars back (``Attention.match``).  The head dims ``d``/``dv`` are static."""
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
        ops = {k: (Operand(tuple(_as_label(a) for a in v["axes"]), tuple(v["shape"]), v["dtype"])
                   if v is not None else None)
               for k, v in d.items() if k in ("q", "k", "v", "out", "mask", "guard")}
        rest = {k: v for k, v in d.items() if k not in ops}
        rest["batch"] = tuple(rest["batch"])
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
        self.map_dims(lambda n: found.setdefault(str(n.name), n) if isinstance(n, C.tirx.Var) else n)
        return found

    def bind(self, symbols: dict) -> "AttentionSpec":
        """The spec with each symbol (a var name, as ``from_json`` reads it, or a var) replaced by
        ``symbols[name]`` (a TIR var); KeyError names a symbol ``symbols`` lacks."""
        def sub(n):
            if isinstance(n, str):
                return symbols[n]
            return symbols[str(n.name)] if isinstance(n, C.tirx.Var) else n
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
        for n in plain:
            if not isinstance(n, (str, C.tirx.Var)):
                raise ValueError(f"attention: symbolic extent {n} is not a plain symbol (batch, sequence)")
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


def _dim_json(n):
    """An extent as JSON: an int, or the name of its symbol."""
    if isinstance(n, (int, str)):
        return n
    if isinstance(n, C.IntImm):
        return int(n.value)
    if isinstance(n, C.tirx.Var):
        return str(n.name)
    raise ValueError(f"attention: symbolic extent {n} is not a plain symbol (batch, sequence)")


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
        if spec.guard is not None:
            g = ph["guard"][tuple(_index(spec.guard, {**_batch_env(spec, bidx), "i": i}, ext))]
            val = tir.Select(g, tir.const(0.0, "float32"), val)
        return val

    Y = te.compute(spec.out.shape, out, name="attn_out")
    func = te.create_prim_func([ph[n] for n, _ in spec.inputs()] + [Y])
    if func.attrs is not None and "global_symbol" in func.attrs:
        func = func.without_attr("global_symbol")   # private: the module names it
    return func.with_attr({ATTR: spec.to_json(), RULE_ATTR: "attention", "op_pattern": 8})


# --------------------------------------------------------------------------- the CPU template
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


class Attention(Template):
    family = "cpu.attention"
    target_kinds = ("llvm",)

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

    # Step 0. The knob space: rows per task and keys per block.
    def space(self, match: Match, target: C.Target) -> KnobSpace:
        spec = match.info["spec"]
        lanes = cpu_info(target).float32_lanes
        sq, sk = static(spec.sq), static(spec.sk)      # None: symbolic, every block may serve
        qb = tuple(q for q in Q_BLOCKS if q == 1 or sq is None or q < 2 * sq)
        kb = tuple(lanes * v for v in K_BLOCK_VECTORS if v == 1 or sk is None or lanes * v < 2 * sk)
        return KnobSpace((
            Knob("q_block", qb, "query rows per parallel task (they share every K/V tile)"),
            Knob("k_block", kb, "keys per online-softmax step (a multiple of the vector width)"),
            Knob("lanes", (lanes,), "float32 lanes per vector (target)"),
        ))

    def default_config(self, match: Match, target: C.Target) -> dict:
        spec, info = match.info["spec"], cpu_info(target)
        space = {k.name: k.choices for k in self.space(match, target).knobs}
        # the K tile and the V rows of one key block in a share of L1
        kb = space["k_block"][0]
        for c in space["k_block"]:
            if (spec.d + spec.dv) * c * 4 <= L1_SHARE_KV * info.l1d_bytes:
                kb = c
        # query rows: accumulators + scores in a share of L1, and enough tasks for every core
        tasks_rows = max(1, math.prod(_hint(n, SYMBOLIC_BATCH_HINT) for n in spec.batch))
        qb = space["q_block"][0]
        for c in space["q_block"]:
            fits = c * (spec.dv + kb + 2) * 4 <= L1_SHARE_ACC * info.l1d_bytes
            tasks = tasks_rows * math.ceil(_hint(spec.sq, SYMBOLIC_SEQ_HINT) / c)
            if fits and tasks >= MIN_TASKS_PER_CORE * info.cores:
                qb = c
        return {"q_block": qb, "k_block": kb, "lanes": info.float32_lanes}

    def apply(self, sch: C.Schedule, match: Match, config: dict) -> None:
        spec = match.info["spec"]
        root = sch.get_sblock("root")
        func = sch.mod["main"]
        # Step 1. The online-softmax loop nest for this configuration, over the kernel's own buffers.
        new_root = _flash_root(spec, list(func.params), config["q_block"], config["k_block"],
                               config["lanes"])
        # Step 2. It replaces the reference stages (scores, softmax, P @ V) wholesale.
        old = sch.get(root)
        sch.state.replace(sch.get_sref(root), new_root, {old: new_root})


def _flash_root(spec: AttentionSpec, params: list, qb: int, kb: int, lanes: int):
    """The root block of the online-softmax kernel (see the module docstring)."""
    T, IRBuilder, tir = C.tir_builder, C.IRBuilder, C.tirx
    names = [n for n, _ in spec.inputs()] + ["out"]
    buf = dict(zip(names, params))
    f32 = "float32"
    nb_total = math.prod(spec.batch) if spec.batch else 1
    nqb = _ceil_div(spec.sq, qb)
    nkb = _ceil_div(spec.sk, kb)
    # a symbolic sequence: the last query block runs only the rows that exist (a static one clamps them)
    q_tail = static(spec.sq) is None
    scale = tir.const(spec.scale, f32)
    neg_inf, zero, one = tir.const(NEG_INF, f32), tir.const(0.0, f32), tir.const(1.0, f32)

    ext = spec.extents()

    def load(name, op, env):
        return buf[name][tuple(_index(op, env, ext))]

    with IRBuilder() as ib:
        with T.prim_func(s_tir=True):
            T.func_name("main")
            for n in names:
                T.arg(n, buf[n])
            with T.parallel(0, nb_total * nqb) as task:
                with T.sblock("attention_flash"):
                    t = T.axis.spatial(nb_total * nqb, task)
                    T.reads(*[buf[n][tuple(slice(0, s) for s in op.shape)] for n, op in spec.inputs()])
                    T.writes(buf["out"][tuple(slice(0, s) for s in spec.out.shape)])
                    m = T.sblock_alloc_buffer((qb,), f32, scope="local")
                    mn = T.sblock_alloc_buffer((qb,), f32, scope="local")
                    lsum = T.sblock_alloc_buffer((qb,), f32, scope="local")
                    acc = T.sblock_alloc_buffer((qb, spec.dv), f32, scope="local")
                    s = T.sblock_alloc_buffer((qb, kb), f32, scope="local")
                    kt = T.sblock_alloc_buffer((spec.d, kb), f32, scope="local")
                    bidx = _unravel(tir.floordiv(t, nqb), list(spec.batch)) if spec.batch else []
                    benv = _batch_env(spec, bidx)
                    q0 = tir.floormod(t, nqb) * qb
                    rows = tir.min(qb, spec.sq - q0) if q_tail else qb
                    # Step 1. Running max, running sum and accumulator of each query row.
                    with T.serial(0, qb) as qi:
                        T.buffer_store(m, neg_inf, [qi])
                        T.buffer_store(lsum, zero, [qi])
                        with _vector_loop(T, spec.dv, lanes) as e:
                            T.buffer_store(acc, zero, [qi, e])
                    # Step 2. Key blocks; a causal kernel stops after the last block its rows can see.
                    n_blocks = nkb
                    if spec.causal_offset is not None:
                        last_key = q0 + (qb - 1) + spec.causal_offset
                        n_blocks = tir.max(tir.min(tir.floordiv(last_key, kb) + 1, nkb), 0)
                    with T.serial(0, n_blocks) as ko:
                        j0 = ko * kb
                        # Step 2a. The K tile, transposed ([d, kb]): the score loop is a vector over keys.
                        with T.serial(0, spec.d) as dd:
                            with _vector_loop(T, kb, lanes) as jj:
                                jc = tir.min(j0 + jj, spec.sk - 1)
                                T.buffer_store(kt, load("k", spec.k, {**benv, "j": jc, "d": dd}), [dd, jj])
                        with T.serial(0, rows) as qi:
                            ic = tir.min(q0 + qi, spec.sq - 1)
                            # Step 2b. Scores of the row against the block's keys.
                            with _vector_loop(T, kb, lanes) as jj:
                                T.buffer_store(s, zero, [qi, jj])
                            with T.serial(0, spec.d) as dd:
                                qv = load("q", spec.q, {**benv, "i": ic, "d": dd})
                                with _vector_loop(T, kb, lanes) as jj:
                                    T.buffer_store(s, s[qi, jj] + qv * kt[dd, jj], [qi, jj])
                            # Step 2c. Logits: scale, mask; -inf past the last key and above the diagonal.
                            with _vector_loop(T, kb, lanes) as jj:
                                j = j0 + jj
                                x = s[qi, jj] * scale
                                if spec.mask is not None:
                                    x = x + load("mask", spec.mask,
                                                 {**benv, "i": ic, "j": tir.min(j, spec.sk - 1)})
                                valid = j < spec.sk
                                if spec.causal_offset is not None:
                                    valid = tir.And(valid, j <= ic + spec.causal_offset)
                                T.buffer_store(s, tir.Select(valid, x, neg_inf), [qi, jj])
                            # Step 2d. New running max (a max of -inf only stays -inf: exp below uses 0).
                            T.buffer_store(mn, m[qi], [qi])
                            with T.serial(0, kb) as jj:
                                T.buffer_store(mn, tir.max(mn[qi], s[qi, jj]), [qi])
                            safe = tir.Select(mn[qi] == neg_inf, zero, mn[qi])
                            # Step 2e. Probabilities of the block, their sum, the rescaled accumulator.
                            with _vector_loop(T, kb, lanes) as jj:
                                T.buffer_store(s, tir.exp(s[qi, jj] - safe), [qi, jj])
                            alpha = tir.exp(m[qi] - safe)
                            T.buffer_store(lsum, lsum[qi] * alpha, [qi])
                            with T.serial(0, kb) as jj:
                                T.buffer_store(lsum, lsum[qi] + s[qi, jj], [qi])
                            with _vector_loop(T, spec.dv, lanes) as e:
                                T.buffer_store(acc, acc[qi, e] * alpha, [qi, e])
                            T.buffer_store(m, mn[qi], [qi])
                            # Step 2f. acc += p @ V[block], a vector over the head dim.
                            with T.serial(0, kb) as jj:
                                jc = tir.min(j0 + jj, spec.sk - 1)
                                with _vector_loop(T, spec.dv, lanes) as e:
                                    vv = load("v", spec.v, {**benv, "j": jc, "e": e})
                                    T.buffer_store(acc, acc[qi, e] + s[qi, jj] * vv, [qi, e])
                    # Step 3. Normalize and store the rows of this block that exist.
                    with T.serial(0, qb) as qi:
                        i = q0 + qi
                        with T.If(i < spec.sq):
                            with T.Then():
                                inv = one / lsum[qi]
                                with _vector_loop(T, spec.dv, lanes) as e:
                                    val = acc[qi, e] * inv
                                    if spec.guard is not None:
                                        g = load("guard", spec.guard, {**benv, "i": i})
                                        val = tir.Select(g, zero, val)
                                    T.buffer_store(buf["out"], val,
                                                   _index(spec.out, {**benv, "i": i, "e": e}, ext))
    return ib.get().body.block
