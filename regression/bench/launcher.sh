# Sourced by the benchmarks: sets the array `mpirun` (launcher, then the flags every launch
# needs) for the ptrain executable $1. MPIEXEC and MPIEXEC_PREFLAGS come from the environment,
# else from mpiexec.env in ptrain's build folder (where CMake, the one place that works them
# out, wrote them: Open MPI --oversubscribe and, as root, --allow-run-as-root; MPICH none),
# else mpirun without flags. Both launchers take --bind-to core|none and -np.
bench_launcher() {
  local env_file built_exec="" built_flags="" exe flags
  env_file="$(dirname "$(readlink -f "$1")")/mpiexec.env"
  if [ -f "$env_file" ]; then
    built_exec=$(. "$env_file" && echo "$MPIEXEC")
    built_flags=$(. "$env_file" && echo "$MPIEXEC_PREFLAGS")
  fi
  exe=${MPIEXEC:-${built_exec:-mpirun}}
  if [ -n "${MPIEXEC_PREFLAGS+set}" ]; then flags=$MPIEXEC_PREFLAGS
  elif [ "$exe" = "$built_exec" ]; then flags=$built_flags
  else flags=""; fi
  # shellcheck disable=SC2206  # the flags are words
  mpirun=("$exe" $flags)
}
