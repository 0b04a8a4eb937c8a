"""Datasets: prompt files (Parquet/JSONL, verl columns), registered synthetic tasks, SFT/DPO pairs,
a resumable data loader, and GSM8K/MATH preprocessing.

    ds = build_prompt_dataset(cfg.data, tokenizer, "train")
    loader = StatefulDataLoader(ds, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    batch = loader.next_batch()   # Batch: input_ids/attention_mask/position_ids + uid, ground_truth, ...
"""

from hybridflow.data.collate import collate_prompt_response, left_pad, position_ids_from_mask, right_pad
from hybridflow.data.files import DatasetError, read_rows, write_jsonl, write_parquet
from hybridflow.data.loader import StatefulDataLoader
from hybridflow.data.pairs import PairDataset, PairSample, build_pair_dataset
from hybridflow.data.prompts import PromptDataset, PromptSample, build_prompt_dataset
from hybridflow.data.registry import get_dataset, list_datasets, register_dataset

__all__ = [
    "DatasetError",
    "PairDataset",
    "PairSample",
    "PromptDataset",
    "PromptSample",
    "StatefulDataLoader",
    "build_pair_dataset",
    "build_prompt_dataset",
    "collate_prompt_response",
    "get_dataset",
    "left_pad",
    "list_datasets",
    "position_ids_from_mask",
    "read_rows",
    "register_dataset",
    "right_pad",
    "write_jsonl",
    "write_parquet",
]
