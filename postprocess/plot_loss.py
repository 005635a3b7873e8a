#!/usr/bin/python3
"""Loss curves of one or several ptrain runs: training loss per step (lines) and validation
loss where it was evaluated (markers), one colour per run, to a PNG.

  plot_loss.py RUN [RUN ...] [-o loss.png] [--log] [--title TEXT]

A RUN is a run folder (its log.csv and deck.nml), a log.csv, or a sweep folder from sweep.py
(all of its runs). Runs are labelled by the deck keys in which they differ.
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


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("runs", nargs="+", help="run folders, log.csv files or sweep folders")
    ap.add_argument("-o", "--output", default="loss.png", help="the PNG (default loss.png)")
    ap.add_argument("--log", action="store_true", help="logarithmic loss axis")
    ap.add_argument("--title", default="", help="figure title")
    args = ap.parse_args()

    try:
        dirs = io.run_dirs(args.runs)
    except FileNotFoundError as e:
        raise SystemExit(f"plot_loss.py: {e}")
    if not dirs:
        raise SystemExit("plot_loss.py: no run with a log.csv")
    labels = io.run_labels(dirs)

    fig, ax = plt.subplots(figsize=(8, 5), dpi=100)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (d, label) in enumerate(zip(dirs, labels)):
        log = io.read_log(d)
        c = colors[i % len(colors)]
        ax.plot(log["step"], log["loss"], color=c, lw=1.2, label=f"{label} (train)")
        has_val = np.isfinite(log["val_loss"])
        if has_val.any():
            ax.plot(log["step"][has_val], log["val_loss"][has_val], color=c, ls="--",
                    marker="o", ms=4, lw=0.8, label=f"{label} (val)")
        final = io.last_finite(log["val_loss"])
        print(f"{label}: {int(log['step'][-1])} steps, final loss {log['loss'][-1]:.4f}"
              + (f", val loss {final:.4f}" if np.isfinite(final) else ""))
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    if args.log:
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if args.title:
        ax.set_title(args.title)
    fig.tight_layout()
    fig.savefig(args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
