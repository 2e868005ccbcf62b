"""Device meshes with axes ("batch", "model"), built from a `--mesh=DxM` string.

`batch` shards the data (and, in the "keras" Gemma table, one weight dimension); `model` shards
the weights. "auto" puts every device on `model` (batch=1), the seed article's (1, 8) layout:
LoRA fine-tuning of a model that does not fit one chip is memory-bound, not data-bound.
"""
from __future__ import annotations

import re

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

AXES = ("batch", "model")


def parse_mesh(spec, num_devices: int) -> tuple[int, int]:
    """"DxM" | "auto" | (D, M) -> (D, M), checked against `num_devices`."""
    if isinstance(spec, str):
        text = spec.strip().lower()
        if text == "auto":
            return 1, num_devices
        m = re.fullmatch(r"(-?\d+)x(-?\d+)", text)
        if m is None:
            raise ValueError(f"mesh {spec!r} is not of the form DxM (e.g. 1x{num_devices}, "
                             f"{num_devices}x1) or 'auto'")
        shape = int(m.group(1)), int(m.group(2))
    else:
        try:
            shape = tuple(int(d) for d in spec)
        except (TypeError, ValueError):
            raise ValueError(f"mesh {spec!r} is not a (batch, model) pair of ints, "
                             "a DxM string or 'auto'") from None
        if len(shape) != 2:
            raise ValueError(f"mesh {spec!r} has {len(shape)} dims; give two: (batch, model)")
    if min(shape) < 1:
        raise ValueError(f"mesh {shape[0]}x{shape[1]} has a dimension < 1; both must be >= 1")
    if shape[0] * shape[1] != num_devices:
        raise ValueError(f"mesh {shape[0]}x{shape[1]} needs {shape[0] * shape[1]} devices but "
                         f"{num_devices} are available{_cpu_hint()}; use D*M = {num_devices} "
                         "or --mesh=auto")
    return shape


def _cpu_hint() -> str:
    if jax.default_backend() != "cpu":
        return ""
    return (" (on CPU, simulate more with XLA_FLAGS=--xla_force_host_platform_device_count=N "
            "set before jax is imported)")


def make_mesh(spec="auto", devices=None) -> Mesh:
    """-> Mesh with axes ("batch", "model"). devices: default `jax.devices()`, all of them."""
    devices = list(jax.devices() if devices is None else devices)
    shape = parse_mesh(spec, len(devices))
    try:  # topology-aware order on TPU/GPU (neighbouring chips share the model axis)
        grid = mesh_utils.create_device_mesh(shape, devices)
    except (ValueError, NotImplementedError, AssertionError):
        grid = np.asarray(devices, dtype=object).reshape(shape)
    return Mesh(grid, AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    """[B, T] data: rows split over `batch`, replicated over `model` (KerasHub's data layout)."""
    return NamedSharding(mesh, P("batch"))
