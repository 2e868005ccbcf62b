"""What this machine has, known before jax starts: accelerators, cores, memory.

Command-line tools call these first thing, because two settings must be fixed before JAX
initialises its backends:

- `quiet_without_tpu()`: on a machine without TPU chips JAX would still load libtpu (when it is
  installed, e.g. by the `tpu` extra), which prints start-up chatter ("Failed to find host
  bounds for accelerator type", "could not determine TPU worker hostnames") and contends for
  /tmp/libtpu_lockfile with every other JAX process. Without any accelerator the platform is
  set to CPU (JAX_PLATFORMS=cpu) and libtpu's logging is turned down; with a TPU, or with
  JAX_PLATFORMS set by the user, nothing changes.
- `check_simulated_devices(n)`: a DxM mesh on a CPU-only machine runs on D*M simulated XLA
  devices, and each costs real memory and compile time (a 1x16 LoRA run of the toy model took
  3.7 GB here, 1x32 5.1 GB); a 1x1000 mesh grew to ~20 GB before the kernel killed it. So at
  most `max_simulated_devices()` are allowed: 4 per core and one per 256 MiB of RAM, never
  fewer than 8.
"""
from __future__ import annotations

import glob
import os
import re
import sys

from jaxlm.errors import UserError

GOOGLE_PCI_VENDOR = "0x1ae0"  # TPU chips sit on the PCI bus under Google's vendor id
DEVICES_PER_CORE = 4
BYTES_PER_DEVICE = 256 << 20
MIN_SIMULATED = 8


def has_tpu() -> bool:
    for vendor in glob.glob("/sys/bus/pci/devices/*/vendor"):
        try:
            with open(vendor) as f:
                if f.read().strip() == GOOGLE_PCI_VENDOR:
                    return True
        except OSError:
            continue
    return bool(glob.glob("/dev/accel*"))  # TPU v2-v4 VMs


def has_gpu() -> bool:
    return os.path.exists("/dev/nvidia0") or os.path.exists("/dev/kfd")


def cpu_only(environ=None) -> bool:
    """Whether JAX will run on the CPU: JAX_PLATFORMS says so, or no accelerator is attached."""
    env = os.environ if environ is None else environ
    platforms = env.get("JAX_PLATFORMS", "")
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    return not (has_tpu() or has_gpu())


def quiet_without_tpu(environ=None) -> None:
    """See the module docstring; call before JAX initialises its backends."""
    env = os.environ if environ is None else environ
    if has_tpu():
        return
    env.setdefault("TPU_MIN_LOG_LEVEL", "3")
    env.setdefault("TPU_STDERR_LOG_LEVEL", "3")
    if env.get("JAX_PLATFORMS") or has_gpu():
        return
    env["JAX_PLATFORMS"] = "cpu"
    if environ is None and "jax" in sys.modules:  # imported already: its config read the env
        from jax._src import xla_bridge
        if not xla_bridge.backends_are_initialized():
            sys.modules["jax"].config.update("jax_platforms", "cpu")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def memory_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 8 << 30


def max_simulated_devices() -> int:
    return max(MIN_SIMULATED, min(DEVICES_PER_CORE * cores(), memory_bytes() // BYTES_PER_DEVICE))


def with_host_devices(flags: str, n: int | None) -> str:
    """XLA_FLAGS text `flags` with its simulated CPU device count set to `n` (None: the flag
    removed, so XLA's one host device). Stripped: XLA reads flags that are only spaces as a file
    name and aborts."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\S+", "", flags)
    return (flags if n is None else f"{flags} --xla_force_host_platform_device_count={n}").strip()


def check_simulated_devices(n: int, flag: str) -> None:
    """A UserError when `n` simulated CPU devices are out of proportion to this machine."""
    limit = max_simulated_devices()
    if n > limit:
        raise UserError(
            f"{flag} needs {n} simulated CPU devices in this process, but this machine "
            f"({cores()} cores, {memory_bytes() / 2**30:.0f} GiB) runs at most {limit} "
            f"({DEVICES_PER_CORE} per core, one per {BYTES_PER_DEVICE >> 20} MiB); use a mesh of "
            f"at most {limit} devices (e.g. --mesh=1x{_fit(limit)}), or run on an accelerator")


def _fit(limit: int) -> int:
    n = 1
    while n * 2 <= limit:
        n *= 2
    return n


def return_freed_memory() -> bool:
    """Hand the memory malloc keeps after large frees back to the kernel (glibc's malloc_trim);
    -> whether it could. After the one-device evaluation of the demo model (a 1.1 GB copy of
    the weights, freed) glibc kept 0.57 GB that the training step would otherwise sit on top of.
    A no-op off glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        return False
    return True
