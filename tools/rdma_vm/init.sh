#!/bin/sh
# /init of the Soft-RoCE test guest: bring up rxe0, mount the project and the control share, run
# /ctl/cmd.sh with its output on the second serial port, leave its exit code in /ctl/rc, power off.
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
ulimit -l unlimited  # memory registration pins pages
for m in crc32_generic crc32_pclmul virtio_pci 9pnet_virtio 9p dummy rdma_rxe ib_uverbs rdma_ucm; do
  modprobe "$m" 2>/dev/null
done
ip link set lo up
ip link add dummy0 type dummy 2>/dev/null  # loading the module may already have made it
ip link set dummy0 up
rdma link add rxe0 type rxe netdev dummy0
i=0; while [ ! -e /dev/infiniband/uverbs0 ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i+1)); done
mkdir -p /work /ctl
mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 work /work
mount -t 9p -o trans=virtio,version=9p2000.L ctl /ctl
cd /work
timeout "${GUEST_TIMEOUT:-600}" sh /ctl/cmd.sh > /dev/ttyS1 2>&1
echo $? > /ctl/rc
sync
echo o > /proc/sysrq-trigger
sleep 5
