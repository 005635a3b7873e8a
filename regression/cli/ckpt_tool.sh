#!/usr/bin/env bash
# postprocess/ckpt_tool.py on a small checkpoint made here with h5py in the layout
# src/ckpt/checkpoint.hpp documents, its checksums computed with plain Python integers (an
# implementation independent of the tool's numpy one): list shows tensors, state and grid;
# export gives back the arrays; verify passes, and fails naming the dataset on a corrupted
# copy; export refuses the corrupted copy. (test_ckpt_restart runs the tool on files that
# the C++ writer made.)
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

# 1. A checkpoint: two tensors in /model, /optim/m, /optim/v, five /state scalars.
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
            "6 datasets, 39 parameters"; do
  grep -qF -- "$want" list.txt || fail "list lacks '$want':
$(cat list.txt)"
done
"$TOOL" list --deck ckpt_00000042.h5 >deck.txt || fail "list --deck"
grep -q "steps = 42" deck.txt || fail "list --deck: $(cat deck.txt)"

# 3. verify
"$TOOL" verify ckpt_00000042.h5 >verify.txt 2>&1 || fail "verify: $(cat verify.txt)"
grep -q "all 11 checksums OK" verify.txt || fail "verify: $(cat verify.txt)"

# 4. export, with and without the optimizer state
"$TOOL" export ckpt_00000042.h5 model.npz >/dev/null || fail "export"
"$TOOL" export ckpt_00000042.h5 all.npz --optim >/dev/null || fail "export --optim"
"$PY" - <<'EOF' || fail "exported arrays"
import numpy as np
m = np.load("model.npz")
assert sorted(m.files) == ["h.0.mlp.fc.weight", "wte.weight"], m.files
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
[ "$rc" != 0 ] || fail "verify passed a corrupted file"
grep -q "/optim/m/h.0.mlp.fc.weight: checksum mismatch" bad.txt || fail "verify: $(cat bad.txt)"
grep -q "1 of 11 datasets FAILED" bad.txt || fail "verify: $(cat bad.txt)"
if "$TOOL" export bad.h5 bad.npz --optim >/dev/null 2>&1; then fail "export took a corrupted file"; fi
[ ! -e bad.npz ] || fail "export wrote bad.npz"

# 6. Not a checkpoint.
echo "plain text" >text.h5
if "$TOOL" verify text.h5 >/dev/null 2>&1; then fail "verify passed a text file"; fi
echo "ckpt_tool: list, export, verify OK"
