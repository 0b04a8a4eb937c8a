"""`hybridflow report RUN_DIR`: plot a run's metrics.jsonl to report.png and report.html.

Panels: reward, validation accuracy, KL to the reference, entropy, response length, per-phase time
(`timing_s/*`), throughput, losses and the train-vs-rollout log-prob gap, over steps. Each panel plots
the metrics whose names match its patterns (the names the trainers write), so a run that logs only some
of them (DPO has no KL, GRPO without a KL term has no reference) still gets a report; an empty panel says "not logged". The HTML page embeds the PNG, a summary table
(first / last / min / max) and the last validation generations table.
"""

from __future__ import annotations

import argparse
import base64
import html
import json
import re
import sys
from pathlib import Path

# (title, regexes of metric names); at most MAX_SERIES series per panel. The names are those the
# trainers write (tests/ check each panel against real runs); DPO's implicit rewards stand in for a reward.
PANELS = [
    ("Reward", [r"^reward/mean$", r"^dpo/rewards_(chosen|rejected)$"]),
    ("Validation accuracy", [r"^val/.*/acc@1$", r"^val/.*/mean@\d+$", r"^val/.*/reward$"]),
    # the KL to the reference (in the reward, or as a loss); actor/ppo_kl, the drift from the rollout
    # policy within one update, is not it
    ("KL to reference", [r"^actor/reward_kl_penalty$", r"^actor/kl_loss$"]),
    ("Entropy", [r"^actor/entropy$"]),
    ("Response length (tokens)", [r"^response_length/mean$"]),
    ("Time per phase (s)", [r"^timing_s/(?!timeline/).*"]),  # phases and overlap sections, not timelines
    ("Throughput (tokens/s)", [r"^perf/throughput$"]),
    (
        "Losses",
        [r"^actor/pg_loss$", r"^critic/vf_loss$", r"^cost_critic/vf_loss$", r"^dpo/loss$", r"^sft/loss$"],
    ),
    # whether generation and training agree: |log p_train - log p_rollout| over the step's response tokens
    ("Train vs rollout log-prob gap", [r"^rollout/log_prob_diff_(mean|max)$"]),
]
MAX_SERIES = 8


def read_metrics(path: str | Path) -> dict[str, list[tuple[int, float]]]:
    """metrics.jsonl -> name -> [(step, value)] sorted by step; a later line for a step wins."""
    by_step: dict[int, dict] = {}
    with open(path) as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                print(f"report: skipping {path}, line {n}: not valid JSON", file=sys.stderr)
                continue
            by_step.setdefault(int(rec.pop("step")), {}).update(rec)
    series: dict[str, list[tuple[int, float]]] = {}
    for step in sorted(by_step):
        for k, v in by_step[step].items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                series.setdefault(k, []).append((step, float(v)))
    return series


def panel_series(series: dict, patterns: list[str]) -> list[str]:
    """Metric names matching a panel, in pattern order (the first patterns are the preferred names).
    Past MAX_SERIES the largest series stay (mean |value|; ties by that order): a step's phases are
    a dozen or more, and the one that dominates it (update_actor) must not fall off the panel."""
    out = []
    for p in patterns:
        out += sorted(k for k in series if re.search(p, k) and k not in out)
    if len(out) > MAX_SERIES:
        keep = set(sorted(out, key=lambda k: -_size(series[k]))[:MAX_SERIES])
        out = [k for k in out if k in keep]
    return out


def _size(points) -> float:
    """Mean |value| of a series of (step, value) points; 0 for a name without points."""
    values = [abs(v) for _, v in points or ()]
    return sum(values) / len(values) if values else 0.0


def empty_panels(names) -> list[str]:
    """Titles of the panels that no metric in `names` (an iterable of metric names) would fill."""
    names = list(names)
    return [title for title, patterns in PANELS if not panel_series(dict.fromkeys(names), patterns)]


def plot(series: dict, png_path: Path, title: str) -> list[str]:
    """Write the panel grid; -> the metric names plotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cols = 4
    rows = -(-len(PANELS) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.6 * rows), squeeze=False)
    plotted = []
    for ax, (name, patterns) in zip(axes.flat, PANELS):
        keys = panel_series(series, patterns)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if not keys:
            ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes, color="gray")
            continue
        for k in keys:
            steps, values = zip(*series[k])
            ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, label=k)
        ax.legend(fontsize=7)
        plotted += keys
    for ax in list(axes.flat)[len(PANELS) :]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)
    return plotted


def _summary_rows(series: dict, keys: list[str]) -> str:
    rows = []
    for k in keys:
        v = [x for _, x in series[k]]
        cells = "".join(f"<td>{x:.4g}</td>" for x in (v[0], v[-1], min(v), max(v)))
        rows.append(f"<tr><td>{html.escape(k)}</td><td>{len(v)}</td>{cells}</tr>")
    return "\n".join(rows)


def _generations_table(path: Path, limit: int = 10) -> str:
    if not path.exists():
        return "<p>no generations logged</p>"
    rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
    if not rows:
        return "<p>no generations logged</p>"
    last = max(r["step"] for r in rows)
    rows = [r for r in rows if r["step"] == last][:limit]
    cols = [c for c in rows[0] if c not in ("step", "table")]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = "\n".join(
        "<tr>" + "".join(f"<td><pre>{html.escape(str(r.get(c, '')))}</pre></td>" for c in cols) + "</tr>"
        for r in rows
    )
    return f"<h2>Validation generations (step {last})</h2><table><tr>{head}</tr>{body}</table>"


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Write report.png and report.html for a run directory; -> their paths."""
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        raise FileNotFoundError(
            f"{metrics} does not exist; is {run_dir} a run directory with the jsonl logger?"
        )
    series = read_metrics(metrics)
    if not series:
        raise ValueError(f"{metrics} holds no numeric metrics")
    out_dir = Path(out_dir) if out_dir else run_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    png, page = out_dir / "report.png", out_dir / "report.html"
    plotted = plot(series, png, f"hybridflow run: {run_dir.name}")
    image = base64.b64encode(png.read_bytes()).decode()
    config = run_dir / "config.yaml"
    config_html = f"<h2>Config</h2><pre>{html.escape(config.read_text())}</pre>" if config.exists() else ""
    steps = sorted({s for v in series.values() for s, _ in v})
    page.write_text(
        f"""<!doctype html><html><head><meta charset="utf-8"><title>{html.escape(run_dir.name)}</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 8px;text-align:left;vertical-align:top}} pre{{margin:0;white-space:pre-wrap}}</style>
</head><body><h1>Run {html.escape(run_dir.name)}</h1>
<p>{len(steps)} logged steps ({steps[0]}..{steps[-1]}), from {html.escape(str(metrics))}</p>
<img src="data:image/png;base64,{image}" style="max-width:100%">
<h2>Summary</h2><table><tr><th>metric</th><th>points</th><th>first</th><th>last</th><th>min</th><th>max</th></tr>
{_summary_rows(series, plotted)}</table>
{_generations_table(run_dir / "generations.jsonl")}
{config_html}
</body></html>
"""
    )
    return png, page


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="a run directory (holding metrics.jsonl)")
    parser.add_argument("--output", default=None, help="directory for report.png/html (default: RUN_DIR)")


def run(args: argparse.Namespace) -> int:
    try:
        png, page = write_report(args.run_dir, args.output)
    except (FileNotFoundError, ValueError) as e:
        print(f"hybridflow report: {e}", file=sys.stderr)
        return 1
    print(f"wrote {png}\nwrote {page}")
    return 0
