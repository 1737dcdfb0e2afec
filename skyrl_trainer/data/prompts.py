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


def render_observation(
    tokenizer: ChatTokenizer, messages: list[dict], action_tokens: list[int], stop_token_ids
) -> list[int]:
    """Token ids to append after a sampled assistant turn so that the context continues with
    `messages` (observations) and then the assistant's next reply prompt; earlier tokens are
    never re-tokenised.

    With a chat template, this is the difference the template makes between a conversation ending
    with an assistant reply and the same conversation plus `messages` with the generation prompt,
    preceded by whatever closes the assistant turn: if the turn ended on a stop token (e.g.
    `<|im_end|>`) only the template's text after that token (e.g. "\\n"); if it was cut (max
    tokens), the whole end-of-turn text. Without a chat template: each message's content followed
    by "\\n", after a "\\n" closing the turn.
    """
    if not getattr(tokenizer, "chat_template", None):
        text = "\n" + "".join(f"{m['content']}\n" for m in messages)
        return list(tokenizer.encode(text, add_special_tokens=False))
    reply = "\x00REPLY\x00"  # a marker no template alters, to find where the reply ends
    base = [{"role": "user", "content": "\x00"}, {"role": "assistant", "content": reply}]
    base_text = tokenizer.apply_chat_template(base, tokenize=False)
    full_text = tokenizer.apply_chat_template(
        base + list(messages), tokenize=False, add_generation_prompt=True
    )
    if not full_text.startswith(base_text):
        raise ValueError(
            "the chat template renders a conversation differently once messages follow an "
            "assistant reply, so observations cannot continue the sampled tokens verbatim"
        )
    end_of_turn = base_text[base_text.rindex(reply) + len(reply) :]
    if action_tokens and action_tokens[-1] in set(stop_token_ids):
        stop_text = tokenizer.decode([action_tokens[-1]])
        if end_of_turn.startswith(stop_text):
            end_of_turn = end_of_turn[len(stop_text) :]
    text = end_of_turn + full_text[len(base_text) :]
    return list(tokenizer.encode(text, add_special_tokens=False))
