"""HybridFlow: RL post-training of LLMs with a single controller over SPMD worker groups.

`from hybridflow import Run` is the Python API (hybridflow/api.py, README "Python API"); it is loaded on
first use, so `import hybridflow` (and `hybridflow --help`) imports neither torch nor Ray."""

from hybridflow._lazy import lazy_exports

__version__ = "0.1.0"
__all__ = ["Run", "__version__"]
__getattr__ = lazy_exports(__name__, {"Run": "api"})
