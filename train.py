"""Fine-tune Gemma on a device mesh: `python train.py --mesh=1x8 --lora_rank=4`.

Everything runs with defaults: a random toy Gemma (`gemma_tiny`) on the built-in checkable
dataset, finishing in minutes on a laptop CPU. See `python train.py --help` and README.md.
`--task=mlm` hands the remaining flags to the RoBERTa masked-LM trainer (`jaxlm.mlm`).
"""
import os
import re
import sys


def _flag(argv, name):
    """The value of --name=V or --name V, read with string ops (jax must not be imported yet)."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            return argv[i + 1]
    return None


def simulate_cpu_devices(argv) -> None:
    """A DxM mesh on a CPU-only machine needs D*M XLA host devices, fixed before jax starts.

    The flag only affects the CPU platform, so it is harmless where an accelerator exists (there
    a mesh that does not fit is reported with the real device count). On the CPU a mesh out of
    proportion to the machine is refused now (`jaxlm.machine.check_simulated_devices`), before
    it can take the machine's memory. A malformed --mesh is left for the argument checks.
    """
    m = re.fullmatch(r"\s*(\d+)x(\d+)\s*", (_flag(argv, "mesh") or "").lower())
    flags = os.environ.get("XLA_FLAGS", "")
    if m and "xla_force_host_platform_device_count" not in flags:
        n = int(m.group(1)) * int(m.group(2))
        from jaxlm.distributed import num_processes_hint
        hosts = num_processes_hint(argv)  # several processes share the mesh's devices
        if hosts > 1 and n % hosts == 0:
            n //= hosts
        from jaxlm import machine
        if machine.cpu_only():
            machine.check_simulated_devices(n, f"--mesh={m.group(1)}x{m.group(2)}")
        if n > 1:
            os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def start_processes(argv):
    """Join the other hosts' processes (jaxlm.distributed) when asked; -> argv without its flags.

    Every process must run the same command (else their collectives would not match and hang);
    only process 0 prints progress."""
    from jaxlm import distributed
    from jaxlm.errors import cli

    @cli
    def start(argv):
        settings, argv = distributed.from_argv(argv)
        if distributed.initialize(settings):
            distributed.check_same({"command line": argv})
            distributed.quiet_followers()
        return argv
    return start(argv)


def prepare(argv) -> None:
    """Before jax starts its backends: the platform, and the simulated devices a CPU mesh
    needs (jax is imported by then, through the jaxlm package, but reads both later); and the
    compile cache (`jaxlm.compile_cache`)."""
    from jaxlm import compile_cache, machine
    from jaxlm.errors import cli

    @cli
    def prepare_(argv):
        machine.quiet_without_tpu()
        simulate_cpu_devices(argv)
        compile_cache.enable(_flag(argv, "compile_cache"))
    prepare_(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    prepare(argv)
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    argv = start_processes(argv)
    task = _flag(argv, "task") or "lm"
    if task == "mlm":
        from jaxlm.mlm import main as mlm_main
        rest = [x for i, x in enumerate(argv) if not x.startswith("--task=")
                and x != "--task" and not (i > 0 and argv[i - 1] == "--task")]
        return mlm_main(rest)
    from jaxlm.errors import cli
    from jaxlm.train import cli as flags, lm

    @cli
    def run(argv):
        return lm.run(flags.parse(argv))
    return run(argv)


def restart_with_huge_pages() -> None:
    """`jaxlm.hugepages.restart_with_huge_pages` before the jaxlm package is imported.

    The package imports JAX (~1.6 s on a 2-core host), which the restarted process imports
    again; the module needs only os and sys, so it is loaded by its path, outside the package.
    `python train.py --preset=gemma_tiny --steps=20` took 9.1-11.2 s with the restart after that
    import, 7.6-7.9 s with it first (7.3-7.6 s with the tunable already set; the 2-core AMD
    EPYC, 2026-12-07)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jaxlm", "hugepages.py")
    if not os.path.exists(path):  # this file away from its checkout: the installed package
        from jaxlm.hugepages import restart_with_huge_pages as restart
        return restart()
    spec = importlib.util.spec_from_file_location("_jaxlm_hugepages", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.restart_with_huge_pages()


if __name__ == "__main__":
    try:  # a Ctrl-C while the libraries import is one line too
        restart_with_huge_pages()  # on Linux: once, before any work (see its docstring)
        sys.exit(main())
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
