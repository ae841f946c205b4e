"""A chat model's template (``chat_template`` in its ``tokenizer_config.json``, a Jinja text as
transformers keeps it) rendered around chat messages: one definition for the controller's task prompts
(:mod:`workloads.task_prompts`) and the nodes' OpenAI-compatible chat route, so that both give the
model the text it was trained to read. Rendered in Jinja's immutable sandbox (the template comes with
the checkpoint), with the generation prompt added; ``bos_token`` and ``eos_token`` render empty (the
tokenizer adds the BOS itself). Needs ``jinja2`` only when a template is rendered.
"""

import json
import os
from typing import Any, Dict, List, Optional


class ChatTemplateError(ValueError):
    pass


def plain_chat(messages: List[Dict[str, Any]]) -> str:
    """The messages as plain "Role: content" paragraphs ending in "Assistant:", for a model without a
    chat template (the tiny one): the one fallback of the task prompts and the chat route."""
    lines = ["%s: %s" % (str(m["role"]).capitalize(), m["content"]) for m in messages]
    return "\n\n".join(lines + ["Assistant:"])


def read_chat_template(directory: str) -> Optional[str]:
    """The checkpoint's chat template, or None where it has none (the tiny model)."""
    try:
        with open(os.path.join(directory, "tokenizer_config.json"), encoding="utf-8") as handle:
            settings = json.load(handle)
    except (OSError, ValueError):
        return None
    template = settings.get("chat_template") if isinstance(settings, dict) else None
    return template if isinstance(template, str) and template.strip() else None


class ChatTemplate(object):
    """A parsed template; :meth:`render` turns messages into the prompt text."""

    def __init__(self, template: str) -> None:
        from jinja2.exceptions import TemplateError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        try:
            environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = environment.from_string(template)
        except TemplateError as error:
            raise ChatTemplateError("the model's chat_template does not parse (%s)" % error) from None

    def render(self, messages: List[Dict[str, Any]]) -> str:
        from jinja2.exceptions import TemplateError

        try:
            return self._template.render(messages=messages, add_generation_prompt=True, bos_token="", eos_token="")
        except TemplateError as error:  # a template may refuse a conversation (raise_exception)
            raise ChatTemplateError("the model's chat_template refused the messages (%s)" % error) from None
