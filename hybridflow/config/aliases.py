"""Names other frameworks use for our settings, so an unknown key's hint considers meaning, not only
spelling (`trainer.test_freq` -> `trainer.val_every`, not the closer-spelled `trainer.seed`).

KEY_ALIASES maps a verl or TRL name (a dotted path, or a bare TRL argument name) to our key;
VALUE_ALIASES maps other spellings of a choice value to ours (`reinforce_plus_plus` -> `reinforce_pp`)
and is applied when the config is loaded. docs/verl.md lists the full verl mapping (config/verl.py).
"""

from __future__ import annotations

# their name -> our key. Paths are matched on their tail, so 'actor.ppo_micro_batch_size_per_gpu'
# also matches verl's 'actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu'.
KEY_ALIASES: dict[str, str] = {
    # verl
    "trainer.test_freq": "trainer.val_every",
    "trainer.save_freq": "trainer.save_every",
    "trainer.logger": "trainer.loggers",
    "trainer.default_local_dir": "trainer.output_dir",
    "trainer.n_gpus_per_node": "resources.n_gpus_per_node",
    "trainer.nnodes": "resources.nnodes",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep_last",
    "trainer.resume_mode": "trainer.resume",
    "rollout.name": "rollout.engine",
    "rollout.tensor_model_parallel_size": "rollout.tg",
    "rollout.val_kwargs": "rollout.val",
    "rollout.log_prob_micro_batch_size_per_gpu": "actor.micro_batch_size_per_device",
    "data.max_response_length": "rollout.response_length",
    "data.filter_overlong_prompts": "data.truncation",
    "actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size_per_device",
    "actor.ppo_max_token_len_per_gpu": "actor.max_tokens_per_micro_batch",
    "actor.use_kl_loss": "algorithm.use_kl_loss",
    "actor.kl_loss_coef": "algorithm.kl_loss_coef",
    "actor.kl_loss_type": "algorithm.kl_loss_kind",
    "actor.entropy_coeff": "algorithm.entropy_coeff",
    "actor.clip_ratio": "actor.clip_ratio_low",
    "actor.tis_imp_ratio_cap": "actor.rollout_correction.upper",  # also ours until rollout_correction
    "actor.grad_clip": "actor.optim.grad_clip",
    "optim.lr_warmup_steps": "actor.optim.warmup_steps",
    "optim.warmup_style": "actor.optim.schedule",
    "optim.clip_grad": "actor.optim.grad_clip",
    "ref.log_prob_micro_batch_size_per_gpu": "ref.micro_batch_size_per_device",
    "critic.ppo_micro_batch_size_per_gpu": "critic.micro_batch_size_per_device",
    "model.enable_gradient_checkpointing": "actor.gradient_checkpointing",
    "fsdp_config.param_offload": "actor.offload",
    "algorithm.kl_ctrl": "algorithm.kl",
    "kl_ctrl.kl_coef": "algorithm.kl.coef",
    "kl_ctrl.type": "algorithm.kl.controller",
    "kl_ctrl.target_kl": "algorithm.kl.target",
    "algorithm.use_kl_in_reward": "algorithm.kl.in_reward",
    "algorithm.kl_penalty": "algorithm.kl.kind",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_by_std",
    "reward_model.enable": "reward.kind",
    "custom_reward_function.path": "reward.fn",
    "custom_reward_function.name": "reward.fn",
    # TRL (GRPOConfig / PPOConfig / DPOConfig / TrainingArguments)
    "model_name_or_path": "model.path",
    "learning_rate": "actor.optim.lr",
    "num_generations": "rollout.n",
    "max_completion_length": "rollout.response_length",
    "max_new_tokens": "rollout.response_length",
    "max_prompt_length": "data.max_prompt_length",
    "per_device_train_batch_size": "actor.micro_batch_size_per_device",
    "num_train_epochs": "trainer.total_epochs",
    "max_steps": "trainer.total_steps",
    "eval_steps": "trainer.val_every",
    "save_steps": "trainer.save_every",
    "save_total_limit": "trainer.keep_last",
    "report_to": "trainer.loggers",
    "run_name": "trainer.experiment_name",
    "warmup_steps": "actor.optim.warmup_steps",
    "lr_scheduler_type": "actor.optim.schedule",
    "max_grad_norm": "actor.optim.grad_clip",
    "epsilon": "actor.clip_ratio_low",
    "epsilon_high": "actor.clip_ratio_high",
    "num_iterations": "actor.ppo_epochs",
    "num_ppo_epochs": "actor.ppo_epochs",
    "kl_coef": "algorithm.kl.coef",
    "cliprange": "actor.clip_ratio_low",
    "cliprange_value": "critic.cliprange_value",
    "vf_coef": "critic.optim.lr",
    "scale_rewards": "algorithm.norm_by_std",
    "gradient_checkpointing": "actor.gradient_checkpointing",
    "use_vllm": "rollout.engine",
    "vllm_gpu_memory_utilization": "rollout.gpu_memory_utilization",
}

# key -> {their value: ours}
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "algorithm.name": {"reinforce_plus_plus": "reinforce_pp", "reinforce++": "reinforce_pp", "gae": "ppo"},
    "algorithm.adv_estimator": {"reinforce_plus_plus": "reinforce_pp", "reinforce++": "reinforce_pp"},
    "rollout.engine": {"hf": "builtin"},
}


def alias_for(path: str) -> str | None:
    """Our key for a foreign dotted `path` (matched on its longest known tail), or None."""
    parts = path.split(".")
    for i in range(len(parts)):
        tail = ".".join(parts[i:])
        if tail in KEY_ALIASES:
            return KEY_ALIASES[tail]
    return None


def normalize_values(data: dict) -> dict:
    """`data` (a nested config mapping) with VALUE_ALIASES applied in place; returns it."""
    for key, table in VALUE_ALIASES.items():
        section, _, name = key.partition(".")
        node = data.get(section)
        if isinstance(node, dict) and isinstance(node.get(name), str) and node[name] in table:
            node[name] = table[node[name]]
    return data
