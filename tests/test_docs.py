"""Every snippet of the documentation (README.md and the pages in docs/) runs, or is run by the test named for it
here; and the config reference has an entry, with a meaning, for every key.

- The Python files (a first line ``# name.py``) are written out and run as they are; the user package and its config
  folder are built from the pages' blocks, then the pages' own command trains them.
- Every ``python -m hydraddp`` command composes, and validates where it names no placeholder (DATE/TIME, node0).
- Every other command is listed in ``RUN_BY`` with the test (or script) that runs it; a new README command with no
  entry there fails this file.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import itertools
import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from hydraddp.distributed.env import free_port
from tests.helpers.spawn import REPO, child_env, job_dirs, run_process

# README.md and every page of the site, as one text: a snippet is found wherever it is.
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
README = "\n".join(page.read_text() for page in PAGES)
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.M | re.S)
FILE_HEADER = re.compile(r"^# (\S+\.(?:py|yaml))\b.*$", re.M)
# Commands with these compose but are not validated here: placeholders, or what this machine lacks (GPUs).
PLACEHOLDERS = ("DATE/TIME", "node0", "backend=nccl")

# Commands that are not `python -m hydraddp OVERRIDES`, by their start: where each one runs for real.
RUN_BY = {
    "bash scripts/dev.sh run": "tests/test_docs.py::test_the_quickstart_run_command_trains",
    "bash scripts/dev.sh test": ".ci/run",
    "bash scripts/dev.sh docs": ".ci/run",
    "bash scripts/install_horovod.sh": "scripts/dev.sh",
    ".venv/bin/mlflow ui": "tests/test_docs.py::test_the_mlflow_ui_command_serves_the_runs",
    "python -m hydraddp.plan": "tests/plan/test_command.py::test_the_plan_shows_units_parts_and_every_wrap",
    "python -m hydraddp.compare": "tests/tracking/test_compare.py::test_compare_prints_the_table_and_writes_the_plots",
    "python -m hydraddp.export": "tests/train/test_checkpoint.py::test_the_export_loads_with_weights_only_into_the_unwrapped_model",
    "python -m hydraddp --cfg job | --help": "tests/test_cli.py::test_help_lists_every_group_and_its_options",
    "python -m hydraddp --config-dir myconf": "tests/test_docs.py::test_the_own_package_snippets_train_with_the_readmes_command",
    "torchrun --nproc_per_node=2 -m hydraddp": "tests/test_cli.py::test_under_torchrun_it_attaches_with_one_job_directory_and_every_rank_resumes_latest_there",
    "horovodrun --gloo -np 2": "tests/horovod/test_horovod.py::test_horovodrun_attach_makes_one_run_and_one_job_directory",
    "cp .env.example .env": "tests/test_docker_compose.py::test_services_and_secrets",
    "docker compose up --build": "tests/test_docker_compose.py::test_trainers_are_one_two_node_rendezvous_of_valid_hydraddp_commands",
    ".venv/bin/python -m pytest -m \"not slow\"": "tests/test_docs.py::test_the_fast_tier_launches_nothing_and_checks_every_wrap_on_two_ranks",
    ".venv/bin/python benchmarks/run.py": "tests/test_benchmarks.py::test_the_harness_measures_every_figure_and_the_peers_train_the_same_model",
    "python -m hydraddp.kube": "tests/clusters/test_kube.py::test_the_manifest_validates_with_the_operators_own_models_and_holds_no_secret",
    # No cluster here: the manifest's pods read this Secret, which that test checks.
    "kubectl create secret generic hydraddp-tracking": "tests/clusters/test_kube.py::test_the_manifest_validates_with_the_operators_own_models_and_holds_no_secret",
    # The Slurm cluster in containers: scripts/slurm_test.sh brings it up and down, its checks run the jobs (CI).
    "docker compose -f deploy/slurm/compose.yml --env-file .env up": "scripts/slurm_test.sh",
    "docker compose -f deploy/slurm/compose.yml --env-file .env exec ctl sbatch": "scripts/slurm_checks/srun.py",
    "docker compose -f deploy/slurm/compose.yml --env-file .env down": "scripts/slurm_test.sh",
}


def blocks(language: str) -> list[str]:
    return [m.group(2) for m in FENCE.finditer(README) if m.group(1) == language]


def files(block: str) -> dict[str, str]:
    """A block's files: each starts at a ``# path`` line and runs to the next one."""
    headers = list(FILE_HEADER.finditer(block))
    return {h.group(1): block[h.end():(headers[i + 1].start() if i + 1 < len(headers) else len(block))].strip() + "\n"
            for i, h in enumerate(headers)}


def readme_file(name: str) -> str:
    found = [files(b)[name] for b in blocks("python") + blocks("yaml") if name in files(b)]
    assert len(found) == 1, f"the documentation should hold {name} once"
    return found[0]


def commands() -> list[str]:
    """Every command of the bash blocks: comments dropped, continued lines (``\\``) joined."""
    text = "\n".join(blocks("bash")).replace("\\\n", " ")
    lines = [line.split("  #")[0].strip() for line in text.splitlines()]
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]


def hydraddp_overrides(command: str) -> list[list[str]] | None:
    """The override lists a ``... -m hydraddp ARGS`` command composes (one per sweep job), None for other commands."""
    words = shlex.split(command)
    if "hydraddp" not in words or words[words.index("hydraddp") - 1] != "-m":
        return None
    args = words[words.index("hydraddp") + 1:]
    if any(a.startswith("--") for a in args):
        return None  # Hydra's own flags: RUN_BY
    sweep = args[:1] == ["-m"]
    args = args[1:] if sweep else args
    if not sweep:
        return [args]
    if "hydra/sweeper=hydraddp_optuna" in args:  # a search: one job, at a value every trial can take
        from hydraddp.search.space import parse, representative

        space = parse([a for a in args if not a.startswith("hydra")])
        return [space.fixed + representative(space)]
    choices = [[f"{a.split('=')[0]}={v}" for v in a.split("=", 1)[1].split(",")] for a in args]
    return [list(job) for job in itertools.product(*choices)]


# Where Horovod is not built (scripts/pythons.sh's other Pythons), its commands are refused for that alone.
HOROVOD_MISSING = "backend=horovod needs Horovod with PyTorch support, and it is not installed."
HAS_HOROVOD = importlib.util.find_spec("horovod") is not None


def test_every_hydraddp_command_composes_and_validates():
    from hydraddp.config.compose import compose
    from hydraddp.preflight.config import problems

    checked = 0
    for command in commands():
        for overrides in hydraddp_overrides(command) or []:
            cfg = compose(overrides)  # Hydra's parser and the typed schema
            if not any(p in command for p in PLACEHOLDERS):
                # Through the Slurm launcher the allocation gives the rendezvous (checked before submission so).
                cluster = "hydra/launcher=slurm" in overrides
                found = [p for p in problems(cfg, cluster_rendezvous=cluster)
                         if not (p.message.startswith(HOROVOD_MISSING) and not HAS_HOROVOD)]
                assert found == [], (command, overrides)
            checked += 1
    assert checked >= 10


def test_every_other_command_is_run_by_a_named_test():
    for command in commands():
        if hydraddp_overrides(command) is not None and not command.startswith(("torchrun", "horovodrun")):
            continue
        [runner] = [where for start, where in RUN_BY.items() if command.startswith(start)] or [None]
        assert runner is not None, f"documented command with no test that runs it: {command!r} (add it to RUN_BY)"
        path, _, test = runner.partition("::")
        text = (REPO / path).read_text()
        assert (f"def {test}(" in text) if test else command.split()[-1] in text or "dev.sh test" in text, runner


@pytest.mark.slow
def test_the_own_package_snippets_train_with_the_readmes_command(tmp_path):
    user = tmp_path / "user"
    sources = {"mypkg/__init__.py": "", "mypkg/parts.py": readme_file("mypkg/parts.py"),
               **{p: readme_file(p) for p in ("myconf/model/tiny.yaml", "myconf/data/blobs.yaml", "myconf/task/hinge.yaml")}}
    for path, text in sources.items():
        (user / path).parent.mkdir(parents=True, exist_ok=True)
        (user / path).write_text(text)
    code = "\n".join(line for line in sources["mypkg/parts.py"].splitlines() if line.strip() and
                     not line.lstrip().startswith(("#", "import", "from")))
    config = "\n".join(line for p in sources if p.endswith(".yaml") for line in sources[p].splitlines() if line.strip())
    assert len(code.splitlines()) + len(config.splitlines()) < 20  # the README's promise: under 20 lines
    [command] = [c for c in commands() if "--config-dir myconf" in c]
    args = shlex.split(command)[3:]  # after "python -m hydraddp"
    done = run_process([sys.executable, "-m", "hydraddp", *args, "trainer.max_steps=40", "trainer.eval_every=0",
                        f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"], cwd=user, timeout=180,
                       env={"PYTHONPATH": os.pathsep.join([str(user), str(REPO)])})
    assert done.returncode == 0, done.stderr[-4000:]
    [job] = job_dirs(user)
    result = json.loads((job / "result.json").read_text())
    assert result["world_size"] == 2 and all(r["wrapper"] == "fsdp2" for r in result["reports"])
    assert list(result["eval_metrics"]) == ["loss"]  # a task with loss() only: evaluation reports the loss
    assert result["losses"]["40"] < result["losses"]["10"]


def run_snippet(name: str, tmp_path: Path, timeout: float = 240) -> str:
    (tmp_path / name).write_text(readme_file(name))
    done = run_process([sys.executable, name], cwd=tmp_path, timeout=timeout)
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout.strip().splitlines()[-1]


@pytest.mark.slow
def test_the_from_python_snippet_runs_as_written(tmp_path):
    units = ast.literal_eval(run_snippet("from_python.py", tmp_path))
    assert units == {rank: ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"] for rank in (0, 1)}


@pytest.mark.slow
def test_the_core_snippet_runs_as_written(tmp_path):
    units, param_bytes = run_snippet("core.py", tmp_path).rsplit("] ", 1)
    from hydraddp.models.gpt import GPT

    assert ast.literal_eval(units + "]") == ["<root>", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    full_bytes = sum(p.numel() * 4 for p in GPT().parameters())
    assert int(param_bytes) == pytest.approx(full_bytes / 2, rel=0.01)  # FSDP2: each rank holds half


def test_the_api_listing_names_what_exists():
    import hydraddp.distributed as idist

    [listing] = [b for b in blocks("python") if b.startswith("# ignite 0.5.5's names")]
    for name in sorted(set(re.findall(r"\bidist\.(\w+)", listing))):
        assert hasattr(idist, name), name
    listed = re.search(r"idist\.auto_model\((.*?)\)\n", listing, re.S).group(1)
    assert " ".join(listed.split()) == plain_signature(idist.auto_model)


def plain_signature(fn) -> str:
    """``fn``'s parameters as the README writes them: no annotations, ``*`` before the keyword-only ones."""
    parts, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        parts.append(f"**{p.name}" if p.kind is p.VAR_KEYWORD else p.name if p.default is p.empty
                     else f"{p.name}={p.default!r}")
    return ", ".join(parts)


@pytest.mark.slow
def test_the_quickstart_run_command_trains(tmp_path):
    [command] = {c for c in commands() if c.startswith("bash scripts/dev.sh run")}  # the same on every page
    env = {"VENV": sys.prefix}  # this venv: the setup finds everything installed
    done = run_process([*shlex.split(command), "trainer.max_steps=10", "tracking.enabled=false",
                        f"hydra.run.dir={tmp_path}/job"], cwd=REPO, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads((tmp_path / "job" / "result.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_the_mlflow_ui_command_serves_the_runs(tmp_path):
    [command] = [c for c in commands() if c.startswith(".venv/bin/mlflow ui")]
    port = free_port()
    args = [str(Path(sys.executable).with_name("mlflow")), *shlex.split(command)[1:], "--port", str(port)]
    # Without MLflow's job runner (as tests/helpers/mlflow_server.py): its eight processes, each importing mlflow, were
    # most of the command's 25 CPU-seconds to its first answer.
    env = child_env("readme-ui", {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    proc = subprocess.Popen(args, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    assert response.read() == b"OK"
                    break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "mlflow ui did not start"
                time.sleep(0.3)
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(30)


def test_the_fast_tier_launches_nothing_and_checks_every_wrap_on_two_ranks():
    """The README's fast tier (collected, not run): no test that launches, and the 2-rank parity of every wrap."""
    [command] = [c for c in commands() if c.startswith(".venv/bin/python -m pytest")]
    args = [a for a in shlex.split(command)[3:] if a not in ("-n", "2")]  # collection needs no workers
    done = run_process([sys.executable, "-m", "pytest", *args, "--co", "-q", "-p", "no:cacheprovider"], cwd=REPO,
                       timeout=120)
    assert done.returncode == 0, done.stdout[-3000:]
    selected = {line for line in done.stdout.splitlines() if "::" in line}
    assert len(selected) > 200, len(selected)
    for wrap in ("ddp", "fsdp", "fsdp2"):
        assert f"tests/distributed/test_parity.py::test_sgd_losses_and_params_match_one_process[fp32-{wrap}]" in selected
    launching = ("tests/test_cli.py", "tests/clusters/test_submitit.py", "tests/horovod/", "tests/ignite_reference/",
                 "tests/tracking/test_mlflow.py", "tests/test_wheel.py")
    assert not [test for test in selected if test.startswith(launching)]


def test_every_key_of_every_option_has_a_reference_entry_with_its_meaning():
    """docs/reference/config.md is generated from conf/ and the schema (docs/config_reference.py): every key of the
    composed default config and of every group's every option is there, with a meaning from a comment beside it."""
    sys.path.insert(0, str(REPO / "docs"))
    try:
        import config_reference
    finally:
        sys.path.remove(str(REPO / "docs"))
    from omegaconf import OmegaConf

    from hydraddp.config.compose import compose

    assert config_reference.undocumented() == []
    page = config_reference.markdown()
    default = OmegaConf.to_container(compose([]), resolve=False)
    default.pop("hydra", None)
    keys = [key for key, _ in config_reference._flat(default, "")]
    assert len(keys) > 60 and all(f"| `{key}` |" in page for key in keys)
    for group, names in config_reference.options().items():
        assert all(f"### `{group}={name}`" in page for name in names)
    assert "| `wrap.kwargs.sharding_strategy` |" in page  # a key only one option (wrap=fsdp) has
