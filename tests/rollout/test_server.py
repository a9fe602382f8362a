"""The chat server and scaffold episodes, driven by clients nobody here wrote: the `openai` Python client and
smolagents' ToolCallingAgent, against a tiny random Qwen3-MoE with a ChatML template that renders tools
(`scripts/tiny_chat_model.py`). `transformers`' `apply_chat_template` on the same folder is the independent
rendering of each conversation. Every request is bounded: a few tokens, a few requests per episode, deadlines.
"""

import sys
import threading
import time

import jax
import numpy as np
import openai
import pytest
from flax import nnx
from transformers import PreTrainedTokenizerFast

from sao_jax import models
from sao_jax.data.chat import ChatFormat, HFTokenizer
from sao_jax.envs import toy_repo
from sao_jax.envs.base import Prompt
from sao_jax.rollout.agent_loop import AgentLoopConfig
from sao_jax.rollout.sampler import Sampler
from sao_jax.rollout.scaffold import ScaffoldLoop, ScaffoldSettings
from sao_jax.rollout.server import ChatServer, GenerationEngine, check_loopback, parse_tool_calls
from scripts.tiny_chat_model import write_tiny_chat_model

VERSION = 7
TOOLS = [{"type": "function", "function": {"name": "run_tests", "description": "Run the tests.",
                                           "parameters": {"type": "object", "properties": {}}}}]  # fmt: skip
IM_END = "<|im_end|>"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = write_tiny_chat_model(tmp_path_factory.mktemp("tiny_chat"))
    tok = HFTokenizer.from_folder(folder)
    policy = models.from_pretrained(str(folder))
    return dict(tok=tok, chat_format=ChatFormat.from_tokenizer(tok), sampler=Sampler(policy, chunk_size=8),
                params=nnx.state(policy), ref=PreTrainedTokenizerFast.from_pretrained(folder))  # fmt: skip


def by_prompt(prompt, base_url, episode_id):
    """The episode function of every loop here: each prompt carries its own in `metadata["run"]`."""
    return prompt.metadata["run"](prompt, base_url, episode_id)


def loop_for(model, **settings):
    config = AgentLoopConfig(num_slots=2, max_total_tokens=2048, max_action_tokens=8, add_bos=False)
    settings = {"episode_fn": by_prompt, "deadline_s": 120, "max_episode_tokens": 64, "episodes_at_once": 4} | settings
    return ScaffoldLoop(model["sampler"], model["tok"], model["chat_format"], config, ScaffoldSettings(**settings))


@pytest.fixture(scope="module")
def loop(model):
    loop = loop_for(model)
    yield loop
    loop.close()


def prompt_running(run, i=0):
    return Prompt(id=i, text="Run the tests.", answer="", difficulty=1, metadata={"run": run})


def client_for(base_url, episode_id):
    return openai.OpenAI(base_url=base_url, api_key=episode_id, max_retries=0, timeout=120)


def action_spans(trajectory):
    """[(start, end)] of each action's tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], trajectory.action_mask.astype(int), [0]])))
    return list(zip(edges[::2], edges[1::2]))


@pytest.mark.slow
def test_openai_client_multi_turn_with_tools_and_logprobs_is_the_trajectory(model, loop):
    tok, ref = model["tok"], model["ref"]
    seen = {}

    def three_turns(prompt, base_url, episode_id):
        client = client_for(base_url, episode_id)
        messages = [{"role": "system", "content": "You run tests."}, {"role": "user", "content": prompt.text}]
        responses = []
        for turn in range(3):
            response = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS, max_tokens=6,
                                                      logprobs=True, top_logprobs=2)  # fmt: skip
            responses.append(response)
            messages.append(response.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": f"result {turn}"})
        seen.update(responses=responses, messages=messages[:-1])
        return 0.5

    [trajectory] = loop.rollout((model["params"], VERSION), [prompt_running(three_turns)], jax.random.key(0))
    info = trajectory.info
    assert info["error"] is None and (info["segments"], info["prefix_mismatches"], info["num_turns"]) == (1, 0, 3)

    # What the client saw, token for token, is what the trajectory trains on.
    responses = seen["responses"]
    sampled = [r.model_extra["sao"]["completion_token_ids"] for r in responses]
    spans = action_spans(trajectory)
    assert [trajectory.tokens[a:b].tolist() for a, b in spans] == sampled
    seen_logprobs = np.concatenate([[c.logprob for c in r.choices[0].logprobs.content] for r in responses])
    np.testing.assert_array_equal(seen_logprobs.astype(np.float32), trajectory.rollout_logprobs[trajectory.action_mask])
    assert [c.token for r in responses for c in r.choices[0].logprobs.content] == \
        [tok.decode([t]) for t in trajectory.tokens[trajectory.action_mask]]
    for response in responses:  # top_logprobs: the likeliest tokens under μ, at least as likely as the sample
        for entry in response.choices[0].logprobs.content:
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 2 and tops[0] >= tops[1] and tops[0] >= entry.logprob - 1e-4
    assert set(trajectory.policy_version[trajectory.action_mask]) == {VERSION}
    assert set(trajectory.policy_version[~trajectory.action_mask]) == {-1}
    assert trajectory.rewards.sum() == 0.5 and trajectory.rewards[spans[-1][1] - 1] == 0.5
    np.testing.assert_array_equal(trajectory.turn_index[: spans[0][0]], -1)
    for k, (a, b) in enumerate(spans):
        np.testing.assert_array_equal(trajectory.turn_index[a: spans[k + 1][0] if k + 1 < len(spans) else b], k)

    # The trajectory is transformers' rendering of the conversation, with the policy's own text as the
    # assistant turns (its stop token kept when it was not the template's end of turn).
    messages = [dict(m) for m in seen["messages"]]
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    ends = []
    for i, ids in zip(assistant, sampled):
        ends.append(ids[-1] == tok.added_tokens[IM_END])
        messages[i] = {"role": "assistant", "content": tok.decode(ids[:-1] if ends[-1] else ids)}
    rendered = ref.apply_chat_template(messages, tools=TOOLS, tokenize=False)
    assert tok.decode(trajectory.tokens) + ("\n" if ends[-1] else IM_END + "\n") == rendered
    prompt_ids = ref.apply_chat_template(messages[:2], tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                         return_dict=False)  # fmt: skip
    assert trajectory.tokens[: spans[0][0]].tolist() == list(prompt_ids)
    for (_, end), (start, _) in zip(spans, spans[1:]):  # each observation tokenized as transformers does
        text = tok.decode(trajectory.tokens[end:start])
        assert trajectory.tokens[end:start].tolist() == ref(text, add_special_tokens=False)["input_ids"]


def test_rewritten_history_starts_a_new_segment_and_is_counted(model, loop):
    ref = model["ref"]
    seen = {}

    def rewrite(prompt, base_url, episode_id):
        client = client_for(base_url, episode_id)
        first = client.chat.completions.create(model="policy", max_tokens=4,
                                               messages=[{"role": "user", "content": "Run the tests."}])  # fmt: skip
        messages = [{"role": "user", "content": "Run the tests, please."},  # history rewritten
                    {"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "Again."}]  # fmt: skip
        second = client.chat.completions.create(model="policy", max_tokens=4, messages=messages)
        seen.update(first=first, second=second, messages=messages)
        return 1.0

    before = loop.stats["prefix_mismatch"]
    [trajectory] = loop.rollout((model["params"], VERSION), [prompt_running(rewrite)], jax.random.key(1))
    info = trajectory.info
    assert (info["segments"], info["prefix_mismatches"], info["num_turns"]) == (2, 1, 1)
    assert loop.stats["prefix_mismatch"] == before + 1
    first_ids = seen["first"].model_extra["sao"]["completion_token_ids"]
    assert info["dropped_action_tokens"] == len(first_ids)
    # The trajectory is the second segment alone: the second request's rendering, then its completion.
    [(start, end)] = action_spans(trajectory)
    expected = ref.apply_chat_template(seen["messages"], add_generation_prompt=True, tokenize=True, return_dict=False)
    assert trajectory.tokens[:start].tolist() == list(expected)
    assert trajectory.tokens[start:end].tolist() == seen["second"].model_extra["sao"]["completion_token_ids"]
    assert seen["second"].model_extra["sao"]["segment"] == 1


def test_each_request_samples_with_the_weights_published_when_it_was_admitted(model, loop):
    def two_requests(prompt, base_url, episode_id):
        client = client_for(base_url, episode_id)
        messages = [{"role": "user", "content": prompt.text}]
        for _ in range(2):
            response = client.chat.completions.create(model="policy", max_tokens=3, messages=messages)
            messages.append(response.choices[0].message.model_dump(exclude_none=True))
            messages.append({"role": "user", "content": "More."})
        return 0.0

    published = iter(range(10, 20))  # a new version each time the weights are read
    [trajectory] = loop.rollout(lambda: (model["params"], next(published)), [prompt_running(two_requests)],
                                jax.random.key(6))  # fmt: skip
    assert [set(trajectory.policy_version[a:b]) for a, b in action_spans(trajectory)] == [{10}, {11}]
    assert trajectory.oldest_version == 10


def test_failing_scaffolds_cost_one_trajectory_each_and_the_rollout_goes_on(model):
    release = threading.Event()

    def one_request(prompt, base_url, episode_id):
        client_for(base_url, episode_id).chat.completions.create(
            model="policy", max_tokens=4, messages=[{"role": "user", "content": prompt.text}])
        return 1.0

    def hangs(prompt, base_url, episode_id):
        one_request(prompt, base_url, episode_id)
        release.wait(timeout=60)  # bounded: the test releases it at the end
        return 1.0

    def raises(prompt, base_url, episode_id):
        one_request(prompt, base_url, episode_id)
        raise RuntimeError("the scaffold broke")

    def spends_its_budget(prompt, base_url, episode_id):
        client = client_for(base_url, episode_id)
        for _ in range(5):  # 8 tokens a request, a budget of 12: the second is cut, the third refused
            try:
                client.chat.completions.create(model="policy", max_tokens=8,
                                               messages=[{"role": "user", "content": prompt.text}])  # fmt: skip
            except openai.BadRequestError as error:
                assert error.code == "token_budget_exceeded"
                return 1.0
        return 1.0

    def no_reward(prompt, base_url, episode_id):
        one_request(prompt, base_url, episode_id)
        return "passed"

    runs = {"ok": one_request, "timeout": hangs, "exception": raises, "token_budget": spends_its_budget,
            "invalid_result": no_reward}  # fmt: skip
    failing = loop_for(model, deadline_s=3.0, max_episode_tokens=12)
    try:
        started = time.monotonic()
        prompts = [prompt_running(run, i) for i, run in enumerate(runs.values())]
        trajectories = failing.rollout((model["params"], VERSION), prompts, jax.random.key(2))
        assert time.monotonic() - started < 60
        kinds = [t.info["error_kind"] for t in trajectories]
        assert kinds == [None, "timeout", "exception", "token_budget", "invalid_result"]
        assert trajectories[0].outcome_reward == 1.0 and trajectories[0].info["done"]
        assert all(t.outcome_reward == 0.0 for t in trajectories[1:])
        stats = failing.stats
        assert stats["trajectories"] == 5
        assert [stats[f"scaffold_{kind}"] for kind in list(runs)[1:]] == [1, 1, 1, 1]
        # The async engine's rollout function: a failed episode raises, so the engine counts it failed.
        with pytest.raises(Exception, match="the scaffold broke"):
            failing(prompt_running(raises), (model["params"], VERSION), jax.random.key(3))
    finally:
        release.set()
        failing.close()


@pytest.mark.slow
def test_a_command_scaffold_gets_the_server_in_its_environment_and_is_killed_at_its_deadline(model):
    started = time.monotonic()
    talk = ("import os, openai; c = openai.OpenAI(max_retries=0); c.chat.completions.create(model='p', max_tokens=2, "
            "messages=[{'role': 'user', 'content': os.environ['SAO_PROMPT']}]); print('log line'); print(0.25)")
    hang = "import time; time.sleep(60)"
    for code, deadline_s, expected in ((talk, 120.0, (None, 0.25)), (hang, 2.0, ("timeout", 0.0))):
        loop = loop_for(model, episode_fn=None, command=(sys.executable, "-c", code), deadline_s=deadline_s)
        try:
            [trajectory] = loop.rollout((model["params"], VERSION), [prompt_running(None)], jax.random.key(4))
        finally:
            loop.close()
        assert (trajectory.info["error_kind"], trajectory.outcome_reward) == expected
    assert time.monotonic() - started < 130


@pytest.mark.slow
def test_smolagents_tool_calling_agent_runs_a_multi_turn_episode_with_exact_masks(model, loop):
    """The real scaffold on the toy repository task: its (noise) actions fail to parse as tool calls, it
    appends the error and asks again, so every step extends the episode: one segment, one action a step."""
    ref, tok = model["ref"], model["tok"]
    agents = {}

    def smolagents_run(prompt, base_url, episode_id):
        agent, files = toy_repo.smolagents_agent(prompt, base_url, episode_id, max_steps=3, max_tokens=6)
        agents[episode_id] = agent
        agent.run(prompt.text)
        return toy_repo.reward(files, prompt.metadata["files"])

    [task] = toy_repo.generate_prompts(np.random.default_rng(0), 1)
    task = Prompt(task.id, task.text, task.answer, task.difficulty, {**task.metadata, "run": smolagents_run})
    [trajectory] = loop.rollout((model["params"], VERSION), [task], jax.random.key(5))
    info = trajectory.info
    assert info["error"] is None and info["env_info"]["reward"] == 0.0
    agent = agents[info["episode_id"]]
    steps = [s for s in agent.memory.steps if getattr(s, "model_output_message", None) is not None]
    assert len(steps) == 3 and (info["requests"], info["segments"], info["num_turns"]) == (3, 1, 3)
    # Each action is the completion the agent received (through the openai client), token for token.
    sampled = [s.model_output_message.raw.model_extra["sao"]["completion_token_ids"] for s in steps]
    assert [trajectory.tokens[a:b].tolist() for a, b in action_spans(trajectory)] == sampled
    # And the whole trajectory is transformers' rendering of the conversation the agent sent last, with
    # the policy's own text in the assistant turns.
    last_request = steps[-1].model_input_messages
    messages = agent.model._prepare_completion_kwargs(last_request, tools_to_call_from=agent.tools_and_managed_agents)
    conversation = [{"role": m["role"], "content": "\n".join(p["text"] for p in m["content"])}
                    for m in messages["messages"]]  # fmt: skip
    assistant = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    for i, ids in zip(assistant, sampled):
        conversation[i]["content"] = tok.decode(ids[:-1] if ids[-1] == tok.added_tokens[IM_END] else ids)
    rendered = ref.apply_chat_template(conversation, tools=messages["tools"], add_generation_prompt=True,
                                       tokenize=False)  # fmt: skip
    last = action_spans(trajectory)[-1]
    assert tok.decode(trajectory.tokens[: last[0]]) == rendered


def test_requests_the_server_does_not_serve_get_openai_errors(model):
    engine = GenerationEngine(model["sampler"], model["tok"].decode, num_slots=1, max_total_tokens=2048)
    with ChatServer(engine, model["tok"], model["chat_format"], max_action_tokens=4) as server:
        server.open_episode("ep-x", key=jax.random.key(0), weights=lambda: (model["params"], 0), token_budget=8)
        client = client_for(server.base_url, "ep-x")
        user = [{"role": "user", "content": "hi"}]
        refused = [dict(stream=True), dict(n=2), dict(logit_bias={"5": 1.0}), dict(top_logprobs=21),
                   dict(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])]
        for extra in refused:
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model="policy", **({"messages": user} | extra))
        with pytest.raises(openai.AuthenticationError):
            client_for(server.base_url, "ep-unknown").chat.completions.create(model="policy", messages=user)
        # An assistant tool call in the history is rendered by the template, as transformers renders it.
        history = user + [{"role": "assistant", "content": "",
                           "tool_calls": [{"id": "call_1", "type": "function",
                                           "function": {"name": "run_tests", "arguments": "{}"}}]},
                          {"role": "tool", "tool_call_id": "call_1", "content": "1 failed"}]  # fmt: skip
        response = client.chat.completions.create(model="policy", messages=history, tools=TOOLS, max_tokens=2)
        reference = [{**m, "tool_calls": [{"type": "function", "function": {"name": "run_tests", "arguments": {}}}]}
                     if m["role"] == "assistant" else m for m in history]  # fmt: skip
        expected = model["ref"].apply_chat_template(reference, tools=TOOLS, add_generation_prompt=True, tokenize=True,
                                                    return_dict=False)  # fmt: skip
        assert response.model_extra["sao"]["prompt_token_ids"] == list(expected)
        server.close_episode("ep-x")
        with pytest.raises(openai.AuthenticationError):  # a closed episode is no longer served
            client.chat.completions.create(model="policy", messages=user)
    engine.close()


def test_the_server_listens_on_loopback_addresses_only(model):
    assert [check_loopback(h) for h in ("127.0.0.1", "127.0.0.2", "::1", "localhost")] == \
        ["127.0.0.1", "127.0.0.2", "::1", "127.0.0.1"]  # fmt: skip
    for host in ("0.0.0.0", "::", "192.168.1.5", "10.0.0.1", "example.com", ""):
        with pytest.raises(ValueError, match="loopback"):
            ChatServer(None, model["tok"], model["chat_format"], max_action_tokens=4, host=host)


def test_hermes_tool_calls_are_parsed_and_other_text_kept():
    text = ('Let me check. <tool_call>{"name": "run_tests", "arguments": {"k": 1}}</tool_call>'
            "<tool_call>not json</tool_call>")
    content, calls = parse_tool_calls(text)
    assert content == "Let me check. <tool_call>not json</tool_call>"
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [("run_tests", '{"k": 1}')]
    assert parse_tool_calls("no calls here ") == ("no calls here ", [])
