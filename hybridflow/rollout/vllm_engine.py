"""`rollout.engine: vllm`: vLLM's offline engine behind GenerationEngine, in-process in the rollout rank.

As verl's hybrid worker does, each actor rank holds one `vllm.LLM` in its own process (no vLLM worker
processes, `VLLM_ENABLE_V1_MULTIPROCESSING=0`). Weights never touch disk: the engine is built from the
model's config alone (`load_format="dummy"`), and before every `generate` the actor's current weights go
to vLLM as an iterator of (HF name, tensor) through vLLM's in-place `reload_weights`, then the prefix
cache is reset so no KV computed from old weights is reused. See docs/rollout.md.

Output: the same Batch as the built-in engine (`build_rollout_batch`), so nothing downstream knows which
engine ran. `rollout_log_probs` come from vLLM's "processed_logprobs" mode: log_softmax(logits / T)
over the full vocabulary, the built-in engine's convention (rollout/sampling.py), when top-k/top-p do
not truncate. When they do, vLLM's values are of the truncated distribution; the batch then says so in
meta["rollout_log_probs_exact"] = False and the trainer recomputes old_log_probs with the actor.

GPU path (written, not yet run on a GPU): `gpu_memory_utilization` is passed to vLLM; between
generate calls the engine sleeps (level 2: KV cache and weights freed) and wakes weights first, loads
the actor's weights, then the KV cache (verl's order, lowest peak memory). vLLM's own tensor parallel
(external_launcher) is written but validation rejects rollout.tg > 1 with vLLM: it is not wired to the
3D-HybridEngine's tg-way shards yet.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from hybridflow.batch import Batch
from hybridflow.rollout.base import GenerationEngine, build_rollout_batch, check_prompt_batch
from hybridflow.rollout.params import SamplingParams

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass
class VLLMEngineConfig:
    """How the vLLM engine is built (sampling itself is per call, in SamplingParams)."""

    max_model_len: int = 2048
    """Longest prompt + response (data.max_prompt_length + rollout.response_length)."""
    max_num_seqs: int = 256
    """Most sequences (prompts x n) vLLM schedules at once; the KV cache is sized for them."""
    gpu_memory_utilization: float = 0.0
    """Fraction of device memory (on CPU: of RAM, as vLLM's CPU build reads it) for weights + KV
    cache. 0: a KV cache sized exactly for max_num_seqs x max_model_len (vLLM's
    kv_cache_memory_bytes), which leaves the rest of the device to the colocated training."""
    tensor_parallel_size: int = 1
    """rollout.tg: vLLM tensor parallel over groups of consecutive actor ranks (GPU only)."""
    seed: int = 0
    cpu_threads: int = 0
    """Torch intra-op threads while generating on CPU (0 = the process's setting)."""
    pad_token_id: int | None = None


def available() -> str | None:
    """None when vLLM can be imported here, else the one-line reason."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # ImportError, or vLLM's own import-time failures
        return (
            f"vLLM is not installed in this environment ({type(e).__name__}: {e}); "
            "`make vllm` builds .venv-vllm with it"
        )
    return None


class VLLMEngine(GenerationEngine):
    """`generate(batch, params) -> Batch` with vLLM, on `model`'s current weights (see module docstring).

    model: the HF causal LM whose parameters are full tensors whenever `generate` runs (the actor's
    model inside the worker's generation-weights context, or a plain model). Its config builds vLLM's
    model; its weights are streamed into vLLM at every call.
    """

    def __init__(self, model: torch.nn.Module, config: VLLMEngineConfig | None = None):
        reason = available()
        if reason is not None:
            raise RuntimeError(f"rollout.engine=vllm: {reason}")
        self.model = model
        self.config = config or VLLMEngineConfig()
        cfg = model.config
        pad = self.config.pad_token_id
        if pad is None:
            pad = cfg.pad_token_id if cfg.pad_token_id is not None else _first(cfg.eos_token_id)
        self.pad_token_id = 0 if pad is None else int(pad)
        param = next(model.parameters())
        self.device = param.device
        self.gpu = param.device.type == "cuda"
        self.last_stats: dict[str, float] = {}
        self.llm = self._build(cfg, param.dtype)
        self._asleep = False
        if self.gpu:
            self.sleep()

    # ---- construction ------------------------------------------------------------------------------
    def _build(self, hf_config, dtype: torch.dtype):
        c = self.config
        if dtype not in _DTYPES:
            raise ValueError(f"VLLMEngine: model dtype {dtype} is not one of {list(_DTYPES)}")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # its CPU-build warnings are not ours to act on
        if not self.gpu:
            from hybridflow.rollout.factory import VLLM_CPU_HEAD_DIMS

            head_dim = (
                getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
            )
            if head_dim not in VLLM_CPU_HEAD_DIMS:
                raise ValueError(
                    f"VLLMEngine: vLLM's CPU attention supports head_dim {list(VLLM_CPU_HEAD_DIMS)}, this model has {head_dim}"
                )
        kw = dict(
            skip_tokenizer_init=True,  # prompts and outputs are token ids
            load_format="dummy",  # weights come from the actor at every generate, never from disk
            generation_config="vllm",  # no sampling defaults from the model's generation_config.json
            dtype=_DTYPES[dtype],
            max_model_len=c.max_model_len,
            max_num_seqs=c.max_num_seqs,
            max_num_batched_tokens=max(c.max_model_len, 2048),
            logprobs_mode="processed_logprobs",
            seed=c.seed,
            enable_prefix_caching=True,
        )
        if c.gpu_memory_utilization > 0:
            kw["gpu_memory_utilization"] = c.gpu_memory_utilization
        else:
            kw["kv_cache_memory_bytes"] = kv_cache_bytes(hf_config, dtype, c.max_num_seqs, c.max_model_len)
        if self.gpu:
            kw.update(enable_sleep_mode=True, enforce_eager=False)
            if c.tensor_parallel_size > 1:
                # the external launcher reads the torchrun variables; Ray workers have the process group
                # but not these (each worker sees its own GPU as device 0)
                os.environ.setdefault("RANK", str(torch.distributed.get_rank()))
                os.environ.setdefault("LOCAL_RANK", str(torch.cuda.current_device()))
                kw.update(
                    tensor_parallel_size=c.tensor_parallel_size,
                    distributed_executor_backend="external_launcher",
                )
        else:
            kw.update(enforce_eager=True)
        # vLLM's CPU worker replaces torch.set_num_threads with a no-op for the whole process; the
        # training engine in this same process still needs it.
        set_threads = torch.set_num_threads
        from vllm import LLM

        with tempfile.TemporaryDirectory(prefix="hybridflow-vllm-") as tmp:
            hf_config.save_pretrained(tmp)  # config only: vLLM builds the model from it
            try:
                return LLM(model=tmp, **kw)
            finally:
                torch.set_num_threads = set_threads

    # ---- GenerationEngine --------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """(HF name, full tensor) pairs into vLLM's model in place, then drop the stale prefix cache."""
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()

    def set_shard(self, weights, tp=None) -> None:
        """The 3D-HybridEngine's generation weights for the next calls (hybrid_engine/resharder.py): HF
        name -> full tensor, or None for the model's own (FSDP-unsharded) parameters. vLLM shards full
        tensors itself, so a tg-way shard (tp given) cannot be loaded; validation rejects tg > 1."""
        if tp is not None and tp.size > 1:
            raise ValueError("VLLMEngine: loads full weights only; rollout.tg > 1 is not supported with vllm")
        self.shard = weights

    def sync_weights(self) -> float:
        """Stream the current generation weights into vLLM; returns the seconds it took."""
        start = time.perf_counter()
        shard = getattr(self, "shard", None)
        named = shard.items() if shard is not None else self.model.named_parameters()
        self.load_weights((name, _full(p.detach())) for name, p in named)
        return time.perf_counter() - start

    def sleep(self) -> None:
        """GPU: free vLLM's KV cache and weights while training runs (level 2: the weights are
        reloaded from the actor at the next generate anyway). CPU: nothing to free."""
        if self.gpu and not self._asleep:
            self.llm.sleep(level=2)
            self._asleep = True

    def _wake_and_sync(self) -> float:
        if not self._asleep:
            return self.sync_weights()
        self.llm.wake_up(tags=["weights"])
        seconds = self.sync_weights()
        self.llm.wake_up(tags=["kv_cache"])
        self._asleep = False
        return seconds

    def generate(self, batch: Batch, params: SamplingParams) -> Batch:
        ids, mask = check_prompt_batch(batch)
        start = time.perf_counter()
        threads = torch.get_num_threads()
        if not self.gpu and self.config.cpu_threads > 0:
            torch.set_num_threads(self.config.cpu_threads)
        try:
            sync_s = self._wake_and_sync()
            outputs = self.llm.generate(
                prompts_as_vllm(ids, mask),
                vllm_sampling_params(params, len(ids), self.eos_ids),
                use_tqdm=False,
            )
        finally:
            torch.set_num_threads(threads)
            self.sleep()
        responses, lengths, logps = outputs_to_tensors(outputs, params, self.pad_token_id)
        self.last_stats = {
            "rollout/seconds": time.perf_counter() - start,
            "rollout/weight_sync_seconds": sync_s,
            "rollout/response_tokens": float(lengths.sum()),
            "rollout/prompt_tokens": float(mask.sum()) * params.n,
        }
        out = build_rollout_batch(batch, responses, lengths, logps, params, self.pad_token_id)
        out.meta["rollout_log_probs_exact"] = params.greedy or not truncates(params)
        return out

    @property
    def eos_ids(self):
        return self.model.config.eos_token_id

    def close(self) -> None:
        """Drop the engine and vLLM's parallel groups, so another engine can be built in this process."""
        with contextlib.suppress(Exception):
            from vllm.distributed.parallel_state import destroy_model_parallel

            del self.llm
            destroy_model_parallel()


# ---- pure translation between hybridflow and vLLM ----------------------------------------------------
def truncates(params: SamplingParams) -> bool:
    """True when top-k or top-p can drop tokens (vLLM's processed log-probs then differ from ours)."""
    return params.top_k > 0 or params.top_p < 1.0


def prompts_as_vllm(ids: torch.Tensor, mask: torch.Tensor) -> list[dict]:
    """Left-padded (B, Lp) prompts -> vLLM TokensPrompt dicts without the padding."""
    return [{"prompt_token_ids": row[m.bool()].tolist()} for row, m in zip(ids, mask)]


def vllm_sampling_params(params: SamplingParams, num_prompts: int, default_eos) -> list:
    """One vLLM SamplingParams per prompt. Stop ids are passed explicitly (ignore_eos: vLLM has no
    tokenizer here), and prompt i gets seed + i * n: vLLM seeds its n samples seed, seed + 1, ..."""
    from vllm import SamplingParams as VSP

    common = dict(
        n=params.n,
        max_tokens=params.max_new_tokens,
        temperature=0.0 if params.greedy else params.temperature,
        top_k=params.top_k if params.top_k > 0 and not params.greedy else 0,
        top_p=params.top_p if not params.greedy else 1.0,
        stop_token_ids=list(params.stop_ids(default_eos)),
        ignore_eos=True,
        logprobs=0,  # the sampled token's log-prob only
        detokenize=False,
    )
    seed = params.seed
    return [VSP(seed=None if seed is None else seed + i * params.n, **common) for i in range(num_prompts)]


def outputs_to_tensors(outputs, params: SamplingParams, pad_token_id: int):
    """vLLM RequestOutputs (one per prompt, n completions each) -> responses (B*n, Lr), lengths (B*n,),
    log-probs (B*n, Lr), rows ordered prompt-major (a, a, b, b) as build_rollout_batch expects."""
    rows = len(outputs) * params.n
    lr = params.max_new_tokens
    responses = torch.full((rows, lr), pad_token_id, dtype=torch.long)
    logps = torch.zeros(rows, lr, dtype=torch.float32)
    lengths = torch.zeros(rows, dtype=torch.long)
    for i, request in enumerate(outputs):
        completions = sorted(request.outputs, key=lambda c: c.index)
        if len(completions) != params.n:
            raise RuntimeError(
                f"vLLM returned {len(completions)} completions for a prompt, expected {params.n}"
            )
        for j, c in enumerate(completions):
            r, toks = i * params.n + j, list(c.token_ids)[:lr]
            responses[r, : len(toks)] = torch.tensor(toks, dtype=torch.long)
            lengths[r] = len(toks)
            logps[r, : len(toks)] = torch.tensor([c.logprobs[t][tok].logprob for t, tok in enumerate(toks)])
    return responses, lengths, logps


def kv_cache_bytes(hf_config, dtype: torch.dtype, max_num_seqs: int, max_model_len: int) -> int:
    """K and V for max_num_seqs full-length sequences, in vLLM's 16-token blocks, plus one spare block
    per sequence (vLLM's scheduler needs a little slack)."""
    layers = hf_config.num_hidden_layers
    heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    blocks = -(-max_model_len // 16) + 1
    per_token = 2 * layers * heads * head_dim * torch.tensor([], dtype=dtype).element_size()
    return max_num_seqs * blocks * 16 * per_token


def _full(t: torch.Tensor) -> torch.Tensor:
    """A DTensor (tensor-parallel actor) gathered to the full tensor vLLM's loaders shard themselves."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _first(x):
    if isinstance(x, (list, tuple)):
        return x[0] if x else None
    return x
