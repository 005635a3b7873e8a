#!/usr/bin/env bash
# Benchmark: expert parallelism. A MoE model (4 layers, d_model 256, 4 heads, 8 experts of
# F = 1024, top 2, dropless, vocab 4096, seq_len 256, fp32; 8 samples a step in micro-batches
# of 4) as ep = 2 (4 experts and one micro-batch per rank; one core and one BLAS thread each,
# --bind-to core) against one rank with two BLAS threads (--bind-to none, both micro-batches)
# on the same global batch, measured in this same run. Each configuration runs REPEATS times
# (default 3), alternating; the table gives the median [min max] over the rounds of
#  - the tokens/s ratio to the baseline of the same round;
#  - the all-to-all bytes rank 0 sent per step (log.csv bytes_ep), against the --plan figure
#    for uniform routing without drops, m*L_moe*(4*k*b*s*h*(ep-1)/ep + (ep-1)*(E/ep)*4) with
#    m = 1 micro-batch per rank (routing is not uniform: rank 0 sends the rows of its tokens
#    bound for rank 1's experts, and returns the rows rank 1's tokens sent to its experts, so
#    the ratio moves with the load);
#  - the exposed all-to-all time as a fraction of the step (exposed_ep_s / t_step: rank 0
#    blocked in the ep all-to-alls, which includes waiting for the more loaded rank);
#  - the most loaded expert against the mean (moe_load_max), which drives that wait.
# Means over the steps after the first.
#   regression/bench/moe.sh [build/ptrain] [steps] [repeats]
source "$(dirname "$0")/common.sh"
steps=${2:-6}
repeats=${3:-3}
deck=$here/input/moe-tiny.nml
L=4 C=256 S=256 B=4 k=2 E=8 ep=2
shape=(--set model%n_layer=$L --set model%d_model=$C --set model%n_head=4 --set model%vocab=4096
       --set model%seq_len=$S --set model%ffn_mult=4 --set model%n_expert=$E --set model%top_k=$k
       --set model%capacity_factor=0 --set train%global_batch=8 --set train%micro_batch=$B
       --set run%steps="$steps" --set run%eval_every=0 --set run%log_every=1000
       --set data%val_fraction=0 --set backend%peak_gflops=100)
# The plan's per-step ep figure (estimate_experts), in bytes: fp32, m = 1 micro-batch per rank.
uniform=$((1 * L * (4 * k * B * S * C * 4 * (ep - 1) / ep + (ep - 1) * (E / ep) * 4)))
plan_row=$("$ptrain" --plan "$deck" "${shape[@]}" --world 2 --ranks-per-node 2 --set parallel%ep=$ep |
  sed -nE 's/^  ep +([0-9.]+ [KMG]?i?B) .*/\1/p')

# one NAME NP BIND BLAS_THREADS [ptrain options]:
# prints "tokens/s bytes_ep exposed_ep_fraction load_max" (0 for columns a run does not have).
one() {
  local name=$1 np=$2 bind=$3 threads=$4
  shift 4
  "${mpirun[@]}" --bind-to "$bind" -np "$np" "$ptrain" "$deck" "${shape[@]}" \
    --set backend%blas_threads="$threads" --set run%out_dir="'$tmp/$name'" "$@" \
    >"$tmp/$name.log" 2>&1 || { tail -3 "$tmp/$name.log" >&2; exit 1; }
  awk -F, 'NR == 1 { for (i = 1; i <= NF; i++) c[$i] = i; next }
    NR > 2 { tok += $c["tokens_per_s"]; n++
             if (c["bytes_ep"]) { b += $c["bytes_ep"]; x += $c["exposed_ep_s"] / $c["t_step"] }
             l += $c["moe_load_max"] }
    END { printf "%.1f %.0f %.4f %.3f\n", tok / n, b / n, x / n, l / n }' "$tmp/$name/log.csv"
}

ratios="" bytes="" byte_ratios="" exposed="" loads=""
for ((r = 1; r <= repeats; r++)); do
  read -r base _ _ _ < <(one "one$r" 1 none 2)
  read -r tok b x l < <(one "ep$r" 2 core 1 --set parallel%ep=$ep)
  ratios+="$(awk -v a="$tok" -v b="$base" 'BEGIN { print a / b }') "
  bytes+="$b " byte_ratios+="$(awk -v a="$b" -v u="$uniform" 'BEGIN { print a / u }') "
  exposed+="$x " loads+="$l "
  echo "round $r of $repeats: one rank $base tok/s, ep 2 $tok tok/s" >&2
done

stats() {  # values... -> "median min max"
  printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { printf "%s %s %s\n", v[int((NR + 1) / 2)], v[1], v[NR] }'
}
read -r rm rlo rhi < <(stats $ratios)
read -r bm blo bhi < <(stats $bytes)
read -r qm qlo qhi < <(stats $byte_ratios)
read -r xm xlo xhi < <(stats $exposed)
read -r lm llo lhi < <(stats $loads)
pct() { awk -v x="$1" 'BEGIN { printf "%.1f%%", 100 * x }'; }
echo "MoE L=$L d_model=$C S=$S, $E experts top $k dropless, global batch 8 (micro-batches of $B), $repeats rounds, $((steps - 1)) steps each"
printf '%-40s %s\n' "quantity (ep 2, 1 core each)" "median [min max]"
printf '%-40s %.3f [%.3f %.3f]\n' "tok/s ratio to 1 rank x 2 BLAS threads" "$rm" "$rlo" "$rhi"
printf '%-40s %.0f [%.0f %.0f]\n' "bytes_ep per step, measured" "$bm" "$blo" "$bhi"
printf '%-40s %d (plan: %s)\n' "bytes_ep per step, uniform formula" "$uniform" "$plan_row"
printf '%-40s %.3f [%.3f %.3f]\n' "measured / uniform" "$qm" "$qlo" "$qhi"
printf '%-40s %s [%s %s]\n' "exposed all-to-all / step time" "$(pct "$xm")" "$(pct "$xlo")" "$(pct "$xhi")"
printf '%-40s %.2f [%.2f %.2f]\n' "most loaded expert / mean (moe_load_max)" "$lm" "$llo" "$lhi"
echo "baseline: 1 rank x 2 BLAS threads on both cores, measured before each round"
