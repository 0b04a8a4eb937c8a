"""The agent loop's continuous batch on vLLM (rollout.engine=vllm): the calls of
rollout/continuous.ContinuousBatch (join, step, leave, finish) on vLLM's own scheduler, through its
LLMEngine's add_request / step / abort_request.

A row's turn is one vLLM request over the row's whole context so far (prompt, sampled and inserted
tokens, exactly; vLLM's prefix cache keeps the KV of the blocks it has seen, so a rejoining row
prefills only its new tokens), streamed as it decodes (RequestOutputKind.DELTA). A row that leaves
has its request aborted at once, so vLLM schedules the others without it. Each `step` runs one vLLM
engine step and hands out one token per row: a step that returned more tokens for a row keeps the rest
for the next steps, and they are dropped if the row leaves first (sampled past its call's end; waves
drop those too). Each request is seeded from (seed, row, context length), so a row's draws do not
depend on which rows share a vLLM step.
"""

from __future__ import annotations

import dataclasses

import torch

from hybridflow.rollout.base import SamplingParams


class VLLMContinuous:
    """engine: a vllm LLMEngine; rows, max_len: as BuiltinEngine.continuous."""

    def __init__(
        self, engine, params: SamplingParams, rows: int, max_len: int, stop_ids: tuple[int, ...], eos
    ):
        self.engine, self.params, self.max_len, self.eos = engine, params, max_len, eos
        self.stop_ids = frozenset(stop_ids)
        self.seed = params.seed if params.seed is not None else int(torch.randint(2**31, ()))
        self.context: list[list[int]] = [[] for _ in range(rows)]
        self.request: dict[int, str] = {}  # row -> its running request
        self.owner: dict[str, int] = {}  # request id -> row
        self.buffered: dict[int, list[tuple[int, float]]] = {}  # row -> tokens returned, not handed out

    decides = True
    """The only rank deciding (vLLM with rollout.tg > 1 runs waves: rollout/vllm_engine.py)."""

    def share(self, values: list[float]) -> list[float]:
        """As ContinuousBatch.share without a TP group: `values` itself."""
        return values

    @property
    def ready(self) -> bool:
        return bool(self.request) or any(self.buffered.values())

    def join(self, row: int, tokens: list[int]) -> None:
        from vllm.sampling_params import RequestOutputKind

        from hybridflow.rollout.vllm_engine import vllm_sampling_params

        self.context[row] += tokens
        at = len(self.context[row])
        seed = (self.seed * 1_000_003 + row * 1_009 + at) % (2**31)
        turn = dataclasses.replace(self.params, n=1, max_new_tokens=self.max_len - at, seed=seed)
        vsp = vllm_sampling_params(turn, 1, self.eos)[0]
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
