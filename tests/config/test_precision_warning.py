"""A precision with no fast path on this machine is said before the launch, naming the faster choice."""

from __future__ import annotations

import pytest

from hydraddp.config.compose import compose
from hydraddp.parallel import machine
from hydraddp.job import Job, prepare

EMULATED = "flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512bw\n"
NATIVE = "flags\t\t: fpu vme sse sse2 avx avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"


def test_the_cpus_bf16_instructions_are_read_from_its_flags(tmp_path):
    for text, expected in ((EMULATED, False), (NATIVE, True), ("processor : 0\n", None)):
        (tmp_path / "cpuinfo").write_text(text)
        assert machine.cpu_has_fast_bf16(tmp_path / "cpuinfo") is expected
    assert machine.cpu_has_fast_bf16(tmp_path / "missing") is None


@pytest.mark.parametrize("fast, warned", [(False, True), (True, False), (None, False)])
def test_the_plan_warns_of_emulated_bf16_and_names_fp32(tmp_path, monkeypatch, fast, warned):
    monkeypatch.setattr(machine, "cpu_has_fast_bf16", lambda: fast)
    plan = prepare(compose(["precision=bf16", "tracking.enabled=false"]), tmp_path, [], False, 0, lambda p: None)
    assert isinstance(plan, Job)
    assert bool(plan.warnings) is warned
    if warned:
        assert plan.warnings[0].startswith("precision=bf16 on this CPU, which has neither AVX512-BF16 nor AMX")
        assert "precision=fp32 is the faster choice here" in plan.warnings[0]
    fp32 = prepare(compose(["precision=fp32", "tracking.enabled=false"]), tmp_path, [], False, 0, lambda p: None)
    assert fp32.warnings == ()
