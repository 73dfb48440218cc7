"""Helpers of the tensor-parallel tests: a small transformer-ish block, its tp plan, rank workers.

Workers are module-level functions so spawned gloo ranks can import them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

WIDTH, HEADS, SEQ = 8, 2, 3


class Attention(nn.Module):
    """Self-attention on q/k/v/o Linear layers; the head count follows the local width (tp-agnostic)."""

    def __init__(self, width: int = WIDTH, heads: int = HEADS):
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v, self.o = (nn.Linear(width, width) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape

        def heads(t):
            return t.view(batch, seq, -1, self.head_dim).transpose(1, 2)

        q, k, v = heads(self.q(x)), heads(self.k(x)), heads(self.v(x))
        scores = (q @ k.transpose(-1, -2)) / self.head_dim**0.5
        mixed = (scores.softmax(-1) @ v).transpose(1, 2).reshape(batch, seq, -1)
        return self.o(mixed)


class MLP(nn.Module):
    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.fc1 = nn.Linear(width, 2 * width)
        self.fc2 = nn.Linear(2 * width, width)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block: LayerNorm, attention, LayerNorm, MLP, residuals."""

    def __init__(self, width: int = WIDTH):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = Attention(width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


def tp_plan() -> dict:
    """Megatron-style: q/k/v and fc1 column-wise, o and fc2 row-wise (the block's own names)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(),
        "mlp.fc2": RowwiseParallel(),
    }


def parallelize(layer: nn.Module, mesh) -> nn.Module:
    """The Pipeline's ``parallelize=`` hook: blocks get the tp plan on the mesh's "tp" dimension."""
    from torch.distributed.tensor.parallel import parallelize_module

    if not isinstance(layer, Block):
        return layer
    tp = mesh["tp"] if mesh.mesh_dim_names and "tp" in mesh.mesh_dim_names else mesh
    return parallelize_module(layer, tp, tp_plan())


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (collective over its mesh); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


# -- rank workers ----------------------------------------------------------------------------------


def _model(seed: int) -> list[nn.Module]:
    """Three blocks and a head (LayerNorm + Linear), float64."""
    torch.manual_seed(seed)
    head = nn.Sequential(nn.LayerNorm(WIDTH), nn.Linear(WIDTH, WIDTH))
    return [Block().double(), Block().double(), Block().double(), head.double()]


def _batch(batch: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, SEQ, WIDTH, generator=generator, dtype=torch.float64)
    return x, torch.randn(batch, SEQ, WIDTH, generator=generator, dtype=torch.float64)


def _relative(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error, absolute below a norm of 1e-6 (the key projection's bias gets a gradient
    that is zero in exact arithmetic: softmax ignores a shift of a whole row of scores)."""
    return (actual - expected).norm().item() / max(expected.norm().item(), 1e-6)


def pipeline_cases(schedules: list[str], steps: int, max_norm: float) -> dict:
    """On pp 2 × tp 2: for each schedule, ``steps`` AdamW steps clipped to ``max_norm`` of a
    Pipeline of :func:`_model` with its blocks tensor-parallel, against one process on the whole
    batch.  A schedule written ``"dp:<name>"`` runs on pp 1 × dp 2 × tp 2 instead: replicated
    tensor-parallel stages, each replica on its half of the batch.  Returns, per schedule, the
    worst relative error of the gradients (each step) and of the parameters (after the steps), the
    split report of the parallelized Linear layers and the optimizer counters."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerobubble import Pipeline
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=60)
    torch.set_num_threads(1)
    pp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "tp"))
    dp_tp = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    loss_fn = F.mse_loss
    results = {}
    for case, label in enumerate(schedules):
        replicated, schedule = label.startswith("dp:"), label.removeprefix("dp:")
        mesh = dp_tp if replicated else pp_tp
        model = nn.Sequential(*_model(seed=case))
        ref_opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        pipe = Pipeline(
            _model(seed=case),
            schedule=schedule,
            microbatches=4,
            loss_fn=loss_fn,
            mesh=mesh,
            parallelize=parallelize,
            timeout=60,
        )
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.05, weight_decay=0.1)
        grad_error = param_error = 0.0
        worst = None
        for step in range(steps):
            x, y = _batch(8, seed=100 + step)
            loss_fn(model(x), y).backward()
            shard = (
                slice(4 * pipe.layout.grid.dp_index, 4 * pipe.layout.grid.dp_index + 4)
                if replicated
                else slice(None)
            )
            expected = {n: p.grad.clone() for n, p in model.named_parameters()}
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            ref_opt.step()
            ref_opt.zero_grad(set_to_none=True)
            pipe.step(x[shard], y[shard])
            for name, param in pipe.named_parameters():  # every tp rank in the same order: full()
                error = _relative(full(param.grad), expected[name])
                if error > grad_error:
                    worst = (step, name, error)
                grad_error = max(grad_error, error)
            pipe.optimizer_step(optimizer, max_norm=max_norm)
            optimizer.zero_grad(set_to_none=True)
        pipe.synchronize()
        wanted = dict(model.named_parameters())
        for name, param in pipe.named_parameters():
            param_error = max(param_error, _relative(full(param.detach()), wanted[name].detach()))
        report = sorted(
            {(r.module, r.type, r.path, r.verified) for r in pipe.split_report() if r.type == "Linear"}
        )
        stats = pipe.optimizer_stats
        results[label] = {
            "grads": grad_error,
            "worst": worst if grad_error > 0 else None,
            "params": param_error,
            "report": report,
            "clipped": stats.clipped,
            "steps": stats.steps,
            "rolled_back": stats.rolled_back,
            "dtensors": sorted(n for n, p in pipe.named_parameters() if type(p).__name__ == "DTensor"),
        }
    return results


def split_cases() -> dict:
    """On a 2-rank tp mesh: one :class:`Block` parallelized, split by each path (fast paths, the
    generic split alone, routed calls), as a first or a middle stage, B then W or a fused BW, against
    the unparallelized block under plain autograd.  Also the split guard (strict) on it, the
    parameters' hooks and the optimizer's local norm state of DTensor gradients."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh

    from zerobubble.runtime.construct.staging import StageModule
    from zerobubble.runtime.launch import init_distributed
    from zerobubble.runtime.optim.post_validation import local_state
    from zerobubble.runtime.wgrad import (
        FastPaths,
        SplitGuard,
        WeightGradStore,
        default_fast_paths,
        install_deferral,
    )

    init_distributed(backend="gloo", timeout=60)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    registries = {
        "fast": default_fast_paths,
        "generic": FastPaths,
        "routed": lambda: FastPaths(route_linear=True),
    }
    results: dict = {}
    for kind, registry in registries.items():
        for first in (True, False):
            for defer in (True, False):
                torch.manual_seed(0)
                block = Block().double()
                plain = copy.deepcopy(block)
                split = parallelize(copy.deepcopy(block), mesh)
                store = WeightGradStore()
                deferral = install_deferral([split], store, registry())
                stage = StageModule([split])
                guard = SplitGuard(
                    stage=0, module=stage, store=store, deferral=deferral, strict=True,
                    names={id(m): n for n, m in stage.named_modules()}, deferred=defer, fused=not defer,
                )  # fmt: skip
                hooks = []
                for param in split.parameters():
                    param.register_post_accumulate_grad_hook(lambda p, fired=hooks: fired.append(1))
                generator = torch.Generator().manual_seed(1)
                case: dict = {"early": [], "input": 0.0}
                for j in range(2):
                    x = torch.randn(2, SEQ, WIDTH, generator=generator, dtype=torch.float64)
                    g = torch.randn(2, SEQ, WIDTH, generator=generator, dtype=torch.float64)
                    local, reference = (x.clone().requires_grad_(not first) for _ in range(2))
                    guard.before_forward((local,))
                    with store.keyed_forward((0, j)):
                        out = stage(local)
                    store.begin((0, j), defer)
                    out.backward(g)
                    store.end()
                    if defer and j == 0:
                        case["early"] = [n for n, p in split.named_parameters() if p.grad is not None]
                    if defer:
                        store.flush((0, j))
                    plain(reference).backward(g)
                    if not first:
                        case["input"] = max(case["input"], _relative(local.grad, reference.grad))
                expected = dict(plain.named_parameters())
                case["grads"] = max(
                    _relative(full(p.grad), expected[n].grad) for n, p in split.named_parameters()
                )
                case["placements"] = all(
                    p.grad.placements == p.placements for p in split.parameters() if hasattr(p, "placements")
                )
                case["dtensors"] = sum(hasattr(p, "placements") for p in split.parameters())
                case["hooks"] = len(hooks) / (2 * len(list(split.parameters())))  # once a param, a microbatch
                case["paths"] = sorted({path for _, path in deferral.paths()})
                case["verified"] = all(record.verified for record in guard.report()) and not deferral.fallen
                results[(kind, first, defer)] = case
    # the optimizer's state of DTensor gradients: the norm of the full tensors, a non-finite flag
    grads = [p.grad for p in split.parameters()]
    want = torch.stack([full(g).norm() for g in grads]).pow(2).sum()
    state = local_state(grads, 2.0, torch.device("cpu"))
    results["norm"] = (abs(state[0].item() - want.item()) / want.item(), state[1].item())
    shard = split.attn.q.weight.grad.to_local()  # a DTensor gradient: an inf in rank 1's shard only
    shard[0, 0] = float("inf") if torch.distributed.get_rank() == 1 else 0.0
    results["nonfinite"] = local_state(grads, 2.0, torch.device("cpu"))[1].item()
    return results


def three_d_cases(schedules: list[str], steps: int, max_norm: float) -> dict:
    """On pp 2 × dp 2 × tp 2 (8 ranks) with ``data_parallel="fsdp"``: FSDP2 over the tensor-parallel
    blocks, per schedule (:func:`_sharded_steps`)."""
    from torch.distributed.device_mesh import init_device_mesh

    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=120)
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    return {
        schedule: _sharded_steps(mesh, "fsdp", parallelize, schedule, case, steps, max_norm)
        for case, schedule in enumerate(schedules)
    }


def hsdp_cases(schedules: list[str], steps: int, max_norm: float) -> dict:
    """On pp 2 × dp_replicate 2 × dp_shard 2 (8 ranks) with ``data_parallel="hsdp"``, no tensor
    parallelism, per schedule (:func:`_sharded_steps`)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp_replicate", "dp_shard"))
    return {
        schedule: _sharded_steps(mesh, "hsdp", None, schedule, case, steps, max_norm)
        for case, schedule in enumerate(schedules)
    }


def hsdp_tp_norm_case() -> dict:
    """FSDP2 over tensor parallelism on a 3-D mesh dp_replicate 2 × dp_shard 2 × tp 2 (HSDP + TP,
    the 16-rank pipeline layout without its pipeline dimension): one :class:`Block`'s gradients after
    a backward of the same batch everywhere.  Returns the relative error of the clip's norm state
    (summed over the dp_shard group, as the optimizer does) against the unsharded block's, for the
    2-norm and the max norm, and the gradients' placements."""
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from zerobubble.runtime.optim.post_validation import local_state, reduce_op

    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
    torch.manual_seed(0)
    plain = Block().double()
    block = fully_shard(parallelize(copy.deepcopy(plain), mesh["tp"]), mesh=mesh["dp_replicate", "dp_shard"])
    x = torch.randn(4, SEQ, WIDTH, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    block(x).square().sum().backward()
    plain(x).square().sum().backward()
    grads = [p.grad for p in block.parameters()]
    out: dict = {"placements": sorted({str(g.placements) for g in grads})}
    for norm_type in (2.0, float("inf")):
        state = local_state(grads, norm_type, torch.device("cpu"), shards=True)
        dist.all_reduce(state, op=reduce_op(norm_type), group=mesh.get_group("dp_shard"))
        norms = torch.stack([p.grad.norm(norm_type) for p in plain.parameters()])
        want = norms.max() if norm_type == float("inf") else norms.pow(2).sum()
        out[norm_type] = abs(state[0].item() - want.item()) / want.item()
    return out


def _sharded_steps(mesh, data_parallel: str, parallelize_fn, schedule: str, seed: int, steps: int,
                   max_norm: float) -> dict:  # fmt: skip
    """``steps`` AdamW steps clipped to ``max_norm`` on ``mesh`` against one process on the whole
    batch (each replica steps on its share).  Returns the worst relative error of the parameters
    after the steps, the steps the clip scaled, the parameters' placements, and this rank's bytes of
    parameters, gradients and AdamW state over the replicated stage's."""
    from zerobubble import Pipeline

    model = nn.Sequential(*_model(seed=seed))
    ref_opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    pipe = Pipeline(
        _model(seed=seed), schedule=schedule, microbatches=4, loss_fn=F.mse_loss, mesh=mesh,
        parallelize=parallelize_fn, data_parallel=data_parallel, timeout=120,
    )  # fmt: skip
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.05, weight_decay=0.1)
    rows = 16 // pipe.data_parallel
    share = slice(rows * pipe.layout.grid.dp_index, rows * (pipe.layout.grid.dp_index + 1))
    for step in range(steps):
        x, y = _batch(16, seed=100 + step)
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
        pipe.step(x[share], y[share])
        pipe.optimizer_step(optimizer, max_norm=max_norm)
        held = _held_bytes(pipe, optimizer)  # with this step's gradients and AdamW state
        optimizer.zero_grad(set_to_none=True)
    pipe.synchronize()
    wanted = dict(model.named_parameters())
    errors = {n: _relative(full(p.detach()), wanted[n].detach()) for n, p in pipe.named_parameters()}
    replicated = sum(3 * wanted[n].numel() * wanted[n].element_size() for n in errors)  # p, g, 2·state/2
    return {
        "params": max(errors.values()),
        "clipped": pipe.optimizer_stats.clipped,
        "steps": pipe.optimizer_stats.steps,
        "placements": sorted({str(getattr(p, "placements", "plain")) for _, p in pipe.named_parameters()}),
        "bytes": held / (replicated * 4 / 3),
        "replicas": pipe.data_parallel,
    }


def _held_bytes(pipe, optimizer) -> int:
    """This rank's bytes of parameters, gradients and optimizer state (local shards)."""
    from zerobubble.runtime.tensors import local_value

    total = 0
    for param in pipe.parameters():
        total += local_value(param).numel() * param.element_size()
        if param.grad is not None:
            total += local_value(param.grad).numel() * param.element_size()
        for value in optimizer.state.get(param, {}).values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += local_value(value).numel() * value.element_size()
    return total


SAVED_AT = 2  # clipped AdamW steps before the 3-D checkpoint


def _reference_run(seed: int, max_norm: float) -> tuple[dict, dict]:
    """One process on the whole batch: the state after SAVED_AT steps and after one more."""
    model = nn.Sequential(*_model(seed=seed))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    states = []
    for step in range(SAVED_AT + 1):
        x, y = _batch(16, seed=100 + step)
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states[SAVED_AT - 1], states[SAVED_AT]


def _pipeline_step(pipe, optimizer, step: int, max_norm: float) -> None:
    x, y = _batch(16, seed=100 + step)
    rows = 16 // pipe.data_parallel
    part = slice(rows * pipe.layout.grid.dp_index, rows * (pipe.layout.grid.dp_index + 1))
    pipe.step(x[part], y[part])
    pipe.optimizer_step(optimizer, max_norm=max_norm)
    optimizer.zero_grad(set_to_none=True)


def _distance(state: dict, expected: dict) -> float:
    return max(float((full(state[k]).double() - expected[k]).abs().max()) for k in expected)


def three_d_checkpoint_cases(root: str, max_norm: float) -> dict:
    """A DCP checkpoint of pp 2 × dp 2 (FSDP2) × tp 2 after SAVED_AT clipped AdamW steps, loaded into
    pp 2 × dp 4 (FSDP2, no tensor parallelism) and into the unpipelined model (rank 0, torch's own
    ``set_state_dict``); each takes one more step.  Returns the largest parameter difference from one
    process run uninterrupted, at the checkpoint and after the step."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from zerobubble import Pipeline
    from zerobubble.runtime.launch import init_distributed

    init_distributed(backend="gloo", timeout=120)
    torch.set_num_threads(1)
    saved_state, expected = _reference_run(0, max_norm)
    three = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("pp", "dp", "tp"))
    options = {"microbatches": 4, "loss_fn": F.mse_loss, "data_parallel": "fsdp", "timeout": 120}
    pipe = Pipeline(_model(seed=0), schedule="zb-h1", mesh=three, parallelize=parallelize, **options)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.05, weight_decay=0.1)
    for step in range(SAVED_AT):
        _pipeline_step(pipe, optimizer, step, max_norm)
    out = {"saved": _distance(pipe.full_state_dict(), saved_state)}
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=True)}
    dcp.save(state, checkpoint_id=root)
    del pipe, optimizer, state
    dist.barrier()
    two = init_device_mesh("cpu", (2, 4), mesh_dim_names=("pp", "dp"))
    pipe = Pipeline(_model(seed=1), schedule="1f1b", mesh=two, **options)
    optimizer = torch.optim.AdamW(pipe.parameters(), lr=0.05, weight_decay=0.1)
    state = {"model": pipe.state_dict(), "optim": pipe.optimizer_state_dict(optimizer, flatten=True)}
    dcp.load(state, checkpoint_id=root)
    pipe.load_state_dict(state["model"])
    pipe.load_optimizer_state_dict(optimizer, state["optim"])
    _pipeline_step(pipe, optimizer, SAVED_AT, max_norm)
    out["pp2 dp4"] = _distance(pipe.full_state_dict(), expected)
    if dist.get_rank() == 0:
        flat = StateDictOptions(flatten_optimizer_state_dict=True)
        model = nn.Sequential(*_model(seed=2))
        plain = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
        model_state, optim_state = get_state_dict(model, plain, options=flat)
        loaded = {"model": model_state, "optim": optim_state}
        dcp.load(loaded, checkpoint_id=root, no_dist=True)
        set_state_dict(
            model, plain, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"], options=flat
        )
        x, y = _batch(16, seed=100 + SAVED_AT)
        F.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        plain.step()
        out["unpipelined"] = _distance(model.state_dict(), expected)
    dist.barrier()
    return out


def three_d_all(schedules: list[str], steps: int, max_norm: float, root: str) -> dict:
    """:func:`three_d_cases`, :func:`hsdp_cases`, :func:`hsdp_tp_norm_case` and
    :func:`three_d_checkpoint_cases` in one spawn of 8 ranks."""
    return {
        "steps": three_d_cases(schedules, steps, max_norm),
        "hsdp": hsdp_cases(schedules[:2], steps, max_norm),
        "hsdp tp norm": hsdp_tp_norm_case(),
        "checkpoint": three_d_checkpoint_cases(root, max_norm),
    }
