"""The course's layouts written as JAX shardings on fake CPU devices, beside shardlib's (lesson 09).

JAX's style (https://docs.jax.dev/en/latest/sharded-computation.html): annotate where each array
lives (`NamedSharding(mesh, PartitionSpec(...))`), jit the plain single-device step, and let the
compiler (XLA's SPMD partitioner, GSPMD: Xu et al., arXiv 2105.04663) insert the collectives. This
module writes four layouts of one two-layer MLP (x (B, d) -> W1 (k, d) -> GELU -> W2 (d, k), weights
stored as torch stores them, so that the same numbers load into both), trains it with SGD, and reads
the collectives back out of the compiled program (`compiled.as_text()`):

    layout  mesh (axes)            batch      W1, b1            W2, b2
    dp      data: N                P("data")  P()               P()
    fsdp    data: N                P("data")  P("data", None)   P("data", None)
    tp      model: N               P()        P("model", None)  P(None, "model")
    2d      data: 2, model: N/2    P("data")  P("model", None)  P(None, "model")

Per device and step, Psi = 2dk + k + d: dp holds Psi and all-reduces its gradients (Psi elements,
plus the loss); fsdp holds Psi/N and gathers weights, reduces gradients as the compiler chooses;
tp holds (2dk + k)/N + d and all-reduces the row layer's partial output (B d elements, forward);
2d holds (2dk + k)/(N/2) + d, all-reduces (B/2) d within "model" and its gradients within "data".

The device count is fixed when JAX starts its backend: `set_cpu_devices(8)` must run before any JAX
computation (in a notebook: the first cell). A process that forks torch ranks must not have started
JAX's threads first; the checks therefore run JAX in a process of its own (`run_in_subprocess`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import numpy as np

__all__ = [
    "LAYOUTS",
    "count_collectives",
    "init_params",
    "jax_summary",
    "layout_specs",
    "make_batch",
    "make_mesh",
    "run_in_subprocess",
    "run_layout",
    "set_cpu_devices",
    "shardlib_ledgers",
    "torch_reference",
]

LAYOUTS = ("dp", "fsdp", "tp", "2d")
D, K, BATCH, LR = 32, 128, 16, 0.1  # d model width, k hidden width, global batch, SGD step


def set_cpu_devices(n: int) -> None:
    """Ask for n CPU devices; raises with what to do when JAX has already started with another count."""
    import jax

    try:
        jax.config.update("jax_num_cpu_devices", n)  # read when the backend starts
    except RuntimeError as error:  # JAX has computed something already: its device count is fixed
        if len(jax.devices()) == n:
            return
        raise RuntimeError(f"JAX already started with {len(jax.devices())} device(s), so it cannot have {n}: "
                           "restart the kernel and run this first, before any JAX computation "
                           "(or set XLA_FLAGS=--xla_force_host_platform_device_count=N before starting Python)") from error


def make_mesh(layout: str, n: int):
    """The layout's mesh over the first n devices, axes of the Auto type (the compiler places collectives)."""
    import jax
    from jax.sharding import AxisType

    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if len(jax.devices()) < n:
        raise RuntimeError(f"{n} devices wanted, JAX has {len(jax.devices())}: call set_cpu_devices({n}) first")
    shape, names = {"dp": ((n,), ("data",)), "fsdp": ((n,), ("data",)), "tp": ((n,), ("model",)),
                    "2d": ((2, n // 2), ("data", "model"))}[layout]
    if layout == "2d" and n % 2:
        raise ValueError(f"the 2-D layout needs an even number of devices, got {n}")
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names), devices=jax.devices()[:n])


def layout_specs(layout: str) -> tuple[dict, object]:
    """(PartitionSpec of each weight, PartitionSpec of the batch) for a layout."""
    from jax.sharding import PartitionSpec as P

    replicated = {"w1": P(), "b1": P(), "w2": P(), "b2": P()}
    tp = {"w1": P("model", None), "b1": P("model"), "w2": P(None, "model"), "b2": P()}  # column then row
    return {"dp": (replicated, P("data")),
            "fsdp": ({"w1": P("data", None), "b1": P("data"), "w2": P("data", None), "b2": P("data")}, P("data")),
            "tp": (tp, P()),
            "2d": (tp, P("data"))}[layout]


def init_params(seed: int = 0) -> dict[str, np.ndarray]:
    """The weights of torch's nn.Linear(D, K), nn.Linear(K, D) from `seed`, as numpy (torch's (out, in) layout)."""
    import torch

    torch.manual_seed(seed)
    fc, proj = torch.nn.Linear(D, K), torch.nn.Linear(K, D)
    return {"w1": fc.weight.detach().numpy().copy(), "b1": fc.bias.detach().numpy().copy(),
            "w2": proj.weight.detach().numpy().copy(), "b2": proj.bias.detach().numpy().copy()}


def make_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    g = np.random.default_rng(1000 + step)
    x = g.standard_normal((BATCH, D), dtype=np.float32)  # (B, d)
    return x, np.tanh(x @ g.standard_normal((D, D), dtype=np.float32))  # (B, d)


def _loss(params, x, y):
    import jax
    import jax.numpy as jnp

    h = jax.nn.gelu(x @ params["w1"].T + params["b1"], approximate=False)  # (B, k), torch's exact GELU
    out = h @ params["w2"].T + params["b2"]  # (B, d)
    return jnp.mean((out - y) ** 2)


def _sgd_step(params, x, y):
    import jax

    loss, grads = jax.value_and_grad(_loss)(params, x, y)
    return loss, jax.tree.map(lambda p, g: p - LR * g, params, grads)


_COLLECTIVE = re.compile(r"=\s*(?P<shape>\(.*?\)|\S+)\s+(?P<kind>all-reduce|all-gather|reduce-scatter|all-to-all|"
                         r"collective-permute)(?:-start)?\(")
_SHAPE = re.compile(r"[a-z]+\d*\[([\d,]*)\]")


def _group_size(line: str) -> int:
    explicit = re.search(r"replica_groups=\{\{([\d,]+)\}", line)
    if explicit:
        return len(explicit.group(1).split(","))
    mesh = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", line)  # mesh['axis_0'=2,...] {'axis_0'}
    if mesh:
        sizes = dict(re.findall(r"'(\w+)'=(\d+)", mesh.group(1)))
        return int(np.prod([int(sizes[a]) for a in re.findall(r"'(\w+)'", mesh.group(2))]))
    return 0


def count_collectives(hlo_text: str) -> list[dict]:
    """The collectives of a compiled (optimized) HLO module: kind, elements per device, group size.

    elements counts what shardlib's ledger calls a call's bytes (/4): the result of an all-reduce or
    all-gather, the input of a reduce-scatter (its result times the group size).
    """
    found = []
    for line in hlo_text.splitlines():
        match = _COLLECTIVE.search(line)
        if not match or "-done" in line.split("=")[0]:
            continue
        elements = sum(int(np.prod([int(s) for s in dims.split(",") if s] or [1]))
                       for dims in _SHAPE.findall(match.group("shape")))
        group = _group_size(line)
        if match.group("kind") == "reduce-scatter":
            elements *= group
        found.append({"kind": match.group("kind").replace("-", "_"), "elements": elements, "group": group})
    return found


def run_layout(layout: str, n: int, steps: int = 3, seed: int = 0) -> dict:
    """Train `steps` SGD steps under `layout` on n devices: losses, final weights, compiled collectives."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = make_mesh(layout, n)
    weight_specs, batch_spec = layout_specs(layout)
    weights = {name: NamedSharding(mesh, spec) for name, spec in weight_specs.items()}
    batch = NamedSharding(mesh, batch_spec)
    step = jax.jit(_sgd_step, in_shardings=(weights, batch, batch), out_shardings=(NamedSharding(mesh, P()), weights))
    params = {name: jax.device_put(v, weights[name]) for name, v in init_params(seed).items()}
    compiled = step.lower(params, *make_batch(0)).compile()
    losses = []
    for i in range(steps):
        loss, params = compiled(params, *make_batch(i))
        losses.append(float(loss))
    per_device = {name: int(np.prod(v.addressable_shards[0].data.shape)) for name, v in params.items()}
    return {"layout": layout, "devices": n, "losses": losses,
            "params": {name: np.asarray(v).tolist() for name, v in params.items()},
            "collectives": count_collectives(compiled.as_text()), "params_per_device": per_device}


def torch_reference(steps: int = 3, seed: int = 0) -> dict:
    """The same training on one device with torch: the reference every layout is held against."""
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(D, K), torch.nn.GELU(), torch.nn.Linear(K, D))
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for i in range(steps):
        x, y = (torch.from_numpy(a) for a in make_batch(i))
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    names = {"0.weight": "w1", "0.bias": "b1", "2.weight": "w2", "2.bias": "b2"}
    return {"losses": losses, "params": {names[k]: v.detach().numpy() for k, v in model.state_dict().items()}}


def run_in_subprocess(layout: str | tuple[str, ...], n: int, steps: int = 3, timeout: float = 240) -> dict:
    """run_layout in a fresh Python with n CPU devices (what a process that forks torch ranks must use).
    Several layouts, one Python (JAX starts once): {layout: run_layout's result}."""
    layouts = (layout,) if isinstance(layout, str) else tuple(layout)
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    command = [sys.executable, "-m", "shardlib.lessons.jax_sharding", ",".join(layouts), str(n), str(steps)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    if done.returncode:
        raise RuntimeError(f"JAX run of layouts {layouts} on {n} devices failed:\n{done.stderr[-3000:]}")
    runs = json.loads(done.stdout.splitlines()[-1])
    return runs[layout] if isinstance(layout, str) else runs


# ---------------------------------------------------------------------------------
# the same layouts with shardlib on torch ranks (run before JAX starts: forking after it is unsafe)


def _shardlib_layout_on_rank(layout: str) -> dict:
    import torch
    import torch.distributed as dist

    from shardlib.comm import comm_ledger
    from shardlib.launch import current_device
    from shardlib.mesh import Mesh
    from shardlib.parallel.ddp import all_reduce_gradients
    from shardlib.parallel.fsdp import fully_shard
    from shardlib.parallel.tensor import ColumnParallelLinear, RowParallelLinear

    n, rank, device = dist.get_world_size(), dist.get_rank(), current_device()
    weights = {k: torch.from_numpy(v) for k, v in init_params().items()}
    model = torch.nn.Sequential(torch.nn.Linear(D, K), torch.nn.GELU(), torch.nn.Linear(K, D))
    model.load_state_dict({"0.weight": weights["w1"], "0.bias": weights["b1"],
                           "2.weight": weights["w2"], "2.bias": weights["b2"]})
    model.to(device)
    x, y = (torch.from_numpy(a).to(device) for a in make_batch(0))  # (B, d) each
    mesh = Mesh((2, n // 2), ("data", "model")) if layout == "2d" else None
    if layout in ("tp", "2d"):
        group = mesh.group("model") if mesh else None
        model = torch.nn.Sequential(ColumnParallelLinear.from_linear(model[0], group=group), torch.nn.GELU(),
                                    RowParallelLinear.from_linear(model[2], group=group)).to(device)
    if layout == "fsdp":
        fully_shard(model)
    replicas, index = {"dp": (n, rank), "fsdp": (n, rank), "tp": (1, 0), "2d": (2, mesh.rank("data") if mesh else 0)}[layout]
    rows = slice(index * BATCH // replicas, (index + 1) * BATCH // replicas)  # this replica's share of the batch
    with comm_ledger() as ledger:
        loss = torch.nn.functional.mse_loss(model(x[rows]), y[rows])  # (B/replicas, d)
        loss.backward()
        if layout in ("dp", "2d"):
            all_reduce_gradients(model, group=mesh.group("data") if mesh else None)
    return ledger.summary()


def shardlib_ledgers(n: int, device: str = "auto") -> dict:
    """{layout: rank 0's ledger summary of one training step} with shardlib's techniques on n torch ranks."""
    from shardlib.launch import launch

    return {layout: launch(_shardlib_layout_on_rank, n, args=(layout,), timeout=120, device=device)[0]
            for layout in LAYOUTS}


def jax_summary(collectives: list[dict]) -> dict:
    """count_collectives' list as a ledger summary: {kind: {"calls", "bytes"}} (fp32: 4 bytes per element)."""
    table = {}
    for c in collectives:
        row = table.setdefault(c["kind"], {"calls": 0, "bytes": 0})
        row["calls"] += 1
        row["bytes"] += 4 * c["elements"]
    return table


if __name__ == "__main__":  # python -m shardlib.lessons.jax_sharding LAYOUT[,LAYOUT...] N STEPS -> one JSON line
    layouts_arg, n_arg, steps_arg = sys.argv[1].split(","), int(sys.argv[2]), int(sys.argv[3])
    set_cpu_devices(n_arg)
    print(json.dumps({layout: run_layout(layout, n_arg, steps_arg) for layout in layouts_arg}))
