"""HybridFlow: RL post-training of LLMs with a single controller over SPMD worker groups."""

__version__ = "0.1.0"
