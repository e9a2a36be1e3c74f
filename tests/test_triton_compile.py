"""Every Triton kernel configuration compiles ahead of time for sm_80 and sm_90 (CPU only, no
GPU): no compile error, no spill, registers and shared memory within the target's limits. Plus
the checker's own limits, the specs' coverage of the wrappers' choices, and the roofline table.

Cost: about 50 compiles of a few seconds each on a 2-core machine (both cores used; Triton's
cache makes a second run take seconds).
"""
from __future__ import annotations

import os

import pytest

triton = pytest.importorskip("triton")

from ragfast.kernels import aot  # noqa: E402


def _has_nvidia_backend() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return os.path.exists(get_ptxas(80).path)
    except Exception:
        return False


needs_ptxas = pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton's NVIDIA backend / ptxas not bundled")


@pytest.fixture(scope="module")
def reports():
    return aot.check_all(list(aot.REQUIRED), workers=max(1, min(4, os.cpu_count() or 1)))


@needs_ptxas
def test_every_configuration_compiles_without_spills_for_sm80_and_sm90(reports):
    print("\n" + aot.format_table(reports))
    assert len(reports) == 2 * len(aot.all_specs())
    bad = [r for r in reports if not r.ok]
    assert not bad, aot.format_table(bad)
    for r in reports:
        assert 0 < r.registers <= 255 and r.spill_stores == 0 and r.spill_loads == 0
        assert 0 <= r.shared <= aot.TARGETS[r.target]["smem_per_block"]


@needs_ptxas
def test_the_checker_flags_what_breaks_a_limit(reports):
    ok = reports[0]  # the first spec on sm_80
    assert ok.target == 80 and ok.ok and ok.registers > 0 and ok.shared > 0
    # a target whose shared memory and registers are smaller than this kernel needs
    tight = {80: {"smem_per_block": ok.shared - 1, "regs_per_block": 65536, "regs_per_thread": ok.registers - 1}}
    bad, broken = aot.check_all([80], indices=[0], limits=tight) + aot.check_all(
        [80], indices=[0], signature={"q_ptr": "*fp8e4nv"})  # an fp8 x fp32 dot does not compile
    assert not bad.ok and any("shared memory" in p for p in bad.problems)
    assert any("registers" in p for p in bad.problems)
    assert not broken.ok and broken.problems[0].startswith("compile error")


def test_specs_cover_every_choice_of_the_wrappers():
    from ragfast.kernels import prefix_attention as pa
    from ragfast.kernels import topk_scan as ts

    configs = {s.config for s in ts.aot_specs()}
    for mode, dtypes in ts.MODE_DTYPES.items():
        for B in (1, 16, 17, 64, 1000):
            cfg = ts.choose_config(mode, B)
            for dt in dtypes:
                want = (f"{ts.MODE_NAMES[mode]} {ts.TRITON_TYPE[dt]} {cfg.block_q}x{cfg.block_n}x{cfg.block_d} "
                        f"w{cfg.num_warps}")
                assert want in configs
    blocks = {s.constexprs["BLOCK_D"] for s in pa.aot_specs()}
    for D in range(1, pa.MAX_HEAD_DIM + 1):
        assert max(16, triton.next_power_of_2(D)) in blocks
    assert {s.config.split()[0] for s in pa.aot_specs()} == {"fp32", "fp16", "bf16"}


def test_roofline_agrees_with_the_report_cost_table():
    from ragfast.kernels.roofline import GPUS, floor_seconds, prefix_attention_cost, topk_ip_cost
    from ragfast.accounting.projection import DEVICES

    for key in ("h100", "h200"):
        assert GPUS[key].bf16 == DEVICES[key].flops_per_s
        assert GPUS[key].hbm_bytes_per_s == DEVICES[key].bytes_per_s
    h200 = GPUS["h200"]
    # hand-computed: 1M x 768 bf16 rows, one query: 1.536 GB to read, 3.07 GFLOP at 989 TFLOP/s
    c = topk_ip_cost("bf16", 1, 1_000_000, 768, 10)
    assert c.flops == 2 * 2 * 1_000_000 * 768
    assert 1_000_000 * 768 * 2 < c.bytes < 1_000_000 * 768 * 2 * 1.01
    assert floor_seconds(c, h200) == pytest.approx(c.bytes / 4.8e12)
    # 256 fp32 queries on CUDA cores: compute-bound, 393 GFLOP at 67 TFLOP/s = 5.87 ms
    c = topk_ip_cost("fp32", 256, 1_000_000, 768, 10)
    assert floor_seconds(c, h200) == pytest.approx(2 * 256 * 1_000_000 * 768 / 67e12)
    p = prefix_attention_cost(1, 2, 1, 4, 8, 16, visible=10, dtype="fp16")
    assert p.flops == 4 * 2 * 16 * 10 and p.bytes == 2 * (2 * 2 * 4 * 16 + 2 * 1 * 8 * 16) + 8 * 4
