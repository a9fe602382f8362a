"""HF tokenizer folders, chat templates and `ChatEnv`, checked against `transformers`.

Each test folder holds a small byte-level BPE trained here with the `tokenizers` library and a chat
template written here: ChatML (Qwen: `<|im_start|>`/`<|im_end|>`) and a GLM-like format whose next role
marker (`<|observation|>`, `<|user|>`) ends an assistant turn. The templates wrap what the policy
generates in `{% generation %}` blocks, so `transformers`' `apply_chat_template(...,
return_assistant_tokens_mask=True)` on the same files is the independent reference for both the token
ids of a whole conversation and which of them the policy produced.
"""

import json

import jax
import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sao_jax.data.chat import ChatEnv, ChatFormat, ChatTemplate, ChatTemplateError, HFTokenizer
from sao_jax.envs.base import Prompt
from sao_jax.envs.calculator import CalculatorEnv
from sao_jax.rollout.agent_loop import AgentLoop, AgentLoopConfig
from sao_jax.rollout.sampler import DecodeChunk
from sao_jax.train.sft import demonstration_trajectory

CHATML = r"""{%- for m in messages -%}
{%- if m.role == 'assistant' -%}
{{- '<|im_start|>assistant\n' -}}{% generation %}{{- m.content + '<|im_end|>' -}}{% endgeneration %}{{- '\n' -}}
{%- elif m.role == 'tool' -%}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' -}}
{%- else -%}
{{- '<|im_start|>' + m.role + '\n' + m.content + '<|im_end|>\n' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""

GLM_LIKE = r"""[gMASK]<sop>
{%- for m in messages -%}
{%- set after_assistant = loop.index0 > 0 and messages[loop.index0 - 1].role == 'assistant' -%}
{%- if m.role == 'system' -%}{{- '<|system|>\n' + m.content -}}
{%- elif m.role == 'user' -%}
{%- if after_assistant %}{% generation %}<|user|>{% endgeneration %}{% else %}<|user|>{% endif -%}
{{- '\n' + m.content -}}
{%- elif m.role == 'assistant' -%}{{- '<|assistant|>\n' -}}{% generation %}{{- m.content.strip() -}}{% endgeneration %}
{%- elif m.role == 'tool' -%}
{%- if after_assistant %}{% generation %}<|observation|>{% endgeneration %}{% else %}<|observation|>{% endif -%}
{{- '\n<tool_response>\n' + m.content + '\n</tool_response>' -}}
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- '<|assistant|>\n' -}}{%- endif -%}"""

FORMATS = {  # name -> (template, special tokens, end_of_turn, end_of_reply)
    "chatml": (CHATML, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>", "<|im_end|>"),
    "glm": (GLM_LIKE,
            ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
            "<|observation|>", "<|user|>"),
}
CORPUS = ["Q: 17*3+4=?", "<calc>17*3+4</calc>", "<out>55</out>", "<err>syntax</err>", "A: 55", "You are a calculator.",
          "user assistant system tool_response", "caf\u00e9 12 + 34 - 5 // 6"]


def write_folder(folder, template, specials, **config):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(CORPUS * 3, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": None, "eos_token": "<|endoftext|>", **config}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module", params=sorted(FORMATS))
def fmt(request, tmp_path_factory):
    """(name, folder, HFTokenizer, ChatFormat, transformers reference tokenizer) of one format."""
    template, specials, *_ = FORMATS[request.param]
    folder = write_folder(tmp_path_factory.mktemp(request.param), template, specials)
    tok = HFTokenizer.from_folder(folder)
    return request.param, folder, tok, ChatFormat.from_tokenizer(tok), PreTrainedTokenizerFast.from_pretrained(folder)


PROMPT = Prompt(id=7, text="Q: 12+34-5=?\n", answer="41", difficulty=2, metadata={"expression": "12+34-5"})
EPISODES = {  # inner-environment actions (their "\n" stop string included), the last one final
    2: ["<calc>12+34-5</calc>\n", "A: 41\n"],
    3: ["<calc>12+34-</calc>\n", "<calc>12+34-5</calc>\n", "A: 41\n"],
}


def reference_conversation(actions, system=None):
    """The episode as chat messages, built by stepping a plain CalculatorEnv (no ChatEnv involved)."""
    env = CalculatorEnv()
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": env.reset(PROMPT).rstrip("\n")})
    for action in actions:
        result = env.step(action)
        messages.append({"role": "assistant", "content": action.rstrip("\n")})
        if not result.done:
            messages.append({"role": "tool", "content": result.observation.rstrip("\n")})
    assert result.done and result.reward == 1.0
    return messages


def reference_ids_and_mask(ref, messages):
    """transformers' token ids and assistant mask of the conversation continued by a user turn, so the
    last assistant turn ends as the template ends a reply."""
    out = ref.apply_chat_template(messages + [{"role": "user", "content": "next"}], tokenize=True,
                                  return_dict=True, return_assistant_tokens_mask=True)
    return np.asarray(out["input_ids"]), np.asarray(out["assistant_masks"], bool)


# --- tokenizer and template ------------------------------------------------------------------------------


def test_tokenizer_matches_transformers_on_the_same_files(fmt):
    name, _, tok, _, ref = fmt
    text = "<|endoftext|>Q: 17*3+4=? caf\u00e9 \u2603\n" + "".join(FORMATS[name][1])
    ids = tok.encode(text)
    assert ids.dtype == np.int32
    assert ids.tolist() == ref(text, add_special_tokens=False)["input_ids"]
    for special in FORMATS[name][1]:  # a special-token string is its one id
        assert tok.encode(special).tolist() == [ref.convert_tokens_to_ids(special)]
    assert tok.decode(ids) == text == ref.decode(ids.tolist(), skip_special_tokens=False)
    assert tok.vocab_size == len(ref)
    assert tok.bos_id is None and ref.bos_token_id is None
    assert tok.eos_id == ref.eos_token_id == ref.convert_tokens_to_ids("<|endoftext|>")
    assert tok.pad_id == tok.eos_id  # no pad token: falls back to eos


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_render_matches_transformers_apply_chat_template(fmt, add_generation_prompt):
    _, _, tok, _, ref = fmt
    conversations = [
        [{"role": "user", "content": "hi"}],
        reference_conversation(EPISODES[3], system="You are a calculator."),
        [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}, {"role": "assistant", "content": " a "}],
    ]
    for messages in conversations:
        assert tok.chat_template.render(messages, add_generation_prompt=add_generation_prompt) == \
            ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def test_template_globals_and_filters_match_transformers(tmp_path):
    template = """{% for m in messages %}
  {% if m.role == 'system' %}{% continue %}{% endif %}
{{ m | tojson }}|{{ tools | tojson(indent=2) }}|{{ strftime_now('%Y') | length }}
  {% if m.content == 'stop' %}{% break %}{% endif %}
{% endfor %}{{ bos_token is defined }} {{ eos_token }}"""  # block tags on their own lines: trim/lstrip_blocks
    folder = write_folder(tmp_path, template, ["<|endoftext|>"])
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": "caf\u00e9 <b> & 'q'"},
                {"role": "user", "content": "stop"}, {"role": "user", "content": "never"}]
    tools = [{"name": "calc", "description": "a < b"}]
    mine = HFTokenizer.from_folder(folder).chat_template.render(messages, add_generation_prompt=False, tools=tools)
    ref = PreTrainedTokenizerFast.from_pretrained(folder).apply_chat_template(messages, tools=tools, tokenize=False)
    assert mine == ref and "never" not in mine and "caf\u00e9 <b>" in mine


# --- ChatEnv: the episode's tokens are the template's rendering of the conversation ----------------------


def chat_episode(chat_format, tok, actions, system=None):
    """Token ids and action mask of an episode driven through ChatEnv(CalculatorEnv) with `actions`."""
    env = ChatEnv(CalculatorEnv(), chat_format, system=system)
    first = tok.encode(env.reset(PROMPT))
    ids, mask = [first], [False] * len(first)
    for action in env.chat_actions(actions):
        result = env.step(action)
        for text, is_action in ((action, True), (result.observation, False)):
            piece = tok.encode(text)
            ids.append(piece)
            mask += [is_action] * len(piece)
    assert result.done and result.reward == 1.0 and result.observation == ""
    return np.concatenate(ids), np.asarray(mask)


@pytest.mark.parametrize("turns", sorted(EPISODES))
@pytest.mark.parametrize("system", [None, "You are a calculator."])
def test_episode_tokens_are_the_rendered_conversation_tokens(fmt, turns, system):
    name, _, tok, chat_format, ref = fmt
    assert (chat_format.end_of_turn, chat_format.end_of_reply) == FORMATS[name][2:]
    assert chat_format.stop_strings == tuple(dict.fromkeys(FORMATS[name][2:] + ("<|endoftext|>",)))  # + EOS
    ids, mask = chat_episode(chat_format, tok, EPISODES[turns], system=system)
    ref_ids, ref_mask = reference_ids_and_mask(ref, reference_conversation(EPISODES[turns], system=system))
    np.testing.assert_array_equal(ids, ref_ids[: len(ids)])
    np.testing.assert_array_equal(mask, ref_mask[: len(ids)])
    assert mask[-1] and tok.decode(ids[-1:]) == chat_format.end_of_reply
    chat_actions = ChatEnv(CalculatorEnv(), chat_format).chat_actions(EPISODES[turns])
    assert mask.sum() == sum(len(tok.encode(a)) for a in chat_actions)


def test_an_action_cut_before_its_end_of_turn_gets_it_in_the_observation(fmt):
    _, _, tok, chat_format, ref = fmt
    env = ChatEnv(CalculatorEnv(), chat_format)
    text = env.reset(PROMPT)
    observation = env.step("<calc>12+34-5</calc>").observation  # no end-of-turn token: the budget ran out
    assert observation.startswith(chat_format.end_of_turn)
    text += "<calc>12+34-5</calc>" + observation
    messages = reference_conversation(EPISODES[2])[:3]
    assert text == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def test_any_stop_string_ends_the_action_the_inner_env_sees(fmt):
    _, _, tok, chat_format, _ = fmt
    for stop in chat_format.stop_strings:  # e.g. a final answer that ends with EOS
        env = ChatEnv(CalculatorEnv(), chat_format)
        env.reset(PROMPT)
        result = env.step("A: 41" + stop)
        assert result.done and result.reward == 1.0 and result.info["answer"] == "41"
        assert len(tok.encode(stop)) == 1


class ScriptedTokenSampler:
    """Sampler stand-in for the agent loop: the row whose prompt tokens are a key of `scripts` emits that
    script's action token lists, one per action, `chunk_size` tokens per decode chunk."""

    chunk_size = 4

    def __init__(self, scripts):
        self.scripts = scripts

    def init_state(self, batch_size, max_len):
        return [dict(script=None, action=0, typed=0) for _ in range(batch_size)]

    def prefill(self, params, state, tokens, mask, reset):
        for b in np.flatnonzero(reset):
            state[b] = dict(script=self.scripts[tuple(tokens[b][mask[b]].tolist())], action=0, typed=0)
        return state

    def window_for(self, state, longest):
        return longest

    def decode_chunk(self, params, state, key, max_new_tokens, stop_ids, window=None):
        tokens = np.zeros((len(state), self.chunk_size), np.int32)
        num, finished = np.zeros(len(state), np.int32), np.zeros(len(state), bool)
        for b, row in enumerate(state):
            if max_new_tokens[b] == 0:
                continue
            rest = row["script"][row["action"]][row["typed"]:]
            n = min(self.chunk_size, len(rest), int(max_new_tokens[b]))
            tokens[b, :n], num[b] = rest[:n], n
            row["typed"] += n
            if n == len(rest):
                assert rest[-1] in stop_ids[b], "the agent loop must stop on the format's end-of-turn token"
                finished[b], row["action"], row["typed"] = True, row["action"] + 1, 0
        zeros = np.zeros(tokens.shape, np.float32)
        return state, DecodeChunk(tokens=tokens, logprobs=zeros, entropy=zeros, num_tokens=num, finished=finished)


def test_agent_loop_with_chat_env_builds_the_rendered_conversation(fmt):
    _, _, tok, chat_format, ref = fmt
    prompts = [PROMPT, Prompt(id=8, text="Q: 2*3=?\n", answer="6", difficulty=1, metadata={"expression": "2*3"})]
    scripts, references = {}, []
    for prompt in prompts:
        env = ChatEnv(CalculatorEnv(), chat_format)
        scripts[tuple(tok.encode(env.reset(prompt)).tolist())] = [tok.encode(a) for a in env.demonstration(prompt)]
        messages = [{"role": "user", "content": prompt.text.rstrip("\n")},
                    {"role": "assistant", "content": f"<calc>{prompt.metadata['expression']}</calc>"},
                    {"role": "tool", "content": f"<out>{prompt.answer}</out>"},
                    {"role": "assistant", "content": f"A: {prompt.answer}"}]
        references.append(reference_ids_and_mask(ref, messages))
    loop = AgentLoop(ScriptedTokenSampler(scripts), tok, lambda p: ChatEnv(CalculatorEnv(), chat_format),
                     AgentLoopConfig(num_slots=2, max_total_tokens=256, add_bos=False, lockstep=True))
    for trajectory, (ref_ids, ref_mask) in zip(loop.rollout((None, 0), prompts, key=jax.random.key(0)), references):
        assert trajectory.info["error"] is None and trajectory.info["done"] and trajectory.outcome_reward == 1.0
        np.testing.assert_array_equal(trajectory.tokens, ref_ids[: trajectory.num_tokens])
        np.testing.assert_array_equal(trajectory.action_mask, ref_mask[: trajectory.num_tokens])


def test_sft_demonstration_through_chat_env_is_the_rendered_conversation(tmp_path):
    template, specials, *_ = FORMATS["chatml"]
    folder = write_folder(tmp_path, template, specials, bos_token="<|endoftext|>")  # sft always adds a BOS
    tok = HFTokenizer.from_folder(folder)
    env = ChatEnv(CalculatorEnv(), ChatFormat.from_tokenizer(tok))
    demo = demonstration_trajectory(env, PROMPT, env.demonstration(PROMPT), tok)
    ref_ids, ref_mask = reference_ids_and_mask(PreTrainedTokenizerFast.from_pretrained(folder),
                                               reference_conversation(EPISODES[2]))
    assert demo.tokens[0] == tok.bos_id
    np.testing.assert_array_equal(demo.tokens[1:], ref_ids[: demo.num_tokens - 1])
    np.testing.assert_array_equal(demo.action_mask[1:], ref_mask[: demo.num_tokens - 1])
    assert demo.rewards[-1] == 1.0 and demo.rewards.sum() == 1.0


# --- errors ---------------------------------------------------------------------------------------------


def test_missing_files_and_template_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer.from_folder(tmp_path)
    folder = write_folder(tmp_path / "no_template", None, ["<|endoftext|>"])
    tok = HFTokenizer.from_folder(folder)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatFormat.from_tokenizer(tok)
    (folder / "tokenizer_config.json").unlink()
    with pytest.raises(FileNotFoundError, match="tokenizer_config.json"):
        HFTokenizer.from_folder(folder)


def test_chat_template_jinja_file_is_used_when_the_config_has_none(tmp_path):
    folder = write_folder(tmp_path, None, FORMATS["chatml"][1])
    (folder / "chat_template.jinja").write_text(CHATML)
    assert ChatFormat.from_tokenizer(HFTokenizer.from_folder(folder)).end_of_turn == "<|im_end|>"


def test_bad_special_tokens_in_the_config_are_named(tmp_path):
    with pytest.raises(ValueError, match="bos_token '<s>' is not in the vocabulary"):
        HFTokenizer.from_folder(write_folder(tmp_path / "a", None, ["<|endoftext|>"], bos_token="<s>"))
    decoder = {"5": {"content": "<|endoftext|>", "special": True}}  # tokenizer.json gives it id 0
    with pytest.raises(ValueError, match="'<|endoftext|>' has id 5"):
        HFTokenizer.from_folder(write_folder(tmp_path / "b", None, ["<|endoftext|>"], added_tokens_decoder=decoder))


def test_template_that_rewrites_earlier_turns_is_not_prefix_stable(tmp_path):
    # earlier assistant turns are abbreviated, as templates that drop old reasoning do
    template = CHATML.replace("m.content + '<|im_end|>'",
                              "(m.content if loop.index0 + 2 >= messages | length else '...') + '<|im_end|>'")
    tok = HFTokenizer.from_folder(write_folder(tmp_path, template, FORMATS["chatml"][1]))
    env = ChatEnv(CalculatorEnv(), ChatFormat.from_tokenizer(tok))  # one turn renders fine
    env.reset(PROMPT)
    env.step("<calc>12+34-</calc><|im_end|>")
    with pytest.raises(ChatTemplateError, match="not prefix-stable.*after assistant turn 2"):
        env.step("<calc>12+34-5</calc><|im_end|>")
    unstable = "{{ messages | length }}" + CHATML  # the header counts the messages
    with pytest.raises(ChatTemplateError, match="not prefix-stable"):
        ChatFormat.from_tokenizer(HFTokenizer.from_folder(write_folder(tmp_path / "b", unstable, FORMATS["chatml"][1])))


def test_template_without_an_end_token_after_assistant_content_is_refused(tmp_path):
    template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                "{% if add_generation_prompt %}assistant: {% endif %}")
    tok = HFTokenizer.from_folder(write_folder(tmp_path, template, ["<|endoftext|>"]))
    with pytest.raises(ChatTemplateError, match="does not start with an added token"):
        ChatFormat.from_tokenizer(tok)


def test_the_longest_added_token_the_continuation_starts_with_ends_the_turn(tmp_path):
    specials = [*FORMATS["chatml"][1], "<|im"]  # an added token that is a prefix of <|im_end|>
    chat_format = ChatFormat.from_tokenizer(HFTokenizer.from_folder(write_folder(tmp_path, CHATML, specials)))
    assert (chat_format.end_of_turn, chat_format.end_of_reply) == ("<|im_end|>", "<|im_end|>")


def test_template_errors_are_chat_template_errors():
    with pytest.raises(ChatTemplateError, match="refused the conversation: no tools here"):
        ChatTemplate("{% if messages[0].role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}").render(
            [{"role": "tool", "content": "x"}], add_generation_prompt=False)
    with pytest.raises(ChatTemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
    with pytest.raises(ChatTemplateError, match="message 1 must be a mapping with a role"):
        ChatTemplate("").render([{"role": "user"}, {"role": "robot"}], add_generation_prompt=False)
    with pytest.raises(ChatTemplateError, match="failed to render"):
        ChatTemplate("{{ messages.append(1) }}").render([], add_generation_prompt=False)  # sandboxed: immutable


def test_chat_env_misuse_raises(fmt):
    env = ChatEnv(CalculatorEnv(), fmt[3])
    with pytest.raises(RuntimeError, match="before reset"):
        env.step("A: 1")
    env.reset(PROMPT)
    with pytest.raises(TypeError, match="as str"):
        env.step(b"A: 1")
