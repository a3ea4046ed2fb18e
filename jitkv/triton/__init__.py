"""Triton fallbacks, one module per op family (CUDA only; no autotuning)."""
