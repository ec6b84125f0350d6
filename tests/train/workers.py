"""Worker functions for the checkpoint tests (run on every rank as fn(local_rank, ...))."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch
from torch import nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

import hydraddp.distributed as idist
from hydraddp.train import checkpoint
from tests.distributed.workers import mlp


def killed_during_save(local_rank: int, root: str) -> None:
    """Save step 10, then die (SIGKILL, rank 0) in the middle of writing step 20."""
    model = idist.auto_model(mlp(), wrap="fsdp2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    checkpoint.save(Path(root), 10, model, optimizer, {"config": {}})
    real_save = dcp.save

    def save_then_die(state, checkpoint_id, **kwargs):
        real_save(state, checkpoint_id=checkpoint_id, **kwargs)  # the tensors are on disk, the checkpoint is not done
        if idist.get_rank() == 0:
            os.kill(os.getpid(), signal.SIGKILL)

    dcp.save = save_then_die  # checkpoint imports torch.distributed.checkpoint when it saves: it sees this
    checkpoint.save(Path(root), 20, model, optimizer, {"config": {}})


def killed_during_background_save(local_rank: int, root: str) -> None:
    """Save step 10 in the background and finish it, then start step 20 in the background and die (SIGKILL, rank 0)
    while its thread writes: training went on after the state was staged, as checkpoint.async_save does."""
    model = idist.auto_model(mlp(), wrap="fsdp2")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 8)).sum().backward()
    optimizer.step()
    checkpoint.save(Path(root), 10, model, optimizer, {"config": {}}, background=True).finish()
    real_write = FileSystemWriter.write_data

    def write_then_die(self, plan, planner):
        written = real_write(self, plan, planner)
        if idist.get_rank() == 0:
            written.wait()  # this rank's tensors are on disk; the others' and the index may not be
            os.kill(os.getpid(), signal.SIGKILL)
        return written

    FileSystemWriter.write_data = write_then_die
    pending = checkpoint.save(Path(root), 20, model, optimizer, {"config": {}}, background=True)
    model(torch.randn(4, 8)).sum().backward()  # training goes on meanwhile
    pending.finish()


def evaluate_all_digits(local_rank: int) -> dict:
    """The loop's evaluation over all 1797 digits, and the model's FLOPs per token seen before and after FSDP1."""
    from hydraddp.build import flops_per_token
    from hydraddp.data.digits import digits
    from hydraddp.models.gpt import GPT
    from hydraddp.models.mlp import MLP
    from hydraddp.train import data
    from hydraddp.train.evaluation import evaluate

    _, every_digit = digits(eval_fraction=1.0)
    torch.manual_seed(0)
    model = idist.auto_model(MLP())
    metrics, samples = evaluate(model, data.eval_loader(every_digit, 256, 0), idist.device())
    evaluation = (metrics["loss"], metrics["accuracy"], samples)
    torch.manual_seed(0)
    gpt = GPT(depth=2, dim=32, heads=2, seq_len=16)
    bare_flops = flops_per_token(gpt)
    if idist.get_world_size() == 1:
        return {"evaluation": tuple(evaluation), "bare_flops": bare_flops}
    sharded = idist.auto_model(gpt, wrap="fsdp")
    return {"evaluation": tuple(evaluation), "bare_flops": bare_flops, "shard_flops": sharded.module.flops_per_token()}


def no_decay_groups(local_rank: int, wraps: list[str]) -> dict:
    """For each wrap: the names of the parameters in the weight-decay-0 group, and the names expected (every bias
    and norm weight of the bare GPT), both without the wrappers' prefixes."""
    from hydraddp.models.gpt import GPT
    from hydraddp.train.optim import no_decay_names, parameter_groups

    def clean(name):
        for prefix in ("_fsdp_wrapped_module.", "module.", "_orig_mod."):
            name = name.replace(prefix, "")
        return name

    out = {}
    for wrap in wraps:
        torch.manual_seed(0)
        bare = GPT(depth=2, dim=32, heads=2, seq_len=16)
        expected = sorted(name for name, _ in no_decay_names(bare))
        kwargs = {"use_orig_params": True} if wrap == "fsdp" else {}
        if wrap in ("fsdp", "fsdp2"):
            kwargs["block_classes"] = ["GPTBlock"]
        model = idist.auto_model(bare, wrap=wrap, **kwargs)
        decay, exempt = parameter_groups(model, True)
        name_of = {id(p): clean(n) for n, p in model.named_parameters()}
        optimizer = torch.optim.AdamW([decay, exempt], weight_decay=0.1)
        out[wrap] = {"exempt": sorted(name_of[id(p)] for p in exempt["params"]), "expected": expected,
                     "decayed": len(decay["params"]), "total": len(list(model.parameters())),
                     "decays": [group["weight_decay"] for group in optimizer.param_groups]}
    return out


def accumulation(local_rank: int, wraps: list[str], steps: int = 3) -> dict:
    """For each wrap and K in (1, 4): ``steps`` optimizer steps of train_step on the same per-rank batches; the
    final full parameters and, per step, the gradient reductions (all-reduce, reduce-scatter) torch dispatched."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    from hydraddp.models.mlp import MLP
    from hydraddp.train.step import train_step
    from hydraddp.train.tasks import Classification
    from tests.distributed.workers import full_params

    generator = torch.Generator().manual_seed(100 + idist.get_rank())
    batches = [(torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator))
               for _ in range(steps)]
    class CountCollectives(TorchDispatchMode):
        """Every c10d collective torch dispatches (DDP's reducer, FSDP's reduce-scatters), by name."""

        def __init__(self):
            super().__init__()
            self.counts = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "c10d":
                self.counts[func.__name__] += 1
            return func(*args, **(kwargs or {}))

    out = {}
    for wrap in wraps:
        for accumulate in (1, 4):
            torch.manual_seed(0)
            model = idist.auto_model(MLP(hidden=[32]), wrap=wrap)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
            reductions = []
            for batch in batches:
                with CountCollectives() as mode:
                    train_step(model, Classification(), batch, optimizer, None, None, False, accumulate)
                reductions.append(sum(n for op, n in mode.counts.items()
                                      if "reduce_scatter" in op or "allreduce" in op))
            out[(wrap, accumulate)] = {"params": full_params(model), "reductions": reductions}
    return out


class HFLayer(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(dim, dim), nn.GELU())

    def forward(self, x):
        return x + self.mlp(x)


class HFStyle(nn.Module):
    """A model that declares its blocks the Hugging Face way (``_no_split_modules``), for the FSDP units."""

    _no_split_modules = ["HFLayer"]

    def __init__(self, dim: int = 16, layers: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(HFLayer(dim) for _ in range(layers))
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def units_from_the_model(local_rank: int, wraps: list[str]) -> dict:
    """build_model on a model with _no_split_modules: the units each FSDP made, from the WrapReport."""
    from hydraddp.build import build_model
    from hydraddp.config.compose import compose

    out = {}
    for wrap in wraps:
        cfg = compose([f"wrap={wrap}", "model._target_=tests.train.workers.HFStyle", "model.layers=3"])
        _, report = build_model(cfg)
        out[wrap] = report.units
    return out


def activation_checkpointing(local_rank: int, wraps: list[str], steps: int = 3) -> dict:
    """For each wrap, with and without activation checkpointing on the GPT's blocks: per-step losses of
    train_step on the same batches, and the WrapReport's checkpointed blocks."""
    from hydraddp.models.gpt import GPT
    from hydraddp.train.step import train_step
    from hydraddp.train.tasks import CausalLM

    generator = torch.Generator().manual_seed(7 + idist.get_rank())
    batches = [(torch.randint(0, 128, (4, 16), generator=generator), torch.randint(0, 128, (4, 16), generator=generator))
               for _ in range(steps)]
    out = {}
    for wrap in wraps:
        for checkpointing in (False, True):
            torch.manual_seed(0)
            model = idist.auto_model(GPT(depth=2, dim=32, heads=2, seq_len=16), wrap=wrap,
                                     activation_checkpointing=checkpointing)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = [train_step(model, CausalLM(), batch, optimizer, None, None, False).item() for batch in batches]
            out[(wrap, checkpointing)] = {"losses": losses, "checkpointed": idist.wrap_report(model).checkpointed}
    return out


def compiled(local_rank: int, runs: list[tuple[str, str]], steps: int = 4) -> dict:
    """For each (model, wrap), eager and with ``compile=True``: per-step losses on the same batches, the WrapReport's
    compiled modules, and how many graphs Dynamo really captured (a compile that silently ran eager captures none)."""
    from torch._dynamo.utils import counters

    from hydraddp.models.gpt import GPT
    from hydraddp.models.mlp import MLP
    from hydraddp.train.step import train_step
    from hydraddp.train.tasks import CausalLM, Classification

    generator = torch.Generator().manual_seed(3 + idist.get_rank())
    data = {"mlp": [(torch.randn(8, 64, generator=generator), torch.randint(0, 10, (8,), generator=generator))
                    for _ in range(steps)],
            "gpt": [(torch.randint(0, 128, (4, 16), generator=generator),
                     torch.randint(0, 128, (4, 16), generator=generator)) for _ in range(steps)]}
    build = {"mlp": (MLP, Classification), "gpt": (lambda: GPT(depth=2, dim=32, heads=2, seq_len=16), CausalLM)}
    out = {}
    for model_name, wrap in runs:
        make_model, task = build[model_name]
        for compiled in (False, True):
            torch.manual_seed(0)
            counters.clear()
            model = idist.auto_model(make_model(), wrap=wrap, compile=compiled)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            losses = [train_step(model, task(), b, optimizer, None, None, False).item() for b in data[model_name]]
            out[(model_name, wrap, compiled)] = {"losses": losses, "compiled": idist.wrap_report(model).compiled,
                                     "graphs": counters["stats"]["unique_graphs"]}
    return out


def train_configs(local_rank: int, cases: dict[str, list[str]]) -> dict:
    """``train()`` of each composed config (name -> overrides) on this rank: its logged losses and WrapReports."""
    from hydraddp.config.compose import compose
    from hydraddp.train.loop import train

    out = {}
    for name, overrides in cases.items():
        result = train(compose(overrides))
        out[name] = {"losses": result.losses, "units": result.reports[0]["units"], "eval": result.eval_metrics}
    return out


def fsdp2_gpt_warnings(local_rank: int) -> list[str]:
    """The warnings of one fp32 FSDP2 training step of the GPT (one unit per block, the root around them)."""
    import warnings

    from hydraddp.models.gpt import GPT
    from hydraddp.train.step import train_step
    from hydraddp.train.tasks import CausalLM

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = idist.auto_model(GPT(depth=2, dim=32, heads=2, seq_len=16), wrap="fsdp2")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        batch = (torch.randint(0, 128, (4, 16)), torch.randint(0, 128, (4, 16)))
        train_step(model, CausalLM(), batch, optimizer, None, None, False)
    return [str(w.message) for w in caught]


def evaluate_unevenly(local_rank: int, wraps: list[str], samples: int, batch_size: int) -> dict:
    """The loop's evaluation of a 2-block GPT (an FSDP unit per block: each eval forward all-gathers) over
    ``samples`` token windows, which do not split into the same number of batches on every rank."""
    from torch.utils.data import TensorDataset

    from hydraddp.models.gpt import GPT
    from hydraddp.train import data, tasks
    from hydraddp.train.evaluation import evaluate

    tokens = torch.randint(0, 32, (samples, 9), generator=torch.Generator().manual_seed(0))
    windows = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    out = {}
    for wrap in wraps:
        torch.manual_seed(0)
        model = idist.auto_model(GPT(vocab_size=32, seq_len=8, dim=16, depth=2, heads=2), wrap=wrap)
        loader = data.eval_loader(windows, batch_size, 0)
        metrics, counted = evaluate(model, loader, idist.device(), tasks.CausalLM())
        out[wrap] = {"metrics": metrics, "samples": counted, "batches": len(loader)}
    return out


def dropout_masks(local_rank: int, cases: dict[str, list[str]]) -> dict:
    """The dropout masks each composed config's ``train()`` drew on this rank, in order (a global forward hook sees
    every ``nn.Dropout``: where its output is zero and its input was not)."""
    from torch.nn.modules.module import register_module_forward_hook

    from hydraddp.config.compose import compose
    from hydraddp.train.loop import train

    masks: list[torch.Tensor] = []

    def record(module, inputs, output):
        if isinstance(module, nn.Dropout) and module.training:
            local = getattr(output, "_local_tensor", output)  # a TP-split activation: this rank's part
            masks.append(((local == 0) & (getattr(inputs[0], "_local_tensor", inputs[0]) != 0)).detach().clone())

    out = {}
    handle = register_module_forward_hook(record)
    try:
        for name, overrides in cases.items():
            masks.clear()
            result = train(compose(overrides))
            out[name] = {"masks": list(masks), "losses": result.losses}
    finally:
        handle.remove()
    return out


def compile_counts(local_rank: int, cases: dict[str, list[str]]) -> dict:
    """Each composed config's ``train()`` under ``tests.train.user_task.CountingCompiles``: Dynamo's frames, its graph
    breaks and the GPT blocks run eagerly, before every step and evaluation batch; and the graph-break reasons."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from hydraddp.config.compose import compose
    from hydraddp.train.loop import train
    from tests.train import user_task

    user_task.count_eager_blocks()
    out = {}
    for name, overrides in cases.items():
        torch._dynamo.reset()
        counters.clear()
        user_task.CountingCompiles.seen, user_task.EAGER_BLOCKS[0] = [], 0
        train(compose([*overrides, "task._target_=tests.train.user_task.CountingCompiles"]))
        out[name] = {"seen": list(user_task.CountingCompiles.seen), "breaks": dict(counters["graph_break"])}
    return out


def lora_steps(local_rank: int, cases: dict[str, list[str]], steps: int = 3) -> dict:
    """For each composed config (name -> overrides) of the peft LoRA Llama (tests/helpers/lora.py): ``steps`` training
    steps as the loop takes them, then the losses, the parameters that train, the base weights that changed and the
    adapters that did not (against the whole build under the same seed), and the WrapReport."""
    import math

    from hydraddp.build import build_model, data_mesh
    from hydraddp.config.compose import compose
    from hydraddp.config.instantiate import instantiate
    from hydraddp.train import data, tasks
    from hydraddp.train.optim import parameter_groups
    from hydraddp.train.step import train_step
    from tests.distributed.workers import full_params
    from tests.helpers.lora import is_adapter, tiny_lora_llama

    out = {}
    for name, overrides in cases.items():
        cfg = compose(["model._target_=tests.helpers.lora.tiny_lora_llama", "data=tokens", "task=causal_lm",
                       "data.seq_len=16", "data.batch_size=8", "data.dataset.num_chars=4000", *overrides])
        torch.manual_seed(cfg.trainer.seed)
        start = {k.removeprefix("base_model.model."): v.detach().clone()
                 for k, v in tiny_lora_llama().state_dict().items()}
        model, _ = build_model(cfg)
        optimizer = idist.auto_optim(instantiate(cfg.optim.optimizer, "optim.optimizer")(
            parameter_groups(model, cfg.optim.no_decay_norm_and_bias)))
        task = instantiate(cfg.task, "task")
        batches = iter(data.train_loader(instantiate(cfg.data.dataset, "data.dataset")[0], cfg.data.batch_size, 0,
                                         cfg.trainer.seed, data_mesh(cfg)))
        losses = [float(train_step(model, task, tasks.to_device(next(batches), idist.device()), optimizer, None,
                                   cfg.trainer.grad_clip, False, 1)) for _ in range(steps)]
        report = idist.wrap_report(model, optimizer)
        end = {k.removeprefix("base_model.model."): v for k, v in full_params(model).items()}
        stored = next(p for p in model.parameters()).dtype  # bf16-true: the start is compared in the weights' dtype
        same = {k: torch.equal(end[k].to(stored), start[k].to(stored)) for k in start if k in end}
        optimized = [p for group in optimizer.param_groups for p in group["params"]]
        out[name] = {"losses": losses, "finite": all(math.isfinite(x) for x in losses),
                     "base_changed": sorted(k for k, s in same.items() if not s and not is_adapter(k)),
                     "adapters_unchanged": sorted(k for k, s in same.items() if s and is_adapter(k)),
                     "adapters": sorted(k for k in same if is_adapter(k)),
                     "optimized_all_trainable": all(p.requires_grad for p in optimized),
                     "optimized": len(optimized), "trainable": sum(p.requires_grad for p in model.parameters()),
                     "report": report.to_dict()}
    return out


def matrix_rows(local_rank: int, launches: list[tuple[str, dict, str, dict]]) -> dict:
    """``train()`` of each planned launch (name, resolved config, job directory, saved config) as a launch's worker
    runs it, rank 0 writing the run's events: its losses, or the refusal (``ConfigurationError``: exit 2 in a launch)
    or the failure, so that one row's failure does not hide the others'."""
    import math
    import traceback

    from omegaconf import OmegaConf

    from hydraddp.distributed import ConfigurationError
    from hydraddp.tracking.events import EventWriter
    from hydraddp.train.loop import train

    out = {}
    for name, config, job_dir, saved_config in launches:
        events = EventWriter(Path(job_dir) / "events.jsonl") if local_rank == 0 else None
        try:
            result = train(OmegaConf.create(config), Path(job_dir), events, saved_config)
            out[name] = {"status": "preempted" if result.preempted else "finished", "losses": result.losses,
                         "final_loss": result.final_loss, "finite": all(map(math.isfinite, result.losses.values())),
                         "steps": result.steps}
        except ConfigurationError as exc:
            out[name] = {"status": "refused", "error": str(exc)}
        except Exception as exc:  # noqa: BLE001 - reported per row
            out[name] = {"status": "failed", "error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        finally:
            if events is not None:
                events.close()
    return out
