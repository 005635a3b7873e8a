#!/usr/bin/python3
"""Look into ptrain checkpoints (format_version 2) and weights files (format_version 1).

  ckpt_tool.py list FILE [--deck]        tensors (name, shape, dtype), /state, root attributes
  ckpt_tool.py export FILE OUT.npz [--optim]
                                         model tensors (and with --optim the AdamW moments
                                         as optim.m.<name> / optim.v.<name> and the state as
                                         state.<name>) to a NumPy .npz, checksums verified
  ckpt_tool.py verify FILE               recompute every dataset's checksum; exit 2 on any
                                         mismatch or missing checksum
export and verify first check that the file is whole: every tensor of the model its deck
attribute describes (or, without one, of the layers its names show), for a checkpoint also
both AdamW moments of each (when the deck's optimizer has them) and the /state scalars.

Exit codes, as ptrain's: 0 success; 2 the user's file is wrong: it cannot be opened or read
(missing, damaged, cut short), is not a ptrain checkpoint or weights file, is incomplete, or
is corrupted (a checksum mismatch or a missing checksum), or OUT.npz cannot be written; each
is one error line on stderr (verify first lists the failed datasets). Wrong arguments exit 2
too (argparse); anything else (1, with a traceback) is a fault of the tool.

The checksum (src/ckpt/weights.hpp): for a dataset x with global row-major indices i,
  sum_i mix64(mix64(i + 0x9e3779b97f4a7c15) ^ bits(x_i))   (mod 2^64)
bits = the stored bit pattern zero-extended to 64 bits, mix64 = the splitmix64 finaliser.
A scalar /state dataset is one element with i = 0; /state/dataset_samples is 1-d.
"""
import argparse
import os
import re
import signal
import sys
import traceback

import h5py
import numpy as np

# The tensors of the GPT-2 model (README, "Tensor names"): once, and per block h.<i>.
TOP_TENSORS = ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
BLOCK_TENSORS = ["ln_1.weight", "ln_1.bias", "attn.qkv.weight", "attn.qkv.bias",
                 "attn.proj.weight", "attn.proj.bias", "ln_2.weight", "ln_2.bias",
                 "mlp.fc.weight", "mlp.fc.bias", "mlp.proj.weight", "mlp.proj.bias"]
STATE = ["step", "consumed_samples", "optimizer_t", "seed", "lr"]  # a checkpoint's /state
# and, in checkpoints written since they were added, the data's fingerprint and the samples
# drawn from each dataset (an array)
DATA_STATE = ["data_fingerprint", "dataset_samples"]

EXIT_INPUT = 2  # the user's file is wrong (ptrain's kExitInput)

GOLDEN = np.uint64(0x9E3779B97F4A7C15)
BLOCK = 1 << 24  # elements hashed at a time (bounds the memory of big tensors)


class BadFile(Exception):
    """A one-line reason why the user's file cannot be used: exit code EXIT_INPUT."""


def mix64(z):
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def bits64(values):
    """The stored bit patterns of a 1-d array, zero-extended to uint64."""
    if values.dtype.itemsize == 4:
        return values.view(np.uint32).astype(np.uint64)
    if values.dtype.itemsize == 8:
        return values.view(np.uint64)
    raise ValueError(f"{values.dtype} elements are not 4 or 8 bytes")


def checksum(dataset):
    """The documented checksum of an h5py dataset, read in blocks of rows."""
    total = np.uint64(0)
    with np.errstate(over="ignore"):
        if dataset.shape == ():
            flat = np.asarray(dataset[()]).reshape(1)
            return int(mix64(mix64(np.zeros(1, np.uint64) + GOLDEN) ^ bits64(flat)).sum())
        row = int(np.prod(dataset.shape[1:], dtype=np.int64))
        rows = max(1, BLOCK // max(row, 1))
        for first in range(0, dataset.shape[0], rows):
            flat = np.ascontiguousarray(dataset[first:first + rows]).reshape(-1)
            index = np.arange(first * row, first * row + flat.size, dtype=np.uint64)
            total += mix64(mix64(index + GOLDEN) ^ bits64(flat)).sum(dtype=np.uint64)
    return int(total)


def text(value):
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def datasets(f):
    """(path, dataset) of every dataset in the file, sorted by path."""
    found = []
    f.visititems(lambda name, obj: found.append(("/" + name, obj))
                 if isinstance(obj, h5py.Dataset) else None)
    return sorted(found, key=lambda item: item[0])


def open_file(path):
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise BadFile(f"{path}: cannot open: {' '.join(str(e).split())}") from None
    version = text(f.attrs.get("format_version", b""))
    if version not in ("1", "2"):
        f.close()
        raise BadFile(f"{path}: not a ptrain checkpoint or weights file "
                      f"(format_version {version or 'missing'})")
    return f


def deck_value(deck, group, key):
    """The value text of group%key in the resolved deck ptrain stores (its echo), or None."""
    block = re.search(rf"^&{group}\b(.*?)^/", deck, re.M | re.S | re.I)
    value = block and re.search(rf"^\s*{key}\s*=\s*([^!\n]*)", block.group(1), re.M | re.I)
    return value.group(1).strip().strip("'\"").lower() if value else None


def missing_datasets(f):
    """The datasets a whole file of its kind would have and this one lacks."""
    deck = text(f.attrs.get("deck", b""))
    model = set(f["model"]) if isinstance(f.get("model"), h5py.Group) else set()
    n_layer = deck_value(deck, "model", "n_layer")
    if n_layer is not None and n_layer.isdigit():
        layers = int(n_layer)
    else:
        blocks = [int(m.group(1)) for m in map(re.compile(r"h\.(\d+)\.").match, model) if m]
        layers = max(blocks, default=-1) + 1
    names = TOP_TENSORS + [f"h.{i}.{t}" for i in range(layers) for t in BLOCK_TENSORS]
    missing = [f"/model/{n}" for n in names if n not in model]
    if text(f.attrs.get("format_version", b"")) == "2":
        optimizer = deck_value(deck, "train", "optimizer")
        if optimizer == "adamw" or (optimizer is None and "optim" in f):
            missing += [f"/optim/{g}/{n}" for g in ("m", "v") for n in names
                        if f"optim/{g}/{n}" not in f]
        missing += [f"/state/{n}" for n in STATE if f"state/{n}" not in f]
    return missing


def require_whole(f, path):
    missing = missing_datasets(f)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise BadFile(f"{path}: incomplete: {len(missing)} datasets missing: {shown}")


def state_of(f):
    if "state" not in f:
        return {}
    return {name: f["state"][name][()].tolist() for name in f["state"]}


def cmd_list(args):
    with open_file(args.file) as f:
        attrs = {k: text(v) for k, v in f.attrs.items()}
        version = attrs.get("format_version")
        kind = "training checkpoint" if version == "2" else "weights file"
        def row(key, value):
            print(f"{key:<24}{value}")

        row("file", args.file)
        row("format_version", f"{version} ({kind})")
        for key in ("grid", "zero", "date", "ptrain_version"):
            if key in attrs:
                row(key, attrs[key])
        for key, value in sorted(attrs.items()):
            if key not in ("format_version", "grid", "zero", "date", "ptrain_version",
                           "deck", "checksum_algorithm"):
                row(key, value)
        state = state_of(f)
        for name in STATE + DATA_STATE:
            if name in state:
                row("state." + name, state[name])
        tensors = [(p, d) for p, d in datasets(f) if not p.startswith("/state/")]
        params = sum(int(np.prod(d.shape, dtype=np.int64)) for p, d in tensors
                     if p.startswith("/model/"))
        row("tensors", f"{len(tensors)} datasets, {params} parameters")
        width = max([len(p) for p, _ in tensors] + [4])
        for path, d in tensors:
            print(f"  {path:<{width}}  {str(tuple(d.shape)):<18} {d.dtype.name}")
        if args.deck and "deck" in attrs:
            print("deck:")
            print(attrs["deck"])


def verify_file(f, paths=None):
    """Returns the list of problems (empty when every checked dataset is intact)."""
    problems = []
    for path, d in datasets(f):
        if paths is not None and path not in paths:
            continue
        if "checksum" not in d.attrs:
            problems.append(f"{path}: no checksum attribute")
            continue
        stored = int(d.attrs["checksum"])
        try:
            got = checksum(d)
        except (ValueError, OSError) as e:
            problems.append(f"{path}: cannot read: {e}")
            continue
        if got != stored:
            problems.append(f"{path}: checksum mismatch (stored {stored:#018x}, "
                            f"data gives {got:#018x}): the data is corrupted")
    return problems


def cmd_verify(args):
    with open_file(args.file) as f:
        require_whole(f, args.file)
        n = len(datasets(f))
        problems = verify_file(f)
    for p in problems:
        print(f"{args.file}: {p}", file=sys.stderr)
    if problems:
        print(f"{args.file}: {len(problems)} of {n} datasets FAILED", file=sys.stderr)
        return EXIT_INPUT
    print(f"{args.file}: all {n} checksums OK")
    return 0


def cmd_export(args):
    with open_file(args.file) as f:
        require_whole(f, args.file)
        out, paths = {}, []
        for path, d in datasets(f):
            group, _, name = path[1:].partition("/")
            if group == "model":
                key = name
            elif args.optim and group == "optim":
                key = "optim." + name.replace("/", ".", 1)
            elif args.optim and group == "state":
                key = "state." + name
            else:
                continue
            paths.append(path)
            out[key] = d[()]
        problems = verify_file(f, set(paths))
    if problems:
        for p in problems:
            print(f"{args.file}: {p}", file=sys.stderr)
        raise BadFile(f"{args.file}: not exported ({len(problems)} corrupted datasets)")
    try:
        np.savez(args.out, **out)
    except OSError as e:
        raise BadFile(f"{args.out}: cannot write: {' '.join(str(e).split())}") from None
    print(f"{args.out}: {len(out)} arrays")
    return 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="tensors, state and attributes")
    p.add_argument("file")
    p.add_argument("--deck", action="store_true", help="also print the echoed deck")
    p.set_defaults(run=cmd_list)
    p = sub.add_parser("export", help="tensors to a NumPy .npz")
    p.add_argument("file")
    p.add_argument("out")
    p.add_argument("--optim", action="store_true", help="also the moments and the state")
    p.set_defaults(run=cmd_export)
    p = sub.add_parser("verify", help="recompute every checksum")
    p.add_argument("file")
    p.set_defaults(run=cmd_verify)
    args = parser.parse_args()
    if not hasattr(os, "fork"):
        return run(args)
    # libhdf5 itself may crash on a damaged file: run the command in a child process, so that
    # is one error line too.
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        try:
            code = run(args)
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # a fault of the tool: its traceback, exit 1
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        print(f"{args.file}: cannot read: libhdf5 failed on it "
              f"({signal.Signals(os.WTERMSIG(status)).name}); the file is damaged", file=sys.stderr)
        return EXIT_INPUT
    return os.WEXITSTATUS(status)


def run(args):
    """The command's exit code; a bad file is its one error line on stderr and EXIT_INPUT."""
    try:
        return args.run(args) or 0
    except BrokenPipeError:  # output piped into head: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except BadFile as e:
        print(e, file=sys.stderr)
        return EXIT_INPUT
    except (OSError, KeyError, RuntimeError, ValueError, TypeError) as e:
        # A damaged file (cut short while written, overwritten) fails deep inside h5py.
        print(f"{args.file}: cannot read: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_INPUT


if __name__ == "__main__":
    sys.exit(main())
