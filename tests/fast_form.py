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


def dots(hlo: str) -> list[tuple[str, str, str, str, str]]:
    """Every dot in compiled HLO text as (lhs type, rhs type, result type, lhs contracting
    dims, rhs contracting dims): XLA:CPU's fast bfloat16 form of a 2-D product is
    ("bf16", "bf16", "f32", "{1}", "{0}")."""
    types, found = {}, []
    for line in hlo.splitlines():
        if " = " not in line:
            continue
        name, rest = line.strip().removeprefix("ROOT ").split(" = ", 1)
        types[name] = rest.split("[", 1)[0]
        if " dot(" in rest:
            lhs, rhs = (o.strip() for o in rest.split(" dot(", 1)[1].split(")", 1)[0].split(","))
            dims = [rest.split(f"{side}_contracting_dims=", 1)[1].split("}", 1)[0] + "}" for side in ("lhs", "rhs")]
            found.append((types[lhs], types[rhs], types[name], *dims))
    return found


def dot_operand_types(hlo: str) -> list[str]:
    """The element types of every dot's operands in compiled HLO text."""
    return [t for lhs, rhs, *_ in dots(hlo) for t in (lhs, rhs)]


def buffers(hlo: str) -> set[str]:
    """The shapes ("bf16[6,40]") that compiled HLO text writes to memory: every instruction's
    outside the fused computations (whose values live in registers within one loop)."""
    fused = {part.split(",", 1)[0].split()[0] for part in hlo.split("calls=")[1:]}
    shapes, inside = set(), False
    for line in hlo.splitlines():
        if line.rstrip().endswith("{") and " = " not in line:  # a computation's header
            inside = line.strip().removeprefix("ENTRY ").split(" ", 1)[0] in fused
        elif " = " in line and not inside:
            shapes.add(line.split(" = ", 1)[1].split("{", 1)[0].split(" ", 1)[0])
    return shapes


def transposed_sizes(jaxpr) -> list[int]:
    """The element counts of every array a jaxpr (its loops' bodies included) transposes."""
    sizes = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "transpose":
            sizes.append(eqn.invars[0].aval.size)
        for sub in jax.core.jaxprs_in_params(eqn.params):
            sizes += transposed_sizes(sub)
    return sizes
