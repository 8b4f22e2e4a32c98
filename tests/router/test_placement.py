"""DistServe-style placement estimate: queueing formulas and the colocated/disaggregated comparison."""
import math

from sglite.router.placement import (StepTimes, decode_batch, goodput_per_device, max_rate,
                                          meets_colocated, mdl_ttft)


def test_md1_queue():
    assert mdl_ttft(0.0, 2.0) == 2.0
    assert mdl_ttft(0.25, 2.0) == 2.0 + 0.25 * 4 / (2 * 0.5)  # D + R D^2 / (2 (1 - R D))
    assert mdl_ttft(0.5, 2.0) == math.inf


def test_decode_batch_is_littles_law_fixed_point():
    st = StepTimes(1.0, 0.05, 0.002, 48)
    b = decode_batch(2.0, st)
    assert abs(b - 2.0 * 48 * st.step(b)) < 1e-9
    assert decode_batch(1 / (48 * 0.002), st) == math.inf


def test_fit_recovers_a_line():
    st = StepTimes.fit(1.0, {1: 0.052, 8: 0.066, 32: 0.114}, 48)
    assert abs(st.decode_a - 0.05) < 1e-9 and abs(st.decode_b - 0.002) < 1e-9


def test_interference_makes_disaggregation_win_under_a_tight_tpot():
    """Long prefills and a TPOT SLO close to the bare decode step: colocated decode steps are
    stretched by the prefill share, so splitting the phases serves more per device."""
    st = StepTimes(prefill_s=2.0, decode_a=0.1, decode_b=0.001, output_len=48)
    g = goodput_per_device(st, ttft_slo=8.0, tpot_slo=0.15, max_devices=4)
    assert g["disaggregated"][0] > g["colocated"][0] > 0
    # with no TPOT pressure the colocated device is never worse by more than the split's rounding
    g2 = goodput_per_device(st, ttft_slo=8.0, tpot_slo=100.0, max_devices=4)
    assert g2["colocated"][0] >= 0.9 * g2["disaggregated"][0]


def test_max_rate_bisection():
    assert abs(max_rate(lambda r: r <= 3.5) - 3.5) < 1e-6
    assert max_rate(lambda r: False) == 0.0
    st = StepTimes(1.0, 0.05, 0.002, 48)
    r = max_rate(lambda r: meets_colocated(r, st, 1, 4.0, 0.4))
    assert meets_colocated(r * 0.99, st, 1, 4.0, 0.4) and not meets_colocated(r * 1.02, st, 1, 4.0, 0.4)


def test_kv_transfer_time_counts_against_disaggregated_ttft_only():
    """The transfer adds to the disaggregated TTFT: at a TTFT SLO of prefill + transfer the
    single prefill device can no longer meet it at any rate; colocated is unaffected."""
    from sglite.router.placement import meets_disaggregated

    st = StepTimes(prefill_s=2.0, decode_a=0.1, decode_b=0.001, output_len=48)
    slow = StepTimes(prefill_s=2.0, decode_a=0.1, decode_b=0.001, output_len=48, transfer_s=0.5)
    assert meets_disaggregated(0.1, st, 1, 1, ttft_slo=2.4, tpot_slo=1.0)
    assert not meets_disaggregated(0.1, slow, 1, 1, ttft_slo=2.4, tpot_slo=1.0)
    g, g_slow = (goodput_per_device(s, ttft_slo=4.0, tpot_slo=0.15, max_devices=4) for s in (st, slow))
    assert g_slow["colocated"] == g["colocated"]
    assert 0 < g_slow["disaggregated"][0] < g["disaggregated"][0]
    assert StepTimes.fit(2.0, {1: 0.1, 8: 0.2}, 48, transfer_s=0.5).transfer_s == 0.5
