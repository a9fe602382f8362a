"""Hugging Face tokenizers and chat templates, and `ChatEnv`: any environment spoken in a model's chat format.

`HFTokenizer.from_folder(path)` reads a model folder's `tokenizer.json` (the `tokenizers` library) and
`tokenizer_config.json` (special tokens, extra added tokens, the Jinja `chat_template`, or a
`chat_template.jinja` file beside it). It has the interface the agent loop and SFT use from `CharTokenizer`:
`encode` adds no BOS/EOS and maps special-token strings in the text to their ids; `decode` keeps special
tokens, so an action's end-of-turn token survives the trip from sampled ids to the environment's text.

`ChatTemplate` renders a conversation as `transformers`' `apply_chat_template` does: a sandboxed Jinja
environment with trim_blocks/lstrip_blocks, loop controls, `raise_exception`, `strftime_now`, a `tojson`
that does not HTML-escape, and the `{% generation %}` block tag (its body rendered unchanged).

`ChatFormat.from_tokenizer` finds, by rendering conversations with placeholder texts and taking
differences, the tokens that end an assistant turn:

    head  = render([user U], add_generation_prompt=True)
    render([user U, assistant X, tool O], add_generation_prompt=True) = head + X + end_of_turn + …
    render([user U, assistant X, user V], add_generation_prompt=True) = head + X + end_of_reply + …

Each must be an added (special) token, so the sampler can stop on it. For ChatML both are `<|im_end|>`;
a format whose next role marker ends the turn (GLM: `<|observation|>` before a tool result, `<|user|>`
before a user turn) has two. The policy may stop on either, or on the tokenizer's EOS.

`ChatEnv(env, chat_format)` then makes an episode's token stream the template's rendering of the
conversation [system?, user = prompt, assistant = a_0, tool = o_0, assistant = a_1, …]:

    reset  -> render(messages so far, add_generation_prompt=True)          the prefix up to the first header
    action -> a_k + end_of_turn                                            what the policy samples
    step   -> render(messages + [a_k, o_k]) minus the text already emitted, minus a_k and end_of_turn

so reset text + Σ (action + observation) is exactly the rendering of the whole conversation, up to the
last end-of-turn token. Each step re-renders the conversation and checks that it extends the text
already emitted; a template that rewrites earlier turns (not prefix-stable) is a `ChatTemplateError`.
Tokenizing the pieces separately equals tokenizing the whole when every piece boundary is a token
boundary: true at special tokens, and at the headers' ends for the usual pre-tokenizers unless an action
starts with whitespace that would merge with the header's.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import numpy as np
import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from sao_jax.envs.base import STOP, Environment, Prompt, StepResult
from sao_jax.errors import UserError

ROLES = ("system", "user", "assistant", "tool")
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")
# Placeholder texts for deriving the turn structure; plain words so any template renders them verbatim.
_USER, _ASSISTANT, _TOOL, _NEXT_USER = "SAOUSERTEXT", "SAOASSISTANTTEXT", "SAOTOOLTEXT", "SAONEXTUSERTEXT"


class TokenizerFolderError(UserError, FileNotFoundError):
    """A tokenizer folder (`model.pretrained`) that does not exist or lacks a tokenizer file."""


class ChatTemplateError(ValueError):
    """A chat template that is missing, fails to render, or cannot be cut into turns."""


# --- chat templates ---------------------------------------------------------------------------------------


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`: HF templates mark assistant text with it (for masks);
    here the body renders unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body, lineno=lineno)


def _raise_exception(message: str):
    raise ChatTemplateError(f"the chat template refused the conversation: {message}")


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.datetime.now().strftime(format)


class ChatTemplate:
    """A compiled Hugging Face chat template (Jinja source), with the special tokens it may refer to."""

    def __init__(self, source: str, *, special_tokens: Mapping[str, str | None] | None = None):
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                    extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
        environment.filters["tojson"] = _tojson
        environment.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = environment.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"chat template does not parse: {e.message} (template line {e.lineno})") from None
        self.source = source
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}  # as transformers

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool, **context: Any) -> str:
        """The conversation as text. messages: [{"role": system|user|assistant|tool, "content": str, …}];
        add_generation_prompt: end with the header of a new assistant turn; context: further template
        variables (`tools`, `enable_thinking`, …)."""
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or message.get("role") not in ROLES:
                raise ChatTemplateError(f"message {i} must be a mapping with a role in {ROLES} (got {message!r})")
        variables = {**self.special_tokens, **context}
        try:
            return self._template.render(messages=[dict(m) for m in messages],
                                         add_generation_prompt=add_generation_prompt, **variables)
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from None


# --- tokenizer --------------------------------------------------------------------------------------------


def _token_text(value, *, field: str, where: str) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, {"content": str, …}, or null."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"{where}: {field} must be a string, an object with 'content', or null (got {value!r})")


class HFTokenizer:
    """A Hugging Face fast tokenizer with the `CharTokenizer` interface (`encode`, `decode`, `vocab_size`,
    `bos_id`, `eos_id`, `pad_id`) plus `added_tokens` ({text: id}), `special_tokens` ({"bos_token": text,
    …}) and `chat_template` (a `ChatTemplate`, or None when the folder has none).

    bos_id is None when the model has no BOS token (Qwen); pad_id falls back to eos_id without a pad token.
    """

    def __init__(self, tokenizer: tokenizers.Tokenizer, *, special_tokens: Mapping[str, str | None],
                 chat_template: str | None = None, name: str = "tokenizer"):  # fmt: skip
        self._tokenizer = tokenizer
        self._tokenizer.encode_special_tokens = False  # special-token strings in text map to their ids
        self.name = name
        self.special_tokens = {k: special_tokens.get(k) for k in SPECIAL_TOKEN_NAMES}
        self.added_tokens = {t.content: i for i, t in tokenizer.get_added_tokens_decoder().items()}
        ids = {k: self._id_of(token, k) for k, token in self.special_tokens.items()}
        self.bos_id, self.eos_id = ids["bos_token"], ids["eos_token"]
        self.pad_id = self.eos_id if ids["pad_token"] is None else ids["pad_token"]
        self.chat_template = None if chat_template is None else ChatTemplate(chat_template,
                                                                             special_tokens=self.special_tokens)

    @classmethod
    def from_folder(cls, path: str | Path) -> HFTokenizer:
        """Load `tokenizer.json` + `tokenizer_config.json` (+ `chat_template.jinja` if the config has no
        `chat_template`). Tokens listed in the config's `added_tokens_decoder` but missing from
        tokenizer.json are added; one whose id disagrees is an error."""
        folder = Path(path)
        if not folder.is_dir():
            raise TokenizerFolderError(f"no such folder ({folder})")
        files = {name: folder / name for name in ("tokenizer.json", "tokenizer_config.json")}
        for name, file in files.items():
            if not file.is_file():
                raise TokenizerFolderError(f"{folder}: no {name} (a Hugging Face tokenizer folder needs tokenizer.json "
                                        "and tokenizer_config.json)")
        tokenizer = tokenizers.Tokenizer.from_file(str(files["tokenizer.json"]))
        where = str(files["tokenizer_config.json"])
        try:
            config = json.loads(files["tokenizer_config.json"].read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON ({e})") from None
        for id_text, spec in config.get("added_tokens_decoder", {}).items():
            content = _token_text(spec, field=f"added_tokens_decoder[{id_text}]", where=where)
            if tokenizer.token_to_id(content) is None:
                token = tokenizers.AddedToken(content, special=bool(spec.get("special", True)), normalized=False)
                (tokenizer.add_special_tokens if token.special else tokenizer.add_tokens)([token])
            if tokenizer.token_to_id(content) != int(id_text):
                raise ValueError(f"{where}: added token {content!r} has id {id_text} but tokenizer.json gives it "
                                 f"{tokenizer.token_to_id(content)}")
        special_tokens = {k: _token_text(config.get(k), field=k, where=where) for k in SPECIAL_TOKEN_NAMES}
        return cls(tokenizer, special_tokens=special_tokens, chat_template=_chat_template_source(folder, config),
                   name=str(folder))  # fmt: skip

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def unk_id(self) -> int | None:
        """The id text outside the vocabulary becomes, or None when every text has ids (byte-level BPE)."""
        unk = getattr(self._tokenizer.model, "unk_token", None)
        return None if not unk else self._tokenizer.token_to_id(unk)

    def encode(self, text: str) -> np.ndarray:
        """Token ids of `text`, no BOS/EOS added; special-token strings become their ids."""
        return np.asarray(self._tokenizer.encode(text, add_special_tokens=False).ids, np.int32)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of `ids`, special tokens included (so `encode(decode(ids))` gives them back)."""
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=False)

    def _id_of(self, token: str | None, field: str) -> int | None:
        if token is None:
            return None
        token_id = self._tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"{self.name}: {field} {token!r} is not in the vocabulary")
        return token_id


def _chat_template_source(folder: Path, config: Mapping[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": …}, …]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
        template = named.get("default")
        if template is None:
            raise ValueError(f"{folder}/tokenizer_config.json: chat_template lists {sorted(named)} but no 'default'")
    if template is None and (folder / "chat_template.jinja").is_file():
        template = (folder / "chat_template.jinja").read_text()
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{folder}/tokenizer_config.json: chat_template must be a string "
                         f"(got {type(template).__name__})")
    return template


# --- the turn structure of a chat format ------------------------------------------------------------------


def _continuation(emitted: str, rendered: str, *, what: str) -> str:
    """`rendered` minus its prefix `emitted`, or a ChatTemplateError showing where they part."""
    if rendered.startswith(emitted):
        return rendered[len(emitted):]
    i = next((i for i, (a, b) in enumerate(zip(emitted, rendered)) if a != b), min(len(emitted), len(rendered)))
    raise ChatTemplateError(
        f"chat template is not prefix-stable: {what} does not start with the text before it; they part at "
        f"character {i}: {emitted[max(0, i - 30): i + 30]!r} vs {rendered[max(0, i - 30): i + 30]!r}")


@dataclasses.dataclass(frozen=True)
class ChatFormat:
    """A chat template cut into turns (module docstring). `context`: template variables for every
    rendering (e.g. {"enable_thinking": False}). `stop_strings`: the tokens an assistant turn may end with —
    end_of_turn, end_of_reply and the tokenizer's EOS (the agent loop stops on EOS too)."""

    template: ChatTemplate
    end_of_turn: str  # ends an assistant turn that a tool result follows
    end_of_reply: str  # ends an assistant turn that a user turn follows
    eos_token: str | None = None
    context: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @classmethod
    def from_tokenizer(cls, tokenizer: HFTokenizer, **context: Any) -> ChatFormat:
        if tokenizer.chat_template is None:
            raise ChatTemplateError(f"{tokenizer.name}: no chat template (neither 'chat_template' in "
                                    "tokenizer_config.json nor a chat_template.jinja file)")
        template = tokenizer.chat_template
        user, assistant = {"role": "user", "content": _USER}, {"role": "assistant", "content": _ASSISTANT}
        head = template.render([user], add_generation_prompt=True, **context) + _ASSISTANT
        ends = []
        for follower in ({"role": "tool", "content": _TOOL}, {"role": "user", "content": _NEXT_USER}):
            rendered = template.render([user, assistant, follower], add_generation_prompt=True, **context)
            after = _continuation(head, rendered, what=f"[user, assistant, {follower['role']}] rendered")
            end = max((t for t in tokenizer.added_tokens if after.startswith(t)), key=len, default=None)
            if end is None:
                raise ChatTemplateError(
                    f"{tokenizer.name}: an assistant turn followed by a {follower['role']} turn is rendered with "
                    f"{after[:40]!r} after its content, which does not start with an added token; the policy "
                    "needs one token to end its turn on")
            ends.append(end)
        return cls(template, end_of_turn=ends[0], end_of_reply=ends[1],
                   eos_token=tokenizer.special_tokens["eos_token"], context=dict(context))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        ends = (self.end_of_turn, self.end_of_reply) + ((self.eos_token,) if self.eos_token is not None else ())
        return tuple(dict.fromkeys(ends))

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.template.render(messages, add_generation_prompt=add_generation_prompt, **self.context)


class ChatEnv:
    """`env` (any `Environment`) spoken in `chat_format` (module docstring): the prompt is the user turn,
    each action the content of an assistant turn, each observation a tool turn.

    The inner environment's line convention is dropped at the boundary: one trailing "\\n" comes off the
    prompt and each observation before they become message contents, and the action's stop token comes off
    before the inner `step` sees it. An action that did not end with `end_of_turn` (cut at the token budget,
    or ended with another stop string while the episode goes on) gets the whole continuation as its observation,
    end-of-turn token included, so the context still follows the template.
    """

    def __init__(self, env: Environment, chat_format: ChatFormat, *, system: str | None = None):
        self.env, self.chat_format, self.system = env, chat_format, system
        self.stop_strings = chat_format.stop_strings
        self._messages: list[dict[str, str]] | None = None
        self._text = ""  # the conversation rendered so far: everything the policy has seen or sampled

    @property
    def max_turns(self) -> int:
        return self.env.max_turns

    def reset(self, prompt: Prompt) -> str:
        user = {"role": "user", "content": self.env.reset(prompt).removesuffix(STOP)}
        self._messages = ([{"role": "system", "content": self.system}] if self.system is not None else []) + [user]
        self._text = self.chat_format.render(self._messages, add_generation_prompt=True)
        return self._text

    def step(self, action_text: str) -> StepResult:
        if self._messages is None:
            raise RuntimeError("ChatEnv.step called before reset(prompt)")
        if not isinstance(action_text, str):
            raise TypeError(f"ChatEnv.step expects the action as str, got {type(action_text).__name__}")
        stop = next((s for s in self.stop_strings if action_text.endswith(s)), None)
        content = action_text[: len(action_text) - len(stop)] if stop else action_text
        result = self.env.step(content)
        if result.done:
            return result
        self._messages += [{"role": "assistant", "content": content},
                           {"role": "tool", "content": result.observation.removesuffix(STOP)}]
        turn = sum(m["role"] == "assistant" for m in self._messages)
        rendered = self.chat_format.render(self._messages, add_generation_prompt=True)
        bridge = _continuation(self._text + content, rendered, what=f"the conversation after assistant turn {turn}")
        end = self.chat_format.end_of_turn
        if not bridge.startswith(end):
            raise ChatTemplateError(f"after assistant turn {turn} the template renders {bridge[:40]!r} after its "
                                    f"content, not the end-of-turn token {end!r}")
        self._text = rendered
        return dataclasses.replace(result, observation=bridge[len(end):] if stop == end else bridge)

    def chat_actions(self, actions: Sequence[str]) -> list[str]:
        """The inner environment's actions as this format's actions: the inner stop string off, the
        end-of-turn token on (`end_of_reply` on the last one, the final answer)."""
        inner_stops = tuple(self.env.stop_strings)
        out = []
        for i, action in enumerate(actions):
            stop = next((s for s in inner_stops if action.endswith(s)), "")
            end = self.chat_format.end_of_reply if i == len(actions) - 1 else self.chat_format.end_of_turn
            out.append(action[: len(action) - len(stop)] + end)
        return out

    def demonstration(self, prompt: Prompt) -> list[str]:
        """The inner environment's gold actions (`env.demonstration(prompt)`) in this format."""
        return self.chat_actions(self.env.demonstration(prompt))
