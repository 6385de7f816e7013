#!/bin/bash
# pin.sh BENCH_PID: the bench stack's decode worker alone on CPU 0, every other process of the bench on CPU 1
b=$1
for i in $(seq 120); do
  d=$(ps -eo pid,ppid,args | awk -v b=$b '$2==b && /services.decode/ {print $1}')
  [ -n "$d" ] && break; sleep 1
done
sleep 3
for p in $(ps -eo pid,ppid | awk -v b=$b '$2==b {print $1}') $b; do
  if [ "$p" = "$d" ]; then taskset -a -p 0x1 $p >/dev/null; else taskset -a -p 0x2 $p >/dev/null; fi
done
echo "decode $d on cpu0; others on cpu1"
taskset -p $d; 
