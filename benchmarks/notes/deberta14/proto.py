import sys, time, numpy as np
sys.path.insert(0,'/tmp/d14'); import harness as H
from tvmfuse import _compat as C
from tvmfuse.schedules.cpu import common as U
from tvmfuse.schedules.cpu import matmul as MM
from tvmfuse.schedules.cpu.symbolic import _own_intermediates

def sched(func, mr=4, nvec=2, lanes=8, hint=True, par=True, own=True, unit=False):
    sch = C.Schedule(func)
    U.inline_elementwise(sch)
    reds = [b for b in U.top_blocks(sch) if U.is_reduction(sch, b)]
    red = reds[0]
    outs = [b for b in U.top_blocks(sch) if not U.is_reduction(sch, b)]
    epi = outs[0] if outs else sch.cache_write(red, 0, "global")
    loops = sch.get_loops(epi)
    b_loops, i_loop, j_loop = loops[:-2], loops[-2], loops[-1]
    nr = nvec * lanes
    if unit:
        io, i1, ii = sch.split(i_loop, factors=[None, 1, mr])
        jo, j1, ji = sch.split(j_loop, factors=[None, 1, nr])
        sch.reorder(*b_loops, io, jo, i1, j1, ii, ji)
    else:
        io, ii = sch.split(i_loop, factors=[None, mr])
        jo, ji = sch.split(j_loop, factors=[None, nr])
        sch.reorder(*b_loops, io, jo, ii, ji)
        j1 = jo
    b = sch.fuse(*b_loops) if len(b_loops) > 1 else b_loops[0]
    if par: sch.parallel(b)
    MM.compute_on_register_tile(sch, red, j1, lanes, 1)
    e_jo, e_jv = sch.split(ji, factors=[None, lanes])
    sch.vectorize(e_jv)
    if hint:
        for lp in (io, jo):
            sch.annotate(lp, "pragma_loop_partition_hint", 1)
    if own: _own_intermediates(sch)
    return sch.mod["main"]

def bench(f, sizes, number=50):
    lib = C.build_prim_module(C.IRModule({"main": f.with_attr("global_symbol","main")}), H.parse_target(None))
    rng=np.random.default_rng(1); args=[]
    for p in f.params:
        if hasattr(p,'shape'):
            a=rng.standard_normal([H.evalx(e,sizes) for e in p.shape]).astype('float32'); args.append(C.tensor(a))
        else: args.append(sizes[str(p.name)])
    fn=lib["main"]; fn(*args); res=[]
    for r in range(7):
        t0=time.perf_counter()
        for _ in range(number): fn(*args)
        res.append((time.perf_counter()-t0)/number)
    return min(res)*1e6, args
def ref(name, args):
    a=[x.numpy() if hasattr(x,'numpy') else x for x in args]
    if name=='fused_matmul2_add5': return a[0]@a[1]+a[2], a[-1]
    if name=='matmul3': return a[0]@a[1], a[-1]
    if name=='matmul1': return a[0]@a[1][None], a[-1]

if __name__=="__main__":
    tgt=H.parse_target(None)
    for name in sys.argv[1:2]:
        f=H.load(name)
        for kw in eval(sys.argv[2]):
            try:
                with tgt: g=sched(f, **kw)
            except Exception as e:
                print(name, kw, 'FAIL', str(e).splitlines()[-1][:200]); continue
            for sizes in ({"batch":1,"sequence":128},{"batch":1,"sequence":17},{"batch":8,"sequence":17}):
                try:
                    us,args=bench(g,sizes)
                except Exception as e:
                    print(name, kw, 'BUILD FAIL', str(e).splitlines()[-1][:200]); break
                exp,got=ref(name,args)
                err=np.abs(exp-got).max()/np.abs(exp).max()
                print(name, kw, sizes, f"{us:.1f} us err {err:.1e}")
