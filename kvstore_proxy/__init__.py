"""kvstore-proxy: the XpYd prefill/decode proxy for vLLM, aware of the store (see main)."""
