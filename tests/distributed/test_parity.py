"""Parity, the core correctness test: one process and every wrap mode at 2 gloo ranks train the same.

Same seed, same data, same global batch (16), 5 steps. fp32 must agree to 1e-5. In bf16 the modes agree
with each other bitwise here, and with one process to BF16_TOL: bf16 keeps 8 mantissa bits (a relative
step of 2**-8 ~ 0.004), and a different gradient-reduction order moves results by a few such steps.
AdamW divides by sqrt(v), which turns last-bit differences in near-zero gradients into differences of
about lr in the parameters, so under AdamW the losses are compared with one process and the parameters
between the distributed modes only.
"""

import pytest

WRAPS = ("ddp", "fsdp", "fsdp2")
PRECISIONS = ("fp32", "bf16")
OPTIMS = ("sgd", "adamw")
FP32_TOL = 1e-5
BF16_TOL = 1e-2


@pytest.fixture(scope="module")
def runs(pools):
    serial_cases = [(None, p, o) for o in OPTIMS for p in (*PRECISIONS, "bf16-true")]
    dist_cases = [(w, p, o) for o in OPTIMS for p in (*PRECISIONS, "bf16-true") for w in WRAPS]
    serial = pools.run("tests.distributed.workers:train_cases", serial_cases, backend="none", nproc=1)
    dist = pools.run("tests.distributed.workers:train_cases", dist_cases)
    return serial[0], dist


def max_param_diff(a, b):
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_sgd_losses_and_params_match_one_process(runs, wrap, precision):
    serial, dist = runs
    tol = FP32_TOL if precision == "fp32" else BF16_TOL
    one, two = serial[(None, precision, "sgd")], dist[0][(wrap, precision, "sgd")]
    assert len(two["losses"]) == 5
    assert two["losses"] == pytest.approx(one["losses"], abs=tol)
    assert max_param_diff(two["params"], one["params"]) < tol
    # Training really moved the parameters (a parity of nothing would pass too).
    assert one["losses"][0] - one["losses"][-1] > 0.01


@pytest.mark.parametrize("wrap", WRAPS)
def test_ranks_agree_on_the_full_parameters(runs, wrap):
    _, dist = runs
    assert max_param_diff(dist[0][(wrap, "fp32", "sgd")]["params"], dist[1][(wrap, "fp32", "sgd")]["params"]) == 0


@pytest.mark.parametrize("wrap", WRAPS)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_adamw_losses_match_one_process_and_modes_match_each_other(runs, wrap, precision):
    serial, dist = runs
    tol = FP32_TOL if precision == "fp32" else BF16_TOL
    assert dist[0][(wrap, precision, "adamw")]["losses"] == pytest.approx(serial[(None, precision, "adamw")]["losses"], abs=tol)
    assert max_param_diff(dist[0][(wrap, precision, "adamw")]["params"], dist[0][("ddp", precision, "adamw")]["params"]) < tol


@pytest.mark.parametrize("wrap", WRAPS)
def test_bf16_true_trains_in_bf16_weights(runs, wrap):
    serial, dist = runs
    run = dist[0][(wrap, "bf16-true", "sgd")]
    assert run["report"]["storage_dtype"] == "bfloat16"
    # bf16 weights and bf16 reductions: looser than mixed bf16, still the same training.
    assert run["losses"] == pytest.approx(serial[(None, "bf16-true", "sgd")]["losses"], abs=5 * BF16_TOL)


@pytest.mark.parametrize("wrap", WRAPS)
def test_reports_say_what_was_applied(runs, wrap):
    _, dist = runs
    fp32, bf16 = dist[0][(wrap, "fp32", "sgd")]["report"], dist[0][(wrap, "bf16", "sgd")]["report"]
    assert (fp32["wrapper"], fp32["world_size"], fp32["backend"]) == (wrap, 2, "gloo")
    assert (bf16["param_dtype"], bf16["reduce_dtype"], bf16["storage_dtype"]) == ("bfloat16", "float32", "float32")
    sharded = wrap != "ddp"
    full = fp32["total_numel"] * 4
    assert fp32["param_bytes"] == (full // 2 if sharded else full)
    assert fp32["grad_bytes"] == fp32["param_bytes"]
    # SGD with momentum keeps one buffer per parameter: the optimizer state is sharded like the parameters.
    assert fp32["optim_state_bytes"] == fp32["param_bytes"]
