#!/usr/bin/env bash
# The whole machine's busy CPU while a command runs, from /proc/stat: the number docs/status.md #16
# compares between whole `.ci/run`s (on 2 cores the suite is CPU-bound, so its wall time follows this).
#
#   benchmarks/cpu_busy.sh .ci/run
#
# Prints a line every 10 s (busy %, load average) and at the end the busy CPU-seconds over the
# command's run (user+nice+system+irq+softirq+steal, all cores). Cheap: one read of /proc/stat per line.
set -uo pipefail
read_stat() { read -r _ u n s i w q sq st _ < /proc/stat; busy=$((u + n + s + q + sq + st)); all=$((busy + i + w)); }
hz=$(getconf CLK_TCK)
read_stat; b0=$busy; pb=$busy; pa=$all
"$@" & pid=$!
while kill -0 "$pid" 2>/dev/null; do
  sleep 10
  read_stat
  echo "cpu_busy: $(date +%T) busy $(( 100 * (busy - pb) / (all - pa > 0 ? all - pa : 1) ))% load $(cut -d' ' -f1 /proc/loadavg)" >&2
  pb=$busy; pa=$all
done
wait "$pid"; rc=$?
read_stat
echo "cpu_busy: $(( (busy - b0) / hz )) CPU-s busy while the command ran (exit $rc)" >&2
exit $rc
