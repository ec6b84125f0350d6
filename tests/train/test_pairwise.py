"""Every option meets every other: a covering array (every pair of values in at least one row), generated, each row
run with every default on (the plan's measured step, MLflow tracking with the LoggedModel, periodic checkpoints).

A row finishes with finite losses and a FINISHED run, or is refused before it trains by a rule the README states
(exit 2 in a launch); a stop-and-resume row ends where the same row without the stop ends. The cheap way: each row
is decided as a launch decides it (``job.prepare``: every check, the resume found, the run to continue), its
ranks run ``train()`` on reused workers of its backend (2 gloo ranks, 2 Horovod ranks, or one process for
backend=none) as a launch's workers do, and its MLflow run is kept by the tracker's own ``LaunchRun`` from the
events rank 0 wrote. The launches themselves are tested elsewhere."""

from __future__ import annotations

import itertools
import math
import os
from pathlib import Path

import pytest

FACTORS: dict[str, tuple[str, ...]] = {
    "backend": ("gloo", "horovod", "none"),  # every backend that runs on CPU ranks (none: one process, no group)
    "wrap": ("ddp", "fsdp", "fsdp2", "hsdp", "tp", "auto"),
    "precision": ("fp32", "bf16", "bf16-true"),
    "init_device": ("auto", "cpu"),
    "pretrained": ("none", "hf"),
    "accumulate": ("1", "2"),
    "frozen": ("none", "lora"),
    "checkpointing": ("off", "on"),
    "compile": ("off", "on"),
    "no_decay": ("off", "on"),  # optim.no_decay_norm_and_bias: the parameter groups meet every wrap's parameters
    "async_save": ("off", "on"),
    "data": ("map", "stream"),
    "uneven_eval": ("off", "on"),
    "stop_resume": ("off", "on"),
    "offload": ("none",),  # cpu: the refused rows below
    "pp": ("1", "2"),  # mesh.pp: 2 pipeline stages on the 2 ranks, each stage under FSDP2
}
# Pairs no generated row holds. Those the combination rules refuse are theirs to say (``_allowed`` asks them):
# a backend without the wrap (Horovod has only its own data parallelism, backend=none no group at all: both run
# wrap=auto), FSDP1 or Horovod compiled. Besides: a LoRA model is the user's own, which model.pretrained (a Hugging
# Face directory for model=hf_causal_lm) does not load into; TP with LoRA is refused whatever else the row holds, in a
# row of its own (REFUSED).
EXCLUDED = {(("frozen", "lora"), ("pretrained", "hf")), (("wrap", "tp"), ("frozen", "lora"))}
# Pipeline stages on 2 ranks: each stage is sharded by FSDP2 (hsdp and tp need 4 ranks then), under gloo. The rules
# that refuse a pipeline with the other wraps, with gradient accumulation (the microbatches are) and with a model
# that declares no pipeline shape (peft's) each have a row of their own in REFUSED.
EXCLUDED |= {(("pp", "2"), ("wrap", wrap)) for wrap in ("ddp", "fsdp", "hsdp", "tp", "auto")} | \
    {(("pp", "2"), ("backend", backend)) for backend in ("horovod", "none")} | \
    {(("pp", "2"), ("accumulate", "2")), (("pp", "2"), ("frozen", "lora"))}
# Values that a README rule refuses whatever else the row holds, so that a row holding them would cover no other
# pair: each meets the wraps it applies to in a row of its own, which must be refused with that rule's message.
# Offload moves FSDP's parameters between an accelerator and the CPU (none here: the rows run on CPU ranks); a TP
# plan names the modules of the model it was written for (peft renames them). And one pair the rules refuse, which
# the rows above leave out: Horovod compiled, and Horovod with bf16-true weights (Horovod 0.28.1 has no bfloat16
# collectives), each refused with the rule's message rather than silently never tried.
REFUSED = [({"wrap": wrap, "offload": "cpu"}, "offload=cpu moves FSDP parameters between an accelerator and the CPU")
           for wrap in ("fsdp", "fsdp2", "hsdp", "tp")] + \
          [({"wrap": "tp", "frozen": "lora"}, "the TP plan's entry 'lm_head' matches no module of PeftModelForCausalLM"),
           ({"backend": "horovod", "compile": "on"}, "hydraddp does not compile under Horovod"),
           ({"backend": "horovod", "precision": "bf16-true"}, "Horovod 0.28.1 has no bfloat16 collectives"),
           ({"pp": "2", "wrap": "ddp"}, "mesh.pp=2 with wrap=ddp: each pipeline stage is sharded"),
           ({"pp": "2", "wrap": "fsdp2", "accumulate": "2"}, "a pipeline accumulates over its microbatches already"),
           ({"pp": "2", "wrap": "fsdp2", "frozen": "lora"}, "PeftModelForCausalLM declares no pipeline_shape")]

BACKENDS = {"gloo": ["backend=gloo"], "horovod": ["backend=horovod"],
            "none": ["backend=none", "launcher.nproc_per_node=1"]}
POOLS = {"gloo": "gloo", "horovod": "horovod", "none": None}  # the reused workers each backend's rows run on
WRAPS = {"auto": ["wrap=auto"], "ddp": ["wrap=ddp"], "fsdp": ["wrap=fsdp"], "fsdp2": ["wrap=fsdp2"],
         "hsdp": ["wrap=fsdp2", "mesh.dp_replicate=2", "mesh.dp_shard=1"],
         "tp": ["wrap=fsdp2", "mesh.dp_shard=1", "mesh.tp=2"]}
STEPS, STOP = 4, 2
# The eval set of token_dicts(seq_len=16, num_chars=5120) holds 32 samples: 8 a batch splits evenly over 2 ranks.
COMMON = ["data=tokens", "task=causal_lm", "data.seq_len=16", "data.batch_size=8", "data.dataset.num_chars=5120",
          f"trainer.max_steps={STEPS}", "trainer.log_every=1", "trainer.eval_every=2", "checkpoint.every_n_steps=2",
          "tracking.model.every_checkpoint=true", "tracking.system_metrics.enabled=false"]


def _allowed(row: dict[str, str]) -> bool:
    """Whether a row (or part of one) may be generated: not EXCLUDED, and not refused by the combination rules."""
    from hydraddp.parallel.combinations import Combination, check_compatibility

    values = set(row.items())
    if any(a in values and b in values for a, b in EXCLUDED):
        return False
    backend = row.get("backend", FACTORS["backend"][0])
    wrap = WRAPS[row.get("wrap", "auto")][0].split("=")[1]  # hsdp and tp are fsdp2 over a mesh
    combo = Combination(backend=backend, wrap=wrap, precision=row.get("precision", "fp32"),
                        offload=row.get("offload", "none"), compile=row.get("compile") == "on",
                        world_size=1 if backend == "none" else 2, has_horovod=True)  # CPU ranks, Horovod built
    return not check_compatibility(combo)


def covering_array(factors: dict[str, tuple[str, ...]]) -> list[dict[str, str]]:
    """A greedy pairwise covering array (AETG's idea, deterministic): each new row starts from an uncovered pair,
    then takes, factor by factor, the value that covers the most pairs still uncovered."""
    names = list(factors)
    uncovered = {((a, x), (b, y)) for a, b in itertools.combinations(names, 2)
                 for x in factors[a] for y in factors[b] if _allowed({a: x, b: y})}
    rows = []
    while uncovered:
        (a, x), (b, y) = min(uncovered)
        row = {a: x, b: y}
        for name in names:
            if name in row:
                continue
            def gain(value):
                trial = {**row, name: value}
                return (_allowed(trial), sum(((n, v), (name, value)) in uncovered or ((name, value), (n, v)) in uncovered
                                             for n, v in row.items()))
            row[name] = max(factors[name], key=gain)
        rows.append({n: row[n] for n in names})
        uncovered -= {((p, row[p]), (q, row[q])) for p, q in itertools.combinations(names, 2)}
    return rows


PAIRWISE = covering_array(FACTORS)
ROWS = PAIRWISE + [{**{name: values[0] for name, values in FACTORS.items()}, **values} for values, _ in REFUSED]
EXPECTED_REFUSAL = {len(PAIRWISE) + i: rule for i, (_, rule) in enumerate(REFUSED)}


def test_the_rows_cover_every_allowed_pair():
    for a, b in itertools.combinations(FACTORS, 2):
        for x, y in itertools.product(FACTORS[a], FACTORS[b]):
            covered = any(row[a] == x and row[b] == y for row in PAIRWISE)
            assert covered == _allowed({a: x, b: y}), (a, x, b, y)
    assert len(PAIRWISE) <= 24


def overrides_of(row: dict[str, str], pretrained_dir: Path) -> list[str]:
    chosen = [*COMMON, *BACKENDS[row["backend"]], *WRAPS[row["wrap"]], f"precision={row['precision']}",
              f"model.init_device={row['init_device']}",
              f"trainer.accumulate_grad_batches={row['accumulate']}",
              f"trainer.activation_checkpointing={str(row['checkpointing'] == 'on').lower()}",
              f"trainer.compile={str(row['compile'] == 'on').lower()}",
              f"optim.no_decay_norm_and_bias={str(row['no_decay'] == 'on').lower()}",
              f"checkpoint.async_save={str(row['async_save'] == 'on').lower()}", f"offload={row['offload']}",
              f"data.eval_batch_size={6 if row['uneven_eval'] == 'on' else 8}", f"mesh.pp={row['pp']}"]
    # The user's LoRA model replaces the model group, as README's "your own model" does it.
    chosen.insert(0, "model._target_=tests.helpers.lora.tiny_lora_llama" if row["frozen"] == "lora" else "model=hf_causal_lm")
    if row["pretrained"] == "hf":
        chosen.append(f"model.pretrained={pretrained_dir}")
    if row["data"] == "stream":
        chosen.append("data.dataset._target_=tests.train.user_data.token_stream")
    return chosen


@pytest.fixture(scope="module")
def pretrained_dir(tmp_path_factory):
    from hydraddp.models.hf import causal_lm
    from tests.helpers.lora import TINY_LLAMA

    where = tmp_path_factory.mktemp("pretrained")
    causal_lm("llama", **TINY_LLAMA).save_pretrained(where)
    return where


class Launches:
    """Plans launches as ``python -m hydraddp`` does, runs their ranks on the pool, keeps their MLflow runs."""

    def __init__(self, pools, root: Path):
        self.pools, self.root, self.uri = pools, root, f"sqlite:///{root / 'mlflow.db'}"

    def plan(self, name: str, overrides: list[str], job_dir: Path):
        from hydraddp.config.compose import compose
        from hydraddp.job import prepare
        from hydraddp.preflight import claim

        job_dir.mkdir(parents=True, exist_ok=True)
        cfg = compose([*overrides, f"tracking.uri={self.uri}"])
        try:
            return prepare(cfg, job_dir, [*overrides, f"tracking.uri={self.uri}"], sweeping=False, job_num=0,
                           remove_untouched=lambda path: None)
        finally:
            claim.release()

    def run(self, planned: dict) -> dict:
        """``planned``: name -> Job. Each one's ranks on its backend's workers, then each one's run, as its
        tracker keeps it."""
        outcomes = {}
        for pool in dict.fromkeys(POOLS.values()):
            launches = [(name, plan.config, str(plan.job_dir), plan.saved_config) for name, plan in planned.items()
                        if POOLS[plan.config["backend"]["name"]] == pool]
            if launches:
                outcomes.update(self.pools.run("tests.train.workers:matrix_rows", launches, backend=pool,
                                               timeout=900)[0])
        for name, plan in planned.items():
            outcomes[name]["run"] = self._track(plan, outcomes[name]["status"])
        return outcomes

    def _track(self, plan, status: str) -> tuple[str, str]:
        from hydraddp.tracking.process import launch_run_of
        from hydraddp.tracking.run import FAILED, FINISHED, KILLED
        from hydraddp.tracking.setup import launch_run

        run = launch_run_of(dict(launch_run(plan).settings))  # the tracker process's own arguments
        run.start()
        run.finish({"finished": FINISHED, "preempted": KILLED}.get(status, FAILED))
        from mlflow.tracking import MlflowClient

        return run.run_id, MlflowClient(self.uri).get_run(run.run_id).info.status


@pytest.fixture(scope="module", autouse=True)
def horovod_pool(pools):
    """The Horovod rows' workers live for this file only: Horovod's background loop negotiates while they wait."""
    yield
    pools(backend="horovod").close()


def _absent_backends() -> tuple[str, ...]:
    from hydraddp.distributed import has_hvd_support

    return () if has_hvd_support or os.environ.get("CI") else ("horovod",)  # CI always builds Horovod


def _refusal(problems) -> str:
    return "; ".join(f"{', '.join(p.keys)}: {p.message}" for p in problems)


@pytest.mark.slow  # no launch, but two minutes of training on reused workers: not for the fast tier's quick answer
@pytest.mark.timeout(900)
def test_every_pair_of_options_trains_with_every_default_on_or_is_refused_by_a_stated_rule(pools, tmp_path,
                                                                                          pretrained_dir, capsys):
    launches = Launches(pools, tmp_path)
    names = [f"row{i:02d}" for i in range(len(ROWS))]
    planned, refused, absent = {}, {}, _absent_backends()
    for name, row in zip(names, ROWS):
        if row["backend"] in absent:
            continue
        overrides = overrides_of(row, pretrained_dir)
        if row["stop_resume"] == "on":  # the same row without the stop, to end where it ends
            overrides_whole, overrides = overrides, [*overrides, f"trainer.stop_at_step={STOP}"]
            whole = launches.plan(name + "-whole", overrides_whole, tmp_path / (name + "-whole"))
            if not isinstance(whole, list):
                planned[name + "-whole"] = whole
        found = launches.plan(name, overrides, tmp_path / name)
        if isinstance(found, list):
            refused[name] = _refusal(found)
        else:
            planned[name] = found
    outcomes = launches.run(planned)
    # The stopped rows go on from their checkpoint, in the same job directory and MLflow run.
    resumed = {}
    for name, row in zip(names, ROWS):
        if row["stop_resume"] == "on" and outcomes.get(name, {}).get("status") == "finished":
            again = launches.plan(name + "-resumed", [*overrides_of(row, pretrained_dir), "checkpoint.resume=latest"],
                                  tmp_path / name)
            assert not isinstance(again, list), _refusal(again)
            resumed[name + "-resumed"] = again
    outcomes.update(launches.run(resumed) if resumed else {})

    table = _table(names, outcomes, refused, absent)
    with capsys.disabled():
        print("\n" + table)
    for index, (name, row) in enumerate(zip(names, ROWS)):
        if row["backend"] in absent:
            continue
        if index in EXPECTED_REFUSAL:
            assert EXPECTED_REFUSAL[index] in refused.get(name, ""), (name, row, refused.get(name), outcomes.get(name))
            continue
        assert name not in refused, (name, row, refused[name])
        last = outcomes.get(name + "-resumed", outcomes[name])
        assert last["status"] == "finished" and last["finite"], (name, row, last.get("error", last))
        assert last["run"][1] == "FINISHED", (name, last["run"])
        if row["stop_resume"] == "on":
            whole = outcomes[name + "-whole"]
            assert whole["status"] == "finished", (name, whole.get("error"))
            assert last["run"][0] == outcomes[name]["run"][0]  # the resume went on in the stopped launch's run
            # fp32 to README's 1e-6 (relative 1e-5 over 4 steps); bf16 within its own rounding (8 bits of mantissa),
            # as a compiled graph rebuilt after the resume may round otherwise
            tolerance = 1e-5 if row["precision"] == "fp32" else 2e-3
            assert math.isclose(last["final_loss"], whole["final_loss"], rel_tol=tolerance), \
                (name, row, last["losses"], whole["losses"])


def _table(names: list[str], outcomes: dict, refused: dict, absent: tuple[str, ...]) -> str:
    columns = list(FACTORS)
    lines = [" | ".join(["row", *columns, "outcome"]), " | ".join(["---"] * (len(columns) + 2))]
    for name, row in zip(names, ROWS):
        if row["backend"] in absent:
            outcome = f"skipped: backend={row['backend']} is not installed here"
        elif name in refused:
            outcome = f"refused: {refused[name]}"
        else:
            last = outcomes.get(name + "-resumed", outcomes[name])
            first_line = (last.get("error") or "").split("\n", 1)[0][:200]
            result = f", loss {last['final_loss']:.4f}" if last.get("final_loss") is not None else f": {first_line}"
            outcome = f"{last['status']} {last['run'][1]}{result}"
        lines.append(" | ".join([name, *(row[c] for c in columns), outcome]))
    return "\n".join(lines)
