"""Chat messages and HH-RLHF transcripts: pure conversions, the one version both sides use.

The store keeps every prompt as one text (an HH-RLHF style transcript for chat prompts,
`messages_to_text`) and, when it was imported as such, its chat messages (`check_messages` says
what is wrong with a list of them). `split_hh` cuts a transcript at its last "\n\nAssistant:".

`prompt_messages(text, messages)`: the stored messages when there are any; else the transcript
split into turns ("\\n\\nHuman:" -> user, "\\n\\nAssistant:" -> assistant, "\\n\\nSystem:" ->
system, each turn's text without its surrounding whitespace, the empty last Assistant turn being
the generation prompt); any other text is one user message, as it is. The training side reads a
text prompt through it too (pipeline/text.to_messages), so a reward model reads the same tokens
from either export format, System turns included; it is the inverse of messages_to_text.

`conversation_problem(messages, limits)`: what keeps a conversation from a chat sampler (a bad
message, a length limit), the one check of the app's client and the sampler itself.

`server_url_problem(url)`: what keeps a text from being an OpenAI-compatible server's base URL
(http://host:8000/v1), the one check of the store's chat setting and the app's client.

`pair_from_messages(prompt, chosen, rejected)`: a conversational preference row (explicit or
implicit prompt) as (prompt messages, chosen text, rejected text), or the problem with it.
"""

from __future__ import annotations

import re
import urllib.parse

CHAT_ROLES = ("system", "user", "assistant")
ASSISTANT_MARK = "\n\nAssistant:"
_TURN = re.compile(r"\n\n(System|Human|Assistant):")
TURN_START = "^\n\n(System|Human|Assistant):"
"""_TURN at the start of a text, as a regular expression for SQL (DuckDB's RE2): an HH transcript."""
_ROLES = {"System": "system", "Human": "user", "Assistant": "assistant"}


def messages_to_text(messages: list[dict]) -> str:
    """Chat messages -> an HH-RLHF style transcript ("\\n\\nHuman: ...\\n\\nAssistant:"), the form
    prompts are exported in. A trailing "\\n\\nAssistant:" asks for the next reply."""
    names = {"system": "System", "user": "Human", "assistant": "Assistant"}
    text = "".join(f"\n\n{names[m['role']]}: {m['content']}" for m in messages)
    return text + ("\n\nAssistant:" if messages[-1]["role"] != "assistant" else "")


def check_messages(messages) -> str | None:
    """None if `messages` is a non-empty list of {role, content} chat turns, else the problem."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content}"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or set(m) - {"role", "content"} or "role" not in m or "content" not in m:
            return f"messages[{i}] must be an object with exactly 'role' and 'content'"
        if m["role"] not in CHAT_ROLES:
            return f"messages[{i}].role must be one of {CHAT_ROLES}, not {m['role']!r}"
        if not isinstance(m["content"], str) or not m["content"].strip():
            return f"messages[{i}].content is empty or not text"
    return None


def server_url_problem(url: str) -> str | None:
    """None if `url` is an http(s) address with a host, as OpenAI clients take a base URL; else
    the problem, naming the URL."""
    parts = urllib.parse.urlsplit(url.strip())
    if parts.scheme in ("http", "https") and parts.netloc:
        return None
    return f"the chat server URL {url!r} is not an http(s) address such as http://localhost:8000/v1"


def conversation_problem(messages, limits) -> tuple[str, str | None] | None:
    """None if `messages` is a conversation a chat sampler answers (check_messages, the user's
    message last) within `limits` (pipeline.config.ChatConfig: max_messages, max_message_chars,
    max_conversation_chars); else (the problem, the name of the limit it breaks or None). The app
    checks a conversation with it before asking, and the sampler again when asked."""
    problem = check_messages(messages)
    if problem:
        return problem, None
    if len(messages) > limits.max_messages:
        return f"{len(messages)} messages: the limit is max_messages = {limits.max_messages}", "max_messages"
    for i, m in enumerate(messages):
        if len(m["content"]) > limits.max_message_chars:
            return (f"messages[{i}] has {len(m['content'])} characters: the limit is max_message_chars = "
                    f"{limits.max_message_chars}", "max_message_chars")
    total = sum(len(m["content"]) for m in messages)
    if total > limits.max_conversation_chars:
        return (f"the conversation has {total} characters: the limit is max_conversation_chars = "
                f"{limits.max_conversation_chars}", "max_conversation_chars")
    if messages[-1]["role"] != "user":
        return "the last message must be the user's: the reply answers it", None
    return None


def split_hh(transcript: str) -> tuple[str, str] | None:
    """Split an HH-RLHF transcript at its last "\\n\\nAssistant:" -> (prompt incl. marker, reply)."""
    at = transcript.rfind(ASSISTANT_MARK)
    if at < 0:
        return None
    cut = at + len(ASSISTANT_MARK)
    return transcript[:cut], transcript[cut:]


def prompt_messages(text: str, messages: list[dict] | None = None) -> list[dict]:
    """Chat messages [{role, content}] of a stored prompt (see the module docstring)."""
    if messages:
        return [{"role": m["role"], "content": m["content"]} for m in messages]
    body = text.lstrip(" ")
    if not _TURN.match(body):
        return [{"role": "user", "content": text}]
    parts = _TURN.split(body)  # ['', 'Human', ' hi', 'Assistant', ' hello', ...]
    turns = [{"role": _ROLES[name], "content": said.strip()} for name, said in zip(parts[1::2], parts[2::2])]
    if turns[-1]["role"] == "assistant" and not turns[-1]["content"]:
        turns.pop()
    return turns or [{"role": "user", "content": text}]


def pair_from_messages(prompt, chosen, rejected) -> tuple[list[dict], str, str] | str:
    """(prompt messages, chosen reply, rejected reply) of a conversational preference row, or the
    problem with it as text.

    Explicit prompt: `prompt` a list of messages, `chosen` and `rejected` one assistant message
    each. Implicit prompt (`prompt` None): `chosen` and `rejected` whole conversations that agree
    up to their last message, which is the assistant's.
    """
    for name, value in (("chosen", chosen), ("rejected", rejected)):
        problem = check_messages(value)
        if problem:
            return f"'{name}': {problem}"
        if value[-1]["role"] != "assistant":
            return f"'{name}': its last message must be the assistant's, not the {value[-1]['role']}'s"
    if prompt is None:
        prompt = chosen[:-1]
        if not prompt or rejected[:-1] != prompt:
            return "no 'prompt' and the 'chosen' and 'rejected' conversations differ before their last message"
    else:
        problem = check_messages(prompt)
        if problem:
            return f"'prompt': {problem}"
        for name, value in (("chosen", chosen), ("rejected", rejected)):
            if len(value) != 1:
                return f"'{name}' must be one assistant message after the prompt, not {len(value)} messages"
    return prompt, chosen[-1]["content"], rejected[-1]["content"]
