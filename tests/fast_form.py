"""Test helpers for XLA:CPU's fast bfloat16 form: narrow inputs, and which element types the
compiled products multiply."""
import jax
import jax.numpy as jnp

# (platform lowered for, model dtype, whether the CPU kernel is in the program) for a kernel
# that gains only in a narrow dtype (`kernels.narrow_by_platform`).
NARROW_KERNEL_CHOICES = [("cpu", "bfloat16", True), ("tpu", "bfloat16", False), ("cpu", "float32", False)]


def narrow(*shapes, seed=0):
    keys = jax.random.split(jax.random.key(seed), len(shapes))
    return [(jax.random.normal(k, s) * 0.5).astype(jnp.bfloat16) for k, s in zip(keys, shapes)]


def dot_operand_types(hlo: str) -> list[str]:
    """The element types of every dot's operands in compiled HLO text."""
    types, found = {}, []
    for line in hlo.splitlines():
        if " = " not in line:
            continue
        name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
        types[name] = rest.split("[", 1)[0]
        if " dot(" in rest:
            found += [types[o.strip()] for o in rest.split(" dot(", 1)[1].split(")", 1)[0].split(",")]
    return found
