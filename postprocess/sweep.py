#!/usr/bin/python3
"""Parameter studies for ptrain: make a folder of decks for jobscripts/sweep.sbatch, and
gather the finished runs into one table.

  sweep.py generate BASE.nml SWEEP KEY=V1,V2,... [KEY=...] [--set KEY=VALUE ...] [--max-parallel K]
  sweep.py collect SWEEP [-o TABLE.csv]

generate writes SWEEP/decks/<i>.nml for every combination of the swept values (the last key
varies fastest), each a copy of BASE with those keys (and the --set ones) replaced and
run%out_dir = SWEEP/runs/<i> (absolute), and SWEEP/sweep.json describing the study. Values are
written as on ptrain's command line: numbers and .true./.false. as they are, quoted strings as
they are, and a bare word becomes a string (model%dtype=fp32,fp64). --check runs
`ptrain --plan` on every deck first (PTRAIN, or ptrain on PATH; --world N ranks).

collect writes one row per run (default SWEEP/results.csv; '-' for stdout): the index, the swept
keys, status (done / partial / missing), steps logged, final loss, final validation loss, mean
tokens/s and mean MFU over the steps after the first, peak memory, and the run folder.
"""
import argparse
import csv
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ptrain_io as io  # noqa: E402


def parse_assignments(items, what):
    out = []
    for item in items:
        if "=" not in item:
            raise SystemExit(f"sweep.py: {what} '{item}' is not KEY=VALUE")
        key, values = item.split("=", 1)
        key = key.strip()
        try:
            io.Deck.split_key(key)
        except ValueError as e:
            raise SystemExit(f"sweep.py: {e}")
        out.append((key, values))
    return out


def generate(args):
    try:
        base = io.Deck.read(args.base)
    except (OSError, ValueError) as e:
        raise SystemExit(f"sweep.py: {e}")
    ranges = []
    for key, values in parse_assignments(args.ranges, "range"):
        vals = io.split_values(values)
        if not vals:
            raise SystemExit(f"sweep.py: no values for {key}")
        ranges.append((key, [io.format_value(v) for v in vals]))
    if len({k for k, _ in ranges}) != len(ranges):
        raise SystemExit("sweep.py: a key is swept twice")
    fixed = [(k, io.format_value(v)) for k, v in parse_assignments(args.set or [], "--set")]
    if not ranges:
        raise SystemExit("sweep.py: nothing to sweep (give KEY=V1,V2,...)")

    sweep = os.path.abspath(args.sweep)
    decks_dir = os.path.join(sweep, "decks")
    if os.path.exists(decks_dir) and os.listdir(decks_dir):
        if not args.force:
            raise SystemExit(f"sweep.py: {decks_dir} is not empty (--force replaces it)")
        shutil.rmtree(decks_dir)
    os.makedirs(decks_dir, exist_ok=True)

    name = base.value("run%name", "ptrain")
    runs = []
    for i, combo in enumerate(io.product(ranges)):
        deck = io.Deck({g: dict(kv) for g, kv in base.groups.items()})
        for key, raw in fixed:
            deck.set(key, raw)
        for key, raw in combo.items():
            deck.set(key, raw)
        out_dir = os.path.join(sweep, "runs", str(i))
        deck.set("run%out_dir", io.quote(out_dir))
        deck.set("run%name", io.quote(f"{name}-{i}"))
        path = os.path.join(decks_dir, f"{i}.nml")
        swept = " ".join(f"{k}={v}" for k, v in combo.items())
        deck.write(path, header=f"! sweep deck {i}: {swept}\n! made by sweep.py from "
                                f"{os.path.abspath(args.base)}")
        runs.append({"index": i, "deck": path, "out_dir": out_dir, "values": combo})

    with open(os.path.join(sweep, "sweep.json"), "w") as f:
        json.dump({"base": os.path.abspath(args.base), "keys": [k for k, _ in ranges],
                   "fixed": dict(fixed), "runs": runs}, f, indent=1)

    if args.check:
        ptrain = os.environ.get("PTRAIN") or shutil.which("ptrain")
        if not ptrain:
            raise SystemExit("sweep.py: --check needs ptrain (set PTRAIN or put it on PATH)")
        for r in runs:
            p = subprocess.run([ptrain, "--plan", r["deck"], "--world", str(args.world)],
                               capture_output=True, text=True)
            if p.returncode != 0:
                raise SystemExit(f"sweep.py: deck {r['deck']} does not plan on {args.world} "
                                 f"rank(s):\n{p.stderr.strip()}")

    n = len(runs)
    k = min(args.max_parallel, n)
    print(f"{n} decks in {decks_dir}")
    print(f"submit: sbatch --array=0-{n - 1}%{k} jobscripts/sweep.sbatch {sweep}")
    print(f"then:   {sys.argv[0]} collect {sweep}")


def collect(args):
    sweep = io.read_sweep(args.sweep)
    if sweep is None:
        raise SystemExit(f"sweep.py: {args.sweep} has no sweep.json (made by sweep.py generate)")
    keys = sweep["keys"]
    fields = (["index"] + keys + ["status", "steps", "final_loss", "val_loss",
              "tokens_per_s", "mfu", "peak_mem_bytes", "out_dir"])
    rows = []
    for r in sweep["runs"]:
        row = {"index": r["index"], "out_dir": r["out_dir"]}
        row.update({k: io.parse_value(r["values"][k]) for k in keys})
        log = os.path.join(r["out_dir"], "log.csv")
        if not os.path.isfile(log):
            row["status"] = "missing"
            rows.append(row)
            continue
        cols = io.read_log(log)
        steps = cols["step"]
        want = None
        for deck in (os.path.join(r["out_dir"], "deck.nml"), r["deck"]):
            if os.path.isfile(deck):
                want = io.Deck.read(deck).value("run%steps")
                if want is not None:
                    break
        done = steps.size > 0 and want is not None and int(steps[-1]) == int(want)
        row.update({
            "status": "done" if done else "partial",
            "steps": int(steps[-1]) if steps.size else 0,
            "final_loss": io.last_finite(cols["loss"]),
            "val_loss": io.last_finite(cols["val_loss"]),
            "tokens_per_s": io.steady_mean(cols["tokens_per_s"]),
            "mfu": io.steady_mean(cols["mfu"]),
            "peak_mem_bytes": int(max(cols["peak_mem_bytes"])) if steps.size else "",
        })
        rows.append(row)

    out = args.output or os.path.join(args.sweep, "results.csv")
    f = sys.stdout if out == "-" else open(out, "w", newline="")
    w = csv.DictWriter(f, fieldnames=fields, restval="", lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in row.items()})
    if f is not sys.stdout:
        f.close()
        counts = {s: sum(r["status"] == s for r in rows) for s in ("done", "partial", "missing")}
        print(f"{out}: {len(rows)} runs ({counts['done']} done, {counts['partial']} partial, "
              f"{counts['missing']} missing)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    sub = ap.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="write a folder of decks for sweep.sbatch")
    g.add_argument("base", help="the base deck")
    g.add_argument("sweep", help="the sweep folder to write (decks/, sweep.json)")
    g.add_argument("ranges", nargs="+", metavar="KEY=V1,V2", help="a swept key and its values")
    g.add_argument("--set", action="append", metavar="KEY=VALUE", help="a key for every deck")
    g.add_argument("--max-parallel", type=int, default=4, help="array tasks at once (%%K)")
    g.add_argument("--force", action="store_true", help="replace an existing decks/ folder")
    g.add_argument("--check", action="store_true", help="validate each deck with ptrain --plan")
    g.add_argument("--world", type=int, default=1, help="ranks for --check (default 1)")
    c = sub.add_parser("collect", help="gather finished runs into one CSV table")
    c.add_argument("sweep", help="the sweep folder")
    c.add_argument("-o", "--output", help="the table (default SWEEP/results.csv; - for stdout)")
    args = ap.parse_args()
    (generate if args.command == "generate" else collect)(args)


if __name__ == "__main__":
    main()
