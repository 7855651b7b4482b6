"""Prefill instance: compute each prompt's KV once (max_tokens=1) and save it to the store."""

from __future__ import annotations

import sys

from common import kv_transfer_config, llm_args, prompts
from vllm import LLM, SamplingParams
from vllm.config import KVTransferConfig
from vllm.inputs import TokensPrompt


def main(model: str) -> None:
    llm = LLM(**llm_args(model), kv_transfer_config=KVTransferConfig(**kv_transfer_config("kv_producer")))
    outputs = llm.generate(
        [TokensPrompt(prompt_token_ids=p) for p in prompts()], SamplingParams(max_tokens=1, temperature=0)
    )
    for out in outputs:
        print(f"prefilled {len(out.prompt_token_ids)} tokens")


if __name__ == "__main__":
    main(sys.argv[1])
