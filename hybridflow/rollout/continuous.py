"""Continuous batching on the built-in engine: rows (trajectories) join the decode batch, sample one token
per step and leave it, each at its own time; the agent loop (agent/loop.py) schedules them.

A row's cache row (rollout/ragged_decoder.py) holds exactly the tokens it was fed: its prompt, the tokens
it sampled, the tokens a tool inserted, in order. Each `step`:
1. rows that joined (a prompt, or the last sampled token and what a tool inserted after it) are fed in
   one `extend` call; fresh rows with the same prompt (the n samples of one) are prefilled once and the
   cache row copied;
2. the rows that sampled last step and stayed are moved to the front of the cache (hole filling: one
   swap per row out of place) and fed their token in one decode call;
3. every row fed samples its next token.
A row that leaves (its turn ended) keeps its cache row and its last token, not yet fed, until it joins
again. Rows beyond `capacity` cache rows (BuiltinEngineConfig.max_num_seqs) wait for a finished row's.

Draws are counter-based: row r's token at position p uses the uniform hash(key_r, p)
(sampling.counter_uniforms), key_r a hash of (seed, its prompt's id, its sample index) when the caller
names the prompts (sampling.sample_keys), else of (seed, r), so a row's samples depend neither on which
rows share a step, nor on when its tool answered, nor (prompts named) on the rank it runs on. Only the logits' rounding does (a matmul over b rows may block differently from one
over b' rows, ~1e-7 in fp32), which can flip a draw that falls that close to a boundary of the CDF.

Under a generation tensor-parallel group (rollout.tg > 1; the decoder's `tp`) every rank of the group
runs the same rows: each `step` must feed the same rows the same tokens on every rank, or their
collectives would not match. The sampled tokens are the group's first rank's (`TPGroup.agree`), and
the caller's `join` / `leave` / `finish` calls follow from them and from what `share` hands out: the
group's first rank `decides` (it runs the tool calls) and shares which rows' calls answered and with
what tokens, so every rank makes the same calls in the same order. Without a group, `decides` is true
and `share` hands back its argument: one code path.
"""

from __future__ import annotations

import torch

from hybridflow.rollout.base import SamplingParams
from hybridflow.rollout.ragged_decoder import RaggedDecoder
from hybridflow.rollout.sampling import counter_uniforms, row_keys, sample_keys, sample_next


class ContinuousBatch:
    """rows: trajectories, numbered 0..rows-1, n per prompt (a, a, b, b); capacity: cache rows (at most
    rows); prompts: (rows // n,) the prompts' ids (base.prompt_ids), None to key draws by row. Call `join` with a
    row's tokens to feed, `step` to sample one token for every row in the batch, `leave` when a row's
    turn ends, `finish` when its trajectory does."""

    def __init__(
        self,
        decoder: RaggedDecoder,
        params: SamplingParams,
        rows: int,
        capacity: int,
        stop_ids: tuple[int, ...],
        prompts: torch.Tensor | None = None,
    ):
        self.decoder, self.params, self.device = decoder, params, decoder.embed.device
        tp = decoder.tp
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.stop_ids = frozenset(stop_ids)
        """Tokens that end a trajectory (eos and stop tokens): the caller's to act on."""
        seed = params.seed if params.seed is not None else int(torch.randint(2**31, ()))
        self.keys = (
            row_keys(seed, rows, self.device)
            if prompts is None
            else sample_keys(seed, prompts, rows // len(prompts), self.device)
        )
        self.fill = [0] * rows  # tokens in each row's cache
        self.last: dict[int, int] = {}  # row -> its last sampled token, not fed yet
        self.decoding: list[int] = []  # rows that sampled last step and stay: fed by decode
        self.joining: dict[int, list[int]] = {}  # row -> tokens to feed by extend (in join order)
        self.slot_of: dict[int, int] = {}  # row -> its cache row
        self.row_at: list[int | None] = [None] * capacity
        self.free = list(range(capacity - 1, -1, -1))

    @property
    def ready(self) -> bool:
        """Whether `step` has a row to feed."""
        return bool(self.decoding) or any(r in self.slot_of or self.free for r in self.joining)

    @property
    def decides(self) -> bool:
        """Whether this rank decides what the rows do between steps (and runs their tool calls): the
        only rank without a TP group, the group's first rank in one."""
        return self.tp is None or self.tp.is_src

    def share(self, values: list[float]) -> list[float]:
        """The deciding rank's `values` on every rank of the TP group (the others pass anything, e.g.
        []); `values` itself without a group."""
        return values if self.tp is None else self.tp.share(values, self.device)

    def join(self, row: int, tokens: list[int]) -> None:
        """Feed `tokens` after what the row holds (and its last sampled token) at the next step."""
        last = [self.last.pop(row)] if row in self.last else []
        self.joining[row] = self.joining.get(row, []) + last + list(tokens)

    def leave(self, row: int) -> None:
        """The row stops decoding; its cache row and last token are kept for its next `join`."""
        self.decoding.remove(row)

    def finish(self, row: int) -> None:
        """The row is done: its cache row is free for a row waiting for one."""
        if row in self.decoding:
            self.decoding.remove(row)
        self.joining.pop(row, None)
        self.last.pop(row, None)
        slot = self.slot_of.pop(row, None)
        if slot is not None:
            self.row_at[slot] = None
            self.free.append(slot)

    def step(self) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """-> (rows, tokens (k,), log-probs (k,)): one token sampled for each row fed."""
        joined, joined_logits = self._extend()
        fed, logits = self._decode()
        if joined:
            fed, logits = (
                fed + joined,
                joined_logits if logits is None else torch.cat([logits, joined_logits]),
            )
        counters = torch.tensor([self.fill[r] for r in fed], dtype=torch.int64, device=self.device)
        uniforms = counter_uniforms(self.keys[torch.tensor(fed, device=self.device)], counters)
        tokens, logps = sample_next(logits, self.params, uniforms=uniforms)
        if self.tp is not None:  # the first rank's draws for all, whatever the rounding of each's logits
            tokens, logps = self.tp.agree(tokens, logps)
        self.last.update(zip(fed, tokens.tolist()))
        self.decoding = list(fed)  # the caller's `leave` calls edit this one, not the returned list
        return fed, tokens, logps

    def _extend(self) -> tuple[list[int], torch.Tensor | None]:
        """Feed the joining rows that have (or get) a cache row; a prompt shared by fresh rows once."""
        rows = []
        for r in self.joining:
            if r not in self.slot_of:
                if not self.free:
                    continue  # waits for a finished row's cache row
                self._place(r)
            rows.append(r)
        if not rows:
            return [], None
        first: dict[tuple, int] = {}  # a fresh prompt -> the row that computes it
        for r in rows:
            if self.fill[r] == 0:
                first.setdefault(tuple(self.joining[r]), r)
        computed = [r for r in rows if self.fill[r] > 0 or first[tuple(self.joining[r])] == r]
        logits = self.decoder.extend(
            [self.slot_of[r] for r in computed],
            [self.joining[r] for r in computed],
            [self.fill[r] for r in computed],
        )
        copies = [(first[tuple(self.joining[r])], r) for r in rows if r not in computed]
        if copies:
            src = torch.tensor([self.slot_of[a] for a, _ in copies], device=self.device)
            self.decoder.copy_rows(
                src, torch.tensor([self.slot_of[b] for _, b in copies], device=self.device)
            )
        where = {r: i for i, r in enumerate(computed)}
        pick = [where[r] if r in where else where[first[tuple(self.joining[r])]] for r in rows]
        for r in rows:
            self.fill[r] += len(self.joining.pop(r))
        return rows, logits[torch.tensor(pick, device=self.device)]

    def _place(self, row: int) -> None:
        slot = self.free.pop()
        self.slot_of[row], self.row_at[slot] = slot, row
        self.decoder.reset_row(slot)

    def _decode(self) -> tuple[list[int], torch.Tensor | None]:
        """Feed each decoding row its last token, the rows moved to cache rows [0, b) first."""
        rows = self.decoding
        if not rows:
            return [], None
        b, wanted = len(rows), set(rows)
        holes = [p for p in range(b) if self.row_at[p] not in wanted]
        movers = [self.slot_of[r] for r in rows if self.slot_of[r] >= b]
        if holes:  # swap each hole with a decoding row out of place
            src = torch.tensor(holes + movers, device=self.device)
            self.decoder.copy_rows(src, torch.tensor(movers + holes, device=self.device))
            for h, m in zip(holes, movers):
                self.row_at[h], self.row_at[m] = self.row_at[m], self.row_at[h]
                for p in (h, m):
                    if self.row_at[p] is not None:
                        self.slot_of[self.row_at[p]] = p
        order = self.row_at[:b]
        tokens = torch.tensor([self.last.pop(r) for r in order], device=self.device)
        pos = [self.fill[r] for r in order]
        logits = self.decoder.decode_rows(tokens, torch.tensor(pos, device=self.device), max(pos) + 1)
        for r in order:
            self.fill[r] += 1
        return order, logits
