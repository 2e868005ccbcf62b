"""Every bench script runs end to end on a tiny config and ends with its BENCH lines.

The README's numbers come from these scripts, so a refactor must not break them silently (the
accelerator one in particular only runs for real when a GPU/TPU is lent). Speed is not asserted
here; the measured tables and their commands are in bench/README.md.
"""
import math
import os
import re
import subprocess
import sys

import pytest

from jaxlm import machine
from models import cpu_forms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_bench(script, *args):
    """-> (stdout, {bench name: {field: value}}) of `python bench/<script> <args>`."""
    r = subprocess.run([sys.executable, os.path.join("bench", script), *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    lines = {}
    for line in r.stdout.splitlines():
        if line.startswith("BENCH "):
            name, *fields = line.split()[1:]
            lines[name] = dict(field.split("=", 1) for field in fields)
    return r.stdout, lines


def assert_names_its_host(stdout: str):
    """The CPU ratios depend on the machine, so each CPU bench says which one ran it."""
    host = [line for line in stdout.splitlines() if line.startswith("host: ")]
    assert len(host) == 1 and f"{os.cpu_count()} cores" in host[0], host
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f
                          if line.startswith("model name")), "")
        assert model in host[0], (model, host)
    assert ("amx_bf16" in host[0]) == cpu_forms.amx(), host  # the decoder's path depends on it


def positive(value: str) -> float:
    x = float(value)
    assert math.isfinite(x) and x > 0, value
    return x


def ratio_within_rounding(ratio: str, num: float, den: float, half: float) -> bool:
    """Whether a ratio printed to 0.01 is num / den for some num and den within `half` (their
    printing's rounding) of the printed ones."""
    bounds = [(num + a) / max(den + b, 1e-9) for a in (-half, half) for b in (-half, half)]
    return min(bounds) - 0.005 <= float(ratio) <= max(bounds) + 0.005


def test_train_step_bench_compares_both_modes_with_kerashub():
    out, lines = run_bench("train_step.py", "--layers=1", "--vocab=512", "--batch=2", "--seq=32",
                           "--steps=1", "--warmup=1")
    assert_names_its_host(out)
    for mode in ("lora", "full"):
        fields = lines[f"train_{mode}"]
        # The ratio is printed to two decimals: a small ratio is off by up to 0.005.
        assert positive(fields["ratio"]) == pytest.approx(
            positive(fields["jaxlm"]) / positive(fields["keras"]), rel=0.01, abs=0.006)
    assert {"jaxlm", "lora", "keras_full", "peak_gflops"} <= set(lines["train_mfu_cpu"])
    assert_over_the_higher_peak(out, float(lines["train_mfu_cpu"]["peak_gflops"]))


def assert_over_the_higher_peak(out: str, reported: float):
    """The matmul peak is measured before and after the steps, and MFU is over the higher."""
    measured = [float(g) for g in re.findall(r"matmul peak(?: after the steps)?: ([\d.]+) GFLOP/s", out)]
    assert len(measured) == 2 and reported == pytest.approx(max(measured), abs=0.051)


def test_train_step_bench_takes_turns_and_drops_each_turns_first_step():
    sys.path.insert(0, ROOT)
    from bench.train_step import interleaved
    calls = []

    def runner(name):
        def run(n):
            calls.append((name, n))
            return [float(len(calls))] * n  # each step "takes" the turn's number
        return run
    out = interleaved({"a": runner("a"), "b": runner("b")}, warmup=2, steps=3, rounds=2)
    assert calls == [("a", 2), ("b", 2), ("a", 4), ("b", 4), ("a", 4), ("b", 4)]
    assert out == {"a": [[3.0] * 3, [5.0] * 3], "b": [[4.0] * 3, [6.0] * 3]}


def test_generate_bench_gives_kerashub_strings():
    out, lines = run_bench("generate.py", "--layers=1", "--vocab=4096", "--max_length=48",
                           "--short_length=24", "--repeats=1")
    assert "identical strings: True" in out
    assert_names_its_host(out)
    positive(lines["generate_b4"]["ratio"])
    fields = lines["decode_step_vs_weight_read"]
    # The step is the slope between two call lengths: on a 1-layer model with one repeat,
    # noise can make it negative, so check the arithmetic (to the printing's rounding), not
    # the sign. CI failed once on jaxlm_x_read=-0.06.
    step = float(fields["jaxlm"])
    assert math.isfinite(step)
    assert ratio_within_rounding(fields["jaxlm_x_read"], step, positive(fields["weight_read_ms"]),
                                 half=0.005), fields


def test_skinny_matmul_bench_times_each_column_count_against_one_read():
    out, lines = run_bench("skinny_matmul.py", "--rows=256", "--cols=64", "--columns=1,4",
                           "--cores=1", "--repeats=3", "--rounds=1")
    assert_names_its_host(out)
    fields = lines["skinny_matmul"]
    assert fields["cores"] == "1" and "1 core(s)" in out
    for name in ("read_ms", "c1_ms", "c4_ms", "c1_x_read", "c4_x_read", "numpy_c4_ms"):
        positive(fields[name])
    assert "c2_ms" not in fields
    # The times are printed to 0.001 ms: a tiny read time makes the bound wide, not the check vacuous.
    assert ratio_within_rounding(fields["c4_x_read"], float(fields["c4_ms"]), float(fields["read_ms"]),
                                 half=0.0005), fields


def test_skinny_matmul_bench_refuses_more_cores_than_it_may_use():
    r = subprocess.run([sys.executable, os.path.join("bench", "skinny_matmul.py"),
                        f"--cores={len(os.sched_getaffinity(0)) + 1}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and "--cores=" in r.stderr and "pass 1 to" in r.stderr


def test_memory_bench_compiles_a_tiny_config_for_tpu():
    _, lines = run_bench("memory.py", "--presets=gemma_tiny", "--topology=v5e:2x4", "--remat=on",
                         "--sequence_length=64")
    fields = lines["memory_gemma_tiny_lora_remat"]
    assert fields["fits"] == "1" and positive(fields["total_gib"]) < 1


def test_memory_bench_compares_lora_with_full_on_one_cpu_device():
    stdout, lines = run_bench("memory.py", "--platform=cpu", "--presets=gemma_tiny",
                              "--layers=unrolled", "--sequence_length=32")
    lora, full = (lines[f"memory_cpu_gemma_tiny_{m}_unrolled"] for m in ("lora", "full"))
    ratio = positive(lines["memory_cpu_gemma_tiny_unrolled"]["lora_over_full"])
    assert ratio == pytest.approx(positive(lora["temp_gib"]) / positive(full["temp_gib"]), abs=0.01)
    assert float(lora["args_gib"]) < float(full["args_gib"])  # no optimizer state for the base
    # The step train.py runs: its own compile-only table, row for row (the bench once compiled
    # smaller loss blocks than train.py and left the code size out of its total).
    r = subprocess.run([sys.executable, "train.py", "--compile_only=cpu", "--mesh=1x1",
                        "--preset=gemma_tiny", "--lora_rank=4", "--batch_size=2",
                        "--sequence_length=32"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                       env={**os.environ, "XLA_FLAGS": machine.with_host_devices(
                           os.environ.get("XLA_FLAGS", ""), None)})  # train.py sizes the host to the mesh
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines()
            if line.startswith("  ") and ("GiB" in line or "MiB" in line)]
    assert any("temporaries" in row for row in rows) and any("total" in row for row in rows)
    assert "\n".join(rows) in stdout


def test_real_model_bench_runs_all_three_frameworks_on_a_tiny_gemma3():
    """--tiny: a random Gemma 3 from transformers, mapped to jaxlm and exported to KerasHub;
    the script itself checks the three give the same logits, then trains and decodes."""
    # Two lengths: PEFT and KerasHub's enable_lora wrap their model in place, so each length
    # needs fresh models (the second length once crashed on "lora is already enabled").
    out, lines = run_bench("real_model.py", "--tiny", "--steps=1", "--warmup=1", "--rounds=1",
                           "--repeats=1", "--new_tokens=8", "--modes=lora", "--seqs=32,16",
                           "--batches=2,2", "--decode_batches=2", "--memory=off",
                           "--torch_threads=1")
    assert "real_train_lora_t16" in lines
    assert "jaxlm vs hf: max |diff|" in out and "jaxlm vs keras: max |diff|" in out
    assert_names_its_host(out)
    assert re.search(r"versions: jax=\S+ .*torch=\S+ transformers=\S+ peft=\S+ .*keras-hub=\S+", out)
    for name in ("real_train_lora_t32", "real_decode_b2"):
        fields = lines[name]
        assert positive(fields["vs_hf"]) == pytest.approx(
            positive(fields["jaxlm"]) / positive(fields["hf"]), rel=0.02, abs=0.006)
        positive(fields["keras"]), positive(fields["vs_keras"])
    positive(lines["real_train_lora_t32"]["mfu"])


def test_real_model_bench_runs_in_bfloat16_with_the_train_layout():
    """--dtype=bfloat16: every framework in bfloat16, jaxlm's LoRA step as train.py takes it
    (through the CPU train layout on a CPU with AMX), the lines named real_bf16_..."""
    out, lines = run_bench("real_model.py", "--tiny", "--quick", "--dtype=bfloat16", "--modes=lora",
                           "--seqs=16", "--batches=2", "--decode_batches=2", "--memory=off",
                           "--torch_threads=1")
    assert "measured bfloat16 matmul peak" in out and lines["real_peak"]["dtype"] == "bfloat16"
    fields = lines["real_bf16_train_lora_t16"]
    for name in ("jaxlm", "hf", "keras", "mfu"):
        positive(fields[name])
    assert_over_the_higher_peak(out, float(lines["real_peak"]["gflops"]))
    positive(lines["real_bf16_decode_b2"]["jaxlm"])


def test_compile_time_bench_reports_a_ratio():
    _, lines = run_bench("compile_time.py", "--layers=1,2")
    positive(lines["compile_2_vs_1"]["ratio"])


def test_accelerator_bench_smoke_runs_on_cpu(tmp_path):
    _, lines = run_bench("accelerator.py", "--smoke", f"--profile={tmp_path}")
    for name in ("accel_train_full", "accel_train_lora", "accel_decode_b1", "accel_decode_b32"):
        positive(lines[name]["tokens_per_s"])
    positive(lines["accel_train_full"]["mfu"])
    traces = {os.path.relpath(d, tmp_path).split(os.sep)[0]
              for d, _, files in os.walk(tmp_path) if "perfetto_trace.json.gz" in files}
    assert traces == {"full", "lora"}


def test_real_step_ab_bench_times_the_activation_rule_against_the_partitioner():
    stdout, lines = run_bench("real_step_ab.py", "--tiny", "--what=activations", "--rounds=1",
                              "--batch=8", "--seq=16")
    assert_names_its_host(stdout)
    for v in ("table", "partitioner"):
        positive(lines["real_ab_activations"][f"{v}_ms"])
    table = next(line for line in stdout.splitlines() if line.startswith("activations table:"))
    assert "all-gather" in table  # the rule is in the compiled step


def test_real_step_ab_bench_decodes_alike_with_and_without_the_screen():
    stdout, lines = run_bench("real_step_ab.py", "--tiny", "--what=screen", "--rounds=1",
                              "--decode_batches=1,4", "--new_tokens=8")
    assert_names_its_host(stdout)
    for v in ("b1_on", "b1_off", "b4_on", "b4_off"):
        positive(lines["real_ab_screen"][f"{v}_ms"])
    assert "screen: the same tokens with and without" in stdout


def test_demo_bench_measures_both_commands():
    out, lines = run_bench("demo.py", "--", "--preset=gemma_tiny", "--steps=2", "--num_samples=0")
    assert_names_its_host(out)
    one, two = lines["demo_one"], lines["demo_two"]
    peaks = [positive(kb) for kb in two["peak_kb"].split("+")]
    assert len(peaks) == 2 and sum(peaks) == positive(two["total_kb"])
    assert abs(float(two["over_one"]) - sum(peaks) / positive(one["peak_kb"])) < 1e-3
    assert positive(one["wall_s"]) and positive(two["wall_s"])
    assert one["exact_match"] == two["exact_match"] == "0/40"  # a random toy model, the same data


def test_profile_bench_splits_the_traced_step_into_products_and_the_rest():
    out, lines = run_bench("profile_step.py", "--tiny", "--batch=2", "--seq=16")
    assert_names_its_host(out)
    line = lines["profile_lora_bf16_t16"]
    step, products, other, idle = (positive(line[k]) if k != "idle_ms" else float(line[k])
                                   for k in ("step_ms", "products_ms", "other_ms", "idle_ms"))
    assert products + other + idle <= step + 0.15  # the ops' span is inside the timed call
    mfu, ceiling = positive(line["mfu"]), positive(line["mfu_products_only"])
    assert abs(ceiling / mfu - step / products) < 0.05 * step / products
    assert "cpu_online" in out.split("top products", 1)[1]  # the loss's products are found


def test_profile_bench_finds_every_product_and_nothing_else():
    """A product in a fusion, one nested in a loop, and elementwise ops around them."""
    import jax
    import jax.numpy as jnp
    sys.path.insert(0, ROOT)
    from bench.profile_step import product_ops

    def f(a, b):
        c = jnp.tanh(a @ b) * 2.0
        c = jax.lax.fori_loop(0, 3, lambda i, x: jnp.exp(x @ b) + i, c)
        return (c.sum(axis=0) + 1.0, jnp.einsum("ij,kj->ik", c, a))
    x = jnp.ones((64, 64), jnp.bfloat16)
    hlo = jax.jit(f).lower(x, x).compile().as_text()
    products, labels = product_ops(hlo)
    assert len(products) == 3, products
    assert all("dot_general" in labels[p] or "einsum" in labels[p] for p in products), labels
    assert not any(labels[n].endswith(("/tanh", "/exp", "/reduce_sum")) for n in products)
