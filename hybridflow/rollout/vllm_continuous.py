"""The agent loop's continuous batch on vLLM (rollout.engine=vllm): the calls of
rollout/continuous.ContinuousBatch (join, step, leave, finish) on vLLM's own scheduler, through its
LLMEngine's add_request / step / abort_request.

A row's turn is one vLLM request over the row's whole context so far (prompt, sampled and inserted
tokens, exactly; vLLM's prefix cache keeps the KV of the blocks it has seen, so a rejoining row
prefills only its new tokens), streamed as it decodes (RequestOutputKind.DELTA). A row that leaves
has its request aborted at once, so vLLM schedules the others without it. Each `step` runs one vLLM
engine step and hands out one token per row: a step that returned more tokens for a row keeps the rest
for the next steps, and they are dropped if the row leaves first (sampled past its call's end; waves
drop those too). Each request is seeded from (seed, row, context length), the row named by its prompt's
id and sample index when the caller gives the prompts, so a row's draws do not depend on which rows
share a vLLM step, nor on the rank it runs on.

Under vLLM tensor parallel (rollout.tg > 1) each rank of the group runs its own LLMEngine over the
external launcher, and vLLM's engines produce the same outputs only when every rank makes the same
add_request / step / abort_request calls in the same order (its scheduling is deterministic). The
agent loop's calls follow from the sampled tokens, which vLLM's all-gathered logits and per-request
seeds make the same on every rank, and from the tool answers, which the group's first rank alone runs
and `share`s (as rollout/continuous.ContinuousBatch does under the built-in engine's group); the seed
is the first rank's too.
"""

from __future__ import annotations

import dataclasses

import torch

from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.tp_group import TPGroup


class VLLMContinuous:
    """engine: a vllm LLMEngine; rows, max_len: as BuiltinEngine.continuous; tp: vLLM's TP group with
    more than one rank, else None; device: where `share` broadcasts (the group's device)."""

    def __init__(
        self,
        engine,
        params: SamplingParams,
        rows: int,
        max_len: int,
        stop_ids: tuple[int, ...],
        eos,
        tp: TPGroup | None = None,
        device: torch.device | None = None,
        prompts: torch.Tensor | None = None,
    ):
        self.engine, self.params, self.max_len, self.eos = engine, params, max_len, eos
        self.tp, self.device = tp, device or torch.device("cpu")
        self.stop_ids = frozenset(stop_ids)
        seed = params.seed if params.seed is not None else int(torch.randint(2**31, ()))
        self.seed = int(self.share([seed])[0])  # a random seed drawn per rank: the first rank's for all
        # each row's id in its requests' seeds: sample j of prompt p (prompts named: the same on any rank)
        n = rows // len(prompts) if prompts is not None else 1
        self.row_id = (
            list(range(rows)) if prompts is None else [int(p) * n + j for p in prompts for j in range(n)]
        )
        self.context: list[list[int]] = [[] for _ in range(rows)]
        self.request: dict[int, str] = {}  # row -> its running request
        self.owner: dict[str, int] = {}  # request id -> row
        self.buffered: dict[int, list[tuple[int, float]]] = {}  # row -> tokens returned, not handed out

    @property
    def decides(self) -> bool:
        """As ContinuousBatch.decides: the only rank without a TP group, the group's first rank in one."""
        return self.tp is None or self.tp.is_src

    def share(self, values: list[float]) -> list[float]:
        """As ContinuousBatch.share: the deciding rank's `values` on every rank of the group."""
        return values if self.tp is None else self.tp.share(values, self.device)

    @property
    def ready(self) -> bool:
        return bool(self.request) or any(self.buffered.values())

    def join(self, row: int, tokens: list[int]) -> None:
        from vllm.sampling_params import RequestOutputKind

        from hybridflow.rollout.vllm_engine import vllm_sampling_params

        self.context[row] += tokens
        at = len(self.context[row])
        seed = (self.seed * 1_000_003 + self.row_id[row] * 1_009 + at) % (2**31)
        turn = dataclasses.replace(self.params, n=1, max_new_tokens=self.max_len - at, seed=seed)
        vsp = vllm_sampling_params(turn, [0], self.eos)[0]
        vsp.output_kind = RequestOutputKind.DELTA
        rid = f"{row}.{at}"
        self.request[row], self.owner[rid] = rid, row
        self.engine.add_request(rid, {"prompt_token_ids": list(self.context[row])}, vsp)

    def leave(self, row: int) -> None:
        rid = self.request.pop(row, None)
        if rid is not None:
            self.engine.abort_request([rid])
            self.owner.pop(rid, None)
        self.buffered.pop(row, None)

    finish = leave

    def close(self) -> None:
        for row in list(self.request):
            self.leave(row)

    def step(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """-> (rows, tokens (k,), log-probs (k,)): the next token of each row that has one."""
        if self.request:
            for out in self.engine.step():
                row = self.owner.get(out.request_id)
                if row is None:
                    continue
                c = out.outputs[0]
                got = [(t, c.logprobs[k][t].logprob) for k, t in enumerate(c.token_ids)]
                self.buffered.setdefault(row, []).extend(got)
                if out.finished:
                    self.owner.pop(self.request.pop(row), None)
        rows = [r for r, b in self.buffered.items() if b]
        picked = [self.buffered[r].pop(0) for r in rows]
        for r, (t, _) in zip(rows, picked):
            self.context[r].append(t)
        tokens = torch.tensor([t for t, _ in picked], dtype=torch.long)
        return rows, tokens, torch.tensor([lp for _, lp in picked], dtype=torch.float32)
