"""SFT on tool-use traces: the response tokenized as the agent loop lays it out (model turns, then each
tool output through rollout.multi_turn.tool_response_template), response_mask 0 on the tool's tokens, so
the NLL counts the model's tokens only. Masks checked against hand-counted ones (the char tokenizer: one
token per character)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from hybridflow.config import load_config
from hybridflow.data.pairs import PairDataset
from hybridflow.data.traces import ToolOutputs, trace_segments
from hybridflow.models.tiny import build_char_tokenizer
from hybridflow.trainers.offline import SFTTrainer
from hybridflow.workers.losses import sft_loss

TOK = build_char_tokenizer()
R = ToolOutputs("<r>{output}</r>", 256)
TRACE = "<c>1*2</c><r>2</r>2"  # model: 10 chars; tool: <r>2</r>, 8; model: 2; then EOS (the model's)
TRACE_MASK = [1] * 10 + [0] * 8 + [1] + [1]


def ids(text: str) -> list[int]:
    return TOK.encode(text, add_special_tokens=False)


def dataset(responses: list, tools=R, **kwargs) -> PairDataset:
    records = [("f.jsonl", i, {"prompt": "1*2=", "response": r}) for i, r in enumerate(responses)]
    return PairDataset.from_records(records, TOK, ["response"], apply_chat_template=False, tool_outputs=tools,
                                    **kwargs)  # fmt: skip


def test_segments_of_text_and_message_traces():
    assert trace_segments(TRACE, R) == [("<c>1*2</c>", True), ("2", False), ("2", True)]
    assert trace_segments("<r></r><r>x</r>", R) == [("", False), ("x", False)]  # empty outputs stay
    assert trace_segments("no tool here", R) is None and trace_segments(TRACE, None) is None
    assert trace_segments(TRACE, ToolOutputs("{output}", 8)) is None  # no markers: the text is the model's
    messages = [{"role": "assistant", "content": "<c>1*2</c>"}, {"role": "tool", "content": "2"}]
    assert trace_segments(messages, R) == [("<c>1*2</c>", True), ("2", False)]
    with pytest.raises(ValueError, match="set rollout.multi_turn.enable"):
        trace_segments(messages, None)
    with pytest.raises(ValueError, match="assistant or tool turns"):
        trace_segments([{"role": "user", "content": "x"}, {"role": "tool", "content": "2"}], R)


def test_the_batch_masks_tool_tokens_and_the_nll_counts_model_tokens():
    messages = [{"role": "assistant", "content": "<c>1*2</c>"}, {"role": "tool", "content": "2345"},
                {"role": "assistant", "content": "2"}]  # fmt: skip
    ds = dataset(
        [TRACE, messages, "12"], tools=ToolOutputs("<r>{output}</r>", 1)
    )  # tool outputs cut to 1 token
    batch = ds.collate(ds.samples)
    eos = TOK.eos_token_id
    assert batch["responses"][0].tolist() == ids(TRACE) + [eos]
    assert batch["responses"][1].tolist() == ids(TRACE) + [eos]  # "2345" cut to "2", as the loop inserts
    assert batch["response_mask"][0].tolist() == TRACE_MASK
    assert batch["response_mask"][1].tolist() == TRACE_MASK
    assert batch["response_mask"][2].tolist() == [1, 1, 1] + [0] * 17  # an ordinary response: all its tokens
    width = batch["prompts"].shape[1]
    assert batch["attention_mask"][0, width:].sum() == 20  # attention covers the tool's tokens
    log_probs = -torch.arange(1, 21, dtype=torch.float32).repeat(3, 1)  # token j: -(j+1)
    loss, _ = sft_loss({"log_probs": log_probs}, batch)
    model_positions = [j + 1 for j, m in enumerate(TRACE_MASK) if m] * 2 + [1, 2, 3]
    assert loss.item() == pytest.approx(sum(model_positions) / len(model_positions), rel=1e-6)


def test_truncation_cuts_the_mask_with_the_tokens():
    (left,) = dataset([TRACE], truncation="left", max_response_length=12).samples
    assert left.responses[0] == (ids(TRACE) + [TOK.eos_token_id])[-12:] and left.masks[0] == TRACE_MASK[-12:]
    (off,) = dataset([TRACE], tools=None).samples  # multi-turn off: the text is all the model's
    assert off.masks == [None]


def test_the_sft_trainer_reads_the_rollout_template(tmp_path):
    path = tmp_path / "sft.jsonl"
    path.write_text(json.dumps({"prompt": "1*2=", "response": TRACE}) + "\n")
    overrides = ["algorithm.name=sft", "model.path=unused", f"data.train_files=[{path}]",
                 "data.train_batch_size=1", "actor.ppo_mini_batch_size=1", "rollout.multi_turn.enable=true",
                 "rollout.multi_turn.tools=[python]", "rollout.multi_turn.tool_response_template=<r>{output}</r>"]  # fmt: skip
    cfg = load_config(overrides=overrides, validate=False)
    trainer = types.SimpleNamespace(
        cfg=cfg, tokenizer=TOK, tools=None, kind="sft", name="sft", max_length=lambda: 0
    )
    loader = SFTTrainer.build_train_loader(trainer)
    (sample,) = loader.dataset.samples
    assert sample.masks == [TRACE_MASK]
