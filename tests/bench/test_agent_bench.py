"""`sglite bench agent` bookkeeping on the fake engine: every turn is a call, its result goes into
the next turn, per-turn TTFT and cached tokens are summed right, in both modes."""
import json

import pytest

from sglite.bench import agent
from sglite.server.runner import ServerThread
from sglite.server.settings import ServerConfig
from sglite.server.testing import FakeEngine


@pytest.fixture(scope="module")
def server():
    with ServerThread(FakeEngine(context_length=16384, max_total_tokens=1 << 20), ServerConfig(port=0)) as s:
        yield s


@pytest.mark.parametrize("mode", agent.MODES)
def test_bench_agent_modes(server, mode, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert agent.main(["--base-url", server.url, "--num-conversations", "3", "--turns", "4", "--modes", mode,
                       "--max-output-tokens", "128", "--output-json", str(out)]) == 0
    (res,) = json.loads(out.read_text())["results"]
    assert res["mode"] == mode and res["conversations"] == 3 and len(res["per_turn"]) == 4
    for t in res["per_turn"]:
        assert t["calls"] == 3 and t["ttft_mean_s"] is not None and t["ttft_mean_s"] > 0
        assert 0 <= t["cached_tokens"] <= t["input_tokens"]
    turns = res["per_turn"]
    # the prompt grows each turn by the previous call, its result and the new question
    assert all(b["input_tokens"] > a["input_tokens"] for a, b in zip(turns, turns[1:]))
    # the fake engine caches prompts (not outputs) and counts the longest shared prefix: turn k+1's
    # prompt extends turn k's, in both modes (the server renders the stored history the same way)
    assert all(b["cached_tokens"] >= a["input_tokens"] for a, b in zip(turns, turns[1:]))
    assert 0 < res["hit_rate_after_first"] < 1 and res["hit_rate_after_first"] < res["prefix_reuse"] <= 1
    assert "mode " + mode in capsys.readouterr().out


def test_rounds_alternate_the_modes_and_report_the_spread(server, tmp_path, capsys):
    out = tmp_path / "r.json"
    assert agent.main(["--base-url", server.url, "--num-conversations", "2", "--turns", "3", "--rounds", "3", "--max-output-tokens", "128",
                       "--output-json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [r["mode"] for r in data["results"]] == list(agent.MODES) * 3
    printed = capsys.readouterr().out
    for mode in agent.MODES:
        sp = data["spread"][mode]
        ratios = [r["ttft_last_over_first"] for r in data["results"] if r["mode"] == mode]
        assert sp["ratios"] == ratios and len(ratios) == 3
        assert sp["min"] == min(ratios) <= sp["median"] <= sp["max"] == max(ratios)
        assert f"== {mode}, 3 runs: TTFT last/first {ratios[0]:.2f}, " in printed
    with pytest.raises(SystemExit, match="--rounds: must be >= 1"):
        agent.main(["--base-url", server.url, "--rounds", "0"])


def test_a_call_cut_off_by_max_output_tokens_stops_the_bench_with_the_flag_named(server):
    # the fake engine's call is longer than 16 tokens: turn 1 ends incomplete, and sending its
    # broken arguments back would only get a 400 about JSON
    with pytest.raises(RuntimeError, match="turn 1 of conversation 0 ended incomplete at --max-output-tokens 16"):
        agent.main(["--base-url", server.url, "--num-conversations", "1", "--turns", "2", "--modes", "full",
                    "--max-output-tokens", "16"])


def test_history_bookkeeping():
    conv = agent.Conversation(0)
    first = agent.request_body(conv, 0, "full", "m", 16)
    assert first["input"] == [{"role": "user", "content": "Question 1: what is the weather in Paris right now?"}]
    call = {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    agent.record(conv, "full", 0.01, {"id": "resp_1", "output": [call],
                                      "usage": {"input_tokens": 50, "input_tokens_details": {"cached_tokens": 7}}})
    second = agent.request_body(conv, 1, "full", "m", 16)
    assert [i.get("type", "message") for i in second["input"]] == ["message", "function_call",
                                                                   "function_call_output", "message"]
    assert json.loads(second["input"][2]["output"])["city"] == "Paris"
    prev = agent.Conversation(1)
    agent.request_body(prev, 0, "previous", "m", 16)
    agent.record(prev, "previous", None, {"id": "resp_9", "output": [call]})
    body = agent.request_body(prev, 1, "previous", "m", 16)
    assert body["previous_response_id"] == "resp_9" and len(body["input"]) == 2 and body["store"]
    s = agent.summarize([conv], 1)
    assert s["per_turn"][0]["hit_rate"] == pytest.approx(7 / 50) and s["per_turn"][0]["calls"] == 1
