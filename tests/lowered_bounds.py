"""Out-of-bounds accesses of a lowered kernel at concrete sizes, found by running its index arithmetic (tests).

A schedule over symbolic extents is lowered once, symbolically, by TVM's default TIR pipeline (loop
partitioning, vectorizing, unrolling and simplification reason about the symbolic sizes, and can get a
tail wrong); the lowered body is then translated to Python that keeps only the index arithmetic (every
loop, ``if``, ``if_then_else`` and variable binding; no float value) and run for each size given: every
buffer store and load index is compared with the extent of its buffer (the parameters' and every
allocation's, at that size).

Why not TVM's ``tirx.instrument_bound_checkers``: on 0.27 it instruments nothing in a kernel built from a
schedule (it reads buffer-bound attributes that only the old te lowering wrote), and a write past an
intermediate's end corrupts the heap only now and then (``free(): invalid pointer`` later, elsewhere).
This check is deterministic: a wrong tail at a size shows at that size, on every run and host.
"""
from __future__ import annotations

from tvmfuse import _compat as C

T = C.tirx
_OPS = {T.Add: "({} + {})", T.Sub: "({} - {})", T.Mul: "({} * {})", T.FloorDiv: "({} // {})",
        T.FloorMod: "({} % {})", T.Div: "_tdiv({}, {})", T.Mod: "_tmod({}, {})", T.Min: "min({}, {})",
        T.Max: "max({}, {})", T.LT: "({} < {})", T.LE: "({} <= {})", T.GT: "({} > {})", T.GE: "({} >= {})",
        T.EQ: "({} == {})", T.NE: "({} != {})", T.And: "({} and {})", T.Or: "({} or {})"}
_ITE = "prim.if_then_else"
_LIKELY = "prim.likely"


class Unknown(Exception):
    """An index, extent or condition that depends on something other than sizes and loop variables."""


def _tdiv(a, b):
    return abs(a) // abs(b) * (1 if (a >= 0) == (b > 0) else -1)


def _tmod(a, b):
    return a - _tdiv(a, b) * b


def _key(obj):
    return obj.__chandle__()


class _Translator:
    """The lowered TIR as the source of a Python function ``run(sizes, check)``."""

    def __init__(self):
        self.lines: list[str] = []
        self.names: dict = {}            # variable -> Python name
        self.buffers: dict = {}          # buffer -> Python name of (name, extents, flat extent)
        self.depth = 1

    def emit(self, line: str):
        self.lines.append("    " * self.depth + line)

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{len(self.names) + len(self.buffers) + len(self.lines)}"

    # ------------------------------------------------------------------ expressions
    def expr(self, e) -> str:
        if isinstance(e, T.IntImm):
            return str(int(e.value))
        if isinstance(e, T.Var):
            name = self.names.get(_key(e))
            if name is None:
                raise Unknown(f"variable {e.name} is neither a size nor bound to index arithmetic")
            return name
        fmt = _OPS.get(type(e))
        if fmt is not None:
            return fmt.format(self.expr(e.a), self.expr(e.b))
        if isinstance(e, T.Not):
            return f"(not {self.expr(e.a)})"
        if isinstance(e, (T.Cast, T.Broadcast)):          # a Broadcast condition: the same in every lane
            return self.expr(e.value)
        if isinstance(e, T.Select):
            return f"({self.expr(e.true_value)} if {self.expr(e.condition)} else {self.expr(e.false_value)})"
        if isinstance(e, C.Call) and str(e.op.name) == _ITE:
            return f"({self.expr(e.args[1])} if {self.expr(e.args[0])} else {self.expr(e.args[2])})"
        if isinstance(e, C.Call) and str(e.op.name) == _LIKELY:
            return self.expr(e.args[0])
        raise Unknown(f"no index arithmetic: {type(e).__name__} {e}")

    def index_range(self, e) -> str:
        """Python source of the (lowest, highest) element an index touches."""
        if isinstance(e, T.Ramp):
            base, last = self.expr(e.base), f"({self.expr(e.base)} + {self.expr(e.stride)} * {int(e.lanes) - 1})"
            return f"(min({base}, {last}), max({base}, {last}))"
        if isinstance(e, T.Broadcast):
            return self.index_range(e.value)
        v = self.expr(e)
        return f"({v}, {v})"

    # ------------------------------------------------------------------ buffers
    def declare(self, buf):
        try:
            dims = [self.expr(d) for d in buf.shape]
        except Unknown:
            return                          # a view whose extent is no size (the packed API's handles)
        name = self.fresh("b")
        self.emit(f"{name} = _buffer({str(buf.name)!r}, [{', '.join(dims)}])")
        self.buffers[_key(buf)] = name

    def access(self, buf, indices, what: str):
        name = self.buffers.get(_key(buf))
        if name is None:
            raise Unknown(f"{what} of {buf.name}: the buffer is not declared with an extent")
        ranges = ", ".join(self.index_range(ix) for ix in indices)
        self.emit(f"check({name}, [{ranges}], {what!r})")

    def loads(self, e):
        """Checks of every load of ``e``; an ``if_then_else``'s loads only on its taken side."""
        if isinstance(e, C.TensorLoad):
            for ix in e.indices:
                self.loads(ix)
            self.access(e.source, list(e.indices), "load")
            return
        if isinstance(e, C.Call) and str(e.op.name) == _ITE:
            self.loads(e.args[0])
            self.emit(f"if {self.expr(e.args[0])}:")
            self.depth += 1
            self.emit("pass")
            self.loads(e.args[1])
            self.depth -= 1
            self.emit("else:")
            self.depth += 1
            self.emit("pass")
            self.loads(e.args[2])
            self.depth -= 1
            return
        children = list(e.args) if isinstance(e, C.Call) else [
            getattr(e, f) for f in ("a", "b", "value", "base", "stride", "condition", "true_value",
                                     "false_value") if hasattr(e, f)]
        for c in children:
            if C.is_prim_expr(c):
                self.loads(c)

    # ------------------------------------------------------------------ statements
    def stmt(self, s, sizes: set):
        if isinstance(s, T.SeqStmt):
            for c in s.seq:
                self.stmt(c, sizes)
        elif isinstance(s, T.For):
            var = self.fresh("i")
            lo, ext = self.expr(s.min), self.expr(s.extent)
            self.emit(f"for {var} in range({lo}, {lo} + {ext}):")
            self.names[_key(s.loop_var)] = var
            self.depth += 1
            self.emit("pass")
            self.stmt(s.body, sizes)
            self.depth -= 1
        elif isinstance(s, T.IfThenElse):
            try:
                cond = self.expr(s.condition)
            except Unknown:
                return                      # the packed API's checks of its arguments: no kernel code
            self.emit(f"if {cond}:")
            self.depth += 1
            self.emit("pass")
            self.stmt(s.then_case, sizes)
            self.depth -= 1
            if s.else_case is not None:
                self.emit("else:")
                self.depth += 1
                self.emit("pass")
                self.stmt(s.else_case, sizes)
                self.depth -= 1
        elif isinstance(s, T.Bind):
            var = self.fresh("v")
            if str(s.var.name) in sizes:
                self.emit(f"{var} = sizes[{str(s.var.name)!r}]")
            else:
                try:
                    self.emit(f"{var} = {self.expr(s.value)}")
                except Unknown:
                    return                  # a handle or a field of the packed arguments
            self.names[_key(s.var)] = var
        elif isinstance(s, (T.AllocBuffer, T.DeclBuffer)):
            self.declare(s.buffer)
        elif isinstance(s, T.BufferStore):
            self.loads(s.value)
            for ix in s.indices:
                self.loads(ix)
            self.access(s.buffer, list(s.indices), "store")
        elif isinstance(s, T.AttrStmt):
            self.stmt(s.body, sizes)
        elif isinstance(s, (T.Evaluate, T.AssertStmt, T.Return)):
            return
        else:
            raise Unknown(f"statement {type(s).__name__} not handled")


def _buffer(name: str, dims: list[int]):
    n = 1
    for d in dims:
        n *= d
    return name, dims, n


def lowered(func, target):
    """``func`` through TVM's default TIR pipeline for ``target`` (symbolic sizes: what is compiled)."""
    mod = C.IRModule({"main": func.with_attr("global_symbol", "main")})
    return C.lower_tir(mod, target)["main"]


def out_of_bounds(func, target, size_points: list[dict], max_reports: int = 5) -> list[str]:
    """The out-of-bounds stores and loads of ``func`` lowered for ``target``, at each of ``size_points``
    (``{symbolic variable name: value}``, the same names at every point): an empty list when every access
    at every size is in bounds (at most ``max_reports`` per size)."""
    tr = _Translator()
    tr.stmt(lowered(func, target).body, set(size_points[0]) if size_points else set())
    source = "def run(sizes, check):\n    pass\n" + "\n".join(tr.lines) + "\n"
    scope = {"_buffer": _buffer, "_tdiv": _tdiv, "_tmod": _tmod}
    exec(compile(source, "<lowered index arithmetic>", "exec"), scope)   # noqa: S102 (our own translation)
    reports: list[str] = []
    for sizes in size_points:
        found: list[str] = []

        def check(buf, ranges, what, sizes=sizes, found=found):
            name, dims, n = buf
            if len(ranges) == 1:
                dims = [n]
            if len(ranges) != len(dims):
                raise Unknown(f"{what} of {name}: {len(ranges)} indices into {len(dims)} axes")
            lo = hi = 0
            stride = 1
            for (a, b), d in zip(reversed(ranges), reversed(dims)):
                lo, hi, stride = lo + a * stride, hi + b * stride, stride * d
            if (lo < 0 or hi >= n) and len(found) < max_reports:
                found.append(f"{what} {name}[{lo}..{hi}] outside [0, {n}) at {sizes}")

        scope["run"](sizes, check)
        reports += found
    return reports
