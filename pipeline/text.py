"""Text in, token ids out (and back): prompts files, chat formatting, prompt and response encoding,
padding, sampled responses decoded.

Generation, reward training, PPO and scoring all encode through these functions, so a reward model
is trained on exactly the token layout it is later asked to score:

    prompt_token_ids(tokenizer, prompt)      chat template (SYSTEM_PROMPT first) with the assistant turn opened (or raw text)
    encode_response(tokenizer, response)     response ids + EOS, the token generation stops at
    pad_rows(rows, pad_id, left=...)         (input_ids, attention_mask), padded on either side
    decode_responses(tokenizer, ids, mask)   sampled responses back to text, special tokens dropped
"""

from __future__ import annotations

import json
import os

import torch

from formats.chat import prompt_messages
from pipeline.rundir import read_jsonl

SYSTEM_PROMPT = "You are a helpful assistant. Reply in at most two sentences."
"""The system message of every prompt that has none, in every stage alike (generation, reward
model, PPO, DPO, evaluation: all encode through `prompt_token_ids`). Without it SmolLM2's chat
template puts in its own ("You are a helpful AI assistant named SmolLM ..."), under which the
default model runs past the length limit on almost every answer, and annotators rank half-answers
(the figures: GenerateConfig.max_new_tokens)."""


def with_system_prompt(messages: list[dict]) -> list[dict]:
    """`messages` with SYSTEM_PROMPT first, unless they open with a system message of their own."""
    if messages and messages[0]["role"] == "system":
        return messages
    return [{"role": "system", "content": SYSTEM_PROMPT}, *messages]


def template_with_system_prompt(template: str | None) -> str | None:
    """A chat template that puts SYSTEM_PROMPT first when the messages have no system message, as
    `prompt_token_ids` does: an exported model's tokenizer then lays prompts out as ours did. No
    template (raw-text prompts, which never get a system prompt) stays none."""
    if not template:
        return template
    opening = ("{%- if not messages or messages[0]['role'] != 'system' %}{%- set messages = "
               f"[{{'role': 'system', 'content': {json.dumps(SYSTEM_PROMPT)}}}] + messages %}}{{%- endif %}}")
    return template if template.startswith(opening) else opening + template


def to_messages(prompt) -> list[dict]:
    """Chat messages for a prompt: a message list as is; text as formats/chat.py `prompt_messages`
    reads a stored prompt (an HH-RLHF transcript split into its System / Human / Assistant turns,
    the empty last Assistant turn being the generation prompt; anything else one user message), so
    the store's exports and the trainers read a prompt the same way."""
    if isinstance(prompt, list):
        for i, m in enumerate(prompt):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"message {i} of a prompt is not a {{role, content}} dict: {m!r}")
        return [{"role": m["role"], "content": m["content"]} for m in prompt]
    if not isinstance(prompt, str):
        raise ValueError(f"a prompt must be text or a list of messages, got {type(prompt).__name__}")
    return prompt_messages(prompt)


def read_prompts(path: str | os.PathLike) -> list[dict]:
    """Rows of a JSONL file with a `prompt` field (text or a list of {role, content} messages)."""
    rows = read_jsonl(path, check=_check_prompt_row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


def _check_prompt_row(row) -> None:
    if not isinstance(row, dict) or "prompt" not in row:
        raise ValueError("no 'prompt' field")
    try:
        to_messages(row["prompt"])
    except ValueError as exc:
        raise ValueError(f"field 'prompt': {exc}") from None


def prompt_token_ids(tokenizer, prompt, max_prompt_tokens: int | None = None) -> list[int]:
    """Token ids of one prompt: the chat template with the generation prompt (and SYSTEM_PROMPT when
    the prompt has no system message) when the tokenizer has one, else the raw text. Too long -> keep the last tokens (the end holds the question)."""
    if getattr(tokenizer, "chat_template", None):
        messages = with_system_prompt(to_messages(prompt))
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        text = prompt if isinstance(prompt, str) else "\n\n".join(m["content"] for m in to_messages(prompt))
        ids = tokenizer(text)["input_ids"]
    if not ids:
        raise ValueError(f"an empty prompt: {prompt!r}")
    if max_prompt_tokens and len(ids) > max_prompt_tokens:
        ids = ids[-max_prompt_tokens:]
    return ids


def encode_response(tokenizer, response: str) -> list[int]:
    """Response ids + EOS. With a chat template the text is stripped: the template puts the reply
    right after 'assistant\\n' (HH replies start with a space that generation never produces)."""
    text = response.strip() if tokenizer.chat_template else response
    return tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]


def pad_rows(rows: list[list[int]], pad_id: int, left: bool, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), both (B, L) for the longest row L, padded on the left (prompts
    that generation continues) or on the right."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        cols = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, cols] = torch.tensor(r, dtype=torch.long)
        mask[i, cols] = 1
    return ids.to(device), mask.to(device)


def encode_prompts(tokenizer, prompts, max_prompt_tokens: int | None = None, device=None):
    """(input_ids, attention_mask) (B, P), left-padded, chat template applied when present."""
    rows = [prompt_token_ids(tokenizer, p, max_prompt_tokens) for p in prompts]
    return pad_rows(rows, tokenizer.pad_token_id, left=True, device=device)


def decode_responses(tokenizer, response_ids: torch.Tensor, response_mask: torch.Tensor) -> list[str]:
    return [tokenizer.decode(ids[m.bool()].tolist(), skip_special_tokens=True)
            for ids, m in zip(response_ids, response_mask)]
