"""The functional decoder (llama_decoder.py) with a length of its own per cache row, for continuous
batching (rollout/continuous.py): rows join, decode and leave at different lengths.

Where it departs from the parent: row r's tokens sit at cache slots [0, fill_r), unpadded, so a token's
slot is its position id. `extend` appends any number of tokens to any rows (a new prompt, or the tokens
a tool inserted after a row's last sampled one): their k/v are written at their slots and their queries
attend to the row's whole cache causally (SDPA on the rows' gathered cache, like a prefill that starts
mid-row). `decode_rows` appends one token to each of the first b rows at each row's own slot. The cache
is zero-filled at `start`: a short row's slots past its fill are read by the batch's longer attention
span (masked by key_bias, and 0 * NaN would not be 0). Tensor parallel is the parent's (its heads/tg
heads, row-parallel all-reduces, vocab-parallel embeddings and logits): every rank of the group must
make the same calls with the same rows (rollout/continuous.py sees to it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridflow.rollout.llama_decoder import LlamaFamilyDecoder


class RaggedDecoder(LlamaFamilyDecoder):
    """`start(capacity, max_len, max_position)` as the parent, then `extend`, `decode_rows` and
    `copy_rows` in any order; rows are cache positions, [0, b) the decode batch."""

    def start(self, capacity: int, max_len: int, max_position: int) -> None:
        super().start(capacity, max_len, max_position)
        if not self.full_attention:  # the parent leaves the cache uninitialised there
            self.kv.zero_()
        self.used = 0  # slots in use by the longest row: what copy_rows moves

    def reset_row(self, row: int) -> None:
        """Cache position `row` holds a new row from now on: nothing of it is visible."""
        self.key_bias[row] = float("-inf")

    def copy_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Cache rows src (k,) -> positions dst (k,); the sources are read before any write, so src and
        dst may overlap (a swap is src=[i, j], dst=[j, i])."""
        self.kv[:, :, dst, :, : self.used] = self.kv[:, :, src, :, : self.used]
        self.key_bias[dst] = self.key_bias[src]

    def decode_rows(self, tokens: torch.Tensor, pos: torch.Tensor, longest: int) -> torch.Tensor:
        """tokens, pos: (b,) for cache rows [0, b): each row's token goes to slot pos (its position
        id); longest: max(pos) + 1, known to the caller without a device read. -> logits (b, vocab)."""
        b = tokens.shape[0]
        rows = torch.arange(b, device=tokens.device)
        self.key_bias[rows, pos] = 0.0
        self.used = max(self.used, longest)
        return self._decode_at(tokens, pos, (rows, slice(None), pos), longest)

    def extend(self, rows: list[int], tokens: list[list[int]], fills: list[int]) -> torch.Tensor:
        """Append tokens[i] (m_i >= 1 of them) to cache row rows[i], which holds fills[i] tokens;
        -> the logits after each row's last new token (k, vocab)."""
        device = self.embed.device
        k, m = len(rows), [len(t) for t in tokens]
        width, span = max(m), max(f + n for f, n in zip(fills, m))
        self.used = max(self.used, span)
        idx = torch.tensor(rows, device=device)
        which = torch.repeat_interleave(torch.arange(k, device=device), torch.tensor(m, device=device))
        slots = torch.tensor([f + j for f, n in zip(fills, m) for j in range(n)], device=device)  # (N,)
        real = which * width + torch.tensor([j for n in m for j in range(n)], device=device)  # in (k, width)
        self.key_bias[idx[which], slots] = 0.0
        # query j of row i (slot fills[i] + j) sees the row's visible keys up to its own slot; a padding
        # query (j >= m_i) sees all the row's new keys (never none: no NaN) and is discarded
        qslot = torch.tensor(fills, device=device)[:, None] + torch.arange(width, device=device)  # (k, width)
        visible = self.key_bias[idx, :span] == 0  # (k, span)
        mask = visible[:, None, :] & (
            torch.arange(span, device=device) <= qslot[..., None]
        )  # (k, width, span)
        cs = self.rope[slots]
        cos, sin = cs[:, :1], cs[:, 1:]  # (N, 1, hd)
        x = self._embed(torch.tensor([t for row in tokens for t in row], device=device))  # (N, hidden)
        ends = torch.tensor(m, device=device).cumsum(0) - 1  # each row's last new token in x
        nq, hd = self.num_heads, self.head_dim
        for i, layer in enumerate(self._weights_for(x.shape[0])):
            q, kk, vv = self._qkv(x, layer, cos, sin)
            self.k_cache[i][idx[which], :, slots] = kk
            self.v_cache[i][idx[which], :, slots] = vv
            q_pad = x.new_zeros(k * width, nq, hd)
            q_pad[real] = q
            a = F.scaled_dot_product_attention(
                q_pad.view(k, width, nq, hd).transpose(1, 2),
                self.k_cache[i][idx, :, :span],
                self.v_cache[i][idx, :, :span],
                attn_mask=mask[:, None],
                scale=self.scaling,
                enable_gqa=self.num_kv_heads != nq,
            )  # (k, heads, width, hd)
            x = self._mlp_block(x, a.transpose(1, 2).reshape(k * width, nq * hd)[real], layer)
        return self._logits(x[ends])
