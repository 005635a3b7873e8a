#!/usr/bin/env bash
# GPT-2 124M and 350M (vocab 50304, T = 1024) in bf16 on one GPU: ptrain's tokens/s and MFU
# against the bf16 cuBLAS probe it measures in the same run (8192^3), beside PyTorch on the
# same GPU, eager and torch.compile (gpt2_torch.py: bf16 autocast, scaled_dot_product_attention,
# fused AdamW). Batches as the device kit's PyTorch reference figures: 16 for 124M, 8 for 350M.
#
#   regression/bench/gpu.sh [PTRAIN] [STEPS=10] [SIZES="124m 350m"]
#
# PTRAIN is a CUDA build (default: ptrain on PATH, then build-cuda/ptrain); python3 needs
# torch with CUDA (skipped with a note when it has none). Prints one row per model and run.
set -uo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
ptrain=${1:-$(command -v ptrain || echo "$here/build-cuda/ptrain")}
steps=${2:-10}
sizes=${3:-124m 350m}
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
python=${PYTHON:-python3}
status=0

# shape MODEL: the --set options of a size
shape() {
  case $1 in
    124m) echo "model%n_layer=12 model%d_model=768 model%n_head=12 train%global_batch=16 train%micro_batch=16" ;;
    350m) echo "model%n_layer=24 model%d_model=1024 model%n_head=16 train%global_batch=8 train%micro_batch=8" ;;
    *) echo "gpu.sh: unknown size $1 (124m or 350m)" >&2; exit 2 ;;
  esac
}

printf '%-6s %-22s %10s %8s %14s %10s\n' model run tok/s MFU "probe TFLOP/s" "vs eager"
torch_ok=1
"$python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())' 2>/dev/null || torch_ok=0
for size in $sizes; do
  sets=(--set model%vocab=50304 --set model%seq_len=1024 --set "model%dtype='bf16'"
        --set "backend%device='cuda'" --set run%steps="$steps" --set run%eval_every=0
        --set run%log_every=1000 --set data%val_fraction=0)
  for kv in $(shape "$size"); do sets+=(--set "$kv"); done
  out=$tmp/$size
  if ! "$ptrain" "$here/input/gpt2-124m.nml" "${sets[@]}" --set run%out_dir="'$out'" --bench \
      >"$tmp/$size.log" 2>&1; then
    echo "gpu.sh: ptrain $size failed: $(tail -3 "$tmp/$size.log")"; status=1; continue
  fi
  # the done line: "...; N tok/s, G GFLOP/s = P% of peak (steps after the first)"
  tok=$(sed -n 's/^done:.*; \([0-9.]*\) tok\/s,.*/\1/p' "$tmp/$size.log" | tail -1)
  mfu=$(sed -n 's/^done:.* = \([0-9.]*%\) of peak.*/\1/p' "$tmp/$size.log" | tail -1)
  peak=$(sed -n 's/^peak: bf16 gemm probe (.*) = \([0-9.]*\) GFLOP\/s.*/\1/p' "$tmp/$size.log" | head -1)
  eager=
  if [ "$torch_ok" = 1 ]; then
    eager=$("$python" "$here/regression/bench/gpt2_torch.py" "$out/deck.nml" "$steps" --device cuda \
      --dtype bf16 2>&1 | sed -n 's/^torch: .* s\/step, \([0-9]*\) tok\/s.*/\1/p')
    compiled=$("$python" "$here/regression/bench/gpt2_torch.py" "$out/deck.nml" "$steps" --device cuda \
      --dtype bf16 --compile 2>&1 | sed -n 's/^torch: .* s\/step, \([0-9]*\) tok\/s.*/\1/p')
  fi
  ratio() { [ -n "$2" ] && awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", a / b }' || echo -; }
  printf '%-6s %-22s %10s %8s %14s %10s\n' "$size" "ptrain bf16" "${tok:-?}" "${mfu:-?}" \
    "$(awk -v p="${peak:-0}" 'BEGIN { printf "%.0f", p / 1000 }')" "$(ratio "${tok:-0}" "$eager")"
  if [ "$torch_ok" = 1 ]; then
    printf '%-6s %-22s %10s %8s %14s %10s\n' "$size" "torch eager" "${eager:-failed}" - - 1.00
    printf '%-6s %-22s %10s %8s %14s %10s\n' "$size" "torch.compile" "${compiled:-failed}" - - \
      "$(ratio "${compiled:-0}" "$eager")"
  else
    echo "gpu.sh: no CUDA PyTorch here ($python): the torch rows are left out"
  fi
done
exit "$status"
