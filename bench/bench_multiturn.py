"""A chat's second turn on another decode instance: TTFT with the first answer's blocks in
the store (save_decode), with only the prompt's, and with nothing (recompute).

    python bench/bench_multiturn.py [--prompt 1536] [--answer 256] [--message 64] [--chats 4]

Builds a random Llama (nothing downloaded), starts a kvstore daemon, and in one engine
process: two kv_both engines answer the same first turns (prompt of --prompt tokens,
--answer generated), one saving its answers' blocks (save_decode, the kv_both default)
under one namespace, the other not (save_decode false) under another. Then three fresh
engines (no prefix cache of their own from turn 1) take the second turns (the prompt,
the answer, --message new tokens), one prompt at a time: kv_consumer of each namespace,
and no connector. Prints the median TTFT of each and the ratios; the first chat of
each engine is a warm-up, left out. Figures, never pass/fail.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
from pathlib import Path

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
from harness import build_model, kv_config, run_engines
from support.daemon import Daemon


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--prompt", type=int, default=1536)
    p.add_argument("--answer", type=int, default=256)
    p.add_argument("--message", type=int, default=64)
    p.add_argument("--chats", type=int, default=4)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="kvbench-multiturn-"))
    vocab = 4096
    model = build_model(tmp / "model", layers=args.layers, hidden=args.hidden, heads=16, kv_heads=8,
                        intermediate=args.hidden * 2, vocab=vocab)  # fmt: skip
    rng = random.Random(11)
    chats = [[rng.randrange(vocab) for _ in range(args.prompt)] for _ in range(args.chats + 1)]
    messages = [[rng.randrange(vocab) for _ in range(args.message)] for _ in chats]
    total = args.prompt + args.answer + args.message
    llm = {
        "max_model_len": total + 64,
        "max_num_batched_tokens": total + 64,
        "kv_cache_memory_bytes": 1 << 30,
    }
    daemon = Daemon(tmp / "data", capacity="8GiB", memory_size="2GiB", memory_dir=Path("/dev/shm")).start()
    try:
        answer = {"name": "", "max_tokens": args.answer, "llm": llm}
        second = {"continue": {"from": "turn1-saved", "then": messages}, "max_tokens": 1, "llm": llm,
                  "one_by_one": True}  # fmt: skip
        saved, prompt_only = (
            {"namespace": "with-answer"},
            {"namespace": "prompt-only", "save_decode": False},
        )
        out = run_engines(tmp, model, [
            {**answer, "name": "turn1-saved", "kv": kv_config(daemon.address, "kv_both", **saved), "prompts": chats},
            {**answer, "name": "turn1-prompt-only", "kv": kv_config(daemon.address, "kv_both", **prompt_only),
             "prompts": chats},
            {**second, "name": "answer stored", "kv": kv_config(daemon.address, "kv_consumer", **saved)},
            {**second, "name": "prompt stored", "kv": kv_config(daemon.address, "kv_consumer", **prompt_only)},
            {**second, "name": "recompute", "kv": None},
        ], timeout=None, progress=True)  # fmt: skip
    finally:
        daemon.stop()
    if out["turn1-saved"]["tokens"] != out["turn1-prompt-only"]["tokens"]:
        print("note: the two first turns answered differently; the second turns follow turn1-saved")
    base = out["answer stored"]["prompts"]
    if any(out[n]["prompts"] != base for n in ("prompt stored", "recompute")):
        raise SystemExit("the second turns' prompts differ between engines")
    same = all(out[n]["tokens"] == out["recompute"]["tokens"] for n in ("answer stored", "prompt stored"))
    print(f"{args.layers}-layer random Llama (hidden {args.hidden}), {args.chats} chats: turn 1 {args.prompt} "
          f"prompt tokens + {args.answer} answer tokens; turn 2 adds {args.message}, on a fresh engine")  # fmt: skip
    print(f"{'turn 2, with':22} {'median TTFT':>12} {'vs recompute':>13}")
    recompute = statistics.median(out["recompute"]["ttft"][1:])
    for name in ("answer stored", "prompt stored", "recompute"):
        ttft = statistics.median(out[name]["ttft"][1:])
        print(f"{name:22} {ttft * 1000:10.0f}ms {recompute / ttft:12.2f}x")
    print(f"first tokens equal to recompute's: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
