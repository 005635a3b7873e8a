#!/usr/bin/python3
"""Throughput across the runs of a sweep (or any set of runs): bars of tokens/s, MFU and, when
the logs have them, the exposed communication per step, one bar per run, to a PNG; the same
figures as a table on stdout.

  plot_scaling.py RUN|SWEEP [...] [-o scaling.png] [--title TEXT]

Each run's log.csv gives the means over the steps after the first; its deck.nml (the resolved
deck) gives the ranks (dp*tp*pp*cp*ep) and the labels (the keys in which the runs differ).
Exposed-communication columns are the log.csv columns named t_comm_* or containing 'exposed'
(seconds per step), and t_bubble (pipeline bubble); stacked when there are several. Logs
without them get a note instead of that panel. With several rank counts, the tokens/s bars
carry the parallel efficiency: tokens/s per rank against the smallest run's.
"""
import argparse
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ptrain_io as io  # noqa: E402


def comm_columns(log):
    return [c for c in log if c.startswith("t_comm") or "exposed" in c or c == "t_bubble"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("runs", nargs="+", help="run folders, log.csv files or sweep folders")
    ap.add_argument("-o", "--output", default="scaling.png", help="the PNG (default scaling.png)")
    ap.add_argument("--title", default="", help="figure title")
    args = ap.parse_args()

    try:
        dirs = io.run_dirs(args.runs)
    except FileNotFoundError as e:
        raise SystemExit(f"plot_scaling.py: {e}")
    if not dirs:
        raise SystemExit("plot_scaling.py: no run with a log.csv")
    labels = io.run_labels(dirs)

    runs = []
    for d, label in zip(dirs, labels):
        log = io.read_log(d)
        deck_path = os.path.join(d, "deck.nml")
        ranks = io.world_size(io.Deck.read(deck_path)) if os.path.isfile(deck_path) else 1
        comm = {c: io.steady_mean(log[c]) for c in comm_columns(log)}
        runs.append({"label": label, "ranks": ranks, "tps": io.steady_mean(log["tokens_per_s"]),
                     "mfu": io.steady_mean(log["mfu"]), "t_step": io.steady_mean(log["t_step"]),
                     "comm": comm})
    runs.sort(key=lambda r: r["ranks"])  # stable: sweep order within a rank count
    comm_cols = sorted({c for r in runs for c in r["comm"]})

    x = np.arange(len(runs))
    names = [r["label"].replace(" ", "\n") + f"\n({r['ranks']} rank{'s' if r['ranks'] > 1 else ''})"
             for r in runs]
    fig, axes = plt.subplots(3, 1, figsize=(max(6.0, 1.2 * len(runs) + 2), 10), dpi=100,
                             sharex=True)
    tps = np.array([r["tps"] for r in runs])
    axes[0].bar(x, tps, color="tab:blue")
    axes[0].set_ylabel("tokens/s")
    base = runs[0]
    several_sizes = len({r["ranks"] for r in runs}) > 1
    for xi, r in zip(x, runs):
        if several_sizes and np.isfinite(r["tps"]) and base["tps"] > 0:
            eff = (r["tps"] / r["ranks"]) / (base["tps"] / base["ranks"])
            axes[0].annotate(f"{100 * eff:.0f}%", (xi, r["tps"]), ha="center", va="bottom",
                             fontsize=8)
    axes[1].bar(x, [100 * r["mfu"] for r in runs], color="tab:green")
    axes[1].set_ylabel("MFU (%)")
    if comm_cols:
        bottom = np.zeros(len(runs))
        for c in comm_cols:
            v = np.array([r["comm"].get(c, 0.0) for r in runs])
            v = np.where(np.isfinite(v), v, 0.0)
            axes[2].bar(x, v, bottom=bottom, label=c)
            bottom += v
        axes[2].set_ylabel("exposed comm (s/step)")
        axes[2].legend(fontsize=8)
    else:
        axes[2].text(0.5, 0.5, "no exposed-communication columns in these logs",
                     ha="center", va="center", transform=axes[2].transAxes)
        axes[2].set_yticks([])
    axes[2].set_xticks(x)
    axes[2].set_xticklabels(names, fontsize=8)
    for ax in axes:
        ax.grid(axis="y", alpha=0.3)
    if args.title:
        axes[0].set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.output)

    width = max(12, max(len(r["label"]) for r in runs))
    head = f"{'run':{width}s} {'ranks':>5s} {'tokens/s':>10s} {'MFU':>6s} {'s/step':>9s}"
    print(head + "".join(f" {c:>12s}" for c in comm_cols))
    for r in runs:
        line = (f"{r['label']:{width}s} {r['ranks']:5d} {r['tps']:10.0f} {100 * r['mfu']:5.1f}%"
                f" {r['t_step']:9.4f}")
        print(line + "".join(f" {r['comm'].get(c, float('nan')):12.4g}" for c in comm_cols))
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
