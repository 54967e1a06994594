#!/bin/bash
# One device call: plain training bench, raw MPS probe, reamer's own code.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
T0=$(date +%s)
{ nvidia-smi; uname -r; python3 -c "import torch, pynvml, cupy; print(torch.__version__, torch.version.cuda, pynvml.__file__, cupy.__version__)";
  python3 -m pip show nvidia-ml-py 2>/dev/null | head -2; cat /proc/driver/nvidia/version; ls /sys/fs/cgroup | head; } > $OUT/sysinfo.txt 2>&1
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  timeout 90 python3 bench/train_gpu_pytorch.py --iterations 40 --report $OUT/train_plain.json > $OUT/train.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/train.log
fi
if [ "${SKIP_RAW:-0}" != 1 ]; then
  timeout ${RAW_S:-250} python3 docs/gpu-verification/probe_mps.py > $OUT/raw.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/raw.log
fi
timeout ${REAMER_S:-200} python3 docs/gpu-verification/probe_reamer.py > $OUT/reamer.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/reamer.log
for f in $OUT/*.log; do echo "== $f"; tail -c 1500 $f; done
