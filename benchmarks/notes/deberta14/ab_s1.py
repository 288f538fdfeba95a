import sys; sys.path.insert(0,'/tmp/d14'); import harness as H
tgt=H.parse_target(None)
for name in ['fused_matmul2_add5','matmul3','matmul1']:
    for sz in ({"batch":1,"sequence":1},{"batch":1,"sequence":17}):
        fam,us,_=H.run(name,sz,tgt, number=200)
        print(name[:30],sz,fam,round(us,2))
