"""The derived figures, the printed table and the summary line of ``python -m lab.bench aot``
(`lab.bench.aot` compiles and measures; this module only reads its results)."""

from __future__ import annotations

MB = 1e6


def finish(results: dict) -> None:
  """Adds the figures computed from the compiled ones: optimizer state per GPU from
  ``memory_analysis`` (arguments less parameters, batch statistics, step and batch), the
  ZeRO-1 state ratio, and the cost model's compute time and efficiency predictions.

  Example:
    >>> finish({"targets": {}})
  """
  from lab.costmodel import compiled as cost
  from lab.costmodel import hardware

  for entry in results["targets"].values():
    memory = entry.get("memory")
    if memory and "by_batch" in memory:
      for rows in memory["by_batch"].values():
        for r in rows.values():
          if "memory" in r:
            fixed = sum(v for k, v in r["state_bytes"].items() if k != "opt_state")
            r["opt_state_from_memory_analysis"] = r["memory"]["argument"] - fixed - r["batch_bytes"]
      first = min(memory["by_batch"]["allreduce_adam"])
      plain = memory["by_batch"]["allreduce_adam"][first]
      shard = memory["by_batch"]["shard_optimizer_adam"][first]
      if "memory" in plain and "memory" in shard:
        memory["zero1_state_ratio"] = (shard["opt_state_from_memory_analysis"]
                                       / plain["opt_state_from_memory_analysis"])
    gpus = [8, 16, 32, 64, 128, 256, 512, 1024]
    for r in [*entry["xla"].values(), entry["plain_jax"]]:
      if "overlap" not in r:
        continue
      seconds = max(r["compute_seconds"]["flops_bound"], r["compute_seconds"]["bytes_bound"])
      sizes = [g["gradient_bytes"] for g in r["gradient_allreduces"]]
      base = hardware.cluster("h200_ndr")
      r["predicted_efficiency"] = {
          "gpus": gpus, "compiled_overlap": cost.predict(seconds, sizes, r["overlap"], base, gpus),
          "no_overlap": cost.predict(seconds, sizes, 0.0, base, gpus)}


def _row(name: str, r: dict) -> str:
  if "error" in r:
    return f"  {name:34s} not compiled: {r['error'].splitlines()[0][:150]}"
  grads = r["gradient_allreduces"]
  compute = max(r["compute_seconds"]["flops_bound"], r["compute_seconds"]["bytes_bound"])
  sizes = ", ".join(f"{g['gradient_bytes'] / MB:.1f}" for g in grads[:8])
  windows = ", ".join(str(g["compute_inside"]) for g in grads[:8])
  beside = r.get("overlap_beside_convolutions")
  return (f"  {name:34s} overlap {r['overlap']:.3f}"
          + ("" if beside is None else f" (beside convolutions {beside:.2f})")
          + f"  {len(grads)} gradient collectives"
          f" [{sizes}{', ...' if len(grads) > 8 else ''}] MB, kernels beside each [{windows}];"
          f" {r['critical']['count']} others on the critical path"
          f" ({r['critical']['bytes'] / 1e3:.0f} kB); temp {r['memory']['temp'] / 1e9:.2f} GB;"
          f" compute >= {compute * 1e3:.1f} ms ({r['compute_seconds']['bound']});"
          f" compiled in {r['compile_seconds']} s")


def table(results: dict) -> None:
  """Prints what `lab.bench.aot.run` measured, target by target."""
  plan = results["bucket_plan"]
  print(f"lab.bench aot ({results['size']}: {results['config']['model']},"
        f" {results['config']['image']} px, {results['config']['batch']} images per GPU),"
        f" {results.get('wall_seconds', 0):.0f} s")
  print(f"mnjax's bucket plan: {plan['buckets']} buckets of at most"
        f" {plan['bucket_bytes'] >> 20} MiB, {plan['gradient_bytes'] / MB:.1f} MB of gradients")
  for target, entry in results["targets"].items():
    print(f"{target}, xla kind (one process per GPU), from the compiled schedule:")
    for name, r in entry["xla"].items():
      print(_row(name, r))
    print(_row("plain jax.jit (nn.BatchNorm)", entry["plain_jax"]))
    if "combine_threshold" in entry:
      print(_row(f"combiner threshold {plan['bucket_bytes'] >> 20} MiB",
                 entry["combine_threshold"]))
    for kind, r in entry.get("mpi_kinds", {}).items():
      if "error" in r:
        print(f"  MPI kind {kind} ({r.get('target')}): not compiled: {r['error'][:300]}")
        continue
      calls = [c for c, _ in r["sequence"] if "mpi" in c]
      print(f"  MPI kind {kind} ({r['target']}, one process's program): compiled,"
            f" {len(calls)} MPI calls ({len(r['gradient_allreduces'])}"
            f" carrying gradients), synchronous on the compute stream: overlap"
            f" {r['overlap']:.3f}; first gradient call before the last convolution:"
            f" {r['first_gradient_before_last_heavy']}")
    order = entry.get("order")
    if order:
      flat = order["flat_shard_optimizer"]
      print(f"  order: xla lowering identical for rank 0 and the last rank:"
            f" {order['xla_lowering_identical']}; flat + shard_optimizer, ranks {flat['ranks']}:"
            f" {flat['calls']} calls, identical {flat['identical']}"
            + (f" ({flat['errors'][0][:200]})" if flat["errors"] else ""))
    memory = entry.get("memory")
    if memory and "error" in memory:
      print(f"  memory per GPU: not compiled: {memory['error'][:300]}")
    elif memory:
      print(f"  memory per GPU (flat kind, adam; {memory['memory_bytes'] / 1e9:.1f} GB usable):")
      print(f"    {'images/GPU':>10s} {'variant':22s} {'params':>8s} {'opt state':>10s}"
            f" {'temp':>8s} {'peak':>8s}  (GB)")
      for label, rows in memory["by_batch"].items():
        for batch, r in rows.items():
          if "error" in r:
            print(f"    {batch:>10} {label:22s} not compiled: {r['error'][:120]}")
            continue
          print(f"    {batch:>10} {label:22s} {r['state_bytes']['params'] / 1e9:8.3f}"
                f" {r['opt_state_from_memory_analysis'] / 1e9:10.3f}"
                f" {r['memory']['temp'] / 1e9:8.2f} {r['peak_bytes'] / 1e9:8.2f}")
      for label, m in memory["max_batch"].items():
        compiled = f", compiled {m['compiled']}" if "compiled" in m else ""
        print(f"    largest batch, {label}: {m.get('largest', m.get('predicted'))}"
              f" ({m.get('per_image_bytes', 0) / MB:.1f} MB per image; predicted"
              f" {m.get('predicted')}{compiled})")
      if "zero1_state_ratio" in memory:
        print(f"    shard_optimizer / allreduce optimizer state per GPU:"
              f" {memory['zero1_state_ratio']:.4f}")


def summary(results: dict) -> str:
  """The last line: ResNet-50 on the first target (8 H200), ratios and batches.

  Example:
    >>> r = {"targets": {"1x8xH200": {"xla": {"sync_bn_allreduce_fp32": {"overlap": 1.0},
    ...      "sync_bn_double_buffering_fp32": {"overlap": 1.0}}, "plain_jax": {"overlap": 0.99},
    ...      "memory": {"zero1_state_ratio": 0.125, "max_batch": {
    ...      "allreduce_adam": {"largest": 900}, "shard_optimizer_adam": {"largest": 902}}}}}}
    >>> summary(r).split()[2:]
    ['overlap_backprop=1.000', 'overlap_double_buffering=1.000', 'overlap_plain_jax=0.990',
     'zero1_state_ratio=0.125', 'max_batch_allreduce=900', 'max_batch_shard=902']
  """
  first = next(iter(results["targets"].values()))
  xla, memory = first["xla"], first.get("memory", {})

  def share(r):
    return f"{r['overlap']:.3f}" if "overlap" in r else "nan"

  def batch(label):
    m = memory.get("max_batch", {}).get(label, {})
    return m.get("largest", m.get("predicted", -1)) or -1

  ratio = memory.get("zero1_state_ratio")
  return ("aot summary: "
          f"overlap_backprop={share(xla['sync_bn_allreduce_fp32'])} "
          f"overlap_double_buffering={share(xla['sync_bn_double_buffering_fp32'])} "
          f"overlap_plain_jax={share(first['plain_jax'])} "
          f"zero1_state_ratio={'nan' if ratio is None else f'{ratio:.3f}'} "
          f"max_batch_allreduce={batch('allreduce_adam')} "
          f"max_batch_shard={batch('shard_optimizer_adam')}")
