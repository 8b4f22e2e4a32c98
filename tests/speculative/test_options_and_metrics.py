"""Speculative decoding (issue 17): the options (bad values name the field, algorithm names are
case-insensitive, speculation off above ``speculative_disable_by_batch_size`` and for requests with
logprobs) and what it reports (``meta_info`` counters, the ``/metrics`` acceptance histogram)."""
import pytest

from sglite import Engine
from sglite.errors import InvalidRequestError
from tests.speculative.prompts import COPY_PROMPTS


# ---------------------------------------------------------------------- options
def test_bad_speculative_options_name_the_field(tmp_path):
    from sglite.config import EngineConfig

    for kw, field in [({"speculative_algorithm": "LOOKAHEAD"}, "speculative_algorithm"),
                      ({"speculative_algorithm": "EAGLE", "model_path": str(tmp_path)}, "speculative_draft_model_path"),
                      ({"speculative_algorithm": "MEDUSA", "speculative_draft_model_path": str(tmp_path / "x")},
                       "speculative_draft_model_path"),
                      ({"speculative_eagle_topk": 0}, "speculative_eagle_topk"),
                      ({"speculative_algorithm": "STANDALONE"}, "speculative_draft_model_path"),
                      ({"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(tmp_path / "x")},
                       "speculative_draft_model_path"),
                      ({"speculative_num_draft_tokens": 0}, "speculative_num_draft_tokens"),
                      ({"speculative_num_steps": 65}, "speculative_num_steps"),
                      ({"speculative_disable_by_batch_size": 0}, "speculative_disable_by_batch_size")]:
        with pytest.raises(InvalidRequestError) as ei:
            EngineConfig(**kw)
        assert ei.value.field == field


def test_speculative_algorithm_is_case_insensitive():
    """``ngram`` / ``--speculative-algorithm standalone`` are SGLang's NGRAM / STANDALONE; unknown
    names are still refused naming the field."""
    import argparse

    from sglite.config import EngineConfig
    from sglite.flags import add_engine_args

    assert EngineConfig(speculative_algorithm="ngram").speculative_algorithm == "NGRAM"
    p = add_engine_args(argparse.ArgumentParser())
    assert p.parse_args(["--speculative-algorithm", "Ngram"]).speculative_algorithm == "NGRAM"
    with pytest.raises(ValueError, match="speculative_algorithm"):
        EngineConfig(speculative_algorithm="lookahead")
    assert EngineConfig(speculative_algorithm="eagle").speculative_algorithm == "EAGLE"


def test_speculation_off_above_batch_size_and_for_logprobs(tiny_model_dir):
    e = Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=4096,
               speculative_algorithm="NGRAM", speculative_disable_by_batch_size=2)
    try:
        out = e.generate(COPY_PROMPTS[:3], {"max_new_tokens": 12, "temperature": 0})
        assert all("spec_verify_ct" not in o["meta_info"] for o in out)  # 3 decoding > 2: never drafted
        one = e.generate(COPY_PROMPTS[0], {"max_new_tokens": 12, "temperature": 0}, return_logprob=True)
        assert "spec_verify_ct" not in one["meta_info"] and len(one["meta_info"]["output_token_logprobs"]) == 12
        one = e.generate(COPY_PROMPTS[0], {"max_new_tokens": 12, "temperature": 0})
        assert one["meta_info"]["spec_verify_ct"] > 0
    finally:
        e.shutdown()


# ---------------------------------------------------------------------- server: meta_info and /metrics
def test_meta_info_and_metrics_report_acceptance(tiny_model_dir):
    import httpx

    from sglite.server.runner import ServerThread
    from sglite.server.settings import ServerConfig

    eng = Engine(str(tiny_model_dir), dtype="float32", device="cpu", max_total_tokens=2048,
                 speculative_algorithm="NGRAM")
    try:
        with ServerThread(eng, ServerConfig(port=0, enable_metrics=True)) as srv:
            out = httpx.post(srv.url + "/generate", timeout=60, json={
                "text": COPY_PROMPTS[0], "sampling_params": {"max_new_tokens": 32, "temperature": 0}}).json()
            meta = out["meta_info"]
            assert meta["spec_verify_ct"] > 0 and meta["spec_accept_length"] > 1.0
            text = httpx.get(srv.url + "/metrics").text
        counts = {ln.split()[0]: float(ln.split()[-1]) for ln in text.splitlines()
                  if ln.startswith("sglite_spec_accept_length")}
        assert counts["sglite_spec_accept_length_count"] == meta["spec_verify_ct"]
        assert counts["sglite_spec_accept_length_sum"] == meta["spec_verify_ct"] + meta["spec_accepted_tokens"]
        assert counts['sglite_spec_accept_length_bucket{le="1.0"}'] == meta["spec_accept_histogram"][0]
    finally:
        eng.shutdown()
