"""What the native transport is measured against, on one process with 2 GPUs: the launch
shape of NCCL's kernel for a 256 MiB ``ppermute`` exchange (blocks, threads, registers,
shared memory, from the profiler's kernel details) with its rate, and the copy engines' rate
one way and both ways at once (torch peer copies).

Usage (2 GPUs, e.g. nvidia-h200-x2): python benchmarks/ppermute_probe.py
"""

import glob
import tempfile

import jax
import jax.numpy as jnp
from jax.profiler import ProfileData
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

mesh = jax.make_mesh((2,), ("x",))
rows, width = 32768, 4096  # 256 MiB of bf16 per device
x = jax.device_put(jnp.ones((2 * rows, width), jnp.bfloat16), NamedSharding(mesh, P("x")))
f = jax.jit(
    jax.shard_map(
        lambda a: jax.lax.ppermute(a, "x", [(0, 1), (1, 0)]),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )
)
f(x).block_until_ready()
d = tempfile.mkdtemp()
jax.profiler.start_trace(d)
for _ in range(3):
    f(x).block_until_ready()
jax.profiler.stop_trace()
path = glob.glob(f"{d}/**/*.xplane.pb", recursive=True)[0]
seen = 0
for plane in ProfileData.from_file(path).planes:
    if not plane.name.startswith("/device:GPU"):
        continue
    for line in plane.lines:
        for e in line.events:
            if "nccl" in e.name.lower() and seen < 4:
                seen += 1
                print(
                    plane.name,
                    line.name,
                    e.name[:60],
                    f"{e.duration_ns / 1e3:.1f} us",
                    f"{rows * width * 2 / e.duration_ns:.1f} GB/s",
                )
                print("   ", dict(e.stats).get("kernel_details"))
import torch  # noqa: E402

a = [torch.ones(rows * width, dtype=torch.bfloat16, device=f"cuda:{i}") for i in range(2)]
b = [torch.empty_like(t) for t in a]
for bidir in (False, True):
    for _ in range(2):
        ev = []
        for i in range(2 if bidir else 1):
            with torch.cuda.device(i):
                s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                b[1 - i].copy_(a[i], non_blocking=True)
                t.record()
                ev.append((i, s, t))
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
    print(
        "bidirectional" if bidir else "one direction",
        [
            f"GPU{i}->GPU{1 - i}: {rows * width * 2 / (s.elapsed_time(t) * 1e6):.1f} GB/s"
            for i, s, t in ev
        ],
    )
