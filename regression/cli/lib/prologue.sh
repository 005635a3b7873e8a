# Sourced first by every regression/cli/*.sh test: strict mode, the variables ctest passes
# (PTRAIN, PTRAIN_SOURCE_DIR, MPIEXEC, MPIEXEC_PREFLAGS), fail, launch, and a temporary
# folder $tmp removed at exit together with any process still running from it.
set -euo pipefail
: "${PTRAIN:?}" "${PTRAIN_SOURCE_DIR:?}" "${MPIEXEC:=mpirun}" "${MPIEXEC_PREFLAGS:=}"
fail() { echo "FAIL: $*" >&2; exit 1; }
launch() { "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$@"; }  # launch NP COMMAND...
tmp=$(mktemp -d)
trap 'pkill -9 -f "$tmp" 2>/dev/null || true; rm -rf "$tmp"' EXIT
