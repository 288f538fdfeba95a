import json, sys, time, numpy as np
from tvmfuse import _compat as C
from tvmfuse.schedules import schedule_prim_func
from tvmfuse.target import parse_target
funcs=json.load(open('/tmp/d14/funcs.json'))
def load(name):
    return C.parse_script(funcs[name])
def shapes(func, sizes):
    ana=C.Analyzer()
    out=[]
    for p in func.params:
        if p in func.buffer_map:
            buf=func.buffer_map[p]
            s=[]
            for e in buf.shape:
                for v,val in sizes.items():
                    pass
                s.append(e)
            out.append(('buf',buf))
        else:
            out.append(('var',p))
    return out
def evalx(e, sizes):
    vars_={}
    def vis(n):
        if isinstance(n, C.tirx.Var): vars_.setdefault(str(n.name), n)
    C.post_order_visit(e, vis)
    ana=C.Analyzer()
    for n,v in vars_.items(): ana.bind(v, C.tirx.IntImm(str(v.ty), sizes[n]))
    return int(ana.simplify(e))
def run(name, sizes, tgt, show=False, number=50, func=None):
    func = func or load(name)
    with tgt:
        s = schedule_prim_func(func, tgt, name=name)
    if s is None:
        from tvmfuse.schedules.cpu.generic import schedule_generic
        with tgt: f = schedule_generic(func, tgt)[0]
        class _S: template='cpu.generic'
        s=_S()
    else:
        f = s.func
    if show: print(f.script())
    mod = C.IRModule({"main": f.with_attr("global_symbol","main")})
    lib = C.build_prim_module(mod, tgt)
    dev = C.cpu()
    args=[]; arrs=[]
    rng=np.random.default_rng(0)
    for p in f.params:
        if hasattr(p,'shape'):
            shp=[evalx(e,sizes) for e in p.shape]
            a=(rng.standard_normal(shp).astype('float32') if 'float' in str(p.dtype) else rng.integers(0,32,shp).astype(str(p.dtype))); arrs.append(a); args.append(C.tensor(a, dev))
        else:
            arrs.append(sizes[str(p.name)]); args.append(sizes[str(p.name)])
    lib["main"](*args)
    fn=lib["main"]; res=[]
    for r in range(7):
        t0=time.perf_counter()
        for _ in range(number): fn(*args)
        res.append((time.perf_counter()-t0)/number)
    return s.template, min(res)*1e6, [a.numpy() if hasattr(a,'numpy') else a for a in args]
if __name__=="__main__":
    tgt=parse_target(None)
    for name in sys.argv[1:]:
        for sizes in ({"batch":1,"sequence":128},{"batch":1,"sequence":17},{"batch":8,"sequence":17}):
            fam,us,_=run(name,sizes,tgt)
            print(name, sizes, fam, f"{us:.1f} us")
