"""CPU-only decode tuning for the built-in engine: formats and kernels that pay off only on a CPU, each
behind a self-check with the plain path as its fallback, so nothing here changes what is computed beyond
rounding that the rollout tests bound. The decoder (rollout/llama_decoder.py) uses them when they apply;
nothing in this package imports the rest of hybridflow. Measurements: docs/bench/generation.md.

mkl_packed.py  MKL's packed-GEMM weights for fp32 decode (the decode matmuls skip re-packing the weight)
"""
