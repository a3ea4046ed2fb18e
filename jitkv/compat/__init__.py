"""Drop-in shims for engines written against vLLM's or sglang's KV-cache write ops.

``jitkv.compat.vllm`` and ``jitkv.compat.sglang`` keep the peer's function names, argument order
and results, and run jitkv's public ops (``jitkv.store_cache``, ``jitkv.set_mla_kv_buffer``)
underneath. Importing them imports neither vLLM nor sglang and builds nothing."""

from . import sglang, vllm

__all__ = ["sglang", "vllm"]
