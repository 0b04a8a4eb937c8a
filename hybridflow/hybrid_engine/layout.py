"""Training and generation layouts of the actor on the same N ranks, and their process groups (pure math).

Training uses (p, t, d): pipeline, tensor and data parallel sizes. Rank order is the project's one
convention, (pp, dp, tp) with tp fastest (Megatron's; controller/worker.build_device_mesh, the engines'
("dp", "tp") mesh and the planner use it): rank = p_i * (d*t) + d_i * t + t_i. Generation uses (pg, tg, dg, d) on the same N = p*t*d ranks,
with micro-DP size dg = p*t / (pg*tg): inside each training model-parallel group (the p*t ranks with the
same d_i) there are dg generation replicas, each a pg x tg grid.

Two ways to place the generation grid (docs/design.md §4):
- "hybridflow": generation TP groups are strided by t/tg and PP groups by p/pg, so rank (p_i, t_i) with
  t_i = g_tp * (t/tg) + m_tp and p_i = g_pp * (p/pg) + m_pp gets generation coordinates (g_pp, g_tp) and
  micro-DP index m_pp * (t/tg) + m_tp. Every rank's training shard is then part of its generation shard,
  and the ranks holding the rest of that shard are exactly its micro-DP group (consecutive ranks for p = 1).
- "vanilla" (HybridFlow-V): generation groups are consecutive ranks of the model-parallel group, the
  generation TP rank is the local rank modulo tg, which in general does not own any of the weights it
  needs, so the switch must gather the whole model inside the training model-parallel group.

Everything here is a pure function of sizes and ranks: the planner and tests use it without processes.
"""

from __future__ import annotations

from dataclasses import dataclass

STYLES = ("hybridflow", "vanilla")


@dataclass(frozen=True)
class TrainLayout:
    """Training parallel sizes; all global (N = p * t * d ranks)."""

    p: int  # pipeline-parallel size (stages over layers)
    t: int  # tensor-parallel size
    d: int  # data-parallel size (model replicas)

    def __post_init__(self):
        for name in ("p", "t", "d"):
            if getattr(self, name) < 1:
                raise ValueError(f"training layout {name}={getattr(self, name)} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.p * self.t * self.d

    def coords(self, rank: int) -> tuple[int, int, int]:
        """rank -> (d_i, p_i, t_i)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside training layout of {self.world_size} ranks")
        return (rank // self.t) % self.d, rank // (self.d * self.t), rank % self.t

    def rank(self, d_i: int, p_i: int, t_i: int) -> int:
        return p_i * self.d * self.t + d_i * self.t + t_i

    def tp_groups(self) -> list[list[int]]:
        return _groups(self.world_size, lambda r: (self.coords(r)[0], self.coords(r)[1]))

    def pp_groups(self) -> list[list[int]]:
        return _groups(self.world_size, lambda r: (self.coords(r)[0], self.coords(r)[2]))

    def mp_groups(self) -> list[list[int]]:
        """Model-parallel groups: the p*t ranks holding one training replica (same d_i)."""
        return _groups(self.world_size, lambda r: self.coords(r)[0])


@dataclass(frozen=True)
class GenLayout:
    """Generation layout on the ranks of `train`: generation TP size tg and PP size pg; dg is derived."""

    train: TrainLayout
    pg: int  # generation pipeline-parallel size; must divide train.p
    tg: int  # generation tensor-parallel size; must divide train.t
    style: str = "hybridflow"  # "hybridflow" (strided groups) or "vanilla" (HybridFlow-V, consecutive)

    def __post_init__(self):
        tr = self.train
        if self.style not in STYLES:
            raise ValueError(f"generation layout style {self.style!r} unknown; choose one of {STYLES}")
        if self.tg < 1 or tr.t % self.tg:
            raise ValueError(
                f"generation tg={self.tg} must divide training t={tr.t} (try tg in {_divs(tr.t)})"
            )
        if self.pg < 1 or tr.p % self.pg:
            raise ValueError(
                f"generation pg={self.pg} must divide training p={tr.p} (try pg in {_divs(tr.p)})"
            )

    @property
    def dg(self) -> int:
        """Micro-DP size: generation replicas per training model-parallel group, p*t/(pg*tg)."""
        return self.train.p * self.train.t // (self.pg * self.tg)

    @property
    def num_replicas(self) -> int:
        """Generation model replicas in total (d * dg); the prompts are split over these."""
        return self.train.d * self.dg

    def coords(self, rank: int) -> tuple[int, int, int, int]:
        """rank -> (d_i, g_pp, g_tp, micro_dp_index)."""
        tr = self.train
        d_i, p_i, t_i = tr.coords(rank)
        if self.style == "hybridflow":
            st, sp = tr.t // self.tg, tr.p // self.pg  # strides: training ranks per generation shard
            g_tp, m_tp = divmod(t_i, st)
            g_pp, m_pp = divmod(p_i, sp)
            return d_i, g_pp, g_tp, m_pp * st + m_tp
        local = p_i * tr.t + t_i
        return d_i, (local // self.tg) % self.pg, local % self.tg, local // (self.tg * self.pg)

    def replica(self, rank: int) -> int:
        """Index (0 .. d*dg-1) of the generation replica this rank belongs to."""
        d_i, _, _, mu = self.coords(rank)
        return d_i * self.dg + mu

    def tp_groups(self) -> list[list[int]]:
        """Generation tensor-parallel groups (same d_i, g_pp, micro-DP index); ordered by g_tp."""
        return _groups(
            self.train.world_size, lambda r: self._key(r, 0, 1, 3), order=lambda r: self.coords(r)[2]
        )

    def pp_groups(self) -> list[list[int]]:
        """Generation pipeline groups (same d_i, g_tp, micro-DP index); ordered by g_pp."""
        return _groups(
            self.train.world_size, lambda r: self._key(r, 0, 2, 3), order=lambda r: self.coords(r)[1]
        )

    def micro_dp_groups(self) -> list[list[int]]:
        """Micro-DP groups (same d_i, g_pp, g_tp): ranks holding the same generation shard."""
        return _groups(
            self.train.world_size, lambda r: self._key(r, 0, 1, 2), order=lambda r: self.coords(r)[3]
        )

    def replica_groups(self) -> list[list[int]]:
        """The pg*tg ranks forming one generation model replica, in replica order."""
        groups = _groups(self.train.world_size, self.replica)
        return sorted(groups, key=lambda g: self.replica(g[0]))

    def needed_pieces(self, rank: int) -> tuple[range, range]:
        """(training stages, training TP pieces) whose weights this rank needs for generation."""
        tr = self.train
        _, g_pp, g_tp, _ = self.coords(rank)
        sp, st = tr.p // self.pg, tr.t // self.tg
        return range(g_pp * sp, (g_pp + 1) * sp), range(g_tp * st, (g_tp + 1) * st)

    def replica_slice(self, rank: int, batch_size: int) -> slice:
        """3D_ALL_MICRO_DP distribute: the prompts rank's replica generates (torch.tensor_split rule)."""
        q, r = divmod(batch_size, self.num_replicas)
        i = self.replica(rank)
        start = i * q + min(i, r)
        return slice(start, start + q + (1 if i < r else 0))

    def collect_ranks(self) -> list[int]:
        """3D_ALL_MICRO_DP collect: one rank per replica (g_tp = 0 on the last stage), in replica order."""
        return [next(r for r in g if self.coords(r)[1:3] == (self.pg - 1, 0)) for g in self.replica_groups()]

    def _key(self, rank: int, *idx: int) -> tuple[int, ...]:
        c = self.coords(rank)
        return tuple(c[i] for i in idx)


def _groups(n: int, key, order=None) -> list[list[int]]:
    """Partition range(n) by key(rank); groups in order of first rank, members sorted by `order`."""
    out: dict = {}
    for r in range(n):
        out.setdefault(key(r), []).append(r)
    groups = [sorted(g, key=order) if order else g for g in out.values()]
    return sorted(groups, key=min)


def _divs(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


LLAMA_FAMILY = (
    "llama",
    "qwen2",
    "mistral",
)  # what the tensor-parallel decoder runs (rollout/llama_decoder.py)


def generation_layout_errors(
    actor_parallel, tg: int, pg: int, model_dir: str | None, reshard: str = "hybridflow"
) -> list[str]:
    """One-line reasons why the actor's training layout cannot switch to generation tg x pg (config
    validation). model_dir: an HF directory whose config.json gives the head counts, or None."""
    tp, pp = actor_parallel.tp, actor_parallel.pp
    errors = []
    if pp > 1:
        errors += _pipeline_errors(tp, tg, reshard, _read_config(model_dir))
    if pg != 1:
        errors.append(f"rollout.pg = {pg}: generation pipeline parallelism does not exist yet; use pg = 1")
    if tg < 1 or tp % tg:
        errors.append(
            f"rollout.tg = {tg} must divide actor.parallel.tp = {tp} (try tg in {_divs(max(tp, 1))})"
        )
        return errors
    hf = _read_config(model_dir)
    if hf is None:
        return errors
    heads, kv = hf.get("num_attention_heads"), hf.get("num_key_value_heads", hf.get("num_attention_heads"))
    if isinstance(heads, int) and isinstance(kv, int) and (heads % tg or kv % tg):
        errors.append(
            f"rollout.tg = {tg} must divide the model's num_attention_heads = {heads} and "
            f"num_key_value_heads = {kv}"
        )
    kind = hf.get("model_type")
    if kind not in LLAMA_FAMILY and (tp > 1 or reshard != "hybridflow"):
        errors.append(
            f"actor.parallel.tp = {tp}, rollout.reshard = {reshard}: model_type {kind!r} generates on the HF "
            f"forward, in place on the actor's whole weights; that needs tp = 1 and reshard = hybridflow "
            f"(resharded generation runs {LLAMA_FAMILY} models)"
        )
    return errors


def _pipeline_errors(tp: int, tg: int, reshard: str, hf: dict | None) -> list[str]:
    """What actor.parallel.pp > 1 runs with: the hybridflow switch with pg = 1 (each rank gathers its
    tg-shard of every stage, hybrid_engine/pipeline_switch.py; tg dividing tp is checked below), a
    Llama-family model without tied embeddings."""
    errors = []
    if reshard != "hybridflow":
        errors.append(f"rollout.reshard = {reshard} with actor.parallel.pp > 1: pipeline stages switch to "
                      "generation by the hybridflow method only; set rollout.reshard=hybridflow")  # fmt: skip
    if hf is not None and hf.get("model_type") not in LLAMA_FAMILY:
        errors.append(f"actor.parallel.pp > 1: pipeline stages are cut from {LLAMA_FAMILY} models, not "
                      f"{hf.get('model_type')!r}; use pp = 1")  # fmt: skip
    if hf is not None and hf.get("tie_word_embeddings"):
        errors.append("actor.parallel.pp > 1: the model ties its input and output embeddings "
                      "(tie_word_embeddings), which the first and last stages would train as two copies; use pp = 1")  # fmt: skip
    return errors


def _read_config(model_dir: str | None) -> dict | None:
    import json
    import os

    path = os.path.join(model_dir, "config.json") if model_dir else None
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            hf = json.load(f)
    except (OSError, ValueError):
        return None  # unreadable or corrupt: the model.path check reports it in one line
    return {**hf.get("text_config", {}), **hf}
