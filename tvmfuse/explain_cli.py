"""``tvmfuse explain MODEL.onnx``: the fusion groups formed and, per refused pair, why.

Runs the graph stage only (pre-legalize rewrites, legalization, grouping, FuseTIR); nothing is built, so it is
quick on big models and shows the decisions of the rules, not of the schedules.  Like ``tvmfuse.compile``,
a failure inside TVM's FuseTIR leaves the module unfused and is listed as a refusal (not a traceback).
"""
from __future__ import annotations

import json
from dataclasses import replace

LEGEND = ("ops are named op(relax var of its result); a refusal names the producer -> consumer pair "
          "(or two siblings reading one tensor), the rule that considered it, and why it did not fuse")


def explain(model, target=None, input_shapes: dict | None = None, **option_overrides) -> dict:
    """Groups and refusals of ``model`` (path, ModelProto or IRModule) under tvmfuse's rules;
    ``input_shapes`` pins input shapes / symbolic dims as in ``tvmfuse.compile``."""
    from . import _compat as C
    from .explain import Recorder
    from .frontend import load_onnx, read_model
    from .pipeline import PipelineOptions, Stages
    from .report import fused_groups, graph_stats
    from .target import parse_target

    tgt = parse_target(target)
    options = replace(PipelineOptions(), **option_overrides)
    if isinstance(model, C.IRModule) and input_shapes:
        from .errors import InputError

        raise InputError("input_shapes applies to ONNX models, not to an IRModule")
    mod = model if isinstance(model, C.IRModule) else load_onnx(read_model(model), input_shapes=input_shapes)
    with tgt:
        stages = Stages(tgt, options)
        unfused = C.Sequential(stages.unfused_view(), name="tvmfuse.explain.unfused")(mod)
        with Recorder() as rec:
            fused = C.Sequential(stages.graph(), name="tvmfuse.explain.graph")(mod)
    mcpu = str(tgt.attrs["mcpu"]) if "mcpu" in tgt.attrs else ""
    return {"target": str(tgt.kind.name) + (f" ({mcpu})" if mcpu else ""),
            "kernels_unfused": graph_stats(unfused, fold_constant_calls=True).kernels, "kernels_fused": graph_stats(fused).kernels,
            "groups": fused_groups(rec.groups), "refused": list(rec.refused)}


def format_explain(name: str, d: dict) -> str:
    rows = [f"tvmfuse explain: {name}  [{d['target']}]",
            f"kernels: {d['kernels_unfused']} unfused (one per op) -> {d['kernels_fused']} with tvmfuse's groups",
            f"({LEGEND})",
            f"groups formed ({len(d['groups'])}):"]
    for g in d["groups"]:
        outs = f", {g['outputs']} outputs" if g.get("outputs", 1) > 1 else ""
        by = f" -> {g['template']}" if g.get("template") else ""      # the family that accepted the group
        if g.get("declined"):          # none did: the kernel gets the first template matching it, or the fallback
            by = f" -> no family accepted it ({g['declined']})"
        rows.append(f"  {g['kernel']}: {' + '.join(g['ops'])}  [{g['rule']}{outs}]{by}")
    if not d["groups"]:
        rows.append("  (none)")
    rows.append(f"refused fusions ({len(d['refused'])}):")
    for r in d["refused"]:
        rule = f" [{r['rule']}]" if r.get("rule") else " [no rule]"
        rows.append(f"  {r['producer']} -> {r['consumer']}{rule}: {r['reason']}")
    if not d["refused"]:
        rows.append("  (none)")
    return "\n".join(rows)


def cmd_explain(args) -> int:
    import os

    from .compiled import input_shapes_of

    d = explain(args.model, target=args.target, input_shapes=input_shapes_of(args))
    if args.json:
        print(json.dumps({"model": args.model, **d}, indent=2))
    else:
        print(format_explain(os.path.basename(args.model), d))
    return 0


def add_commands(subparsers) -> None:
    from .compiled import add_compile_options

    p = subparsers.add_parser("explain", help="list the fusion groups formed and why each refused pair was refused")
    add_compile_options(p, tuning_log=False)
    p.add_argument("--json", action="store_true", help="print groups and refusals as JSON")
    p.set_defaults(func=cmd_explain)
