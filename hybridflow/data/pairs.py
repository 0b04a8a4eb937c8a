"""Offline datasets: SFT (prompt, response) and DPO preference (prompt, chosen, rejected) pairs.

Batches use the rollout layout (`collate_prompt_response`: prompts left-padded, responses
right-padded, response_mask) so the actor computes their log-probs with the same code as for
rollouts. A DPO batch of B pairs holds 2B rows: chosen at even rows, rejected at odd rows
(meta.pairs = True), both rows of a pair sharing a uid. Responses end with EOS. A response that is a
tool-use trace (data/traces.py) is tokenized as the agent loop lays it out, its response_mask 0 on the
tools' tokens: the loss counts the model's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hybridflow.batch import Batch
from hybridflow.batch_meta import BatchMeta
from hybridflow.data.collate import collate_prompt_response
from hybridflow.data.files import where
from hybridflow.data.prompts import (
    Record,
    _pad_id,
    check_records,
    dataset_records,
    fit_length,
    logger,
    parse_row,
    render_prompt,
)
from hybridflow.data.traces import ToolOutputs, tokenize_trace, trace_segments

if TYPE_CHECKING:  # annotations only: tests/config/test_fields_read.py follows the types
    from hybridflow.config.schema import DataConfig


@dataclass
class PairSample:
    index: int
    prompt_ids: list[int]
    responses: list[list[int]]  # [response] for SFT, [chosen, rejected] for DPO
    prompt_text: str
    data_source: str
    extra_info: dict = field(default_factory=dict)
    masks: list[list[int] | None] | None = None
    """Per response, its loss mask when it is a tool-use trace (0 on tool tokens); None: all ones."""


def _response_text(value: Any, key: str) -> str:
    if isinstance(value, list) and value and isinstance(value[-1], dict):
        value = value[-1].get("content")  # a message list: the last (assistant) turn
    if not isinstance(value, str) or not value:
        raise ValueError(f"'{key}' must be non-empty text, got {value!r}")
    return value


def _response(value: Any, key: str, tool_outputs: ToolOutputs | None) -> str | list:
    """A response column -> its text, or its segments when it is a tool-use trace."""
    try:
        segments = trace_segments(value, tool_outputs)
    except ValueError as e:
        raise ValueError(f"'{key}': {e}") from None
    return segments if segments is not None else _response_text(value, key)


def _tokenized(response: str | list, tokenizer, tool_outputs) -> tuple[list[int], list[int] | None]:
    """-> (ids, loss mask or None for all ones)."""
    if isinstance(response, str):
        return tokenizer(response, add_special_tokens=False)["input_ids"], None
    return tokenize_trace(response, tokenizer, tool_outputs)


class PairDataset:
    """SFT (`keys=[response_key]`) or DPO (`keys=[chosen_key, rejected_key]`) samples."""

    def __init__(self, samples: list[PairSample], pad_token_id: int, stats: dict, kind: str, name: str = ""):
        self.samples, self.pad_token_id, self.stats, self.kind, self.name = (
            samples,
            pad_token_id,
            stats,
            kind,
            name,
        )

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> PairSample:
        return self.samples[i]

    @classmethod
    def from_records(
        cls,
        records: list[Record],
        tokenizer,
        keys: list[str],
        *,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        max_response_length: int = 512,
        truncation: str = "error",
        on_malformed: str = "error",
        apply_chat_template: bool = True,
        name: str = "",
        tools: list | None = None,
        max_length: int = 0,
        tool_outputs: ToolOutputs | None = None,
    ) -> PairDataset:
        """max_length > 0 also caps prompt + response tokens (SFT: algorithm.sft.max_length), so each
        response gets what its prompt leaves, at most max_response_length. tool_outputs: how the agent
        loop inserts tool outputs (None: multi-turn off), for responses that are tool-use traces."""
        stats = {"rows": len(records), "malformed": 0, "truncated": 0, "filtered": 0}

        def parse(row):
            out = parse_row(row, prompt_key)
            out["responses"] = [_response(row.get(k), k, tool_outputs) for k in keys]
            # the response columns are the sample's targets, not free columns riding along in extra_info
            out["extra_info"] = {
                k: v
                for k, v in out["extra_info"].items()
                if k not in keys or k in (row.get("extra_info") or {})
            }
            return out

        eos = tokenizer.eos_token_id
        samples = []
        for source, i, p in check_records(records, parse, on_malformed, stats):
            text = render_prompt(p["prompt"], tokenizer, apply_chat_template, tools)
            ids = tokenizer(text, add_special_tokens=not apply_chat_template)["input_ids"]
            prompt_ids = fit_length(ids, max_prompt_length, truncation, f"{where(source, i)}: prompt")
            tokenized = [_tokenized(r, tokenizer, tool_outputs) for r in p["responses"]]
            responses = [ids + [eos] for ids, _ in tokenized]
            budget = max_response_length
            if max_length > 0 and prompt_ids is not None:
                budget = min(budget, max(max_length - len(prompt_ids), 0))
            what = f"{where(source, i)}: response"
            cut = [fit_length(r, budget, truncation, what) for r in responses]
            if prompt_ids is None or any(r is None for r in cut):
                stats["filtered"] += 1
                continue
            stats["truncated"] += int(
                len(prompt_ids) < len(ids) or any(len(a) < len(b) for a, b in zip(cut, responses))
            )
            masks = [
                None if m is None else fit_length(m + [1], budget, truncation, what) for _, m in tokenized
            ]
            samples.append(
                PairSample(len(samples), prompt_ids, cut, text, p["data_source"], p["extra_info"], masks)
            )
        stats["kept"] = len(samples)
        logger.info("dataset %s (%s): %s", name, "sft" if len(keys) == 1 else "dpo", stats)
        return cls(samples, _pad_id(tokenizer), stats, "sft" if len(keys) == 1 else "dpo", name)

    def collate(self, samples: list[PairSample], epoch: int = 0) -> Batch:
        """SFT: B rows; DPO: 2B rows (chosen even, rejected odd). Tensors per `collate_prompt_response`."""
        per = len(samples[0].responses)
        prompts = [s.prompt_ids for s in samples for _ in range(per)]
        responses = [r for s in samples for r in s.responses]
        masks = [m if m is not None else [1] * len(r) for s in samples for r, m in zip(s.responses, s.masks)]
        return Batch(
            collate_prompt_response(prompts, responses, self.pad_token_id, masks),
            {
                "uid": [f"{epoch}-{s.index}" for s in samples for _ in range(per)],
                "data_source": [s.data_source for s in samples for _ in range(per)],
                "prompt_text": [s.prompt_text for s in samples for _ in range(per)],
            },
            BatchMeta(pairs=True if per == 2 else None),
        )


def build_pair_dataset(
    cfg: DataConfig,
    tokenizer,
    kind: str,
    split: str = "train",
    max_response_length: int = 512,
    max_length: int = 0,
    tools: list | None = None,
    tool_outputs: ToolOutputs | None = None,
):
    """SFT (kind='sft') or DPO (kind='dpo') dataset of a split per a DataConfig; None if no data.
    max_length > 0 caps prompt + response tokens (see PairDataset.from_records); tools: the JSON schemas
    the chat template lists, as in the RL prompts (agent.tool_schemas)."""
    found = dataset_records(cfg, split)
    if found is None:
        return None
    records, name = found
    keys = [cfg.response_key] if kind == "sft" else [cfg.chosen_key, cfg.rejected_key]
    return PairDataset.from_records(
        records,
        tokenizer,
        keys,
        prompt_key=cfg.prompt_key,
        max_prompt_length=cfg.max_prompt_length,
        max_response_length=max_response_length,
        truncation=cfg.truncation,
        on_malformed=cfg.on_malformed,
        apply_chat_template=cfg.apply_chat_template,
        name=name,
        max_length=max_length,
        tools=tools,
        tool_outputs=tool_outputs,
    )
