"""The `resources` and `trainer` sections of the configuration tree (config/schema.py composes them into
`HybridFlowConfig`): the devices, placement and Ray cluster; steps, validation, checkpoints, logging and
restarts. Same conventions as config/schema.py (help text on every field; docs/design.md §7), each
section's own checks beside it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from hybridflow.fields import MAX_PER_MACHINE, MAX_SECONDS, MAX_SEED, setting

_f = setting  # a short name keeps the field lists readable

LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


@dataclass
class ResourcesConfig:
    placement: str = _f(
        "colocate",
        "colocate (all models share all devices), split (actor+ref | critic+reward), auto (planner), "
        "or a plan file written by `hybridflow plan`",
    )
    device: str = _f("auto", "auto = cuda when available, else cpu", choices=("auto", "cpu", "cuda"))
    n_gpus_per_node: int = _f(
        1, "devices per node (on CPU: worker processes per node)", ge=1, le=MAX_PER_MACHINE
    )
    nnodes: int = _f(1, "number of nodes", ge=1, le=MAX_PER_MACHINE)
    rollout_devices: int = _f(
        0,
        "trainer.rollout_ahead=1: devices of the rollout pool, taken from the n_gpus_per_node * nnodes "
        "(the rest train; 0 = half of them, rounded down; with placement auto the planner sizes it)",
        ge=0,
    )
    frozen_pool: str = _f(
        "auto",
        "trainer.rollout_ahead=1: the pool of the reference, reward and cost models: rollout = in the rollout "
        "pool's processes, scoring step k+1's batch while the actor trains on step k; training; both = the "
        "reference in both pools, each step's rows split between them to even the pools' busy time (reward "
        "and cost models on the rollout pool); auto = rollout under colocate / split (docs/design.md), the "
        "planner's choice under auto / a plan",
        choices=("auto", "rollout", "training", "both"),
    )
    planner_profile: str = _f(
        "",
        "placement auto: plan with this device profile, the cost model's coefficients measured on the "
        "machine by `hybridflow calibrate --out FILE` ('' = the device catalogue's datasheet entry)",
    )
    ray_address: str = _f("", "'' = start an embedded local Ray cluster; 'auto' or host:port = join one")
    ray_num_cpus: int = _f(
        0, "embedded cluster: logical CPUs to declare (0 = Ray's default)", ge=0, le=MAX_PER_MACHINE
    )
    ray_dashboard: bool = _f(False, "embedded cluster: start Ray's dashboard (on 127.0.0.1)")

    @property
    def num_devices(self) -> int:
        return self.n_gpus_per_node * self.nnodes


@dataclass
class TrainerConfig:
    total_steps: int = _f(0, "training steps (0 = derive from total_epochs)", ge=0)
    total_epochs: int = _f(1, "passes over the training set when total_steps = 0", ge=0)
    val_every: int = _f(0, "validate every N steps (0 = only before training and at the end)", ge=0)
    val_before_train: bool = _f(True, "validate once before the first step")
    val_generations_to_log: int = _f(4, "validation samples shown in the generations table", ge=0)
    val_only: bool = _f(
        False, "validate the initial (or resumed) weights once, log the val/ metrics and exit: no training"
    )
    rollout_data_dir: str = _f(
        "", "write each step's rollouts to <dir>/<step>.jsonl: input, output, gts, score, step ('' = off)"
    )
    validation_data_dir: str = _f(
        "", "write each validation's generations to <dir>/<step>.jsonl, as rollout_data_dir ('' = off)"
    )
    save_every: int = _f(0, "checkpoint every N steps (0 = only at the end)", ge=0)
    save_every_minutes: float = _f(
        30.0,
        "also checkpoint after a step when this many minutes passed since the last save (0 = off)",
        ge=0,
        le=MAX_SECONDS // 60,
    )
    max_restarts: int = _f(
        3,
        "a dead worker or a collective timeout: tear down, restart the workers, reload the last checkpoint, continue (this many times)",
        ge=0,
    )
    restart_wait_s: float = _f(
        300.0,
        "on a restart, how long to wait for the devices the placement needs (a lost node replaced), "
        "printing progress; then fail, or shrink per trainer.min_devices",
        ge=0,
        le=MAX_SECONDS,
    )
    min_devices: int = _f(
        0,
        "on a restart that still lacks devices after restart_wait_s: continue on fewer (dp shrinks, the "
        "batch arithmetic re-checked) down to this many; 0 = never shrink",
        ge=0,
    )
    stop_grace_s: float = _f(
        120.0,
        "on SIGTERM/SIGINT: time to finish the step and write a checkpoint before abandoning them",
        ge=0,
        le=MAX_SECONDS,
    )
    hang_timeout_s: float = _f(
        0.0,
        "a worker call during which no rank finishes for this long is a hung worker: its group is killed "
        "and restarted like a dead one (trainer.max_restarts); 0 = off. Set above the longest call",
        ge=0,
        le=MAX_SECONDS,
    )
    keep_last: int = _f(
        2, "checkpoints to keep (older ones are deleted); 0 keeps every one (verl's null)", ge=0
    )
    resume: str = _f(
        "auto", "auto = continue from the latest checkpoint, never, a step number (12), or a checkpoint path"
    )
    output_dir: str = _f("runs", "runs are written to output_dir/experiment_name")
    experiment_name: str = _f("default", "name of this run's directory and of the tracking run")
    project_name: str = _f("hybridflow", "wandb project / mlflow experiment")
    loggers: list[str] = _f(["console", "jsonl"], f"metric sinks, any of {list(LOGGERS)}")
    max_skipped_steps: int = _f(
        3,
        "stop the run (one line, exit 2) after this many consecutive steps whose update was skipped "
        "(non-finite loss or gradient norm)",
        ge=1,
    )
    seed: int = _f(1, "global seed (model init, sampling, dropout)", ge=0, le=MAX_SEED)
    overlap_phases: bool = _f(
        True,
        "issue an RL step's independent phases (values, reference, reward and cost models; the critic "
        "and actor updates) together as futures, so groups on different pools run at once; false waits "
        "for each phase before the next (the sequential baseline: same numbers, docs/metrics.md)",
    )
    rollout_ahead: int = _f(
        0,
        "1 = one-step off-policy: a rollout pool of its own (resources.rollout_devices) samples step k+1's "
        "responses while the actor trains on step k; weights synced after each update (docs/design.md)",
        choices=(0, 1),
    )


def resources_errors(r: ResourcesConfig) -> list[str]:
    errors = []  # the sizes' ranges: the fields' domains (fields.domain_errors)
    if r.placement not in ("colocate", "split", "auto") and not os.path.isfile(r.placement):
        errors.append(
            f"resources.placement: {r.placement!r} is not colocate|split|auto or an existing plan file"
        )
    if r.planner_profile and r.placement != "auto":
        errors.append(
            f"resources.planner_profile: only resources.placement=auto plans (a plan file was priced when "
            f"written: `hybridflow plan --profile FILE`); placement is {r.placement!r}, so remove it"
        )
    elif r.planner_profile and not os.path.isfile(r.planner_profile):
        errors.append(
            f"resources.planner_profile: no file {r.planner_profile!r}; write one with "
            f"`hybridflow calibrate --out {r.planner_profile}`"
        )
    return errors


CPU_WORKER_MIN_BYTES = 256 << 20
"""The least one CPU worker process holds before any model: Python with torch and Ray's runtime loaded."""


def machine_errors(r: ResourcesConfig) -> list[str]:
    """What this machine must have for the section: checked by `hybridflow train` only, since a config
    may be written or shown (`hybridflow config show`) on a machine other than the one it runs on. A
    joined cluster (resources.ray_address) is checked against its resources when the pools reserve them
    (controller/resource_pool.py); the embedded one runs on this machine's devices, checked here, so an
    impossible count fails at once instead of in a reservation that cannot be met."""
    if r.ray_address:
        return []
    import torch

    asked = f"resources.n_gpus_per_node={r.n_gpus_per_node} x nnodes={r.nnodes}"
    if r.device == "cuda" and not torch.cuda.is_available():
        return [
            "resources.device: cuda, but torch finds no CUDA device on this machine; use auto or cpu, "
            "or resources.ray_address to join a cluster that has GPUs"
        ]
    if _uses_cuda(r.device):
        have = torch.cuda.device_count()
        if r.num_devices > have:
            return [f"{asked} asks for {r.num_devices} GPUs, this machine has {have}; ask for at most {have}, "
                    "or set resources.ray_address to join a cluster that has them"]  # fmt: skip
        return []
    most = _physical_memory() // CPU_WORKER_MIN_BYTES
    if r.num_devices > most:
        return [
            f"{asked} asks for {r.num_devices} CPU worker processes, each of {CPU_WORKER_MIN_BYTES >> 20} MiB "
            f"at least, and this machine's {_physical_memory() / 2**30:.0f} GiB holds at most {most}; ask for "
            "fewer"
        ]
    return []


def _uses_cuda(device: str) -> bool:
    """As controller/resource_pool.uses_cuda (a layer above config): cuda, or auto on a machine with one."""
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def _physical_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def machine_warnings(r: ResourcesConfig) -> list[str]:
    """What runs here but slowly: more CPU worker processes than this machine has cores (verl scripts'
    n_gpus_per_node=8 copied to a laptop). Each device is a process on CPU; they time-share the cores
    and every collective waits for the one descheduled: more processes than cores only add waiting."""
    if r.ray_address or r.device == "cuda":
        return []
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if r.num_devices <= cores:
        return []
    if r.device == "auto":
        import torch

        if torch.cuda.is_available():
            return []
    return [
        f"resources.n_gpus_per_node={r.n_gpus_per_node} x nnodes={r.nnodes}: on CPU each device is a worker "
        f"process, and {r.num_devices} of them share this machine's {cores} cores ({r.num_devices / cores:.0f} "
        "per core): they take turns on them and every collective waits for a descheduled rank, so steps run "
        f"several times slower than with n_gpus_per_node={cores}; set that (or fewer) to use the cores "
        "without oversubscribing them"
    ]


def trainer_errors(t: TrainerConfig) -> list[str]:
    errors = []  # the ranges: the fields' domains (fields.domain_errors)
    if t.total_steps == 0 and t.total_epochs == 0:
        errors.append("trainer.total_steps: both total_steps and total_epochs are 0; set one of them")
    errors += [
        f"trainer.loggers: unknown logger {n!r}; choose from {list(LOGGERS)}"
        for n in t.loggers
        if n not in LOGGERS
    ]
    resume = str(t.resume).strip()
    if (
        resume not in ("auto", "never")
        and not re.fullmatch(r"(step_)?\d+", resume)
        and not os.path.exists(resume)
    ):
        errors.append(
            f"trainer.resume: {t.resume!r} is neither 'auto', 'never', a step number nor an existing checkpoint path"
        )
    name = t.experiment_name
    if not name or os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        errors.append(
            f"trainer.experiment_name: {name!r} must be a relative name inside trainer.output_dir (no '..', not absolute)"
        )
    return errors
