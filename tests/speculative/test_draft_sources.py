"""Speculative decoding (issue 17): where drafts come from. The n-gram index over the request's
tokens, the text-level prompt lookup (copies across JSON punctuation, word-aligned matches first,
short unaligned matches dropped) and the byte-joined tail text it reads.

Oracles: proposals worked by hand, the tokenizer's own decode / encode for the tail text, and
greedy output token for token against the engine without speculation for copy-into-JSON prompts.
"""
import json

from sglite.runtime.speculative import NgramIndex
from sglite.runtime.speculative.text_lookup import TextLookup, TokenText
from tests.speculative.prompts import SOURCE


# ---------------------------------------------------------------------- n-gram index
def test_ngram_index_proposes_the_latest_longest_match():
    idx = NgramIndex([5, 6, 7, 8, 1, 2, 5, 6, 9, 9, 5, 6])
    # "5 6" occurred twice before: the latest (followed by 9 9) comes first
    assert idx.propose(3, candidates=2) == [[9, 9, 5], [7, 8, 1]]
    idx.extend([7])  # "5 6 7": the 3-gram match wins over the later 1-gram "7"
    assert idx.propose(4) == [[8, 1, 2, 5]]
    assert NgramIndex([1, 2, 3]).propose(4) == []  # nothing repeats
    assert idx.propose(0) == []


def test_ngram_sync_indexes_only_new_tokens():
    seq = [3, 4, 5, 3, 4]
    idx = NgramIndex()
    idx.sync(len(seq), lambda a, b: seq[a:b])
    assert idx.propose(2) == [[5, 3]]
    seq += [5, 3]
    idx.sync(len(seq), lambda a, b: seq[a:b])
    assert idx.seq == seq and idx.propose(1) == [[4]]


# ---------------------------------------------------------------------- text lookup
def test_text_lookup_copies_across_json_punctuation():
    look = TextLookup(SOURCE)
    # the model spelled the value's start with a token the prompt never had ("mar" after a quote)
    (m,) = look.find('{"name":"Maria Gonzalez","email":"mar', 12)
    assert m.cont == "ia.gonzalez@" and m.chars == 3 and m.aligned
    # a one-character start: word-aligned occurrences ("Seville") rank before the latest one
    # ("JSON", mid-word)
    got = look.find('","city":"S', 6, candidates=3)
    assert got[0].cont == "eville" and got[0].aligned
    assert any(g.cont.startswith("ON.") and not g.aligned for g in got)
    assert look.find('":"', 5) == []  # JSON punctuation alone matches nothing in the prompt
    assert look.longest_suffix("xyz Seville and") == len(" Seville and")
    assert look.find("qqq", 4) == [] and look.find("Maria", 0) == []


def test_text_lookup_continuations_are_distinct_and_bounded():
    look = TextLookup("ab cd ab cd ab ce")
    got = look.find("ab c", 3, candidates=5)
    assert [g.cont for g in got] == ["e", "d a"]  # latest first, duplicates dropped
    assert all(len(g.cont) <= 3 for g in got)


def test_text_lookup_min_chars_drops_short_unaligned_matches():
    look = TextLookup("the cat sat on the mat")
    assert look.find("xqat", 6)  # "qat": not in the source; "at" is (2 chars, mid-word in the tail)
    assert look.find("xqat", 6, min_chars=3) == []
    assert look.find("xx at", 6, min_chars=3)  # "at" starts a word in the tail: may be aligned
    assert look.find("on the m", 6, min_chars=3)[0].cont == "at"  # long enough: kept


# ---------------------------------------------------------------------- tail text
def test_token_text_joins_bytes_like_the_tokenizer_decodes(real_tokenizer):
    tok = real_tokenizer
    text = "Héllo wörld — 日本語 tokens, \"quoted\" {json: 1}\n<|im_end|> next"
    ids = tok.encode(text)
    tt = TokenText(tok)
    tt.check(ids, tok.decode(ids, skip_special_tokens=False))
    assert tt._exact
    for a in range(0, len(ids), 3):
        for b in range(a + 1, min(len(ids), a + 12) + 1):
            assert tt.text(ids[a:b]) == tok.decode(ids[a:b], skip_special_tokens=False)
    for s in ("Seville\", \"job\": \"", " the members agreed", "<|im_start|>assistant\nHi"):
        assert tt.encode(s) == tok.encode(s)
    space = tok.encode(" members")[0]
    assert tt.starts_word(space) and not tt.starts_word(tok.encode("members")[0])


# ---------------------------------------------------------------------- engine: text drafts
def test_json_extraction_greedy_identical_with_text_drafts(ngram_pair):
    """Copy-into-JSON prompts, batched and alone: same tokens as without speculation."""
    base, spec = ngram_pair
    schema = {"type": "object", "additionalProperties": False, "required": ["name", "city"],
              "properties": {"name": {"type": "string", "maxLength": 20}, "city": {"type": "string", "maxLength": 20}}}
    prompts = [SOURCE + ' {"name":"Maria Gonzalez","city":"Seville"} again:',
               "Tom Becker lives in Hamburg. " * 3 + "JSON:"]
    sps = [{"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema)},
           {"max_new_tokens": 40, "temperature": 0, "json_schema": json.dumps(schema), "frequency_penalty": 0.3}]
    want = [o["output_ids"] for o in base.generate(prompts, sps)]
    assert [o["output_ids"] for o in spec.generate(prompts, sps)] == want
    assert [spec.generate(p, s)["output_ids"] for p, s in zip(prompts, sps)] == want
