"""verl keys without an equivalent here, each classed by whether it can change the job (config/verl.py
applies these tables; docs/verl.md lists every entry, checked by tests/config/test_verl_keys.py).

- NOTED / NOTED_TREES: keys with no effect on results here (logging, profiling, paths, kernels, memory
  and batching knobs under which the numbers are the same, settings read only by a feature that is
  refused below). Accepted; each is named in a printed note.
- REFUSED: keys that would change the job. Accepted with a note only with a value under which verl
  does what runs here; any other value is refused in one line naming the key and why (exit 2 before
  Ray starts). Starting from a saved LoRA adapter, verl's own agent loops and tool classes, Megatron, sandboxed
  code execution and custom dataset
  classes are here until their features land.
A key in none of the tables nor mapped (config/verl.py's RENAMES and PREFIXES) is refused, as verl's
own (struct) config refuses a key it does not know: every key of verl's full PPO configs of 0.4.1,
0.5, 0.6 and 0.7 is in one of them.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any

OFF = (None, "")  # "not set" in verl's YAMLs
LORA_ADAPTER = "starting from a saved LoRA adapter is not supported yet (model.lora trains new ones)"
CRITIC_LORA = "the critic's adapters take model.lora's settings (verl's default here)"
MULTI_TURN = (
    "verl's agent loops do not run here; multi-turn rollouts are rollout.multi_turn (docs/rollout.md)"
)
VERL_TOOLS = "verl's tool classes do not run here; list typed functions in rollout.multi_turn.tools"
MEGATRON = "Megatron-LM is not supported; models here train with FSDP2 sharding (strategy fsdp)"
FSDP = ("fsdp", "fsdp2")
FP32 = ("fp32", "float32")
BF16 = ("bf16", "bfloat16")
MODEL_DTYPE = "verl keeps this model's parameters in that dtype; here trained models keep float32 ones"
COMPUTE_DTYPE = "the compute dtype is model.dtype (auto = bfloat16 on GPU, as verl's default)"

# verl key -> (why, the values accepted: those under which verl does what runs here)
REFUSED: dict[str, tuple[str, tuple]] = {
    # models
    "actor_rollout_ref.model.lora_adapter_path": (LORA_ADAPTER, OFF),
    "actor_rollout_ref.model.exclude_modules": (
        "LoRA adapters go on model.lora.target_modules, none left out",
        OFF,
    ),
    # the critic's adapters are model.lora's (model.lora.critic switches them; config/verl.py maps lora_rank)
    "critic.model.lora_alpha": (CRITIC_LORA, (16, 16.0)),
    "critic.model.target_modules": (CRITIC_LORA, ("all-linear", ["all-linear"])),
    "actor_rollout_ref.model.external_lib": ("import it in a reward or model module", OFF),
    "actor_rollout_ref.model.custom_chat_template": ("prompts use the tokenizer's own chat template", OFF),
    "actor_rollout_ref.model.override_config": ("the model's config.json is used as is", ({}, None)),
    "critic.model.override_config": ("the model's config.json is used as is", ({}, None)),
    "actor_rollout_ref.model.hf_config_path": ("the model config is read from model.path", OFF),
    "actor_rollout_ref.model.mtp.enable": ("multi-token prediction is not supported", (False,)),
    "actor_rollout_ref.hybrid_engine": ("the actor always generates (the HybridEngine)", (True,)),
    "actor_rollout_ref.ref.model": ("the reference is the policy's initial weights (model.path)", OFF),
    # engines
    "actor_rollout_ref.actor.strategy": (MEGATRON, FSDP),
    "actor_rollout_ref.ref.strategy": (MEGATRON, FSDP),
    "critic.strategy": (MEGATRON, FSDP),
    "reward_model.strategy": (MEGATRON, FSDP),
    "actor_rollout_ref.actor.fsdp_config.strategy": (MEGATRON, FSDP),
    "actor_rollout_ref.ref.fsdp_config.strategy": (MEGATRON, FSDP),
    "critic.model.fsdp_config.strategy": (MEGATRON, FSDP),
    "actor_rollout_ref.actor.fsdp_config.model_dtype": (MODEL_DTYPE, FP32),
    "critic.model.fsdp_config.model_dtype": (MODEL_DTYPE, FP32),
    "actor_rollout_ref.ref.fsdp_config.model_dtype": (
        "the reference computes in model.dtype whichever dtype stores it",
        FP32 + BF16,
    ),
    "actor_rollout_ref.actor.fsdp_config.dtype": (COMPUTE_DTYPE, BF16),
    "actor_rollout_ref.ref.fsdp_config.dtype": (COMPUTE_DTYPE, BF16),
    "critic.model.fsdp_config.dtype": (COMPUTE_DTYPE, BF16),
    "actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype": (COMPUTE_DTYPE, BF16),
    "actor_rollout_ref.rollout.dtype": (COMPUTE_DTYPE, BF16),
    "actor_rollout_ref.actor.ulysses_sequence_parallel_size": ("no sequence parallelism", (1,)),
    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size": ("no sequence parallelism", (1,)),
    "actor_rollout_ref.ref.ulysses_sequence_parallel_size": ("no sequence parallelism", (1,)),
    "critic.ulysses_sequence_parallel_size": ("no sequence parallelism", (1,)),
    # the actor's update
    "actor_rollout_ref.actor.shuffle": ("mini-batches keep the rollout order", (False,)),
    "critic.shuffle": ("mini-batches keep the rollout order", (False,)),
    "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio": ("set actor.optim.warmup_steps", (0, 0.0)),
    "critic.optim.lr_warmup_steps_ratio": ("set critic.optim.warmup_steps", (0, 0.0)),
    "actor_rollout_ref.actor.optim.optimizer": ("the optimizer is AdamW", ("AdamW", "adamw")),
    "critic.optim.optimizer": ("the optimizer is AdamW", ("AdamW", "adamw")),
    "actor_rollout_ref.actor.optim.override_optimizer_config": ("the optimizer is AdamW", ({}, None)),
    "critic.optim.override_optimizer_config": ("the optimizer is AdamW", ({}, None)),
    "actor_rollout_ref.actor.loss_scale_factor": ("token losses are scaled by actor.loss_agg_mode", OFF),
    "actor_rollout_ref.actor.router_replay.mode": ("no MoE router replay", ("disabled",)),
    "actor_rollout_ref.ref.router_replay.mode": ("no MoE router replay", ("disabled",)),
    # generation
    "actor_rollout_ref.rollout.mode": (
        "generation here is one batched call per step; verl's sync and async (single-turn agent loop) "
        "modes sample the same responses",
        ("sync", "async"),
    ),
    "actor_rollout_ref.rollout.do_sample": (
        "for greedy training rollouts set actor_rollout_ref.rollout.temperature=0",
        (True,),
    ),
    "actor_rollout_ref.rollout.ignore_eos": ("responses end at EOS", (False,)),
    "actor_rollout_ref.rollout.use_fire_sampling": (
        "no FIRE sampling: every token at the temperature",
        (False,),
    ),
    "actor_rollout_ref.rollout.over_sample_rate": ("every response is awaited", (0, 0.0)),
    "actor_rollout_ref.rollout.skip_rollout": ("every step generates", (False,)),
    "actor_rollout_ref.rollout.quantization": ("no quantized rollouts", OFF),
    "actor_rollout_ref.rollout.enable_rollout_routing_replay": ("no MoE router replay", (False,)),
    "actor_rollout_ref.rollout.multi_turn.tool_config_path": (VERL_TOOLS, OFF),
    "actor_rollout_ref.rollout.multi_turn.interaction_config_path": (
        "no simulated-user (interaction) turns",
        OFF,
    ),
    "actor_rollout_ref.rollout.multi_turn.max_user_turns": ("no simulated-user (interaction) turns", OFF),
    "actor_rollout_ref.rollout.multi_turn.max_tool_response_length": (
        "verl cuts a tool's output by characters; here rollout.multi_turn.max_tool_output_tokens cuts by tokens "
        "(its default, 256, is taken as that many tokens)",
        (*OFF, 256),
    ),
    "actor_rollout_ref.rollout.agent.default_agent_loop": (MULTI_TURN, ("single_turn_agent",)),
    "actor_rollout_ref.rollout.agent.agent_loop_config_path": (MULTI_TURN, OFF),
    "actor_rollout_ref.rollout.agent.custom_async_server.path": (MULTI_TURN, OFF),
    "data.tool_config_path": (VERL_TOOLS, OFF),
    # data
    "data.custom_cls.path": (
        "custom dataset classes are not supported yet (data.dataset registers one)",
        OFF,
    ),
    "data.sampler.class_path": ("custom samplers are not supported; data.shuffle orders the prompts", OFF),
    "data.datagen.path": ("dynamic data generation is not supported", OFF),
    "data.train_max_samples": ("every row of the training files is used", (-1, None)),
    "data.val_max_samples": ("every row of the validation files is used", (-1, None)),
    "data.apply_chat_template_kwargs": ("the chat template takes no extra arguments", ({}, None)),
    "data.reward_fn_key": ("rewards dispatch on data_source", ("data_source",)),
    "data.tokenizer": ("set actor_rollout_ref.model.tokenizer_path", OFF),
    # rewards
    "reward_model.reward_manager": (
        "rule rewards run in the reward executor (reward.num_workers); dapo adds the overlong buffer",
        ("naive", "prime", "dapo"),
    ),
    "reward_manager.name": (
        "rule rewards run in the reward executor (reward.num_workers); dapo adds the overlong buffer",
        ("naive", "prime", "dapo"),
    ),
    "reward_manager.source": ("reward managers are not pluggable", ("register",)),
    "reward_manager.module.path": ("reward managers are not pluggable", OFF),
    "reward_model.reward_loop_source": ("reward managers are not pluggable", ("register",)),
    "reward_model.reward_loop_module_path": ("reward managers are not pluggable", OFF),
    "reward_model.reward_loop_class_name": ("reward managers are not pluggable", OFF),
    "reward_model.sandbox_fusion.url": ("sandboxed code execution is not supported yet", OFF),
    "reward_model.max_length": ("the reward model reads whole sequences", OFF),
    "reward_model.model.override_config": ("the model's config.json is used as is", ({}, None)),
    # algorithm and trainer
    "algorithm.use_pf_ppo": ("no prioritized-replay PPO (pf_ppo)", (False,)),
    "trainer.critic_warmup": ("no critic-only warm-up steps", (0,)),
    "trainer.default_hdfs_dir": ("no HDFS copy; checkpoints go to trainer.output_dir", OFF),
    "trainer.del_local_ckpt_after_load": ("checkpoints are kept per trainer.keep_last", (False,)),
    "transfer_queue.enable": ("no transfer queue: batches move through Ray", (False,)),
}

# verl key -> why it has no effect on results here (a note names it)
NOTED: dict[str, str] = {
    "actor_rollout_ref.model.use_liger": "no Liger kernels; the HF model's own ops run",
    "actor_rollout_ref.model.use_fused_kernels": "no fused kernels",
    "actor_rollout_ref.model.use_shm": "models load from disk",
    "actor_rollout_ref.model.enable_activation_offload": "activations stay on the device",
    "actor_rollout_ref.nccl_timeout": "collective timeouts are the worker groups' own",
    "actor_rollout_ref.actor.ppo_micro_batch_size": "deprecated in verl; set ppo_micro_batch_size_per_gpu",
    "actor_rollout_ref.actor.fsdp_config.grad_offload": "deprecated in verl; gradients stay on device",
    "actor_rollout_ref.actor.use_torch_compile": "no torch.compile",
    "actor_rollout_ref.actor.use_fused_kernels": "no fused kernels",
    "actor_rollout_ref.actor.use_remove_padding": "a copy of actor_rollout_ref.model.use_remove_padding",
    "actor_rollout_ref.actor.use_prefix_grouper": "shared prompts are packed per model.remove_padding",
    "actor_rollout_ref.actor.entropy_from_logits_with_chunking": "logits are chunked per engine setting",
    "actor_rollout_ref.actor.entropy_checkpointing": "memory setting",
    "actor_rollout_ref.actor.calculate_entropy": "actor/entropy is always logged",
    "actor_rollout_ref.actor.calculate_sum_pi_squared": "a metric input of verl's",
    "actor_rollout_ref.actor.sum_pi_squared_checkpointing": "memory setting",
    "actor_rollout_ref.actor.freeze_vision_tower": "text models only",
    "actor_rollout_ref.actor.data_loader_seed": "mini-batches keep the rollout order (shuffle false)",
    "actor_rollout_ref.actor.rollout_n": "a copy of actor_rollout_ref.rollout.n",
    "actor_rollout_ref.actor.tau_pos": "read only by verl's sapo loss (refused)",
    "actor_rollout_ref.actor.tau_neg": "read only by verl's sapo loss (refused)",
    "actor_rollout_ref.actor.optim.optimizer_impl": "torch's AdamW",
    "actor_rollout_ref.actor.optim.total_training_steps": "filled in by the trainer, as in verl",
    "actor_rollout_ref.actor.optim.num_cycles": "read only by verl's cosine schedule with restarts",
    "actor_rollout_ref.rollout.micro_batch_size": "deprecated in verl",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": "deprecated in verl",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": "old log-probs use actor.micro_batch_size_per_device",
    "actor_rollout_ref.rollout.log_prob_use_dynamic_bsz": "old log-probs use actor.max_tokens_per_micro_batch",
    "actor_rollout_ref.rollout.log_prob_max_token_len_per_gpu": "old log-probs use actor.max_tokens_per_micro_batch",
    "actor_rollout_ref.rollout.enforce_eager": "vllm engine setting, chosen by the engine",
    "actor_rollout_ref.rollout.free_cache_engine": "the KV cache is freed after each generate",
    "actor_rollout_ref.rollout.load_format": "weights come from the actor in memory",
    "actor_rollout_ref.rollout.max_num_batched_tokens": "vllm engine setting, chosen by the engine",
    "actor_rollout_ref.rollout.enable_chunked_prefill": "vllm engine setting, chosen by the engine",
    "actor_rollout_ref.rollout.enable_prefix_caching": "vllm engine setting, chosen by the engine",
    "actor_rollout_ref.rollout.max_num_seqs": "vllm engine setting, chosen by the engine",
    "actor_rollout_ref.rollout.max_model_len": "sized from data.max_prompt_length + response length",
    "actor_rollout_ref.rollout.cudagraph_capture_sizes": "vllm engine setting, chosen by the engine",
    "actor_rollout_ref.rollout.disable_log_stats": "vllm engine setting, chosen by the engine",
    "actor_rollout_ref.rollout.scheduling_policy": "vllm engine setting, chosen by the engine",
    "actor_rollout_ref.rollout.multi_stage_wake_up": "memory setting",
    "actor_rollout_ref.rollout.layered_summon": "memory setting",
    "actor_rollout_ref.rollout.update_weights_bucket_megabytes": "weights sync in memory (rollout.reshard)",
    "actor_rollout_ref.rollout.data_parallel_size": "generation is data-parallel over the actor's devices",
    "actor_rollout_ref.rollout.expert_parallel_size": "no expert parallelism (dense models)",
    "actor_rollout_ref.rollout.pipeline_model_parallel_size": "see rollout.pg",
    "actor_rollout_ref.rollout.prompt_length": "a copy of data.max_prompt_length",
    "actor_rollout_ref.rollout.calculate_log_probs": "the rollout's log-probs are always kept",
    "actor_rollout_ref.rollout.logprobs_mode": "the rollout's log-probs follow the training convention",
    "actor_rollout_ref.rollout.skip_dump_dir": "read only by skip_rollout (refused)",
    "actor_rollout_ref.rollout.skip_tokenizer_init": "vllm engine setting, chosen by the engine",
    "actor_rollout_ref.rollout.quantization_config_file": "read only with quantization (refused)",
    "actor_rollout_ref.rollout.agent.num_workers": "generation is one batched call per step",
    "actor_rollout_ref.ref.log_prob_micro_batch_size": "deprecated in verl",
    "actor_rollout_ref.ref.fsdp_config.optimizer_offload": "the reference has no optimizer",
    "actor_rollout_ref.ref.rollout_n": "a copy of actor_rollout_ref.rollout.n",
    "actor_rollout_ref.ref.use_torch_compile": "no torch.compile",
    "actor_rollout_ref.ref.entropy_from_logits_with_chunking": "logits are chunked per engine setting",
    "actor_rollout_ref.ref.entropy_checkpointing": "memory setting",
    "critic.enable": "the algorithm decides (PPO's gae uses a critic)",
    "critic.rollout_n": "a copy of actor_rollout_ref.rollout.n",
    "critic.ppo_micro_batch_size": "deprecated in verl; set ppo_micro_batch_size_per_gpu",
    "critic.forward_micro_batch_size": "values use critic.micro_batch_size_per_device",
    "critic.forward_micro_batch_size_per_gpu": "values use critic.micro_batch_size_per_device",
    "critic.forward_max_token_len_per_gpu": "values use critic.max_tokens_per_micro_batch",
    "critic.data_loader_seed": "mini-batches keep the rollout order (shuffle false)",
    "critic.model.tokenizer_path": "the critic uses the policy's tokenizer",
    "critic.model.use_remove_padding": "padding removal leaves the numbers as they are; one setting, "
    "model.remove_padding (actor_rollout_ref.model.use_remove_padding), covers every model",
    "critic.model.fsdp_config.grad_offload": "deprecated in verl",
    "critic.model.external_lib": "a copy of actor_rollout_ref.model.external_lib",
    "critic.model.trust_remote_code": "see model.trust_remote_code",
    "critic.model.use_shm": "models load from disk",
    "critic.model.enable_activation_offload": "activations stay on the device",
    "critic.optim.optimizer_impl": "torch's AdamW",
    "critic.optim.total_training_steps": "filled in by the trainer, as in verl",
    "critic.optim.num_cycles": "read only by verl's cosine schedule with restarts",
    "reward_model.model.input_tokenizer": "the reward model reads the decoded text re-tokenized",
    "reward_model.model.external_lib": "a copy of actor_rollout_ref.model.external_lib",
    "reward_model.model.trust_remote_code": "see model.trust_remote_code",
    "reward_model.model.use_shm": "models load from disk",
    "reward_model.model.use_remove_padding": "see model.remove_padding",
    "reward_model.model.use_fused_kernels": "no fused kernels",
    "reward_model.micro_batch_size": "deprecated in verl",
    "reward_model.use_dynamic_bsz": "memory setting",
    "reward_model.forward_max_token_len_per_gpu": "memory setting",
    "reward_model.enable_resource_pool": "placement follows resources.placement",
    "reward_model.n_gpus_per_node": "placement follows resources.placement",
    "reward_model.nnodes": "placement follows resources.placement",
    "reward_model.launch_reward_fn_async": "rule rewards run beside the other phases (trainer.overlap_phases)",
    "reward_model.use_reward_loop": "rule rewards run in the reward executor",
    "reward_model.ulysses_sequence_parallel_size": "no sequence parallelism",
    "reward_model.overlong_buffer.log": "logging",
    "data.return_raw_chat": "prompts are rendered with the chat template when loaded",
    "data.return_raw_input_ids": "prompts are rendered with the chat template when loaded",
    "data.return_full_prompt": "prompts are rendered with the chat template when loaded",
    "data.return_multi_modal_inputs": "text models only",
    "data.image_key": "text models only",
    "data.video_key": "text models only",
    "data.image_patch_size": "text models only",
    "data.use_shm": "data loads from disk",
    "data.dataloader_num_workers": "prompts are loaded in the driver",
    "data.filter_overlong_prompts_workers": "prompts are filtered in the driver",
    "data.validation_shuffle": "validation metrics do not depend on the order",
    "data.trust_remote_code": "see model.trust_remote_code",
    "trainer.balance_batch": "rollouts are split in order",
    "trainer.device": "see resources.device",
    "trainer.esi_redundant_time": "checkpoints follow trainer.save_every_minutes",
    "trainer.max_critic_ckpt_to_keep": "trainer.keep_last covers every model",
    "trainer.ray_wait_register_center_timeout": "Ray start-up waits are the launcher's own",
    "trainer.use_legacy_worker_impl": "one worker implementation",
    "trainer.profile_steps": "profiling",
    "ray_init.timeline_json_file": "no Ray timeline",
    "ray_kwargs.timeline_json_file": "no Ray timeline",
}

# whole sub-trees (fnmatch patterns) with no effect on results here
NOTED_TREES: dict[str, str] = {
    "*.profiler.*": "profiling",
    "global_profiler.*": "profiling",
    "trainer.npu_profile.*": "profiling",
    "trainer.controller_nsight_options.*": "profiling",
    "trainer.worker_nsight_options.*": "profiling",
    "*.checkpoint.*": "checkpoints hold every part (docs/checkpoints.md)",
    "actor_rollout_ref.model.fused_kernel_options.*": "no fused kernels",
    "actor_rollout_ref.model.tiled_mlp.*": "memory setting",
    "critic.model.tiled_mlp.*": "memory setting",
    "actor_rollout_ref.model.mtp.*": "read only with mtp.enable (refused)",
    "actor_rollout_ref.rollout.mtp.*": "a copy of actor_rollout_ref.model.mtp",
    "*.router_replay.*": "read only with router_replay.mode (refused)",
    "actor_rollout_ref.actor.policy_loss.*": "read only by verl's loss modes refused here",
    "actor_rollout_ref.rollout.engine_kwargs.*": "engine settings, chosen by the engine",
    "actor_rollout_ref.rollout.multi_turn.*": "verl's checks of chat-template re-rendering between turns and its "
    "truncation side: nothing is re-rendered here (token in, token out)",
    "actor_rollout_ref.rollout.agent.*": "read only by agent loops (refused)",
    "actor_rollout_ref.rollout.checkpoint_engine.*": "weights sync in memory (rollout.reshard)",
    "actor_rollout_ref.rollout.trace.*": "tracing",
    "actor_rollout_ref.rollout.prometheus.*": "monitoring",
    "*.fsdp_config.*": "sharding and memory settings; the numbers do not depend on them",
    "data.custom_cls.*": "read only with data.custom_cls.path (refused)",
    "data.sampler.*": "read only with data.sampler.class_path (refused)",
    "data.datagen.*": "read only with data.datagen.path (refused)",
    "reward_manager.module.*": "read only with reward_manager.module.path (refused)",
    "reward_model.sandbox_fusion.*": "read only with sandbox_fusion.url (refused)",
    "reward_model.reward_kwargs.*": "verl's dapo reward manager's copies: overlong_buffer_cfg maps as "
    "reward_model.overlong_buffer (Read together), max_resp_len is data.max_response_length",
    "reward_model.rollout.*": "generative reward models' engine (reward_model.enable runs a classifier here)",
    "algorithm.pf_ppo.*": "read only with use_pf_ppo (refused)",
    "ray_kwargs.ray_init.*": "the embedded Ray cluster follows resources.ray_*",
}


def classify(key: str, value: Any) -> tuple[str, str] | None:
    """-> ("note", text) for a key accepted without effect, ("tree", the NOTED_TREES pattern) for one
    in such a sub-tree (noted once per sub-tree), ("error", one line) for one refused, or None when the
    key is in none of these tables."""
    if key in REFUSED:
        why, accepted = REFUSED[key]
        if not _accepted(value, accepted):
            return "error", f"verl key {key}={value!r}: {why}; remove it or set {accepted[0]!r}"
        return "note", f"verl key {key}={value!r} is accepted as verl's behaviour here: {why}"
    if key in NOTED:
        return "note", f"verl key {key}={value!r} has no effect on results here and is ignored: {NOTED[key]}"
    tree = next((p for p in NOTED_TREES if fnmatchcase(key, p)), None)
    return None if tree is None else ("tree", tree)


def _accepted(value: Any, accepted: tuple) -> bool:
    # bool is an int in Python: lora_rank=False must not pass as 0, nor shuffle=0 as False
    return any(value == a and isinstance(value, bool) == isinstance(a, bool) for a in accepted) or (
        isinstance(value, str) and value in accepted
    )
