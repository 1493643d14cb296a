"""The scale check by simulation: the hardware profile, the analytic GPT profile, and GPT-3
175B (and two smaller Megatron-LM runs) planned against the published figures."""

from __future__ import annotations

import functools
import math

import pytest

from pipeline.planner.hardware import A100_80GB, Hardware
from pipeline.planner.scale import HEADER, PUBLISHED, ScaleCheck, check, main, megatron, row
from pipeline.planner.transformer import GPT, MIXED_ADAM, gpt_profile


def test_the_a100_profile_and_its_links() -> None:
    hw = A100_80GB
    assert hw.peak_flops == 312e12 and hw.per_host == 8
    assert hw.memory_budget == pytest.approx(0.9 * 80 * 2**30)
    # Within a host: NVLink's 300 GB/s each way at 80%; between hosts one 200 Gb/s adapter
    # per GPU at 80%.
    assert hw.host_link.per_byte == pytest.approx(1 / 240e9)
    assert hw.network_link.per_byte == pytest.approx(1 / 20e9)
    assert hw.host_link.allreduce(8e6, 8) == pytest.approx(14 * (2e-6 + 1e6 / 240e9))
    assert hw.compute_seconds(249.6e12, 0.0) == pytest.approx(1.0)  # 80% of 312 TFLOP/s
    assert hw.compute_seconds(0.0, 0.8 * 2.039e12) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="share in"):
        Hardware("x", 1.0, 1.5, 1.0, 1.0, 1.0, 1, 1.0, 0.0, 1.0, 0.0, 1.0)


@pytest.mark.parametrize("name, billions", [("175B", 174.6), ("39B", 39.1), ("18B", 18.4)])
def test_parameters_and_flops_follow_the_papers_equations(name: str, billions: float) -> None:
    m = PUBLISHED[name].model
    h, s, v, n = m.hidden, m.seq, m.vocab, m.layers
    # Equation (2), P = 12 l h^2 (1 + 13/12h + (V + s)/12lh), and the final layer norm.
    assert m.parameters == round(12 * n * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * n * h))
                                 + 2 * h)
    assert round(m.parameters / 1e9, 1) == billions  # as Table 1 / Table 2 list it
    # Equation (3) with recomputation, and without it the model's own FLOPs.
    b = 512
    assert m.flops_per_step(b, 1.0) == pytest.approx(
        96 * b * s * n * h * h * (1 + s / (6 * h) + v / (16 * n * h)), rel=1e-12)
    assert m.flops_per_step(b, 0.0) == pytest.approx(
        72 * b * s * n * h * h * (1 + s / (6 * h) + v / (12 * n * h)), rel=1e-12)


def test_a_blocks_costs_match_a_hand_count() -> None:
    m = GPT(layers=2, hidden=64, heads=4, seq=16, vocab=100)
    profile, sharding = gpt_profile(m, A100_80GB, batch=4, rows=[2])
    c = profile.at(2)
    t, h, s, a = 2 * 16, 64, 16, 4
    flops, bw = 312e12 * 0.8, 2.039e12 * 0.8
    block = ((24 * t * h * h + 4 * t * s * h) / flops
             + (22 * t * h + 16 * t * h + 9 * a * s * t) / bw)
    assert c.forward[1] == pytest.approx(block, rel=1e-12)
    assert c.backward_weight[1] == pytest.approx(24 * t * h * h / flops, rel=1e-12)
    assert c.backward[1] == pytest.approx(c.backward_input[1] + c.backward_weight[1])
    assert c.saved_bytes[1] == 34 * t * h + 5 * a * s * t and c.input_bytes[1] == 2 * t * h
    assert profile.num_layers == 4 and profile.batch_rows == 4
    # Parameters, each in bf16: the embedding tied to the head is one key, held by both ends.
    total, _, _ = profile.static_bytes(0, 4)
    assert total == 2 * m.parameters
    assert profile.params[0][0][0] == profile.params[-1][0][0] == 0
    # Megatron's tp: two all-reduces of the block's 2 s h-byte output each way; the
    # embedding's output once forward, the head's input gradient once backward.
    assert sharding.forward_collectives == (1, 2, 2, 0)
    assert sharding.backward_collectives == (0, 2, 2, 1)
    assert sharding.message(1, c) == 2 * t * h
    assert sharding.split_saved[1] == pytest.approx(1 - 10 * h / (34 * h + 5 * a * s))


def _within_memory(c: ScaleCheck) -> None:
    """The rules the plan obeys: tp inside a host, the ranks' product, and enough model
    parallelism to hold 16 bytes of weights, gradient and Adam state per parameter."""
    k, run = c.config, c.run
    assert k.dp * k.pp * k.tp == run.gpus and A100_80GB.per_host % k.tp == 0
    least = math.ceil(run.model.parameters * (2 + 2 + 2 * MIXED_ADAM)
                      / A100_80GB.memory_budget)
    assert k.pp * k.tp >= least
    assert max(k.peak_bytes or (math.inf,)) <= A100_80GB.memory_budget * (1 + 1e-12)


@functools.cache
def _megatron(name: str) -> ScaleCheck:
    # GPT-3's t x p at 1024 GPUs is not published: 8 x 16 is the assumption (8 GPUs a host).
    return megatron(PUBLISHED[name], pp=16)


@pytest.mark.parametrize("name", ["175B", "39B", "18B"])
def test_megatrons_own_configuration_predicts_at_most_a_quarter_above_the_paper(
        name: str) -> None:
    # The simulator's cost model on the configuration Megatron ran. Its kernels run at 80% of
    # peak with no launch gaps and its pipeline messages overlap compute, which the real run
    # did not quite achieve: the prediction may exceed the measurement (by 6% to 22% here,
    # docs/scale-check.md), but a cost model that leaves overheads out must not fall below
    # what the hardware was measured doing, and a quarter above would mean it lost touch.
    c = _megatron(name)
    assert c.recomputed == 1.0  # every micro-batch recomputed, as the paper counts it
    assert c.run.tflops <= c.executed <= 1.25 * c.run.tflops


@pytest.mark.parametrize("name", ["39B", "18B"])
def test_a_smaller_run_is_planned_at_least_as_fast_as_megatrons_configuration(
        name: str) -> None:
    c = check(PUBLISHED[name])
    _within_memory(c)
    # Megatron's configuration is one of the candidates (it fits), so the plan, the fastest
    # simulated candidate, is at least as fast; and nothing beats the profile's matmul rate.
    assert c.model >= _megatron(name).model * (1 - 1e-9)
    assert c.executed <= A100_80GB.peak_flops * A100_80GB.matmul_efficiency / 1e12
    assert c.config.rows in (1, 2)


def test_gpt3_175b_on_1024_a100s_is_planned_within_bounds() -> None:
    # How long the search takes is docs/scale-check.md's business (about 20 s on 2 cores),
    # not a test's.
    c = check(PUBLISHED["175B"])
    _within_memory(c)
    assert c.config.tp == 8  # 175B's state needs tp x pp >= 37; tp fills a host first
    assert c.config.rows == 1  # as the paper's runs: the most micro-batches for the bubble
    assert c.model >= _megatron("175B").model * (1 - 1e-9)
    assert c.executed <= A100_80GB.peak_flops * A100_80GB.matmul_efficiency / 1e12
    # The paper's 140 TFLOP/s counted with recomputation are 105 of the model's own.
    assert c.published_model == pytest.approx(105, abs=0.5)


def test_the_command_writes_markdown_rows_and_refuses_unknown_runs(
        capsys: pytest.CaptureFixture[str]) -> None:
    line = row(_megatron("18B"))
    assert line.startswith("| 18.4B | 256 | 1024 | Megatron's configuration")
    assert line.count("|") == HEADER.splitlines()[0].count("|")
    assert "| 32 x 1 x 8 | 8 x 1 | 1 | 1f1b | always |" in line
    with pytest.raises(SystemExit):
        main(["1T"])
    assert "unknown runs ['1T']" in capsys.readouterr().err
