"""Texts and a tokenizer the tests share: a long English text and a byte-level tokenizer with a chat
template (tests/evals/test_retrieval.py, test_ruler.py), and short texts that stress a tokenizer
(tests/models/test_loading.py, test_long_models.py)."""

from __future__ import annotations


TEXT = "\n\n".join(
    f"Paragraph {i}. It was a bright cold day in April, and the clocks were striking {i % 13}. "
    f"Mr. Bennet said nothing! Did she know? The rain fell on the {i}th house.\n" for i in range(400)
)


class ByteChat:
    """Token = UTF-8 byte, with a chat template: a stand-in for a real tokenizer in fast tests."""

    eos_id = 0  # NUL ends an answer
    vocab_size = 256
    chat_template = "fake"

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt=True):
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>\n" for m in messages)
        return "<system>Be helpful.</system>\n" + body + ("<assistant>" if add_generation_prompt else "")


TOK = ByteChat()


TEXTS = [
    "The quick brown fox jumps over the lazy dog. Isn't it? \"Yes\" -- she said; (really!) [ok] {fine}",
    "Numbers: 12345, 3.14159, -42, 1e-10, $1,000.00, 2024-01-01 and 007.",
    "multiple   spaces\n\n\nnewlines\ttabs\t\tand  \r\n crlf   ",
    "   leading spaces and trailing ones  ",
    "Unicode: café naïve résumé Ærøskøbing Straße, 日本語のテキスト, 中文测试, 한국어, Ελληνικά, Привет",
    "emoji 😀👍🏽🇫🇷 and symbols ½ x² ٣٤ → ∑ ∞ ©",
    "def f(x):\n    return x**2  # square\n\nprint({'a': [1, 2]}, end='')\n",
    "<|im_start|>user\nhello<|im_end|>\n<|endoftext|>",
    "",
]
