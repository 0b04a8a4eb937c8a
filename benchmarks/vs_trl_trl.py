"""The TRL side of benchmarks/vs_trl.py: one GRPO run with TRL's `GRPOTrainer`, timed per phase.

Run as a subprocess by vs_trl.py (so each side gets a fresh interpreter and its own thread setting);
prints one JSON line with per-iteration timings and the reward curve. Phases are timed by wrapping
the trainer's own methods on the instance, so no TRL code is copied or changed:

  generation  `_generate` (chat template, tokenize, `model.generate`, decode)
  ref         `_get_per_token_logps_and_entropies` on the reference model (no grad)
  old         the same method on the policy without grad (TRL skips it when generation and update
              are aligned: steps_per_generation = num_iterations = 1, as here, so it stays 0)
  values      always 0 (no critic in GRPO)
  reward      `_calculate_rewards`
  update      `training_step` minus `_prepare_inputs` (forward + backward), plus the optimizer step
              (between the `on_pre_optimizer_step` and `on_optimizer_step` callbacks)
  other       the rest of the interval between two `on_step_end` callbacks (advantages, padding,
              logging, data loading)

Equal response lengths: `min_new_tokens = max_completion_length`, so `generate` masks EOS until the
last token and every completion has exactly `response_length` tokens.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

import torch
from vs_trl_common import tree_cpu_seconds, workload_parser

PHASES = ("generation", "ref", "old", "values", "reward", "update", "other")


def build_dataset(num_samples: int, seed: int):
    """The synthetic arithmetic rows as a HF dataset: conversational `prompt` + `ground_truth`."""
    from datasets import Dataset

    from hybridflow.data.synthetic import arithmetic

    rows = arithmetic("train", seed=seed, num_samples=num_samples)
    return Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_model"]["ground_truth"]} for r in rows]
    )


def arithmetic_reward(completions, ground_truth, **_):
    """The same rule hybridflow uses (first number in the response equals the answer)."""
    from hybridflow.rewards.arithmetic import compute_score

    return [
        compute_score(c[0]["content"] if isinstance(c, list) else c, gt, mode="first_number")
        for c, gt in zip(completions, ground_truth)
    ]


class PhaseTimer:
    """Seconds per phase of the current step (`current`), and the finished steps (`steps`)."""

    def __init__(self):
        self.current = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.rewards: list[float] = []
        self.last_end = self.last_cpu = 0.0
        self.tokens_seen = 0.0
        self.opt_start = 0.0

    def wrap(self, obj, name: str, phase_of):
        """Replace obj.name by a timed version; phase_of(args, kwargs) -> phase name (or None: untimed)."""
        original = getattr(obj, name)

        def timed(*args, **kwargs):
            phase = phase_of(args, kwargs)
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                if phase is not None:
                    self.current[phase] += time.perf_counter() - start

        setattr(obj, name, timed)


def build_trainer(args, timer: PhaseTimer):
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    seqs = args.batch_size * args.n
    config = GRPOConfig(
        output_dir=os.path.join(args.workdir, "trl_out"),
        use_cpu=True,
        seed=args.seed,
        max_steps=args.steps,
        per_device_train_batch_size=seqs,  # one micro-batch: every sequence of the step at once
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        num_generations=args.n,
        max_completion_length=args.response_length,
        generation_kwargs={} if args.stop_at_eos else {"min_new_tokens": args.response_length},
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=1.0,
        beta=args.kl_coef,
        epsilon=0.2,
        loss_type="dapo",  # token-mean over the batch = hybridflow's loss_agg_mode=token-mean
        scale_rewards="group",
        shuffle_dataset=False,  # both sides take the prompts in dataset order
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        log_completions=False,
        dataloader_num_workers=0,
        bf16=args.precision == "bf16",  # TRL's default is True; fp32 rows set it False
        fp16=False,
        gradient_checkpointing=False,  # TRL's GRPO default is True; hybridflow's default is off
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=arithmetic_reward,
        args=config,
        train_dataset=build_dataset(args.steps * args.batch_size, args.seed),
        processing_class=tokenizer,
    )

    t = trainer
    timer.wrap(t, "_generate", lambda a, k: "generation")
    timer.wrap(t, "_calculate_rewards", lambda a, k: "reward")

    def logps_phase(a, k):
        if torch.is_grad_enabled():
            return None  # the policy forward of the loss: counted in update
        return "ref" if (a[0] if a else k["model"]) is t.ref_model else "old"

    timer.wrap(t, "_get_per_token_logps_and_entropies", logps_phase)
    timer.wrap(t, "_prepare_inputs", lambda a, k: "prepare")
    timer.wrap(t, "training_step", lambda a, k: "train_step")

    class Hooks(TrainerCallback):
        def on_pre_optimizer_step(self, *_, **__):
            timer.opt_start = time.perf_counter()

        def on_optimizer_step(self, *_, **__):
            timer.current["optimizer"] += time.perf_counter() - timer.opt_start

        def on_step_end(self, *_, **__):
            now, cpu = time.perf_counter(), tree_cpu_seconds()
            cur = timer.current
            step = {p: cur.get(p, 0.0) for p in ("generation", "ref", "old", "values", "reward")}
            step["update"] = cur["train_step"] - cur["prepare"] + cur["optimizer"]
            step["iteration"] = now - timer.last_end
            step["other"] = step["iteration"] - sum(step[p] for p in PHASES if p != "other")
            step["cpu"] = cpu - timer.last_cpu
            timer.steps.append(step)
            timer.last_end, timer.last_cpu = now, cpu
            timer.current = defaultdict(float)

        def on_log(self, _args, _state, _control, logs=None, **__):
            if logs and "reward" in logs:  # logged after on_step_end: file it with that step
                timer.rewards.append(float(logs["reward"]))
                tokens = float(logs["num_tokens"])
                timer.steps[-1]["tokens"] = tokens - timer.tokens_seen
                timer.steps[-1]["response_len"] = float(logs.get("completions/mean_length", 0.0))
                timer.tokens_seen = tokens

    trainer.add_callback(Hooks())
    return trainer


def main(argv=None) -> int:
    p = workload_parser(__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    timer = PhaseTimer()
    trainer = build_trainer(args, timer)
    # the first interval is only closed by step 1's end: time step 0 from the train() call
    timer.last_end, timer.last_cpu = time.perf_counter(), tree_cpu_seconds()
    trainer.train()
    print(json.dumps({"side": "trl", "steps": timer.steps, "rewards": timer.rewards}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
