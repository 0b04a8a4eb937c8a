"""Guards for torch / transformers APIs newer than the oldest releases the package supports.

The dev venv runs torch 2.13.0 and transformers 5.24.0 (constraints.txt); a GPU image may come with older
releases preinstalled. Each API that the oldest supported release lacks is called through a shim here that
takes the new API when it exists and an equivalent older one otherwise:

| shim                                 | new API (where it is missing)                              | fallback                           |
| ------------------------------------ | ---------------------------------------------------------- | ---------------------------------- |
| dist.all_gather_single               | torch.distributed.all_gather_single (torch < 2.13)         | all_gather_into_tensor (same call) |
| hf.enable_activation_checkpointing   | PreTrainedModel.activation_checkpointing_enable (< 5.23)   | gradient_checkpointing_enable      |
| dcp.hf_storage_reader                | torch.distributed.checkpoint.hf_storage (public from 2.8) | shards.py reads the slices itself  |

versions.py holds the oldest releases that work (MIN_VERSIONS) and the check `hybridflow train` runs
before Ray starts. docs/operations.md ("Supported versions") has the table and how each was established.
"""
