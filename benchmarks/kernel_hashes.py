"""Fingerprints of the Mosaic GPU kernels one pallas training step compiles: each kernel's
module as lowered for CUDA, printed without debug info (so moved source lines do not count)
and hashed. Two trees whose hashes agree run the same kernels; this is how a change is shown
to leave a kernel alone. CPU only (lowering needs no GPU).

    python benchmarks/kernel_hashes.py --head-dims 64,128,256

Prints one line per head dim and schedule (``programs``: 0 one program per unit, 132 the
persistent forward and dK/dV kernels): the hashes in the order the step lowers them.
"""

from __future__ import annotations

import argparse
import hashlib
import re

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir as jax_mlir
from jax._src.lib.mlir import ir
from jax.experimental.mosaic.gpu import dialect as mgpu_dialect

from magi_jax.mask import AttnMask
from magi_jax.pallas import ffa_pallas, plan_for_mask

# Unaligned slices of every kind, Tq != Tk, a query head pair over one key head.
MASK = AttnMask.from_ranges(
    [[0, 100], [100, 190], [100, 190]],
    [[0, 500], [0, 60], [60, 640]],
    ["causal", "full", "inv_causal"],
    200,
    640,
)


def kernel_modules(d: int, programs: int) -> list[bytes]:
    """The serialized Mosaic GPU modules of a fwd+bwd step at head dim ``d``."""
    plan = plan_for_mask(MASK, "pallas")
    q = jax.ShapeDtypeStruct((MASK.total_q, 2, d), jnp.bfloat16)
    kv = jax.ShapeDtypeStruct((MASK.total_k, 1, d), jnp.bfloat16)

    def loss(q_, k_, v_):
        out, _ = ffa_pallas(
            q_, k_, v_, plan, softmax_scale=0.1, persistent=programs, dkv_persistent=programs
        )
        return out.astype(jnp.float32).sum()

    lowered = (
        jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
        .trace(q, kv, kv)
        .lower(lowering_platforms=("cuda",))
    )
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    if child.operation.name == "stablehlo.custom_call" and "mosaic" in str(
                        child.attributes["call_target_name"]
                    ):
                        config = child.attributes["mhlo.backend_config"]
                        found.append(bytes(ir.StringAttr(config["module"]).value_bytes))
                    walk(child.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


# A per-process counter Mosaic GPU names kernel dumps by, not part of the kernel.
_DUMP_NAME = re.compile(r'mosaic_gpu\.dump_basename = "[^"]*",? ?')


def fingerprints(d: int, programs: int) -> list[str]:
    """The kernels of :func:`kernel_modules`, each printed without debug info and hashed."""
    ctx = jax_mlir.make_ir_context()
    mgpu_dialect.register_dialect(ctx)
    ctx.allow_unregistered_dialects = True  # the modules are serialized in stable dialects
    with ctx:
        texts = [
            ir.Module.parse(m).operation.get_asm(enable_debug_info=False)
            for m in kernel_modules(d, programs)
        ]
    return [hashlib.sha256(_DUMP_NAME.sub("", t).encode()).hexdigest()[:12] for t in texts]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--head-dims", default="64,128,256")
    a = p.parse_args()
    for d in (int(x) for x in a.head_dims.split(",")):
        # No persistent kernel at D = 256 (their output buffers do not fit).
        for programs in (0, 132) if d <= 128 else (0,):
            print(f"D {d} programs {programs}: {' '.join(fingerprints(d, programs))}")


if __name__ == "__main__":
    main()
