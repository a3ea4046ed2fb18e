"""Drop-in shims for engines written against vLLM's KV-cache write ops.

``jitkv.compat.vllm`` keeps the peer's function names, argument order and results, and runs jitkv's
public ops (``jitkv.store_cache``, ``jitkv.set_mla_kv_buffer``) underneath. Importing it imports
no vLLM and builds nothing."""

from . import vllm

__all__ = ["vllm"]
