"""The configuration tree: one dataclass per component, composed into `HybridFlowConfig`.

Each component's dataclass is defined once, with its help text (hybridflow/fields.py; docs/design.md §7):
the engine's OptimConfig / ParallelConfig in engines/config.py, the `algorithm` section's in
config/algorithm_config.py, `resources` and `trainer` in config/run_config.py, the rest here, all composed into
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

from hybridflow.config.agent import MultiTurnConfig, multi_turn_errors
from hybridflow.config.algorithm_config import (  # the `algorithm` section; re-exported from here
    AlgorithmConfig,
    DPOConfig,  # noqa: F401
    KLConfig,  # noqa: F401
    SafeRLHFConfig,  # noqa: F401
    SFTConfig,  # noqa: F401
)
from hybridflow.config.dapo import OverlongBufferConfig
from hybridflow.config.run_config import ResourcesConfig, TrainerConfig  # the `resources`, `trainer` sections
from hybridflow.config.sandbox import SandboxConfig
from hybridflow.engines.config import LoraConfig, OptimConfig, ParallelConfig, lora_errors, optim_errors
from hybridflow.fields import MAX_PER_MACHINE, MAX_SECONDS, MAX_SEED, section, setting

_f, _sub = setting, section  # short names keep the field lists readable


# kept equal to hybridflow.algorithms (losses.AGG_MODES, policy_losses.POLICY_LOSSES,
# rollout_correction.CORRECTION_MODES / _LEVELS) without importing torch here (tests/config checks)
LOSS_AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)
POLICY_LOSS_NAMES = ("vanilla", "gspo", "cispo", "geo_mean")
CORRECTION_MODES = ("none", "tis", "mis", "icepop", "geo_mask")
CORRECTION_LEVELS = ("token", "sequence")
_AGG_HELP = (
    "how token losses become one number: token-mean, token-sum (no normaliser), seq-mean-token-sum, "
    "seq-mean-token-mean (GRPO), seq-mean-token-sum-norm (Dr. GRPO: each sequence's sum / "
    "rollout.response_length)"
)


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
        "models (auto = bfloat16 on GPU, float32 on CPU; docs/rollout.md, 'Compute dtype', says when "
        "bfloat16 pays on CPU)",
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
    cpu_gemm: str = _f(
        "auto",
        "library for fp32 matrix products on CPU (the training engines' linear layers and the built-in "
        "decoder): mkl (PyTorch's own), onednn, or auto = oneDNN on x86 CPUs with AVX-512 that are not Intel's, "
        "where MKL runs its AVX2 kernels (docs/rollout.md, 'CPU GEMMs'); no effect on GPUs, in 16-bit or under "
        "tensor parallelism",
        choices=("auto", "onednn", "mkl"),
    )
    lora: LoraConfig = _sub(
        LoraConfig,
        "LoRA: low-rank adapters on the actor (and the critic) over frozen base weights; the reference is the "
        "actor with its adapters off (docs/lora.md)",
    )


@dataclass
class DataConfig:
    train_files: list[str] = _f(
        [], "Parquet/JSONL files with verl columns (prompt, data_source, reward_model, ...)"
    )
    val_files: list[str] = _f([], "validation files (same format)")
    dataset: str = _f(
        "",
        "registered dataset used when train_files is empty, e.g. 'synthetic:arithmetic', or "
        "'reasoning_gym:<task>' (reasoning-gym's procedural tasks, scored by their verifiers; its extra)",
    )
    dataset_kwargs: dict[str, Any] = _f({}, "keyword arguments of the registered dataset (e.g. num_samples)")
    prompt_key: str = _f("prompt", "column holding the prompt: chat messages or plain text")
    response_key: str = _f("response", "SFT: column holding the target response")
    chosen_key: str = _f("chosen", "DPO: column holding the preferred response")
    rejected_key: str = _f("rejected", "DPO: column holding the dispreferred response")
    apply_chat_template: bool = _f(True, "render prompts with the tokenizer's chat template")
    max_prompt_length: int = _f(512, "max prompt tokens", ge=1)
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
    train_batch_size: int = _f(8, "prompts per training step (each gets rollout.n responses)", ge=1)
    val_batch_size: int = _f(0, "prompts per validation batch (0 = the whole validation set at once)", ge=0)
    shuffle: bool = _f(True, "shuffle the training set every epoch (seeded, resumable)")
    seed: int = _f(1, "shuffle seed", ge=0, le=MAX_SEED)


# ---- workers -----------------------------------------------------------------------------------
@dataclass
class RolloutCorrectionConfig:
    """Importance weights for the gap between the rollout's log-probs and the training engine's (bf16,
    vLLM, trainer.rollout_ahead=1), on each token's policy loss (algorithms/rollout_correction.py;
    defaults: docs/metrics.md, "Rollout correction")."""

    mode: str = _f(
        "tis",
        "none; tis: weight min(rho, upper); mis: weight rho, 0 outside [lower, upper]; icepop: mis per token "
        "with lower > 0; geo_mask: drop sequences whose geometric-mean rho is outside [lower, upper]",
        choices=CORRECTION_MODES,
    )
    level: str = _f(
        "token",
        "rho per token, or per sequence (the product of its token ratios); tis and mis only (icepop is "
        "per token, geo_mask per sequence by definition)",
        choices=CORRECTION_LEVELS,
    )
    upper: float = _f(2.0, "upper bound on rho (tis: the truncation cap, verl's tis_imp_ratio_cap)", gt=0)
    lower: float = _f(0.0, "lower bound on rho (mis, icepop, geo_mask; 0 = none)", ge=0)


@dataclass
class ActorConfig:
    optim: OptimConfig = _sub(OptimConfig, "actor optimizer")
    ppo_mini_batch_size: int = _f(8, "prompts per optimizer step (x rollout.n sequences)", ge=1)
    ppo_epochs: int = _f(1, "passes over each rollout batch", ge=1)
    num_mini_batches: int = _f(
        0,
        "derived: data.train_batch_size / ppo_mini_batch_size optimizer steps per epoch",
        derived=True,
        ge=0,
    )
    micro_batch_size_per_device: int = _f(4, "sequences per forward/backward on one device", ge=1)
    max_tokens_per_micro_batch: int = _f(
        0, "pack micro-batches up to this many tokens per device (0 = off)", ge=0
    )
    policy_loss: str = _f(
        "vanilla",
        "vanilla (PPO clip + dual clip), gspo (sequence ratio), cispo (clipped IS weight x log-prob), geo_mean "
        "(GMPO); verl's names (algorithms/policy_losses.py)",
        choices=POLICY_LOSS_NAMES,
    )
    clip_ratio_low: float = _f(
        0.2,
        "clip: ratio >= 1 - clip_ratio_low (gspo: of the sequence ratio, ~3e-4; geo_mean: log-ratio >= -it)",
        ge=0,
    )
    clip_ratio_high: float = _f(
        0.2,
        "clip: ratio <= 1 + clip_ratio_high (raise for DAPO clip-higher; gspo: ~4e-4; geo_mean: log-ratio <= it)",
        ge=0,
    )
    clip_ratio_c: float = _f(
        3.0, "dual-clip constant for negative advantages (policy_loss vanilla only)", gt=1
    )
    rollout_correction: RolloutCorrectionConfig = _sub(
        RolloutCorrectionConfig, "rollout-vs-training log-prob correction"
    )
    loss_agg_mode: str = _f("token-mean", _AGG_HELP, choices=LOSS_AGG_MODES)
    mask_truncated: bool = _f(
        False,
        "DAPO's overlong filtering: responses that reached rollout.response_length take no part in the loss "
        "(algorithm.name=dapo)",
    )
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    offload: bool = _f(False, "move parameters and optimizer state to CPU while colocated models run")
    parallel: ParallelConfig = _sub(ParallelConfig, "actor training parallelism")


@dataclass
class RolloutValConfig:
    """Sampling used for validation (greedy by default so acc@1 is deterministic)."""

    n: int = _f(1, "responses per validation prompt (mean@n is logged when > 1)", ge=1)
    temperature: float = _f(0.0, "0 = greedy", ge=0)
    top_k: int = _f(-1, "-1 or 0 = off", ge=-1)
    top_p: float = _f(1.0, "nucleus sampling threshold", gt=0, le=1)


@dataclass
class RolloutConfig:
    n: int = _f(1, "responses sampled per prompt (GRPO/RLOO need >= 2)", ge=1)
    temperature: float = _f(1.0, "sampling temperature (0 = greedy)", ge=0)
    top_k: int = _f(-1, "top-k sampling (-1 or 0 = off)", ge=-1)
    top_p: float = _f(1.0, "nucleus sampling threshold", gt=0, le=1)
    response_length: int = _f(512, "max new tokens per response", ge=1)
    engine: str = _f(
        "builtin",
        "generation engine: builtin, or vllm (`make vllm`; docs/rollout.md)",
        choices=("builtin", "vllm"),
    )
    tg: int = _f(
        1,
        "generation tensor-parallel size (3D-HybridEngine; must divide actor tp and the head counts; with "
        "trainer.rollout_ahead=1 also the rollout pool's, so it must divide resources.rollout_devices)",
        ge=1,
    )
    pg: int = _f(
        1, "generation pipeline-parallel size (only 1: pipeline parallelism does not exist yet)", ge=1
    )
    reshard: str = _f(
        "hybridflow",
        "actor train -> generate switch (docs/hybrid_engine.md): hybridflow = micro-DP all-gather to the "
        "tg shard, allgather = whole model on every rank, vanilla = HybridFlow-V, two_copy = resident copy",
        choices=("hybridflow", "allgather", "vanilla", "two_copy"),
    )
    micro_batch_size_per_device: int = _f(
        0, "prompts per generate() call on one device (0 = all at once)", ge=0
    )
    cpu_threads: int = _f(
        0,
        "builtin engine on CPU: torch threads while generating (0 = auto: 1 under 5M params)",
        ge=0,
        le=MAX_PER_MACHINE,
    )
    gpu_memory_utilization: float = _f(
        0.0,
        "vllm only: fraction of device memory (CPU: of RAM) for weights + KV cache; 0 = KV cache sized "
        "for one call's sequences",
        unit=True,
    )
    val: RolloutValConfig = _sub(RolloutValConfig, "validation sampling")
    multi_turn: MultiTurnConfig = _sub(
        MultiTurnConfig, "multi-turn rollouts with tools or an environment (response_length bounds the whole "
        "trajectory: model turns and tool outputs)",
    )  # fmt: skip


@dataclass
class CriticConfig:
    optim: OptimConfig = _sub(OptimConfig, "critic optimizer", lr=1e-5)
    ppo_mini_batch_size: int = _f(
        0, "prompts per critic optimizer step (0 = actor.ppo_mini_batch_size)", ge=0
    )
    ppo_epochs: int = _f(0, "passes over each rollout batch (0 = actor.ppo_epochs)", ge=0)
    num_mini_batches: int = _f(
        0,
        "derived: data.train_batch_size / ppo_mini_batch_size optimizer steps per epoch",
        derived=True,
        ge=0,
    )
    micro_batch_size_per_device: int = _f(4, "sequences per forward/backward on one device", ge=1)
    max_tokens_per_micro_batch: int = _f(
        0, "pack micro-batches up to this many tokens per device (0 = off)", ge=0
    )
    cliprange_value: float = _f(0.5, "clip new values to old +/- cliprange_value", gt=0)
    loss_agg_mode: str = _f("token-mean", _AGG_HELP, choices=LOSS_AGG_MODES)
    gradient_checkpointing: bool = _f(False, "recompute activations in backward to save memory")
    offload: bool = _f(False, "move parameters and optimizer state to CPU while colocated models run")
    parallel: ParallelConfig = _sub(ParallelConfig, "critic training parallelism")


@dataclass
class RefConfig:
    micro_batch_size_per_device: int = _f(8, "sequences per log-prob forward on one device", ge=1)
    max_tokens_per_micro_batch: int = _f(
        0, "pack micro-batches up to this many tokens per device (0 = off)", ge=0
    )
    offload: bool = _f(False, "keep parameters on CPU between calls")
    parallel: ParallelConfig = _sub(ParallelConfig, "reference inference parallelism")


@dataclass
class RewardFnConfig:
    """One of several weighted rule rewards (reward.fns): the run's score is the weighted sum."""

    fn: str = _f(
        "", "a reward spec, as reward.fn: a registered name, 'file.py:function' or 'module:function'"
    )
    weight: float = _f(1.0, "its weight in the run's score (the sum of weight x score over reward.fns)")
    name: str = _f("", "its metrics' name, reward/<name>/mean ('' = the function's name)")
    fn_kwargs: dict[str, Any] = _f({}, "extra keyword arguments passed to this function")


@dataclass
class RewardConfig:
    """Rule rewards (read as is by rewards/executor.py's RewardExecutor) or a reward model."""

    kind: str = _f("rule", "rule function(s) or a reward model", choices=("rule", "model"))
    fn: str = _f(
        "", "rule reward: 'path/to/file.py:function_name' or a registered name ('' = by data_source)"
    )
    fn_kwargs: dict[str, Any] = _f({}, "extra keyword arguments passed to the reward function")
    fns: list[RewardFnConfig] = _f(
        [],
        "several weighted rule rewards, each {fn, weight, name, fn_kwargs}, each logged as reward/<name>/mean "
        "(instead of reward.fn); the score is their weighted sum",
    )
    batched: Optional[bool] = _f(None, "fn takes whole lists (true) or one sample (false); null = fn.batched")
    timeout_s: float = _f(
        10.0,
        "seconds one sample may take (hangs are killed and reported; once a sample runs past timeout_s / 10 "
        "the batch's other samples run concurrently, so a hanging batch costs about 1 x timeout_s); "
        "a batched fn: seconds one call may take",
        gt=0,
        le=MAX_SECONDS,
    )
    num_workers: int = _f(
        1, "processes scoring rule rewards (0 = built-ins in-process)", ge=0, le=MAX_PER_MACHINE
    )
    chunk_size: int = _f(0, "samples per chunk sent to a worker (0 = automatic)", ge=0)
    on_error: str = _f(
        "score",
        "a raising/hanging reward fn is always reported (sample id + traceback); then it scores "
        "`error_score` (score), 0 (zero), or aborts the run (raise)",
        choices=("score", "zero", "raise"),
    )
    error_score: float = _f(0.0, "score given to a sample whose reward function failed")
    max_logged_errors: int = _f(
        5, "failures per batch logged with their full traceback (all are counted)", ge=0
    )
    max_error_fraction: float = _f(
        0.5,
        "stop the run (one line, exit 2) when more than this fraction of a batch's rewards fail (1 = never)",
        unit=True,
    )
    max_abs_score: float = _f(
        1e6, "a score of larger magnitude (or not finite as float32) is a failed sample", gt=0
    )
    startup_timeout_s: float = _f(
        60.0,
        "seconds a reward worker may take to import reward.fn (a hang or exit there is a one-line error)",
        gt=0,
        le=MAX_SECONDS,
    )
    preload: list[str] = _f(
        [],
        "modules each reward worker imports at start-up, not inside the first sample's timeout "
        "(data.dataset=reasoning_gym:<task> adds reasoning_gym)",
    )
    micro_batch_size_per_device: int = _f(8, "reward model: sequences per forward on one device", ge=1)
    parallel: ParallelConfig = _sub(ParallelConfig, "reward model inference parallelism")
    overlong_buffer: OverlongBufferConfig = _sub(
        OverlongBufferConfig, "DAPO's overlong reward shaping of training scores (algorithm.name=dapo)"
    )
    sandbox: SandboxConfig = _sub(SandboxConfig, "limits and process containment of rule reward code")


# ---- cluster and run ---------------------------------------------------------------------------
# ResourcesConfig and TrainerConfig, with their checks: config/run_config.py


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


# ---- each section's own checks, one line per problem naming its key (config/validate.collect_errors runs
# them; a check that needs another section lives there). Choices are checked from the field metadata.
def model_errors(m: ModelConfig) -> list[str]:
    errors = lora_errors(m.lora, "model.lora")
    if m.share_prompt is True and m.remove_padding is False:
        errors.append(
            "model.share_prompt: true needs padding removal (shared prompts live in packed rows), but "
            "model.remove_padding is false; set share_prompt to null or false, or remove_padding to null or true"
        )
    return errors


def data_errors(d: DataConfig) -> list[str]:
    return []  # its ranges are the fields' domains (fields.domain_errors)


def actor_errors(a: ActorConfig) -> list[str]:
    return optim_errors(a.optim, "actor.optim")  # the ranges: the fields' domains


def rollout_errors(r: RolloutConfig) -> list[str]:
    # the ranges are the fields' domains; what each engine uses: rollout/factory.rollout_engine_errors
    return multi_turn_errors(r.multi_turn)


def critic_errors(c: CriticConfig) -> list[str]:
    return optim_errors(c.optim, "critic.optim")


def ref_errors(r: RefConfig) -> list[str]:
    return []  # its ranges are the fields' domains


def reward_errors(r: RewardConfig) -> list[str]:
    errors = []
    if r.on_error == "score" and abs(r.error_score) > r.max_abs_score:
        errors.append(f"reward.error_score: {r.error_score} is beyond reward.max_abs_score {r.max_abs_score}, "
                      "a score the run itself counts as failed; choose one within it")  # fmt: skip
    return errors + reward_fns_errors(r)  # reward.sandbox: its fields' domains


def reward_fns_errors(r: RewardConfig) -> list[str]:
    """reward.fns replaces reward.fn and its fn_kwargs (each entry has its own), so both set is refused."""
    if not r.fns:
        return []
    errors = [f"reward.fns and reward.{k} are both set; give each entry its own fn and fn_kwargs"
              for k, v in (("fn", r.fn), ("fn_kwargs", r.fn_kwargs)) if v]  # fmt: skip
    errors += [f"reward.fns[{i}].fn: empty; name a reward function" for i, e in enumerate(r.fns) if not e.fn]
    names = [reward_fn_name(e) for e in r.fns]
    errors += [f"reward.fns: two entries are named {n!r}; set reward.fns[i].name" for n in sorted(set(names))
               if names.count(n) > 1]  # fmt: skip
    return errors


def reward_fn_name(entry: RewardFnConfig) -> str:
    """reward.fns entry -> its metrics' name: `name`, else the function's name in its spec."""
    return entry.name or entry.fn.rsplit(":", 1)[-1].rsplit(".", 1)[-1].rsplit("/", 1)[-1]
