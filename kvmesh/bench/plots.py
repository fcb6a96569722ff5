"""PNG plots of ``kvmesh bench cluster`` results (matplotlib, headless)."""
from __future__ import annotations

from pathlib import Path


def log_axis(axis, low: float, high: float) -> None:
    """A log scale for data in ``low..high``, labelled in plain numbers at 1, 2 and 5 of each decade, or at
    the decades alone over more than two; minor ticks unlabelled (matplotlib's default labels minor
    ticks where the data span less than a decade, and they overlap)."""
    from matplotlib.ticker import LogLocator, NullFormatter, StrMethodFormatter

    axis.axes.set_xscale("log") if axis.axis_name == "x" else axis.axes.set_yscale("log")
    many_decades = low > 0 and high / low > 100  # then the decades alone
    axis.set_major_locator(LogLocator(base=10, subs=(1.0,) if many_decades else (1.0, 2.0, 5.0)))
    axis.set_major_formatter(StrMethodFormatter("{x:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_cluster_results(res: dict, folder: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    modes = res["modes"]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in modes.items():
        values = m["ttft_ms_all"]
        ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=name)
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    every = [v for m in modes.values() for v in m["ttft_ms_all"] if v > 0]
    log_axis(ax.xaxis, min(every, default=1.0), max(every, default=1.0))
    ax.set_title(f"TTFT CDF: {res['workload']}, {res['model']}")
    ax.legend()
    paths.append(_save(plt, fig, out / "ttft_cdf.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    names = list(modes)
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [modes[n]["hit_rate_local"] for n in names], width=0.4, label="local")
    ax.bar([i + 0.2 for i in x], [modes[n]["hit_rate_global"] for n in names], width=0.4, label="local or peer")
    ax.set_xticks(list(x), names)
    ax.set_ylabel("requests with a prefix hit")
    ax.set_ylim(0, 1)
    ax.set_title("Hit rate per mode")
    ax.legend()
    paths.append(_save(plt, fig, out / "hit_rate.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    rate = res.get("rate") or res.get("concurrency")
    for name, m in modes.items():
        ax.plot([rate], [m["throughput_tok_s"]], "o", label=name)
    ax.set_xlabel("request rate (req/s)" if res.get("rate") else "concurrency")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Throughput")
    ax.legend()
    paths.append(_save(plt, fig, out / "throughput.png"))
    return paths


def _save(plt, fig, path: Path) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)
