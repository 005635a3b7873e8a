#!/usr/bin/env bash
# backend%threads (issue 16): the rank's threads go to the host kernels (Kokkos OpenMP, or
# beside a Serial Kokkos ptrain's own OpenMP threads; a build without OpenMP runs them on one)
# and to BLAS, which take turns; backend%blas_threads
# overrides BLAS's share; the default is cores per node / ranks per node. An fp64 run gives
# the same losses and gradient norms with 1 and 2 threads to 1e-12 (OpenMP reductions may
# add in another order), whichever Kokkos backend this build has. With OpenMP kernels and
# pthreaded OpenBLAS, a warning names OPENBLAS_THREAD_TIMEOUT and OMP_WAIT_POLICY when unset.
source "$(dirname "${BASH_SOURCE[0]}")/lib/prologue.sh"
source "$(dirname "${BASH_SOURCE[0]}")/lib/compare.sh"
deck="$PTRAIN_SOURCE_DIR/input/tiny.nml"
common=(--set model%dtype="'fp64'" --set run%steps=12 --set run%log_every=4 --set run%eval_every=6
        --set backend%peak_gflops=1)
run() {  # run NAME OPTIONS...: one rank
  local name=$1; shift
  "$PTRAIN" "$deck" "${common[@]}" --set run%out_dir="'$tmp/$name'" "$@" >"$tmp/$name.log" 2>&1 ||
    fail "$name: $(tail -3 "$tmp/$name.log")"
  grep -m1 "^threads: " "$tmp/$name.log"
}
line1=$(run t1 --set backend%threads=1)
line2=$(run t2 --set backend%threads=2)
line3=$(run t2b1 --set backend%threads=2 --set backend%blas_threads=1)
echo "$line1"; echo "$line2"; echo "$line3"
space=$(sed -n 's/.*host kernels on \([A-Za-z]*\) with.*/\1/p' <<<"$line2")
[[ "$line1" == "threads: 1 per rank; host kernels on $space with 1, BLAS 1 ("*")" ]] || fail "threads=1: $line1"
if [ "$space" = Serial ]; then want=1; else want=2; fi
[[ "$line2" == "threads: 2 per rank; host kernels on $space with $want, BLAS 2 ("*")" ]] || fail "threads=2: $line2"
[[ "$line3" == "threads: 2 per rank; host kernels on $space with $want, BLAS 1 ("*")" ]] || fail "blas_threads: $line3"
# Spinning BLAS or OpenMP threads beside threaded kernels: warned of, unless both variables are set.
if [ "$want" = 2 ] && [[ "$line2" == *"(OpenBLAS, pthreads)" ]] && [ -z "${OPENBLAS_THREAD_TIMEOUT:-}" ]; then
  grep -q "export OPENBLAS_THREAD_TIMEOUT=4" "$tmp/t2.log" || fail "no warning of OpenBLAS's spinning threads"
  grep -q "OPENBLAS_THREAD_TIMEOUT" "$tmp/t2b1.log" && fail "warned with one BLAS thread"
  OPENBLAS_THREAD_TIMEOUT=4 run t2to --set backend%threads=2 >/dev/null
  grep -q "export OMP_WAIT_POLICY=PASSIVE before" "$tmp/t2to.log" || fail "not warned of OMP_WAIT_POLICY alone"
  OPENBLAS_THREAD_TIMEOUT=4 OMP_WAIT_POLICY=passive run t2quiet --set backend%threads=2 >/dev/null
  grep -q "spin" "$tmp/t2quiet.log" && fail "warned with both set"
  echo "threads: spinning BLAS or OpenMP threads are warned of, and not once both are set"
fi

# The default: the node's cores shared by its ranks (never fewer than one).
cores=$(getconf _NPROCESSORS_ONLN)
line=$(run default)
[[ "$line" == "threads: $cores per rank;"* ]] || fail "default on 1 rank of $cores cores: $line"
launch 2 "$PTRAIN" "$deck" "${common[@]}" --set train%micro_batch=8 --set run%out_dir="'$tmp/np2'" >"$tmp/np2.log" 2>&1 ||
  fail "2 ranks: $(tail -3 "$tmp/np2.log")"
per=$(( cores / 2 > 0 ? cores / 2 : 1 ))
grep -q "^threads: $per per rank;" "$tmp/np2.log" || fail "default on 2 ranks: $(grep -m1 '^threads' "$tmp/np2.log")"

# The same training, to 1e-12, with 1 and 2 threads: every step's loss and gradient norm and
# both validation losses.
for name in t2 t2b1; do
  for s in $(seq 1 12); do
    for key in loss grad_norm; do
      a=$(column t1 $key $s); b=$(column $name $key $s)
      [ -n "$a" ] && close "$b" "$a" 1e-12 || fail "$name: step $s $key $b vs ${a:-missing} with 1 thread"
    done
  done
  for s in 6 12; do
    a=$(column t1 val_loss $s); b=$(column $name val_loss $s)
    [ -n "$a" ] && close "$b" "$a" 1e-12 || fail "$name: step $s val_loss $b vs ${a:-missing} with 1 thread"
  done
done
echo "threads: 1 and 2 threads agree to 1e-12 on 12 steps"
