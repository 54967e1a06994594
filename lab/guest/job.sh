#!/bin/bash
# Runs inside the lab VM (started by /usr/local/sbin/reamer-lab-boot): tests/hosts/ with the shared
# virtualenv, its JUnit report and the evidence (journal, dmesg, lscpu) into the report share $1.
out=$1
arg() { local w; for w in $(cat /proc/cmdline); do case $w in "reamer_lab.$1="*) echo "${w#*=}"; return;; esac; done; }
checkout=$(arg checkout)
profile=$(arg profile)
cd "$checkout" || exit 2
export REAMER_LAB_PROFILE="$profile" REAMER_LAB_OUT="$out" PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
set -a; . "$out/lab.env"; set +a   # REAMER_LAB_MODELS
# Leave the VM 60 s to collect the evidence and power off before the host's limit.
deadline=$(( $(cat "$out/deadline-s" 2>/dev/null || echo 900) - 60 - ${SECONDS} ))
mapfile -t extra < <(grep -v '^$' "$out/pytest-args" 2>/dev/null)
echo "profile=$profile kernel=$(uname -r) cgroup=$(stat -fc %T /sys/fs/cgroup) pid1=$(cat /proc/1/comm) budget=${deadline}s"
timeout --kill-after=20 "$deadline" "$checkout/.venv/bin/python" -m pytest -p no:cacheprovider -p no:randomly \
  -o junit_suite_name="hosts-$profile" -o junit_family=xunit1 --junitxml="$out/junit.xml" -rA \
  --timeout=600 --durations=12 tests/hosts "${extra[@]}" > "$out/pytest.log" 2>&1
rc=$?
echo "pytest rc=$rc"
journalctl -b --no-pager -u reamer > "$out/journal-reamer.txt" 2>&1
journalctl -b --no-pager -p warning > "$out/journal-warnings.txt" 2>&1
dmesg > "$out/dmesg.txt" 2>&1
lscpu > "$out/lscpu.txt" 2>&1
systemctl --failed --no-pager > "$out/systemd-failed.txt" 2>&1
exit $rc
