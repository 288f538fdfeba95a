import sys, time, numpy as np
sys.path.insert(0,'/tmp/d14'); import harness as H, proto as P
from tvmfuse import _compat as C
from tvmfuse.schedules.cpu import common as U
from tvmfuse.schedules.cpu import matmul as MM
from tvmfuse.schedules.cpu.symbolic import _own_intermediates

def sched(func, mr=4, nvec=2, lanes=8, par=True, own=True, padi=True, padj=True, hint=True):
    sch = C.Schedule(func)
    U.inline_elementwise(sch)
    red = [b for b in U.top_blocks(sch) if U.is_reduction(sch, b)][0]
    nit = len(sch.get(red).iter_vars)
    padding = [1]*nit; 
    if padi: padding[nit-3] = mr
    if padj: padding[nit-2] = mvec = nvec*lanes
    before = {U.block_name(sch, b) for b in U.top_blocks(sch)}
    sch.pad_einsum(red, padding)
    new = [b for b in U.top_blocks(sch) if U.block_name(sch, b) not in before]
    outs = U.output_names(sch)
    crop = [b for b in new if any(U.block_name(sch,p)==U.block_name(sch,red) for p in sch.get_producers(b))]
    pads = [b for b in new if b not in crop]
    pad_names=[U.block_name(sch,b) for b in pads]
    if U.block_name(sch, crop[0]) not in outs:
        sch.compute_inline(crop[0])
        epi = [b for b in U.top_blocks(sch) if U.block_name(sch,b) in outs][0]
    else:
        epi = crop[0]
    loops = sch.get_loops(epi)
    b_loops, i_loop, j_loop = loops[:-2], loops[-2], loops[-1]
    nr = nvec * lanes
    io, ii = sch.split(i_loop, factors=[None, mr])
    jo, ji = sch.split(j_loop, factors=[None, nr])
    sch.reorder(*b_loops, io, jo, ii, ji)
    b = sch.fuse(*b_loops) if len(b_loops) > 1 else b_loops[0]
    if par: sch.parallel(b)
    MM.compute_on_register_tile(sch, red, jo, lanes, 1)
    e_jo, e_jv = sch.split(ji, factors=[None, lanes])
    sch.vectorize(e_jv)
    for n in pad_names:
        pb = sch.get_sblock(n)
        sch.compute_at(pb, b, preserve_unit_loops=True)
        U.vectorize_inner(sch, pb, lanes)
    if hint:
        for lp in (io, jo):
            sch.annotate(lp, "pragma_loop_partition_hint", 1)
    if own: _own_intermediates(sch)
    return sch.mod["main"]

if __name__=="__main__":
    tgt=H.parse_target(None)
    name=sys.argv[1]
    f=H.load(name)
    for kw in eval(sys.argv[2]):
        try:
            with tgt: g=sched(f, **kw)
        except Exception as e:
            import traceback; traceback.print_exc()
            print(name, kw, 'FAIL', str(e).splitlines()[-1][:300]); continue
        if len(sys.argv)>3: print(g.script())
        for sizes in ({"batch":1,"sequence":128},{"batch":1,"sequence":17},{"batch":8,"sequence":17}):
            try:
                us,args=P.bench(g,sizes)
            except Exception as e:
                print(name, kw, 'BUILD FAIL', str(e).splitlines()[-1][:200]); break
            exp,got=P.ref(name,args)
            err=np.abs(exp-got).max()/np.abs(exp).max()
            print(name, kw, sizes, f"{us:.1f} us err {err:.1e}")
