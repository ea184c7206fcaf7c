#!/usr/bin/env bash
# The test suite (about 21 minutes on 2 cores, plus the first install): bash scripts/test.sh [pytest options...]
# Fails when a test fails and when no test ran.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXTRAS=dev source "$ROOT/scripts/env.sh"
cd "$ROOT"
set +e
python -m pytest "$@"
rc=$?
set -e
if [ $rc -eq 5 ]; then
  echo "error: pytest collected no tests" >&2
  exit 1
fi
exit $rc
