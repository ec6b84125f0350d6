"""Which backend / wrap / precision / offload combinations work, decided in one place.

``check_compatibility`` returns *every* problem with the keys involved and the fix. ``auto_model``
raises on them; the Hydra app calls the same function before any process starts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

WRAPS = ("auto", "none", "dp", "ddp", "fsdp", "fsdp2")
REALIZED_WRAPS = ("none", "dp", "ddp", "fsdp", "fsdp2", "horovod")
PRECISIONS = ("fp32", "bf16", "fp16", "bf16-true")
OFFLOADS = ("none", "cpu")
BACKENDS = ("none", "gloo", "nccl", "mpi", "horovod")


@dataclass(frozen=True)
class Problem:
    """One reason a combination cannot run: the keys involved, what is wrong, and how to fix it."""

    keys: tuple[str, ...]
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.message} {self.fix}"


class ConfigurationError(ValueError):
    """Raised with every problem of a combination; ``str`` lists them one per line."""

    def __init__(self, problems: list[Problem] | Problem):
        self.problems = [problems] if isinstance(problems, Problem) else list(problems)
        super().__init__("\n".join(f"- {p}" for p in self.problems))


@dataclass(frozen=True)
class Combination:
    """Everything the rules look at. ``backend=None``/``"none"`` means no process group."""

    backend: str | None
    wrap: str | None = "auto"
    precision: str | None = "fp32"
    offload: str = "none"
    sync_bn: bool = False
    compile: bool = False  # torch.compile (per block under fsdp2, the whole model under none/ddp)
    world_size: int = 1
    nproc_per_node: int | None = None  # processes on this node; None: all of world_size
    cuda_device_count: int = 0
    bf16_supported: bool = True
    global_batch_size: int | None = None
    data_parallel_size: int | None = None  # the ranks that read different batches; None: world_size (no TP)
    has_horovod: bool = False
    has_mpi: bool = False
    # Started by torchrun, srun or mpirun: each process is one rank, and may see only its own GPU.
    attached: bool = False
    # Config paths used in messages, e.g. {"world_size": "launcher.nproc_per_node"} from the Hydra app.
    names: Mapping[str, str] = field(default_factory=dict)


# torch.compile's places: per block before fully_shard (torchtitan's rule), or the whole model.
COMPILED_WRAPS = ("none", "ddp", "fsdp2")
COMPILE_REFUSED = {
    "dp": "DataParallel copies the module to every device at each step, and each copy would be compiled anew.",
    "fsdp": "FSDP1 runs its unit hooks around flat parameters, which Dynamo does not trace (torch compiles FSDP2).",
    "horovod": "hydraddp does not compile under Horovod: its gradient hooks are untested with compiled graphs.",
}


def resolve_wrap(combo: Combination) -> str:
    """ignite's ``auto_model`` rule for ``wrap=auto``; explicit names pass through."""
    wrap = combo.wrap or "auto"
    if wrap == "auto":
        if combo.world_size > 1:
            return "horovod" if combo.backend == "horovod" else "ddp"
        return "dp" if combo.cuda_device_count > 1 else "none"
    if combo.backend == "horovod" and wrap == "ddp":
        return "horovod"  # Horovod's data parallelism is its broadcast + DistributedOptimizer path
    return wrap


def check_compatibility(combo: Combination) -> list[Problem]:
    """Every problem of ``combo``, each naming its keys, the offending values and the fix."""
    problems = _unknown_options(combo)
    if problems:
        return problems  # the other rules would only misread a name that is not an option
    wrap = resolve_wrap(combo)
    return [problem for rule in RULES for problem in rule(combo, wrap)]


def _named(combo: Combination) -> Callable[[str], str]:
    """A rule's key as the caller names it (the Hydra app: config paths)."""
    return lambda key: combo.names.get(key, key)


def _problem(combo: Combination, keys: tuple[str, ...], message: str, fix: str) -> Problem:
    return Problem(tuple(combo.names.get(k, k) for k in keys), message, fix)


def _unknown_options(combo: Combination) -> list[Problem]:
    n = _named(combo)
    return [_problem(combo, (key,), f"{n(key)}={value} is not an option.", f"Use one of: {', '.join(valid)}.")
            for key, value, valid in (
                ("backend", combo.backend or "none", BACKENDS),
                ("wrap", combo.wrap or "auto", (*WRAPS, "horovod")),
                ("precision", combo.precision or "fp32", PRECISIONS),
                ("offload", combo.offload, OFFLOADS),
            ) if value not in valid]


def _backend_problems(combo: Combination, wrap: str) -> Iterator[Problem]:
    """The backend against this machine: GPUs for nccl, MPI and Horovod in the build, and a group for several
    processes."""
    n, backend, gpu = _named(combo), combo.backend or "none", combo.cuda_device_count > 0
    if backend == "nccl" and not gpu:
        yield _problem(combo, ("backend",), "backend=nccl needs CUDA GPUs, and this machine has none.",
                       "Use backend=gloo (or backend=auto, which picks gloo without CUDA).")
    nproc = combo.world_size if combo.nproc_per_node is None else combo.nproc_per_node
    # A task that sees one GPU has it to itself (srun --gpus-per-task=1), whatever the tasks per node.
    own_gpu_each = combo.attached and combo.cuda_device_count == 1
    if backend == "nccl" and gpu and nproc > combo.cuda_device_count and not own_gpu_each:
        yield _problem(combo, ("backend", "nproc_per_node"),
                       f"backend=nccl runs one process per GPU, but {n('nproc_per_node')}={nproc} and this node has "
                       f"{combo.cuda_device_count} GPU(s).",
                       f"Set {n('nproc_per_node')}={combo.cuda_device_count} (or fewer)"
                       + (", or auto (one per GPU)." if n("nproc_per_node").startswith("launcher.") else "."))
    if backend == "mpi" and not combo.has_mpi:
        yield _problem(combo, ("backend",), "backend=mpi needs a torch build with MPI, and this one has none.",
                       "Use backend=gloo, or backend=horovod under mpirun.")
    if backend == "horovod" and not combo.has_horovod:
        yield _problem(combo, ("backend",),
                       "backend=horovod needs Horovod with PyTorch support, and it is not installed.",
                       "Install it with `bash scripts/install_horovod.sh`, or use backend=gloo.")
    if backend == "none" and combo.world_size > 1:
        yield _problem(combo, ("backend", "world_size"),
                       f"backend=none runs one process without a process group, but "
                       f"{n('world_size')}={combo.world_size}.",
                       f"Use backend=gloo (or auto) for {combo.world_size} processes, or set {n('world_size')}=1.")


def _data_parallel_problems(combo: Combination, wrap: str) -> Iterator[Problem]:
    """wrap=dp: one process splitting each batch over its GPUs."""
    if wrap != "dp":
        return
    n = _named(combo)
    if combo.world_size > 1:
        yield _problem(combo, ("wrap", "world_size"),
                       f"wrap=dp is single-process DataParallel, but {n('world_size')}={combo.world_size} processes "
                       "run.",
                       "Use wrap=ddp (or auto) for several processes, or one process with wrap=dp.")
    if combo.cuda_device_count == 0:
        yield _problem(combo, ("wrap",),
                       "wrap=dp (DataParallel) splits a batch over CUDA devices, and this machine has none.",
                       "Use wrap=none on one CPU process, or wrap=ddp with backend=gloo for several.")
    if combo.sync_bn:
        yield _problem(combo, ("wrap", "sync_bn"),
                       "sync_bn=true does not work with wrap=dp: SyncBatchNorm needs one process per device.",
                       f"Use wrap=ddp with sync_bn=true, or keep wrap=dp and set {n('sync_bn')}=false.")


def _wrap_backend_problems(combo: Combination, wrap: str) -> Iterator[Problem]:
    """Wrappers the backend has no counterpart for: Horovod's own data parallelism, or no process group at all."""
    backend = combo.backend or "none"
    if backend == "horovod" and wrap in ("dp", "fsdp", "fsdp2"):
        yield _problem(combo, ("backend", "wrap"),
                       f"wrap={wrap} cannot run under backend=horovod: Horovod has no {wrap} wrapper.",
                       "Use wrap=auto (Horovod's broadcast + DistributedOptimizer), or backend=gloo/nccl with wrap="
                       f"{wrap}.")
    if backend == "horovod" and combo.precision == "bf16-true":
        # Its first broadcast of the bf16 weights fails: "Tensor type torch.BFloat16Tensor is not supported".
        yield _problem(combo, ("backend", "precision"),
                       "precision=bf16-true cannot run under backend=horovod: Horovod 0.28.1 has no bfloat16 "
                       "collectives, and bf16-true keeps the weights and gradients in bfloat16.",
                       "Use precision=bf16 (fp32 weights and gradients, bf16 compute), or backend=gloo/nccl with "
                       "precision=bf16-true.")
    if wrap in ("ddp", "fsdp", "fsdp2") and backend == "none":
        yield _problem(combo, ("backend", "wrap"), f"wrap={wrap} needs a process group, and backend=none has none.",
                       "Use backend=gloo (or auto), or wrap=none for a single plain process.")


def _offload_problems(combo: Combination, wrap: str) -> Iterator[Problem]:
    if combo.offload != "cpu":
        return
    if wrap not in ("fsdp", "fsdp2"):
        yield _problem(combo, ("offload", "wrap"), f"offload=cpu only applies to FSDP, but wrap={wrap}.",
                       "Use wrap=fsdp or wrap=fsdp2 with offload=cpu, or set offload=none.")
    if combo.cuda_device_count == 0:
        yield _problem(combo, ("offload",), "offload=cpu moves FSDP parameters between an accelerator and the CPU, "
                       "and this machine has no accelerator (torch fails with 'Cannot access accelerator device').",
                       "Set offload=none on a CPU-only machine.")


def _precision_problems(combo: Combination, wrap: str) -> Iterator[Problem]:
    precision, gpu = combo.precision or "fp32", combo.cuda_device_count > 0
    if precision == "fp16" and not gpu:
        yield _problem(combo, ("precision",),
                       "precision=fp16 needs CUDA: fp16 mixed precision with a grad scaler is a GPU mode.",
                       "Use precision=bf16 (or fp32) on CPU.")
    if precision in ("bf16", "bf16-true") and gpu and not combo.bf16_supported:
        yield _problem(combo, ("precision",), f"precision={precision} needs bf16 support, and this GPU has none.",
                       "Use precision=fp16 or fp32 on this GPU.")


def _sync_bn_problems(combo: Combination, wrap: str) -> Iterator[Problem]:
    if combo.sync_bn and wrap in ("ddp", "fsdp", "fsdp2") and combo.world_size > 1 and combo.cuda_device_count == 0:
        yield _problem(combo, ("sync_bn",), "sync_bn=true needs GPUs: SyncBatchNorm layers only work with GPU modules "
                       "(torch's words: DDP refuses them on CPU), and this machine has none.",
                       f"Set {_named(combo)('sync_bn')}=false on CPU (BatchNorm statistics then stay per rank), or "
                       "run on GPUs.")


def _compile_problems(combo: Combination, wrap: str) -> Iterator[Problem]:
    if combo.compile and wrap not in COMPILED_WRAPS:
        n = _named(combo)
        yield _problem(combo, ("compile", "wrap"),
                       f"{n('compile')}=true cannot run with wrap={wrap}: {COMPILE_REFUSED[wrap]}",
                       f"Use wrap=fsdp2 (compiled per block) or wrap=ddp (the whole model), or set "
                       f"{n('compile')}=false.")


def _batch_split_problems(combo: Combination, wrap: str) -> Iterator[Problem]:
    """The global batch against the ranks that read different batches."""
    n, readers = _named(combo), combo.data_parallel_size or combo.world_size
    if combo.global_batch_size is not None and readers > 1 and combo.global_batch_size % readers:
        per_rank = combo.global_batch_size / readers
        over = (f"{n('world_size')}={combo.world_size} ranks" if readers == combo.world_size else
                f"the data-parallel degree {readers} (the world size {combo.world_size} over {n('tp')}: the ranks of a "
                "TP group read one batch)")
        yield _problem(combo, ("batch_size", "world_size"),
                       f"{n('batch_size')}={combo.global_batch_size} is the global batch and does not split evenly "
                       f"over {over} ({combo.global_batch_size} / {readers} = {per_rank:g}).",
                       f"Use a multiple of {readers}, e.g. {n('batch_size')}="
                       f"{(combo.global_batch_size // readers + 1) * readers}.")


# Every rule family, in the order their problems are listed; each sees the combination and its resolved wrap.
RULES: tuple[Callable[[Combination, str], Iterable[Problem]], ...] = (
    _backend_problems, _data_parallel_problems, _wrap_backend_problems, _offload_problems, _precision_problems,
    _sync_bn_problems, _compile_problems, _batch_split_problems,
)
