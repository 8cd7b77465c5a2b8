"""Chat messages -> prompt token ids, through the target's own chat template."""

from __future__ import annotations


def encode_chat(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    """Render with the generation prompt, then tokenise without adding specials twice."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)
