"""The agent loop builds trajectories whose per-token layout matches the turn structure the
environment produced (checked by replaying every action through a fresh environment), whose rollout
log-probs are the policy's (checked by one teacher-forced forward per trajectory), and in which a
misbehaving environment ends only its own trajectory.

Two drivers: the real sampler on a tiny random policy, and `ScriptedSampler`, a numpy stand-in that
types out the environment's demonstration (so the reward-1 path is exercised without a trained model).
"""

import threading
import time

import jax
import numpy as np
import pytest
from flax import nnx

from sao_jax.data.tokenizers import CharTokenizer
from sao_jax.envs import ENVIRONMENTS, StepResult, make_env
from sao_jax.envs.calculator import CalculatorEnv
from sao_jax.models import Policy, tiny_qwen3_moe
from sao_jax.rollout.agent_loop import AgentLoop, AgentLoopConfig, EnvFailure, RolloutService
from sao_jax.rollout.sampler import DecodeChunk, Sampler

TOKENIZER = CharTokenizer()
NEWLINE = int(TOKENIZER.encode("\n")[0])


def calculator_prompts(n, seed=0):
    return ENVIRONMENTS["calculator"].generate_prompts(np.random.default_rng(seed), n)


def fake_logprob(tokens):
    """What ScriptedSampler records for a token, so the test can tell which token a value belongs to."""
    return -np.asarray(tokens, np.float32) / 1000


def fake_entropy(tokens):
    return np.asarray(tokens, np.float32) / 100


class ScriptedSampler:
    """Sampler stand-in: a row whose prompt text is in `scripts` types out that script's actions, one
    per action, `chunk_size` characters per decode chunk, honouring the per-row budget."""

    chunk_size = 3

    def __init__(self, scripts: dict[str, list[str]]):
        self.scripts = scripts

    def init_state(self, batch_size, max_len):
        return dict(text=[""] * batch_size, action=[0] * batch_size, typed=[0] * batch_size)

    def prefill(self, params, state, tokens, mask, reset):
        for b in range(len(tokens)):
            if reset[b]:
                state["text"][b], state["action"][b], state["typed"][b] = "", 0, 0
            state["text"][b] += TOKENIZER.decode(tokens[b][mask[b]])
        return state

    def window_for(self, state, longest):
        return longest

    def decode_chunk(self, params, state, key, max_new_tokens, stop_ids, window=None):
        batch, width = len(max_new_tokens), self.chunk_size
        tokens = np.zeros((batch, width), np.int32)
        num, finished = np.zeros(batch, np.int32), np.zeros(batch, bool)
        for b in range(batch):
            if max_new_tokens[b] == 0:
                continue
            prompt_text = state["text"][b].split("\n")[0] + "\n"
            action = self.scripts[prompt_text][state["action"][b]]
            rest = action[state["typed"][b] :]
            n = min(width, len(rest), int(max_new_tokens[b]))
            tokens[b, :n], num[b] = TOKENIZER.encode(rest[:n]), n
            state["typed"][b] += n
            state["text"][b] += rest[:n]
            if n == len(rest) or n == max_new_tokens[b]:
                finished[b] = True
                state["action"][b], state["typed"][b] = state["action"][b] + 1, 0
        chunk = DecodeChunk(tokens=tokens, logprobs=fake_logprob(tokens), entropy=fake_entropy(tokens),
                            num_tokens=num, finished=finished)  # fmt: skip
        return state, chunk


def demonstration_scripts(prompts):
    return {p.text: CalculatorEnv.demonstration(p) for p in prompts}


def spans(trajectory):
    """[(turn, is_action, tokens)] runs of equal (turn_index, action_mask)."""
    out = []
    for t in range(trajectory.num_tokens):
        key = (int(trajectory.turn_index[t]), bool(trajectory.action_mask[t]))
        if not out or out[-1][:2] != key:
            out.append((*key, []))
        out[-1][2].append(int(trajectory.tokens[t]))
    return out


def check_layout_by_replay(trajectory, prompt, env):
    """Replay every action through `env` (fresh) and check the tokens, masks, turns and rewards."""
    runs = spans(trajectory)
    turn, is_action, tokens = runs[0]
    assert (turn, is_action) == (-1, False)
    assert tokens == [TOKENIZER.bos_id, *TOKENIZER.encode(env.reset(prompt))]
    expected_rewards = np.zeros(trajectory.num_tokens, np.float32)
    position, k, result = len(tokens), 0, None
    for turn, is_action, tokens in runs[1:]:
        if is_action:
            assert turn == k, f"action span {k} has turn_index {turn}"
            result = env.step(TOKENIZER.decode(tokens))
            position += len(tokens)
            expected_rewards[position - 1] = result.reward
        else:
            assert turn == k and not result.done
            assert tokens == list(TOKENIZER.encode(result.observation)), f"observation of turn {k}"
            position += len(tokens)
            k += 1
    assert runs[-1][1], "a trajectory ends with an action"
    np.testing.assert_array_equal(trajectory.rewards, expected_rewards)
    assert trajectory.info["num_turns"] == k + 1
    assert trajectory.info["done"] == result.done
    assert trajectory.info["final_action"] == TOKENIZER.decode(runs[-1][2])
    return result


# --- scripted policy ------------------------------------------------------------------------------------


def test_demonstration_earns_reward_one_with_the_right_layout():
    prompts = calculator_prompts(5)
    loop = AgentLoop(ScriptedSampler(demonstration_scripts(prompts)), TOKENIZER, lambda p: make_env("calculator"),
                     AgentLoopConfig(num_slots=2, max_total_tokens=128, max_action_tokens=40))  # fmt: skip
    streamed = []
    trajectories = loop.rollout((None, 3), prompts, jax.random.key(0), on_trajectory=streamed.append)
    assert [t.prompt_id for t in trajectories] == [p.id for p in prompts]
    assert sorted(id(t) for t in streamed) == sorted(id(t) for t in trajectories)
    for prompt, trajectory in zip(prompts, trajectories):
        expression, answer = prompt.metadata["expression"], prompt.answer
        expected_text = [(-1, False, prompt.text), (0, True, f"<calc>{expression}</calc>\n"),
                         (0, False, f"<out>{answer}</out>\n"), (1, True, f"A: {answer}\n")]  # fmt: skip
        runs = spans(trajectory)
        assert [(turn, act, TOKENIZER.decode(tokens)) for turn, act, tokens in runs] == expected_text
        assert runs[0][2][0] == TOKENIZER.bos_id
        assert trajectory.outcome_reward == 1.0 and trajectory.rewards[-1] == 1.0
        action = trajectory.action_mask
        np.testing.assert_array_equal(trajectory.rollout_logprobs, np.where(action, fake_logprob(trajectory.tokens), 0))
        np.testing.assert_array_equal(trajectory.rollout_entropy, np.where(action, fake_entropy(trajectory.tokens), 0))
        np.testing.assert_array_equal(trajectory.policy_version, np.where(action, 3, -1))
        assert trajectory.info["num_turns"] == 2 and trajectory.info["done"] and trajectory.info["error"] is None
        assert trajectory.info["env_info"]["correct"] and trajectory.info["final_action"] == f"A: {answer}\n"
        check_layout_by_replay(trajectory, prompt, make_env("calculator"))
    assert loop.stats["trajectories"] == 5 and loop.stats["unterminated_actions"] == 0


def test_versions_are_read_per_decode_chunk():
    """A weights callable whose version goes up at every call: each action token records the version
    of the chunk that sampled it (ScriptedSampler types 3 characters per chunk)."""
    prompts = calculator_prompts(1)
    versions = iter(range(100))
    loop = AgentLoop(ScriptedSampler(demonstration_scripts(prompts)), TOKENIZER, lambda p: make_env("calculator"),
                     AgentLoopConfig(num_slots=1, max_total_tokens=128, max_action_tokens=40))  # fmt: skip
    (trajectory,) = loop.rollout(lambda: (None, next(versions)), prompts, jax.random.key(0))
    recorded = trajectory.policy_version[trajectory.action_mask]
    assert np.all(np.diff(recorded) >= 0) and len(set(recorded)) >= 4
    for v in set(recorded):  # one version per chunk: at most 3 tokens each
        assert 1 <= np.sum(recorded == v) <= ScriptedSampler.chunk_size


def test_budgets_truncate_actions_turns_and_total_tokens():
    prompts = calculator_prompts(3, seed=1)
    wrong_and_long = {p.text: ["<calc>1+1</calc>\n"] * 10 for p in prompts}
    env = lambda p: make_env("calculator", max_turns=10)  # noqa: E731
    loop = AgentLoop(ScriptedSampler(wrong_and_long), TOKENIZER, env,
                     AgentLoopConfig(num_slots=2, max_total_tokens=400, max_action_tokens=40, max_turns=3))  # fmt: skip
    for trajectory in loop.rollout((None, 0), prompts, jax.random.key(0)):
        assert trajectory.info["truncated"] == "max_turns" and trajectory.info["num_turns"] == 3
        assert not trajectory.info["done"] and trajectory.action_mask[-1]

    loop = AgentLoop(ScriptedSampler(wrong_and_long), TOKENIZER, env,
                     AgentLoopConfig(num_slots=2, max_total_tokens=60, max_action_tokens=5))  # fmt: skip
    for prompt, trajectory in zip(prompts, loop.rollout((None, 0), prompts, jax.random.key(0))):
        assert trajectory.info["truncated"] == "max_total_tokens" and trajectory.num_tokens <= 60
        assert trajectory.info["unterminated_actions"] == trajectory.info["num_turns"]  # every action cut at 5
        assert all(len(tokens) == 5 for _, act, tokens in spans(trajectory) if act)
        check_layout_by_replay(trajectory, prompt, make_env("calculator", max_turns=10))


def test_an_observation_that_exactly_fills_the_cache_truncates_before_it():
    """max_total_tokens = bos + prompt + first action + first observation: the observation would fit but
    leave no slot for an action, so the trajectory ends after the first action. One token more, and the
    observation goes in followed by a one-token action (then the next observation does not fit)."""
    (prompt,) = calculator_prompts(1, seed=6)
    action, answer = CalculatorEnv.demonstration(prompt)
    observation = f"<out>{prompt.answer}</out>\n"
    filled = 1 + len(prompt.text) + len(action) + len(observation)  # one token per character, plus bos
    scripts = demonstration_scripts([prompt])
    for max_total_tokens in (filled, filled + 1):
        loop = AgentLoop(ScriptedSampler(scripts), TOKENIZER, lambda p: make_env("calculator"),
                         AgentLoopConfig(num_slots=1, max_total_tokens=max_total_tokens, max_action_tokens=40))
        (trajectory,) = loop.rollout((None, 0), [prompt], jax.random.key(0))
        assert trajectory.info["truncated"] == "max_total_tokens" and trajectory.info["error"] is None
        assert loop.stats["truncated_max_total_tokens"] == 1
        texts = [(turn, act, TOKENIZER.decode(tokens)) for turn, act, tokens in spans(trajectory)]
        if max_total_tokens == filled:
            assert texts == [(-1, False, prompt.text), (0, True, action)]
            assert trajectory.info["num_turns"] == 1
        else:
            assert texts == [(-1, False, prompt.text), (0, True, action), (0, False, observation), (1, True, answer[0])]
            assert trajectory.num_tokens == filled + 1 and trajectory.info["num_turns"] == 2


def test_a_prompt_that_fills_the_cache_is_rejected_and_one_token_more_leaves_room_for_one_action_token():
    (prompt,) = calculator_prompts(1, seed=7)
    prompt_tokens = 1 + len(prompt.text)  # bos + one token per character
    scripts = demonstration_scripts([prompt])
    loop = AgentLoop(ScriptedSampler(scripts), TOKENIZER, lambda p: make_env("calculator"),
                     AgentLoopConfig(num_slots=1, max_total_tokens=prompt_tokens, max_action_tokens=40))
    (trajectory,) = loop.rollout((None, 0), [prompt], jax.random.key(0))
    assert trajectory.info["error_kind"] == "prompt_too_long" and trajectory.num_tokens == 0
    assert f"prompt of {prompt_tokens} tokens" in trajectory.info["error"]
    assert loop.stats["prompt_too_long"] == 1 and loop.stats["decode_chunks"] == 0

    loop = AgentLoop(ScriptedSampler(scripts), TOKENIZER, lambda p: make_env("calculator"),
                     AgentLoopConfig(num_slots=1, max_total_tokens=prompt_tokens + 1, max_action_tokens=40))
    (trajectory,) = loop.rollout((None, 0), [prompt], jax.random.key(0))
    assert trajectory.info["error"] is None and loop.stats["prompt_too_long"] == 0
    assert trajectory.num_tokens == prompt_tokens + 1 and trajectory.action_mask.sum() == 1
    assert trajectory.info["final_action"] == "<" and trajectory.info["unterminated_actions"] == 1
    assert trajectory.info["truncated"] == "max_total_tokens"


# --- misbehaving environments -------------------------------------------------------------------------------


class FaultyEnv(CalculatorEnv):
    """The calculator, except that its first step (or reset) misbehaves in the way `fault` names."""

    release = threading.Event()  # lets the hanging step finish once the test is over

    def __init__(self, fault):
        super().__init__()
        self.fault = fault

    def reset(self, prompt):
        if self.fault == "reset_raises":
            raise OSError("cannot start")
        text = super().reset(prompt)
        return 42 if self.fault == "reset_not_text" else text

    def step(self, action_text):
        result = super().step(action_text)
        if self.fault == "raises":
            raise RuntimeError("boom")
        if self.fault == "hangs":
            self.release.wait(timeout=30)
        if self.fault == "observation_not_text":
            return StepResult(b"bytes", result.reward, result.done, result.info)
        if self.fault == "reward_not_number":
            return StepResult(result.observation, "1", result.done, result.info)
        if self.fault == "observation_not_ascii":
            return StepResult("caf\u00e9\n", result.reward, result.done, result.info)
        if self.fault == "tuple":
            return (result.observation, result.reward, result.done, result.info)
        return result


FAULTS = {  # fault -> info["error_kind"]
    "raises": "exception", "hangs": "timeout", "observation_not_text": "invalid_result",
    "reward_not_number": "invalid_result", "observation_not_ascii": "invalid_result", "tuple": "invalid_result",
    "reset_raises": "exception", "reset_not_text": "invalid_result",
}  # fmt: skip


def test_a_misbehaving_environment_costs_only_its_own_trajectory():
    """Healthy and faulty environments interleaved over 3 slots: every faulty one ends with its error
    recorded and counted; every healthy one still earns reward 1 with the full layout."""
    faults = [None, *FAULTS, None, None]
    prompts = calculator_prompts(len(faults), seed=2)
    fault_of = {p.id: f for p, f in zip(prompts, faults)}
    config = AgentLoopConfig(num_slots=3, max_total_tokens=128, max_action_tokens=40, env_timeout_s=0.5)
    loop = AgentLoop(ScriptedSampler(demonstration_scripts(prompts)), TOKENIZER,
                     lambda p: FaultyEnv(fault_of[p.id]), config)  # fmt: skip
    start = time.monotonic()
    try:
        trajectories = loop.rollout((None, 0), prompts, jax.random.key(0))
    finally:
        FaultyEnv.release.set()
    assert time.monotonic() - start < 10
    assert [t.prompt_id for t in trajectories] == [p.id for p in prompts]
    for fault, prompt, trajectory in zip(faults, prompts, trajectories):
        if fault is None:
            assert trajectory.info["error"] is None and trajectory.outcome_reward == 1.0
            check_layout_by_replay(trajectory, prompt, make_env("calculator"))
            continue
        assert trajectory.info["error_kind"] == FAULTS[fault], (fault, trajectory.info)
        assert trajectory.outcome_reward == 0.0
        if fault.startswith("reset"):
            assert trajectory.num_tokens == 0 and "env.reset" in trajectory.info["error"]
        else:  # the failing step's action is kept; nothing after it
            assert trajectory.action_mask[-1] and trajectory.info["final_action"].startswith("<calc>")
            assert trajectory.info["num_turns"] == 0
    assert loop.stats["env_exception"] == 2 and loop.stats["env_timeout"] == 1
    assert loop.stats["env_invalid_result"] == 5 and loop.stats["trajectories"] == len(faults)


# --- the engine's entry point ------------------------------------------------------------------------------


class FixedWeights:
    """Stands in for the engine's WeightStore."""

    def latest(self):
        return None, 5


def call_concurrently(service, prompts, weights):
    """service(prompt, weights, key) from one thread per prompt; returns each call's result or error."""
    results = [None] * len(prompts)

    def call(i):
        try:
            results[i] = service(prompts[i], weights, jax.random.key(i))
        except Exception as error:  # noqa: BLE001 — the test inspects it
            results[i] = error

    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return results


def test_service_batches_concurrent_callers_and_fails_only_the_faulty_one():
    """Six engine workers call the service at once. Each environment's reset waits until three are in
    flight together (a barrier that breaks after 10 s), so the test passes only if three callers'
    trajectories share the loop's three slots. The caller whose environment raises gets EnvFailure."""
    prompts = calculator_prompts(6, seed=4)
    together = threading.Barrier(3)
    raising = prompts[4].id

    def env_factory(prompt):
        together.wait(timeout=10)
        return FaultyEnv("raises" if prompt.id == raising else None)

    loop = AgentLoop(ScriptedSampler(demonstration_scripts(prompts)), TOKENIZER, env_factory,
                     AgentLoopConfig(num_slots=3, max_total_tokens=128, max_action_tokens=40))  # fmt: skip
    service = RolloutService(loop)
    results = call_concurrently(service, prompts, FixedWeights())
    service.close()
    for prompt, result in zip(prompts, results):
        if prompt.id == raising:
            assert isinstance(result, EnvFailure) and result.kind == "exception" and "boom" in str(result)
            continue
        assert not isinstance(result, Exception), result
        assert result.prompt_id == prompt.id and result.outcome_reward == 1.0
        np.testing.assert_array_equal(result.policy_version, np.where(result.action_mask, 5, -1))
        check_layout_by_replay(result, prompt, make_env("calculator"))
    assert loop.stats["trajectories"] == 6 and loop.stats["env_exception"] == 1


def test_service_failure_reaches_every_caller():
    class BrokenSampler(ScriptedSampler):
        def decode_chunk(self, *args, **kwargs):
            raise MemoryError("device out of memory")

    prompts = calculator_prompts(3, seed=5)
    service = RolloutService(AgentLoop(BrokenSampler({}), TOKENIZER, lambda p: make_env("calculator"),
                                       AgentLoopConfig(num_slots=2)))  # fmt: skip
    for result in call_concurrently(service, prompts, FixedWeights()):
        assert isinstance(result, RuntimeError) and isinstance(result.__cause__, MemoryError)
    with pytest.raises(RuntimeError, match="has failed"):
        service(prompts[0], FixedWeights(), jax.random.key(0))


# --- the real sampler on a tiny random policy ---------------------------------------------------------------


@pytest.mark.slow
def test_random_policy_trajectories_replay_and_match_teacher_forcing():
    """5 calculator episodes over 3 slots (rows reused), a random policy, one environment that raises on
    its first step. Layout checked by replay; rollout log-probs and entropies on every action token
    equal the log-softmax of one uncached forward over the whole trajectory."""
    policy = Policy(tiny_qwen3_moe(vocab_size=TOKENIZER.vocab_size, initializer_range=0.3), rngs=nnx.Rngs(1))
    params = nnx.state(policy)
    prompts = calculator_prompts(5, seed=3)
    raising = prompts[1].id
    loop = AgentLoop(Sampler(policy, chunk_size=4), TOKENIZER,
                     lambda p: FaultyEnv("raises" if p.id == raising else None),
                     AgentLoopConfig(num_slots=3, max_total_tokens=80, max_action_tokens=10))  # fmt: skip
    trajectories = loop.rollout((params, 7), prompts, jax.random.key(0))
    assert trajectories[1].info["error_kind"] == "exception" and loop.stats["env_exception"] == 1

    width = 80
    ids = np.zeros((len(prompts), width), np.int32)
    mask = np.zeros((len(prompts), width), bool)
    for b, trajectory in enumerate(trajectories):
        ids[b, : trajectory.num_tokens], mask[b, : trajectory.num_tokens] = trajectory.tokens, True
    logits = np.asarray(jax.jit(lambda i, m: policy(i, attention_mask=m))(ids, mask), np.float64)
    log_softmax = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1, keepdims=True)) \
        - logits.max(-1, keepdims=True)  # fmt: skip

    num_turns = 0
    for b, (prompt, trajectory) in enumerate(zip(prompts, trajectories)):
        action = trajectory.action_mask
        positions = np.flatnonzero(action)
        assert positions.size and positions[0] > 0
        teacher = log_softmax[b, positions - 1]  # token t is predicted at t - 1
        sampled = teacher[np.arange(len(positions)), trajectory.tokens[positions]]
        np.testing.assert_allclose(trajectory.rollout_logprobs[positions], sampled, atol=1e-5)
        np.testing.assert_allclose(trajectory.rollout_entropy[positions],
                                   -np.sum(np.exp(teacher) * teacher, axis=-1), atol=1e-5)  # fmt: skip
        assert np.all(trajectory.rollout_logprobs[~action] == 0) and np.all(trajectory.rollout_entropy[~action] == 0)
        np.testing.assert_array_equal(trajectory.policy_version, np.where(action, 7, -1))
        for _, is_action, tokens in spans(trajectory):  # an action ends at its first stop token, or is cut
            if is_action:
                stops = [i for i, token in enumerate(tokens) if token in (NEWLINE, TOKENIZER.eos_id)]
                assert stops in ([], [len(tokens) - 1]), tokens
                assert stops or len(tokens) == 10 or trajectory.num_tokens == 80
        if b != 1:
            check_layout_by_replay(trajectory, prompt, make_env("calculator"))
            num_turns += trajectory.info["num_turns"]
    assert num_turns > len(prompts), "degenerate test: expected multi-turn episodes"
