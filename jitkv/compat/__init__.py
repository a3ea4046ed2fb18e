"""Drop-in shims for engines written against vLLM's, sglang's or FlashInfer's KV-cache write ops.

``jitkv.compat.vllm``, ``jitkv.compat.sglang`` and ``jitkv.compat.flashinfer`` keep the peer's function
names, argument order and results, and run jitkv's public ops (``jitkv.store_cache``,
``jitkv.set_mla_kv_buffer``, ``jitkv.rope_store_cache``, ``jitkv.rope_set_mla_kv_buffer``) underneath.
Importing them imports none of those engines and builds nothing."""

from . import flashinfer, sglang, vllm

__all__ = ["flashinfer", "sglang", "vllm"]
