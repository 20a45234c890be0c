# SPDX-License-Identifier: MIT
"""Tests of plugrl_min that read as documentation of the PlugRL server contract.
Wire format and registries as units; routing and the hooks over real WebSockets; the command line in this
process, and as subprocesses where a process boundary matters (signals, exit statuses, kill -9, plug-ins
imported into a fresh interpreter).

The order is plugrl_min.py's: the helpers, then one section per section of the file (1 to 15), then one per
optional block ([learn-threads] to [gym]), then the checks of README.md, its exercises solved, and the opt-in
benchmarks.

No wait here is without a deadline: a test fails after 240 s, a run that several tests share after its own (see
deadline_of). While you change the wire and a run may hang, lower them all and run the wire's tests alone:
    PLUGRL_TEST_DEADLINE=60 python -m pytest -q test_plugrl_min.py -m wire -x --tb=native
(-m wire: every test that speaks the wire itself, see `wire`; the quick check, -m contract, stays as it is.)
What the wire says (its messages, an action's rows, the closes) is spelled once, under "What the wire says"."""

import argparse
import ast
import base64
import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import glob
import importlib.util
import inspect
import io
import itertools
import json
import math
import os
import pathlib
import queue
import re
import shutil
import signal
import socket
import string
import struct
import subprocess
import sys
import threading
import time
import textwrap
import tokenize
import tracemalloc
import types
import typing
import unittest.mock
import urllib.parse
import warnings

import numpy as np
import pytest
import torch
from torch import nn
import websockets
from websockets.asyncio.client import connect
import websockets.asyncio.server

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import plugrl_min  # noqa: E402
import sac_example  # noqa: E402
from plugrl_min import (Checkpoint, ClosedLoopMultiAction, Controller, MultiAction, ProtocolError,  # noqa: E402
                        load_newest_checkpoint, make_algo, make_env, make_policy, observation,
                        pack_message, save_checkpoint, unpack_message)

SOURCE = os.path.join(HERE, "plugrl_min.py")


# =============================================================================================
# Marks: the handout checks and the benchmarks, skipped unless asked for; the quick contract check
# =============================================================================================

# The project's own checks of README.md against the code, and of plugrl_min.py's layout against README.md's
# reading map (its line numbers, the first reading's banner, function sizes, optional blocks), which CI runs and
# a student's edit of plugrl_min.py need not pass. Each has `handout` in its name, so -k handout selects them:
# PLUGRL_CHECK_HANDOUT=1 python -m pytest -q test_plugrl_min.py -k handout
handout = pytest.mark.skipif(os.environ.get("PLUGRL_CHECK_HANDOUT") != "1",
                             reason="the project's own check of README.md and the file's layout (CI runs it): "
                                    "PLUGRL_CHECK_HANDOUT=1")

# The benchmarks (the last section), opt-in: they print tables and take minutes.
bench = pytest.mark.skipif(os.environ.get("PLUGRL_BENCH") != "1",
                           reason="a benchmark: run with PLUGRL_BENCH=1 ... -n 0 -k bench -s")

# The quick contract check: python -m pytest -q test_plugrl_min.py -m contract
# A test of the PlugRL contract itself (the wire and its errors, the registries, the page's troubleshooting,
# routing and the hooks' order, chains and counts, the page's template, stop, checkpoints and resume) carries
# @contract where it stands. None of them pins pg's or sac's internals, so an edit of pg (exercise 8's PPO)
# keeps them green while it keeps the contract.
contract = pytest.mark.contract

# The wire's tests: python -m pytest -q test_plugrl_min.py -m wire -x
# A test that speaks the wire itself carries @wire: a client or server it drives over a WebSocket, an env client
# it starts, a frame it packs or reads. A change of the wire is checked by these first (they fail instead of
# hanging: see deadline_of), then by all the tests; a run with local clients crosses the wire unmarked.
wire = pytest.mark.wire


# =============================================================================================
# Helpers that the tests of several sections share
# =============================================================================================

# --- The command line, in subprocesses or in this process; waiting on a child's files -------------

def subprocess_env(pythonpath=None) -> dict:
    """The environment of a child process: unbuffered, no API key, plug-ins found through PYTHONPATH."""
    env = {key: value for key, value in os.environ.items() if key != "PLUGRL_API_KEY"}
    env["PYTHONUNBUFFERED"] = "1"
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), os.environ.get("PYTHONPATH")]))
    return env


def python(*args, pythonpath=None, timeout=60) -> subprocess.CompletedProcess:
    """Run `python ARGS` in the project directory and wait for it."""
    return subprocess.run([sys.executable, *args], cwd=HERE, env=subprocess_env(pythonpath), capture_output=True,
                          text=True, timeout=timeout, stdin=subprocess.DEVNULL)


class Background:
    """A `python ARGS` child running beside the test; its output goes to files the test can poll."""

    def __init__(self, tmp_path, name, args, pythonpath=None):
        self.out_path, self.err_path = tmp_path / f"{name}.out", tmp_path / f"{name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.proc = subprocess.Popen([sys.executable, *args], cwd=HERE, env=subprocess_env(pythonpath),
                                         stdin=subprocess.DEVNULL, stdout=out, stderr=err)

    def stdout(self) -> str:
        return self.out_path.read_text()

    def stderr(self) -> str:
        return self.err_path.read_text()

    def port(self, timeout=30.0) -> int:
        """The port of the server's `listening on ws://127.0.0.1:PORT` line."""
        deadline = time.monotonic() + timeout
        while True:
            match = re.search(r"listening on ws://127\.0\.0\.1:(\d+)", self.stdout())
            if match:
                return int(match.group(1))
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"server not listening (status {self.proc.poll()}):\n"
                                     f"{self.stdout()}\n{self.stderr()}")
            time.sleep(0.05)

    def wait(self, timeout=60.0) -> int:
        return self.proc.wait(timeout)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def write_plugin(tmp_path, module: str, source: str) -> None:
    """A plug-in module in tmp_path (the children get tmp_path on PYTHONPATH)."""
    (tmp_path / f"{module}.py").write_text(source)


def run_main(*argv) -> tuple[int, str, str]:
    """`python plugrl_min.py ARGV` in this process: (exit status, stdout, stderr), as a shell sees them.

    For what needs no process of its own: help, argument and registry errors, a server fed from a thread. No
    interpreter to start, no torch to import. Plug-ins need the plugins_in_process fixture.
    """
    threads = torch.get_num_threads()  # the server sets its own
    out, err = io.StringIO(), io.StringIO()
    try:  # Ctrl-C and SIGTERM stay pytest's: the server's handlers are for a process of its own
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
                unittest.mock.patch.object(plugrl_min.signal, "signal"):
            status = plugrl_min.main([str(word) for word in argv])  # returns the status: main() exits
    finally:
        torch.set_num_threads(threads)
    return status, out.getvalue(), err.getvalue()


def interrupt(signum, frame):
    raise KeyboardInterrupt


class DeadlinePassed(BaseException):
    """A deadline's end. Not an Exception: the code under test catches those, and must not swallow this."""


def lowered(seconds: float) -> int:
    """A deadline in whole seconds, lowered to PLUGRL_TEST_DEADLINE's when that is set and smaller."""
    cap = os.environ.get("PLUGRL_TEST_DEADLINE")
    return max(1, int(min(seconds, float(cap)) if cap else seconds))


@contextlib.contextmanager
def deadline_of(what: str, seconds: float):
    """Fail `what`, instead of letting it hang, once it has run for `seconds` (SIGALRM, in the main thread,
    also inside an event loop). An outer deadline that ends sooner is kept, and armed again after."""
    seconds, started = lowered(seconds), time.monotonic()

    def expire(signum, frame):
        raise DeadlinePassed(f"{what} ran past its deadline of {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    outer = signal.alarm(seconds)  # the seconds left of an outer deadline; 0: none
    if 0 < outer < seconds:
        signal.signal(signal.SIGALRM, previous)
        signal.alarm(outer)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if outer:
            signal.alarm(max(1, round(outer - (time.monotonic() - started))))


@pytest.fixture(autouse=True)
def deadline(request):
    """Every test fails, instead of hanging, once it has run for 240 s (a benchmark, which runs for minutes: an
    hour): a wait that never ends hides the bug it waits for (the slowest test takes under a minute). The runs
    that module fixtures share have deadlines of their own (they start before this one). And Ctrl-C stops the
    test run at once, also inside an event loop: asyncio.run turns Python's own SIGINT handler into a
    cancellation that a test may swallow."""
    seconds = 3600 if request.node.name.startswith("test_bench_") else 240
    previous = signal.signal(signal.SIGINT, interrupt)
    with deadline_of("the test", seconds):
        yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def plugins_in_process(tmp_path, monkeypatch):
    """Plug-ins written to tmp_path import in this process; what they register, and they, are forgotten after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    for table in ("_POLICY_CONFIGS", "_POLICIES", "_ALGO_CONFIGS", "_ALGOS", "ENVIRONMENTS"):
        monkeypatch.setattr(plugrl_min, table, dict(getattr(plugrl_min, table)))
    yield
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def reserve_port() -> int:
    """A port the OS picks (bind to port 0): the client must be told it before the server exists."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def env_client_args(port, *extra) -> list[str]:
    return ["plugrl_min.py", "env-client", "dummy-v1", "--server-port", str(port), *extra]


def dummy_server(run_dir, *flags, port=0) -> list[str]:
    """The command line of a dummy run: a learn every 100 frames, a save and a metrics line every learn."""
    return ["plugrl_min.py", "dummy-policy", "default", "dummy", "default", "--algo.learn-every", "100",
            "--algo.save-every", "1", "--log-every", "1", "--port", str(port), "--run-dir", str(run_dir), *flags]


def dummy_run_command(*flags) -> list[str]:
    """A short dummy run with one local client of 4 environments, by absolute path (any cwd)."""
    return [sys.executable, SOURCE, "dummy-policy", "default", "dummy", "default", "--local-env-clients", "1",
            "--local-num-envs", "4", "--algo.global-steps", "2000", "--algo.learn-every", "500", "--log-every", "1",
            *flags]


def notebook_words(run_dir, steps, algo="pg") -> list[str]:
    return ["dummy-policy", "default", algo, "default", "--local-env-clients", "1", "--local-num-envs", "16",
            "--algo.global-steps", str(steps), "--log-every", "1", "--port", "0", "--run-dir", str(run_dir)]


def in_a_thread(function, *args) -> tuple[threading.Thread, list]:
    """function(*args) in a daemon thread of this process, beside a server process: (the thread, [its result])."""
    result = []
    thread = threading.Thread(target=lambda: result.append(function(*args)), daemon=True)
    thread.start()
    return thread, result


def wait_for(condition, timeout, what) -> None:
    """Poll condition() (a subprocess's files) until it holds; fail after timeout seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def read_metrics(run_dir, event="learn") -> list[dict]:
    """The lines of metrics.jsonl written at a learn (event="learn"), at the end ("end"), or all (None)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as file:
        lines = [json.loads(line) for line in file]
    return [line for line in lines if event is None or line["event"] == event]


def metrics_lines(run_dir) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as file:
        return sum(1 for line in file if line.endswith("\n"))


def checkpoint_steps(run_dir) -> list[int]:
    """The steps of the checkpoints in run_dir, oldest first (temporary files are not checkpoints)."""
    return sorted(int(os.path.basename(path)[5:-3]) for path in glob.glob(os.path.join(run_dir, "checkpoints",
                                                                                          "step_*.pt")))


def folder_bytes(folder) -> dict:
    """Every file under folder, by relative path, with its bytes: a run's record as it stands."""
    return {os.path.relpath(path, folder): open(path, "rb").read()
            for path in glob.glob(os.path.join(folder, "**"), recursive=True) if os.path.isfile(path)}


def readme() -> str:
    with open(os.path.join(HERE, "README.md")) as file:
        return file.read()


def readme_block(after: str, nth: int = 0) -> str:
    """The nth ``` block that opens after the first place README.md says `after`."""
    text = readme()
    blocks = [(block.start(), block.group(1))
              for block in re.finditer(r"^```[a-z]*\n(.*?)^```$", text, re.M | re.S)]
    return [body for start, body in blocks if start > text.index(after)][nth]


def in_a_test(words: list[str], tmp_path) -> list[str]:
    """A README server command on a free port, writing to a temporary run directory; its --plugin MODULE is the
    test's plugrl_test_MODULE, which a student's MODULE.py left in the project folder cannot shadow."""
    words = [f"plugrl_test_{word}" if before == "--plugin" else word for before, word in zip([""] + words, words)]
    return [*words, "--port", "0", "--run-dir", str(tmp_path / "run")]


def gymnasium_or_skip():
    return pytest.importorskip("gymnasium", reason="gymnasium is not installed (pip install gymnasium)")


# --- An in-process server, hand-driven WebSocket clients, an instrumented algorithm ---------------

def small_policy():
    return plugrl_min.make_policy("dummy-policy", plugrl_min.DummyPolicyConfig(hidden_size=8))


def dummy_algo(policy, steps):
    """The built-in dummy algorithm around policy (a learn every 1000 frames), until global step `steps`."""
    return make_algo("dummy", policy, plugrl_min.DummyAlgoConfig(global_steps=steps))


def row_obs(state) -> dict:
    """One environment's observation as feedback() is given it: its row of each array, its text a str."""
    return {"images": {}, "states": {"state": state}, "text": ""}


def obs_tensors(obs: dict) -> dict:
    """An observation's images and states as tensors, as a policy's forward() takes them."""
    return plugrl_min.map_arrays(torch.from_numpy, {"images": obs["images"], "states": obs["states"]})


def obs_of(tags) -> dict:
    """Observations [n, 3] whose first column tags each environment, so the algorithm can tell them apart."""
    state = np.array([[tag, 0.0, 0.0] for tag in tags], np.float32).reshape(len(tags), 3)
    return plugrl_min.observation(len(tags), states={"state": state})


class Client:
    """A hand-driven env client over a real WebSocket: explicit infer and feedback messages."""

    def __init__(self, ws, metadata):
        self.ws, self.metadata = ws, metadata

    @classmethod
    async def connect(cls, port):
        ws = await connect(f"ws://127.0.0.1:{port}", compression=None, proxy=None, open_timeout=10)
        return cls(ws, unpack_message(await asyncio.wait_for(ws.recv(), 10)))  # the server speaks first

    async def receive(self) -> dict:
        return unpack_message(await asyncio.wait_for(self.ws.recv(), 10))

    async def infer(self, env_ids, tags) -> dict:
        await self.ws.send(pack_message(infer_message(env_ids, tags)))
        return await self.receive()

    async def feedback(self, env_ids, tags, *, reward=None, terminated=None, truncated=None, episode=None,
                       extra_info=None):
        m = len(env_ids)
        terminated = np.zeros(m, bool) if terminated is None else np.array(terminated, bool)
        truncated = np.zeros(m, bool) if truncated is None else np.array(truncated, bool)
        if episode is None:  # the page's info["episode"]: r, l, s, and mask on finished episodes
            episode = {"r": np.zeros(m, np.float32), "l": np.zeros(m, np.int64), "s": np.zeros(m, bool)}
        episode = {**{key: np.array(value) for key, value in episode.items()}, "mask": terminated | truncated}
        extra = {key: np.array(value, np.float32) for key, value in (extra_info or {}).items()}
        reward = np.zeros(m, np.float32) if reward is None else np.array(reward, np.float32)
        await self.ws.send(pack_message(feedback_message(env_ids, tags, terminated, rewards=reward,
                                                         truncated=truncated, info={"episode": episode, **extra})))

    async def step(self, env_ids, tags, **feedback) -> dict:
        """One decision: infer, then feed back; returns the action message."""
        reply = await self.infer(env_ids, tags)
        actions_of(reply)  # an action, not an error
        await self.feedback(env_ids, tags, **feedback)
        return reply

    async def closed(self) -> tuple[int, str]:
        """Wait until the server closes this connection; its close code and reason."""
        await asyncio.wait_for(self.ws.wait_closed(), 10)
        return self.ws.close_code, self.ws.close_reason

    async def close(self):
        await self.ws.close()


async def run_rounds(port, tags, rounds, think=None, **feedback) -> int:
    """A client whose environments (tagged `tags`) make `rounds` decisions, then leave; returns frames sent.

    think(): seconds to spend between an action and its feedback (clients that step at different paces
    send their feedback in different passes of the server loop, across learns).
    """
    client = await Client.connect(port)
    env_ids = list(range(len(tags)))
    for _ in range(rounds):
        await client.infer(env_ids, tags)
        if think is not None:
            await asyncio.sleep(think())
        await client.feedback(env_ids, tags, **feedback)
    await client.close()
    return rounds * len(tags)


async def feed(port, decisions=None, then=lambda: None) -> tuple[int, tuple[int, str]]:
    """A hand-driven client with one environment, once a server listens on port: `decisions` decisions (None:
    until the server closes it).

    Then it takes one more action (its reply proves that every feedback before it was routed), calls then(),
    and waits, owing that feedback, for the server to close it. Returns (frames fed, (close code, reason)).
    """
    deadline = time.monotonic() + 60
    while True:  # the server may still be starting (in this process's main thread, say)
        try:
            client, fed = await Client.connect(port), 0
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
    try:
        while decisions is None or fed < decisions:
            await client.step([0], [0.5])
            fed += 1
        await client.infer([0], [0.5])
        then()
        return fed, await client.closed()
    except websockets.ConnectionClosed:
        return fed, (client.ws.close_code, client.ws.close_reason)


async def eventually(condition, timeout=10.0) -> None:
    """Wait until condition() holds (frames sent are routed on the server's next pass)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.02)


async def env_client_in_process(*argv) -> int:
    """`python plugrl_min.py env-client ARGV` in a thread of this process (its own event loop), beside an
    in-process server: its exit status; what it prints goes to capsys."""
    return await asyncio.to_thread(plugrl_min.env_client_main, [str(word) for word in argv])


def run_server(algo, run_dir, script, *, timeout=60.0, **options):
    """Serve algo in-process on a free port while `await script(port, server)` drives clients.

    Then request a stop (if the run has not ended by itself); returns (run()'s status, the script's result).
    """
    os.makedirs(run_dir, exist_ok=True)  # the command line makes it (claim_run_dir); Server writes in it

    async def main():
        config = plugrl_min.ServerConfig(**options)
        server = plugrl_min.Server(algo, str(run_dir), ("dummy-policy", "probe"), config)
        ports = asyncio.Queue()
        task = asyncio.create_task(server.run("127.0.0.1", 0, on_listening=ports.put_nowait))
        port = await asyncio.wait_for(ports.get(), 10)
        try:
            result = await asyncio.wait_for(script(port, server), timeout)
        finally:
            server.request_stop()
            status = await asyncio.wait_for(task, 15)
        return status, result

    return asyncio.run(main())


@pytest.fixture
def one_torch_thread():
    """Inference in this process on one torch thread, as the server's command line sets it: when other processes
    share a 2-core machine, two torch threads wait on each other at every matmul, and small networks get 5-10x
    slower than on one (servers in these tests learn on one too: learn_threads=1, --learn-threads 1)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class Probe(plugrl_min.BaseAlgorithm):
    """An instrumented algorithm: records the hooks the server calls. Tests subclass it to change one thing.

    infer echoes each environment's tag as its action and puts the tag and the learn count (the policy
    version it acted with) into the runtime state; feedback stores nothing but the call's arguments.
    """

    on_policy = False
    learn_every = None  # stored frames between learns (None: never learns)
    learn_seconds = 0.0
    held = False  # true: each learn lasts until the test sets self.released (at most 60 s), not learn_seconds
    record_episodes = True  # feedback calls record_episode_metrics, as the page's template does

    def __init__(self):
        super().__init__(config=plugrl_min.BaseAlgoConfig(global_steps=None), policy=small_policy())
        self.events = []  # ("infer", tags), ("feedback", tag), ("learn",) in call order
        self.frames = []  # the keyword arguments of every feedback call
        self.discarded, self.stale, self.learns, self.stored_since_learn = 0, 0, 0, 0
        self.episodes_recorded, self.checkpoints, self.learn_threads = 0, 0, []
        self.learning = False  # true while learn_impl runs
        self.released = threading.Event()  # a held learn ends once the test sets it

    def hold(self):
        """The learn's own time: learn_seconds asleep, or, held, until the test releases it (a test on a busy
        machine then needs no learn long enough for what it does meanwhile)."""
        if not self.held:
            time.sleep(self.learn_seconds)
        elif not self.released.wait(60):
            raise TimeoutError("the test never released the learn")

    def infer(self, obs):
        tags = obs["states"]["state"][:, 0].copy()
        self.events.append(("infer", sorted(tags.tolist())))
        return tags.reshape(-1, 1, 1), {"tag": tags, "learns": np.full(len(tags), self.learns)}

    def feedback(self, *, obs, runtime_state, train_state=None, terminated, truncated, next_obs, reward, info,
                 next_terminated, next_truncated, prev_node):
        frame = dict(obs=obs, runtime_state=runtime_state, train_state=train_state, terminated=terminated,
                     truncated=truncated, next_obs=next_obs, reward=reward, info=info,
                     next_terminated=next_terminated, next_truncated=next_truncated, prev_node=prev_node)
        self.frames.append(frame)
        self.events.append(("feedback", float(runtime_state["tag"])))
        self.stale += int(runtime_state["learns"]) != self.learns  # acted with an older policy
        if self.record_episodes and (next_terminated or next_truncated) and "episode" in info:
            if bool(info["episode"].get("mask", True)):
                self.record_episode_metrics(info["episode"])
        self.global_step += 1
        self.stored_since_learn += 1
        return self.next_node(frame), self.global_step, {}

    def next_node(self, frame):
        return frame["prev_node"]

    def discard_feedback(self, *, info, next_terminated, next_truncated):
        self.discarded += 1
        super().discard_feedback(info=info, next_terminated=next_terminated, next_truncated=next_truncated)

    def record_episode_metrics(self, episode):
        self.episodes_recorded += 1
        super().record_episode_metrics(episode)

    def learn_impl(self):
        self.learn_threads.append(threading.current_thread())
        self.learning = True
        self.hold()
        self.learning = False
        self.events.append(("learn",))
        self.learns += 1
        self.stored_since_learn = 0
        return self.global_step, {}

    def should_learn(self):
        return self.learn_every is not None and self.stored_since_learn >= self.learn_every

    def create_checkpoint(self):
        self.checkpoints += 1
        return super().create_checkpoint()


class LearnsEveryFour(Probe):
    learn_every = 4


class LearnsOnceAfterTheFirstFrame(Probe):
    """One learn, started by the first stored frame, that lasts until the test releases it."""

    held = True

    def should_learn(self):
        return self.learns == 0 and self.global_step >= 1


class Faulty(Probe):
    """Raises in one hook; learns and saves after every stored frame so that every hook runs."""

    learn_every = 1

    def __init__(self, fault):
        super().__init__()
        self.fault = fault

    def maybe_fail(self, hook):
        if self.fault == hook:
            raise RuntimeError(f"deliberate fault in {hook}")

    def infer(self, obs):
        self.maybe_fail("infer")
        return super().infer(obs)

    def feedback(self, **kwargs):
        self.maybe_fail("feedback")
        return super().feedback(**kwargs)

    def learn_impl(self):
        self.maybe_fail("learn_impl")
        return super().learn_impl()

    def should_save(self):
        return self.learns > self.checkpoints

    def create_checkpoint(self):
        self.maybe_fail("create_checkpoint")
        return super().create_checkpoint()


async def two_clients_until_closed(port, server):
    """One client makes a decision (every hook runs), another waits; both until the server closes them."""
    acting, waiting = await Client.connect(port), await Client.connect(port)
    try:
        await acting.step([0], [1])
        await acting.infer([0], [1])
    except websockets.ConnectionClosed:
        pass
    return await acting.closed(), await waiting.closed()


@dataclasses.dataclass
class ShortConfig(plugrl_min.BaseAlgoConfig):
    global_steps: int | None = 5


def pg_algo(policy="dummy-policy", **overrides):
    config = dataclasses.replace(plugrl_min.PGConfig(), **overrides)
    algo = make_algo("pg", make_policy(policy), config)
    algo.init_optimizers()
    return algo


# --- What the wire says, each thing in one place: the messages, an action's rows, the closes -------
# Tests build and read messages only through these, so a change of the wire changes them, not the tests.

DATA_FIELDS = ("obs", "rewards", "terminated", "truncated", "info")  # a feedback's, in its data (SPEC 5.4)


def infer_message(env_ids=(0,), tags=None, **fields) -> dict:
    """An infer for env_ids, their observations tagged `tags` (7.0 each by default); fields replace or add
    (obs: its data, the observation)."""
    tags = [7.0] * len(env_ids) if tags is None else tags
    message = {"message_type": "infer", "data": obs_of(tags), "env_indices": np.array(env_ids, np.int64),
               "step_ids": np.zeros(len(env_ids), np.int64)}
    return with_changes(message, **fields)


def feedback_message(env_ids=(0,), tags=None, terminated=False, episode=None, **fields) -> dict:
    """A well-formed feedback, as the env client sends it: rewards 0, info['episode'] = r, l, s and mask (by
    default an episode of return -3 and 5 steps where `terminated`); fields replace or add, those of its
    data (DATA_FIELDS) in its data."""
    m = len(env_ids)
    done = np.broadcast_to(np.array(terminated, bool), (m,)).copy()
    if episode is None:
        episode = {"r": np.where(done, -3.0, 0.0).astype(np.float32), "l": np.where(done, 5, 0), "s": done.copy()}
    episode = {key: np.asarray(value) for key, value in episode.items()}
    episode.setdefault("mask", done.copy())
    tags = [7.0] * m if tags is None else tags
    data = {"obs": obs_of(tags), "rewards": np.zeros(m, np.float32), "terminated": done,
            "truncated": np.zeros(m, bool), "info": {"episode": episode}}
    message = {"message_type": "feedback", "env_indices": np.array(env_ids, np.int64),
               "step_ids": np.zeros(m, np.int64), "data": data}
    return with_changes(message, **fields)


def with_changes(message: dict, **changes) -> dict:
    """A copy of message with fields replaced, a feedback's DATA_FIELDS in its data and an infer's obs as its
    data (a value of ... removes the field)."""
    message = dict(message)
    data = dict(message["data"]) if message["message_type"] == "feedback" else None
    for key, value in changes.items():
        if data is not None and key in DATA_FIELDS:
            data[key] = value
        else:
            message["data" if key == "obs" else key] = value
    if data is not None:
        message["data"] = {key: value for key, value in data.items() if value is not ...}
    return {key: value for key, value in message.items() if value is not ...}


def metadata_message(**fields) -> dict:
    """The metadata a server sends first, dummy-policy's (obs [3], one continuous action); fields replace."""
    data = {"protocol_version": 1, "server": "plugrl_min", "action_dim": 1, "num_actions": None,
            "action_horizon": 1, "features": [],
            "obs_spec": {"states": {"state": [[3], "float32"]}}}
    return {"message_type": "metadata", "data": {**data, **fields}}


def action_message(env_ids, action) -> dict:
    """The action a server sends for env_ids: action [n, H, *da], the policy's shape, time-major on the wire."""
    action = np.asarray(action)
    return {"message_type": "action", "data": {"env_ids": np.asarray(env_ids, np.int64),
                                                "action": np.moveaxis(action, 0, 1)}}


def actions_of(reply: dict) -> np.ndarray:
    """An action reply's actions in the policy's shape, [n, H, *da] (row i: the infer's i-th environment);
    a discrete action ([H, n] on the wire) as [n, H, 1]."""
    assert reply["message_type"] == "action", reply
    action = np.moveaxis(reply["data"]["action"], 0, 1)
    return action[..., None] if action.ndim == 2 else action


def env_ids_of(reply: dict) -> list[int]:
    """The environments an action reply is for, in its rows' order."""
    return reply["data"]["env_ids"].tolist()


RUN_END = (1001, "plugrl-server-stop")  # (close code, reason) of every connection when the run ends


def hook_failed(error: str = "RuntimeError") -> tuple[int, str]:
    """The close every client gets when a hook raised `error`: PlugRL's, which never names it (the server's
    printed line does: `server failed: <error>`)."""
    return 1011, "Internal server error."


def silent_after(seconds: float) -> tuple[int, str]:
    """The close of a client that owed feedback past the feedback timeout of `seconds`: PlugRL's (SPEC 7.3),
    the same whatever the timeout (the server's log says the seconds)."""
    return 1001, "Feedback timeout"


RESYNC = (1001, "plugrl-server-resync")  # the close of a connection whose message was refused (SPEC 7.2)
TOO_BIG = 1009  # the close code of a frame over the server's size limit


class Refusal(typing.NamedTuple):
    """What the server did after a client's bad message: the type of what it sent (None: nothing; a type:
    it accepted the message), and the close code and reason (None: the connection was left open)."""
    sent: str | None
    code: int | None
    reason: str | None


async def refusal_of(ws, wait=10.0) -> Refusal:
    """Read what the server does after a bad message on ws: a message, or a close, within `wait` s."""
    try:
        message = unpack_message(await asyncio.wait_for(ws.recv(), wait))
        return Refusal(message.get("message_type"), None, None)
    except websockets.ConnectionClosed:
        return Refusal(None, ws.close_code, ws.close_reason)
    except (TimeoutError, asyncio.TimeoutError):
        return Refusal(None, None, None)  # no reply, no close


def resyncs_logged(err: str) -> list[tuple[int, str, str]]:
    """(client number, why, hint) of each connection the server's log says it closed for a resync."""
    line = r"^client (\d+): (.*) \(hint: (.*)\): closed 1001 plugrl-server-resync$"
    return [(int(number), why, hint) for number, why, hint in re.findall(line, err, re.MULTILINE)]


MISSING = object()  # a field left out of the message
N = 2  # environments in every message below


def good_message(kind: str) -> dict:
    """A valid infer, or a valid feedback in which both environments end an episode (of return 0, 1 step)."""
    if kind == "infer":
        return infer_message(range(N), [1, 2])
    done = np.ones(N, bool)
    return feedback_message(range(N), [1, 2], terminated=done, truncated=~done,
                            episode={"r": np.zeros(N, np.float32), "l": np.ones(N, np.int64), "s": done})


def with_field(message: dict, path: str, value) -> dict:
    """A copy of message with the field at a dotted path set to value (or removed: MISSING)."""
    message = dict(message)
    *parents, last = path.split(".")
    node = message
    for key in parents:
        node[key] = dict(node[key])
        node = node[key]
    if value is MISSING:
        del node[last]
    else:
        node[last] = value
    return message


# --- Runs that the tests of several sections read (one each per test process) ---------------------

DUMMY_FLAGS = ["--algo.learn-every", "250", "--algo.save-every", "2"]


@pytest.fixture(scope="module")
def dummy_run(tmp_path_factory):
    """One dummy run of 2000 steps (a learn every 250, a save every 2 learns) with one client of 4 envs: the
    server in this process, the env client a process of its own (its exit status is the subject)."""
    tmp = tmp_path_factory.mktemp("dummy")
    run_dir, summary, port = tmp / "run", tmp / "summary.json", reserve_port()
    with deadline_of("the dummy run", 180), \
            Background(tmp, "client", ["plugrl_min.py", "env-client", "dummy-v1", "--server-port", str(port),
                                       "--num-episodes", "0", "--num-envs", "4", "--summary-json", str(summary),
                                       "--connect-timeout", "60"]) as client:  # killed on the way out
        server_status, out, err = run_main("dummy-policy", "default", "dummy", "default", "--algo.global-steps",
                                           "2000", *DUMMY_FLAGS, "--port", port, "--run-dir", run_dir)
        client_status = client.wait(60)
    return types.SimpleNamespace(run_dir=run_dir, summary=summary, server_status=server_status,
                                 server_out=out + err, client_status=client_status,
                                 client_out=client.stdout() + client.stderr())


@pytest.fixture(scope="module")
def short_run(tmp_path_factory):
    """One dummy run of 400 frames (a learn every 100, a metrics line per learn), in this process, with one local
    dummy-v1 client of 4 environments: its exit status, output and run directory."""
    run_dir = tmp_path_factory.mktemp("short") / "run"
    with deadline_of("the short run", 120):
        status, out, err = run_main("dummy-policy", "default", "dummy", "default", "--port", "0",
                                    "--algo.global-steps", "400", "--algo.learn-every", "100", "--log-every", "1",
                                    "--local-env-clients", "1", "--local-num-envs", "4", "--run-dir", run_dir)
    return types.SimpleNamespace(status=status, out=out, err=err, run_dir=run_dir,
                                 lines=read_metrics(run_dir, event=None))


@pytest.fixture(scope="module")
def sac_run_logged_every_300(tmp_path_factory):
    """sac on dummy-v1 for 1,000 steps, learning from step 200, a metrics line every 300 steps."""
    run_dir = tmp_path_factory.mktemp("sac-logged") / "run"
    with deadline_of("the sac run", 300):  # subprocess.run kills its child on the way out
        result = python("plugrl_min.py", "dummy-policy", "default", "sac", "default", "--policy.hidden-size",
                        "32", "--algo.q-hidden-size", "32", "--algo.batch-size", "32", "--algo.learning-starts", "200",
                        "--algo.global-steps", "1000", "--log-every", "300", "--local-env-clients", "1", "--seed",
                        "1", "--port", "0", "--run-dir", str(run_dir), timeout=300)
    assert result.returncode == 0, result.stderr
    client = (run_dir / "env-client-1.log").read_text()
    return types.SimpleNamespace(lines=read_metrics(run_dir, None), client=client, stdout=result.stdout)


@pytest.fixture(scope="module")
def two_short_runs(tmp_path_factory) -> list[str]:
    """Two runs of the dummy algorithm on dummy-v1 (4 environments, seeds 1 and 2) side by side,
    6,000 steps each, a metrics line every 300 steps."""
    folder = tmp_path_factory.mktemp("report")
    runs = [str(folder / f"seed{seed}") for seed in (1, 2)]
    processes = [subprocess.Popen([sys.executable, "plugrl_min.py", "dummy-policy", "default", "dummy", "default",
                                   "--algo.learn-every", "100", "--log-every", "300", "--algo.global-steps", "6000",
                                   "--local-env-clients", "1", "--local-num-envs", "4", "--seed", str(seed),
                                   "--port", "0", "--run-dir", run], cwd=HERE, env=subprocess_env(),
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for seed, run in zip((1, 2), runs)]
    try:
        with deadline_of("the two short runs", 180):
            for process in processes:
                assert process.wait() == 0, process.stderr.read()
    finally:  # a run that failed or hung outlives neither its test nor the other run
        for process in processes:
            process.kill()
            process.wait()
    return runs


@pytest.fixture
def earlier_run(two_short_runs, tmp_path):
    """A copy of a finished run directory, and its bytes."""
    run = tmp_path / "earlier"
    shutil.copytree(two_short_runs[0], run)
    return run, folder_bytes(run)


# =============================================================================================
# 1. The loop: without the wire, then the env client's half of it over the wire
# =============================================================================================
# train_in_process: the hooks driven in one process, writing a served run's record, to the same weights.
# run_episodes: one infer per round trip, a decision executed, its feedback sent; the client counts
# what it executed and the episodes it ended (its summary).

# --- The loop without the wire (--in-process): the record of a served run, and the same weights ----------

def tensors_of(tree, prefix="") -> dict:
    """Every tensor of a checkpoint's payload, by its path: {"model/head.weight": tensor, ...}."""
    if isinstance(tree, torch.Tensor):
        return {prefix: tree}
    items = tree.items() if isinstance(tree, dict) else enumerate(tree) if isinstance(tree, list) else ()
    return {path: tensor for key, value in items for path, tensor in tensors_of(value, f"{prefix}/{key}").items()}


def in_process_and_over_the_wire(tmp_path, words: list[str]) -> tuple[dict, dict, dict]:
    """The same run (the same seed, one learn thread) in this process's loop without the wire, behind a server
    with one local client (which reuses observations: reuse-feedback-obs), and behind a server whose one client,
    started by the command it prints, sends every observation whole, side by side: the tensors of each one's
    final checkpoint."""
    runs = {"in-process": ["--in-process"], "wire": ["--local-env-clients", "1"], "whole": ["--port", "0"]}
    processes = {name: subprocess.Popen([sys.executable, SOURCE, *words, *flags, "--seed", "7", "--learn-threads",
                                         "1", "--run-dir", str(tmp_path / name)], cwd=tmp_path, env=subprocess_env(),
                                        stdout=subprocess.PIPE if name == "whole" else subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)
                 for name, flags in runs.items()}
    hint = ""
    while "--num-episodes 0" not in hint:  # its client's command line: the environment and their number
        hint = processes["whole"].stdout.readline()
        assert hint or processes["whole"].poll() is None, processes["whole"].stderr.read()
    client = subprocess.Popen([sys.executable, *hint.split()[1:], "--seed", "7", "--no-reuse-feedback-obs"],
                              cwd=HERE, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for process in [*processes.values(), client]:
        try:
            _, err = process.communicate(timeout=240)
        finally:
            process.kill()  # after a timeout: no run outlives its test
        assert process.returncode == 0, err
    checkpoints = [plugrl_min.checkpoint_paths(tmp_path / name)[-1] for name in runs]
    assert [os.path.basename(path) for path in checkpoints] == [os.path.basename(checkpoints[0])] * 3
    return [tensors_of(torch.load(path, weights_only=True)) for path in checkpoints]


def test_pg_trained_in_process_over_the_wire_and_with_every_observation_whole_ends_on_byte_identical_weights(
        tmp_path):
    in_process, wire, whole = in_process_and_over_the_wire(tmp_path, [
        "dummy-policy", "default", "pg", "default", "--policy.hidden-size", "32", "--local-num-envs", "16",
        "--algo.frames-per-learn", "256", "--algo.global-steps", "1024"])  # 4 learns of 16 environments
    assert in_process.keys() == wire.keys() == whole.keys() and len(in_process) > 20  # policy, value, optimizers
    assert [path for path in in_process if not torch.equal(in_process[path], wire[path])] == []
    assert [path for path in in_process if not torch.equal(in_process[path], whole[path])] == []


def test_sac_trained_in_process_over_the_wire_and_with_every_observation_whole_ends_on_byte_identical_weights(
        tmp_path):
    in_process, wire, whole = in_process_and_over_the_wire(tmp_path, [
        "dummy-policy", "default", "sac", "default", "--policy.hidden-size", "32", "--algo.q-hidden-size", "32",
        "--algo.batch-size", "32", "--algo.learning-starts", "100", "--algo.global-steps", "400"])  # 300 updates
    assert in_process.keys() == wire.keys() == whole.keys() and len(in_process) > 20  # actor, critics, targets
    assert [path for path in in_process if not torch.equal(in_process[path], wire[path])] == []
    assert [path for path in in_process if not torch.equal(in_process[path], whole[path])] == []


def test_an_in_process_run_writes_the_record_a_served_run_writes(tmp_path):
    words = ["dummy-policy", "default", "dummy", "default", "--algo.global-steps", "600", "--algo.learn-every",
             "100", "--algo.save-every", "2", "--log-every", "1", "--local-num-envs", "4", "--seed", "3"]
    in_process = run_main(*words, "--in-process", "--run-dir", tmp_path / "in-process")
    served = run_main(*words, "--local-env-clients", "1", "--run-dir", tmp_path / "served")
    assert in_process[0] == served[0] == 0, in_process[2] + served[2]
    files = {name: {file for file in os.listdir(tmp_path / name) if not file.startswith("events.out.tfevents")}
             for name in ("in-process", "served")}
    assert files["served"] - files["in-process"] == {"env-client-1.log"}  # no client, no client's log
    assert files["in-process"] == {"config.json", "metrics.jsonl", "checkpoints"}
    assert checkpoint_steps(tmp_path / "in-process") == checkpoint_steps(tmp_path / "served") == [200, 400, 600]
    lines = {name: read_metrics(tmp_path / name, event=None) for name in ("in-process", "served")}
    assert [(line["event"], line["step"], sorted(line)) for line in lines["in-process"]] == [
        (line["event"], line["step"], sorted(line)) for line in lines["served"]]
    assert lines["in-process"][-1]["event"] == "end" and "run finished: global step 600" in in_process[1]
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("in-process", "served")]
    assert configs[0] == configs[1] and configs[0]["env"] == "dummy-v1"  # eval reads which environment


def test_in_process_with_local_env_clients_is_a_one_line_usage_error(tmp_path):
    status, out, err = run_main("dummy-policy", "default", "dummy", "default", "--in-process",
                                "--local-env-clients", "1", "--run-dir", tmp_path / "run")
    assert status == 2 and not (tmp_path / "run").exists()
    assert err.strip().splitlines() == ["error: --in-process runs the environments in this process: it takes "
                                        "--local-num-envs, not --local-env-clients"]


# --- One infer per decision, over a real WebSocket, for every closed-loop length K ----------------

def _run_over_the_wire(tmp_path, steps, num_envs, episodes, mode="sum", env_id="dummy-v1"):
    """An in-process server and run_env_client, in one event loop. The server counts its infer calls and keeps
    the reward of every frame fed (counts["rewards"]) and the return and length of every episode the algorithm
    recorded (counts["episodes"]); it is stopped once it has routed every frame the client sent."""
    config = plugrl_min.DummyAlgoConfig(global_steps=10**9)
    algo = plugrl_min.make_algo("dummy", plugrl_min.make_policy("dummy-policy"), config)
    counts = {"infer": 0, "rows": 0, "rewards": [], "episodes": []}
    original_infer, original_feedback = algo.infer, algo.feedback
    original_record = algo.record_episode_metrics

    def counting_infer(obs):
        counts["infer"] += 1
        counts["rows"] += len(obs["states"]["state"])
        return original_infer(obs)

    def keeping_feedback(**frame):
        counts["rewards"].append(np.asarray(frame["reward"]).tolist())
        return original_feedback(**frame)

    def keeping_episodes(episode):  # fed or discarded, every finished episode the server recorded
        counts["episodes"].append((float(episode["r"]), int(episode["l"])))
        original_record(episode)

    algo.infer, algo.feedback, algo.record_episode_metrics = counting_infer, keeping_feedback, keeping_episodes
    server = plugrl_min.Server(algo, str(tmp_path), ("dummy-policy", "dummy"))
    summary_path = tmp_path / "summary.json"

    async def main():
        listening = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(server.run("127.0.0.1", 0, on_listening=listening.set_result))
        done, _ = await asyncio.wait([listening, serving], timeout=10, return_when=asyncio.FIRST_COMPLETED)
        assert listening in done, "the server did not start listening"
        args = argparse.Namespace(
            env_id=env_id, server_host="127.0.0.1", server_port=listening.result(), num_episodes=episodes,
            num_envs=num_envs, seed=0, summary_json=str(summary_path), connect_timeout=10, api_key=None,
            closed_loop_steps=steps, controller="track", reward_aggregation=mode, env_kwargs=None,
            no_reuse_feedback_obs=False)
        try:
            client_status = await asyncio.wait_for(plugrl_min.run_env_client(args), 60)
            # Every action the server sent was answered: its last feedback may still wait to be routed.
            await eventually(lambda: server.frames == counts["rows"], timeout=60)
        finally:
            server.request_stop()
            server_status = await asyncio.wait_for(serving, 30)
        return client_status, server_status

    client_status, server_status = asyncio.run(main())
    assert (client_status, server_status) == (0, 0)
    summary = json.loads(summary_path.read_text())
    return summary, counts, server


@wire
def test_wire_summary_returns_are_the_returns_of_the_episodes_the_server_recorded(wire_run):
    _, num_envs, summary, counts, _ = wire_run
    returns = [episode_return for episode_return, _ in counts["episodes"]]
    assert summary["returns"] == returns  # each episode's return, in the order the episodes ended
    assert summary["episodes"] == len(returns) and 12 <= len(returns) < 12 + num_envs  # 12 asked, the last decision
    assert summary["mean_return"] == pytest.approx(np.mean(returns), rel=1e-9)


@wire
def test_wire_summary_decisions_are_the_frames_the_server_routed(wire_run):
    _, num_envs, summary, counts, server = wire_run
    assert summary["decisions"] == server.frames == counts["rows"] > 0  # each decision of each env: one frame
    assert summary["decisions"] % num_envs == 0


@wire
def test_wire_summary_env_steps_are_the_steps_of_its_episodes(wire_run):
    _, num_envs, summary, counts, _ = wire_run
    lengths = sum(length for _, length in counts["episodes"])
    # Episodes still running when the client stopped add their steps: none with one environment (it stops on
    # an episode's end), fewer than dummy-v1's 50 for each of the others.
    assert 0 <= summary["env_steps"] - lengths <= (num_envs - 1) * (plugrl_min.DummyEnv.max_steps - 1)


WIRE_CASES = [(1, 1), (4, 1), (4, 3), (16, 1)]  # (K, num_envs)


@pytest.fixture(scope="module", params=WIRE_CASES, ids=[f"K{k}-envs{n}" for k, n in WIRE_CASES])
def wire_run(request, tmp_path_factory):
    steps, num_envs = request.param
    with deadline_of(f"the run over the wire, K = {steps}", 150):
        summary, counts, server = _run_over_the_wire(tmp_path_factory.mktemp("wire"), steps, num_envs,
                                                     episodes=12)
    return steps, num_envs, summary, counts, server


@wire
def test_wire_server_infers_once_per_decision(wire_run):
    _, num_envs, summary, counts, server = wire_run
    assert counts["rows"] == summary["decisions"]  # one inferred row per decision of each env
    assert counts["infer"] * num_envs == summary["decisions"]  # one infer() per round trip of the client
    assert server.record.infer_calls == counts["infer"]


@wire
def test_wire_env_steps_are_about_K_per_decision(wire_run):
    steps, _, summary, _, _ = wire_run
    env_steps, decisions, episodes = summary["env_steps"], summary["decisions"], summary["episodes"]
    assert env_steps <= steps * decisions
    # Only the last decision of an episode can be cut short, by at most K - 1 steps.
    assert env_steps >= steps * decisions - (steps - 1) * episodes
    if 1 < steps <= 4:  # episodes (up to 50 steps) are long next to K: roughly K steps a decision
        assert env_steps > (steps - 1) * decisions


class StackSteps(plugrl_min.DummyEnv):
    """dummy-v1 (for the track controller) whose environment 0's episodes last 2 steps and environment 1's 5, the
    action ignored; step t of an episode (from 1) of environment i earns 10 * (i + 1) + t."""

    lengths = np.array([2, 5])

    def _step(self, action, rows):
        t = self.episode_length[rows] + 1  # this step of the episode, counted from 1
        ended = t >= self.lengths[rows]
        return 10.0 * (rows + 1) + t, ended, ended


@pytest.mark.parametrize("mode", ["mean", "last", "stack"])
def test_a_reward_aggregation_other_than_sum_is_refused_over_the_wire_in_one_line_before_a_step(mode):
    executor = MultiAction(plugrl_min.DummyEnv(2), reward_aggregation=mode)
    with pytest.raises(plugrl_min.CommandError, match=f"--reward-aggregation {mode} is not what a feedback's "
                                                      r"rewards mean over the wire \(each decision's sum\): leave it at sum"):
        plugrl_min.check_metadata(metadata_message(), executor, closed_loop=False)


# --- To the end of the run: the page's smoke test (dummy-v1 against dummy) ------------------------

@wire
def test_env_client_exits_0_saying_the_server_ended_the_run(dummy_run):
    assert dummy_run.client_status == 0, dummy_run.client_out
    assert "the server ended the run" in dummy_run.client_out


@wire
def test_summary_json_decisions_and_env_steps_are_the_frames_the_server_routed(dummy_run):
    with open(dummy_run.summary) as file:
        summary = json.load(file)
    end = read_metrics(dummy_run.run_dir, event="end")[0]
    assert summary["decisions"] == end["server/frames"] >= 2000  # each decision's frame routed, stale ones too
    assert summary["env_steps"] == summary["decisions"]  # dummy-policy's actions last one step


@wire
def test_summary_json_episodes_and_returns_are_those_the_server_recorded(dummy_run):
    with open(dummy_run.summary) as file:
        summary = json.load(file)
    lines = read_metrics(dummy_run.run_dir, event=None)
    episodes = sum(line["rollout/episodes"] for line in lines)
    assert summary["episodes"] == len(summary["returns"]) == episodes > 0
    recorded = sum(line["rollout/reward"] * line["rollout/episodes"] for line in lines) / episodes
    assert summary["mean_return"] == pytest.approx(np.mean(summary["returns"]), rel=1e-9)
    assert summary["mean_return"] == pytest.approx(recorded, rel=1e-6)


# --- A connection lost as feedback leaves ----------------------------------------------------

class OneStepEpisodes(plugrl_min.VecEnv):
    """Every episode lasts one physical step (then it is truncated); reward 1 a step."""

    max_steps = 1

    def _reset(self, rows):
        pass

    def _step(self, action, rows):
        return np.ones(len(rows)), np.zeros(len(rows), bool), np.zeros(len(rows), bool)

    def _observe(self):
        return observation(self.num_envs, states={"state": np.zeros((self.num_envs, 3), np.float32)})


class ScriptedServer:
    """The server's end of one connection, as run_episodes sees it (recv and send): the metadata,
    then an action for every infer. lose_feedback: the connection is lost as feedback is sent."""

    def __init__(self, lose_feedback: bool, feedbacks_then_close: int = 1):
        meta = plugrl_min.metadata_of(small_policy(), plugrl_min.obs_spec_of(small_policy().obs_spec),
                                      ("dummy-policy", "dummy"))
        self.replies = [pack_message(meta)]
        self.lose_feedback, self.left = lose_feedback, feedbacks_then_close
        self.feedbacks = []

    async def recv(self):
        if self.left == 0:  # the connection closed after the feedbacks it was to take
            raise websockets.ConnectionClosed(None, None)
        return self.replies.pop(0)

    async def send(self, frame):
        message = unpack_message(frame)
        if message["message_type"] == "infer":
            n = len(message["env_indices"])
            self.replies.append(pack_message(action_message(message["env_indices"],
                                                            np.zeros((n, 1, 1), np.float32))))
        elif self.lose_feedback:
            raise websockets.ConnectionClosed(None, None)
        else:
            self.feedbacks.append(message)
            self.left -= 1


# --- The env client's connection: PlugRL's options, how it stops, a server's text frame (SPEC 1.1, 7.4-7.6) ------

class ServerThread:
    """A WebSocket server written in the test, on its own thread and event loop: `await handler(ws)` per
    connection. The handler may hold its loop (time.sleep), as a server learning on its loop would."""

    def __init__(self, handler):
        self.handler, self.ready, self.port = handler, threading.Event(), None

    async def serve(self):
        self.loop, self.stop = asyncio.get_running_loop(), asyncio.Event()
        async with websockets.asyncio.server.serve(self.handler, "127.0.0.1", 0, compression=None,
                                                   max_size=None) as server:
            self.port = server.sockets[0].getsockname()[1]
            self.ready.set()
            await self.stop.wait()

    def __enter__(self):
        self.thread = threading.Thread(target=asyncio.run, args=(self.serve(),), daemon=True)
        self.thread.start()
        assert self.ready.wait(10), "the test's server did not start"
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(10)


def serving_dummy_v1(hold_at=None, hold=0.0, closes=None, padding=0, text_at=None, done_at=None, resync_at=(),
                     seen=None, features=("reuse-feedback-obs",), reuses=None, obs_spec=True, sizes=None):
    """A handler that answers dummy-v1's infers with zeros (its episodes last 50 decisions): it holds its loop
    for `hold` s before decision `hold_at`, sends a text frame at decision `text_at`, closes 1000 when
    `done_at` decisions were answered (and 1001 plugrl-server-resync when connection k's resync_at[k] were; 0:
    at its first infer),
    pads the metadata with `padding` bytes, appends how the client closed (code, reason) to `closes`, and
    each connection's list of the message types it got to `seen`, and of each message's reuse (an infer's,
    None without one) or done flags (a feedback's) to `reuses`. `features`: what its metadata lists; without
    `obs_spec` it does not say what the policy reads (SPEC 5.1 asks nothing of it), so any environment fits.
    `sizes`: the length of every frame the client sends is appended to it."""
    connections = itertools.count()
    meta = plugrl_min.metadata_of(small_policy(), plugrl_min.obs_spec_of(small_policy().obs_spec),
                                  ("dummy-policy", "dummy"))
    meta["data"]["padding"] = b"\0" * padding  # an extra key, which a client ignores (SPEC 5.1)
    meta["data"]["features"] = list(features)
    if not obs_spec:
        del meta["data"]["obs_spec"]

    async def handler(ws):
        index, kinds = next(connections), []
        if seen is not None:
            seen.append(kinds)
        await ws.send(pack_message(meta))
        decisions = 0
        with contextlib.suppress(websockets.ConnectionClosed):
            async for frame in ws:
                if sizes is not None:
                    sizes.append(len(frame))
                message = unpack_message(frame)
                kinds.append(message["message_type"])
                if reuses is not None:
                    data, reuse = message["data"], message.get("reuse")
                    reuses.append(("infer", None if reuse is None else reuse.tolist()) if kinds[-1] == "infer"
                                  else ("feedback", (data["terminated"] | data["truncated"]).tolist()))
                if message["message_type"] != "infer":
                    continue
                if index < len(resync_at) and resync_at[index] == 0:
                    await ws.close(*RESYNC)  # its first infer refused: no action on this connection
                    break
                if decisions == text_at:
                    await ws.send("Traceback (most recent call last): ...")
                if decisions == hold_at:
                    time.sleep(hold)  # the whole loop held: no pong answers a ping meanwhile
                n = len(message["env_indices"])
                await ws.send(pack_message(action_message(message["env_indices"], np.zeros((n, 1, 1), np.float32))))
                decisions += 1
                if decisions == done_at:
                    await ws.close(1000)
                if index < len(resync_at) and decisions == resync_at[index]:
                    await ws.close(*RESYNC)  # the client holds the feedback of the action just sent
                    break  # what it sent before it read the close is not looked at
        if closes is not None:
            closes.append((ws.close_code, ws.close_reason))
    return handler


def env_client_against(server: ServerThread, *flags, env_id="dummy-v1", num_envs=1) -> int:
    return plugrl_min.env_client_main([env_id, "--server-port", str(server.port), "--num-envs", str(num_envs),
                                       "--seed", "0", *flags])  # seed 0: dummy-v1's first episode lasts 50 decisions


@wire
def test_the_env_client_sends_no_keepalive_ping_so_a_server_holding_its_loop_past_the_ping_timeout_keeps_it(
        monkeypatch, capsys):
    # websockets' keepalive (a ping every 20 s; no pong within 20 s closes the connection) scaled to 0.1 s each,
    # so that a server holding its loop 1.5 s stands for one learning on its loop for minutes. The client must
    # turn it off; left on, the connection closes in the hold and the client reconnects.
    scaled = lambda *args, **kwargs: connect(*args, **{"ping_interval": 0.1, "ping_timeout": 0.1, **kwargs})
    monkeypatch.setattr(plugrl_min, "connect", scaled)
    closes = []
    with ServerThread(serving_dummy_v1(hold_at=2, hold=1.5, closes=closes)) as server:
        status = env_client_against(server, "--num-episodes", "1")
    out, err = capsys.readouterr()
    assert status == 0 and "reconnecting" not in err and out.startswith("done | episodes 1 "), (out, err)
    assert closes == [(1000, "")]


@wire
def test_the_env_client_closes_1000_when_its_episodes_are_done(capsys):
    closes = []
    with ServerThread(serving_dummy_v1(closes=closes)) as server:
        status = env_client_against(server, "--num-episodes", "2")
    assert status == 0 and capsys.readouterr().out.startswith("done | episodes 2 ")
    assert closes == [(1000, "")]  # not 1006: it sent a close frame before dropping the socket


@wire
def test_the_env_client_exits_0_without_reconnecting_when_the_server_closes_1000(capsys):
    closes = []
    with ServerThread(serving_dummy_v1(done_at=5, closes=closes)) as server:
        status = env_client_against(server, "--num-episodes", "0")
    out, err = capsys.readouterr()
    assert status == 0 and out.startswith("the server closed the connection | episodes 0 | ") and err == ""
    assert closes == [(1000, "")]  # one connection


@wire
def test_on_a_resync_the_env_client_reconnects_drops_the_feedback_it_held_and_starts_again_with_an_infer(capsys):
    seen, reuses = [], []
    with ServerThread(serving_dummy_v1(resync_at=[3], seen=seen, reuses=reuses)) as server:
        status = env_client_against(server, "--num-episodes", "1")
    out, err = capsys.readouterr()
    assert status == 0 and out.startswith("done | episodes 1 "), (out, err)
    assert err == "the server asked for a resync (its output says why); reconnecting\n"
    assert seen[0] == ["infer", "feedback"] * 2 + ["infer"]  # the third action's feedback never came
    assert len(seen) == 2 and seen[1][:2] == ["infer", "feedback"]
    assert reuses[2] == ("infer", [True]) and reuses[5] == ("infer", None)  # whole on the new connection


@pytest.mark.parametrize("actions", [0, 1])
@wire
def test_an_env_client_resynced_three_times_in_a_row_each_after_one_action_or_none_gives_up_with_exit_1(
        capsys, actions):
    seen = []
    with ServerThread(serving_dummy_v1(resync_at=[actions] * 10, seen=seen)) as server:
        status = env_client_against(server, "--num-episodes", "0")
    err = capsys.readouterr().err
    assert status == 1 and seen == [["infer"]] * 3, (seen, err)  # closed after its one action, or instead
    assert err.endswith("env-client: the server refused this client's messages 3 times in a row "
                        "(1001 plugrl-server-resync): its output or log says why\n")


@pytest.mark.parametrize("features, flags, reused", [
    (["reuse-feedback-obs"], [], True), ([], [], False), (["reuse-feedback-obs"], ["--no-reuse-feedback-obs"], False)],
    ids=["listed", "not listed", "turned off"])
@wire
def test_the_env_client_reuses_each_row_but_a_new_episodes_only_when_the_server_lists_the_feature(
        capsys, features, flags, reused):
    reuses = []  # probe-v1's three environments end their episodes after 3, 5 and 7 steps: apart
    with ServerThread(serving_dummy_v1(features=features, reuses=reuses, obs_spec=False)) as server:
        status = env_client_against(server, "--num-episodes", "6", *flags, env_id="probe-v1", num_envs=3)
    assert status == 0, capsys.readouterr().err
    infers = [reuse for kind, reuse in reuses if kind == "infer"]
    dones = [done for kind, done in reuses if kind == "feedback"]
    assert infers[0] is None  # a new connection: every observation whole
    assert infers[1:] == [[not ended for ended in done] if reused else None for done in dones][:len(infers) - 1]
    assert [False, True, False] in dones  # one environment ended while the others went on


@wire
def test_a_text_frame_from_the_server_is_fatal_to_the_env_client_never_parsed_nor_retried(capsys):
    closes = []
    with ServerThread(serving_dummy_v1(text_at=3, closes=closes)) as server:
        status = env_client_against(server, "--num-episodes", "0")
    err = capsys.readouterr().err
    assert status == 1 and "reconnecting" not in err and closes == [(1011, "")], err  # one connection, left
    assert "env-client: the server failed: it sent what is not a message (expected a binary frame, got a text " \
           "frame); its output or log says why" in err


@wire
def test_the_env_client_takes_a_frame_of_any_size_from_the_server(capsys):
    with ServerThread(serving_dummy_v1(padding=2**25 + 1)) as server:  # over the server's own cap
        status = env_client_against(server, "--num-episodes", "1")
    assert status == 0 and capsys.readouterr().out.startswith("done | episodes 1 ")


# --- Each message as PlugRL's SPEC (version 1, section 5) lays it out, by a client written here -----------

@wire
def test_the_metadata_is_a_data_map_of_the_specs_keys_and_this_servers_own(tmp_path):
    async def script(port, server):
        client = await Client.connect(port)
        await client.close()
        return client.metadata

    _, metadata = run_server(dummy_algo(small_policy(), 100), tmp_path, script)
    assert metadata.keys() == {"message_type", "data"} and metadata["message_type"] == "metadata"
    data = metadata["data"]
    assert {key: data[key] for key in ("protocol_version", "server", "action_horizon", "action_dim", "features")} == {
        "protocol_version": 1, "server": "plugrl_min", "action_horizon": 1, "action_dim": 1,
        "features": ["reuse-feedback-obs"]}
    assert (data["policy"], data["algorithm"]) == ("dummy-policy", "probe")  # the names run_server serves under
    assert data["num_actions"] is None
    assert data["obs_spec"] == {"states": {"state": [[3], "float32"]}}  # as config.json and --policy.obs-spec spell it


@wire
def test_an_action_is_time_major_with_env_ids_those_of_the_infer_in_its_order_and_its_step_ids_are_never_read(
        tmp_path):
    policy = make_policy("dummy-policy", plugrl_min.DummyPolicyConfig(hidden_size=8, action_horizon=3, action_dim=2))

    async def script(port, server):
        client = await Client.connect(port)
        infer = infer_message([5, 2], step_ids=np.array([2**40, 7], np.int64))
        await client.ws.send(pack_message(infer))
        reply = await client.receive()
        await client.close()
        return reply

    _, reply = run_server(dummy_algo(policy, 100), tmp_path, script)
    assert reply["data"]["env_ids"].tolist() == [5, 2]
    assert reply["data"]["action"].shape == (3, 2, 2)  # [H, n, action_dim]: step first
    assert actions_of(reply).shape == (2, 3, 2) and np.abs(reply["data"]["action"]).max() <= 1


@wire
def test_a_discrete_action_is_h_by_n_on_the_wire(tmp_path):
    policy = make_policy("categorical-policy", plugrl_min.CategoricalPolicyConfig(
        obs_spec={"states": {"state": [[3], "float32"]}}, hidden_size=8))

    async def script(port, server):
        client = await Client.connect(port)
        reply = await client.infer([0, 1, 2, 3], [1, 2, 3, 4])
        await client.close()
        return reply

    _, reply = run_server(dummy_algo(policy, 100), tmp_path, script)
    action = reply["data"]["action"]
    assert action.shape == (1, 4) and action.dtype == np.int64 and set(action.ravel()) <= {0, 1}


class ScriptedChunks(ScriptedServer):
    """A ScriptedServer whose actions are chunks of H steps."""

    def __init__(self, horizon: int):
        super().__init__(lose_feedback=False)
        self.horizon = horizon

    async def send(self, frame):
        message = unpack_message(frame)
        if message["message_type"] == "infer":
            n = len(message["env_indices"])
            self.replies.append(pack_message(action_message(message["env_indices"], np.zeros((n, self.horizon, 1)))))
        else:
            self.feedbacks.append(message)
            self.left -= 1


@wire
def test_a_feedback_sends_each_decisions_rewards_summed_over_the_steps_it_ran_and_step_ids_count_decisions():
    executor = MultiAction(plugrl_min.DummyEnv(2, seed=0))
    executor.reset()
    server, rewards = ScriptedChunks(horizon=3), []
    server.left = 3  # three decisions of three steps
    original = executor.env._step

    def step(action, rows):  # the rewards each step earns, kept
        reward, terminated, success = original(action, rows)
        rewards.append(np.asarray(reward, np.float64))
        return reward, np.zeros(len(rows), bool), success

    executor.env._step = step
    with pytest.raises(websockets.ConnectionClosed):
        asyncio.run(plugrl_min.run_episodes(server, executor, 0, {"returns": [], "env_steps": 0, "decisions": 0}))
    sent = [message["data"]["rewards"] for message in server.feedbacks]
    assert all(r.dtype == np.float32 for r in sent)
    for decision, got in enumerate(sent):
        np.testing.assert_allclose(got, np.sum(rewards[3 * decision:3 * decision + 3], axis=0), rtol=1e-6)
    assert [message["step_ids"].tolist() for message in server.feedbacks] == [[0, 0], [1, 1], [2, 2]]


@wire
def test_an_episode_that_ends_as_the_connection_is_lost_is_reported_once_and_the_next_connection_starts_fresh():
    executor = MultiAction(OneStepEpisodes(1))
    executor.reset()
    tally = {"returns": [], "env_steps": 0, "decisions": 0}
    with pytest.raises(websockets.ConnectionClosed):  # the episode ended; its feedback never left
        asyncio.run(plugrl_min.run_episodes(ScriptedServer(lose_feedback=True), executor, 0, tally))
    again = ScriptedServer(lose_feedback=False)
    with pytest.raises(websockets.ConnectionClosed):
        asyncio.run(plugrl_min.run_episodes(again, executor, 0, tally))
    episode = again.feedbacks[0]["data"]["info"]["episode"]
    assert episode["l"].tolist() == [1] and episode["r"].tolist() == [1.0]  # a new episode, not the old one again
    assert tally["returns"] == [1.0, 1.0]  # each episode counted once, by the client


# =============================================================================================
# 2. The server: one control task between the clients and the algorithm
# =============================================================================================
# Server over real WebSockets, with the instrumented Probe: which frames reach feedback and with what,
# how infer is batched, where learn runs, what becomes of clients that leave or hooks that raise.

# --- reuse-feedback-obs (SPEC 10.1): an observation the last feedback carried is not sent again ---------

def reusing_infer(env_ids, reuse, tags) -> dict:
    """An infer whose rows where reuse is true are the last feedback's: data holds the others' `tags`."""
    return infer_message(env_ids, step_ids=np.zeros(len(env_ids), np.int64), reuse=np.array(reuse, bool),
                         obs=obs_of(tags))


@wire
def test_an_infer_reusing_rows_gives_the_policy_the_last_feedbacks_rows_and_the_new_ones_in_env_indices_order(
        tmp_path):
    async def script(port, server):
        client = await Client.connect(port)
        await client.infer([0, 1, 2], [1, 1, 1])
        await client.feedback([0, 1, 2], [10, 11, 12], terminated=[False, True, False])
        await client.ws.send(pack_message(reusing_infer([2, 1, 0], [True, False, True], [21])))
        reply = await client.receive()  # env 1 ended its episode: its new one's observation comes whole
        await client.close()
        return reply

    _, reply = run_server(Probe(), tmp_path, script)
    assert actions_of(reply)[:, 0, 0].tolist() == [12.0, 21.0, 10.0]  # Probe acts its observation's tag


@pytest.mark.parametrize("case", ["a new connection", "after its episode ended", "another connection's"])
@wire
def test_a_reuse_of_an_observation_the_server_does_not_hold_closes_for_a_resync(tmp_path, capsys, case):
    async def script(port, server):
        client = await Client.connect(port)
        if case != "a new connection":
            await client.step([0], [1], terminated=[case == "after its episode ended"])
        if case == "another connection's":
            client = await Client.connect(port)
        await client.ws.send(pack_message(reusing_infer([0], [True], [])))
        return await refusal_of(client.ws)

    _, refusal = run_server(Probe(), tmp_path, script)
    assert refusal == Refusal(None, *RESYNC)
    [(_, why, _)] = resyncs_logged(capsys.readouterr().err)
    assert why == "infer.reuse: environment 0 has no observation to reuse on this connection"


@pytest.mark.parametrize("ended", [False, True], ids=["its row", "none after its episode ended"])
@wire
def test_a_reuse_takes_the_row_of_the_last_feedback_that_named_the_environment_even_one_not_stored(
        tmp_path, capsys, ended):
    async def script(port, server):
        client = await Client.connect(port)
        await client.step([0], [10])
        await client.infer([1], [11])
        await client.feedback([0, 1], [20, 21], terminated=[ended, False])  # env 0 owed none: not stored
        await client.ws.send(pack_message(reusing_infer([0, 1], [True, True], [])))
        return await (refusal_of(client.ws) if ended else client.receive())

    _, reply = run_server(Probe(), tmp_path, script)
    if ended:  # that row ended the episode: there is nothing to reuse
        assert reply == Refusal(None, *RESYNC) and len(resyncs_logged(capsys.readouterr().err)) == 1
    else:
        assert actions_of(reply)[:, 0, 0].tolist() == [20.0, 21.0]


@contract
def test_an_infer_reusing_every_row_may_send_its_empty_text_as_numpy_makes_it_a_float64_array():
    message = reusing_infer([0, 1], [True, True], [])
    message["data"]["text"] = np.asarray(["probe"] * 0)  # float64 [0]: no str to tell its kind
    plugrl_min.check_message(message, plugrl_min.obs_spec_of(small_policy().obs_spec))
    assert message["data"]["text"].dtype.kind == "U" and message["data"]["text"].shape == (0,)


@contract
def test_an_infer_whose_data_rows_are_not_its_false_reuse_rows_is_refused():
    message = reusing_infer([0, 1], [True, False], [1, 2])  # one row not reused, two rows sent
    with pytest.raises(ProtocolError, match=re.escape("infer.data.states.state must be float32 [1, 3]; got float32 [2, 3]")):
        plugrl_min.check_message(message, plugrl_min.obs_spec_of(small_policy().obs_spec))


# --- Routing: which frames go to feedback, with what ----------------------------------------------

def run_three_clients(algo, run_dir, rounds=30):
    """Three clients (2, 3 and 4 environments) at uneven paces, `rounds` decisions each; returns the frames sent.

    With the same traffic, the off-policy test below sees frames whose action came from an older policy.
    """
    rng = np.random.default_rng(0)

    async def script(port, server):
        sent = sum(await asyncio.gather(*(run_rounds(port, tags, rounds, think=lambda: rng.uniform(0, 0.01))
                                          for tags in ([1, 2], [11, 12, 13], [21, 22, 23, 24]))))
        await eventually(lambda: len(algo.frames) + algo.discarded == sent)
        return sent

    return run_server(algo, run_dir, script)[1]


@contract
@wire
def test_on_policy_algorithm_is_never_fed_a_frame_from_an_older_policy(tmp_path):
    class OnPolicy(Probe):
        on_policy = True
        learn_every = 5

    algo = OnPolicy()
    sent = run_three_clients(algo, tmp_path)
    assert algo.learns >= 5 and algo.frames
    assert algo.stale == 0  # every stored frame's action came from the current policy version
    assert algo.discarded > 0 and len(algo.frames) + algo.discarded == sent


@contract
@wire
def test_off_policy_algorithm_is_fed_every_frame(tmp_path):
    class OffPolicy(Probe):
        on_policy = False
        learn_every = 5

    algo = OffPolicy()
    sent = run_three_clients(algo, tmp_path)
    assert algo.learns >= 5
    assert len(algo.frames) == sent and algo.discarded == 0
    assert algo.stale > 0  # including frames whose action came from an older policy version


@contract
@wire
def test_feedback_terminated_is_the_previous_frames_flag_and_next_terminated_this_ones(tmp_path):
    flags = [(False, False), (True, False), (False, False), (False, True), (True, False), (False, False)]
    algo = Probe()

    async def script(port, server):
        client = await Client.connect(port)
        for terminated, truncated in flags:
            await client.step([0], [1], terminated=[terminated], truncated=[truncated])
        await eventually(lambda: len(algo.frames) == len(flags))

    run_server(algo, tmp_path, script)
    got = [(f["terminated"], f["truncated"], f["next_terminated"], f["next_truncated"]) for f in algo.frames]
    previous = [(False, False)] + flags[:-1]
    assert got == [(*before, *now) for before, now in zip(previous, flags)]


@contract
@wire
def test_feedback_gets_the_obs_it_acted_on_next_obs_and_reward(tmp_path):
    algo = Probe()

    async def script(port, server):
        client = await Client.connect(port)
        await client.infer([0], [1])
        await client.feedback([0], [2], reward=[0.25])
        await eventually(lambda: len(algo.frames) == 1)

    run_server(algo, tmp_path, script)
    (frame,) = algo.frames
    assert frame["obs"]["states"]["state"][0] == 1 and frame["next_obs"]["states"]["state"][0] == 2 and frame["reward"] == 0.25


# --- Routing: prev_node chains each environment's stored frames -----------------------------------

@contract
@wire
def test_prev_node_comes_back_to_the_same_environment(tmp_path):
    class ReturnsNodes(Probe):
        def next_node(self, frame):  # an environment-specific counter
            tag = int(frame["runtime_state"]["tag"])
            return (1000 * tag + sum(int(f["runtime_state"]["tag"]) == tag for f in self.frames), "x")

    algo = ReturnsNodes()

    async def script(port, server):  # two clients with the same env indices 0 and 1, four environments
        await asyncio.gather(run_rounds(port, [1, 2], 4), run_rounds(port, [3, 4], 4))
        await eventually(lambda: len(algo.frames) == 16)

    run_server(algo, tmp_path, script)
    for tag in (1, 2, 3, 4):
        nodes = [f["prev_node"] for f in algo.frames if int(f["runtime_state"]["tag"]) == tag]
        assert nodes == [(-1, "")] + [(1000 * tag + k, "x") for k in (1, 2, 3)]


class ChainsFrames(Probe):
    """On-policy, a learn every 6 stored frames; each stored frame's node is (its index, "chain").

    Clients send info["tag"], so discard_feedback can note whose frame it was.
    """

    on_policy = True
    learn_every = 6

    def next_node(self, frame):
        return (len(self.frames) - 1, "chain")

    def discard_feedback(self, *, info, next_terminated, next_truncated):
        self.events.append(("discard", float(info["tag"])))
        super().discard_feedback(info=info, next_terminated=next_terminated,
                                 next_truncated=next_truncated)


@contract
@wire
def test_after_a_discarded_frame_the_next_stored_frame_of_that_environment_gets_no_prev_node(tmp_path):
    algo = ChainsFrames()

    async def script(port, server):  # two clients at different paces: learns make stale frames
        rng = np.random.default_rng(0)
        await asyncio.gather(run_rounds(port, [1, 2], 20, think=lambda: rng.uniform(0, 0.01),
                                        extra_info={"tag": [1.0, 2.0]}),
                             run_rounds(port, [3], 30, think=lambda: rng.uniform(0, 0.01),
                                        extra_info={"tag": [3.0]}))
        await eventually(lambda: len(algo.frames) + algo.discarded == 70)

    run_server(algo, tmp_path, script)
    assert algo.discarded > 0 and algo.learns >= 3
    previous = {}  # tag -> node of that environment's previous frame; None if it was discarded
    fed = 0
    restarts = 0
    for kind, tag in (event for event in algo.events if event[0] in ("feedback", "discard")):
        if kind == "discard":
            previous[tag] = None
            continue
        # The node of the environment's previous frame if it was stored, else (-1, ""): a
        # chain never reaches back over a discarded frame.
        expected = previous.get(tag) or (-1, "")
        assert algo.frames[fed]["prev_node"] == expected, (fed, tag)
        restarts += expected == (-1, "")
        previous[tag] = (fed, "chain")
        fed += 1
    assert restarts > 3  # the three first frames, and at least one after a discard


@contract
@wire
def test_prev_node_continues_across_an_episode_end(tmp_path):
    algo = ChainsFrames()
    algo.learn_every = None

    async def script(port, server):
        client = await Client.connect(port)
        await client.step([0], [1])
        await client.step([0], [1], terminated=[True])  # the episode ends here
        await client.step([0], [1])  # the next episode's first frame
        await eventually(lambda: len(algo.frames) == 3)
        await client.close()

    run_server(algo, tmp_path, script)
    assert [frame["prev_node"] for frame in algo.frames] == [(-1, ""), (0, "chain"), (1, "chain")]
    assert [frame["terminated"] for frame in algo.frames] == [False, False, True]


@contract
@wire
def test_a_new_connections_environments_start_with_no_prev_node(tmp_path):
    algo = ChainsFrames()
    algo.learn_every = None

    async def script(port, server):
        for _ in range(2):  # the same environment index, on two connections one after the other
            client = await Client.connect(port)
            await client.step([0], [1])
            await client.step([0], [1])
            await client.close()
        await eventually(lambda: len(algo.frames) == 4)

    run_server(algo, tmp_path, script)
    assert [frame["prev_node"] for frame in algo.frames] == [(-1, ""), (0, "chain"),
                                                             (-1, ""), (2, "chain")]


# --- Routing: infer batched across clients, learn on its own thread, should_stop ends the run -----

class SlowLearner(Probe):
    """Learns once every environment of the three clients (1 + 2 + 3) has fed back, until the test releases it."""

    learn_every = 6
    held = True


def run_queued_clients(run_dir):
    """Three clients feed back, then ask for actions while the server learns; returns (algo, tag sets, replies)."""
    algo = SlowLearner()
    tag_sets = ([1], [2, 3], [4, 5, 6])
    fed_back = asyncio.Barrier(len(tag_sets))

    async def one_client(port, tags):
        client = await Client.connect(port)
        env_ids = list(range(len(tags)))
        await client.step(env_ids, tags)
        await fed_back.wait()
        await eventually(lambda: algo.learning)  # the next infers queue up
        reply = await client.infer(env_ids, tags)
        await client.close()
        return reply

    async def release_once_every_infer_waits(server):
        # Each client's infer queued while learn() runs; the feedbacks before them may still be queued too.
        infers = lambda: sum(isinstance(item, plugrl_min.InferRequest) for item in server.inbox)
        await eventually(lambda: infers() == len(tag_sets), timeout=60)
        algo.released.set()

    async def script(port, server):
        *replies, _ = await asyncio.gather(*(one_client(port, tags) for tags in tag_sets),
                                           release_once_every_infer_waits(server))
        return replies

    return algo, tag_sets, run_server(algo, run_dir, script)[1]


@contract
@wire
def test_clients_waiting_during_learn_are_served_by_one_infer_call(tmp_path):
    algo, _, _ = run_queued_clients(tmp_path)
    learned = algo.events.index(("learn",))
    assert algo.events[learned + 1] == ("infer", [1, 2, 3, 4, 5, 6])


@contract
@wire
def test_a_batched_infers_actions_are_split_back_to_their_clients(tmp_path):
    algo, tag_sets, replies = run_queued_clients(tmp_path)
    for tags, reply in zip(tag_sets, replies):
        assert env_ids_of(reply) == list(range(len(tags)))
        assert actions_of(reply).shape == (len(tags), 1, 1) and actions_of(reply)[:, 0, 0].tolist() == tags


@contract
@wire
def test_learn_runs_in_a_worker_thread_while_the_server_keeps_answering(tmp_path):
    class LearnsUntilReleased(Probe):
        learn_every = 1
        held = True

    algo = LearnsUntilReleased()

    async def script(port, server):
        first = await Client.connect(port)
        await first.step([0], [1])  # starts a learn that lasts until the test releases it
        await eventually(lambda: algo.learning)
        second = await Client.connect(port)  # handshake and metadata while learn() runs
        answered_while_learning = algo.learning and algo.learns == 0
        algo.released.set()
        await eventually(lambda: algo.learns == 1)
        await first.close()
        await second.close()
        return answered_while_learning, second.metadata

    _, (answered_while_learning, metadata) = run_server(algo, tmp_path, script)
    assert answered_while_learning and metadata["message_type"] == "metadata"
    assert algo.learn_threads and algo.learn_threads[0] is not threading.main_thread()


@contract
@wire
def test_should_stop_closes_every_client_with_run_finished_and_run_returns_0(tmp_path):
    class StopsAtTen(Probe):
        def should_stop(self):
            return self.global_step >= 10

    async def until_closed(port, tags):
        client = await Client.connect(port)
        try:
            while True:
                await client.step(list(range(len(tags))), tags)
        except websockets.ConnectionClosed:
            return client.ws.close_code, client.ws.close_reason

    async def script(port, server):
        return await asyncio.gather(until_closed(port, [1]), until_closed(port, [2, 3]))

    algo = StopsAtTen()
    status, closes = run_server(algo, tmp_path, script)
    assert status == 0 and closes == [RUN_END, RUN_END]
    assert algo.global_step >= 10 and algo.checkpoints == 1  # the final checkpoint


# --- Clients that leave, at any point: nothing lost, nothing stored twice -------------------------

class StopsAtN(Probe):
    """Off-policy, stores every frame, stops when global_step reaches n (BaseAlgorithm.should_stop)."""

    def __init__(self, n):
        super().__init__()
        self.config.global_steps = n


MID_EPISODE_FRAMES = 3


async def hang_up(client: Client, abort: bool) -> None:
    """Leave: a clean close handshake, or a dropped TCP connection (what a killed process leaves)."""
    if abort:
        client.ws.transport.abort()
    else:
        await client.close()


async def leave_after_metadata(port, tag, abort) -> int:
    await hang_up(await Client.connect(port), abort)
    return 0


async def leave_after_infer_before_action(port, tag, abort) -> int:
    client = await Client.connect(port)
    await client.ws.send(pack_message(infer_message((0,), [tag])))
    await hang_up(client, abort)
    return 0


async def leave_after_action_before_feedback(port, tag, abort) -> int:
    client = await Client.connect(port)
    await client.infer([0, 1], [tag, tag])
    await hang_up(client, abort)
    return 0


async def leave_mid_episode_owing_feedback(port, tag, abort) -> int:
    """A few complete decisions of an episode, then gone while it owes feedback for the next one."""
    client = await Client.connect(port)
    for _ in range(MID_EPISODE_FRAMES):
        await client.step([0], [tag])
    await client.infer([0], [tag])  # its action proves the server read every feedback before it
    await hang_up(client, abort)
    return MID_EPISODE_FRAMES


async def leave_mid_episode_right_after_a_feedback(port, tag, abort) -> int:
    """A few complete decisions of an episode, the last feedback sent just before the close: all of them count."""
    client = await Client.connect(port)
    for _ in range(MID_EPISODE_FRAMES):
        await client.step([0], [tag])
    await hang_up(client, abort)
    return MID_EPISODE_FRAMES


# Every point of the exchange, each left with a clean close and with a dropped connection; except right after a
# feedback, where only a clean close guarantees that the frame (a complete message, so it is stored) got there.
DISCONNECTS = [(leave, abort) for leave in (leave_after_metadata, leave_after_infer_before_action,
                                            leave_after_action_before_feedback, leave_mid_episode_owing_feedback)
               for abort in (False, True)] + [(leave_mid_episode_right_after_a_feedback, False)]


@wire
def test_clients_that_disconnect_at_every_point_lose_and_duplicate_nothing(tmp_path):
    repeats, concurrent_frames = 6, 300  # 9 ways to leave x 6 = 54 disconnecting clients
    disconnecting = DISCONNECTS * repeats
    left_frames = MID_EPISODE_FRAMES * sum(leave.__name__.startswith("leave_mid_episode") for leave, _ in disconnecting)
    n = left_frames + concurrent_frames + 200
    algo = StopsAtN(n)
    sent = {}

    async def good_client(port, disconnects_done):
        """Trains alongside the disconnecting clients, then on until the run is over."""
        client, fed = await Client.connect(port), 0
        try:
            while True:
                if fed == concurrent_frames:  # the last frames come after every disconnect
                    await asyncio.wait_for(disconnects_done.wait(), 30)
                await client.step([0], [1])
                fed += 1
        except websockets.ConnectionClosed:
            return fed, client.ws.close_reason

    async def script(port, server):
        done = asyncio.Event()
        good = asyncio.create_task(good_client(port, done))
        for wave in range(0, len(disconnecting), 18):
            tags = range(100 + wave, 100 + wave + 18)
            fed = await asyncio.gather(*(leave(port, tag, abort)
                                         for tag, (leave, abort) in zip(tags, disconnecting[wave:wave + 18])))
            sent.update(zip(tags, fed))
        await eventually(lambda: len(server.connections) == 1)  # only the good client is left
        done.set()
        return await good

    status, (good_fed, reason) = run_server(algo, tmp_path, script)
    stored = collections.Counter(float(frame["runtime_state"]["tag"]) for frame in algo.frames)
    assert status == 0 and reason == RUN_END[1]
    assert algo.global_step == len(algo.frames) == n
    assert good_fed == n - left_frames
    assert stored == {1.0: good_fed, **{float(tag): fed for tag, fed in sent.items() if fed}}  # none twice
    assert all(frame["obs"]["states"]["state"][0] == frame["next_obs"]["states"]["state"][0] for frame in algo.frames)  # none half


@wire
def test_a_feedback_sent_just_before_leaving_is_stored_even_when_the_server_reads_it_after_the_close(tmp_path):
    algo = LearnsOnceAfterTheFirstFrame()

    async def script(port, server):
        learner, leaving = await Client.connect(port), await Client.connect(port)
        await leaving.infer([0], [2])
        await learner.step([0], [1])  # starts the learn: feedback is queued until it ends
        await eventually(lambda: algo.learning)
        await leaving.feedback([0], [2])
        await leaving.close()  # gone before the server routes its last, complete frame
        await eventually(lambda: len(server.connections) == 1)
        assert algo.learning  # the connection is gone and its last frame not yet routed
        algo.released.set()
        await eventually(lambda: algo.learns == 1 and not algo.learning)
        await learner.infer([0], [1])  # one more pass of the server loop
        await learner.close()

    run_server(algo, tmp_path, script)
    assert sorted(float(frame["runtime_state"]["tag"]) for frame in algo.frames) == [1.0, 2.0]


class HoldsTheLateClient(plugrl_min.Server):
    """Holds the second client until the run has ended (its control loop returned): in its
    handshake (hold="handshake"), or with the handshake done, before its handler runs ("open")."""

    hold = "handshake"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.ended = asyncio.Event()
        self.arrived = {"handshake": 0, "open": 0}

    async def hold_handshake(self, connection, request):  # the API key check's place in the handshake
        self.arrived["handshake"] += 1
        if self.hold == "handshake" and self.arrived["handshake"] == 2:
            await self.ended.wait()
        return None

    async def handle_client(self, ws):
        self.arrived["open"] += 1
        if self.hold == "open" and self.arrived["open"] == 2:
            await self.ended.wait()
        await super().handle_client(ws)

    async def control_loop(self):
        await super().control_loop()
        self.ended.set()


def run_with_a_late_client(tmp_path, hold):
    """A first client stops the run (should_stop after 2 frames) while a second one is held."""
    class StopsAfterTwoFrames(Probe):
        def should_stop(self):
            return self.global_step >= 2

    async def main():
        server = HoldsTheLateClient(StopsAfterTwoFrames(), str(tmp_path), ("dummy-policy", "probe"))
        server.hold = hold
        ports = asyncio.Queue()
        with unittest.mock.patch.object(plugrl_min, "api_key_check", lambda api_key: server.hold_handshake):
            run = asyncio.create_task(server.run("127.0.0.1", 0, on_listening=ports.put_nowait))
            port = await ports.get()
        first = await Client.connect(port)
        late = asyncio.create_task(env_client_in_process("dummy-v1", "--server-port", port, "--num-episodes", "0"))
        await eventually(lambda: server.arrived[hold] == 2)  # the late client is held there
        await first.step([0], [1])
        await first.step([0], [1])
        status = await asyncio.wait_for(run, 30)
        return status, await first.closed(), await late

    return asyncio.run(main())


@pytest.mark.parametrize("hold", ["handshake", "open"])
@wire
def test_a_client_that_arrives_as_the_run_ends_is_told_the_run_finished_and_exits_0(tmp_path, hold, capsys):
    status, closed, late_status = run_with_a_late_client(tmp_path, hold)
    late_output = capsys.readouterr().out
    assert status == 0 and closed == RUN_END
    assert late_status == 0 and "the server ended the run |" in late_output, late_output


# --- A hook that raises: every client told "server failed", run() returns 1, no checkpoint --------

@pytest.mark.parametrize("hook", ["infer", "feedback", "learn_impl", "create_checkpoint"])
@wire
def test_an_exception_in_a_hook_tells_every_client_the_server_failed_and_run_returns_1(tmp_path, capsys, hook):
    status, closes = run_server(Faulty(hook), tmp_path, two_clients_until_closed)
    assert status == 1
    assert closes == (hook_failed("RuntimeError"), hook_failed("RuntimeError"))
    log = capsys.readouterr().err
    assert "Traceback (most recent call last)" in log and f"RuntimeError: deliberate fault in {hook}" in log


class FaultyLater(Faulty):
    """Raises in infer or feedback once a frame was stored (so the stop would save), never learns."""

    learn_every = None

    def maybe_fail(self, hook):
        if self.fault == hook and self.global_step >= 1:
            raise RuntimeError(f"deliberate fault in {hook}")


async def two_decisions_until_closed(port, server):
    """One client makes two decisions and asks for a third, until the server closes it."""
    client = await Client.connect(port)
    with contextlib.suppress(websockets.ConnectionClosed):
        await client.step([0], [1])
        await client.step([0], [1])
        await client.infer([0], [1])
    return await client.closed()


@pytest.mark.parametrize("hook", ["learn_impl", "create_checkpoint"])
@wire
def test_an_exception_in_a_hook_writes_no_checkpoint(tmp_path, hook):
    run_server(Faulty(hook), tmp_path, two_clients_until_closed)
    assert checkpoint_steps(tmp_path) == []


@pytest.mark.parametrize("hook", ["infer", "feedback"])
@wire
def test_an_exception_in_infer_or_feedback_after_a_stored_frame_writes_no_final_checkpoint(tmp_path, hook):
    algo = FaultyLater(hook)
    status, closed = run_server(algo, tmp_path, two_decisions_until_closed)
    assert (status, closed, algo.global_step) == (1, hook_failed("RuntimeError"), 1)  # a stop would save it
    assert checkpoint_steps(tmp_path) == []


FAILS_IN_LEARN = '''
import dataclasses
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config


@register_algo_config("fails-in-learn")
@dataclasses.dataclass
class FailsInLearnConfig(DummyAlgoConfig):
    learn_every: int = 50
    save_every: int = 1


@register_algo("fails-in-learn")
class FailsInLearn(DummyAlgorithm):
    def learn_impl(self):
        raise RuntimeError("deliberate failure in learn_impl")
'''


@wire
def test_an_algorithm_that_raises_in_learn_exits_1_and_its_client_exits_saying_the_server_failed(tmp_path, capsys):
    write_plugin(tmp_path, "plugrl_test_fails_in_learn", FAILS_IN_LEARN)
    run_dir = tmp_path / "run"
    with Background(tmp_path, "server", ["plugrl_min.py", "dummy-policy", "default", "fails-in-learn", "default",
                                         "--port", "0", "--run-dir", str(run_dir), "--plugin", "plugrl_test_fails_in_learn"],
                    pythonpath=tmp_path) as server:  # a process, for its exit status; the client runs in this one
        client_status = plugrl_min.env_client_main(env_client_args(server.port(), "--num-episodes", "0")[2:])
        server_status = server.wait(60)
    assert server_status == 1, server.stdout() + server.stderr()
    assert "Traceback" in server.stderr() and "RuntimeError: deliberate failure in learn_impl" in server.stderr()
    assert client_status == 1 and f"the server failed (1011 {hook_failed('RuntimeError')[1]})" in capsys.readouterr().err
    assert checkpoint_steps(run_dir) == []


# --- save: this run's three newest checkpoints are kept -------------------------------------------

@wire
def test_pruning_keeps_this_runs_three_newest_checkpoints_and_deletes_no_other(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "checkpoints").mkdir(parents=True)
    foreign = [10**9 + i for i in range(3)]  # higher steps than this run reaches: they sort last
    for step in foreign:
        (run_dir / "checkpoints" / f"step_{step:012d}.pt").write_bytes(b"another run's checkpoint")
    algo = make_algo("dummy", small_policy(), plugrl_min.DummyAlgoConfig(global_steps=None, learn_every=100,
                                                                          save_every=1))
    status, _ = run_server(algo, run_dir, lambda port, server: run_rounds(port, [0.5], 600))
    assert status == 0 and checkpoint_steps(run_dir) == [400, 500, 600, *foreign]
    assert all((run_dir / "checkpoints" / f"step_{step:012d}.pt").read_bytes() == b"another run's checkpoint"
               for step in foreign)


def test_an_old_checkpoint_that_cannot_be_pruned_is_named_in_one_line(tmp_path):
    server = plugrl_min.Server(dummy_algo(small_policy(), 1000), str(tmp_path), ("dummy-policy", "dummy"))
    old = tmp_path / "checkpoints" / "step_000000000001.pt"
    old.mkdir(parents=True)  # what os.remove cannot remove, even as root
    server.saved = [str(old), str(tmp_path / "b"), str(tmp_path / "c")]  # the fourth save prunes the first
    with pytest.raises(plugrl_min.CommandError, match=re.escape(f"cannot remove the old checkpoint {old}: ")):
        server.save()


# --- run: the listening line ----------------------------------------------------------------------

@pytest.mark.parametrize("host, url_host", [("0.0.0.0", "0.0.0.0"), ("::", "[::]")])
def test_the_listening_line_is_a_url_a_tool_can_read(tmp_path, capsys, host, url_host):
    if host == "::" and not socket.has_ipv6:
        pytest.skip("this Python was built without IPv6")

    async def main():
        server = plugrl_min.Server(dummy_algo(small_policy(), None), str(tmp_path), ("dummy-policy", "dummy"))
        ports = asyncio.Queue()
        task = asyncio.create_task(server.run(host, 0, on_listening=ports.put_nowait))
        port = await asyncio.wait_for(ports.get(), 10)
        server.request_stop()
        await asyncio.wait_for(task, 15)
        return port

    port = asyncio.run(main())
    url = re.search(r"listening on (\S+)", capsys.readouterr().out).group(1)
    assert url == f"ws://{url_host}:{port}"
    assert urllib.parse.urlsplit(url).port == port


class RefusesAnEmptyBatch(Probe):
    def infer(self, obs):
        assert len(obs["states"]["state"]) > 0, "infer called for no environment"
        return super().infer(obs)


@wire
def test_an_infer_for_no_environment_is_answered_without_calling_the_algorithms_infer(tmp_path):
    algo = RefusesAnEmptyBatch()

    async def script(port, server):
        client = await Client.connect(port)
        await client.ws.send(pack_message(infer_message([], [])))
        empty = await client.receive()
        await client.feedback([], [])  # its turn: one feedback after every action, even an empty one
        step = await client.step([0], [1])  # the connection still works, the run too
        await eventually(lambda: len(algo.frames) == 1)
        await client.close()
        return empty, step

    status, (empty, step) = run_server(algo, tmp_path, script)
    assert actions_of(empty).shape == (0, 1, 1) and actions_of(step).shape == (1, 1, 1) and status == 0
    assert [event for event in algo.events if event[0] == "infer"] == [("infer", [1.0])]


# =============================================================================================
# 3. A checkpoint on disk, and what SIGINT and SIGTERM do
# =============================================================================================
# save_checkpoint's atomic writes, --resume, and signals as a terminal, timeout, docker or a launcher
# send them: a final checkpoint and exit 0; a second request while the final save runs: exit 130.

# --- Stop and resume: a signal saves and exits 0; atomic checkpoints; --resume restores every counter ---

STOPPED_AT = 351  # 3 learns (at steps 100, 200, 300), then 51 more frames


@pytest.fixture(scope="module")
def stopped_run(tmp_path_factory):
    """A dummy run (a learn every 100 frames, a save every learn) stopped by SIGTERM at step 351, mid-decision."""
    tmp = tmp_path_factory.mktemp("stopped")
    run_dir = tmp / "run"
    with deadline_of("the stopped run", 120), \
            Background(tmp, "server", dummy_server(run_dir, "--algo.global-steps", "1000000000")) as server:
        fed, closed = asyncio.run(feed(server.port(), STOPPED_AT, then=lambda: server.proc.send_signal(signal.SIGTERM)))
        status = server.wait(30)
    return types.SimpleNamespace(run_dir=run_dir, fed=fed, closed=closed, status=status, out=server.stdout(),
                                 err=server.stderr())


@contract
@wire
def test_sigterm_writes_a_final_checkpoint_tells_the_clients_and_exits_0(stopped_run):
    assert stopped_run.status == 0, stopped_run.err
    assert stopped_run.closed == RUN_END
    assert "run finished: global step 351, 3 learns" in stopped_run.out
    assert checkpoint_steps(stopped_run.run_dir) == [200, 300, 351]


@contract
@wire
def test_the_final_checkpoint_holds_every_counter(stopped_run):
    payload = torch.load(stopped_run.run_dir / "checkpoints" / "step_000000000351.pt", weights_only=True)
    assert payload["step"] == 351 and payload["server"]["global_step"] == 351
    assert payload["server"]["policy_version"] == 3 and payload["server"]["frames"] == 351
    assert payload["meta"] == {"learns": 3, "saved_at_learn": 3, "frames_since_learn": 51}


@contract
@wire
def test_the_server_binds_loopback_by_default_and_warns_about_nothing(stopped_run):
    assert "listening on ws://127.0.0.1:" in stopped_run.out
    assert "warning" not in stopped_run.err


@contract
@wire
def test_resume_continues_the_global_step_learn_cadence_and_save_cadence_exactly(stopped_run, tmp_path):
    run_dir, port = tmp_path / "run", reserve_port()
    shutil.copytree(stopped_run.run_dir, run_dir)
    client, fed = in_a_thread(asyncio.run, feed(port))  # the resumed server in this process: no signal to send it
    status, out, err = run_main(*dummy_server(run_dir, "--algo.global-steps", "600", "--resume", port=port)[1:])
    client.join(30)
    assert status == 0 and "resumed from step 351" in out, err
    assert fed == [(600 - 351, RUN_END)]  # the global step went on from 351
    resumed = read_metrics(run_dir)[3:]
    assert [line["step"] for line in resumed] == [400, 500, 600]  # learns on the cadence, not at 451, 551
    assert [line["server/policy_version"] for line in resumed] == [4, 5, 6]  # the server's counters came back
    assert checkpoint_steps(run_dir) == [400, 500, 600]  # a save every learn, as before the stop
    payload = torch.load(run_dir / "checkpoints" / "step_000000000600.pt", weights_only=True)
    assert payload["meta"] == {"learns": 6, "saved_at_learn": 6, "frames_since_learn": 0}  # and the dummy's, from meta


@contract
@wire
def test_sigint_writes_a_final_checkpoint_tells_the_clients_and_exits_0(tmp_path):
    run_dir = tmp_path / "run"
    with Background(tmp_path, "server", dummy_server(run_dir)) as server:
        fed, closed = asyncio.run(feed(server.port(), 42, then=lambda: server.proc.send_signal(signal.SIGINT)))
        status = server.wait(30)
    assert status == 0 and closed == RUN_END, server.stderr()
    assert checkpoint_steps(run_dir) == [42]


def save_three(run_dir) -> None:
    policy = small_policy()
    for learns in (1, 2, 3):
        save_checkpoint(str(run_dir), Checkpoint(100 * learns, policy.state_dict(), None, {"learns": learns}),
                        {"global_step": 100 * learns, "policy_version": learns})


@contract
def test_a_checkpoint_cut_short_by_a_crash_is_skipped_for_the_one_before(tmp_path, capsys):
    save_three(tmp_path)
    newest = tmp_path / "checkpoints" / "step_000000000300.pt"
    newest.write_bytes(newest.read_bytes()[:newest.stat().st_size // 2])
    checkpoint, server = load_newest_checkpoint(str(tmp_path))
    assert checkpoint.step == 200 and checkpoint.meta == {"learns": 2}
    assert server == {"global_step": 200, "policy_version": 2}
    assert "skipping damaged checkpoint" in capsys.readouterr().err


@contract
def test_a_save_killed_midway_through_the_file_leaves_the_last_good_checkpoint_the_newest(tmp_path, monkeypatch):
    save_three(tmp_path)

    class KilledMidWrite(io.FileIO):
        """A file that takes half of what it is given, then its process dies (the crash comes
        after the file exists on disk, half written)."""

        def write(self, data):
            super().write(bytes(data)[:len(data) // 2])
            raise KeyboardInterrupt

    monkeypatch.setattr(plugrl_min, "open", lambda path, mode: KilledMidWrite(path, "w"), raising=False)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(str(tmp_path), Checkpoint(400, small_policy().state_dict(), None, {"learns": 4}),
                        {"global_step": 400})
    monkeypatch.undo()
    assert checkpoint_steps(tmp_path) == [100, 200, 300]  # no step_400.pt, half written or whole
    assert load_newest_checkpoint(str(tmp_path))[0].step == 300


@contract
def test_resume_with_nothing_to_resume_is_a_one_line_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    status, out, err = run_main("dummy-policy", "default", "dummy", "default", "--port", "0",
                                "--run-dir", str(empty), "--resume")  # in this process: it stops before serving
    assert status != 0 and "listening" not in out
    assert err.strip().splitlines() == [f"error: no loadable checkpoint in {empty} (checkpoints/step_*.pt)"]


def test_resume_from_a_checkpoint_whose_meta_lacks_a_counter_is_one_line_naming_it_and_keeps_the_callers_threads(
        tmp_path):
    run_dir = tmp_path / "run"
    words = ["dummy-policy", "default", "dummy", "default", "--in-process", "--algo.learn-every", "100",
             "--algo.save-every", "1", "--run-dir", str(run_dir)]
    assert run_main(*words, "--algo.global-steps", "200")[0] == 0
    (path,) = plugrl_min.checkpoint_paths(str(run_dir))[-1:]
    saved = torch.load(path, weights_only=True)
    del saved["meta"]["frames_since_learn"]  # as another algorithm's or an older version's checkpoint
    torch.save(saved, path)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)  # the caller's own count
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            status = plugrl_min.main([*words, "--algo.global-steps", "400", "--resume"])
        kept = torch.get_num_threads()
    finally:
        torch.set_num_threads(threads)
    assert (status, kept) == (1, 3)
    assert err.getvalue().splitlines() == [f"error: cannot resume {run_dir}: its newest checkpoint has no "
                                           "'frames_since_learn', which dummy's load_checkpoint reads"]


LOOKS_UP_ITS_SCHEDULE_ON_RESUME = '''
import dataclasses

from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config


@register_algo_config("scheduled")
@dataclasses.dataclass
class ScheduledConfig(DummyAlgoConfig):
    schedule: str = "linear"


@register_algo("scheduled")
class Scheduled(DummyAlgorithm):
    RATES = {"linear": 1.0}

    def load_checkpoint(self, checkpoint):
        super().load_checkpoint(checkpoint)
        self.rate = self.RATES[self.config.schedule]
'''


def test_resume_where_the_algorithms_own_lookup_raises_key_error_keeps_its_traceback_and_exits_1(tmp_path):
    write_plugin(tmp_path, "plugrl_test_scheduled", LOOKS_UP_ITS_SCHEDULE_ON_RESUME)
    words = ["plugrl_min.py", "dummy-policy", "default", "scheduled", "default", "--plugin", "plugrl_test_scheduled",
             "--in-process", "--algo.learn-every", "100", "--algo.save-every", "1", "--run-dir", tmp_path / "run"]
    first = python(*map(str, words), "--algo.global-steps", "200", pythonpath=tmp_path)
    assert first.returncode == 0, first.stderr
    resumed = python(*map(str, words), "--algo.global-steps", "400", "--algo.schedule", "cosine", "--resume",
                     pythonpath=tmp_path)  # the checkpoint is whole: the bug is the plug-in's own table's
    assert resumed.returncode == 1
    assert "cannot resume" not in resumed.stderr  # the one line is for a key the checkpoint lacks
    assert "Traceback (most recent call last):" in resumed.stderr
    assert "self.rate = self.RATES[self.config.schedule]" in resumed.stderr
    assert resumed.stderr.rstrip().endswith("KeyError: 'cosine'")


def test_a_checkpoints_meta_kept_by_an_algorithm_saves_again_in_a_checkpoint_that_loads(tmp_path):
    first = plugrl_min.save_checkpoint(str(tmp_path), plugrl_min.Checkpoint(1, None, None, {"learns": 3}), {})
    kept = plugrl_min.read_checkpoint(first)[0].meta  # an algorithm that saves again the meta it loaded
    again = plugrl_min.save_checkpoint(str(tmp_path), plugrl_min.Checkpoint(2, None, None, kept), {})
    assert plugrl_min.read_checkpoint(again)[0].meta == {"learns": 3}


# --- A run that served nothing saves nothing ------------------------------------------------------

def test_a_run_that_ends_with_no_frame_served_leaves_no_run_directory_behind(tmp_path):
    run_dir = tmp_path / "run"
    with Background(tmp_path, "server", dummy_server(run_dir)) as server:
        server.port()
        wait_for(lambda: run_dir.exists(), 30, "the run directory")  # claimed once the port is taken
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0, server.stderr()
    assert not run_dir.exists()  # no checkpoint, no metrics: nothing to keep, and the same --run-dir runs again
    assert "no frame was served" in server.stdout() and f"the run directory {run_dir} is removed" in server.stdout()


def test_resume_drops_a_last_line_of_metrics_cut_short_and_report_reads_the_whole_run(tmp_path):
    run_dir = tmp_path / "run"
    words = ["dummy-policy", "default", "dummy", "default", "--in-process", "--algo.learn-every", "100",
             "--algo.save-every", "1", "--log-every", "1", "--run-dir", run_dir]
    assert run_main(*words, "--algo.global-steps", "300")[0] == 0
    path = run_dir / "metrics.jsonl"
    path.write_text(path.read_text()[:-40])  # a run killed as it wrote its end line
    status, out, err = run_main(*words, "--algo.global-steps", "600", "--resume")
    assert status == 0 and f"warning: {path}'s last line was cut short: dropped" in err, err
    lines = read_metrics(run_dir, event=None)  # every line whole: no line fused with the one cut short
    assert [line["step"] for line in lines] == [100, 200, 300, 400, 500, 600, 600]
    status, out, err = run_main("report", run_dir)
    assert status == 0 and out.startswith(f"A {run_dir}: 600 steps | 6 learns") and err == ""


# --- Signals as people and tools send them --------------------------------------------------------

@pytest.mark.parametrize("signum, again", [(signal.SIGINT, "Ctrl-C"), (signal.SIGTERM, "SIGTERM")])
def test_the_first_signal_says_which_signal_again_quits_without_a_checkpoint(signum, again, capsys):
    server = plugrl_min.Server(dummy_algo(small_policy(), 100), "unused", ("dummy-policy", "dummy"))
    plugrl_min.on_signal(server, signum, None)
    assert server.stop_requested and capsys.readouterr().err == (
        "\nstopping after the learn in progress, if any (a final checkpoint once a frame was served); "
        f"{again} again, a second or more from now, quits without one\n")


ENDLESS_LEARNER = '''
import dataclasses, sys, time
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config


@register_algo_config("endless")
@dataclasses.dataclass
class EndlessConfig(DummyAlgoConfig):
    global_steps: int | None = None
    learn_every: int = 20
    save_every: int = 10**9
    save_seconds: float = 0.0  # how long create_checkpoint takes


@register_algo("endless")
class Endless(DummyAlgorithm):
    def learn_impl(self):  # the page's symptom 4: frames_since_learn is never reset
        time.sleep(0.02)
        self.learns += 1
        print("learn", flush=True)  # no frame comes in while it learns: no line of metrics.jsonl either
        return self.global_step, {}

    def create_checkpoint(self):
        print("saving", flush=True)
        time.sleep(self.config.save_seconds)
        return super().create_checkpoint()
'''


def endless_server(tmp_path, *flags):
    write_plugin(tmp_path, "plugrl_test_endless_learner", ENDLESS_LEARNER)
    return Background(tmp_path, "server", ["plugrl_min.py", "dummy-policy", "default", "endless", "default",
                                           "--plugin", "plugrl_test_endless_learner", "--port", "0",
                                           "--run-dir", str(tmp_path / "run"), *flags], pythonpath=tmp_path)


def learns_printed(server) -> int:
    """The learns an ENDLESS_LEARNER server has printed, one `learn` line each."""
    return server.stdout().splitlines().count("learn")


@wire
def test_sigint_stops_a_server_that_learns_again_and_again_with_a_final_checkpoint(tmp_path, capsys):
    with endless_server(tmp_path) as server:  # a process, for the signal; its env client in a thread of this one
        client, client_status = in_a_thread(plugrl_min.env_client_main,
                                            env_client_args(server.port(), "--num-episodes", "0")[2:])
        wait_for(lambda: learns_printed(server) >= 5, 60, "the server learning again and again")
        server.proc.send_signal(signal.SIGINT)
        status = server.wait(20)
        client.join(30)
    assert status == 0, server.stderr()
    assert "run finished" in server.stdout() and "saving" in server.stdout()
    assert len(checkpoint_steps(tmp_path / "run")) == 1  # the final one
    assert client_status == [0] and "the server ended the run |" in capsys.readouterr().out


@wire
def test_a_second_sigint_during_a_slow_final_save_exits_at_once_without_a_checkpoint(tmp_path):
    with endless_server(tmp_path, "--algo.save-seconds", "60") as server:
        in_a_thread(asyncio.run, feed(server.port()))  # a hand-driven client, until the server is gone
        wait_for(lambda: learns_printed(server) >= 1, 60, "a learn")
        server.proc.send_signal(signal.SIGINT)
        wait_for(lambda: "saving" in server.stdout(), 20, "the final save to begin")
        # Copies of a signal within 1 s of the first are the same request: the second comes later. The server
        # handled the first before it began to save, however late: 1.5 s after the save is seen is later still.
        time.sleep(1.5)
        server.proc.send_signal(signal.SIGINT)
        status = server.wait(45)  # the save takes 60 s: an exit within 45 s of the second is an exit at once
    assert status == 130
    assert "without a final checkpoint" in server.stderr()
    assert checkpoint_steps(tmp_path / "run") == []


@wire
def test_a_second_sigterm_within_50_ms_is_the_same_request_a_final_checkpoint_and_exit_0(tmp_path):
    run_dir = tmp_path / "run"

    def sigterm_twice(process):
        process.send_signal(signal.SIGTERM)
        time.sleep(0.05)  # the stimulus: a copy 50 ms later, as timeout and docker stop send one
        process.send_signal(signal.SIGTERM)

    with Background(tmp_path, "server", dummy_server(run_dir)) as server:
        fed, closed = asyncio.run(feed(server.port(), 42, then=lambda: sigterm_twice(server.proc)))
        status = server.wait(30)
    assert status == 0 and closed == RUN_END, server.stderr()
    assert checkpoint_steps(run_dir) == [42]
    assert "without a final checkpoint" not in server.stderr()


@pytest.mark.parametrize("gap", [0.05, 0.3])
@wire
def test_two_sigterms_50_or_300_ms_apart_are_one_request_and_exit_0(tmp_path, gap):
    run_dir = tmp_path / "run"
    with Background(tmp_path, "server", dummy_server(run_dir, "--algo.global-steps", "1000000000")) as server:
        def sigterm_twice():
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(gap)
            server.proc.send_signal(signal.SIGTERM)
        fed, closed = asyncio.run(feed(server.port(), 250, then=sigterm_twice))
        status = server.wait(30)
    assert status == 0 and closed == RUN_END, server.stderr()
    assert checkpoint_steps(run_dir)[-1] == 250


def wait_for_a_learn_line(run_dir, process) -> None:
    """Frames flow and the server learns: metrics.jsonl has its first line."""
    wait_for(lambda: metrics_lines(run_dir) >= 1 or process.poll() is not None, 120, "a learn")
    assert process.poll() is None, "the run ended before it learned"


@pytest.mark.parametrize("sender", ["timeout", "kill -TERM -- -PGID"])
def test_timeout_and_a_sigterm_to_the_process_group_leave_a_final_checkpoint_and_exit_0(tmp_path, sender):
    run_dir = tmp_path / "run"
    command = [sys.executable, "plugrl_min.py", "dummy-policy", "default", "dummy", "default", "--local-env-clients",
               "1", "--algo.global-steps", "1000000000", "--algo.learn-every", "200", "--log-every", "1",
               "--port", "0", "--run-dir", str(run_dir)]
    if sender == "timeout":  # --preserve-status: timeout exits with the server's own status
        command = ["timeout", "--preserve-status", "600", *command]
    with open(tmp_path / "out", "w") as out:
        process = subprocess.Popen(command, cwd=HERE, env=subprocess_env(), stdin=subprocess.DEVNULL, stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_a_learn_line(run_dir, process)
        if sender == "timeout":  # timeout passes it on to the server, and again to its process group
            process.send_signal(signal.SIGTERM)
        else:
            os.killpg(process.pid, signal.SIGTERM)
        status = process.wait(60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    printed = (tmp_path / "out").read_text()
    assert status == 0, printed
    step = int(re.search(r"run finished: global step (\d+)", printed).group(1))
    assert checkpoint_steps(run_dir)[-1] == step  # the final checkpoint, at the step the run ended


EXITS_SLOWLY = '''
import atexit, time
atexit.register(time.sleep, 3)  # a process that takes a while to exit, after its event loop has closed
atexit.register(print, "exiting", flush=True)
'''


@wire
def test_a_copy_of_sigterm_after_the_event_loop_closed_still_exits_0(tmp_path):
    write_plugin(tmp_path, "plugrl_test_exits_slowly", EXITS_SLOWLY)
    run_dir = tmp_path / "run"
    with Background(tmp_path, "server", dummy_server(run_dir, "--plugin", "plugrl_test_exits_slowly"),
                    pythonpath=tmp_path) as server:
        fed, closed = asyncio.run(feed(server.port(), 150, then=lambda: server.proc.send_signal(signal.SIGTERM)))
        wait_for(lambda: "exiting" in server.stdout(), 30, "the server to exit")
        server.proc.send_signal(signal.SIGTERM)  # 'timeout' and Slurm send a copy; the run has ended
        status = server.wait(30)
    assert status == 0, server.stderr()
    assert checkpoint_steps(run_dir)[-1] == 150


def test_copies_of_sigterm_until_the_process_is_gone_leave_status_0_with_a_local_client_and_a_learn_thread(
        tmp_path):
    run_dir = tmp_path / "run"
    command = ["plugrl_min.py", "dummy-policy", "default", "pg", "default", "--local-env-clients", "1",
               "--algo.global-steps", "1000000000", "--run-dir", str(run_dir)]
    chart_ended = re.compile(r"^ {10} 0 +[\d,]+$", re.M)  # the report's last line: the run has ended
    with Background(tmp_path, "server", command) as server:
        wait_for_a_learn_line(run_dir, server.proc)  # pg has learned: its learn thread is there
        first = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        copies_after_the_end = 0
        # A copy every 20 ms: within the first second (the same request), and from the end of the run
        # until the process is gone (nothing left to stop). Between, a copy rightly quits at once (130).
        while server.proc.poll() is None and time.monotonic() < first + 60:
            if chart_ended.search(server.stdout()):
                copies_after_the_end += 1
            elif time.monotonic() - first > 0.95:
                time.sleep(0.02)
                continue
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(0.02)
        status = server.wait(30)
    assert status == 0, server.stdout()[-1500:] + server.stderr()
    assert copies_after_the_end >= 1 and "without a final checkpoint" not in server.stderr()
    step = int(re.search(r"run finished: global step (\d+)", server.stdout()).group(1))
    assert checkpoint_steps(run_dir)[-1] == step


@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, -signal.SIGTERM), (signal.SIGINT, None)],
                         ids=["SIGTERM", "Ctrl-C"])
def test_a_signal_to_a_test_run_with_an_in_process_server_stops_the_test_run(tmp_path, signum, status):
    # A test run whose in-process server has just started: the signal is pytest's, not the server's.
    name = "test_a_client_owing_feedback_while_another_trains_is_dropped_after_the_timeout"
    with open(tmp_path / "out", "w") as out:
        run = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider", "-n", "0",
                                SOURCE.replace(
            "plugrl_min.py", "test_plugrl_min.py"), "-k", name], cwd=tmp_path, env=subprocess_env(), stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: "listening on" in (tmp_path / "out").read_text(), 60, "the in-process server")
        run.send_signal(signum)
        sent = time.monotonic()
        ended = run.wait(60)
        assert time.monotonic() - sent < 20  # on a busy machine too; a swallowed signal let the test run on
        printed = (tmp_path / "out").read_text()
        if status is None:  # pytest's own KeyboardInterrupt: status 2, or 1 when it lands in an event loop
            assert ended in (1, 2) and "KeyboardInterrupt" in printed and " passed" not in printed, printed
        else:
            assert ended == status, printed
    finally:
        if run.poll() is None:
            run.kill()


# =============================================================================================
# 4. State types: what flows from infer to feedback, and what a checkpoint holds
# =============================================================================================
# Checkpoint: tensors and plain Python values only, so that every checkpoint loads with
# torch.load(weights_only=True). The runtime and train states are followed through sections 2 and 7.

@wire
def test_dummy_checkpoints_load_with_weights_only(dummy_run):
    paths = sorted(os.listdir(dummy_run.run_dir / "checkpoints"))
    assert paths == ["step_000000001000.pt", "step_000000001500.pt", "step_000000002000.pt"]  # the newest 3
    for name in paths:
        payload = torch.load(dummy_run.run_dir / "checkpoints" / name, weights_only=True)
        assert payload["step"] == int(name[5:-3]) and "trunk.0.weight" in payload["model"]
        assert payload["meta"]["learns"] == payload["step"] // 250


def test_every_torch_load_in_the_code_passes_weights_only():
    with open(SOURCE) as file:
        tree = ast.parse(file.read())
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and ast.unparse(node.func) == "torch.load"]
    assert calls and all(any(keyword.arg == "weights_only" and ast.unparse(keyword.value) == "True"
                             for keyword in call.keywords) for call in calls), [ast.unparse(call) for call in calls]


class SavesNumpyInMeta(Faulty):
    """create_checkpoint puts a numpy integer in meta: torch.load(weights_only=True) refuses such a file."""

    def create_checkpoint(self):
        checkpoint = super().create_checkpoint()
        checkpoint.meta["frames"] = np.int64(len(self.frames))
        return checkpoint


@wire
def test_a_checkpoint_that_cannot_load_with_weights_only_fails_the_run_instead_of_being_written(tmp_path):
    async def one_decision(port, server):
        client = await Client.connect(port)
        try:
            await client.step([0], [1])  # a learn, then a checkpoint is due
            await client.infer([0], [1])
        except websockets.ConnectionClosed:
            pass
        return client.ws.close_reason

    status, reason = run_server(SavesNumpyInMeta(fault=None), tmp_path, one_decision)
    assert status == 1 and reason == hook_failed("TypeError")[1]
    assert checkpoint_steps(tmp_path) == []


# =============================================================================================
# 5. Policies: a batch of observations in, a batch of actions out
# =============================================================================================
# BaseTorchPolicy.device: where the weights live (--device); checkpoints load on the CPU. The built-in
# policies' actions and runtime states: section 11.

def test_device_cuda_without_cuda_is_a_one_line_error_and_exit_2(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert plugrl_min.main(["dummy-policy", "default", "dummy", "default", "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --device cuda, but torch finds no CUDA device (torch.cuda.is_available() is False): "
                   "use --device cpu"]


def test_device_auto_without_cuda_runs_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the server runs in this process
    status, _, err = run_main("dummy-policy", "default", "pg", "default", "--device", "auto",
                              "--algo.global-steps", "64", "--algo.frames-per-learn", "32", "--local-env-clients", "1",
                              "--run-dir", tmp_path / "run")
    assert status == 0, err
    checkpoint, _ = load_newest_checkpoint(str(tmp_path / "run"))  # written from the weights where they live
    assert checkpoint.step == 64 and all(tensor.device.type == "cpu" for tensor in checkpoint.model.values())


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("algo", ["pg", "sac"])
def test_pg_and_sac_learn_on_cuda_and_their_checkpoints_load_on_the_cpu(tmp_path, algo):
    result = python("plugrl_min.py", "dummy-policy", "default", algo, "default", "--device", "cuda",
                    "--algo.global-steps", "2000", *(["--algo.learning-starts", "500"] if algo == "sac" else []),
                    "--local-env-clients", "1", "--port", "0", "--run-dir", str(tmp_path / "run"), timeout=300)
    assert result.returncode == 0, result.stderr
    (path,) = plugrl_min.checkpoint_paths(str(tmp_path / "run"))[-1:]
    saved = torch.load(path, weights_only=True)  # where the weights were: the run learned on CUDA
    assert all(t.device.type == "cuda" for t in saved["model"].values())
    checkpoint, _ = load_newest_checkpoint(str(tmp_path / "run"))  # and it loads on a machine without
    assert checkpoint.step == 2000 and all(t.device.type == "cpu" for t in checkpoint.model.values())


# =============================================================================================
# 6. Algorithms: the hooks the server loop calls, and the smallest algorithm
# =============================================================================================
# BaseAlgorithm's hooks as the page's troubleshooting and its minimal template use them, and dummy, the
# smallest complete algorithm.

# --- The page's troubleshooting, one symptom each -------------------------------------------------

LISTED_PLUGIN = '''
import dataclasses
from plugrl_min import BaseAlgoConfig, BaseAlgorithm, register_algo, register_algo_config

@register_algo_config("plugin-listed")
@dataclasses.dataclass
class ListedConfig(BaseAlgoConfig):
    listed_flag: int = 7

@register_algo("plugin-listed")
class Listed(BaseAlgorithm):
    def learn_impl(self):
        return self.global_step, {}
'''

CONFIG_ONLY_PLUGIN = '''
import dataclasses
from plugrl_min import BaseAlgoConfig, register_algo_config

@register_algo_config("config-only")
@dataclasses.dataclass
class ConfigOnly(BaseAlgoConfig):
    global_steps: int | None = 10
'''


@contract
def test_a_uid_whose_module_is_not_imported_is_missing_from_help(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_listed_plugin", LISTED_PLUGIN)  # importable, but nothing imports it
    status, out, err = run_main("dummy-policy", "default", "--help")
    assert status == 0, err
    assert re.search(r"^algorithms: .*\bdummy \(default\)", out, re.M) and "plugin-listed" not in out, out


@contract
def test_plugin_puts_its_uid_in_help(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_listed_plugin", LISTED_PLUGIN)
    status, out, err = run_main("--plugin", "plugrl_test_listed_plugin", "dummy-policy", "default", "--help")
    assert status == 0, err
    assert re.search(r"algorithms:.*\bplugin-listed \(default\)", out), out


SHARED_FIELD_PLUGIN = '''
import dataclasses
from plugrl_min import BaseAlgoConfig, register_algo_config

@register_algo_config("shares-a-field")
@dataclasses.dataclass
class SharesAField(BaseAlgoConfig):
    hidden_size: int = 64  # dummy-policy's config has it too
'''


# The plug-in has no algorithm class: the run stops while it builds the algorithm, before it serves.
@contract
def test_a_field_in_both_configs_is_a_warning_naming_it(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_shared_field_plugin", SHARED_FIELD_PLUGIN)
    _, _, err = run_main("--plugin", "plugrl_test_shared_field_plugin", "dummy-policy", "default", "shares-a-field",
                         "default", "--port", "0", "--run-dir", str(tmp_path / "run"))
    assert "'hidden_size' is in both the policy and the algorithm config: keep it in one" in err


@contract
def test_only_the_config_registered_prints_the_config_then_keyerror(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_config_only_plugin", CONFIG_ONLY_PLUGIN)
    status, out, err = run_main("dummy-policy", "default", "config-only", "default", "--port", "0",
                                "--run-dir", str(tmp_path / "run"), "--plugin", "plugrl_test_config_only_plugin")
    assert status != 0
    printed, _ = json.JSONDecoder().raw_decode(out)  # the resolved config comes first
    assert printed["algorithm"] == "config-only" and printed["algo_config"]["global_steps"] == 10
    assert "KeyError: 'Algorithm config-only is not registered.'" in out + err
    assert "listening on" not in out


@contract
def test_overriding_learn_instead_of_learn_impl_makes_make_algo_raise_typeerror():
    plugrl_min.register_algo_config("overrides-learn")(ShortConfig)

    @plugrl_min.register_algo("overrides-learn")
    class OverridesLearn(plugrl_min.BaseAlgorithm):
        def learn(self):
            return self.global_step, {}

    with pytest.raises(TypeError, match="learn_impl"):
        plugrl_min.make_algo("overrides-learn", small_policy())


class MisnamedKeyword(Probe):
    def feedback(self, *, obs, runtime_state, train_state=None, terminated, truncated, next_obs,
                 rewards, info, next_terminated, next_truncated, prev_node):  # "rewards", not "reward"
        raise AssertionError("never called: the server passes reward=")


async def one_frame_then_closed(port, server):
    client = await Client.connect(port)
    await client.step([0], [1])
    return await client.closed()


@contract
@wire
def test_a_misnamed_feedback_keyword_fails_the_run_on_its_first_frame(tmp_path):
    status, closed = run_server(MisnamedKeyword(), tmp_path, one_frame_then_closed)
    assert status == 1 and closed == hook_failed("TypeError")


@contract
@wire
def test_a_misnamed_feedback_keyword_prints_the_typeerror_in_the_server_log(tmp_path, capsys):
    run_server(MisnamedKeyword(), tmp_path, one_frame_then_closed)
    log = capsys.readouterr().err
    assert re.search(r"TypeError: .*feedback\(\) got an unexpected keyword argument 'reward'", log), log


def episode_frames(n):
    """Feedback fields for n one-environment frames that each finish an episode: r = i, l = 10 + i, s = i odd."""
    return [dict(terminated=[True], episode={"r": [float(i)], "l": [10 + i], "s": [i % 2 == 1]}) for i in range(n)]


class ForgetsEpisodes(LearnsEveryFour):
    record_episodes = False  # feedback never calls record_episode_metrics


def run_episodes_and_read_metrics(algo, run_dir, frames=8, log_every=1):
    """One client finishes an episode every frame; the lines of metrics.jsonl written at a learn."""
    async def script(port, server):
        client = await Client.connect(port)
        for fields in episode_frames(frames):
            await client.step([0], [1], **fields)
        await eventually(lambda: algo.learns == frames // 4)

    run_server(algo, run_dir, script, log_every=log_every)
    return read_metrics(run_dir)


@contract
@wire
def test_with_log_every_1_metrics_jsonl_holds_one_object_per_learn_with_rollout_means(tmp_path):
    metrics = run_episodes_and_read_metrics(LearnsEveryFour(), tmp_path)
    assert [line["step"] for line in metrics] == [4, 8]
    assert [line["rollout/reward"] for line in metrics] == [1.5, 5.5]  # means of r = 0..3 and 4..7
    assert [line["rollout/length"] for line in metrics] == [11.5, 15.5]
    assert [line["rollout/success"] for line in metrics] == [0.5, 0.5]
    assert [line["rollout/episodes"] for line in metrics] == [4, 4]


@contract
@wire
def test_rollout_metrics_stay_zero_without_record_episode_metrics(tmp_path):
    metrics = run_episodes_and_read_metrics(ForgetsEpisodes(), tmp_path)
    assert len(metrics) == 2
    for line in metrics:
        assert (line["rollout/reward"], line["rollout/length"], line["rollout/success"]) == (0, 0, 0)
        assert line["rollout/episodes"] == 0


class OnPolicyLearnsEveryThree(Probe):
    """Two environments per message, a learn every 3 stored frames: every second message, the second
    environment's frame arrives while should_learn() is true and is discarded."""

    on_policy = True
    learn_every = 3


class DiscardsWithoutSuper(OnPolicyLearnsEveryThree):
    def discard_feedback(self, *, info, next_terminated, next_truncated):
        self.discarded += 1  # no super().discard_feedback(...): the frame's episode is never recorded


def run_discarding(algo, run_dir, messages=8):
    async def script(port, server):
        await run_rounds(port, [1, 2], messages, terminated=[True, True],
                         episode={"r": [1.0, 1.0], "l": [5, 5], "s": [False, False]})
        await eventually(lambda: len(algo.frames) + algo.discarded == 2 * messages)

    run_server(algo, run_dir, script, log_every=1)  # a line per learn
    return read_metrics(run_dir)


@contract
@wire
def test_discarded_frames_still_record_their_finished_episodes(tmp_path):
    algo = OnPolicyLearnsEveryThree()
    metrics = run_discarding(algo, tmp_path)
    assert algo.discarded == 4 and len(algo.frames) == 12
    assert algo.episodes_recorded == 16
    assert [line["rollout/episodes"] for line in metrics] == [4, 4, 4, 4]


@contract
@wire
def test_a_discard_feedback_override_without_super_loses_those_episodes(tmp_path):
    algo = DiscardsWithoutSuper()
    metrics = run_discarding(algo, tmp_path)
    assert algo.discarded == 4
    assert algo.episodes_recorded == 12  # only the stored frames' episodes
    assert [line["rollout/episodes"] for line in metrics] == [3, 3, 3, 3]


@contract
@wire
def test_should_learn_still_true_after_learn_learns_again_without_inferring(tmp_path):
    class LearnsThreeTimes(Probe):
        learns_left = 0

        def feedback(self, **frame):
            self.learns_left = 3  # should_learn() stays true for three learns
            return super().feedback(**frame)

        def learn_impl(self):
            self.learns_left -= 1
            return super().learn_impl()

        def should_learn(self):
            return self.learns_left > 0

    algo = LearnsThreeTimes()

    async def script(port, server):
        client = await Client.connect(port)
        await client.step([0], [1])
        await client.infer([0], [1])  # answered only once should_learn() turns false

    run_server(algo, tmp_path, script)
    assert algo.events == [("infer", [1]), ("feedback", 1), ("learn",), ("learn",), ("learn",), ("infer", [1])]


class CountsPasses(Probe):
    """should_stop() is asked once on every pass of the server loop: count the passes."""

    passes = 0

    def should_stop(self):
        self.passes += 1
        return False


@contract
@wire
def test_should_save_that_stays_true_writes_a_checkpoint_on_every_pass(tmp_path):
    class AlwaysSaves(CountsPasses):
        def should_save(self):
            return True

    algo = AlwaysSaves()

    async def script(port, server):
        await run_rounds(port, [1], 3)
        passes = algo.passes
        await eventually(lambda: algo.passes >= passes + 2)  # idle: the server still passes twice a second

    run_server(algo, tmp_path, script)
    assert algo.learns == 0
    assert algo.checkpoints >= algo.passes >= 3 + 2  # 3 feedback messages, 2 idle ticks at least
    assert os.listdir(tmp_path / "checkpoints")


@contract
@wire
def test_should_save_that_turns_false_after_create_checkpoint_writes_once(tmp_path):
    class SavesOnce(CountsPasses):
        def should_save(self):
            return self.global_step >= 2 and self.checkpoints == 0  # create_checkpoint moves the counter

    algo = SavesOnce()

    async def script(port, server):
        await run_rounds(port, [1], 3)
        passes = algo.passes
        await eventually(lambda: algo.passes >= passes + 2)  # two idle passes, should_save asked at each

    run_server(algo, tmp_path, script)
    assert algo.passes >= 5
    assert algo.checkpoints == 2  # the one that was due, and the final one when the run stops


# --- The page's minimal template, as a plug-in, end to end; the one-registry rule -----------------

# Copied from the page; template_as_plugin() changes only its imports.
TEMPLATE = '''import dataclasses

import numpy as np

from plugrl_server.algorithm.base_algorithm import BaseAlgoConfig, BaseAlgorithm
from plugrl_server.algorithm.registration import register_algo, register_algo_config
from plugrl_server.common.checkpoint_manager import Checkpoint
from plugrl_server.policy.base_torch_policy import BaseTorchPolicy
from plugrl_server.policy.state import PolicyRuntimeState, PolicyTrainState

UID = "your-algo"


@register_algo_config(UID)
@dataclasses.dataclass
class YourAlgoConfig(BaseAlgoConfig):
    # The run length is BaseAlgoConfig's field, set with --algo.global-steps.
    global_steps: int | None = 100_000


@register_algo(UID)
class YourAlgorithm(BaseAlgorithm):
    # Set to False if the algorithm learns from a replay buffer.
    on_policy = True

    def __init__(self, config: YourAlgoConfig, policy: BaseTorchPolicy):
        super().__init__(config=config, policy=policy)
        self.global_step = 0

    def infer(self, obs: dict) -> tuple[np.ndarray, PolicyRuntimeState]:
        action, runtime_state = self.policy.get_action_and_runtime_state(obs)
        return action, runtime_state

    def feedback(
        self,
        *,
        obs: dict,
        runtime_state: PolicyRuntimeState,
        train_state: PolicyTrainState = None,
        terminated: bool,
        truncated: bool,
        next_obs: dict,
        reward: float,
        info: dict,
        next_terminated: bool,
        next_truncated: bool,
        prev_node: tuple,
    ) -> tuple[tuple, int, dict]:
        # Store the frame here.
        if (next_terminated or next_truncated) and "episode" in info:
            if bool(info["episode"].get("mask", True)):
                # Without this, rollout/success, reward and length stay 0.
                self.record_episode_metrics(info["episode"])
        self.global_step += 1
        return prev_node, self.global_step, {}

    def learn_impl(self) -> tuple[int, dict]:
        return self.global_step, {}

    def should_learn(self) -> bool:
        return False

    def should_stop(self) -> bool:
        return self.global_step >= self.config.global_steps

    def should_save(self) -> bool:
        return False

    def create_checkpoint(self) -> Checkpoint:
        # state_dict() exists because a BaseTorchPolicy is a torch.nn.Module.
        return Checkpoint(step=self.global_step, model=self.policy.state_dict(), optimizer=None, meta={})

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        self.global_step = checkpoint.step
        if checkpoint.model is not None:
            self.policy.load_state_dict(checkpoint.model)
'''


def template_as_plugin() -> str:
    """The template with `from plugrl_server.<module> import X` turned into `from plugrl_min import X`."""
    plugin = re.sub(r"^from plugrl_server\.[\w.]+ import ", "from plugrl_min import ", TEMPLATE, flags=re.M)
    changed = [new for old, new in zip(TEMPLATE.splitlines(), plugin.splitlines()) if old != new]
    assert len(changed) == 5 and all(line.startswith("from plugrl_min import ") for line in changed)
    return plugin


# A real server process: how the plug-in is imported into a fresh interpreter (plugrl_min.py as __main__, or
# the page's `python -c`) is what decides whether it registers where the command line looks.
@contract
@pytest.mark.parametrize("launcher", ["--plugin", "python -c"])
@wire
def test_the_pages_template_runs_as_a_plugin_until_global_steps(tmp_path, launcher):
    write_plugin(tmp_path, "plugrl_test_your_module", template_as_plugin())
    words = ["dummy-policy", "default", "your-algo", "default", "--algo.global-steps", "400",
             "--port", "0", "--run-dir", str(tmp_path / "run")]
    if launcher == "--plugin":
        args = ["plugrl_min.py", *words, "--plugin", "plugrl_test_your_module"]
    else:  # the page's way: import the plug-in, then enter the command line
        args = ["-c", "import plugrl_test_your_module; from plugrl_min import main; main()", *words]
    with Background(tmp_path, "server", args, pythonpath=tmp_path) as server:
        fed, closed = asyncio.run(feed(server.port()))
        status = server.wait(60)
    assert status == 0, server.stderr()
    assert "run finished: global step 400" in server.stdout()
    assert fed == 400 and closed == RUN_END
    assert os.path.exists(tmp_path / "run" / "checkpoints" / "step_000000000400.pt")


# A real process: plugrl_min.py runs as __main__ there, and the plug-in imports `plugrl_min`.
@contract
def test_a_plugin_importing_plugrl_min_registers_where_the_command_line_looks(tmp_path):
    write_plugin(tmp_path, "plugrl_test_listed_plugin", LISTED_PLUGIN)  # `from plugrl_min import register_algo, ...`
    result = python("plugrl_min.py", "dummy-policy", "default", "plugin-listed", "default", "--algo.global-steps",
                    "0", "--port", "0", "--run-dir", str(tmp_path / "run"), "--plugin", "plugrl_test_listed_plugin",
                    pythonpath=tmp_path)
    assert result.returncode == 0, result.stderr  # the command line found the plug-in's config and class
    assert json.JSONDecoder().raw_decode(result.stdout)[0]["algo_config"] == {"global_steps": 0, "listed_flag": 7}
    assert "run finished" in result.stdout


# --- dummy: the smallest algorithm keeps a real one's cadence -------------------------------------

@wire
def test_dummy_stops_at_global_steps(dummy_run):
    assert dummy_run.server_status == 0, dummy_run.server_out
    assert "run finished: global step 2000, 8 learns" in dummy_run.server_out


# =============================================================================================
# 7. PG: the first learner, on one rank or several (DDPAlgorithm)
# =============================================================================================
# pg's chains, GAE and losses worked out by hand, pg learning over the wire, and sac_example.py, the
# off-policy learner beside it (a plug-in the server command imports).

# --- pg: chains by prev_node, GAE along them, its losses ------------------------------------------

def feed_pg(algo, state, *, reward=0.0, next_state=None, terminated=False, truncated=False,
            next_terminated=False, next_truncated=False, prev_node=(-1, "")):
    """One frame into pg, as the server would hand it over; returns the node pg gives back."""
    next_state = state if next_state is None else next_state
    node, _, _ = algo.feedback(
        obs=row_obs(np.array(state, np.float32)), runtime_state=None,
        train_state={"sample": np.zeros(1, np.float32)}, terminated=terminated, truncated=truncated,
        next_obs=row_obs(np.array(next_state, np.float32)), reward=reward, info={},
        next_terminated=next_terminated, next_truncated=next_truncated, prev_node=prev_node)
    return node


class FirstComponent(nn.Module):
    """A stand-in value network: V(s) = s[0], so advantages can be worked out by hand."""

    def forward(self, obs):
        return obs["states"]["state"][:, :1]


@pytest.mark.parametrize("flag, value, least", [("frames-per-learn", 1, 2), ("value-epochs", 0, 1),
                                                ("save-every", 0, 1)])
def test_pg_refuses_a_value_it_cannot_learn_with_before_serving_in_one_line(flag, value, least, tmp_path):
    status, out, err = run_main("dummy-policy", "default", "pg", "default", f"--algo.{flag}", value,
                                "--in-process", "--run-dir", tmp_path / "run")
    assert status == 2 and "run directory" not in out and not (tmp_path / "run").exists()
    assert err.strip().splitlines() == [f"error: --algo.{flag} must be at least {least}; got {value}"]


def test_pg_bootstraps_a_truncated_segment_with_the_value_of_its_last_observation_not_a_terminated_one():
    algo = pg_algo(gamma=0.5, gae_lambda=1.0)
    algo.train_value = FirstComponent()  # what learn and advantages evaluate: the module, or its DDP wrapper
    node = feed_pg(algo, [1, 0, 0], reward=1.0, next_state=[2, 0, 0])  # env A: frame 0 ...
    feed_pg(algo, [2, 0, 0], reward=1.0, next_state=[4, 0, 0], next_truncated=True, prev_node=node)
    feed_pg(algo, [3, 0, 0], reward=1.0, next_state=[8, 0, 0], next_terminated=True)  # env B
    assert algo.batch["successor"][:3].tolist() == [1, -1, -1]
    assert algo.batch["obs"]["states"]["state"][:3, 0].tolist() == [1, 2, 3]  # stored per observation key
    advantage, value = algo.advantages(plugrl_min.map_arrays(lambda array: torch.from_numpy(array[:3]), algo.batch))
    # truncated: 1 + 0.5 * V(4) - V(2) = 1; its predecessor: 1 + 0.5 * V(2) - V(1) + 0.5 * 1 = 1.5
    # terminated: 1 - V(3) = -2 (no bootstrap from V(8))
    assert advantage.tolist() == [1.5, 1.0, -2.0] and value.tolist() == [1.0, 2.0, 3.0]


def test_pg_links_an_environments_frames_but_not_across_an_episode_or_a_batch():
    algo = pg_algo(frames_per_learn=4)
    first = feed_pg(algo, [0, 0, 0])
    second = feed_pg(algo, [0, 0, 0], prev_node=first)  # its episode ends here
    feed_pg(algo, [0, 0, 0], terminated=True, prev_node=second)  # the next episode's first frame
    assert algo.batch["successor"][:3].tolist() == [1, -1, -1]
    feed_pg(algo, [0, 0, 0])
    algo.learn()
    fresh = feed_pg(algo, [0, 0, 0], prev_node=second)  # a node from the batch before the learn
    assert fresh == (0, "1") and algo.batch["successor"][1] == -1


@wire
def test_pg_chains_follow_the_frames_a_client_sent_over_the_wire(tmp_path):
    algo = pg_algo(frames_per_learn=8, global_steps=None)

    async def script(port, server):
        client = await Client.connect(port)
        # Two environments; env 1's episode ends at its second frame. Then a learn (8 frames),
        # after which every environment starts over (its first frame's prev_node is empty).
        await client.step([0, 1], [0.1, 0.2])
        await client.step([0, 1], [0.1, 0.2], terminated=[False, True])
        await client.step([0, 1], [0.1, 0.2])
        await client.step([0, 1], [0.1, 0.2])
        await eventually(lambda: algo.learns == 1)
        links_before = algo.batch["successor"][:8].tolist()
        await client.step([0, 1], [0.1, 0.2])
        await client.step([0, 1], [0.1, 0.2])
        await eventually(lambda: algo.stored == 4)
        await client.close()
        return links_before

    _, links_before = run_server(algo, tmp_path, script)
    # rows in arrival order: (env 0, env 1) per step. env 0: 0 -> 2 -> 4 -> 6; env 1: 1 -> 3, then
    # its episode ends; 5 -> 7.
    assert links_before == [2, 3, 4, -1, 6, 7, -1, -1]
    assert algo.batch["successor"][:4].tolist() == [2, 3, -1, -1]


class KnownValue(nn.Module):
    """A stand-in value network, V(s) = s[0], with one parameter so that its loss has a gradient."""

    def __init__(self):
        super().__init__()
        self.zero = nn.Parameter(torch.zeros(1))

    def forward(self, obs):
        return obs["states"]["state"][:, :1] + self.zero


def pg_chain_and_a_terminated_frame(**config):
    """pg with V(s) = s[0]: environment A's chain of three frames, the last cut by the batch, and
    environment B's one terminated frame between them (rows A, B, A, A)."""
    algo = pg_algo(frames_per_learn=4, **config)
    algo.train_value = KnownValue()
    node = feed_pg(algo, [1, 0, 0], reward=1.0, next_state=[2, 0, 0])
    feed_pg(algo, [5, 0, 0], reward=1.0, next_state=[9, 0, 0], next_terminated=True)
    node = feed_pg(algo, [2, 0, 0], reward=2.0, next_state=[3, 0, 0], prev_node=node)
    feed_pg(algo, [3, 0, 0], reward=3.0, next_state=[4, 0, 0], prev_node=node)
    return algo


def test_pg_advantages_are_gae_lambda_along_each_chain_worked_out_by_hand():
    algo = pg_chain_and_a_terminated_frame(gamma=0.5, gae_lambda=0.5)
    frames = plugrl_min.map_arrays(lambda array: torch.from_numpy(array[:4]), algo.batch)
    advantage, value = algo.advantages(frames)
    # TD errors: A 1 + .5 V(2) - V(1) = 1, 2 + .5 V(3) - V(2) = 1.5, 3 + .5 V(4) - V(3) = 2 (cut by
    # the batch: it bootstraps); B 1 - V(5) = -4 (terminated: no V(9)). Backwards along A with
    # gamma * lambda = .25: 2, then 1.5 + .25 * 2 = 2, then 1 + .25 * 2 = 1.5.
    assert advantage.tolist() == [1.5, -4.0, 2.0, 2.0] and value.tolist() == [1.0, 5.0, 2.0, 3.0]


def test_pg_policy_loss_is_minus_log_prob_times_normalised_advantage_minus_the_entropy_bonus():
    algo = pg_chain_and_a_terminated_frame(gamma=0.5, gae_lambda=0.5, ent_coef=0.1)
    advantage = torch.tensor([1.5, -4.0, 2.0, 2.0])  # as worked out above
    normalised = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    with torch.no_grad():
        distribution = algo.policy(obs_tensors(plugrl_min.slice_rows(algo.batch["obs"], slice(0, 4))))
        log_prob = distribution.log_prob(torch.from_numpy(algo.batch["sample"][:4]))
        expected = -(log_prob * normalised).mean() - 0.1 * distribution.entropy().mean()
    _, log = algo.learn_impl()
    assert log["train/policy_loss"] == pytest.approx(expected.item(), rel=1e-5)


def test_pg_with_no_advantage_to_follow_raises_the_policys_entropy():
    algo = pg_algo(frames_per_learn=4)
    algo.train_value = KnownValue()
    for x in (1.0, 2.0, 3.0, 4.0):  # each a terminated frame whose reward is V(s): no advantage
        feed_pg(algo, [x, 0, 0], reward=x, next_terminated=True)
    states = obs_tensors(plugrl_min.slice_rows(algo.batch["obs"], slice(0, 4)))
    before = algo.policy(states).entropy().mean().item()
    algo.learn_impl()
    assert algo.policy(states).entropy().mean().item() > before  # only the entropy bonus pulled


@plugrl_min.register_algo("forgetful-pg")
class Forgetful(plugrl_min.PG):
    """pg without its load_learner_state: the DDPAlgorithm hook is abstract again."""

    load_learner_state = plugrl_min.DDPAlgorithm.load_learner_state


def test_a_ddpalgorithm_that_leaves_a_hook_out_fails_at_make_algo_naming_it():
    with pytest.raises(TypeError, match="load_learner_state"):
        make_algo("forgetful-pg", small_policy(), plugrl_min.PGConfig())


# --- pg over the wire: it learns, resumes on its cadence, and never waits for a lost client -------

# A learn every 256 frames at a policy_lr of 3e-3 learns in a fifth of the default's frames; one thread per
# learn, as a busy 2-core machine learns fastest (two threads wait on each other at every operation).
PG_LEARNS_FAST = ["--algo.frames-per-learn", "256", "--algo.policy-lr", "0.003", "--learn-threads", "1"]


def pg_run(tmp_path, env_id, steps, seed, policy=("dummy-policy", "default"), *flags):
    """`python plugrl_min.py ... pg default --local-env-clients 1 --local-num-envs 16`, shortened: the mean
    return of each metrics line (every 1000 steps) that saw episodes."""
    run_dir = tmp_path / "run"
    result = python("plugrl_min.py", *policy, "pg", "default", *PG_LEARNS_FAST, *flags, "--local-env-clients", "1",
                    "--local-num-envs", "16", "--local-env", env_id, "--algo.global-steps", str(steps),
                    "--seed", str(seed), "--port", "0", "--run-dir", str(run_dir), timeout=180)
    assert result.returncode == 0, result.stderr
    lines = [line for line in read_metrics(run_dir) if line["rollout/episodes"]]
    return [line["rollout/reward"] for line in lines]


def test_pg_learns_dummy_v1_over_the_wire(tmp_path):
    rewards = pg_run(tmp_path, "dummy-v1", 15_000, 2, ("dummy-policy", "default"), "--policy.hidden-size", "64")
    assert rewards[0] < -20  # the first 1000 steps, before learning shows: the untrained policy scores about -31
    assert np.mean(rewards[-5:]) > -15  # a random policy cannot reach this; a good one is near -2 (here, by 15k)


def test_pg_learns_cartpole_v1_over_the_wire(tmp_path):
    rewards = pg_run(tmp_path, "cartpole-v1", 10_000, 2, ("categorical-policy", "cartpole"))
    assert rewards[0] < 30  # the first 1000 steps: random actions score about 22
    assert np.mean(rewards[-5:]) > 50  # about 110 by 10k steps


PG_FLAGS = ["--algo.frames-per-learn", "100", "--algo.save-every", "1", "--log-every", "1", "--learn-threads", "1"]


@wire
def test_pg_resume_continues_the_learn_cadence_exactly(tmp_path):
    run_dir, port = tmp_path / "run", reserve_port()
    command = ["dummy-policy", "default", "pg", "default", *PG_FLAGS, "--port", str(port), "--run-dir", str(run_dir)]
    # Both servers in this process, the second with --resume; a hand-driven client in a thread feeds each one.
    client, first = in_a_thread(asyncio.run, feed(port))
    assert run_main(*command, "--algo.global-steps", "250")[0] == 0
    client.join(30)
    assert first == [(250, RUN_END)]
    assert checkpoint_steps(run_dir) == [100, 200, 250]  # the last one mid-batch: 50 frames stored
    client, resumed = in_a_thread(asyncio.run, feed(port))
    status, out, err = run_main(*command, "--resume", "--algo.global-steps", "500")
    client.join(30)
    assert status == 0 and "resumed from step 250" in out, err
    assert resumed == [(250, RUN_END)]  # the global step went on from 250
    assert [line["step"] for line in read_metrics(run_dir)] == [100, 200, 300, 400, 500]
    assert [line["server/policy_version"] for line in read_metrics(run_dir)] == [1, 2, 3, 4, 5]
    payload = torch.load(run_dir / "checkpoints" / "step_000000000500.pt", weights_only=True)
    assert (payload["meta"]["learns"], payload["meta"]["stored"]) == (5, 0)  # pg's own counters came back too


@wire
def test_a_client_killed_mid_segment_never_stalls_pg(tmp_path, one_torch_thread):
    algo = pg_algo(frames_per_learn=100, global_steps=1000)

    async def script(port, server):
        doomed = await asyncio.create_subprocess_exec(  # a real process: it dies of kill -9, mid-segment
            sys.executable, *env_client_args(port, "--num-episodes", "0", "--num-envs", "3"), cwd=HERE,
            env=subprocess_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            await eventually(lambda: algo.learns >= 2, timeout=60)  # two learns with the doomed client
            other = asyncio.create_task(feed(port))
            await eventually(lambda: algo.learns >= 3, timeout=60)  # a learn with both clients
            doomed.kill()  # its environments owe feedback, their chains are open
            return await asyncio.wait_for(other, 120)
        finally:
            if doomed.returncode is None:
                doomed.kill()
            await doomed.wait()

    status, (_, closed) = run_server(algo, tmp_path, script, timeout=240, learn_threads=1)
    assert status == 0 and closed == RUN_END
    assert read_metrics(tmp_path, event="end")[0]["step"] == 1000


@wire
def test_pg_discards_stale_frames_after_learns_and_sac_discards_none(tmp_path, one_torch_thread):
    def run(uid, config):  # three env clients of 2 environments each, in this process, to the end of the run
        algo = make_algo(uid, small_policy(), config)
        algo.init_optimizers()

        async def script(port, server):
            return await asyncio.gather(*(env_client_in_process("dummy-v1", "--server-port", port, "--num-envs", "2",
                                                                "--num-episodes", "0") for _ in range(3)))

        status, client_statuses = run_server(algo, tmp_path / type(algo).__name__, script, learn_threads=1)
        assert status == 0 and client_statuses == [0, 0, 0]
        lines = read_metrics(tmp_path / type(algo).__name__, event=None)
        return sum(line["server/discarded"] for line in lines), sum(line["server/fed"] for line in lines)

    discarded, fed = run("pg", plugrl_min.PGConfig(frames_per_learn=64, global_steps=1000))
    assert discarded > 0 and fed >= 1000  # a message of 2 frames may carry it past 1000
    discarded, fed = run("sac", sac_example.SACConfig(learning_starts=100, global_steps=300, batch_size=32))
    assert discarded == 0 and fed >= 300


# --- sac_example.py: registered, its networks and storage -----------------------------------------

def filled_sac(seed=0, frames=200, **overrides):
    """A SAC on dummy-policy with `frames` random frames stored and its owed updates done."""
    torch.manual_seed(seed)
    config = dataclasses.replace(sac_example.SACConfig(), learning_starts=100, batch_size=32, **overrides)
    algo = make_algo("sac", make_policy("dummy-policy"), config)
    algo.init_optimizers()
    rng = np.random.default_rng(seed)
    for _ in range(frames):
        obs = observation(1, states={"state": rng.standard_normal((1, 3), dtype=np.float32)})
        action, runtime_state = algo.infer(obs)
        train_state = algo.derive_train_state(runtime_state)
        algo.feedback(obs=row_obs(obs["states"]["state"][0]), runtime_state=runtime_state,
                      train_state={"action": train_state["action"][0]}, terminated=False, truncated=False,
                      next_obs=row_obs(rng.standard_normal(3, dtype=np.float32)), reward=float(rng.standard_normal()),
                      info={}, next_terminated=False, next_truncated=False, prev_node=(-1, ""))
        if algo.should_learn():
            algo.learn()
    return algo


def round_trip(algo):
    """create_checkpoint, torch.save, torch.load(weights_only=True), load into a fresh SAC of another seed."""
    buffer = io.BytesIO()
    torch.save(dataclasses.asdict(algo.create_checkpoint()), buffer)
    buffer.seek(0)
    payload = torch.load(buffer, weights_only=True)
    torch.manual_seed(12345)
    fresh = make_algo("sac", make_policy("dummy-policy"), algo.config)
    fresh.init_optimizers()
    fresh.load_checkpoint(Checkpoint(**payload))
    return fresh


@wire
def test_sac_is_fed_a_frame_whose_action_an_older_policy_version_chose(tmp_path, one_torch_thread):
    config = dataclasses.replace(sac_example.SACConfig(), learning_starts=1, batch_size=2, global_steps=None)
    algo = make_algo("sac", small_policy(), config)
    algo.init_optimizers()
    fed, discarded = [], []  # (the frame's tag, the policy version when it was routed)

    async def script(port, server):
        original_feedback, original_discard = algo.feedback, algo.discard_feedback
        algo.feedback = lambda **frame: (fed.append((float(frame["obs"]["states"]["state"][0]), server.version)),
                                         original_feedback(**frame))[1]
        algo.discard_feedback = lambda **frame: (discarded.append(frame), original_discard(**frame))[1]
        a, b = await Client.connect(port), await Client.connect(port)
        await a.infer([0], [1])  # a acts with version 0 ...
        assert server.version == 0
        for _ in range(3):
            await b.step([0], [2])  # ... b's frames make learns due: version 1, 2
        await eventually(lambda: server.version >= 1)
        await a.feedback([0], [1])  # a's frame is stale now
        await eventually(lambda: len(fed) + len(discarded) == 4)
        await a.close()
        await b.close()

    status, _ = run_server(algo, tmp_path, script, learn_threads=1)
    assert status == 0 and discarded == [] and len(fed) == 4
    assert [version for tag, version in fed if tag == 1] >= [1]  # fed, though a learn came after its action


def test_sac_stores_a_stacked_reward_as_its_sum():
    algo = filled_sac(frames=0)
    obs, action = row_obs(np.zeros(3, np.float32)), {"action": np.zeros((1, 1), np.float32)}
    algo.feedback(obs=obs, runtime_state=action, train_state=action, terminated=False, truncated=False,
                  next_obs=obs, reward=np.array([1.0, 2.0, 0.0], np.float32), info={}, next_terminated=False,
                  next_truncated=False, prev_node=(-1, ""))
    assert algo.buffer.size == 1 and algo.buffer.reward[0] == 3.0


@wire
def test_sac_server_trains_to_the_end_with_a_closed_loop_client(tmp_path, capsys, one_torch_thread):
    config = dataclasses.replace(sac_example.SACConfig(), global_steps=300, learning_starts=100, batch_size=32)
    algo = make_algo("sac", make_policy("dummy-policy"), config)
    algo.init_optimizers()

    async def script(port, server):
        return await env_client_in_process("pendulum-v1", "--server-port", port, "--num-episodes", "0",
                                           "--closed-loop-steps", "3", "--controller", "track")

    status, client_status = run_server(algo, tmp_path, script, learn_threads=1)
    out, err = capsys.readouterr()
    assert client_status == 0 and status == 0, err
    assert "run finished: global step 300" in out and algo.updates == 300 - 100


def test_sac_example_script_help_lists_algo_flags():
    result = subprocess.run([sys.executable, "sac_example.py", "dummy-policy", "default", "sac", "default", "--help"],
                            cwd=HERE, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "--algo.batch-size" in result.stdout
    assert "warning" not in result.stderr  # no field shared by the policy and the algorithm config


def test_twin_critic_rows_are_two_independent_mlps():
    critic = sac_example.TwinQ(4, 32, plugrl_min.ObsEncoder({"states": {"state": [[3], "float32"]}}))
    state, action = torch.randn(8, 3), torch.randn(8, 1)
    obs = {"images": {}, "states": {"state": state}}
    expected = []
    for c in range(2):  # each critic alone, layer by layer, from its slice of the stacked weights
        x = torch.cat([state, action], dim=-1)
        for k, (weight, bias) in enumerate(zip(critic.weights, critic.biases)):
            x = x @ weight[c] + bias[c]
            x = x.relu() if k < 2 else x
        expected.append(x.squeeze(-1))
    q = critic(obs, action)
    assert q.shape == (2, 8)
    assert torch.allclose(q, torch.stack(expected), atol=1e-5)
    assert not torch.allclose(q[0], q[1])  # independently initialised: two critics, not one twice


def feed_sac(algo, *, next_terminated=False, next_truncated=False, info=None):
    """One frame of zeros into algo.feedback."""
    return algo.feedback(obs=row_obs(np.zeros(3, np.float32)), runtime_state=None,
                         train_state={"action": np.zeros((1, 1), np.float32)}, terminated=False, truncated=False,
                         next_obs=row_obs(np.ones(3, np.float32)), reward=1.5, info=info or {},
                         next_terminated=next_terminated, next_truncated=next_truncated, prev_node=(-1, ""))


def test_the_critic_target_takes_the_smaller_twin_and_stops_at_termination():
    reward = torch.tensor([1.0, 1.0, 1.0])
    done = torch.tensor([0.0, 1.0, 0.0])
    next_q = torch.tensor([[10.0, 10.0, 2.0], [4.0, 4.0, 3.0]])  # [2, B]: Q1' and Q2'
    next_log_prob = torch.tensor([-1.0, -1.0, 0.0])
    target = sac_example.td_target(reward, done, next_q, next_log_prob, alpha=0.5, gamma=0.9)
    # 1 + 0.9 * (min(10, 4) + 0.5); terminated: 1 alone; 1 + 0.9 * min(2, 3)
    assert target.tolist() == pytest.approx([5.05, 1.0, 2.8])


def test_termination_stops_bootstrapping_and_truncation_does_not():
    algo = make_algo("sac", make_policy("dummy-policy"))
    feed_sac(algo, next_truncated=True)
    feed_sac(algo, next_terminated=True)
    assert algo.buffer.done[:2].tolist() == [0.0, 1.0]
    assert algo.buffer.reward[:2].tolist() == [1.5, 1.5] and algo.buffer.next_obs["states"]["state"][1].tolist() == [1.0, 1.0, 1.0]


def test_feedback_counts_the_frame_and_records_finished_episodes():
    algo = make_algo("sac", make_policy("dummy-policy"))
    episode = {"r": np.float32(-7.0), "l": np.int64(50), "s": np.bool_(False), "mask": np.bool_(True)}
    assert feed_sac(algo, next_truncated=True, info={"episode": episode}) == ((-1, ""), 1, {})
    _, log = algo.build_train_info(algo.global_step, {})
    assert log["rollout/episodes"] == 1 and log["rollout/reward"] == -7.0


# --- SAC on every key ----------------------------------------------------------------------------

def image_sac(**config):
    policy = make_policy("dummy-policy", dataclasses.replace(plugrl_min.DummyPolicyConfig(hidden_size=16),
                                                             obs_spec=IMAGE_AND_STATE))
    defaults = dict(global_steps=400, learning_starts=40, batch_size=16, q_hidden_size=16)
    algo = make_algo("sac", policy, sac_example.SACConfig(**{**defaults, **config}))
    algo.init_optimizers()
    return algo


def test_sacs_replay_buffer_keeps_every_key_in_its_dtype():
    algo = image_sac()
    obs = plugrl_min.split_rows(image_and_state_obs(1), 1)[0]
    algo.feedback(obs=obs, runtime_state=None, train_state={"action": np.zeros((1, 1), np.float32)},
                  terminated=False, truncated=False, next_obs=obs, reward=1.0, info={}, next_terminated=False,
                  next_truncated=False, prev_node=(-1, ""))
    image = algo.buffer.obs["images"]["image"]
    assert image.dtype == np.uint8 and image[0].max() == 255 and "text" not in algo.buffer.obs
    assert algo.buffer.next_obs["states"]["state"].dtype == np.float32


def test_sacs_replay_buffer_holds_no_more_frames_than_the_run_stores():
    assert image_sac(global_steps=400, buffer_size=10**6).buffer.capacity == 400


def test_sac_refuses_a_buffer_larger_than_the_memory_available_in_one_line_naming_the_flag():
    status, _, err = run_main("dummy-policy", "default", "sac", "default", "--algo.buffer-size", str(10**13),
                              "--algo.global-steps", "none", "--port", "0")
    (line,) = err.strip().splitlines()
    assert status == 2 and re.search(r"replay buffer needs [\d,]+ bytes", line) and "--algo.buffer-size" in line


# --- sac_example.py: its update schedule and checkpoints ------------------------------------------

def test_infer_gives_uniform_random_actions_before_learning_starts():
    algo = make_algo("sac", make_policy("dummy-policy"))
    action, runtime_state = algo.infer(observation(4000, states={"state": np.zeros((4000, 3), np.float32)}))
    assert action.shape == (4000, 1, 1) and action.dtype == np.float32
    assert np.array_equal(runtime_state["action"], action)
    assert action.min() >= -1 and action.max() <= 1
    assert abs(action.mean()) < 0.05 and action.std() > 0.5  # uniform on [-1, 1] has std 0.58; the policy's is ~0


def test_learn_catches_up_one_update_per_frame_and_then_stops_learning():
    algo = filled_sac(frames=100)  # exactly learning_starts: nothing owed yet
    assert not algo.should_learn()
    for _ in range(40):  # 40 frames at once, as from 40 environments
        feed_sac(algo)
    assert algo.should_learn()
    algo.learn()
    assert algo.updates == 40
    assert not algo.should_learn()


def test_learn_with_a_buffer_smaller_than_a_batch_skips_updates_without_spinning():
    algo = filled_sac(frames=0)
    algo.global_step = 1000  # as after --resume: counters restored, buffer empty
    algo.updates = 690
    before = [p.detach().clone() for p in algo.critic.parameters()]
    algo.learn()
    assert not algo.should_learn()
    assert all(torch.equal(a, b) for a, b in zip(before, algo.critic.parameters()))


def test_should_save_turns_false_once_create_checkpoint_has_run():
    algo = filled_sac(frames=200, save_every=100)
    assert algo.should_save()
    algo.create_checkpoint()
    assert not algo.should_save()


def test_checkpoint_round_trip_restores_every_counter():
    algo = filled_sac(frames=200, save_every=100)
    fresh = round_trip(algo)
    assert (fresh.global_step, fresh.updates, fresh.saved_at) == (200, 100, 100)
    assert fresh.should_learn() == algo.should_learn() and fresh.should_save() == algo.should_save()


def test_checkpoint_round_trip_restores_networks_optimizers_and_alpha():
    algo = filled_sac(frames=200)
    fresh = round_trip(algo)
    for mine, theirs in ((algo.policy, fresh.policy), (algo.critic, fresh.critic),
                         (algo.critic_target, fresh.critic_target)):
        for (name, a), (_, b) in zip(mine.state_dict().items(), theirs.state_dict().items()):
            assert torch.equal(a, b), name
    assert torch.equal(algo.log_alpha, fresh.log_alpha)
    for name in ("q_optimizer", "actor_optimizer"):
        a, b = getattr(algo, name).state_dict()["state"], getattr(fresh, name).state_dict()["state"]
        assert a.keys() == b.keys() and len(a) > 0
        assert all(torch.equal(a[k]["exp_avg"], b[k]["exp_avg"]) for k in a), name


@wire
def test_resume_continues_the_update_schedule_over_the_wire(tmp_path):
    run_dir, port = tmp_path / "run", reserve_port()
    command = ["dummy-policy", "default", "sac", "default", "--seed", "0", "--algo.learning-starts", "100",
               "--algo.batch-size", "32", "--algo.q-hidden-size", "32", "--policy.hidden-size", "32",
               "--learn-threads", "1", "--port", str(port), "--run-dir", str(run_dir)]
    # Both servers in this process, the second with --resume; a hand-driven client in a thread feeds each one.
    client, first = in_a_thread(asyncio.run, feed(port))
    assert run_main(*command, "--algo.global-steps", "300")[0] == 0
    client.join(30)
    client, second = in_a_thread(asyncio.run, feed(port))
    status, out, err = run_main(*command, "--algo.global-steps", "400", "--resume")
    client.join(30)
    assert status == 0 and "resumed from step 300" in out, err
    assert (first, second) == ([(300, RUN_END)], [(100, RUN_END)])
    payload = torch.load(run_dir / "checkpoints" / "step_000000000400.pt", weights_only=True)
    assert payload["meta"]["updates"] == 400 - 100  # one update slot per frame past learning_starts, both runs


# --- sac_example.py: learning over the wire -------------------------------------------------------

@wire
def test_sac_learns_dummy_v1_far_better_than_random(tmp_path, one_torch_thread):
    # A random policy scores about -25 on dummy-v1, a good one about -3 to -8. Small networks and batches
    # keep this to seconds; it gets there in about 1000 frames past learning_starts.
    torch.manual_seed(1)
    config = sac_example.SACConfig(learning_starts=300, global_steps=1500, batch_size=64, q_hidden_size=64)
    algo = make_algo("sac", make_policy("dummy-policy", plugrl_min.DummyPolicyConfig(hidden_size=64)), config)
    algo.init_optimizers()

    async def script(port, server):  # the env client in a thread of this process, over a WebSocket all the same
        return await env_client_in_process("dummy-v1", "--server-port", port, "--seed", "1", "--num-episodes", "0",
                                           "--summary-json", tmp_path / "summary.json")

    assert run_server(algo, tmp_path / "run", script, learn_threads=1) == (0, 0)
    returns = json.loads((tmp_path / "summary.json").read_text())["returns"]
    assert len(returns) >= 30
    assert np.mean(returns[-20:]) > -12, returns[-20:]


# =============================================================================================
# 8. Wire format: each message one msgpack map in one binary WebSocket frame
# =============================================================================================
# pack_message and unpack_message against the msgpack package with openpi's hooks, byte for byte; what
# they refuse; then the WebSocket layer under them, by hand on a raw socket. Nothing is ever unpickled.

# --- The reference: the msgpack package with openpi's two hooks, as PlugRL's SPEC (3.2) lays them out ---

def msgpack_or_skip():
    return pytest.importorskip("msgpack", reason="msgpack is the tests' reference codec: pip install msgpack")


def openpi_pack_array(value):
    """openpi's pack_array: the default hook of msgpack.packb."""
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in ("V", "O", "c"):
        raise ValueError(f"Unsupported dtype: {value.dtype}")
    if isinstance(value, np.ndarray):
        return {b"__ndarray__": True, b"data": value.tobytes(), b"dtype": value.dtype.str, b"shape": value.shape}
    if isinstance(value, np.generic):
        return {b"__npgeneric__": True, b"data": value.item(), b"dtype": value.dtype.str}
    return value


def openpi_unpack_array(value):
    """openpi's unpack_array: the object hook of msgpack.unpackb."""
    if b"__ndarray__" in value:
        return np.ndarray(buffer=value[b"data"], dtype=np.dtype(value[b"dtype"]), shape=value[b"shape"])
    if b"__npgeneric__" in value:
        return np.dtype(value[b"dtype"]).type(value[b"data"])
    return value


def reference_pack(message) -> bytes:
    return msgpack_or_skip().packb(message, default=openpi_pack_array)


def reference_unpack(frame: bytes):
    return msgpack_or_skip().unpackb(frame, object_hook=openpi_unpack_array)


def array_map(dtype, shape, data) -> dict:
    """An array's map as a peer may write it, right or wrong: it unpacks as an array, or is refused."""
    return {b"__ndarray__": True, b"data": data, b"dtype": dtype, b"shape": shape}


def step_messages(n: int, seed: int = 0) -> list[dict]:
    """An infer, its action and a feedback for n environments, with what the wire must carry besides: nested
    info, a <U text array, numpy scalars, an empty array, a 180 KB camera frame, a big-endian array."""
    rng = np.random.default_rng(seed)
    obs = {"state": rng.random((n, 3), np.float32), "camera": rng.integers(0, 256, (1, 224, 268, 3), np.uint8)}
    info = {"episode": {"r": rng.random(n, np.float32), "l": np.ones(n, np.int64), "s": np.zeros(n, bool),
                        "mask": np.ones(n, bool)},
            "task": np.array(["pick up the red block", "stack"] * n)[:n], "contacts": np.zeros((n, 0), np.float32),
            "force": np.arange(n, dtype=">f8"), "nested": {"at": [np.int64(3), np.float32(0.5), 1.5, None, "x"]}}
    return [{"message_type": "infer", "env_indices": np.arange(n), "obs": obs},
            {"message_type": "action", "env_indices": np.arange(n), "action": rng.random((n, 1, 1), np.float32)},
            {"message_type": "feedback", "env_indices": np.arange(n), "obs": obs, "reward": rng.random(n, np.float32),
             "terminated": np.zeros(n, bool), "truncated": np.ones(n, bool), "info": info}]


def assert_same_values(got, want, path="message"):
    """The same tree: the same containers and keys, arrays of the same dtype, shape and elements."""
    if isinstance(want, np.ndarray):  # in this machine's byte order: a big-endian array is read as numbers
        assert isinstance(got, np.ndarray) and got.shape == want.shape, path
        assert got.dtype == want.dtype.newbyteorder("=") and np.array_equal(got, want), path
    elif isinstance(want, dict):
        assert isinstance(got, dict) and got.keys() == want.keys(), path
        for key in want:
            assert_same_values(got[key], want[key], f"{path}.{key}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(got, list) and len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            assert_same_values(a, b, f"{path}[{i}]")
    else:
        assert type(got) is type(want) and got == want, (path, got, want)


# --- A step's messages, byte for byte what msgpack writes with openpi's hooks, both ways -----------

@contract
@pytest.mark.parametrize("n", [1, 64])
@wire
def test_a_steps_messages_pack_to_the_bytes_msgpack_writes_with_openpis_hooks(n):
    for message in step_messages(n):
        assert pack_message(message) == reference_pack(message), message["message_type"]


@contract
@pytest.mark.parametrize("n", [1, 64])
@wire
def test_a_steps_messages_packed_by_msgpack_unpack_to_what_msgpack_unpacks_them_to(n):
    for message in step_messages(n):
        frame = reference_pack(message)
        assert_same_values(unpack_message(frame), reference_unpack(frame))


INTS = [0, 127, 128, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1, 2**64 - 1,
        -1, -32, -33, -128, -129, -32768, -32769, -2**31, -2**31 - 1, -2**63]


@contract
@pytest.mark.parametrize("value", INTS)
@wire
def test_an_int_packs_in_the_smallest_width_as_msgpack_packs_it_and_comes_back(value):
    frame = pack_message({"x": value})
    assert frame == reference_pack({"x": value}) and unpack_message(frame)["x"] == value


@contract
@pytest.mark.parametrize("length", [0, 15, 16, 31, 32, 255, 256, 65535, 65536])
@wire
def test_str_bin_lists_and_maps_of_every_length_class_pack_as_msgpack_packs_them(length):
    message = {"s": "é" * (length // 2) + "x" * (length % 2), "b": bytes(length), "l": list(range(length)),
               "t": tuple("ab"), "m": {str(i): i for i in range(length)}}
    assert pack_message(message) == reference_pack(message)
    assert_same_values(unpack_message(pack_message(message)), {**message, "t": ["a", "b"]})


@contract
@wire
def test_what_a_peer_may_write_unpacks_float32_and_the_widths_msgpack_would_not_choose():
    frame = (b"\x85" + b"\xa1f\xca" + struct.pack(">f", 0.5) + b"\xa1u\xcf" + (7).to_bytes(8, "big")
             + b"\xa1s\xdb" + (2).to_bytes(4, "big") + b"hi" + b"\xa1a\xdd" + (1).to_bytes(4, "big") + b"\xc0"
             + b"\xa1m\xdf" + (1).to_bytes(4, "big") + b"\xc4\x01k\xc3")
    assert unpack_message(frame) == {"f": 0.5, "u": 7, "s": "hi", "a": [None], "m": {b"k": True}}


@contract
@pytest.mark.parametrize("scalar", [np.float32(1.5), np.int64(-3), np.bool_(True), np.uint8(255), np.float16(-2)],
                         ids=repr)
@wire
def test_a_numpy_scalar_travels_as_openpis_npgeneric_and_comes_back_of_its_type(scalar):
    frame = pack_message({"x": scalar})
    assert frame == reference_pack({"x": scalar}) and b"__npgeneric__" in frame
    back = unpack_message(frame)["x"]
    assert type(back) is type(scalar) and back == scalar


@contract
@wire
def test_an_np_float64_packs_as_a_float_as_msgpack_packs_it():
    assert unpack_message(pack_message({"x": np.float64(2.5)})) == {"x": 2.5}  # a float subclass


DTYPES = ["|b1", "|u1", "<u2", "<u4", "<u8", "|i1", "<i2", "<i4", "<i8", "<f2", "<f4", "<f8", "<U5"]


def sample(dtype: str, shape) -> np.ndarray:
    values = np.asarray(np.arange(math.prod(shape)).reshape(shape) % 7)  # 0-d stays an array
    return values.astype(dtype)


@contract
@pytest.mark.parametrize("dtype", DTYPES)
@wire
def test_an_array_of_every_dtype_and_shape_round_trips_keeping_its_typestr(dtype):
    for shape in [(), (0,), (5,), (2, 3), (2, 0, 4)]:
        array = sample(dtype, shape)
        frame = pack_message({"a": array})
        assert frame == reference_pack({"a": array})
        back = unpack_message(frame)["a"]
        assert (back.dtype.str, back.shape) == (dtype, shape) and np.array_equal(back, array)


@contract
@wire
def test_text_travels_as_utf32_nul_padded_to_its_longest_string():
    frame = pack_message({"text": np.array(["pick up the red block", "stack"])})
    assert b"<U21" in frame and "stack".encode("utf-32-le") + bytes(4 * 16) in frame
    assert unpack_message(frame)["text"].tolist() == ["pick up the red block", "stack"]


@contract
@wire
def test_a_big_endian_array_is_read_with_its_values_in_this_machines_byte_order():
    array = np.array([1.5, -2.0], ">f4")
    frame = pack_message({"a": array})
    assert frame == reference_pack({"a": array}) and array.tobytes() in frame  # sent as it is
    back = unpack_message(frame)["a"]
    assert back.dtype == np.dtype("=f4") and back.tolist() == [1.5, -2.0]


@contract
@wire
def test_a_view_packs_its_own_elements_in_c_order():
    grid = np.arange(24, dtype=np.int32).reshape(4, 6)
    for view in (grid.T, grid[::2, 1:], grid[:, ::-1], np.asfortranarray(grid)):
        assert pack_message({"v": view}) == reference_pack({"v": view})
        assert unpack_message(pack_message({"v": view}))["v"].tolist() == view.tolist()


@contract
@pytest.mark.parametrize("kind", [bytes, bytearray])
@wire
def test_a_received_array_is_a_read_only_view_of_the_frame_not_a_copy(kind):
    frame = kind(pack_message({"camera": np.ones((224, 268, 3), np.uint8), "state": np.ones((2, 2))}))
    for array in unpack_message(frame).values():
        assert not array.flags.writeable and np.shares_memory(array, np.frombuffer(frame, np.uint8))


@contract
@wire
def test_a_frame_laid_out_as_one_read_before_is_not_parsed_again_and_gives_its_own_values(monkeypatch):
    first, again = (pack_message(step_messages(8, seed)[2]) for seed in (1, 2))
    assert len(first) == len(again) and first != again  # the same keys, dtypes and shapes, other values
    read_first = unpack_message(first)
    read_first["info"]["episode"]["mask"] = "changed by its reader"
    parsed = []
    monkeypatch.setattr(plugrl_min, "_read", lambda *args: parsed.append(args) or pytest.fail("parsed"))
    got = unpack_message(again)
    assert not parsed
    assert_same_values(got, step_messages(8, seed=2)[2])  # not the first frame's values, nor its reader's
    assert np.shares_memory(got["obs"]["camera"], np.frombuffer(again, np.uint8))


@contract
@pytest.mark.parametrize("before, after", [({"ab": np.arange(3)}, {"cd": np.arange(3)}),
                                           ({"a": np.zeros(3, "<i4")}, {"a": np.ones(3, "<f4")}),
                                           ({"a": np.zeros((2, 3))}, {"a": np.ones((3, 2))}),
                                           ({"a": [np.arange(3), "x"]}, {"a": ["y", np.arange(3)]})],
                         ids=["a key", "a dtype", "a shape", "an order"])
@wire
def test_a_frame_of_the_same_length_laid_out_otherwise_is_read_as_its_own(before, after):
    frames = pack_message(before), pack_message(after)
    assert len(frames[0]) == len(frames[1])
    unpack_message(frames[0])
    assert_same_values(unpack_message(frames[1]), after)


# --- What is refused: each a ProtocolError that says which ---------------------------------------

def refusal_by_unpack(frame) -> str:
    """What unpack_message says of frame; fails if it accepts it, or raises anything but a ProtocolError."""
    with pytest.raises(ProtocolError) as refusal:
        unpack_message(frame)
    return str(refusal.value)


@contract
@wire
def test_a_text_frame_is_rejected():
    assert "text frame" in refusal_by_unpack('{"message_type": "infer"}')


@contract
@pytest.mark.parametrize("ext", [b"\xd4\x01\x00", b"\xd8\x01" + bytes(16), b"\xc7\x03\x01abc",
                                 b"\xd6\xff" + bytes(4), b"\xc1"], ids=["fixext1", "fixext16", "ext8", "timestamp",
                                                                        "0xc1"])
@wire
def test_an_extension_type_or_an_unused_byte_is_rejected_naming_it(ext):
    said = refusal_by_unpack(b"\x81\xa1x" + ext)
    assert f"byte 0x{ext[0]:02x} at offset 3" in said


@contract
@wire
def test_a_frame_cut_anywhere_is_rejected():
    frame = pack_message(step_messages(2)[2])
    for cut in [*range(0, 200), *range(200, len(frame), 997)]:
        assert refusal_by_unpack(frame[:cut])


@contract
@pytest.mark.parametrize("extra", [b"\x00", b"\xc0", b"\x80", b"\x81\xa1a\x01"], ids=repr)
@wire
def test_bytes_left_over_after_the_map_are_rejected(extra):
    assert f"{len(extra)} bytes follow the message's end" in refusal_by_unpack(pack_message({"a": 1}) + extra)


@contract
@pytest.mark.parametrize("top", [[1, 2], 1, "infer", None, True], ids=repr)
@wire
def test_a_frame_that_is_not_a_map_is_rejected(top):
    assert "a message is a map" in refusal_by_unpack(reference_pack(top))


@contract
@pytest.mark.parametrize("key", [1, None, 1.5, [1], {}], ids=repr)
@wire
def test_a_map_key_that_is_neither_str_nor_bin_is_rejected(key):
    assert "keys are str or bin" in refusal_by_unpack(b"\x81" + reference_pack(key) + b"\x01")


@contract
@wire
def test_a_str_that_is_not_utf8_is_rejected():
    assert "not UTF-8" in refusal_by_unpack(b"\x81\xa1x\xa2\xff\xfe")


@contract
@wire
def test_nesting_deeper_than_64_levels_is_refused_both_ways():
    message = {"x": 7}
    for _ in range(plugrl_min._MAX_DEPTH - 2):  # 63 maps: the 7 is at level 64, the limit
        message = {"x": message}
    assert unpack_message(pack_message(message)) == message
    with pytest.raises(ProtocolError, match="deeper than 64 levels"):
        pack_message({"x": message})
    for depth in (65, 100_000):  # the depth is counted as it is read: no RecursionError
        assert "deeper than 64" in refusal_by_unpack(b"\x81\xa1x" + b"\x91" * depth + b"\xc0")


@contract
@wire
def test_a_message_that_holds_itself_is_refused():
    message = {"a": 1}
    message["self"] = message
    with pytest.raises(ProtocolError, match="deeper"):
        pack_message(message)


@contract
@pytest.mark.parametrize("value", [{1, 2}, object(), 2**64, -2**63 - 1, 1j],
                         ids=["set", "object", "2**64", "-2**63 - 1", "complex"])
@wire
def test_a_value_msgpack_cannot_carry_is_refused_when_packing(value):
    with pytest.raises(ProtocolError):
        pack_message({"x": value})


@contract
@pytest.mark.parametrize("head", [b"\xdb", b"\xc6", b"\xdd", b"\xdf"], ids=["str32", "bin32", "array32", "map32"])
@wire
def test_a_length_past_the_frames_end_is_rejected_before_anything_is_allocated(head):
    frame = b"\x81\xa1x" + head + b"\xff\xff\xff\xff" + bytes(16)  # 4 billion bytes or items, 16 sent
    tracemalloc.start()
    try:
        said = refusal_by_unpack(frame)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "runs past the frame's end" in said and peak < 2**20


@contract
@pytest.mark.parametrize("shape", [[10**12], [2**40, 2**40], [10**6] * 4, [1, 10**15], [2**62, 3]])
@wire
def test_a_huge_declared_shape_is_rejected_without_allocating_it(shape):
    tracemalloc.start()
    try:
        said = refusal_by_unpack(pack_message({"x": array_map("<f8", shape, bytes(8))}))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert "bytes of data, got 8 bytes" in said and peak < 2**20


@contract
@pytest.mark.parametrize("data", [bytes(11), bytes(13), bytes(0), "twelve bytes", None, 12], ids=repr)
@wire
def test_an_array_whose_data_is_not_its_shapes_bytes_is_rejected(data):
    assert "needs 12 bytes of data" in refusal_by_unpack(pack_message({"x": array_map("<f4", [3], data)}))


@contract
@pytest.mark.parametrize("shape", [[-1], [2.5], ["3"], [True], 3, None, [[1]], [1] * 33], ids=repr)
@wire
def test_a_shape_that_is_not_a_list_of_sizes_is_rejected(shape):
    assert "shape must be a list of sizes" in refusal_by_unpack(pack_message({"x": array_map("<f4", shape, b"")}))


@contract
@pytest.mark.parametrize("dtype", ["|O8", "|V4", "<c8", "<M8[s]", "float32", "f4", "<f5", "<i3", "|S4", 5, None],
                         ids=repr)
@wire
def test_a_dtype_that_is_not_a_typestr_of_bool_int_uint_float_or_text_is_rejected(dtype):
    assert "dtype" in refusal_by_unpack(pack_message({"x": array_map(dtype, [1], bytes(8))}))


@contract
@pytest.mark.parametrize("value", [np.array([1, "a"], object), np.array([1 + 2j]), np.zeros(2, "|V4"),
                                   np.complex64(1j)], ids=["object", "complex", "structured", "complex scalar"])
@wire
def test_an_object_structured_or_complex_dtype_is_refused_when_packing(value):
    with pytest.raises(ProtocolError, match="cannot send dtype"):
        pack_message({"x": value})


@contract
@wire
def test_a_text_array_holding_a_code_point_above_u10ffff_is_rejected_even_laid_out_as_a_good_one():
    good, bad = (pack_message({"text": array_map("<U1", [1], point.to_bytes(4, "little"))})
                 for point in (0x10FFFF, 0x110000))  # numpy raises SystemError on reading the bad one
    assert "above U+10FFFF" in refusal_by_unpack(bad)
    assert unpack_message(good)["text"][0] == chr(0x10FFFF)
    assert "above U+10FFFF" in refusal_by_unpack(bad)  # as one more frame of the good one's layout


@contract
@wire
def test_a_map_that_has_a_key_twice_is_rejected():
    assert "the key 'x' twice" in refusal_by_unpack(b"\x82\xa1x\x01\xa1x\x02")


@contract
@pytest.mark.parametrize("data", ["x", 300, None, [1]], ids=repr)
@wire
def test_a_numpy_scalar_that_cannot_hold_its_data_is_rejected(data):
    frame = pack_message({"x": {b"__npgeneric__": True, b"data": data, b"dtype": "|u1"}})
    assert "cannot hold" in refusal_by_unpack(frame)


@contract
def test_no_pickle_anywhere_in_the_code():
    with open(SOURCE, "rb") as file:  # names in the code itself, not in comments or strings
        names = {token.string for token in tokenize.tokenize(file.readline) if token.type == tokenize.NAME}
    assert not [name for name in names if "pickle" in name.lower()]


# --- A client of another codec: msgpack's own frames reach the algorithm as ours do ----------------

@wire
def test_a_feedback_packed_by_msgpack_with_openpis_hooks_gives_the_algorithm_the_frames_ours_gives(tmp_path):
    feedback = good_message("feedback")
    feedback["data"]["rewards"] = np.array([0.5, -2.25], ">f4")  # a big-endian peer, too
    frames = [reference_pack(feedback), pack_message(feedback)]

    async def script(port, server):
        for frame in frames:  # one client each, one environment tagged 1, one tagged 2
            client = await Client.connect(port)
            await client.infer(list(range(N)), [1, 2])
            await client.ws.send(frame)
            await client.infer(list(range(N)), [1, 2])  # answered: the feedback was taken
        return server.algo.frames

    status, stored = run_server(Probe(), tmp_path, script)
    assert len(stored) == 2 * N and status == 0
    for theirs, ours in zip(stored[:N], stored[N:]):
        for key in ("reward", "next_terminated", "next_truncated"):
            assert theirs[key] == ours[key]
        np.testing.assert_array_equal(theirs["next_obs"]["states"]["state"], ours["next_obs"]["states"]["state"])
    assert [frame["reward"] for frame in stored[:N]] == [0.5, -2.25]


# --- The WebSocket layer, by hand on a raw socket, as README.md tells a client without a library ---

def raw_websocket(port) -> tuple[socket.socket, bytes]:
    """RFC 6455's handshake written by hand: the socket, and the bytes read past the 101 response."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, rest = data.split(b"\r\n\r\n", 1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock, rest


def ws_frame(payload: bytes, opcode=2, fin=True, mask=True) -> bytes:
    """One client frame: binary (2) or continuation (0), masked as RFC 6455 requires of a client."""
    n = len(payload)
    size = bytes([n]) if n < 126 else bytes([126]) + n.to_bytes(2, "big")
    head = bytes([0x80 * fin | opcode, size[0] | 0x80 * mask]) + size[1:]
    if not mask:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(byte ^ key[i % 4] for i, byte in enumerate(payload))


def read_ws_frame(sock, buffered: bytes) -> tuple[int, bytes, bytes]:
    """The server's next frame (unmasked, unfragmented): (opcode, payload, the bytes read past it)."""
    def take(count):
        nonlocal buffered
        while len(buffered) < count:
            buffered += sock.recv(65536)
        part, buffered = buffered[:count], buffered[count:]
        return part

    first, second = take(2)
    n = second & 0x7F
    n = int.from_bytes(take(2), "big") if n == 126 else int.from_bytes(take(8), "big") if n == 127 else n
    return first & 0x0F, take(n), buffered


def raw_exchange(port, *frames: bytes) -> list[tuple[int, bytes]]:
    """Open by hand, read the metadata, send the frames, read until the server answers or closes."""
    sock, buffered = raw_websocket(port)
    with sock:
        opcode, metadata, buffered = read_ws_frame(sock, buffered)
        assert opcode == 2 and unpack_message(metadata)["message_type"] == "metadata"
        for frame in frames:
            sock.sendall(frame)
        opcode, payload, buffered = read_ws_frame(sock, buffered)
        return [(opcode, payload)]


@wire
def test_an_unmasked_client_frame_closes_the_connection_with_1002_and_no_error_message(tmp_path):
    infer = pack_message(infer_message([0], [0.5]))
    _, [(opcode, payload)] = run_server(Probe(), tmp_path, lambda port, server: asyncio.to_thread(
        raw_exchange, port, ws_frame(infer, mask=False)))
    assert opcode == 8 and payload[:2] == (1002).to_bytes(2, "big") and payload[2:] == b"incorrect masking"


@wire
def test_an_infer_in_two_fragments_is_answered_as_one_message(tmp_path):
    infer = pack_message(infer_message([0], [0.5]))
    fragments = [ws_frame(infer[:10], opcode=2, fin=False), ws_frame(infer[10:], opcode=0)]
    _, [(opcode, payload)] = run_server(Probe(), tmp_path, lambda port, server: asyncio.to_thread(
        raw_exchange, port, *fragments))
    assert opcode == 2 and actions_of(unpack_message(payload)).ravel().tolist() == [0.5]


@wire
def test_an_infer_for_no_environment_gets_an_action_for_no_environment(tmp_path):
    infer = pack_message(infer_message([], []))
    _, [(opcode, payload)] = run_server(dummy_algo(small_policy(), None), tmp_path, lambda port, server:
                                        asyncio.to_thread(raw_exchange, port, ws_frame(infer)))
    assert opcode == 2 and actions_of(unpack_message(payload)).shape == (0, 1, 1)


# =============================================================================================
# 9. Rows: a message's arrays, batched along axis 0, cut into each environment's rows
# =============================================================================================
# A feedback for some of a client's environments, an observation that is a dict of several arrays:
# each environment gets its own row of each.

@wire
def test_a_feedback_may_answer_a_subset_of_the_infers_environments_the_rest_a_later_one_each_its_own_row(
        tmp_path):
    async def script(port, server):  # SPEC 4.3: an environment whose decision still runs is answered later
        client = await Client.connect(port)
        await client.infer([7, 1000], [1, 2])  # the client's own names for its environments
        await client.ws.send(pack_message(feedback_message([1000], [2], info=..., rewards=np.full(1, 2.0))))
        await client.infer([1000], [2])
        await client.ws.send(pack_message(feedback_message([7, 1000], [1, 2], info=..., rewards=np.array([1.0, 3.0]))))
        await client.infer([7, 1000], [1, 2])
        return [(float(frame["runtime_state"]["tag"]), frame["reward"])
                for frame in server.algo.frames]

    status, frames = run_server(Probe(), tmp_path, script)
    assert frames == [(2.0, 2.0), (1.0, 1.0), (2.0, 3.0)] and status == 0


def test_two_observation_keys_train_over_the_wire_with_the_readmes_camera_and_its_policy(tmp_path):
    write_plugin(tmp_path, "plugrl_test_my_camera", readme_block("An observation is a dict of arrays"))
    words = readme_block("An observation is a dict of arrays", nth=1).split()[1:]
    result = python(*in_a_test(words, tmp_path), "--algo.frames-per-learn", "128", "--algo.global-steps", "640",
                    pythonpath=tmp_path, timeout=180)
    assert result.returncode == 0, result.stderr
    lines = read_metrics(tmp_path / "run", None)
    assert lines[-1]["server/policy_version"] == 5 and sum(line["rollout/episodes"] for line in lines) > 0


# =============================================================================================
# 10. Registries: where the command line finds policies, algorithms and environments
# =============================================================================================
# (uid, variant) -> a default config, uid -> a class; one registration per name; register_env and a
# plug-in's environment, found by its id.

# --- Registries: (uid, variant) -> default config instance; uid -> class --------------------------

class Minimal(plugrl_min.BaseAlgorithm):
    def learn_impl(self):
        return self.global_step, {}


@contract
@pytest.mark.parametrize("decorator, base", [("register_algo_config", ShortConfig),
                                             ("register_policy_config", ShortConfig),
                                             ("register_algo", Minimal),
                                             ("register_policy", plugrl_min.BaseTorchPolicy)])
def test_registering_the_same_uid_and_variant_twice_raises(decorator, base):
    register = getattr(plugrl_min, decorator)  # config decorators take (uid, variant="default"), classes (uid)
    register(f"twice-{decorator}")(type("First", (base,), {}))
    with pytest.raises(plugrl_min.UsageError, match="is registered twice, by "):
        register(f"twice-{decorator}")(type("Second", (base,), {}))


@contract
def test_a_config_variant_defaults_to_default():
    plugrl_min.register_algo_config("variants")(dataclasses.dataclass(type("Plain", (ShortConfig,), {})))
    plugrl_min.register_algo_config("variants", "long")(
        dataclasses.make_dataclass("Long", [("global_steps", int, 500)], bases=(ShortConfig,)))
    plugrl_min.register_algo("variants")(Minimal)
    policy = small_policy()
    assert plugrl_min.make_algo("variants", policy).config.global_steps == 5
    assert plugrl_min.make_algo("variants", policy, variant="default").config.global_steps == 5
    assert plugrl_min.make_algo("variants", policy, variant="long").config.global_steps == 500


@contract
def test_make_algo_of_a_registered_config_without_its_class_raises_keyerror():
    plugrl_min.register_algo_config("config-only-in-process")(ShortConfig)
    with pytest.raises(KeyError) as error:
        plugrl_min.make_algo("config-only-in-process", small_policy())
    assert error.value.args == ("Algorithm config-only-in-process is not registered.",)


@contract
def test_make_algo_gives_each_algorithm_its_own_copy_of_the_default_config():
    plugrl_min.register_algo_config("copies")(ShortConfig)
    plugrl_min.register_algo("copies")(type("Copies", (Minimal,), {}))
    first = plugrl_min.make_algo("copies", small_policy())
    first.config.global_steps = 99
    assert plugrl_min.make_algo("copies", small_policy()).config.global_steps == 5


# --- One name, one registration -------------------------------------------------------------------

def test_a_name_registered_twice_is_one_line_naming_both_modules_and_exit_2(tmp_path, plugins_in_process):
    with open(os.path.join(HERE, "sac_example.py")) as file:
        write_plugin(tmp_path, "plugrl_test_sac_copy", file.read())  # a copy, names unchanged
    status, out, err = run_main("--help", "--plugin", "plugrl_test_sac_copy")
    assert status == 2 and out == ""
    assert err == ("error: algorithm config sac/default is registered twice, by sac_example and by "
                   "plugrl_test_sac_copy: rename one, or load only one of them\n")


def test_a_copy_of_sac_example_under_its_own_name_is_refused_in_a_fresh_process_saying_how_to_rename_it(
        tmp_path):
    with open(os.path.join(HERE, "sac_example.py")) as file:
        write_plugin(tmp_path, "my_sac", file.read())  # a student's copy, to edit: UID still "sac"
    result = python("plugrl_min.py", "dummy-policy", "default", "sac", "default", "--plugin", "my_sac",
                    "--port", "0", "--run-dir", str(tmp_path / "run"), pythonpath=tmp_path)
    assert result.returncode == 2 and "listening" not in result.stdout, result.stdout
    assert result.stderr == ("error: algorithm sac is registered twice, by my_sac and by sac_example: give your "
                             'copy its own UID (UID = "my-sac" at the top of my_sac.py) and serve it by that name\n')
    assert not (tmp_path / "run").exists()


# --- register_env: your own environment, by its id ------------------------------------------------

MY_ENV = '''
import numpy as np
from plugrl_min import VecEnv, observation, register_env


@register_env("my-line-v0")
class MyLine(VecEnv):
    """A point on a line moves by the action; reward -|x|; 20 steps an episode."""
    max_steps = 20

    def __init__(self, num_envs, seed=None):
        self.x = np.zeros(num_envs)
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.x[rows] = self.rng.uniform(-1, 1, len(rows))

    def _step(self, action, rows):
        self.x[rows] += 0.1 * np.clip(action[:, 0], -1, 1)
        return -np.abs(self.x[rows]), np.zeros(len(rows), bool), np.zeros(len(rows), bool)

    def _observe(self):
        return observation(self.num_envs, states={"state": np.stack([self.x, np.zeros_like(self.x), -self.x], axis=1).astype(np.float32)})
'''


@wire
def test_a_plugins_environment_runs_in_the_env_client_by_its_id(tmp_path):
    write_plugin(tmp_path, "plugrl_test_my_env", MY_ENV)

    async def script(port, server):  # the client, a real process: --plugin imports my_env into plugrl_min.py
        client = await asyncio.create_subprocess_exec(
            sys.executable, "plugrl_min.py", "env-client", "my-line-v0", "--plugin", "plugrl_test_my_env", "--server-port",
            str(port), "--num-episodes", "0", cwd=HERE, env=subprocess_env(tmp_path), stdin=subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
        output, _ = await asyncio.wait_for(client.communicate(), 60)
        return client.returncode, output.decode()

    status, (client_status, output) = run_server(dummy_algo(small_policy(), 100), tmp_path / "run", script)
    assert status == 0 and client_status == 0, output
    assert read_metrics(tmp_path / "run", event="end")[0]["rollout/length"] == 20


def test_a_plugins_environment_is_listed_in_help(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_my_env", MY_ENV)
    _, out, _ = run_main("--help", "--plugin", "plugrl_test_my_env")
    assert re.search(r"environments.*\bmy-line-v0\b", out), out


# The server in this process passes --plugin on to the local env client it starts, a process of its own.
def test_a_plugins_environment_trains_with_local_clients(tmp_path, plugins_in_process, monkeypatch):
    write_plugin(tmp_path, "plugrl_test_my_env", MY_ENV)
    monkeypatch.setenv("PYTHONPATH", subprocess_env(tmp_path)["PYTHONPATH"])  # where the local client finds it
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--plugin", "plugrl_test_my_env",
                              "--local-env-clients", "1", "--local-env", "my-line-v0", "--local-num-envs", "2",
                              "--port", "0", "--algo.global-steps", "60", "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert read_metrics(tmp_path / "run", event="end")[0]["rollout/length"] == 20


SPELLED_ENV = MY_ENV.replace('"my-line-v0"', '"spelled-v0"').replace("max_steps = 20", "max_steps = 20\n    obs_spec = SPEC") \
    .replace("np.zeros_like(self.x), -self.x]", "*[np.zeros_like(self.x)] * 5, -self.x]")  # 7 numbers


@pytest.mark.parametrize("spec", ['{"states": {"state": ((7,), "<f4")}}', '{"states": {"state": ([7], np.float32)}}'],
                         ids=["dtype '<f4'", "a list shape"])
@wire
def test_a_plugin_environment_spelling_its_obs_spec_another_way_is_accepted_and_chosen(tmp_path, plugins_in_process,
                                                                                     monkeypatch, spec):
    write_plugin(tmp_path, "plugrl_test_spelled", SPELLED_ENV.replace("SPEC", spec))
    monkeypatch.setenv("PYTHONPATH", subprocess_env(tmp_path)["PYTHONPATH"])  # where the local client finds it
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--plugin", "plugrl_test_spelled",
                              "--policy.obs-spec", '{"states": {"state": [[7], "float32"]}}', "--local-env-clients", "1", "--port", "0",
                              "--algo.global-steps", "60", "--run-dir", tmp_path / "run")  # no --local-env
    assert status == 0, err
    assert " env-client spelled-v0 " in (tmp_path / "run" / "env-client-1.log").read_text()
    assert read_metrics(tmp_path / "run", event="end")[0]["rollout/length"] == 20


# =============================================================================================
# 11. Built-in policies: dummy-policy (tanh-Gaussian) and categorical-policy (choices)
# =============================================================================================
# The actions each sends ([n, H, action_dim] float32, or int64 indices) and the sample and log-prob
# it keeps in its runtime state.

def test_dummy_policy_keeps_the_sample_its_action_came_from_and_that_samples_log_prob():
    policy = make_policy("dummy-policy", plugrl_min.DummyPolicyConfig(action_horizon=2))
    state = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    action, runtime_state = policy.get_action_and_runtime_state(observation(len(state), states={"state": state}))
    assert action.dtype == np.float32 and action.shape == (5, 2, 1)
    np.testing.assert_allclose(action.reshape(5, 2), np.tanh(runtime_state["sample"]), rtol=1e-6)
    expected = policy({"images": {}, "states": {"state": torch.from_numpy(state)}}).log_prob(torch.from_numpy(runtime_state["sample"]))
    # atol: a float32 sum near 0 may differ in its last bit from the same sum taken the other way
    np.testing.assert_allclose(runtime_state["log_prob"], expected.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_categorical_policy_sends_int64_indices_n_h_1_and_keeps_its_sample_and_log_prob():
    policy = make_policy("categorical-policy", variant="cartpole")
    action, runtime_state = policy.get_action_and_runtime_state(observation(5, states={"state": np.zeros((5, 4), np.float32)}))
    assert action.dtype == np.int64 and action.shape == (5, 1, 1) and set(action.ravel()) <= {0, 1}
    assert runtime_state["sample"].tolist() == action[:, 0, 0].tolist()
    expected = policy({"images": {}, "states": {"state": torch.zeros(5, 4)}}).log_prob(torch.from_numpy(runtime_state["sample"]))
    np.testing.assert_allclose(runtime_state["log_prob"], expected.detach().numpy(), rtol=1e-6, atol=1e-6)
    fake = policy.fake_runtime_state(3)
    assert {key: value.shape for key, value in fake.items()} == {"action": (3, 1, 1), "sample": (3,),
                                                                 "log_prob": (3,)}


# --- ObsEncoder and the built-in policies on every key ---------------------------------------

IMAGE_AND_STATE = {"images": {"image": [[16, 16, 3], "uint8"]}, "states": {"state": [[2], "float32"]}}


def image_and_state_obs(n: int, column: int = 3) -> dict:
    image = np.zeros((n, 16, 16, 3), np.uint8)
    image[:, :, column] = 255
    return observation(n, states={"state": np.zeros((n, 2), np.float32)}, images={"image": image})


def test_obs_encoder_joins_an_image_through_convolutions_and_a_state_as_it_is():
    encoder = plugrl_min.ObsEncoder(IMAGE_AND_STATE)
    assert any(isinstance(module, nn.Conv2d) for module in encoder.modules())
    obs = obs_tensors(image_and_state_obs(5))
    obs["states"]["state"] += torch.tensor([7.0, 8.0])
    features = encoder(obs)
    assert features.shape == (5, encoder.features) and encoder.features == 64 + 2
    assert features[:, -2:].tolist() == [[7.0, 8.0]] * 5  # keys in sorted order: the state last, unchanged


def test_obs_encoder_scales_uint8_pixels_to_0_1_before_its_convolutions():
    encoder = plugrl_min.ObsEncoder(IMAGE_AND_STATE)
    seen = []
    first = next(module for module in encoder.modules() if isinstance(module, nn.Conv2d))
    first.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    encoder(obs_tensors(image_and_state_obs(2)))
    assert seen[0].dtype == torch.float32 and seen[0].shape == (2, 3, 16, 16)  # channels first, for Conv2d
    assert seen[0].min().item() == 0.0 and seen[0].max().item() == 1.0


@pytest.mark.parametrize("spec", [{"images": {"cam": [[3, 12, 10, 1], "uint8"]}},
                                  {"images": {"cam": [[12, 10], "uint8"]}},
                                  {"images": {"cam": [[12, 10, 3], "float32"]}}], ids=["4 axes", "2 axes", "float"])
def test_obs_encoder_refuses_an_image_that_is_not_uint8_h_w_c_in_one_line_saying_where_numbers_go(spec):
    with pytest.raises(plugrl_min.UsageError, match=r"a camera is uint8 \[h, w, c\]; other numbers go under 'states'"):
        plugrl_min.ObsEncoder(spec)


def test_obs_encoder_of_a_flat_state_has_no_parameters_and_passes_it_through():
    encoder = plugrl_min.ObsEncoder({"states": {"state": [[3], "float32"]}})
    state = torch.randn(4, 3)
    assert list(encoder.parameters()) == [] and encoder({"images": {}, "states": {"state": state}}) is state


def test_obs_encoder_reads_a_key_of_shape_empty_as_one_feature_a_row():
    encoder = plugrl_min.ObsEncoder({"states": {"speed": [[], "float32"], "state": [[2], "float32"]}})
    features = encoder({"images": {}, "states": {"speed": torch.tensor([1.5, 2.5]), "state": torch.zeros(2, 2)}})
    assert encoder.features == 3 and features[:, 0].tolist() == [1.5, 2.5]


def test_the_greedy_action_of_dummy_policy_is_the_squashed_mean_of_each_chunk():
    torch.manual_seed(0)
    policy = make_policy("dummy-policy", plugrl_min.DummyPolicyConfig(hidden_size=8, action_horizon=2,
                                                                      action_dim=3))
    obs = observation(5, states={"state": np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)})
    greedy = policy.get_greedy_action(obs)
    mean, _ = policy.gaussian(obs_tensors(obs))
    assert greedy.shape == (5, 2, 3) and greedy.dtype == np.float32
    assert np.array_equal(greedy, torch.tanh(mean).detach().numpy().reshape(5, 2, 3))
    assert np.array_equal(greedy, policy.get_greedy_action(obs))  # no draw: the same twice


def test_the_greedy_action_of_categorical_policy_is_each_observations_most_likely_choice():
    torch.manual_seed(0)
    policy = make_policy("categorical-policy", plugrl_min.CategoricalPolicyConfig(num_actions=5, hidden_size=8))
    obs = observation(64, states={"state": np.random.default_rng(0).standard_normal((64, 4)).astype(np.float32)})
    greedy = policy.get_greedy_action(obs)
    probs = policy(obs_tensors(obs)).probs.detach()
    assert greedy.shape == (64, 1, 1) and greedy.dtype == np.int64
    assert np.array_equal(greedy[:, 0, 0], probs.argmax(-1).numpy()) and len(set(greedy.ravel())) > 1


@pytest.mark.parametrize("uid", ["dummy-policy", "categorical-policy"])
def test_a_builtin_policy_acts_on_a_dict_observation_and_reads_its_image(uid):
    torch.manual_seed(0)
    config = dataclasses.replace(plugrl_min._POLICY_CONFIGS[(uid, "default")], obs_spec=IMAGE_AND_STATE)
    policy = make_policy(uid, config)
    assert plugrl_min.obs_spec_of(policy.obs_spec) == plugrl_min.obs_spec_of(IMAGE_AND_STATE)
    action, runtime_state = policy.get_action_and_runtime_state(image_and_state_obs(4))
    assert action.shape == (4, 1, 1) and runtime_state["sample"].shape[0] == 4
    with torch.no_grad():  # another picture, another distribution: the image is read
        left, right = (policy(obs_tensors(image_and_state_obs(1, c))) for c in (2, 13))
        sample = left.sample()
        assert not torch.allclose(left.log_prob(sample), right.log_prob(sample))


def test_the_policy_configs_obs_spec_is_a_json_flag():
    _, _, configs = plugrl_min.parse_server_flags(["dummy-policy", "default", "pg", "default", "--policy.obs-spec",
                                                   '{"states": {"state": [[17], "float64"]}}'])
    assert configs["policy"].obs_spec == {"states": {"state": [[17], "float64"]}}
    assert make_policy("dummy-policy", configs["policy"]).obs_spec == {"images": {}, "states": {"state": ((17,), "float64")}}


def test_pgs_value_network_reads_an_image_through_convolutions_of_its_own():
    policy = make_policy("dummy-policy", dataclasses.replace(plugrl_min.DummyPolicyConfig(hidden_size=8),
                                                             obs_spec=IMAGE_AND_STATE))
    algo = make_algo("pg", policy, plugrl_min.PGConfig(frames_per_learn=8))
    convolutions = [module for module in algo.value.modules() if isinstance(module, nn.Conv2d)]
    assert convolutions and not any(module in list(policy.modules()) for module in convolutions)
    assert algo.values(obs_tensors(image_and_state_obs(3))).shape == (3,)


# =============================================================================================
# 12. The run's record: metrics.jsonl, the progress line, the start and the end of a run
# =============================================================================================
# A line of metrics.jsonl every --log-every frames (the learns and episodes in between, averaged),
# one at the end; one run, one folder, and a failed start leaves an earlier run's folder as it was.

# --- What feedback returns, averaged into the next line; every frame counted once -----------------

class LogsAlternately(Probe):
    """On-policy, a learn every 5 frames; feedback logs {"a": 2i} on even frames, {"b": 1} on odd."""

    on_policy = True
    learn_every = 5

    def feedback(self, **frame):
        node, step, _ = super().feedback(**frame)
        i = len(self.frames) - 1
        return node, step, {"a": 2.0 * i} if i % 2 == 0 else {"b": torch.tensor(1.0)}


@contract
@wire
def test_every_log_key_feedback_returns_is_averaged_into_the_next_metrics_line(tmp_path):
    algo = LogsAlternately()

    async def script(port, server):
        await run_rounds(port, [1], 10)
        await eventually(lambda: algo.learns == 2)

    run_server(algo, tmp_path, script, log_every=1)  # a line per learn
    learns = read_metrics(tmp_path)
    assert [line["a"] for line in learns] == [4.0, 14.0]  # means of 0, 4, 8 and 10, 14, 18
    assert [line["b"] for line in learns] == [1.0, 1.0]


@contract
@wire
def test_server_fed_and_discarded_count_every_frame_the_clients_sent(tmp_path):
    algo = LogsAlternately()

    async def script(port, server):
        rng = np.random.default_rng(1)
        sent = await asyncio.gather(run_rounds(port, [1, 2], 15, think=lambda: rng.uniform(0, 0.01)),
                                    run_rounds(port, [3], 25, think=lambda: rng.uniform(0, 0.01)))
        await eventually(lambda: len(algo.frames) + algo.discarded == sum(sent))
        return sum(sent)

    _, sent = run_server(algo, tmp_path, script)
    lines = read_metrics(tmp_path, event=None)
    assert lines[-1]["event"] == "end"  # a line at the end of the run too
    assert sum(line["server/fed"] for line in lines) == len(algo.frames)
    assert sum(line["server/discarded"] for line in lines) == algo.discarded > 0
    assert len(algo.frames) + algo.discarded == sent == 55


@contract
@wire
def test_a_run_that_never_learns_still_writes_its_metrics_at_the_end(tmp_path):
    algo = LogsAlternately()
    algo.learn_every = None

    async def script(port, server):
        await run_rounds(port, [1], 4, terminated=[True], episode={"r": [3.0], "l": [7], "s": [True]})
        await eventually(lambda: len(algo.frames) == 4)

    run_server(algo, tmp_path, script)
    (line,) = read_metrics(tmp_path, event=None)
    assert line["event"] == "end" and line["a"] == 2.0 and line["b"] == 1.0
    assert line["rollout/episodes"] == 4 and line["rollout/reward"] == 3.0
    assert line["server/fed"] == 4 and line["server/discarded"] == 0


# --- A line every --log-every frames, and one at the end ------------------------------------------

@wire
def test_dummy_writes_a_metrics_line_at_the_first_learn_after_every_1000_steps_and_one_at_the_end(dummy_run):
    metrics = read_metrics(dummy_run.run_dir, event=None)  # --log-every 1000, the default
    assert [(line["event"], line["step"]) for line in metrics] == [("learn", 1000), ("learn", 2000), ("end", 2000)]
    assert [line["server/policy_version"] for line in metrics] == [4, 8, 8]
    assert [line["server/fed"] for line in metrics] == [1000, 1000, 0]  # the frames stored in each window
    for line in metrics[:2]:  # each learn line: the means over the episodes of its 1000 steps
        assert line["rollout/episodes"] > 0 and line["rollout/reward"] < 0


def test_metrics_lines_come_every_log_every_steps_and_at_the_end(sac_run_logged_every_300):
    lines = sac_run_logged_every_300.lines
    assert [line["step"] for line in lines] == [300, 600, 900, 1000]
    assert [line["event"] for line in lines] == ["learn"] * 3 + ["end"]


def test_metrics_lines_count_every_episode_once_and_the_end_line_those_since_the_line_before(sac_run_logged_every_300):
    lines = sac_run_logged_every_300.lines
    client_episodes = int(re.search(r"\| episodes (\d+)", sac_run_logged_every_300.client).group(1))
    assert sum(line["rollout/episodes"] for line in lines) == client_episodes
    assert lines[-1]["rollout/episodes"] > 0  # dummy-v1's episodes end within 50 steps


@wire
def test_metrics_lines_average_the_train_values_of_the_learns_in_between(tmp_path):
    class LogsItsLearnCount(Probe):
        learn_every = 1  # a learn after every frame: one frame comes in at a time

        def learn_impl(self):
            step, _ = super().learn_impl()
            return step, {"train/loss": float(self.learns)}  # 1.0 at the first learn, 2.0 at the second ...

    algo = LogsItsLearnCount()

    async def script(port, server):
        await run_rounds(port, [1], 6)
        await eventually(lambda: algo.learns == 6)

    run_server(algo, tmp_path, script, log_every=3)  # a line at the first learn after every 3 frames
    assert [line["train/loss"] for line in read_metrics(tmp_path)] == [2.0, 5.0]  # means of 1, 2, 3 and 4, 5, 6


def test_the_window_weights_each_learns_rollout_means_by_its_episodes(tmp_path):
    server = plugrl_min.Server(Probe(), str(tmp_path), ("dummy-policy", "probe"))
    server.record.add({"rollout/reward": -10.0, "rollout/episodes": 1, "train/loss": 1.0})
    server.record.add({"rollout/reward": -1.0, "rollout/episodes": 3, "train/loss": 3.0})
    server.record.add({"rollout/reward": 0.0, "rollout/episodes": 0, "train/loss": 5.0})
    with open(tmp_path / "metrics.jsonl", "wb") as server.record.metrics_file:
        server.record.write(server, "learn")
    (line,) = read_metrics(tmp_path, None)
    assert line["rollout/reward"] == (-10.0 + 3 * -1.0) / 4 and line["rollout/episodes"] == 4
    assert line["train/loss"] == 3.0  # a plain mean over the three learns


@wire
def test_a_metrics_file_that_cannot_be_written_is_named_and_the_clients_are_not_told_a_hook_failed(
        tmp_path, capsys):
    (tmp_path / "metrics.jsonl").symlink_to("/dev/full")  # a full disk: every write fails
    status, closes = run_server(Faulty(None), tmp_path, two_clients_until_closed, log_every=1)
    err = capsys.readouterr().err
    assert status == 1 and closes == (hook_failed("OSError in its run directory"),) * 2
    assert f"error: cannot write {tmp_path / 'metrics.jsonl'}: No space left on device" in err
    assert "Traceback" not in err


# --- The run directory: one run, one folder; a failed start leaves no trace -----------------------

def test_three_seeds_started_together_keep_three_complete_separate_runs(tmp_path):
    processes = [subprocess.Popen(dummy_run_command("--seed", str(seed)), cwd=tmp_path, env=subprocess_env(),
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for seed in (1, 2, 3)]
    for process in processes:
        assert process.wait(180) == 0, process.stderr.read()
    runs = sorted(glob.glob(str(tmp_path / "runs" / "*")))
    assert len(runs) == 3
    seeds = []
    for run in runs:
        with open(os.path.join(run, "config.json")) as file:
            seeds.append(json.load(file)["seed"])
        lines = read_metrics(run, None)
        assert [line["event"] for line in lines] == ["learn"] * 4 + ["end"]  # this run's lines, none of another's
        assert [line["step"] for line in lines] == [500, 1000, 1500, 2000, 2000]
        assert checkpoint_steps(run) == [2000]  # its own final checkpoint
        log = open(os.path.join(run, "env-client-1.log")).read()
        assert f"--seed {seeds[-1]}" in log.splitlines()[0] and "the server ended the run" in log
    assert sorted(seeds) == [1, 2, 3]


def test_a_default_run_directory_already_taken_gets_a_new_name_and_the_taken_one_is_untouched(tmp_path):
    # Every name this run could choose in the next minute is taken, as by a run started the same second.
    now = time.time()
    taken = [tmp_path / "runs" / f"dummy-dummy-v1-{time.strftime('%Y%m%d-%H%M%S', time.localtime(now + t))}"
             for t in range(-1, 60)]
    for folder in taken:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("another run's\n")
    status = subprocess.run(dummy_run_command(), cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                            timeout=180, stdin=subprocess.DEVNULL)
    assert status.returncode == 0, status.stderr
    new = re.search(r"run directory: (\S+)", status.stdout).group(1)
    assert new.endswith("-2") and checkpoint_steps(tmp_path / new) == [2000]
    assert all(os.listdir(folder) == ["config.json"] and (folder / "config.json").read_text() == "another run's\n"
               for folder in taken)


def test_a_reused_run_directory_without_resume_is_refused_and_its_bytes_are_unchanged(earlier_run):
    run, before = earlier_run
    status, out, err = run_main(*dummy_run_command("--run-dir", run)[2:])
    assert status == 2 and err.strip() == (f"error: {run} holds a run already: add --resume to continue it, "
                                           "or name another --run-dir")
    assert folder_bytes(run) == before


def test_a_config_json_that_cannot_be_written_is_named_not_the_run_directory(earlier_run):
    run, _ = earlier_run
    (run / "config.json").unlink()
    (run / "config.json").symlink_to("/dev/full")  # a full disk: every write fails
    status, _, err = run_main(*dummy_run_command("--run-dir", run, "--resume")[2:])
    assert status == 1 and f"error: cannot write {run / 'config.json'}: No space left on device" in err, err


def test_a_start_with_a_taken_port_leaves_an_earlier_runs_folder_as_it_was(earlier_run):
    run, before = earlier_run
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        status, _, err = run_main(*dummy_run_command("--run-dir", run, "--resume", "--port",
                                                     taken.getsockname()[1])[2:])
    assert status == 1 and "cannot listen on 127.0.0.1" in err
    assert folder_bytes(run) == before


def test_a_start_with_an_unknown_environment_leaves_an_earlier_runs_folder_as_it_was(earlier_run):
    run, before = earlier_run
    status, _, err = run_main(*dummy_run_command("--run-dir", run, "--resume", "--local-env", "dummy-v9")[2:])
    assert status == 2 and err.strip().splitlines()[-1].startswith("error: unknown environment 'dummy-v9'")
    assert folder_bytes(run) == before


def test_a_start_with_an_environment_that_does_not_fit_the_policy_writes_nothing(tmp_path):
    status, _, err = run_main(*dummy_run_command("--run-dir", tmp_path / "run", "--local-env", "cartpole-v1")[2:])
    assert status == 2 and "error: the server's policy does not fit cartpole-v1: " in err
    assert not (tmp_path / "run").exists()


def test_a_run_directory_whose_run_served_no_frame_is_refused_saying_to_remove_it(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")  # a start whose client never came
    status, _, err = run_main(*dummy_run_command("--run-dir", tmp_path / "run")[2:])
    assert status == 2 and err.strip() == (f"error: {tmp_path / 'run'} holds a run already: one that served no "
                                           "frame (its env-client-N.log may say why): remove the folder, or "
                                           "name another --run-dir")


def test_resume_without_a_run_directory_says_it_needs_one(tmp_path):
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--resume")
    assert status == 2 and err.strip() == "error: --resume needs --run-dir, the run directory to continue"


def test_a_resumed_run_appends_to_its_local_clients_log_with_a_line_that_marks_each_start(earlier_run):
    run, before = earlier_run
    status, _, err = run_main(*dummy_run_command("--run-dir", run, "--resume", "--algo.global-steps", "6500")[2:])
    assert status == 0, err
    log = (run / "env-client-1.log").read_text()
    assert log.startswith(before["env-client-1.log"].decode())  # the first start's lines, kept
    assert [line.startswith("--- env client 1 started") for line in log.splitlines()].count(True) == 2


def test_a_run_directory_that_cannot_be_made_is_named_and_no_bind_is_blamed(tmp_path, capsys):
    status = plugrl_min.server_main(["dummy-policy", "default", "dummy", "default", "--port", "0",
                                     "--run-dir", "/proc/nope/run"])
    err = capsys.readouterr().err
    assert status == 1 and "error: cannot make the run directory /proc/nope/run: " in err, err
    assert "listen" not in err


def test_a_server_whose_run_directory_does_not_exist_names_the_file_it_cannot_open():
    server = plugrl_min.Server(Probe(), "/proc/nope/run", ("dummy-policy", "probe"))  # the command line makes it
    with pytest.raises(plugrl_min.CommandError, match=re.escape("cannot open /proc/nope/run/metrics.jsonl: ")):
        asyncio.run(server.run("127.0.0.1", 0))


def test_a_resumed_run_counts_its_learns_frames_and_time_on_from_its_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    flags = ["dummy-policy", "default", "dummy", "default", "--local-env-clients", "1", "--run-dir", str(run_dir),
             "--algo.learn-every", "100", "--algo.save-every", "1", "--log-every", "100"]
    first = python("plugrl_min.py", *flags, "--algo.global-steps", "500", timeout=120)
    assert first.returncode == 0, first.stderr
    before = read_metrics(run_dir, None)
    second = python("plugrl_min.py", *flags, "--algo.global-steps", "900", "--resume", timeout=120)
    assert second.returncode == 0, second.stderr
    after = read_metrics(run_dir, None)[len(before):]
    assert "global step 900, 9 learns" in second.stdout  # the run's learns, as report counts them
    assert after[-1]["server/policy_version"] == 9 and after[-1]["server/frames"] == 900
    assert after[0]["time"] > before[-1]["time"]  # the run's clock goes on


# =============================================================================================
# 13. Clients: their messages checked, how long they may owe feedback, who may connect
# =============================================================================================
# Bad input costs only its sender: that connection alone is closed for a resync, 1001 plugrl-server-resync,
# no message first (1009 for a frame too big). The feedback timeout and the API key, each under its own heading.

# --- Every field of every client message: wrong dtype, wrong shape, missing -----------------------

# (message, field path, bad value or MISSING, the field the error names, what it says of it)
BAD_FIELDS = [
    *[("infer", "env_indices", bad, "infer.env_indices", "must be int64 [n]")
      for bad in (np.arange(N, dtype=np.int32), np.arange(N).reshape(N, 1), MISSING)],
    *[("infer", "step_ids", bad, "infer.step_ids", "must be int64 [2]")  # checked, never read
      for bad in (np.zeros(N, np.float32), np.zeros(N + 1, np.int64), MISSING)],
    *[("infer", "data.states.state", bad, "infer.data.states.state", "must be float32 [2, 3]")
      for bad in (np.zeros((N, 3), np.int64), np.zeros((N, 4), np.float32), MISSING)],
    ("infer", "data.text", MISSING, "infer.data.text", "must be str [2], a <U array or a list"),
    ("infer", "data.states", MISSING, "infer.data", "must be a map of images, states and text"),
    *[("feedback", "env_indices", bad, "feedback.env_indices", "must be int64 [n]")
      for bad in (np.arange(N, dtype=np.uint64), np.arange(N).reshape(1, N), MISSING)],
    ("feedback", "step_ids", MISSING, "feedback.step_ids", "must be int64 [2]"),
    ("feedback", "data", MISSING, "feedback.data", "must be a map of obs, rewards, terminated, truncated, info"),
    *[("feedback", "data.obs.states.state", bad, "feedback.data.obs.states.state", "must be float32 [2, 3]")
      for bad in (np.zeros((N, 3), np.uint8), np.zeros((N, 1, 3), np.float32), MISSING)],
    ("feedback", "data.obs.text", np.zeros(N), "feedback.data.obs.text", "must be str [2], a <U array or a list"),
    *[("feedback", "data.rewards", bad, "feedback.data.rewards", "must be float [m] with m = 2")
      for bad in (np.zeros(N, np.int64), np.zeros((N, 1), np.float32), MISSING)],
    *[("feedback", f"data.{flag}", bad, f"feedback.data.{flag}", "must be bool [m] with m = 2")
      for flag in ("terminated", "truncated")
      for bad in (np.zeros(N, np.uint8), np.zeros((N, 1), bool), MISSING)],
    # info may be {} or left out (see below); each array in it [m, ...], a number or a str beside them
    ("feedback", "data.info", np.zeros(N, np.float32), "feedback.data.info", "must be a map, {} for nothing"),
    ("feedback", "data.info.steps", np.zeros(N + 1, np.int64), "feedback.data.info.steps",
     "must be an array [m, ...] with m = 2"),
    # info.episode may be left out; when it is there, r, l, s and mask must all be
    ("feedback", "data.info.episode", np.zeros(N, bool), "feedback.data.info.episode",
     "must be a map of r, l, s and mask"),
    *[("feedback", f"data.info.episode.{key}", bad, f"feedback.data.info.episode.{key}",
       f"must be {kind} [m] with m = 2")
      for key, kind, right, wrong in (("r", "float", np.float32, np.int64),
                                      ("l", "int", np.int64, np.float32),
                                      ("s", "bool", bool, np.int64),
                                      ("mask", "bool", bool, np.float32))
      for bad in (np.zeros(N, wrong), np.zeros((N, 1), right), MISSING)],
]


async def refused(port, message) -> Refusal:
    """Send message on a fresh connection (a feedback after an infer of its environments): what the server
    did about it."""
    client = await Client.connect(port)
    if message["message_type"] == "feedback":
        await client.infer(list(range(N)), [1, 2])
    await client.ws.send(pack_message(message))
    return await refusal_of(client.ws)


def case_id(case):
    kind, path, bad, _, _ = case
    what = "missing" if bad is MISSING else (
        f"{bad.dtype.name}{list(bad.shape)}" if isinstance(bad, np.ndarray) else type(bad).__name__)
    return f"{kind}.{path}={what}"


@pytest.mark.parametrize("case", BAD_FIELDS, ids=[case_id(case) for case in BAD_FIELDS])
@wire
def test_a_wrong_or_missing_field_closes_for_a_resync_and_the_log_names_the_field_and_what_it_must_be(
        tmp_path, capsys, case):
    kind, path, bad, field, expected = case
    message = with_field(good_message(kind), path, bad)
    status, refusal = run_server(Probe(), tmp_path, lambda port, server: refused(port, message))
    assert refusal == Refusal(None, *RESYNC) and status == 0
    [(number, why, hint)] = resyncs_logged(capsys.readouterr().err)
    assert number == 1 and why.startswith(f"{field} {expected}; got") and hint, why


@wire
def test_info_and_info_episode_may_be_left_out(tmp_path):
    async def script(port, server):
        client = await Client.connect(port)
        feedback = good_message("feedback")
        for message in (with_field(feedback, "data.info", MISSING), with_field(feedback, "data.info", {}),
                        with_field(feedback, "data.info.episode", MISSING)):
            await client.infer(list(range(N)), [1, 2])
            await client.ws.send(pack_message(message))
        await client.infer(list(range(N)), [1, 2])  # answered: nothing was refused
        return [frame["info"] for frame in server.algo.frames]

    status, infos = run_server(Probe(), tmp_path, script)
    assert infos == [{}] * (3 * N) and status == 0


@contract
def test_a_str_beside_the_arrays_of_feedback_info_goes_to_every_environment():
    data = feedback_message([0, 1], [1, 2], info={"task": "pick", "contacts": np.zeros((2, 3), np.float32)})["data"]
    plugrl_min.check_outcome(data, 2)
    rows = plugrl_min.split_rows(data["info"], 2)
    assert [row["task"] for row in rows] == ["pick", "pick"] and [row["contacts"].shape for row in rows] == [(3,)] * 2


@contract
def test_a_feedback_info_with_no_array_to_split_it_by_for_two_environments_is_refused():
    data = feedback_message([0, 1], [1, 2], info={"task": "pick"})["data"]
    with pytest.raises(ProtocolError, match=re.escape("feedback.data.info must be a map with an array [m, ...], m = 2")):
        plugrl_min.check_outcome(data, 2)
    plugrl_min.check_outcome(feedback_message([0], [1], info={"task": "pick"})["data"], 1)  # one environment: its own


@wire
def test_a_reward_beyond_float32_is_refused_naming_the_field_and_no_other_client_gets_a_nan(tmp_path, capsys):
    policy = small_policy()
    algo = make_algo("pg", policy, plugrl_min.PGConfig(global_steps=None, frames_per_learn=8))
    algo.init_optimizers()

    async def script(port, server):
        bad = await Client.connect(port)
        await bad.infer([0], [0.5])
        await bad.ws.send(pack_message(feedback_message([0], [0.5], rewards=np.array([1e300]))))  # float64
        refusal = await refusal_of(bad.ws)
        good = await Client.connect(port)
        actions = [actions_of(await good.step(list(range(8)), [0.1 * i for i in range(8)])) for _ in range(4)]
        return refusal, actions, server.version

    status, (refusal, actions, learns) = run_server(algo, tmp_path, script)
    assert refusal == Refusal(None, *RESYNC)
    [(_, why, _)] = resyncs_logged(capsys.readouterr().err)
    assert why == "feedback.data.rewards holds NaN, infinity or a value beyond float32's range"
    assert learns >= 2 and all(np.isfinite(action).all() for action in actions)


def feedback_of(state=0.5, reward=0.0, episode_r=None, extra=None) -> dict:
    """A feedback message for one environment of obs_spec {"states": {"state": float32 [1]}}."""
    info = {} if extra is None else {"extra": np.array([extra])}
    if episode_r is not None:
        info["episode"] = {"r": np.array([episode_r]), "l": np.array([1]), "s": np.array([True]),
                           "mask": np.array([True])}
    obs = observation(1, states={"state": np.array([[state]], np.float32)})
    return feedback_message([0], obs=obs, rewards=np.array([reward]), info=info)


@pytest.mark.parametrize("message, refused", [
    (feedback_of(reward=1e300), "feedback.data.rewards holds NaN, infinity or a value beyond float32's range"),
    (feedback_of(episode_r=-1e300), "feedback.data.info.episode.r holds NaN, infinity or a value beyond"),
    (feedback_of(state=np.nan), "feedback.data.obs.states.state holds NaN or infinity"),
    (feedback_of(extra=1e300), None)], ids=["reward", "episode return", "observation", "other info"])
@wire
def test_the_reward_and_episode_return_must_fit_float32_observations_be_finite_other_info_is_free(message, refused):
    spec = plugrl_min.obs_spec_of({"states": {"state": ((1,), "float32")}})
    if refused is None:
        assert plugrl_min.check_message(message, spec) == ("feedback", [0])
    else:
        with pytest.raises(ProtocolError, match=re.escape(refused)):
            plugrl_min.check_message(message, spec)


CAMERA_SPEC = {"images": {"image": ((16, 16, 3), "uint8")}, "states": {"state": ((2,), "float32")}}  # the README's


@contract
def test_every_key_the_policy_reads_is_checked_an_image_of_another_dtype_is_refused_naming_it():
    message = infer_message([0], obs=observation(1, states={"state": np.zeros((1, 2), np.float32)},
                                                 images={"image": np.zeros((1, 16, 16, 3), np.float32)}))
    with pytest.raises(ProtocolError, match=re.escape("infer.data.images.image must be uint8 [1, 16, 16, 3]; got float32")):
        plugrl_min.check_message(message, plugrl_min.obs_spec_of(CAMERA_SPEC))


@contract
def test_a_float64_state_as_plugrls_clients_send_it_reaches_the_policy_as_its_float32():
    state = np.array([[0.1, 1e-40]])  # float64; the second is below float32's normal range
    message = infer_message([0], obs=observation(1, states={"state": state},
                                                 images={"image": np.zeros((1, 16, 16, 3), np.uint8)}))
    plugrl_min.check_message(message, plugrl_min.obs_spec_of(CAMERA_SPEC))
    given = message["data"]["states"]["state"]
    assert given.dtype == np.float32 and given.tolist() == state.astype(np.float32).tolist()


@contract
def test_a_key_the_policy_does_not_read_is_ignored_and_a_key_it_reads_missing_is_refused_naming_it():
    extra = {"wrist": np.zeros((1, 112, 112, 3), np.uint8)}
    obs = observation(1, states={"state": np.zeros((1, 2), np.float32), "joints": np.zeros((1, 5))},
                      images={"image": np.zeros((1, 16, 16, 3), np.uint8), **extra})
    message = infer_message([0], obs=obs)
    plugrl_min.check_message(message, plugrl_min.obs_spec_of(CAMERA_SPEC))
    assert message["data"]["images"].keys() == {"image"} and message["data"]["states"].keys() == {"state"}
    del obs["images"]["image"]
    with pytest.raises(ProtocolError, match=re.escape("infer.data.images.image must be uint8 [1, 16, 16, 3]; got nothing")):
        plugrl_min.check_message(infer_message([0], obs=obs), plugrl_min.obs_spec_of(CAMERA_SPEC))


@contract
@pytest.mark.parametrize("text", [np.array(["pick up the red block", ""]), ["pick up the red block", ""]],
                         ids=["a <U array", "a list of str"])
def test_text_as_a_u_array_or_a_list_of_str_reaches_the_algorithm_as_a_u_array(text):
    message = infer_message([0, 1], obs=observation(2, states={"state": np.zeros((2, 2), np.float32)},
                                                    images={"image": np.zeros((2, 16, 16, 3), np.uint8)}))
    message["data"]["text"] = text
    plugrl_min.check_message(message, plugrl_min.obs_spec_of(CAMERA_SPEC))
    given = message["data"]["text"]
    assert given.dtype.kind == "U" and given.tolist() == ["pick up the red block", ""]


# --- Bad input: that connection alone is closed for a resync; a fuzz test over every kind ---------

@pytest.mark.parametrize("bad, why", [
    ("text frame", "expected a binary frame, got a text frame"),
    ("unknown message_type", "message_type must be 'infer' or 'feedback'; got 'hello'"),
    ("obs of the wrong shape", "infer.data.states.state must be float32 [1, 3]; got float32 [1, 2]"),
    ("feedback before any action", "feedback where infer was due"),
    ("two infers in a row", "infer where feedback was due"),
    ("two feedbacks in a row", "feedback where infer was due"),
])
@contract
@wire
def test_a_protocol_violation_closes_that_connection_alone_for_a_resync_and_the_log_says_why(
        tmp_path, capsys, bad, why):
    algo = Probe()

    async def script(port, server):
        good, offender = await Client.connect(port), await Client.connect(port)
        await good.step([0], [1])
        if bad == "text frame":
            await offender.ws.send("infer")
        elif bad == "unknown message_type":
            await offender.ws.send(pack_message({"message_type": "hello"}))
        elif bad == "obs of the wrong shape":
            await offender.ws.send(pack_message(infer_message([0], obs=observation(1, states={"state": np.zeros((1, 2), np.float32)}))))
        elif bad == "feedback before any action":
            await offender.feedback([0], [2])
        elif bad == "two feedbacks in a row":  # one action answered by two: one per action, its rows in it
            await offender.infer([0, 1], [2, 2])
            await offender.feedback([0], [2])
            await offender.feedback([1], [2])
        else:
            await offender.infer([0], [2])
            await offender.ws.send(pack_message(infer_message([1], [2])))
        refusal = await refusal_of(offender.ws)
        await good.step([0], [1])  # the other client is still served
        await eventually(lambda: len(algo.frames) == 2)
        await good.close()
        return refusal

    status, refusal = run_server(algo, tmp_path, script)
    assert refusal == Refusal(None, *RESYNC) and status == 0  # no message first: SPEC v1 has none
    assert [(number, logged) for number, logged, _ in resyncs_logged(capsys.readouterr().err)] == [(2, why)]


@wire
def test_feedback_for_an_environment_whose_action_came_on_an_earlier_connection_is_logged_not_stored_the_rest_is(
        tmp_path, capsys):
    algo = Probe()

    async def script(port, server):
        first = await Client.connect(port)
        await first.infer([0], [BAD_TAG])  # its feedback will come on the next connection, which has no step state
        await first.close()
        second = await Client.connect(port)
        await second.infer([1], [1])
        await second.feedback([0, 1], [BAD_TAG, 1])
        reply = await second.infer([0, 1], [2, 2])  # not a resync: served on
        await second.close()
        return reply

    status, reply = run_server(algo, tmp_path, script)
    assert len(actions_of(reply)) == 2 and status == 0
    assert [float(frame["runtime_state"]["tag"]) for frame in algo.frames] == [1.0]
    assert ("client 2: feedback for environments with no step state on this connection, [0]: not stored"
            in capsys.readouterr().err)


BAD_TAG = 7.0  # every bad connection's observations carry this tag; the good client's carry 1 and 2


def infer_with_state(state_map: dict) -> bytes:
    """An infer for environment 0 whose obs["states"]["state"] is the array map given, right or wrong."""
    return pack_message(infer_message([0], obs=observation(1, states={"state": state_map})))


ONE_STATE = np.full((1, 3), BAD_TAG, np.float32).tobytes()  # one environment's observation, as data


def with_info_episode(episode) -> dict:
    return with_changes(feedback_message(terminated=True), info={"episode": episode})


def pick(rng, options):
    return options[int(rng.integers(len(options)))]


# Every kind of malformed frame: make(rng) -> (prelude, frame). With prelude, the connection first makes a valid
# infer for env 0 and reads its action (some faults only exist after an action); with "fed", it sends that
# action's feedback too. A str frame goes as a text frame.
MALFORMED = {}


def malformed(kind):
    def register(make):
        MALFORMED[kind] = make
        return make
    return register


@malformed("random bytes")
def _(rng):
    return False, rng.bytes(int(rng.integers(0, 256)))


@malformed("truncated frame")
def _(rng):
    full = pack_message(pick(rng, [infer_message((0, 1, 2)), feedback_message((0, 1))]))
    return False, full[:int(rng.integers(0, len(full)))]


@malformed("text frame")
def _(rng):
    as_json = json.dumps({"message_type": "infer", "env_indices": [0], "obs": {"state": [[7, 0, 0]]}})
    noise = "".join(chr(c) for c in rng.integers(32, 0x2FF, int(rng.integers(1, 200))))
    return False, pick(rng, ["", "infer", as_json, noise])


@malformed("not msgpack")
def _(rng):
    code = pick(rng, [b"\xc1", b"\xd4\x01\x00", b"\xd5\x01\x00\x00", b"\xc7\x01\x01\x00", b"\xd6\xff\x00\x00\x00\x00"])
    return False, pick(rng, [code, b"\x81\xa1x" + code, b"\x82\xacmessage_type\xa5infer\xa1x" + code])


@malformed("not a map")
def _(rng):
    return False, pack_message(pick(rng, [[], [infer_message()], 1, "infer", None, True, 2.5, b"infer"]))


@malformed("a map key neither str nor bin")
def _(rng):
    key = pick(rng, [b"\x01", b"\xc0", b"\xcb" + bytes(8), b"\x90", b"\x80", b"\xc3"])
    return False, b"\x82\xacmessage_type\xa5infer" + key + b"\x01"


@malformed("bad dtype")
def _(rng):
    dtype = pick(rng, ["|O8", "<c8", "<c16", "|S4", "|V4", "<M8[s]", "<m8[s]", "complex64", "float32", "f", "<f5",
                       "<i3", 5, None, ["<f4"], {"<f4": 1}, b"<f4"])
    return False, infer_with_state(array_map(dtype, [1, 3], ONE_STATE))


@malformed("data that is not the shape's bytes")
def _(rng):
    data = pick(rng, [ONE_STATE[:int(rng.integers(0, 12))], ONE_STATE + bytes(int(rng.integers(1, 9))), "x", 12, None])
    return False, infer_with_state(array_map("<f4", pick(rng, [[1, 3], [2, 3], [1, 30]]), data))


@malformed("bytes left over after the map")
def _(rng):
    return False, pack_message(infer_message()) + rng.bytes(int(rng.integers(1, 33)))


@malformed("huge declared array")
def _(rng):
    shape = pick(rng, [[10**12], [2**40, 2**40], [10**6] * 4, [2**62, 3], [1, 10**15]])
    return False, infer_with_state(array_map(pick(rng, ["<f8", "|u1", "<i4"]), shape, ONE_STATE))


@malformed("a length past the frame's end")
def _(rng):
    head = pick(rng, [b"\xdb", b"\xc6", b"\xdd", b"\xdf", b"\xda", b"\xc5", b"\xdc", b"\xde"])
    width = 4 if head in (b"\xdb", b"\xc6", b"\xdd", b"\xdf") else 2
    return False, b"\x82\xacmessage_type\xa5infer\xa1x" + head + b"\xff" * width + rng.bytes(8)


@malformed("shape that is not a list of sizes")
def _(rng):
    shape = pick(rng, [[0, 2**64 - 1], [1] * 100, [2**63, 0], [-1], [2.5], ["3"], [True], "3", [[1]], None, 3])
    return False, infer_with_state(array_map("<f4", shape, ONE_STATE))


@malformed("array map without its keys")
def _(rng):
    state = pick(rng, [{b"__ndarray__": True}, {b"__ndarray__": True, b"data": ONE_STATE, b"dtype": "<f4"},
                       {b"__ndarray__": True, b"data": ONE_STATE, b"shape": [1, 3]},
                       {b"__npgeneric__": True, b"dtype": "<f4"}, {b"__npgeneric__": True, b"data": [1], b"dtype": "<f4"}])
    return False, infer_with_state(state)


@malformed("nested too deeply")
def _(rng):
    depth = pick(rng, [int(rng.integers(65, 900)), 50_000])  # the deepest under FUZZ_MAX_BYTES
    return False, b"\x82\xacmessage_type\xa5infer\xa1x" + pick(rng, [b"\x91", b"\x81\xa1y"]) * depth + b"\xc0"


@malformed("unknown message_type")
def _(rng):
    kind = pick(rng, ["action", "metadata", "error", "", "Infer", "feedbacks", 1, None, [], {}, True, ...])
    return False, pack_message(with_changes(infer_message(), message_type=kind))


@malformed("message_type not a string")
def _(rng):
    kind = pick(rng, [np.array([1, 2]), np.zeros(3, np.float32), np.array([1]), np.array([[True, False]])])
    return False, pack_message(with_changes(infer_message(), message_type=kind))


@malformed("bad env_indices")
def _(rng):
    indices = pick(rng, [np.array([0], np.int32), np.array([0.0]), np.array([0], np.uint64), np.zeros((1, 1), np.int64),
                         [0], ..., np.int64(0), np.array([-1], np.int64), np.array([True])])
    return False, pack_message(with_changes(infer_message(), env_indices=indices))


@malformed("env index reused within one message")
def _(rng):
    return pick(rng, [(False, pack_message(infer_message(pick(rng, [(0, 0), (1, 2, 1), (3, 3, 3)])))),
                      (True, pack_message(feedback_message((0, 0))))])


@malformed("obs keys differ from the policy's")
def _(rng):
    state, text = obs_of([BAD_TAG])["states"]["state"], np.array([""])
    obs = pick(rng, [..., {}, {"state": state}, {"images": {}, "states": {"State": state}, "text": text}, state,
                     [state], "state", {"images": {}, "states": {"state": {"x": state}}, "text": text},
                     {"images": {}, "states": {"state": state}}, {"images": [], "states": {"state": state}, "text": text},
                     {"images": {}, "states": {"state": state}, "text": np.array([1])},
                     {"images": {}, "states": {"state": state}, "text": ["a", "b"]}])
    return False, pack_message(with_changes(infer_message(), obs=obs))


@malformed("obs shape differs from the policy's")
def _(rng):
    shape = pick(rng, [(1, 2), (1, 4), (2, 3), (3,), (1, 3, 1), (0, 3), ()])
    return False, pack_message(with_changes(infer_message(), obs=observation(1, states={"state": np.zeros(shape, np.float32)})))


@malformed("obs dtype differs from the policy's")
def _(rng):
    dtype = pick(rng, [np.int32, np.int64, np.uint8, np.bool_])  # a float of another width is cast, not refused
    return False, pack_message(with_changes(infer_message(), obs=observation(1, states={"state": np.zeros((1, 3), dtype)})))


@malformed("NaN or infinity in an infer's obs")
def _(rng):
    n = int(rng.integers(1, 5))
    state = np.full((n, 3), BAD_TAG, np.float32)
    state.flat[rng.integers(3 * n)] = pick(rng, [np.nan, np.inf, -np.inf])
    return False, pack_message(with_changes(infer_message(range(n)), obs=observation(n, states={"state": state})))


@malformed("NaN or infinity in a feedback")
def _(rng):
    return True, pack_message(pick(rng, [
        with_changes(feedback_message(), obs=observation(1, states={"state": np.array([[BAD_TAG, np.nan, 0]], np.float32)})),
        with_changes(feedback_message(), obs=observation(1, states={"state": np.array([[BAD_TAG, 0, -np.inf]], np.float32)})),
        with_changes(feedback_message(), rewards=np.array([np.nan], np.float32)),
        with_changes(feedback_message(), rewards=np.array([np.inf])),
        with_changes(feedback_message(), rewards=np.array([[1.0, np.nan]], np.float32))]))


@malformed("feedback before any action")
def _(rng):
    return False, pack_message(feedback_message(pick(rng, [(0,), (1,), (0, 1)])))


@malformed("two infers without feedback")
def _(rng):
    return True, pack_message(infer_message(pick(rng, [(0,), (0, 1), (1, 0)])))


@malformed("two feedbacks in a row")
def _(rng):
    return "fed", pack_message(feedback_message())


@malformed("more environments than --max-envs-per-client")
def _(rng):
    return False, pack_message(infer_message(list(range(FUZZ_MAX_ENVS + int(rng.integers(1, 32))))))


@malformed("bad reward, flags or info")
def _(rng):
    change = pick(rng, [
        {"rewards": np.zeros(2, np.float32)}, {"rewards": np.zeros(1, bool)}, {"rewards": np.zeros((1, 1, 1))},
        {"rewards": np.float32(0)}, {"rewards": ...}, {"rewards": [0.0]}, {"terminated": np.zeros(1, np.int8)},
        {"truncated": np.zeros(2, bool)}, {"terminated": ...}, {"info": 5}, {"info": [np.zeros(1)]},
        {"info": {"x": np.zeros((2, 3))}}, {"info": {"x": {"y": np.zeros(3)}}}, {"info": {"x": np.zeros(2)}}])
    return True, pack_message(with_changes(feedback_message(), **change))


@malformed("malformed info['episode']")
def _(rng):
    done = np.array([True])
    return True, pack_message(with_info_episode(pick(rng, [
        {"l": np.array([5]), "s": done, "mask": done},  # no return
        {"r": np.array([-3.0], np.float32), "mask": done},  # no length
        np.array([-3.0]),  # not a dict
        {"r": np.zeros((1, 3), np.float32), "l": np.array([5]), "s": done, "mask": done},  # 3 returns per env
        {"r": {"sum": np.array([-3.0])}, "l": np.array([5]), "s": done, "mask": done},  # nested
        {"r": np.array([np.nan], np.float32), "l": np.array([5]), "s": done, "mask": done}])))  # not finite


@malformed("oversized frame")
def _(rng):
    return False, b"\0" * (FUZZ_MAX_BYTES + int(rng.integers(1, 4096)))


RESYNCED = "close {} {}".format(*RESYNC)  # what outcome_of says of a message the server refused
TOO_BIG_A_FRAME = f"close {TOO_BIG} (frame too big)"  # and of a frame over its size limit
EXPECTED = collections.defaultdict(lambda: RESYNCED, {"oversized frame": TOO_BIG_A_FRAME})
FUZZ_PER_KIND = 80  # 30 kinds: 2,400 malformed frames
FUZZ_MAX_BYTES = 256 * 1024
FUZZ_MAX_ENVS = 8  # --max-envs-per-client
FUZZ_BATCH = 60  # bad connections open at once


async def outcome_of(ws) -> str:
    """What the server did after a bad frame, in words (RESYNCED; TOO_BIG_A_FRAME for a frame too big)."""
    refusal = await refusal_of(ws)
    if refusal.code is None:
        await ws.close()
    if refusal.sent is not None:
        return f"accepted (got {refusal.sent})"
    if refusal.code is None:
        return "no reply in 10 s"
    return f"close {refusal.code} {'(frame too big)' if refusal.code == TOO_BIG else refusal.reason}"


async def one_bad_connection(port, kind, rng) -> str:
    """Connect, read the metadata, (maybe) make one valid decision (and feed it back), send one bad frame: the outcome."""
    prelude, frame = MALFORMED[kind](rng)
    try:
        ws = await connect(f"ws://127.0.0.1:{port}", compression=None, proxy=None, open_timeout=10, max_size=None)
        assert unpack_message(await asyncio.wait_for(ws.recv(), 10))["message_type"] == "metadata"
    except Exception as error:  # noqa: BLE001 - counted in the table
        return f"connect failed ({type(error).__name__})"
    try:
        if prelude:
            await ws.send(pack_message(infer_message()))
            reply = unpack_message(await asyncio.wait_for(ws.recv(), 10))
            if reply.get("message_type") != "action":
                await ws.close()
                return "prelude refused"
        if prelude == "fed":
            await ws.send(pack_message(feedback_message()))
        try:
            await ws.send(frame)
        except websockets.ConnectionClosed:
            pass  # the server closed while a large frame was still going out: see below
        return await outcome_of(ws)
    except Exception as error:  # noqa: BLE001 - counted in the table
        await ws.close()
        return f"{type(error).__name__}"


def format_table(tried, reasons, good) -> str:
    lines = [f"malformed frames tried: {sum(sum(c.values()) for c in tried.values())} (one per connection, "
             f"{FUZZ_BATCH} connections at a time), while a good client fed {good} frames", "",
             f"{'kind':48s} {'tried':>5s}  what each produced (expected: {RESYNCED})"]
    for kind in MALFORMED:
        produced = ", ".join(f"{outcome}: {n}" for outcome, n in tried[kind].most_common())
        mark = "" if set(tried[kind]) == {EXPECTED[kind]} else "   <-- NOT AS EXPECTED"
        lines.append(f"{kind:48s} {sum(tried[kind].values()):5d}  {produced}{mark}")
    lines += ["", f"the server's log: {len(reasons)} resyncs; its most frequent reasons:"]
    lines += [f"  {n:5d}  {why[:110]}" for why, n in collections.Counter(reasons).most_common(12)]
    return "\n".join(lines) + "\n"


@contract
@wire
def test_fuzz_every_kind_of_malformed_frame_closes_its_connection_for_a_resync_while_a_good_client_trains(
        tmp_path, capsys):
    algo = Probe()  # off-policy: every frame with a step state is fed
    tried = collections.defaultdict(collections.Counter)
    jobs = [(kind, np.random.default_rng([i, n])) for n in range(FUZZ_PER_KIND) for i, kind in enumerate(MALFORMED)]
    np.random.default_rng(0).shuffle(jobs)

    async def good_client(port, done: asyncio.Event) -> tuple[int, str | None]:
        client, fed = await Client.connect(port), 0
        try:
            while not done.is_set():
                await client.step([0, 1], [1, 2])
                fed += 2
        except websockets.ConnectionClosed:
            return fed, client.ws.close_reason  # the server closed it: the assertions below say so
        await client.close()
        return fed, None

    async def script(port, server):
        done = asyncio.Event()
        good = asyncio.create_task(good_client(port, done))
        for start in range(0, len(jobs), FUZZ_BATCH):
            batch = jobs[start:start + FUZZ_BATCH]
            results = await asyncio.gather(*(one_bad_connection(port, kind, rng) for kind, rng in batch))
            for (kind, _), outcome in zip(batch, results):
                tried[kind][outcome] += 1
        done.set()
        fed, closed_by_server = await good
        if closed_by_server is None:
            await eventually(lambda: len(algo.frames) >= fed, timeout=10)
            still_serving = await Client.connect(port)
            await still_serving.step([0], [3])
            await still_serving.close()
        return fed, closed_by_server

    status, (fed, closed_by_server) = run_server(algo, tmp_path, script, max_message_bytes=FUZZ_MAX_BYTES,
                                                 max_envs_per_client=FUZZ_MAX_ENVS)
    reasons = [why for _, why, _ in resyncs_logged(capsys.readouterr().err)]
    table = format_table(tried, reasons, fed)
    print("\n" + table)  # shown with pytest -s: the malformed frames tried, by kind, and what each produced
    tags = collections.Counter(float(frame["runtime_state"]["tag"]) for frame in algo.frames)
    assert sum(sum(counter.values()) for counter in tried.values()) >= 2400
    assert closed_by_server is None and status == 0  # the server ran until it was asked to stop
    assert {kind: dict(counter) for kind, counter in tried.items() if set(counter) != {EXPECTED[kind]}} == {}
    # Every good frame was fed, a valid first feedback of "two feedbacks in a row" too; no bad one got through.
    assert tags == {1.0: fed // 2, 2.0: fed // 2, 3.0: 1, BAD_TAG: FUZZ_PER_KIND}
    assert len(reasons) == sum(counter[RESYNCED] for counter in tried.values())  # each resync, and why, in the log


@pytest.mark.parametrize("episode", [
    {"l": np.array([5]), "s": np.array([True]), "mask": np.array([True])},
    np.array([-3.0]),
    {"r": np.zeros((1, 3), np.float32), "l": np.array([5]), "s": np.array([True]), "mask": np.array([True])},
], ids=["without its return", "not a dict", "three returns per environment"])
@contract
@wire
def test_feedback_with_a_malformed_info_episode_closes_for_a_resync_and_the_server_keeps_running(tmp_path, episode):
    algo = Probe()

    async def script(port, server):
        good, offender = await Client.connect(port), await Client.connect(port)
        await offender.infer([0], [BAD_TAG])
        await offender.ws.send(pack_message(with_info_episode(episode)))
        outcome = await outcome_of(offender.ws)
        await good.step([0], [1])  # the server, and the other client, carry on
        await eventually(lambda: len(algo.frames) == 1)
        await good.close()
        return outcome

    status, outcome = run_server(algo, tmp_path, script)
    assert outcome == RESYNCED and status == 0
    assert [float(frame["runtime_state"]["tag"]) for frame in algo.frames] == [1.0]


# --- Sizes: --max-message-bytes (32 MiB by default), --max-envs-per-client ------------------------

@wire
def test_a_frame_over_max_message_bytes_closes_that_connection_with_1009_and_the_server_carries_on(tmp_path):
    algo = Probe()

    async def script(port, server):
        good, offender = await Client.connect(port), await Client.connect(port)
        await good.step([0], [1])
        await offender.ws.send(b"\0" * (64 * 1024 + 1))
        outcome = await outcome_of(offender.ws)
        await good.step([0], [1])
        await eventually(lambda: len(algo.frames) == 2)
        await good.close()
        return outcome

    status, outcome = run_server(algo, tmp_path, script, max_message_bytes=64 * 1024)
    assert outcome == TOO_BIG_A_FRAME and status == 0


@wire
def test_an_env_client_refused_for_size_stops_at_once_naming_the_limit_and_the_flag(tmp_path, capsys):
    async def script(port, server):
        started = time.monotonic()
        status = await env_client_in_process("dummy-v1", "--server-port", port, "--num-envs", "4",
                                             "--num-episodes", "0")
        return status, time.monotonic() - started

    _, (status, seconds) = run_server(Probe(), tmp_path, script, max_message_bytes=100)
    err = capsys.readouterr().err
    assert status == 1 and seconds < 10 and err.count("reconnecting") <= 1, err
    assert "exceeds limit of 100 bytes" in err and "--max-message-bytes" in err, err


@wire
def test_the_default_max_message_bytes_is_32_mib(tmp_path):
    async def script(port, server):
        at_limit, over = await Client.connect(port), await Client.connect(port)
        await at_limit.ws.send(b"\0" * 2**25)  # read, then refused as a malformed message
        await over.ws.send(b"\0" * (2**25 + 1))  # refused for its size
        return await outcome_of(at_limit.ws), await outcome_of(over.ws)

    _, outcomes = run_server(Probe(), tmp_path, script)
    assert outcomes == (RESYNCED, TOO_BIG_A_FRAME)


def test_the_default_frame_cap_is_over_twice_a_feedback_of_64_plugrl_dummy_v1_environments_with_both_cameras():
    one = plugrl_dummy_v1_observation(["pick up the cube"])
    obs = {group: {key: np.repeat(array, 64, axis=0) for key, array in one[group].items()}
           for group in ("images", "states")} | {"text": ["pick up the cube"] * 64}
    frame = pack_message(feedback_message(range(64), obs=obs, rewards=np.zeros(64)))
    assert 12_000_000 < len(frame) < plugrl_min.MAX_MESSAGE_BYTES / 2  # room for an info holding it again


@wire
def test_an_infer_with_more_environments_than_the_cap_is_refused_before_the_policy_runs(tmp_path, capsys):
    async def script(port, server):
        client = await Client.connect(port)
        await client.step([0, 1, 2], [0.1, 0.2, 0.3])
        await client.ws.send(pack_message(infer_message([3, 4], [0.4, 0.5])))  # five on one connection
        return await refusal_of(client.ws)

    probe = Probe()
    status, refusal = run_server(probe, tmp_path, script, max_envs_per_client=4)
    [(_, why, _)] = resyncs_logged(capsys.readouterr().err)
    assert why == "infer: a connection may use at most 4 environments (the server's --max-envs-per-client)"
    infers = [tags for event, *tags in probe.events if event == "infer"]
    assert refusal == Refusal(None, *RESYNC) and len(infers) == 1  # the first; the policy never saw the second


@wire
def test_exactly_max_envs_per_client_environments_are_served(tmp_path):
    async def script(port, server):
        client = await Client.connect(port)
        return await client.step([0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4])  # four environments: the cap

    _, reply = run_server(Probe(), tmp_path, script, max_envs_per_client=4)
    assert len(actions_of(reply)) == 4


@wire
def test_a_client_at_or_under_the_cap_infers_the_environments_it_holds_again_and_again(tmp_path):
    async def script(port, server):
        client = await Client.connect(port)
        replies = [await client.step([0, 1, 2], [0.1, 0.2, 0.3]) for _ in range(3)]  # three of four
        replies += [await client.step([0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4]) for _ in range(3)]  # all four
        return replies

    _, replies = run_server(Probe(), tmp_path, script, max_envs_per_client=4)
    assert [len(actions_of(reply)) for reply in replies] == [3, 3, 3, 4, 4, 4]


# --- The feedback timeout: a client silent too long is dropped, one waiting on a learn is kept ----

@wire
def test_the_server_closes_no_connection_for_a_missing_pong_so_a_client_held_in_a_slow_step_keeps_it(
        monkeypatch, tmp_path):
    # websockets' keepalive (a ping every 20 s; no pong within 20 s closes the connection) scaled to 0.1 s each:
    # a client held 1.5 s in a slow env.step stands for a simulator stepping for minutes. The server pings
    # (NATs keep the connection) but must set no ping timeout; left at websockets' own, it closes 1011 in the hold.
    real = plugrl_min.websockets_serve
    scaled = lambda *args, **kwargs: real(*args, **{"ping_timeout": 0.1, **kwargs, "ping_interval": 0.1})
    monkeypatch.setattr(plugrl_min, "websockets_serve", scaled)

    async def slow_client(port):  # run on a thread of its own: held, its loop answers no ping
        client = await Client.connect(port)
        await client.infer([0], [1])
        time.sleep(1.5)  # the loop held, as a blocking env.step holds it
        await client.feedback([0], [1])
        reply = await client.infer([0], [2])
        await client.close()
        return reply

    async def script(port, server):
        return await asyncio.to_thread(asyncio.run, slow_client(port))

    status, reply = run_server(Probe(), tmp_path, script)
    assert status == 0 and len(actions_of(reply)) == 1


@wire
def test_a_client_silent_after_an_action_is_dropped_after_the_feedback_timeout_and_others_carry_on(tmp_path):
    algo = Probe()

    async def keeps_stepping(client, stop: asyncio.Event) -> int:
        steps = 0
        while not stop.is_set():
            await client.step([0], [1])  # feeds back after every action, so it is never dropped
            steps += 1
            await asyncio.sleep(0.01)
        return steps

    async def script(port, server):
        good, silent = await Client.connect(port), await Client.connect(port)
        stop = asyncio.Event()
        stepping = asyncio.create_task(keeps_stepping(good, stop))
        await silent.infer([0], [BAD_TAG])
        acted = time.monotonic()
        refusal = await refusal_of(silent.ws, wait=60)
        dropped_after = time.monotonic() - acted
        stop.set()
        steps = await stepping
        await eventually(lambda: len(algo.frames) == steps)
        good_open = good.ws.close_code is None
        await good.close()
        return refusal, dropped_after, steps, good_open

    # 3 s, not 0.5: the good client owes feedback for a moment after every action, and a busy machine can stall
    # this process (server and clients alike) for half a second; the timeout is the good client's margin.
    _, (refusal, dropped_after, steps, good_open) = run_server(algo, tmp_path, script, feedback_timeout=3.0)
    assert (refusal.code, refusal.reason) == silent_after(3.0)
    assert 2.9 <= dropped_after  # the server counts from its send, a little before the client reads
    assert good_open and steps > 0 and len(algo.frames) == steps


@wire
def test_a_silent_client_gets_no_message_only_the_close_and_the_servers_log_names_it_and_the_seconds(
        tmp_path, capsys):
    async def script(port, server):
        first, silent = await Client.connect(port), await Client.connect(port)
        await silent.infer([0], [BAD_TAG])
        refusal = await refusal_of(silent.ws)
        await first.close()
        return refusal

    _, refusal = run_server(Probe(), tmp_path, script, feedback_timeout=0.3)
    assert refusal == Refusal(None, *silent_after(0.3))  # no message first (SPEC 7.3)
    assert "client 2: no feedback for 0.3 s of serving: closed 1001 Feedback timeout" in capsys.readouterr().err


@wire
def test_a_client_that_owes_feedback_while_the_server_learns_longer_than_the_timeout_is_kept(tmp_path):
    algo = LearnsOnceAfterTheFirstFrame()

    async def script(port, server):
        learner, owing = await Client.connect(port), await Client.connect(port)
        await owing.infer([0], [2])  # owes feedback from here
        await learner.step([0], [1])  # starts the learn, which lasts until released
        await eventually(lambda: algo.learning)
        await asyncio.sleep(1.0)  # silent for twice the timeout, all of it while the server learns
        assert algo.learning
        await owing.feedback([0], [2])
        algo.released.set()
        again = await owing.infer([0], [2])  # answered once the learn is over
        await owing.feedback([0], [2])
        await eventually(lambda: len(algo.frames) == 3)
        await learner.close()
        await owing.close()
        return again

    _, again = run_server(algo, tmp_path, script, feedback_timeout=0.5)
    assert len(actions_of(again)) == 1 and algo.learns == 1
    assert sorted(float(frame["runtime_state"]["tag"]) for frame in algo.frames) == [1.0, 2.0, 2.0]


@wire
def test_an_environment_owing_feedback_past_the_timeout_gets_its_client_dropped_though_the_client_feeds_back_others(
        tmp_path):
    algo = Probe()

    async def script(port, server):
        client = await Client.connect(port)
        await client.infer([0, 1], [1, 2])
        started = time.monotonic()
        try:
            while time.monotonic() - started < 60.0:  # environment 1 owes all along; 0 keeps answering
                await client.feedback([0], [1])
                reply = await client.infer([0], [1])
                await asyncio.sleep(0.02)
        except websockets.ConnectionClosed:
            return time.monotonic() - started, (client.ws.close_code, client.ws.close_reason)
        return None, None

    _, (after, closed) = run_server(algo, tmp_path, script, feedback_timeout=0.5)
    assert closed == silent_after(0.5)
    assert 0.45 <= after  # never before the timeout; on a busy machine the drop may come a few seconds late


class Learns(plugrl_min.DummyAlgorithm):
    """dummy-policy's actions, stored nowhere; a learn of 20 ms after every 8 frames, for ever."""

    def __init__(self):
        super().__init__(plugrl_min.DummyAlgoConfig(global_steps=None, learn_every=8), small_policy())

    def learn_impl(self):
        time.sleep(0.02)
        return super().learn_impl()


@wire
def test_a_client_owing_feedback_while_another_trains_is_dropped_after_the_timeout(tmp_path):
    async def script(port, server):
        trainer = asyncio.create_task(run_rounds(port, [1.0, 2.0], 10**6))
        silent = await Client.connect(port)
        await silent.infer([0], [0.5])  # it owes this feedback, and sends nothing more
        started, learned = time.monotonic(), server.learning_seconds
        await asyncio.wait_for(silent.ws.wait_closed(), 40)
        waited, learned = time.monotonic() - started, server.learning_seconds - learned
        trainer.cancel()
        return silent.ws.close_code, silent.ws.close_reason, waited, learned

    status, (code, reason, waited, learned) = run_server(Learns(), tmp_path, script, feedback_timeout=1.5)
    assert (code, reason) == silent_after(1.5)
    # Learns came all the while, for longer than the tick's half second of slack: their time did not count.
    # (0.1 s: the action reached this client a little after the server sent it.)
    assert learned > 0.6 and 1.5 + learned - 0.1 <= waited < 40


def connections_to(port: int) -> int:
    """Open TCP connections that the server on 127.0.0.1:port accepted (Linux's /proc/net/tcp)."""
    with open("/proc/net/tcp") as table:
        rows = [line.split() for line in table.readlines()[1:]]
    return sum(1 for row in rows if int(row[1].split(":")[1], 16) == port and row[3] == "01")


def env_client_process(tmp_path, name, port, *flags) -> Background:
    return Background(tmp_path, name, ["plugrl_min.py", "env-client", "dummy-v1", "--server-port", str(port),
                                       "--num-episodes", "0", *flags])


SLOW_STEP_ENV = """
import os, time
from plugrl_min import DummyEnv, register_env

@register_env("slow-step-v1")
class SlowStepEnv(DummyEnv):
    # dummy-v1, whose step sleeps once for the seconds written in PAUSE_FILE (then removed): a debugger,
    # a slow simulator. The action has come: the client owes its feedback all along.
    def _step(self, action, rows):
        if os.path.exists(PAUSE_FILE):
            seconds = float(open(PAUSE_FILE).read())
            os.remove(PAUSE_FILE)
            time.sleep(seconds)
        return super()._step(action, rows)
"""


@pytest.mark.parametrize("pause, dropped", [(0.5, False), (8.0, True)])
@wire
def test_a_paused_client_survives_a_pause_shorter_than_the_timeout_and_is_dropped_after_a_longer_one(
        tmp_path, pause, dropped):
    run_dir = tmp_path / "run"
    flags = ["--algo.global-steps", "1000000000", "--local-env-clients", "1", "--feedback-timeout", "3"]
    pause_file = tmp_path / "pause.txt"
    write_plugin(tmp_path, "plugrl_test_slow_step", SLOW_STEP_ENV.replace("PAUSE_FILE", repr(str(pause_file))))
    with Background(tmp_path, "server", dummy_server(run_dir, *flags)) as server:
        port = server.port()
        command = ["plugrl_min.py", "env-client", "slow-step-v1", "--plugin", "plugrl_test_slow_step",
                   "--server-port", str(port), "--num-episodes", "0"]
        with Background(tmp_path, "paused", command, pythonpath=tmp_path) as client:
            wait_for(lambda: connections_to(port) == 2 and metrics_lines(run_dir) >= 2, 60, "both clients training")
            # Not kill -STOP: stopped between its feedback and its next infer, a client owes nothing (an idle
            # one, rightly kept), so a test that stops it at a random moment fails now and then.
            (tmp_path / "pause.tmp").write_text(str(pause))
            (tmp_path / "pause.tmp").replace(pause_file)  # whole, never read half-written
            wait_for(lambda: not pause_file.exists(), 30, "the client's step to take the pause")
            if dropped:
                wait_for(lambda: "1001 (going away) Feedback timeout); reconnecting" in client.stderr(), 30,
                         "the paused client to hear why it was dropped, and come back")
                # The paused client is 1 or 2, whichever connected first; the local one is never dropped.
                drops = re.findall(r"client \d: no feedback for 3 s of serving: closed 1001 Feedback timeout",
                                   server.stderr())
                assert len(drops) == 1, server.stderr()
            else:
                lines = metrics_lines(run_dir)
                wait_for(lambda: metrics_lines(run_dir) > lines + 2, 30, "more frames")
                assert client.proc.poll() is None and client.stderr() == ""
        server.proc.send_signal(signal.SIGTERM)
        assert server.wait(30) == 0


# --- Who may connect: loopback by default; --api-key / PLUGRL_API_KEY checked at the handshake -------

@pytest.mark.parametrize("authorization", [None, "Api-Key wrong", "s3cret", "Bearer s3cret", "Api-Key s3cret2",
                                           "Api-Key "],
                         ids=["no key", "wrong key", "no scheme", "Bearer", "longer key", "empty key"])
@wire
def test_the_server_refuses_at_the_handshake_a_client_without_the_same_api_key(tmp_path, authorization):
    async def script(port, server):
        headers = {"Authorization": authorization} if authorization is not None else None
        with pytest.raises(websockets.InvalidStatus) as refused:
            await connect(f"ws://127.0.0.1:{port}", additional_headers=headers, proxy=None, open_timeout=10)
        return refused.value.response.status_code, len(server.connections)

    _, (code, connections) = run_server(Probe(), tmp_path, script, api_key="s3cret")
    assert code == 401 and connections == 0


@wire
def test_the_server_serves_a_client_sending_authorization_api_key_with_its_key(tmp_path):
    async def script(port, server):
        ws = await connect(f"ws://127.0.0.1:{port}", additional_headers={"Authorization": "Api-Key s3cret"},
                           proxy=None, open_timeout=10)
        client = Client(ws, unpack_message(await asyncio.wait_for(ws.recv(), 10)))
        reply = await client.step([0], [1])
        await client.close()
        return client.metadata["message_type"], len(actions_of(reply))

    _, (kind, actions) = run_server(Probe(), tmp_path, script, api_key="s3cret")
    assert (kind, actions) == ("metadata", 1)


@wire
def test_env_clients_without_the_servers_api_key_exit_nonzero_and_with_it_train(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("PLUGRL_API_KEY", raising=False)

    async def script(port, server):  # the clients in this process, one after the other: PLUGRL_API_KEY is global
        args = ["dummy-v1", "--server-port", port, "--num-episodes", "2"]
        outputs = []
        for extra, key in (([], None), (["--api-key", "s3cret"], None), ([], "s3cret")):
            if key is not None:
                monkeypatch.setenv("PLUGRL_API_KEY", key)  # read as the client parses its flags
            status = await env_client_in_process(*args, *extra)
            outputs.append((status, *capsys.readouterr()))
        return outputs

    _, (without, flag, environment) = run_server(Probe(), tmp_path, script, api_key="s3cret")
    assert without[0] != 0
    assert "env-client: the server refused the connection (HTTP 401): wrong or missing --api-key?" in without[2]
    assert (flag[0], environment[0]) == (0, 0), flag[2] + environment[2]
    assert "done | episodes 2 |" in flag[1] and "done | episodes 2 |" in environment[1]


def serve_on_a_taken_port(host, tmp_path, capsys, monkeypatch, api_key=None) -> str:
    """server_main on a port held by a listening socket: it prints its warnings, then fails to bind.

    Nothing ever listens on the non-loopback address, so the test exposes nothing to the network.
    """
    monkeypatch.delenv("PLUGRL_API_KEY", raising=False)
    if api_key is not None:
        monkeypatch.setenv("PLUGRL_API_KEY", api_key)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        status = plugrl_min.server_main(["dummy-policy", "default", "dummy", "default", "--host", host,
                                         "--port", str(taken.getsockname()[1]), "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert status == 1 and "error: cannot listen on" in err, err
    return err


def test_binding_a_non_loopback_address_without_an_api_key_prints_a_warning(tmp_path, capsys, monkeypatch):
    err = serve_on_a_taken_port("0.0.0.0", tmp_path, capsys, monkeypatch)
    assert "warning: serving on 0.0.0.0 without --api-key" in err


def test_binding_a_non_loopback_address_with_plugrl_api_key_prints_no_warning(tmp_path, capsys, monkeypatch):
    err = serve_on_a_taken_port("0.0.0.0", tmp_path, capsys, monkeypatch, api_key="s3cret")
    assert "warning" not in err


@pytest.mark.parametrize("how", ["PLUGRL_API_KEY=", "--api-key ''"])
def test_an_empty_api_key_is_none_and_trains_with_a_local_client(tmp_path, how):
    env = {**subprocess_env(), "PLUGRL_API_KEY": ""}
    flags = ["--api-key", ""] if how.startswith("--api-key") else []
    status = subprocess.run(dummy_run_command("--run-dir", tmp_path / "run", "--host", "0.0.0.0", *flags),
                            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180,
                            stdin=subprocess.DEVNULL)
    assert status.returncode == 0, status.stderr
    assert checkpoint_steps(tmp_path / "run") == [2000]
    assert "without --api-key" in status.stderr  # and that is true: anyone may connect


# =============================================================================================
# 14. Environment client: environments, executing a decision, connecting
# =============================================================================================
# VecEnv and dummy-v1; a decision executed as one or several physical steps (ClosedLoopMultiAction with
# a controller, MultiAction with an action chunk); connecting, waiting and reconnecting.

# --- The vectorized environment interface ---------------------------------------------------------

def test_reset_with_indices_resets_only_those_and_returns_every_observation():
    env = make_env("counting-v1", 3)
    env.reset()
    env.step(np.zeros((3, 1)))
    env.step(np.zeros((3, 1)))
    obs = env.reset(indices=[1])
    assert obs["states"]["state"].shape == (3, 1)
    assert state_of(obs) == [2.0, 0.0, 2.0]


def test_make_env_with_the_same_seed_gives_the_same_episodes():
    a, b = make_env("dummy-v1", 4, seed=7), make_env("dummy-v1", 4, seed=7)
    np.testing.assert_array_equal(a.reset()["states"]["state"], b.reset()["states"]["state"])
    np.testing.assert_array_equal(a.reset(indices=[2])["states"]["state"], b.reset(indices=[2])["states"]["state"])


def test_make_env_unknown_id_is_a_usage_error_naming_it():
    with pytest.raises(plugrl_min.UsageError, match="no-such-env"):
        make_env("no-such-env", 1)


def test_inactive_env_keeps_its_observation():
    env = make_env("dummy-v1", 2, seed=0)
    before = env.reset()["states"]["state"].copy()
    obs, *_ = env.step(np.ones((2, 1)), active=np.array([True, False]))
    np.testing.assert_array_equal(obs["states"]["state"][1], before[1])
    assert not np.array_equal(obs["states"]["state"][0], before[0])  # the active one did move


def test_inactive_env_gets_zero_reward():
    env = make_env("dummy-v1", 2, seed=0)
    env.reset()
    _, reward, *_ = env.step(np.ones((2, 1)), active=np.array([False, True]))
    assert reward[0] == 0.0
    assert reward[1] != 0.0


def test_inactive_env_keeps_its_done_flags():
    env = make_env("counting-v1", 2)  # env 0 terminates after 4 steps, env 1 after 5
    env.reset()
    for _ in range(4):
        _, _, terminated, truncated, _ = env.step(np.zeros((2, 1)))
    assert terminated.tolist() == [True, False]
    obs, reward, terminated, truncated, _ = env.step(np.zeros((2, 1)), active=np.array([False, False]))
    assert terminated.tolist() == [True, False]
    assert truncated.tolist() == [False, False]
    assert state_of(obs) == [4.0, 4.0]


def test_inactive_step_does_not_count_toward_the_episode():
    env = make_env("counting-v1", 1)
    env.reset()
    env.step(np.zeros((1, 1)))
    env.step(np.zeros((1, 1)), active=np.array([False]))
    obs, *_ = env.step(np.zeros((1, 1)))
    assert state_of(obs) == [2.0]


def test_inactive_finished_env_does_not_report_its_episode_again():
    env = make_env("counting-v1", 2)
    env.reset()
    for _ in range(4):
        *_, info = env.step(np.zeros((2, 1)))
    assert info["episode"]["mask"].tolist() == [True, False]
    *_, info = env.step(np.zeros((2, 1)), active=np.array([False, True]))
    assert info["episode"]["mask"].tolist() == [False, True]


# --- dummy-v1 (and pendulum-v1 beside it) ---------------------------------------------------------

@pytest.mark.parametrize("env_id", ["dummy-v1", "pendulum-v1"])
def test_observations_are_float32_n_by_3(env_id):
    env = make_env(env_id, 5, seed=0)
    obs = env.reset()
    assert obs["states"]["state"].shape == (5, 3) and obs["states"]["state"].dtype == np.float32
    obs, *_ = env.step(np.zeros((5, 1), np.float32))
    assert obs["states"]["state"].shape == (5, 3) and obs["states"]["state"].dtype == np.float32


@pytest.mark.parametrize("env_id", ["dummy-v1", "pendulum-v1"])
def test_actions_outside_minus_one_one_are_clipped(env_id):
    a, b = make_env(env_id, 2, seed=3), make_env(env_id, 2, seed=3)
    assert a.action_dim == 1
    a.reset(), b.reset()
    obs_a, reward_a, *_ = a.step(np.array([[5.0], [-5.0]]))
    obs_b, reward_b, *_ = b.step(np.array([[1.0], [-1.0]]))
    np.testing.assert_array_equal(obs_a["states"]["state"], obs_b["states"]["state"])
    np.testing.assert_array_equal(reward_a, reward_b)


def test_dummy_truncates_at_50_steps_with_episode_info():
    env = make_env("dummy-v1", 1, seed=1)
    obs = env.reset()
    assert abs(obs["states"]["state"][0, 2]) > 0.05  # standing still never reaches the target
    total = 0.0
    for _ in range(49):
        _, reward, terminated, truncated, info = env.step(np.zeros((1, 1)))
        total += float(reward[0])
        assert not (terminated[0] or truncated[0]) and not info["episode"]["mask"][0]
    _, reward, terminated, truncated, info = env.step(np.zeros((1, 1)))
    total += float(reward[0])
    episode = info["episode"]
    assert truncated[0] and not terminated[0]
    assert set(episode) >= {"r", "l", "s", "mask"}
    assert episode["mask"][0] and episode["l"][0] == 50 and not episode["s"][0]
    assert episode["r"][0] == pytest.approx(total, rel=1e-5)


def test_dummy_terminates_with_success_on_reaching_the_target():
    env = make_env("dummy-v1", 1, seed=1)
    obs = env.reset()
    total, steps = 0.0, 0
    while True:
        gap = float(obs["states"]["state"][0, 2])
        obs, reward, terminated, truncated, info = env.step(np.array([[np.clip(gap / 0.2, -1, 1)]]))
        total, steps = total + float(reward[0]), steps + 1
        if terminated[0] or truncated[0]:
            break
    episode = info["episode"]
    assert terminated[0] and not truncated[0] and steps < 50
    assert episode["mask"][0] and episode["s"][0] and episode["l"][0] == steps
    assert episode["r"][0] == pytest.approx(total, rel=1e-5)


# --- Executing a decision: the counting table (counting-v1, env i ends after 4 + i steps) ---------

MODES = ("sum", "mean", "last", "stack")


class RecordingController(Controller):
    """Pass-through controller with a dict state: calls per env, and the sum of the observations it saw.

    It records every call (observation and decision it saw), so tests can check what the executor passes.
    """

    def __init__(self, decision_dim=1):
        self.decision_dim = decision_dim
        self.calls = 0
        self.seen_obs, self.seen_decisions = [], []

    def initial_state(self, n):
        return {"calls": np.zeros(n, np.int64), "obs_sum": np.zeros((n, 1), np.float32)}

    def __call__(self, obs, decision, state):
        self.calls += 1
        self.seen_obs.append(obs["states"]["state"].copy())
        self.seen_decisions.append(np.array(decision, copy=True))
        new_state = {"calls": state["calls"] + 1, "obs_sum": state["obs_sum"] + obs["states"]["state"][:, :1]}
        return np.asarray(decision)[:, :1], new_state


class PerRowInitialController(RecordingController):
    """Like RecordingController, but every environment's initial state is different (its own index)."""

    def initial_state(self, n):
        return {"calls": np.arange(n, dtype=np.int64) * 100, "obs_sum": np.zeros((n, 1), np.float32)}


@plugrl_min.register_env("counting-v1")
class CountingEnv(plugrl_min.VecEnv):
    """counting-v1, the environment of the SPEC's table: obs = physical steps this episode, reward 1 a step;
    env i ends at 4 + i. Registered here, where the tests use it, as a plug-in would."""

    obs_spec = {"states": {"state": ((1,), "float32")}}

    def _reset(self, rows):
        pass  # the count is VecEnv's episode_length

    def _step(self, action, rows):
        ended = self.episode_length[rows] + 1 >= 4 + rows
        return np.ones(len(rows)), ended, np.ones(len(rows), bool)

    def _observe(self):
        return observation(self.num_envs, states={"state": self.episode_length[:, None].astype(np.float32)})


class PassThroughController(Controller):
    """For counting-v1: the action is the decision; the state counts the calls per environment."""

    def initial_state(self, n):
        return np.zeros(n, np.int64)

    def __call__(self, obs, decision, state):
        return decision, state + 1


def counting(n, steps, mode="sum", controller=None, **kwargs):
    """counting-v1 with n envs, a closed loop of `steps`, reset; returns (executor, controller)."""
    controller = controller or RecordingController()
    executor = ClosedLoopMultiAction(make_env("counting-v1", n), controller, steps=steps,
                                     reward_aggregation=mode, **kwargs)
    executor.reset()
    return executor, controller


def ones(n, dim=1):
    return np.ones((n, dim), np.float32)


def decide(executor, n, times=1):
    """Execute `times` decisions of ones; returns the last result."""
    for _ in range(times):
        result = executor.step(ones(n))
    return result


def state_of(obs):
    return obs["states"]["state"][:, 0].tolist()


FIRST_DECISION = {"sum": [3.0], "mean": [1.0], "last": [1.0], "stack": [[1.0, 1.0, 1.0]]}
SECOND_DECISION = {"sum": [1.0], "mean": [1.0], "last": [1.0], "stack": [[1.0, 0.0]]}


@pytest.mark.parametrize("mode", MODES)
def test_counting_table_first_decision_reward(mode):
    executor, _ = counting(1, 3, mode)
    _, reward, *_ = decide(executor, 1)
    assert reward.tolist() == FIRST_DECISION[mode]


@pytest.mark.parametrize("mode", MODES)
def test_counting_table_first_decision_observation_3_not_done(mode):
    executor, _ = counting(1, 3, mode)
    obs, _, terminated, truncated, info = decide(executor, 1)
    assert state_of(obs) == [3.0]
    assert not terminated[0] and not truncated[0]
    assert info["executed_steps"].tolist() == [3]


@pytest.mark.parametrize("mode", MODES)
def test_counting_table_second_decision_reward(mode):
    executor, _ = counting(1, 3, mode)
    decide(executor, 1)
    _, reward, *_ = decide(executor, 1)
    assert reward.tolist() == SECOND_DECISION[mode]


@pytest.mark.parametrize("mode", MODES)
def test_counting_table_second_decision_observation_4_terminated(mode):
    executor, _ = counting(1, 3, mode)
    decide(executor, 1)
    obs, _, terminated, truncated, info = decide(executor, 1)
    assert state_of(obs) == [4.0]
    assert terminated[0] and not truncated[0]
    assert info["executed_steps"].tolist() == [1]


def test_counting_table_controller_called_3_then_1_times():
    executor, controller = counting(1, 3)
    decide(executor, 1)
    assert controller.calls == 3
    decide(executor, 1)
    assert controller.calls == 4


def test_episode_statistics_count_physical_steps():
    executor, _ = counting(1, 3)
    *_, info = decide(executor, 1)
    assert not info["episode"]["mask"][0]
    *_, info = decide(executor, 1)
    assert info["episode"]["mask"][0]
    assert info["episode"]["l"][0] == 4 and info["episode"]["r"][0] == 4.0


# Batch, K = 3: env 0 ends after 4 steps, env 1 after 5. Second decision: env 0 runs 1 step, env 1 runs 2;
# every env stopped early, width = min(K, max executed + 1) = min(3, 3) = 3.
BATCH_SECOND = {"sum": [1.0, 2.0], "mean": [1.0, 1.0], "last": [1.0, 1.0],
                "stack": [[1.0, 0.0, 0.0], [1.0, 1.0, 0.0]]}


@pytest.mark.parametrize("mode", MODES)
def test_batch_first_decision_reward_every_env_runs_all_3_steps(mode):
    executor, _ = counting(2, 3, mode)
    _, reward, *_ = decide(executor, 2)
    expected = [[1.0, 1.0, 1.0]] * 2 if mode == "stack" else [FIRST_DECISION[mode][0]] * 2
    assert reward.tolist() == expected


@pytest.mark.parametrize("mode", MODES)
def test_batch_second_decision_reward_with_envs_ending_at_different_steps(mode):
    executor, _ = counting(2, 3, mode)
    decide(executor, 2)
    _, reward, *_ = decide(executor, 2)
    assert reward.tolist() == BATCH_SECOND[mode]


def test_batch_second_decision_gives_each_envs_last_executed_observation_and_flags():
    executor, _ = counting(2, 3)
    decide(executor, 2)
    obs, _, terminated, truncated, info = decide(executor, 2)
    assert state_of(obs) == [4.0, 5.0]
    assert terminated.tolist() == [True, True] and truncated.tolist() == [False, False]
    assert info["executed_steps"].tolist() == [1, 2]


# K = 5, three envs ending after 4, 5 and 6 steps: env 2 still runs, so the stack is zero-filled to K.
ZERO_FILL = {"sum": [4.0, 5.0, 5.0], "mean": [1.0, 1.0, 1.0], "last": [1.0, 1.0, 1.0],
             "stack": [[1.0, 1.0, 1.0, 1.0, 0.0], [1.0] * 5, [1.0] * 5]}


@pytest.mark.parametrize("mode", MODES)
def test_batch_reward_when_one_env_stops_while_others_still_run(mode):
    executor, _ = counting(3, 5, mode)
    _, reward, *_ = decide(executor, 3)
    assert reward.tolist() == ZERO_FILL[mode]


def test_batch_flags_and_executed_steps_when_one_env_still_runs():
    executor, _ = counting(3, 5)
    obs, _, terminated, _, info = decide(executor, 3)
    assert state_of(obs) == [4.0, 5.0, 5.0]
    assert terminated.tolist() == [True, True, False]
    assert info["executed_steps"].tolist() == [4, 5, 5]


def test_stack_has_one_trailing_zero_when_every_env_stops_early_in_a_batch():
    # K = 8, envs end after 4 and 5 steps: width = min(8, 5 + 1) = 6.
    executor, _ = counting(2, 8, "stack")
    _, reward, *_ = decide(executor, 2)
    assert reward.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]]


def test_stack_has_one_trailing_zero_when_the_single_env_stops_early():
    executor, _ = counting(1, 10, "stack")
    _, reward, *_ = decide(executor, 1)
    assert reward.tolist() == [[1.0, 1.0, 1.0, 1.0, 0.0]]


def test_stack_has_no_trailing_zero_when_an_env_ends_exactly_on_the_last_step():
    # K = 4, env 0 ends on step 4 exactly, env 1 keeps running: no step was left, width stays K.
    executor, _ = counting(2, 4, "stack")
    _, reward, *_ = decide(executor, 2)
    assert reward.tolist() == [[1.0] * 4, [1.0] * 4]


@pytest.mark.parametrize("mode", ["sum", "mean", "last"])
def test_aggregation_uses_the_per_step_rewards_of_the_executed_steps(mode):
    # dummy-v1 rewards differ per step; compare with plain stepping of an identical environment.
    n, k = 3, 4
    env, plain = make_env("dummy-v1", n, seed=5), make_env("dummy-v1", n, seed=5)
    executor = ClosedLoopMultiAction(env, RecordingController(), steps=k, reward_aggregation=mode)
    executor.reset(), plain.reset()
    decision = np.array([[0.3], [-0.2], [1.0]], np.float32)
    _, reward, *_, info = executor.step(decision)
    assert info["executed_steps"].tolist() == [k] * n  # no episode ends within this decision
    steps = [plain.step(decision)[1] for _ in range(k)]
    expected = {"sum": np.sum(steps, 0), "mean": np.mean(steps, 0), "last": steps[-1]}[mode]
    np.testing.assert_allclose(reward, expected, rtol=1e-6)


# --- Executing a decision: steps=1, the decision held, the controller's state ---------------------

@pytest.mark.parametrize("env_id", ["dummy-v1", "pendulum-v1"])
@pytest.mark.parametrize("mode", MODES)
def test_steps_1_is_exactly_one_plain_step_with_the_controllers_action(env_id, mode):
    n = 3
    env, plain = make_env(env_id, n, seed=11), make_env(env_id, n, seed=11)
    controller = plugrl_min.make_controller("track", env)
    executor = ClosedLoopMultiAction(env, controller, steps=1, reward_aggregation=mode)
    obs, plain_obs = executor.reset(), plain.reset()
    state = controller.initial_state(n)
    rng = np.random.default_rng(0)
    for _ in range(60):
        decision = rng.uniform(-1, 1, (n, 1)).astype(np.float32)
        action, state = controller(plain_obs, decision, state)
        expected = plain.step(action)
        obs, reward, terminated, truncated, info = executor.step(decision)
        np.testing.assert_array_equal(obs["states"]["state"], expected[0]["states"]["state"])
        np.testing.assert_array_equal(reward, expected[1][:, None] if mode == "stack" else expected[1])
        np.testing.assert_array_equal(terminated, expected[2])
        np.testing.assert_array_equal(truncated, expected[3])
        for key in ("r", "l", "s", "mask"):
            np.testing.assert_array_equal(info["episode"][key], expected[4]["episode"][key])
        assert info["executed_steps"].tolist() == [1] * n
        done = terminated | truncated
        if done.any():
            executor.reset(np.flatnonzero(done))
            plain_obs = plain.reset(np.flatnonzero(done))
        else:
            plain_obs = expected[0]


def test_finished_environments_rows_are_never_passed_to_the_controller():
    # counting-v1, K = 5: environments 0, 1, 2 end after 4, 5 and 6 physical steps.
    executor, controller = counting(3, 5)
    decide(executor, 3)
    assert [len(obs) for obs in controller.seen_obs] == [3, 3, 3, 3, 2]  # env 0 ended at step 4
    assert [obs[:, 0].tolist() for obs in controller.seen_obs[-1:]] == [[4.0, 4.0]]  # envs 1 and 2
    assert executor.state["calls"].tolist() == [4, 5, 5]


def test_decision_array_passed_in_is_not_modified():
    executor, _ = counting(2, 3)
    decision = np.array([[0.25], [-0.5]], np.float32)
    original = decision.copy()
    executor.step(decision)
    executor.step(decision)
    np.testing.assert_array_equal(decision, original)


def test_decision_is_held_fixed_for_every_physical_step():
    executor, controller = counting(2, 3)
    decision = np.array([[0.25], [-0.5]], np.float32)
    executor.step(decision)
    assert len(controller.seen_decisions) == 3
    for seen in controller.seen_decisions:
        np.testing.assert_array_equal(seen, decision)


def test_controller_state_advances_once_per_executed_step():
    executor, _ = counting(2, 3)
    decide(executor, 2)
    assert executor.state["calls"].tolist() == [3, 3]
    assert executor.state["obs_sum"][:, 0].tolist() == [0.0 + 1 + 2] * 2


def test_controller_state_of_a_finished_env_stays_frozen():
    executor, controller = counting(2, 3)
    decide(executor, 2)
    decide(executor, 2)  # env 0 runs 1 step, env 1 runs 2; the controller is called twice for both
    assert controller.calls == 5
    assert executor.state["calls"].tolist() == [4, 5]
    assert executor.state["obs_sum"][:, 0].tolist() == [3.0 + 3.0, 3.0 + 3.0 + 4.0]


def test_controller_state_starts_over_after_a_partial_reset():
    executor, _ = counting(2, 3)
    decide(executor, 2, times=2)
    executor.reset(indices=[0])
    assert executor.state["calls"].tolist() == [0, 5]
    assert executor.state["obs_sum"][:, 0].tolist() == [0.0, 10.0]


def test_controller_state_starts_over_after_a_full_reset():
    executor, _ = counting(2, 3)
    decide(executor, 2, times=2)
    executor.reset()
    assert executor.state["calls"].tolist() == [0, 0]
    assert executor.state["obs_sum"][:, 0].tolist() == [0.0, 0.0]


def test_controller_state_counts_again_from_zero_after_a_reset():
    executor, _ = counting(2, 3)
    decide(executor, 2, times=2)
    executor.reset(indices=[0, 1])
    decide(executor, 2)
    assert executor.state["calls"].tolist() == [3, 3]


def test_array_controller_state_is_frozen_for_a_finished_env():
    executor = ClosedLoopMultiAction(make_env("counting-v1", 2), PassThroughController(), steps=3)
    executor.reset()
    decide(executor, 2, times=2)
    assert executor.state.tolist() == [4, 5]
    executor.reset(indices=[1])
    assert executor.state.tolist() == [4, 0]


@pytest.mark.parametrize("indices", [[2, 0], [0, 2]])
def test_reset_restores_each_reset_envs_own_initial_state(indices):
    # Initial states that differ per env (env i starts at 100 i): each reset row gets its own back.
    executor, _ = counting(3, 2, controller=PerRowInitialController())
    decide(executor, 3)
    executor.reset(indices=indices)
    assert executor.state["calls"].tolist() == [0, 102, 200]


def test_first_controller_call_sees_the_observation_the_policy_saw():
    executor, controller = counting(2, 2)
    policy_obs = executor.reset()["states"]["state"].copy()
    executor.step(ones(2))
    np.testing.assert_array_equal(controller.seen_obs[0], policy_obs)


def test_first_controller_call_after_a_partial_reset_sees_the_reset_observation():
    executor, controller = counting(2, 2)
    decide(executor, 2)
    policy_obs = executor.reset(indices=[0])["states"]["state"].copy()
    assert policy_obs[:, 0].tolist() == [0.0, 2.0]
    executor.step(ones(2))
    np.testing.assert_array_equal(controller.seen_obs[2], policy_obs)


def test_first_controller_call_of_a_decision_sees_the_previous_decisions_observation():
    executor, controller = counting(1, 2)
    obs, *_ = decide(executor, 1)
    executor.step(ones(1))
    np.testing.assert_array_equal(controller.seen_obs[2], obs["states"]["state"])


def test_later_controller_calls_see_fresh_observations():
    executor, controller = counting(2, 3)
    decide(executor, 2)
    assert [seen[:, 0].tolist() for seen in controller.seen_obs] == [[0.0, 0.0], [1.0, 1.0], [2.0, 2.0]]


def test_stack_observations_gives_every_physical_steps_observation():
    executor, _ = counting(1, 3, stack_observations=True)
    obs, *_ = decide(executor, 1)
    assert obs["states"]["state"].shape == (1, 3, 1)
    assert obs["states"]["state"][0, :, 0].tolist() == [1.0, 2.0, 3.0]


def test_stack_observations_has_as_many_observations_as_the_stacked_rewards():
    executor, _ = counting(1, 3, mode="stack", stack_observations=True)
    decide(executor, 1)
    obs, reward, *_ = decide(executor, 1)  # one step runs, then the episode ends: [1, 0]
    assert reward[0].tolist() == [1.0, 0.0]
    assert obs["states"]["state"][0, :, 0].tolist() == [4.0, 4.0]  # the last observation repeated once


def test_stack_observations_next_decision_starts_from_the_newest_observation():
    executor, controller = counting(1, 3, stack_observations=True)
    decide(executor, 1)
    decide(executor, 1)
    assert controller.seen_obs[3][:, 0].tolist() == [3.0]


# --- Executing a decision: bad arguments ----------------------------------------------------------

@pytest.mark.parametrize("steps", [0, -1, 2.5, True, "3", None])
def test_bad_steps_is_a_value_error_that_names_steps(steps):
    with pytest.raises(ValueError, match=r"steps must be an integer of at least 1") as error:
        ClosedLoopMultiAction(make_env("counting-v1", 1), RecordingController(), steps=steps)
    assert repr(steps) in str(error.value)


def test_unknown_reward_aggregation_is_a_value_error_listing_the_modes():
    with pytest.raises(ValueError, match="reward_aggregation") as error:
        ClosedLoopMultiAction(make_env("counting-v1", 1), RecordingController(), steps=2,
                              reward_aggregation="median")
    message = str(error.value)
    assert "'median'" in message
    assert all(mode in message for mode in MODES)


def test_multiaction_unknown_reward_aggregation_is_a_value_error():
    with pytest.raises(ValueError, match="reward_aggregation"):
        MultiAction(make_env("counting-v1", 1), reward_aggregation="max")


def test_multiaction_bad_replan_steps_is_a_value_error():
    with pytest.raises(ValueError, match="steps.*0"):
        MultiAction(make_env("counting-v1", 1), replan_steps=0)


@pytest.mark.parametrize("shape", [(2, 2), (2,), (3, 1), (2, 1, 1)])
def test_decision_of_the_wrong_shape_is_a_value_error_naming_both_shapes(shape):
    executor, controller = counting(2, 3)
    with pytest.raises(ValueError, match=r"decision must be \[2, 1\]") as error:
        executor.step(np.zeros(shape, np.float32))
    assert str(list(shape)) in str(error.value)
    assert controller.calls == 0  # nothing was executed


def test_action_chunk_of_the_wrong_shape_is_a_value_error():
    executor = MultiAction(make_env("counting-v1", 2))
    executor.reset()
    with pytest.raises(ValueError, match=r"action chunk must be \[2, H >= 1, 1\], got \[2, 3\]"):
        executor.step(np.zeros((2, 3), np.float32))


def test_an_empty_action_chunk_is_a_value_error():
    executor = MultiAction(make_env("counting-v1", 2))
    executor.reset()
    with pytest.raises(ValueError, match=r"action chunk must be \[2, H >= 1, 1\], got \[2, 0, 1\]"):
        executor.step(np.zeros((2, 0, 1), np.float32))


# --- MultiAction (open loop) ----------------------------------------------------------------------

def test_multiaction_executes_all_H_steps_of_the_chunk():
    executor = MultiAction(make_env("counting-v1", 1))
    executor.reset()
    obs, reward, terminated, _, info = executor.step(np.zeros((1, 3, 1), np.float32))
    assert state_of(obs) == [3.0] and not terminated[0]
    assert info["executed_steps"].tolist() == [3]


def test_multiaction_executes_at_most_replan_steps():
    executor = MultiAction(make_env("counting-v1", 1), replan_steps=2)
    executor.reset()
    obs, reward, *_, info = executor.step(np.zeros((1, 3, 1), np.float32))
    assert state_of(obs) == [2.0]
    assert info["executed_steps"].tolist() == [2]


def test_multiaction_rewards_are_summed():
    executor = MultiAction(make_env("counting-v1", 1))
    executor.reset()
    _, reward, *_ = executor.step(np.zeros((1, 3, 1), np.float32))
    assert reward.tolist() == [3.0]


def test_multiaction_stops_a_finished_env():
    executor = MultiAction(make_env("counting-v1", 2))
    executor.reset()
    obs, reward, terminated, truncated, info = executor.step(np.zeros((2, 7, 1), np.float32))
    assert info["executed_steps"].tolist() == [4, 5]
    assert state_of(obs) == [4.0, 5.0]
    assert reward.tolist() == [4.0, 5.0]
    assert terminated.tolist() == [True, True]


def test_multiaction_executes_the_chunks_actions_in_order():
    env, plain = make_env("dummy-v1", 2, seed=2), make_env("dummy-v1", 2, seed=2)
    executor = MultiAction(env)
    executor.reset(), plain.reset()
    chunk = np.array([[[0.5], [-1.0], [0.25]], [[-0.3], [0.9], [0.0]]], np.float32)
    obs, reward, *_, info = executor.step(chunk)
    assert info["executed_steps"].tolist() == [3, 3]
    plain_steps = [plain.step(chunk[:, t]) for t in range(3)]
    rewards = [step[1] for step in plain_steps]
    np.testing.assert_array_equal(obs["states"]["state"], plain_steps[-1][0]["states"]["state"])
    np.testing.assert_allclose(reward, np.sum(rewards, 0), rtol=1e-6)


def test_multiaction_reset_with_indices_returns_every_observation():
    executor = MultiAction(make_env("counting-v1", 2))
    executor.reset()
    executor.step(np.zeros((2, 2, 1), np.float32))
    obs = executor.reset(indices=[1])
    assert state_of(obs) == [2.0, 0.0]
    assert state_of(executor.obs) == [2.0, 0.0]


@pytest.mark.parametrize("mode", MODES)
def test_open_and_closed_loop_share_one_inner_loop(mode):
    # The same physical actions through MultiAction and ClosedLoopMultiAction give the same decision result.
    n, k = 3, 5
    open_loop = MultiAction(make_env("counting-v1", n), reward_aggregation=mode)
    closed_loop = ClosedLoopMultiAction(make_env("counting-v1", n), RecordingController(), steps=k,
                                        reward_aggregation=mode)
    open_loop.reset(), closed_loop.reset()
    for _ in range(2):
        a = open_loop.step(np.ones((n, k, 1), np.float32))
        b = closed_loop.step(ones(n))
        for x, y in zip(a[:4], b[:4]):
            np.testing.assert_array_equal(x["states"]["state"] if isinstance(x, dict) else x,
                                          y["states"]["state"] if isinstance(y, dict) else y)
        np.testing.assert_array_equal(a[4]["executed_steps"], b[4]["executed_steps"])
        done = np.flatnonzero(a[2] | a[3])
        open_loop.reset(done), closed_loop.reset(done)


# --- Connecting: the server's metadata checked against the environment ----------------------------

@pytest.mark.parametrize("policy, env_id, server_space, client_space", [
    (("categorical-policy", plugrl_min.CategoricalPolicyConfig()), "cartpole-v1", None, None),
    (("dummy-policy", plugrl_min.DummyPolicyConfig(obs_spec={"states": {"state": [[4], "float32"]}})), "cartpole-v1", "continuous, action_dim 1",
     "discrete, 2 actions"),
    (("categorical-policy", plugrl_min.CategoricalPolicyConfig(obs_spec={"states": {"state": [[3], "float32"]}})), "dummy-v1", "discrete, 2 actions",
     "continuous, action_dim 1"),
], ids=["fits", "continuous server, discrete client", "discrete server, continuous client"])
@wire
def test_a_client_whose_action_space_differs_stops_naming_both(tmp_path, capsys, policy, env_id, server_space,
                                                               client_space):
    async def script(port, server):
        return await env_client_in_process(env_id, "--server-port", port, "--num-episodes", "0")

    _, client_status = run_server(dummy_algo(make_policy(*policy), 50), tmp_path, script)
    err = capsys.readouterr().err
    if server_space is None:
        assert client_status == 0, err
        return
    assert client_status == 1
    message = err.strip().splitlines()[-1]
    assert f"the policy's actions are {server_space}, this client needs {client_space}" in message


class TwoKeys(plugrl_min.VecEnv):
    """An environment whose observations are a picture and a state (not registered)."""

    obs_spec = {"images": {"image": ((16, 16, 3), "uint8")}, "states": {"state": ((2,), "float32")}}

    def _reset(self, rows):
        pass

    def _observe(self):
        return observation(self.num_envs, states={"state": np.zeros((self.num_envs, 2), np.float32)},
                           images={"image": np.zeros((self.num_envs, 16, 16, 3), np.uint8)})


def test_a_client_that_gives_more_keys_than_the_policy_reads_fits_it():
    metadata = metadata_message(obs_spec={"states": {"state": [[2], "float32"]}})
    plugrl_min.check_metadata(metadata, MultiAction(TwoKeys(2)), closed_loop=False)  # the picture is extra


def test_a_client_that_lacks_a_key_the_policy_reads_stops_naming_it():
    metadata = metadata_message(obs_spec={"images": {"wrist": [[16, 16, 3], "uint8"]},
                                          "states": {"state": [[2], "float32"]}})
    with pytest.raises(plugrl_min.CommandError, match=r"observation images.wrist: the policy reads uint8 \[16, 16, 3\], "
                                                      r"this environment gives nothing"):
        plugrl_min.check_metadata(metadata, MultiAction(TwoKeys(2)), closed_loop=False)


def test_a_client_whose_observation_shape_differs_names_the_key_and_both_shapes():
    metadata = metadata_message(obs_spec={"images": {"image": [[16, 16, 3], "uint8"]},
                                          "states": {"state": [[3], "float32"]}})
    with pytest.raises(plugrl_min.CommandError, match=r"observation states.state: the policy reads float32 \[3\], this "
                                                      r"environment gives float32 \[2\]"):
        plugrl_min.check_metadata(metadata, MultiAction(TwoKeys(2)), closed_loop=False)


def plugrl_dummy_v1_observation(text) -> dict:
    """What PlugRL's own dummy-v1 client sends for one environment: two cameras, float64 states, text."""
    rng = np.random.default_rng(0)
    return {"images": {"base": rng.integers(0, 256, (1, 224, 224, 3), np.uint8),
                       "wrist": rng.integers(0, 256, (1, 112, 112, 3), np.uint8)},
            "states": {"robot_state": rng.standard_normal((1, 10)), "joint_angles": rng.standard_normal((1, 5))},
            "text": text}


@wire
def test_the_plugrl_dummy_v1_policy_answers_plugrl_dummy_v1s_observation_with_text_as_an_array_or_a_list(tmp_path):
    config = plugrl_min._POLICY_CONFIGS[("dummy-policy", "plugrl-dummy-v1")]
    algo = dummy_algo(make_policy("dummy-policy", config), 100)

    async def script(port, server):
        client = await Client.connect(port)
        replies = []
        for text in (np.array(["do something"]), ["do something"]):
            await client.ws.send(pack_message(infer_message([0], obs=plugrl_dummy_v1_observation(text))))
            replies.append(await client.receive())
            await client.ws.send(pack_message(feedback_message([0], obs=plugrl_dummy_v1_observation(text))))
        await client.close()
        return replies

    _, replies = run_server(algo, tmp_path, script)
    assert [actions_of(reply).shape for reply in replies] == [(1, 1, 7)] * 2


def test_a_policy_config_of_the_flat_form_is_one_line_showing_the_grouped_form():
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--in-process",
                              "--policy.obs-spec", '{"state": [[3], "float32"]}')
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "obs_spec {'state': [[3], 'float32']} is flat: PlugRL's observation groups its keys, " \
           "{'states': {'state': [[3], 'float32']}}" in err


class FlatEnv(plugrl_min.DummyEnv):
    """dummy-v1 as an environment written before observations were grouped."""

    obs_spec = {"state": ((3,), "float32")}


def test_an_environment_of_the_flat_form_breaks_no_run_that_does_not_use_it_and_is_one_line_when_used(tmp_path,
                                                                                                   monkeypatch):
    monkeypatch.setitem(plugrl_min.ENVIRONMENTS, "plugrl-test-flat-v0", FlatEnv)
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--in-process", "--algo.global-steps",
                              "50", "--run-dir", tmp_path / "run")
    assert status == 0, err
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--in-process", "--local-env",
                              "plugrl-test-flat-v0", "--run-dir", tmp_path / "flat")
    assert status == 2 and len(err.strip().splitlines()) == 1
    assert "error: environment plugrl-test-flat-v0: obs_spec {'state': ((3,), 'float32')} is flat" in err


# --- Connecting: a server not up yet, a server restarted ------------------------------------------

@wire
def test_env_client_waits_for_a_server_that_is_not_up_yet(tmp_path, capsys):
    port = reserve_port()

    async def main():
        client = asyncio.create_task(asyncio.to_thread(plugrl_min.env_client_main, [
            "dummy-v1", "--server-port", str(port), "--num-episodes", "2", "--connect-timeout", "30"]))
        await asyncio.sleep(1.5)  # no server yet: the client retries with backoff
        waited = not client.done()
        server = plugrl_min.Server(Probe(), str(tmp_path), ("dummy-policy", "probe"))
        run = asyncio.create_task(server.run("127.0.0.1", port))
        status = await asyncio.wait_for(client, 30)
        server.request_stop()
        await asyncio.wait_for(run, 15)
        return waited, status

    waited, status = asyncio.run(main())
    assert waited and status == 0
    assert "done | episodes 2 |" in capsys.readouterr().out


@wire
def test_env_client_gives_a_clear_error_when_no_server_comes_within_connect_timeout(capsys):
    port = reserve_port()
    started = time.monotonic()
    status = plugrl_min.env_client_main(["dummy-v1", "--server-port", str(port), "--connect-timeout", "1"])
    elapsed = time.monotonic() - started
    assert status != 0 and 1.0 <= elapsed < 15.0  # it gives up, well before --connect-timeout's default
    assert f"env-client: no server at ws://127.0.0.1:{port} after 1 s" in capsys.readouterr().err


@wire
def test_env_client_passes_on_a_bare_exit_status_unchanged(monkeypatch, capsys):
    def exit_3(*args):
        raise SystemExit(3)  # an exit status from a library or plug-in, not one of the client's own stops

    monkeypatch.setattr(plugrl_min, "make_env", exit_3)
    assert plugrl_min.main(["env-client", "dummy-v1"]) == 3
    assert capsys.readouterr().err == ""


@wire
def test_env_client_reconnects_after_a_server_restart_and_finishes(tmp_path, capsys):
    port = reserve_port()
    server_args = ["plugrl_min.py", "dummy-policy", "default", "dummy", "default", "--port", str(port),
                   "--algo.learn-every", "100", "--algo.global-steps", "1000000000", "--log-every", "1",
                   "--run-dir", str(tmp_path / "first")]
    # The client in a thread of this process. The first server, a process, dies of kill -9; the second serves
    # the same port in this process, until the client is done.
    client, statuses = in_a_thread(plugrl_min.env_client_main, env_client_args(
        port, "--num-episodes", "150", "--num-envs", "4", "--connect-timeout", "30")[2:])
    with Background(tmp_path, "first", server_args) as first:
        wait_for(lambda: metrics_lines(tmp_path / "first") >= 2 or first.proc.poll() is not None, 30,
                 "the first server's first 200 frames")
        first.proc.kill()  # kill -9, mid-run
        first.wait(10)
    alive_between = client.is_alive()
    config = plugrl_min.DummyAlgoConfig(global_steps=None, learn_every=100)
    os.makedirs(tmp_path / "second")
    second = plugrl_min.Server(make_algo("dummy", small_policy(), config), str(tmp_path / "second"),
                               ("dummy-policy", "dummy"), plugrl_min.ServerConfig(log_every=1))

    async def serve_until_the_client_is_done():
        run = asyncio.create_task(second.run("127.0.0.1", port))
        await asyncio.to_thread(client.join, 60)
        second.request_stop()
        return await asyncio.wait_for(run, 30)

    second_status = asyncio.run(serve_until_the_client_is_done())
    out, err = capsys.readouterr()
    assert alive_between and statuses == [0], out + err
    assert "reconnecting" in err
    assert int(re.search(r"done \| episodes (\d+)", out).group(1)) >= 150  # 4 envs may overshoot
    assert "refused" not in err  # the new server was never sent feedback for an action it did not give
    assert second_status == 0 and second.version >= 1 and metrics_lines(tmp_path / "second") >= 1, out


@pytest.mark.parametrize("flag", ["--num-envs", "--closed-loop-steps"])
@wire
def test_env_client_with_zero_environments_or_zero_closed_loop_steps_is_a_one_line_usage_error(flag):
    status, _, err = run_main("env-client", "dummy-v1", flag, "0")
    assert status == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1].endswith(
        "error: --num-envs and --closed-loop-steps must be at least 1, --num-episodes at least 0")


@wire
def test_a_client_that_stacks_observations_is_refused_when_it_starts_in_one_line(tmp_path):
    executor = MultiAction(make_env("dummy-v1", 2, seed=0), stack_observations=True)
    executor.reset()

    async def script(port, server):
        async with connect(f"ws://127.0.0.1:{port}") as ws:
            with pytest.raises(plugrl_min.CommandError) as stop:
                await plugrl_min.run_episodes(ws, executor, 1, {"returns": [], "env_steps": 0, "decisions": 0})
            return str(stop.value), server.frames

    _, (said, frames) = run_server(dummy_algo(small_policy(), 100), tmp_path / "run", script)
    assert frames == 0 and said == ("stack_observations gives a frame every physical step's observation, which a "
                                    "feedback message does not carry: leave it out over the wire")


def test_an_open_loop_multiaction_stacks_every_steps_observation_when_asked():
    executor = MultiAction(make_env("dummy-v1", 2, seed=0), stack_observations=True)
    executor.reset()
    obs, reward, *_ = executor.step(np.zeros((2, 3, 1), np.float32))  # a chunk of 3 actions
    assert obs["states"]["state"].shape == (2, 3, 3) and reward.shape == (2,)


# =============================================================================================
# 15. Command line: the server (POLICY VARIANT ALGO VARIANT), env-client and report
# =============================================================================================
# In this process (run_main) where no process of its own is needed: help and argument errors come
# before anything is built or served. Local env clients, plug-ins, and main() as a function.

# --- --help tells the truth -----------------------------------------------------------------------

def parsers_of_every_command(monkeypatch) -> dict:
    """The argparse parser each command builds, caught as it parses: {command: parser}."""
    caught = {}

    def catch(parser, args=None, namespace=None):
        command = parser.prog.split()[2]
        caught[command if command in ("env-client", "report", "eval") else "server"] = parser
        raise SystemExit(0)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", catch)
    for words in (["dummy-policy", "default", "pg", "default"], ["env-client", "dummy-v1"], ["report", "x"],
                  ["eval", "x"]):
        run_main(*words)
    return caught


@wire
def test_every_flag_with_a_default_says_it_in_its_help(monkeypatch):
    parsers = parsers_of_every_command(monkeypatch)
    assert sorted(parsers) == ["env-client", "eval", "report", "server"]
    def said(action):  # its own value, as the code sets it: "(default: 60)" for 60.0
        value = format(action.default, "g" if isinstance(action.default, float) else "")
        return re.search(rf"default: {re.escape(value)}\b", action.help or "")

    silent = [f"{command} {action.option_strings[0]}" for command, parser in parsers.items()
              for action in parser._actions if action.option_strings and action.default not in (None, False)
              and action.default is not argparse.SUPPRESS and not said(action)]
    assert silent == []


def test_the_feedback_timeout_is_60_seconds_by_default_as_plugrl_s_servers_wait(monkeypatch):
    server_flags = parsers_of_every_command(monkeypatch)["server"]
    assert plugrl_min.ServerConfig().feedback_timeout == server_flags.get_default("feedback_timeout") == 60.0


def test_help_lists_the_builtin_policy_and_algorithm():
    status, out, _ = run_main("--help")
    assert status == 0
    assert re.search(r"policies:.*\bdummy-policy\b", out), out
    assert re.search(r"algorithms:.*\bdummy\b", out), out


def test_help_after_an_incomplete_command_exits_0_and_a_missing_word_exits_2():
    status, out, err = run_main("dummy-policy", "--help")
    assert status == 0 and "policies:" in out, err
    assert run_main("dummy-policy")[0] == 2


@pytest.mark.parametrize("words", [["dummy-policy", "default", "no-such-algo", "default"],
                                   ["dummy-policy", "default", "dummy", "no-such-variant"]],
                         ids=["unknown uid", "unknown variant"])
def test_an_unknown_uid_or_variant_is_a_one_line_error_listing_the_known_ones(words):
    status, _, err = run_main(*words)
    assert status != 0
    (line,) = err.strip().splitlines()
    known = line.split("known: ", 1)[1]  # in this process, the uids the tests above registered are known too
    assert "no-such" in line and all(f"{uid} (default)" in known for uid in ("dummy", "pg", "sac")), err


def test_help_gives_each_config_flag_the_comment_on_its_field_as_its_meaning():
    status, out, _ = run_main("dummy-policy", "default", "pg", "default", "--help")
    text = " ".join(out.split())  # argparse wraps to the terminal's width
    assert status == 0
    assert "--algo.gae-lambda V GAE: 0 is the one-step TD error, 1 the Monte Carlo return (default: 0.95)" in text
    assert "--policy.hidden-size V the width of both hidden layers (default: 256)" in text


COMMENTED_CONFIG = '''
import dataclasses
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config


@register_algo_config("commented")
@dataclasses.dataclass
class CommentedConfig(DummyAlgoConfig):
    patience: int = 3  # learns without progress before the run gives up
'''


def test_a_plugins_config_comments_are_its_flags_help_too(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_commented", COMMENTED_CONFIG)
    status, out, _ = run_main("dummy-policy", "default", "commented", "default", "--help", "--plugin",
                              "plugrl_test_commented")
    text = " ".join(out.split())
    assert status == 0 and "--algo.patience V learns without progress before the run gives up (default: 3)" in text
    assert "--algo.learn-every V frames between learns (default: 1000)" in text  # the base's comment


@pytest.mark.parametrize("command, imports", [(["env-client", "--help"], False), (["report", "--help"], False),
                                              (["--help"], True)])
@wire
def test_only_the_server_command_imports_the_bundled_sac_example(monkeypatch, command, imports):
    calls = []
    monkeypatch.setattr(plugrl_min, "import_sac_example", lambda: calls.append(1))
    status, _, _ = run_main(*command)
    assert status == 0 and bool(calls) == imports


# --- The first errors a student meets say what to do ----------------------------------------------

def test_an_unknown_algorithm_names_plugin_as_the_likely_fix():
    status, _, err = run_main("dummy-policy", "default", "reinforce", "default")
    assert status == 2
    (line,) = err.strip().splitlines()
    assert "unknown algorithm 'reinforce'" in line and "--plugin MODULE" in line


ALGORITHM_WITHOUT_CONFIG = '''
from plugrl_min import DummyAlgorithm, register_algo


@register_algo("no-config")
class NoConfig(DummyAlgorithm):
    pass
'''


def test_a_plugin_with_an_algorithm_but_no_config_is_one_line_naming_what_to_register(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_no_config", ALGORITHM_WITHOUT_CONFIG)
    status, out, err = run_main("dummy-policy", "default", "no-config", "default", "--plugin", "plugrl_test_no_config")
    assert status == 2 and out == ""
    (line,) = err.splitlines()
    assert line.endswith("'no-config' is registered without a config: register one with "
                         "@register_algo_config('no-config')")


def test_plugin_given_as_a_file_name_says_to_drop_the_py(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "my_algo", "")
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--plugin", "my_algo.py")
    assert status != 0
    assert err.strip() == "error: --plugin takes a module name, not a file: --plugin my_algo"


CHECKS_ITS_CONFIG = '''
import dataclasses
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config


@register_algo_config("picky")
@dataclasses.dataclass
class PickyConfig(DummyAlgoConfig):
    rate: float = 0.1


@register_algo("picky")
class Picky(DummyAlgorithm):
    def __init__(self, config, policy):
        if not 0 < config.rate < 1:
            raise ValueError(f"rate must be in (0, 1), got {config.rate}")
        super().__init__(config=config, policy=policy)
'''


def test_an_error_building_the_algorithm_keeps_its_traceback_and_names_the_step(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_picky", CHECKS_ITS_CONFIG)
    status, _, err = run_main("dummy-policy", "default", "picky", "default", "--plugin", "plugrl_test_picky",
                              "--algo.rate", "2")
    assert status == 1
    lines = err.strip().splitlines()
    assert lines[0] == "Traceback (most recent call last):"
    assert "ValueError: rate must be in (0, 1), got 2.0" in lines
    assert lines[-1] == "error: building algorithm 'picky' from its config failed (the traceback above says why)"


@wire
def test_a_server_started_alone_says_how_to_start_a_client(tmp_path):
    with Background(tmp_path, "server", ["plugrl_min.py", "categorical-policy", "cartpole", "dummy", "default",
                                         "--port", "0", "--run-dir", str(tmp_path / "run")]) as server:
        port = server.port()
        wait_for(lambda: "--local-env-clients 1" in server.stdout(), 10, "the hint")
        out = server.stdout()
        command = re.search(r"^  (python plugrl_min\.py env-client .*)$", out, re.MULTILINE).group(1)
        assert command == (f"python plugrl_min.py env-client cartpole-v1 --server-port {port} --num-envs 1 "
                           "--num-episodes 0")  # 0: until the server ends the run
        status, _, err = run_main(*command.split()[2:-2], "--num-episodes", "2")  # as printed, shorter
    assert status == 0, err
    assert "or run this server with --local-env-clients 1 to do both in one command" in out


@pytest.mark.parametrize("algo, env_id", [("dummy", "dummy-v1"), ("sac", "pendulum-v1")])
@wire
def test_the_hint_to_start_a_client_names_the_algorithms_environment_and_the_api_key_flag(tmp_path, algo, env_id):
    command = ["plugrl_min.py", "dummy-policy", "default", algo, "default", "--port", "0", "--run-dir",
               str(tmp_path / "run"), "--api-key", "s3cret"]  # sac's example_env: the pendulum it learns
    with Background(tmp_path, "server", command) as server:
        port = server.port()
        wait_for(lambda: "another terminal" in server.stdout(), 30, "the hint")
    hint = server.stdout().split("another terminal with\n")[1].splitlines()[0]
    assert hint.startswith(f"  python plugrl_min.py env-client {env_id} --server-port {port} ")
    assert hint.endswith(" --api-key KEY") and "s3cret" not in server.stdout()


@wire
def test_an_unknown_environment_is_a_one_line_error_listing_the_registered_ones():
    status, _, err = run_main("env-client", "no-such-env-v0", "--connect-timeout", "1")
    assert status == 2
    (line,) = err.strip().splitlines()
    assert "unknown environment 'no-such-env-v0'" in line
    assert "dummy-v1, pendulum-v1, cartpole-v1, probe-v1, counting-v1, gym:ENV_ID" in line and "register_env" in line


def test_websockets_older_than_16_is_one_line_saying_which_version_is_needed(tmp_path):
    (tmp_path / "websockets").mkdir()  # 15 lacks Server.close(code, reason): every run would end in a TypeError
    (tmp_path / "websockets" / "__init__.py").write_text('__version__ = "15.0.1"\n')
    status = python("plugrl_min.py", "--help", pythonpath=tmp_path)
    assert status.returncode != 0 and status.stderr == (
        "error: plugrl_min needs websockets 16 or newer; this Python has 15.0.1: pip install -r requirements.txt\n")


# --- Local env clients: started with the server, watched, reaped ----------------------------------

BREAKS_AFTER_30_STEPS = '''
from plugrl_min import DummyEnv, register_env


@register_env("breaks-v0")
class Breaks(DummyEnv):
    steps = 0

    def _step(self, action, rows):
        self.steps += 1
        if self.steps > 30:
            raise ValueError("breaks-v0 broke at step 30")
        return super()._step(action, rows)
'''


def run_breaks_after_30_steps(tmp_path) -> tuple[int, str]:
    """A server whose local client's environment raises a ValueError at its 31st step: (status, stderr)."""
    write_plugin(tmp_path, "plugrl_test_breaks", BREAKS_AFTER_30_STEPS)
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--plugin", "plugrl_test_breaks",
                              "--local-env-clients", "1", "--local-env", "breaks-v0", "--run-dir", tmp_path / "run")
    return status, err


def test_a_local_client_that_exits_nonzero_stops_the_server_with_status_1_naming_it_and_its_error(
        tmp_path, plugins_in_process):
    status, err = run_breaks_after_30_steps(tmp_path)
    assert status == 1, err
    (line,) = [line for line in err.splitlines() if "local env client" in line]
    assert line.startswith("error: local env client 1 exited with status 1: ValueError: breaks-v0 broke at step 30")
    assert "env-client-1.log" in line
    assert checkpoint_steps(tmp_path / "run") == [30]  # the final checkpoint all the same


def test_a_value_error_from_an_environment_reaches_the_clients_log_with_its_traceback(tmp_path, plugins_in_process):
    status, err = run_breaks_after_30_steps(tmp_path)  # a ValueError is the user's bug, not a usage error
    log = (tmp_path / "run" / "env-client-1.log").read_text()
    assert status == 1, err
    assert "Traceback (most recent call last):" in log and 'raise ValueError("breaks-v0 broke at step 30")' in log
    assert log.rstrip().endswith("ValueError: breaks-v0 broke at step 30")


STOPS_IN_ONE_LINE_AT_STEP_30 = '''
import plugrl_min


@plugrl_min.register_env("stops-v0")
class Stops(plugrl_min.DummyEnv):
    steps = 0

    def _step(self, action, rows):
        self.steps += 1
        if self.steps > 30:
            raise plugrl_min.CommandError("stops-v0 lost its simulator at step 30")
        return super()._step(action, rows)
'''


def test_an_in_process_environments_one_line_failure_is_named_by_its_type_not_as_a_file_of_the_run(
        tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_stops", STOPS_IN_ONE_LINE_AT_STEP_30)
    status, out, err = run_main("dummy-policy", "default", "dummy", "default", "--plugin", "plugrl_test_stops",
                                "--in-process", "--local-env", "stops-v0", "--run-dir", tmp_path / "run")
    assert status == 1 and "error: stops-v0 lost its simulator at step 30" in err.splitlines()
    assert "server failed: CommandError: global step 30, 0 learns" in out.splitlines()
    assert "OSError" not in out + err


def test_local_clients_that_never_end_share_one_deadline_then_are_killed():
    hung = [subprocess.Popen(["sleep", "600"]) for _ in range(3)]  # clients deaf to the end of the run
    try:
        started = time.monotonic()
        plugrl_min.reap([(i, process, "") for i, process in enumerate(hung, 1)], 2.0)
        seconds = time.monotonic() - started
        statuses = [process.poll() for process in hung]
    finally:
        for process in hung:
            process.kill()
            process.wait()
    assert 2.0 <= seconds < 5.0 and statuses == [-signal.SIGKILL] * 3  # 2 s in all, not 2 s each (6 s)


@wire
def test_a_local_client_whose_log_cannot_be_read_still_stops_the_run_cleanly_naming_the_log(tmp_path, capsys):
    failed = subprocess.Popen(["false"])
    failed.wait()
    log = tmp_path / "gone" / "env-client-1.log"

    async def script(port, server):
        server.local_clients.append((1, failed, str(log)))
        return await feed(port)  # until the server closes the connection

    status, (_, closed) = run_server(Probe(), tmp_path / "run", script)
    err = capsys.readouterr().err
    assert status == 1 and closed == RUN_END, err
    assert (f"error: local env client 1 exited with status 1: (its log cannot be read: No such file or "
            f"directory) (its log: {log})") in err


def test_a_server_on_every_address_tells_its_local_clients_the_ipv4_port(tmp_path):
    status = subprocess.run(dummy_run_command("--run-dir", tmp_path / "run", "--host", "", "--api-key", "t"),
                            cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=180,
                            stdin=subprocess.DEVNULL)  # '' binds IPv4 and IPv6, each on a free port of its own
    assert status.returncode == 0, status.stderr
    assert checkpoint_steps(tmp_path / "run") == [2000]


# --- Plug-ins: found in the current folder, and by a renamed copy ---------------------------------

PLUGIN_BY_CWD = '''
import dataclasses
from {module} import DummyAlgorithm, DummyAlgoConfig, register_algo, register_algo_config

@register_algo_config("from-cwd")
@dataclasses.dataclass
class FromCwdConfig(DummyAlgoConfig):
    global_steps: int | None = 300
    learn_every: int = 100


@register_algo("from-cwd")
class FromCwd(DummyAlgorithm):
    pass
'''


def test_a_plugin_in_the_current_folder_is_found_when_the_script_runs_by_path(tmp_path):
    (tmp_path / "plugrl_test_cwd_algo.py").write_text(PLUGIN_BY_CWD.format(module="plugrl_min"))
    status = subprocess.run([sys.executable, SOURCE, "dummy-policy", "default", "from-cwd", "default", "--plugin",
                             "plugrl_test_cwd_algo", "--local-env-clients", "1", "--run-dir", "run"], cwd=tmp_path,
                            env=subprocess_env(), capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert status.returncode == 0, status.stderr
    assert "run finished: global step 300" in status.stdout


def test_a_renamed_copy_serves_a_plugin_that_imports_it_by_its_new_name(tmp_path):
    shutil.copy(SOURCE, tmp_path / "rl_server.py")
    (tmp_path / "plugrl_test_renamed_algo.py").write_text(PLUGIN_BY_CWD.format(module="rl_server"))
    status = subprocess.run([sys.executable, "rl_server.py", "dummy-policy", "default", "from-cwd", "default",
                             "--plugin", "plugrl_test_renamed_algo", "--local-env-clients", "1", "--run-dir", "run"],
                            cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert status.returncode == 0, status.stderr
    assert "run finished: global step 300" in status.stdout


# --- A seed, planted anywhere: a copy in a package, a renamed copy, and how each runs -------------

LINE_ENV = '''
import numpy as np
from {framework} import VecEnv, observation, register_env


@register_env("plugrl-test-line-v0")
class Line(VecEnv):
    action_dim, max_steps = 1, 20

    def __init__(self, num_envs, seed=None):
        self.x = np.zeros(num_envs)
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.x[rows] = self.rng.uniform(-1, 1, len(rows))

    def _step(self, action, rows):
        self.x[rows] += 0.1 * np.clip(action[:, 0], -1, 1)
        return -np.abs(self.x[rows]), np.abs(self.x[rows]) < 0.05, np.abs(self.x[rows]) < 0.05

    def _observe(self):
        return observation(self.num_envs, states={{"state": np.stack([self.x, self.x, -self.x], axis=1).astype(np.float32)}})
'''


def plant(tmp_path, layout: str) -> tuple[str, str, str]:
    """plugrl_min.py and sac_example.py copied as a user copies them, with a plug-in environment that imports
    the framework by the copy's own name: (the file's path, its module name, the plug-in's module name)."""
    if layout == "package":  # myproj/rl/plugrl_min.py, and a plug-in in myproj/plugins/ importing it by path
        for folder in ("myproj", "myproj/rl", "myproj/plugins"):
            (tmp_path / folder).mkdir()
            (tmp_path / folder / "__init__.py").write_text("")
        target, module, plugin = tmp_path / "myproj" / "rl" / "plugrl_min.py", "myproj.rl.plugrl_min", "myproj.plugins.line"
    else:  # rl_server.py beside the project's own modules
        target, module, plugin = tmp_path / "rl_server.py", "rl_server", "plugrl_test_line"
    shutil.copy(SOURCE, target)
    shutil.copy(os.path.join(HERE, "sac_example.py"), target.parent / "sac_example.py")
    (tmp_path / (plugin.replace(".", "/") + ".py")).write_text(LINE_ENV.format(framework=module))
    return str(target), module, plugin


def planted_runs(plugin: str, run_dir) -> list[list[str]]:
    """A short pg on the plug-in's environment, and a short sac on pendulum-v1, each with a local client."""
    return [["dummy-policy", "default", "pg", "default", "--plugin", plugin, "--local-env", "plugrl-test-line-v0",
             "--local-env-clients", "1", "--local-num-envs", "4", "--algo.global-steps", "400",
             "--algo.frames-per-learn", "100", "--run-dir", str(run_dir / "pg")],
            ["dummy-policy", "default", "sac", "default", "--local-env-clients", "1", "--algo.global-steps", "300",
             "--algo.learning-starts", "200", "--algo.batch-size", "32", "--run-dir", str(run_dir / "sac")]]


@pytest.mark.parametrize("layout, way", [("package", "script"), ("package", "-m"), ("package", "main"),
                                         ("renamed", "script"), ("renamed", "main")])
def test_a_copy_in_a_package_or_renamed_runs_pg_and_sac_end_to_end(tmp_path, layout, way):
    path, module, plugin = plant(tmp_path, layout)
    elsewhere = tmp_path / "elsewhere"  # main([...]) from a program in another folder, its sys.path set by hand
    elsewhere.mkdir()
    for words in planted_runs(plugin, tmp_path / "runs"):
        if way == "main":
            program = (f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import {module} as framework; "
                       "sys.exit(framework.main(sys.argv[1:]))")
            command, cwd = ["-c", program, *words], elsewhere
        else:
            command, cwd = (["-m", module] if way == "-m" else [path]) + words, tmp_path
        result = subprocess.run([sys.executable, *command], cwd=cwd, env=subprocess_env(), capture_output=True,
                                text=True, timeout=180, stdin=subprocess.DEVNULL)
        assert result.returncode == 0, result.stderr[-3000:]
        steps = words[words.index("--algo.global-steps") + 1]
        assert f"run finished: global step {steps}" in result.stdout


def test_a_plugin_importing_the_package_path_or_plugrl_min_registers_in_the_one_copy(tmp_path):
    plant(tmp_path, "package")
    (tmp_path / "plugrl_test_by_name.py").write_text(  # the README's spelling: from plugrl_min import ...
        LINE_ENV.format(framework="plugrl_min").replace("plugrl-test-line-v0", "plugrl-test-by-name-v0"))
    program = ("from myproj.rl import plugrl_min as framework; import myproj.plugins.line, plugrl_test_by_name, sys; "
               "print(sorted(set(framework.ENVIRONMENTS) & {'plugrl-test-line-v0', 'plugrl-test-by-name-v0'}), "
               "sys.modules['plugrl_min'] is framework)")
    result = subprocess.run([sys.executable, "-c", program], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                            text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert result.stdout.split() == ["['plugrl-test-by-name-v0',", "'plugrl-test-line-v0']", "True"], result.stderr


def test_importing_it_beside_an_old_websockets_raises_an_import_error_with_the_one_line(tmp_path):
    (tmp_path / "websockets").mkdir()
    (tmp_path / "websockets" / "__init__.py").write_text('__version__ = "15.0.1"\n')
    program = "\n".join(["try:", "    import plugrl_min", "except ImportError as error:",
                          "    print('ImportError:', error)", "print('the program goes on')"])
    result = python("-c", program, pythonpath=tmp_path)
    assert result.returncode == 0 and result.stdout.splitlines() == [
        "ImportError: plugrl_min needs websockets 16 or newer; this Python has 15.0.1: pip install -r requirements.txt",
        "the program goes on"], result.stderr


def test_sac_with_a_discrete_policy_is_refused_before_serving_in_one_line_naming_dummy_policy(tmp_path):
    status, out, err = run_main("categorical-policy", "cartpole", "sac", "default", "--local-env", "cartpole-v1",
                                "--local-env-clients", "1", "--run-dir", tmp_path / "run")
    assert status == 2 and "listening" not in out and not (tmp_path / "run").exists()
    assert err.strip().splitlines() == ["error: sac trains continuous actions through the policy's sample(obs), "
                                        "which CategoricalPolicy lacks: serve dummy-policy"]


BREAKS_WITH_TWO_ENVIRONMENTS = '''
from plugrl_min import DummyEnv, register_env


@register_env("plugrl-test-not-two-v0")
class NotTwo(DummyEnv):
    def __init__(self, num_envs, seed=None):
        if num_envs == 2:  # the server makes one to size its policy; the local client's two fail
            raise RuntimeError("two environments are one too many")
        super().__init__(num_envs, seed)
'''


def test_a_start_that_fails_leaves_the_run_directory_as_it_found_it_and_the_same_command_runs_once_fixed(
        tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_not_two", BREAKS_WITH_TWO_ENVIRONMENTS)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("the user's own")
    words = ["dummy-policy", "default", "dummy", "default", "--plugin", "plugrl_test_not_two", "--local-env",
             "plugrl-test-not-two-v0", "--local-env-clients", "1", "--algo.global-steps", "300", "--run-dir", run_dir]
    status, out, err = run_main(*words, "--local-num-envs", "2")
    assert status == 1 and "RuntimeError: two environments are one too many" in err  # the client's log, printed
    assert os.listdir(run_dir) == ["notes.txt"] and f"the run directory {run_dir} is as it was" in out
    status, out, err = run_main(*words, "--local-num-envs", "1")
    assert status == 0, err
    assert checkpoint_steps(run_dir) == [300] and (run_dir / "notes.txt").read_text() == "the user's own"


GYM_IN_THE_SCRIPT = '''
import sys
import gymnasium
import plugrl_min
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class InTheScript(CartPoleEnv):
    pass


gymnasium.register("PlugrlInTheScript-v0", entry_point=InTheScript, max_episode_steps=50)
sys.exit(plugrl_min.main(["categorical-policy", "default", "pg", "default", "--local-env",
                          "gym:PlugrlInTheScript-v0", "--local-env-clients", "1", "--run-dir", sys.argv[1]]))
'''


def test_a_gym_environment_registered_in_the_starting_script_is_refused_saying_where_to_register_it(tmp_path):
    gymnasium_or_skip()
    (tmp_path / "train.py").write_text(GYM_IN_THE_SCRIPT)
    result = subprocess.run([sys.executable, "train.py", str(tmp_path / "run")], cwd=tmp_path,
                            env=subprocess_env(HERE), capture_output=True, text=True, timeout=120,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 2 and "listening" not in result.stdout and not (tmp_path / "run").exists()
    assert result.stderr.strip().splitlines()[-1] == (
        "error: environment 'gym:PlugrlInTheScript-v0' is defined in __main__, which the --local-env-clients "
        "processes cannot import: define it in a module and add --plugin MODULE (gym:MODULE:ID for a Gymnasium one)")


# --- main(): a function that returns the status ---------------------------------------------------

def test_main_in_a_plain_script_returns_the_status_twice_and_gives_the_signals_back(tmp_path):
    runs = [notebook_words(tmp_path / run, 4096) for run in "ab"]
    script = "\n".join([f"import signal, sys; sys.path.insert(0, {HERE!r}); import plugrl_min",
                        "before = signal.getsignal(signal.SIGINT)",
                        f"for words in {runs!r}:",
                        "    print('status', plugrl_min.main(words))",
                        "print('Ctrl-C is the script', signal.getsignal(signal.SIGINT) is before)"])
    result = python("-c", script, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("status 0") == 2 and "Ctrl-C is the script True" in result.stdout
    assert all(plugrl_min.checkpoint_paths(tmp_path / run) for run in "ab")


# --- The built-in policies sized from the environment the server knows --------------------------

WIDE_ENVS = '''
import numpy as np
from plugrl_min import (BaseAlgoConfig, DummyAlgorithm, DummyEnv, VecEnv, observation, register_algo,
                        register_algo_config, register_env)


@register_env("wide-v0")
class Wide(DummyEnv):
    """dummy-v1's point, seen as 5 numbers and pushed by 2."""
    obs_spec, action_dim = {"states": {"state": ((5,), "float32")}}, 2

    def _observe(self):
        state = super()._observe()["states"]["state"]
        return observation(self.num_envs, states={"state": np.concatenate([state, state[:, :2]], axis=1)})


@register_env("three-choices-v0")
class ThreeChoices(VecEnv):
    obs_spec, num_actions, max_steps = {"states": {"state": ((6,), "float32")}}, 3, 10

    def _reset(self, rows):
        pass

    def _step(self, action, rows):
        return np.zeros(len(rows)), np.zeros(len(rows), bool), np.zeros(len(rows), bool)

    def _observe(self):
        return observation(self.num_envs, states={"state": np.zeros((self.num_envs, 6), np.float32)})


@register_algo_config("wide-example")
class WideConfig(BaseAlgoConfig):
    global_steps: int = 100


@register_algo("wide-example")
class WideExample(DummyAlgorithm):
    example_env = "wide-v0"  # what the server sizes a built-in policy from, without --local-env
'''


def policy_served(monkeypatch, *words) -> plugrl_min.BaseTorchPolicy:
    """The policy a server command would serve (Server.run replaced: nothing is served or written)."""
    served = {}

    async def run(self, host, port, on_listening=None):
        served["policy"] = self.algo.policy
        return 0

    monkeypatch.setattr(plugrl_min.Server, "run", run)
    status, _, err = run_main(*words)
    assert status == 0, err
    return served["policy"]


def test_a_builtin_policy_takes_its_observation_and_action_sizes_from_the_local_env(
        tmp_path, plugins_in_process, monkeypatch):
    write_plugin(tmp_path, "plugrl_test_wide", WIDE_ENVS)
    policy = policy_served(monkeypatch, "dummy-policy", "default", "dummy", "default", "--plugin", "plugrl_test_wide",
                           "--local-env", "wide-v0", "--run-dir", tmp_path / "run")
    assert policy.obs_spec == plugrl_min.obs_spec_of({"states": {"state": ((5,), "float32")}}) and policy.action_dim == 2


def test_the_algorithms_example_env_sizes_the_policy_when_no_local_env_is_named(tmp_path, plugins_in_process,
                                                                                 monkeypatch):
    write_plugin(tmp_path, "plugrl_test_wide", WIDE_ENVS)
    policy = policy_served(monkeypatch, "dummy-policy", "default", "wide-example", "default", "--plugin",
                           "plugrl_test_wide", "--run-dir", tmp_path / "run")
    assert policy.obs_spec == plugrl_min.obs_spec_of({"states": {"state": ((5,), "float32")}}) and policy.action_dim == 2


def test_a_categorical_policy_takes_its_number_of_actions_from_a_discrete_env(tmp_path, plugins_in_process,
                                                                             monkeypatch):
    write_plugin(tmp_path, "plugrl_test_wide", WIDE_ENVS)
    policy = policy_served(monkeypatch, "categorical-policy", "default", "pg", "default", "--plugin",
                           "plugrl_test_wide", "--local-env", "three-choices-v0", "--run-dir", tmp_path / "run")
    assert policy.obs_spec == plugrl_min.obs_spec_of({"states": {"state": ((6,), "float32")}}) and policy.num_actions == 3


def test_a_size_given_as_a_flag_wins_over_the_environments(tmp_path, plugins_in_process, monkeypatch):
    write_plugin(tmp_path, "plugrl_test_wide", WIDE_ENVS)
    policy = policy_served(monkeypatch, "dummy-policy", "default", "dummy", "default", "--plugin", "plugrl_test_wide",
                           "--local-env", "wide-v0", "--policy.action-dim", "3", "--run-dir", tmp_path / "run")
    assert policy.obs_spec == plugrl_min.obs_spec_of({"states": {"state": ((5,), "float32")}}) and policy.action_dim == 3


def test_a_policy_that_does_not_fit_its_local_env_names_the_flag_that_would_fit_it(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_wide", WIDE_ENVS)
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--plugin", "plugrl_test_wide",
                              "--local-env", "wide-v0", "--policy.action-dim", "3", "--local-env-clients", "1",
                              "--run-dir", tmp_path / "run")
    assert status == 2 and err.strip().endswith(
        "the policy's actions are continuous, action_dim 3, this client needs continuous, action_dim 2 "
        "(serve with --policy.action-dim 2)")
    assert not (tmp_path / "run").exists()


def test_a_client_whose_observation_differs_is_told_the_obs_spec_flag_that_fits_it():
    meta = plugrl_min.metadata_of(small_policy(), plugrl_min.obs_spec_of(small_policy().obs_spec), ("d", "d"))
    problem = plugrl_min.misfit(meta["data"], plugrl_min.CartPoleEnv)
    assert problem.startswith("observation states.state: the policy reads float32 [3], this environment gives float32 [4]")
    assert problem.endswith("""--policy.obs-spec '{"states": {"state": [[4], "float32"]}}')""")


def test_a_continuous_policy_for_a_discrete_env_is_told_to_serve_categorical_policy():
    meta = plugrl_min.metadata_of(small_policy(), plugrl_min.obs_spec_of({"states": {"state": ((4,), "float32")}}), ("d", "d"))
    assert plugrl_min.misfit(meta["data"], plugrl_min.CartPoleEnv).endswith(
        "this client needs discrete, 2 actions (serve categorical-policy)")


def test_a_policy_obs_spec_that_is_not_a_json_object_is_a_usage_error(capsys):
    assert plugrl_min.main(["dummy-policy", "default", "dummy", "default", "--policy.obs-spec", "3"]) == 2
    assert "--policy.obs-spec: expected a JSON object" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["[1, 2]", "{not json"])
@wire
def test_env_kwargs_that_are_not_a_json_object_are_a_usage_error(text, capsys):
    assert plugrl_min.main(["env-client", "dummy-v1", "--env-kwargs", text]) == 2
    assert "--env-kwargs" in capsys.readouterr().err


def test_the_servers_env_kwargs_reach_its_local_clients_environments(tmp_path, plugins_in_process, monkeypatch):
    write_plugin(tmp_path, "plugrl_test_kwargs", MY_ENV.replace("def __init__(self, num_envs, seed=None):",
                                                                "def __init__(self, num_envs, seed=None, length=20):")
                 .replace("        self.x = np.zeros(num_envs)", "        self.x, self.max_steps = np.zeros(num_envs), length"))
    monkeypatch.setenv("PYTHONPATH", subprocess_env(tmp_path)["PYTHONPATH"])  # where the local client finds it
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--plugin", "plugrl_test_kwargs",
                              "--local-env", "my-line-v0", "--env-kwargs", '{"length": 7}', "--local-env-clients", "1",
                              "--port", "0", "--algo.global-steps", "60", "--run-dir", tmp_path / "run")
    assert status == 0, err
    assert read_metrics(tmp_path / "run", event="end")[0]["rollout/length"] == 7  # a truncation after 7, not 20
    assert json.loads((tmp_path / "run" / "config.json").read_text())["env_kwargs"] == {"length": 7}


# =============================================================================================
# [learn-threads] How many torch threads a learn gets: one per core that other processes leave idle
# =============================================================================================
# LearnThreads's decision on made-up measurements, then a real neighbour, /proc/stat, a pinned process.

@pytest.fixture
def two_cores(monkeypatch):
    """A machine of two cores, as LearnThreads sees it: this process's affinity and torch's count.
    A learn sets the torch count of the thread it runs in: put the test's count back."""
    monkeypatch.setattr(plugrl_min, "CORES", [0, 1])
    monkeypatch.setattr(plugrl_min, "TORCH_THREADS", 2)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def decided(threads: plugrl_min.LearnThreads, busy: float, own: float, seconds: float = 1.0) -> int:
    """The count after `seconds` of learns during which the cores were busy for `busy` CPU seconds,
    `own` of them this process's."""
    threads.busy, threads.own, threads.seconds = busy, own, seconds
    threads.decide()
    return threads.count


def test_learns_take_every_core_while_no_other_process_keeps_one_busy(two_cores, capsys):
    threads = plugrl_min.LearnThreads(None)
    assert threads.count == 2
    assert decided(threads, busy=1.9, own=1.85) == 2  # the learn's own two threads, and a little else
    assert capsys.readouterr().err == ""


def test_learns_take_one_thread_while_another_process_keeps_a_core_busy_and_say_nothing_of_it(
        two_cores, capsys):
    threads = plugrl_min.LearnThreads(None)
    assert decided(threads, busy=2.0, own=1.0) == 1
    assert decided(threads, busy=1.6, own=0.9) == 1  # 0.7 of a core taken: the rounding keeps one
    assert capsys.readouterr().err == ""  # the progress line shows the count; nothing alarms
    assert decided(threads, busy=1.0, own=0.95) == 2  # the neighbour is gone: every core again


def test_the_serving_thread_is_on_one_torch_thread_before_any_network_is_built(monkeypatch, tmp_path):
    # Pinned only after the networks were built on two threads, sac's two-thread learns took 1.4x as long.
    seen = []

    def build_algorithm(*args):
        seen.append(torch.get_num_threads())
        raise SystemExit(0)

    monkeypatch.setattr(plugrl_min, "build_algorithm", build_algorithm)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        plugrl_min.main(["dummy-policy", "default", "dummy", "default", "--run-dir", str(tmp_path / "run")])
    finally:
        torch.set_num_threads(threads)
    assert seen == [1]


def test_a_fixed_learn_thread_count_is_kept_and_nothing_is_measured(two_cores):
    threads = plugrl_min.LearnThreads(1)
    seen = []
    learn = threads.around(lambda: seen.append(torch.get_num_threads()) or (0, {}))
    with concurrent.futures.ThreadPoolExecutor(1) as learn_thread:  # as the server's learns run
        for _ in range(3):
            learn_thread.submit(torch.set_num_threads, 2).result(10)  # whatever it was before
            assert learn_thread.submit(learn).result(10) == (0, {})
    assert seen == [1, 1, 1] and threads.count == 1 and threads.seconds == 0.0


def pinned_to(core: int):
    """preexec_fn of a child that may run on this one core only (as under taskset -c CORE)."""
    return lambda: os.sched_setaffinity(0, {core})


@pytest.mark.skipif(not os.path.exists("/proc/stat") or len(os.sched_getaffinity(0)) < 2
                    or plugrl_min.TORCH_THREADS < 2, reason="needs /proc/stat and two cores for torch")
def test_learns_beside_a_process_that_keeps_a_core_busy_move_to_fewer_threads(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda count: None)  # this test's threads stay as they are
    threads = plugrl_min.LearnThreads(None)
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"],
                               preexec_fn=pinned_to(max(os.sched_getaffinity(0))))
    try:
        learn = threads.around(lambda: sum(range(200_000)))  # CPU work on one thread
        deadline = time.monotonic() + 60
        while threads.count == threads.most:  # a decision every second of learning
            learn()
            assert time.monotonic() < deadline, "no decision came"
    finally:
        spinner.kill()
        spinner.wait()
    assert threads.count < threads.most


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat on this system")
def test_busy_seconds_count_only_this_processs_cores_and_a_core_kept_busy_counts_all_its_time(monkeypatch):
    core = min(os.sched_getaffinity(0))
    monkeypatch.setattr(plugrl_min, "CORES", [core])
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pinned_to(core))
    try:
        time.sleep(0.2)  # the spinner is up
        started, before = time.monotonic(), plugrl_min.busy_seconds()
        time.sleep(3.0)  # a stall of this process between its two readings skews them: 3 s keeps it small
        busy, elapsed = plugrl_min.busy_seconds() - before, time.monotonic() - started
    finally:
        spinner.kill()
        spinner.wait()
    assert 0.8 * elapsed <= busy <= 1.2 * elapsed, (busy, elapsed)  # one core's time, not two


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this system")
def test_a_server_pinned_to_one_core_learns_on_one_thread_though_torch_would_use_two(tmp_path):
    script = ("import torch, plugrl_min\n"
              "print(torch.get_num_threads(), plugrl_min.LearnThreads(None).count)")
    result = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                            env={**subprocess_env(HERE), "OMP_NUM_THREADS": "2"}, timeout=60,
                            preexec_fn=pinned_to(min(os.sched_getaffinity(0))))
    assert result.stdout.split() == ["2", "1"], result.stdout + result.stderr  # torch's 2: one core


# =============================================================================================
# [ranks] Several learners: the ranks of a torch.distributed launch
# =============================================================================================
# DDPAlgorithm on real ranks, launched by torch.distributed.run: rank 0 serves and learns, every other
# rank learns only; a launch stops, resumes and fails as one run.

RANK_EXITS = '''
"""Runs plugrl_min.py as its rank of a launch, and writes the rank's exit status to $RANK_EXITS."""
import os, runpy, sys
status = 0
try:
    runpy.run_path(os.environ["PLUGRL_MIN"], run_name="__main__")
except SystemExit as exit:
    status = exit.code if isinstance(exit.code, int) else 1
    raise
finally:
    with open(os.path.join(os.environ["RANK_EXITS"], "rank" + os.environ["RANK"]), "w") as file:
        file.write(str(status))
'''


def launch(tmp_path, name, *args, pythonpath=None, node=None, cwd=HERE, **env) -> subprocess.Popen:
    """`python -m torch.distributed.run --standalone --nproc-per-node 2 plugrl_min.py ARGS`, in a session of its
    own, its output in tmp_path/NAME.out; each rank's exit status lands in tmp_path/NAME-exits/. With
    node=(node rank, master port), the launcher of one machine of two, one rank each, as README.md shows."""
    exits = tmp_path / f"{name}-exits"
    exits.mkdir(exist_ok=True)
    (tmp_path / "rank_exits.py").write_text(RANK_EXITS)
    paths = os.pathsep.join(filter(None, [str(pythonpath or ""), HERE]))  # plug-ins, and sac_example
    child_env = {**subprocess_env(paths), "RANK_EXITS": str(exits), "PLUGRL_MIN": SOURCE, **env}
    where = ["--standalone", "--nproc-per-node", "2"] if node is None else [
        "--nnodes", "2", "--node-rank", str(node[0]), "--nproc-per-node", "1", "--master-addr", "127.0.0.1",
        "--master-port", str(node[1])]
    with open(tmp_path / f"{name}.out", "w") as out:
        return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *where,
                                 str(tmp_path / "rank_exits.py"), *args], cwd=cwd, env=child_env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)


def rank_exits(tmp_path, name) -> dict:
    return {path.name: int(path.read_text()) for path in sorted((tmp_path / f"{name}-exits").iterdir())}


def finish(process, timeout) -> int:
    try:
        return process.wait(timeout)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


PG_ONE_LEARN = '''
"""One learn of pg on a batch of 64 frames, on one process or on the ranks of a launch."""
import atexit, os, sys
import numpy as np, torch
import plugrl_min
from torch.nn.parallel import DistributedDataParallel

out, rank, ranks = sys.argv[1], int(os.environ.get("RANK", "0")), None
torch.manual_seed(0)
policy = plugrl_min.make_policy("dummy-policy", plugrl_min.DummyPolicyConfig(hidden_size=16))
algo = plugrl_min.make_algo("pg", policy, plugrl_min.PGConfig(frames_per_learn=64))
algo.init_optimizers()
before = {key: value.clone() for key, value in policy.state_dict().items()}
if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # as server_main does
    torch.distributed.init_process_group("gloo")
    atexit.register(torch.distributed.destroy_process_group)  # left to exit, gloo can abort (SIGABRT)
    ranks = plugrl_min.Ranks()
    algo.activate_ddp(DistributedDataParallel(policy))
if rank == 0:  # the server stores 64 frames of 4 environments, chained by prev_node, then learns
    rng, nodes = np.random.default_rng(1), {}
    for i in range(64):
        nodes[i % 4], _, _ = algo.feedback(
            obs={"images": {}, "states": {"state": rng.standard_normal(3, np.float32)}, "text": ""}, runtime_state=None,
            train_state={"sample": rng.standard_normal(1, np.float32)}, terminated=False, truncated=False,
            next_obs={"images": {}, "states": {"state": rng.standard_normal(3, np.float32)}, "text": ""},
            reward=float(rng.standard_normal()), info={},
            next_terminated=i % 13 == 12, next_truncated=False, prev_node=nodes.get(i % 4, (-1, "")))
    learn = plugrl_min.in_step(ranks, algo, algo.learn)  # as Server.learn_once does
    algo.pre_learn()
    learn()
    algo.post_learn()
    if ranks is not None:
        ranks.broadcast({"order": "stop"})
else:
    plugrl_min.serve_as_learner(algo, ranks)
torch.save({"before": before, "policy": policy.state_dict(), "value": algo.value.state_dict()},
           os.path.join(out, f"rank{rank}.pt"))
'''


def test_one_learn_of_pg_on_two_ranks_leaves_the_weights_of_one_learn_on_one_process(tmp_path):
    script = tmp_path / "pg_one_learn.py"
    script.write_text(PG_ONE_LEARN)
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    one = subprocess.Popen([sys.executable, str(script), str(tmp_path / "one")], cwd=HERE, env=subprocess_env(HERE))
    two = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                            str(script), str(tmp_path / "two")], cwd=HERE, env=subprocess_env(HERE))
    assert finish(one, 120) == 0 and finish(two, 120) == 0
    alone = torch.load(tmp_path / "one" / "rank0.pt", weights_only=True)
    assert not torch.equal(alone["before"]["head.weight"], alone["policy"]["head.weight"])  # it learned
    for rank in (0, 1):
        learned = torch.load(tmp_path / "two" / f"rank{rank}.pt", weights_only=True)
        for part in ("policy", "value"):
            for key, weight in alone[part].items():
                torch.testing.assert_close(learned[part][key], weight, rtol=1e-5, atol=1e-6, msg=f"{rank} {key}")


RECORDED_PG = '''
"""pg, writing every distributed hook it is called with to $CALLS/rankR.jsonl."""
import dataclasses, json, os
from plugrl_min import PG, PGConfig, register_algo, register_algo_config


@register_algo_config("recorded-pg")
@dataclasses.dataclass
class RecordedPGConfig(PGConfig):
    pass


@register_algo("recorded-pg")
class RecordedPG(PG):
    def record(self, hook, **details):
        with open(os.path.join(os.environ["CALLS"], "rank" + os.environ.get("RANK", "0") + ".jsonl"), "a") as file:
            file.write(json.dumps({"hook": hook, **details}) + "\\n")

    def activate_ddp(self, ddp_policy):
        self.record("activate_ddp", wrapper=type(ddp_policy).__name__)
        super().activate_ddp(ddp_policy)

    def get_server_data(self):
        self.record("get_server_data", global_step=self.global_step)
        return super().get_server_data()

    def load_server_data(self, global_step, meta_info, data):
        self.record("load_server_data", global_step=global_step)
        super().load_server_data(global_step, meta_info, data)

    def load_checkpoint(self, checkpoint):
        self.record("load_checkpoint", step=checkpoint.step)
        super().load_checkpoint(checkpoint)

    def load_learner_state(self, checkpoint):
        self.record("load_learner_state", step=checkpoint.step)
        super().load_learner_state(checkpoint)

    def learn_impl(self):
        self.record("learn", global_step=self.global_step)
        return super().learn_impl()

    def create_ddp_checkpoint(self):
        self.record("create_ddp_checkpoint", global_step=self.global_step)
        return super().create_ddp_checkpoint()
'''

STOPPED_AFTER_LEARNS = 12
TWO_RANK_STEPS = 32 * 1024  # pg's default batches; seed 1 is past -2 by 20,000 frames


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """recorded-pg (pg that records its distributed hooks) on dummy-v1 under two ranks and one local
    client: SIGTERM to the launcher after 12 learns, then --resume to 32,768 steps under two launchers, as on
    two machines (README.md's commands): rank 1's in a folder of its own, where it writes nothing."""
    with deadline_of("the two-rank runs", 600):  # every launch below is killed on the way out
        tmp_path = tmp_path_factory.mktemp("two-ranks")
        write_plugin(tmp_path, "plugrl_test_recorded_pg", RECORDED_PG)
        calls = tmp_path / "calls"
        calls.mkdir()
        run_dir = tmp_path / "run"
        words = ["dummy-policy", "default", "recorded-pg", "default", "--plugin", "plugrl_test_recorded_pg", "--local-env-clients",
                 "1", "--local-num-envs", "16", "--seed", "1", "--algo.global-steps", str(TWO_RANK_STEPS), "--algo.save-every", "8",
                 "--log-every", "1", "--port", "0", "--run-dir", str(run_dir)]
        first = launch(tmp_path, "first", *words, pythonpath=tmp_path, CALLS=str(calls))
        try:
            wait_for(lambda: metrics_lines(run_dir) >= STOPPED_AFTER_LEARNS or first.poll() is not None, 180,
                     "the first learns on two ranks")
            stopped_at = metrics_lines(run_dir)
            first.send_signal(signal.SIGTERM)  # to the launcher, which passes it on to every rank
        finally:
            first_status = finish(first, 90)
        steps_before = checkpoint_steps(run_dir)
        master_port, rank_1_folder = reserve_port(), tmp_path / "machine-2"
        rank_1_folder.mkdir()
        second = launch(tmp_path, "second", *words, "--resume", pythonpath=tmp_path, CALLS=str(calls),
                        node=(0, master_port))
        second_rank_1 = launch(tmp_path, "second-rank-1", *words, "--resume", pythonpath=tmp_path, CALLS=str(calls),
                               node=(1, master_port), cwd=rank_1_folder, RANK_EXITS=str(tmp_path / "second-exits"))
        try:
            second_status = finish(second, 300)
        finally:  # killed once its launcher is gone, or after 60 s
            second_rank_1_status = finish(second_rank_1, 60)
        return types.SimpleNamespace(
            second_rank_1_status=second_rank_1_status, rank_1_folder=sorted(os.listdir(rank_1_folder)),
            rank_1_out=(tmp_path / "second-rank-1.out").read_text(),
            run_dir=run_dir, calls=calls, stopped_at=stopped_at, first_status=first_status, steps_before=steps_before,
            first_exits=rank_exits(tmp_path, "first"), first_out=(tmp_path / "first.out").read_text(),
            second_status=second_status, second_exits=rank_exits(tmp_path, "second"),
            second_out=(tmp_path / "second.out").read_text())


def calls_of(two_ranks, rank) -> list[dict]:
    with open(two_ranks.calls / f"rank{rank}.jsonl") as file:
        return [json.loads(line) for line in file]


def test_sigterm_to_the_launcher_stops_every_rank_with_exit_0_after_one_final_checkpoint(two_ranks):
    assert two_ranks.first_exits == {"rank0": 0, "rank1": 0}, two_ranks.first_out
    assert "rank 1: rank 0 ended the run" in two_ranks.first_out
    step = int(re.search(r"run finished: global step (\d+)", two_ranks.first_out).group(1))
    assert two_ranks.steps_before[-1] == step  # the final one, after the saves every 8 learns


def test_resume_under_two_ranks_continues_the_learn_cadence_exactly(two_ranks):
    lines = read_metrics(two_ranks.run_dir, event="learn")
    assert [line["step"] for line in lines] == [1024 * k for k in range(1, len(lines) + 1)]
    assert [line["server/policy_version"] for line in lines] == list(range(1, len(lines) + 1))
    assert "resumed from step" in two_ranks.second_out


def test_two_ranks_and_a_local_client_train_pg_on_dummy_v1_to_the_bar_of_one_process(two_ranks):
    assert two_ranks.second_status == 0 and two_ranks.second_exits == {"rank0": 0, "rank1": 0}, two_ranks.second_out
    assert two_ranks.second_rank_1_status == 0
    curve = plugrl_min.return_curve(read_metrics(two_ranks.run_dir, None))
    assert curve[-1][0] == TWO_RANK_STEPS and curve[-1][1] >= -5.0 and curve[-1][2] >= 100, curve[-5:]
    steps = checkpoint_steps(two_ranks.run_dir)
    assert steps == sorted(steps) and steps[-1] == TWO_RANK_STEPS  # one series: the first part's, then the resumed


def test_every_rank_learns_through_distributed_data_parallel(two_ranks):
    for rank in (0, 1):
        wrappers = [call["wrapper"] for call in calls_of(two_ranks, rank) if call["hook"] == "activate_ddp"]
        assert wrappers == ["DistributedDataParallel"] * 2  # once per launch


def test_the_other_rank_loads_rank_0s_server_data_with_its_global_step_once_per_learn(two_ranks):
    shipped = [call["global_step"] for call in calls_of(two_ranks, 0) if call["hook"] == "get_server_data"]
    loaded = [call["global_step"] for call in calls_of(two_ranks, 1) if call["hook"] == "load_server_data"]
    learns = [[call for call in calls_of(two_ranks, rank) if call["hook"] == "learn"] for rank in (0, 1)]
    assert loaded == shipped and len(shipped) == len(learns[0]) == len(learns[1]) > STOPPED_AFTER_LEARNS


def test_on_resume_rank_0_loads_the_checkpoint_and_the_other_rank_its_learner_state(two_ranks):
    def loads(rank):
        return [(call["hook"], call["step"]) for call in calls_of(two_ranks, rank)
                if call["hook"] in ("load_checkpoint", "load_learner_state")]

    step = two_ranks.steps_before[-1]
    assert loads(0) == [("load_checkpoint", step), ("load_learner_state", step)]  # pg's builds on it
    assert loads(1) == [("load_learner_state", step)]


def test_only_rank_0_writes_checkpoints(two_ranks):
    assert not [call for call in calls_of(two_ranks, 1) if call["hook"] == "create_ddp_checkpoint"]
    assert [call for call in calls_of(two_ranks, 0) if call["hook"] == "create_ddp_checkpoint"]


def test_on_a_second_machine_rank_1_writes_nothing_to_disk(two_ranks):
    assert "rank 1 of 2" in (two_ranks.rank_1_out)  # it learned, launched from a folder of its own
    assert two_ranks.rank_1_folder == []  # no run directory, log or checkpoint


@pytest.mark.parametrize("rank", ["0", "1"])
@pytest.mark.parametrize("algo", ["dummy", "sac"])
def test_a_base_algorithm_under_two_ranks_is_a_one_line_error_naming_ddpalgorithm_and_exit_2(monkeypatch, capsys,
                                                                                         algo, rank):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    assert plugrl_min.main(["dummy-policy", "default", algo, "default", "--port", "0"]) == 2
    out, err = capsys.readouterr()
    assert "listening" not in out
    assert err.strip().splitlines() == [
        f"error: 2 ranks need a DDPAlgorithm; {algo!r} is a BaseAlgorithm without activate_ddp, get_server_data, "
        "load_server_data, load_learner_state, create_ddp_checkpoint: run it without torch.distributed.run, "
        "or implement them"]


def processes_naming(text) -> list[int]:
    """The pids of live processes whose command line holds text."""
    found = []
    for path in glob.glob("/proc/[0-9]*/cmdline"):
        try:
            with open(path, "rb") as file:
                if text.encode() in file.read():
                    found.append(int(path.split("/")[2]))
        except OSError:
            pass
    return found


def test_a_learner_rank_killed_by_sigkill_ends_the_run_within_60_s_leaving_its_checkpoints_intact(tmp_path):
    run_dir = tmp_path / "run"
    process = launch(tmp_path, "run", "dummy-policy", "default", "pg", "default", "--local-env-clients", "1",
                     "--local-num-envs", "16", "--algo.save-every", "2", "--algo.global-steps", "1000000000",
                     "--port", "0", "--run-dir", str(run_dir))
    try:
        wait_for(lambda: len(checkpoint_steps(run_dir)) >= 2 or process.poll() is not None, 180, "two checkpoints")
        learner = int(re.search(r"rank 1 of 2 \(pid (\d+)\)", (tmp_path / "run.out").read_text()).group(1))
        os.kill(learner, signal.SIGKILL)
        killed = time.monotonic()
        status = process.wait(90)
        ended_after = time.monotonic() - killed
    finally:
        finish(process, 10)
    assert status != 0 and ended_after < 60
    assert "error" in (tmp_path / "run.out").read_text().lower()
    for step in checkpoint_steps(run_dir):  # every checkpoint written before the kill loads
        assert torch.load(run_dir / "checkpoints" / f"step_{step:012d}.pt", weights_only=True)["step"] == step
    assert processes_naming(str(run_dir)) == []  # no rank is left
    port = re.search(r"listening on ws://127\.0\.0\.1:(\d+)", (tmp_path / "run.out").read_text()).group(1)
    wait_for(lambda: not processes_naming(f"--server-port\0{port}\0"), 60, "the local client to leave")


def test_kill_9_of_the_launcher_leaves_no_rank_or_client_running_and_a_final_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    process = launch(tmp_path, "run", "dummy-policy", "default", "pg", "default", "--local-env-clients", "1",
                     "--local-num-envs", "16", "--algo.global-steps", "1000000000", "--log-every", "1",
                     "--run-dir", str(run_dir))
    try:
        wait_for(lambda: metrics_lines(run_dir) >= 2 or process.poll() is not None, 180, "learns on two ranks")
        out = (tmp_path / "run.out").read_text()
        port = re.search(r"listening on ws://127\.0\.0\.1:(\d+)", out).group(1)
        process.kill()  # SIGKILL to the launcher alone: its ranks and their client are on their own
        process.wait(10)
        wait_for(lambda: not processes_naming(str(run_dir)) and not processes_naming(f"--server-port\0{port}\0"), 60,
                 "every rank and the local client to exit")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
    out = (tmp_path / "run.out").read_text()
    assert "the launcher is gone" in out and rank_exits(tmp_path, "run") == {"rank0": 0, "rank1": 0}, out
    step = int(re.search(r"run finished: global step (\d+)", out).group(1))
    assert checkpoint_steps(run_dir)[-1] == step  # the final checkpoint
    with socket.socket() as again:  # its port is free again (SO_REUSEADDR: as a new server binds it)
        again.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        again.bind(("127.0.0.1", int(port)))


# =============================================================================================
# [trace] --trace N: the contract, watched as it runs
# =============================================================================================

TRACE_LINE = re.compile(r"trace: conn (\d+) env (\d+) \| infer batch of (\d+) at version (\d+) \| action \[.*\] \| "
                        r"-> (feedback|discard_feedback) \((.*)\) \| prev_node (.*) -> (.*)")


class LearnsEveryTwo(Probe):
    on_policy = True
    learn_every = 2


@wire
def test_trace_shows_a_stale_frame_discarded_after_a_learn_with_the_versions(tmp_path, capsys):
    algo = LearnsEveryTwo()

    async def script(port, server):
        a, b = await Client.connect(port), await Client.connect(port)
        await b.infer([0], [2])  # b acts with version 0 ...
        await a.step([0], [1])
        await a.step([0], [1])  # ... a's second frame makes the learn due: version 1
        await eventually(lambda: algo.learns == 1)
        await b.feedback([0], [2])  # b's frame is stale now
        await eventually(lambda: algo.discarded == 1)
        await a.close()
        await b.close()

    run_server(algo, tmp_path, script, trace=10)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("trace:")]
    assert lines[2] == "trace: learn 1 -> policy version 1"
    frames = [TRACE_LINE.fullmatch(line) for line in lines if "env" in line]
    assert all(frames), lines
    assert [match.group(5) for match in frames] == ["feedback", "feedback", "discard_feedback"]
    conn, env, size, version, _, why, node_in, node_out = frames[2].groups()
    assert (conn, env, version) == ("2", "0", "0")
    assert why == "stale: acted with version 0, the policy is version 1"
    assert (node_in, node_out) == ("(-1, '')", "(-1, '')")
    assert frames[1].group(7, 8) == ("(-1, '')", "(-1, '')")  # the probe returns the node it is given


@wire
def test_trace_says_learn_due_for_a_frame_that_arrives_once_the_batch_is_full(tmp_path, capsys):
    algo = LearnsEveryTwo()

    async def script(port, server):
        client = await Client.connect(port)
        await client.step([0, 1, 2], [1, 2, 3])  # three frames in one message: the third is one too many
        await eventually(lambda: algo.learns == 1)
        await client.close()

    run_server(algo, tmp_path, script, trace=3)
    frames = [TRACE_LINE.fullmatch(line) for line in capsys.readouterr().out.splitlines() if "env" in line]
    assert frames[2].group(5, 6) == ("discard_feedback", "learn due: should_learn() is true")


@wire
def test_no_trace_by_default(tmp_path, capsys):
    async def script(port, server):
        await run_rounds(port, [1, 2], 5)
        await eventually(lambda: algo.learns >= 1)

    algo = LearnsEveryTwo()
    run_server(algo, tmp_path, script)
    assert "trace:" not in capsys.readouterr().out


@wire
def test_trace_narrates_the_first_n_frames_only(tmp_path, capsys):
    algo = Probe()

    async def script(port, server):
        await run_rounds(port, [1], 10)
        await eventually(lambda: len(algo.frames) == 10)

    run_server(algo, tmp_path, script, trace=4)
    frames = [line for line in capsys.readouterr().out.splitlines() if line.startswith("trace: conn")]
    assert len(frames) == 4 and all("-> feedback (off-policy: every frame is stored)" in line for line in frames)


# =============================================================================================
# [tensorboard] TensorBoard's curves beside metrics.jsonl
# =============================================================================================
# A test of tensorboard skips only when tensorboard is not installed.

def test_tensorboard_event_files_hold_the_curves_of_the_run(short_run):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    assert short_run.status == 0, short_run.err
    events = EventAccumulator(str(short_run.run_dir))
    events.Reload()
    rewards = [event.value for event in events.Scalars("rollout/reward")]
    lines = [line for line in short_run.lines if line["rollout/episodes"]]  # no rollout/* point without episodes
    assert len(lines) >= 2 and rewards == pytest.approx([line["rollout/reward"] for line in lines])
    versions = [event.value for event in events.Scalars("server/policy_version")]
    assert versions == [line["server/policy_version"] for line in short_run.lines] == [1, 2, 3, 4, 4]


def test_a_metrics_line_without_episodes_draws_no_rollout_point_not_even_rollout_episodes(short_run):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(short_run.run_dir))
    events.Reload()
    with_episodes = [line["rollout/episodes"] for line in short_run.lines if line["rollout/episodes"]]
    assert 0 < len(with_episodes) < len(short_run.lines)  # some lines have none: the rule is exercised
    assert [event.value for event in events.Scalars("rollout/episodes")] == with_episodes


@wire
def test_without_tensorboard_the_run_is_the_same_and_says_nothing_of_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # `import` now fails

    async def script(port, server):
        await run_rounds(port, [1], 3)

    status, _ = run_server(LearnsEveryFour(), tmp_path, script)
    assert status == 0 and plugrl_min.open_tensorboard(str(tmp_path)) is None
    assert not glob.glob(str(tmp_path / "events.out.tfevents.*"))
    assert read_metrics(tmp_path, event=None)
    assert "tensorboard" not in capsys.readouterr().out.replace(str(tmp_path), "RUN_DIR").lower()


# =============================================================================================
# [report] `python plugrl_min.py report RUN_DIR ...`: runs compared, and their chart
# =============================================================================================

REPORT_LINE = re.compile(r"A (.+): ([\d,]+) steps \| (\d+) learns \| ([\d,]+) discarded \| ([\d,]+) episodes \| "
                         r"all (\d+) episodes (-?[\d.]+)")  # fewer than 100 ended: their mean, and no best of 100+


def test_every_run_ends_with_a_report_of_its_run_directory_and_a_chart_of_its_return(short_run):
    assert short_run.status == 0, short_run.err
    printed = short_run.out.split("run finished: global step 400, 4 learns\n", 1)[1]
    assert printed.rstrip("\n") == plugrl_min.report([str(short_run.run_dir)])  # the report of the run dir
    summary, *chart = printed.splitlines()
    run_dir, steps, learns, discarded, episodes, averaged, mean = REPORT_LINE.fullmatch(summary).groups()
    lines = short_run.lines
    assert run_dir == str(short_run.run_dir) and (steps, learns) == ("400", "4")
    assert int(discarded.replace(",", "")) == sum(line["server/discarded"] for line in lines)
    assert int(episodes.replace(",", "")) == int(averaged) == sum(line["rollout/episodes"] for line in lines) > 0
    seen = [(line["rollout/episodes"], line["rollout/reward"]) for line in lines if line["rollout/episodes"]]
    assert sum(count for count, _ in seen) < 100  # so the figure averages all of them, and says so
    overall = sum(count * mean for count, mean in seen) / sum(count for count, _ in seen)  # weighted by episodes
    assert float(mean) == pytest.approx(overall, abs=0.01)
    assert chart[0] == "mean return of the last 100+ episodes (of all, before 100 ended), by step" and len(chart) == 1 + 12 + 2
    assert sum(row.count("A") for row in chart[1:13]) >= 1  # the run's curve, drawn with its mark


def test_the_text_chart_draws_a_curve_with_its_mark_on_a_dozen_rows_from_its_highest_mean_to_its_lowest():
    curve = [(100 * i, float(i)) for i in range(1, 101)]
    title, *rows, axis, steps = plugrl_min.text_chart({"A": curve}).splitlines()
    assert title == "mean return of the last 100+ episodes (of all, before 100 ended), by step" and len(rows) == 12
    assert rows[0].startswith("    100.00 |") and rows[-1].startswith("      1.00 |")
    assert all(len(row) == len("      1.00 |") + 60 for row in rows) and axis == " " * 11 + "+" + "-" * 60
    assert steps.split() == ["0", "10,000"]
    columns = [row.index("A") for row in rows]  # a rising curve: every row has a point, the top row's rightmost
    assert rows[0].endswith("A") and columns == sorted(columns, reverse=True)


def test_the_chart_marks_a_cell_two_runs_share_with_a_star():
    rows = plugrl_min.text_chart({"A": [(0, 1.0), (10, 2.0)], "B": [(0, 5.0), (10, 2.0)]}).splitlines()
    plotted = "".join(row.split("|", 1)[1] for row in rows[1:13])
    assert plotted.count("A") == 1 and plotted.count("B") == 1 and plotted.count("*") == 1


def test_the_run_ends_with_the_report_of_its_run_directory(sac_run_logged_every_300):
    stdout = sac_run_logged_every_300.stdout
    assert re.search(r"^A \S+: 1,000 steps \| 800 learns \| 0 discarded \| ([\d,]+) episodes \| "
                     r"all \1 episodes -?\d+\.\d\d$", stdout, re.M), stdout


def last_100_by_hand(lines) -> float | None:
    """The newest lines until they hold 100 episodes: their mean return, weighted by their episodes; None while
    fewer than 100 have ended (no mean of 100+ episodes exists yet)."""
    held, weighted = 0, 0.0
    for line in reversed(lines):
        if held >= 100:
            break
        held += line["rollout/episodes"]
        weighted += line["rollout/episodes"] * line["rollout/reward"]
    return weighted / held if held >= 100 else None


def report_of(runs, reach=None) -> list[str]:
    return plugrl_min.report(runs, reach).splitlines()


def test_report_gives_each_runs_last_100_episodes_as_their_true_mean(two_short_runs):
    rows = report_of(two_short_runs)[:2]
    assert len(rows) == 2, rows  # a row per run: zip below stops at the shorter
    for mark, run, row in zip("AB", two_short_runs, rows):
        lines = read_metrics(run, None)
        episodes = sum(line["rollout/episodes"] for line in lines)
        assert episodes > 100  # so that the newest lines, not all of them, make the figure
        assert row.startswith(f"{mark} {run}: 6,000 steps | 60 learns | 0 discarded | {episodes:,} episodes | ")
        assert f"| last 100+ episodes {last_100_by_hand(lines):.2f} |" in row


def test_report_gives_the_best_last_100_mean_over_the_run(two_short_runs):
    row = report_of(two_short_runs[:1])[0]
    lines = read_metrics(two_short_runs[0], None)
    means = [last_100_by_hand(lines[:end]) for end in range(1, len(lines) + 1) if lines[end - 1]["rollout/episodes"]]
    assert None in means  # the first lines hold fewer than 100 episodes: they make no "best"
    best = max(mean for mean in means if mean is not None)
    assert row.endswith(f"| best {best:.2f}")


def test_report_reach_gives_the_first_step_at_which_the_last_100_mean_reached_it(two_short_runs):
    lines = read_metrics(two_short_runs[0], None)
    means = [(line["step"], last_100_by_hand(lines[:end])) for end, line in enumerate(lines, 1)
             if line["rollout/episodes"] and last_100_by_hand(lines[:end]) is not None]
    reach = round(sorted(mean for _, mean in means)[len(means) // 2], 2)  # the median: reached, not at once
    first = next(step for step, mean in means if mean >= reach)
    rows = report_of(two_short_runs[:1], reach) + report_of(two_short_runs[:1], 1000)
    assert rows[0].endswith(f"| {reach:g} reached at step {first:,}")
    assert [row for row in rows if row.startswith("A ")][1].endswith("| 1000 never reached")


def test_report_draws_every_run_on_the_same_axes_each_with_its_letter(two_short_runs):
    chart = report_of(two_short_runs)[2:]
    assert chart[0] == "mean return of the last 100+ episodes (of all, before 100 ended), by step"
    plotted = "".join(row.split("|", 1)[1] for row in chart[1:13])
    assert set(plotted) == {" ", "A", "B"} and chart[-1].strip() == "0" + " " * 55 + "6,000"


def test_report_of_28_runs_lists_all_28_and_says_the_chart_draws_a_to_z(two_short_runs, tmp_path):
    runs = []
    for index in range(28):
        run = tmp_path / f"run{index}"
        run.mkdir()
        shutil.copy(pathlib.Path(two_short_runs[index % 2]) / "metrics.jsonl", run)
        runs.append(str(run))
    rows = report_of(runs)
    listed = [row.split(" ", 2)[:2] for row in rows[:28]]
    assert listed == [[mark, run + ":"] for mark, run in zip([*string.ascii_uppercase, "AA", "AB"], runs)]
    assert rows[28] == "mean return of the last 100+ episodes (of all, before 100 ended), by step (runs A to Z are drawn; 2 more are not)"


@pytest.mark.parametrize("what", ["a missing directory", "an empty metrics.jsonl"])
def test_report_of_a_missing_run_or_an_empty_metrics_file_is_a_one_line_error_and_exit_2(tmp_path, capsys, what):
    run = tmp_path / "run"
    if what == "an empty metrics.jsonl":
        run.mkdir()
        (run / "metrics.jsonl").write_text("")
    status = plugrl_min.main(["report", str(run)])
    said = capsys.readouterr().err.strip().splitlines()
    assert status == 2 and len(said) == 1 and said[0].startswith("error: ")
    assert ("holds no metrics.jsonl" if what == "a missing directory" else "is empty") in said[0]


def test_report_into_a_closed_pipe_exits_quietly(two_short_runs):
    process = subprocess.Popen([sys.executable, SOURCE, "report", *two_short_runs], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=subprocess_env())
    process.stdout.close()  # `| head -1` that has read its line: the report's writes meet a closed pipe
    status = process.wait(60)
    assert status == 0 and process.stderr.read() == b""


def test_a_cut_off_last_line_of_metrics_is_skipped_with_a_warning_naming_the_file_and_line(earlier_run, capsys):
    run, _ = earlier_run
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n" + lines[-1][:25])  # a run killed as it wrote its last line
    status, out, err = run_main("report", run)
    assert status == 0 and out.startswith(f"A {run}: 6,000 steps")  # the line before, the 6,000-step learn
    assert err == f"warning: {path}, line {len(lines)} is cut short (a run killed as it wrote?): skipped\n"


def test_report_last_n_gives_the_mean_return_of_the_last_n_episodes(tmp_path, capsys):
    lines = [{"event": "learn", "step": 100 * i, "rollout/episodes": 5, "rollout/reward": float(i),
              "server/policy_version": i, "server/discarded": 0} for i in range(1, 5)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert plugrl_min.main(["report", str(tmp_path), "--last", "10"]) == 0
    out = capsys.readouterr().out
    assert "| last 10+ episodes 3.50 |" in out  # the newest two lines, five episodes each: (3 + 4) / 2
    assert "mean return of the last 10+ episodes (of all, before 10 ended), by step" in out


def write_metrics(run, *lines) -> None:
    """A run's metrics.jsonl of learn lines (step, episodes, their mean return), as a run writes them."""
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({
        "event": "learn", "step": step, "rollout/episodes": episodes, "rollout/reward": reward,
        "server/policy_version": i, "server/discarded": 0}) + "\n" for i, (step, episodes, reward) in enumerate(lines)))


def test_report_takes_best_and_reach_only_from_windows_of_100_or_more_episodes(tmp_path):
    run = tmp_path / "run"  # one episode at -1 first: a window of one episode must not make the best
    write_metrics(run, (10, 1, -1.0), *[(20 * i, 50, -20.0) for i in range(1, 11)])
    (row, *_) = report_of([str(run)], reach=-5)
    assert row.endswith(" | last 100+ episodes -20.00 | best -20.00 | -5 never reached"), row


def test_report_of_a_run_with_fewer_episodes_than_n_says_it_averaged_all_of_them(tmp_path):
    run = tmp_path / "run"
    write_metrics(run, (10, 1, -6.0), (20, 2, -7.5))
    (row, *_) = report_of([str(run)], reach=-100)
    assert row == f"A {run}: 20 steps | 1 learns | 0 discarded | 3 episodes | all 3 episodes -7.00 | -100 never reached"


# =============================================================================================
# [notebook] In a notebook: the server on a thread of its own, Interrupt as Ctrl-C
# =============================================================================================
# main([...]) in a real Jupyter kernel, Interrupt as Ctrl-C, start() and stop(). A test that needs the
# kernel skips only when ipykernel or jupyter_client is not installed.

class Kernel:
    """A real ipykernel, started from this Python through a kernel spec of the test's own, and a
    client that runs cells in it: the notebook a student runs, without the browser."""

    def __init__(self, folder):
        jupyter_client = pytest.importorskip("jupyter_client", reason="jupyter_client is not installed")
        pytest.importorskip("ipykernel", reason="ipykernel is not installed")
        from jupyter_client.kernelspec import KernelSpecManager
        spec = folder / "kernels" / "plugrl-test"
        spec.mkdir(parents=True)
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
            "display_name": "plugrl test", "language": "python", "interrupt_mode": "signal"}))
        specs = KernelSpecManager(kernel_dirs=[str(folder / "kernels")])
        self.manager = jupyter_client.KernelManager(kernel_name="plugrl-test", kernel_spec_manager=specs)
        self.manager.start_kernel(cwd=str(folder), env=subprocess_env())
        self.client = self.manager.client()
        self.client.start_channels()
        self.client.wait_for_ready(timeout=60)
        self.run(f"import sys; sys.path.insert(0, {HERE!r}); import plugrl_min")  # this checkout's file

    def run(self, code: str, timeout: float = 120.0, when=None) -> str:
        """Run a cell: what it printed (an exception as 'ERROR name'). when(text) is called five
        times a second while the cell runs, until it returns true."""
        msg_id = self.client.execute(code)
        texts, deadline = [], time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            assert left > 0, f"the cell did not end in {timeout} s: {''.join(texts)[-2000:]}"
            if when is not None and when("".join(texts)):
                when = None
            try:
                message = self.client.get_iopub_msg(timeout=min(left, 0.2))
            except queue.Empty:
                continue
            if message["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = message["msg_type"], message["content"]
            if kind == "stream":
                texts.append(content["text"])
            elif kind == "error":
                texts.append(f"ERROR {content['ename']}: {content['evalue']}\n")
            elif kind == "status" and content["execution_state"] == "idle":
                return "".join(texts)

    def alive(self) -> bool:
        return self.manager.is_alive() and self.run("print(6 * 7)", timeout=30).strip() == "42"

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture
def kernel(tmp_path):
    kernel = Kernel(tmp_path)
    yield kernel
    kernel.close()


def interrupt_after_a_learn(kernel, run_dir, times=1, marker="metrics.jsonl"):
    """when(): once the run has written its marker file (a metrics line), the kernel's Interrupt,
    `times` times 1.5 s apart."""
    def when(text):
        if not (run_dir / marker).exists() or not (run_dir / marker).read_text() and marker == "metrics.jsonl":
            return False
        for i in range(times):
            time.sleep(1.5 * (i > 0))  # a second Interrupt a second or more later: stop at once
            kernel.manager.interrupt_kernel()
        return True
    return when


def test_main_in_a_notebook_cell_returns_0_and_leaves_a_checkpoint_twice_in_one_kernel(kernel, tmp_path):
    runs = [tmp_path / "first", tmp_path / "second"]
    said = kernel.run("\n".join(f"print('status', plugrl_min.main({notebook_words(run, 8192)!r}))" for run in runs))
    assert said.count("status 0") == 2 and "ERROR" not in said, said[-3000:]
    for run in runs:
        assert [path.name for path in (run / "checkpoints").iterdir()] == ["step_000000008192.pt"]
        assert (run / "config.json").exists() and (run / "env-client-1.log").exists()


def threads_and_children(kernel) -> str:
    return kernel.run("import os, threading, glob\n"
                      "print(sorted(t.name for t in threading.enumerate() if t.name.startswith(('plugrl', 'learn'))),"
                      " [p for p in glob.glob('/proc/[0-9]*/stat')"
                      "  if open(p).read().rsplit(')', 1)[1].split()[1] == str(os.getpid())])").strip()


def threads_running_plugrl_min(kernel) -> str:
    """How many of the kernel's threads, but the cell's own, have plugrl_min.py on their stack, whatever their
    names: a client or server left behind is one of them."""
    return kernel.run("import sys, threading, traceback\n"
                      "print(sum(any(frame.f_code.co_filename.endswith('plugrl_min.py')"
                      " for frame, _ in traceback.walk_stack(top))"
                      " for ident, top in sys._current_frames().items() if ident != threading.get_ident()))").strip()


def test_an_interrupt_in_a_notebook_stops_the_run_as_ctrl_c_and_the_kernel_lives_on(kernel, tmp_path):
    run = tmp_path / "long"
    said = kernel.run(f"print('status', plugrl_min.main({notebook_words(run, 10**9)!r}))",
                      when=interrupt_after_a_learn(kernel, run))
    assert "stopping after the learn in progress" in said and "status 0" in said and "ERROR" not in said, said[-3000:]
    assert plugrl_min.checkpoint_paths(run) and read_metrics(run, event=None)[-1]["event"] == "end"
    assert threads_and_children(kernel) == "[] []"  # no server thread, learn thread or client left
    # Nor a thread of another name still in plugrl_min's code: a client left behind would give up on its server
    # after 30 s, and end the kernel.
    deadline = time.monotonic() + 10
    while (left := threads_running_plugrl_min(kernel)) != "0":
        assert time.monotonic() < deadline, f"{left} threads of the kernel still run plugrl_min's code"
        time.sleep(0.2)
    assert kernel.alive()


SLOW_LEARNER = """
import dataclasses, time
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config

@register_algo_config("slow")
@dataclasses.dataclass
class SlowConfig(DummyAlgoConfig):
    learn_every: int = 160

@register_algo("slow")
class Slow(DummyAlgorithm):
    def learn_impl(self):  # a learn of 4 s: the first Interrupt waits for it, the second does not
        open(LEARNING, "w").close()  # the test interrupts now, in the learn
        time.sleep(4)
        return super().learn_impl()
"""


def test_a_second_interrupt_in_a_notebook_stops_at_once_without_a_checkpoint_and_the_kernel_lives(kernel, tmp_path):
    run = tmp_path / "long"
    kernel.run(SLOW_LEARNER.replace("LEARNING", repr(str(run / "learning"))))
    started = time.monotonic()
    said = kernel.run(f"print('status', plugrl_min.main({notebook_words(run, 10**9, 'slow')!r}))",
                      when=interrupt_after_a_learn(kernel, run, times=2, marker="learning"))
    assert "stopped again: stopping now, without a final checkpoint" in said and "status 130" in said, said[-3000:]
    assert not plugrl_min.checkpoint_paths(run) and time.monotonic() - started < 60
    deadline = time.monotonic() + 20  # the learn in progress ends in its own thread, within its 4 s
    while (left := threads_and_children(kernel)) != "[] []":
        assert time.monotonic() < deadline, left
        time.sleep(0.5)
    assert kernel.alive()


def test_a_run_started_in_the_background_stops_on_request_with_a_final_checkpoint(kernel, tmp_path):
    run = tmp_path / "background"
    said = kernel.run(f"training = plugrl_min.start({notebook_words(run, 10**9)!r}); print('in', training.run_dir)")
    assert f"in {run}" in said, said[-3000:]
    deadline = time.monotonic() + 60
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):  # trains meanwhile
        assert time.monotonic() < deadline, "no metrics line in 60 s"
        time.sleep(0.2)
    said = kernel.run("print('status', training.stop())")
    assert "status 0" in said and plugrl_min.checkpoint_paths(run), said[-3000:]
    assert read_metrics(run, event=None)[-1]["event"] == "end" and threads_and_children(kernel) == "[] []"


CALLERS_STATE = """
import numpy as np, torch
torch.set_num_threads(3); torch.manual_seed(123); np.random.seed(456)  # the notebook's own
"""
CALLERS_STATE_AFTER = """
drawn = (torch.rand(3), np.random.rand(3))
torch.manual_seed(123); np.random.seed(456)
print('threads', torch.get_num_threads(), 'draws as seeded before',
      torch.equal(drawn[0], torch.rand(3)), bool((drawn[1] == np.random.rand(3)).all()))
"""


def test_main_in_a_notebook_leaves_the_callers_torch_threads_and_random_states_as_they_were(kernel, tmp_path):
    kernel.run(CALLERS_STATE)
    said = kernel.run(f"print('status', plugrl_min.main({notebook_words(tmp_path / 'run', 4096) + ['--seed', '7']!r}))")
    assert "status 0" in said, said[-3000:]
    assert kernel.run(CALLERS_STATE_AFTER).strip() == "threads 3 draws as seeded before True True"


def test_start_and_stop_in_a_notebook_leave_the_callers_torch_threads_and_random_states_as_they_were(kernel, tmp_path):
    run = tmp_path / "background"
    kernel.run(CALLERS_STATE)
    said = kernel.run(f"training = plugrl_min.start({notebook_words(run, 10**9) + ['--seed', '7']!r})\n"
                      "print('threads on return', torch.get_num_threads())")
    assert "threads on return 3" in said, said[-3000:]
    deadline = time.monotonic() + 60
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()):  # it draws meanwhile
        assert time.monotonic() < deadline, "no metrics line in 60 s"
        time.sleep(0.2)
    assert "status 0" in kernel.run("print('status', training.stop())")
    assert kernel.run(CALLERS_STATE_AFTER).strip() == "threads 3 draws as seeded before True True"


def test_start_on_a_taken_port_in_a_notebook_raises_after_the_line_that_names_the_port(kernel, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        said = kernel.run(f"training = plugrl_min.start({notebook_words(tmp_path / 'run', 4096)[:4] + ['--port', str(port)]!r})")
    assert f"error: cannot listen on 127.0.0.1:{port}" in said, said[-3000:]
    assert f"ERROR RuntimeError: the run did not start (exit status 1): cannot listen on 127.0.0.1:{port}: " in said, \
        said[-3000:]  # the exception names the address too


RACER = """
import os
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config
register_algo_config("racer")(DummyAlgoConfig)

@register_algo("racer")
class Racer(DummyAlgorithm):
    def __init__(self, config, policy):  # another run claims the run directory in the meantime
        super().__init__(config, policy)
        os.makedirs(RUN, exist_ok=True)
        open(os.path.join(RUN, "config.json"), "w").close()
"""


def test_a_run_directory_claimed_meanwhile_in_a_notebook_gives_status_2_and_one_line(kernel, tmp_path):
    run = tmp_path / "run"
    kernel.run(RACER.replace("RUN", repr(str(run))))
    said = kernel.run(f"print('status', plugrl_min.main({notebook_words(run, 4096, 'racer')[:4] + ['--run-dir', str(run), '--port', '0']!r}))")
    assert f"error: {run} holds a run already: name another --run-dir" in said and "status 2" in said, said[-3000:]


SLOW_END = """
import dataclasses, time
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config

@register_algo_config("slow-end")
@dataclasses.dataclass
class SlowEndConfig(DummyAlgoConfig):
    learn_every: int = 160
    save_every: int = 10**9

@register_algo("slow-end")
class SlowEnd(DummyAlgorithm):
    final = False

    def create_checkpoint(self):  # save_every 10**9: the final checkpoint
        self.final = True
        return super().create_checkpoint()

    def build_train_info(self, global_step, log_dict):  # after the final save: the end line takes 4 s
        if self.final:
            open(ENDING, "w").close()
            time.sleep(4)
        return super().build_train_info(global_step, log_dict)
"""


def interrupt_twice(kernel, run_dir, second):
    """when(): the kernel's Interrupt once the run has written a metrics line, and again once second(text) is
    true and 1.5 s have passed (a copy within a second would be the same Interrupt)."""
    first = []

    def when(text):
        if not first:
            if (run_dir / "metrics.jsonl").exists() and (run_dir / "metrics.jsonl").read_text():
                kernel.manager.interrupt_kernel()
                first.append(time.monotonic())
            return False
        if second(text) and time.monotonic() - first[0] > 1.5:
            kernel.manager.interrupt_kernel()
            return True
        return False
    return when


def test_a_second_interrupt_in_a_notebook_after_the_final_checkpoint_lets_the_run_end_with_status_0(kernel, tmp_path):
    run = tmp_path / "run"
    kernel.run(SLOW_END.replace("ENDING", repr(str(run / "ending"))))
    said = kernel.run(f"print('status', plugrl_min.main({notebook_words(run, 10**9, 'slow-end')!r}))",
                      when=interrupt_twice(kernel, run, lambda text: (run / "ending").exists()))
    assert "stopped again: the run is ending already, after its final save" in said, said[-3000:]
    assert "status 0" in said and "without a final checkpoint" not in said, said[-3000:]
    assert plugrl_min.checkpoint_paths(run) and read_metrics(run, event=None)[-1]["event"] == "end"


SLOW_EXIT = """
import atexit, sys, time
if "env-client" in sys.argv:  # the local client: it ends 6 s after the run, while the server waits for it
    atexit.register(time.sleep, 6)
"""


def ended_and_reported(text: str) -> bool:
    """The run's report is out: it is the last thing the run prints before its status is known (the
    "run finished" line comes earlier, while the run still ends)."""
    return re.search(r"\nA .*: [\d,]+ steps \|", text) is not None


def test_an_interrupt_in_a_notebook_while_the_local_clients_end_says_the_run_has_ended_and_keeps_status_0(kernel,
                                                                                                          tmp_path):
    run = tmp_path / "run"
    write_plugin(tmp_path, "plugrl_test_slow_exit", SLOW_EXIT)  # the kernel's folder: the client's too
    said = kernel.run(f"print('status', plugrl_min.main({notebook_words(run, 10**9) + ['--plugin', 'plugrl_test_slow_exit']!r}))",
                      when=interrupt_twice(kernel, run, ended_and_reported))
    assert "the run has ended already: its local env clients get up to 10 s to end" in said, said[-3000:]
    assert "status 0" in said and "without a final checkpoint" not in said, said[-3000:]


@wire
def test_env_client_in_a_notebook_cell_stops_on_interrupt_with_130_and_no_traceback(kernel, tmp_path):
    run = tmp_path / "run"
    with Background(tmp_path, "server", ["plugrl_min.py", "dummy-policy", "default", "dummy", "default", "--port", "0",
                                         "--algo.global-steps", str(10**9), "--algo.learn-every", "100",
                                         "--log-every", "1", "--run-dir", str(run)]) as server:
        words = ["env-client", "dummy-v1", "--server-port", str(server.port()), "--num-episodes", "0"]

        def when(text):  # the kernel's Interrupt once the server has learned from this client
            if (run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text():
                kernel.manager.interrupt_kernel()
                return True
            return False
        said = kernel.run(f"print('status', plugrl_min.main({words!r}))", when=when)
    assert "status 130" in said and "Traceback" not in said and "ERROR" not in said, said[-3000:]
    assert threads_and_children(kernel) == "[] []"  # no client thread left


CELL_ENV = """
from plugrl_min import ENVIRONMENTS, register_env

@register_env("cell-v1")
class CellEnv(ENVIRONMENTS["dummy-v1"]):
    pass
"""


def test_a_local_env_defined_in_a_notebook_cell_is_refused_at_the_start_in_one_line(kernel, tmp_path):
    run = tmp_path / "run"
    kernel.run(CELL_ENV)
    said = kernel.run(f"print('status', plugrl_min.main({notebook_words(run, 4096) + ['--local-env', 'cell-v1']!r}))")
    assert ("error: environment 'cell-v1' is defined in __main__, which the --local-env-clients processes cannot "
            "import: define it in a module and add --plugin MODULE") in said, said[-3000:]
    assert "status 2" in said and not run.exists(), said[-3000:]


NOTEBOOK_PLUGIN = """
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config
register_algo_config("nb-algo")(DummyAlgoConfig)
register_algo("nb-algo")(type("NbAlgo", (DummyAlgorithm,), {}))
"""


def test_the_readme_says_to_use_main_not_percent_run_whose_copy_a_plugin_does_not_reach(kernel, tmp_path):
    section = readme()[readme().index("## In a notebook"):readme().index("## Your own environment")]
    assert re.search(r"Not `%run plugrl_min\.py \.\.\.`: it\s+runs a second copy of the file, which a plug-in's\s+"
                     r"registrations do not reach; use `main\(\[\.\.\.\]\)`", section), section
    write_plugin(tmp_path, "plugrl_test_nb_algo", NOTEBOOK_PLUGIN)
    words = [*notebook_words(tmp_path / "run", 2048, "nb-algo"), "--plugin", "plugrl_test_nb_algo"]
    said = kernel.run(f"import plugrl_test_nb_algo\nprint('status', plugrl_min.main({words!r}))")
    assert "status 0" in said, said[-3000:]
    said = kernel.run(f"%run {SOURCE} {' '.join(words[:-4])} --run-dir {tmp_path / 'other'} --plugin plugrl_test_nb_algo")
    assert "error: unknown algorithm 'nb-algo'" in said, said[-3000:]


def test_start_with_a_usage_error_raises_and_names_the_status_after_the_one_line_error(capsys):
    with pytest.raises(RuntimeError, match=r"exit status 2"):
        plugrl_min.start(["dummy-policy", "default", "no-such-algo", "default"])
    assert "error: unknown algorithm 'no-such-algo'" in capsys.readouterr().err


BROKEN_ALGO = """
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config
register_algo_config("broken")(DummyAlgoConfig)

@register_algo("broken")
class Broken(DummyAlgorithm):
    def __init__(self, config, policy):
        raise ValueError("no weights for you")
"""
TWICE_REGISTERED = """
from plugrl_min import PGConfig, register_algo_config
register_algo_config("pg")(type("TwiceConfig", (PGConfig,), {}))
"""


@pytest.mark.parametrize("failure, words, line, status", [
    ("building", ["broken", "default", "--plugin", "plugrl_test_broken"],
     "error: building algorithm 'broken' from its config failed (the traceback above says why)", 1),
    ("resume", ["dummy", "default", "--resume", "--run-dir", "EMPTY"], "error: no loadable checkpoint in ", 1),
    ("missing plug-in", ["dummy", "default", "--plugin", "plugrl_test_not_there"],
     "error: cannot import plug-in 'plugrl_test_not_there'", 2),
    ("registered twice", ["dummy", "default", "--plugin", "plugrl_test_twice"],
     "error: algorithm config pg/default is registered twice, by plugrl_min and by plugrl_test_twice", 2)])
def test_start_fails_before_serving_as_main_does_then_raises_naming_the_status(failure, words, line, status, tmp_path,
                                                                              plugins_in_process, capsys):
    write_plugin(tmp_path, "plugrl_test_broken", BROKEN_ALGO)
    write_plugin(tmp_path, "plugrl_test_twice", TWICE_REGISTERED)
    (tmp_path / "EMPTY").mkdir()
    words = ["dummy-policy", "default", *[str(tmp_path / word) if word == "EMPTY" else word for word in words],
             "--port", "0"]
    assert plugrl_min.main(words) == status
    by_main = capsys.readouterr().err
    assert line in by_main.splitlines()[-1], by_main
    with pytest.raises(RuntimeError) as stop:
        plugrl_min.start(words)
    by_start = capsys.readouterr().err
    assert by_start.splitlines()[-1] == by_main.splitlines()[-1], by_start
    reason = by_main.splitlines()[-1].removeprefix("error: ")  # the exception says it too
    assert str(stop.value) == f"the run did not start (exit status {status}): {reason}"


# =============================================================================================
# [pendulum] pendulum-v1: Gymnasium's Pendulum-v1, in numpy
# =============================================================================================

@pytest.mark.parametrize("th, thdot", [
    (1.0, 0.5),  # plain steps
    (1.5, 7.9),  # speed clipped at +8
    (4.0, -7.95),  # angle normalized for the cost, speed clipped at -8
    (-3.1, 0.0),  # hanging near the bottom, across the ±π wrap
])
def test_pendulum_v1_steps_as_gymnasiums_pendulum_v1_for_a_whole_episode(th, thdot):
    gymnasium = gymnasium_or_skip()
    theirs = gymnasium.make("Pendulum-v1")  # with its time limit
    theirs.reset(seed=0)
    theirs.unwrapped.state = np.array([th, thdot])
    ours = make_env("pendulum-v1", 1, seed=0)
    ours.reset()
    ours.theta[:], ours.theta_dot[:] = th, thdot
    actions = np.random.default_rng(0).uniform(-1.5, 1.5, 200)  # past [-1, 1] too: both clip the torque at 2
    for step, action in enumerate(actions):
        obs, reward, terminated, truncated, _ = theirs.step(np.array([2.0 * action]))  # torque = 2 * a
        our_obs, our_reward, our_terminated, our_truncated, _ = ours.step(np.array([[action]]))
        np.testing.assert_allclose(our_obs["states"]["state"][0], obs, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
        assert our_reward[0] == pytest.approx(reward, rel=1e-5, abs=1e-6), step
        assert (bool(our_terminated[0]), bool(our_truncated[0])) == (terminated, truncated), step
    assert truncated  # the 200th step ends both


def test_pendulum_known_step_by_hand():
    """th=1, thdot=0.5, a=0.3 (u=0.6): reward -(1 + 0.025 + 0.00036); newthdot = 0.5 + (15 sin 1 + 1.8) 0.05."""
    env = make_env("pendulum-v1", 1)
    env.reset()
    env.theta[:], env.theta_dot[:] = 1.0, 0.5
    obs, reward, *_ = env.step(np.array([[0.3]]))
    assert reward[0] == pytest.approx(-1.02536, rel=1e-6)
    newthdot = 1.2211032386
    newth = 1.0 + newthdot * 0.05
    np.testing.assert_allclose(obs["states"]["state"][0], [math.cos(newth), math.sin(newth), newthdot], rtol=1e-6)


def test_pendulum_truncates_after_200_steps():
    env = make_env("pendulum-v1", 1, seed=0)
    env.reset()
    for _ in range(199):
        _, _, terminated, truncated, info = env.step(np.zeros((1, 1)))
        assert not terminated[0] and not truncated[0]
    _, _, terminated, truncated, info = env.step(np.zeros((1, 1)))
    assert truncated[0] and not terminated[0]
    assert info["episode"]["mask"][0] and info["episode"]["l"][0] == 200


@pytest.mark.parametrize("theta, succeeded", [(0.05, False), (-0.45, True)])
def test_a_pendulum_episode_succeeds_if_it_ends_upright_within_0_1(theta, succeeded):
    env = make_env("pendulum-v1", 1, seed=0)
    env.reset()
    env.episode_length[:] = 199  # the next step is the last
    env.theta[:], env.theta_dot[:] = theta, 8.0  # it moves by 0.4 in the step: from 0.05 to 0.45, or to -0.05
    _, _, _, truncated, info = env.step(np.zeros((1, 1)))
    assert truncated[0] and bool(info["episode"]["s"][0]) == succeeded


# =============================================================================================
# [cartpole] cartpole-v1: Gymnasium's CartPole-v1 in numpy, and the policy's variant
# =============================================================================================

def test_cartpole_v1_steps_as_gymnasiums_cartpole_v1():
    gymnasium = gymnasium_or_skip()
    theirs = gymnasium.make("CartPole-v1").unwrapped
    theirs.reset(seed=0)
    ours = make_env("cartpole-v1", 1, seed=0)
    ours.reset()
    actions = np.random.default_rng(0).integers(0, 2, 400)
    endings = 0
    for action in actions:
        theirs.state = ours.state[0].copy()  # the same state, then the same action
        obs, reward, terminated, _, _ = theirs.step(int(action))
        our_obs, our_reward, our_terminated, _, _ = ours.step(np.array([[action]]))
        np.testing.assert_array_equal(our_obs["states"]["state"][0], obs)
        assert (our_reward[0], our_terminated[0]) == (reward, terminated)
        if terminated:
            endings += 1
            ours.reset()
            theirs.reset()
    assert endings > 5  # the terminations were compared too, not only upright steps


def test_cartpole_v1_truncates_after_500_steps_as_a_success():
    env = make_env("cartpole-v1", 1, seed=0)
    env.reset()
    for step in range(500):
        env.state[:] = 0.0  # held upright: it never falls
        _, reward, terminated, truncated, info = env.step(np.array([[step % 2]]))
    assert reward[0] == 1.0 and not terminated[0] and truncated[0]
    assert info["episode"]["l"][0] == 500 and info["episode"]["s"][0]


def test_probe_v1_counts_steps_keeps_the_action_applied_pays_1_and_ends_env_i_after_3_plus_2_i_mod_3():
    env = make_env("probe-v1", 4, kwargs={"action_dim": 2})  # SPEC 8.1's probe environment
    obs = env.reset()
    assert obs["states"]["t"].tolist() == [[0.0]] * 4 and obs["states"]["a"].shape == (4, 2)
    ends = {}
    for step in range(1, 8):
        action = np.array([[10000 * step + 10 * j, 10000 * step + 10 * j + 1] for j in range(4)], np.float64)
        obs, reward, terminated, truncated, _ = env.step(action, active=[i not in ends for i in range(4)])
        assert obs["states"]["a"][[i for i in range(4) if i not in ends]].tolist() == [
            action[i].tolist() for i in range(4) if i not in ends]
        ends.update({i: step for i in np.flatnonzero(terminated) if i not in ends})
        assert not truncated.any() and reward.tolist() == [float(i not in ends or ends[i] == step) for i in range(4)]
    assert ends == {0: 3, 1: 5, 2: 7, 3: 3} and obs["states"]["t"][:, 0].tolist() == [3.0, 5.0, 7.0, 3.0]
    assert obs["states"]["t"].dtype == obs["states"]["a"].dtype == np.float64
    assert env.reset([0])["states"]["t"][0, 0] == 0.0  # the client resets it, never its step


@wire
def test_a_categorical_policy_server_runs_cartpole_episodes_over_the_wire(tmp_path, capsys):
    algo = dummy_algo(make_policy("categorical-policy", variant="cartpole"), 400)

    async def script(port, server):
        return await env_client_in_process("cartpole-v1", "--server-port", port, "--num-envs", "4",
                                           "--num-episodes", "0")

    status, client_status = run_server(algo, tmp_path, script)
    assert status == 0 and client_status == 0, capsys.readouterr().err
    assert "the server ended the run |" in capsys.readouterr().out
    end = read_metrics(tmp_path, event="end")[0]
    assert end["step"] == 400
    assert sum(line["rollout/episodes"] for line in read_metrics(tmp_path, event=None)) > 0


# =============================================================================================
# [gym] gym:ENV_ID: a Gymnasium environment with Box or Discrete actions
# =============================================================================================
# A test of gymnasium skips only when gymnasium is not installed.

def test_gym_cartpoles_choices_push_the_cart_as_they_push_gymnasiums_own_cartpole_v1():
    gymnasium = gymnasium_or_skip()
    env = make_env("gym:CartPole-v1", 2, seed=0)
    assert (env.num_actions, env.action_dim, env.max_steps) == (2, 1, 500)
    executor = MultiAction(env)
    executor.reset()
    theirs = [gymnasium.make("CartPole-v1") for _ in range(2)]

    def same_start(i):  # Gymnasium's CartPole from the state our environment i starts in
        theirs[i].reset(seed=0)
        theirs[i].unwrapped.state = np.array(env.envs[i].unwrapped.state, np.float64)

    for i in range(2):
        same_start(i)
    rng, endings = np.random.default_rng(0), 0
    for _ in range(300):
        choices = rng.integers(0, 2, 2)  # each environment its own
        speed = executor.obs["states"]["state"][:, 1].copy()  # x'
        obs, reward, terminated, truncated, _ = executor.step(choices.reshape(2, 1, 1))
        for i, choice in enumerate(choices.tolist()):
            expected, expected_reward, ended, cut, _ = theirs[i].step(choice)
            np.testing.assert_array_equal(obs["states"]["state"][i], expected)
            assert (reward[i], terminated[i], truncated[i]) == (expected_reward, ended, cut)
            assert np.sign(obs["states"]["state"][i, 1] - speed[i]) == (1 if choice == 1 else -1)  # 0 pushes left, 1 right
        for i in np.flatnonzero(terminated | truncated):
            executor.reset([i])
            same_start(i)
            endings += 1
    assert endings > 5  # episode ends and the starts after them were compared too


def test_gym_environment_with_another_action_space_is_refused_naming_it():
    gymnasium = gymnasium_or_skip()

    class TwoKnobs(gymnasium.Env):
        observation_space = gymnasium.spaces.Box(-1, 1, (2,))
        action_space = gymnasium.spaces.MultiDiscrete([3, 3])

    if "TwoKnobs-v0" not in gymnasium.registry:
        gymnasium.register("TwoKnobs-v0", entry_point=TwoKnobs)
    with pytest.raises(plugrl_min.UsageError, match="has a MultiDiscrete action space; plugrl_min runs Box and Discrete"):
        make_env("gym:TwoKnobs-v0", 1)


def test_an_unknown_gym_id_is_a_one_line_usage_error_at_the_servers_start(tmp_path):
    gymnasium_or_skip()
    status, _, err = run_main("dummy-policy", "default", "pg", "default", "--local-env", "gym:NoSuchTask-v0",
                              "--local-env-clients", "1", "--run-dir", str(tmp_path / "run"))
    (line,) = err.strip().splitlines()  # not gymnasium's traceback
    assert status == 2 and "gym:NoSuchTask-v0" in line and "NoSuchTask" in line.split("gym:NoSuchTask-v0", 1)[1]
    assert not (tmp_path / "run").exists()


def test_gym_environment_without_gymnasium_says_which_package_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "gymnasium", None)  # as if it were not installed: its import fails
    with pytest.raises(plugrl_min.CommandError, match="pip install gymnasium"):
        make_env("gym:Pendulum-v1", 1)


# --- Gymnasium environments of the tests, registered once per process -------------------------

def core_env_class(observation_space, observe, reward=100.0, limit=None):
    """A Gymnasium Env class: observe(t) is the observation after t steps; reward each step; it never
    terminates, and truncates itself after `limit` steps (None: never)."""
    import gymnasium

    class Core(gymnasium.Env):
        action_space = gymnasium.spaces.Box(-1, 1, (1,), np.float32)

        def __init__(self, reward=reward):
            self.observation_space, self.reward, self.t = observation_space, reward, 0

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.t = 0
            return observe(0), {}

        def step(self, action):
            self.t += 1
            return observe(self.t), self.reward, False, limit is not None and self.t >= limit, {}

    return Core


def register_once(env_id: str, entry_point, **kwargs) -> str:
    import gymnasium
    if env_id not in gymnasium.registry:
        gymnasium.register(env_id, entry_point=entry_point, **kwargs)
    return f"gym:{env_id}"


def state_env(**kwargs) -> str:
    """A core of float32 [2] observations, reward 100 a step (kwarg reward=), registered as is."""
    gymnasium_or_skip()
    from gymnasium.spaces import Box
    core = core_env_class(Box(-10, 10, (2,), np.float32), lambda t: np.full(2, t, np.float32))
    return register_once("PlugrlCore-v0", core, **kwargs)


def dict_image_env() -> str:
    """Dict observations: a uint8 [8, 8, 3] picture ("camera") and a float32 [2] ("position")."""
    gymnasium_or_skip()
    from gymnasium.spaces import Box, Dict

    def observe(t):
        return {"camera": np.full((8, 8, 3), t % 256, np.uint8), "position": np.full(2, t, np.float32)}

    space = Dict({"camera": Box(0, 255, (8, 8, 3), np.uint8), "position": Box(-1e3, 1e3, (2,), np.float32)})
    # A time limit, so that episodes end and pg and sac see finished episodes.
    return register_once("PlugrlDictImage-v0", core_env_class(space, observe, reward=-1.0), max_episode_steps=20)


# --- gym:ID as gymnasium.make makes it ---------------------------------------------------------

def test_a_registered_gym_env_whose_entry_point_wraps_its_core_reports_the_wrapped_rewards():
    state_env()
    import gymnasium

    def scaled():  # the registered task is the core's reward over 100
        return gymnasium.wrappers.TransformReward(gymnasium.make("PlugrlCore-v0"), lambda reward: reward / 100)

    env = make_env(register_once("PlugrlScaled-v0", scaled), 2, seed=0)
    env.reset()
    _, reward, _, _, _ = env.step(np.zeros((2, 1), np.float32))
    assert reward.tolist() == [1.0, 1.0]


def test_a_gym_envs_own_time_limit_truncates_it_and_does_not_terminate_it():
    gymnasium_or_skip()
    from gymnasium.spaces import Box
    # The simulator keeps its own clock: no max_episode_steps in its registration for a TimeLimit to read.
    core = core_env_class(Box(-10, 10, (2,), np.float32), lambda t: np.zeros(2, np.float32), limit=3)
    env = make_env(register_once("PlugrlLimited-v0", core), 1, seed=0)
    env.reset()
    flags = [env.step(np.zeros((1, 1), np.float32))[2:4] for _ in range(3)]
    assert [(bool(terminated[0]), bool(truncated[0])) for terminated, truncated in flags] == [
        (False, False), (False, False), (False, True)]


def test_keyword_arguments_reach_gymnasium_make():
    env = make_env(state_env(), 1, seed=0, kwargs={"reward": 7.0})
    env.reset()
    assert env.step(np.zeros((1, 1), np.float32))[1].tolist() == [7.0]


def test_keyword_arguments_reach_a_registered_vecenvs_constructor(monkeypatch):
    class Scaled(plugrl_min.DummyEnv):
        def __init__(self, num_envs, seed=None, scale=1.0):
            self.scale = scale
            super().__init__(num_envs, seed)

    monkeypatch.setitem(plugrl_min.ENVIRONMENTS, "plugrl-test-scaled-v0", Scaled)
    assert make_env("plugrl-test-scaled-v0", 1, kwargs={"scale": 3.0}).scale == 3.0


def test_a_keyword_argument_the_environment_does_not_take_is_one_line_naming_it():
    with pytest.raises(plugrl_min.UsageError, match=r"refused the keyword arguments \{'no_such': 1\}"):
        make_env(state_env(), 1, kwargs={"no_such": 1})


def test_gym_module_colon_id_imports_the_module_that_registers_the_env(tmp_path, monkeypatch):
    gymnasium_or_skip()
    (tmp_path / "plugrl_test_gym_module.py").write_text(
        "import gymnasium\n"
        "gymnasium.register('PlugrlFromModule-v0', entry_point='gymnasium.envs.classic_control:PendulumEnv',"
        " max_episode_steps=5)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_env("gym:plugrl_test_gym_module:PlugrlFromModule-v0", 1, seed=0)
    assert env.obs_spec == {"images": {}, "states": {"state": ((3,), "float32")}} and env.max_steps == 5


GYM_MODULE = '''
import gymnasium
import numpy as np
from gymnasium.spaces import Box, Dict


class Task(gymnasium.Env):
    """A few steps of an observation made of zeros; reward -1 a step, ended by the time limit."""

    action_space = Box(-1, 1, (1,), np.float32)

    def __init__(self, space):
        self.observation_space = space

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observe(), {}

    def step(self, action):
        return self.observe(), -1.0, False, False, {}

    def observe(self):  # zeros, in the space's own structure and dtypes
        space = self.observation_space
        return gymnasium.spaces.utils.unflatten(space, np.zeros(gymnasium.spaces.utils.flatdim(space)))


class Pend(Task):
    def __init__(self):
        super().__init__(Box(-1, 1, (3,), np.float32))


class DictImage(Task):
    def __init__(self):
        super().__init__(Dict({"camera": Box(0, 255, (8, 8, 3), np.uint8), "position": Box(-1, 1, (2,))}))


class ChannelFirst(Task):
    def __init__(self):
        super().__init__(Box(0, 255, (3, 8, 6), np.uint8))


for name in ("Pend", "DictImage", "ChannelFirst"):
    gymnasium.register(f"My{name}-v0", entry_point=f"plugrl_test_gym_mod:{name}", max_episode_steps=5)
'''


@pytest.mark.parametrize("env_id", ["MyPend-v0", "MyDictImage-v0", "MyChannelFirst-v0"])
def test_gym_module_colon_id_runs_end_to_end_with_a_local_client(tmp_path, env_id):
    gymnasium_or_skip()
    write_plugin(tmp_path, "plugrl_test_gym_mod", GYM_MODULE)  # on the children's PYTHONPATH, not imported here
    result = python("plugrl_min.py", "dummy-policy", "default", "dummy", "default", "--local-env",
                    f"gym:plugrl_test_gym_mod:{env_id}", "--local-env-clients", "1", "--algo.global-steps", "40",
                    "--port", "0", "--run-dir", str(tmp_path / "run"), pythonpath=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr
    assert read_metrics(tmp_path / "run", "end")[0]["rollout/episodes"] == 8  # 40 steps of 5-step episodes


# --- observations as the environment gives them -------------------------------------------------

def test_a_box_image_observation_is_the_key_image_and_stays_uint8_h_w_c():
    gymnasium_or_skip()
    from gymnasium.spaces import Box
    core = core_env_class(Box(0, 255, (6, 8, 3), np.uint8), lambda t: np.full((6, 8, 3), 200 + t, np.uint8))
    env = make_env(register_once("PlugrlImage-v0", core), 2, seed=0)
    assert env.obs_spec == {"images": {"image": ((6, 8, 3), "uint8")}, "states": {}}
    image = env.reset()["images"]["image"]
    assert image.dtype == np.uint8 and image.shape == (2, 6, 8, 3) and image.max() == 200


def test_a_channel_first_uint8_box_is_the_camera_image_transposed_to_h_w_c():
    gymnasium_or_skip()
    from gymnasium.spaces import Box
    picture = np.arange(3 * 8 * 6, dtype=np.uint8).reshape(3, 8, 6)  # [c, h, w]
    core = core_env_class(Box(0, 255, (3, 8, 6), np.uint8), lambda t: picture)
    env = make_env(register_once("PlugrlImageCHW-v0", core), 2, seed=0)
    assert env.obs_spec == {"images": {"image": ((8, 6, 3), "uint8")}, "states": {}}
    np.testing.assert_array_equal(env.reset()["images"]["image"][1], picture.transpose(1, 2, 0))


def test_a_2d_uint8_box_is_a_state_not_a_camera():
    gymnasium_or_skip()
    from gymnasium.spaces import Box
    core = core_env_class(Box(0, 255, (8, 6), np.uint8), lambda t: np.full((8, 6), 200 + t, np.uint8))
    env = make_env(register_once("PlugrlImageHW-v0", core), 2, seed=0)
    assert env.obs_spec == {"images": {}, "states": {"state": ((8, 6), "uint8")}}
    assert env.reset()["states"]["state"].shape == (2, 8, 6)


def test_a_text_entry_of_a_dict_is_the_observations_text():
    gymnasium_or_skip()
    from gymnasium.spaces import Box, Dict, Text
    space = Dict({"goal": Text(20), "position": Box(-1, 1, (2,))})
    core = core_env_class(space, lambda t: {"goal": f"reach {t}", "position": np.zeros(2, np.float32)})
    env = make_env(register_once("PlugrlText-v0", core), 2, seed=0)
    assert env.obs_spec == {"images": {}, "states": {"position": ((2,), "float32")}}
    assert env.reset()["text"].tolist() == ["reach 0", "reach 0"]
    obs = env.step(np.zeros((2, 1), np.float32))[0]
    assert obs["text"].dtype.kind == "U" and obs["text"].tolist() == ["reach 1", "reach 1"]


@pytest.mark.parametrize("low, high", [(-np.inf, np.inf), (0.0, np.inf)])
def test_an_unbounded_box_action_is_refused_before_serving_in_one_line(tmp_path, low, high):
    gymnasium_or_skip()
    from gymnasium.spaces import Box
    core = core_env_class(Box(-1, 1, (2,), np.float32), lambda t: np.zeros(2, np.float32))
    core.action_space = Box(low, high, (1,), np.float32)
    env_id = register_once(f"PlugrlUnbounded{int(low == 0)}-v0", core)
    status, out, err = run_main("dummy-policy", "default", "pg", "default", "--local-env", env_id,
                                "--local-env-clients", "1", "--run-dir", tmp_path / "run")
    assert status == 2 and "listening" not in out, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"error: {env_id} has an unbounded Box action space ")
    assert line.endswith("[-1, 1] is scaled to its bounds; wrap it in one with finite bounds")


def test_a_float64_box_observation_stays_float64_with_its_shape():
    gymnasium_or_skip()
    from gymnasium.spaces import Box
    fine = 1 + 1e-12  # lost in float32

    core = core_env_class(Box(-10, 10, (2, 2), np.float64), lambda t: np.full((2, 2), fine))
    env = make_env(register_once("PlugrlFloat64-v0", core), 1, seed=0)
    assert env.obs_spec == {"images": {}, "states": {"state": ((2, 2), "float64")}}
    state = env.reset()["states"]["state"]
    assert state.dtype == np.float64 and state.shape == (1, 2, 2) and state[0, 0, 0] == fine


def test_a_dict_observation_gives_one_key_per_entry_each_in_its_dtype():
    env = make_env(dict_image_env(), 2, seed=0)
    assert env.obs_spec == {"images": {"camera": ((8, 8, 3), "uint8")}, "states": {"position": ((2,), "float32")}}
    env.reset()
    obs = env.step(np.zeros((2, 1), np.float32))[0]
    camera = obs["images"]["camera"]
    assert camera.dtype == np.uint8 and camera.shape == (2, 8, 8, 3) and camera.max() == 1
    assert obs["states"]["position"].tolist() == [[1.0, 1.0], [1.0, 1.0]] and obs["text"].tolist() == ["", ""]


def test_a_dict_nested_in_a_dict_is_joined_as_outer_dot_inner():
    gymnasium_or_skip()
    from gymnasium.spaces import Box, Dict
    space = Dict({"arm": Dict({"angle": Box(-4, 4, (2,)), "speed": Box(-9, 9, (1,))}), "goal": Box(-9, 9, (2,))})

    def observe(t):
        return {"arm": {"angle": np.array([1, 2], np.float32), "speed": np.array([3], np.float32)},
                "goal": np.array([4, 5], np.float32)}

    env = make_env(register_once("PlugrlNested-v0", core_env_class(space, observe)), 1, seed=0)
    states = env.reset()["states"]
    assert sorted(states) == ["arm.angle", "arm.speed", "goal"]
    assert [states[key].tolist() for key in sorted(states)] == [[[1, 2]], [[3]], [[4, 5]]]


def test_a_dict_nested_two_levels_is_refused_in_one_line_naming_the_entry():
    gymnasium_or_skip()
    from gymnasium.spaces import Box, Dict
    space = Dict({"a": Dict({"b": Dict({"c": Box(-1, 1, (1,))})})})
    env_id = register_once("PlugrlDeep-v0", core_env_class(space, lambda t: space.sample()))
    with pytest.raises(plugrl_min.UsageError) as stop:
        make_env(env_id, 1)
    (line,) = str(stop.value).splitlines()
    assert "a Dict observation space (its entry 'a.b')" in line and "register_env" in line


def test_a_discrete_observation_is_a_one_hot_float32():
    gymnasium_or_skip()
    from gymnasium.spaces import Discrete
    core = core_env_class(Discrete(4, start=10), lambda t: 10 + (2 + t) % 4)
    env = make_env(register_once("PlugrlDiscrete-v0", core), 1, seed=0)
    assert env.obs_spec == {"images": {}, "states": {"state": ((4,), "float32")}}
    assert env.reset()["states"]["state"].tolist() == [[0, 0, 1, 0]]
    assert env.step(np.zeros((1, 1), np.float32))[0]["states"]["state"].tolist() == [[0, 0, 0, 1]]


def test_a_tuple_observation_is_refused_before_serving_in_one_line_naming_it():
    gymnasium_or_skip()
    from gymnasium.spaces import Box, Tuple
    space = Tuple((Box(-1, 1, (1,)), Box(-1, 1, (2,))))
    env_id = register_once("PlugrlTuple-v0", core_env_class(space, lambda t: space.sample()))
    with pytest.raises(plugrl_min.UsageError) as stop:
        make_env(env_id, 1)
    (line,) = str(stop.value).splitlines()
    assert line.startswith("gym:PlugrlTuple-v0 has a Tuple observation space;")
    assert "write a VecEnv" in line and "register_env" in line


# --- pg and sac over the wire on an observation with an image, a task only the picture solves -----

class PictureSide(plugrl_min.VecEnv):
    """One decision an episode, rewarded a * side: the picture's bright half says the side, -1 or 1, and
    the position says nothing. Random or blind actions average 0; a policy that reads the picture, 1."""

    obs_spec = {"images": {"camera": ((8, 8, 3), "uint8")}, "states": {"position": ((2,), "float32")}}
    action_dim, max_steps = 1, 1

    def __init__(self, num_envs, seed=None):
        self.side = np.ones(num_envs)
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.side[rows] = self.rng.choice([-1.0, 1.0], len(rows))

    def _step(self, action, rows):
        reward = np.clip(action[:, 0], -1, 1) * self.side[rows]
        return reward, np.ones(len(rows), bool), reward > 0

    def _observe(self):
        camera = np.zeros((self.num_envs, 8, 8, 3), np.uint8)
        camera[self.side < 0, :, :4] = 255
        camera[self.side > 0, :, 4:] = 255
        return observation(self.num_envs, states={"position": np.zeros((self.num_envs, 2), np.float32)},
                           images={"camera": camera})


def gym_picture_side() -> str:
    """PictureSide as a Gymnasium Dict: a channel-first uint8 camera [3, 8, 8] and a position."""
    gymnasium_or_skip()
    import gymnasium
    from gymnasium.spaces import Box, Dict

    class GymPictureSide(gymnasium.Env):
        observation_space = Dict({"camera": Box(0, 255, (3, 8, 8), np.uint8),
                                  "position": Box(-1, 1, (2,), np.float32)})
        action_space = Box(-1, 1, (1,), np.float32)

        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            self.side = self.np_random.choice([-1.0, 1.0])
            camera = np.zeros((3, 8, 8), np.uint8)
            camera[:, :, :4] = 255 * (self.side < 0)  # the bright half of its width: channel-first
            camera[:, :, 4:] = 255 * (self.side > 0)
            return {"camera": camera, "position": np.zeros(2, np.float32)}, {}

        def step(self, action):
            reward = float(np.clip(action[0], -1, 1) * self.side)
            return self.reset()[0], reward, True, False, {"is_success": reward > 0}

    return register_once("PlugrlPictureSide-v0", GymPictureSide)


@pytest.mark.parametrize("uid, least, env", [("pg", 0.8, "VecEnv"), ("sac", 0.4, "VecEnv"), ("pg", 0.8, "gym")])
@wire
def test_pg_and_sac_learn_over_the_wire_a_task_only_the_picture_solves(tmp_path, monkeypatch, uid, least, env):
    monkeypatch.setitem(plugrl_min.ENVIRONMENTS, "plugrl-test-picture-v0", PictureSide)
    env_id = "plugrl-test-picture-v0" if env == "VecEnv" else gym_picture_side()
    spec = plugrl_min.obs_spec_as_json(make_env(env_id).obs_spec)
    assert spec == plugrl_min.obs_spec_as_json(PictureSide.obs_spec)  # a camera [8, 8, 3] and a position
    torch.manual_seed(1)
    policy = make_policy("dummy-policy", plugrl_min.DummyPolicyConfig(hidden_size=32, obs_spec=spec))
    config = (plugrl_min.PGConfig(global_steps=3000, frames_per_learn=64, policy_lr=3e-3) if uid == "pg" else
              sac_example.SACConfig(global_steps=1200, learning_starts=100, batch_size=32, q_hidden_size=32))
    algo = make_algo(uid, policy, config)
    algo.init_optimizers()

    async def script(port, server):
        return await env_client_in_process(env_id, "--server-port", port, "--num-envs", "16",
                                           "--num-episodes", "0", "--seed", "1")

    threads = torch.get_num_threads()
    try:
        assert run_server(algo, tmp_path / "run", script, learn_threads=1, log_every=64) == (0, 0)
    finally:
        torch.set_num_threads(threads)
    (last,) = plugrl_min.return_curve(read_metrics(tmp_path / "run", None), episodes=200)[-1:]
    assert last[1] >= least  # the position is all zeros: only the picture tells the side


# =============================================================================================
# [eval] `python plugrl_min.py eval RUN_DIR`: a trained policy, evaluated and watched
# =============================================================================================
# The run's policy acts (greedily unless --stochastic) on its own environment; nothing learns, nothing is written
# into the run; --serve puts it behind a server of its own for env clients; --video records Gymnasium episodes.

@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """A short pg run on dummy-v1, in this process (--in-process), to evaluate: its newest three checkpoints."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    with deadline_of("the trained run", 120):
        status, _, err = run_main("dummy-policy", "default", "pg", "default", "--policy.hidden-size", "16",
                                  "--in-process", "--local-num-envs", "8", "--algo.frames-per-learn", "256",
                                  "--algo.save-every", "1", "--algo.global-steps", "1024", "--seed", "1",
                                  "--run-dir", run_dir)
    assert status == 0, err
    return run_dir


def eval_line(*words) -> str:
    status, out, err = run_main("eval", *map(str, words))
    assert status == 0, err
    (line,) = out.strip().splitlines()
    return line


def test_eval_prints_one_line_of_episodes_mean_return_spread_min_and_max(trained_run):
    line = eval_line(trained_run, "--episodes", "4", "--seed", "2")
    match = re.fullmatch(rf"eval {re.escape(str(trained_run))} at step 1,024, greedy, on dummy-v1: 4 episodes \| "
                         r"mean return (\S+) \| std (\S+) \| min (\S+) \| max (\S+)", line)
    assert match, line
    mean, std, low, high = map(float, match.groups())
    assert low <= mean <= high and std >= 0 and high < 0  # dummy-v1 pays -|target - x| a step


def test_eval_leaves_every_file_of_the_run_directory_byte_identical(trained_run):
    before = folder_bytes(trained_run)
    eval_line(trained_run, "--episodes", "2", "--seed", "1")
    eval_line(trained_run, "--episodes", "2", "--stochastic")
    assert folder_bytes(trained_run) == before


def test_two_evals_with_the_same_seed_print_the_same_line_and_another_seed_another(trained_run):
    lines = [eval_line(trained_run, "--episodes", "5", "--stochastic", "--seed", seed) for seed in (3, 3, 4)]
    assert lines[0] == lines[1] != lines[2]


def test_eval_of_a_checkpoint_by_path_acts_with_its_weights(trained_run):
    oldest = plugrl_min.checkpoint_paths(trained_run)[0]
    assert os.path.basename(oldest) != os.path.basename(plugrl_min.checkpoint_paths(trained_run)[-1])
    line = eval_line(trained_run, "--checkpoint", oldest, "--episodes", "2", "--seed", "1")
    assert line.startswith(f"eval {trained_run} at step {int(os.path.basename(oldest)[5:-3]):,}, greedy")


NO_GREEDY_POLICY = '''
import dataclasses
import plugrl_min
from plugrl_min import DummyPolicy, register_policy, register_policy_config


@register_policy_config("plugrl-test-sampler")
@dataclasses.dataclass
class SamplerConfig:
    hidden_size: int = 16


@register_policy("plugrl-test-sampler")
class Sampler(plugrl_min.BaseTorchPolicy):  # dummy-policy's sampling, without get_greedy_action
    def __init__(self, config):
        super().__init__()
        self.inner = DummyPolicy(plugrl_min.DummyPolicyConfig(hidden_size=config.hidden_size))
        self.obs_spec, self.action_dim = self.inner.obs_spec, self.inner.action_dim

    def get_action_and_runtime_state(self, obs):
        return self.inner.get_action_and_runtime_state(obs)

    def fake_runtime_state(self, n):
        return self.inner.fake_runtime_state(n)

    def forward(self, obs):
        return self.inner(obs)
'''


def test_eval_of_a_policy_without_a_greedy_action_samples_saying_so_in_one_line(tmp_path, plugins_in_process):
    write_plugin(tmp_path, "plugrl_test_sampler", NO_GREEDY_POLICY)
    status, _, err = run_main("plugrl-test-sampler", "default", "dummy", "default", "--plugin", "plugrl_test_sampler",
                              "--in-process", "--algo.global-steps", "100", "--run-dir", tmp_path / "run")
    assert status == 0, err
    status, out, err = run_main("eval", tmp_path / "run", "--episodes", "2", "--seed", "1")
    assert status == 0, err
    note, line = out.strip().splitlines()
    assert note == "plugrl-test-sampler has no get_greedy_action: evaluated as it samples"
    assert ", sampled, on dummy-v1: 2 episodes |" in line


@wire
def test_eval_serves_the_trained_policy_to_an_env_client_over_the_wire(trained_run, tmp_path):
    before = folder_bytes(trained_run)
    with Background(tmp_path, "eval", ["plugrl_min.py", "eval", str(trained_run), "--serve", "--port", "0",
                                       "--episodes", "6"]) as server:
        port = server.port()
        client = python("plugrl_min.py", "env-client", "dummy-v1", "--server-port", str(port), "--num-envs", "2",
                        "--num-episodes", "0", "--seed", "1")
        assert server.wait(60) == 0, server.stderr()
    assert client.returncode == 0 and client.stdout.startswith("the server ended the run | episodes 6 |")
    served = re.search(r"^eval .* served: 6 episodes \| mean return (\S+) \|", server.stdout(), re.M)
    client_mean = float(re.search(r"mean return (\S+)", client.stdout).group(1))
    assert served and float(served.group(1)) == pytest.approx(client_mean, abs=0.01)
    assert folder_bytes(trained_run) == before  # its record is its own: runs/eval-*, not the trained run's


def test_eval_serve_from_a_notebook_cell_is_a_one_line_usage_error(trained_run):
    async def cell():  # a notebook's kernel runs its cells inside an event loop of its own
        return run_main("eval", trained_run, "--serve", "--port", "0")
    status, _, err = asyncio.run(cell())
    assert status == 2 and err.strip().splitlines() == ["error: eval --serve runs from a shell, not a notebook cell"]


def test_eval_without_an_environment_to_play_is_a_one_line_usage_error(tmp_path):
    run_dir = tmp_path / "run"
    status, _, err = run_main("dummy-policy", "default", "dummy", "default", "--in-process",
                              "--algo.global-steps", "100", "--run-dir", run_dir)
    assert status == 0, err
    config = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**config, "env": None}))  # as a run of outside clients
    status, _, err = run_main("eval", run_dir)
    assert status == 2 and err.strip().splitlines() == [
        f"error: {run_dir}'s config.json names no environment (its run had no local env clients): name one with "
        "--env ENV_ID"]


def test_eval_video_of_an_environment_that_draws_no_frames_is_a_one_line_usage_error(trained_run, tmp_path):
    status, _, err = run_main("eval", trained_run, "--video", tmp_path / "videos")
    assert status == 2 and err.strip().splitlines() == [
        "error: --video records a gym:ENV_ID environment, which draws its own frames; DummyEnv draws none"]
    assert not (tmp_path / "videos").exists()


def test_eval_records_each_gymnasium_episode_as_a_video_outside_the_run(tmp_path):
    gymnasium_or_skip()
    pytest.importorskip("moviepy", reason="moviepy is not installed (pip install moviepy)")
    pytest.importorskip("pygame", reason="pygame is not installed (pip install pygame): CartPole draws with it")
    run_dir = tmp_path / "run"
    status, _, err = run_main("categorical-policy", "default", "dummy", "default", "--local-env",
                              "gym:CartPole-v1", "--in-process", "--algo.global-steps", "50", "--run-dir", run_dir)
    assert status == 0, err
    before = folder_bytes(run_dir)
    eval_line(run_dir, "--episodes", "2", "--seed", "1", "--video", tmp_path / "videos")
    assert sorted(os.listdir(tmp_path / "videos")) == ["env0-episode-0.mp4", "env0-episode-1.mp4"]
    assert all(os.path.getsize(tmp_path / "videos" / name) > 1000 for name in os.listdir(tmp_path / "videos"))
    assert folder_bytes(run_dir) == before


def test_eval_video_without_moviepy_is_one_line_naming_it(tmp_path, monkeypatch):
    gymnasium_or_skip()
    run_dir = tmp_path / "run"
    status, _, err = run_main("categorical-policy", "default", "dummy", "default", "--local-env",
                              "gym:CartPole-v1", "--in-process", "--algo.global-steps", "50", "--run-dir", run_dir)
    assert status == 0, err
    monkeypatch.setitem(sys.modules, "moviepy", None)  # as if it were not installed: its import fails
    status, _, err = run_main("eval", run_dir, "--video", tmp_path / "videos")
    assert status == 1 and err.strip().splitlines() == [
        "error: --video needs moviepy, which writes the files: pip install moviepy"]


# =============================================================================================
# README.md: the reading map, the file's shape, every command it shows, its tables and its client
# =============================================================================================
# The handout checks (`handout`, PLUGRL_CHECK_HANDOUT=1) hold README.md and the file's layout to each
# other: CI runs them; a student's edit of plugrl_min.py need not pass them.

# --- The reading map: the first reading ends by line 700 and answers its five questions -----------

def readme_map() -> list[tuple[int, int, str, str]]:
    """The rows of README.md's map of the second reading: (first line, last line, what, how it is read)."""
    rows = re.findall(r"^\| (\d+)-(\d+) \| (.+) \| (second|optional) \|$", readme(), re.M)
    return [(int(first), int(last), what, read) for first, last, what, read in rows]


def source_lines() -> list[str]:
    with open(SOURCE) as file:
        return file.read().splitlines()


def banner_line() -> int:
    """The line (1-based) of the comment that ends the first reading."""
    return next(i for i, line in enumerate(source_lines(), 1) if re.match(r"#.*first reading ends", line, re.I))


def map_row_start(what: str, lines: list[str]) -> int:
    """Where a row of the second reading's map starts in plugrl_min.py (0-based), found by what it names,
    not by its numbers: a section (`7. ...`: its `# =====` line) or an optional block (`[trace]...`: its
    `# ===== [trace]` line)."""
    section = re.match(r"(\d+)\. |\[([\w-]+)\]", what)
    assert section, f"the reading map's row {what!r} names no section or block"
    pattern = rf"# ===== {section.group(1)}\. " if section.group(1) else rf"# ===== \[{section.group(2)}\] "
    found = [i for i, line in enumerate(lines) if re.match(pattern, line)]
    assert len(found) == 1, f"the reading map's row {what!r} names {len(found)} banners in plugrl_min.py"
    return found[0]


def map_rows_in_file() -> list[tuple[int, int, str, str]]:
    """The second reading's rows as the file has them: (first line, last line, what, read), in the map's order.
    Every row ends where the next row in file order starts, the first starts after the first reading's banner,
    and the last ends with the file: together they cover the second reading, each line once."""
    lines = source_lines()
    rows = readme_map()
    starts = [map_row_start(what, lines) for _, _, what, _ in rows]
    firsts = sorted(starts)
    ends = dict(zip(firsts, firsts[1:] + [len(lines)]))
    starts[starts.index(firsts[0])] = banner_line()  # the first row takes the lines after the banner
    ends[banner_line()] = ends.pop(firsts[0])
    return [(start + 1, ends[start], what, read) for start, (_, _, what, read) in zip(starts, rows)]


def first_reading_table() -> list[tuple[str, list[str]]]:
    """README.md's table of the first reading: (section, the names its row gives)."""
    rows = re.findall(r"^\| (the docstring|\d+\. [^|]+?) \| (.+) \|$", readme(), re.M)
    return [(section, re.findall(r"`(\w+)`", names)) for section, names in rows]


def defined_in(lines: list[str], name: str) -> int:
    """The first line (0-based) that defines name: def, class, or an assignment at the start of a line."""
    pattern = rf"\s*(?:async def |def |class ){name}\b|{name}\b.*[:=]"
    found = next((i for i, line in enumerate(lines) if re.match(pattern, line)), None)
    assert found is not None, f"{name} is defined nowhere in plugrl_min.py"
    return found


FIRST_READING_ENDS_BY = 700


@handout
def test_handout_the_first_reading_ends_at_its_banner_by_line_700():
    assert banner_line() <= FIRST_READING_ENDS_BY


@handout
def test_handout_the_readmes_first_reading_names_its_sections_in_order_and_only_what_stands_above_the_banner():
    lines = source_lines()
    table = first_reading_table()
    assert [section.split(".")[0] for section, _ in table[1:]] == ["1", "2", "3", "4", "5", "6"]
    assert table[0][0] == "the docstring"
    for section, names in table[1:]:
        start = next(i for i, line in enumerate(lines) if line.startswith(f"# ===== {section.split('.')[0]}. "))
        assert start < banner_line() and names, section
        for name in names:  # each below its section's banner, and above the first reading's
            assert start < defined_in(lines, name) < banner_line(), f"{name} ({section})"


@handout
def test_handout_the_readme_second_readings_rows_come_in_file_order():
    rows = map_rows_in_file()
    assert [start for start, *_ in rows] == sorted(start for start, *_ in rows)
    assert all((read == "optional") == what.startswith("[") for _, _, what, read in rows)


def defined_at(qualified: str) -> int:
    """The line (1-based) where `Class.method` or `function` is defined in plugrl_min.py."""
    obj = plugrl_min
    for part in qualified.split("."):
        obj = getattr(obj, part)
    return inspect.getsourcelines(obj)[1]


# The five questions a course asks of the file, and where the first reading answers each.
FIVE_QUESTIONS = {
    "where a frame's action comes from, and what decides feedback or discard_feedback": [
        "Server.infer_waiting", "Server.infer_batch", "BaseAlgorithm.infer", "BaseTorchPolicy.get_action_and_runtime_state",
        "route_feedback", "discard_reason", "BaseAlgorithm.on_policy"],
    "what happens to a frame acted by an older policy": [
        "route_feedback", "discard_reason", "BaseAlgorithm.discard_feedback", "BaseAlgorithm.feedback"],
    "when learn runs, on which thread, and why serving pauses": [
        "learn_and_save", "Server.control_loop", "Server.learn_once", "BaseAlgorithm.learn"],
    "what a checkpoint holds and when it is written": [
        "Checkpoint", "learn_and_save", "Server.save", "save_checkpoint", "DummyAlgorithm.create_checkpoint"],
    "what the server does on SIGTERM": ["on_signal", "Server.request_stop", "learn_and_save", "Server.run"],
}


@handout
@pytest.mark.parametrize("question", FIVE_QUESTIONS)
def test_handout_the_first_reading_answers_each_of_the_five_questions(question):
    for name in FIVE_QUESTIONS[question]:
        if name == "BaseAlgorithm.on_policy":  # an attribute: the line that sets it
            line = next(i for i, text in enumerate(open(SOURCE), 1) if text.startswith("    on_policy: bool"))
        else:
            line = defined_at(name)
        assert line < banner_line(), f"{name} (line {line}) is not in the first reading"


# --- The file's shape: functions that read in one sitting, optional blocks a copy can cut ---------

@handout
def test_handout_no_function_is_longer_than_60_lines_and_no_class_than_250():
    too_long = [f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
                for node in ast.walk(ast.parse(open(SOURCE).read()))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                and node.end_lineno - node.lineno + 1 > (250 if isinstance(node, ast.ClassDef) else 60)]
    assert not too_long


OPTIONAL_BLOCKS = ["learn-threads", "ranks", "trace", "tensorboard", "report", "notebook", "pendulum", "cartpole",
                   "gym", "eval"]


def optional_block(lines: list[str], feature: str) -> tuple[range, list[int]]:
    """The block of an optional feature (its banner `# ===== [feature] ...` up to the next banner) and the lines
    elsewhere that belong to it (marked by a trailing comment that starts with `# [feature]`)."""
    (start,) = [i for i, line in enumerate(lines) if line.startswith(f"# ===== [{feature}] ")]
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("# ===== ")), len(lines))
    marked = [i for i, line in enumerate(lines) if re.search(rf"\S.*  # \[{re.escape(feature)}\]( |$)", line)]
    assert all(i not in range(start, end) for i in marked), "a block's own lines need no mark"
    return range(start, end), marked


def names_defined_in(source: str) -> set[str]:
    """The module-level names a piece of the file defines: functions, classes, constants."""
    names = set()
    for node in ast.parse(textwrap.dedent(source)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {target.id for target in targets if isinstance(target, ast.Name)}
    return names


def global_names_by_line(source: str) -> dict[int, set[str]]:
    """Line number (0-based) -> the module-level names read on it: a function's own parameters and
    variables are not (a local `start` is not the function start)."""
    used = {}

    def visit(node, local: frozenset):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs + [
                node.args.vararg, node.args.kwarg]
            bound = {argument.arg for argument in arguments if argument is not None}
            bound |= {sub.id for sub in ast.walk(node) if isinstance(sub, ast.Name) and not isinstance(sub.ctx, ast.Load)}
            local = local | bound
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in local:
            used.setdefault(node.lineno - 1, set()).add(node.id)
        for child in ast.iter_child_nodes(node):
            visit(child, local)

    visit(ast.parse(source), frozenset())
    return used


@handout
@pytest.mark.parametrize("feature", OPTIONAL_BLOCKS)
def test_handout_each_line_that_names_an_optional_blocks_code_is_marked_and_the_core_calls_it_in_3_places_at_most(feature):
    lines = source_lines()
    block, marked = optional_block(lines, feature)
    defined = names_defined_in("\n".join(lines[block.start:block.stop]))
    naming = {i for i, names in global_names_by_line("\n".join(lines)).items() if i not in block and names & defined}
    assert naming <= set(marked), [lines[i] for i in sorted(naming - set(marked))]
    places = [i for i in sorted(naming) if i - 1 not in naming]  # a statement over several lines: one place
    assert len(places) <= 3, [lines[i] for i in places]


def places_of(lines: list[str], numbers: list[int]) -> set[str]:
    """The functions or classes that hold these lines (0-based), innermost first; '' for the module's level."""
    spans = [(node.lineno - 1, node.end_lineno - 1, node.name) for node in ast.walk(ast.parse("\n".join(lines)))
             if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    return {min(((end - start, name) for start, end, name in spans if start <= i <= end), default=(0, ""))[1]
            for i in numbers}


@handout
@pytest.mark.parametrize("feature", OPTIONAL_BLOCKS)
def test_handout_an_optional_blocks_marked_lines_stand_in_five_places_at_most(feature):
    lines = source_lines()
    _, marked = optional_block(lines, feature)
    assert len(places_of(lines, marked)) <= 5, sorted(places_of(lines, marked))


@handout
def test_handout_the_first_reading_holds_12_marked_lines_at_most():
    names = "|".join(map(re.escape, OPTIONAL_BLOCKS))
    marked = [line for line in source_lines()[:banner_line()] if re.search(rf"\S.*  # \[({names})\]( |$)", line)]
    assert len(marked) <= 12, marked


@handout
@pytest.mark.parametrize("feature", OPTIONAL_BLOCKS)
def test_handout_a_copy_without_an_optional_block_and_its_marked_lines_still_serves_learns_and_saves(feature, tmp_path):
    lines = source_lines()
    block, marked = optional_block(lines, feature)
    kept = [line for i, line in enumerate(lines) if i not in block and i not in marked]
    copy = "\n".join(kept) + "\n"
    dangling = names_defined_in("\n".join(lines[block.start:block.stop])) & set().union(
        *global_names_by_line(copy).values())
    assert not dangling, f"the copy still names {dangling}"
    (tmp_path / "plugrl_min.py").write_text(copy)
    shutil.copy(os.path.join(HERE, "sac_example.py"), tmp_path)
    run_dir = tmp_path / "run"
    result = subprocess.run([sys.executable, "plugrl_min.py", "dummy-policy", "default", "dummy", "default",
                             "--local-env-clients", "1", "--local-env", "dummy-v1", "--algo.global-steps", "3000",
                             "--run-dir", str(run_dir)], cwd=tmp_path, env=subprocess_env(), capture_output=True,
                            text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "run finished: global step 3000, 3 learns" in result.stdout
    assert checkpoint_steps(run_dir)[-1] == 3000  # the final checkpoint


@handout
def test_handout_the_readme_reading_map_line_numbers_are_current():
    rows = map_rows_in_file()
    table = "\n".join(f"| {first}-{last} | {what} | {read} |" for first, last, what, read in rows)
    assert [(first, last) for first, last, _, _ in readme_map()] == [(f, l) for f, l, _, _ in rows], \
        f"the map should read:\n{table}"
    assert f"`# ===== The first reading ends here`\n(line {banner_line()})" in readme(), banner_line()


# --- Every command it shows runs as shown, and prints what it shows -------------------------------

NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:e[-+]?\d+)?")  # 1,024 is one number


def shape_of(line: str) -> str:
    """A line without its numbers, its run directory, where a chart's marks fall, and its
    alignment: what must match."""
    line = re.sub(r"^([A-Z]) \S+: ", r"\1 RUN: ", line)  # a report's row names its run directory
    line = re.sub(r"^run directory: \S+$", "run directory: RUN", line)  # and so does the start
    line = re.sub(r"\|[A-Z ]*$", "|", line)  # a chart's row: its marks move from run to run
    return " ".join(NUMBER.sub("N", line).split())


def assert_prints_as_shown(shown: str, printed: str) -> None:
    """Every line the README shows appears in what was printed, in the same order; numbers (times,
    rates, rewards) may differ, and so may the progress lines a fast machine never prints."""
    printed_shapes = [shape_of(line) for line in printed.splitlines()]
    position = 0
    for line in shown.splitlines():
        if not line.strip() or line.strip() == "..." or line.startswith(("$ ", "^C", "step ")):
            continue
        assert shape_of(line) in printed_shapes[position:], f"not printed, in order: {line!r}\n{printed}"
        position = printed_shapes.index(shape_of(line), position) + 1


def readme_command(after: str) -> list[str]:
    """The first `python plugrl_min.py ...` command of the block after `after`, as arguments."""
    command = next(line for line in readme_block(after).splitlines() if line.startswith("python plugrl_min.py"))
    return command.split()[1:]


QUICKSTART_OUTPUT = "The quickstart, as one run printed it"
QUICKSTART_LINE = "A line of the quickstart's `metrics.jsonl`"


def counts_of(block: str) -> list[str]:
    """The figures of a run's output that depend neither on the machine nor on chance: the steps and learns
    of its end line, and the steps, learns and discards of its report's row."""
    return re.findall(r"global step \d+, \d+ learns|[\d,]+ steps \| [\d,]+ learns \| [\d,]+ discarded", block)


def test_the_readme_quickstarts_counts_are_those_its_command_makes(tmp_path):
    words = readme_command("## Quickstart")[1:]  # after plugrl_min.py
    _, args, configs = plugrl_min.parse_server_flags(words)
    steps, per_learn = configs["algo"].global_steps, configs["algo"].frames_per_learn
    assert per_learn % (2 * args.local_num_envs) == 0  # whole messages fill a batch, and half of one
    # pg learns once per full batch of per_learn frames; one client discards nothing. The README's figures:
    learns = steps // per_learn
    assert counts_of(readme_block(QUICKSTART_OUTPUT)) == [f"global step {steps}, {learns} learns",
                                                         f"{steps:,} steps | {learns:,} learns | 0 discarded"]
    line = json.loads(readme_block(QUICKSTART_LINE))
    assert (line["event"], line["server/fed"], line["server/discarded"]) == ("learn", per_learn, 0)
    assert line["step"] == line["server/frames"] == line["server/policy_version"] * per_learn <= steps
    # That cadence, run: the same command for 3.5 batches ends on 3 learns and no discard.
    short = 3 * per_learn + per_learn // 2
    status, out, err = run_main(*in_a_test(words, tmp_path), "--algo.global-steps", short)
    assert status == 0, err
    assert counts_of(out)[-2:] == [f"global step {short}, 3 learns", f"{short:,} steps | 3 learns | 0 discarded"]
    assert [line["step"] for line in read_metrics(tmp_path / "run")] == [per_learn, 2 * per_learn, 3 * per_learn]


@handout
def test_handout_the_readme_quickstart_prints_what_it_shows(tmp_path):
    """The quickstart, run: it prints the lines the README shows, with the same counts. With
    PLUGRL_WRITE_README=1 this run's output becomes the README's blocks."""
    words = readme_command("## Quickstart")
    started = time.monotonic()
    status, out, err = run_main(*in_a_test(words[1:], tmp_path))  # the server in this process, not its client
    seconds = time.monotonic() - started
    assert status == 0, err
    learns = read_metrics(tmp_path / "run")
    if os.environ.get("PLUGRL_WRITE_README") == "1":
        printed = out.splitlines()
        printed = [*printed[:2], "  ...", *printed[printed.index("}"):]]  # the configuration's first key
        plot = next(i for i, line in enumerate(printed)
                    if line.startswith("mean return of the last"))
        printed = [*printed[:plot + 1], "..."]  # the plot's title, not the plot
        name = time.strftime("runs/pg-dummy-v1-%Y%m%d-%H%M%S", time.localtime(time.time() - seconds))
        printed = [line.replace(str(tmp_path / "run"), name) for line in printed]  # as without --run-dir
        text = readme()
        for after, block in ((QUICKSTART_OUTPUT, "\n".join(printed).rstrip() + "\n"),
                             (QUICKSTART_LINE, json.dumps(learns[-1]) + "\n")):
            text = text.replace(readme_block(after), block, 1)
        with open(os.path.join(HERE, "README.md"), "w") as file:
            file.write(text)
    shown = readme_block(QUICKSTART_OUTPUT)
    assert_prints_as_shown(shown, out)
    assert counts_of(shown) == counts_of(out)[-2:]
    assert learns[-1].keys() == json.loads(readme_block(QUICKSTART_LINE)).keys()
    assert np.mean([line["rollout/reward"] for line in learns[-10:]]) > -5  # it learned


@handout
def test_handout_the_readme_quickstarts_pace_is_that_of_its_measured_time():
    """The quickstart's output block links its time to the wire's-cost table: the pace its last
    progress line shows (fps counts from the server's start, so step / fps is the seconds so far,
    and total / fps the whole run's at that pace) lies within a quarter of the table's over-the-wire
    times of the quickstart: at most the slowest x 1.25, at least the fastest / 1.25. A quarter is
    about the swing of one run's time on a shared 2-core machine; a block printed on a busy one
    (twice the table's time) contradicts the table, and is regenerated when the machine is quiet."""
    progress = re.findall(r"^step (\d+)/(\d+) \| (\d+) fps", readme_block(QUICKSTART_OUTPUT), re.M)
    step, total, fps = map(int, progress[-1])
    implied = step / fps * (total / step)
    table = readme().split("### The wire's cost")[1]
    wire = re.search(r"^\| `pg`, the quickstart \| [^|]* \| ([\d., ]+) s \|", table, re.M).group(1)
    times = [float(seconds) for seconds in wire.split(",")]
    margin = 1.25
    assert min(times) / margin <= implied <= max(times) * margin, \
        f"the block's {step:,} steps at {fps} fps imply {implied:.1f} s for {total:,}; " \
        f"the table: {wire} s"


@handout
def test_handout_the_readme_smoke_test_prints_what_it_shows(tmp_path):
    server_words = readme_command("The smoke test of the PlugRL page")
    client_words = next(line for line in readme_block("The smoke test of the PlugRL page").splitlines()
                        if "env-client" in line).split()[1:]
    with Background(tmp_path, "server", in_a_test(server_words, tmp_path)) as server:
        port = str(server.port())
        client = python(*[port if word == "8000" else word for word in client_words])
        wait_for(lambda: "--local-env-clients 1" in server.stdout(), 10, "the server's hint")
        server.proc.send_signal(signal.SIGINT)
        assert server.wait(30) == 0 and client.returncode == 0
    shown = readme_block("Terminal 1, the server")
    stop_line = next(line for line in shown.splitlines() if line.startswith("stopping"))
    assert_prints_as_shown(shown.replace(stop_line, ""), server.stdout())
    assert_prints_as_shown(stop_line, server.stderr())  # Ctrl-C's answer goes to stderr
    assert_prints_as_shown(readme_block("Terminal 2, the client"), client.stdout)


@handout
def test_handout_the_readme_trace_prints_what_it_shows(tmp_path):
    words = readme_command("Watch it happen")
    result = python(*in_a_test(words, tmp_path), "--algo.global-steps", "400", timeout=120)
    assert result.returncode == 0, result.stderr
    shown = readme_block("Watch it happen", nth=1)
    trace = "\n".join(line for line in result.stdout.splitlines() if line.startswith("trace:"))
    assert_prints_as_shown(shown, trace)
    assert len(shown.splitlines()) == len(trace.splitlines())


@handout
def test_handout_the_readme_two_client_trace_shows_a_stale_frame_right_after_a_learn(tmp_path):
    words = readme_command("One client never sends a stale frame")
    status, out, err = run_main(*in_a_test(words[1:], tmp_path))
    assert status == 0, err
    trace = [line for line in out.splitlines() if line.startswith("trace:")]
    stale = [i for i, line in enumerate(trace) if "discard_feedback (stale: acted with version" in line]
    assert stale and any(trace[i - 1].startswith("trace: learn") for i in stale)


@handout
def test_handout_the_readme_own_environment_trains_as_shown(tmp_path, plugins_in_process, monkeypatch):
    write_plugin(tmp_path, "plugrl_test_my_env", readme_block("## Your own environment"))
    words = readme_command("import numpy as np\nfrom plugrl_min import VecEnv, observation, register_env")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # for the local client; the server runs in this process
    # Seeded, on one learn thread: unseeded, about one run in ten left pg where it began (-8.7).
    status, _, err = run_main(*in_a_test(words[1:], tmp_path), "--seed", "1", "--learn-threads", "1")
    assert status == 0, err
    rewards = [line["rollout/reward"] for line in read_metrics(tmp_path / "run") if line["rollout/episodes"]]
    assert np.mean(rewards[-5:]) > np.mean(rewards[:3]) + 1  # it learned to reach 0


@handout
def test_handout_the_readme_closed_loop_command_runs(tmp_path):
    server_words, client_words = [line.split()[1:] for line in
                                  readme_block("## One decision, several physical steps").splitlines()]
    with Background(tmp_path, "server", in_a_test(server_words, tmp_path)) as server:
        client = python(*client_words, "--server-port", str(server.port()))
        server.proc.send_signal(signal.SIGINT)
        assert server.wait(30) == 0
    assert client.returncode == 0 and "done | episodes" in client.stdout, client.stderr


def test_report_prints_what_the_readme_shows(two_short_runs):
    shown = readme_block("**The figure to quote**")
    assert_prints_as_shown(shown, plugrl_min.report(two_short_runs, reach=-1000.0))


# --- Its tables and figures are the code's --------------------------------------------------------

def test_the_readmes_table_of_environments_agrees_with_the_code():
    rows = re.findall(r"^\| `([a-z]+-v1)` \| float32 \[(\d+)\]: [^|]* \| [^|]* \| (\d+) \| .* \| (continuous|discrete), "
                      r"(\d+) (?:number|choices)", readme(), re.M)
    assert [row[0] for row in rows] == ["dummy-v1", "pendulum-v1", "cartpole-v1"]
    for env_id, size, length, kind, count in rows:
        env = plugrl_min.ENVIRONMENTS[env_id]
        assert env.obs_spec == {"states": {"state": ((int(size),), "float32")}} and env.max_steps == int(length), env_id
        assert (env.num_actions, env.action_dim) == ((None, int(count)) if kind == "continuous" else (int(count), 1))


def test_the_readmes_default_run_lengths_are_the_configs():
    line = " ".join(readme().split("The algorithms' default run lengths")[1].split("\n\n")[0].split())
    for algo in ("dummy", "pg", "sac"):
        steps = plugrl_min._ALGO_CONFIGS[(algo, "default")].global_steps
        assert f"`{algo}` {steps:,}" in line, algo


def test_the_readmes_sac_figures_stand_once_in_the_sac_against_cleanrl_table():
    """Each figure once: the SAC section and "Trained, then evaluated" point to -k bench_sac's table (its
    returns and greedy evaluations over seeds 1 to 3); none copies them."""
    text = readme()
    section = text.split("### SAC against CleanRL")[1]
    table = section[section.index("\n|"):].split("\n\n")[0]  # its first table: -k bench_sac's
    figures = re.findall(r"-\d+\.\d\d", table)
    assert len(figures) >= 6 and [figure for figure in figures if text.count(figure) != 1] == []


@wire
def test_the_readmes_hex_dump_of_an_infer_frame_is_what_pack_message_writes_at_the_offsets_it_gives():
    frame = pack_message(infer_message([0], obs=observation(1, states={"state": np.array([[0.5, -1.0, 2.0]], np.float32)})))
    lines = re.findall(r"^([0-9a-f]{4})  ((?:[0-9a-f]{2} )*[0-9a-f]{2})", readme_block("A hex dump of one small"), re.M)
    assert b"".join(bytes.fromhex(line) for _, line in lines) == frame
    offsets = [int(offset, 16) for offset, _ in lines]
    assert offsets == [0] + list(itertools.accumulate(len(bytes.fromhex(line)) for _, line in lines[:-1]))


@wire
def test_pg_sends_the_readmes_bytes_per_learn_for_its_default_batch_from_rank_0():
    algo = pg_algo()
    algo.stored = algo.config.frames_per_learn
    order = {"order": "learn", "threads": 1, "server_data": algo.get_server_data()}  # as in_step sends it
    said = re.search(r"that is ([\d,]+)\s+bytes", readme())
    assert said and int(said.group(1).replace(",", "")) == len(pack_message(order))


# --- The README's standalone client, extracted and run against a real server to its end -----------

STANDALONE_CLIENT = "### A standalone client in numpy, msgpack and websockets"


def private_memory_mb(pid) -> float:
    """USS: the memory only this process holds (Private_Clean + Private_Dirty of smaps_rollup)."""
    with open(f"/proc/{pid}/smaps_rollup") as file:
        fields = dict(line.split()[:2] for line in file if line.split()[-1:] == ["kB"])
    return (int(fields["Private_Clean:"]) + int(fields["Private_Dirty:"])) / 1024


@pytest.fixture(scope="module")
def standalone_run(tmp_path_factory):
    """The README's standalone client, as a file, against `dummy-policy default dummy default`
    for 2,000 frames (4 environments, episodes of up to 100 steps): it runs until the server
    ends the run. Its memory is sampled every 20 ms while it runs."""
    msgpack_or_skip()  # the client's codec
    tmp_path = tmp_path_factory.mktemp("standalone")
    script = tmp_path / "client.py"
    script.write_text(readme_block(STANDALONE_CLIENT, nth=1))
    run_dir = tmp_path / "run"
    with deadline_of("the standalone client's run", 120), \
            Background(tmp_path, "server", ["plugrl_min.py", "dummy-policy", "default", "dummy",
                                            "default", "--port", "0", "--algo.global-steps", "2000",
                                            "--run-dir", str(run_dir)]) as server:
        client = subprocess.Popen([sys.executable, str(script), str(server.port()), "1000000"],
                                  cwd=tmp_path, env=subprocess_env(), stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        samples, deadline = [], time.monotonic() + 60
        while client.poll() is None and time.monotonic() < deadline:
            try:
                samples.append(private_memory_mb(client.pid))
            except (FileNotFoundError, ProcessLookupError, KeyError):  # it is exiting
                pass
            time.sleep(0.02)
        if client.poll() is None:
            client.kill()
        out, err = client.communicate(timeout=10)
        try:
            server_status = server.wait(30)
        except subprocess.TimeoutExpired:  # the client left early: the run never ended
            server_status = None
    metrics = read_metrics(run_dir, None) if (run_dir / "metrics.jsonl").exists() else []
    return {"status": client.returncode, "stdout": out, "stderr": err, "samples": samples,
            "server_status": server_status, "metrics": metrics}


@wire
def test_the_standalone_client_runs_until_the_server_ends_the_run_and_exits_0(standalone_run):
    assert (standalone_run["status"], standalone_run["server_status"]) == (0, 0), standalone_run
    assert re.fullmatch(r"\d+ episodes, mean return -?\d+\.\d\d\n", standalone_run["stdout"])


@wire
def test_the_server_records_the_standalone_clients_episodes(standalone_run):
    episodes = [line["rollout/episodes"] for line in standalone_run["metrics"]]
    assert any(count > 0 for count in episodes), standalone_run["metrics"]


@wire
def test_the_standalone_client_uses_under_100_mb_of_private_memory(standalone_run):
    samples = standalone_run["samples"]
    assert standalone_run["status"] == 0, "the client failed: its memory says nothing"
    assert len(samples) >= 5, "too few samples: the client ended too soon to be measured"
    assert 5 < max(samples) < 100, f"USS {max(samples):.0f} MB"


def standalone_codec(tmp_path):
    """pack and unpack of the README's standalone client, imported from its file."""
    msgpack_or_skip()
    (tmp_path / "client.py").write_text(readme_block(STANDALONE_CLIENT, nth=1))
    spec = importlib.util.spec_from_file_location("readme_client", tmp_path / "client.py")
    client = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(client)
    return client.pack, client.unpack


NESTED = {"message_type": "feedback", "info": {"contacts": [np.arange(3, dtype=np.int64), {"force": np.ones((2, 2))}]},
          "obs": {"state": np.zeros((1, 3), np.float32)}, "flags": [True, None, "x"]}


def same(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, list) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("direction", ["standalone pack, plugrl_min unpack", "plugrl_min pack, standalone unpack"])
@wire
def test_arrays_nested_in_lists_and_dicts_cross_between_the_standalone_client_and_plugrl_min(tmp_path, direction):
    pack, unpack = standalone_codec(tmp_path)
    if direction.startswith("standalone"):
        decoded = unpack_message(pack(NESTED))
    else:
        decoded = unpack(pack_message(NESTED))
    assert same(NESTED, decoded)


# --- Its test commands: the quick contract check, and a student's files beside the tests ----------

def collected(*flags) -> list[str]:
    """The test names (parameters cut) a fresh `pytest --collect-only -q FLAGS` of this file selects, as the README's
    commands run it: whatever gives the marks (a decorator on each test, or a scan of the headings)."""
    result = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p",
                             "no:cacheprovider", os.path.basename(__file__), *flags], cwd=HERE, env=subprocess_env(),
                            capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return sorted({line.split("::", 1)[1].split("[", 1)[0] for line in result.stdout.splitlines() if "::" in line})


CONTRACT_PARTS = {  # what the quick check must test: a pattern of test names, and how many at least
    "routing to feedback or discard": (r"^test_(on|off)_policy_algorithm_is_|discarded_frames|discard_feedback", 4),
    "the hooks and their order": (r"should_(learn|save|stop)|learn_runs_in_a_worker_thread|feedback_keyword", 5),
    "prev_node chains": (r"prev_node", 3),
    "checkpoints and resume": (r"checkpoint|resume", 5),
    # Most of these are the codec's tests today: a rewrite of the codec keeps such names on its own tests
    # (a frame rejected, a field refused), or this count of the wire's errors falls below 15.
    "the wire's errors": (r"rejected|refused|protocol_error|malformed|gets_an_error", 15),
}
NOT_THE_CONTRACT = r"^test_(pg|sac|ppo|dqn|twin_critic|bench|handout)_|_(pg|sac)_|_(pg|sac)$"  # their internals


def test_the_quick_contract_check_runs_routing_hooks_chains_checkpoints_and_the_wires_errors_and_no_pg_or_sac():
    everything, quick = collected(), collected("-m", "contract")
    assert set(quick) < set(everything)
    for part, (pattern, least) in CONTRACT_PARTS.items():
        assert len([name for name in quick if re.search(pattern, name)]) >= least, (part, quick)
    internals = [name for name in everything if re.search(NOT_THE_CONTRACT, name)]
    assert len(internals) > 20 and not set(internals) & set(quick), set(internals) & set(quick)


HANGS = '''
import time, pytest
from test_plugrl_min import deadline, deadline_of  # the autouse deadline of every test, and a run's


@pytest.fixture(scope="module")
def shared_run():
    with deadline_of("the shared run", 2):
        time.sleep(120)  # a run whose client never comes


def test_a_fixture_that_hangs(shared_run):
    pass


def test_a_test_that_hangs():
    time.sleep(120)
'''


def test_a_hanging_shared_run_or_test_fails_at_its_deadline_and_plugrl_test_deadline_lowers_every_one(tmp_path):
    (tmp_path / "test_hangs.py").write_text(HANGS)
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-rf",
                             "test_hangs.py"], cwd=tmp_path, env={**subprocess_env(HERE), "PLUGRL_TEST_DEADLINE": "5"},
                            capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert time.monotonic() - started < 60, result.stdout  # not the 120 s either sleep asks for
    assert "DeadlinePassed: the shared run ran past its deadline of 2 s" in result.stdout, result.stdout
    assert "DeadlinePassed: the test ran past its deadline of 5 s" in result.stdout, result.stdout
    assert "1 failed" in result.stdout and "1 error" in result.stdout


def test_every_run_that_tests_share_has_a_deadline_of_its_own():
    tree = ast.parse(pathlib.Path(__file__).read_text())
    shared = [node for node in tree.body if isinstance(node, ast.FunctionDef) and any(
        isinstance(decorator, ast.Call) and any(keyword.arg == "scope" for keyword in decorator.keywords)
        for decorator in node.decorator_list)]
    bounded = {node.name for node in shared for call in ast.walk(node) if isinstance(call, ast.Call)
               and getattr(call.func, "id", None) == "deadline_of"}
    assert len(shared) >= 9 and [node.name for node in shared if node.name not in bounded] == []


def test_the_wire_selection_holds_every_test_that_drives_a_client_or_a_server_itself_and_not_all_tests():
    everything, chosen = collected(), collected("-m", "wire")
    drivers = {"Client", "run_server", "feed", "raw_exchange", "env_client_in_process", "ScriptedServer"}
    tree = ast.parse(pathlib.Path(__file__).read_text())
    driving = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)
               and node.name.startswith("test_") and not node.name.startswith(("test_bench_", "test_handout_"))
               and {name.id for name in ast.walk(node) if isinstance(name, ast.Name)} & drivers}
    assert len(driving) > 60 and driving <= set(chosen) < set(everything), driving - set(chosen)


def test_a_students_my_env_and_my_algo_in_the_project_folder_do_not_change_the_tests_results(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("plugrl_min.py", "sac_example.py", "test_plugrl_min.py", "README.md"):
        shutil.copy(os.path.join(HERE, name), project / name)
    for module in ("my_env", "my_algo", "my_camera"):  # the names README.md and its exercises use
        (project / f"{module}.py").write_text(f"raise RuntimeError('the tests imported a student\\'s {module}.py')\n")
    chosen = "plugins_environment or two_observation_keys"  # plug-ins named as README.md names them
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_plugrl_min.py",
                             "-k", chosen], cwd=project, env=subprocess_env(), capture_output=True, text=True,
                            timeout=300, stdin=subprocess.DEVNULL)
    assert re.search(r"^\d+ passed", result.stdout.splitlines()[-1]) and "failed" not in result.stdout, result.stdout


# --- The floors README.md names are the code's ----------------------------------------------

def test_the_websockets_floor_is_the_same_in_requirements_the_import_guard_and_the_readme():
    floor = re.search(r"^websockets>=(\d+)\.0$", open(os.path.join(HERE, "requirements.txt")).read(), re.M).group(1)
    guard = re.search(r"websockets\.__version__\.split\(\"\.\"\)\[0\]\) < (\d+)", open(SOURCE).read()).group(1)
    assert floor == guard and f"websockets {floor}+" in open(os.path.join(HERE, "README.md")).read()


def test_the_python_version_the_readme_names_is_the_one_the_guard_checks():
    guard = re.search(r"sys\.version_info < \(3, (\d+)\)", open(SOURCE).read()).group(1)
    assert f"Python 3.{guard}+" in open(os.path.join(HERE, "README.md")).read()


# =============================================================================================
# The README's exercises, solved: each check run over seeds 1 to 5 with a reference solution
# =============================================================================================
# Commands and ranges are read from the exercises' own text, so README.md and the bench cannot drift:
#   PLUGRL_BENCH=1 python -m pytest -q -n 0 test_plugrl_min.py -k bench_exercise -s
# The solutions' modules are named plugrl_test_* so a student's my_dqn.py, my_chase.py ... cannot shadow them.

def exercise_text(number: int) -> str:
    """Item `number` of README.md's ## Exercises, its line breaks made spaces."""
    text = readme()[readme().index("## Exercises"):]
    text = text[:text.index("\n## ", 1)]
    item = re.search(rf"^{number}\. (.*?)(?=^\d+\. |\Z)", text, re.M | re.S).group(1)
    return re.sub(r"\s+", " ", item)


FIGURE = r"-?\d[\d,]*(?:\.\d+)?"  # a figure of an exercise, 1,024 included
CHECK = re.compile(rf"\b(at most|at least) ({FIGURE})|({FIGURE}) to ({FIGURE})")  # one figure's check


def number_of(text: str) -> float:
    return float(text.replace(",", ""))


def exercise_ranges(number: int) -> list[tuple[float, float]]:
    """Every check of the exercise's *Check:*, in order, as (lowest, highest) a seed may give: `at least X`
    (X, inf), `at most X` (-inf, X), `X to Y` either way round."""
    check = exercise_text(number).split("*Check:*", 1)[1]
    ranges = []
    for side, bound, low, high in CHECK.findall(check):
        if side:
            ranges.append((number_of(bound), math.inf) if side == "at least" else (-math.inf, number_of(bound)))
        else:
            ranges.append(tuple(sorted((number_of(low), number_of(high)))))
    return ranges


def exercise_commands(number: int) -> list[list[str]]:
    """The `python plugrl_min.py ...` code spans of the exercise, as argument lists (after plugrl_min.py)."""
    return [span.split()[2:] for span in re.findall(r"`(python plugrl_min\.py [^`]*)`", exercise_text(number))]


def filled(args: list[str], seed: int, tmp_path, modules: dict = {}) -> list[str]:
    """A README command for one seed: S is the seed, runs/... a folder in tmp_path, plug-ins renamed."""
    out = []
    for arg in args:
        arg = re.sub(r"(?<=-)S$|^S$", str(seed), arg)
        if arg.startswith("runs/"):
            arg = str(tmp_path / arg)
        out.append(modules.get(arg, arg))
    return out


def curve_figures(run_dir, reach: float | None = None) -> dict:
    """What `report RUN --reach R` says of a run: its step of first reaching R, the last and best figures (of
    windows of 100 episodes or more, as report takes them)."""
    lines = plugrl_min.read_metrics(str(run_dir))
    curve = [(step, mean) for step, mean, count in plugrl_min.return_curve(lines) if count >= 100]
    figures = {"last": curve[-1][1], "best": max(mean for _, mean in curve), "steps": lines[-1]["step"],
               "learns": lines[-1]["server/policy_version"],
               "discarded": sum(line["server/discarded"] for line in lines),
               "first": next(line["rollout/reward"] for line in lines if line["rollout/episodes"])}
    if reach is not None:
        figures["reach"] = next((step for step, mean in curve if mean >= reach), math.inf)
    return figures


def train(args: list[str], pythonpath=None, cwd_source=SOURCE, timeout=1200) -> subprocess.CompletedProcess:
    done = python(cwd_source, *args, pythonpath=pythonpath, timeout=timeout)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done


def project_copy(tmp_path, name: str, edits: dict) -> pathlib.Path:
    """A copy of the project in tmp_path/name with {file: [(old, new), ...]} applied, each old found once."""
    project = tmp_path / name
    project.mkdir()
    for file in ("plugrl_min.py", "sac_example.py"):
        source = pathlib.Path(HERE, file).read_text()
        for old, new in edits.get(file, []):
            assert source.count(old) == 1, f"the exercise's edit no longer fits {file}: {old!r}"
            source = source.replace(old, new)
        (project / file).write_text(source)
    return project


# (What pg has, what the exercise's student writes instead), each in PG in plugrl_min.py.
EXERCISE_8_EDIT = [
    ('        return {"sample": runtime_state["sample"]}\n',
     '        return {"sample": runtime_state["sample"], "log_prob": runtime_state["log_prob"]}\n'),
    ('"sample": np.zeros_like(sample), ',
     '"sample": np.zeros_like(sample), "log_prob": np.zeros(n, np.float32),\n                      '),
    ('        batch["sample"][row] = train_state["sample"]\n',
     '        batch["sample"][row] = train_state["sample"]\n'
     '        batch["log_prob"][row] = train_state["log_prob"]\n'),
    ('''        distribution = self.train_policy(obs)
        entropy = distribution.entropy().mean()
        log_prob = distribution.log_prob(frames["sample"][share])
        policy_loss = -(log_prob * advantage[share]).mean() - cfg.ent_coef * entropy
        self.policy_optimizer.zero_grad()
        policy_loss.backward()
        nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
        self.policy_optimizer.step()
''', '''        rows = torch.arange(share.start, share.stop, device=device)
        for _ in range(4):  # PPO: 4 epochs of minibatches of 256 rows, the ratio clipped at 0.2
            for minibatch in rows[torch.randperm(len(rows), device=device)].split(256):
                distribution = self.train_policy(slice_rows(frames["obs"], minibatch))
                entropy = distribution.entropy().mean()
                old = frames["log_prob"][minibatch]
                ratio = (distribution.log_prob(frames["sample"][minibatch]) - old).exp()
                gain = advantage[minibatch]
                clipped = torch.min(ratio * gain, ratio.clamp(0.8, 1.2) * gain)
                policy_loss = -clipped.mean() - cfg.ent_coef * entropy
                self.policy_optimizer.zero_grad()
                policy_loss.backward()
                nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
                self.policy_optimizer.step()
'''),
]


@handout
def test_handout_exercise_8s_ppo_edit_of_pg_passes_the_quick_contract_check(tmp_path):
    project = tmp_path / "project"
    project.mkdir()
    for name in ("plugrl_min.py", "sac_example.py", "test_plugrl_min.py", "README.md"):
        shutil.copy(os.path.join(HERE, name), project / name)
    source = (project / "plugrl_min.py").read_text()
    for old, new in EXERCISE_8_EDIT:
        assert source.count(old) == 1, f"exercise 8 no longer fits PG: {old!r}"
        source = source.replace(old, new)
    (project / "plugrl_min.py").write_text(source)
    def in_the_copy(*args):
        return subprocess.run([sys.executable, *args], cwd=project, env=subprocess_env(), capture_output=True,
                              text=True, timeout=220, stdin=subprocess.DEVNULL)
    learned = in_the_copy("-c", "import plugrl_min as m; algo = m.make_algo('pg', m.make_policy('dummy-policy'));"
                                " print(sorted(algo.batch))")
    assert "'log_prob'" in learned.stdout, learned.stderr  # the edited pg is the one the copy runs
    result = in_the_copy("-m", "pytest", "-q", "-p", "no:cacheprovider", "test_plugrl_min.py", "-m", "contract")
    assert re.search(r"^\d+ passed", result.stdout.splitlines()[-1]) and "failed" not in result.stdout, result.stdout


EXERCISE_STUCK = '''
import dataclasses
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config


@register_algo_config("stuck")
@dataclasses.dataclass
class StuckConfig(DummyAlgoConfig):
    pass


@register_algo("stuck")
class Stuck(DummyAlgorithm):
    def learn_impl(self):  # frames_since_learn never reset: should_learn stays true
        self.learns += 1
        return self.global_step, {}
'''

EXERCISE_P_CONTROLLER = '''
import numpy as np
import plugrl_min
from plugrl_min import Controller


class PController(Controller):
    """action = kp * (decision - x), clipped to [-1, 1]; dummy-v1's obs is [x, target, gap]."""

    def __init__(self, kp: float):
        self.kp = kp

    def __call__(self, obs, decision, state):
        return np.clip(self.kp * (decision[:, 0] - obs["states"]["state"][:, 0]), -1, 1)[:, None], state


builtin = plugrl_min.make_controller


def make_controller(name, env):  # --controller p5 (kp = 5), p2.5 ...
    return PController(float(name[1:])) if name.startswith("p") else builtin(name, env)


plugrl_min.make_controller = make_controller
'''

EXERCISE_CHASE = '''
import numpy as np
from plugrl_min import VecEnv, observation, register_env


@register_env("my-chase-v0")
class MyChase(VecEnv):
    obs_spec = {"states": {"state": ((3,), "float32")}}
    action_dim, max_steps = 1, 20

    def __init__(self, num_envs, seed=None):
        self.x, self.target, self.speed = np.zeros(num_envs), np.zeros(num_envs), np.zeros(num_envs)
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.x[rows] = self.rng.uniform(-1, 1, len(rows))
        self.target[rows] = 0.0
        self.speed[rows] = self.rng.uniform(-0.03, 0.03, len(rows))

    def _step(self, action, rows):
        self.x[rows] += 0.1 * np.clip(action[:, 0], -1, 1)
        self.target[rows] += self.speed[rows]  # after the point
        gap = np.abs(self.target[rows] - self.x[rows])
        return -gap, gap < 0.05, gap < 0.05

    def _observe(self):
        state = np.stack([self.x, self.target, self.target - self.x], axis=1)
        return observation(self.num_envs, states={"state": state.astype(np.float32)})
'''

EXERCISE_DQN = '''# SPDX-License-Identifier: MIT
"""my_dqn: exercise 9's reference solution, a Double DQN on categorical-policy, registered as `dqn`.

The policy's MLP (CategoricalPolicy.logits, its raw output before torch's Categorical) is the
Q-network; this file adds its target copy, a replay buffer and epsilon-greedy acting.
    python plugrl_min.py categorical-policy cartpole dqn default --plugin my_dqn \
        --local-env-clients 1 --local-num-envs 4 --local-env cartpole-v1 --seed 1 --run-dir runs/dqn-1
"""

import copy
import dataclasses

import numpy as np
import torch
from torch.nn import functional as F

import plugrl_min
from plugrl_min import BaseAlgoConfig, BaseAlgorithm, Checkpoint, register_algo, register_algo_config

UID = "dqn"


@register_algo_config(UID)
@dataclasses.dataclass
class DQNConfig(BaseAlgoConfig):
    """DQN's hyperparameters; every field is a flag (--algo.batch-size 64)."""

    global_steps: int | None = 100_000  # frames stored, then the run ends
    buffer_size: int = 100_000  # frames kept; the oldest is overwritten first
    gamma: float = 0.99  # discount per decision
    batch_size: int = 128  # frames per update
    learning_starts: int = 1_000  # frames before the first update
    train_frequency: int = 4  # frames per update after learning_starts
    lr: float = 1e-3  # Adam's step size
    target_network_frequency: int = 100  # updates between copies of the Q-network to its target
    start_e: float = 1.0  # epsilon at step 0 ...
    end_e: float = 0.05  # ... falling linearly to this ...
    exploration_steps: int = 10_000  # ... over these many frames
    save_every: int = 5_000  # updates between checkpoints
    log_every: int = 100  # updates between train/* metrics


class ReplayBuffer:
    """A ring of (obs, action, reward, next_obs, done) frames."""

    def __init__(self, capacity: int, obs_shape: tuple):
        self.capacity, self.size, self.next = capacity, 0, 0
        self.obs = np.zeros((capacity, *obs_shape), np.float32)
        self.next_obs = np.zeros((capacity, *obs_shape), np.float32)
        self.action = np.zeros(capacity, np.int64)
        self.reward = np.zeros(capacity, np.float32)
        self.done = np.zeros(capacity, np.float32)
        self.tensors = [torch.from_numpy(a) for a in (self.obs, self.action, self.reward, self.next_obs, self.done)]

    def add(self, obs, action: int, reward: float, next_obs, done: bool) -> None:
        i = self.next
        self.obs[i], self.action[i], self.reward[i], self.next_obs[i], self.done[i] = obs, action, reward, next_obs, done
        self.next = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size: int, device) -> list[torch.Tensor]:
        rows = torch.randint(self.size, (batch_size,))
        return [t.index_select(0, rows).to(device) for t in self.tensors]


@register_algo(UID)
class DQN(BaseAlgorithm):
    """Off-policy Double DQN: every frame to the buffer, one update per train_frequency frames."""

    on_policy = False  # a replay buffer: stale frames are fine
    example_env = "cartpole-v1"

    def __init__(self, config: DQNConfig, policy: plugrl_min.BaseTorchPolicy):
        super().__init__(config=config, policy=policy)
        self.updates = self.saved_at = 0
        self.device = policy.device
        self.q = policy.logits  # the raw MLP output: one Q-value per action (not log-probabilities)
        self.q_target = copy.deepcopy(self.q).requires_grad_(False)
        self.buffer = ReplayBuffer(config.buffer_size, tuple(policy.obs_spec["states"]["state"][0]))
        self.last = {}
        self.optimizer = None

    def init_optimizers(self) -> None:
        self.optimizer = torch.optim.Adam(self.q.parameters(), lr=self.config.lr)

    def epsilon(self) -> float:
        cfg = self.config
        fraction = min(self.global_step / cfg.exploration_steps, 1.0)
        return cfg.start_e + fraction * (cfg.end_e - cfg.start_e)

    @torch.inference_mode()
    def infer(self, obs: dict) -> tuple[np.ndarray, dict]:
        """Epsilon-greedy on the Q-values."""
        state = torch.from_numpy(obs["states"]["state"]).to(self.device)
        greedy = self.q(state).argmax(dim=1).cpu()
        n = len(greedy)
        explore = torch.rand(n) < self.epsilon()
        choice = torch.where(explore, torch.randint(self.policy.num_actions, (n,)), greedy)
        action = choice.numpy().reshape(-1, 1, 1)
        return action, {"action": action}

    def derive_train_state(self, runtime_state: dict) -> dict:
        return {"action": runtime_state["action"]}

    def feedback(self, *, obs, runtime_state, train_state=None, terminated, truncated, next_obs,
                 reward, info, next_terminated, next_truncated, prev_node):
        self.record_finished_episode(info, next_terminated, next_truncated)
        self.buffer.add(obs["states"]["state"], int(np.asarray(train_state["action"]).reshape(-1)[0]),
                        float(np.sum(reward)), next_obs["states"]["state"], next_terminated)
        self.global_step += 1
        return prev_node, self.global_step, {}

    def updates_due(self) -> int:
        return max(self.global_step - self.config.learning_starts, 0) // self.config.train_frequency

    def should_learn(self) -> bool:
        return self.updates < self.updates_due()

    def learn_impl(self) -> tuple[int, dict]:
        logged = self.updates // self.config.log_every
        while self.updates < self.updates_due():
            self.updates += 1
            if self.buffer.size >= self.config.batch_size:
                self.update()
        if self.updates // self.config.log_every == logged or not self.last:
            return self.global_step, {}
        return self.global_step, {f"train/{k}": v.item() for k, v in self.last.items()} | {"train/epsilon": self.epsilon()}

    def update(self) -> None:
        cfg = self.config
        obs, action, reward, next_obs, done = self.buffer.sample(cfg.batch_size, self.device)
        with torch.no_grad():  # Double DQN: the online network picks, the target evaluates
            next_action = self.q(next_obs).argmax(dim=1, keepdim=True)
            next_q = self.q_target(next_obs).gather(1, next_action).squeeze(1)
            target = reward + cfg.gamma * (1 - done) * next_q
        q = self.q(obs).gather(1, action.unsqueeze(1)).squeeze(1)
        loss = F.smooth_l1_loss(q, target)  # Huber
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        self.last.update(td_loss=loss.detach(), q_values=q.detach().mean())
        if self.updates % cfg.target_network_frequency == 0:
            self.q_target.load_state_dict(self.q.state_dict())

    def should_save(self) -> bool:
        return self.updates - self.saved_at >= self.config.save_every

    def create_checkpoint(self) -> Checkpoint:
        self.saved_at = self.updates
        meta = {"updates": self.updates, "saved_at": self.saved_at, "q_target": self.q_target.state_dict()}
        return Checkpoint(step=self.global_step, model=self.policy.state_dict(),
                          optimizer=self.optimizer.state_dict(), meta=meta)

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        super().load_checkpoint(checkpoint)
        self.updates, self.saved_at = int(checkpoint.meta["updates"]), int(checkpoint.meta["saved_at"])
        self.q_target.load_state_dict(checkpoint.meta["q_target"])
        if checkpoint.optimizer is not None:
            self.optimizer.load_state_dict(checkpoint.optimizer)
'''


def stuck_run(args, seed, tmp_path, pythonpath):
    """Exercise 2: start the stuck server, wait for its learns to climb, Ctrl-C; its run directory."""
    args = filled(args, seed, tmp_path, {"my_algo": "plugrl_test_my_algo"})
    run_dir = pathlib.Path(args[args.index("--run-dir") + 1])
    with Background(tmp_path, f"stuck-{seed}", [SOURCE, *args], pythonpath=pythonpath) as server:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.proc.poll() is None:
            learns = [int(n.replace(",", "")) for n in re.findall(r"\| ([\d,]+) learns", server.stdout())]
            if learns and learns[-1] >= 20_000:
                break
            time.sleep(0.5)
        server.proc.send_signal(signal.SIGINT)
        assert server.wait(120) == 0, server.stdout()[-2000:] + server.stderr()[-2000:]
    return run_dir


def measure_exercise(number: int, seed: int, tmp_path) -> list:
    """The figures of exercise `number`'s check for one seed, one per `X to Y` of its text (None: not a
    figure of this seed's run, e.g. pg's own range quoted beside PPO's)."""
    commands, sub = exercise_commands(number), tmp_path / f"ex{number}-seed{seed}"
    sub.mkdir()
    if number == 1:
        done = train(filled(commands[0], seed, sub))
        return [sum("(stale:" in line for line in done.stdout.splitlines())]  # the README's grep -c "(stale:"
    if number == 2:
        write_plugin(sub, "plugrl_test_my_algo", EXERCISE_STUCK)
        run_dir = stuck_run(next(c for c in commands if "stuck" in c), seed, sub, sub)
        figures = curve_figures(run_dir)
        saved = (run_dir / "checkpoints" / "step_000000001000.pt").exists()
        held = figures["steps"] == 1000 and saved
        print(f"seed {seed}: {figures['steps']:,} steps, step_000000001000.pt {'saved' if saved else 'absent'} "
              f"(README: 1,000 steps and that checkpoint): {'met' if held else 'missed'}")
        return [figures["learns"]]
    if number == 3:
        project = project_copy(sub, "project", {"sac_example.py": [("    on_policy = False", "    on_policy = True")]})
        args = filled(commands[0], seed, sub)
        train(args, cwd_source=str(project / "plugrl_min.py"))
        run_dir = args[args.index("--run-dir") + 1]
        figures = curve_figures(run_dir)
        shown = {what: int(count.replace(",", "")) for count, what in re.findall(r"`([\d,]+) (steps|learns)`",
                                                                                 exercise_text(3))}
        held = (figures["steps"], figures["learns"]) == (shown["steps"], shown["learns"])
        print(f"seed {seed}: {figures['steps']:,} steps, {figures['learns']:,} learns (README: {shown['steps']:,} "
              f"and {shown['learns']:,}): {'met' if held else 'missed'}")
        return [figures["discarded"]]
    if number == 4:
        server_args, client_args = (filled(c, seed, sub) for c in commands[:2])
        server_args[server_args.index("--port") + 1] = "0"
        rates = []
        with Background(sub, "server", [SOURCE, *server_args]) as server:
            port = server.port()
            for envs in ("1", "64"):
                args = list(client_args)
                args[args.index("--num-envs") + 1] = envs
                done = train([*args, "--server-port", str(port)])
                rates.append(float(re.search(r"([\d.]+) env steps/s", done.stdout).group(1)))
            server.proc.send_signal(signal.SIGINT)
            server.wait(60)
        return [rates[1] / rates[0]]
    if number == 5:
        write_plugin(sub, "plugrl_test_my_ctrl", EXERCISE_P_CONTROLLER)
        server_args = filled(commands[0], seed, sub)
        lines = {}
        for controller in ("track", "p5"):
            args = list(server_args) + ["--port", "0"]
            args[args.index("--run-dir") + 1] += f"-{controller}"
            with Background(sub, f"server-{controller}", [SOURCE, *args]) as server:
                train(["env-client", "dummy-v1", "--closed-loop-steps", "4", "--seed", str(seed), "--num-episodes", "0",
                       "--controller", controller, "--plugin", "plugrl_test_my_ctrl", "--server-port", str(server.port())],
                      pythonpath=sub)
                assert server.wait(120) == 0
            report = python(SOURCE, "report", args[args.index("--run-dir") + 1])
            lines[controller] = re.search(r"last 100\+ episodes .*?\| best [-\d.]+", report.stdout).group(0)
        quoted = seed != 1 or lines["track"] in exercise_text(5)  # the README quotes seed 1's line
        held = lines["track"] == lines["p5"] and quoted
        print(f"seed {seed}: track: {lines['track']} | p, kp = 5: {lines['p5']}: {'met' if held else 'missed'}")
        return []
    if number == 6:
        write_plugin(sub, "plugrl_test_my_chase", EXERCISE_CHASE)
        args = filled(commands[0], seed, sub, {"my_chase": "plugrl_test_my_chase"})
        train(args, pythonpath=sub)
        figures = curve_figures(args[args.index("--run-dir") + 1])
        return [figures["first"], figures["last"], figures["best"]]
    if number == 7:
        reach = float(re.search(r"--reach (\d+)", exercise_text(7)).group(1))
        reached, last = [], []
        for frames in ("512", "1024", "4096"):
            args = [arg.replace("F", frames) if arg in ("F",) or arg.startswith("runs/") else arg
                    for arg in commands[0]]
            args = filled(args, seed, sub)
            train(args)
            figures = curve_figures(args[args.index("--run-dir") + 1], reach)
            reached.append(figures["reach"])
            last.append(figures["last"])
        return reached + last
    if number == 8:
        project = project_copy(sub, "project", {"plugrl_min.py": EXERCISE_8_EDIT})
        args = filled(commands[0], seed, sub)
        train(args, cwd_source=str(project / "plugrl_min.py"))
        figures = curve_figures(args[args.index("--run-dir") + 1], 195)
        return [figures["reach"], figures["last"]]
    if number == 9:
        write_plugin(sub, "plugrl_test_my_dqn", EXERCISE_DQN)
        args = filled(commands[0], seed, sub, {"my_dqn": "plugrl_test_my_dqn"})
        train(args, pythonpath=sub)
        figures = curve_figures(args[args.index("--run-dir") + 1], 195)
        return [figures["reach"], figures["last"]]
    raise ValueError(number)


QUOTED_SEEDS = (1, 2, 3, 4, 5)  # the README's checks hold for each; its figures are theirs


@bench
@pytest.mark.parametrize("number", range(1, 10))
def test_bench_exercise_checks_over_seeds_1_to_5(tmp_path, number):
    ranges = exercise_ranges(number)
    rows = [measure_exercise(number, seed, tmp_path) for seed in QUOTED_SEEDS]
    print(f"\nexercise {number}: {exercise_text(number)[:60]}...")
    for i, (low, high) in enumerate(ranges):
        figures = [row[i] for row in rows]
        held = all(low <= figure <= high for figure in figures)
        print(f"  check {i + 1}: seeds {QUOTED_SEEDS[0]} to {QUOTED_SEEDS[-1]} measured "
              f"{' / '.join(f'{f:,.2f}' for f in figures)} (README: {low:,g} to {high:,g}): "
              f"{'met' if held else 'missed'}")


def seen_by_the_server(words, monkeypatch) -> dict:
    """A README server command run up to its serving (Server.run replaced): what the run would use."""
    seen = {}

    async def run(self, host, port, on_listening=None):
        seen.update(global_steps=self.algo.config.global_steps, seed=torch.initial_seed(), port=port)
        return 0

    monkeypatch.setattr(plugrl_min.Server, "run", run)
    status, _, err = run_main(*words)
    assert status == 0, err
    return seen


def test_exercise_4s_server_command_as_written_outlasts_both_clients(monkeypatch, tmp_path):
    server, client = exercise_commands(4)[:2]
    assert seen_by_the_server(server, monkeypatch)["global_steps"] >= 10**9  # not dummy's 10,000 steps
    assert "--num-episodes" in client and "--seed" in client


DQN_STUB = '''
from plugrl_min import DummyAlgoConfig, DummyAlgorithm, register_algo, register_algo_config
register_algo_config("dqn")(DummyAlgoConfig)
register_algo("dqn")(DummyAlgorithm)  # a stand-in for the student's dqn: the words and flags are the subject
'''


def test_exercise_9s_command_as_written_parses_with_its_seed(tmp_path, plugins_in_process, monkeypatch):
    write_plugin(tmp_path, "plugrl_test_my_dqn", DQN_STUB)
    words = filled(exercise_commands(9)[0], 3, tmp_path, {"my_dqn": "plugrl_test_my_dqn"})
    torch.manual_seed(12345)  # so that 3 comes from the command's --seed S, not from an earlier test
    assert seen_by_the_server(words, monkeypatch)["seed"] == 3


def test_the_worked_solutions_are_needed_by_the_exercise_bench_and_handout_checks_alone():
    """A teacher removes the EXERCISE_* strings before handing out: no test of the README's command may need them."""
    tree = ast.parse(pathlib.Path(__file__).read_text())
    solutions = {target.id for node in tree.body if isinstance(node, ast.Assign) for target in node.targets
                 if isinstance(target, ast.Name) and target.id.startswith("EXERCISE_")}
    functions = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    names = {name: {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} for name, node in functions.items()}
    needs = {name for name in functions if names[name] & solutions}
    while True:  # a function that calls one that needs them needs them too
        more = {name for name in functions if names[name] & needs} - needs
        if not more:
            break
        needs |= more
    elsewhere = [node.lineno for node in tree.body if not isinstance(node, (ast.FunctionDef, ast.Assign))
                 and {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} & (solutions | needs)]
    tests = sorted(name for name in needs if name.startswith("test_"))
    assert len(solutions) >= 5 and tests and elsewhere == []
    assert [name for name in tests if not name.startswith(("test_bench_", "test_handout_"))] == []


def test_every_exercise_has_one_check_per_figure_its_bench_measures():
    counts = {number: len(exercise_ranges(number)) for number in range(1, 10)}
    assert counts == {1: 1, 2: 0, 3: 1, 4: 1, 5: 0, 6: 3, 7: 6, 8: 2, 9: 2}  # len(measure_exercise(number, ...))


SEED_FIGURES = re.compile(rf"{FIGURE}(?: / {FIGURE})+")  # a run of figures, one per seed


def test_every_exercise_check_quotes_one_figure_per_bench_seed_and_each_holds():
    seeds = f"seeds {QUOTED_SEEDS[0]} to {QUOTED_SEEDS[-1]}"
    assert f"Each check\nholds for {seeds}" in readme() and QUOTED_SEEDS == tuple(range(1, 6)), seeds
    for number in range(1, 10):
        check = exercise_text(number).split("*Check:*", 1)[1]
        found = list(CHECK.finditer(check))
        assert len(found) == len(exercise_ranges(number))
        for match, following, (low, high) in zip(found, found[1:] + [None], exercise_ranges(number)):
            after = check[match.end():following.start() if following else len(check)]  # up to the next check
            (quoted,) = SEED_FIGURES.findall(after) or [None]  # exactly one run of figures: its seeds'
            assert quoted, f"exercise {number}: {match.group(0)} quotes no run of figures for its seeds"
            figures = [number_of(text) for text in quoted.split(" / ")]
            assert len(figures) == len(QUOTED_SEEDS), (number, match.group(0), figures)
            assert all(low <= figure <= high for figure in figures), (number, match.group(0), figures)


# =============================================================================================
# Benchmarks, opt-in: PLUGRL_BENCH=1 python -m pytest -n 0 test_plugrl_min.py -k bench -s
# =============================================================================================
# Measurements, not tests of behaviour: each prints its figures (the README quotes them) and, beside each
# bar, whether it was met or missed; it asserts only that the runs it times ran to the end, since a failed run
# gives no figure worth printing. They take minutes, and a normal test run skips them.

BENCH_BODIES_NOT_RUN = '''
import pytest


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A benchmark's body is not run: whether pytest skipped it is the subject."""
    if pyfuncitem.name.startswith("test_bench_"):
        return True
'''


def benchmark_outcomes(tmp_path, value) -> dict:
    """Every test_bench_* of this file run by a fresh pytest with PLUGRL_BENCH=value (None: unset), their bodies
    replaced by nothing: {test id: (outcome, skip reason)} from its JUnit XML."""
    import xml.etree.ElementTree
    write_plugin(tmp_path, "plugrl_test_no_bench_bodies", BENCH_BODIES_NOT_RUN)
    env = {key: val for key, val in subprocess_env(tmp_path).items() if key != "PLUGRL_BENCH"}
    env.update({} if value is None else {"PLUGRL_BENCH": value})
    report = tmp_path / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p",
                    "plugrl_test_no_bench_bodies", os.path.basename(__file__), "-k", "test_bench_",
                    f"--junitxml={report}"], cwd=HERE, env=env, capture_output=True, text=True, timeout=300,
                   stdin=subprocess.DEVNULL)
    outcomes = {}
    for case in xml.etree.ElementTree.parse(report).iter("testcase"):
        verdicts = [child for child in case if child.tag in ("skipped", "failure", "error")]
        outcomes[case.get("name")] = (verdicts[0].tag, verdicts[0].get("message", "")) if verdicts else ("passed", "")
    return outcomes


def test_a_run_without_plugrl_bench_1_skips_every_benchmark_saying_how_to_run_it(tmp_path):
    outcomes = benchmark_outcomes(tmp_path, None)
    benchmarks = {name for name in globals() if name.startswith("test_bench_")}
    assert {name.split("[", 1)[0] for name in outcomes} == benchmarks  # every one of them, and nothing else
    assert {outcome for outcome, _ in outcomes.values()} == {"skipped"}
    assert all("run with PLUGRL_BENCH=1" in reason for _, reason in outcomes.values()), outcomes


def test_plugrl_bench_1_runs_every_benchmark(tmp_path):
    outcomes = benchmark_outcomes(tmp_path, "1")
    benchmarks = {name for name in globals() if name.startswith("test_bench_")}
    assert {name.split("[", 1)[0] for name in outcomes} == benchmarks
    assert {outcome for outcome, _ in outcomes.values()} == {"passed"}, outcomes  # none skipped


RAN_TO_THE_END = re.compile(r"[\w.]+\.returncode == 0|finish\(.*\) == 0|status == 0")  # a run's exit status 0
FIGURES_PRODUCED = {  # the throughput bench's: every client served to its end, and every figure a number
    "run['episodes'] >= run['asked']",
    "all((math.isfinite(figure) and figure > 0 for figure in figures.values()))",
    "math.isfinite(ratios['memory'])",
}


def test_every_bench_asserts_only_that_the_runs_it_times_ran_to_the_end():
    """A bench prints met or missed beside each bar, since load moves its figures; a promise of the README is a
    test of its own. It asserts only what makes its figures worth printing: each run it timed exited with
    status 0, and, in the throughput bench, every client was served to its end and every figure is a number."""
    with open(__file__) as file:
        tree = ast.parse(file.read())
    benches = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_bench_")]
    asserted = {(bench.name, ast.unparse(node.test)) for bench in benches for node in ast.walk(bench)
                if isinstance(node, ast.Assert)}
    assert benches and asserted  # the file was read, and its benches do assert that their runs ended
    assert {(name, test) for name, test in asserted
            if not RAN_TO_THE_END.fullmatch(test) and test not in FIGURES_PRODUCED} == set()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_listening(port: int, process, timeout=60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server exited with {process.returncode}"
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise AssertionError(f"no server on port {port} after {timeout} s")


# --- SAC over the wire against CleanRL's loop in-process, pendulum-v1 -----------------------------

def sac_seed(seed: int, steps: int, folder, *flags) -> dict:
    """One SAC server (with these flags) and one pendulum-v1 client as processes: the client's summary, timed.
    The server's output goes to seed{seed}.log in folder."""
    port = str(free_port())
    with open(folder / f"seed{seed}.log", "w") as log:
        server = subprocess.Popen([sys.executable, "plugrl_min.py", "dummy-policy", "default", "sac", "default",
                                   "--port", port, "--seed", str(seed), "--algo.global-steps", str(steps),
                                   "--run-dir", str(folder / f"seed{seed}"), *flags], cwd=HERE, stdout=log)
    try:
        client = python("plugrl_min.py", "env-client", "pendulum-v1", "--server-port", port, "--seed", str(seed),
                        "--num-episodes", "0", "--summary-json", str(folder / f"seed{seed}.json"),
                        "--connect-timeout", "60", timeout=3600)
        assert client.returncode == 0, client.stderr
        assert server.wait(60) == 0
    finally:
        server.kill()
    with open(folder / f"seed{seed}.json") as file:
        return json.load(file)


def cleanrl_update_ms(updates: int = 400) -> float:
    """ms per learning step of CleanRL's SAC loop on the pendulum, in-process and written its way:
    nn.Linear critics, torch.distributions, a second sample for alpha, three Adams, a Python
    target update, one action per environment step."""
    def mlp(n_in, n_out):
        return nn.Sequential(nn.Linear(n_in, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, n_out))

    actor, qf1, qf2, qf1_target, qf2_target = mlp(3, 2), mlp(4, 1), mlp(4, 1), mlp(4, 1), mlp(4, 1)
    log_alpha, alpha = torch.zeros(1, requires_grad=True), 1.0
    q_optimizer = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=1e-3)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=3e-4)
    alpha_optimizer = torch.optim.Adam([log_alpha], lr=1e-3)
    frames = np.random.randn(20_000, 9).astype(np.float32)  # obs 3, action 1, reward, next obs 3, done

    def get_action(x):  # CleanRL's Actor.get_action, action scale 2
        mean, log_std = actor(x).chunk(2, dim=-1)
        normal = torch.distributions.Normal(mean, (-5 + 3.5 * (torch.tanh(log_std) + 1)).exp())
        x_t = normal.rsample()
        log_prob = normal.log_prob(x_t) - torch.log(2 * (1 - torch.tanh(x_t).pow(2)) + 1e-6)
        return 2 * torch.tanh(x_t), log_prob.sum(1, keepdim=True)

    for step in range(50 + updates):  # the first 50 warm up
        if step == 50:
            start = time.perf_counter()
        get_action(torch.Tensor(frames[:1, :3]))[0].detach().numpy()  # the action of this env step
        batch = torch.tensor(frames[np.random.randint(0, len(frames), 256)])
        obs, action, reward, next_obs, done = batch.split([3, 1, 1, 3, 1], dim=1)
        with torch.no_grad():
            next_action, next_log_prob = get_action(next_obs)
            next_sa = torch.cat([next_obs, next_action], 1)
            next_q = torch.min(qf1_target(next_sa), qf2_target(next_sa)) - alpha * next_log_prob
            target = reward.flatten() + (1 - done.flatten()) * 0.99 * next_q.view(-1)
        sa = torch.cat([obs, action], 1)
        q_loss = (nn.functional.mse_loss(qf1(sa).view(-1), target)
                  + nn.functional.mse_loss(qf2(sa).view(-1), target))
        q_optimizer.zero_grad()
        q_loss.backward()
        q_optimizer.step()
        if step % 2 == 0:  # policy_frequency 2: two actor steps every second update
            for _ in range(2):
                pi, log_pi = get_action(obs)
                s_pi = torch.cat([obs, pi], 1)
                actor_loss = (alpha * log_pi - torch.min(qf1(s_pi), qf2(s_pi))).mean()
                actor_optimizer.zero_grad()
                actor_loss.backward()
                actor_optimizer.step()
                with torch.no_grad():
                    _, log_pi = get_action(obs)
                alpha_loss = (-log_alpha.exp() * (log_pi - 1)).mean()  # target entropy -1
                alpha_optimizer.zero_grad()
                alpha_loss.backward()
                alpha_optimizer.step()
                alpha = log_alpha.exp().item()
        for q, q_target in ((qf1, qf1_target), (qf2, qf2_target)):
            for param, target_param in zip(q.parameters(), q_target.parameters()):
                target_param.data.copy_(0.005 * param.data + 0.995 * target_param.data)
    return 1000 * (time.perf_counter() - start) / updates


def trained_and_evaluated(run_dir, last: int, seed: int, *flags) -> tuple[str, str, str]:
    """A trained run's figures as printed: `report RUN --last N`'s, and the mean and std of
    `eval RUN --seed S FLAGS`, greedy, 10 episodes."""
    report = python("plugrl_min.py", "report", str(run_dir), "--last", str(last))
    assert report.returncode == 0, report.stderr
    figure = re.search(r"\| (?:last \d+\+|all \d+) episodes (-?[\d.]+)", report.stdout).group(1)
    evaluated = python("plugrl_min.py", "eval", str(run_dir), "--seed", str(seed), *flags,
                       timeout=600)
    assert evaluated.returncode == 0, evaluated.stderr
    line = evaluated.stdout.strip().splitlines()[-1]
    mean, std = re.search(r"mean return (\S+) \| std (\S+)", line).groups()
    return figure, mean, std


@bench
def test_bench_sac_learns_pendulum_over_the_wire_no_slower_than_cleanrl_in_process(tmp_path):
    """Each seed's one run gives all its figures: its time, `report --last 10` and, after CleanRL's
    loop is timed, its greedy `eval --seed S` (the figures "Trained, then evaluated" points to)."""
    seeds, steps, bar = 3, 15_000, -200.0
    updates = steps - sac_example.SACConfig().learning_starts
    rows = []
    for seed in range(1, seeds + 1):  # one at a time: two runs would share the cores
        summary = sac_seed(seed, steps, tmp_path)
        # CleanRL's loop, timed right after the run (same machine, same load), without its
        # 5,000 random steps (about a second): in CleanRL's favour.
        reference = updates * cleanrl_update_ms() / 1000
        # Its client was not the server's own: eval is told the environment.
        figure, mean, std = trained_and_evaluated(tmp_path / f"seed{seed}", 10, seed,
                                                  "--env", "pendulum-v1")
        rows.append((float(figure), summary["seconds"], reference))
        print(f"| {seed} | {figure} | {mean} (std {std}) | {summary['seconds']:.1f} s | "
              f"{reference:.1f} s | {os.getloadavg()[0]:.1f} | ({summary['env_steps']} env steps)",
              flush=True)
    returns, seconds, references = (np.array(column) for column in zip(*rows))
    learns = bool((returns >= bar).all())
    fast = seconds.mean() <= references.mean()  # one seed's time swings by a tenth with load
    print(f"summary: returns {'met' if learns else 'missed'} (worst `report --last 10` "
          f"{returns.min():.2f}, bar {bar:g}) | speed {'met' if fast else 'missed'} (mean "
          f"{seconds.mean():.1f} s per seed, CleanRL in-process {references.mean():.1f} s)")


# --- The wire's cost: the same agent in this process (--in-process) and over the wire, in one run -------

def learn_threads_used(log: str) -> collections.Counter:
    """How many of the server's progress lines (one per 10 s) show each learn thread count."""
    return collections.Counter(int(count) for count in re.findall(r"ms, (\d+) threads?", log))


def timed_command(words: list[str], run_dir) -> dict:
    """`python plugrl_min.py WORDS --run-dir RUN_DIR`, timed from its start to its exit as a user waits for it:
    its seconds, the learn threads its progress lines show, and report's figure of its run."""
    started = time.perf_counter()
    result = subprocess.run([sys.executable, "plugrl_min.py", *words, "--run-dir", str(run_dir)], cwd=HERE,
                            env=subprocess_env(), capture_output=True, text=True, timeout=3600,
                            stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - started
    assert result.returncode == 0, result.stderr
    figure = re.search(r"\| (?:last \d+\+|all \d+) episodes (-?[\d.]+)", result.stdout)  # report's own line
    return {"seconds": seconds, "threads": dict(learn_threads_used(result.stdout)), "figure": float(figure[1])}


@bench
def test_bench_the_wires_cost_the_same_agent_in_process_and_over_the_wire(tmp_path):
    agents = {"pg, the quickstart": ["dummy-policy", "default", "pg", "default", "--local-num-envs", "16"],
              "sac, pendulum-v1, 15,000 steps": ["dummy-policy", "default", "sac", "default", "--local-env",
                                                 "pendulum-v1"],
              # The same steps and round trips with no update at all: what the wire costs a step, alone.
              "sac without its updates": ["dummy-policy", "default", "sac", "default", "--local-env", "pendulum-v1",
                                          "--algo.learning-starts", "15000"]}
    most = 1.10  # sac over the wire at most 1.10 x in this process
    totals = {}
    for name, words in agents.items():
        # One run at a time, the order swapped each seed: the first of a pair ran slower here, and a drift in
        # load favours neither. Four pairs: one pair's ratio swings by a third on this shared machine.
        for seed in (1, 2, 3, 4):
            ways = {"in-process": ["--in-process"], "wire": ["--local-env-clients", "1"]}
            order = list(ways) if seed % 2 else list(reversed(ways))
            folder = tmp_path / f"agent{list(agents).index(name)}"
            runs = {way: timed_command([*words, *ways[way], "--seed", str(seed)], folder / f"{way}-{seed}")
                    for way in order}
            for way, run in runs.items():
                totals.setdefault((name, way), []).append(run["seconds"])
            print(f"{name} | seed {seed} | in-process {runs['in-process']['seconds']:.1f} s | over the wire "
                  f"{runs['wire']['seconds']:.1f} s | {runs['wire']['seconds'] / runs['in-process']['seconds']:.2f} x | "
                  f"figures {runs['in-process']['figure']:.2f} and {runs['wire']['figure']:.2f} | learn threads "
                  f"{runs['in-process']['threads']} and {runs['wire']['threads']} | load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
    ratios = {name: sum(totals[(name, "wire")]) / sum(totals[(name, "in-process")]) for name in agents}
    for name, ratio in ratios.items():  # over every seed: one seed's time swings with load
        extra = (sum(totals[(name, 'wire')]) - sum(totals[(name, 'in-process')])) / len(totals[(name, 'wire')])
        print(f"summary: {name}: over the wire {sum(totals[(name, 'wire')]):.1f} s, in-process "
              f"{sum(totals[(name, 'in-process')]):.1f} s: {ratio:.2f} x; the wire's {extra:.1f} s a run")
    print(f"sac's bar: at most {most} x: {'met' if ratios['sac, pendulum-v1, 15,000 steps'] <= most else 'missed'}")


# --- Training's figure beside the greedy evaluation's, for three trained runs ---------------------------

@bench
def test_bench_the_readmes_eval_table_trained_runs_and_their_greedy_evaluation(tmp_path):
    """The pg runs of README's "Trained, then evaluated" (the quickstart's is eval's example there);
    its sac figures are -k bench_sac's, that run's own."""
    runs = {"the quickstart: `pg`, dummy-v1": (["dummy-policy", "default", "pg", "default", "--local-num-envs",
                                                "16"], 100),
            "`pg`, cartpole-v1": (["categorical-policy", "cartpole", "pg", "default", "--local-num-envs", "16",
                                   "--local-env", "cartpole-v1"], 100)}
    print("| run, seed 1 | `report --last N`: the last N+ episodes of training | `eval --seed 1`: greedy, 10 "
          "episodes |\n|---|---|---|")
    for name, (words, last) in runs.items():
        run_dir = tmp_path / f"run{len(os.listdir(tmp_path))}"
        trained = python("plugrl_min.py", *words, "--local-env-clients", "1", "--seed", "1", "--run-dir",
                         str(run_dir), timeout=3600)
        assert trained.returncode == 0, trained.stderr
        figure, mean, std = trained_and_evaluated(run_dir, last, 1)
        print(f"| {name} | {figure} (N = {last}) | {mean} (std {std}) | load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)


# --- Throughput: the full server against a floor server, in the same run --------------------------

FLOOR_SERVER = '''
import asyncio, sys, types, numpy as np, torch
sys.path.insert(0, ".")
torch.set_num_threads(1)
import plugrl_min as p
from websockets.asyncio.server import serve
policy = p.make_policy("dummy-policy")
server = p.Server(p.make_algo("dummy", policy), "/dev/null", ("dummy-policy", "floor"))
async def handler(ws):  # the protocol and the policy, and nothing else
    await ws.send(p.pack_message(server.metadata))
    held = {}  # reuse-feedback-obs, which the metadata lists: each environment's last feedback row
    async for frame in ws:
        message = p.unpack_message(frame)
        ids = message["env_indices"].tolist()
        if message["message_type"] == "feedback":
            data = message["data"]
            for row, (i, ended) in enumerate(zip(ids, (data["terminated"] | data["truncated"]).tolist())):
                held[i] = None if ended else (data["obs"], row)
        elif message["message_type"] == "infer":
            obs = message["data"]
            if message.get("reuse") is not None:
                slots = [types.SimpleNamespace(fed=held.get(i)) for i in ids]
                obs = p.reused_obs(slots, ids, message["reuse"], obs)
            action, _ = policy.get_action_and_runtime_state(obs)
            await ws.send(p.pack_message({"message_type": "action", "data": {
                "env_ids": message["env_indices"], "action": np.moveaxis(action, 0, 1)}}))
async def main():
    async with serve(handler, "127.0.0.1", int(sys.argv[1]), compression=None, max_size=None):
        await asyncio.Future()
asyncio.run(main())
'''


def peak_memory_mb(pid) -> float:
    with open(f"/proc/{pid}/status") as file:
        return next(int(line.split()[1]) / 1024 for line in file if line.startswith("VmHWM:"))


def run_layout(clients, envs, episodes, folder, floor=False) -> dict:
    """`clients` dummy-v1 env clients of `envs` environments against the full or the floor server."""
    port = free_port()
    command = (["-c", FLOOR_SERVER, str(port)] if floor else
               ["plugrl_min.py", "dummy-policy", "default", "dummy", "default", "--port", str(port),
                "--algo.global-steps", str(10**12), "--run-dir", str(folder / f"run-{port}")])
    server = subprocess.Popen([sys.executable, *command], cwd=HERE, stdout=subprocess.DEVNULL)
    try:
        wait_listening(port, server)
        summaries = [folder / f"summary-{port}-{i}.json" for i in range(clients)]
        processes = [subprocess.Popen([sys.executable, "plugrl_min.py", "env-client", "dummy-v1", "--server-port",
                                       str(port), "--num-envs", str(envs), "--num-episodes", str(episodes),
                                       "--summary-json", str(path)], cwd=HERE, stdout=subprocess.DEVNULL)
                     for path in summaries]
        assert all(process.wait(600) == 0 for process in processes)
        memory = peak_memory_mb(server.pid)
    finally:
        server.kill()
        server.wait()
    results = [json.loads(path.read_text()) for path in summaries]
    steps = sum(result["env_steps"] for result in results)
    return {"rate": steps / max(result["seconds"] for result in results), "memory_mb": memory,
            "steps_per_episode": steps / sum(result["episodes"] for result in results),
            "episodes": min(result["episodes"] for result in results), "asked": episodes}  # per client


def layout_pair(clients, envs, seconds, folder):
    """The same work on both servers, sized so the full server runs about `seconds`."""
    probe = run_layout(clients, envs, max(4, 2 * envs), folder)
    episodes = max(4, int(probe["rate"] * seconds / clients / probe["steps_per_episode"]))
    floor = run_layout(clients, envs, episodes, folder, floor=True)
    return run_layout(clients, envs, episodes, folder), floor


CODEC = '''
import functools, json, sys, timeit, numpy as np
sys.path.insert(0, ".")
import plugrl_min as p
import msgpack
from test_plugrl_min import openpi_pack_array, openpi_unpack_array, step_messages
pack = functools.partial(msgpack.packb, default=openpi_pack_array)  # PlugRL's codec: openpi's hooks
unpack = functools.partial(msgpack.unpackb, object_hook=openpi_unpack_array)


def seconds(code, message, number):
    return min(timeit.repeat(lambda: code(message), number=number, repeat=5)) / number


out = {}
for n in (1, 64):
    messages = [dict(m, obs={"state": m["obs"]["state"]}) if "obs" in m else m for m in step_messages(n)]
    out[n] = [1e6 * sum(seconds(lambda m: p.unpack_message(p.pack_message(m)), m, 2000) for m in messages),
              1e6 * sum(seconds(lambda m: unpack(pack(m)), m, 2000) for m in messages)]
camera = {"message_type": "infer", "env_indices": np.arange(1), "obs": step_messages(1)[0]["obs"]}
out["camera"] = [1e6 * seconds(lambda m: p.unpack_message(p.pack_message(m)), camera, 500),
                 1e6 * seconds(lambda m: unpack(pack(m)), camera, 500)]
print(json.dumps(out))
'''


@bench
def test_bench_throughput_against_the_protocols_floor(tmp_path):
    bars = {"one": 0.9, "64 envs": 0.9, "8x8": 1.0, "batching": 15.0, "memory": 100.0, "codec": 2.5,
            "codec camera": 1.0}
    one, one_floor = layout_pair(1, 1, 4.0, tmp_path)
    b64, b64_floor = layout_pair(1, 64, 4.0, tmp_path)
    many, many_floor = layout_pair(8, 8, 4.0, tmp_path)
    torch_only = subprocess.run([sys.executable, "-c", "import torch; print(open('/proc/self/status').read())"],
                                capture_output=True, text=True, check=True).stdout
    torch_mb = next(int(line.split()[1]) / 1024 for line in torch_only.splitlines() if line.startswith("VmHWM:"))
    ratios = {"one": one["rate"] / one_floor["rate"], "64 envs": b64["rate"] / b64_floor["rate"],
              "8x8": many["rate"] / many_floor["rate"], "batching": b64["rate"] / one["rate"],
              "memory": many["memory_mb"] - torch_mb}
    for name, label, full, floor in (("one", "1 client x 1 env  ", one, one_floor),
                                     ("64 envs", "1 client x 64 envs", b64, b64_floor),
                                     ("8x8", "8 clients x 8 envs", many, many_floor)):
        print(f"{label}   full {full['rate']:8.0f}  floor {floor['rate']:8.0f} env steps/s  "
              f"{ratios[name]:.2f} x floor (bar {bars[name]})")
    print(f"batching             {ratios['batching']:8.1f} x   64 envs over 1 env, full server (bar {bars['batching']})")
    print(f"server peak memory   {many['memory_mb']:8.0f} MB  {ratios['memory']:+.0f} MB over bare torch "
          f"{torch_mb:.0f} MB (bar +{bars['memory']:.0f})")
    codec = subprocess.run([sys.executable, "-c", CODEC], cwd=HERE, capture_output=True, text=True)
    if codec.returncode == 0:
        for n, (ours, theirs) in json.loads(codec.stdout).items():
            name = "codec camera" if n == "camera" else f"codec {n}"
            ratios[name] = ours / theirs
            what = "a 180 KB camera frame" if n == "camera" else f"a step's three messages, {n} env(s)"
            print(f"{name:20s} plugrl_min {ours:6.1f} us, msgpack with openpi's hooks {theirs:6.1f} us ({what}, "
                  f"pack and unpack)  {ours / theirs:.2f} x (bar <= {bars.get(name, bars['codec'])})")
    else:
        print(f"codec                not measured: pip install msgpack to compare ({codec.stderr[-200:]})")
    short = [name for name in ("one", "64 envs", "8x8", "batching") if ratios[name] < bars[name]]
    short += ["memory"] if ratios["memory"] > bars["memory"] else []
    short += [name for name in ratios if name.startswith("codec") and ratios[name] > bars.get(name, bars["codec"])]
    print("all bars hold" if not short else f"short of the bar: {', '.join(short)}")
    # The bars are printed, not asserted: the machine's load moves them. What holds on any machine: both servers
    # served every client to the end of its episodes (a client also exits 0 when a server ends the run), and
    # every figure is a number; each rate, memory and ratio above zero.
    runs = {"1 x 1": (one, one_floor), "1 x 64": (b64, b64_floor), "8 x 8": (many, many_floor)}
    for layout, pair in runs.items():
        for server, run in zip(("full", "floor"), pair):
            assert run["episodes"] >= run["asked"], f"{layout}, {server} server: {run['episodes']} of {run['asked']}"
    figures = {f"{layout} {server} {key}": run[key] for layout, pair in runs.items()
               for server, run in zip(("full", "floor"), pair) for key in ("rate", "memory_mb")}
    figures.update({name: ratio for name, ratio in ratios.items() if name != "memory"}, torch_mb=torch_mb)
    assert all(math.isfinite(figure) and figure > 0 for figure in figures.values()), figures
    assert math.isfinite(ratios["memory"])  # the server's peak over bare torch's: a difference, any sign


# --- Camera and HalfCheetah: the built-in policies on images, SAC on MuJoCo beside CleanRL's own script --

def readme_camera_module() -> str:
    """README's my_camera.py (section "Your own environment"), plus a twin whose picture is blank."""
    with open(os.path.join(HERE, "README.md")) as file:
        readme = file.read()
    source = re.search(r"```python\n(# my_camera\.py.*?)```", readme, re.S).group(1)
    return source + '''

@register_env("camera-blind-v0")
class BlindCamera(Camera):
    """camera-v0 with a blank picture: what a policy blind to the image can score."""

    def _observe(self):
        obs = super()._observe()
        obs["images"]["image"][:] = 0
        return obs
'''


def camera_run(tmp_path, algo: str, env_id: str, steps: int, seed: int, *flags) -> dict:
    run_dir = tmp_path / f"{algo}-{env_id}-{seed}"
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "plugrl_min.py", "dummy-policy", "default", algo, "default", "--plugin", "plugrl_bench_camera",
         "--local-env", env_id, "--local-env-clients", "1",  # dummy-policy sized from the camera
         "--algo.global-steps", str(steps), "--seed", str(seed), "--learn-threads", "1", "--run-dir", str(run_dir),
         *flags], cwd=HERE, capture_output=True, text=True, timeout=3600,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in read_metrics(run_dir, None) if line["rollout/episodes"] > 0]
    report = subprocess.run([sys.executable, "plugrl_min.py", "report", str(run_dir)], cwd=HERE, capture_output=True,
                            text=True, timeout=120).stdout.splitlines()[0]
    last = float(re.search(r"last \d+\+ episodes (-?[\d.,]+)", report).group(1).replace(",", ""))
    return {"first": lines[0]["rollout/reward"], "last": last, "seconds": time.perf_counter() - start,
            "report": report}


@bench
def test_bench_the_camera_task_is_learned_from_the_picture_by_pg_and_sac_with_dummy_policy(tmp_path):
    (tmp_path / "plugrl_bench_camera.py").write_text(readme_camera_module())
    # SAC's updates with convolutions cost ~50 ms each on a shared 2-core CPU: a shorter run, learning sooner.
    runs = [("pg", 100_000, ["--local-num-envs", "16"]), ("sac", 10_000, ["--algo.learning-starts", "1000"])]
    rows = {}
    for algo, steps, flags in runs:
        for env_id in ("camera-v0", "camera-blind-v0"):
            rows[algo, env_id] = run = camera_run(tmp_path, algo, env_id, steps, 1, *flags)
            print(f"{algo} {env_id:16s} {steps:>7,} steps: first learn's mean return {run['first']:7.2f} | "
                  f"last 100+ episodes {run['last']:7.2f} | {run['seconds']:6.1f} s | {run['report']}", flush=True)
    for algo, _, _ in runs:
        seeing, blind = rows[algo, "camera-v0"], rows[algo, "camera-blind-v0"]
        print(f"summary {algo}: seeing {seeing['first']:.2f} -> {seeing['last']:.2f}; blind to the picture "
              f"{blind['last']:.2f}; the picture's bar, 1.0 better than blind: "
              f"{'met' if seeing['last'] > blind['last'] + 1.0 else 'missed'}", flush=True)


# --- SAC on HalfCheetah, plugrl_min over the wire beside CleanRL's sac_continuous_action.py -----

def cleanrl_checkout() -> str | None:
    """A checkout of CleanRL (github.com/vwxyzjn/cleanrl, a clone or a bare mirror) named by $CLEANRL_DIR;
    None without one."""
    folder = os.environ.get("CLEANRL_DIR")
    return folder if folder and os.path.isdir(folder) else None


def cleanrl_script(folder: str, work: str) -> str:
    """cleanrl/ and cleanrl_utils/ of the checkout laid out in work (a bare git mirror has no work tree)."""
    if os.path.isfile(os.path.join(folder, "cleanrl", "sac_continuous_action.py")):
        return os.path.join(folder, "cleanrl", "sac_continuous_action.py")
    archive = subprocess.run(["git", "--git-dir", os.path.join(folder, ".git") if os.path.isdir(
        os.path.join(folder, ".git")) else folder, "archive", "HEAD", "cleanrl/sac_continuous_action.py",
        "cleanrl_utils"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", work], input=archive, check=True)
    return os.path.join(work, "cleanrl", "sac_continuous_action.py")


def cleanrl_python() -> tuple[str | None, str]:
    """A Python that runs CleanRL's script as written (gymnasium 0.29's vector API, tyro, mujoco): $CLEANRL_PYTHON,
    else this one if its gymnasium is 0.29; (None, why) otherwise."""
    candidate = os.environ.get("CLEANRL_PYTHON", sys.executable)
    probe = subprocess.run([candidate, "-c", "import gymnasium, mujoco, tyro; print(gymnasium.__version__)"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        return None, f"{candidate} cannot import gymnasium, mujoco and tyro: {probe.stderr.strip().splitlines()[-1]}"
    if not probe.stdout.strip().startswith("0.29"):
        return None, (f"{candidate} has gymnasium {probe.stdout.strip()}; CleanRL's script reads gymnasium 0.29's "
                      "final_info/final_observation: set CLEANRL_PYTHON to a Python with gymnasium[mujoco]==0.29.1")
    return candidate, ""


def cleanrl_seed(python: str, script: str, env_id: str, seed: int, steps: int, work: str) -> dict:
    start = time.perf_counter()
    result = subprocess.run([python, script, "--env-id", env_id, "--seed", str(seed), "--total-timesteps", str(steps),
                             "--no-cuda"], cwd=work, capture_output=True, text=True, timeout=7200,
                            env={**os.environ, "PYTHONPATH": work, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    returns = [float(value) for value in re.findall(r"episodic_return=\[?(-?[\d.e+-]+)", result.stdout)]
    return {"seconds": time.perf_counter() - start, "returns": returns}


def plugrl_cheetah_seed(env_id: str, seed: int, steps: int, folder, last_n: int) -> dict:
    """One plugrl_min server with a local client on gym:ENV_ID (dummy-policy sized from it), timed; its
    return is report's `--last N`."""
    run_dir = folder / f"plugrl-{seed}"
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "plugrl_min.py", "dummy-policy", "default", "sac", "default", "--local-env", f"gym:{env_id}",
         "--local-env-clients", "1", "--algo.global-steps", str(steps), "--seed", str(seed), "--learn-threads", "1",
         "--run-dir", str(run_dir)], cwd=HERE, capture_output=True, text=True, timeout=7200)
    assert result.returncode == 0, result.stderr[-3000:]
    curve = plugrl_min.return_curve(plugrl_min.read_metrics(str(run_dir)), last_n)
    return {"seconds": time.perf_counter() - start, "last": curve[-1][1]}


@bench
def test_bench_sac_on_halfcheetah_over_the_wire_beside_cleanrls_own_script(tmp_path):
    # One torch thread each (--learn-threads 1, OMP_NUM_THREADS=1): on a shared 2-core machine CleanRL's
    # default two threads wait on each other (seed 1 ran at 8 steps/s that way).
    pytest.importorskip("mujoco", reason='MuJoCo is not installed: pip install "gymnasium[mujoco]"')
    env_id, steps, last_n = "HalfCheetah-v4", 15_000, 5  # v4: the version CleanRL's gymnasium 0.29 has
    folder, python = cleanrl_checkout(), None
    why = "no CleanRL checkout (set CLEANRL_DIR)"
    if folder is not None:
        python, why = cleanrl_python()
    rows = []
    for seed in (1, 2, 3):  # one at a time: two runs would share the cores
        mine = plugrl_cheetah_seed(env_id, seed, steps, tmp_path, last_n)
        row = (f"seed {seed}: plugrl_min over the wire {mine['seconds']:7.1f} s, last {last_n}+ episodes "
               f"{mine['last']:8.1f}")
        theirs = None
        if python is not None:
            work = tmp_path / f"cleanrl-{seed}"
            work.mkdir()
            theirs = cleanrl_seed(python, cleanrl_script(folder, str(work)), env_id, seed, steps, str(work))
            row += (f" | CleanRL's script {theirs['seconds']:7.1f} s, last {last_n} episodes "
                    f"{np.mean(theirs['returns'][-last_n:]):8.1f}")
        rows.append((mine, theirs))
        print(row + f" | load average {os.getloadavg()[0]:.1f}", flush=True)
    mine = [m["last"] for m, _ in rows]
    summary = f"summary ({env_id}, {steps:,} steps, 3 seeds): plugrl_min {np.mean(mine):.1f} in " \
              f"{np.mean([m['seconds'] for m, _ in rows]):.1f} s a seed"
    if python is not None:
        theirs = [np.mean(t["returns"][-last_n:]) for _, t in rows]
        summary += f"; CleanRL {np.mean(theirs):.1f} in {np.mean([t['seconds'] for _, t in rows]):.1f} s a seed"
    else:
        summary += f"; CleanRL's script skipped: {why}"
    print(summary, flush=True)


# --- What a client process costs: the built-in env client against the README's standalone one -----

def client_cost(command, folder) -> tuple[float, float]:
    """(seconds from its start to its first infer, its peak private memory in MB while it runs)
    of one client process, command(port), against an in-process server."""
    noted = {}

    class NotesTheFirstInfer(Probe):
        def infer(self, obs):
            noted.setdefault("first infer", time.perf_counter())
            return super().infer(obs)

    async def script(port, server):
        started = time.perf_counter()
        process = subprocess.Popen(command(port), cwd=HERE, env=subprocess_env(),
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await eventually(lambda: "first infer" in noted, 60)
        peak = 0.0
        for _ in range(20):  # two seconds of running
            await asyncio.sleep(0.1)
            peak = max(peak, private_memory_mb(process.pid))
        process.kill()
        process.wait()
        return noted["first infer"] - started, peak

    return run_server(NotesTheFirstInfer(), folder, script, timeout=120)[1]


@bench
def test_bench_what_a_client_process_costs(tmp_path):
    script = tmp_path / "client.py"
    script.write_text(readme_block(STANDALONE_CLIENT, nth=1))
    clients = {"plugrl_min.py env-client dummy-v1 --num-envs 4": lambda port: [
                   sys.executable, "plugrl_min.py", "env-client", "dummy-v1", "--num-envs", "4",
                   "--num-episodes", "0", "--server-port", str(port)],
               "the README's standalone client": lambda port: [
                   sys.executable, str(script), str(port), "1000000"]}
    for name, command in clients.items():
        costs = [client_cost(command, tmp_path / f"{len(name)}-{i}") for i in range(3)]
        startups = sorted(cost[0] for cost in costs)
        print(f"{name:48s} start-up to its first infer {startups[1]:.2f} s (median of 3) | "
              f"private memory (USS) {max(cost[1] for cost in costs):.0f} MB")


# --- The real machines: learn threads, and learners on several ranks ------------------------------

def timed_sac_run(tmp_path, name, *flags) -> float:
    """Wall seconds of sac on pendulum-v1 for 8,000 steps with one local client."""
    started = time.perf_counter()
    result = python("plugrl_min.py", "dummy-policy", "default", "sac", "default", "--local-env-clients", "1",
                    "--local-env", "pendulum-v1", "--algo.global-steps", "8000", "--seed", "1", "--port", "0",
                    "--run-dir", str(tmp_path / name), *flags, timeout=3600)
    assert result.returncode == 0, result.stderr
    return time.perf_counter() - started


@bench
def test_bench_the_default_learn_threads_against_one_thread_and_all_quiet_and_beside_a_busy_process(tmp_path):
    most = torch.get_num_threads()
    settings = {"default": [], "1 thread": ["--learn-threads", "1"],
                f"{most} threads": ["--learn-threads", str(most)]}
    rounds = int(os.environ.get("PLUGRL_BENCH_ROUNDS", "2"))
    rows = []
    for busy in (False, True):
        neighbour = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            times = {name: [] for name in settings}
            for round_ in range(rounds):  # interleaved: the machine's drift falls on every setting
                for name, flags in settings.items():
                    times[name].append(timed_sac_run(tmp_path, f"{busy}-{round_}-{name}", *flags))
        finally:
            if neighbour is not None:
                neighbour.kill()
                neighbour.wait()
        median = {name: float(np.median(values)) for name, values in times.items()}
        faster = min(median["1 thread"], median[f"{most} threads"])
        rows.append(f"{'busy neighbour' if busy else 'quiet':<15} " + " | ".join(
            f"{name} {median[name]:6.1f} s" for name in settings) +
            f" | default / faster {median['default'] / faster:.2f} (bar 1.15)")
    print(f"\nsac, pendulum-v1, 8,000 steps, one local client; median of {rounds} runs each\n" + "\n".join(rows))


def quickstart_runs_at_once(tmp_path, name, runs, *flags) -> float:
    """Wall seconds until `runs` quickstart runs (pg, 50,000 steps), started together, all end."""
    started = time.perf_counter()
    processes = [subprocess.Popen([sys.executable, "plugrl_min.py", "dummy-policy", "default", "pg", "default",
                                   "--local-env-clients", "1", "--local-num-envs", "16",
                                   "--algo.global-steps", "50000", "--seed", str(seed), "--port", "0",
                                   "--run-dir", str(tmp_path / f"{name}-{seed}"), *flags],
                                  cwd=HERE, env=subprocess_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                 for seed in range(1, runs + 1)]
    for process in processes:
        assert process.wait(3600) == 0, process.stderr.read()
    return time.perf_counter() - started


@bench
def test_bench_the_default_learn_threads_in_a_lab_of_four_runs_and_in_one_run_alone(tmp_path):
    most = torch.get_num_threads()
    lab = {name: quickstart_runs_at_once(tmp_path, f"lab-{name}", 4, *flags)
           for name, flags in (("default", []), ("1 thread", ["--learn-threads", "1"]))}
    alone = {name: quickstart_runs_at_once(tmp_path, f"alone-{name}", 1, *flags)
             for name, flags in (("default", []), ("1 thread", ["--learn-threads", "1"]),
                                 (f"{most} threads", ["--learn-threads", str(most)]))}
    better = min(alone["1 thread"], alone[f"{most} threads"])
    print(f"\nthe quickstart (pg, 50,000 steps); four runs started together, then one alone\n"
          f"four at once  default {lab['default']:6.1f} s | 1 thread {lab['1 thread']:6.1f} s | "
          f"default / 1 thread {lab['default'] / lab['1 thread']:.2f} (bar 1.15)\n"
          f"one alone     " + " | ".join(f"{name} {seconds:6.1f} s" for name, seconds in alone.items()) +
          f" | default / better {alone['default'] / better:.2f} (bar 1.15)")


def mean_learn_seconds(run_dir) -> float:
    lines = [line for line in read_metrics(run_dir, event="learn")[1:]]  # the first learn warms up
    return float(np.mean([line["server/learn_seconds"] for line in lines]))


@bench
def test_bench_pg_learn_time_on_one_and_two_ranks(tmp_path):
    rows = []
    for frames_per_learn in (1024, 16384):
        steps = str(frames_per_learn * 12)
        words = ["dummy-policy", "default", "pg", "default", "--local-env-clients", "1", "--local-num-envs", "16",
                 "--algo.frames-per-learn", str(frames_per_learn), "--algo.global-steps", steps, "--seed", "1",
                 "--log-every", "1", "--port", "0"]
        one = python("plugrl_min.py", *words, "--learn-threads", str(torch.get_num_threads()),  # every core
                     "--run-dir", str(tmp_path / f"one-{frames_per_learn}"), timeout=3600)
        assert one.returncode == 0, one.stderr
        two = launch(tmp_path, f"two-{frames_per_learn}", *words, "--run-dir", str(tmp_path / f"two-{frames_per_learn}"))
        assert finish(two, 3600) == 0, (tmp_path / f"two-{frames_per_learn}.out").read_text()
        alone = mean_learn_seconds(tmp_path / f"one-{frames_per_learn}")
        ranks = mean_learn_seconds(tmp_path / f"two-{frames_per_learn}")
        rows.append(f"--algo.frames-per-learn {frames_per_learn:>6} | 1 process {1000 * alone:7.1f} ms | "
                    f"2 ranks {1000 * ranks:7.1f} ms | 2 ranks / 1 process {ranks / alone:.2f}")
    print(f"\npg on dummy-v1, 16 environments; mean learn time, the first learn left out; one process on "
          f"{torch.get_num_threads()} threads, two ranks on one thread each\n" + "\n".join(rows))


# --- The README's tables of learning curves, run again over seeds 1 to 3 --------------------------

LEARNING_TABLES = {  # the README section holding the table: the command of that section's table
    "### Learning curves: pg on dummy-v1": "dummy-policy default pg default --local-env-clients 1 --local-num-envs 16",
    "### Learning curves: pg on CartPole": "categorical-policy cartpole pg default --local-env-clients 1 "
                                        "--local-num-envs 16 --local-env cartpole-v1",
}


def readme_table(after: str) -> list[list[str]]:
    """The cells of the first `| step | seed 1 | ...` table after `after`, its heading row left out."""
    text = readme()[readme().index(after):]
    table = text[text.index("| step | seed 1"):].split("\n\n")[0].splitlines()[2:]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in table]


def table_cell(label: str, shown: str, curve: list[tuple[int, float, int]]) -> str:
    """What a row of the table says of one run, worked out from its curve the way `report` does: best and the
    first step to reach a figure from windows of 100+ episodes; a step's row from the curve as it stood."""
    decimals = len(shown.split(".")[1]) if "." in shown else 0
    full = [(step, mean) for step, mean, count in curve if count >= 100]
    if label == "best":
        return f"{max(mean for _, mean in full):.{decimals}f}"
    if "last 100+ episodes" in label:  # at the run's end, as report says it
        return f"{full[-1][1]:.{decimals}f}"
    if "first reached" in label:
        goal = float(re.search(r"--reach (-?[\d.]+)", label).group(1))
        return f"{next(step for step, mean in full if mean >= goal):,}"
    step = int(label.split()[0].replace(",", ""))
    return f"{next(mean for at, mean, _ in curve if at >= step):.{decimals}f}"


@bench
def test_bench_the_readmes_learning_tables_rerun_over_seeds_1_to_3(tmp_path):
    for section, command in LEARNING_TABLES.items():
        curves = []
        for seed in (1, 2, 3):
            run_dir = tmp_path / f"{section.split()[-1]}-seed{seed}"
            done = python(SOURCE, *command.split(), "--seed", str(seed), "--port", "0", "--run-dir", str(run_dir),
                          timeout=900)
            assert done.returncode == 0, done.stderr
            curves.append(plugrl_min.return_curve(plugrl_min.read_metrics(str(run_dir))))
        table = readme_table(section)
        measured = [[label, *(table_cell(label, shown, curve) for shown, curve in zip(cells, curves))]
                    for label, *cells in table]
        print(f"\n{section}: {command}, seeds 1 to 3")
        for row, shown in zip(measured, table):  # met: the README's row, to the digit
            print("| " + " | ".join(row) + " | " + ("met" if row == shown else f"missed: the README has {shown}"))


# --- reuse-feedback-obs: the bytes it saves a step ------------------------------------------------

class TwoCameras(plugrl_min.VecEnv):
    """dummy-v1 with PlugRL's dummy-v1 cameras beside its state: base [224, 224, 3] and wrist [112, 112, 3]
    uint8, 188,160 bytes an environment, new pixels every step."""

    obs_spec = {"images": {"base": ((224, 224, 3), "uint8"), "wrist": ((112, 112, 3), "uint8")},
                "states": {"state": ((3,), "float32")}}
    max_steps = 50  # dummy-v1's

    def __init__(self, num_envs, seed=None):
        self.inner = plugrl_min.DummyEnv(num_envs, seed)
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.inner._reset(rows)

    def _step(self, action, rows):
        return self.inner._step(action, rows)

    def _observe(self):
        n, images = self.num_envs, {"base": (224, 224, 3), "wrist": (112, 112, 3)}
        return observation(n, states=self.inner._observe()["states"],
                           images={key: self.rng.integers(0, 256, (n, *shape), np.uint8) for key, shape in images.items()})


@bench
def test_bench_bytes_a_decision_sends_with_and_without_reuse_feedback_obs(capsys):
    plugrl_min.ENVIRONMENTS.setdefault("plugrl-test-two-cameras-v1", TwoCameras)  # for this bench alone
    print("\nbytes an env client sends a decision, per environment (its feedback and its next infer):",
          file=sys.__stdout__)
    for env_id, num_envs, episodes in (("pendulum-v1", 16, 32), ("plugrl-test-two-cameras-v1", 4, 8)):
        sent = {}
        for name, flags in (("reuse", []), ("whole", ["--no-reuse-feedback-obs"])):
            sizes, reuses = [], []
            with ServerThread(serving_dummy_v1(obs_spec=False, sizes=sizes, reuses=reuses)) as server:
                status = env_client_against(server, "--num-episodes", str(episodes), *flags, env_id=env_id,
                                            num_envs=num_envs)
            assert status == 0, capsys.readouterr().err
            decisions = sum(kind == "feedback" for kind, _ in reuses)
            sent[name] = sum(sizes) / decisions / num_envs
        print(f"  {env_id}, {num_envs} environments: {sent['reuse']:,.0f} with reuse, {sent['whole']:,.0f} "
              f"without ({sent['whole'] / sent['reuse']:.2f} x)", file=sys.__stdout__)
