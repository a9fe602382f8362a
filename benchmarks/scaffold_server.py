"""Requests/s and generated tokens/s through the chat server (an `openai` client per episode, HTTP on
loopback) against the in-process agent loop, on the same tiny chat model, prompts and sampler settings.

Both run `EPISODES` one-turn episodes (the user turn rendered by the chat template, one completion of
at most `MAX_TOKENS` tokens) with `SLOTS` sampler rows, once to compile and once timed. The CPU is
shared with whatever else runs, so the ratio is indicative.

    python benchmarks/scaffold_server.py [--episodes 32] [--slots 8]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import openai  # noqa: E402
from flax import nnx  # noqa: E402

from sao_jax import models  # noqa: E402
from sao_jax.data.chat import ChatFormat, HFTokenizer  # noqa: E402
from sao_jax.envs.base import Prompt, StepResult  # noqa: E402
from sao_jax.rollout.agent_loop import AgentLoop, AgentLoopConfig  # noqa: E402
from sao_jax.rollout.sampler import Sampler  # noqa: E402
from sao_jax.rollout.scaffold import ScaffoldLoop, ScaffoldSettings  # noqa: E402
from scripts.tiny_chat_model import write_tiny_chat_model  # noqa: E402

MAX_TOKENS = 32
QUESTION = "The tests of `add` in test_calc.py fail. Fix the bug in calc.py so that every test passes."


class OneTurnChat:
    """The agent loop's side of the same episode: the rendered user turn, one action, done."""

    max_turns = 1

    def __init__(self, chat_format):
        self.chat_format, self.stop_strings = chat_format, chat_format.stop_strings

    def reset(self, prompt):
        return self.chat_format.render([{"role": "user", "content": prompt.text}], add_generation_prompt=True)

    def step(self, action_text):
        return StepResult("", 0.0, True, {})


CLIENTS: dict[str, openai.OpenAI] = {}  # one client per server; each episode takes a copy with its own key


def one_request(prompt, base_url, episode_id):
    if base_url not in CLIENTS:  # building an OpenAI client takes ~0.5 s: not what is measured here
        CLIENTS[base_url] = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    CLIENTS[base_url].with_options(api_key=episode_id).chat.completions.create(
        model="policy", max_tokens=MAX_TOKENS, messages=[{"role": "user", "content": prompt.text}])
    return 0.0


def timed(rollout) -> tuple[float, int]:
    rollout()  # compile
    started = time.perf_counter()
    trajectories = rollout()
    return time.perf_counter() - started, int(sum(t.action_mask.sum() for t in trajectories))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=32)
    parser.add_argument("--slots", type=int, default=8)
    args = parser.parse_args()
    folder = write_tiny_chat_model(tempfile.mkdtemp())
    tok = HFTokenizer.from_folder(folder)
    chat_format = ChatFormat.from_tokenizer(tok)
    policy = models.from_pretrained(str(folder))
    weights = (nnx.state(policy), 0)
    sampler = Sampler(policy, chunk_size=16)
    config = AgentLoopConfig(num_slots=args.slots, max_total_tokens=512, max_action_tokens=MAX_TOKENS, add_bos=False)
    prompts = [Prompt(id=i, text=QUESTION, answer="", difficulty=1) for i in range(args.episodes)]
    key = jax.random.key(0)

    agent_loop = AgentLoop(sampler, tok, lambda p: OneTurnChat(chat_format), config)
    scaffold = ScaffoldLoop(sampler, tok, chat_format, config,
                            ScaffoldSettings(episode_fn=one_request, deadline_s=600, episodes_at_once=args.slots))
    rows = [("agent loop (in process)", timed(lambda: agent_loop.rollout(weights, prompts, key))),
            ("chat server (openai client, HTTP)", timed(lambda: scaffold.rollout(weights, prompts, key)))]
    scaffold.close()
    print(f"{args.episodes} one-turn episodes, {args.slots} slots, at most {MAX_TOKENS} tokens each, "
          f"{jax.devices()[0].platform}")
    print(f"{'':36s} {'wall s':>8s} {'requests/s':>11s} {'tokens/s':>9s}")
    for name, (wall_s, tokens) in rows:
        print(f"{name:36s} {wall_s:8.2f} {args.episodes / wall_s:11.2f} {tokens / wall_s:9.1f}")
    ratio = rows[1][1][1] / rows[1][1][0] / (rows[0][1][1] / rows[0][1][0])
    print(f"server / agent loop tokens/s: {ratio:.2f}")


if __name__ == "__main__":
    main()
