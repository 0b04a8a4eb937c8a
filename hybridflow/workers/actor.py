"""ActorRolloutRefWorker: the policy's roles — actor (trains), rollout (generates), ref (frozen copy; with
LoRA the actor itself with its adapters off, models/lora.py).

Any subset of the roles runs in one process (verl's hybrid worker). With "actor" and "rollout"
together, generation runs on the actor's own HF model object, so there is no weight copy: a
training step changes the very parameters the next generation reads.

Generation runs through the 3D-HybridEngine (docs/hybrid_engine.md): the actor's ranks hold the training
layout (t-way TP x d-way FSDP2) and a Resharder (hybrid_engine/resharder.py) switches them to the
generation layout (rollout.tg-way TP, d * t/tg replicas) and back around every generate call, by the
method `rollout.reshard` names. The rollout engine then decodes tensor-parallel on this rank's generation
shard. Prompts are split over the generation replicas (the "rollout" layout, 3D_ALL_MICRO_DP); the
switch's counters come back in the output's meta.reshard_metrics (max over ranks).

Methods and transfer protocols:
  init_model                     ONE_TO_ALL       build engines (call once, before anything else)
  generate_sequences(prompts)    3D_ALL_MICRO_DP  prompts split over generation replicas
  compute_log_prob(batch)        3D_PROTO "train" -> old_log_probs
  compute_ref_log_prob(batch)    3D_PROTO "ref"   -> ref_log_probs
  update_actor(batch)            DP_METRICS       PPO epochs x mini-batches; metrics pooled over ranks
  train_sft / train_dpo(batch)   DP_METRICS       offline trainers (warm start, preference pairs)
  save/load_checkpoint, save_hf_model  ONE_TO_ALL (collective)
  weight_sync_address, init_weight_sync, weight_spec, weight_shapes, send_weights, receive_weights
                                 the actor -> rollout pool sync of trainer.rollout_ahead=1 (weight_sync.py)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch
import torch.distributed as dist

from hybridflow.agent import build_agent_loop
from hybridflow.agent.registry import install as install_agent_objects
from hybridflow.batch import Batch
from hybridflow.checkpoint import load_engine_state, save_engine_state
from hybridflow.config.roles import ActorWorkerConfig
from hybridflow.controller import Protocol, Worker, register
from hybridflow.engines import TrainEngine
from hybridflow.engines.precision import cast_parameters
from hybridflow.hybrid_engine.pipeline_switch import PipelineResharder, skeleton_on
from hybridflow.hybrid_engine.resharder import build_resharder, generation_layout
from hybridflow.models import load_causal_lm, load_tokenizer, lora
from hybridflow.models.meta import WEIGHTS_ATTR
from hybridflow.rollout import SamplingParams
from hybridflow.rollout.base import decode_responses, response_lengths
from hybridflow.rollout.factory import build_generation_engine
from hybridflow.rollout.pool_tp import keep_shard, load_shard, param_bytes, pool_tp_group
from hybridflow.workers.common import (
    MetricLists,
    engine_config,
    iter_mini_batches,
    mask_padding,
    model_compute_dtype,
    offload_metrics,
    seed_everything,
    set_train_layout,
)
from hybridflow.workers.losses import (
    GapMeter,
    actor_loss_fn,
    dpo_loss_fn,
    gap_training_side,
    sft_loss,
    split_aggregation,
)
from hybridflow.workers.weight_sync import WeightSyncMixin

ROLES = ("actor", "rollout", "ref")
# fields update_actor needs; everything else stays on the controller side
_ACTOR_FIELDS = ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")


class ActorRolloutRefWorker(WeightSyncMixin, Worker):
    """config: the policy's part of the config tree (config/roles.py); roles: a subset of ("actor",
    "rollout", "ref"); total_optim_steps: optimizer steps of the whole run (for warmup / cosine schedules)."""

    def __init__(
        self,
        config: ActorWorkerConfig,
        roles=("actor", "rollout"),
        total_optim_steps: int = 0,
        agent_objects: bytes | None = None,
    ):
        """agent_objects: the tools / environment of the Python API the config names, by value
        (agent/registry.py pickled)."""
        bad = [r for r in roles if r not in ROLES]
        if bad or not roles:
            raise ValueError(
                f"ActorRolloutRefWorker roles must be a non-empty subset of {ROLES}, got {roles}"
            )
        self.config, self.roles, self.total_optim_steps = config, tuple(roles), total_optim_steps
        self.agent_objects = agent_objects
        self.actor = self.ref = self.rollout = self.resharder = self.pool_tp = self.agent = None
        self._gen_calls = 0
        seed = config.seed
        pack = {
            "remove_padding": config.model.remove_padding,
            "share_prompt": config.model.share_prompt,
            "cpu_gemm": config.model.cpu_gemm,
        }
        # each role's engine config only where it runs: a role on another pool has that pool's dp
        # (the reference on the rollout pool of rollout_ahead=1 while the actor's pool is smaller)
        self.actor_cfg = self.ref_cfg = None
        if "actor" in roles:
            self.actor_cfg = engine_config(
                config.actor, self.world_size, "actor", seed, config.model.dtype, total_optim_steps, **pack,
                lora=config.model.lora,
            )  # fmt: skip
            set_train_layout(self, "train", self.actor_cfg.parallel)
            if config.model.lora.enabled:  # the reference is the actor with its adapters off
                set_train_layout(self, "ref", self.actor_cfg.parallel)
        if "ref" in roles:
            self.ref_cfg = engine_config(config.ref, self.world_size, "ref", seed, config.model.dtype, **pack)
            set_train_layout(self, "ref", self.ref_cfg.parallel)
        if "rollout" in roles:
            self._set_rollout_layout()

    def _set_rollout_layout(self) -> None:
        """Generation replicas of the 3D-HybridEngine's layout (hybrid_engine/layout.py GenLayout)."""
        r = self.config.rollout
        pp = 1
        if "actor" in self.roles:
            tp, dp, tg = self.actor_cfg.parallel.tp, self.actor_cfg.parallel.dp, r.tg
            pp = self.actor_cfg.parallel.pp
        else:  # a rollout-only pool (trainer.rollout_ahead=1): consecutive TP groups (rollout/pool_tp.py,
            tg = r.tg  # or vLLM's own over the pool's ranks: the same consecutive ones)
            tp, dp = tg, self.world_size // tg
        gen = generation_layout(r.reshard, tp, dp, tg, pp)
        g_tp = gen.coords(self.rank)[2]
        self.set_layout(
            "rollout", dp_rank=gen.replica(self.rank), dp_size=gen.num_replicas, tp_rank=g_tp, tp_size=gen.tg
        )

    # ---- setup -------------------------------------------------------------------------------------
    @register(Protocol.ONE_TO_ALL)
    def init_model(self) -> dict:
        """Load the models of this worker's roles; returns parameter counts."""
        m = self.config.model
        seed_everything(self.config.seed)
        self.tokenizer = load_tokenizer(m.tokenizer_path or m.path, m.trust_remote_code)
        remote = {"trust_remote_code": m.trust_remote_code}
        info = {}
        if "actor" in self.roles:
            self.actor = TrainEngine(
                load_causal_lm(m.path, device="meta", **remote),
                self.actor_cfg,
                trainable=True,
                device=self.device,
            )
            info["actor_params"] = self.actor.num_params()
        if "ref" in self.roles:
            self.ref = TrainEngine(
                load_causal_lm(m.path, device="meta", **remote),
                self.ref_cfg,
                trainable=False,
                device=self.device,
            )
            info["ref_params"] = self.ref.num_params()
        if "rollout" in self.roles:
            model = None
            dtype = model_compute_dtype(m.dtype, self.config.device)
            r = self.config.rollout
            if self.actor is not None and self.actor.pipeline is not None:
                # pipeline stages: each rank generates from its tg-shard of every stage, gathered over its
                # pp group (hybrid_engine/pipeline_switch.py), named by a whole model on the meta device
                model = skeleton_on(load_causal_lm(m.path, device="meta", **remote), self.device)
                self.resharder = PipelineResharder(
                    self.actor, model, r.tg, split_vocab=r.engine == "builtin", dtype=dtype
                )
            elif self.actor is not None:
                # the built-in decoder runs embeddings / lm_head vocab-parallel (docs/hybrid_engine.md);
                # shards move and are held in generation's compute dtype (half the bytes in bf16)
                self.resharder = build_resharder(
                    self.actor, r.reshard, r.tg, split_vocab=r.engine == "builtin", dtype=dtype
                )
            own = self.actor is None  # the rollout pool: weights arrive by the weight sync
            if own:
                self.pool_tp = pool_tp_group(self.rank, self.world_size, self._pool_tg())
            if model is None:
                model = self.actor.hf_model if not own else self._pool_model(m.path, remote, dtype)
            self.rollout = build_generation_engine(
                self.config, model, self.world_size, own, dtype, self.device
            )
            install_agent_objects(self.agent_objects)
            self.agent = build_agent_loop(self.config.rollout.multi_turn, self.tokenizer)
            if own and self.config.rollout.engine == "vllm":
                model.to("meta")  # vLLM holds the weights; the HF model only names their shapes now
        return info

    def _pool_model(self, path: str, remote: dict, dtype: torch.dtype | None) -> torch.nn.Module:
        """A rollout-only pool's model (`load_pool_model`), this rank's generation shard for tg > 1."""
        tp = self.pool_tp
        index, tg = (tp.rank(), tp.size) if tp is not None else (0, 1)
        on_device = self.config.rollout.engine != "vllm"
        return load_pool_model(path, remote, dtype, self.device, index, tg, on_device)

    @register(Protocol.ONE_TO_ALL)
    def rollout_param_bytes(self) -> int:
        """Bytes of the rollout model's parameters this rank holds (a rollout pool rank's shard)."""
        return param_bytes(self.rollout.model)

    def _pool_tg(self) -> int:
        """Generation TP size of a rollout-only pool: rollout.tg with the built-in engine (vLLM runs its own)."""
        r = self.config.rollout
        return r.tg if r.engine == "builtin" else 1

    # ---- generation ----------------------------------------------------------------------------------
    def sampling_params(self, overrides: dict | None = None, step: int | None = None) -> SamplingParams:
        """Rollout settings (+ overrides). The sampling seed depends on (trainer.seed, training step) — not
        on how many other calls (validation) happened, nor on the rank: the engine keys each sample's
        draws by its prompt's uid (rollout/base.prompt_ids), so ranks draw different samples, a rerun at
        any data-parallel size repeats them, and validating more often does not change the training run."""
        r = self.config.rollout
        kw = dict(n=r.n, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p)
        kw.update(overrides or {})
        call = step if step is not None else 1_000_000 + self._gen_calls
        seed = self.config.seed * 1_000_003 + call * 7919
        return SamplingParams(
            max_new_tokens=r.response_length, do_sample=kw["temperature"] > 0, seed=seed, **kw
        )

    @register(Protocol.THREE_D_ALL_MICRO_DP)
    def generate_sequences(self, prompts: Batch, sampling: dict | None = None) -> Batch:
        """Prompts (B, Lp) left-padded -> rollouts (B*n rows; fields per hybridflow/rollout/base.py)
        plus `response_text`. `sampling` overrides rollout settings for this call (n, temperature,
        top_k, top_p), e.g. greedy validation or ReMax's greedy baseline."""
        if self.rollout is None:
            raise RuntimeError(f"generate_sequences needs the 'rollout' role; this worker has {self.roles}")
        params = self.sampling_params(sampling, prompts.meta.global_step)
        self._gen_calls += 1
        keyed = "uid" in prompts.non_tensors
        if not keyed:  # rows keyed by their place in the call: each replica and chunk its own seed
            params = dataclasses.replace(params, seed=params.seed + self.get_layout("rollout").dp_rank)
        per_call = self.config.rollout.micro_batch_size_per_device or max(len(prompts), 1)
        with self._generation_weights() as reshard_metrics:
            outs = [
                self._generate(
                    chunk, params if keyed else dataclasses.replace(params, seed=params.seed + 104_729 * i)
                )
                for i, chunk in enumerate(prompts.split(per_call))
            ]
        out = outs[0] if len(outs) == 1 else Batch.concat(outs)  # rollout_metrics: the max over chunks
        # the whole response, tool outputs included (response_mask is the model's tokens only)
        out["response_text"] = self.decode(out["responses"], response_lengths(out))
        out.meta.reshard_metrics = reshard_metrics
        return out

    def _generate(self, prompts: Batch, params: SamplingParams) -> Batch:
        """One call of the engine, or of the agent loop driving it (rollout.multi_turn)."""
        if self.agent is not None:
            return self.agent.generate(self.rollout, prompts, params)
        return self.rollout.generate(prompts, params)

    def decode(self, responses: torch.Tensor, lengths: torch.Tensor) -> list[str]:
        return decode_responses(self.tokenizer, responses, lengths)

    @contextlib.contextmanager
    def _generation_weights(self):
        """Switch to the generation layout for the duration of a generate call; yields a dict that is
        filled with this round's reshard metrics (max over ranks) when the switch is back."""
        metrics: dict[str, float] = {}
        if self.pool_tp is not None:  # a rollout-only pool: its model holds only its shard, no switch
            self.rollout.set_shard(
                dict(self.rollout.model.named_parameters(remove_duplicate=False)), self.pool_tp
            )
            try:
                yield metrics
            finally:
                self.rollout.set_shard(None)
            return
        if self.resharder is None:
            yield metrics
            return
        rs = self.resharder
        sent_before = getattr(self.rollout, "sent_bytes", None)  # an engine holding its own copy (vLLM)
        with rs.generation() as (weights, tp):
            self.rollout.set_shard(None if rs.in_place else weights, tp)
            try:
                yield metrics
            finally:
                self.rollout.set_shard(None)
        metrics.update(_max_over_ranks(rs.stats.as_metrics(), self.device))
        metrics["rollout/weight_update_bytes"] = float(self._weight_update_bytes(sent_before))

    def _weight_update_bytes(self, sent_before: int | None) -> int:
        """What a rollout engine holding its own copy is sent per step. vLLM: the bytes it was actually
        streamed in this switch (with LoRA the merged weights: every weight, whole). The built-in engine
        reads the weights in place (merged by the Resharder), so none travel: the figure is then what one
        training step changes, whole (every parameter in the compute dtype; with LoRA only the adapters,
        fp32), i.e. what an adapter-only sync would send."""
        if sent_before is not None:
            return self.rollout.sent_bytes - sent_before
        if self.actor.lora_layers:
            return lora.adapter_bytes(self.actor.hf_model)
        dtype = model_compute_dtype(self.config.model.dtype, self.config.device)
        size = dtype.itemsize if dtype is not None else 4
        if self.actor.pipeline is not None:  # the whole model's, not this rank's stage's
            return sum(p.numel() for p in self.rollout.model.parameters()) * size
        return self.actor.num_params() * size

    # ---- inference ---------------------------------------------------------------------------------
    @register(Protocol.THREE_D, layout="train")
    def compute_log_prob(self, batch: Batch) -> Batch:
        """Log-probs of the responses under the current actor: Batch(old_log_probs (B, Lr))."""
        lp, _ = self._engine("actor").compute_log_probs(batch, temperature=_temperature(batch))
        return Batch({"old_log_probs": lp})

    @register(Protocol.THREE_D, layout="ref")
    def compute_ref_log_prob(self, batch: Batch) -> Batch:
        """Log-probs under the frozen reference: Batch(ref_log_probs (B, Lr)). At the rollout's
        temperature, like the old and new log-probs (as verl), so the KL compares like with like. With
        LoRA the reference is the actor with its adapters off: the base weights, no second model."""
        if self.ref is None and self.actor is not None and self.actor.lora_layers:
            with self.actor.adapters_disabled():
                lp, _ = self.actor.compute_log_probs(batch, temperature=_temperature(batch))
        else:
            lp, _ = self._engine("ref").compute_log_probs(batch, temperature=_temperature(batch))
        return Batch({"ref_log_probs": lp})

    # ---- training ----------------------------------------------------------------------------------
    @register(Protocol.DP_METRICS, layout="train")
    def update_actor(self, batch: Batch) -> dict:
        """PPO update: `ppo_epochs` passes, `train_batch_size / ppo_mini_batch_size` optimizer steps each.
        Needs advantages and old_log_probs, unless meta.old_log_probs_source is "update" (one optimizer step: they are
        its forward's own, trainers/rl.py), and ref_log_probs with use_kl_loss. Returns actor/* lists."""
        a, algo = self.config.actor, self.config.algorithm
        # the rollout's log-probs against the old ones: numerics (bf16, vLLM) or a policy a step older
        # (trainer.rollout_ahead=1) apart (algorithms/rollout_correction.py)
        correct = a.rollout_correction.mode != "none" and "rollout_log_probs" in batch.keys()
        num_mini = a.num_mini_batches  # resolve_config: train_batch_size / ppo_mini_batch_size
        # old log-probs from this update's own forward: exact only while the weights cannot move under it
        from_forward = batch.meta.old_log_probs_source == "update"
        if from_forward and (num_mini, a.ppo_epochs) != (1, 1):
            raise ValueError(f"update_actor: old log-probs from the update's forward need one optimizer "
                             f"step, not {a.ppo_epochs} epoch(s) x {num_mini} mini-batches")  # fmt: skip
        # the train-vs-rollout gap, from the log-probs before any optimizer step (workers/losses.py `GapMeter`)
        gap_side = gap_training_side(batch.meta, batch.keys())
        keys = (
            [*_ACTOR_FIELDS, "advantages"]
            + ([] if from_forward else ["old_log_probs"])
            + (["ref_log_probs"] if algo.use_kl_loss else [])
            + (["rollout_log_probs"] if correct or gap_side else [])
        )
        gap = GapMeter() if gap_side else None
        norm_length = self.config.rollout.response_length
        loss_fn = actor_loss_fn(
            a, algo, norm_length, correct, from_forward, gap if gap_side == "forward" else None
        )
        weighting = split_aggregation(a.loss_agg_mode)[1]
        temperature = _temperature(batch)
        metrics = MetricLists()
        eng = self._engine("actor")
        # entropy is always logged; it needs grad only when it is part of the loss
        entropy_mode = True if algo.entropy_coeff else "detached"
        rows = mask_padding(batch).select(keys)
        if gap_side == "old":
            gap.add(rows["old_log_probs"], rows["rollout_log_probs"], rows["response_mask"])
        with eng.phase(optimizer=True):  # offload: state moves in and out once per update
            for mb in iter_mini_batches(rows, num_mini, a.ppo_epochs, eng.global_step):
                out = eng.train_step(mb, loss_fn, with_entropy=entropy_mode, temperature=temperature,
                                     loss_weighting=weighting, global_metrics=True)  # fmt: skip
                metrics.add(out, "actor/")
                if gap is not None:
                    gap.close()
        if gap is not None:
            metrics.add(gap.metrics(eng.dp_group(), eng.device))
        metrics.add(offload_metrics(eng), "perf/actor_")
        # prompt tokens the update's forwards did not compute (model.share_prompt), per rank
        metrics.add({"shared_prompt_tokens": eng.take_shared_prompt_tokens()}, "perf/actor_")
        return metrics.as_dict()

    @register(Protocol.DP_METRICS, layout="train")
    def train_sft(self, batch: Batch) -> dict:
        """One optimizer step of supervised fine-tuning (token-mean NLL of the responses)."""
        out = self._engine("actor").train_step(
            mask_padding(batch).select(_ACTOR_FIELDS), sft_loss, global_metrics=True
        )
        return {f"sft/{k}": v for k, v in out.items()}

    @register(Protocol.DP_METRICS, layout="train")
    def train_dpo(self, batch: Batch) -> dict:
        """One optimizer step of DPO on interleaved pairs (chosen even rows, rejected odd rows).
        Micro-batches are fixed and even-sized so a pair never straddles two of them."""
        dpo = self.config.algorithm.dpo
        if not batch.meta.pairs or len(batch) % 2 or batch.meta.pad_rows:
            raise ValueError(
                f"train_dpo: got {len(batch)} rows on rank {self.rank} ({batch.meta.pad_rows} of them padding, "
                f"meta.pairs={batch.meta.pairs}); pairs need interleaved rows, an even count and a batch that "
                "divides dp"
            )
        keys = [*_ACTOR_FIELDS] + ([] if dpo.reference_free else ["ref_log_probs"])
        mbs = self.config.actor.micro_batch_size_per_device
        out = self._engine("actor").train_step(
            batch.select(keys),
            dpo_loss_fn(dpo),
            loss_weighting="sequences",
            micro_batch_size=max(2, mbs - mbs % 2),
            global_metrics=True,
        )
        return {f"dpo/{k}": v for k, v in out.items()}

    def _engine(self, role: str) -> TrainEngine:
        eng = getattr(self, role)
        if eng is None:
            raise RuntimeError(
                f"this ActorRolloutRefWorker has roles {self.roles}; the call needs the {role!r} role "
                "(was init_model called?)"
            )
        return eng

    # ---- persistence -------------------------------------------------------------------------------
    @register(Protocol.ONE_TO_ALL)
    def save_checkpoint(self, path: str) -> None:
        """The actor's part of checkpoint `path`: path/actor/ with sharded model + optimizer + schedule,
        this rank's RNG states, the HF config and tokenizer (docs/checkpoints.md; collective)."""
        save_engine_state(
            self._engine("actor"), os.path.join(path, "actor"), self.rank, tokenizer=self.tokenizer
        )

    @register(Protocol.ONE_TO_ALL)
    def load_checkpoint(self, path: str) -> None:
        load_engine_state(self._engine("actor"), os.path.join(path, "actor"), self.rank)

    @register(Protocol.ONE_TO_ALL)
    def save_hf_model(self, path: str) -> None:
        """The actor as a plain HF directory (with the tokenizer), written by rank 0 (collective)."""
        self._engine("actor").save_hf(path, tokenizer=self.tokenizer)


def load_pool_model(
    path: str, remote: dict, dtype: torch.dtype | None, device, index: int, tg: int, on_device: bool
) -> torch.nn.Module:
    """A rollout-only pool's model, its parameters in the compute dtype `dtype` (None: as loaded; the
    weight sync then carries that dtype, half the bytes in bf16) before any byte reaches the device, so
    the device never holds the model in fp32 beside its cast. Built on the meta device and cast there;
    then each tensor (TP rank `index` of tg's generation shard only, rollout/pool_tp.py) is read from
    the safetensors into that dtype on `device`; where the files do not hold every tensor by name, it is
    loaded whole on the host, cast and cut there, then moved. on_device=False (vLLM, which holds its
    own weights and cuts its own blocks): left on the meta device (or the host) to name the tensors and
    their shapes; the engine streams the weights from there once (rollout/vllm_engine.stored_weights)."""
    model = load_causal_lm(path, device="meta", **remote)
    if dtype is not None:
        cast_parameters(model, dtype)  # not buffers: the rotary tables stay fp32, as the actor's
    if not on_device:
        return model
    if hasattr(model, WEIGHTS_ATTR):
        return load_shard(model, index, tg, device).to(device)  # buffers too
    return (keep_shard(model, index, tg) if tg > 1 else model).to(device)


def _max_over_ranks(metrics: dict[str, float], device: torch.device) -> dict[str, float]:
    """Every rank gets the max of each value over the group (one small all-reduce, on the worker's device:
    NCCL has no host tensors)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return metrics
    t = torch.tensor(list(metrics.values()), dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return dict(zip(metrics, t.tolist()))


def _temperature(batch: Batch) -> float:
    """The rollout's log-prob temperature, which every forward over its rows divides the logits by (verl);
    1.0 for a batch no rollout made."""
    t = batch.meta.temperature
    return 1.0 if t is None else t
