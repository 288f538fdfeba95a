"""``tvmfuse.FuseGroups``: tvmfuse's partitioner over the legalized module.

Every dataflow block of every inference function is a DAG of bindings; each ``call_tir`` is a node that
``rules.classify`` gives a kind.  Nodes are merged with a union-find, first along producer -> consumer
edges (in binding order), then between siblings that read one tensor, then the norm prologues that waited
for their sibling matmuls to be one group, each merge decided by ``rules`` (legality, profitability,
target support joined in ``_decide``).  Each group of two or more ops becomes a Relax function with
``Primitive=1``, ``tvmfuse.rule`` (the rules that formed it) and ``tvmfuse.template`` (the family that
accepted it, where one did), called from the block; a tensor of the group that something outside still
reads is one more output of the group (the function returns a tuple).  TVM's FuseTIR then merges each
group into one PrimFunc.

Every fusion that a rule considered and did not do, and every pair a rule could not cover, is recorded
with ``explain.record_refusal``.
"""
from __future__ import annotations

import heapq
import logging

from .. import _compat as C
from ..explain import record_group, record_refusal
from ..report import op_name
from . import rules as R

log = logging.getLogger("tvmfuse.fusion")


class _UnionFind:
    def __init__(self, n: int):
        self.parent = list(range(n))
        self.members = {i: [i] for i in range(n)}

    def find(self, i: int) -> int:
        while self.parent[i] != i:
            self.parent[i] = self.parent[self.parent[i]]
            i = self.parent[i]
        return i

    def union(self, a: int, b: int) -> int:
        ra, rb = self.find(a), self.find(b)
        if ra == rb:
            return ra
        if len(self.members[ra]) < len(self.members[rb]):
            ra, rb = rb, ra
        self.parent[rb] = ra
        self.members[ra].extend(self.members.pop(rb))
        return ra


class _BlockGraph:
    """One dataflow block as a DAG over its bindings (index = binding order, a topological order)."""

    def __init__(self, mod, block, limits: R.TargetLimits, target=None):
        self.bindings = list(block.bindings)
        n = len(self.bindings)
        self.limits, self.target = limits, target
        self.index = {}
        for i, b in enumerate(self.bindings):
            self.index[b.var] = i
        self.preds = [set() for _ in range(n)]
        self.succs = [set() for _ in range(n)]
        self.external = [not isinstance(b.var, C.relax.DataflowVar) for b in self.bindings]
        for i, b in enumerate(self.bindings):
            for v in C.relax_free_vars(b.value):
                j = self.index.get(v)
                if j is not None:
                    self.preds[i].add(j)
                    self.succs[j].add(i)
        self.info: list[R.NodeInfo | None] = [None] * n   # None: not a call_tir (a barrier)
        self.alias_of: dict[int, int] = {}                 # TupleGetItem of a call_tir tuple -> its producer
        for i, b in enumerate(self.bindings):
            v = b.value
            if _is_call_tir(v):
                func = mod[v.args[0]] if v.args[0] in mod.get_global_vars() else None
                info = R.classify(func, v, C.type_of(b.var))
                if not all(isinstance(a, (C.relax.Var, C.Constant)) or R.scalar_arg(a) for a in v.args[1].fields):
                    info.kind, info.why_opaque = R.OPAQUE, "an argument is neither a tensor var nor a constant"
                info.name = f"{info.name}({C.var_name(b.var)})"
                self.info[i] = info
        # extents a match_cast defines at run time (Range's length, NonZero's count): a group holding ops over
        # them may also hold the ops that compute them, which FuseTIR cannot order; such ops keep their kernel
        runtime_dims = set()
        for b in self.bindings:
            if isinstance(b, C.relax.MatchCast):
                runtime_dims |= R.shape_vars(C.type_of(b.var))
        for i, b in enumerate(self.bindings):
            info = self.info[i]
            if info is None or info.kind == R.OPAQUE or not runtime_dims:
                continue
            used = R.shape_vars(C.type_of(b.var)).union(*[R.shape_vars(C.type_of(a)) for a in b.value.args[1].fields])
            if used & runtime_dims:
                info.kind, info.why_opaque = R.OPAQUE, (f"extent {sorted(used & runtime_dims)} is defined at run time "
                                                        "by a match_cast (data-dependent shape)")
        for i, b in enumerate(self.bindings):
            v = b.value
            if isinstance(v, C.relax.TupleGetItem) and isinstance(v.tuple_value, C.relax.Var):
                j = self.index.get(v.tuple_value)
                if j is not None and self.info[j] is not None:
                    self.alias_of[i] = j
        for j, info in enumerate(self.info):
            if info is None or not isinstance(C.type_of(self.bindings[j].var), C.TupleType):
                continue
            if self.external[j] or any(s not in self.alias_of for s in self.succs[j]):
                info.kind, info.why_opaque = R.OPAQUE, "its tuple result is used whole, not field by field"
        for i, info in enumerate(self.info):
            if info is None:
                continue
            if self.external[i]:
                info.view = False        # RewriteDataflowReshape rewrites dataflow vars only
            info.var = self.bindings[i].var
            info.readers = tuple(self.info[s] for s in sorted(self.succs[i])) + ((None,) if self.external[i] else ())
        self.uf = _UnionFind(n)
        self.group_rules: dict[int, list[str]] = {}
        self.group_template: dict[int, str] = {}       # root -> the template family that accepted the group
        self.group_declined: dict[int, str] = {}       # root -> why the rule's family declined (generic took it)
        for i, j in self.alias_of.items():
            if self.info[j].kind != R.OPAQUE:
                self.uf.union(i, j)

    # ----------------------------------------------------------------------------------- queries
    def node(self, i: int) -> int:
        """The call_tir behind binding i (itself, or the producer of the tuple it reads a field of)."""
        return self.alias_of.get(i, i)

    def fusable(self, i: int) -> bool:
        info = self.info[self.node(i)]
        return info is not None and info.kind != R.OPAQUE

    def group_infos(self, members) -> list[R.NodeInfo]:
        return [self.info[k] for k in members if k not in self.alias_of and self.info[k] is not None]

    def outputs(self, members: set) -> list[int]:
        """Members whose value something outside the group reads (tuple producers excepted)."""
        outs = []
        for k in sorted(members):
            if isinstance(C.type_of(self.bindings[k].var), C.TupleType):
                continue
            if self.external[k] or any(s not in members for s in self.succs[k]):
                outs.append(k)
        return outs

    def creates_cycle(self, members: set) -> int | None:
        """A node outside ``members`` on a path that leaves the merged group and re-enters it, else None.

        Groups already formed count as single nodes (each will be one kernel), so the walk enters the
        whole group of every node it reaches.  Only bindings before the group's last member can lead back.
        """
        last = max(members)
        seen, stack = set(), []
        for k in members:
            stack.extend(s for s in self.succs[k] if s not in members and s < last)
        while stack:
            x = stack.pop()
            if x in seen:
                continue
            seen.add(x)
            for y in self.uf.members[self.uf.find(x)]:
                seen.add(y)
                for s in self.succs[y]:
                    if s in members:
                        return x
                    if s < last and s not in seen:
                        stack.append(s)
        return None

    # ----------------------------------------------------------------------------------- decision
    def decide(self, a: int, b: int, rule: R.Rule) -> tuple[str | None, str | None, str]:
        """Legality, the checks of the rules that formed both groups and of ``rule``, and target support
        (size limits, then a template family that accepts the merged group), joined: (None, the family
        that will schedule it; None where the target's families gate nothing, why the rule's family
        declined where the CPU generic schedule takes the group) if the groups of a and b may, should and
        can fuse; else (the reason they do not, None, "")."""
        ga, gb = self.uf.find(a), self.uf.find(b)
        members = set(self.uf.members[ga]) | set(self.uf.members[gb])
        blocker = self.creates_cycle(members)
        if blocker is not None:
            return (f"illegal: the path through {self._name(blocker)} leaves the group and comes back "
                    "(the fused kernel would depend on itself)"), None, ""
        infos = self.group_infos(members)
        formed = [R.RULES_BY_NAME[n] for n in self.group_rules.get(ga, []) + self.group_rules.get(gb, [])]
        reason = R.check_rules(formed + [rule], infos)
        if reason is not None:
            return "not profitable: " + reason, None, ""
        outs = self.outputs(members)
        reason = R.check_supported(infos, len(outs), self.limits)
        if reason is not None:
            return "not supported by the target: " + reason, None, ""
        group = R.GroupInfo(infos, [self.info[k] for k in outs if self.info[k] is not None])
        family, reason, declined = R.check_template(rule, group, self.target, tuple(formed))
        if reason is not None:
            return "not supported by the target: " + reason, None, ""
        return None, family, declined

    def merge(self, a: int, b: int, rule: str, template: str | None = None, declined: str = "") -> None:
        rules = self.group_rules.pop(self.uf.find(a), []) + self.group_rules.pop(self.uf.find(b), [])
        self.group_template.pop(self.uf.find(a), None)
        self.group_template.pop(self.uf.find(b), None)
        self.group_declined.pop(self.uf.find(a), None)
        self.group_declined.pop(self.uf.find(b), None)
        root = self.uf.union(a, b)
        self.group_rules[root] = list(dict.fromkeys(rules + [rule]))
        if template is not None:
            self.group_template[root] = template
        elif declined:
            self.group_declined[root] = declined

    def dissolve(self, root: int) -> None:
        """Split a group back into single ops (a call_tir keeps the tuple fields it owns)."""
        members = self.uf.members.pop(root)
        for k in members:
            self.uf.parent[k] = k
            self.uf.members[k] = [k]
        for i in members:
            j = self.alias_of.get(i)
            if j is not None:
                self.uf.union(i, j)

    def _name(self, i: int) -> str:
        info = self.info[self.node(i)]
        return info.name if info is not None else C.var_name(self.bindings[i].var)


def _is_call_tir(expr) -> bool:
    return (isinstance(expr, C.relax.Call) and isinstance(expr.op, C.Op) and expr.op.name == "relax.call_tir"
            and isinstance(expr.args[0], C.GlobalVar))


def _first_rule(kind: str, a: R.NodeInfo, b: R.NodeInfo, a_group_kinds=None) -> R.Rule | None:
    for rule in R.RULES:
        if rule.kind == kind and rule.matches(a, b, a_group_kinds):
            return rule
    return None


def _group_kinds(g: _BlockGraph, i: int) -> set:
    return {m.kind for m in g.group_infos(g.uf.members[g.uf.find(i)])}


def _no_rule_reason(producer: R.NodeInfo, consumer: R.NodeInfo) -> str:
    why = f"no rule fuses a producer of kind {producer.kind} into a consumer of kind {consumer.kind}"
    if consumer.kind == R.CONTRACTION:
        why += " (a matmul/conv kernel takes elementwise ops after it, not before)"
    return why


def _fuse(g: _BlockGraph, a: int, b: int, rule: R.Rule, pending: list) -> None:
    """Merge the groups of a and b under ``rule`` when ``decide`` agrees, else keep its refusal."""
    reason, template, declined = g.decide(a, b, rule)
    if reason is None:
        g.merge(a, b, rule.name, template, declined)
    else:
        pending.append((a, b, reason, rule.name))


def partition(g: _BlockGraph) -> list[tuple[str, str, str, str]]:
    """Form the groups of one block; returns the refusals (producer, consumer, reason, rule)."""
    pending: list[tuple[int, int, str, str]] = []
    out_refused: list[tuple[str, str, str, str]] = []
    # Step 1. Producer -> consumer edges, consumers in binding order.
    for i in range(len(g.bindings)):
        if g.info[i] is None:
            continue
        for p in sorted({g.node(j) for j in g.preds[i]}):
            if g.info[p] is None:
                continue
            if not (g.fusable(p) and g.fusable(i)):
                opaque = g.info[p] if g.info[p].kind == R.OPAQUE else g.info[i]
                pending.append((p, i, f"{opaque.name} is opaque: {opaque.why_opaque}", ""))
                continue
            if g.uf.find(p) == g.uf.find(i):
                continue
            rule = _first_rule("edge", g.info[p], g.info[i], _group_kinds(g, p))
            if rule is None:
                pending.append((p, i, _no_rule_reason(g.info[p], g.info[i]), ""))
                continue
            _fuse(g, p, i, rule, pending)
    # Step 2. Siblings: fusable readers of one tensor (a block var, a function parameter).
    readers: dict = {}
    for i, info in enumerate(g.info):
        if info is None or not g.fusable(i):
            continue
        for a in g.bindings[i].value.args[1].fields:
            if isinstance(a, C.relax.Var) and not R.scalar_arg(a):
                readers.setdefault(a, []).append(i)
            elif isinstance(a, C.Constant) and R.shared_table(a):
                readers.setdefault(a, []).append(i)
    for var, rs in readers.items():
        for x in range(len(rs)):
            for y in range(x + 1, len(rs)):
                a, b = rs[x], rs[y]
                if g.uf.find(a) == g.uf.find(b):
                    continue
                rule = _first_rule("sibling", g.info[a], g.info[b])
                if rule is not None:
                    _fuse(g, a, b, rule, pending)
    # Step 2b. Norm prologues refused in step 1 because the normalised tensor had readers outside the
    # consumer's group (Q/K/V siblings, which join in step 2): asked again now that the siblings are one group.
    retry = [x for x in pending if x[3] == "norm_prologue"]
    pending = [x for x in pending if x[3] != "norm_prologue"]
    for a, b, _reason, name in retry:
        if g.uf.find(a) != g.uf.find(b):
            _fuse(g, a, b, R.RULES_BY_NAME[name], pending)
    # Step 2c. A group leaves out the reshapes passed a symbol at its edges (free views alone).
    for root in list(g.uf.members):
        _trim_edge_views(g, root, out_refused)
    # Step 2d. Horizontal: the copy/elementwise groups reading outputs of one kernel (Q, K and V of one
    # sibling-matmul kernel, each re-laid-out to heads) join into one kernel, once the groups are otherwise
    # formed.
    _join_sibling_copies(g, pending)
    # Step 3. Groups the target cannot take as finished, and groups of reshapes only (each op alone a free
    # view), are split back into their ops.
    for root in list(g.uf.members):
        members = g.uf.members.get(root)
        if members is None or len(g.group_infos(members)) < 2:
            continue
        reason = R.check_final_group(g.group_infos(members), len(g.outputs(set(members))), g.limits)
        reason = "not supported by the target: " + reason if reason is not None else None
        if reason is None and R.views_only(g.group_infos(members)) is not None:
            reason = "not profitable: " + R.views_only(g.group_infos(members))
        if reason is not None:
            rules = "+".join(g.group_rules.pop(root, []))
            g.group_template.pop(root, None)
            g.group_declined.pop(root, None)
            ops = [g._name(k) for k in sorted(members) if k not in g.alias_of]
            out_refused.append((ops[0], ops[-1], reason, rules))
            g.dissolve(root)
    # Step 4. What is still apart is a refusal the user sees.
    out, seen = out_refused, set()
    for a, b, reason, rule in pending:
        if g.uf.find(a) != g.uf.find(b) and (a, b) not in seen:
            seen.add((a, b))
            out.append((g._name(a), g._name(b), reason, rule))
    return out


def _copy_group(g: _BlockGraph, root: int) -> bool:
    """A group of layout and elementwise ops (no reduction, no matmul) with at least one op that is not a free
    view (a group of views alone stays views: nothing to join)."""
    infos = g.group_infos(g.uf.members[root])
    return bool(infos) and R.check_sibling_copies(infos) is None and not all(m.view for m in infos)


def _join_sibling_copies(g: _BlockGraph, pending: list) -> None:
    """Rule ``sibling_copies``: for each group, the groups reading its outputs that are copy/elementwise groups
    (``_copy_group``) joined to the first of them in binding order, each pair through ``decide``.  The rule
    covers independent groups only: a pair where one leads to the other is no candidate (no refusal)."""
    for root in list(g.uf.members):
        members = g.uf.members.get(root)
        if members is None or not g.group_infos(members):
            continue
        readers, seen = [], {root}
        for k in sorted(members):
            for s in sorted(g.succs[k]):
                r = g.uf.find(s)
                if r in seen or not g.fusable(s):
                    continue
                seen.add(r)
                if _copy_group(g, r):
                    readers.append(g.node(s))
        for x in readers[1:]:
            first, other = g.uf.find(readers[0]), g.uf.find(x)
            if first == other or g.creates_cycle(set(g.uf.members[first]) | set(g.uf.members[other])) is not None:
                continue     # one reads the other (densenet's concats of one conv's output): not independent
            rule = _first_rule("horizontal", g.info[readers[0]], g.info[x])
            if rule is not None:
                _fuse(g, readers[0], x, rule, pending)


def _edge_views(g: _BlockGraph, members: set) -> list[int]:
    """The reshapes (``NodeInfo.view``) of a group that are not between two of its other ops: no path inside
    the group leads to them from an op that is no reshape, or none leads from them to one."""
    calls = [k for k in members if k not in g.alias_of and g.info[k] is not None]
    anchors = {k for k in calls if not g.info[k].view}
    if not anchors:
        return []

    def reach(start, step):
        seen, stack = set(start), list(start)
        while stack:
            for y in step[stack.pop()]:
                if y in members and y not in seen:
                    seen.add(y)
                    stack.append(y)
        return seen
    between = reach(anchors, g.succs) & reach(anchors, g.preds)
    return [k for k in calls if g.info[k].view and k not in between]


def _symbol_edge_views(g: _BlockGraph, members: set, edge: list[int]) -> list[int]:
    """The edge reshapes to take out: each connected run of ``edge`` (reshapes reading one another) that holds
    a reshape LegalizeOps passes a symbol as a scalar (``rules.scalar_arg``: ``[batch * C, 16, 4]``, no
    extent is ``batch`` alone, so its index remap divides by the symbol).  A whole run goes: what is left
    reads no taken-out reshape through a kept one, and stays acyclic."""
    left, out = set(edge), []
    while left:
        run, stack = set(), [left.pop()]
        while stack:
            k = stack.pop()
            run.add(k)
            for n in g.preds[k] | g.succs[k]:
                if n in left:
                    left.discard(n)
                    stack.append(n)
        if any(R.scalar_arg(a) for k in run for a in g.bindings[k].value.args[1].fields):
            out.extend(run)
    return sorted(out)


def _trim_edge_views(g: _BlockGraph, root: int, refused: list) -> None:
    """Take the edge reshapes passed a symbol (``_edge_views``, ``_symbol_edge_views``) out of a group: alone
    each is a free view (RewriteDataflowReshape), in the kernel an index remap by the symbol (``% batch``)
    that saves no kernel.  A reshape between two ops of the group stays (one kernel, not two: Swin's window
    reshapes around its shifted-window mask), and so does any other reshape (a static build's, a flatten of
    ``[batch, C, 1, 1]``: the symbolic build keeps the static build's groups).  Taking out ops no path of the
    group's other ops passes through leaves it acyclic; the rest is asked for a template family again (kept
    whole if none takes it)."""
    members = g.uf.members.get(root)
    if members is None or len(g.group_infos(members)) < 2:
        return
    member_set = set(members)
    edge = _symbol_edge_views(g, member_set, _edge_views(g, member_set))
    if not edge:
        return
    keep = member_set - set(edge) - {i for i, j in g.alias_of.items() if j in edge}
    infos = g.group_infos(keep)
    rules = g.group_rules.get(root, [])
    template, declined = g.group_template.get(root), g.group_declined.get(root, "")
    if len(infos) >= 2:
        formed = [R.RULES_BY_NAME[n] for n in rules]
        outs = g.outputs(keep)
        group = R.GroupInfo(infos, [g.info[k] for k in outs if g.info[k] is not None])
        template, reason, declined = R.check_template(formed[-1], group, g.target, tuple(formed[:-1]))
        if reason is not None:
            return
    g.group_rules.pop(root, None)
    g.group_template.pop(root, None)
    g.group_declined.pop(root, None)
    g.dissolve(root)
    keep_calls = sorted(k for k in keep if k not in g.alias_of)
    for k in keep_calls[1:]:
        g.uf.union(keep_calls[0], k)
    if len(infos) >= 2:
        new_root = g.uf.find(keep_calls[0])
        g.group_rules[new_root] = rules
        if template is not None:
            g.group_template[new_root] = template
        elif declined:
            g.group_declined[new_root] = declined
    why = ("not profitable: a reshape passed a symbol, at the edge of a group: alone a free view, in the "
           "kernel an index remap by the symbol")
    told = set()
    for k in edge:
        pairs = [(g.node(p), k) for p in sorted(g.preds[k]) if g.node(p) in member_set] + \
                [(k, g.node(s)) for s in sorted(g.succs[k]) if g.node(s) in member_set]
        for a, b in pairs[:1]:
            if (a, b) not in told:
                told.add((a, b))
                refused.append((g._name(a), g._name(b), why, "+".join(rules)))


# ----------------------------------------------------------------------------------------- rewriting
def _group_function(g: _BlockGraph, members: list[int], name: str, rule: str, template: str = ""):
    """The Primitive Relax function of one group and the outer arguments it is called with."""
    member_set = set(members)
    outer_args, params, pmap = [], [], {}
    for k in members:
        v = g.bindings[k].value
        if k in g.alias_of:
            continue
        for a in v.args[1].fields:
            if isinstance(a, C.relax.Var) and g.index.get(a) in member_set or R.scalar_arg(a):
                continue
            key = a
            if any(key.same_as(o) for o in outer_args):
                continue
            outer_args.append(a)
            p = C.relax.Var(f"p{len(params)}", C.type_of(a))
            params.append(p)
            pmap[a] = p
    outs = g.outputs(member_set)
    symbols = _undefined_symbols(g, members, params)
    if symbols:
        # the tensors it reads do not define every symbol its ops are sized by (a matmul's [batch * sequence,
        # N] reshaped to [batch, sequence, ...]): the symbols come in as one shape parameter, or FuseTIR
        # leaves the fused call's result shape unknown
        outer_args.append(C.relax.ShapeExpr(symbols))
        params.append(C.relax.Var(f"p{len(params)}", C.relax.ShapeType(symbols)))
    bb = C.BlockBuilder()
    attrs = {"Primitive": 1, "tvmfuse.rule": rule, **({"tvmfuse.template": template} if template else {})}
    with bb.function(name, params, attrs=attrs, private=True):
        with bb.dataflow():
            vmap = {}
            for k in members:
                b = g.bindings[k]
                v = b.value
                if k in g.alias_of:
                    new = C.relax.TupleGetItem(vmap[v.tuple_value], v.index)
                else:
                    args = [a if R.scalar_arg(a) else vmap[a] if (isinstance(a, C.relax.Var) and a in vmap) else
                            next(p for o, p in pmap.items() if o.same_as(a)) for a in v.args[1].fields]
                    new = C.relax.Call(v.op, [v.args[0], C.relax.Tuple(args)] + list(v.args[2:]), v.attrs,
                                       v.ty_args)
                vmap[b.var] = bb.emit(new, name_hint=C.var_name(b.var))
            ret = [vmap[g.bindings[k].var] for k in outs]
            result = bb.emit_output(ret[0] if len(ret) == 1 else C.relax.Tuple(ret))
        bb.emit_func_output(result)
    return bb.get()[name], outer_args, outs


def _undefined_symbols(g: _BlockGraph, members: list[int], params: list) -> list:
    """The symbolic vars that the group's ops use and no parameter's shape defines (a parameter defines
    the vars that are whole extents of its shape: ``batch`` in ``[batch, 64]``, not in ``[batch * 64]``),
    in order of first use."""
    defined = set()
    for p in params:
        defined |= {str(v.name) for v in C.relax.analysis.definable_tir_vars_in_type(C.type_of(p))}
    used = {}
    for k in members:
        b = g.bindings[k]
        tys = [C.type_of(b.var)]
        if k not in g.alias_of:      # the tensors it reads, and the symbols a call_tir passes (tir_vars)
            tys += [C.type_of(a) for a in b.value.args[1].fields] + [C.type_of(a) for a in b.value.args[2:]]
        found = [v for ty in tys for v in C.relax.analysis.tir_vars_in_type(ty)]
        if k not in g.alias_of:      # a symbolic scalar argument (``batch``) is its own expression
            for a in b.value.args[1].fields:
                if R.scalar_arg(a):
                    C.post_order_visit(a, lambda n: found.append(n) if isinstance(n, C.tirx.Var)
                                       and isinstance(C.type_of(n), C.PrimType) else None)
        for v in found:
            if str(v.name) not in defined:
                used.setdefault(str(v.name), v)
    return list(used.values())


def _group_name(g: _BlockGraph, members: list[int], taken: set) -> str:
    ops = [str(g.bindings[k].value.args[0].name_hint) for k in members if k not in g.alias_of]
    base = "fused_" + "_".join(ops)
    if len(base) > 64:
        base = base[:56] + f"_{len(ops)}ops"
    name, n = base, 1
    while name in taken:
        name, n = f"{base}_{n}", n + 1
    taken.add(name)
    return name


def _rewrite_block(g: _BlockGraph, mbb, taken: set, stats: list):
    groups = {}
    for root, members in g.uf.members.items():
        calls = [k for k in members if k not in g.alias_of and g.info[k] is not None]
        if len(calls) >= 2:
            groups[root] = sorted(members)
    if not groups:
        return None
    item_of = [g.uf.find(i) if g.uf.find(i) in groups else i for i in range(len(g.bindings))]
    items = sorted(set(item_of))
    first = {}
    for i, it in enumerate(item_of):
        first.setdefault(it, i)
    deps = {it: set() for it in items}
    for i in range(len(g.bindings)):
        for p in g.preds[i]:
            if item_of[p] != item_of[i]:
                deps[item_of[i]].add(item_of[p])
    users = {it: [] for it in items}
    for it, ds in deps.items():
        for d in ds:
            users[d].append(it)
    indeg = {it: len(ds) for it, ds in deps.items()}
    ready = [(first[it], it) for it in items if indeg[it] == 0]
    heapq.heapify(ready)
    new_bindings = []
    while ready:
        _, it = heapq.heappop(ready)
        if it in groups:
            members = groups[it]
            rule = "+".join(g.group_rules.get(it, []))
            name = _group_name(g, members, taken)
            template = g.group_template.get(it, "")
            func, outer_args, outs = _group_function(g, members, name, rule, template)
            gv = mbb.add_func(func, name)
            call = mbb.normalize(C.relax.Call(gv, outer_args))
            record_group(name, [op_name(str(g.bindings[k].value.args[0].name_hint)) for k in members
                                if k not in g.alias_of], rule, len(outs), template,
                         g.group_declined.get(it, ""))
            stats.append(name)
            if len(outs) == 1:
                new_bindings.append(C.relax.VarBinding(g.bindings[outs[0]].var, call))
            else:
                tv = C.relax.DataflowVar(name.replace("fused_", "t_")[:40], C.type_of(call))
                new_bindings.append(C.relax.VarBinding(tv, call))
                for idx, k in enumerate(outs):
                    new_bindings.append(C.relax.VarBinding(g.bindings[k].var,
                                                           mbb.normalize(C.relax.TupleGetItem(tv, idx))))
        else:
            new_bindings.append(g.bindings[it])
        for u in users[it]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(ready, (first[u], u))
    if len(new_bindings) < len(items):
        raise RuntimeError("tvmfuse.FuseGroups: the group graph has a cycle (legality check broken)")
    return C.relax.DataflowBlock(new_bindings)


@C.module_pass(opt_level=0, name="tvmfuse.FuseGroups")
class FuseGroups:
    """Group the legalized module's call_tir ops by tvmfuse's rules into Primitive functions."""

    def __init__(self, target=None, limits: R.TargetLimits | None = None):
        self.limits = limits or R.limits_for(target)
        self.target = target

    def transform_module(self, mod, _ctx):
        mbb = C.BlockBuilder(mod)
        taken = {str(gv.name_hint) for gv in mod.get_global_vars()}
        stats = []

        def fuse(block):
            g = _BlockGraph(mod, block, self.limits, self.target)
            for producer, consumer, reason, rule in partition(g):
                record_refusal(producer, consumer, reason, rule)
            return _rewrite_block(g, mbb, taken, stats)

        out = rewrite_dataflow_blocks(mod, mbb, fuse)
        log.debug("tvmfuse.FuseGroups: %d groups", len(stats))
        return out


def rewrite_dataflow_blocks(mod, mbb, rewrite) -> C.IRModule:
    """``mod`` with each dataflow block of each Relax function (not a fused kernel's Primitive function, and
    with a SeqExpr body) replaced by ``rewrite(block)``, a new block or None (unchanged); the functions ``mbb``
    gained are added (with_functions).  Shared by FuseGroups and rewrites.OutputReshapeView."""
    updates = {}
    for gv, func in mod.functions.items():
        if not isinstance(func, C.relax.Function) or (func.attrs and "Primitive" in func.attrs):
            continue
        body = func.body
        if not isinstance(body, C.relax.SeqExpr):
            continue
        blocks, changed = [], False
        for block in body.blocks:
            new = rewrite(block) if isinstance(block, C.relax.DataflowBlock) else None
            blocks.append(block if new is None else new)
            changed |= new is not None
        if changed:
            updates[gv] = C.relax.Function(func.params, C.relax.SeqExpr(blocks, body.body), func.ret_ty,
                                           func.is_pure, func.attrs, func.span)
    return with_functions(mod, mbb, updates)


def with_functions(mod, mbb, updates: dict):
    """``mod`` with the functions ``mbb`` added (new kernels) and ``updates`` (gv -> function) replaced; the
    module itself when nothing changed.  Shared by the passes that rewrite Relax functions."""
    if not updates:
        return mod
    out = mbb.get()
    for gv, func in updates.items():
        out[gv] = func
    return out
