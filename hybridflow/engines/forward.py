"""The forward passes RL needs, on top of a plain HF model: response log-probs (+ entropy),
per-token values, last-token scores.

Why a wrapper module (`RLForward`) rather than calling the HF model: the HF causal-LM forward
materialises logits for every position, (batch, seq, vocab). We only need the response positions,
and not even those all at once: `chunked_log_probs` runs lm_head + log_softmax over chunks of the
sequence, and under autograd recomputes each chunk in backward (activation checkpointing), so at
most (batch, chunk, vocab) logits exist at a time. The wrapper is also the FSDP root (see
parallelize.py), so the embeddings, final norm and heads it touches are unsharded by the root's
hooks even though we call the backbone and the heads separately.

Alignment (verl's): with L = Lp + Lr and responses the last Lr columns of input_ids, the token at
position t is predicted from the hidden state at t-1, so response log-probs read hidden[:, -Lr-1:-1];
critic values use the same positions (the value of the state before each response token).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from hybridflow.engines import packing, shared_prompt, varlen
from hybridflow.models import cpu_gemm
from hybridflow.models.hf import model_kind, scalar_head


def _log_probs_chunk(
    hidden, weight, bias, labels, temperature: float, with_entropy: bool | str, linear=F.linear
):
    """hidden (B, C, H), labels (B, C) -> log_probs (B, C) [, entropy (B, C)], all fp32.
    with_entropy="detached": the entropy is a metric only, computed without grad (nothing saved for backward).
    linear: F.linear, or models/cpu_gemm.linear where the lm_head's layers go through oneDNN."""
    logits = linear(hidden, weight, bias).float()  # (B, C, V)
    if temperature != 1.0:
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (B, C)
    log_probs = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if not with_entropy:
        return log_probs, None
    # Not set_grad_enabled(True): under an outer no_grad (forward-only passes) grad must stay off.
    with torch.no_grad() if with_entropy == "detached" else contextlib.nullcontext():
        entropy = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # reuses lse: one logsumexp
    return log_probs, entropy


def chunked_log_probs(
    hidden: torch.Tensor,
    lm_head: nn.Module,
    labels: torch.Tensor,
    chunk_size: int = 256,
    temperature: float = 1.0,
    with_entropy: bool | str = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of `labels` under lm_head(hidden) / temperature, computed `chunk_size` positions at a time.

    hidden: (B, T, H) hidden states predicting labels (B, T). Returns (log_probs (B, T), entropy (B, T) or None).
    with_entropy: False, True (entropy differentiable) or "detached" (entropy as a metric only: no grad, so
    it is neither kept for backward nor recomputed there).
    """
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    linear = cpu_gemm.linear if cpu_gemm.routed(lm_head) else F.linear
    lps, ents = [], []
    needs_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for s in range(0, hidden.shape[1], chunk_size):
        args = (
            hidden[:, s : s + chunk_size],
            weight,
            bias,
            labels[:, s : s + chunk_size],
            temperature,
            with_entropy,
            linear,
        )
        if needs_grad:  # drop the chunk's logits after forward; recompute them in backward
            lp, ent = checkpoint(_log_probs_chunk, *args, use_reentrant=False)
        else:
            lp, ent = _log_probs_chunk(*args)
        lps.append(lp)
        ents.append(ent)
    log_probs = torch.cat(lps, dim=1)
    return log_probs, (torch.cat(ents, dim=1) if with_entropy else None)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """(B, L) mask -> (B,) index of the last attended position (works for left and right padding)."""
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    return (attention_mask.long() * positions).argmax(-1)


class RLForward(nn.Module):
    """Wraps a plain HF model (causal LM, token- or sequence-classification) and returns what RL needs.

    forward(input_ids (B, L), attention_mask (B, L), position_ids (B, L), response_length Lr) -> dict:
      causal_lm: "log_probs" (B, Lr) [+ "entropy" (B, Lr)]
      critic:    "values" (B, Lr)
      reward:    "scores" (B,) read at the last attended token
    """

    def __init__(self, model: nn.Module, logits_chunk_size: int = 256, share_prompt: bool = False):
        super().__init__()
        self.model = model
        self.kind = model_kind(model)
        self.logits_chunk_size = logits_chunk_size
        # packed micro-batches: rows with the same prompt compute it once (engines/shared_prompt.py)
        self.share_prompt = share_prompt
        self.shared_prompt_tokens = 0  # prompt tokens not computed since the engine last took the count

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        response_length: int,
        temperature: float = 1.0,
        with_entropy: bool | str = False,
        pack_rows: int | None = None,
    ) -> dict[str, torch.Tensor]:
        """pack_rows: None = the padded forward; an int = padding removed (engines/packing.py), rows of
        max(pack_rows, longest sequence) tokens. Outputs have the padded layout either way."""
        # packed: each row one run of tokens, some response token to score, and enough tokens saved to gain
        # (packing.MIN_PADDING_TO_PACK: padding, plus the prompts computed once with share_prompt); else padded
        if (
            pack_rows is not None
            and attention_mask[:, -response_length:].any()
            and packing.contiguous(attention_mask)
        ):
            mask = attention_mask.cpu()
            # one row of every sequence, attention per sequence (engines/varlen.py), where the model takes it
            one_row = varlen.fits(self.model, int(mask.sum(-1).max()))
            shared = None  # stays None where no two rows share a prompt
            if one_row and self.share_prompt:
                shared = shared_prompt.plan(mask, input_ids, position_ids, response_length)
            if packing.worth_packing(mask, shared.saved if shared is not None else 0):
                return self._packed(input_ids, attention_mask, position_ids, response_length, temperature,
                                    with_entropy, pack_rows, one_row, shared)  # fmt: skip
        out = self.model.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
        )
        hidden = out.last_hidden_state  # (B, L, H)
        if self.kind == "reward":
            last = last_token_index(attention_mask)
            h_last = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]  # (B, H)
            return {"scores": scalar_head(self.model)(h_last).squeeze(-1).float()}
        h_resp = hidden[:, -response_length - 1 : -1]  # (B, Lr, H): states before each response token
        return self._heads(h_resp, input_ids[:, -response_length:], temperature, with_entropy)

    def _heads(self, h_resp, labels, temperature, with_entropy, chunk=None) -> dict[str, torch.Tensor]:
        """Values or log-probs (+ entropy) from the hidden states before each response token; `chunk`
        positions of lm_head at a time (default logits_chunk_size)."""
        if self.kind == "critic":
            return {"values": scalar_head(self.model)(h_resp).squeeze(-1).float()}
        log_probs, entropy = chunked_log_probs(
            h_resp,
            self.model.get_output_embeddings(),
            labels,
            chunk or self.logits_chunk_size,
            temperature,
            with_entropy,
        )
        outputs = {"log_probs": log_probs}
        if entropy is not None:
            outputs["entropy"] = entropy
        return outputs

    def _packed(self, input_ids, attention_mask, position_ids, response_length, temperature, with_entropy,
                pack_rows, one_row, shared) -> dict[str, torch.Tensor]:  # fmt: skip
        """The forward on packed rows (one row, or rows of pack_rows; a shared-prompt plan if given); the
        heads run on the real response tokens only (N of them)."""
        mask = attention_mask.cpu()
        lengths = mask.sum(-1)
        if shared is not None:
            plan = shared.to(input_ids.device)
            ids, pos = plan.pack(input_ids, position_ids)
            self.shared_prompt_tokens += plan.saved
            with varlen.no_mask():
                out = self.model.base_model(input_ids=ids, position_ids=pos, use_cache=False,
                                            shared_layout=plan.layout)  # fmt: skip
        elif one_row:
            plan = packing.plan(mask, int(lengths.sum())).to(input_ids.device)
            ids, pos = packing.pack(plan, input_ids, position_ids)
            with varlen.no_mask():
                out = self.model.base_model(input_ids=ids, position_ids=pos, use_cache=False,
                                            seq_lens=plan.row_lengths())  # fmt: skip
        else:  # attention_mask=None: transformers builds the per-sequence causal mask from the position resets
            plan = packing.plan(mask, pack_rows).to(input_ids.device)
            ids, pos = packing.pack(plan, input_ids, position_ids)
            out = self.model.base_model(input_ids=ids, position_ids=pos, use_cache=False)
        hidden = out.last_hidden_state
        if self.kind == "reward":
            h_last = hidden[plan.seq_row, plan.seq_end.clamp(min=0)]
            return {"scores": scalar_head(self.model)(h_last).squeeze(-1).float()}
        (b, j), (row, col), prev = plan.response_index(attention_mask, response_length)
        # one row of N tokens: chunks of B x logits_chunk_size tokens hold as many logits as the padded ones
        chunk = self.logits_chunk_size * attention_mask.shape[0]
        # index_select on the flat rows: its backward is an index_add_, not advanced indexing's
        # accumulating index_put_ (several ms a call on CPU; engines/varlen_gather.py)
        flat = hidden.reshape(-1, hidden.shape[-1])
        h_prev = torch.index_select(flat, 0, prev[0] * hidden.shape[1] + prev[1])
        heads = self._heads(h_prev.unsqueeze(0), ids[row, col].unsqueeze(0), temperature, with_entropy, chunk)
        shape = (attention_mask.shape[0], response_length)
        return {k: v.new_zeros(shape).index_put((b, j), v[0]) for k, v in heads.items()}
