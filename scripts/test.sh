#!/usr/bin/env bash
# The test suite (33-47 minutes on 2 cores, as the README says, plus the first install): bash scripts/test.sh [pytest options...]
# Runs on TEST_WORKERS pytest-xdist workers (default 2), each taking whole test modules (--dist loadfile),
# so that one module's DeepSpeed launches share their module's fixtures and two modules' launches overlap:
# much of a launch's time is waiting (a rendezvous, a timeout, a process starting) rather than computing.
# TEST_WORKERS=0 runs in this process, one test after another (for --pdb, say); a later -n in the options
# wins. Fails when a test fails and when no test ran.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS=dev source "$ROOT/scripts/env.sh"
cd "$ROOT"
set +e
python -m pytest -n "${TEST_WORKERS:-2}" --dist loadfile "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
