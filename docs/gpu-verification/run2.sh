#!/bin/bash
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 CTL_TIMEOUT=12
T0=$(date +%s)
timeout 150 python3 docs/gpu-verification/probe2.py raw > $OUT/raw2.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/raw2.log
timeout 200 python3 docs/gpu-verification/probe2.py reamer > $OUT/reamer2.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/reamer2.log
timeout 120 python3 -m pytest tests/gpu -q -p no:cacheprovider > $OUT/pytest.log 2>&1; echo "rc=$? t=$(( $(date +%s)-T0 ))" >> $OUT/pytest.log
for f in $OUT/*.log; do echo "== $f"; tail -c 1200 $f; done
