import sys; sys.path.insert(0,'/tmp/d14'); import harness as H
tgt=H.parse_target(None)
for name in sys.argv[1:]:
    for sz in ({"batch":1,"sequence":128},{"batch":8,"sequence":17}):
        fam,us,_=H.run(name,sz,tgt, number=10)
        print(name[:40],sz,fam,round(us,1))
