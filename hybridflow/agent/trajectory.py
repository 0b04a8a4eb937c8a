"""One trajectory's tokens as they are made, and the rollout Batch built from many.

Token in, token out: a trajectory is the prompt's tokens, then segments appended in order, each either
model tokens (as the engine sampled them, with their log-probs) or inserted tokens (a tool's output
through the response template). Nothing is decoded and re-encoded: each turn's generate call is given
exactly `prompt + response`, and the training forward sees exactly those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hybridflow.batch import Batch
from hybridflow.rollout.base import SamplingParams, build_rollout_batch

# per-trajectory figures, carried as (B,) tensors so that any split / concat / filter of the batch keeps
# them with their rows; trainers/metrics.py averages them into agent/* metrics
STAT_FIELDS = (
    "agent_turns",
    "agent_tool_calls",
    "agent_tool_errors",
    "agent_tool_timeouts",
    "agent_tool_time_s",
    "agent_finish_s",
)


@dataclass
class Trajectory:
    prompt: list[int]
    budget: int
    """Response tokens it may hold in all (rollout.response_length)."""
    tokens: list[int] = field(default_factory=list)
    model: list[int] = field(default_factory=list)
    """1 where the token is the model's, 0 where it was inserted."""
    log_probs: list[float] = field(default_factory=list)
    done: bool = False
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    tool_time_s: float = 0.0
    reward: float | None = None
    finished_s: float | None = None
    """Seconds into the rollout call when it finished (agent/loop.py sets it)."""

    @property
    def remaining(self) -> int:
        return self.budget - len(self.tokens)

    def context(self) -> list[int]:
        """What the next turn is conditioned on: exactly the tokens so far."""
        return self.prompt + self.tokens

    def add_model(self, tokens: list[int], log_probs: list[float]) -> None:
        self.tokens += tokens
        self.model += [1] * len(tokens)
        self.log_probs += log_probs
        self.turns += 1

    def add_inserted(self, tokens: list[int]) -> None:
        tokens = tokens[: self.remaining]
        self.tokens += tokens
        self.model += [0] * len(tokens)
        self.log_probs += [0.0] * len(tokens)
        if self.remaining <= 0:
            self.done = True


def left_padded(rows: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token lists -> (ids, attention_mask), both (B, max len), left-padded."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            ids[i, width - len(r) :] = torch.tensor(r)
            mask[i, width - len(r) :] = 1
    return ids, mask


def build_agent_batch(batch: Batch, trajs: list[Trajectory], params: SamplingParams, pad: int) -> Batch:
    """The verl-named rollout batch (rollout/base.py) of B*n trajectories (rows i*n + j of prompt i);
    `response_mask` is 1 on model tokens only, attention covers inserted tokens too."""
    lr = max(t.budget for t in trajs)
    responses = torch.full((len(trajs), lr), pad, dtype=torch.long)
    model = torch.zeros(len(trajs), lr, dtype=torch.long)
    logps = torch.zeros(len(trajs), lr, dtype=torch.float32)
    for i, t in enumerate(trajs):
        k = len(t.tokens)
        responses[i, :k] = torch.tensor(t.tokens, dtype=torch.long)
        model[i, :k] = torch.tensor(t.model, dtype=torch.long)
        logps[i, :k] = torch.tensor(t.log_probs, dtype=torch.float32)
    lengths = torch.tensor([len(t.tokens) for t in trajs], dtype=torch.long)
    out = build_rollout_batch(batch, responses, lengths, logps, params, pad, loss_mask=model)
    stats = [[t.turns, t.tool_calls, t.tool_errors, t.tool_timeouts, t.tool_time_s, t.finished_s or 0.0]
             for t in trajs]  # fmt: skip
    for name, column in zip(STAT_FIELDS, torch.tensor(stats, dtype=torch.float32).T):
        out[name] = column.clone()
    if any(t.reward is not None for t in trajs):
        # the environment's reward reaches reward.fn as extra_info["env_reward"] (docs/rollout.md)
        infos = out.non_tensors.get("extra_info", [None] * len(trajs))
        out["extra_info"] = [{**(info or {}), "env_reward": t.reward} for info, t in zip(infos, trajs)]
    return out
