"""A user's own package, outside the repository, with its own model, dataset, task and config folder, trains
through Hydra's --config-dir with no edit to hydraddp (the README's "Your own experiment")."""

from __future__ import annotations

import json
import os
import textwrap

import pytest

from tests.helpers.spawn import REPO, job_dirs, run_cli

pytestmark = pytest.mark.slow  # launches for real: see docs/development/tests.md

PACKAGE = {
    "mypkg/__init__.py": "",
    "mypkg/parts.py": '''
        import torch
        from torch import nn
        from torch.utils.data import TensorDataset


        class TinyNet(nn.Module):
            def __init__(self, width: int):
                super().__init__()
                self.layers = nn.Sequential(nn.Linear(2, width), nn.Tanh(), nn.Linear(width, 3))

            def forward(self, points):
                return self.layers(points)


        def blobs(n: int, seed: int = 0):
            generator = torch.Generator().manual_seed(seed)
            labels = torch.randint(0, 3, (n,), generator=generator)
            centers = torch.tensor([[0.0, 3.0], [3.0, -2.0], [-3.0, -2.0]])
            points = centers[labels] + 1.2 * torch.randn(n, 2, generator=generator)
            cut = n * 3 // 4
            return TensorDataset(points[:cut], labels[:cut]), TensorDataset(points[cut:], labels[cut:])


        class Hinge:
            """Multi-class hinge loss; reports accuracy as "hits"."""

            def loss(self, model, batch):
                points, labels = batch
                return nn.functional.multi_margin_loss(model(points), labels)

            def eval_sums(self, model, batch):
                points, labels = batch
                scores = model(points)
                return {"loss_sum": nn.functional.multi_margin_loss(scores, labels, reduction="sum"),
                        "hits": (scores.argmax(-1) == labels).sum(), "count": torch.tensor(len(labels))}

            def summarize(self, sums):
                return {"loss": sums["loss_sum"] / sums["count"], "hits": sums["hits"] / sums["count"]}
    ''',
    "myconf/model/tiny.yaml": "_target_: mypkg.parts.TinyNet\nwidth: 16\n",
    "myconf/data/blobs.yaml": "dataset:\n  _target_: mypkg.parts.blobs\n  n: 1024\nbatch_size: 32\neval_batch_size: 128\n",
    "myconf/task/hinge.yaml": "_target_: mypkg.parts.Hinge\n",
}


def test_a_package_outside_the_repo_trains_through_config_dir(tmp_path):
    user = tmp_path / "user"
    for path, text in PACKAGE.items():
        (user / path).parent.mkdir(parents=True, exist_ok=True)
        (user / path).write_text(textwrap.dedent(text))
    done = run_cli("--config-dir", str(user / "myconf"), "model=tiny", "data=blobs", "task=hinge",
                   "trainer.max_steps=40", "trainer.log_every=10", "trainer.eval_every=0", "optim.optimizer.lr=0.01",
                   cwd=tmp_path / "run", env={"PYTHONPATH": os.pathsep.join([str(user), str(REPO)])})
    assert done.returncode == 0, done.stderr[-4000:]
    [job] = job_dirs(tmp_path / "run")
    result = json.loads((job / "result.json").read_text())
    assert result["world_size"] == 2 and sorted(result["eval_metrics"]) == ["hits", "loss"]
    assert result["eval_metrics"]["hits"] > 0.8  # three blobs, a little overlap
    losses = [result["losses"][str(step)] for step in (10, 40)]
    assert losses[1] < losses[0]
