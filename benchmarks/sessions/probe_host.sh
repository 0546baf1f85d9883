#!/usr/bin/env bash
# What a GPU machine offers, written before a session's runs, and a host made ready for them:
#   bash benchmarks/sessions/probe_host.sh NEED_GIB
# Prints the GPUs' links (nvidia-smi topo), NUMA nodes, cores, /dev/shm and memory. Then:
# - /dev/shm smaller than NEED_GIB is remounted at NEED_GIB (as root);
# - a VM whose memory grows as it is used (the lent multi-GPU machines report 31 GiB at start and
#   grow about 8 GiB per 3 s) would make SlideDP's store refuse to start ("the host has only N GiB
#   available"), so memory is touched up to NEED_GIB first and released.
set -u
need=${1:-120}
nvidia-smi --query-gpu=index,name,pci.bus_id,memory.total --format=csv
nvidia-smi topo -m
lscpu | grep -E '^(CPU\(s\)|NUMA node|Model name|Socket)'
python3 -c 'import torch; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count())'
df -h /dev/shm
shm=$(df --output=size -BG /dev/shm | tail -1 | tr -dc 0-9)
if [ "$shm" -lt "$need" ]; then mount -o remount,size=${need}G /dev/shm && df -h /dev/shm; fi
python3 - "$need" <<'PY'
import sys, time
import numpy as np, psutil
need = int(sys.argv[1]) << 30
vm = psutil.virtual_memory()
print(f"memory: total {vm.total / 2**30:.1f} GiB, available {vm.available / 2**30:.1f} GiB")
if vm.available < need:
    t0, held = time.time(), []
    while psutil.virtual_memory().available < need and sum(a.nbytes for a in held) < need:
        held.append(np.ones(1 << 30, dtype=np.int64))  # 8 GiB, touched
    del held
    vm = psutil.virtual_memory()
    print(f"grew in {time.time() - t0:.0f} s: total {vm.total / 2**30:.1f} GiB, available {vm.available / 2**30:.1f} GiB")
PY
