"""KV compression (fp8, int8) through the connector: accuracy, bytes stored, save/load speed.

    python bench/bench_compression.py [--models small,large] [--prompts 32] [--tokens 400]
        [--dtype bfloat16] [--compressions none,fp8,int8] [--scores logits|logprobs]
        [--micro-mib 256] [--device cpu]
    python bench/bench_compression.py --micro-only [--device cuda]

For each random-weight Llama (nothing downloaded; presets in MODELS) one engine process
runs, one engine after the other:
  baseline   no connector: greedy tokens (--max-tokens, 32) and the first decode step's
             logits over the whole vocabulary (logprobs=-1, max_logprobs=-1, logprobs_mode
             raw_logits; --scores logprobs: its logprobs instead);
  per compression (the connector's kv_connector_extra_config "compression"; "none", the
  reference, always runs first): the store is emptied, a kv_producer engine prefills the
  prompts (saves their KV), the daemon's Stats give the bytes stored, the stored blocks
  are read back (KVStoreClient.select), then a kv_consumer engine loads the KV and
  generates like the baseline.
It prints, per compression: generated tokens equal to the baseline's (position-wise,
averaged over prompts), max and mean |logit - baseline's| of the first decode step over
the whole vocabulary, the daemon's bytes_used, blocks loaded, and the connector's
save and load time and GB/s of uncompressed KV: its own seconds (its stats' save_seconds
and load_seconds) and the wall time inside its hooks (as bench_connector.py measures it).
Then the error of the dequantized KV itself: the raw ("none") blocks through this
module's codecs (kvstore_connector.compression; each block of each KV head its own row),
and the connector's compressed blocks as stored, decoded and compared with the raw ones.
Last, a micro benchmark of the codecs alone: encode and decode GB/s (of uncompressed
bytes) of a [n, block_size, 2 * head_size] bf16 tensor of --micro-mib MiB on the CPU, and
with --device cuda on CUDA too (torch.cuda.synchronize around the timed loop).

Figures, never pass/fail. A small run (a couple of minutes on 2 cores):
    python bench/bench_compression.py --models small --prompts 4 --tokens 200 --micro-mib 32
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _paths  # noqa: F401  (sys.path: bench/_paths.py)
from kvstore_connector.compression import CODECS, Codec, make_codec

if TYPE_CHECKING:
    import torch

    from kvstore_client import KVStoreClient

# random-weight Llamas: a small one and a larger one (more layers, wider, head 128 as Llama's)
MODELS: dict[str, dict[str, int]] = {
    "small": {"layers": 2, "hidden": 256, "heads": 4, "kv_heads": 2, "intermediate": 512},
    "large": {"layers": 6, "hidden": 1024, "heads": 8, "kv_heads": 4, "intermediate": 2048},
}
VOCAB = 4096
BLOCK = 32  # the engines' block size (engine_runner's)
RESULT = "RESULT "


# ---------------------------------------------------------------- the engine process
@contextlib.contextmanager
def connector_counters() -> Iterator[Counter[str]]:
    """While active, every stat the connector's worker side records (blocks, bytes and
    seconds of its loads and saves) is also summed into the yielded Counter. vLLM takes
    the connector's own stats every step, and only logs them."""
    from kvstore_connector.worker import WorkerSide

    totals: Counter[str] = Counter()
    original = WorkerSide._add_stats

    def add(self: WorkerSide, **values: float) -> None:
        totals.update(values)
        original(self, **values)

    WorkerSide._add_stats = add  # type: ignore[method-assign]
    try:
        yield totals
    finally:
        WorkerSide._add_stats = original  # type: ignore[method-assign]


def kv_transfer(address: str, role: str, compression: str) -> dict[str, Any]:
    from harness import kv_config

    # "none" without the key: the connector of today (no "compression" yet) runs it too
    return kv_config(address, role, **({} if compression == "none" else {"compression": compression}))


Blocks = list[dict[str, "torch.Tensor"]]
"""Per prompt, its stored blocks: {store layer: [n, *shape]}, in stream order."""


def read_stored(kv: KVStoreClient, prompts: list[list[int]]) -> dict[bytes, Blocks]:
    """Every connector namespace in the store and its blocks of each prompt, looked up by
    the prompt's block hashes (the connector's chain root is in its namespace)."""
    from kvstore_client.hashing import block_hashes, connector_block_size, connector_hash_root

    out: dict[bytes, Blocks] = {}
    for ns in sorted({b.namespace for b in kv.iter_blocks()}):
        root, block_size = connector_hash_root(ns), connector_block_size(ns)
        if root is None or block_size is None:
            print(f"  namespace {ns!r} is not the connector's: not read", file=sys.stderr)
            continue
        out[ns] = [kv.select(ns, block_hashes(root, p, block_size)) for p in prompts]
    return out


class ErrorSum:
    """max and mean |a - b| (and of |b|) over everything added."""

    def __init__(self) -> None:
        self.max_err = self.max_abs = self.sum_err = self.sum_abs = 0.0
        self.count = 0

    def add(self, approx: torch.Tensor, exact: torch.Tensor) -> None:
        a, b = approx.double().reshape(-1), exact.double().reshape(-1)
        if a.numel() == 0:
            return
        err = (a - b).abs()
        self.max_err = max(self.max_err, err.max().item())
        self.max_abs = max(self.max_abs, b.abs().max().item())
        self.sum_err += err.sum().item()
        self.sum_abs += b.abs().sum().item()
        self.count += a.numel()

    def doc(self) -> dict[str, float] | None:
        if not self.count:
            return None
        return {"max_err": self.max_err, "mean_err": self.sum_err / self.count, "max_abs": self.max_abs,
                "mean_abs": self.sum_abs / self.count, "elements": self.count}  # fmt: skip


def codec_on_raw(raw: Blocks, name: str, kv_heads: int) -> dict[str, float] | None:
    """The codec's round trip over the raw blocks, one row per block of one KV head, as
    the connector's store layers are (`<layer>#h<j>`); a store layer of all heads (an
    older connector: [n, heads, ...]) is split by head."""
    codec = make_codec(name)
    if codec is None:
        return None
    errors = ErrorSum()
    for layers in raw:
        for layer, t in layers.items():
            per_head = "#h" in layer or t.dim() < 3 or t.shape[1] != kv_heads
            rows = t if per_head else t.reshape(-1, *t.shape[2:])
            errors.add(codec.decode(codec.encode(rows), rows.dtype, rows.shape[1:]), rows)
    return errors.doc()


def stored_vs_raw(raw: Blocks, stored: Blocks, name: str) -> dict[str, Any]:
    """The connector's stored blocks of compression `name`, decoded, against the raw ones.

    Matched per prompt and block, and per store layer where both have the same layer
    names; else each block's layers are flattened in stream order and compared element
    by element (a store that splits a layer by head, heads leading, lines up)."""
    import torch

    codec = make_codec(name)
    if codec is None:
        return {"note": "no codec"}
    if not any(stored):
        return {"note": "no blocks stored"}
    if all(t.dtype != torch.uint8 for layers in stored for t in layers.values()):
        return {"note": "stored uncompressed (compression ignored?)"}
    errors = ErrorSum()
    matched = "by layer name"
    for raw_layers, comp_layers in zip(raw, stored, strict=True):
        if not raw_layers or not comp_layers:
            continue
        first_raw, first_comp = next(iter(raw_layers.values())), next(iter(comp_layers.values()))
        n = min(first_raw.shape[0], first_comp.shape[0])
        if raw_layers.keys() == comp_layers.keys():
            for layer, exact in raw_layers.items():
                packed = comp_layers[layer][:n].reshape(n, -1)
                errors.add(codec.decode(packed, exact.dtype, exact.shape[1:]), exact[:n])
            continue
        matched = "in stream order"
        exact = torch.cat([t[:n].reshape(n, -1) for t in raw_layers.values()], dim=1)
        approx = torch.cat([codec.decode(t[:n].reshape(n, -1), first_raw.dtype, (t[0].numel() - 4,))
                            for t in comp_layers.values()], dim=1)  # fmt: skip
        if approx.shape != exact.shape:
            return {"note": f"layouts differ: raw {list(exact.shape)} vs decoded {list(approx.shape)}"}
        errors.add(approx, exact)
    doc = errors.doc()
    return {**doc, "matched": matched} if doc else {"note": "no blocks to compare"}


def dense_first_scores(outputs: list[Any], vocab: int) -> torch.Tensor:
    """[prompts, vocab] float64: the first decode step's score (its logit, or with --scores
    logprobs its logprob: what vLLM's logprobs_mode returns) of every vocabulary entry."""
    import torch

    out = torch.full((len(outputs), vocab), float("nan"), dtype=torch.float64)
    for i, o in enumerate(outputs):
        first = o.outputs[0].logprobs[0]  # {token id: Logprob}, the whole vocabulary
        ids = torch.tensor(list(first.keys()), dtype=torch.long)
        out[i, ids] = torch.tensor([lp.logprob for lp in first.values()], dtype=torch.float64)
    return out


def compare(base_tokens: list[list[int]], base_lp: torch.Tensor, tokens: list[list[int]],
            lp: torch.Tensor) -> dict[str, float]:  # fmt: skip
    same = [
        sum(a == b for a, b in zip(x, y, strict=True)) / len(x)
        for x, y in zip(base_tokens, tokens, strict=True)
    ]
    err = (lp - base_lp).abs()
    finite = err[err.isfinite()]
    return {"token_match": statistics.mean(same), "lp_max_err": finite.max().item() if finite.numel() else math.nan,
            "lp_mean_err": finite.mean().item() if finite.numel() else math.nan,
            "first_token_match": statistics.mean(x[0] == y[0] for x, y in zip(base_tokens, tokens, strict=True))}  # fmt: skip


def run_job(job: dict[str, Any]) -> None:
    """The engine process: every engine of one model, one after the other; prints RESULT."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine core here: hooks timed, stats seen
    import gc

    from engine_runner import time_hooks
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvstore_client import KVStoreClient

    prompts = [TokensPrompt(prompt_token_ids=p) for p in job["prompts"]]
    decode = SamplingParams(max_tokens=job["max_tokens"], temperature=0.0, ignore_eos=True, logprobs=-1,
                            flat_logprobs=True, detokenize=False)  # fmt: skip
    fill = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    kwargs = {"skip_tokenizer_init": True, "enforce_eager": True, "block_size": BLOCK, "dtype": job["dtype"],
              "kv_cache_memory_bytes": job["kv_cache_bytes"], "max_model_len": job["max_model_len"],
              "max_logprobs": -1, "seed": 0, "disable_log_stats": True,
              "logprobs_mode": "raw_logits" if job["scores"] == "logits" else "raw_logprobs"}  # fmt: skip

    def engine(name: str, kv: dict[str, Any] | None, params: SamplingParams) -> dict[str, Any]:
        with time_hooks("KVStoreConnector" if kv else None) as spent, connector_counters() as counters:
            llm = LLM(model=job["model"], kv_transfer_config=KVTransferConfig(**kv) if kv else None, **kwargs)
            hooks0 = spent[0]
            started = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - started
            hook_seconds = spent[0] - hooks0
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()
        print(f"PROGRESS {job['label']}: {name} ({seconds:.1f}s)", flush=True)
        return {"outputs": outputs, "seconds": seconds, "hook_seconds": hook_seconds, "stats": dict(counters)}

    result: dict[str, Any] = {"label": job["label"], "compressions": {}}
    base = engine("baseline", None, decode)
    base_tokens = [list(o.outputs[0].token_ids) for o in base["outputs"]]
    base_lp = dense_first_scores(base["outputs"], job["vocab"])
    finite = base_lp[base_lp.isfinite()]
    result["baseline"] = {"seconds": base["seconds"], "score_mean": finite.mean().item(),
                          "score_abs_mean": finite.abs().mean().item(),
                          "score_range": [finite.min().item(), finite.max().item()]}  # fmt: skip
    raw: Blocks = []
    with KVStoreClient(job["address"]) as kv:
        for name in job["compressions"]:
            doc: dict[str, Any] = {}
            result["compressions"][name] = doc
            kv.evict(all=True)  # each compression's bytes alone; its consumer can load nothing else
            if name != "none" and raw:  # the codec alone, whatever the connector does
                doc["kv_codec"] = codec_on_raw(raw, name, job["kv_heads"])
            try:
                producer = engine(f"{name} producer", kv_transfer(job["address"], "kv_producer", name), fill)
                stats = kv.stats()
                doc["store"] = {k: stats[k] for k in ("blocks", "bytes_used", "namespaces")}
                stored = read_stored(kv, job["prompts"])
                doc["namespaces"] = [ns.decode(errors="replace") for ns in stored]
                consumer = engine(
                    f"{name} consumer", kv_transfer(job["address"], "kv_consumer", name), decode
                )
            # NOTE: any failure of one compression's engines (today: a connector without the
            # "compression" key refuses it) is printed in its row; the others still run
            except Exception as exc:
                doc["error"] = f"{type(exc).__name__}: {exc}"
                print(f"PROGRESS {job['label']}: {name} failed: {doc['error']}", flush=True)
                continue
            if name == "none":
                # NOTE: the reference has exactly one namespace (one rank): more would be a
                # store shared with something else, and the raw blocks ambiguous.
                if len(stored) == 1:
                    raw = next(iter(stored.values()))
                    doc["raw_layers"] = (
                        [[k, str(t.dtype), list(t.shape[1:])] for k, t in raw[0].items()] if raw else []
                    )
            elif raw:
                doc["kv_stored"] = stored_vs_raw(raw, next(iter(stored.values()), []), name) if len(stored) == 1 \
                    else {"note": f"{len(stored)} namespaces stored"}  # fmt: skip
            tokens = [list(o.outputs[0].token_ids) for o in consumer["outputs"]]
            doc["accuracy"] = compare(
                base_tokens, base_lp, tokens, dense_first_scores(consumer["outputs"], job["vocab"])
            )
            doc["save"] = {
                "seconds": producer["seconds"],
                "hook_seconds": producer["hook_seconds"],
                **producer["stats"],
            }
            doc["load"] = {
                "seconds": consumer["seconds"],
                "hook_seconds": consumer["hook_seconds"],
                **consumer["stats"],
            }
    print(RESULT + json.dumps(result), flush=True)


def run_engine_process(tmp: Path, job: dict[str, Any], timeout: float | None) -> dict[str, Any]:
    """Run run_job in a fresh Python process (vLLM's state never reaches this one)."""
    path = tmp / f"job-{job['label']}.json"
    path.write_text(json.dumps(job))
    result: dict[str, Any] | None = None
    with tempfile.TemporaryFile("w+") as errors:
        with subprocess.Popen([sys.executable, __file__, "--engine-job", str(path)], stdout=subprocess.PIPE,
                              stderr=errors, text=True) as proc:  # fmt: skip
            deadline = None if timeout is None else time.monotonic() + timeout
            if proc.stdout is None:
                raise RuntimeError("engine process without a stdout pipe")
            for line in proc.stdout:  # vLLM logs to stdout too: only our lines count
                if line.startswith("PROGRESS "):
                    print("  " + line[len("PROGRESS ") :].rstrip(), file=sys.stderr, flush=True)
                elif line.startswith(RESULT):
                    result = json.loads(line[len(RESULT) :])
                if deadline is not None and time.monotonic() > deadline:
                    proc.kill()
                    break
            proc.wait()
        errors.seek(0)
        stderr = errors.read()
    if proc.returncode != 0 or result is None:
        raise RuntimeError(f"engine process failed (rc={proc.returncode}):\n{stderr[-6000:]}")
    return result


# ---------------------------------------------------------------- the micro benchmark
def _timed(fn: Callable[[], object], reps: int, cuda: bool) -> float:
    """Median seconds of fn() over `reps` runs after one warm-up."""
    import torch

    fn()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def cuda_checks(codec: Codec, sample: torch.Tensor, shape: tuple[int, ...]) -> str:
    """Whether encode and decode on CUDA run without a host synchronisation (torch's sync
    debug mode raises on one), and give the CPU's bytes and values, on a sample."""
    import torch

    torch.cuda.set_sync_debug_mode("error")
    try:
        packed = codec.encode(sample)
        codec.decode(packed, torch.bfloat16, shape)
        sync = "no host sync"
    except RuntimeError as exc:
        sync = f"HOST SYNC: {exc}"
        packed = codec.encode(sample)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    cpu_packed = codec.encode(sample.cpu())
    same_bytes = (packed.cpu() == cpu_packed).float().mean().item()
    # decoding is a product: the same bytes give the same values on both
    same_values = torch.equal(codec.decode(cpu_packed.cuda(), torch.bfloat16, shape).cpu(),
                              codec.decode(cpu_packed, torch.bfloat16, shape))  # fmt: skip
    return (f"{sync}; bytes equal to the CPU's: {same_bytes:.6f} of {len(sample)} blocks; "
            f"the CPU's bytes decoded alike: {same_values}")  # fmt: skip


def micro(device: str, mib: float, head_size: int, reps: int) -> None:
    import torch

    cuda = device == "cuda"
    shape = (BLOCK, 2 * head_size)
    n = max(1, int(mib * 2**20) // (math.prod(shape) * 2))
    x = torch.randn((n, *shape), dtype=torch.float32, device=device).to(torch.bfloat16)
    raw = x.numel() * x.element_size()
    threads = (
        f", {torch.get_num_threads()} torch threads" if not cuda else f", {torch.cuda.get_device_name()}"
    )
    print(f"\nmicro benchmark on {device}{threads}: [{n}, {shape[0]}, {shape[1]}] bf16 = {raw / 2**20:.0f} MiB; "
          f"GB/s of uncompressed bytes, median of {reps}")  # fmt: skip
    rows = ["encode_into", "encode", "decode"]
    if cuda:
        rows.insert(2, "encode_into pinned host")
    print(f"{'':<10}" + "".join(f"{r:>26}" for r in rows))
    for name in CODECS[1:]:
        codec = make_codec(name)
        if codec is None:
            continue
        out = torch.empty((n, *codec.stored_shape(shape)), dtype=torch.uint8, device=device)
        packed = codec.encode(x)
        fns: dict[str, Callable[[], object]] = {
            "encode_into": functools.partial(codec.encode_into, x, out),
            "encode": functools.partial(codec.encode, x),
            "decode": functools.partial(codec.decode, packed, torch.bfloat16, shape),
        }
        if cuda:
            host = torch.empty_like(out, device="cpu").pin_memory()
            fns["encode_into pinned host"] = functools.partial(codec.encode_into, x, host)
        figures = {r: raw / _timed(fns[r], reps, cuda) / 1e9 for r in rows}
        print(f"{name:<10}" + "".join(f"{figures[r]:>26.2f}" for r in rows))
        if cuda:
            print(f"{'':<10}{cuda_checks(codec, x[: min(n, 256)], shape)}")
        del out, packed


# ---------------------------------------------------------------- the report
def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def report(label: str, spec: dict[str, int], args: argparse.Namespace, result: dict[str, Any]) -> None:
    head = spec["hidden"] // spec["heads"]
    itemsize = 4 if args.dtype == "float32" else 2
    block_bytes = spec["layers"] * 2 * spec["kv_heads"] * head * BLOCK * itemsize  # uncompressed, all layers
    blocks = args.prompts * (args.tokens // BLOCK)
    print(f"\nmodel {label}: {spec['layers']} layers, hidden {spec['hidden']}, {spec['heads']} heads "
          f"({spec['kv_heads']} KV, head {head}), {args.dtype}, block {BLOCK}; {args.prompts} prompts x "
          f"{args.tokens} tokens: {blocks} full blocks = {blocks * block_bytes / 2**20:.1f} MiB of KV; "
          f"baseline (no connector) {result['baseline']['seconds']:.1f}s for {args.max_tokens} tokens")  # fmt: skip
    low, high = result["baseline"]["score_range"]
    print(f"  the baseline's first-step {args.scores}: mean {result['baseline']['score_mean']:.3g}, "
          f"mean |x| {result['baseline']['score_abs_mean']:.3g}, from {low:.3g} to {high:.3g}")  # fmt: skip
    comps = result["compressions"]
    none_bytes = comps.get("none", {}).get("store", {}).get("bytes_used")
    print(f"{'':<6}{'tokens':>8}{'1st tok':>8}{args.scores[:-1] + ' err':>18}{'stored':>16}{'blocks':>14}"
          f"{'save, connector':>18}{'save, hooks':>16}{'load, connector':>18}{'load, hooks':>16}")  # fmt: skip
    print(f"{'':<6}{'=base':>8}{'=base':>8}{'max':>9}{'mean':>9}{'MiB':>9}{'/none':>7}{'saved':>7}{'loaded':>7}"
          + f"{'s':>8}{'GB/s':>10}{'s':>7}{'GB/s':>9}" * 2)  # fmt: skip
    for name, doc in comps.items():
        if "error" in doc:
            print(f"{name:<6}failed: {doc['error'][:300]}")
            continue
        acc, save, load, store = doc["accuracy"], doc["save"], doc["load"], doc["store"]

        def speed(blocks: float, seconds: float) -> str:
            return _fmt(blocks * block_bytes / seconds / 1e9 if seconds else None, ".3g")

        ratio = store["bytes_used"] / none_bytes if none_bytes else None
        saved, loaded = save.get("blocks_saved", 0), load.get("blocks_loaded", 0)
        print(f"{name:<6}{acc['token_match']:>8.3f}{acc['first_token_match']:>8.3f}{_fmt(acc['lp_max_err'], '.2e'):>9}"
              f"{_fmt(acc['lp_mean_err'], '.2e'):>9}{store['bytes_used'] / 2**20:>9.2f}{_fmt(ratio, '.3f'):>7}"
              f"{saved:>7}{loaded:>7}"
              f"{save.get('save_seconds', 0):>8.3f}{speed(saved, save.get('save_seconds', 0)):>10}"
              f"{save['hook_seconds']:>7.2f}{speed(saved, save['hook_seconds']):>9}"
              f"{load.get('load_seconds', 0):>8.3f}{speed(loaded, load.get('load_seconds', 0)):>10}"
              f"{load['hook_seconds']:>7.2f}{speed(loaded, load['hook_seconds']):>9}")  # fmt: skip
    print("  connector: its stats' save_seconds / load_seconds, summed over requests (a save counts from its "
          "first layer to its commit, forward pass and other requests' commits included); hooks: wall time "
          "inside the connector's hooks (the transfer's cost to the engine). GB/s: uncompressed KV bytes "
          f"({block_bytes / 2**10:.0f} KiB a block) / those seconds.")  # fmt: skip
    raw_layers = comps.get("none", {}).get("raw_layers")
    if raw_layers:
        first = raw_layers[0]
        print(f"raw store layers: {len(raw_layers)} ({first[0]}, ...), {first[1]} {first[2]} per block each")
    lines = [(name, kind, doc.get(key)) for name, doc in comps.items() if name != "none"
             for kind, key in (("codec on raw blocks", "kv_codec"), ("stored by connector", "kv_stored"))]  # fmt: skip
    if lines:
        print(f"dequantized KV vs raw{'':<21}{'max |err|':>11}{'mean |err|':>12}{'max |x|':>10}{'mean |x|':>10}"
              f"{'mean err/mean |x|':>19}")  # fmt: skip
        for name, kind, e in lines:
            if e is None or "note" in e:
                why = "its engines failed" if "error" in comps[name] else "no raw blocks"
                print(f"  {name:<6}{kind:<34}{(e or {}).get('note', f'not measured ({why})')}")
                continue
            print(f"  {name:<6}{kind:<34}{e['max_err']:>11.3e}{e['mean_err']:>12.3e}{e['max_abs']:>10.3f}"
                  f"{e['mean_abs']:>10.3f}{e['mean_err'] / e['mean_abs']:>19.2e}")  # fmt: skip
    for name, doc in comps.items():
        if name != "none" and "store" in doc and none_bytes and doc["store"]["bytes_used"] == none_bytes:
            print(f"note: {name} stored as many bytes as none: the connector did not compress")
        saved = doc.get("save", {}).get("blocks_saved", 0)
        if "save" in doc and saved < blocks:  # the figures then cover fewer blocks: say why
            errors = doc["save"].get("save_errors", 0)
            print(f"note: {name}: the producer saved {saved} of {blocks} blocks ({errors} save errors: a "
                  "store that answers a save's Reserve slower than lookup_timeout_s, e.g. on a machine "
                  "busy with something else, is skipped for retry_interval_s)")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--models", default="small,large", help=f"comma-separated, of {', '.join(MODELS)}")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=400, help="prompt length (full blocks are stored)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="the engines' dtype")
    p.add_argument("--compressions", default=",".join(CODECS), help="comma-separated; none always runs first")
    p.add_argument("--scores", choices=["logits", "logprobs"], default="logits",
                   help="what is compared over the vocabulary at the first decode step (vLLM's logprobs_mode raw_*)")  # fmt: skip
    p.add_argument("--micro-only", action="store_true", help="only the codec micro benchmark")
    p.add_argument("--micro-mib", type=float, default=256, help="the micro benchmark's tensor (0: skip it)")
    p.add_argument("--micro-reps", type=int, default=5)
    p.add_argument("--micro-head-size", type=int, default=128)
    p.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: the micro benchmark on CUDA too"
    )
    p.add_argument("--timeout", type=float, default=3600, help="seconds per model's engine process")
    p.add_argument("--engine-job", type=Path, help=argparse.SUPPRESS)  # the engine process (run_job)
    args = p.parse_args()
    if args.engine_job is not None:
        run_job(json.loads(args.engine_job.read_text()))
        return
    compressions = [c.strip() for c in args.compressions.split(",") if c.strip()]
    for c in compressions:
        make_codec(c)  # a ValueError naming the allowed values
    compressions = ["none", *[c for c in compressions if c != "none"]]
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown:
        p.error(f"unknown models {unknown}; known: {', '.join(MODELS)}")
    if not args.micro_only:
        bench_engines(args, models, compressions)
    if args.micro_mib > 0:
        micro("cpu", args.micro_mib, args.micro_head_size, args.micro_reps)
        if args.device == "cuda":
            micro("cuda", args.micro_mib, args.micro_head_size, args.micro_reps)


def bench_engines(args: argparse.Namespace, models: list[str], compressions: list[str]) -> None:
    import random

    from harness import build_model
    from support.daemon import Daemon

    tmp = Path(tempfile.mkdtemp(prefix="kvbench-compression-"))
    rng = random.Random(7)
    prompts = [[rng.randrange(VOCAB) for _ in range(args.tokens)] for _ in range(args.prompts)]
    results: dict[str, dict[str, Any]] = {}
    daemon = Daemon(tmp / "data", capacity="8GiB", memory_size="1GiB", memory_dir=Path("/dev/shm")).start()
    try:
        for label in models:
            spec = MODELS[label]
            model = build_model(tmp / f"model-{label}", vocab=VOCAB, **spec)
            head = spec["hidden"] // spec["heads"]
            per_token = spec["layers"] * 2 * spec["kv_heads"] * head * (4 if args.dtype == "float32" else 2)
            seq = args.tokens + args.max_tokens + BLOCK
            job = {"label": label, "model": str(model), "address": daemon.address, "prompts": prompts,
                   "max_tokens": args.max_tokens, "dtype": args.dtype, "compressions": compressions,
                   "scores": args.scores,
                   "vocab": VOCAB, "kv_heads": spec["kv_heads"], "max_model_len": seq,
                   # every prompt's KV at once, twice over: nothing evicted from vLLM's own cache
                   "kv_cache_bytes": max(256 << 20, 2 * per_token * seq * args.prompts)}  # fmt: skip
            print(f"model {label}: {len(compressions)} compressions, {args.prompts} prompts", file=sys.stderr)
            results[label] = run_engine_process(tmp, job, args.timeout)
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    for label in models:
        report(label, MODELS[label], args, results[label])


if __name__ == "__main__":
    main()
