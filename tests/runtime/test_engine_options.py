"""Engine options added for the CLI: ``tokenizer_path`` and ``chat_template`` (file, named
template of the tokenizer, inline Jinja), validated before anything loads."""
import shutil

import pytest

from sglite.config import EngineConfig
from sglite.errors import InvalidRequestError
from sglite.runtime.tokenizer import Tokenizer, resolve_chat_template

# A template with markers unlike the model's ChatML, so its use is visible in the output.
TEMPLATE = ("{% for m in messages %}### {{ m['role'] }}:\n{{ m['content'] }}\n<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}### assistant:\n{% endif %}")


def test_resolve_chat_template_forms(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    assert resolve_chat_template(str(f)) == TEMPLATE
    named = {"default": "{{ 'a' }}", "tool_use": "{{ 'b' }}"}
    assert resolve_chat_template("tool_use", named) == "{{ 'b' }}"
    assert resolve_chat_template("default", "{{ 'only' }}") == "{{ 'only' }}"
    assert resolve_chat_template(TEMPLATE) == TEMPLATE  # inline Jinja
    with pytest.raises(InvalidRequestError, match=r"chat_template: 'rag' is not a file.*\['default', 'tool_use'\]"):
        resolve_chat_template("rag", named)
    (tmp_path / "empty.jinja").write_text("  \n")
    with pytest.raises(InvalidRequestError, match="is empty"):
        resolve_chat_template(str(tmp_path / "empty.jinja"))


def test_config_checks_paths_before_loading(tmp_path):
    with pytest.raises(InvalidRequestError, match="tokenizer_path: no such folder") as ei:
        EngineConfig(tokenizer_path=str(tmp_path / "nope"))
    assert ei.value.field == "tokenizer_path"
    with pytest.raises(InvalidRequestError, match="chat_template: no such file") as ei:
        EngineConfig(chat_template=str(tmp_path / "nope.jinja"))
    assert ei.value.field == "chat_template"
    EngineConfig(chat_template="tool_use")  # a name: checked against the tokenizer at load
    EngineConfig(chat_template=TEMPLATE)


def test_tokenizer_with_a_template_file(tiny_model_dir, tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    tk = Tokenizer.from_dir(tiny_model_dir, chat_template=str(f))
    text = tk.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert text == "### user:\nHi\n<|im_end|>\n### assistant:\n"
    assert tk.role_markers()["user"] == ("### user:\n", "\n<|im_end|>\n")
    assert tk.end_of_turn == "<|im_end|>" and tk.encode("<|im_end|>")[0] in tk.eos_token_ids
    with pytest.raises(InvalidRequestError, match="chat_template"):
        Tokenizer.from_dir(tiny_model_dir, chat_template="no-such-name")


def test_engine_tokenizer_path_and_chat_template(tiny_model_dir, tmp_path):
    from sglite import Engine

    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_dir / name).is_file():
            shutil.copy(tiny_model_dir / name, tok_dir / name)
    f = tmp_path / "t.jinja"
    f.write_text(TEMPLATE)
    with Engine(model_path=str(tiny_model_dir), tokenizer_path=str(tok_dir), chat_template=str(f),
                dtype="float32", max_total_tokens=1024, num_threads=1) as e:
        assert e.apply_chat_template([{"role": "user", "content": "Hi"}]).startswith("### user:\nHi")
        assert e.model_info()["role_markers"]["assistant"][0] == "### assistant:\n"
        out = e.generate("Hello", {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 3
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(InvalidRequestError, match="tokenizer_path: no loadable tokenizer"):
        Engine(model_path=str(tiny_model_dir), tokenizer_path=str(empty), dtype="float32", max_total_tokens=1024)


def test_stream_interval_below_one_names_the_field():
    with pytest.raises(ValueError, match="stream_interval: must be >= 1, got 0"):
        EngineConfig(stream_interval=0).validate()
