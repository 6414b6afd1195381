#!/bin/sh
# Runs the Python client's tests (tests/python) against a real zipcached.
#
#   python/run_tests.sh [pytest args...]
#
# Uses Debian's interpreter (python3-numpy, python3-pytest), not whatever
# python3 comes first on PATH: a pyenv one has no numpy. Override with
# PYTHON=... . ZC_BUILD_DIR picks the build (default: build/ of this
# checkout); the library and daemon must already be built (`make`).
# Exits with pytest's status; pytest's last line is the summary.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
root=$(dirname "$here")
PYTHON=${PYTHON:-/usr/bin/python3}
: "${ZC_BUILD_DIR:=$root/build}"
export ZC_BUILD_DIR
export ZIPCACHE_LIBRARY="${ZIPCACHE_LIBRARY:-$ZC_BUILD_DIR/lib/libzipcache.so}"
if ! "$PYTHON" -c 'import numpy, pytest' 2>/dev/null; then
	echo "run_tests.sh: $PYTHON lacks numpy or pytest (apt-get install python3-numpy python3-pytest)" >&2
	exit 2
fi
# -p no:cacheprovider: leave no .pytest_cache in the source tree.
export PYTHONDONTWRITEBYTECODE=1
exec "$PYTHON" -m pytest -p no:cacheprovider -q -rfE "$root/tests/python" "$@"
