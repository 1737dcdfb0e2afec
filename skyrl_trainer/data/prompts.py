"""Rendering a problem's chat messages into the prompt token ids the policy samples from."""

from __future__ import annotations

from typing import Any, Protocol


class ChatTokenizer(Protocol):
    """What render_prompt uses of a Hugging Face tokenizer (typed here because the trainer side does
    not import transformers)."""

    chat_template: str | None

    def apply_chat_template(self, conversation: list[dict], **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...


def render_prompt(
    tokenizer: ChatTokenizer, messages: list[dict], system_prompt: str | None = None
) -> list[int]:
    """Token ids of `messages` as a prompt ready for the assistant's reply.

    With `system_prompt`, a system message is put first (a ValueError if `messages` already starts with
    one). With a chat template: the template with `add_generation_prompt=True`, rendered as text and then
    encoded without adding special tokens (the template writes them). Without a chat template (base
    models): plain text, each message's content followed by "\\n" ("question\\n"), encoded as ordinary
    text (so with the tokenizer's usual BOS, if it adds one).
    """
    if system_prompt is not None:
        if messages and messages[0].get("role") == "system":
            raise ValueError(
                "messages already start with a system message; do not also give system_prompt"
            )
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if getattr(tokenizer, "chat_template", None):
        # Text first: with tokenize=True transformers 5.x may return a BatchEncoding, not a list.
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(tokenizer.encode(text, add_special_tokens=False))
    text = "".join(f"{message['content']}\n" for message in messages)
    return list(tokenizer.encode(text))
