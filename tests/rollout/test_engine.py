"""The rollout engine: weight store, streaming engine, group mode, shutdown.

The rollout function is a fake that reads the weight store before each "decode chunk", stamps the
version it read on that chunk's action tokens and draws its tokens from the key it is given. Waits
use events and counts; the only clock is a generous liveness bound in `wait_until`.
"""

import collections
import itertools
import logging
import queue
import threading
import time

import jax
import numpy as np
import pytest

from sao_jax.rollout.engine import (
    RolloutEngine,
    RolloutsFailing,
    WeightStore,
    rollout_key,
)
from sao_jax.rollout.trajectory import Trajectory

PROMPT_TOKENS = 2
LIVENESS_S = 20.0  # generous bound for "eventually"; never a performance assert


def wait_until(predicate, what):
    deadline = time.monotonic() + LIVENESS_S
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.001)


def key_tokens(key, n):
    """Tokens a rollout with this key draws (numpy, seeded from the key's bits)."""
    rng = np.random.default_rng(np.asarray(jax.random.key_data(key)))
    return rng.integers(0, 1000, n).astype(np.int32), rng.normal(size=n).astype(np.float32)


class FakeRollout:
    """rollout_fn stand-in: `num_chunks` chunks of `chunk_tokens` action tokens after a 2-token prompt.

    Before each chunk it reads `weights.latest()` and records that version on the chunk's tokens.
    Hooks: `between_chunks(prompt, chunk)` runs before chunks 1.., `gate(prompt)` runs first,
    `fail(prompt, key)` -> True makes the call raise, `bad(prompt)` -> True makes it return None.
    """

    def __init__(self, *, num_chunks=3, chunk_tokens=2, chunk_sleep_s=0.0, between_chunks=None, gate=None,
                 fail=None, bad=None):
        self.num_chunks, self.chunk_tokens, self.chunk_sleep_s = num_chunks, chunk_tokens, chunk_sleep_s
        self.between_chunks, self.gate, self.fail, self.bad = between_chunks, gate, fail, bad
        self.lock = threading.Lock()
        self.versions = {}  # prompt -> per-action-token versions of its (last) rollout
        self.started = 0
        self.completed = 0
        self.raised = set()

    def __call__(self, prompt, weights, key):
        with self.lock:
            self.started += 1
        if self.gate:
            self.gate(prompt)
        versions = []
        for chunk in range(self.num_chunks):
            if chunk and self.between_chunks:
                self.between_chunks(prompt, chunk)
            _, version = weights.latest()
            versions += [version] * self.chunk_tokens
            time.sleep(self.chunk_sleep_s)
        if self.fail and self.fail(prompt, key):
            with self.lock:
                self.raised.add(prompt)
            raise RuntimeError(f"fake rollout failure on prompt {prompt}")
        if self.bad and self.bad(prompt):
            return None
        n_action = len(versions)
        n = PROMPT_TOKENS + n_action
        tokens, logprobs = key_tokens(key, n)
        action = np.arange(n) >= PROMPT_TOKENS
        with self.lock:
            self.versions[prompt] = versions
            self.completed += 1
        return Trajectory(
            tokens=tokens,
            action_mask=action,
            rollout_logprobs=np.where(action, logprobs, 0.0).astype(np.float32),
            rollout_entropy=np.where(action, 1.0, 0.0).astype(np.float32),
            policy_version=np.concatenate([np.full(PROMPT_TOKENS, -1), versions]).astype(np.int32),
            rewards=np.where(np.arange(n) == n - 1, 1.0, 0.0).astype(np.float32),
            turn_index=np.where(action, 0, -1).astype(np.int32),
            prompt_id=-7,  # the engine must replace it with the prompt index
        )


class OnDemandPublisher:
    """Test thread that publishes version + 1 each time a rollout asks, then wakes that rollout."""

    def __init__(self, store):
        self.store = store
        self.requests = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="test-publisher")
        self.thread.start()

    def _run(self):
        while (done := self.requests.get()) is not None:
            version = self.store.version + 1
            self.store.publish({"w": version}, version)
            done.set()

    def request_and_wait(self, *_):
        done = threading.Event()
        self.requests.put(done)
        assert done.wait(LIVENESS_S), "publisher did not answer"

    def stop(self):
        self.requests.put(None)
        self.thread.join()


def check_accounting(state):
    accounted = (
        state.prompts_consumed + state.prompts_dropped + state.prompts_failed
        + len(state.unconsumed_indices) + len(state.in_flight_indices)
    )
    assert state.next_prompt_index - state.start_index == accounted


def engine_threads_alive():
    return [t for t in threading.enumerate() if t.name.startswith("rollout-worker-")]


# ---- weight store ----------------------------------------------------------------------------------


def test_weight_store_hands_out_the_published_reference_and_version():
    params = {"w": np.ones(3)}
    store = WeightStore(params, version=0)
    newer = {"w": np.zeros(3)}
    store.publish(newer, 1)
    got, version = store.latest()
    assert got is newer and version == 1 and store.version == 1


@pytest.mark.parametrize("version", [1, 0])
def test_weight_store_rejects_an_older_or_equal_version(version):
    store = WeightStore({}, version=1)
    with pytest.raises(ValueError, match=f"version {version} is not newer than the published version 1"):
        store.publish({}, version)
    assert store.version == 1


def test_weight_store_rejects_a_non_integer_version():
    with pytest.raises(TypeError, match="must be an int"):
        WeightStore({}, version=1.5)


def test_weight_store_readers_always_see_matching_params_and_non_decreasing_versions():
    store = WeightStore({"v": 0}, version=0)
    stop = threading.Event()
    problems = []

    def read():
        last = 0
        while not stop.is_set():
            params, version = store.latest()
            if params["v"] != version or version < last:
                problems.append((params["v"], version, last))
            last = version

    readers = [threading.Thread(target=read) for _ in range(3)]
    for reader in readers:
        reader.start()
    for version in range(1, 3001):
        store.publish({"v": version}, version)
    stop.set()
    for reader in readers:
        reader.join()
    assert problems == []
    assert store.latest() == ({"v": 3000}, 3000)


# ---- keys ------------------------------------------------------------------------------------------


def test_rollout_key_is_fold_in_of_prompt_index_then_member():
    base = jax.random.key(7)
    expected = jax.random.fold_in(jax.random.fold_in(base, 5), 2)
    assert np.array_equal(jax.random.key_data(rollout_key(base, 5, 2)), jax.random.key_data(expected))
    keys = {tuple(np.asarray(jax.random.key_data(rollout_key(base, p, m)))) for p in range(4) for m in range(3)}
    assert len(keys) == 12


# ---- streaming engine ------------------------------------------------------------------------------


def test_versions_are_recorded_per_token_and_the_staleness_bound_drops_exactly_the_stale():
    num_prompts, max_staleness = 24, 3
    store = WeightStore({"w": 0}, version=0)
    publisher = OnDemandPublisher(store)
    # Every even prompt asks for a new version after its first chunk, so it spans >= 2 versions.
    rollout = FakeRollout(
        num_chunks=3,
        between_chunks=lambda prompt, chunk: publisher.request_and_wait() if prompt % 2 == 0 and chunk == 1 else None,
    )
    try:
        engine = RolloutEngine(
            rollout, range(num_prompts), store, jax.random.key(0),
            num_workers=3, queue_capacity=num_prompts, max_staleness=max_staleness,
        )
        wait_until(lambda: engine.metrics()["trajectories_produced"] == num_prompts, "all rollouts")
    finally:
        publisher.stop()
    final_version = store.version
    assert final_version == num_prompts // 2

    batch = engine.get_batch(num_prompts)  # the source is exhausted: returns what survives the bound
    state = engine.close()

    # The recorded versions, independently of the engine: non-decreasing, some spanning two versions.
    for versions in rollout.versions.values():
        assert versions == sorted(versions)
    assert sum(len(set(v)) >= 2 for v in rollout.versions.values()) >= num_prompts // 2
    staleness = {p: final_version - min(v) for p, v in rollout.versions.items()}
    expected_kept = {p for p, s in staleness.items() if s <= max_staleness}
    assert 0 < len(expected_kept) < num_prompts  # the bound has something to do either way

    kept_ids = [t.prompt_id for t in batch]
    assert sorted(kept_ids) == sorted(expected_kept)
    for trajectory in batch:  # the engine hands the rollout's per-token versions through unchanged
        assert list(trajectory.policy_version[trajectory.action_mask]) == rollout.versions[trajectory.prompt_id]
    metrics = engine.metrics()
    assert metrics["trajectories_dropped_stale"] == num_prompts - len(expected_kept)
    assert metrics["staleness_histogram"] == dict(collections.Counter(staleness.values()))
    assert state.prompts_dropped == num_prompts - len(expected_kept)
    check_accounting(state)


def test_a_full_queue_blocks_the_workers_and_never_exceeds_capacity():
    num_workers, capacity = 3, 2
    rollout = FakeRollout(num_chunks=1)
    engine = RolloutEngine(
        rollout, itertools.count(), WeightStore({}, 0), jax.random.key(0),
        num_workers=num_workers, queue_capacity=capacity,
    )
    try:
        wait_until(lambda: engine.metrics()["workers_blocked"] == num_workers, "all workers blocked")
        metrics = engine.metrics()
        # Queue full, every worker holding one finished trajectory, nobody got further.
        assert metrics["queue_depth"] == capacity
        assert rollout.completed == capacity + num_workers
        assert metrics["prompts_taken"] == capacity + num_workers

        first = [t.prompt_id for t in engine.get_batch(capacity)]
        assert len(set(first)) == capacity and set(first) <= set(range(capacity + num_workers))
        # Two blocked workers move their trajectories in, then all block again on fresh prompts.
        wait_until(lambda: rollout.completed == 2 * capacity + num_workers, "refill")
        wait_until(lambda: engine.metrics()["workers_blocked"] == num_workers, "all workers blocked again")
        metrics = engine.metrics()
        assert metrics["queue_depth"] == capacity
        assert metrics["queue_depth_max"] == capacity
        assert metrics["prompts_taken"] == 2 * capacity + num_workers
    finally:
        state = engine.close()
    assert state.threads_alive == 0
    assert engine.metrics()["queue_depth_max"] == capacity  # closing does not push past it either
    assert state.prompts_consumed == capacity
    assert len(state.unconsumed_indices) == capacity + num_workers and state.in_flight_indices == ()
    check_accounting(state)


def test_trajectories_come_out_in_completion_order():
    release = {p: threading.Event() for p in range(3)}
    rollout = FakeRollout(num_chunks=1, gate=lambda prompt: release[prompt].wait(LIVENESS_S))
    store = WeightStore({}, 0)
    with RolloutEngine(rollout, range(3), store, jax.random.key(0), num_workers=3, queue_capacity=3) as engine:
        wait_until(lambda: rollout.started == 3, "three rollouts running")
        for produced, prompt in enumerate([2, 0, 1], start=1):
            release[prompt].set()
            wait_until(lambda: engine.metrics()["queue_depth"] == produced, f"prompt {prompt} queued")
        assert [t.prompt_id for t in engine.get_batch(3)] == [2, 0, 1]


def test_every_prompt_is_accounted_for_when_the_trainer_publishes_between_batches():
    store = WeightStore({"w": 0}, version=0)
    failing = {3, 10, 17}
    rollout = FakeRollout(num_chunks=2, chunk_sleep_s=0.001, fail=lambda prompt, key: prompt in failing)
    consumed = []
    engine = RolloutEngine(
        rollout, itertools.count(), store, jax.random.key(1), num_workers=3, queue_capacity=4, max_staleness=1
    )
    try:
        for step in range(1, 9):
            batch = engine.get_batch(3)
            assert len(batch) == 3
            for trajectory in batch:  # kept ones respect the bound at the version they were consumed at
                assert store.version - trajectory.oldest_version <= 1
            consumed += [t.prompt_id for t in batch]
            store.publish({"w": step}, step)
    finally:
        state = engine.close()
    assert state.threads_alive == 0
    check_accounting(state)

    taken = set(range(state.next_prompt_index))
    failed = rollout.raised
    unconsumed, in_flight = set(state.unconsumed_indices), set(state.in_flight_indices)
    assert len(consumed) == len(set(consumed)) == 24  # nothing duplicated
    dropped = taken - set(consumed) - failed - unconsumed - in_flight
    parts = [set(consumed), failed, unconsumed, in_flight, dropped]
    assert sum(map(len, parts)) == len(taken)  # disjoint: each prompt in exactly one place
    assert set().union(*parts) == taken
    assert len(dropped) == state.prompts_dropped == engine.metrics()["trajectories_dropped_stale"]
    assert len(failed) == state.prompts_failed == engine.metrics()["trajectories_failed"]


def make_engine(rollout, prompts, store, key, **kwargs):
    return RolloutEngine(rollout, prompts, store, key, num_workers=2, queue_capacity=6, **kwargs)


def test_a_raising_or_misbehaving_rollout_costs_only_its_own_trajectory():
    rollout = FakeRollout(num_chunks=1, fail=lambda prompt, key: prompt == 2, bad=lambda prompt: prompt == 4)
    with make_engine(rollout, range(6), WeightStore({}, 0), jax.random.key(0)) as engine:
        batch = engine.get_batch(6)
        assert sorted(t.prompt_id for t in batch) == [0, 1, 3, 5]
        assert engine.get_batch(1) == []  # source exhausted, nothing in flight: the end
        failures = sorted(engine.failures, key=lambda f: f.prompt_index)
        assert [(f.prompt_index, f.member) for f in failures] == [(2, 0), (4, 0)]
        assert "fake rollout failure on prompt 2" in failures[0].error
        assert "returned NoneType, not a Trajectory" in failures[1].error
        metrics = engine.metrics()
        assert metrics["trajectories_failed"] == 2 and metrics["trajectories_consumed"] == 4
        state = engine.state()
    assert state.prompts_failed == 2
    check_accounting(state)


def test_group_mode_releases_whole_groups_with_one_prompt_id_and_member_keys():
    group_size, base = 3, jax.random.key(4)
    rollout = FakeRollout(num_chunks=2)
    with make_engine(rollout, range(4), WeightStore({}, 0), base, group_size=group_size) as engine:
        with pytest.raises(ValueError, match="multiple of group_size=3"):
            engine.get_batch(4)
        batch = engine.get_batch(6) + engine.get_batch(6)
        assert engine.get_batch(3) == []
    assert len(batch) == 12
    groups = [batch[i : i + group_size] for i in range(0, len(batch), group_size)]
    assert sorted(g[0].prompt_id for g in groups) == [0, 1, 2, 3]
    for group in groups:
        prompt_id = group[0].prompt_id
        assert all(t.prompt_id == prompt_id for t in group)
        for member, trajectory in enumerate(group):  # members in order, each with its own key
            key = jax.random.fold_in(jax.random.fold_in(base, prompt_id), member)
            tokens, _ = key_tokens(key, trajectory.num_tokens)
            assert np.array_equal(trajectory.tokens, tokens)


def test_a_group_with_a_failed_member_is_discarded_whole():
    base = jax.random.key(5)
    bad_key = jax.random.key_data(rollout_key(base, 1, 1))
    rollout = FakeRollout(num_chunks=1, fail=lambda prompt, key: np.array_equal(jax.random.key_data(key), bad_key))
    with make_engine(rollout, range(3), WeightStore({}, 0), base, group_size=2) as engine:
        batch = engine.get_batch(6)
        metrics, state = engine.metrics(), engine.state()
    assert [t.prompt_id for t in batch] in ([0, 0, 2, 2], [2, 2, 0, 0])
    assert metrics["trajectories_failed"] == 1 and metrics["trajectories_discarded"] == 1
    assert state.prompts_failed == 1
    check_accounting(state)


def test_a_group_with_one_member_too_stale_is_dropped_whole_and_every_member_counted():
    """Store at version 2, max_staleness 1: member 0 samples with version 2 (staleness 0), member 1
    with version 0 (staleness 2). The group is dropped, both trajectories counted, both in the histogram."""
    base = jax.random.key(6)
    old_key = jax.random.key_data(rollout_key(base, 0, 1))
    rollout = FakeRollout(num_chunks=2)

    def stamp_member_one_two_versions_back(prompt, weights, key):
        if np.array_equal(jax.random.key_data(key), old_key):
            weights = WeightStore({}, weights.version - 2)
        return rollout(prompt, weights, key)

    store = WeightStore({}, 0)
    store.publish({}, 2)
    with make_engine(stamp_member_one_two_versions_back, range(1), store, base, group_size=2,
                     max_staleness=1) as engine:
        assert engine.get_batch(2) == []
        metrics, state = engine.metrics(), engine.state()
    assert rollout.completed == 2  # both members ran, member 1 on version 0
    assert metrics["staleness_histogram"] == {0: 1, 2: 1}
    assert metrics["trajectories_dropped_stale"] == 2 and metrics["trajectories_consumed"] == 0
    assert state.prompts_dropped == 1 and state.prompts_consumed == 0
    check_accounting(state)


def test_get_batch_returns_what_it_has_when_the_timeout_passes():
    release = threading.Event()
    rollout = FakeRollout(num_chunks=1, gate=lambda prompt: release.wait(LIVENESS_S) if prompt >= 1 else None)
    engine = RolloutEngine(rollout, range(4), WeightStore({}, 0), jax.random.key(0), num_workers=2)
    try:
        wait_until(lambda: engine.metrics()["queue_depth"] == 1, "prompt 0 queued")
        assert [t.prompt_id for t in engine.get_batch(3, timeout_s=0.01)] == [0]  # others are gated
        release.set()
        assert sorted(t.prompt_id for t in engine.get_batch(3)) == [1, 2, 3]
        metrics = engine.metrics()
        assert 0.0 < metrics["trainer_idle_fraction"] <= 1.0
        assert metrics["action_tokens_produced"] == 4 * 2
        assert metrics["trajectories_per_s"] > 0 and metrics["action_tokens_per_s"] > 0
    finally:
        engine.close()


# ---- shutdown --------------------------------------------------------------------------------------


def test_close_stops_every_worker_and_reports_what_was_in_flight():
    release = threading.Event()
    rollout = FakeRollout(num_chunks=1, gate=lambda prompt: release.wait(LIVENESS_S) if prompt >= 2 else None)
    store = WeightStore({}, 0)
    engine = RolloutEngine(rollout, itertools.count(), store, jax.random.key(0), num_workers=3, queue_capacity=4)
    wait_until(lambda: rollout.started == 5, "two done, three gated")  # prompts 0, 1 done; 2, 3, 4 gated
    running = engine.state()
    assert running.unconsumed_indices == (0, 1) and running.in_flight_indices == (2, 3, 4)

    state = engine.close(timeout_s=0.01)  # the gated rollouts cannot finish yet
    assert state.threads_alive == 3 and state.in_flight_indices == (2, 3, 4)
    release.set()
    state = engine.close()  # the gated rollouts finish; their trajectories are reported, not queued
    assert state.threads_alive == 0 and engine_threads_alive() == []
    assert state.unconsumed_indices == (0, 1, 2, 3, 4) and state.in_flight_indices == ()
    assert state.next_prompt_index == 5  # nothing taken after close
    check_accounting(state)
    with pytest.raises(RuntimeError, match="closed"):
        engine.get_batch(1)


def test_an_error_in_the_prompt_source_surfaces_in_get_batch_and_close_is_clean():
    def prompts():
        yield 0
        yield 1
        raise OSError("disk gone")

    engine = RolloutEngine(FakeRollout(num_chunks=1), prompts(), WeightStore({}, 0), jax.random.key(0), num_workers=2)
    assert sorted(t.prompt_id for t in engine.get_batch(2)) == [0, 1]
    with pytest.raises(RuntimeError, match="worker thread") as caught:
        engine.get_batch(1)
    assert "prompt source raised OSError: disk gone" in str(caught.value.__cause__)
    state = engine.close()
    assert state.threads_alive == 0
    check_accounting(state)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"queue_capacity": 2, "group_size": 3}, "cannot hold one group"),
        ({"num_workers": 0}, "num_workers must be >= 1"),
        ({"max_staleness": -1}, "max_staleness must be >= 0"),
    ],
)
def test_bad_engine_arguments_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutEngine(FakeRollout(), range(1), WeightStore({}, 0), jax.random.key(0), **kwargs)


def test_a_rollout_function_that_always_fails_stops_get_batch_with_the_counts_and_prints_nothing(caplog):
    """Every rollout raises (a dead environment): get_batch raises RolloutsFailing once the bound of
    failures in a row is reached, instead of waiting forever, and no failure is logged as it happens."""
    rollout = FakeRollout(num_chunks=1, fail=lambda prompt, key: True)
    with caplog.at_level("INFO"):
        with make_engine(rollout, itertools.count(), WeightStore({}, 0), jax.random.key(0),
                         max_consecutive_failures=8) as engine:  # fmt: skip
            with pytest.raises(RolloutsFailing) as stalled:
                engine.get_batch(4)
            counts = engine.error_counts()
    assert stalled.value.consecutive >= 8
    ((message, count),) = stalled.value.errors.items() if len(stalled.value.errors) == 1 else [(None, None)]
    assert message is None or count >= 8  # the fake names its prompt: one message per prompt otherwise
    assert sum(counts.values()) >= 8
    assert all("fake rollout failure on prompt" in error for error in counts)
    assert [r for r in caplog.records if r.levelno >= logging.INFO and r.name.startswith("sao_jax")] == []
    assert "Traceback" not in caplog.text


def test_a_success_resets_the_count_of_failures_in_a_row():
    rollout = FakeRollout(num_chunks=1, fail=lambda prompt, key: prompt % 4 != 3)  # 3 failures, then a success
    with RolloutEngine(rollout, range(40), WeightStore({}, 0), jax.random.key(0), num_workers=1,
                       max_consecutive_failures=4) as engine:  # one worker: completion order is prompt order
        assert sorted(t.prompt_id for t in engine.get_batch(10)) == list(range(3, 40, 4))
    with pytest.raises(ValueError, match="max_consecutive_failures"):
        make_engine(rollout, range(4), WeightStore({}, 0), jax.random.key(0), max_consecutive_failures=0)
