"""Chat templates: rendering with Hugging Face's semantics, in the sandbox."""

from __future__ import annotations

import json
import types

import pytest

from conftest import SHIPPED_DIR
from powerinfer_cpp.chat import ChatTemplate, ChatTemplateError

SHIPPED_TEMPLATE = json.loads((SHIPPED_DIR / "tokenizer_config.json").read_text())["chat_template"]

# Templates that exercise what HF's renderer does: bos/eos tokens, trim_blocks and
# lstrip_blocks (indented block tags leave no whitespace), loop.last, loop controls,
# tojson keeping non-ASCII text, and the system-first check with raise_exception.
TEMPLATES = {
    "shipped": SHIPPED_TEMPLATE,
    "chatml-bos": (
        "{{ bos_token }}{% for m in messages %}\n"
        "    {% if m['role'] == 'system' %}\n"
        "<|sys|>{{ m['content'] | trim }}{{ eos_token }}\n"
        "    {% else %}\n"
        "<|{{ m['role'] }}|>{{ m['content'] }}{% if not loop.last %}{{ eos_token }}{% endif %}\n"
        "    {% endif %}\n"
        "{% endfor %}\n"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"),
    "loopcontrols-tojson": (
        "{% for m in messages %}{% if loop.index > 3 %}{% break %}{% endif %}"
        "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
        "{{ m | tojson }}\n{% endfor %}"),
    "system-check": (
        "{% if messages[0]['role'] != 'system' %}"
        "{{ raise_exception('the first message must be a system message') }}{% endif %}"
        "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Who made the light?"}],
    [{"role": "system", "content": "  Answer in the words of the KJV.  "},
     {"role": "user", "content": "Who made the light?"},
     {"role": "assistant", "content": "God said, Let there be light."},
     {"role": "user", "content": "Und dann? — «ça»"}],
]


@pytest.fixture(scope="module")
def hf_tok():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(SHIPPED_DIR))


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("gen", [True, False])
def test_render_matches_hugging_face(hf_tok, name, conv, gen):
    src, msgs = TEMPLATES[name], CONVERSATIONS[conv]
    tmpl = ChatTemplate(src, bos_token="<s>", eos_token="</s>")
    try:
        want = hf_tok.apply_chat_template(msgs, chat_template=src, tokenize=False,
                                          add_generation_prompt=gen)
    except Exception as e:  # HF raises from raise_exception: so must we, with its message
        with pytest.raises(ChatTemplateError, match="first message must be a system"):
            tmpl.render(msgs, add_generation_prompt=gen)
        assert "system message" in str(e)
        return
    assert tmpl.render(msgs, add_generation_prompt=gen) == want


def test_shipped_template_reaches_the_file(shipped_gguf):
    from powerinfer_cpp.tokenizer import load_tokenizer

    assert load_tokenizer(shipped_gguf).chat_template == SHIPPED_TEMPLATE


def test_from_model_tokens_and_bos(shipped_gguf):
    from powerinfer_cpp import Model

    with Model(shipped_gguf, n_ctx=64) as m:
        tmpl = ChatTemplate.from_model(m)
        assert tmpl.tokens["bos_token"] == "<s>" and tmpl.tokens["eos_token"] == "</s>"
        text = tmpl.render([{"role": "user", "content": "Hi"}])
        assert text == "user:\nHi\nassistant:\n"
        ids = tmpl.tokenize(m, text)
        assert ids[0] == m.tokenizer.bos_id and ids.count(m.tokenizer.bos_id) == 1
        # a template that writes BOS itself does not get a second one
        own = ChatTemplate("{{ bos_token }}{{ messages[0]['content'] }}", bos_token="<s>")
        ids = own.tokenize(m, own.render([{"role": "user", "content": "Hi"}]))
        assert ids.count(m.tokenizer.bos_id) == 1
        assert tmpl.stop_strings() == ["\nuser:\n", "</s>"]


def test_no_template_is_a_clear_error():
    fake = types.SimpleNamespace(path="plain.gguf",
                                 tokenizer=types.SimpleNamespace(chat_template=None))
    with pytest.raises(ChatTemplateError, match="plain.gguf has no chat template"):
        ChatTemplate.from_model(fake)


@pytest.mark.parametrize("src,match", [
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "unsafe"),
    ("{% set x = messages.append(1) %}", "unsafe"),
    ("{{ raise_exception('no tools here') }}", "no tools here"),
    ("{% for m in messages %}", "does not compile"),
    ("{{ messages[5]['content'] }}", "failed"),
])
def test_sandbox_and_errors(src, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(src).render([{"role": "user", "content": "x"}])


def test_messages_are_checked():
    t = ChatTemplate(SHIPPED_TEMPLATE)
    with pytest.raises(TypeError):
        t.render("hello")
    with pytest.raises(ValueError, match="role"):
        t.render([{"content": "x"}])
    with pytest.raises(TypeError, match="content"):
        t.render([{"role": "user", "content": 5}])
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    assert t.render([{"role": "user", "content": parts}], False) == "user:\nab\n"
