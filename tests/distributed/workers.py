"""Worker functions for the spawned core tests: each runs on every rank as fn(local_rank, ...)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.utils.data import TensorDataset

import hydraddp.distributed as idist

GLOBAL_BATCH = 16


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))


def dataset(n: int = 128) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded fp32 parameters under clean names, whatever the wrapper (a collective)."""
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.detach().float().clone() for k, v in state.items()}


def train_parity(local_rank: int, wrap: str | None, precision: str, optim: str = "sgd", steps: int = 5,
                 model_kwargs: dict | None = None) -> dict:
    """A few steps on the same data and global batch: per-step global losses and final full parameters."""
    model = idist.auto_model(mlp(), wrap=wrap, precision=precision, **(model_kwargs or {}))
    if optim == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    optimizer = idist.auto_optim(optimizer)
    loader = idist.auto_dataloader(dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
    losses = []
    for step, (x, y) in zip(range(steps), loader):
        x, y = x.to(idist.device()), y.to(idist.device())
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(idist.all_reduce(loss.item()) / idist.get_world_size())
    report = idist.wrap_report(model, optimizer).to_dict()
    return {"losses": losses, "params": full_params(model), "report": report, "type": type(model).__name__}


def train_cases(local_rank: int, cases: list[tuple]) -> dict[tuple, dict]:
    """Several ``train_parity`` runs in one process group: (wrap, precision, optim) -> result."""
    return {case: train_parity(local_rank, *case) for case in cases}


def _step(model: nn.Module, batch: torch.Tensor, target: torch.Tensor, optimizer: torch.optim.Optimizer) -> float:
    loss = nn.functional.cross_entropy(model(batch).flatten(0, -2), target.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def wrap_units(local_rank: int, cases: dict[str, tuple[str, dict]]) -> dict[str, dict]:
    """name -> (wrap, auto_model kwargs): wrap a tiny transformer, take one step, return the WrapReport."""
    from tests.distributed.models import tiny_transformer

    out = {}
    for name, (wrap, kwargs) in cases.items():
        model = idist.auto_model(tiny_transformer(depth=3), wrap=wrap, **kwargs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        tokens = torch.randint(0, 50, (4, 6), generator=torch.Generator().manual_seed(idist.get_rank()))
        _step(model, tokens, tokens, optimizer)
        out[name] = idist.wrap_report(model, optimizer).to_dict()
    return out


def batchnorm_cases(local_rank: int) -> dict:
    """BatchNorm under bf16: DDP autocast and both FSDPs, which must keep it in its own fp32 unit."""
    from tests.distributed.models import bn_net

    out: dict = {}
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(idist.get_rank()))
    y = torch.randint(0, 4, (8,), generator=torch.Generator().manual_seed(10 + idist.get_rank()))
    for wrap in ("ddp", "fsdp", "fsdp2"):
        model = idist.auto_model(bn_net(), wrap=wrap, precision="bf16")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = [_step(model, x, y, optimizer) for _ in range(3)]
        bn = next(m for m in model.modules() if isinstance(m, nn.BatchNorm1d))
        out[wrap] = {"report": idist.wrap_report(model).to_dict(), "losses": losses,
                     "bn_running_mean_dtype": str(bn.running_mean.dtype)}
    return out


def error_cases(local_rank: int) -> dict[str, str]:
    """Each misuse the core must refuse, with the message it gives."""
    from hydraddp.distributed import ConfigurationError

    attempts = {
        "offload": lambda: idist.auto_model(mlp(), wrap="fsdp2", offload="cpu"),
        "fp16": lambda: idist.auto_model(mlp(), wrap="ddp", precision="fp16"),
        "dp_with_process_group": lambda: idist.auto_model(mlp(), wrap="dp"),
        "unknown_wrap": lambda: idist.auto_model(mlp(), wrap="zero3"),
        "sync_bn_on_cpu": lambda: idist.auto_model(mlp(), sync_bn=True, wrap="ddp"),
    }

    def optimizer_before_wrapping(wrap):
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        idist.auto_model(model, wrap=wrap)
        idist.auto_optim(optimizer)

    attempts["optimizer_before_fsdp"] = lambda: optimizer_before_wrapping("fsdp")
    attempts["optimizer_before_fsdp2"] = lambda: optimizer_before_wrapping("fsdp2")
    out = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            out[name] = "no error"
        except ConfigurationError as exc:
            out[name] = str(exc)
    # The supported order passes: wrap, then create the optimizer.
    model = idist.auto_model(mlp(), wrap="fsdp2")
    idist.auto_optim(torch.optim.SGD(model.parameters(), lr=0.1))
    return out


def ignite_choice(local_rank: int) -> dict[str, str]:
    """The wrapper ignite's auto_model picks and the one ours picks with wrap=None, in the same process."""
    import ignite.distributed as ignite_idist

    return {
        "ignite": type(ignite_idist.auto_model(mlp())).__name__,
        "hydraddp": type(idist.auto_model(mlp())).__name__,
        "use_fsdp": idist.wrap_report(idist.auto_model(mlp(), use_fsdp=True)).wrapper if idist.get_world_size() > 1 else "",
    }


def collectives(local_rank: int) -> dict:
    rank = idist.get_rank()
    return {
        "rank": rank,
        "local_rank": local_rank,
        "world_size": idist.get_world_size(),
        "nproc_per_node": idist.get_nproc_per_node(),
        "nnodes": idist.get_nnodes(),
        "node_rank": idist.get_node_rank(),
        "backend": idist.backend(),
        "device": str(idist.device()),
        "sum_int": idist.all_reduce(rank + 1),
        "max_float": idist.all_reduce(float(rank) * 2.5, "max"),
        "avg_tensor": idist.all_reduce(torch.tensor([float(rank), 2.0]), "average").tolist(),
        "gather_tensor": idist.all_gather(torch.tensor([rank, rank])).tolist(),
        "gather_number": idist.all_gather(rank * 10),
        "gather_str": idist.all_gather(f"r{rank}"),
        "gather_dict": idist.all_gather({"rank": rank}),
        "broadcast_tensor": idist.broadcast(torch.tensor([rank + 7]), src=1).tolist(),
        "broadcast_str": idist.broadcast(f"from{rank}", src=0),
        "broadcast_safe": idist.broadcast("only-src" if rank == 0 else None, src=0, safe_mode=True),
        "threads": torch.get_num_threads(),
        "omp_env": __import__("os").environ.get("OMP_NUM_THREADS"),
    }


def dataloader_shards(local_rank: int) -> dict:
    loader = idist.auto_dataloader(dataset(40), batch_size=8, num_workers=0, shuffle=True)
    epochs = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)  # as with ignite: the user moves the sampler to the next epoch
        epochs.append([int(i) for i in loader.sampler])
    first_batch = next(iter(loader))[0]
    return {"loader_type": type(loader).__name__, "sampler": type(loader.sampler).__name__,
            "per_rank_batch": loader.batch_size, "first_batch_rows": first_batch.shape[0], "epochs": epochs,
            "pin_memory": loader.pin_memory}


def fail_on_rank(local_rank: int, failing_rank: int) -> None:
    if idist.get_rank() == failing_rank:
        raise ValueError(f"boom on rank {failing_rank}")
    idist.barrier()  # the healthy rank waits for the failed one: the agent must still stop it


def never_ending_thread_forever() -> None:
    import threading

    threading.Event().wait()


def leave_a_thread_that_never_ends(local_rank: int, grace_s: float) -> int:
    """Return, leaving a non-daemon thread that never ends: the process's exit would join it for good."""
    import threading

    from hydraddp.distributed import elastic

    elastic.EXIT_GRACE_S = grace_s
    threading.Thread(target=never_ending_thread_forever, name="never-ends").start()
    return local_rank


def sleep_forever(local_rank: int, marker_dir: str) -> None:
    import pathlib
    import time

    pathlib.Path(marker_dir, f"started-{idist.get_rank()}").touch()
    while True:
        time.sleep(0.1)


def seed_plus_rank(local_rank: int, wrap: str | None) -> dict:
    """ignite-style init: each rank seeds with seed + rank before building the model; then 5 SGD steps."""
    torch.manual_seed(1234 + idist.get_rank())
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    built = {k: v.detach().clone() for k, v in model.state_dict().items()}
    model = idist.auto_model(model, wrap=wrap)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = idist.auto_dataloader(dataset(), batch_size=GLOBAL_BATCH, shuffle=False)
    losses = []
    for _, (x, y) in zip(range(5), loader):
        loss = nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(idist.all_reduce(loss.item()) / idist.get_world_size())
    return {"built": built, "losses": losses, "params": full_params(model)}


def copies_and_pickles(local_rank: int, cases: list[tuple[str, str]]) -> dict:
    """For each (wrap, precision): deepcopy, AveragedModel and torch.save/load of the wrapped model and of its
    inner module, next to the same operation on the same wrapper made by plain torch (no precision).

    Each outcome is "ok" with the copy's output equal to the original's (and fp32 when the original's is),
    or the error; the plain torch outcome says whether torch itself permits the operation.
    """
    import copy
    import io

    from torch.optim.swa_utils import AveragedModel

    def save_load(module):
        buffer = io.BytesIO()
        torch.save(module, buffer)
        buffer.seek(0)
        return torch.load(buffer, weights_only=False)

    ops = {"deepcopy": copy.deepcopy, "AveragedModel": AveragedModel, "torch.save": save_load}
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    out = {}
    for wrap, precision in cases:
        ours = idist.auto_model(mlp(), wrap=wrap, precision=precision)
        plain = idist.auto_model(mlp(), wrap=wrap)  # fp32: no hooks of hydraddp's, only torch's wrapper
        for target in ("wrapped", "inner"):
            pick = (lambda m: m) if target == "wrapped" else (lambda m: getattr(m, "module", m))
            try:
                with torch.no_grad():
                    expected = pick(ours)(x)
            except Exception as exc:  # e.g. FSDP1's inner module cannot run outside its wrapper
                expected = exc
            for op_name, op in ops.items():
                if isinstance(expected, Exception):
                    out[(wrap, precision, target, op_name)] = {"torch_permits": False, "output_dtype": None,
                                                               "ours": f"original fails: {expected}"}
                    continue
                try:
                    with torch.no_grad():
                        op(pick(plain))(x)
                    torch_permits = True
                except Exception:
                    torch_permits = False
                try:
                    copied = op(pick(ours))
                    with torch.no_grad():
                        got = copied(x)
                        for param in copied.parameters():
                            param.zero_()  # a copy that computes with its own weights now outputs zeros
                        zeroed = copied(x)
                    if not (torch.equal(got, expected) and got.dtype == expected.dtype):
                        outcome = f"differs: {got.dtype} vs {expected.dtype}, {(got.float() - expected.float()).abs().max()}"
                    elif zeroed.abs().max() != 0:
                        outcome = "the copy computes with the original's weights"
                    else:
                        outcome = "ok"
                except Exception as exc:
                    outcome = f"{type(exc).__name__}: {exc}"
                out[(wrap, precision, target, op_name)] = {"torch_permits": torch_permits, "ours": outcome,
                                                           "output_dtype": str(expected.dtype)}
    return out


def given_samplers(local_rank: int) -> dict:
    """auto_dataloader with the samplers a user may pass: ignite's rules for each."""
    import warnings

    from torch.utils.data import DistributedSampler, WeightedRandomSampler

    rank, world = idist.get_rank(), idist.get_world_size()
    data = dataset(10)
    own = idist.auto_dataloader(data, batch_size=2, sampler=DistributedSampler(data, num_replicas=world, rank=rank,
                                                                               shuffle=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        idist.auto_dataloader(data, sampler=DistributedSampler(data, num_replicas=world, rank=(rank + 1) % world))
        idist.auto_dataloader(data, sampler=DistributedSampler(data, num_replicas=world + 1, rank=rank))
    weighted = idist.auto_dataloader(data, batch_size=4, sampler=WeightedRandomSampler([1.0] * 10, 10))
    uneven = idist.auto_dataloader(data, batch_size=5)
    tiny = idist.auto_dataloader(data, batch_size=1)
    return {"own_indices": list(own.sampler),
            "own_sampler_kept": type(own.sampler).__name__, "warnings": [str(w.message) for w in caught],
            "weighted_sampler": type(weighted.sampler).__name__, "weighted_indices": list(weighted.sampler),
            "uneven_batch": uneven.batch_size, "tiny_batch": tiny.batch_size}


def groups_and_broadcast(local_rank):
    """ignite's group= and broadcast rules on a real 2-rank gloo group (tests/distributed/test_ignite_api.py)."""
    rank = idist.get_rank()

    def error_of(call):
        try:
            call()
        except (TypeError, ValueError) as exc:
            return str(exc)
        return None

    # A group is made by every rank (torch's rule); only its members then use it.
    pair, only_rank1 = idist.new_group([0, 1]), idist.new_group([1])
    result = {
        "group_sum": idist.all_reduce(torch.tensor([rank]), group=only_rank1).tolist() if rank == 1 else None,
        "list_group_sum": idist.all_reduce(torch.tensor([rank + 1]), group=[0, 1]).tolist(),
        "group_gather": idist.all_gather(torch.tensor(rank), group=pair).tolist(),
        "objects_in_group": idist.all_gather({"r": rank}, group=[0, 1]),
        # rank 0 is outside the group: it gets its own tensor back, as in ignite
        "outside_gather": idist.all_gather(torch.tensor([rank]), group=only_rank1).tolist(),
    }
    result["broadcast_none"] = error_of(lambda: idist.broadcast(None, src=0))
    result["broadcast_number"] = idist.broadcast(5 if rank == 0 else None, src=0, safe_mode=True)
    result["broadcast_list"] = error_of(lambda: idist.broadcast([0, 1], src=0))
    result["bad_group"] = (error_of(lambda: idist.all_reduce(torch.tensor([rank]), group="abc")) or "")[:52]
    idist.barrier()
    return result
