"""The configuration tree: one dataclass per component, composed into `HybridFlowConfig`.

Each component's dataclass is defined once, with its help text (hybridflow/fields.py; docs/design.md §7):
the engine's OptimConfig / ParallelConfig in engines/config.py, the `algorithm` section's in
config/algorithm_config.py, the rest here, all composed into
`HybridFlowConfig`. YAML files and dotted CLI overrides are checked against these classes,
`hybridflow config show` prints them, and
`hybridflow config --help` lists each field's help string. Names follow verl without its sprawl.

Conventions:
- Sizes are global unless the name ends in `_per_device`.
- Batch sizes in `data`, `actor.ppo_mini_batch_size` and `critic.ppo_mini_batch_size` count prompts
  (verl's convention): each prompt carries `rollout.n` responses, so a mini-batch holds
  `ppo_mini_batch_size * rollout.n` sequences. Micro-batch sizes count sequences.
- 0 (or "") means "derive it" where a help string says so; `resolve_config` fills those in, so the
  trainer reads concrete values.
- A field with `choices` metadata is checked by `validate_config`. A `derived` field is computed by
  `resolve_config` (batch arithmetic is done there once); a user value must agree with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from hybridflow.config.algorithm_config import (  # the `algorithm` section; re-exported from here
    AlgorithmConfig,
    DPOConfig,  # noqa: F401
    KLConfig,  # noqa: F401
    SafeRLHFConfig,  # noqa: F401
    SFTConfig,  # noqa: F401
)
from hybridflow.engines.config import OptimConfig, ParallelConfig
from hybridflow.fields import section, setting

_f, _sub = setting, section  # short names keep the field lists readable


# kept equal to hybridflow.algorithms (losses.AGG_MODES) without importing torch here
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


# ---- shared pieces: OptimConfig and ParallelConfig are the engine's (engines/config.py) -------


# ---- models and data ---------------------------------------------------------------------------
@dataclass
class ModelConfig:
    path: str = _f("", "local HF directory of the policy (actor; also the reference and the default critic)")
    tokenizer_path: str = _f("", "tokenizer directory ('' = path)")
    critic_path: str = _f("", "critic initialisation ('' = path; the value head is new)")
    reward_model_path: str = _f("", "HF sequence-classification reward model (reward.kind=model)")
    cost_model_path: str = _f("", "cost model for Safe-RLHF")
    trust_remote_code: bool = _f(False, "allow custom modelling code shipped in the model directories")
    dtype: str = _f(
        "auto",
        "compute dtype of the actor (fp32 master weights under mixed precision), generation and the frozen "
        "models (auto = bfloat16 on GPU, float32 on CPU; bfloat16 is faster on CPUs with AVX512-BF16 for "
        "models from ~10M params; docs/rollout.md)",
        choices=("auto", "float32", "bfloat16", "float16"),
    )
    remove_padding: Optional[bool] = _f(
        None,
        "pack each micro-batch's real tokens into one row without padding (when > 5% of it is padding) in "
        "the actor / reference / critic / "
        "reward-model forward and update (verl's use_remove_padding; docs/design.md §7); the token budgets "
        "(max_tokens_per_micro_batch) then count real tokens. null = on for llama, qwen2, qwen3 and mistral "
        "models, off for others; true on another model type is rejected",
    )
    share_prompt: Optional[bool] = _f(
        None,
        "with padding removal, rows of a micro-batch with the same prompt (GRPO/RLOO's n samples) compute it "
        "once: each response attends to the one copy, outputs and gradients unchanged (docs/design.md §7). "
        "Saves the repeated prompt tokens in the reference, old-log-prob, value and update forwards. "
        "null = wherever padding is removed; true needs padding removal (rejected with remove_padding=false)",
    )


@dataclass
class DataConfig:
    train_files: list[str] = _f(
        [], "Parquet/JSONL files with verl columns (prompt, data_source, reward_model, ...)"
    )
    val_files: list[str] = _f([], "validation files (same format)")
    dataset: str = _f("", "registered dataset used when train_files is empty, e.g. 'synthetic:arithmetic'")
    dataset_kwargs: dict[str, Any] = _f({}, "keyword arguments of the registered dataset (e.g. num_samples)")
    prompt_key: str = _f("prompt", "column holding the prompt: chat messages or plain text")
    response_key: str = _f("response", "SFT: column holding the target response")
    chosen_key: str = _f("chosen", "DPO: column holding the preferred response")
    rejected_key: str = _f("rejected", "DPO: column holding the dispreferred response")
    apply_chat_template: bool = _f(True, "render prompts with the tokenizer's chat template")
    max_prompt_length: int = _f(512, "max prompt tokens")
    truncation: str = _f(
        "error",
        "what to do with longer prompts: fail, keep the left/right part, or drop them (count logged)",
        choices=("error", "left", "right", "filter"),
    )
    on_malformed: str = _f(
        "error", "a malformed row fails the load, or is skipped and reported", choices=("error", "skip")
    )
    missing_ground_truth: str = _f(
        "error",
        "a prompt row without reward_model.ground_truth under a rule reward: a malformed row (error), "
        "counted and warned at load (warn), or accepted (ignore: rewards that need none, e.g. format)",
        choices=("error", "warn", "ignore"),
    )
    train_batch_size: int = _f(8, "prompts per training step (each gets rollout.n responses)")
    val_batch_size: int = _f(0, "prompts per validation batch (0 = the whole validation set at once)")
    shuffle: bool = _f(True, "shuffle the training set every epoch (seeded, resumable)")
    seed: int = _f(1, "shuffle seed")


# ---- workers -----------------------------------------------------------------------------------
@dataclass
class ActorConfig:
    optim: OptimConfig = _sub(OptimConfig, "actor optimizer")
    ppo_mini_batch_size: int = _f(8, "prompts per optimizer step (x rollout.n sequences)")
    ppo_epochs: int = _f(1, "passes over each rollout batch")
    num_mini_batches: int = _f(
        0, "derived: data.train_batch_size / ppo_mini_batch_size optimizer steps per epoch", derived=True
    )
    micro_batch_size_per_device: int = _f(4, "sequences per forward/backward on one device")
    max_tokens_per_micro_batch: int = _f(0, "pack micro-batches up to this many tokens per device (0 = off)")
    clip_ratio_low: float = _f(0.2, "PPO clip: ratio >= 1 - clip_ratio_low")
    clip_ratio_high: float = _f(0.2, "PPO clip: ratio <= 1 + clip_ratio_high (raise for DAPO clip-higher)")
    clip_ratio_c: float = _f(3.0, "dual-clip constant for negative advantages (> 1)")
    tis_imp_ratio_cap: float = _f(
        2.0,
        "trainer.rollout_ahead=1: each token's policy loss is weighted by min(exp(old - rollout log-prob), "
        "this cap), correcting for the rollout's one-step-older policy (verl's name; <= 0 = no correction)",
    )
    loss_agg_mode: str = _f("token-mean", "how token losses become one number", choices=LOSS_AGG_MODES)
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    offload: bool = _f(False, "move parameters and optimizer state to CPU while colocated models run")
    parallel: ParallelConfig = _sub(ParallelConfig, "actor training parallelism")


@dataclass
class RolloutValConfig:
    """Sampling used for validation (greedy by default so acc@1 is deterministic)."""

    n: int = _f(1, "responses per validation prompt (mean@n is logged when > 1)")
    temperature: float = _f(0.0, "0 = greedy")
    top_k: int = _f(-1, "-1 = off")
    top_p: float = _f(1.0, "nucleus sampling threshold")


@dataclass
class RolloutConfig:
    n: int = _f(1, "responses sampled per prompt (GRPO/RLOO need >= 2)")
    temperature: float = _f(1.0, "sampling temperature (0 = greedy)")
    top_k: int = _f(-1, "top-k sampling (-1 = off)")
    top_p: float = _f(1.0, "nucleus sampling threshold")
    response_length: int = _f(512, "max new tokens per response")
    engine: str = _f(
        "builtin",
        "generation engine: builtin, or vllm (`make vllm`; docs/rollout.md)",
        choices=("builtin", "vllm"),
    )
    tg: int = _f(
        1,
        "generation tensor-parallel size (3D-HybridEngine; must divide actor tp and the head counts; with "
        "trainer.rollout_ahead=1 also the rollout pool's, so it must divide resources.rollout_devices)",
    )
    pg: int = _f(1, "generation pipeline-parallel size (only 1: pipeline parallelism does not exist yet)")
    reshard: str = _f(
        "hybridflow",
        "actor train -> generate switch (docs/hybrid_engine.md): hybridflow = micro-DP all-gather to the "
        "tg shard, allgather = whole model on every rank, vanilla = HybridFlow-V, two_copy = resident copy",
        choices=("hybridflow", "allgather", "vanilla", "two_copy"),
    )
    micro_batch_size_per_device: int = _f(0, "prompts per generate() call on one device (0 = all at once)")
    cpu_threads: int = _f(
        0, "builtin engine on CPU: torch threads while generating (0 = auto: 1 under 5M params)"
    )
    cpu_streams: int = _f(
        1,
        "builtin engine on CPU with >= 2 threads: decode the rows as this many parallel streams, one "
        "thread each, same bits as 1 thread (1 = off, the default: at 25M, 0.7-0.8x the speed of 2 "
        "OpenMP threads under load, 0.8-1.1x when lighter, docs/bench/generation.md; 0 = auto: one per thread "
        "from 5M params)",
    )
    gpu_memory_utilization: float = _f(
        0.0,
        "vllm only: fraction of device memory (CPU: of RAM) for weights + KV cache; 0 = KV cache sized "
        "for one call's sequences",
    )
    val: RolloutValConfig = _sub(RolloutValConfig, "validation sampling")


@dataclass
class CriticConfig:
    optim: OptimConfig = _sub(OptimConfig, "critic optimizer", lr=1e-5)
    ppo_mini_batch_size: int = _f(0, "prompts per critic optimizer step (0 = actor.ppo_mini_batch_size)")
    ppo_epochs: int = _f(0, "passes over each rollout batch (0 = actor.ppo_epochs)")
    num_mini_batches: int = _f(
        0, "derived: data.train_batch_size / ppo_mini_batch_size optimizer steps per epoch", derived=True
    )
    micro_batch_size_per_device: int = _f(4, "sequences per forward/backward on one device")
    max_tokens_per_micro_batch: int = _f(0, "pack micro-batches up to this many tokens per device (0 = off)")
    cliprange_value: float = _f(0.5, "clip new values to old +/- cliprange_value")
    loss_agg_mode: str = _f("token-mean", "how token losses become one number", choices=LOSS_AGG_MODES)
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    offload: bool = _f(False, "move parameters and optimizer state to CPU while colocated models run")
    parallel: ParallelConfig = _sub(ParallelConfig, "critic training parallelism")


@dataclass
class RefConfig:
    micro_batch_size_per_device: int = _f(8, "sequences per log-prob forward on one device")
    max_tokens_per_micro_batch: int = _f(0, "pack micro-batches up to this many tokens per device (0 = off)")
    offload: bool = _f(False, "keep parameters on CPU between calls")
    parallel: ParallelConfig = _sub(ParallelConfig, "reference inference parallelism")


@dataclass
class RewardConfig:
    """Rule rewards (read as is by rewards/executor.py's RewardExecutor) or a reward model."""

    kind: str = _f("rule", "rule function(s) or a reward model", choices=("rule", "model"))
    fn: str = _f(
        "", "rule reward: 'path/to/file.py:function_name' or a registered name ('' = by data_source)"
    )
    fn_kwargs: dict[str, Any] = _f({}, "extra keyword arguments passed to the reward function")
    batched: Optional[bool] = _f(None, "fn takes whole lists (true) or one sample (false); null = fn.batched")
    timeout_s: float = _f(
        10.0,
        "seconds one sample may take (hangs are killed and reported; once a sample runs past timeout_s / 10 "
        "the batch's other samples run concurrently, so a hanging batch costs about 1 x timeout_s)",
    )
    num_workers: int = _f(1, "processes scoring rule rewards (0 = built-ins in-process)")
    chunk_size: int = _f(0, "samples per chunk sent to a worker (0 = automatic)")
    on_error: str = _f(
        "score",
        "a raising/hanging reward fn is always reported (sample id + traceback); then it scores "
        "`error_score` (score), 0 (zero), or aborts the run (raise)",
        choices=("score", "zero", "raise"),
    )
    error_score: float = _f(0.0, "score given to a sample whose reward function failed")
    max_logged_errors: int = _f(5, "failures per batch logged with their full traceback (all are counted)")
    max_error_fraction: float = _f(
        0.5,
        "stop the run (one line, exit 2) when more than this fraction of a batch's rewards fail (1 = never)",
    )
    max_abs_score: float = _f(
        1e6, "a score of larger magnitude (or not finite as float32) is a failed sample"
    )
    startup_timeout_s: float = _f(
        60.0,
        "seconds a reward worker may take to import reward.fn (a hang or exit there is a one-line error)",
    )
    micro_batch_size_per_device: int = _f(8, "reward model: sequences per forward on one device")
    parallel: ParallelConfig = _sub(ParallelConfig, "reward model inference parallelism")


# ---- cluster and run ---------------------------------------------------------------------------
@dataclass
class ResourcesConfig:
    placement: str = _f(
        "colocate",
        "colocate (all models share all devices), split (actor+ref | critic+reward), auto (planner), "
        "or a plan file written by `hybridflow plan`",
    )
    device: str = _f("auto", "auto = cuda when available, else cpu", choices=("auto", "cpu", "cuda"))
    n_gpus_per_node: int = _f(1, "devices per node (on CPU: worker processes per node)")
    nnodes: int = _f(1, "number of nodes")
    rollout_devices: int = _f(
        0,
        "trainer.rollout_ahead=1: devices of the rollout pool, taken from the n_gpus_per_node * nnodes "
        "(the rest train; 0 = half of them, rounded down; with placement auto the planner sizes it)",
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
    ray_address: str = _f("", "'' = start an embedded local Ray cluster; 'auto' or host:port = join one")
    ray_num_cpus: int = _f(0, "embedded cluster: logical CPUs to declare (0 = Ray's default)")
    ray_dashboard: bool = _f(False, "embedded cluster: start Ray's dashboard (on 127.0.0.1)")

    @property
    def num_devices(self) -> int:
        return self.n_gpus_per_node * self.nnodes


@dataclass
class TrainerConfig:
    total_steps: int = _f(0, "training steps (0 = derive from total_epochs)")
    total_epochs: int = _f(1, "passes over the training set when total_steps = 0")
    val_every: int = _f(0, "validate every N steps (0 = only before training and at the end)")
    val_before_train: bool = _f(True, "validate once before the first step")
    val_generations_to_log: int = _f(4, "validation samples shown in the generations table")
    val_only: bool = _f(
        False, "validate the initial (or resumed) weights once, log the val/ metrics and exit: no training"
    )
    rollout_data_dir: str = _f(
        "", "write each step's rollouts to <dir>/<step>.jsonl: input, output, gts, score, step ('' = off)"
    )
    validation_data_dir: str = _f(
        "", "write each validation's generations to <dir>/<step>.jsonl, as rollout_data_dir ('' = off)"
    )
    save_every: int = _f(0, "checkpoint every N steps (0 = only at the end)")
    save_every_minutes: float = _f(
        30.0, "also checkpoint after a step when this many minutes passed since the last save (0 = off)"
    )
    max_restarts: int = _f(
        3,
        "a dead worker or a collective timeout: tear down, restart the workers, reload the last checkpoint, continue (this many times)",
    )
    restart_wait_s: float = _f(
        300.0,
        "on a restart, how long to wait for the devices the placement needs (a lost node replaced), "
        "printing progress; then fail, or shrink per trainer.min_devices",
    )
    min_devices: int = _f(
        0,
        "on a restart that still lacks devices after restart_wait_s: continue on fewer (dp shrinks, the "
        "batch arithmetic re-checked) down to this many; 0 = never shrink",
    )
    stop_grace_s: float = _f(
        120.0, "on SIGTERM/SIGINT: time to finish the step and write a checkpoint before abandoning them"
    )
    keep_last: int = _f(2, "checkpoints to keep (older ones are deleted)")
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
    )
    seed: int = _f(1, "global seed (model init, sampling, dropout)")
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
    )


@dataclass
class HybridFlowConfig:
    """Everything one run needs. Load with `load_config(path, overrides)`."""

    algorithm: AlgorithmConfig = _sub(AlgorithmConfig, "the algorithm and its loss settings")
    model: ModelConfig = _sub(ModelConfig, "model directories")
    data: DataConfig = _sub(DataConfig, "prompt datasets")
    actor: ActorConfig = _sub(ActorConfig, "policy training")
    rollout: RolloutConfig = _sub(RolloutConfig, "generation")
    critic: CriticConfig = _sub(CriticConfig, "value model training (PPO, Safe-RLHF)")
    ref: RefConfig = _sub(RefConfig, "reference policy inference")
    reward: RewardConfig = _sub(RewardConfig, "reward computation")
    resources: ResourcesConfig = _sub(ResourcesConfig, "devices, placement and the Ray cluster")
    trainer: TrainerConfig = _sub(TrainerConfig, "steps, validation, checkpoints, logging")

    @property
    def run_dir(self) -> str:
        import os

        return os.path.join(self.trainer.output_dir, self.trainer.experiment_name)
