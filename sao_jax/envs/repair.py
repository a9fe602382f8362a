"""The chained calculator with a test and one repair: the environment's feedback decides the value.

Prompt, tools and answer grammar are the chain's (`sao_jax/envs/chain.py`): "Q: a=17*3; b=a+4; b=?\\n",
one "<calc>EXPR</calc>" or "<est>EXPR</est>" call per link (one operation each), "A: INTEGER" to answer.
What changes is the answer, which is tested:
  right answer, first attempt   -> done, reward 1
  wrong answer, first attempt   -> the observation "<test>fail</test>\\n", reward 0, the episode goes on:
                                   the policy may redo the chain and answer again
  right answer, second attempt  -> done, reward `repair_reward` (constructor option, default 0.5)
  wrong answer, second attempt  -> done, reward 0
So there are two decisions worth learning, getting it right first time and repairing after a failed
test, and the second one pays less. The episode also ends (reward 0) after the prompt's turn budget,
(n calls + 1 answer) × 2 attempts + `spare_turns` (constructor `max_turns` overrides it).

The failed test is the only place the environment says the first answer was wrong: a critic that
reads the "<test>fail</test>" observation can move its value from "right first time" (about 1) to "a
repair" (at most `repair_reward`) there, which is where skip- and cross-observation GAE differ
(docs/algorithms.md §2, open question (a)).

Gold demonstration: the chain's, right first time. Weak demonstration: the chain's coin-flipping
demonstrator (an estimate at each link with probability 1/2, `metadata["weak_tools"]`); when its
answer is wrong (an estimate anywhere, since no link's value is round) it goes on with the repair,
the gold actions after the failed test, and earns `repair_reward`; with the exact tool at every link it
is the gold demonstration and earns 1. With `demonstrate_repair=False` the weak demonstration stops at
its wrong answer: no "<test>" text is then ever in the SFT data, and the first failed test a policy
(and its critic) reads comes in RL.

Demonstrations are class methods, so that the trainer can call them on the class; called on an
environment instance, `weak_demonstration` follows that instance's `demonstrate_repair` (the trainer
builds the instance from `env.options`).
"""

from __future__ import annotations

import dataclasses
import functools

from sao_jax.envs.base import STOP, Prompt, StepResult
from sao_jax.envs.chain import ChainEnv

ATTEMPTS = 2
FAIL = f"<test>fail</test>{STOP}"


class RepairEnv(ChainEnv):
    """The chain with a tested answer and one repair (rules in the module docstring).

    `StepResult.info` is the chain's: `turn`, and as they apply `error`, `tool`, `tool_output`, `answer`,
    `correct`, `tools` (on an answer: every tag called so far in the episode, both attempts), and
    `out_of_turns`; on every step also `failed_test` (an answer of this episode so far was wrong) and
    `repaired` (right on the second attempt), and on every answer `attempt` (1 or 2). The last step's
    info thus says, for every episode, whether it failed a test and whether it repaired.
    """

    attempts = ATTEMPTS  # answers an episode may give (the trainer logs repair shares when > 1)

    def __init__(self, *, max_turns: int | None = None, repair_reward: float = 0.5,
                 demonstrate_repair: bool = True) -> None:
        """`max_turns` None: each prompt's own budget (`metadata["max_turns"]`); `repair_reward`: the
        reward of a right second answer, in [0, 1); `demonstrate_repair`: whether this instance's weak
        demonstration goes on with the repair after its wrong answer."""
        super().__init__(max_turns=max_turns)
        if not 0.0 <= repair_reward < 1.0:
            raise ValueError(f"RepairEnv: repair_reward must be in [0, 1) (got {repair_reward}); 1 is right first "
                             "time, and held-out success counts rewards >= 1")
        self.repair_reward = float(repair_reward)
        self.demonstrate_repair = bool(demonstrate_repair)
        self.weak_demonstration = functools.partial(type(self).weak_demonstration, repair=self.demonstrate_repair)
        self._answers = 0

    @staticmethod
    def turn_budget(links: int, spare_turns: int) -> int:
        """(n calls + 1 answer) per attempt, `ATTEMPTS` attempts, and the spare turns."""
        return (links + 1) * ATTEMPTS + spare_turns

    @classmethod
    def weak_demonstration(cls, prompt: Prompt, *, repair: bool = True) -> list[str]:
        """The chain's coin-flipping demonstrator, then, when its answer is wrong and `repair`, the gold
        actions again (the failed test comes between them). On an instance, `repair` is the
        instance's `demonstrate_repair`."""
        weak = super().weak_demonstration(prompt)
        gold = cls.demonstration(prompt)
        return weak + gold if repair and weak != gold else weak

    def _observe_prompt(self, prompt: Prompt) -> str:
        self._answers = 0
        return super()._observe_prompt(prompt)

    def _act(self, action: str) -> StepResult:
        result = super()._act(action)
        if "correct" not in result.info:  # a tool call or a malformed action: the chain's
            info = {**result.info, "failed_test": self._answers > 0, "repaired": False}
            return dataclasses.replace(result, info=info)
        self._answers += 1
        correct, repaired = result.info["correct"], result.info["correct"] and self._answers > 1
        info = {**result.info, "attempt": self._answers, "failed_test": not correct or self._answers > 1,
                "repaired": repaired}
        if correct:
            return StepResult("", self.repair_reward if repaired else 1.0, True, info)
        if self._answers < ATTEMPTS:
            return StepResult(FAIL, 0.0, False, info)
        return StepResult("", 0.0, True, info)
