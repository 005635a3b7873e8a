#!/usr/bin/env bash
# postprocess/ckpt_tool.py on a small checkpoint made here with h5py in the layout
# src/ckpt/checkpoint.hpp documents, its checksums computed with plain Python integers (an
# implementation independent of the tool's numpy one): list shows tensors, state and grid;
# export gives back the arrays; verify passes, and fails naming the dataset on a corrupted
# copy; export refuses the corrupted copy. A bad file of the user's (missing, not a ptrain
# file, incomplete, corrupted, damaged) is one line and exit code 2, as ptrain's input errors;
# success is 0. (test_ckpt_restart runs the tool on files that the C++ writer made.)
set -euo pipefail
: "${PTRAIN_SOURCE_DIR:?}"
PY=/usr/bin/python3
TOOL="$PTRAIN_SOURCE_DIR/postprocess/ckpt_tool.py"
fail() { echo "FAIL: $*" >&2; exit 1; }
if ! "$PY" -c 'import numpy, h5py' 2>/dev/null; then
  echo "SKIP: $PY has no numpy/h5py"; exit 0
fi
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
cd "$tmp"
[ -x "$TOOL" ] || fail "$TOOL is not executable"

# 1. A checkpoint of a one-block model: its 16 tensors in /model, /optim/m and /optim/v
#    (wte and h.0.mlp.fc.weight with 2-d and 3-d shapes), five /state scalars.
"$PY" - <<'EOF'
import struct
import h5py
import numpy as np

MASK = (1 << 64) - 1

def mix64(z):
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)

def checksum(values, fmt):  # values in row-major order, fmt: struct code of the stored type
    total = 0
    for i, x in enumerate(values):
        bits = int.from_bytes(struct.pack("<" + fmt, x), "little")
        total = (total + mix64(mix64((i + 0x9E3779B97F4A7C15) & MASK) ^ bits)) & MASK
    return total

tensors = {"wte.weight": np.arange(15, dtype=np.float32).reshape(5, 3) / 8,
           "h.0.mlp.fc.weight": (np.arange(24, dtype=np.float32).reshape(2, 3, 4) - 7) / 4}
# The rest of a one-block model, so the file is whole.
for name in ["wpe.weight", "ln_f.weight", "ln_f.bias"] + ["h.0." + t for t in (
        "ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias", "attn.proj.weight",
        "attn.proj.bias", "ln_2.weight", "ln_2.bias", "mlp.fc.bias", "mlp.proj.weight",
        "mlp.proj.bias")]:
    tensors[name] = np.array([len(name), -1.5], dtype=np.float32)
with h5py.File("ckpt_00000042.h5", "w") as f:
    for k, v in {"format_version": "2", "grid": "tp2 pp1 dp2", "zero": "1", "date":
                 "2024-01-02T03:04:05Z", "ptrain_version": "0.1.0",
                 "deck": "&run\n  steps = 42\n/\n"}.items():
        f.attrs[k] = np.bytes_(v)
    for group, scale in (("model", 1.0), ("optim/m", 0.5), ("optim/v", 0.25)):
        for name, x in tensors.items():
            d = f.create_dataset(f"{group}/{name}", data=(x * scale).astype(np.float32))
            d.attrs["checksum"] = np.uint64(checksum((x * scale).ravel().tolist(), "f"))
    for name, value, dtype, fmt in (("step", 42, np.int64, "q"),
                                    ("consumed_samples", 1344, np.int64, "q"),
                                    ("optimizer_t", 42, np.int64, "q"),
                                    ("seed", 0xFEDCBA9876543210, np.uint64, "Q"),
                                    ("lr", 2.5e-4, np.float64, "d")):
        d = f.create_dataset(f"state/{name}", data=dtype(value))
        d.attrs["checksum"] = np.uint64(checksum([value], fmt))
EOF

# 2. list
"$TOOL" list ckpt_00000042.h5 >list.txt || fail "list: $(cat list.txt)"
for want in "2 (training checkpoint)" "tp2 pp1 dp2" "state.step              42" \
            "state.seed              18364758544493064720" "state.consumed_samples  1344" \
            "/model/wte.weight" "/optim/v/h.0.mlp.fc.weight" "(2, 3, 4)" "float32" \
            "48 datasets, 67 parameters"; do
  grep -qF -- "$want" list.txt || fail "list lacks '$want':
$(cat list.txt)"
done
"$TOOL" list --deck ckpt_00000042.h5 >deck.txt || fail "list --deck"
grep -q "steps = 42" deck.txt || fail "list --deck: $(cat deck.txt)"

# 3. verify
"$TOOL" verify ckpt_00000042.h5 >verify.txt 2>&1 || fail "verify: $(cat verify.txt)"
grep -q "all 53 checksums OK" verify.txt || fail "verify: $(cat verify.txt)"

# 4. export, with and without the optimizer state
"$TOOL" export ckpt_00000042.h5 model.npz >/dev/null || fail "export"
"$TOOL" export ckpt_00000042.h5 all.npz --optim >/dev/null || fail "export --optim"
"$PY" - <<'EOF' || fail "exported arrays"
import numpy as np
m = np.load("model.npz")
assert len(m.files) == 16 and "h.0.mlp.fc.weight" in m.files and "wte.weight" in m.files, m.files
assert (m["wte.weight"] == np.arange(15, dtype=np.float32).reshape(5, 3) / 8).all()
assert m["h.0.mlp.fc.weight"].shape == (2, 3, 4) and m["h.0.mlp.fc.weight"].dtype == np.float32
a = np.load("all.npz")
assert "optim.m.wte.weight" in a.files and "optim.v.h.0.mlp.fc.weight" in a.files, a.files
assert (a["optim.v.wte.weight"] == m["wte.weight"] * 0.25).all()
assert int(a["state.step"]) == 42 and int(a["state.seed"]) == 0xFEDCBA9876543210
EOF

# 5. A corrupted copy: one element changed, the stored checksum kept.
cp ckpt_00000042.h5 bad.h5
"$PY" -c '
import h5py
with h5py.File("bad.h5", "r+") as f:
    f["optim/m/h.0.mlp.fc.weight"][1, 2, 3] += 1
'
set +e
"$TOOL" verify bad.h5 >bad.txt 2>&1; rc=$?
set -e
[ "$rc" = 2 ] || fail "verify of a corrupted file: exit code $rc, not 2"
grep -q "/optim/m/h.0.mlp.fc.weight: checksum mismatch" bad.txt || fail "verify: $(cat bad.txt)"
grep -q "1 of 53 datasets FAILED" bad.txt || fail "verify: $(cat bad.txt)"
set +e
"$TOOL" export bad.h5 bad.npz --optim >bad.txt 2>&1; rc=$?
set -e
[ "$rc" = 2 ] || fail "export of a corrupted file: exit code $rc, not 2: $(cat bad.txt)"
grep -q "bad.h5: not exported (1 corrupted datasets)" bad.txt || fail "export: $(cat bad.txt)"
[ ! -e bad.npz ] || fail "export wrote bad.npz"

# 6. Not a checkpoint, no file at all, a file without format_version, an output that cannot
#    be written: one line, exit code 2.
tool() {  # tool verify|export|list FILE: its output in out.txt, its exit code in rc
  set +e
  if [ "$1" = export ]; then "$TOOL" export "$2" out.npz; else "$TOOL" "$1" "$2"; fi >out.txt 2>&1
  rc=$?
  set -e
}
user_error() {  # user_error CMD FILE WANT: exit code 2 and one line containing WANT
  tool "$1" "$2"
  [ "$rc" = 2 ] || fail "$1 $2: exit code $rc, not 2: $(cat out.txt)"
  [ "$(wc -l <out.txt)" = 1 ] || fail "$1 $2: not one line: $(cat out.txt)"
  grep -qF -- "$3" out.txt || fail "$1 $2: expected '$3', got: $(cat out.txt)"
}
echo "plain text" >text.h5
"$PY" -c 'import h5py; h5py.File("foreign.h5", "w").create_dataset("x", data=[1.0])'
for cmd in list verify export; do
  user_error $cmd text.h5 "text.h5: cannot open:"
  user_error $cmd missing.h5 "missing.h5: cannot open:"
  user_error $cmd foreign.h5 "foreign.h5: not a ptrain checkpoint or weights file (format_version missing)"
done
set +e
"$TOOL" export ckpt_00000042.h5 no/such/folder/out.npz >out.txt 2>&1; rc=$?
set -e
[ "$rc" = 2 ] || fail "export into a missing folder: exit code $rc, not 2: $(cat out.txt)"
grep -q "no/such/folder/out.npz: cannot write:" out.txt || fail "export into a missing folder: $(cat out.txt)"

# 7. Incomplete files: verify and export each fail with one line naming what is missing.
#    refuse FILE WANT: both commands exit 2, print one line containing WANT, no traceback,
#    and export writes nothing.
refuse() {
  for cmd in verify export; do
    tool $cmd "$1"
    [ "$rc" = 2 ] || fail "$cmd $1: exit code $rc, not 2: $(cat out.txt)"
    [ "$(wc -l <out.txt)" = 1 ] || fail "$cmd $1: not one line: $(cat out.txt)"
    grep -qF -- "$2" out.txt || fail "$cmd $1: expected '$2', got: $(cat out.txt)"
    [ ! -e out.npz ] || fail "$cmd $1 wrote out.npz"
  done
}
edit() {  # edit COPY PYTHON: a copy of the checkpoint changed by PYTHON (h5py file f)
  cp ckpt_00000042.h5 "$1"
  "$PY" -c "import h5py, numpy as np
with h5py.File('$1', 'r+') as f: $2"
}
edit no_wpe.h5 'del f["model/wpe.weight"]'
refuse no_wpe.h5 "no_wpe.h5: incomplete: 1 datasets missing: /model/wpe.weight"
edit no_moment.h5 'del f["optim/v/h.0.ln_2.bias"]'
refuse no_moment.h5 "incomplete: 1 datasets missing: /optim/v/h.0.ln_2.bias"
edit no_state.h5 'del f["state"]'
refuse no_state.h5 "incomplete: 5 datasets missing: /state/step, /state/consumed_samples, /state/optimizer_t, /state/seed and 1 more"
edit two_layers.h5 'f.attrs["deck"] = np.bytes_("&model\n    n_layer = 2   ! two blocks\n/\n&train\n    optimizer = \"adamw\"\n/\n")'
refuse two_layers.h5 "incomplete: 36 datasets missing: /model/h.1.ln_1.weight"
edit sgd.h5 'del f["optim"]; f.attrs["deck"] = np.bytes_("&train\n    optimizer = '"'"'sgd'"'"'\n/\n")'
"$TOOL" verify sgd.h5 >out.txt 2>&1 || fail "verify of an SGD checkpoint (no moments): $(cat out.txt)"

# 8. Damaged files: cut short, or zeros past a point (a write that stopped), or written by a
#    process that was killed before closing it: one line and exit code 2, never a traceback.
size=$(stat -c %s ckpt_00000042.h5)
for keep in 100 2000 $((size / 2)) $((size - 1)); do
  head -c "$keep" ckpt_00000042.h5 >cut.h5
  refuse cut.h5 "cut.h5: cannot"
done
for keep in 100 2000; do
  { head -c "$keep" ckpt_00000042.h5; head -c $((size - keep)) /dev/zero; } >zeros.h5
  refuse zeros.h5 "zeros.h5: "
done
"$PY" -c '
import os, h5py, numpy as np
f = h5py.File("killed.h5", "w")
f.attrs["format_version"] = np.bytes_("1")
for i in range(50):
    f.create_dataset(f"model/t{i}", data=np.arange(1000, dtype=np.float32))
f.flush()
f.create_dataset("model/wte.weight", data=np.zeros((300, 300), np.float32))
os._exit(0)
'
for cmd in verify export; do
  tool $cmd killed.h5
  [ "$rc" = 2 ] || fail "$cmd killed.h5: exit code $rc, not 2: $(cat out.txt)"
  [ "$(wc -l <out.txt)" = 1 ] || fail "$cmd killed.h5: not one line: $(cat out.txt)"
done
echo "ckpt_tool: list, export, verify OK"
