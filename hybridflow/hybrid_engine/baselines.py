"""The paper's baseline switch methods (`rollout.reshard` allgather / vanilla / two_copy), for the
comparison benchmarks/bench_hybrid_engine.py and tests/hybrid_engine measure against the 3D-HybridEngine.

They are not the engine a run uses by default: each is a Resharder (resharder.py) with its hooks
overridden, built only when `rollout.reshard` names it (resharder.build_resharder imports this module
then), so the core never imports this file.

  allgather   all-gather the TP-split weights over the whole training TP group (one bucket per unit, as
              DeepSpeed-Chat gathers a module's parameters together): each rank then holds the full
              model and generates on its tg-shard views of it.
  vanilla     HybridFlow-V: generation groups of consecutive ranks, so a rank owns none of its generation
              shard in general; it gathers the whole model inside the TP group, as allgather does.
  two_copy    OpenRLHF: a resident second copy of the generation shard, refreshed every step by a full
              weight transfer (rank 0 gathers each weight from its TP group and broadcasts it to all).

Their byte and memory formulas are cost.fsdp_switch_cost's rows for the same names.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from hybridflow.hybrid_engine.comm import tensor_bytes
from hybridflow.hybrid_engine.resharder import Resharder


class AllGatherResharder(Resharder):
    """DeepSpeed-Chat: the whole model on every rank while generating."""

    method = "allgather"

    @property
    def in_place(self) -> bool:
        return False

    def _keeps_unit(self, names: list[str]) -> bool:
        return False

    def _whole(self, name: str, local: torch.Tensor) -> torch.Tensor:
        full = self.ledger.hold(self._cast_copy(local))  # the whole model is held anyway: the embeddings too
        return full.chunk(self.tg, 0)[self.tp_index] if name in self.vocab else full

    def _gather_scope(self) -> tuple[dist.ProcessGroup | None, int]:
        return self.train_tp, self.tp_size

    def _generation_piece(self, gathered: torch.Tensor, dim: int) -> torch.Tensor:
        return gathered.chunk(self.tg, dim)[self.g_tp]  # a view: the rank holds the whole weight


class VanillaResharder(AllGatherResharder):
    """HybridFlow-V: allgather's gather with consecutive generation groups (resharder.generation_layout)."""

    method = "vanilla"


class TwoCopyResharder(Resharder):
    """OpenRLHF: a resident copy of the generation shard, refreshed weight by weight from global rank 0."""

    method = "two_copy"

    def __init__(self, engine, tg: int = 1, split_vocab: bool = False, dtype: torch.dtype | None = None):
        super().__init__(engine, tg, split_vocab, dtype)
        self._copy: dict[str, torch.Tensor] = {}

    @property
    def in_place(self) -> bool:
        return False

    def _resident_bytes(self) -> int:
        return sum(tensor_bytes(v) for v in self._copy.values())  # counted all the time

    def _keeps_unit(self, names: list[str]) -> bool:
        return False

    def _direct(self, name: str, local: torch.Tensor, dim: int | None) -> torch.Tensor:
        """Global rank 0 gathers the weight from its TP group and broadcasts it whole; every rank copies
        its generation shard out of it into its resident copy."""
        full = self._broadcast_full(self._cast(local), dim)
        if dim is None:
            piece = full.chunk(self.tg, 0)[self.tp_index] if name in self.vocab else full
        else:
            piece = full.chunk(self.tg, dim)[self.g_tp]
        if name not in self._copy:
            self._copy[name] = self.ledger.hold(piece.clone())
        else:
            self._copy[name].copy_(piece)
        return self._copy[name]

    def _broadcast_full(self, local: torch.Tensor, dim: int | None) -> torch.Tensor:
        """The whole weight on every rank: gathered on rank 0 from its training TP group, broadcast."""
        if dim is not None and self.tp_size > 1:
            in_src_group = self.rank < self.tp_size  # rank 0's training TP group is ranks 0 .. tp-1
            shape = list(local.shape)
            shape[dim] *= self.tp_size
            full = torch.empty(shape, dtype=local.dtype, device=local.device)
            if in_src_group:
                slots = torch.empty((self.tp_size, *local.shape), dtype=local.dtype, device=local.device)
                flat = slots.view(-1) if self.rank == 0 else None
                self.comm.gather(local.contiguous().view(-1), flat, 0, self.train_tp)
                if self.rank == 0:
                    full.copy_(torch.cat(slots.unbind(0), dim=dim))
        else:
            full = local.contiguous().clone() if self.rank == 0 else torch.empty_like(local)
        self.ledger.transient(tensor_bytes(full))
        self.comm.broadcast(full, src=0, group=None)
        return full


BASELINES: dict[str, type[Resharder]] = {
    cls.method: cls for cls in (AllGatherResharder, VanillaResharder, TwoCopyResharder)
}
