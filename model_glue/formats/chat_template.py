"""Chat templates, rendered by hand: the run time has no Jinja. A GGUF's `tokenizer.chat_template` is
recognised by its markers as one of the common families; an unknown one is reported and the text is
sent raw (each message's content, then the reply).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

SMOLLM_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


@dataclass(frozen=True)
class ChatTemplate:
    family: str  # "chatml", "llama3", "llama2", "zephyr", "gemma", "raw" or "text"
    default_system: str | None = None  # inserted when the first message is not a system one
    bos_text: str = ""  # the template's own leading BOS text (Llama 3 writes <|begin_of_text|>)
    note: str | None = None  # why the family is "raw", for the page

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if messages and messages[0]["role"] != "system" and self.default_system:
            messages = [{"role": "system", "content": self.default_system}] + messages
        return _RENDERERS[self.family](self, messages, add_generation_prompt)


def _chatml(t, messages, gen):
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if gen else "")


def _llama3(t, messages, gen):
    text = t.bos_text + "".join(f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>"
                                for m in messages)
    return text + ("<|start_header_id|>assistant<|end_header_id|>\n\n" if gen else "")


def _llama2(t, messages, gen):
    """[INST] turns; a system message is folded into the first user turn (<<SYS>>). BOS before each
    turn is written as text (<s>) and becomes the special id."""
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    out = []
    for k, m in enumerate(messages):
        if m["role"] == "user":
            content = m["content"].strip()
            if k == 0 and system:
                content = f"<<SYS>>\n{system}\n<</SYS>>\n\n{content}"
            out.append(f"<s>[INST] {content} [/INST]")
        else:
            out.append(f" {m['content'].strip()} </s>")
    return "".join(out)


def _zephyr(t, messages, gen):
    text = "".join(f"<|{m['role']}|>\n{m['content']}</s>\n" for m in messages)
    return text + ("<|assistant|>\n" if gen else "")


def _gemma(t, messages, gen):
    """<start_of_turn> turns, the assistant's role named "model"; a system message is folded into the
    first user turn (Gemma has no system role). BOS is the tokenizer's (add_bos_token)."""
    system = None
    if messages and messages[0]["role"] == "system":
        system, messages = messages[0]["content"], messages[1:]
    out = []
    for k, m in enumerate(messages):
        content = m["content"].strip()
        if k == 0 and system:
            content = f"{system}\n\n{content}"
        out.append(f"<start_of_turn>{'model' if m['role'] == 'assistant' else m['role']}\n{content}<end_of_turn>\n")
    return "".join(out) + ("<start_of_turn>model\n" if gen else "")


def _raw(t, messages, gen):
    return "\n".join(m["content"] for m in messages) + ("\n" if gen else "")


def _text(t, messages, gen):
    """A base model's conversation as one text, which the reply continues (no separators added)."""
    return "".join(m["content"] for m in messages)


_RENDERERS = {"chatml": _chatml, "llama3": _llama3, "llama2": _llama2, "zephyr": _zephyr, "gemma": _gemma,
              "raw": _raw, "text": _text}


def chat_template(template: str | None) -> ChatTemplate:
    """The family of a GGUF's Jinja template (None: the file has none)."""
    if not template:
        return ChatTemplate("text", note="the GGUF has no chat template (a base model): the conversation is sent as "
                                         "plain text, which the reply continues")
    if "<|im_start|>" in template:
        default = SMOLLM_SYSTEM_PROMPT if SMOLLM_SYSTEM_PROMPT in template else None
        return ChatTemplate("chatml", default_system=default)
    if "<|start_header_id|>" in template:
        return ChatTemplate("llama3", bos_text="<|begin_of_text|>" if re.search(r"bos_token|<\|begin_of_text\|>", template)
                            else "")
    if "[INST]" in template:
        return ChatTemplate("llama2")
    if "<|user|>" in template and "<|assistant|>" in template:
        return ChatTemplate("zephyr")
    if "<start_of_turn>" in template:
        return ChatTemplate("gemma")
    return ChatTemplate("raw", note="the GGUF's chat template is not one this page renders (ChatML, Llama 3, "
                                    "Llama 2, Zephyr, Gemma): messages are sent as plain text")


# SmolLM2-Instruct's template: what the served model (converted from its GGUF) renders.
SMOLLM2_TEMPLATE = ChatTemplate("chatml", default_system=SMOLLM_SYSTEM_PROMPT)
