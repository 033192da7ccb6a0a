"""Design spike (several devices per process): how to reduce across processes.

Not package code: a measurement kept so the numbers in multi_device.md can be reproduced.

    export XLA_FLAGS=--xla_force_host_platform_device_count=2
    SPIKE=docs/design/multi_device_spike.py
    KINDS=none,c_hierarchical,c_two_dimensional mpirun -n 2 .venv/bin/python $SPIKE 32
    SYNC=1 KINDS=none,b_split mpirun -n 2 .venv/bin/python $SPIKE 32

Kinds: ``none`` (pmean over local devices only: the no-MPI baseline), ``a_io_callback``
(hangs under shard_map: do not select it), ``b_split`` (three jits per step; hangs unless
SYNC=1), ``c_hierarchical`` / ``c_two_dimensional`` (mnjax.comm._instep._primitives inside
shard_map).
"""
import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.experimental import io_callback
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from mpi4py import MPI

import mnjax
from lab.models import SmallCNN
from mnjax.comm._instep import _buckets as bucketing
from mnjax.comm._instep._primitives import allreduce_sum

world = MPI.COMM_WORLD
ndev = jax.local_device_count()
comms = [world.Clone() for _ in range(ndev)]
host_comm = world.Clone()
mesh = Mesh(np.array(jax.local_devices()), ("local",))
B = int(sys.argv[1]) if len(sys.argv) > 1 else 32
data = mnjax.data.load_digits("train")
x = jnp.asarray(data.images[: B * ndev])
y = jnp.asarray(data.labels[: B * ndev])
model = SmallCNN()
params = model.init(jax.random.key(0), x[:1])["params"]
tx = optax.adam(1e-3)
opt = tx.init(params)
nrep = world.size * ndev

def loss(p, xb, yb):
    logits = model.apply({"params": p}, xb)
    return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

def host_allreduce(buf):
    buf = np.asarray(buf)
    out = np.empty_like(buf)
    host_comm.Allreduce(buf, out)
    return out

def cross(kind, g):
    leaves, tdef = jax.tree.flatten(g)
    if kind == "none":
        return jax.tree.map(lambda leaf: jax.lax.pmean(leaf, "local"), g)
    if kind == "a_io_callback":
        flat = jax.lax.psum(bucketing.pack(leaves, jnp.float32), "local")
        flat = io_callback(host_allreduce, jax.ShapeDtypeStruct(flat.shape, flat.dtype), flat,
                           ordered=True)
        return tdef.unflatten(bucketing.unpack(flat / nrep, leaves))
    if kind == "c_hierarchical":
        flat = jax.lax.psum(bucketing.pack(leaves, jnp.float32), "local")
        i = jax.lax.axis_index("local")
        red = jax.lax.cond(i == 0, lambda t: allreduce_sum(t, comms[0]), jnp.zeros_like, flat)
        flat = jax.lax.psum(red, "local")
        return tdef.unflatten(bucketing.unpack(flat / nrep, leaves))
    if kind == "c_two_dimensional":
        flat = bucketing.pack(leaves, jnp.float32)
        pad = (-flat.size) % ndev
        flat = jnp.pad(flat, (0, pad))
        shard = jax.lax.psum_scatter(flat, "local", tiled=True)
        i = jax.lax.axis_index("local")
        shard = jax.lax.switch(i, [lambda s, c=c: allreduce_sum(s, c) for c in comms], shard)
        flat = jax.lax.all_gather(shard, "local", tiled=True)[: flat.size - pad]
        return tdef.unflatten(bucketing.unpack(flat / nrep, leaves))
    raise ValueError(kind)

def make_step(kind):
    def per_device(p, o, xb, yb):
        g = jax.grad(loss)(p, xb, yb)
        g = cross(kind, g)
        u, o = tx.update(g, o, p)
        return optax.apply_updates(p, u), o
    sm = jax.shard_map(per_device, mesh=mesh, in_specs=(P(), P(), P("local"), P("local")),
                       out_specs=(P(), P()), check_vma=False)
    return jax.jit(sm)

# (b) split step: local grads+psum in shard_map; device-0 copy reduced by a single-device
# jit; update replicated.
def grads_local(p, xb, yb):
    g = jax.grad(loss)(p, xb, yb)
    leaves, _ = jax.tree.flatten(g)
    return jax.lax.psum(bucketing.pack(leaves, jnp.float32), "local")
b_grads = jax.jit(jax.shard_map(grads_local, mesh=mesh, in_specs=(P(), P("local"), P("local")),
                                out_specs=P(), check_vma=False))
b_reduce = jax.jit(lambda f: allreduce_sum(f, comms[0]) / nrep)
leaves0, tdef0 = jax.tree.flatten(params)
def upd(p, o, flat):
    g = tdef0.unflatten(bucketing.unpack(flat, leaves0))
    u, o = tx.update(g, o, p)
    return optax.apply_updates(p, u), o
b_update = jax.jit(jax.shard_map(upd, mesh=mesh, in_specs=(P(), P(), P()),
                                 out_specs=(P(), P()), check_vma=False))
rep = NamedSharding(mesh, P())
class SplitStep:
    def __call__(self, p, o, xb, yb):
        flat = b_grads(p, xb, yb)
        red = b_reduce(flat.addressable_shards[0].data)
        red = jax.device_put(red, rep)
        return b_update(p, o, red)

kinds = os.environ.get("KINDS", "none,c_hierarchical,c_two_dimensional").split(",")
steps = {k: (SplitStep() if k == "b_split" else make_step(k)) for k in kinds}
xs = jax.device_put(x, NamedSharding(mesh, P("local")))
ys = jax.device_put(y, NamedSharding(mesh, P("local")))
p0 = jax.device_put(params, rep)
o0 = jax.device_put(opt, rep)
state = {}
for k in kinds:
    p, o = p0, o0
    for _ in range(3):
        p, o = steps[k](p, o, xs, ys)
    state[k] = jax.block_until_ready((p, o))
# correctness: one step from the same start must agree with "none" scaled... compare kinds
# pairwise after 1 step from p0
ref = None
for k in kinds[1:]:
    p1, _ = steps[k](p0, o0, xs, ys)
    f = np.concatenate([np.asarray(leaf).ravel() for leaf in jax.tree.leaves(p1)])
    allf = world.allgather(f)
    ok = all(np.array_equal(allf[0], a) for a in allf)
    if ref is None:
        ref = f
    if world.rank == 0:
        print(k, "identical across ranks", ok, "max diff vs", kinds[1],
              float(np.max(np.abs(f - ref))), flush=True)
times = {k: [] for k in kinds}
STEPS = 20
SYNC = os.environ.get("SYNC") == "1"
for _ in range(9):
    for k in kinds:
        p, o = state[k]
        host_comm.Barrier()
        t = time.perf_counter()
        for _ in range(STEPS):
            p, o = steps[k](p, o, xs, ys)
            if SYNC:
                p, o = jax.block_until_ready((p, o))
        jax.block_until_ready((p, o))
        el = time.perf_counter() - t
        times[k].append(host_comm.allreduce(el, op=MPI.MAX))
        state[k] = (p, o)
med = {k: statistics.median(v) / STEPS for k, v in times.items() if v}
if world.rank == 0:
    print(json.dumps({"procs": world.size, "devices_per_proc": ndev, "batch_per_device": B,
                      "ms_per_step": {k: round(v * 1e3, 3) for k, v in med.items()},
                      "efficiency_vs_local_only": {k: round(med["none"] / v, 3)
                                                   for k, v in med.items()}}, indent=1))
