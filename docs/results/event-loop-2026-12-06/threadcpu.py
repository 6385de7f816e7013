import os, sys, time
pid=int(sys.argv[1]); out=open(sys.argv[2],'w')
hz=os.sysconf('SC_CLK_TCK')
prev={}
while os.path.exists(f'/proc/{pid}'):
    now={}
    for t in os.listdir(f'/proc/{pid}/task'):
        try:
            f=open(f'/proc/{pid}/task/{t}/stat').read().rsplit(')',1)[1].split()
            now[int(t)]=(int(f[11])+int(f[12]))/hz
        except Exception: pass
    row={t:now[t]-prev.get(t,now[t]) for t in now}
    out.write(f"{time.time():.1f} "+" ".join(f"{t}:{d:.2f}" for t,d in sorted(row.items()) if d>0)+"\n"); out.flush()
    prev=now; time.sleep(1)
