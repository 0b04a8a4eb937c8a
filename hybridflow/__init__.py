"""HybridFlow: RL post-training of LLMs with a single controller over SPMD worker groups.

`from hybridflow import Run` is the Python API (hybridflow/api.py, README "Python API"), loaded on first use
(PEP 562), so `import hybridflow` (and `hybridflow --help`) imports neither torch nor Ray."""

__version__ = "0.1.0"
__all__ = ["Run", "__version__"]


def __getattr__(name: str):
    if name == "Run":
        import importlib

        return importlib.import_module("hybridflow.api").Run
    raise AttributeError(f"module 'hybridflow' has no attribute {name!r}")
