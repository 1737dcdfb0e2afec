from __future__ import annotations

import pytest

from skyrl_trainer.data import render_prompt

MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]


def test_chatml_with_system_prompt(tokenizer):
    ids = render_prompt(tokenizer, MESSAGES, "You are a careful solver.")
    text = tokenizer.decode(ids)
    assert text == (
        "<|im_start|>system\nYou are a careful solver.<|im_end|>\n"
        "<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    template_text = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are a careful solver."}, *MESSAGES],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert ids == tokenizer.encode(template_text, add_special_tokens=False)
    assert isinstance(ids, list) and all(isinstance(i, int) for i in ids)
    assert ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_chatml_without_system_prompt(tokenizer):
    ids = render_prompt(tokenizer, MESSAGES, None)
    text = tokenizer.decode(ids)
    # SmolLM2's template writes its own default system message when there is none.
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert "careful solver" not in text
    assert text.endswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>\n<|im_start|>assistant\n")
    template_text = tokenizer.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True
    )
    assert ids == tokenizer.encode(template_text, add_special_tokens=False)


def test_system_prompt_twice_is_an_error(tokenizer):
    with pytest.raises(ValueError, match="already start with a system message"):
        render_prompt(tokenizer, [{"role": "system", "content": "x"}, *MESSAGES], "y")


class _PlainTokenizer:
    """A tokenizer without a chat template: characters as ids, BOS = 0."""

    chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def test_no_chat_template_falls_back_to_plain_text():
    assert render_prompt(_PlainTokenizer(), MESSAGES) == [0] + [ord(c) for c in "What is 2 + 2?\n"]
    assert render_prompt(_PlainTokenizer(), MESSAGES, "Sys") == [0] + [
        ord(c) for c in "Sys\nWhat is 2 + 2?\n"
    ]


@pytest.mark.parametrize("stopped", [True, False])
def test_observation_continues_the_sampled_tokens_as_the_template_would(tokenizer, stopped):
    """prompt + action + observation tokens == the template's rendering of the conversation:
    after a stop token only the template's text after it ("\\n"); after a cut action the whole
    end of turn ("<|im_end|>\\n")."""
    from skyrl_trainer.data.prompts import render_observation

    prompt = render_prompt(tokenizer, [{"role": "user", "content": "Guess."}])
    action = tokenizer.encode("7", add_special_tokens=False)
    if stopped:
        action = action + [tokenizer.eos_token_id]
    feedback = [{"role": "user", "content": "Higher."}]
    observation = render_observation(tokenizer, feedback, action, {tokenizer.eos_token_id})
    expected = render_prompt(
        tokenizer,
        [{"role": "user", "content": "Guess."}, {"role": "assistant", "content": "7"}, *feedback],
    )
    assert prompt + action + observation == expected
    first = tokenizer.decode(observation[:1])
    assert first == ("\n" if stopped else "<|im_end|>")


def test_observation_without_chat_template_is_plain_text():
    from skyrl_trainer.data.prompts import render_observation

    class Plain:
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]

    tokens = render_observation(Plain(), [{"role": "user", "content": "Lower."}], [1, 2], set())
    assert "".join(map(chr, tokens)) == "\nLower.\n"
