#!/usr/bin/env bash
# The full regression cases (regression/cases/*, category full: layout equivalence on every grid
# of up to 8 ranks) through regression/run. Labelled full in regression/CMakeLists.txt, so
# `make test-quick` leaves it out. numpy/h5py come from Makefile.inc's DEBIAN_PACKAGES: without
# them the test skips, unless it runs as root (then it fails).
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
py=/usr/bin/python3
if ! "$py" -c 'import numpy, h5py, tomllib' 2>/dev/null; then
  if [ "$(id -u)" = 0 ]; then echo "FAIL: $py lacks numpy/h5py/tomllib" >&2; exit 1; fi
  echo "SKIP: regression_full: $py lacks numpy/h5py/tomllib"; exit 0
fi
exec "$PTRAIN_SOURCE_DIR/regression/run" --category full
