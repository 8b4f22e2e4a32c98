"""ShareGPT-format datasets (`--dataset sharegpt --dataset-path FILE`): reading, sampling, filtering, errors."""
import json

import pytest

from sglite.bench import serving
from sglite.bench.workloads import SHAREGPT_CONTEXT_LEN, load_sharegpt, sharegpt_workload


def words(text):
    """A stand-in tokenizer: one token per whitespace-separated word."""
    return text.split()


def conv(*turns):
    return {"id": "x", "conversations": [{"from": who, "value": v} for who, v in turns]}


def write(tmp_path, data, name="sharegpt.json"):
    p = tmp_path / name
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return p


def test_first_human_turn_is_the_prompt_and_the_gpt_reply_sets_the_output_len(tmp_path):
    path = write(tmp_path, [
        conv(("system", "be nice"), ("human", "what is two plus two"), ("gpt", "it is four, of course"),
             ("human", "and three"), ("gpt", "six")),
        conv(("gpt", "a reply before any question"), ("human", "tell me a joke please"), ("gpt", "no jokes today")),
        conv(("human", "only a question here")),          # no reply: skipped
        {"conversations": []},                              # nothing: skipped
    ])
    pairs = load_sharegpt(path)
    assert pairs == [("what is two plus two", "it is four, of course"), ("tell me a joke please", "no jokes today")]
    sessions = sharegpt_workload(pairs, 10, words, seed=0)
    got = {s.turns[0].text: s.turns[0].output_len for s in sessions}
    assert got == {"what is two plus two": 5, "tell me a joke please": 3}
    assert all(len(s.turns) == 1 and not s.chat and s.turns[0].ignore_eos for s in sessions)
    fixed = sharegpt_workload(pairs, 10, words, output_len=7)
    assert {s.turns[0].output_len for s in fixed} == {7}


def test_too_short_and_too_long_pairs_are_skipped_and_sampling_is_seeded():
    pairs = [("hi", "hello there friend")]                               # 1-token prompt: too short
    pairs += [("a fine question", "ok")]                                # 1-token reply: too short
    pairs += [("long " * 30, "reply " * 30)]                             # 60 tokens > context 50: too long
    pairs += [(f"question number {i}", "a short answer") for i in range(20)]
    s = sharegpt_workload(pairs, 100, words, seed=1, context_len=50)
    texts = [x.turns[0].text for x in s]
    assert len(s) == 20 and all(t.startswith("question number") for t in texts)
    assert {x.turns[0].output_len for x in s} == {3}
    five = [x.turns[0].text for x in sharegpt_workload(pairs, 5, words, seed=1, context_len=50)]
    assert len(five) == 5 and five == texts[:5]
    other = [x.turns[0].text for x in sharegpt_workload(pairs, 5, words, seed=2, context_len=50)]
    assert other != five                                                # the seed shuffles the pairs
    # the default context limit (SGLang/vLLM's 2048) keeps everything above
    assert len(sharegpt_workload(pairs, 100, words)) == 21 and SHAREGPT_CONTEXT_LEN == 2048
    with pytest.raises(ValueError, match="--dataset-path"):
        sharegpt_workload(pairs[:3], 5, words, context_len=50)          # nothing passes the filter
    with pytest.raises(ValueError, match="num_prompts"):
        sharegpt_workload(pairs, 0, words)
    with pytest.raises(ValueError, match="sharegpt_output_len"):
        sharegpt_workload(pairs, 3, words, output_len=0)


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ("{not json", "not a readable JSON file"),
    ({"conversations": []}, "JSON list"),
    ([{"turns": []}], "entry 0 .* no 'conversations' list"),
    ([conv(("gpt", "only replies"))], "no conversation with a human turn followed by a gpt turn"),
])
def test_missing_or_malformed_file_names_dataset_path(tmp_path, content, message):
    path = tmp_path / "missing.json" if content is None else write(tmp_path, content)
    with pytest.raises(ValueError, match=f"--dataset-path: .*{message}"):
        load_sharegpt(path)


def test_cli_checks_name_the_flag(tmp_path, capsys):
    p = serving.build_parser()
    a = p.parse_args(["--dataset-path", "x.json"])
    serving.check_args(a)
    assert a.dataset == "sharegpt"                       # a path alone selects the ShareGPT dataset
    a = p.parse_args([])
    serving.check_args(a)
    assert a.dataset == "random"
    for argv, flag in ((["--dataset-name", "sharegpt"], "--dataset-path"),
                       (["--dataset", "random", "--dataset-path", "x.json"], "--dataset-path"),
                       (["--dataset-path", "x.json", "--sharegpt-output-len", "0"], "--sharegpt-output-len"),
                       (["--dataset-path", "x.json", "--sharegpt-context-len", "3"], "--sharegpt-context-len")):
        with pytest.raises(ValueError, match=flag):
            serving.check_args(p.parse_args(argv))
    # the entry point stops before any request with a usage error naming the flag
    with pytest.raises(SystemExit) as exc:
        serving.main(["--base-url", "http://127.0.0.1:9", "--dataset-path", str(tmp_path / "nope.json")])
    assert exc.value.code == 2 and "--dataset-path: no such file" in capsys.readouterr().err
