"""Datasets: prompt files (Parquet/JSONL, verl columns), registered synthetic tasks, SFT/DPO pairs,
a resumable data loader, and GSM8K/MATH preprocessing.

    ds = build_prompt_dataset(cfg.data, tokenizer, "train")
    loader = StatefulDataLoader(ds, cfg.data.train_batch_size, shuffle=cfg.data.shuffle, seed=cfg.data.seed)
    batch = loader.next_batch()   # Batch: input_ids/attention_mask/position_ids + uid, ground_truth, ...
"""

from hybridflow._lazy import lazy_exports

# loaded on first use (PEP 562), so CLI --help does not import torch
__getattr__ = lazy_exports(
    __name__,
    {
        "collate_prompt_response": "collate",
        "left_pad": "collate",
        "position_ids_from_mask": "collate",
        "right_pad": "collate",
        "DatasetError": "files",
        "read_rows": "files",
        "write_jsonl": "files",
        "write_parquet": "files",
        "StatefulDataLoader": "loader",
        "PairDataset": "pairs",
        "PairSample": "pairs",
        "build_pair_dataset": "pairs",
        "PromptDataset": "prompts",
        "PromptSample": "prompts",
        "build_prompt_dataset": "prompts",
        "get_dataset": "registry",
        "list_datasets": "registry",
        "register_dataset": "registry",
    },
)

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
