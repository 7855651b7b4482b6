"""Run vLLM engines on CPU in this process and print their outputs as JSON.

    python engine_runner.py JOB.json

JOB: {"model": dir, "engines": [{"name": str, "kv": KVTransferConfig dict or null,
       "prompts": [[token ids]...], "max_tokens": int, "llm": {extra LLM kwargs},
       "model": dir (optional: another model than the job's)}...]}
Engines run one after another (each shut down before the next), so one vLLM
import serves several engines. Prints one line `RESULT <json>` per engine:
{"name", "tokens": [[...]...], "seconds": generate wall time, "ttft": [...]}.
With "one_by_one" and "time_hooks": true, also "hook_seconds": per prompt, the
wall time spent inside the KV connector's hooks (its own cost, for benchmarks).
With "continue": {"from": name, "then": [[token ids]...]}, the prompts are an earlier
engine's prompts, each followed by what it generated and then by `then`'s tokens (a
chat's next turn). With "rounds": n, the prompts are generated n times by the one
engine ("rounds": the tokens of each; "tokens": the last round's). With "wait": true,
an engine prints `WAITING <name>` once it is up and generates only after a line on
stdin (the test does something to the world in between); with "wait_rounds": true,
the same before each round after the first (`WAITING <name>#<n>`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import sys
import time

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

# The connector hooks vLLM calls on the serving path (scheduler and worker side).
HOOKS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta", "request_finished",
    "bind_connector_metadata", "clear_connector_metadata", "start_load_kv", "wait_for_layer_load",
    "save_kv_layer", "wait_for_save", "get_finished", "get_block_ids_with_load_errors",
)  # fmt: skip
CONNECTORS = {
    "KVStoreConnector": "kvstore_connector.connector",
    "ExampleConnector": "vllm.distributed.kv_transfer.kv_connector.v1.example_connector",
}


@contextlib.contextmanager
def time_hooks(name: str | None):
    """While active, connector class `name`'s hooks add their wall time to the yielded cell."""
    spent = [0.0]
    if name is None:
        yield spent
        return
    cls = getattr(importlib.import_module(CONNECTORS[name]), name)
    originals = {hook: cls.__dict__[hook] for hook in HOOKS if hook in cls.__dict__}
    for hook in HOOKS:
        original = getattr(cls, hook, None)
        if original is None:
            continue

        def timed(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                spent[0] += time.perf_counter() - start

        setattr(cls, hook, timed)
    try:
        yield spent
    finally:
        for hook in HOOKS:
            if hook in originals:
                setattr(cls, hook, originals[hook])
            elif hook in cls.__dict__:
                delattr(cls, hook)  # inherited: drop the wrapper


def wait(name: str) -> None:
    """Tell the test `name` is reached and wait for its go (a line on stdin)."""
    print(f"WAITING {name}", flush=True)
    if not sys.stdin.readline():
        raise SystemExit(f"{name}: stdin closed while waiting to go")


def run(job: dict) -> None:
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    done: dict[str, dict] = {}  # by name: prompts and tokens of the engines run so far
    for spec in job["engines"]:
        kv = KVTransferConfig(**spec["kv"]) if spec.get("kv") else None
        llm_extra = dict(spec.get("llm", {}))
        if "kv_events_config" in llm_extra:
            from vllm.config import KVEventsConfig

            llm_extra["kv_events_config"] = KVEventsConfig(**llm_extra["kv_events_config"])
        kwargs = {
            "skip_tokenizer_init": True,
            "enforce_eager": True,
            "block_size": 32,
            "dtype": "bfloat16",
            # NOTE: an explicit KV size, not gpu_memory_utilization: on CPU that is a share
            # of the NUMA node's memory less the process's RSS, which on an 11 GiB node
            # at 0.05 leaves less than nothing for the KV cache.
            "kv_cache_memory_bytes": 256 << 20,
            "max_model_len": 4096,
            "seed": 0,
            "disable_log_stats": not spec.get("log_stats", False),
            **llm_extra,
        }
        timed = spec["kv"]["kv_connector"] if spec.get("time_hooks") else None
        with time_hooks(timed) as spent:
            llm = LLM(model=spec.get("model") or job["model"], kv_transfer_config=kv, **kwargs)
            params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
            if spec.get("wait"):
                wait(spec["name"])
            if "continue" in spec:
                earlier = done[spec["continue"]["from"]]
                spec["prompts"] = [p + t + more for p, t, more in
                                   zip(earlier["prompts"], earlier["tokens"], spec["continue"]["then"], strict=True)]  # fmt: skip
            prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
            tokens, ttft, hook_seconds, rounds = [], [], [], []
            started = time.perf_counter()
            for i in range(spec.get("rounds", 1) - 1):
                rounds.append(
                    [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
                )
                if spec.get("wait_rounds"):
                    wait(f"{spec['name']}#{i + 2}")
            if spec.get("one_by_one"):
                for prompt in prompts:
                    t0, hooks0 = time.perf_counter(), spent[0]
                    out = llm.generate([prompt], params, use_tqdm=False)
                    ttft.append(time.perf_counter() - t0)
                    hook_seconds.append(spent[0] - hooks0)
                    tokens.append(list(out[0].outputs[0].token_ids))
            else:
                outs = llm.generate(prompts, params, use_tqdm=False)
                tokens = [list(o.outputs[0].token_ids) for o in outs]
            seconds = time.perf_counter() - started
            if spec.get("log_stats"):
                llm.llm_engine.do_log_stats()  # vLLM's stat loggers, "KV Transfer metrics" included
            result = {"name": spec["name"], "tokens": tokens, "seconds": seconds, "ttft": ttft,
                      "rounds": [*rounds, tokens]}  # fmt: skip
            if timed is not None:
                result["hook_seconds"] = hook_seconds
            done[spec["name"]] = {"prompts": spec["prompts"], "tokens": tokens}
            result["prompts"] = spec["prompts"]
            print("RESULT " + json.dumps(result), flush=True)
            llm.llm_engine.engine_core.shutdown()
            del llm


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        run(json.load(f))
