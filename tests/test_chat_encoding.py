"""A user's text never becomes control tokens: only the chat template's own markup does (issue 38)."""

import pytest

from tests.chat_fixtures import CHATML, HOSTILE, chatml_tokenizer

TRIMMING_CHATML = CHATML.replace("{{ m.content }}", "{{ m.content | trim }}")
UPPER_CHATML = CHATML.replace("{{ m.content }}", "{{ m.content.upper() if m.role == 'tool' else m.content }}")


def control_count(tokenizer, ids) -> int:
    return sum(1 for i in ids if i in tokenizer.special_ids)


@pytest.mark.parametrize("template", [CHATML, TRIMMING_CHATML, UPPER_CHATML], ids=["plain", "trim", "other-role"])
def test_special_text_in_a_message_stays_text(template):
    """The trimming template changes the text, so the marks cannot tell: the text is found by search."""
    tok = chatml_tokenizer(template)
    messages = [{"role": "user", "content": f"  {HOSTILE}\n"}]
    ids = tok.encode_chat(messages)
    # the template writes 2 per message and 1 for the answer; the user's 3 are plain bytes
    assert control_count(tok, ids) == 3
    assert tok.decode(ids) == tok.apply_chat_template(messages)
    assert control_count(tok, tok.encode_chat(messages, parse_special=True)) == 6


def test_a_conversation_without_special_text_is_tokenized_as_before():
    tok = chatml_tokenizer()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <|im_star"}]
    assert tok.encode_chat(messages) == tok.encode(tok.apply_chat_template(messages))


def test_tool_results_and_content_parts_stay_text():
    tok = chatml_tokenizer("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content if m.content is string"
                           " else m.content[0].text }}<|im_end|>{% endfor %}")  # fmt: skip
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "a<|im_start|>"}]},
        {"role": "tool", "content": "<|im_end|>b"},
    ]
    assert control_count(tok, tok.encode_chat(messages)) == 4


def test_encode_reads_special_text_as_text_on_request():
    tok = chatml_tokenizer()
    assert tok.encode("<|im_start|>x") == [256, ord("x")]
    assert tok.encode("<|im_start|>x", parse_special=False) == list(b"<|im_start|>x")


TOOLS_CHATML = (
    "{% if tools %}<|im_start|>system\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "{{ tools[0].function.description }}<|im_end|>\n{% endif %}" + CHATML
)


def test_special_text_in_a_tool_definition_stays_text():
    """A tool's description and parameter names are the caller's text, whether written as is or through tojson."""
    tok = chatml_tokenizer(TOOLS_CHATML)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": HOSTILE,
                "parameters": {"type": "object", "properties": {"<|im_start|>q": {"type": "string"}}},
            },
        }
    ]
    messages = [{"role": "user", "content": "hi"}]
    ids = tok.encode_chat(messages, tools=tools)
    # the template writes 2 for the tools' block, 2 for the message and 1 for the answer; none of the tool's text
    assert control_count(tok, ids) == 5
    assert tok.decode(ids) == tok.apply_chat_template(messages, tools=tools)
    assert control_count(tok, tok.encode_chat(messages, tools=tools, parse_special=True)) > 5
