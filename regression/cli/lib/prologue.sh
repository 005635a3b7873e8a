# Sourced first by every regression/cli/*.sh test: strict mode, the variables ctest passes
# (PTRAIN, PTRAIN_SOURCE_DIR, MPIEXEC, MPIEXEC_PREFLAGS), fail, launch, and a temporary
# folder $tmp removed at exit together with any process still running from it.
set -euo pipefail
: "${PTRAIN:?}" "${PTRAIN_SOURCE_DIR:?}" "${MPIEXEC:=mpirun}" "${MPIEXEC_PREFLAGS:=}"
fail() { echo "FAIL: $*" >&2; exit 1; }
launch() { "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$@"; }  # launch NP COMMAND...
# stops_with NAME LINE NP DECK [--set ...]: ptrain on NP ranks (120 s at most) writing into
# $tmp/NAME, its output in $tmp/NAME.log, must stop as an error every rank agreed on does:
# exit 1, LINE exactly once, no MPI_Abort banner.
stops_with() {
  local name=$1 line=$2 np=$3 rc=0
  shift 3
  timeout 120 "$MPIEXEC" $MPIEXEC_PREFLAGS -np "$np" "$PTRAIN" "$@" \
    --set run%out_dir="'$tmp/$name'" >"$tmp/$name.log" 2>&1 || rc=$?
  [ "$rc" = 1 ] || fail "$name: exit $rc, expected 1: $(tail -3 "$tmp/$name.log")"
  [ "$(grep -cxF -- "$line" "$tmp/$name.log")" = 1 ] ||
    fail "$name: not once '$line': $(grep -iE 'error|differ' "$tmp/$name.log" | head -3)"
  if grep -q "MPI_ABORT" "$tmp/$name.log"; then fail "$name: MPI_Abort banner"; fi
}
tmp=$(mktemp -d)
trap 'pkill -9 -f "$tmp" 2>/dev/null || true; rm -rf "$tmp"' EXIT
