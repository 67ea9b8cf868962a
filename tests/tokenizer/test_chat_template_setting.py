"""The `chat_template` setting (#55 item 1; vLLM's --chat-template): a Jinja
file that replaces the model's chat template for chat prompts in `LLM`, the
CLI and the server (all built by `LLM.from_config` or `LLM(...)`), checked
before any weight is read; examples/chatml_tools.jinja renders tools
Hermes/Qwen style with SmolLM2's tokenizer (tokenizer only, no weights)."""

import json
import pathlib

import pytest

from jaxinfer.config import GenerationConfig
from jaxinfer.serving.llm import LLM
from structured_cases import ascii_tokenizer, tiny_llm

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "chatml_tools.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]


@pytest.fixture
def template(tmp_path):
    path = tmp_path / "plain.jinja"
    path.write_text("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"
                    "{% if add_generation_prompt %}>{% endif %}")
    return path


def test_the_file_renders_the_llms_chat_prompts(template):
    given = ascii_tokenizer()
    llm = tiny_llm(chat_template=str(template))
    assert llm.tokenizer.render_chat([{"role": "user", "content": "hi"}]) == "[user]hi>"
    want = llm.tokenizer.encode("[user]hi>")
    assert llm.encode_prompt("hi", chat=True) == want
    [out] = llm.generate(["hi"], chat=True, max_new_tokens=2)
    assert out.prompt_token_ids == want
    assert not given.has_chat_template       # the LLM changed a copy


def test_the_config_key_and_key_value(template):
    cfg = GenerationConfig.load(None, (f"chat_template={template}",))
    assert cfg.chat_template == str(template) and GenerationConfig().chat_template is None
    assert "Jinja file" in GenerationConfig.key_docs()["chat_template"]
    with pytest.raises(ValueError, match="chat_template must be a path"):
        GenerationConfig.load(None, ("chat_template=3",))


def test_a_bad_file_fails_before_anything_is_loaded(tmp_path, monkeypatch):
    def no_loading(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr("jaxinfer.serving.llm.load_model", no_loading)
    missing = tmp_path / "missing.jinja"
    cfg = GenerationConfig.load(None, (f"chat_template={missing}",))
    with pytest.raises(FileNotFoundError, match=f"chat_template: no such file '{missing}'"):
        LLM.from_config(cfg)
    with pytest.raises(FileNotFoundError, match="no such file"):
        LLM.load("smollm2-135m-instruct", chat_template=str(missing))
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    with pytest.raises(ValueError, match=r"bad.jinja': not a valid Jinja template \(line 1"):
        LLM.from_config(GenerationConfig.load(None, (f"chat_template={bad}",)))
    bad.write_text("")
    with pytest.raises(ValueError, match="the file is empty"):
        tiny_llm(chat_template=str(bad))


def test_a_template_that_fails_to_render_fails_before_the_weights(tmp_path, monkeypatch):
    """The file parses but raises on a user turn: the error names it, raised
    by the hook that runs once the tokenizer is loaded, before any weight."""
    from jaxinfer.checkpoint.sources import resolve_model

    try:
        resolve_model("smollm2-135m-instruct")
    except Exception as e:  # noqa: BLE001 - no model here
        pytest.skip(f"SmolLM2 not available: {e}")

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were read")

    monkeypatch.setattr("jaxinfer.serving.loading.load_params", no_weights)
    path = tmp_path / "raises.jinja"
    path.write_text("{{ raise_exception('system turns only') }}")
    with pytest.raises(ValueError, match="render a user turn: TemplateError: system turns only"):
        LLM.from_config(GenerationConfig.load(None, (f"chat_template={path}",)))
    with pytest.raises(ValueError, match="fails to render a user turn"):
        tiny_llm(chat_template=str(path))


@pytest.fixture(scope="module")
def smollm2():
    from jaxinfer.checkpoint.sources import resolve_model
    from jaxinfer.tokenizer import Tokenizer

    try:
        path = resolve_model("smollm2-135m-instruct")
    except Exception as e:  # noqa: BLE001 - no model here
        pytest.skip(f"SmolLM2 not available: {e}")
    return Tokenizer.from_gguf(path)


def test_smollm2_renders_tools_with_the_example_template(smollm2):
    from jaxinfer.serving.llm import with_chat_template

    assert not smollm2.renders_tools
    tok = with_chat_template(smollm2, EXAMPLE)
    assert tok.renders_tools and not smollm2.renders_tools
    assert tok.encode("<|im_end|>") == [2] and 2 in tok.eos_token_ids
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    text = tok.render_chat(messages, tools=TOOLS)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n</tools>" in text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\n18 C, sunny\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    ids = tok.encode_prompt(messages, tools=TOOLS)
    assert ids == tok.encode(text, add_special_tokens=False) and ids[:1] == [1]   # <|im_start|>
    # arguments given as a dict (transformers' convention) render the same
    call = messages[2]["tool_calls"][0]["function"]
    dict_args = [*messages[:2], {"role": "assistant", "tool_calls": [
        {"type": "function", "function": {**call, "arguments": {"city": "Paris"}}}]}, messages[3]]
    assert tok.render_chat(dict_args, tools=TOOLS) == text
    plain = tok.render_chat([{"role": "user", "content": "hi"}])
    assert plain == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                     "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
