"""Tokenizer wrapper: ids, EOS set, chat template and role markers derived from it."""
from types import SimpleNamespace

import pytest

from sglite.errors import InvalidRequestError
from sglite.runtime.tokenizer import Tokenizer

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Capital of France?"},
]


def test_basic_facts(real_tokenizer, real_checkpoint):
    tok = real_tokenizer
    assert tok.vocab_size == real_checkpoint.hf_config.vocab_size == len(tok.hf)
    im_end = tok.hf.convert_tokens_to_ids("<|im_end|>")
    assert im_end in tok.eos_token_ids
    assert real_checkpoint.hf_config.eos_token_id in tok.eos_token_ids
    assert {tok.hf.bos_token_id, im_end} <= tok.special_token_ids
    assert tok.hf.convert_tokens_to_ids("Hello") not in tok.special_token_ids


@pytest.mark.parametrize("text", ["Hello world", "  spaces\n\ttabs", "你好，世界 😀👍🏽", "naïve café"])
def test_roundtrip(real_tokenizer, text):
    ids = real_tokenizer.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert real_tokenizer.decode(ids) == text


def test_special_tokens_in_decode(real_tokenizer):
    tok = real_tokenizer
    ids = tok.encode("Hi<|im_end|>there")
    assert tok.hf.convert_tokens_to_ids("<|im_end|>") in ids
    assert tok.decode(ids) == "Hithere"
    assert tok.decode(ids, skip_special_tokens=False) == "Hi<|im_end|>there"
    assert tok.convert_ids_to_tokens(tok.encode(" the")) == ["Ġthe"]
    assert tok.id_to_text(tok.encode(" the")[0]) == " the"
    assert tok.id_to_text(tok.hf.convert_tokens_to_ids("<|im_end|>")) == "<|im_end|>"


def test_config_overrides_vocab_size_and_eos(real_tokenizer):
    cfg = SimpleNamespace(vocab_size=49280, eos_token_id=[0, 7])
    tok = Tokenizer(real_tokenizer.hf, hf_config=cfg, generation_eos=[9])
    assert tok.vocab_size == 49280
    assert {0, 7, 9, real_tokenizer.hf.eos_token_id} <= tok.eos_token_ids


def test_role_markers_rebuild_the_template(real_tokenizer):
    tok = real_tokenizer
    markers = tok.role_markers()
    assert set(markers) == {"system", "user", "assistant"}
    built = "".join(markers[m["role"]][0] + m["content"] + markers[m["role"]][1] for m in MESSAGES)
    assert built == tok.apply_chat_template(MESSAGES, add_generation_prompt=False)
    gen = tok.apply_chat_template(MESSAGES, add_generation_prompt=True)
    assert gen == built + markers["assistant"][0]
    assert tok.end_of_turn == "<|im_end|>"


def test_default_system_prompt(real_tokenizer):
    tok = real_tokenizer
    default = tok.default_system_prompt
    assert default and "SmolLM" in default
    sys_b, sys_a = tok.role_markers()["system"]
    usr_b, usr_a = tok.role_markers()["user"]
    rendered = tok.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=False)
    assert rendered == sys_b + default + sys_a + usr_b + "x" + usr_a


def test_markers_come_from_the_template_not_chatml(real_checkpoint):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(real_checkpoint.model_dir)
    hf.chat_template = (
        "{{ bos_token }}{% for m in messages %}[{{ m['role'] | upper }}]: {{ m['content'] }}"
        "{% if m['role'] == 'assistant' %}<|endoftext|>{% endif %}{{ '\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}[ASSISTANT]: {% endif %}")
    tok = Tokenizer(hf)
    assert hf.convert_tokens_to_ids("<|endoftext|>") in tok.eos_token_ids
    markers = tok.role_markers()
    assert markers["user"] == ("[USER]: ", "\n")
    assert markers["assistant"] == ("[ASSISTANT]: ", "<|endoftext|>\n")
    assert markers["system"][0].endswith("[SYSTEM]: ")
    assert tok.end_of_turn == "<|endoftext|>"
    assert tok.default_system_prompt is None


def test_no_chat_template(real_checkpoint):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(real_checkpoint.model_dir)
    hf.chat_template = None
    tok = Tokenizer(hf)
    assert tok.eos_token_ids == {hf.eos_token_id}
    with pytest.raises(InvalidRequestError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])


def test_model_info_without_chat_template(real_checkpoint, real_tokenizer):
    """A model with no chat template (the Gemma 3 270M GGUF) still reports its model info, with no
    markers, so ``sglite serve`` starts and serves raw completions (it crashed at start-up)."""
    from transformers import AutoTokenizer

    from sglite.frontend.chat_template import ChatTemplate
    from sglite.runtime.engine_info import model_info

    hf = AutoTokenizer.from_pretrained(real_checkpoint.model_dir)
    hf.chat_template = None
    ckpt = SimpleNamespace(source="m.gguf")
    runner = SimpleNamespace(context_length=64, vocab_size=len(hf), dtype="torch.float32", device="cpu")
    info = model_info(ckpt, runner, Tokenizer(hf))
    assert (info["role_markers"], info["end_of_turn"], info["default_system_prompt"]) == ({}, None, None)
    assert info["eos_token_ids"] == [hf.eos_token_id] and info["model_path"] == "m.gguf"
    tpl = ChatTemplate.from_model_info(info)
    assert tpl.prefix("user") == tpl.suffix("user") == "" and tpl.end_of_turn is None
    with_template = model_info(ckpt, runner, real_tokenizer)  # the same call with a template: markers
    assert with_template["role_markers"]["user"] == list(real_tokenizer.role_markers()["user"])
    assert with_template["end_of_turn"] == real_tokenizer.end_of_turn == "<|im_end|>"


def test_from_dir_without_tokenizer(tmp_path):
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        Tokenizer.from_dir(tmp_path)


def test_decode_calls_the_fast_backend_with_hf_decode_results(real_tokenizer):
    import random

    from sglite.runtime.tokenizer import _plain_fast_backend

    tok = real_tokenizer
    assert tok._backend is not None  # the default model's tokenizer is a plain fast one
    rng = random.Random(0)
    special = sorted(tok.special_token_ids)
    for _ in range(300):  # random windows: special tokens, split UTF-8 bytes, leading spaces
        ids = [rng.choice(special) if rng.random() < 0.1 else rng.randrange(len(tok.hf)) for _ in range(rng.randint(1, 6))]
        for skip in (True, False):
            assert tok.decode(ids, skip_special_tokens=skip) == tok.hf.decode(
                ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    class CustomDecode(type(tok.hf)):
        def decode(self, *a, **k):
            return "custom"

    custom = object.__new__(CustomDecode)
    assert _plain_fast_backend(custom) is None and _plain_fast_backend(SimpleNamespace()) is None


def _bos_tokenizer():
    """A word-level fast tokenizer whose post-processor prepends <bos> (as Gemma's and Llama's do)."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "a": 4, "b": 5}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return PreTrainedTokenizerFast(tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", pad_token="<pad>")


def test_prompt_bos_follows_the_tokenizer(real_tokenizer):
    """A text prompt starts with BOS exactly when the tokenizer itself adds one (SGLang's and
    llama.cpp's prompt encoding); a text already starting with <bos> (a chat template) gets one."""
    tok = Tokenizer(_bos_tokenizer())
    assert tok.prompt_bos_id == 2
    assert tok.encode("a b") == [4, 5] and tok.encode_prompt("a b") == [2, 4, 5]
    assert tok.encode_prompt("<bos> a") == [2, 4]
    assert tok.encode_prompt("") == [2]
    assert real_tokenizer.prompt_bos_id is None  # SmolLM2 adds no BOS: prompts are unchanged
    assert real_tokenizer.encode_prompt("Hello world") == real_tokenizer.encode("Hello world")
