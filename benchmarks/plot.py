"""PNG plots of the benchmark CSV files (matplotlib, Agg backend; pip install -e .[bench]).

    python benchmarks/plot.py --results benchmarks/results --out docs/img

Reads from --results the files that run_all.sh writes (any that are missing are skipped):
  collectives-<ranks>.csv (collectives.py --csv)  -> collectives_busbw.png, collectives_ratio.png:
      busbw vs message size, gradsync vs raw mpi4py, one pair of lines per rank count; and
      gradsync / raw bandwidth vs message size;
  train-<model>-<ranks>.csv (train_step.py --compare --csv) -> train_step.png: step time bars
      (single, DDP, gradsync per fusion threshold), one panel per model.
The environment of each file (MPI, cores, malloc settings) goes into the figure's caption.
"""

from __future__ import annotations

import argparse
import glob
import os

import benchenv
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the backend)


def caption(env: dict[str, str]) -> str:
    return (f"{env.get('mpi', '?')}, {env.get('cores', '?')} cores ({env.get('cpu', '?')}), "
            f"malloc: {benchenv.malloc_summary(env)}, {env.get('date', '')}")


def size_label(n: float) -> str:
    for suffix, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g}{suffix}"
    return f"{n:g}"


def plot_collectives(files: list[str], out: str) -> list[str]:
    tables = [benchenv.read_csv(path) for path in files]
    tables.sort(key=lambda table: int(table[1][0]["ranks"]))
    written = []
    fig, ax = plt.subplots(figsize=(8, 5))
    fig_ratio, ax_ratio = plt.subplots(figsize=(8, 3.5))
    for index, (_, rows) in enumerate(tables):
        color = f"C{index}"
        ranks = rows[0]["ranks"]
        sizes = [int(r["bytes"]) for r in rows]
        ax.plot(sizes, [float(r["gradsync_busbw_gbs"]) for r in rows], "o-", color=color,
                label=f"gradsync, {ranks} ranks")
        ax.plot(sizes, [float(r["raw_busbw_gbs"]) for r in rows], "s--", color=color, alpha=0.7,
                label=f"raw mpi4py, {ranks} ranks")
        ax_ratio.plot(sizes, [float(r["ratio"]) for r in rows], "o-", color=color, label=f"{ranks} ranks")
    for axis in (ax, ax_ratio):
        axis.set_xscale("log", base=2)
        ticks = [s for s in sorted({int(r["bytes"]) for _, rows in tables for r in rows})][::2]
        axis.set_xticks(ticks, [size_label(t) for t in ticks], rotation=45)
        axis.set_xlabel("message size (bytes)")
        axis.grid(True, which="both", alpha=0.3)
        axis.legend()
    ax.set_yscale("log")
    ax.set_ylabel("busbw (GB/s, log scale)")
    ax.set_title("float32 Sum allreduce in place: gradsync.allreduce_ vs comm.Allreduce")
    ax_ratio.axhline(1.0, color="gray", lw=0.8)
    ax_ratio.set_ylabel("gradsync / raw bandwidth")
    ax_ratio.set_title("gradsync bandwidth relative to raw mpi4py")
    for figure, name in ((fig, "collectives_busbw.png"), (fig_ratio, "collectives_ratio.png")):
        figure.text(0.01, 0.005, caption(tables[0][0]), fontsize=7, color="gray")
        figure.tight_layout(rect=(0, 0.03, 1, 1))
        path = os.path.join(out, name)
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


def plot_train(files: list[str], out: str) -> list[str]:
    order = {"mlp": 0, "cnn": 1, "transformer": 2}
    tables = [benchenv.read_csv(path) for path in files]
    tables.sort(key=lambda table: (order.get(table[1][0]["model"], 2), table[1][0]["model"]))
    fig, axes = plt.subplots(1, len(tables), figsize=(6 * len(tables), 4.5), squeeze=False)
    for ax, (_, rows) in zip(axes[0], tables):
        names = [r["configuration"] for r in rows]
        times = [float(r["step_ms"]) for r in rows]
        colors = ["C7" if n == "single" else "C1" if n.startswith("ddp") else "C0" for n in names]
        bars = ax.bar(range(len(rows)), times, color=colors)
        ax.bar_label(bars, [f"{t:.1f}" for t in times], fontsize=8)
        ax.set_xticks(range(len(rows)), [n.replace(", ", "\n") for n in names], fontsize=8)
        ax.set_ylabel("median step time (ms)")
        ax.set_title(f"{rows[0]['model']}, {rows[0]['ranks']} ranks, batch 32 per rank")
        ax.grid(True, axis="y", alpha=0.3)
    fig.text(0.01, 0.005, caption(tables[0][0]), fontsize=7, color="gray")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    path = os.path.join(out, "train_step.png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return [path]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default="benchmarks/results", help="folder of the CSV files")
    parser.add_argument("--out", default="docs/img", help="folder for the PNG files")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    written = []
    collectives = glob.glob(os.path.join(args.results, "collectives-*.csv"))
    if collectives:
        written += plot_collectives(collectives, args.out)
    train = glob.glob(os.path.join(args.results, "train-*.csv"))
    if train:
        written += plot_train(train, args.out)
    if not written:
        raise SystemExit(f"no collectives-*.csv or train-*.csv in {args.results}")
    for path in written:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
