"""Decode instance: load the prompts' KV from the store and generate, skipping the prefill."""

from __future__ import annotations

import sys
import time

from common import kv_transfer_config, llm_args, prompts
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt


def main(model: str) -> None:
    llm = LLM(**llm_args(model), kv_transfer_config=KVTransferConfig(**kv_transfer_config("kv_consumer")))
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    for prompt in prompts():
        start = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)[0]
        seconds, tokens = time.perf_counter() - start, list(out.outputs[0].token_ids)
        print(f"{len(prompt)}-token prompt: {seconds:.3f}s, tokens {tokens}")


if __name__ == "__main__":
    main(sys.argv[1])
