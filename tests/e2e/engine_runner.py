"""Run vLLM engines on CPU in this process and print their outputs as JSON.

    python engine_runner.py JOB.json

JOB: {"model": dir, "engines": [{"name": str, "kv": KVTransferConfig dict or null,
       "prompts": [[token ids]...], "max_tokens": int, "llm": {extra LLM kwargs}}...]}
Engines run one after another (each shut down before the next), so one vLLM
import serves several engines. Prints one line `RESULT <json>` per engine:
{"name", "tokens": [[...]...], "seconds": generate wall time, "ttft": [...]}.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run(job: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    for spec in job["engines"]:
        kv = KVTransferConfig(**spec["kv"]) if spec.get("kv") else None
        kwargs = {
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "block_size": 32,
            "dtype": "bfloat16",
            "gpu_memory_utilization": 0.05,
            "max_model_len": 4096,
            "seed": 0,
            "disable_log_stats": not spec.get("log_stats", False),
            **spec.get("llm", {}),
        }
        llm = LLM(model=job["model"], kv_transfer_config=kv, **kwargs)
        params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
        tokens, ttft = [], []
        started = time.perf_counter()
        if spec.get("one_by_one"):
            for prompt in prompts:
                t0 = time.perf_counter()
                out = llm.generate([prompt], params, use_tqdm=False)
                ttft.append(time.perf_counter() - t0)
                tokens.append(list(out[0].outputs[0].token_ids))
        else:
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens = [list(o.outputs[0].token_ids) for o in outs]
        seconds = time.perf_counter() - started
        if spec.get("log_stats"):
            llm.llm_engine.do_log_stats()  # vLLM's stat loggers, "KV Transfer metrics" included
        print("RESULT " + json.dumps({"name": spec["name"], "tokens": tokens, "seconds": seconds, "ttft": ttft}),
              flush=True)  # fmt: skip
        llm.llm_engine.engine_core.shutdown()
        del llm


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run(json.load(f))
