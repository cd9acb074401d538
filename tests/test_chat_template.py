"""Chat templates: HF-compatible rendering, and a sandbox that stops hostile templates with one-line errors."""

from datetime import datetime

import pytest

from akunu.errors import ModelError
from akunu.models.chat_template import ChatTemplate

# SmolLM2-135M-Instruct's template, verbatim from its GGUF metadata (tokenizer.chat_template).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# The shape of Gemma 3's template: BOS from a variable, role alternation enforced with raise_exception.
GEMMA_LIKE_TEMPLATE = """{{ bos_token }}
{%- for message in messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' }}
    {{- message['content'] | trim }}{{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}
"""

CONVERSATION = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}]


def test_smollm2_chatml_two_messages_with_generation_prompt():
    rendered = ChatTemplate(SMOLLM2_TEMPLATE).render(CONVERSATION, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n4.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_smollm2_chatml_keeps_a_given_system_prompt_and_can_omit_generation_prompt():
    messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]
    rendered = ChatTemplate(SMOLLM2_TEMPLATE).render(messages, add_generation_prompt=False)
    assert rendered == "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"


def test_gemma_like_template_uses_bos_token_and_whitespace_control():
    rendered = ChatTemplate(GEMMA_LIKE_TEMPLATE).render(CONVERSATION, bos_token="<bos>")
    assert rendered == (
        "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n"
        "<start_of_turn>model\n4.<end_of_turn>\n<start_of_turn>model\n"
    )


def test_raise_exception_becomes_a_one_line_model_error():
    messages = [{"role": "assistant", "content": "I speak first"}]
    with pytest.raises(ModelError, match="roles must alternate") as caught:
        ChatTemplate(GEMMA_LIKE_TEMPLATE).render(messages)
    assert "\n" not in str(caught.value)


def test_trim_blocks_and_lstrip_blocks_as_in_transformers():
    template = "  {% if true %}\nA\n  {% endif %}\nB"
    assert ChatTemplate(template).render([]) == "A\nB"


def test_hf_helpers_tojson_strftime_generation_and_loop_controls():
    messages = [{"role": "user", "content": "héllo <b>"}, {"role": "user", "content": "second"}]
    template = (
        "{{ messages[0] | tojson }}|{{ strftime_now('%Y') }}|{% generation %}G{% endgeneration %}|"
        "{% for m in messages %}{{ m.content }}{% break %}{% endfor %}"
    )
    year = str(datetime.now().year)
    assert ChatTemplate(template).render(messages) == f'{{"role": "user", "content": "héllo <b>"}}|{year}|G|héllo <b>'


def test_tojson_accepts_hf_keyword_arguments():
    rendered = ChatTemplate("{{ messages | tojson(indent=2, sort_keys=True) }}").render(
        [{"role": "user", "content": "x"}]
    )
    assert rendered == '[\n  {\n    "content": "x",\n    "role": "user"\n  }\n]'


@pytest.mark.parametrize(
    "hostile",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ ''.__class__ }}",
        "{{ '{0.__class__}'.format('') }}",
        "{{ cycler.__init__.__globals__ }}",
        "{{ lipsum.__globals__['os'] }}",
        "{{ self.__init__ }}",
    ],
)
def test_template_reaching_python_internals_fails_with_one_line_model_error(hostile):
    with pytest.raises(ModelError, match="unsafe operation") as caught:
        ChatTemplate(hostile).render(CONVERSATION)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    "mutating",
    [
        "{% set scratch = [] %}{{ scratch.append(1) }}",
        "{{ messages.append({'role': 'system', 'content': 'injected'}) }}",
        "{{ messages.pop() }}",
        "{{ messages[0].update(role='system') }}",
    ],
)
def test_template_mutating_objects_fails_and_changes_nothing(mutating):
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ModelError, match="unsafe operation"):
        ChatTemplate(mutating).render(messages)
    assert messages == [{"role": "user", "content": "hi"}]


def test_template_syntax_error_is_a_one_line_model_error_with_line_number():
    template = "{% for message in messages %}\n{{ message.content }\n{% endfor %}"
    with pytest.raises(ModelError, match=r"not valid Jinja \(line 2\)") as caught:
        ChatTemplate(template).render(CONVERSATION)
    assert "\n" not in str(caught.value)


def test_runtime_failure_inside_template_is_a_model_error():
    with pytest.raises(ModelError, match="ZeroDivisionError"):
        ChatTemplate("{{ 1 / 0 }}").render(CONVERSATION)


def test_undefined_variables_render_empty_as_in_transformers():
    # Templates probe optional inputs such as `tools`; those must stay falsy, not fail.
    template = "{% if tools %}T{% endif %}{{ documents }}|{{ messages[0].content }}"
    assert ChatTemplate(template).render(CONVERSATION) == "|What is 2+2?"


@pytest.mark.parametrize(
    "bomb",
    [
        "{{ 'a' * 10**9 }}",  # issue 16: 15 s and 1 GB before
        "{{ [1, 2] * 10**9 }}",
        "{% set s = 'a' * 10**7 %}{{ s + s }}",
        "{% set s = 'a' * 10**7 %}{{ s ~ s ~ s }}",
        "{{ 7 ** 1000000 }}",  # Jinja reads a ** b ** c as (a ** b) ** c
        "{{ 'a' | center(10**9) }}",
        "{{ 'a'.ljust(10**9) }}",
        "{{ '%999999999s' % 'a' }}",
        "{{ '{:>999999999}'.format('a') }}",
        "{% set s = 'a' * 10**4 %}{{ s | replace('a', s) }}",
        "{% set s = 'a' * 10**4 %}{{ s.replace('a', s) }}",
        "{% for i in range(10**5) %}{% for j in range(10**5) %}{% endfor %}{% endfor %}",
        "{% for i in range(10**5) %}{{ 'x' * 1000 }}{% endfor %}",  # each piece small, the output not
    ],
)
def test_template_growth_is_bounded_and_one_line(bomb):
    with pytest.raises(ModelError, match="unsafe operation") as caught:
        ChatTemplate(bomb).render(CONVERSATION)
    assert "\n" not in str(caught.value)


def test_ordinary_growth_still_renders():
    long_message = [{"role": "user", "content": "word " * 200_000}]  # a million characters
    template = (
        "{{ '=' * 3 }}{% for i in range(3) %}{{ i }}{% endfor %}{{ 2 ** 10 }}{{ '%s!' % 'a' }}{{ '{}?'.format('b') }}"
        "{% for m in messages %}{{ (m.role ~ ':' + m.content) | replace('word', 'w') | length }}{% endfor %}"
    )
    assert ChatTemplate(template).render(long_message) == f"===0121024a!b?{len('user:' + 'w ' * 200_000)}"
