"""Metric sinks behind the Tracker: console (progress bar), JSONL, TensorBoard, wandb, MLflow.

Each backend has `log(metrics, step)`, `log_table(name, rows, step)` and `close()`. wandb and MLflow
are imported only when configured, and a missing package is a clear error naming the config key.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from pathlib import Path

from hybridflow.errors import UserError

# metrics shown on the console line / progress bar, first match wins (verl names as fallbacks)
REWARD_KEYS = ("reward/mean", "critic/score/mean", "critic/rewards/mean")
THROUGHPUT_KEYS = ("perf/throughput",)
# the train-vs-rollout log-prob gap (docs/metrics.md): whether generation and training agree
GAP_KEYS = ("rollout/log_prob_diff_mean",)
# what an update did: the policy loss of every algorithm (SFT's and DPO's own), the KL to the reference
# (as a loss, else in the reward), the entropy and the mean response length
TRAIN_FIELDS = (
    ("loss", ("actor/pg_loss", "sft/loss", "dpo/loss"), "{:.4g}"),
    ("kl", ("actor/kl_loss", "actor/reward_kl_penalty"), "{:.2e}"),
    ("entropy", ("actor/entropy",), "{:.3f}"),
    ("len", ("response_length/mean",), "{:.0f}"),
)
# reward/<function>/mean: one weighted reward function's own mean (workers/reward.py); not these
_NOT_A_FUNCTION = ("mean", "extra", "std", "max", "min")
TABLE_ROWS, TABLE_CELL = 4, 60  # the console's validation table: the full one is in the run dir


class TrackerError(UserError, RuntimeError):
    """A logger the config names cannot start here (package missing, wandb refusing): one line, exit 2."""


def _first(metrics: dict, keys) -> float | None:
    return next((metrics[k] for k in keys if k in metrics), None)


def _fmt_time(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ConsoleBackend:
    """A live tqdm bar (step, ETA, reward, throughput, the train-vs-rollout log-prob gap) on a terminal;
    one line per step otherwise, so captured logs (CI, `make demo | tee`) stay readable."""

    def __init__(self, total_steps: int | None = None, initial_step: int = 0, stream=None, run_dir=None):
        self.stream = stream or sys.stderr
        self.run_dir = run_dir  # where a table's full rows go (the console shows TABLE_ROWS of them)
        self.total, self.initial = total_steps, initial_step
        self.start = time.monotonic()
        self.bar = None
        if total_steps and getattr(self.stream, "isatty", lambda: False)():
            from tqdm import tqdm

            self.bar = tqdm(
                total=total_steps, initial=initial_step, file=self.stream, desc="train", unit="step"
            )

    def _postfix(self, metrics: dict) -> dict:
        out = {}
        reward = _first(metrics, REWARD_KEYS)
        if reward is not None:
            out["reward"] = f"{reward:.3f}"
        out.update({name: f"{v:.3f}" for name, v in function_means(metrics, "reward/").items()})
        for label, keys, fmt in TRAIN_FIELDS:
            value = _first(metrics, keys)
            if value is not None:
                out[label] = fmt.format(value)
        val_fns = function_means(metrics, "val/reward/")
        out.update({f"val {name}": f"{v:.3f}" for name, v in val_fns.items()})
        for k, v in metrics.items():
            # with weighted functions acc@1 is their weighted sum, not an accuracy: their means say more
            if k.startswith("val/") and k.endswith("acc@1") and not val_fns:
                out[k.removeprefix("val/").removesuffix("/acc@1") + " acc"] = f"{v:.3f}"
        tput = _first(metrics, THROUGHPUT_KEYS)
        if tput is not None:
            out["tok/s"] = f"{tput:.0f}"
        gap = _first(metrics, GAP_KEYS)
        if gap is not None:
            out["logp gap"] = f"{gap:.1e}"
        return out

    def log(self, metrics: dict, step: int) -> None:
        post = self._postfix(metrics)
        if self.bar is not None:
            self.bar.set_postfix(post, refresh=False)
            self.bar.update(step - self.bar.n)
            return
        done = step - self.initial
        per_step = (time.monotonic() - self.start) / max(done, 1)
        parts = [f"step {step}" + (f"/{self.total}" if self.total else "")]
        parts += [f"{k} {v}" for k, v in post.items()]
        parts.append(f"{per_step:.2f} s/step")
        if self.total:
            parts.append(f"eta {_fmt_time(per_step * (self.total - step))}")
        print(" | ".join(parts), file=self.stream, flush=True)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        from rich.console import Console
        from rich.table import Table

        if not rows:
            return
        table = Table(title=f"{name} (step {step})", show_lines=False)
        columns = list(rows[0])
        for c in columns:
            table.add_column(c, overflow="ellipsis", no_wrap=True)
        for r in rows[:TABLE_ROWS]:
            table.add_row(*(short_cell(c, r.get(c, "")) for c in columns))
        if self.bar is not None:
            self.bar.clear()
        Console(file=self.stream, width=160).print(table)
        where = write_table(self.run_dir, name, rows, step) if self.run_dir is not None else None
        if where or len(rows) > TABLE_ROWS:
            shown = f"{min(len(rows), TABLE_ROWS)} of {len(rows)} rows shown"
            print(f"{name}: {shown}" + (f"; every row, uncut: {where}" if where else ""), file=self.stream)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def function_means(metrics: dict, prefix: str) -> dict[str, float]:
    """{function name: mean} from `<prefix><name>/mean` (one per weighted reward function)."""
    out = {}
    for k, v in metrics.items():
        name, _, tail = k.removeprefix(prefix).partition("/")
        if k.startswith(prefix) and tail == "mean" and name not in _NOT_A_FUNCTION:
            out[name] = v
    return out


def short_cell(column: str, value) -> str:
    """One line of at most TABLE_CELL characters; a prompt keeps its end (the question: a chat
    template's start is the same system header in every row)."""
    text = " ".join(str(value).split())
    if len(text) <= TABLE_CELL:
        return text
    if column.startswith("prompt"):
        return "..." + text[-(TABLE_CELL - 3) :]
    return text[: TABLE_CELL - 3] + "..."


def write_table(run_dir, name: str, rows: list[dict], step: int) -> Path:
    """run_dir/<name>/step_<step>.jsonl: every row of a table, uncut (the console shows a few)."""
    path = Path(run_dir) / name.replace(":", "_") / f"step_{step}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
    return path


class JsonlBackend:
    """run_dir/metrics.jsonl ({"step": s, ...} per line) and run_dir/generations.jsonl.

    The files hold one history whose steps never go back: on resume from step k the lines after k
    (written before a crash, after the last checkpoint) are dropped; a fresh run (resume_step None)
    starts them empty; a step lower than one already logged is refused.
    """

    def __init__(self, run_dir: str | os.PathLike, resume_step: int | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.gen_path = Path(run_dir) / "generations.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.last_step = -1
        for p in (self.path, self.gen_path):
            keep = [] if resume_step is None or not p.exists() else _lines_up_to(p, resume_step)
            if p.exists() or p == self.path:
                p.write_text("".join(ln + "\n" for ln in keep))
            if p == self.path and keep:
                self.last_step = json.loads(keep[-1])["step"]
        self.f = open(self.path, "a")

    def log(self, metrics: dict, step: int) -> None:
        if step < self.last_step:
            raise TrackerError(
                f"{self.path}: step {step} after step {self.last_step}; a second history is never appended"
            )
        self.last_step = step
        self.f.write(json.dumps({"step": step, **metrics}) + "\n")
        self.f.flush()

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        with open(self.gen_path, "a") as f:
            for r in rows:
                f.write(json.dumps({"step": step, "table": name, **r}, default=str) + "\n")

    def close(self) -> None:
        self.f.close()


def _lines_up_to(path: Path, step: int) -> list[str]:
    return [ln for ln in path.read_text().splitlines() if ln and json.loads(ln)["step"] <= step]


class TensorBoardBackend:
    """A step's scalars as one event (the values SummaryWriter.add_scalar writes one event each for: at
    ~85 metrics a step those calls cost the driver ~2 ms between steps), flushed every step."""

    def __init__(self, run_dir: str | os.PathLike):
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.writer import FileWriter

        self.writer = FileWriter(str(Path(run_dir) / "tensorboard"))
        self.summary = Summary  # imported here, not at module import: tensorboard only when it is chosen

    def log(self, metrics: dict, step: int) -> None:
        values = [self.summary.Value(tag=k, simple_value=v) for k, v in metrics.items()]
        self.writer.add_summary(self.summary(value=values), step)
        self.writer.flush()

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        from torch.utils.tensorboard.summary import text

        if not rows:
            return
        cols = list(rows[0])
        lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(str(r.get(c, "")).replace("|", "\\|") for c in cols) + " |" for r in rows]
        self.writer.add_summary(text(name, "\n".join(lines)), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def _require(package: str, extra: str | None = None):
    import importlib

    try:
        return importlib.import_module(package)
    except ImportError:
        name = package.partition(".")[0]
        raise TrackerError(
            f"trainer.loggers includes {name!r} but the {name} package is not installed; "
            f"`pip install -c constraints.txt -e '.[{extra or name}]'` or remove {name!r} from trainer.loggers"
        ) from None


_WANDB_LOCAL_MODES = ("offline", "dryrun", "disabled")


def wandb_has_no_key() -> bool:
    """No wandb API key here and no local mode asked for: neither WANDB_API_KEY, nor the netrc entry
    `wandb login` writes for the server (WANDB_BASE_URL), nor WANDB_MODE=offline/disabled."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE", "").lower() in _WANDB_LOCAL_MODES:
        return False
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is None
    except (OSError, netrc.NetrcParseError):  # no netrc file, or one wandb could not read either
        return True


class WandbBackend:
    """wandb; its files go to WANDB_DIR when set (else the run directory). Without an API key it logs
    offline, saying so in one line, instead of failing the run at its start: `wandb sync` uploads later."""

    def __init__(self, run_dir, project: str, name: str, config: dict | None):
        self.wandb = _require("wandb")
        where = os.environ.get("WANDB_DIR") or str(run_dir)
        Path(where).mkdir(parents=True, exist_ok=True)
        mode = None  # wandb's own choice: WANDB_MODE, its settings
        if wandb_has_no_key():
            mode = "offline"
            print(
                "hybridflow: warning: trainer.loggers has wandb but no API key is set here (WANDB_API_KEY or "
                f"`wandb login`): logging offline under {where}/wandb; `wandb sync` uploads it later "
                "(WANDB_MODE=offline says this is meant)",
                file=sys.stderr,
            )
        try:
            self.run = self.wandb.init(project=project, name=name, config=config, dir=where, mode=mode)
        except self.wandb.errors.Error as e:  # a refused key, an unreachable server: wandb's own words
            raise TrackerError(f"trainer.loggers: wandb could not start: {e}") from None

    def log(self, metrics: dict, step: int) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        if rows:
            cols = list(rows[0])
            table = self.wandb.Table(columns=cols, data=[[str(r.get(c, "")) for c in cols] for r in rows])
            self.run.log({name: table}, step=step)

    def close(self) -> None:
        self.run.finish()
        # Stop wandb's service process now, while it runs: at interpreter exit the run's processes are
        # gone (trainers/lifecycle.py) and wandb's own atexit teardown would print a ConnectionResetError.
        self.wandb.teardown()


class MlflowBackend:
    """MLflow (the `mlflow-skinny` package is enough). The store is MLFLOW_TRACKING_URI when set, else a
    SQLite database inside the run directory (run_dir/mlflow/mlflow.db, artifacts beside it), so a run
    needs no server and no deprecated file store; `mlflow ui --backend-store-uri sqlite:///...` reads it."""

    _BAD = re.compile(r"[^0-9A-Za-z_\-. /]")  # characters MLflow rejects in metric names (e.g. '@')

    def __init__(self, run_dir, project: str, name: str, config: dict | None):
        _require("mlflow", "mlflow")
        _require("sqlalchemy", "mlflow")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        local = Path(run_dir).absolute() / "mlflow"
        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{local / 'mlflow.db'}"
        if self.uri.startswith("sqlite:///"):
            Path(self.uri.removeprefix("sqlite:///")).parent.mkdir(parents=True, exist_ok=True)
        self.client = MlflowClient(self.uri)
        exp = self.client.get_experiment_by_name(project)
        if exp is not None:
            exp_id = exp.experiment_id
        else:
            artifacts = (local / "artifacts").as_uri() if "MLFLOW_TRACKING_URI" not in os.environ else None
            exp_id = self.client.create_experiment(project, artifact_location=artifacts)
        self.run_id = self.client.create_run(exp_id, run_name=name).info.run_id
        if config:
            params = [Param(k, str(v)[:500]) for k, v in _flatten(config).items()]
            for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
                self.client.log_batch(self.run_id, params=params[i : i + 100])

    def log(self, metrics: dict, step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(self._BAD.sub("_", k), float(v), now, step) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_table(self, name: str, rows: list[dict], step: int) -> None:
        if rows:  # JSON, as MLflow's own tables are (log_table itself would need pandas)
            text = json.dumps([{c: str(v) for c, v in r.items()} for r in rows], indent=1)
            self.client.log_text(self.run_id, text, f"{name}/step_{step}.json")

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def to_float(v) -> float | None:
    """A metric value as a float (tensors, numpy scalars, ints), or None if not numeric."""
    if hasattr(v, "item") and getattr(v, "ndim", 0) == 0:
        v = v.item()
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None
