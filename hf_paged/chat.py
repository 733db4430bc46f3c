"""Chat conversations as prompts (`LLM.chat`, vLLM's spelling): each conversation rendered with the tokenizer's chat
template, then tokenized without adding special tokens again (the template writes them)."""
from __future__ import annotations

from typing import Any, Sequence


def is_conversation(value: Any) -> bool:
    """Whether `value` is one conversation: a non-empty list / tuple of message dicts (with a "role")."""
    return isinstance(value, (list, tuple)) and bool(value) and all(isinstance(m, dict) and "role" in m for m in value)


def as_conversations(messages: Sequence) -> list[list[dict]]:
    """One conversation (a list of message dicts) or a list of them -> a list of conversations. Raises ValueError
    naming the first entry that is neither."""
    if is_conversation(messages):
        return [list(messages)]
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("LLM.chat takes a conversation (a list of {'role': ..., 'content': ...} dicts) or a list of "
                         f"conversations, got {type(messages).__name__}")
    for index, conversation in enumerate(messages):
        if not is_conversation(conversation):
            raise ValueError(f"request {index}: a conversation must be a non-empty list of message dicts with a "
                             f"'role', got {type(conversation).__name__}")
    return [list(conversation) for conversation in messages]


def chat_prompts(tokenizer: Any, conversations: list[list[dict]], chat_template: str | None = None,
                 add_generation_prompt: bool = True, continue_final_message: bool = False, tools: list | None = None,
                 chat_template_kwargs: dict | None = None) -> list[dict]:
    """vLLM-style prompts {"prompt_token_ids": ids} for the conversations, rendered by the tokenizer's chat template
    (or `chat_template`)."""
    if tokenizer is None:
        raise ValueError("LLM.chat needs a tokenizer: LLM(model, tokenizer)")
    if chat_template is None and getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the tokenizer has no chat template; pass chat_template= (a Jinja template)")
    if add_generation_prompt and continue_final_message:
        raise ValueError("add_generation_prompt and continue_final_message cannot both be set")
    prompts = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation, tokenize=False, chat_template=chat_template,
                                             add_generation_prompt=add_generation_prompt,
                                             continue_final_message=continue_final_message, tools=tools,
                                             **(chat_template_kwargs or {}))
        prompts.append({"prompt_token_ids": list(tokenizer(text, add_special_tokens=False)["input_ids"])})
    return prompts
