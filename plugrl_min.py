# SPDX-License-Identifier: MIT
"""plugrl_min: a single-file reference implementation, for teaching, of the PlugRL server contract.

Environments run in client processes and talk over WebSocket to a server that holds the policy
and the algorithm: it batches inference, routes every frame to `feedback` or `discard_feedback`,
learns, checkpoints and resumes. Every hook, rule and troubleshooting symptom of the PlugRL
"Custom Algorithm" page holds here, imported from `plugrl_min` instead of `plugrl_server.*`;
README.md says once what differs.

The first reading is the top of this file, down to the line "first reading ends": the contract
(1-3: the state types, BaseTorchPolicy, BaseAlgorithm with every hook, DummyAlgorithm); the loop
without the wire that drives it, in the order the server does (4); the server that spreads that
loop over clients, speaking PlugRL's protocol (5); a checkpoint on disk, and the signals that end
a run (6). The second reading, one idea a section, in any order: PG, the wire format, rows, the
registries, the built-in policies, the run's record, the clients' checks, the env client, the
command line.

Optional features are one block each, under a banner "# ===== [NAME] ...": learn-threads, ranks,
trace, tensorboard, report, notebook, pendulum, cartpole, probe, gym, eval. Each line elsewhere
that belongs to one carries a comment that begins "# [NAME]". Delete a block and its lines, and the
rest still serves, learns and saves."""

from __future__ import annotations  # an annotation may name a class defined further down

# The core's imports. Each later section or block imports, at its top, what only it uses: a copy
# that cuts one cuts its imports with it.
import abc
import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import io
import itertools
import json
import math
import os
import signal
import sys
import time
import traceback
import typing


def refuse_import(problem: str) -> typing.NoReturn:
    """A version it cannot work with: an ImportError, or on the command line one line, status 1."""
    if __name__ == "__main__":
        sys.exit(f"error: {problem}")
    raise ImportError(problem)


if sys.version_info < (3, 11):  # the version it is tested on
    refuse_import(f"plugrl_min needs Python 3.11 or newer; this is {sys.version.split()[0]}")
import numpy as np
import torch
import websockets
from torch import nn

if int(websockets.__version__.split(".")[0]) < 16:  # Server.close(code, reason) came in 16.0
    refuse_import(f"plugrl_min needs websockets 16 or newer; this Python has "
                  f"{websockets.__version__}: pip install -r requirements.txt")
from websockets.asyncio.server import serve as websockets_serve
from websockets.exceptions import ConnectionClosed  # websockets.ConnectionClosed: a lookup per use


# ===== 1. State types: what flows from infer to feedback, and what a checkpoint holds =====
# PlugRL page: PolicyRuntimeState, PolicyTrainState (plugrl_server.policy.state), Checkpoint.

# Whatever the policy returns from infer beside the action: an array or a dict of arrays (nested),
# batched along axis 0. The server keeps it and hands each environment its row in feedback.
PolicyRuntimeState: typing.TypeAlias = typing.Any
# What derive_train_state keeps of a runtime state for learning (a nested dict of arrays, or None).
PolicyTrainState: typing.TypeAlias = typing.Any


@dataclasses.dataclass
class Checkpoint:
    """What create_checkpoint returns and load_checkpoint receives. Keep every value a tensor or
    a plain Python value (dict, list, int, float, str, bool, None): checkpoints load with
    torch.load(weights_only=True), which refuses anything else."""
    step: int
    model: dict | None
    optimizer: dict | None
    meta: dict


# ===== 2. Policies: a batch of observations in, a batch of actions out =====
# PlugRL page: BaseTorchPolicy. The built-in ones (dummy-policy, categorical-policy): section 11.

class BaseTorchPolicy(nn.Module):
    """An nn.Module (so state_dict() works) with what the server and algorithms call. Continuous
    actions are float32 [n, action_horizon, action_dim]; discrete ones (num_actions set) are
    int64 indices [n, action_horizon, 1]: one of num_actions choices per step."""

    action_dim: int
    action_horizon: int = 1
    num_actions: int | None = None  # None: continuous actions
    obs_spec: dict  # "images" and "states": name -> (shape without the batch axis, dtype)

    def get_action_and_runtime_state(self, obs: dict) -> tuple[np.ndarray, PolicyRuntimeState]:
        """Actions for a batch of observations, and the runtime state of how they were drawn."""
        raise NotImplementedError

    def fake_runtime_state(self, n: int) -> PolicyRuntimeState:
        """A runtime state of the right shapes for n environments (used to size buffers)."""
        raise NotImplementedError

    def forward(self, obs: dict) -> torch.distributions.Distribution:
        """The distribution runtime_state["sample"] came from, given tensors {key: [B, ...]}."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        """Where the weights are (--device): infer moves observations there, actions back."""
        return next(self.parameters()).device

    @property
    def action_shape(self) -> tuple[int, int]:
        """One environment's action (a decision): (action_horizon, action_dim)."""
        return (self.action_horizon, self.action_dim)

    def as_tensors(self, obs: dict) -> dict:
        """A batch of observations with its images and states as tensors on the policy's device;
        its text stays numpy's str: torch has no tensor of text."""
        tensors = map_arrays(lambda array: torch.from_numpy(array).to(self.device),
                             {"images": obs["images"], "states": obs["states"]})
        return {**tensors, "text": obs["text"]}


# ===== 3. Algorithms: the hooks the server loop calls, and the smallest algorithm =====
# PlugRL page: BaseAlgoConfig, BaseAlgorithm, "Server contract" and "Design rules".

@dataclasses.dataclass
class BaseAlgoConfig:
    """Every algorithm config derives from this. global_steps is the run length (--algo.*)."""
    global_steps: int | None = 100_000  # the run ends at this global step (None: never)


class BaseAlgorithm(abc.ABC):
    """The server-side algorithm. Override learn_impl (abstract), feedback and the should_* hooks.

    The server calls the hooks one at a time, never two at once. Before it serves, the command
    line calls init_optimizers() and, with --resume, load_checkpoint(); then every hook runs from
    the control task, except learn(), which runs in the learn thread while that task waits for it.
    Under several ranks, the other ranks call pre_learn, learn and post_learn: serve_as_learner."""

    # The routing rule. True: feedback() gets only frames whose action came from the current
    # policy, while no learn is due. False (a replay-buffer learner): every frame.
    on_policy: bool = True
    example_env: str | None = None  # plugrl_min's own: what --local-env and the hint default to

    def __init__(self, config: BaseAlgoConfig, policy: BaseTorchPolicy):
        self.config, self.policy = config, policy
        self.global_step = 0
        self._episodes = []  # (return, length, success) of the episodes since the last learn

    def infer(self, obs: dict) -> tuple[np.ndarray, PolicyRuntimeState]:
        """Actions and runtime state for one batch (the server batches across clients)."""
        return self.policy.get_action_and_runtime_state(obs)

    def derive_train_state(self, runtime_state: PolicyRuntimeState) -> PolicyTrainState:
        """Keep what learning will need of a runtime state (pg: the sample each action came from).

        It runs once per infer batch, right after infer; each environment's row comes back as
        feedback(train_state=), so a buffer stores that, not the whole runtime state."""
        return None

    def example_train_state(self, n: int) -> PolicyTrainState:
        """A train state for n environments from the policy's fake runtime state: size buffers."""
        return self.derive_train_state(self.policy.fake_runtime_state(n))

    def feedback(self, *, obs: dict, runtime_state: PolicyRuntimeState,
                 train_state: PolicyTrainState = None, terminated: bool, truncated: bool,
                 next_obs: dict, reward, info: dict, next_terminated: bool, next_truncated: bool,
                 prev_node: tuple) -> tuple[tuple, int, dict]:
        """Store one frame: obs, the action drawn for it (runtime_state), reward and next_obs.

        terminated/truncated are the flags of this environment's previous frame, because they
        say what obs is: true means this frame begins an episode (obs is a reset observation).
        Both false does not prove it continues one: an environment's first frame on a connection
        may begin one too. What links frames is prev_node: what feedback returned for this
        environment's previous frame, or (-1, "") when there is none to link to (its first
        frame on this connection, or the one after a discard): a trajectory starts there.
        next_terminated/next_truncated are this transition's own. Returns (prev_node,
        global_step, log_dict): the prev_node to hand to this environment's next frame."""
        raise NotImplementedError(f"{type(self).__name__}.feedback: store the frame and return "
                                  "(prev_node, global_step, log_dict)")

    def discard_feedback(self, *, info: dict, next_terminated: bool, next_truncated: bool) -> None:
        """Every frame that is not stored. Overrides must call super(), or episodes go missing."""
        self.record_finished_episode(info, next_terminated, next_truncated)

    def record_finished_episode(self, info: dict, next_terminated: bool, next_truncated: bool):
        """The page's check, written once: record info["episode"] if this frame ended one."""
        if (next_terminated or next_truncated) and "episode" in info:
            if bool(info["episode"].get("mask", True)):
                self.record_episode_metrics(info["episode"])

    def record_episode_metrics(self, episode: dict) -> None:
        """Count one finished episode (r: return, l: length, s: success) in rollout/*."""
        self._episodes.append((float(episode["r"]), float(episode["l"]),
                               float(episode.get("s", 0.0))))

    def build_train_info(self, global_step: int, log_dict: dict) -> tuple[int, dict]:
        """Add rollout/* (means over the episodes recorded since the last learn; 0 if none)."""
        means = np.mean(self._episodes, axis=0) if self._episodes else np.zeros(3)
        rollout = {"rollout/reward": float(means[0]), "rollout/length": float(means[1]),
                   "rollout/success": float(means[2]), "rollout/episodes": len(self._episodes)}
        return global_step, {**log_dict, **rollout}

    def learn(self) -> tuple[int, dict]:
        """Concrete: learn_impl() wrapped by build_train_info. Override learn_impl, not this."""
        global_step, log_dict = self.learn_impl()
        return self.build_train_info(global_step, log_dict)

    @abc.abstractmethod
    def learn_impl(self) -> tuple[int, dict]:
        """One learning step: (global_step, log_dict). It must move what should_learn reads."""

    def pre_learn(self) -> None:
        """Runs right before learn()."""

    def post_learn(self) -> None:
        """Runs right after learn(). Overrides must call super(): it resets rollout/*."""
        self._episodes = []

    def should_learn(self) -> bool:
        """True when learn() should run. No inference happens while it is true."""
        return False

    def should_save(self) -> bool:
        """True when a checkpoint is due; must turn false once create_checkpoint() has run."""
        return False

    def should_stop(self) -> bool:
        """True when the run is over: a final checkpoint, then every client is told."""
        steps = self.config.global_steps
        return steps is not None and self.global_step >= steps

    def create_checkpoint(self) -> Checkpoint:
        """The policy weights and global_step; put schedule counters in meta."""
        return Checkpoint(step=self.global_step, model=self.policy.state_dict(), optimizer=None,
                          meta={})

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Restore what create_checkpoint saved (on --resume, after init_optimizers)."""
        self.global_step = checkpoint.step
        if checkpoint.model is not None:
            self.policy.load_state_dict(checkpoint.model)

    def init_optimizers(self) -> None:
        """Runs right after the algorithm is built: build optimizers here."""


@dataclasses.dataclass
class DummyAlgoConfig(BaseAlgoConfig):
    """The dummy learns nothing: it only keeps the cadence of a real algorithm."""
    global_steps: int | None = 10_000
    learn_every: int = 1_000  # frames between learns
    save_every: int = 100  # learns between checkpoints


class DummyAlgorithm(BaseAlgorithm):
    """The smallest complete algorithm: counts frames, 'learns' every learn_every, saves.
    Registered as `dummy` with its config in section 10, where the registries are."""

    def __init__(self, config: DummyAlgoConfig, policy: BaseTorchPolicy):
        super().__init__(config=config, policy=policy)
        self.frames_since_learn, self.learns, self.saved_at_learn = 0, 0, 0

    def feedback(self, *, obs, runtime_state, train_state=None, terminated, truncated, next_obs,
                 reward, info, next_terminated, next_truncated, prev_node):
        """Count the frame and its finished episode; store nothing."""
        self.record_finished_episode(info, next_terminated, next_truncated)
        self.global_step += 1
        self.frames_since_learn += 1
        return prev_node, self.global_step, {}

    def learn_impl(self):
        """Nothing to learn; moving frames_since_learn is what turns should_learn false."""
        self.frames_since_learn = 0
        self.learns += 1
        return self.global_step, {}

    def should_learn(self):
        return self.frames_since_learn >= self.config.learn_every

    def should_save(self):
        return self.learns - self.saved_at_learn >= self.config.save_every

    def create_checkpoint(self):
        """Weights, and in meta every counter the schedule reads."""
        self.saved_at_learn = self.learns
        return Checkpoint(step=self.global_step, model=self.policy.state_dict(), optimizer=None,
                          meta={"frames_since_learn": self.frames_since_learn,
                                "learns": self.learns, "saved_at_learn": self.saved_at_learn})

    def load_checkpoint(self, checkpoint):
        """Restore the weights and every counter, so the cadence continues exactly."""
        super().load_checkpoint(checkpoint)
        self.frames_since_learn = checkpoint.meta["frames_since_learn"]
        self.learns = checkpoint.meta["learns"]
        self.saved_at_learn = checkpoint.meta["saved_at_learn"]


# ===== 4. The loop without the wire: the hooks, in the order the server drives them =====
# PlugRL page: "Server contract", its hooks in the order the server calls them, for one client
# over one vector of environments in this process. Section 5 spreads the loop over clients.

async def train_in_process(server: Server, executor: MultiAction) -> None:
    """The loop without the wire (--in-process): the hooks over one vector of environments, in
    the order the server drives them for one client. Served to one client instead, the same seed
    ends on the same weights, byte for byte: the wire changes nothing."""
    n = executor.env.num_envs
    slots = [EnvSlot() for _ in range(n)]  # each environment's last frame: its flags, prev_node
    executor.reset()
    while True:
        # infer() once for every environment, then derive_train_state(); each environment's row
        # of the batch is its step state, which its frame is stored with.
        batch = server.infer_batch(executor.obs, n)
        next_obs, reward, terminated, truncated, info = executor.step(batch.action)
        feedback = {"obs": next_obs, "rewards": reward, "terminated": terminated,
                    "truncated": truncated, "info": episode_info(info)}  # what a client sends
        steps = [StepState(batch, i) for i in range(n)]
        # Each frame to feedback() or discard_feedback(), by discard_reason.
        route_feedback(server, frames_of(range(n), slots, steps, feedback))
        # learn() while should_learn(), between pre_learn() and post_learn(); a checkpoint if
        # should_save() or should_stop(); the run ends at should_stop().
        if await learn_and_save(server):
            return
        server.record.show_progress(server)
        executor.reset_finished(terminated, truncated)  # new episodes, for the next infer


async def learn_and_save(server: Server) -> bool:
    """After routing, on every pass of both loops: learn() while should_learn(), then a checkpoint
    if should_save() or should_stop(). True once the run stops (or a signal asked it to)."""
    # No inference while should_learn() is true: learn() changes the weights infer() reads, and an
    # action drawn now would come from a policy about to be replaced (an on-policy learner would
    # discard its frame). Learn while it stays true: the page's symptom if it never turns false.
    while server.algo.should_learn() and not server.stop_requested:
        await server.learn_once()
    # Once a pass, after its learns (none between back-to-back learns): stop, save.
    stop = server.stop_requested or server.algo.should_stop()
    if server.frames and (stop or server.algo.should_save()):  # none for a run of no frame
        server.save()  # create_checkpoint(), and the server's counters beside, to disk
    return stop


def route_feedback(server: Server, frames: list[Frame], client: int = 1) -> None:
    """The routing rule: each frame to feedback() if the algorithm stores it, discard_feedback()
    if not. client: the connection's number, for --trace."""
    algo = server.algo
    for frame in frames:
        slot, step = frame.slot, frame.step
        reason = discard_reason(algo, server.version, step.batch.version)
        if reason is not None:
            algo.discard_feedback(info=frame.info, next_terminated=frame.next_terminated,
                                  next_truncated=frame.next_truncated)
            node = NO_NODE  # the chain of this environment's stored frames is broken
            server.discarded += 1
        else:
            # terminated/truncated: how the slot's previous frame ended; next_*: this one.
            obs, runtime_state, train_state = step.batch.row(step.row)
            node, server.global_step, log = algo.feedback(
                obs=obs, runtime_state=runtime_state, train_state=train_state,
                terminated=slot.terminated, truncated=slot.truncated, next_obs=frame.next_obs,
                reward=frame.reward, info=frame.info, next_terminated=frame.next_terminated,
                next_truncated=frame.next_truncated, prev_node=slot.prev_node)
            if log:
                server.record.add(log)
        trace_frame(server, client, frame, node, reason)  # [trace] the first N frames
        slot.prev_node = node
        slot.terminated, slot.truncated = frame.next_terminated, frame.next_truncated
    server.frames += len(frames)


def discard_reason(algo: BaseAlgorithm, version: int, acted: int) -> str | None:
    """The routing rule: why a frame goes to discard_feedback ("stale" or "learn due"), or None
    for feedback (acted: the policy version that chose its action). An on-policy gradient
    averages over actions of the policy being improved. A frame whose action came from an older
    version (stale), or one that arrives once a learn is due (its batch is full), would bias it:
    discard_feedback only counts its episode."""
    if not algo.on_policy:  # a replay-buffer learner stores every frame
        return None
    if acted != version:
        return "stale"
    return "learn due" if algo.should_learn() else None


def episode_info(info: dict) -> dict:
    """The info a client sends with its feedback: the decision's episode statistics when any
    environment finished one (every frame gets them; `mask` says which), else nothing."""
    episode = info["episode"]
    return {"episode": episode} if episode["mask"].any() else {}


# ===== 5. The server: one control task between the clients and the algorithm =====
# PlugRL page: "Server contract" and "What the loop implies for the hooks". First what a frame
# leaves on the server while it is in flight, then Server's core, in the order a frame meets it.

SERVER_STOP = "plugrl-server-stop"  # the reason of every close 1001 at the run's end (SPEC 7.1)
INTERNAL_ERROR = "Internal server error."  # the reason of every close 1011 (SPEC 7.4)
NO_NODE = (-1, "")  # prev_node when there is no stored frame of this environment to link to


@dataclasses.dataclass(eq=False, slots=True)  # slots (here and below): lighter, quicker per frame
class InferBatch:
    """One infer() call, kept until every environment in it has sent its feedback."""
    version: int  # the policy version that acted: learns so far
    sent_at: float  # the serving clock when its actions were sent: each one's feedback is due
    action: np.ndarray  # [n, action_horizon, action_dim]
    batched: tuple  # (obs, runtime_state, train_state) as infer gave them, each [n, ...]
    rows: list | None = None  # [n] each environment's (obs, runtime_state, train_state): row()

    def row(self, i: int) -> tuple:
        """Environment i's (obs, runtime_state, train_state), all cut at the first routing. Plain
        form: cut in infer_batch, before the sends (8 clients ran 0.93 of the floor, not 1.16)."""
        if self.rows is None:
            self.rows = list(zip(*(split_rows(tree, len(self.action)) for tree in self.batched)))
        return self.rows[i]


@dataclasses.dataclass(eq=False, slots=True)
class StepState:
    """An environment's step state: the infer batch and row of the action it executes."""
    batch: InferBatch
    row: int


@dataclasses.dataclass(eq=False, slots=True)
class EnvSlot:
    """What the server keeps for one environment of one connection."""
    waiting: bool = False  # its infer is queued; its action not sent yet
    step: StepState | None = None  # the action it was given and owes feedback for
    terminated: bool = False  # how its previous frame ended: feedback(terminated=, truncated=)
    truncated: bool = False
    prev_node: tuple = NO_NODE  # what feedback returned for its previous stored frame
    fed: tuple | None = None  # (obs batch, row) of its last feedback, for an infer's reuse


@dataclasses.dataclass(eq=False, slots=True)
class Connection:
    """One env client: its WebSocket and its environments, by the client's own env_indices."""
    ws: typing.Any
    number: int  # for the trace and the log: connections in the order they came
    slots: dict = dataclasses.field(default_factory=dict)  # env index -> EnvSlot
    expects: str = "infer"  # the message it may send next: infer, then feedback (SPEC 4.2)


@dataclasses.dataclass(eq=False, slots=True)
class InferRequest:
    """A checked infer message, queued until the control loop answers it."""
    conn: Connection
    env_indices: np.ndarray  # int64 [n]
    obs: dict  # images, states, text: each array [n, ...]


@dataclasses.dataclass(eq=False, slots=True)
class Frame:
    """One environment's frame: its step state (what it was given) and what its feedback says."""
    env_index: int  # the client's own name for the environment
    slot: EnvSlot
    step: StepState  # taken from the slot when the message arrived: observation, action, states
    next_obs: dict  # the observation after the decision: images, states and text
    reward: typing.Any  # a float (with 'stack': a [k] array, one reward per physical step)
    next_terminated: bool  # how the decision ended (the slot holds how the previous one did)
    next_truncated: bool
    info: dict  # e.g. {"episode": {...}} (every frame of the message has it if one finished)


@dataclasses.dataclass(eq=False, slots=True)
class FeedbackMessage:
    """A checked feedback message: its frames, one per environment, in the message's order."""
    conn: Connection
    frames: list  # [m] Frame


class Server:
    """One run: the algorithm behind a WebSocket endpoint, writing to its run directory. Each
    connection's task only checks and queues messages. One control task talks to the algorithm,
    so no two hooks ever run at once (learn runs in a worker thread, alone)."""

    def __init__(self, algo: BaseAlgorithm, run_dir: str, names: tuple[str, str],
                 config: ServerConfig | None = None, *,
                 ranks=None,  # [ranks] a Ranks: the other ranks of a torch.distributed launch
                 resumed: dict | None = None):  # a checkpoint's counters, on --resume
        self.algo, self.run_dir = algo, run_dir
        self.config = config = config or ServerConfig()
        counters = {"global_step": 0, "policy_version": 0, "frames": 0, "seconds": 0.0,
                    **(resumed or {})}  # the run counts on from them
        self.threads = LearnThreads(config.learn_threads)  # [learn-threads]
        self.trace_left = config.trace  # [trace] frames still to narrate
        self.ranks = ranks  # [ranks]
        self.global_step, self.version = counters["global_step"], counters["policy_version"]
        self.obs_spec = obs_spec_of(algo.policy.obs_spec)
        self.metadata = metadata_of(algo.policy, self.obs_spec, names)  # every client's first
        self.connections = set()  # the open ones; a closed or rejected one leaves at once
        self.connection_numbers = itertools.count(1)  # Connection.number: in the order they came
        self.inbox, self.waiting = [], []  # checked messages, in arrival order; waiting infers
        self.wake = asyncio.Event()  # set by every message, and twice a second by tick()
        self.stop_requested, self.status = False, 0  # status 1: a local env client failed
        self.signalled_at = None  # when the first SIGINT or SIGTERM came (on_signal)
        self.loop = None  # run()'s event loop, for a signal handler to wake
        self.ended = None  # run()'s status, once it has returned
        self.failure = None  # what failed around the run (the port, its folder): run_status
        self.closing = False  # control_loop has returned: what the run saves is saved
        self.saved = []  # the checkpoints this run wrote, oldest first: pruning deletes no other
        self.learning_seconds = 0.0  # in learns so far: the serving clock stands still in them
        self.frames = self.discarded = 0  # routed by this process, and of those discarded
        self.local_clients = []  # (number, process, log path) of the --local-env-clients
        self.record = RunRecord(config.log_every, counters["frames"], counters["seconds"])
        # Every learn() runs in this one OS thread (torch's thread count is per OS thread).
        self.learn_executor = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="learn")

    async def run(self, host: str, port: int, on_listening=None) -> int:
        """Serve until should_stop() or a signal (status 0), or a local client or hook fails (1).
        Tasks: handle_client per connection, this one's control_loop, and tick().
        on_listening(port) runs once the port is taken, before anything is written."""
        self.loop, config = asyncio.get_running_loop(), self.config
        with naming(f"cannot listen on {host}:{port}"):  # the bind alone: the port is taken...
            server = await websockets_serve(
                self.handle_client, host, port, compression=None, max_size=config.max_message_bytes,
                process_request=api_key_check(config.api_key),  # HTTP 401 without the key
                ping_interval=config.feedback_timeout, ping_timeout=None)  # no pong closes one
        async with server:
            open_run(self, server.sockets, on_listening)
            ticker = asyncio.create_task(tick(self.wake))
            code, reason, status = await run_to_the_end(self, self.control_loop())
            ticker.cancel()
            # Stop accepting, then close every open connection as PlugRL's servers do, the newest
            # too; a handshake in progress is refused (HTTP 503). finish_run prints why it ended.
            server.close(code=code, reason=SERVER_STOP if code == 1001 else INTERNAL_ERROR)
            await server.wait_closed()
        return finish_run(self, code, reason, status)

    async def handle_client(self, ws) -> None:
        """Send the metadata, then check and queue every message; a bad one resyncs this one."""
        conn = Connection(ws, next(self.connection_numbers))
        self.connections.add(conn)
        try:
            await ws.send(pack_message(self.metadata))
            async for frame in ws:
                try:
                    self.inbox.append(self.accept(conn, unpack_message(frame)))
                except Exception as error:  # whatever a client sends costs only its connection
                    await resync(self, conn, error)
                    return
                self.wake.set()
        except ConnectionClosed:
            pass
        finally:
            # Its queued infers are skipped; its feedback already queued was whole, and counts.
            self.connections.discard(conn)

    def accept(self, conn: Connection, message: dict) -> InferRequest | FeedbackMessage:
        """Check a message and move its environments on; handle_client queues what it returns. A
        feedback takes each environment's step state out of its slot now: it may infer again."""
        kind, env_ids = check_message(message, self.obs_spec)
        slots = check_turn(conn, kind, env_ids, self.config.max_envs_per_client)  # SPEC 4.2
        if kind == "infer":
            for slot in slots:
                slot.waiting = True  # until its action is sent
            if message.get("reuse") is not None:
                message["data"] = reused_obs(slots, env_ids, message["reuse"], message["data"])
            return InferRequest(conn, message["env_indices"], message["data"])
        steps = [slot and slot.step for slot in slots]  # None: no step state, nothing stored
        data = message["data"]
        done = (data["terminated"] | data["truncated"]).tolist()
        for row, slot in enumerate(slots):  # a reuse takes the last feedback's row, stored or not
            if slot is not None:  # (SPEC 10.1), and none once it ended an episode
                slot.step, slot.fed = None, None if done[row] else (data["obs"], row)
        frames = frames_of(env_ids, slots, steps, data)
        return FeedbackMessage(conn, [frame for frame in frames if frame.step is not None])

    async def control_loop(self) -> None:
        """Route feedback; learn while should_learn(); save; stop; answer the waiting infers."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            for item in self.inbox:  # no await in this loop: no message can arrive during it
                if isinstance(item, FeedbackMessage):
                    route_feedback(self, item.frames, item.conn.number)
                else:
                    self.waiting.append(item)
            self.inbox = []
            if await learn_and_save(self):  # learn while should_learn(); save; stop
                return
            await self.infer_waiting()
            watch_local_clients(self)
            drop_silent_clients(self)
            self.record.show_progress(self)

    async def infer_waiting(self) -> None:
        """One infer() for every waiting client: concatenate, infer, derive, split, send."""
        requests = [request for request in self.waiting if request.conn in self.connections]
        self.waiting = []
        if not requests:
            return
        obs = join_rows([request.obs for request in requests])  # each one's keys: check_obs's
        batch = self.infer_batch(obs, sum(len(request.env_indices) for request in requests))
        row = 0
        for request in requests:
            first = row
            for i in request.env_indices.tolist():
                slot = request.conn.slots[i]
                slot.waiting, slot.step = False, StepState(batch, row)
                row += 1
            reply = action_message(request.env_indices, batch.action[first:row])
            with contextlib.suppress(ConnectionClosed):
                await request.conn.ws.send(reply)

    def infer_batch(self, obs: dict, n: int) -> InferBatch:
        """infer(obs) for n environments, then derive_train_state: an InferBatch. An infer for no
        environment is answered without the algorithm."""
        policy = self.algo.policy
        dtype = np.float32 if policy.num_actions is None else np.int64  # as the wire sends it
        action, runtime_state, train_state = np.zeros((0, *policy.action_shape), dtype), None, None
        if n > 0:
            action, runtime_state = self.algo.infer(obs)
            action = np.asarray(action, dtype)
            if action.shape != (n, *policy.action_shape):  # the algorithm's own bug: it fails
                raise RuntimeError(f"infer returned actions {list(action.shape)}, expected "
                                   f"{[n, *policy.action_shape]}")
            train_state = self.algo.derive_train_state(runtime_state)
            self.record.count_batch(n)  # for server/mean_batch_size
        return InferBatch(version=self.version, sent_at=serving_clock(self), action=action,
                          batched=(obs, runtime_state, train_state))

    async def learn_once(self) -> None:
        """pre_learn, learn() in the learn thread, post_learn; messages queue, none is answered."""
        started = time.monotonic()
        learn = self.algo.learn
        learn = in_step(self.ranks, self.algo, learn)  # [ranks] every rank learns rank 0's data
        learn = self.threads.around(learn)  # [learn-threads] a thread per core left idle
        self.algo.pre_learn()
        self.global_step, log = await self.loop.run_in_executor(self.learn_executor, learn)
        self.algo.post_learn()
        seconds = time.monotonic() - started
        self.learning_seconds += seconds  # the serving clock stood still
        self.version += 1
        trace_learn(self)  # [trace]
        self.record.learned(self, {**log, "server/learn_seconds": seconds})

    def save(self) -> None:
        """A checkpoint; then this run's older ones are pruned (the newest three stay)."""
        counters = {"global_step": self.global_step, "policy_version": self.version,
                    **self.record.run_counters(self)}  # what the run counts beside: frames, time
        path = save_checkpoint(self.run_dir, self.algo.create_checkpoint(), counters)
        self.saved = prune_checkpoints(self.saved, path)

    def request_stop(self) -> None:
        """Stop after the learn in progress: the final checkpoint (once a frame was served), then
        every client told. From any thread: a signal's handler, a notebook's Interrupt."""
        self.stop_requested = True
        if self.loop is not None:
            call_soon(self.loop, self.wake.set)


# ===== 6. A checkpoint on disk, and what SIGINT and SIGTERM do =====
# PlugRL page: "should_save() and should_stop() are checked on every pass" (learn_and_save saves);
# here, what a save writes, and how a signal becomes should_stop's clean path.

def save_checkpoint(run_dir: str, checkpoint: Checkpoint, server_counters: dict) -> str:
    """Write a checkpoint to a temporary file, then rename it: a crash never damages the last."""
    folder = os.path.join(run_dir, "checkpoints")
    with naming(f"cannot make {folder}"):
        os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{checkpoint.step:012d}.pt")
    payload = {**vars(checkpoint), "server": server_counters}  # asdict would copy every tensor
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    check_loadable(buffer)  # one that cannot be resumed from fails the run now, not at --resume
    temporary = f"{path}.{os.getpid()}.tmp"  # no other process writes this name
    with naming(f"cannot write the checkpoint {path}"), open(temporary, "wb") as file:
        file.write(buffer.getbuffer())
        file.flush()
        os.fsync(file.fileno())
        os.replace(temporary, path)
    return path


def on_signal(server: Server, signum: int = signal.SIGINT, _=None) -> None:
    """SIGINT or SIGTERM: the first is request_stop(); its copies within a second are the same
    request, and a later one quits at once (signalled_again, quit_at_once). A plain handler:
    serve() installs it for a run, and a notebook's first Interrupt calls it."""
    if server.signalled_at is None:
        server.signalled_at = time.monotonic()
        again = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print("\nstopping after the learn in progress, if any (a final checkpoint once a frame "
              f"was served); {again} again, a second or more from now, quits without one",
              file=sys.stderr, flush=True)
        server.request_stop()
    elif signalled_again(server):
        quit_at_once(server)


# ===== The first reading ends here ==========================================================
# Its five questions, and where it answered them: where an action comes from and what routes its
# feedback (infer_batch, route_feedback, discard_reason, on_policy); what becomes of a stale frame
# (discard_reason, discard_feedback); when learn runs and why serving pauses (learn_and_save,
# learn_once); what a checkpoint holds and when it is written (Checkpoint, learn_and_save, save,
# create_checkpoint); what SIGTERM does (on_signal, request_stop, learn_and_save, run).


# ===== 7. PG: the first learner, on one rank or several (DDPAlgorithm) =====
# PlugRL page: "Use BaseAlgorithm unless you implement the distributed hooks required by
# DDPAlgorithm". The page names no hook: these are plugrl_server's (base_algorithm.py, which the
# page points to for exact signatures). pg is the on-policy counterpart of the SAC example.
# Registered as `pg` with its config in section 10. Read it first as a learner of one process.

import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

@dataclasses.dataclass
class PGConfig(BaseAlgoConfig):
    """pg's hyperparameters; every field is a flag (--algo.frames-per-learn 2048)."""
    global_steps: int | None = 200_000  # frames stored, then the run ends
    frames_per_learn: int = 1024  # the batch: a learn runs each time it is full
    gamma: float = 0.99  # discount per decision
    gae_lambda: float = 0.95  # GAE: 0 is the one-step TD error, 1 the Monte Carlo return
    policy_lr: float = 1e-3  # Adam's step size for the policy
    value_lr: float = 1e-3  # Adam's step size for the value network
    value_epochs: int = 10  # value steps per learn on the whole batch; the policy takes one
    ent_coef: float = 0.03  # an entropy bonus: keeps the policy from narrowing too soon
    max_grad_norm: float = 0.5  # gradients are clipped to this norm, policy and value alike
    value_hidden_size: int = 64  # the width of the value network's two hidden layers
    save_every: int = 50  # learns between checkpoints


class DDPAlgorithm(BaseAlgorithm):
    """BaseAlgorithm plus the hooks to learn on several ranks: under torch.distributed.run, rank 0
    serves and learns, the others only learn. At each learn rank 0's get_server_data() reaches
    the others' load_server_data(), then every rank runs pre_learn, learn and post_learn;
    DistributedDataParallel averages the gradients, so the weights stay the same everywhere.
    Rank 0 writes the one checkpoint."""

    ddp_enabled: bool = False  # activate_ddp sets it

    @abc.abstractmethod
    def activate_ddp(self, ddp_policy: DistributedDataParallel) -> None:
        """Learn through the policy's DistributedDataParallel wrapper; set ddp_enabled."""

    @abc.abstractmethod
    def get_server_data(self) -> tuple[int, dict, dict]:
        """Rank 0, before a learn: (global_step, meta_info of JSON values, data of arrays)."""

    @abc.abstractmethod
    def load_server_data(self, global_step: int, meta_info: dict, data: dict) -> None:
        """Every other rank, before a learn: take in what get_server_data gave."""

    @abc.abstractmethod
    def load_learner_state(self, checkpoint: Checkpoint) -> None:
        """Every other rank, on --resume: the learned weights, optimizers and counters."""

    @abc.abstractmethod
    def create_ddp_checkpoint(self) -> Checkpoint:
        """The checkpoint of the modules themselves, never of their DDP wrappers."""

    def create_checkpoint(self) -> Checkpoint:
        """Rank 0's save, on one rank or many."""
        return self.create_ddp_checkpoint()

    def rank_share(self, n: int) -> slice:
        """This rank's equal share of n rows (one rank: all of them); the last n % ranks sit out.
        DistributedDataParallel averages the shares' gradients."""
        ranks, rank = (dist.get_world_size(), dist.get_rank()) if self.ddp_enabled else (1, 0)
        return slice(rank * (n // ranks), (rank + 1) * (n // ranks))


class PG(DDPAlgorithm):
    """On-policy policy gradient with a learned value baseline and GAE(lambda) advantages. It
    learns from fixed-size batches of frames, not whole episodes: a learn runs every
    frames_per_learn stored frames, so long episodes weigh no more than short ones and a client
    that leaves never holds a learn up. Counters: global_step (frames stored), stored (rows of
    this batch), learns, saved_at. A DDPAlgorithm: its hooks for several ranks come last."""

    on_policy = True  # the gradient is only unbiased for actions of the current policy

    def __init__(self, config: PGConfig, policy: BaseTorchPolicy):
        super().__init__(config=config, policy=policy)
        # A batch of one frame has no spread to normalise its advantage by; 0 value steps no loss.
        for flag, least in (("frames_per_learn", 2), ("value_epochs", 1), ("save_every", 1)):
            if getattr(config, flag) < least:
                raise UsageError(f"--algo.{flag.replace('_', '-')} must be at least {least}; got "
                                 f"{getattr(config, flag)}")
        self.stored, self.learns, self.saved_at = 0, 0, 0
        n, spec = config.frames_per_learn, policy.obs_spec
        obs = zeros_of(spec, n)
        sample = self.example_train_state(n)["sample"]  # [n, ...]: the batch's sample column
        # One row per frame. successor: the row of the same environment's next stored frame.
        self.batch = {"obs": obs, "next_obs": map_arrays(np.zeros_like, obs),
                      "sample": np.zeros_like(sample), "reward": np.zeros(n, np.float32),
                      "terminated": np.zeros(n, np.float32), "successor": np.full(n, -1)}
        encoder = ObsEncoder(spec)  # its own: an image through convolutions, not its raw pixels
        hidden = config.value_hidden_size
        self.value = nn.Sequential(encoder, nn.Linear(encoder.features, hidden), nn.Tanh(),
                                   nn.Linear(hidden, hidden), nn.Tanh(),
                                   nn.Linear(hidden, 1)).to(policy.device)
        # What learn differentiates: the modules, or their DDP wrappers once activate_ddp ran.
        self.train_policy, self.train_value = policy, self.value
        self.policy_optimizer = self.value_optimizer = None  # built by init_optimizers()

    def init_optimizers(self) -> None:
        self.policy_optimizer = torch.optim.Adam(self.policy.parameters(), self.config.policy_lr)
        self.value_optimizer = torch.optim.Adam(self.value.parameters(), self.config.value_lr)

    def derive_train_state(self, runtime_state: dict) -> dict:
        """The sample the action came from: learn asks the policy for its log-probability."""
        return {"sample": runtime_state["sample"]}

    def feedback(self, *, obs, runtime_state, train_state=None, terminated, truncated, next_obs,
                 reward, info, next_terminated, next_truncated, prev_node):
        """Store the frame in the next row, and link it after its environment's previous one."""
        self.record_finished_episode(info, next_terminated, next_truncated)
        row, batch = self.stored, self.batch
        put_rows(batch["obs"], row, obs)
        put_rows(batch["next_obs"], row, next_obs)
        batch["sample"][row] = train_state["sample"]
        batch["reward"][row] = np.sum(reward)  # a stacked reward, one per physical step: its sum
        batch["terminated"][row] = next_terminated
        batch["successor"][row] = -1
        # No link if this frame begins an episode (terminated/truncated are the previous frame's
        # flags), or if prev_node names an earlier batch: that frame was stored before a learn.
        previous, batch_id = prev_node
        if previous >= 0 and batch_id == str(self.learns) and not (terminated or truncated):
            batch["successor"][previous] = row
        self.stored += 1
        self.global_step += 1
        return (row, str(self.learns)), self.global_step, {}

    def should_learn(self) -> bool:
        return self.stored >= self.config.frames_per_learn

    def should_save(self) -> bool:
        return self.learns - self.saved_at >= self.config.save_every

    def learn_impl(self) -> tuple[int, dict]:
        """Advantages, one policy step, value_epochs value steps; then a new batch."""
        cfg, n, device = self.config, self.stored, self.policy.device
        frames = map_arrays(lambda array: torch.from_numpy(array[:n]).to(device), self.batch)
        advantage, value = self.advantages(frames)
        returns = advantage + value  # what the value network regresses to
        advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
        share = self.rank_share(n)  # several ranks: this one's rows (one rank: all of them)
        obs = slice_rows(frames["obs"], share)
        # One policy step: a second would follow a policy that did not draw these samples.
        distribution = self.train_policy(obs)
        entropy = distribution.entropy().mean()
        log_prob = distribution.log_prob(frames["sample"][share])
        policy_loss = -(log_prob * advantage[share]).mean() - cfg.ent_coef * entropy
        self.policy_optimizer.zero_grad()
        policy_loss.backward()
        nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
        self.policy_optimizer.step()
        for _ in range(cfg.value_epochs):
            value_loss = 0.5 * (self.values(obs) - returns[share]).pow(2).mean()
            self.value_optimizer.zero_grad()
            value_loss.backward()
            nn.utils.clip_grad_norm_(self.value.parameters(), cfg.max_grad_norm)
            self.value_optimizer.step()
        self.stored = 0
        self.learns += 1  # also names the new batch: nodes of the old one link nothing
        return self.global_step, {"train/policy_loss": policy_loss.item(),
                                  "train/value_loss": value_loss.item(),
                                  "train/entropy": entropy.item()}

    # --- A second reading: GAE, the checkpoint, the hooks of several ranks (DDPAlgorithm) ---

    def values(self, obs: dict) -> torch.Tensor:
        """V(obs) [B]: the value network on every observation key, joined by its ObsEncoder."""
        return self.train_value(obs).squeeze(-1)

    @torch.no_grad()
    def advantages(self, frames: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """GAE(lambda) of the stored frames [n], backwards along each chain; and V(obs) [n]."""
        cfg = self.config
        value, next_value = self.values(frames["obs"]), self.values(frames["next_obs"])
        # Termination stops bootstrapping. After truncation, or at a frame this batch cuts
        # short, the episode goes on, and V(next_obs) stands for the rest of it.
        not_done = 1 - frames["terminated"]
        delta = (frames["reward"] + cfg.gamma * not_done * next_value - value).cpu().numpy()
        advantage = np.zeros(len(delta), np.float32)
        successor = self.batch["successor"]
        for row in reversed(range(len(delta))):  # a successor sits in a later row: done first
            later = advantage[successor[row]] if successor[row] >= 0 else 0.0
            advantage[row] = delta[row] + cfg.gamma * cfg.gae_lambda * later
        return torch.from_numpy(advantage).to(value.device), value

    def create_ddp_checkpoint(self) -> Checkpoint:
        """Policy, value network, optimizers, counters, and the frames of the unfinished batch."""
        self.saved_at = self.learns
        frames = map_arrays(lambda array: torch.from_numpy(array[:self.stored].copy()), self.batch)
        meta = {"stored": self.stored, "learns": self.learns, "saved_at": self.saved_at,
                "value": self.value.state_dict(), "frames": frames}
        optimizer = {"policy": self.policy_optimizer.state_dict(),
                     "value": self.value_optimizer.state_dict()}
        return Checkpoint(step=self.global_step, model=self.policy.state_dict(),
                          optimizer=optimizer, meta=meta)

    def load_learner_state(self, checkpoint: Checkpoint) -> None:
        """Weights, optimizers and counters: all that every rank needs to learn in step."""
        super().load_checkpoint(checkpoint)  # BaseAlgorithm's: global_step and the policy
        meta = checkpoint.meta
        self.stored, self.learns, self.saved_at = meta["stored"], meta["learns"], meta["saved_at"]
        self.value.load_state_dict(meta["value"])
        self.policy_optimizer.load_state_dict(checkpoint.optimizer["policy"])
        self.value_optimizer.load_state_dict(checkpoint.optimizer["value"])

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """The learner state and the unfinished batch's frames: the cadence continues exactly."""
        self.load_learner_state(checkpoint)
        put_rows(self.batch, slice(0, self.stored), checkpoint.meta["frames"])

    def activate_ddp(self, ddp_policy: DistributedDataParallel) -> None:
        """Learn through the policy's wrapper, and through one of the value network alike."""
        self.train_policy = ddp_policy
        self.train_value = DistributedDataParallel(self.value, device_ids=ddp_policy.device_ids)
        self.ddp_enabled = True

    def get_server_data(self) -> tuple[int, dict, dict]:
        """The batch's rows and the counters learn reads."""
        data = slice_rows(self.batch, slice(0, self.stored))
        return self.global_step, {"stored": self.stored, "learns": self.learns}, data

    def load_server_data(self, global_step: int, meta_info: dict, data: dict) -> None:
        """Rank 0's batch and counters, so that this rank learns from the same frames."""
        self.global_step = global_step
        self.stored, self.learns = meta_info["stored"], meta_info["learns"]
        put_rows(self.batch, slice(0, self.stored), data)


# ===== 8. Wire format: each message one msgpack map in one binary WebSocket frame =====
# PlugRL page: the transport under infer() and feedback(): PlugRL's protocol (its SPEC.md,
# version 1, sections 1-3). msgpack, written here with struct: the types a message uses, anything
# else refused; nothing is ever run from bytes. An array travels as openpi writes it: a map with
# the bin keys __ndarray__ (true), data (its C-order bytes), dtype (a numpy typestr such as
# "<f4") and shape; a numpy scalar as {__npgeneric__: true, data: its value, dtype}.
import re
import struct

_MAX_DEPTH = 64  # a message needs a handful of levels; deeper is refused both ways
_KINDS = "buifU"  # bool, uint, int, float, text: object, structured and complex are refused
_TYPESTR = re.compile(rf"[<>|=][{_KINDS}][1-9][0-9]{{0,5}}")  # byte order, kind, item size


class ProtocolError(ValueError):
    """A message that breaks the wire format or the protocol; `hint` tells the sender what to do."""

    def __init__(self, message, hint="see 'The wire protocol' in README.md"):
        super().__init__(message)
        self.hint = hint


def _head(n: int, fix: int, most: int, codes: tuple) -> bytes:
    # The head of a str, bin, array or map of n items or bytes: one byte (fix | n) up to `most`,
    # else a code and n in 1, 2 or 4 big-endian bytes: the smallest, as msgpack writes it.
    if n <= most:
        return bytes((fix | n,))
    if n < 1 << 8 and codes[0]:  # an array or a map has no 1-byte count
        return bytes((codes[0], n))
    if n < 1 << 16:
        return struct.pack(">BH", codes[1], n)
    if n < 1 << 32:
        return struct.pack(">BI", codes[2], n)
    raise ProtocolError(f"{n} items or bytes are more than msgpack can frame")


_STR, _BIN = (0xa0, 31, (0xd9, 0xda, 0xdb)), (0, -1, (0xc4, 0xc5, 0xc6))
_ARRAY, _MAP = (0x90, 15, (0, 0xdc, 0xdd)), (0x80, 15, (0, 0xde, 0xdf))
_INTS = ((0, 1 << 8, 0xcc, "B"), (0, 1 << 16, 0xcd, "H"), (0, 1 << 32, 0xce, "I"),
         (0, 1 << 64, 0xcf, "Q"), (-1 << 7, 0, 0xd0, "b"), (-1 << 15, 0, 0xd1, "h"),
         (-1 << 31, 0, 0xd2, "i"), (-1 << 63, 0, 0xd3, "q"))


def _int(value: int) -> bytes:
    if -32 <= value < 128:  # a fixint: the byte is the number, two's complement below 0
        return struct.pack(">b" if value < 0 else ">B", value)
    for low, high, code, width in _INTS:  # the smallest width that holds it
        if low <= value < high:
            return bytes((code,)) + struct.pack(">" + width, value)
    raise ProtocolError(f"the integer {value} does not fit in 64 bits")


def _pack(value, out: list, depth: int) -> None:
    # Appends value's bytes to out. The checks run in the msgpack package's order (a bool before
    # an int, as a bool is one; an np.float64 as a float, as it is one; numpy's types last), but
    # for what a message is made of: a dict, an array or a str, which no other check would take.
    if depth > _MAX_DEPTH:
        raise ProtocolError(f"the message nests deeper than {_MAX_DEPTH} levels (or in itself)")
    if isinstance(value, dict):
        out.append(_head(len(value), *_MAP))
        for key, item in value.items():
            _pack(key, out, depth + 1)
            _pack(item, out, depth + 1)
    elif isinstance(value, np.ndarray):
        _pack_array(value, out)
    elif isinstance(value, str):
        out.append(_STRS.get(value) or _str(value))
    elif value is None:
        out.append(b"\xc0")
    elif isinstance(value, bool):
        out.append(b"\xc3" if value else b"\xc2")
    elif isinstance(value, int):
        out.append(_int(value))
    elif isinstance(value, float):
        out.append(b"\xcb" + struct.pack(">d", value))
    elif isinstance(value, (bytes, bytearray, memoryview)):
        out += (_head(memoryview(value).nbytes, *_BIN), value)
    elif isinstance(value, (list, tuple)):
        out.append(_head(len(value), *_ARRAY))
        for item in value:
            _pack(item, out, depth + 1)
    elif isinstance(value, np.generic):  # openpi's numpy scalar
        dtype = _sendable(value.dtype)
        _pack({b"__npgeneric__": True, b"data": value.item(), b"dtype": dtype}, out, depth)
    else:
        raise ProtocolError(f"cannot send a {type(value).__name__}: a message holds dicts, "
                            "lists, str, bytes, numbers, bools, None and numpy arrays")


_STRS = {}  # str -> its bytes: a message's keys and names come back every step


def _str(value: str) -> bytes:
    raw = value.encode()
    packed = _head(len(raw), *_STR) + raw
    if len(raw) <= 64 and len(_STRS) < 4096:  # a name, not a free text
        _STRS[value] = packed
    return packed


def _sendable(dtype: np.dtype) -> str:
    if dtype.kind not in _KINDS:
        raise ProtocolError(f"cannot send dtype {dtype}: only bool, int, uint, float and str "
                            "(text) arrays")
    return dtype.str


_NDARRAY = b"\x84\xc4\x0b__ndarray__\xc3\xc4\x04data"  # an array's map, up to its data's bytes
_AFTER_DATA = {}  # (typestr, shape) -> the map's last two entries: dtype and shape


def _pack_array(array: np.ndarray, out: list) -> None:
    # openpi's array map, {__ndarray__, data, dtype, shape}, with the parts that do not change
    # from one message to the next written once (a step packs a dozen arrays), and the data of a
    # C-ordered array joined from the array itself: one copy of a camera frame, not two.
    key = (array.dtype.str, array.shape)
    after = _AFTER_DATA.get(key)
    if after is None:
        after = []
        _pack({b"dtype": _sendable(array.dtype), b"shape": array.shape}, after, 1)
        after = _AFTER_DATA[key] = b"".join(after)[1:]  # without the head of that map of 2
        if len(_AFTER_DATA) > 4096:  # shapes that change with every message
            _AFTER_DATA.clear()
    data = array.data if array.flags.c_contiguous else array.tobytes()
    out += (_NDARRAY, _head(array.nbytes, *_BIN), data, after)


def pack_message(message: dict) -> bytes:
    """One message as a msgpack map: byte for byte what msgpack.packb writes with openpi's hook."""
    out = []
    _pack(message, out, 1)
    return b"".join(out)


_FIXED = {0xc0: None, 0xc2: False, 0xc3: True}
_NUMBERS = {code: struct.Struct(">" + width) for code, width in zip(
    (0xca, 0xcb, 0xcc, 0xcd, 0xce, 0xcf, 0xd0, 0xd1, 0xd2, 0xd3), "fdBHIQbhiq")}
_SIZED = {0xd9: ("str", "B"), 0xda: ("str", "H"), 0xdb: ("str", "I"), 0xc4: ("bin", "B"),
          0xc5: ("bin", "H"), 0xc6: ("bin", "I"), 0xdc: ("array", "H"), 0xdd: ("array", "I"),
          0xde: ("map", "H"), 0xdf: ("map", "I")}
_EXTENSIONS = {0xc7, 0xc8, 0xc9, 0xd4, 0xd5, 0xd6, 0xd7, 0xd8}


def _read(frame: memoryview, pos: int, depth: int, found: list) -> tuple:
    # The value at pos, and where the next begins; found gets (offset, dtype, shape) of each
    # array's data. No length is trusted before the frame is known to hold it: a count of items or
    # bytes past the frame's end is refused, not allocated.
    if depth > _MAX_DEPTH:
        raise ProtocolError(f"the message nests deeper than {_MAX_DEPTH} levels")
    code = frame[pos]
    pos += 1
    if code < 0x80 or code >= 0xe0:  # a fixint
        return (code if code < 0x80 else code - 256), pos
    if code in _FIXED:
        return _FIXED[code], pos
    if code in _NUMBERS:
        number = _NUMBERS[code]
        return number.unpack_from(frame, pos)[0], pos + number.size
    if code < 0xa0:  # fixmap 0x80-0x8f, fixarray 0x90-0x9f
        kind, n = ("map" if code < 0x90 else "array"), code & 0x0f
    elif code < 0xc0:  # fixstr 0xa0-0xbf
        kind, n = "str", code & 0x1f
    elif code in _SIZED:
        kind, width = _SIZED[code]
        (n,) = struct.unpack_from(">" + width, frame, pos)
        pos += struct.calcsize(width)
    else:
        what = "an extension type" if code in _EXTENSIONS else "not a msgpack type"
        raise ProtocolError(f"byte 0x{code:02x} at offset {pos - 1} is {what}: the protocol "
                            "sends maps, arrays, str, bin, numbers, bools and nil")
    if n > len(frame) - pos:  # every item takes a byte at least
        raise ProtocolError(f"a {kind} of {n} at offset {pos} runs past the frame's end")
    if kind == "str":
        return str(frame[pos:pos + n], "utf-8"), pos + n
    if kind == "bin":
        return frame[pos:pos + n], pos + n  # a view: an array's data stays one, _kept copies others
    if kind == "array":
        items = []
        for _ in range(n):
            item, pos = _read(frame, pos, depth + 1, found)
            items.append(_kept(item))
        return items, pos
    table, data_end = {}, 0
    for _ in range(n):
        key, pos = _read(frame, pos, depth + 1, found)
        if not isinstance(key, (str, memoryview)):
            raise ProtocolError(f"a map key before offset {pos} is a {type(key).__name__}: "
                                "keys are str or bin")
        key = _kept(key)
        if key in table:  # msgpack would keep the last one; no peer sends two
            raise ProtocolError(f"a map before offset {pos} has the key {key!r} twice")
        table[key], pos = _read(frame, pos, depth + 1, found)
        data_end = pos if key == b"data" else data_end
    if b"__ndarray__" in table:  # openpi's array: a view of the frame
        dtype, shape = _array_layout(table)
        found.append((data_end - len(table[b"data"]), dtype, shape))
        return _array_at(frame, *found[-1]), pos
    return _map_of(table), pos


def _kept(value):
    return bytes(value) if type(value) is memoryview else value  # a bin the message keeps


def _map_of(table: dict):
    # openpi's numpy scalar becomes the scalar; any other map is kept.
    if b"__npgeneric__" in table:
        dtype, data = _dtype_of(table.get(b"dtype")), table.get(b"data")
        with contextlib.suppress(ValueError, OverflowError):  # openpi's numpy scalar
            if isinstance(data, (bool, int, float, str)):  # its value: a msgpack number, say
                return dtype.type(data)
        raise ProtocolError(f"a numpy scalar {dtype.str} cannot hold {str(data)[:40]}")
    return {key: _kept(value) for key, value in table.items()}


def _dtype_of(typestr) -> np.dtype:
    if not (isinstance(typestr, str) and _TYPESTR.fullmatch(typestr)):
        raise ProtocolError(f"dtype {str(typestr)[:40]!r} is not a typestr of bool, int, uint, "
                            "float or text, such as '<f4'")
    try:
        return np.dtype(typestr)
    except TypeError:  # a size numpy has no such type of: '<i3', '|b2'
        raise ProtocolError(f"numpy has no dtype {typestr}") from None


def _array_layout(table: dict) -> tuple:
    # openpi's array map, checked before numpy sees it: (dtype, shape).
    dtype, shape, data = _dtype_of(table.get(b"dtype")), table.get(b"shape"), table.get(b"data")
    if not (isinstance(shape, list) and len(shape) <= 32
            and all(type(size) is int and size >= 0 for size in shape)):
        raise ProtocolError(f"an array's shape must be a list of sizes, got {str(shape)[:60]}")
    size = math.prod(shape) * dtype.itemsize
    if type(data) is not memoryview or len(data) != size:
        got = f"{len(data)} bytes" if type(data) is memoryview else f"a {type(data).__name__}"
        raise ProtocolError(f"an array {dtype.str} {shape} needs {size} bytes of data, got {got}")
    return dtype, tuple(shape)


def _array_at(frame: memoryview, offset: int, dtype: np.dtype, shape: tuple) -> np.ndarray:
    if dtype.kind == "U" and np.ndarray(
            shape, dtype.byteorder + "u4", frame, offset).max(initial=0) > 0x10FFFF:
        raise ProtocolError("a text array holds a code point above U+10FFFF")  # numpy can't read it
    array = np.ndarray(shape, dtype, frame, offset)  # read-only, a view of the frame: no copy
    # A big-endian array (no little-endian peer sends one) gets this machine's byte order: a copy.
    return array if dtype.isnative else array.astype(dtype.newbyteorder("="))


_LAYOUTS = {}  # len(frame) -> (the frame's bytes between its arrays' data, found, the message)
_AN_ARRAY = object()  # where an array goes in the message of a layout


def unpack_message(frame: bytes) -> dict:
    """A binary frame's msgpack map. Its arrays are read-only views of it: copy one to change it."""
    if not isinstance(frame, (bytes, bytearray, memoryview)):
        raise ProtocolError("expected a binary frame, got a text frame", "send binary frames")
    view = memoryview(frame).toreadonly()  # from a bytearray too, the arrays stay read-only
    # A client sends the same message every step but for its arrays' values: a frame whose bytes
    # between its arrays' data are those of the last frame of its length is that message with new
    # data, read without parsing it again (the plain form parses every frame: 5x as slow).
    pieces, found, message = _LAYOUTS.get(len(view), ((), (), None))
    if message and all(view[start:start + len(piece)] == piece for start, piece in pieces):
        return _rebuilt(message, (_array_at(view, *where) for where in found))
    found = []
    try:
        message, end = _read(view, 0, 1, found)
    except (IndexError, struct.error):
        raise ProtocolError(f"the frame ends inside a value ({len(view)} bytes)") from None
    except UnicodeDecodeError as error:
        raise ProtocolError(f"a str is not UTF-8: {error}") from None
    if end != len(view):
        raise ProtocolError(f"{len(view) - end} bytes follow the message's end")
    if not isinstance(message, dict):
        raise ProtocolError(f"a message is a map, not a {type(message).__name__}")
    pieces, start = [], 0
    for offset, dtype, shape in found:
        pieces.append((start, bytes(view[start:offset])))
        start = offset + math.prod(shape) * dtype.itemsize
    pieces.append((start, bytes(view[start:])))
    if len(_LAYOUTS) > 256:  # lengths that change with every message
        _LAYOUTS.clear()
    if sum(len(piece) for _, piece in pieces) < 1 << 14:  # names and heads, not a frame's bins
        _LAYOUTS[len(view)] = pieces, found, _rebuilt(message, itertools.repeat(_AN_ARRAY))
    return message


def _rebuilt(tree, arrays):
    # A copy of a message's maps and lists, with each array (or its place) the next of arrays.
    if type(tree) is dict:
        return {key: _rebuilt(value, arrays) for key, value in tree.items()}
    if type(tree) is list:
        return [_rebuilt(value, arrays) for value in tree]
    return next(arrays) if type(tree) is np.ndarray or tree is _AN_ARRAY else tree


# ===== 9. Rows: a message's arrays, batched along axis 0, cut into each environment's rows =====
# PlugRL page: "sliced per environment" (derive_train_state's result, and every runtime state).

GROUPS = ("images", "states")  # what a policy reads by name; text it gets as it comes


def observation(n: int, states: dict | None = None, images: dict | None = None, text=None) -> dict:
    """PlugRL's observation of n environments: images (camera -> uint8 [n, h, w, c]), states
    (name -> numbers [n, ...]) and text ([n] str, "" where an environment has none)."""
    return {"images": images or {}, "states": states or {},
            "text": np.full(n, "") if text is None else np.asarray(text, str)}


def obs_spec_of(spec: dict) -> dict:
    """An obs_spec as code reads it, {"images": {name: (shape, np.dtype)}, "states": {...}}, from
    a class's (shape, np.float32) or the [shape, "float32"] of config.json, the flag and the
    metadata (obs_spec_as_json writes it); a group left out is empty. The flat form of old,
    {"state": ...}, is one line."""
    if not (isinstance(spec, dict) and set(spec) <= set(GROUPS)):
        raise UsageError(f"obs_spec {spec} is flat: PlugRL's observation groups its keys, "
                         f"{{'states': {spec}}} (uint8 [h, w, c] cameras under 'images')")
    return {group: {key: (tuple(int(size) for size in shape), np.dtype(dtype))
                    for key, (shape, dtype) in spec.get(group, {}).items()} for group in GROUPS}


def zeros_of(spec: dict, n: int) -> dict:
    """n rows of zeros for every key of an obs_spec: {group: {key: [n, *shape]}}, each in its
    dtype. No text: a buffer keeps what the policy reads by name."""
    return {group: {key: np.zeros((n, *shape), dtype) for key, (shape, dtype) in keys.items()}
            for group, keys in obs_spec_of(spec).items()}


def obs_spec_as_json(spec: dict) -> dict:
    """An obs_spec as --policy.obs-spec and config.json spell it: {"states": {key: [[3],
    "float32"]}}, a group without keys left out."""
    return {group: {key: [list(shape), dtype.name] for key, (shape, dtype) in keys.items()}
            for group, keys in obs_spec_of(spec).items() if keys}


def map_arrays(function, tree):
    """function(array) for every array of a nested dict (or a lone array); None stays None."""
    if isinstance(tree, dict):
        return {key: map_arrays(function, value) for key, value in tree.items()}
    return None if tree is None else function(tree)


def slice_rows(tree, rows):
    """Index every array of a nested dict (or a lone array) along axis 0."""
    return map_arrays(lambda array: array[rows], tree)


def put_rows(tree, rows, values) -> None:
    """tree[rows] = values, in place, for an array or a nested dict of arrays."""
    if isinstance(tree, dict):
        for key in tree:
            put_rows(tree[key], rows, values[key])
    else:
        tree[rows] = values


def join_rows(trees: list, join=np.concatenate):
    """The arrays of nested dicts of one layout, each joined by join: along axis 0 by default
    (a text array to the widest)."""
    if isinstance(trees[0], dict):
        return {key: join_rows([tree[key] for tree in trees], join) for key in trees[0]}
    return join(trees)


def split_rows(tree, n: int) -> list:
    """[slice_rows(tree, i) for i in range(n)], one array at a time (the plain form indexes
    every array once per row). Rows of arrays are views; a 1-d array gives Python numbers; any
    other value (a number, a str beside the arrays of an info) goes to every row (SPEC 5.4)."""
    if not isinstance(tree, (dict, np.ndarray)):
        return [tree] * n
    if not isinstance(tree, dict):
        return tree.tolist() if tree.ndim == 1 else list(tree)
    rows = [{} for _ in range(n)]
    for key, value in tree.items():
        for row, part in zip(rows, split_rows(value, n)):
            row[key] = part
    return rows


def frames_of(env_ids, slots: list, steps: list, feedback: dict) -> list[Frame]:
    """A feedback's frames, one per environment: each its row of every field of the message's
    data (accept, and train_in_process with the data it would have sent)."""
    m = len(slots)
    rows = zip(env_ids, slots, steps, split_rows(feedback["obs"], m),
               split_rows(feedback["rewards"], m),  # floats, or [k] rows in-process
               feedback["terminated"].tolist(), feedback["truncated"].tolist(),
               split_rows(feedback.get("info", {}), m))
    return [Frame(*row) for row in rows]


# ===== 10. Registries: where the command line finds policies, algorithms and environments =====
# PlugRL page: register_algo_config, register_algo (and their policy twins), make_algo.

_POLICY_CONFIGS, _POLICIES, _ALGO_CONFIGS, _ALGOS = {}, {}, {}, {}
ENVIRONMENTS = {}  # env_id -> VecEnv subclass, for the env client (section 14)


def module_names() -> list[str]:
    """Every name a plug-in may import this file by: plugrl_min, the file's own (a renamed copy's),
    and its dotted names in a package: from __spec__ (python -m, an import), or for a script
    run by path from the folders above it that hold an __init__.py."""
    path = os.path.abspath(__file__)
    dotted = os.path.splitext(os.path.basename(path))[0]
    names = ["plugrl_min", dotted, __name__]
    if getattr(__spec__, "name", None):  # python -m myproj.rl.plugrl_min runs as __main__
        names.append(__spec__.name)
    folder = os.path.dirname(path)
    while os.path.isfile(os.path.join(folder, "__init__.py")):  # myproj/rl/: rl, myproj.rl
        folder, package = os.path.split(folder)
        dotted = f"{package}.{dotted}"
        names.append(dotted)
    return names


# One copy of the registries per process: a plug-in's `from plugrl_min import register_env`, or
# `from myproj.rl.plugrl_min import ...`, must reach these tables, not a second copy of the file.
# A name some other module holds already is left to it.
for _name in module_names():
    sys.modules.setdefault(_name, sys.modules[__name__])


class CommandError(Exception):
    """A failure the command line reports in one line, "error: ...", then exits with `status`.
    Raised for what the user can fix (a file, a port, a refused connection); any other exception
    keeps its traceback, since it is a bug: in an environment, a policy, an algorithm, or here."""

    status = 1


class UsageError(CommandError):
    """A name, flag or value that cannot work (an unknown environment, a name registered twice):
    status 2, as argparse gives a mistyped flag."""

    status = 2


def _registrar(table: dict, key, what: str, defaults: bool = False):
    """A class decorator that stores the class (or, for a config, its defaults) under key, once."""
    def decorator(cls):
        if key in table:
            first = (type(table[key]) if defaults else table[key]).__module__
            raise UsageError(f"{what} is registered twice, by {first} and by {cls.__module__}: "
                             "rename one, or load only one of them")
        table[key] = cls() if defaults else cls
        return cls
    return decorator


def register_policy_config(uid: str, variant: str = "default"):
    """Class decorator: register a policy config dataclass's defaults under (uid, variant)."""
    return _registrar(_POLICY_CONFIGS, (uid, variant), f"policy config {uid}/{variant}", True)


def register_policy(uid: str):
    """Class decorator: register a BaseTorchPolicy subclass under uid."""
    return _registrar(_POLICIES, uid, f"policy {uid}")


def register_algo_config(uid: str, variant: str = "default"):
    """Class decorator: register an algorithm config dataclass's defaults under (uid, variant)."""
    return _registrar(_ALGO_CONFIGS, (uid, variant), f"algorithm config {uid}/{variant}", True)


def register_algo(uid: str):
    """Class decorator: register a BaseAlgorithm subclass under uid."""
    return _registrar(_ALGOS, uid, f"algorithm {uid}")


def register_env(env_id: str):
    """Class decorator: register a VecEnv subclass under env_id, for env-client and --local-env."""
    return _registrar(ENVIRONMENTS, env_id, f"environment {env_id}")


def _registered(table) -> str:
    """'uid (variant, ...)' for every uid of a config table."""
    uids = {uid: [variant for known, variant in table if known == uid] for uid, _ in table}
    return ", ".join(f"{uid} ({', '.join(variants)})" for uid, variants in sorted(uids.items()))


def _config(kind: str, configs: dict, classes: dict, uid: str, variant: str):
    """A copy of the registered defaults of (uid, variant): flags never change the registry. None
    registered: one line that says what to do (on the command line, status 2 as for a flag)."""
    if (uid, variant) in configs:
        return dataclasses.replace(configs[(uid, variant)])
    kind = kind.lower()
    decorator = f"@register_{'algo' if kind == 'algorithm' else kind}_config({uid!r})"
    hint = ("" if any(known == uid for known, _ in configs) else
            f"; {uid!r} is registered without a config: register one with {decorator}"
            if uid in classes else f"; if {uid!r} is defined in a plug-in, add --plugin MODULE")
    raise UsageError(f"unknown {kind} {uid!r} variant {variant!r}; known: "
                     f"{_registered(configs)}{hint}")


def _build(kind: str, classes: dict, configs: dict, uid: str, variant: str, config, **kwargs):
    config = _config(kind, configs, classes, uid, variant) if config is None else config
    if uid not in classes:  # the page's symptom when only the config module was imported
        raise KeyError(f"{kind} {uid} is not registered.")
    return classes[uid](config=config, **kwargs)


def make_policy(uid: str, config=None, variant: str = "default"):
    """Build the policy registered as uid (default config: the registered variant's)."""
    return _build("Policy", _POLICIES, _POLICY_CONFIGS, uid, variant, config)


def make_algo(uid: str, policy, config=None, variant: str = "default"):
    """Build the algorithm registered as uid around policy. An abstract class raises TypeError."""
    return _build("Algorithm", _ALGOS, _ALGO_CONFIGS, uid, variant, config, policy=policy)


# The first reading's algorithms, registered here, below the registries they go in. A plug-in
# registers its own with the decorators, as sac_example.py and the built-in policies below do.
register_algo_config("dummy")(DummyAlgoConfig)
register_algo("dummy")(DummyAlgorithm)
register_algo_config("pg")(PGConfig)
register_algo("pg")(PG)


# ===== 11. Built-in policies: dummy-policy (tanh-Gaussian) and categorical-policy (choices) =====
# PlugRL page: the dummy-policy of its smoke test, registered with register_policy(_config).

def image_encoder(shape: tuple, features: int) -> nn.Sequential:
    """[B, C, H, W] in [0, 1] -> [B, features]: two 3x3 convolutions of stride 2, a linear layer.
    shape: the camera's own, [h, w, c]."""
    height, width, channels = shape
    size = 32 * math.ceil(height / 4) * math.ceil(width / 4)  # each convolution halves, rounding up
    return nn.Sequential(nn.Conv2d(channels, 16, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Flatten(), nn.Linear(size, features), nn.ReLU())


class ObsEncoder(nn.Module):
    """The images and states an obs_spec names, in one feature vector [B, features]: a camera
    (uint8 [h, w, c]) scaled to [0, 1] and through convolutions of its own, a state flattened and
    cast to float32; images first, then states, each in sorted name order (so the spelling of
    obs_spec never changes the network). Without images it has no parameters: a policy's MLP on
    one state is the MLP it was. Keys it is not given, and text, it never reads."""

    def __init__(self, obs_spec: dict, image_features: int = 64):
        super().__init__()
        spec = obs_spec_of(obs_spec)
        self.cameras, self.states = sorted(spec["images"]), sorted(spec["states"])
        for key, (shape, dtype) in spec["images"].items():
            if dtype != np.uint8 or len(shape) != 3:
                raise UsageError(f"image {key!r} is {dtype} {list(shape)}: a camera is uint8 "
                                 "[h, w, c]; other numbers go under 'states'")
        # A list, not a ModuleDict: a key of a nested Gymnasium Dict ("outer.inner") has a dot.
        self.images = nn.ModuleList(image_encoder(spec["images"][key][0], image_features)
                                    for key in self.cameras)
        self.features = image_features * len(self.cameras) + sum(
            math.prod(spec["states"][key][0]) for key in self.states)

    def forward(self, obs: dict) -> torch.Tensor:
        """The features [B, features] of tensors {"images": {key: [B, h, w, c]}, "states": ...}."""
        parts = [encoder(obs["images"][key].permute(0, 3, 1, 2).float() / 255)  # [B, c, h, w]
                 for key, encoder in zip(self.cameras, self.images)]
        for key in self.states:
            value = obs["states"][key]  # [B, ...], or [B] for a key of shape ()
            parts.append((value.flatten(1) if value.dim() > 1 else value[:, None]).float())
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # cat would copy one


@register_policy_config("dummy-policy")
@dataclasses.dataclass
class DummyPolicyConfig:
    """Sizes of dummy-policy; the defaults fit dummy-v1 and pendulum-v1 (3 numbers in, 1 out)."""
    obs_spec: dict = dataclasses.field(  # group -> name -> [shape, dtype] it reads (JSON)
        default_factory=lambda: {"states": {"state": [[3], "float32"]}})
    action_dim: int = 1  # numbers in one action, each in [-1, 1]
    action_horizon: int = 1  # actions per decision: a chunk of H for MultiAction
    hidden_size: int = 256  # the width of both hidden layers
    log_std_min: float = -5.0  # the Gaussian's log-std is squashed into [min, max]
    log_std_max: float = 2.0  # (see log_std_min)


@register_policy("dummy-policy")
class DummyPolicy(BaseTorchPolicy):
    """A tanh-Gaussian MLP on ObsEncoder's features, actions in [-1, 1]: the actor of pg and sac."""

    def __init__(self, config: DummyPolicyConfig):
        super().__init__()
        self.config = config
        self.action_dim, self.action_horizon = config.action_dim, config.action_horizon
        self.obs_spec = obs_spec_of(config.obs_spec)
        self.encoder = ObsEncoder(self.obs_spec)
        hidden = config.hidden_size
        self.trunk = nn.Sequential(nn.Linear(self.encoder.features, hidden), nn.ReLU(),
                                   nn.Linear(hidden, hidden), nn.ReLU())
        # Mean and log-std of every action of the chunk, in one matmul.
        self.head = nn.Linear(hidden, 2 * config.action_horizon * config.action_dim)

    def gaussian(self, obs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log-std of the Gaussian before tanh, each [B, action_horizon * action_dim]."""
        mean, log_std = self.head(self.trunk(self.encoder(obs))).chunk(2, dim=-1)
        low, high = self.config.log_std_min, self.config.log_std_max
        return mean, low + 0.5 * (high - low) * (torch.tanh(log_std) + 1)  # squashed to [low, high]

    def forward(self, obs: dict) -> torch.distributions.Distribution:
        """The Gaussian of the sample u; the action is tanh(u)."""
        mean, log_std = self.gaussian(obs)
        gaussian = torch.distributions.Normal(mean, log_std.exp(), validate_args=False)
        return torch.distributions.Independent(gaussian, 1, validate_args=False)

    def sample(self, obs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterized action in (-1, 1) and its log-probability [B] (what sac trains)."""
        gaussian = self(obs)
        u = gaussian.rsample()  # mean + std * noise: the gradient reaches mean and std
        action = torch.tanh(u)
        # The density of a = tanh(u) is the density of u over |da/du| = 1 - tanh(u)^2.
        return action, gaussian.log_prob(u) - torch.log(1 - action.pow(2) + 1e-6).sum(-1)

    @torch.inference_mode()
    def get_action_and_runtime_state(self, obs: dict) -> tuple[np.ndarray, PolicyRuntimeState]:
        """Sample a batch of actions; the runtime state keeps the action, u and u's log-prob."""
        gaussian = self(self.as_tensors(obs))
        u = gaussian.sample()
        log_prob = gaussian.log_prob(u)
        action = torch.tanh(u).cpu().numpy().reshape(-1, *self.action_shape)
        return action, {"action": action, "sample": u.cpu().numpy(),
                        "log_prob": log_prob.cpu().numpy()}

    @torch.inference_mode()
    def get_greedy_action(self, obs: dict) -> np.ndarray:
        """The squashed mean, tanh(mean): what eval takes for the most likely action."""
        mean, _ = self.gaussian(self.as_tensors(obs))
        return torch.tanh(mean).cpu().numpy().reshape(-1, *self.action_shape)

    def fake_runtime_state(self, n: int) -> PolicyRuntimeState:
        size = self.action_horizon * self.action_dim
        return {"action": np.zeros((n, *self.action_shape), np.float32),
                "sample": np.zeros((n, size), np.float32), "log_prob": np.zeros(n, np.float32)}


@register_policy_config("dummy-policy", "plugrl-dummy-v1")
@dataclasses.dataclass
class PlugRLDummyPolicyConfig(DummyPolicyConfig):
    """Sized for what PlugRL's own dummy-v1 client sends: two states (float64 on the wire: cast
    on receipt), two cameras this policy does not read, and text; 7 numbers in an action."""
    obs_spec: dict = dataclasses.field(default_factory=lambda: {"states": {
        "robot_state": [[10], "float32"], "joint_angles": [[5], "float32"]}})
    action_dim: int = 7


@register_policy_config("categorical-policy")
@dataclasses.dataclass
class CategoricalPolicyConfig:
    """Sizes of categorical-policy (discrete actions); the defaults fit cartpole-v1."""
    obs_spec: dict = dataclasses.field(  # group -> name -> [shape, dtype] it reads (JSON)
        default_factory=lambda: {"states": {"state": [[4], "float32"]}})
    num_actions: int = 2  # choices per step
    hidden_size: int = 64  # the width of both hidden layers


@register_policy("categorical-policy")
class CategoricalPolicy(BaseTorchPolicy):
    """An MLP on ObsEncoder's features, a categorical head: num_actions choices (action_dim 1)."""

    def __init__(self, config: CategoricalPolicyConfig):
        super().__init__()
        self.action_dim, self.num_actions = 1, config.num_actions
        self.obs_spec = obs_spec_of(config.obs_spec)
        self.encoder = ObsEncoder(self.obs_spec)
        hidden = config.hidden_size
        self.logits = nn.Sequential(nn.Linear(self.encoder.features, hidden), nn.Tanh(),
                                    nn.Linear(hidden, hidden), nn.Tanh(),
                                    nn.Linear(hidden, config.num_actions))

    def forward(self, obs: dict) -> torch.distributions.Distribution:
        """One categorical over num_actions per observation."""
        logits = self.logits(self.encoder(obs))
        return torch.distributions.Categorical(logits=logits, validate_args=False)

    @torch.inference_mode()
    def get_action_and_runtime_state(self, obs: dict) -> tuple[np.ndarray, PolicyRuntimeState]:
        """Sample a batch of choices; the runtime state keeps each choice and its log-prob."""
        categorical = self(self.as_tensors(obs))
        choice = categorical.sample()  # [n] int64
        action = choice.cpu().numpy().reshape(-1, 1, 1)  # [n, action_horizon = 1, 1]
        return action, {"action": action, "sample": choice.cpu().numpy(),
                        "log_prob": categorical.log_prob(choice).cpu().numpy()}

    @torch.inference_mode()
    def get_greedy_action(self, obs: dict) -> np.ndarray:
        """The most likely choice of each observation, [n, 1, 1] int64 (for eval)."""
        return self(self.as_tensors(obs)).logits.argmax(-1).cpu().numpy().reshape(-1, 1, 1)

    def fake_runtime_state(self, n: int) -> PolicyRuntimeState:
        return {"action": np.zeros((n, 1, 1), np.int64), "sample": np.zeros(n, np.int64),
                "log_prob": np.zeros(n, np.float32)}


# ===== 12. The run's record: metrics.jsonl, the progress line, the start and the end of a run =====
# PlugRL page: "The progress display reads it" (global_steps); rollout/* as learn() returns them.

import collections
import glob
import socket


class RunRecord:
    """What a run writes and says as it goes: a line of metrics.jsonl at the first learn once
    --log-every frames were routed since the line before (the learns and episodes in between,
    averaged) and one at the end; a progress line. A resumed run counts on from its checkpoint:
    its learns (the policy version), frames and seconds."""

    def __init__(self, log_every: int, frames: int = 0, seconds: float = 0.0):
        self.log_every = log_every  # frames between lines of metrics.jsonl (at least)
        self.frames_before, self.seconds_before = frames, seconds  # the run's, before --resume
        # The next line: key -> [sum of weighted values, sum of weights], and its episodes.
        self.window, self.window_episodes = {}, 0
        self.logged_at = self.discarded_at = 0  # server.frames, .discarded at the last line
        self.infer_calls = self.inferred_envs = 0  # for server/mean_batch_size
        self.last_reward = float("nan")  # of the newest line that saw episodes, for the progress
        self.metrics_file = None  # open while the server runs
        self.tensorboard = None  # [tensorboard]
        self.claimed = None  # a new run's folder, claimed by the command line: claim_run_dir
        self.started = self.shown_at = time.perf_counter()
        self.tty = sys.stdout.isatty()  # asked once: a system call, and show_progress is per pass

    def open(self, run_dir: str) -> None:
        """metrics.jsonl, appended to a line at a time (a resumed run continues it, less a last
        line cut short). Unbuffered: a line that cannot be written (a full disk) is not tried
        again at the close."""
        path = os.path.join(run_dir, "metrics.jsonl")
        with naming(f"cannot open {path}"):
            self.metrics_file = open(path, "a+b", buffering=0)  # +: to read its last line
            drop_a_cut_line(self.metrics_file)
        self.tensorboard = open_tensorboard(run_dir)  # [tensorboard]

    def close(self) -> None:
        if self.metrics_file is not None:
            self.metrics_file.close()
        if self.tensorboard is not None:  # [tensorboard]
            self.tensorboard.close()  # [tensorboard]

    def run_counters(self, server) -> dict:
        """What a checkpoint keeps for --resume to count on from: the run's frames and seconds."""
        seconds = self.seconds_before + time.perf_counter() - self.started
        return {"frames": self.frames_before + server.frames, "seconds": round(seconds, 3)}

    def count_batch(self, n: int) -> None:
        self.infer_calls += 1
        self.inferred_envs += n

    def mean_batch_size(self) -> float:
        """Environments per infer() so far: what batching gained."""
        return self.inferred_envs / max(self.infer_calls, 1)

    def add(self, log: dict) -> None:
        """Count a learn's log, or a frame's feedback log, into the next line of metrics.jsonl.
        rollout/* are means over the log's rollout/episodes: weighted by them, they stay exact."""
        episodes = log.get("rollout/episodes", 0)
        self.window_episodes += episodes
        for key, value in log.items():
            weight = episodes if key.startswith("rollout/") else 1
            if weight and key != "rollout/episodes":
                total = self.window.setdefault(key, [0.0, 0])
                total[0] += weight * float(value)
                total[1] += weight

    def learned(self, server, log: dict) -> None:
        """After a learn: its log counts; a line is written once --log-every frames were routed."""
        self.add(log)
        if server.frames - self.logged_at >= self.log_every:
            self.write(server, "learn")
        self.show_progress(server)  # also while should_learn() stays true and no frame comes

    def write(self, server, event: str) -> None:
        """One line of metrics.jsonl (and TensorBoard) for the frames since the last line: the
        mean of every value learn and feedback returned, rollout/* over the episodes that ended."""
        elapsed = time.perf_counter() - self.started  # of this process: its fps
        counters = self.run_counters(server)  # the run's, counting on after --resume
        means = {key: total / weight for key, (total, weight) in self.window.items()}
        rollout = {key: means.pop(key, 0.0)  # 0 when no episode ended
                   for key in ("rollout/reward", "rollout/length", "rollout/success")}
        frames, discarded = server.frames - self.logged_at, server.discarded - self.discarded_at
        metrics = {**means, **rollout, "rollout/episodes": self.window_episodes,
                   "server/fed": frames - discarded, "server/discarded": discarded,
                   "server/frames": counters["frames"], "server/policy_version": server.version,
                   "server/fps": server.frames / elapsed,
                   "server/mean_batch_size": self.mean_batch_size()}
        line = {"event": event, "step": server.global_step, "time": counters["seconds"], **metrics}
        with naming(f"cannot write {self.metrics_file.name}"):
            self.metrics_file.write(f"{json.dumps(line)}\n".encode())
        if self.tensorboard is not None:  # [tensorboard]
            write_scalars(self.tensorboard, metrics, server.global_step)  # [tensorboard]
        if self.window_episodes:
            self.last_reward = rollout["rollout/reward"]
        self.window, self.window_episodes = {}, 0
        self.logged_at, self.discarded_at = server.frames, server.discarded

    def show_progress(self, server) -> None:
        """A progress line: in place every second on a terminal, every 10 s otherwise."""
        now, tty = time.perf_counter(), self.tty
        if now - self.shown_at < (1.0 if tty else 10.0):
            return
        self.shown_at = now
        line = (f"step {server.global_step}/{server.algo.config.global_steps} | "
                f"{server.frames / (now - self.started):.0f} fps | rollout/reward "
                f"{self.last_reward:.2f} | batch {self.mean_batch_size():.1f} | "
                f"{server.version} learns")
        line += server.threads.progress()  # [learn-threads]
        print("\r" + line if tty else line, end="" if tty else "\n", flush=True)


def drop_a_cut_line(file) -> None:
    """A resumed run's metrics.jsonl may end in a line cut short (a run killed as it wrote): the
    next line would fuse with it, so it goes. Lines are far shorter than the 64 KiB looked at."""
    size = file.seek(0, os.SEEK_END)
    tail = os.pread(file.fileno(), 65536, max(size - 65536, 0)) if size else b""  # a new run's
    if tail and not tail.endswith(b"\n"):
        file.truncate(size - len(tail) + tail.rfind(b"\n") + 1)
        print(f"warning: {file.name}'s last line was cut short: dropped", file=sys.stderr)


def open_run(server, sockets: list, on_listening) -> None:
    """Say where it listens, as a URL; on_listening(port); then open the run's files.
    With --host '' and --port 0 each family has a port of its own: IPv4's is the one told."""
    ipv4 = [sock for sock in sockets if sock.family == socket.AF_INET]
    host, port = (ipv4 or sockets)[0].getsockname()[:2]
    print(f"listening on ws://{f'[{host}]' if ':' in host else host}:{port}", flush=True)
    if on_listening is not None:
        on_listening(port)  # the command line's claims the run directory (claim_run_dir)
    server.record.open(server.run_dir)


async def run_to_the_end(server: Server, loop) -> tuple[int, str, int]:
    """Await the run's loop: how it ended, as (close code, reason, exit status). A hook that
    raised ends it at once, its traceback printed: no checkpoint is written after it."""
    try:
        await loop
    except Exception as error:
        return 1011, f"server failed: {print_failure(error)}", 1
    server.closing = True  # what the run saves is saved
    return 1001, "run finished", server.status  # the printed end line's prefix


def call_soon(loop: asyncio.AbstractEventLoop, callback) -> None:
    """callback() in loop's thread, asked from any thread; nothing once that loop has closed."""
    with contextlib.suppress(RuntimeError):  # closed: the run it served is over
        loop.call_soon_threadsafe(callback)


def finish_run(server, code: int, reason: str, status: int) -> int:
    """After the clients were told: the end line of metrics.jsonl, the other ranks stopped, the
    run's report; the exit status (server.ended from now on)."""
    record = server.record
    if code == 1001 and server.frames:  # what the last learns and episodes logged
        record.add(server.algo.build_train_info(server.global_step, {})[1])
        record.write(server, "end")
    record.close()
    if server.ranks is not None:  # [ranks] told last: no dead rank holds a client
        status = server.ranks.stop(status)  # [ranks]
    server.ended = status  # before the lines below: a Ctrl-C that follows them finds it ended
    print(f"\n{reason}: global step {server.global_step}, {server.version} learns", flush=True)
    if not server.frames:
        print("no frame was served: no checkpoint or metrics line was written", flush=True)
    elif code == 1001:  # [report]
        print(report([server.run_dir]), flush=True)  # [report]
    return status


def leave_as_found(run_dir: str, claimed: tuple[bool, set], local_clients: list) -> None:
    """A new run that served no frame (a start that failed, or a stop before any client came)
    leaves its folder as it found it: what it wrote goes, so the same command runs once fixed.
    A local client that failed has its log printed first."""
    made, found = claimed
    for number, process, log_path in local_clients:
        if process.poll() not in (None, 0):  # it may say why the start failed
            with contextlib.suppress(OSError), open(log_path, errors="replace") as log:
                print(f"env-client-{number}.log:\n{log.read().rstrip()}", file=sys.stderr)
    for name in set(os.listdir(run_dir)) - found:  # config.json, logs, TensorBoard's file
        with naming(f"cannot remove {os.path.join(run_dir, name)}"):
            os.remove(os.path.join(run_dir, name))
    if made:
        with naming(f"cannot remove {run_dir}"):
            os.rmdir(run_dir)
    print(f"the run directory {run_dir} is {'removed' if made else 'as it was'}", flush=True)


def serve(server: Server, run, command_line: bool) -> int:
    """Serve in the main thread until the run (server.run, or run_in_process) ends: its exit
    status. SIGINT and SIGTERM call on_signal until the local clients are gone; then this gives
    back the handlers it found (main([...])), or ignores both as the command line exits."""
    handler = functools.partial(on_signal, server)
    before = {signum: signal.signal(signum, handler) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        return run_status(server, run)
    finally:
        for signum, old in before.items():
            # As Python exits it resets a handler, not SIG_IGN: a copy of SIGTERM would kill (143).
            signal.signal(signum, signal.SIG_IGN if command_line else old)


def run_status(server: Server, run) -> int:
    """asyncio.run(run), the server's run, in this thread: its exit status, or for a failure
    around it (the port, the run directory: one line; else a traceback) its CommandError's or 1."""
    status, wait = 1, 10  # the local clients then get 10 s in all to end
    try:
        status = asyncio.run(run)
    except asyncio.CancelledError:  # [notebook] stopped at once, without a final checkpoint
        status, wait = 130, 0  # [notebook] and the local clients are killed at once
    except Exception as error:
        print_failure(error)
        status = error.status if isinstance(error, CommandError) else 1
        server.failure = error
    finally:
        reap(server.local_clients, wait)
        if not server.frames and server.record.claimed is not None:  # a start that failed
            server.record.close()
            leave_as_found(server.run_dir, server.record.claimed, server.local_clients)
    return status


async def tick(wake: asyncio.Event) -> None:
    """Wake the control loop twice a second: timeouts, progress and should_stop when idle."""
    while True:
        await asyncio.sleep(0.5)
        wake.set()


def signalled_again(server: Server) -> bool:
    """A signal a second or more after the first: a second request, not one of its copies
    (timeout, docker stop, Slurm and a terminal's Ctrl-C send several)."""
    return server.signalled_at is not None and time.monotonic() - server.signalled_at >= 1.0


def quit_at_once(server: Server) -> typing.NoReturn:
    """A second request to stop: exit now, without a final checkpoint unless it is written. The
    handler runs between two lines of the loop's thread, a final save's too: os._exit, which no
    save can catch; a cancel would leave a learn running, which the exit waits for."""
    if server.closing:  # the final checkpoint is written: nothing is left to lose
        os._exit(server.status if server.ended is None else server.ended)
    print("\nstopped again: exiting now, without a final checkpoint", file=sys.stderr, flush=True)
    os._exit(130)


@contextlib.contextmanager
def naming(what: str):
    """An OSError inside becomes a CommandError that names what failed: 'what: the reason'."""
    try:
        yield
    except OSError as error:
        raise CommandError(f"{what}: {error.strerror or error}") from None


def print_failure(error: Exception, prefix: str = "error: ") -> str:
    """A CommandError in one line (a file of the run, named); any other exception, a hook's or an
    environment's, with its traceback. Returns what the server's clients are told failed."""
    if not isinstance(error, CommandError):
        traceback.print_exception(error)
    else:
        print(f"{prefix}{error}", file=sys.stderr, flush=True)
        if isinstance(error.__context__, OSError):  # naming()'s: a file of the run, not a hook
            return "OSError in its run directory"
    return type(error).__name__  # a hook's, or --in-process an environment's one-line failure


def checkpoint_paths(run_dir: str) -> list[str]:
    """The run directory's checkpoints, oldest first (their names sort by step)."""
    return sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step_*.pt")))


def prune_checkpoints(saved: list[str], path: str) -> list[str]:
    """After a save to path: the run's newest three checkpoints; the older ones it deletes."""
    saved = [old for old in saved if old != path] + [path]
    for old in saved[:-3]:
        with naming(f"cannot remove the old checkpoint {old}"):
            os.remove(old)
    return saved[-3:]


class MissingFromCheckpoint(KeyError):
    """A key that load_checkpoint reads and the checkpoint lacks: --resume says so in one line."""


class CheckpointDict(dict):
    """A checkpoint's meta or optimizer dict, as read: a key it lacks raises MissingFromCheckpoint,
    so --resume tells it apart from a KeyError of the algorithm's own, which keeps its traceback."""

    def __missing__(self, key):
        raise MissingFromCheckpoint(key)

    def __reduce__(self):  # kept and saved again by an algorithm: a type weights_only loads
        return collections.OrderedDict, (), None, None, iter(self.items())


def check_loadable(buffer: io.BytesIO) -> None:
    """A checkpoint's bytes, loaded as --resume will: a TypeError that names the culprits."""
    buffer.seek(0)
    try:
        torch.load(buffer, weights_only=True)
    except Exception as error:
        raise TypeError("create_checkpoint returned a value that torch.load(weights_only=True) "
                        "refuses: keep tensors and plain Python values (numpy scalars and "
                        "arrays are the usual culprits)") from error


def read_checkpoint(path: str) -> tuple[Checkpoint, dict]:
    """A checkpoint file: its Checkpoint, and the server's counters saved beside it."""
    payload = torch.load(path, weights_only=True, map_location="cpu")
    server = payload.pop("server")
    for part in ("meta", "optimizer"):  # the model is not: load_state_dict names what it lacks
        if isinstance(payload.get(part), dict):
            payload[part] = CheckpointDict(payload[part])
    return Checkpoint(**payload), server


def load_newest_checkpoint(run_dir: str) -> tuple[Checkpoint, dict]:
    """The newest checkpoint that loads (a damaged one is skipped), and the server's counters."""
    for path in reversed(checkpoint_paths(run_dir)):
        try:
            return read_checkpoint(path)
        except Exception as error:  # a file cut short by a crash: fall back to the one before
            print(f"skipping damaged checkpoint {path}: {error}", file=sys.stderr)
    raise CommandError(f"no loadable checkpoint in {run_dir} (checkpoints/step_*.pt)")


# ===== [learn-threads] How many torch threads a learn gets: one per core left idle =====
# plugrl_min's own: the PlugRL page leaves threads to the server. Cut: learns run on the count
# of the thread that serves (infer_on_one_thread), as its infers do.

TORCH_THREADS = torch.get_num_threads()  # torch's own count, before the server pins its own
CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []  # taskset


class LearnThreads:
    """Torch threads for each learn: --learn-threads N, or one per core that other processes
    leave idle, at most torch's count (/proc/stat, each second of learning): a learn's threads spin
    waiting for each other, so beside a busy process two learn slower than one."""

    def __init__(self, fixed: int | None):
        self.fixed, self.most = fixed, min(TORCH_THREADS, len(CORES) or TORCH_THREADS)
        self.count = fixed or self.most
        self.busy = self.own = self.seconds = 0.0  # summed over learns since the last decision
        self.last = (0.0, self.count)  # the last learn's seconds and threads: the progress line

    def around(self, learn):
        """learn, wrapped to run in the learn thread on the chosen count, and measured."""
        def counted_learn():
            torch.set_num_threads(self.count)  # per OS thread: inference keeps its one
            before = (time.perf_counter(), busy_seconds(), time.process_time())
            result = learn()
            self.last = (time.perf_counter() - before[0], self.count)
            if self.fixed is None and before[1] is not None:
                self.seconds += self.last[0]
                self.busy += busy_seconds() - before[1]  # every process's, on these cores
                self.own += time.process_time() - before[2]
                if self.seconds >= 1.0:  # /proc/stat counts in 10 ms ticks: a second is enough
                    self.decide()
            return result
        return counted_learn

    def decide(self) -> None:
        """One thread per core the others left idle during the learns since the last decision."""
        others = max(self.busy - self.own, 0.0) / self.seconds  # in cores
        self.count = max(1, min(self.most, int(len(CORES) - others + 0.5)))
        self.busy = self.own = self.seconds = 0.0

    def progress(self) -> str:
        """The progress line's part: the last learn's time and thread count."""
        seconds, threads = self.last
        return f" | learn {1000 * seconds:.1f} ms, {threads} thread{'s' * (threads > 1)}"


def busy_seconds() -> float | None:
    """CPU seconds of this process's cores since boot, by every process; None off Linux."""
    try:
        with open("/proc/stat") as file:  # per core: user to steal, less idle and iowait
            lines = [line.split() for line in file if line.startswith("cpu")][1:]
    except OSError:
        return None
    ticks = sum(sum(map(int, words[1:9])) - int(words[4]) - int(words[5])
                for words in lines if int(words[0][3:]) in CORES)
    return ticks / os.sysconf("SC_CLK_TCK")


# ===== [ranks] Several learners: the ranks of a torch.distributed launch =====
# PlugRL page: DDPAlgorithm's hooks, as the server calls them. Rank 0 serves and learns; every
# other rank learns only. Cut: a launch of several ranks is a one-process run on each.

import atexit
import datetime
import threading


class Ranks:
    """The ranks of a torch.distributed.run launch: rank 0 sends orders (learn, stop) as
    plugrl_min frames, over a gloo group of their own without a time limit (a learner waits as
    long as the server idles). A dead rank's sockets close: the others' next call fails."""

    def __init__(self):
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.orders = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=3650))
        self.launcher = os.getppid()  # torch.distributed.run, the parent of every rank

    def broadcast(self, order: dict | None = None) -> dict:
        """Rank 0's order to every rank (the others pass none): its length, then its frame."""
        frame = b"" if order is None else pack_message(order)
        length = torch.tensor([len(frame)])
        self.send(length)
        data = torch.frombuffer(bytearray(frame), dtype=torch.uint8) if frame else torch.empty(
            int(length), dtype=torch.uint8)
        self.send(data)
        return unpack_message(data.numpy().tobytes())

    def send(self, tensor: torch.Tensor) -> None:
        """dist.broadcast from rank 0; back once gloo's worker thread let go of the tensor: left its
        last owner, that thread frees it under the GIL, which it cannot take once the interpreter
        exits (std::terminate: SIGABRT)."""
        try:
            dist.broadcast(tensor, 0, group=self.orders)
        finally:  # also after an error: the rank exits next
            deadline = time.monotonic() + 10
            while tensor._use_count() > 1 and time.monotonic() < deadline:
                time.sleep(0.001)

    def stop(self, status: int) -> int:
        """Rank 0, once its clients were told: the stop order. A rank gone already makes it 1."""
        try:
            self.broadcast({"order": "stop"})
        except RuntimeError as error:
            print(f"error: a learner rank is gone ({str(error).splitlines()[0]})", file=sys.stderr)
            return 1
        return status

    def watch_launcher(self) -> None:
        """A thread: once the launcher is gone (kill -9, the OOM killer), rank 0 stops as on
        SIGTERM (a final checkpoint); another rank gives rank 0's stop order 30 s, then exits."""
        while os.getppid() == self.launcher:  # once it dies, this rank is adopted
            time.sleep(0.5)
        if self.rank == 0:
            print("\nthe launcher is gone: stopping as on SIGTERM", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        time.sleep(30)
        print(f"rank {self.rank}: the launcher is gone, and rank 0 silent: exiting",
              file=sys.stderr, flush=True)
        os._exit(1)


def in_step(ranks: Ranks | None, algo: DDPAlgorithm, learn):
    """Rank 0's learn, which first sends get_server_data() (called now, in the control task) to
    every other rank: they learn from the same frames, on the same torch thread count, at the
    same time. In one process (ranks None), learn as it is."""
    if ranks is None:
        return learn
    server_data = algo.get_server_data()  # (global_step, meta_info, data)

    def learn_in_step():  # in the learn thread, on the thread count chosen for this learn
        ranks.broadcast({"order": "learn", "threads": torch.get_num_threads(),
                         "server_data": server_data})
        return learn()
    return learn_in_step


def join_ranks(algo: BaseAlgorithm, uid: str, device: torch.device, resume: str | None):
    """Under torch.distributed.run (WORLD_SIZE > 1): join the process group and wrap the
    networks in DistributedDataParallel. Rank 0 gets its Ranks back and serves; every other rank
    loads its learner state (with --resume, from the same checkpoint as rank 0), learns in step
    with rank 0 until it says stop, and exits. None in one process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return None
    if not isinstance(algo, DDPAlgorithm):  # the page's "DDPAlgorithm errors at runtime"
        hooks = [name for name in vars(DDPAlgorithm) if name in DDPAlgorithm.__abstractmethods__]
        raise UsageError(f"{world} ranks need a DDPAlgorithm; {uid!r} is a BaseAlgorithm without "
                         f"{', '.join(hooks)}: run it without torch.distributed.run, or "
                         "implement them")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    atexit.register(dist.destroy_process_group)  # left to exit, gloo can abort (SIGABRT)
    ranks = Ranks()
    # Every rank wraps, then loads the same checkpoint (on several machines: one disk), so the
    # weights agree whether or not the run resumes.
    device_ids = [device.index] if device.type == "cuda" else None
    algo.activate_ddp(DistributedDataParallel(algo.policy, device_ids=device_ids))
    threading.Thread(target=ranks.watch_launcher, daemon=True, name="plugrl-launcher-watch").start()
    if ranks.rank == 0:
        return ranks
    if resume is not None:  # the other ranks only learn: weights, optimizers and counters
        algo.load_learner_state(load_newest_checkpoint(resume)[0])
    raise SystemExit(serve_as_learner(algo, ranks))


def serve_as_learner(algo: DDPAlgorithm, ranks: Ranks) -> int:
    """Every rank but 0: learn in step with rank 0 at each of its orders, until it says stop."""
    for signum in (signal.SIGINT, signal.SIGTERM):  # rank 0 alone ends the run, with a checkpoint
        signal.signal(signum, signal.SIG_IGN)
    print(f"rank {ranks.rank} of {ranks.size} (pid {os.getpid()}): learning with rank 0",
          flush=True)
    while True:
        try:
            order = ranks.broadcast()
        except RuntimeError as error:
            print(f"rank {ranks.rank}: rank 0 is gone ({str(error).splitlines()[0]})",
                  file=sys.stderr)
            return 1
        if order["order"] == "stop":
            print(f"rank {ranks.rank}: rank 0 ended the run", flush=True)
            return 0
        torch.set_num_threads(order["threads"])
        algo.load_server_data(*order["server_data"])
        algo.pre_learn()
        algo.learn()
        algo.post_learn()


# ===== [trace] --trace N: the contract, watched as it runs =====
# PlugRL page: the routing rule and prev_node, narrated for the first N frames and their learns.

def trace_frame(server: Server, client: int, frame: Frame, node: tuple, reason: str | None) -> None:
    """A line on a frame of the first N: its infer batch, where its feedback went, and why."""
    if server.trace_left <= 0:
        return
    server.trace_left -= 1
    batch = frame.step.batch
    action = np.array2string(batch.action[frame.step.row].ravel(), precision=3)
    where = {None: "feedback (acted with the current version)" if server.algo.on_policy
             else "feedback (off-policy: every frame is stored)",
             "stale": f"discard_feedback (stale: acted with version {batch.version}, the policy "
                      f"is version {server.version})",
             "learn due": "discard_feedback (learn due: should_learn() is true)"}[reason]
    print(f"trace: conn {client} env {frame.env_index} | infer batch of "
          f"{len(batch.action)} at version {batch.version} | action {action} | "
          f"-> {where} | prev_node {frame.slot.prev_node} -> {node}", flush=True)


def trace_learn(server: Server) -> None:
    """One line on a learn, while frames are still narrated."""
    if server.trace_left > 0:
        print(f"trace: learn {server.version} -> policy version {server.version}", flush=True)


# ===== [tensorboard] TensorBoard's curves beside metrics.jsonl =====
# plugrl_min's own: every line of metrics.jsonl, as scalars, when tensorboard is installed.

def open_tensorboard(run_dir: str):
    """A TensorBoard writer on the run directory, or None without the tensorboard package."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # optional: metrics.jsonl is the record either way
        return None
    return SummaryWriter(run_dir)


def write_scalars(writer, metrics: dict, step: int) -> None:
    """One metrics line's values at `step`; no rollout/* point for a line without episodes."""
    for key, value in metrics.items():
        if metrics["rollout/episodes"] or not key.startswith("rollout/"):
            writer.add_scalar(key, value, step)


# ===== [report] `python plugrl_min.py report RUN_DIR ...`: runs compared, and their chart =====
# plugrl_min's own: each run ends with its report; the command compares several. Cut: a run ends
# with its end line alone, and metrics.jsonl is the record.

def read_metrics(run_dir: str) -> list[dict]:
    """The lines of a run directory's metrics.jsonl (a UsageError if it has none)."""
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise UsageError(f"{run_dir} holds no metrics.jsonl: is it a run directory?")
    with open(path) as file:
        texts = file.read().splitlines()
    lines = []
    for number, text in enumerate(texts, 1):
        try:
            lines.append(json.loads(text))
        except ValueError as error:
            if number < len(texts):
                raise UsageError(f"{path}, line {number}: {error}") from None
            print(f"warning: {path}, line {number} is cut short (a run killed as it wrote?): "
                  "skipped", file=sys.stderr)
    if not lines:
        raise UsageError(f"{path} is empty: the run has not written a line yet")
    return lines


def return_curve(lines: list[dict], episodes: int = 100) -> list[tuple[int, float, int]]:
    """(step, mean return, episodes averaged) at every line that saw episodes: the mean over the
    newest lines that hold at least `episodes` (100) of them, each weighted by rollout/episodes;
    until that many have ended, over all so far, fewer."""
    curve, held = [], []  # held: (episodes, mean return) of the newest lines that are needed
    for line in lines:
        if line["rollout/episodes"]:
            held.append((line["rollout/episodes"], line["rollout/reward"]))
            while sum(count for count, _ in held[1:]) >= episodes:
                held.pop(0)
            count = sum(count for count, _ in held)
            total = sum(count * mean for count, mean in held)
            curve.append((line["step"], total / count, count))
    return curve


def run_mark(i: int) -> str:
    """The letters that name the i-th run (from 0) in a report: A to Z, then AA, AB, ..."""
    return (run_mark(i // 26 - 1) if i >= 26 else "") + chr(ord("A") + i % 26)


def report(run_dirs: list[str], reach: float | None = None, last: int = 100) -> str:
    """A line on each run (steps, learns, discards, episodes, the mean return of its last 100+
    (`last`) episodes, or of all if fewer ended; the best such mean of 100+ and the first step it
    reached `reach`), then their curves."""
    rows, curves = [], {}
    for i, run_dir in enumerate(run_dirs):
        mark = run_mark(i)
        lines = read_metrics(run_dir)
        curve = return_curve(lines, last)
        curves[mark] = [(step, mean) for step, mean, _ in curve]
        full = [(step, mean) for step, mean, count in curve if count >= last]  # 100+ averaged
        end = lines[-1]
        figures = [f"{end['step']:,} steps", f"{end['server/policy_version']:,} learns",
                   f"{sum(line['server/discarded'] for line in lines):,} discarded",
                   f"{sum(line['rollout/episodes'] for line in lines):,} episodes"]
        if curve:
            _, mean, count = curve[-1]
            figures.append(f"last {last}+ episodes {mean:.2f}" if count >= last else
                           f"all {count} episodes {mean:.2f}")
        if full:
            figures.append(f"best {max(mean for _, mean in full):.2f}")
        if reach is not None:
            step = next((step for step, mean in full if mean >= reach), None)
            figures.append(f"{reach:g} never reached" if step is None else
                           f"{reach:g} reached at step {step:,}")
        rows.append(f"{mark} {run_dir}: " + " | ".join(figures))
    return "\n".join(rows + [text_chart(curves, last)])


def text_chart(curves: dict, last: int = 100, rows: int = 12, width: int = 60) -> str:
    """The runs' curves on the same axes, each drawn with its mark: return against steps. A mark
    takes one cell: runs past Z are listed, not drawn."""
    title = f"mean return of the last {last}+ episodes (of all, before {last} ended), by step"
    if len(curves) > 26:
        title += f" (runs A to Z are drawn; {len(curves) - 26} more are not)"
        curves = {mark: curve for mark, curve in curves.items() if len(mark) == 1}
    points = [point for curve in curves.values() for point in curve]
    if not points:
        return "no episode finished: nothing to chart"
    steps, means = zip(*points)
    right, low, high = max(steps) or 1, min(means), max(means)
    grid = [[" "] * width for _ in range(rows)]
    for mark, curve in curves.items():
        for step, mean in curve:
            row = round((rows - 1) * (high - mean) / ((high - low) or 1))
            column = round((width - 1) * step / right)
            grid[row][column] = mark if grid[row][column] in (" ", mark) else "*"  # *: several
    labels = [f"{high:10.2f}", *[" " * 10] * (rows - 2), f"{low:10.2f}"]
    return "\n".join([title,
                      *(f"{label} |{''.join(cells)}" for label, cells in zip(labels, grid)),
                      f"{'':10} +{'-' * width}", f"{'':10} 0{right:>{width},}"])


def report_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python plugrl_min.py report",
                                     description="Compare runs from their metrics.jsonl.")
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    parser.add_argument("--reach", type=float, metavar="R", help="also the first step at which "
                        "the mean of the last N+ episodes reached R, once N had ended")
    parser.add_argument("--last", type=int, default=100, metavar="N",
                        help="the mean return of the last N+ episodes (default: 100)")
    args = parser.parse_args(argv)
    if args.last < 1:
        parser.error("--last must be at least 1")
    try:
        print(report(args.run_dirs, args.reach, args.last), flush=True)
    except BrokenPipeError:  # `report RUN | head -3`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
    return 0


# ===== [notebook] In a notebook: the server on a thread of its own, Interrupt as Ctrl-C =====
# plugrl_min's own: a kernel runs an event loop already, and its signals are the kernel's. Cut:
# main([...]) in a cell fails in asyncio.run, as a plain script's would.

import threading


def in_a_notebook() -> bool:
    """True in a notebook cell (its kernel's event loop runs in this thread), or off the main
    thread: either way the signals are not the command's, and it runs on a thread of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # no loop runs in this thread
        return threading.current_thread() is not threading.main_thread()
    return True


class OnAThread:
    """asyncio.run(coroutine) on a thread of its own (a kernel's loop runs in this one): wait()
    blocks until it ends and gives its result, or raises its exception here. The kernel's
    Interrupt (a KeyboardInterrupt in wait) calls interrupted(): a cancel, as Ctrl-C is to
    asyncio.run, and a KeyboardInterrupt here once it has ended."""

    def __init__(self, coroutine, name: str):
        self.task, self.outcome, self.cancelled = None, concurrent.futures.Future(), False
        self.thread = threading.Thread(target=self.run, args=(self.tracked(coroutine),),
                                       name=name, daemon=True)
        self.thread.start()

    async def tracked(self, coroutine):
        """The coroutine, its task kept for another thread to cancel."""
        self.task = asyncio.current_task()
        return await coroutine

    def run(self, coroutine) -> None:
        """The thread: its outcome, whatever ends it, for wait() to give or raise."""
        try:
            self.outcome.set_result(self.finish(coroutine))
        except BaseException as error:  # SystemExit too: raised in the caller's thread
            self.outcome.set_exception(error)

    def finish(self, coroutine):
        """The coroutine's own event loop, until it ends: its result."""
        return asyncio.run(coroutine)

    def wait(self):
        """Until it ends: its result. A sleep loop: interrupted, thread.join can think it ended."""
        while not self.outcome.done():
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                self.interrupted()
        self.thread.join()
        if self.cancelled:
            raise KeyboardInterrupt
        return self.outcome.result()

    def interrupted(self) -> None:
        """Cancel the coroutine (once it runs; after it ended, nothing is left to cancel)."""
        self.cancelled = True
        if self.task is not None:  # once it runs
            call_soon(self.task.get_loop(), self.task.cancel)


class Serving(OnAThread):
    """A run served on a thread of its own (a kernel's loop is busy): wait() blocks like the command
    line and gives the exit status, and the kernel's Interrupt acts as Ctrl-C: once, a clean stop
    with the final checkpoint; again a second later, a stop at once without one (130)."""

    def __init__(self, server: Server, run, on_start, at_end=None):
        self.server, self.at_end = server, at_end
        self.started = threading.Event()  # the run directory is claimed, or the run failed
        self.run_dir = None  # once claimed (the first of the two): where the run writes its files

        def claimed(port: int | None) -> None:
            on_start(port)
            self.run_dir = server.run_dir
            self.started.set()

        super().__init__(run(claimed), "plugrl-server")
        try:
            self.started.wait()
        except KeyboardInterrupt:  # in the start: the run stops at its loop's first pass
            self.server.request_stop()
            self.started.wait()

    def finish(self, coroutine) -> int:
        # A thread's first use of torch takes the count set last by any thread: asked first,
        # this one's stays 1 when the caller's is put back.
        infer_on_one_thread()
        try:
            return run_status(self.server, coroutine)
        finally:
            self.server.learn_executor.shutdown(wait=False)  # its learn, if any, ends alone
            if self.at_end is not None:
                self.at_end()
            self.started.set()

    def stop(self) -> int:
        """Stop after the learn in progress, with the final checkpoint: the exit status."""
        self.server.request_stop()
        return self.wait()

    def interrupted(self) -> None:
        """The kernel's Interrupt, or Ctrl-C in a REPL: the first as on_signal's Ctrl-C (and its
        copies, the same request); a later one stops at once, in the server's thread."""
        if self.server.ended is not None:  # its local clients end (reap): nothing to stop
            print("\nthe run has ended already: its local env clients get up to 10 s to end",
                  file=sys.stderr, flush=True)
        elif not signalled_again(self.server):
            on_signal(self.server)
        else:  # not on_signal's os._exit: it would end the kernel
            call_soon(self.server.loop, self.stop_now)

    def stop_now(self) -> None:
        """A second Interrupt, in the server's thread: a stop at once, without a final
        checkpoint, unless the run has saved what it saves and is ending anyway."""
        if self.server.closing:
            print("\nstopped again: the run is ending already, after its final save",
                  file=sys.stderr, flush=True)
        else:
            print("\nstopped again: stopping now, without a final checkpoint", file=sys.stderr,
                  flush=True)
            self.task.cancel()


def start(argv: list[str]) -> Serving:
    """The server command, trained in the background (a notebook stays free): the same words
    and flags as the command line, through main([...]). Its run_dir is claimed on return;
    stop() ends it. A run that did not start raises RuntimeError, saying why."""
    serving = main(list(argv), background=True)
    if isinstance(serving, CommandError):  # refused before serving: a usage error, a file
        raise RuntimeError(f"the run did not start (exit status {serving.status}): {serving}")
    if not isinstance(serving, Serving):  # argparse's usage error, which it printed
        raise RuntimeError(f"the run did not start (exit status {serving}; see the error above)")
    if serving.run_dir is None:  # it failed as it started: the port, its folder
        status, failure = serving.wait(), serving.server.failure
        raise RuntimeError(f"the run did not start (exit status {status}): {failure}")
    return serving


# ===== 13. Clients: their messages checked, how long they may owe feedback, who may connect =====
# PlugRL page: infer(obs) and feedback(...)'s arguments, as they arrive from other processes, in any
# language: every field is checked against the protocol reference in README.md; a bad one closes its
# connection for a resync, the log naming the field and what it must be. The algorithm only sees
# messages that passed. Then the feedback timeout and the API key. A first reading skips these.

PROTOCOL_VERSION = 1
SERVER_RESYNC = "plugrl-server-resync"  # the reason of a close for a message refused (SPEC 7.2)
REUSE = "reuse-feedback-obs"  # the one feature of the metadata's list: see reused_obs (SPEC 10.1)
MAX_MESSAGE_BYTES = 32 * 2**20  # a larger frame closes its connection (--max-message-bytes)
# PlugRL's SPEC (1.1) sets no cap; this one guards the server's memory against a runaway client,
# at over twice what 64 environments of PlugRL's dummy-v1 send, two cameras each (12 MB).


@dataclasses.dataclass
class ServerConfig:
    """A server's settings: the command line's flags of the same names (--max-message-bytes...)."""
    max_message_bytes: int = MAX_MESSAGE_BYTES  # a larger frame closes its connection (1009)
    max_envs_per_client: int = 4096  # one client must not hold the loop for everyone
    feedback_timeout: float = 60.0  # seconds of serving a client may owe feedback; then dropped
    api_key: str | None = None  # a client must send it at the handshake (None: anyone may)
    log_every: int = 1000  # frames between lines of metrics.jsonl
    learn_threads: int | None = None  # [learn-threads] torch threads per learn (None: idle cores)
    trace: int = 0  # [trace] frames to narrate


def metadata_of(policy: BaseTorchPolicy, obs_spec: dict, names: tuple[str, str]) -> dict:
    """The metadata message (SPEC 5.1): PlugRL's keys, then this server's own beside them: what
    the policy reads (obs_spec, as obs_spec_of writes it) and its number of choices."""
    return {"message_type": "metadata", "data": {
        "protocol_version": PROTOCOL_VERSION, "server": "plugrl_min", "algorithm": names[1],
        "policy": names[0], "action_horizon": policy.action_horizon,
        "action_dim": policy.action_dim, "features": [REUSE],
        "obs_spec": obs_spec_as_json(obs_spec), "num_actions": policy.num_actions}}


def action_message(env_ids: np.ndarray, action: np.ndarray) -> bytes:
    """The action message (SPEC 5.3) for these environments' rows, [n, H, action_dim] here:
    time-major on the wire, [H, n, action_dim]; a discrete action [H, n], as int64."""
    action = action[..., 0] if action.dtype == np.int64 else action
    return pack_message({"message_type": "action",
                         "data": {"env_ids": env_ids, "action": np.moveaxis(action, 0, 1)}})


MISSING = object()  # what message.get(field, MISSING) gives for a field left out
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def mismatch(field: str, expected: str, value) -> ProtocolError:
    """The error for a field that is not what the protocol reference says it must be, naming what
    it received: 'int64 [4, 1]', 'a list', 'null', 'nothing'."""
    got = (f"{value.dtype.name} {list(value.shape)}" if isinstance(value, np.ndarray) else
           "nothing (the field is missing)" if value is MISSING else
           "null" if value is None else f"a {type(value).__name__}")
    return ProtocolError(f"{field} must be {expected}; got {got}")


def is_array(value, kinds: str, shape: tuple) -> bool:
    """An array of these dtype kinds ('b' bool, 'iu' int, 'f' float, 'U' text) and this shape."""
    return isinstance(value, np.ndarray) and value.dtype.kind in kinds and value.shape == shape


def check_message(message: dict, obs_spec: dict) -> tuple[str, list]:
    """Check an infer or feedback message field by field (SPEC 5.2, 5.4): (message_type,
    env_indices as ints). Its data's observation becomes what the policy is given (check_obs)."""
    kind = message.get("message_type")
    if not (isinstance(kind, str) and kind in ("infer", "feedback")):  # not an array: == by element
        raise ProtocolError(f"message_type must be 'infer' or 'feedback'; got {str(kind)[:40]!r}")
    indices = message.get("env_indices", MISSING)
    if not (isinstance(indices, np.ndarray) and indices.dtype == np.int64 and indices.ndim == 1):
        raise mismatch(f"{kind}.env_indices", "int64 [n]", indices)
    env_ids = indices.tolist()
    n = len(env_ids)
    if len(set(env_ids)) != n or min(env_ids, default=0) < 0:
        raise ProtocolError(f"{kind}.env_indices must be distinct and non-negative; got "
                            f"{str(env_ids)[:60]}", "send each environment once per message")
    step_ids = message.get("step_ids", MISSING)  # checked as the SPEC asks; nothing reads it
    if not is_array(step_ids, "iu", (n,)):
        raise mismatch(f"{kind}.step_ids", f"int64 [{n}]", step_ids)
    data = message.get("data", MISSING)
    if kind == "infer":
        reuse = message.get("reuse")  # true: the row of this environment's last feedback
        if reuse is not None and not is_array(reuse, "b", (n,)):
            raise mismatch("infer.reuse", f"bool [{n}]", reuse)
        fresh = n if reuse is None else n - int(reuse.sum())  # the rows data holds
        message["data"] = check_obs(data, obs_spec, fresh, "infer.data")
        return kind, env_ids
    if not isinstance(data, dict):
        raise mismatch("feedback.data", "a map of obs, rewards, terminated, truncated, info", data)
    data["obs"] = check_obs(data.get("obs", MISSING), obs_spec, n, "feedback.data.obs")
    check_outcome(data, n)
    return kind, env_ids


def check_outcome(data: dict, n: int) -> None:
    """A feedback's rewards [m] (each decision's sum), flags and info: split per environment by
    SPEC 5.4's rule, each array [m, ...], a number or a str beside them given to every one."""
    for name, kinds, dtype in (("rewards", "f", "float"), ("terminated", "b", "bool"),
                               ("truncated", "b", "bool")):
        value = data.get(name, MISSING)
        if not is_array(value, kinds, (n,)):
            raise mismatch(f"feedback.data.{name}", f"{dtype} [m] with m = {n}", value)
    info = data.get("info", {})
    if not isinstance(info, dict):
        raise mismatch("feedback.data.info", "a map, {} for nothing", info)
    finite = {"feedback.data.rewards": data["rewards"]}  # the algorithm stores them as float32
    if "episode" in info:
        episode = info["episode"]
        if not isinstance(episode, dict):
            raise mismatch("feedback.data.info.episode", "a map of r, l, s and mask", episode)
        for key, kinds, dtype in (("r", "f", "float"), ("l", "iu", "int"),
                                  ("s", "b", "bool"), ("mask", "b", "bool")):
            value = episode.get(key, MISSING)
            if not is_array(value, kinds, (n,)):
                raise mismatch(f"feedback.data.info.episode.{key}", f"{dtype} [m] with m = {n}",
                               value)
        finite["feedback.data.info.episode.r"] = episode["r"]
    arrays = [(path, leaf) for path, leaf in _leaves(info, "feedback.data.info")
              if isinstance(leaf, np.ndarray)]
    if info and not arrays and n != 1:  # no array to split by: one entry, not m (SPEC 5.4's gap)
        raise mismatch("feedback.data.info", f"a map with an array [m, ...], m = {n}", info)
    for path, leaf in arrays:
        if leaf.shape[:1] != (n,):
            raise mismatch(path, f"an array [m, ...] with m = {n}", leaf)
    for field, array in finite.items():  # a float64 1e300 is infinity as a float32
        if not (np.abs(array) <= _FLOAT32_MAX).all():  # NaN compares false too
            raise ProtocolError(f"{field} holds NaN, infinity or a value beyond float32's range")


def check_obs(obs, obs_spec: dict, n: int, field: str) -> dict:
    """PlugRL's observation of n environments: each image and state the policy reads, of its
    shape and dtype (a float state of another width is cast to the policy's), and finite; text, a
    <U array or a list of n str. What the policy is given: those keys, and text as a <U array.
    Keys it does not read are left out, not refused: a client may send more than a policy reads."""
    if not (isinstance(obs, dict) and all(isinstance(obs.get(group), dict) for group in GROUPS)):
        raise mismatch(field, "a map of images, states and text", obs)
    given = {}
    for group, keys in obs_spec.items():
        given[group] = {}
        for key, (shape, dtype) in keys.items():
            array = obs[group].get(key, MISSING)
            if not (isinstance(array, np.ndarray) and array.shape == (n, *shape)
                    and takes(group, dtype, array.dtype)):
                raise mismatch(f"{field}.{group}.{key}", f"{dtype.name} {[n, *shape]}", array)
            given[group][key] = array = array.astype(dtype, copy=False)  # <f8 from PlugRL's clients
            if dtype.kind == "f" and not np.isfinite(array).all():
                raise ProtocolError(f"{field}.{group}.{key} holds NaN or infinity",
                                    "check the environment's observations")
    text = obs.get("text", MISSING)
    if isinstance(text, list) and all(isinstance(line, str) for line in text):
        text = np.array(text, dtype=str)  # the SPEC's other spelling (its section 3.4)
    if n == 0 and isinstance(text, np.ndarray) and text.shape == (0,):
        text = text.astype(str)  # no row, no str: numpy makes ["x"] * 0 a float64 [0]
    if not is_array(text, "U", (n,)):
        raise mismatch(f"{field}.text", f"str [{n}], a <U array or a list", text)
    return {**given, "text": text}


def takes(group: str, dtype: np.dtype, given: np.dtype) -> bool:
    """Whether a policy reading dtype takes given: a float state of any width (check_obs casts
    it: PlugRL's clients send float64), anything else exactly its own dtype."""
    return given == dtype or group == "states" and dtype.kind == given.kind == "f"


def _leaves(tree: dict, path: str = ""):
    """(dotted path, value) of every non-dict value of a nested dict."""
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{path}.{key}")
        else:
            yield f"{path}.{key}", value


def check_turn(conn: Connection, kind: str, env_ids: list, max_envs: int) -> list:
    """A connection's order (SPEC 4.2): infer, action, feedback, in turn, for each environment
    too. Its slots: made at an environment's first infer; for a feedback, None where the
    connection has none. Feedback rows with no step state (an earlier connection's action) are
    logged here, and accept stores the others."""
    if kind != conn.expects:
        raise ProtocolError(f"{kind} where {conn.expects} was due",
                            "send one feedback after every action, then infer")
    conn.expects = "feedback" if kind == "infer" else "infer"
    if kind == "feedback":
        slots = [conn.slots.get(i) for i in env_ids]
        lost = [i for i, slot in zip(env_ids, slots) if slot is None or slot.step is None]
        if lost:
            print(f"client {conn.number}: feedback for environments with no step state on this "
                  f"connection, {lost}: not stored", file=sys.stderr, flush=True)
        return slots
    check_env_cap(conn, env_ids, max_envs)  # one client must not hold the loop for everyone
    slots = [conn.slots.setdefault(i, EnvSlot()) for i in env_ids]
    for i, slot in zip(env_ids, slots):
        if slot.waiting or slot.step is not None:
            owes = "waits for its last action" if slot.waiting else "owes feedback"
            raise ProtocolError(f"infer: environment {i} {owes}",
                                "send feedback after every action, then infer")
    return slots


def check_env_cap(conn: Connection, env_ids: list, max_envs: int) -> None:
    """Refuse an infer that gives a connection more than --max-envs-per-client environments."""
    if len(conn.slots) + len(env_ids) > max_envs and len(
            conn.slots.keys() | set(env_ids)) > max_envs:  # counted only near the cap
        raise ProtocolError(f"infer: a connection may use at most {max_envs} "
                            "environments (the server's --max-envs-per-client)",
                            "step fewer environments per client, or start more clients")


def reused_obs(slots: list, env_ids: list, reuse: np.ndarray, data: dict) -> dict:
    """reuse-feedback-obs (SPEC 10.1): an infer's observation of its n environments, data's rows
    where reuse is false, and where it is true the row of that environment's last feedback on
    this connection; one it does not hold (none yet, or it ended an episode) is refused."""
    pieces, order, held = [data], [np.flatnonzero(~reuse)], {}
    for position in np.flatnonzero(reuse).tolist():
        if slots[position].fed is None:
            raise ProtocolError(f"infer.reuse: environment {env_ids[position]} has no "
                                "observation to reuse on this connection", "send reuse false "
                                "on a new connection, and after a feedback that ended an episode")
        batch, row = slots[position].fed
        rows, positions = held.setdefault(id(batch), (batch, [], []))[1:]
        rows.append(row)
        positions.append(position)
    for batch, rows, positions in held.values():  # most often one: the last feedback's
        pieces.append(slice_rows(batch, np.array(rows)))
        order.append(positions)
    return slice_rows(join_rows(pieces), np.argsort(np.concatenate(order)))


def close_one(server: Server, conn: Connection, why: str, reason: str):
    """Close one client's connection with 1001 and reason, why in the server's log; the server
    and its other clients carry on. It is served no more from now; returns the close to await."""
    server.connections.discard(conn)
    print(f"client {conn.number}: {why}: closed 1001 {reason}", file=sys.stderr, flush=True)
    return conn.ws.close(1001, reason)


async def resync(server: Server, conn: Connection, error: Exception) -> None:
    """Close a connection whose message was refused for a resync (SPEC 7.2): the client
    reconnects and starts again from an infer."""
    if not isinstance(error, ProtocolError):
        error = ProtocolError(f"malformed message ({type(error).__name__}: {error})")
    await close_one(server, conn, f"{error} (hint: {error.hint})", SERVER_RESYNC)


# --- How long a client may owe feedback: --feedback-timeout S ----------------------------------
# A client that dies without closing (a pulled cable, kill -STOP) must not hold its environments'
# step states forever; a ping every S seconds keeps an idle connection open.

FEEDBACK_TIMEOUT = "Feedback timeout"  # the reason of the close 1001 of such a client (SPEC 7.3)
_DROPPING = set()  # the drops in progress: asyncio keeps only weak references to tasks


def serving_clock(server: Server) -> float:
    """Seconds of serving: a clock that stands still while the server learns."""
    return time.monotonic() - server.learning_seconds


def drop_silent_clients(server: Server) -> None:
    """Drop a client whose environment owes feedback for an action sent --feedback-timeout s of
    serving ago (its other environments' feedback does not excuse it), saying so in the log."""
    due = serving_clock(server) - server.config.feedback_timeout  # an action sent before is overdue
    for conn in list(server.connections):
        if any(slot.step is not None and slot.step.batch.sent_at < due
               for slot in conn.slots.values()):
            why = f"no feedback for {server.config.feedback_timeout:g} s of serving"
            task = asyncio.create_task(close_one(server, conn, why, FEEDBACK_TIMEOUT))  # once
            _DROPPING.add(task)
            task.add_done_callback(_DROPPING.discard)


# --- Who may connect: --api-key (or $PLUGRL_API_KEY), checked at the handshake ----------------
# A server on a shared network is reachable by anyone who finds its port.

import hmac


def api_key_check(api_key: str | None):
    """websockets' process_request: refuse at the handshake a client without the run's API key,
    sent as PlugRL's clients send it (HTTP 401). None: every client is let in. PlugRL's own
    servers never check it (its SPEC 1.2): this server does more."""
    if api_key is None:
        return None
    expected = f"Api-Key {api_key}".encode()

    def check(connection, request):
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if hmac.compare_digest(given, expected):  # in constant time: no hint from the timing
            return None
        return connection.respond(401, "missing or wrong API key\n")
    return check


def warn_without_api_key(host: str, api_key: str | None) -> None:
    """A server reachable from other machines, with no API key, says so."""
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        print(f"warning: serving on {host} without --api-key: anyone who can reach it can "
              "connect", file=sys.stderr)


# ===== 14. Environment client: environments, executing a decision, connecting =====
# PlugRL page: the client of its smoke test (plugrl-run-env-client dummy-v1), its loop
# run_episodes; pendulum-v1, cartpole-v1, probe-v1 and gym:ENV_ID follow as blocks.

from websockets.asyncio.client import connect


class VecEnv:
    """num_envs environments stepped together in numpy; every built-in environment is one. A
    subclass sets obs_spec, action_dim (or num_actions) and max_steps, and writes _reset(rows),
    _step(action, rows) -> (reward, terminated, success) and _observe(); see register_env.
    Keyword arguments of make_env (env-kwargs) reach its constructor after num_envs and seed."""

    obs_spec = {"states": {"state": ((3,), "float32")}}  # what _observe() returns, and text
    action_dim = 1
    num_actions = None  # None: continuous actions in [-1, 1]; else int64 choices 0..num_actions-1
    max_steps = 10**9  # truncation after this many physical steps

    def __init__(self, num_envs: int, seed: int | None = None):
        self.num_envs, self.rng = num_envs, np.random.default_rng(seed)
        self.episode_return, self.episode_length = np.zeros(num_envs), np.zeros(num_envs, np.int64)
        self.terminated, self.truncated, self.success = np.zeros((3, num_envs), bool)

    def reset(self, indices=None) -> dict:
        """Start new episodes in the given environments (all by default); every observation."""
        rows = np.arange(self.num_envs) if indices is None else np.asarray(indices, np.int64)
        self._reset(rows)
        self.episode_return[rows], self.episode_length[rows] = 0, 0
        self.terminated[rows], self.truncated[rows], self.success[rows] = False, False, False
        return self._observe()

    def step(self, action, active=None) -> tuple:
        """One physical step of the active environments (the others stand still, reward 0)."""
        active = np.ones(self.num_envs, bool) if active is None else np.asarray(active, bool)
        rows = np.flatnonzero(active)
        reward = np.zeros(self.num_envs, np.float32)
        reward[rows], terminated, self.success[rows] = self._step(np.asarray(action)[rows], rows)
        self.episode_return[rows] += reward[rows]
        self.episode_length[rows] += 1
        self.terminated[rows] = terminated
        self.truncated[rows] = ~terminated & self._truncated(rows)
        # info["episode"]: return r, length l and success s of the episodes ending here (mask).
        done = active & (self.terminated | self.truncated)
        episode = {"r": np.where(done, self.episode_return, 0).astype(np.float32),
                   "l": np.where(done, self.episode_length, 0), "s": done & self.success,
                   "mask": done}
        return (self._observe(), reward, self.terminated.copy(), self.truncated.copy(),
                {"episode": episode})

    def _truncated(self, rows) -> np.ndarray:
        """Which of these rows just reached the time limit (a GymEnv: Gymnasium's own flag)."""
        return self.episode_length[rows] >= self.max_steps

    def close(self) -> None:
        """Release what the environments hold (a GymEnv: a window, the last episode's video)."""


@register_env("dummy-v1")
class DummyEnv(VecEnv):
    """dummy-v1: a point on [-1, 1] moves by 0.2 a toward a target. obs [x, target, target - x]."""

    max_steps = 50  # a success ends it sooner. Random actions score about -27.5, a good policy -1.5

    def __init__(self, num_envs, seed=None):
        self.x, self.target = np.zeros((2, num_envs))
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.x[rows], self.target[rows] = self.rng.uniform(-1, 1, (2, len(rows)))

    def _step(self, action, rows):
        self.x[rows] = np.clip(self.x[rows] + 0.2 * np.clip(action[:, 0], -1, 1), -1, 1)
        distance = np.abs(self.target[rows] - self.x[rows])
        return -distance, distance < 0.05, distance < 0.05  # reaching the target: a success

    def _observe(self):
        state = np.stack([self.x, self.target, self.target - self.x], axis=1)
        return observation(self.num_envs, states={"state": state.astype(np.float32)})


def action_space(action_dim: int, num_actions: int | None) -> str:
    """How messages name an action space: 'continuous, action_dim 1' or 'discrete, 2 actions'."""
    return (f"continuous, action_dim {action_dim}" if num_actions is None
            else f"discrete, {num_actions} actions")


def make_env(env_id: str, num_envs: int = 1, seed: int | None = None,
             kwargs: dict | None = None) -> VecEnv:
    """A registered environment by id, or gym:ENV_ID for a Gymnasium one; kwargs go to its
    constructor (gymnasium.make(ENV_ID, **kwargs) for gym:ENV_ID)."""
    kwargs = kwargs or {}
    if env_id.startswith("gym:"):  # [gym]
        return GymEnv(env_id[4:], num_envs, seed, kwargs)  # [gym]
    if env_id not in ENVIRONMENTS:
        raise UsageError(f"unknown environment {env_id!r}; registered: {known_envs()} (a "
                         "plug-in adds more with register_env and --plugin)")
    try:  # the keywords are checked, not the constructor's own TypeError: that one is a bug
        inspect.signature(ENVIRONMENTS[env_id]).bind(num_envs, seed, **kwargs)
    except TypeError as error:
        raise UsageError(f"environment {env_id!r} refused the keyword arguments {kwargs}: "
                         f"{error}") from None
    return ENVIRONMENTS[env_id](num_envs, seed, **kwargs)


def known_envs() -> str:
    """What env-client and --local-env accept, for their help and errors."""
    names = list(ENVIRONMENTS)
    names.append("gym:ENV_ID")  # [gym]
    return ", ".join(names)


# --- Executing a decision: one server action, one or more physical steps ---------------------

class Controller:
    """A low-level controller: at every physical step, (obs, decision, state) -> (action, state).
    A state is an array or a dict of arrays, one row per environment; only running rows go in."""

    decision_dim = 1

    def initial_state(self, n: int):
        """The state of n environments at the start of an episode."""
        return np.zeros((n, 0), np.float32)

    def __call__(self, obs: dict, decision: np.ndarray, state):
        """The physical action [k, action_dim] and the new state, for k running environments."""
        raise NotImplementedError


class TrackingController(Controller):
    """track: a PD law steering the position read by position_velocity(obs) to scale * decision."""

    def __init__(self, position_velocity, scale: float = 1.0, kp: float = 5.0, kd: float = 1.0):
        self.position_velocity, self.scale, self.kp, self.kd = position_velocity, scale, kp, kd

    def __call__(self, obs, decision, state):
        position, velocity = self.position_velocity(obs["states"]["state"])
        # The error wrapped to [-π, π): the pendulum's short way round (dummy-v1's never wraps).
        error = (self.scale * decision[:, 0] - position + np.pi) % (2 * np.pi) - np.pi
        return np.clip(self.kp * error - self.kd * velocity, -1, 1)[:, None], state


def make_controller(name: str, env: VecEnv) -> Controller:
    """A built-in controller: track (dummy-v1, pendulum-v1)."""
    if name == "track" and isinstance(env, DummyEnv):  # obs [x, target, gap]; no inertia
        return TrackingController(lambda obs: (obs[:, 0], 0.0))
    if name == "track" and isinstance(env, PendulumEnv):  # [pendulum]
        return TrackingController(pendulum_angle, np.pi)  # [pendulum]
    raise UsageError(f"unknown controller {name!r} for this environment; known: track (for "
                     "dummy-v1 or pendulum-v1)")


REWARD_AGGREGATIONS = ("sum", "mean", "last", "stack")


def _check_steps(steps, name: str) -> None:
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"{name} must be an integer of at least 1, got {steps!r}")


class MultiAction:
    """Open loop: an action chunk [n, H, action_dim] executed step by step, up to replan_steps.
    stack_observations: the frame's observation is every step's, [n, k, ...], not the last."""

    def __init__(self, env: VecEnv, replan_steps: int | None = None, reward_aggregation="sum",
                 stack_observations: bool = False):
        _check_steps(1 if replan_steps is None else replan_steps, "replan_steps")
        if reward_aggregation not in REWARD_AGGREGATIONS:
            raise ValueError(f"reward_aggregation must be one of {', '.join(REWARD_AGGREGATIONS)}, "
                             f"got {reward_aggregation!r}")
        self.env, self.replan_steps, self.reward_aggregation = env, replan_steps, reward_aggregation
        self.stack_observations = stack_observations
        self.obs = None  # what the next decision is made for

    def reset(self, indices=None) -> dict:
        """Start new episodes in all or some environments; every observation."""
        self.obs = self.env.reset(indices)
        return self.obs

    def reset_finished(self, terminated: np.ndarray, truncated: np.ndarray) -> np.ndarray:
        """New episodes where the last decision ended one, for the next: its done mask [n]."""
        done = terminated | truncated
        if done.any():
            self.reset(np.flatnonzero(done))
        return done

    def step(self, action) -> tuple:
        """Execute one chunk: (obs, reward, terminated, truncated, info) of the whole decision."""
        chunk = np.asarray(action)
        n, dim = self.env.num_envs, self.env.action_dim
        if chunk.ndim != 3 or chunk.shape[0] != n or chunk.shape[1] < 1 or chunk.shape[2] != dim:
            raise ValueError(f"action chunk must be [{n}, H >= 1, {dim}], got {list(chunk.shape)}")
        steps = min(chunk.shape[1], self.replan_steps or chunk.shape[1])
        return self.execute_decision(steps, lambda t, obs, active: chunk[:, t])

    def execute_decision(self, steps: int, physical_action) -> tuple:
        """The inner loop of both executors: up to `steps` physical steps of one decision.
        physical_action(t, obs, active) gives the action [n, ...] of step t. An environment that
        ends stops for the rest of the decision: its observation and flags stay its last step's."""
        n = self.env.num_envs
        active, executed = np.ones(n, bool), np.zeros(n, np.int64)
        rewards = np.zeros((n, steps), np.float32)  # a stopped environment earns 0
        seen = []  # the observation after every physical step
        episode = None
        for t in range(steps):
            action = physical_action(t, self.obs, active)
            self.obs, rewards[:, t], terminated, truncated, info = self.env.step(action, active)
            executed += active
            ended = info["episode"]  # an environment ends once at most: keep that step's info
            episode = ended if episode is None else {
                key: np.where(ended["mask"], value, episode[key]) for key, value in ended.items()}
            active &= ~(terminated | truncated)
            seen.append(self.obs)
            if not active.any():
                break
        # stack keeps `steps` columns while an environment still runs, and one trailing zero when
        # every environment stopped early (MultiAction's ragged convention).
        width = min(steps, executed.max() + 1)
        by_mode = {"sum": rewards.sum(1), "mean": rewards.sum(1) / executed,  # over executed steps
                   "last": rewards[np.arange(n), executed - 1], "stack": rewards[:, :width]}
        reward = by_mode[self.reward_aggregation]
        obs = self.obs  # the newest observation stays where the next decision starts
        if self.stack_observations:  # as many observations as stacked rewards, the last repeated
            seen += [seen[-1]] * (width - len(seen))
            obs = join_rows(seen, functools.partial(np.stack, axis=1))
        return obs, reward, terminated, truncated, {"episode": episode, "executed_steps": executed}


class ClosedLoopMultiAction(MultiAction):
    """Closed loop: a decision held for `steps` steps, acted out by a controller on fresh obs."""

    def __init__(self, env: VecEnv, controller: Controller, steps: int,
                 reward_aggregation: str = "sum", stack_observations: bool = False):
        _check_steps(steps, "steps")
        super().__init__(env, reward_aggregation=reward_aggregation,
                         stack_observations=stack_observations)
        self.controller, self.steps = controller, int(steps)
        self.state = controller.initial_state(env.num_envs)

    def reset(self, indices=None) -> dict:
        """Reset all or some environments, and their controller state; every observation."""
        rows = slice(None) if indices is None else np.asarray(indices, np.int64)
        fresh = self.controller.initial_state(self.env.num_envs)
        put_rows(self.state, rows, slice_rows(fresh, rows))
        return super().reset(indices)

    def step(self, decision) -> tuple:
        """Execute one decision: (obs, reward, terminated, truncated, info) of all its steps."""
        decision = np.asarray(decision, np.float32)
        expected = (self.env.num_envs, self.controller.decision_dim)
        if decision.shape != expected:
            raise ValueError(f"decision must be {list(expected)}, got {list(decision.shape)}")

        def physical_action(t, obs, active):
            # Only running rows go in: a finished environment's controller neither acts nor moves.
            rows = np.flatnonzero(active)
            action, state = self.controller(slice_rows(obs, rows), decision[rows],
                                            slice_rows(self.state, rows))
            put_rows(self.state, rows, state)
            full = np.zeros_like(action, shape=(self.env.num_envs, *np.shape(action)[1:]))
            full[rows] = action
            return full

        return self.execute_decision(self.steps, physical_action)


def finished_returns(info: dict) -> list[float]:
    """The returns of the episodes a decision ended: info["episode"]'s r where its mask is set."""
    episode = info["episode"]
    return episode["r"][episode["mask"]].tolist()


def check_metadata(meta: dict, executor, closed_loop: bool) -> None:
    """Stop with a clear message when the server's policy cannot act in this environment. What
    the metadata's data leaves out is not checked: a PlugRL server need not say it (SPEC 5.1)."""
    data = meta.get("data") if meta.get("message_type") == "metadata" else None
    if not isinstance(data, dict) or data.get("protocol_version", 1) != PROTOCOL_VERSION:
        version = data.get("protocol_version") if isinstance(data, dict) else None
        raise CommandError(f"the server speaks protocol {version}, this client {PROTOCOL_VERSION}")
    if executor.stack_observations:  # a feedback observation is [m, ...], not [m, k, ...]
        raise CommandError("stack_observations gives a frame every physical step's observation, "
                           "which a feedback message does not carry: leave it out over the wire")
    if executor.reward_aggregation != "sum":  # a feedback's rewards are each decision's sum
        raise CommandError(f"--reward-aggregation {executor.reward_aggregation} is not what a "
                           "feedback's rewards mean over the wire (each decision's sum): leave it "
                           "at sum (MultiAction keeps the others for a loop of your own)")
    decision_dim = executor.controller.decision_dim if closed_loop else None
    problem = misfit(data, executor.env, decision_dim)
    if problem is not None:
        raise CommandError(f"the server's policy does not fit this environment: {problem}")


def misfit(meta: dict, env, decision_dim: int | None = None) -> str | None:
    """Why the policy of a server's metadata data cannot act in env (a VecEnv, or its class),
    with the flag that would fix it; None if it can, or if the metadata does not say.
    decision_dim: a closed loop's, in place of env's."""
    try:
        reads, gives = obs_spec_of(meta.get("obs_spec", {})), obs_spec_of(env.obs_spec)
    except UsageError as error:  # an environment of the flat form fits no policy
        return str(error)
    for group, key in ((group, key) for group in GROUPS for key in sorted(reads[group])):
        (shape, dtype), given = reads[group][key], gives[group].get(key)
        if given is None or given[0] != shape or not takes(group, dtype, given[1]):
            gave = "nothing" if given is None else f"{given[1].name} {list(given[0])}"
            fits = json.dumps(obs_spec_as_json(env.obs_spec))
            return (f"observation {group}.{key}: the policy reads {dtype.name} {list(shape)}, this "
                    f"environment gives {gave} (serve with --local-env to size the policy from "
                    f"it, or --policy.obs-spec '{fits}')")
    if "action_dim" not in meta:
        return None
    theirs = action_space(meta["action_dim"], meta.get("num_actions"))
    needed = (action_space(decision_dim, None) if decision_dim
              else action_space(env.action_dim, env.num_actions))
    continuous = decision_dim is not None or env.num_actions is None  # what this client needs
    if (meta.get("num_actions") is None) != continuous:
        policy = "dummy-policy" if continuous else "categorical-policy"
        return f"the policy's actions are {theirs}, this client needs {needed} (serve {policy})"
    if theirs != needed:
        flag = (f"--policy.num-actions {env.num_actions}" if meta.get("num_actions")
                else f"--policy.action-dim {decision_dim or env.action_dim}")
        return f"the policy's actions are {theirs}, this client needs {needed} (serve with {flag})"
    if decision_dim and meta.get("action_horizon", 1) != 1:
        return f"a closed loop takes one decision, the policy sends {meta['action_horizon']}"
    return None


async def run_episodes(ws, executor, num_episodes: int, tally: dict, reuse_obs=True) -> None:
    """The client's loop: infer, execute the decision, reset what finished, send feedback."""
    closed_loop = isinstance(executor, ClosedLoopMultiAction)
    meta = unpack_message(await ws.recv())
    check_metadata(meta, executor, closed_loop)
    reuse_obs = reuse_obs and REUSE in meta["data"].get("features", [])
    env_indices = np.arange(executor.env.num_envs, dtype=np.int64)
    step_ids = np.zeros_like(env_indices)  # each episode's decisions so far; the server reads none
    infer = {"message_type": "infer", "env_indices": env_indices}
    await ws.send(pack_message({**infer, "data": executor.obs, "step_ids": step_ids}))
    while True:
        reply = unpack_message(await ws.recv())
        # Time-major on the wire, [H, n, ...]; the executor takes [n, H, action_dim].
        action = np.moveaxis(reply["data"]["action"], 0, 1)
        if executor.env.num_actions is not None:
            action = action[..., None]  # a discrete action is [H, n] on the wire
        if closed_loop:
            action = action[:, 0]  # one decision [n, decision_dim]
        obs, reward, terminated, truncated, info = executor.step(action)
        tally["returns"] += finished_returns(info)
        tally["env_steps"] += int(info["executed_steps"].sum())  # the client's count, not sent
        tally["decisions"] += len(env_indices)
        feedback = {"message_type": "feedback", "env_indices": env_indices, "step_ids": step_ids,
                    "data": {"obs": obs, "rewards": reward, "terminated": terminated,
                             "truncated": truncated, "info": episode_info(info)}}
        frame = pack_message(feedback)  # its bytes: the observations the episodes ended on
        # Reset what finished before the send: the next infer starts the new episodes, and a
        # connection lost in the send leaves no finished environment to be stepped again.
        done = executor.reset_finished(terminated, truncated)
        step_ids = np.where(done, 0, step_ids + 1)
        if num_episodes and len(tally["returns"]) >= num_episodes:  # 0: until the run ends
            await ws.send(frame)
            return
        # The next infer is packed first, so that the two frames leave back to back and the
        # server reads them at once: one pass of its loop for both, not one each.
        next_infer = {**infer, "data": executor.obs, "step_ids": step_ids}
        if reuse_obs:  # the server holds what the feedback carries: send only the new episodes'
            next_infer.update(data=slice_rows(executor.obs, done), reuse=~done)
        next_infer = pack_message(next_infer)
        await ws.send(frame)
        await ws.send(next_infer)


async def connect_to_server(args):
    """Connect, retrying for --connect-timeout s; None if the run has ended."""
    uri = f"ws://{args.server_host}:{args.server_port}"
    headers = {"Authorization": f"Api-Key {args.api_key}"} if args.api_key else {}  # SPEC 1.2
    deadline = time.monotonic() + args.connect_timeout
    while True:
        try:
            # PlugRL's options (SPEC 1.1, 7.6): no frame cap and no keepalive ping, which would
            # close a healthy connection while its server learns on its loop for over 20 s.
            return await connect(uri, additional_headers=headers, max_size=None,
                                 compression=None, ping_interval=None, proxy=None)
        except websockets.InvalidStatus as error:
            status = error.response.status_code
            if status == 503:  # the server is closing: its run has ended
                return None
            raise CommandError(f"the server refused the connection (HTTP {status}): wrong or "
                               "missing --api-key?") from None
        except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake) as error:
            if time.monotonic() > deadline:
                raise CommandError(f"no server at {uri} after {args.connect_timeout:g} s "
                                   f"({error})") from None
            await asyncio.sleep(0.1)


async def run_env_client(args) -> int:
    """The env client: connect (and reconnect), run episodes, print and write the summary."""
    env = make_env(args.env_id, args.num_envs, args.seed, args.env_kwargs)
    if args.closed_loop_steps is None:
        executor = MultiAction(env, reward_aggregation=args.reward_aggregation)
    else:
        executor = ClosedLoopMultiAction(env, make_controller(args.controller, env),
                                         args.closed_loop_steps, args.reward_aggregation)
    executor.reset()
    tally = {"returns": [], "env_steps": 0, "decisions": 0}  # kept across reconnections
    start, ending, resyncs = None, None, 0
    while ending is None:
        ws = await connect_to_server(args)
        start = start or time.perf_counter()  # the wait for the first server is not counted
        if ws is None:
            ending = "the server ended the run"
            continue
        decisions = tally["decisions"]
        try:
            async with ws:  # closed 1000 when done, as a client that stops should (SPEC 7.5)
                await run_episodes(ws, executor, args.num_episodes, tally,
                                   not args.no_reuse_feedback_obs)
            ending = "done"
        except ProtocolError as error:  # a text frame (SPEC 7.4: fatal, never parsed), or worse
            raise CommandError(f"the server failed: it sent what is not a message ({error}); "
                               "its output or log says why") from None
        except ConnectionClosed as closed:
            # Resyncs in a row, each after one action or none: the server refuses what we send.
            resync = closed.rcvd is not None and closed.rcvd.reason == SERVER_RESYNC
            at_once = tally["decisions"] - decisions <= env.num_envs
            resyncs = (resyncs if at_once else 0) + resync
            ending = after_close(closed, resyncs)
    seconds = time.perf_counter() - start
    returns = tally["returns"]
    mean_return = float(np.mean(returns)) if returns else float("nan")
    print(f"{ending} | episodes {len(returns)} | mean return {mean_return:.2f} | "
          f"env steps {tally['env_steps']} | decisions {tally['decisions']} | {seconds:.1f} s | "
          f"{tally['env_steps'] / max(seconds, 1e-9):.0f} env steps/s", flush=True)
    if args.summary_json:
        with open(args.summary_json, "w") as file:
            json.dump({"episodes": len(returns), "mean_return": mean_return, "seconds": seconds,
                       **tally}, file)
    return 0


def after_close(closed: ConnectionClosed, resyncs: int) -> str | None:
    """What a close from the server means to the env client: the run's end (the line it ends its
    output with), a failure (CommandError), or None: reconnect, the decision in flight dropped."""
    reason = closed.rcvd.reason if closed.rcvd else ""
    if closed.rcvd and closed.rcvd.code == 1011:  # its traceback is in its output
        raise CommandError(f"the server failed (1011 {reason}): its traceback is in its output, "
                           "or its log")
    if closed.rcvd and closed.rcvd.code == 1009:  # resending the same message cannot help
        raise CommandError(f"the server refused a message as too large ({reason}): raise the "
                           "server's --max-message-bytes, or step fewer --num-envs per client")
    if reason == SERVER_RESYNC and resyncs >= 3:  # a bug here: reconnecting cannot mend it
        raise CommandError(f"the server refused this client's messages {resyncs} times in a "
                           f"row (1001 {SERVER_RESYNC}): its output or log says why")
    if reason == SERVER_STOP:
        return "the server ended the run"
    if closed.rcvd and closed.rcvd.code == 1000:  # a normal closure: done with us
        return "the server closed the connection"
    if reason == SERVER_RESYNC:  # the feedback it held is dropped, and it starts with an infer
        print("the server asked for a resync (its output says why); reconnecting", file=sys.stderr)
    else:  # a restart, a network blink, the feedback timeout
        print(f"lost the server ({closed}); reconnecting", file=sys.stderr)
    return None


# ===== [pendulum] pendulum-v1: Gymnasium's Pendulum-v1, in numpy =====
# plugrl_min's own: a continuous task sac_example.py learns (its example_env) without gymnasium.

def pendulum_angle(obs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """track's reading of pendulum-v1's observation [cos θ, sin θ, θ']: θ and θ'."""
    return np.arctan2(obs[:, 1], obs[:, 0]), obs[:, 2]


def upright_angle(theta: np.ndarray) -> np.ndarray:
    """θ as the angle from upright, wrapped to [-π, π)."""
    return (theta + np.pi) % (2 * np.pi) - np.pi


@register_env("pendulum-v1")
class PendulumEnv(VecEnv):
    """pendulum-v1: Gymnasium's Pendulum-v1 in numpy. obs [cos θ, sin θ, θ'], torque = 2 * a."""

    max_steps = 200

    def __init__(self, num_envs, seed=None):
        self.theta, self.theta_dot = np.zeros((2, num_envs))
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.theta[rows] = self.rng.uniform(-np.pi, np.pi, len(rows))
        self.theta_dot[rows] = self.rng.uniform(-1, 1, len(rows))

    def _step(self, action, rows):
        g, m, length, dt = 10.0, 1.0, 1.0, 0.05
        u = 2.0 * np.clip(action[:, 0], -1, 1)
        theta, theta_dot = self.theta[rows], self.theta_dot[rows]
        # Gymnasium's cost is of the state the step starts from, θ from upright in [-π, π).
        cost = upright_angle(theta)**2 + 0.1 * theta_dot**2 + 0.001 * u**2
        theta_acc = 3 * g / (2 * length) * np.sin(theta) + 3.0 / (m * length**2) * u
        theta_dot = np.clip(theta_dot + theta_acc * dt, -8, 8)
        self.theta[rows] = theta + theta_dot * dt  # the new velocity moves θ (semi-implicit)
        self.theta_dot[rows] = theta_dot
        # A success is judged where the step ends: upright at the end of the episode.
        return -cost, np.zeros(len(rows), bool), np.abs(upright_angle(self.theta[rows])) < 0.1

    def _observe(self):
        state = np.stack([np.cos(self.theta), np.sin(self.theta), self.theta_dot], axis=1)
        return observation(self.num_envs, states={"state": state.astype(np.float32)})


# ===== [cartpole] cartpole-v1: Gymnasium's CartPole-v1 in numpy, and the policy's variant =====
# plugrl_min's own: a discrete task for pg and categorical-policy without gymnasium.

@register_policy_config("categorical-policy", "cartpole")
@dataclasses.dataclass
class CartPolePolicyConfig(CategoricalPolicyConfig):
    """The defaults (4 observations, 2 actions), named for the command line: `... cartpole`."""


@register_env("cartpole-v1")
class CartPoleEnv(VecEnv):
    """cartpole-v1: Gymnasium's CartPole-v1 in numpy. obs [x, x', θ, θ']; action 0 pushes left."""

    obs_spec, num_actions = {"states": {"state": ((4,), "float32")}}, 2
    max_steps = 500  # lasting this long is a success; random actions last about 22 steps

    def __init__(self, num_envs, seed=None):
        self.state = np.zeros((num_envs, 4))  # float64, as Gymnasium keeps it
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.state[rows] = self.rng.uniform(-0.05, 0.05, (len(rows), 4))

    def _step(self, action, rows):
        gravity, cart_mass, pole_mass, half_length, tau = 9.8, 1.0, 0.1, 0.5, 0.02
        total_mass = cart_mass + pole_mass
        x, x_dot, theta, theta_dot = self.state[rows].T
        force = np.where(action[:, 0] == 1, 10.0, -10.0)
        cos, sin = np.cos(theta), np.sin(theta)
        # Gymnasium's equations in its order of operations, so the floats agree bit for bit.
        temp = (force + pole_mass * half_length * theta_dot**2 * sin) / total_mass
        theta_acc = (gravity * sin - cos * temp) / (
            half_length * (4.0 / 3.0 - pole_mass * cos**2 / total_mass))
        x_acc = temp - pole_mass * half_length * theta_acc * cos / total_mass
        # Explicit Euler: positions move with the old velocities.
        x, theta = x + tau * x_dot, theta + tau * theta_dot
        x_dot, theta_dot = x_dot + tau * x_acc, theta_dot + tau * theta_acc
        self.state[rows] = np.stack([x, x_dot, theta, theta_dot], axis=1)
        fallen = (np.abs(x) > 2.4) | (np.abs(theta) > 12 * 2 * math.pi / 360)  # 12 degrees
        return np.ones(len(rows)), fallen, ~fallen

    def _observe(self):
        return observation(self.num_envs, states={"state": self.state.astype(np.float32)})


# ===== [probe] probe-v1: PlugRL's probe environment, which its client checker reads =====
# PlugRL's SPEC 8.1: what the client did with each action shows in the next observation.

@register_env("probe-v1")
class ProbeEnv(VecEnv):
    """probe-v1: env i counts its steps in states["t"] (float64 [1]), keeps the action it applied
    last in states["a"] (float64 [action_dim], an env kwarg), earns 1 a step, and terminates when
    t reaches 3 + 2 (i mod 3). It never truncates, and only the client resets it."""

    obs_spec = {"states": {"t": ((1,), "float64"), "a": ((1,), "float64")}}

    def __init__(self, num_envs, seed=None, action_dim=1):
        self.action_dim = action_dim
        self.obs_spec = {"states": {"t": ((1,), "float64"), "a": ((action_dim,), "float64")}}
        self.t, self.a = np.zeros((num_envs, 1)), np.zeros((num_envs, action_dim))
        self.length = 3 + 2 * (np.arange(num_envs) % 3)
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.t[rows] = 0

    def _step(self, action, rows):
        self.t[rows] += 1
        self.a[rows] = action  # as it came: the checker's values say their place in the chunk
        ended = self.t[rows, 0] >= self.length[rows]
        return np.ones(len(rows)), ended, np.zeros(len(rows), bool)

    def _observe(self):
        return observation(self.num_envs, states={"t": self.t.copy(), "a": self.a.copy()})


# ===== [gym] gym:ENV_ID: a Gymnasium environment with Box or Discrete actions =====
# plugrl_min's own: gymnasium is optional, imported when a gym:ENV_ID environment is made.

class GymEnv(VecEnv):
    """gym:ENV_ID: num_envs environments as gymnasium.make(ENV_ID, **kwargs) makes them, with
    their wrappers and time limit, stepped one after the other. Discrete or Box actions (scaled
    from [-1, 1]); observations as gym_observation_keys maps them."""

    def __init__(self, env_id, num_envs, seed=None, kwargs=None):
        try:
            import gymnasium
        except ImportError:
            raise CommandError(f"gym:{env_id} needs gymnasium: pip install gymnasium") from None
        # The made environment, not env.unwrapped: its wrappers (a reward scale, a time limit)
        # are part of the task its entry point registered.
        try:
            self.envs = [gymnasium.make(env_id, **(kwargs or {})) for _ in range(num_envs)]
        except gymnasium.error.Error as error:  # an unknown id, a missing extra: one line
            elsewhere = isinstance(error, gymnasium.error.UnregisteredEnv) and ":" not in env_id
            raise UsageError(f"gym:{env_id}: {error}" + elsewhere * (
                " (registered by the starting script? a client process runs no script: register "
                f"it in a module and name that, gym:MODULE:{env_id})")) from None
        except TypeError as error:  # most likely a keyword the environment does not take
            if not kwargs:
                raise
            raise UsageError(f"gym:{env_id} refused the keyword arguments {kwargs}: "
                             f"{error}") from None
        space = self.envs[0].action_space
        if isinstance(space, gymnasium.spaces.Discrete):
            self.num_actions, self.first_action = int(space.n), int(space.start)
        elif isinstance(space, gymnasium.spaces.Box):
            if not (np.isfinite(space.low).all() and np.isfinite(space.high).all()):
                raise UsageError(f"gym:{env_id} has an unbounded Box action space {space}: [-1, 1] "
                                 "is scaled to its bounds; wrap it in one with finite bounds")
            self.action_dim, self.low, self.high = int(np.prod(space.shape)), space.low, space.high
        else:
            raise UsageError(f"gym:{env_id} has a {type(space).__name__} action space; "
                             "plugrl_min runs Box and Discrete ones")
        self.keys = gym_observation_keys(env_id, self.envs[0].observation_space)
        # A Discrete becomes a one-hot float32 [n]: a network reads n numbers, not one index.
        self.one_hot = {key: int(leaf.start) for key, (_, leaf, _) in self.keys.items()
                        if isinstance(leaf, gymnasium.spaces.Discrete)}  # key -> its first value
        self.chw = {key for key, (_, leaf, group) in self.keys.items()
                    if group == "images" and image_layout(leaf.shape) == "CHW"}
        self.obs_spec = {"images": {}, "states": {}}
        for key, (_, leaf, group) in self.keys.items():
            if group == "images":  # [h, w, c], a channel-first Box's too (_store moves its axes)
                h, w, c = leaf.shape[1:] + leaf.shape[:1] if key in self.chw else leaf.shape
                self.obs_spec[group][key] = ((h, w, c), "uint8")
            elif group == "states":  # a Box's own dtype (float64 too)
                self.obs_spec[group][key] = (((int(leaf.n),), "float32") if key in self.one_hot
                                             else (tuple(leaf.shape), leaf.dtype.name))
        self.last = zeros_of(self.obs_spec, num_envs)  # each one's last observation
        self.text = [""] * num_envs  # its last text, from a Text entry
        self.gym_truncated = np.zeros(num_envs, bool)  # what step() said; _truncated reads it
        self.max_steps = self.envs[0].spec.max_episode_steps or 10**9  # Gymnasium's flag truncates
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        from gymnasium.error import DependencyNotInstalled
        for i in rows:  # seeded from self.rng, so --seed makes episodes repeat
            try:  # a first frame is drawn here (render_mode, eval --video): pygame may lack
                obs, _ = self.envs[i].reset(seed=int(self.rng.integers(2**31)))
            except DependencyNotInstalled as error:  # Gymnasium's one line says what to install
                raise CommandError(f"{self.envs[i].spec.id}: {error}") from None
            self._store(i, obs)

    def _step(self, action, rows):
        reward = np.zeros(len(rows))
        terminated, success = np.zeros((2, len(rows)), bool)
        for j, i in enumerate(rows):
            if self.num_actions is None:
                unit = np.clip(action[j], -1, 1).reshape(self.low.shape)  # a Box of any shape
                act = self.low + (unit + 1) / 2 * (self.high - self.low)
            else:
                act = int(action[j, 0]) + self.first_action
            obs, reward[j], terminated[j], self.gym_truncated[i], info = self.envs[i].step(act)
            self._store(i, obs)
            success[j] = info.get("is_success", False)
        return reward, terminated, success

    def _truncated(self, rows):
        return self.gym_truncated[rows]

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def _store(self, i, obs) -> None:
        for key, (path, _, group) in self.keys.items():
            value = obs
            for name in path:  # into a Dict, and into a Dict in it
                value = value[name]
            if group == "text":
                self.text[i] = value
            elif key in self.one_hot:
                self.last[group][key][i] = 0
                self.last[group][key][i, int(value) - self.one_hot[key]] = 1
            else:  # a channel-first camera as [h, w, c]
                self.last[group][key][i] = np.moveaxis(value, 0, -1) if key in self.chw else value

    def _observe(self):
        copied = map_arrays(np.copy, self.last)
        return observation(self.num_envs, copied["states"], copied["images"], list(self.text))


def record_video(env: VecEnv, folder: str) -> None:
    """eval --video: each Gymnasium environment of env records its episodes into folder."""
    if not isinstance(env, GymEnv):
        raise UsageError(f"--video records a gym:ENV_ID environment, which draws its own frames; "
                         f"{type(env).__name__} draws none")
    import gymnasium
    try:
        env.envs = [gymnasium.wrappers.RecordVideo(one, folder, episode_trigger=lambda _: True,
                                                   name_prefix=f"env{i}", disable_logger=True)
                    for i, one in enumerate(env.envs)]
    except gymnasium.error.DependencyNotInstalled:
        raise CommandError("--video needs moviepy, which writes the files: pip install moviepy")


def gym_entry_module(env_id: str) -> str:
    """Where gym:ENV_ID is registered: MODULE of gym:MODULE:ID (a client imports it first), else
    the module of its entry point: '__main__' for a class of the starting script."""
    import gymnasium
    module, _, name = env_id.rpartition(":")
    if module:  # gymnasium.spec takes the ID alone; gymnasium.make imports MODULE itself
        return module
    entry_point = gymnasium.spec(name).entry_point
    if isinstance(entry_point, str):  # "module:Class"
        return entry_point.split(":")[0]
    return getattr(entry_point, "__module__", "")


def image_layout(shape: tuple) -> str:
    """How a uint8 Box of 3 axes holds a picture: "CHW" or "HWC". The channels are the smaller
    of its first and last sizes ([3, 64, 64] is channel-first; a tie, [h, w, c])."""
    return "CHW" if shape[0] < shape[2] else "HWC"


def gym_observation_keys(env_id: str, space) -> dict:
    """key -> (path into a Gymnasium observation, its space, its group): a uint8 Box of 3 axes is
    a camera ("images"), any other Box and a Discrete a state ("states"), a Text the "text". A
    lone space is the key "image", "state" or "text"; a Dict gives one key per entry, a Dict in it
    "outer.inner". Anything else, or a second Text, is refused in one line."""
    from gymnasium import spaces
    if not isinstance(space, spaces.Dict):
        keys = {"image" if _group_of(space) == "images" else "state": ((), space)}
    else:
        keys = {}
        for name, entry in space.spaces.items():
            inner = entry.spaces.items() if isinstance(entry, spaces.Dict) else [(None, entry)]
            for inner_name, leaf in inner:
                path = (name,) if inner_name is None else (name, inner_name)
                keys[".".join(path)] = (path, leaf)
    for key, (path, leaf) in keys.items():
        if not isinstance(leaf, (spaces.Box, spaces.Discrete, spaces.Text)):
            where = f" (its entry {key!r})" if path else ""
            raise UsageError(f"gym:{env_id} has a {type(leaf).__name__} observation space{where}; "
                             "plugrl_min maps Box, Discrete, Text and Dict (nested one level) "
                             "ones: write a VecEnv that gives it as arrays and register_env it")
    if [_group_of(leaf) for _, leaf in keys.values()].count("text") > 1:
        raise UsageError(f"gym:{env_id} has two Text entries; an observation has one text")
    return {key: (path, leaf, _group_of(leaf)) for key, (path, leaf) in keys.items()}


def _group_of(leaf) -> str:
    from gymnasium import spaces
    if isinstance(leaf, spaces.Text):
        return "text"
    camera = isinstance(leaf, spaces.Box) and leaf.dtype == np.uint8 and len(leaf.shape) == 3
    return "images" if camera else "states"


# ===== [eval] `python plugrl_min.py eval RUN_DIR`: a trained policy, evaluated and watched =====
# plugrl_min's own, after PlugRL's eval algorithm: the run's policy acts, nothing learns, and
# nothing is written into the run. Cut: a trained run can only be resumed, which learns again.

def act(policy: BaseTorchPolicy, obs: dict, greedy: bool) -> np.ndarray:
    """The policy's actions for a batch: sampled, or its most likely: get_greedy_action(obs), a
    policy's optional method (the built-in ones have it), shaped as its sampled action."""
    return policy.get_greedy_action(obs) if greedy else policy.get_action_and_runtime_state(obs)[0]


def evaluate(policy: BaseTorchPolicy, env: VecEnv, episodes: int, greedy: bool) -> list[float]:
    """The returns of the first `episodes` episodes the policy plays in env; no hook runs."""
    executor = MultiAction(env)
    executor.reset()
    returns = []
    while len(returns) < episodes:
        _, _, terminated, truncated, info = executor.step(act(policy, executor.obs, greedy))
        returns += finished_returns(info)
        if len(returns) < episodes:  # no episode begun that is not played
            executor.reset_finished(terminated, truncated)
    return returns[:episodes]


def evaluation(returns: list[float]) -> str:
    """eval's one line: episodes, the mean return, its spread (standard deviation), min, max."""
    if not returns:
        return "0 episodes"
    return (f"{len(returns)} episodes | mean return {np.mean(returns):.2f} | std "
            f"{np.std(returns):.2f} | min {min(returns):.2f} | max {max(returns):.2f}")


@dataclasses.dataclass
class EvalConfig(BaseAlgoConfig):
    """eval --serve: the episodes to serve, and how to act."""
    global_steps: int | None = None  # the episodes end it, not the steps
    episodes: int = 10  # finished episodes, then the run ends (0: until stopped)
    greedy: bool = True  # the most likely action; false: sampled as in training


class EvalAlgorithm(BaseAlgorithm):
    """A trained policy behind a server, for env clients of any simulator: it acts, counts every
    finished episode, and never learns. Its run directory is its own, not the trained run's."""

    on_policy = False  # every frame is fed, so every episode is counted

    def infer(self, obs: dict) -> tuple[np.ndarray, None]:
        return act(self.policy, obs, self.config.greedy), None

    def feedback(self, *, obs, runtime_state, train_state=None, terminated, truncated, next_obs,
                 reward, info, next_terminated, next_truncated, prev_node):
        self.record_finished_episode(info, next_terminated, next_truncated)
        self.global_step += 1
        return prev_node, self.global_step, {}

    def learn_impl(self) -> tuple[int, dict]:
        return self.global_step, {}  # never called: should_learn() stays false

    def should_stop(self) -> bool:
        return 0 < self.config.episodes <= len(self._episodes)


def trained_policy(run_dir: str, checkpoint: str | None) -> tuple[BaseTorchPolicy, dict, int]:
    """The run's policy, rebuilt from its config.json, with the weights of its newest loadable
    checkpoint (or `checkpoint`'s): (the policy, the run's config, the checkpoint's step)."""
    with naming(f"cannot read {os.path.join(run_dir, CONFIG)} (is it a run directory?)"):
        with open(os.path.join(run_dir, CONFIG)) as file:
            resolved = json.load(file)
    uid = resolved["policy"]
    config = _config("policy", _POLICY_CONFIGS, _POLICIES, uid, resolved["policy_variant"])
    policy = make_policy(uid, dataclasses.replace(config, **resolved["policy_config"]))
    if checkpoint is None:
        saved, _ = load_newest_checkpoint(run_dir)
    else:
        with naming(f"cannot read the checkpoint {checkpoint}"):
            saved, _ = read_checkpoint(checkpoint)
    policy.load_state_dict(saved.model)
    return policy, resolved, saved.step


def eval_main(argv: list[str], command_line: bool = False) -> int:
    """python plugrl_min.py eval RUN_DIR: the run's policy on its own environment, one line."""
    args = parse_eval_flags(argv)
    policy, resolved, step = trained_policy(args.run_dir, args.checkpoint)
    env_id = args.env or resolved.get("env")
    greedy = not args.stochastic
    if greedy and not hasattr(policy, "get_greedy_action"):  # plugrl_min's own, optional
        print(f"{resolved['policy']} has no get_greedy_action: evaluated as it samples")
        greedy = False
    if args.seed is not None:
        torch.manual_seed(args.seed)  # what a sampled action draws
    infer_on_one_thread()  # main puts the count back
    if args.serve:
        config = EvalConfig(episodes=args.episodes, greedy=greedy)
        return serve_trained(policy, resolved["policy"], env_id, args, config, command_line)
    if env_id is None:
        raise UsageError(f"{args.run_dir}'s config.json names no environment (its run had no local "
                         "env clients): name one with --env ENV_ID")
    kwargs = {**(resolved.get("env_kwargs") or {}), **(args.env_kwargs or {})}  # theirs, yours
    if args.video and env_id.startswith("gym:"):  # [gym] Gymnasium draws each frame for RecordVideo
        kwargs.setdefault("render_mode", "rgb_array")  # [gym] (any other is refused below)
    env = make_env(env_id, 1, args.seed, kwargs)  # one: episodes in order, none cut short
    if args.video:  # [gym]
        record_video(env, args.video)  # [gym]
    returns = evaluate(policy, env, args.episodes, greedy)
    env.close()
    print(f"eval {args.run_dir} at step {step:,}, {'greedy' if greedy else 'sampled'}, on "
          f"{env_id}: {evaluation(returns)}", flush=True)
    return 0


def parse_eval_flags(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python plugrl_min.py eval", description="Evaluate a "
        "trained run's policy: it acts, nothing learns, nothing is written into RUN_DIR.")
    add = parser.add_argument
    add("run_dir", metavar="RUN_DIR")
    add("--episodes", type=int, default=10, metavar="N", help="episodes to play (default: 10; "
        "with --serve, 0 serves until Ctrl-C)")
    add("--checkpoint", metavar="PATH", help="default: RUN_DIR's newest that loads")
    add("--stochastic", action="store_true", help="sample actions as in training, not the most "
        "likely")
    add("--seed", type=int, help="seeds the environment and the samples: the same line twice")
    add("--env", metavar="ENV_ID", help="default: the run's own, from its config.json")
    add_env_kwargs_flag(add, "merged over the run's own")
    add_plugin_flag(add)  # a plug-in's policy or environment
    add("--video", metavar="DIR", help="save each episode as a video in DIR "  # [gym]
        "(gym:ENV_ID; needs moviepy)")  # [gym]
    add("--serve", action="store_true", help="serve the policy to env clients instead, on --port")
    add_address_flags(add)
    add_api_key_flag(add)
    args = parser.parse_args(argv)
    args.port = 8000 if args.port is None else args.port  # no env clients of its own to start
    if args.episodes < 0 or (args.episodes == 0 and not args.serve):
        parser.error("--episodes must be at least 1 (0 only with --serve)")
    run_dir = os.path.abspath(args.run_dir)
    if args.video and os.path.commonpath([run_dir, os.path.abspath(args.video)]) == run_dir:
        parser.error("--video must be outside RUN_DIR: eval writes nothing into the run")
    return args


def serve_trained(policy: BaseTorchPolicy, uid: str, env_id: str | None,
                  args: argparse.Namespace, config: EvalConfig, command_line: bool) -> int:
    """eval --serve: the policy behind a server of its own, until --episodes ended or Ctrl-C;
    its record (config.json, metrics.jsonl) in a run directory of its own."""
    if in_a_notebook():  # [notebook] its kernel's loop holds this thread: serve from a shell
        raise UsageError("eval --serve runs from a shell, not a notebook cell")  # [notebook]
    algo = EvalAlgorithm(config, policy)
    warn_without_api_key(args.host, args.api_key)
    server = Server(algo, None, (uid, "eval"), ServerConfig(api_key=args.api_key))
    record = {"evaluates": args.run_dir, "checkpoint": args.checkpoint, "env": env_id,
              "policy": uid, "eval_config": dataclasses.asdict(config)}

    def on_start(port: int) -> None:
        server.run_dir = claim_run_dir(None, ["eval", *[env_id] * bool(env_id)], record,
                                       server.record)
        print(f"serving {uid} of {args.run_dir}: start an env client, e.g.\n  python "
              f"{os.path.basename(__file__)} env-client {env_id or 'ENV_ID'} --server-port "
              f"{port} --num-episodes 0", flush=True)
    status = serve(server, server.run(args.host, args.port, on_start), command_line)
    print(f"eval {args.run_dir} served: {evaluation([r for r, _, _ in algo._episodes])}")
    return status


# ===== 15. Command line: the server (POLICY VARIANT ALGO VARIANT), env-client, report, eval ==
# PlugRL page: plugrl-run-server and plugrl-run-env-client, flags from the config dataclasses.

import argparse
import importlib.util  # binds importlib too: import_module is used as well
import inspect
import subprocess

CONFIG = "config.json"  # a run directory's first file, created exclusively: it marks a run


def _flag_type(hint):
    """argparse's type= for a config field of int, float, str, bool or dict (JSON), maybe | None."""
    base = next((arg for arg in typing.get_args(hint) if arg is not type(None)), hint)

    def convert(text):
        if text.lower() == "none" and type(None) in typing.get_args(hint):
            return None
        if base is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            return text.lower() in ("true", "1")
        return base(text) if base in (int, float, str) else json_object(text)

    convert.__name__ = getattr(base, "__name__", "value")  # argparse: "invalid int value: 'x'"
    return convert


def field_comments(config_class) -> dict:
    """Field name -> the comment on its line of the config's source: its flag's --help."""
    comments = {}
    for klass in reversed(config_class.__mro__):  # a subclass's comment replaces its base's
        with contextlib.suppress(OSError, TypeError):  # a class made at run time has no source
            source = inspect.getsource(klass)
            comments.update(re.findall(r"^\s+(\w+)\s*:[^#\n]*#\s*(.+)$", source, re.M))
    return comments


def _building(what: str, build, *args):
    """build(*args); a failure keeps its traceback and ends with a line naming the step. A
    CommandError is the constructor's own refusal, in one line (sac of a discrete policy)."""
    try:
        return build(*args)
    except CommandError:
        raise
    except Exception:  # a KeyError "... is not registered." too: the page's symptom, as it is
        traceback.print_exc()
        raise CommandError(f"building {what} failed (the traceback above says why)") from None


def infer_on_one_thread() -> None:
    """Torch's thread count is per OS thread: the one that serves (a run, eval) infers on one, set
    before any network. It answers small batches fastest; on two, sac's learns took 1.4x."""
    if torch.get_num_threads() != 1:
        torch.set_num_threads(1)


def server_main(argv: list[str], plugins: list[str] = (),
                background: bool = False,  # [notebook] start()'s: the Serving, once it serves
                at_end=None,  # [notebook] runs as a run on a thread of its own ends
                command_line: bool = False):
    """The server command, in its steps: the words and flags; the policy and algorithm (and the
    other ranks); --resume; the Server; once its port is taken, the run directory and the local
    clients; then serving until the run ends. Returns the exit status."""
    words, args, configs = parse_server_flags(argv)
    known = known_environment(args, words)  # (env_id, env) or None: it sizes a built-in policy
    if known is not None:
        size_policy(configs["policy"], known[1], args)
    resolved = dict(zip(("policy", "policy_variant", "algorithm", "algo_variant"), words),
                    policy_config=dataclasses.asdict(configs["policy"]),
                    algo_config=dataclasses.asdict(configs["algo"]), seed=args.seed,
                    env_kwargs=args.env_kwargs)
    infer_on_one_thread()
    algo = build_algorithm(words, configs, args, resolved)
    resume = args.run_dir if args.resume else None
    ranks = join_ranks(algo, words[2], algo.policy.device, resume)  # [ranks]
    counters = {}
    if resume is not None:
        checkpoint, counters = load_newest_checkpoint(resume)
        try:
            algo.load_checkpoint(checkpoint)
        except MissingFromCheckpoint as error:  # another algorithm's, or an older version's
            raise CommandError(f"cannot resume {resume}: its newest checkpoint has no "
                               f"{error.args[0]!r}, which {words[2]}'s load_checkpoint "
                               "reads") from None
        print(f"resumed from step {checkpoint.step} in {resume}", flush=True)
    warn_without_api_key(args.host, args.api_key)
    config = ServerConfig(**{field.name: getattr(args, field.name)  # each field has its flag
                             for field in dataclasses.fields(ServerConfig)})
    server = Server(algo, args.run_dir, (words[0], words[2]), config,
                    ranks=ranks,  # [ranks]
                    resumed=counters)
    if resume is not None:  # the run's own checkpoints: pruning may delete its older ones
        server.saved = checkpoint_paths(resume)
    local_env = choose_local_env(args, server, known)
    resolved["env"] = local_env if args.local_env_clients or args.in_process else None

    def on_start(port: int | None) -> None:  # its port is taken (or in-process): now its files
        name = [words[2], *[local_env] * (resolved["env"] is not None),
                *[f"seed{args.seed}"] * (args.seed is not None)]
        server.run_dir = claim_run_dir(args.run_dir, name, resolved, server.record, args.resume)
        if port is not None:
            start_local_clients(server, args, local_env, plugins, port)

    def run(on_start):  # the run: served, or in this process without the wire
        if not args.in_process:
            return server.run(args.host, args.port, on_start)
        env = known[1] if known and known[0] == local_env else make_env(
            local_env, args.local_num_envs, args.seed, args.env_kwargs)
        return run_in_process(server, MultiAction(env), on_start)

    if background or in_a_notebook():  # [notebook] the server on a thread of its own
        serving = Serving(server, run, on_start, at_end)  # [notebook]
        return serving if background else serving.wait()  # [notebook]
    return serve(server, run(on_start), command_line)


async def run_in_process(server: Server, executor: MultiAction, on_start) -> int:
    """--in-process: the run directory (on_start claims it), the loop without the wire, then the
    end line and the report, as a served run writes them; no socket, no client process."""
    server.loop = asyncio.get_running_loop()
    on_start(None)
    server.record.open(server.run_dir)
    return finish_run(server, *await run_to_the_end(server, train_in_process(server, executor)))


def parse_server_flags(argv: list[str]) -> tuple[list[str], argparse.Namespace, dict]:
    """POLICY VARIANT ALGO VARIANT and the flags: (the four words, the flags, the policy and
    algorithm configs filled from their flags). A usage error ends here, with status 2."""
    words = argv[:4]  # POLICY VARIANT ALGO VARIANT
    if len(words) < 4 or any(word.startswith("-") for word in words):  # --help alone lands here
        print("usage: python plugrl_min.py POLICY VARIANT ALGO VARIANT [flags; --help lists them]\n"
              "       python plugrl_min.py env-client ENV_ID [flags; --help lists them]\n"
              "       python plugrl_min.py report RUN_DIR ... [--reach R] [--last N]\n"  # [report]
              "       python plugrl_min.py eval RUN_DIR [flags; --help lists them]\n"  # [eval]
              "--plugin MODULE, anywhere on the line, imports a plug-in first\n\n"
              f"policies: {_registered(_POLICY_CONFIGS)}\n"
              f"algorithms: {_registered(_ALGO_CONFIGS)}\n"
              f"environments (env-client, --local-env): {known_envs()}")
        raise SystemExit(0 if {"-h", "--help"} & set(argv) else 2)
    configs = {"policy": _config("policy", _POLICY_CONFIGS, _POLICIES, *words[:2]),
               "algo": _config("algorithm", _ALGO_CONFIGS, _ALGOS, *words[2:])}
    parser = argparse.ArgumentParser(prog=f"python plugrl_min.py {' '.join(words)}",
                                     description="Serve this policy and algorithm over WebSocket.")
    for prefix, config in configs.items():  # --policy.hidden-size, --algo.global-steps, ...
        add_config_flags(parser, prefix, config)
    add_server_flags(parser.add_argument)
    args = parser.parse_args(argv[4:])
    if args.port is None:  # one command needs no free port 8000; a lone server keeps the page's
        args.port = 0 if args.local_env_clients else 8000
    if args.resume and not args.run_dir:
        raise UsageError("--resume needs --run-dir, the run directory to continue")
    if args.in_process and args.local_env_clients:
        raise UsageError("--in-process runs the environments in this process: it takes "
                         "--local-num-envs, not --local-env-clients")
    if args.run_dir and not args.resume and os.path.exists(os.path.join(args.run_dir, CONFIG)):
        served = checkpoint_paths(args.run_dir)
        raise UsageError(f"{args.run_dir} holds a run already: " + (
            "add --resume to continue it, or name another --run-dir" if served else
            "one that served no frame (its env-client-N.log may say why): remove the folder, or "
            "name another --run-dir"))
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda, but torch finds no CUDA device "
                         "(torch.cuda.is_available() is False): use --device cpu")
    for prefix, config in configs.items():
        for field in dataclasses.fields(config):
            if f"{prefix}.{field.name}" in vars(args):  # given: a field left out keeps its default
                setattr(config, field.name, getattr(args, f"{prefix}.{field.name}"))
    return words, args, configs


def add_config_flags(parser: argparse.ArgumentParser, prefix: str, config) -> None:
    """A flag for every field of a config dataclass (--algo.global-steps), its comment the help."""
    hints, comments = typing.get_type_hints(type(config)), field_comments(type(config))
    group = parser.add_argument_group(f"--{prefix}.* ({type(config).__name__})")
    for field in dataclasses.fields(config):
        default = getattr(config, field.name)
        if prefix == "policy" and field.name in SIZED_FROM_ENV:
            default = f"the environment's, from --local-env or example_env; else {default}"
        group.add_argument(f"--{prefix}.{field.name.replace('_', '-')}", metavar="V",
                           dest=f"{prefix}.{field.name}", type=_flag_type(hints[field.name]),
                           default=argparse.SUPPRESS,  # in args only if given: see size_policy
                           help=f"{comments.get(field.name, '')} "
                           f"(default: {default})".replace("%", "%%").lstrip())


def add_plugin_flag(add) -> None:
    """--plugin MODULE: main() imports it before any command reads its words; listed in --help."""
    add("--plugin", metavar="MODULE", action="append", help="import MODULE first: its "
        "policies, algorithms and environments (repeatable, anywhere on the line)")


def add_env_kwargs_flag(add, note: str = "") -> None:
    """--env-kwargs JSON: keyword arguments of the environment's constructor (gymnasium.make's)."""
    add("--env-kwargs", type=json_object, metavar="JSON", help="keyword arguments for the "
        "environment, a JSON object: '{\"continuous\": false}'" + (f" ({note})" if note else ""))


def json_object(text: str) -> dict:
    """argparse's type= for a JSON object (--env-kwargs, --policy.obs-spec), or a one-line error."""
    try:
        value = json.loads(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"not JSON: {error}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, {{...}}; got {text!r}")
    return value


def add_api_key_flag(add) -> None:
    """--api-key, by default $PLUGRL_API_KEY; an empty one is none, on the server and clients."""
    add("--api-key", default=os.environ.get("PLUGRL_API_KEY"), type=lambda text: text or None,
        help="the secret a client sends at the handshake, as 'Authorization: Api-Key KEY' "
        "(default: $PLUGRL_API_KEY; empty: none)")


def add_address_flags(add) -> None:
    """Where a server listens: a run's, or eval --serve's."""
    add("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, loopback only)")
    add("--port", type=int, help="0 picks a free port, printed at start (default: 8000; a free "
        "one when a run starts its own env clients)")


def add_server_flags(add) -> None:
    """The server's own flags, beside the configs' (add: parser.add_argument)."""
    add_address_flags(add)
    add("--run-dir", help="a new folder for checkpoints and metrics, or with --resume the run to "
        "continue (default: runs/ALGO[-ENV][-seedN]-TIME; ENV with --local-env-clients or "
        "--in-process)")
    add_plugin_flag(add)
    add("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    add("--seed", type=int, help="seeds torch and numpy on the server; local client i gets "
        "--seed S+i-1 for its environments")
    add("--local-env-clients", type=int, default=0, metavar="N", help="start N env clients too "
        "(default: 0)")
    add("--in-process", action="store_true", help="no server: train on --local-env in this "
        "process, the loop without the wire (--seed S seeds it as local client 1)")
    add("--local-env", metavar="ENV_ID", help="their environment (default: the algorithm's "
        "example_env, else the first registered that fits)")
    add("--local-num-envs", type=int, default=1, metavar="M", help="environments per local "
        "client, or --in-process (default: 1)")
    add_env_kwargs_flag(add, "for --local-env")
    add("--device", default="cpu", choices=("cpu", "cuda", "auto"), help="auto: cuda if any "
        "(default: cpu)")
    add("--log-every", type=int, default=ServerConfig.log_every, metavar="F", help="a line of "
        "metrics.jsonl at the first learn once F frames (stored or discarded) were routed since "
        "the last (default: 1000)")
    add("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES, metavar="B",
        help=f"a larger frame closes its connection (1009) (default: {MAX_MESSAGE_BYTES})")
    add("--max-envs-per-client", type=int, default=ServerConfig.max_envs_per_client,
        metavar="N", help="environments one connection may use: one client cannot hold the "
        f"loop (default: {ServerConfig.max_envs_per_client})")
    add("--learn-threads", type=int, metavar="N", help="torch threads per learn "  # [learn-threads]
        "(default: one per core other processes leave idle)")  # [learn-threads]
    add("--trace", type=int, default=0, metavar="N",  # [trace]
        help="narrate the first N frames and learns (default: 0)")  # [trace]
    add("--feedback-timeout", type=float, default=ServerConfig.feedback_timeout, metavar="S",
        help="seconds of serving an environment may owe feedback for an action, also the ping "
        f"interval (default: {ServerConfig.feedback_timeout:g})")
    add_api_key_flag(add)


def known_environment(args: argparse.Namespace, words: list[str]) -> tuple[str, VecEnv] | None:
    """The environment the server knows before it builds the policy, made once: --local-env,
    else the algorithm's example_env; None if neither. An unknown one is a usage error. With
    --in-process it is the one the run trains on: --local-num-envs of it, seeded by --seed."""
    example = getattr(_ALGOS.get(words[2]), "example_env", None)
    env_id = args.local_env or (example if example in ENVIRONMENTS else None)  # a block cut
    if env_id is None:
        return None
    size, seed = (args.local_num_envs, args.seed) if args.in_process else (1, None)
    env = make_env(env_id, size, seed, args.env_kwargs)
    try:  # the flat form of old, said here, where the environment has a name
        obs_spec_of(env.obs_spec)
    except UsageError as error:
        raise UsageError(f"environment {env_id}: {error}") from None
    return env_id, env


SIZED_FROM_ENV = ("obs_spec", "action_dim", "num_actions")  # of a built-in policy's config


def size_policy(config, env: VecEnv, args: argparse.Namespace) -> None:
    """A built-in policy sized from the environment: its config's obs_spec, and action_dim or
    num_actions, each unless a flag gave it. A policy config without these fields is left as it
    is: a policy of your own states its sizes itself."""
    continuous = env.num_actions is None
    sizes = {"obs_spec": obs_spec_as_json(env.obs_spec),
             "action_dim" if continuous else "num_actions":
             env.action_dim if continuous else env.num_actions}
    for name, value in sizes.items():
        if hasattr(config, name) and f"policy.{name}" not in vars(args):
            setattr(config, name, value)


def build_algorithm(words: list[str], configs: dict, args: argparse.Namespace,
                    resolved: dict) -> BaseAlgorithm:
    """Print the resolved config, then build the policy (on --device), the algorithm and its
    optimizers. A registry or constructor error keeps its traceback, then one line."""
    for name in sorted(resolved["policy_config"].keys() & resolved["algo_config"].keys()):
        print(f"warning: {name!r} is in both the policy and the algorithm config: keep it in one",
              file=sys.stderr)
    if os.name != "posix":
        print("warning: plugrl_min is made for Linux and macOS: here, signals and local clients "
              "may not behave as README.md says", file=sys.stderr)
    print(json.dumps(resolved, indent=2), flush=True)  # first: the page's "prints its config"
    if args.seed is not None:
        torch.manual_seed(args.seed)
        np.random.seed(args.seed)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    # LOCAL_RANK: the GPU torch.distributed.run gives this rank (0 without it).
    device = torch.device(f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if cuda else "cpu")
    policy = _building(f"policy {words[0]!r} from its config", make_policy, words[0],
                       configs["policy"])
    policy.to(device)  # before the algorithm: it builds its own networks where the policy is
    algo = _building(f"algorithm {words[2]!r} from its config", make_algo, words[2], policy,
                     configs["algo"])
    _building(f"the optimizers of algorithm {words[2]!r}", algo.init_optimizers)
    return algo


def choose_local_env(args: argparse.Namespace, server: Server, known) -> str | None:
    """--local-env, else the algorithm's example_env if it fits the policy, else the first
    registered environment that fits (None if none does). With local clients it must fit
    (known: known_environment's, made already)."""
    fits = [env_id for env_id, env in ENVIRONMENTS.items()  # in registration order
            if misfit(server.metadata["data"], env) is None]
    local_env = args.local_env or min(fits, key=lambda env_id: env_id != server.algo.example_env,
                                      default=None)  # the algorithm's own example first
    if not (args.local_env_clients or args.in_process):  # checked now, before any file
        return local_env
    if local_env is None:
        raise UsageError("no registered environment fits this policy: name one with --local-env")
    defined_in = getattr(ENVIRONMENTS.get(local_env), "__module__", __name__)
    if local_env.startswith("gym:"):  # [gym] where its entry point is
        defined_in = gym_entry_module(local_env[4:])  # [gym]
    if args.local_env_clients and defined_in == "__main__" and __name__ != "__main__":
        raise UsageError(f"environment {local_env!r} is defined in __main__, which the "
                         "--local-env-clients processes cannot import: define it in a module "
                         "and add --plugin MODULE (gym:MODULE:ID for a Gymnasium one)")
    env = known[1] if known and known[0] == local_env else make_env(
        local_env, kwargs=args.env_kwargs)
    problem = misfit(server.metadata["data"], env)
    if problem is not None:
        raise UsageError(f"the server's policy does not fit {local_env}: {problem}")
    return local_env


def claim_run_dir(run_dir: str | None, name: list[str], resolved: dict, record: RunRecord,
                  resume: bool = False) -> str:
    """The run directory (None: a new one, runs/NAME-TIME), made this run's own by creating its
    config.json exclusively. A new run's record keeps what the folder held, to leave it so if no
    frame is served."""
    found = None if run_dir is None or not os.path.isdir(run_dir) else set(os.listdir(run_dir))
    if run_dir is None:  # a new folder: another run started this second takes another
        name = "-".join([*name, time.strftime("%Y%m%d-%H%M%S")])
        base = os.path.join("runs", re.sub(r"[^\w.-]", "_", name))  # letters, digits, -_. stay
        with naming(f"cannot make a run directory in {os.path.abspath('runs')}"):
            for suffix in itertools.count(1):
                run_dir = base if suffix == 1 else f"{base}-{suffix}"
                with contextlib.suppress(FileExistsError):  # taken: try the next name
                    os.makedirs(run_dir)  # runs/ too
                    break
    with naming(f"cannot make the run directory {run_dir}"):
        os.makedirs(run_dir, exist_ok=True)
    with naming(f"cannot write {os.path.join(run_dir, CONFIG)}"):
        try:
            with open(os.path.join(run_dir, CONFIG), "w" if resume else "x") as file:
                json.dump(resolved, file, indent=2)
        except FileExistsError:  # another run claimed it since the check at the start
            raise UsageError(f"{run_dir} holds a run already: name another --run-dir") from None
    if not resume:  # (made the folder, what it held): see leave_as_found
        record.claimed = (found is None, found or set())
    print(f"run directory: {run_dir}", flush=True)
    return run_dir


# --- Local env clients: --local-env-clients N, started once the port is taken ----------------

def start_local_clients(server: Server, args: argparse.Namespace, local_env: str | None,
                        plugins: list[str], port: int) -> None:
    """Start the --local-env-clients, each logging to the run directory; or, without them, say
    how to start a client in another terminal."""
    client_args = ["env-client", local_env or "ENV_ID", "--server-port", str(port),
                   "--num-envs", str(args.local_num_envs), "--num-episodes", "0",
                   *[flag for module in plugins for flag in ("--plugin", module)],
                   *(["--env-kwargs", json.dumps(args.env_kwargs)] if args.env_kwargs else [])]
    if not args.local_env_clients:
        command = f"python {os.path.basename(__file__)} {' '.join(client_args)}"
        command += " --api-key KEY" * bool(args.api_key)  # the secret is not printed
        print(f"no env clients yet: start one in another terminal with\n  {command}\nor "
              "run this server with --local-env-clients 1 to do both in one command", flush=True)
    environment = dict(os.environ)
    environment["PLUGRL_API_KEY"] = args.api_key or ""  # off the command line, as a secret
    # The folders this process imports from, the plug-ins' too (a package's, a notebook's own).
    environment["PYTHONPATH"] = os.pathsep.join(os.path.abspath(path) for path in sys.path)
    for i in range(1, args.local_env_clients + 1):
        seed = [] if args.seed is None else ["--seed", str(args.seed + i - 1)]
        command = [sys.executable, os.path.abspath(__file__), *client_args, *seed]
        log_path = os.path.join(server.run_dir, f"env-client-{i}.log")
        with naming(f"cannot start local env client {i} (its log: {log_path})"), \
                open(log_path, "a") as log:  # a resumed run adds to its log
            print(f"--- env client {i} started {time.strftime('%Y-%m-%d %H:%M:%S')}: "
                  f"{' '.join(command[1:])}", file=log, flush=True)
            # A session of its own: signals for the server (Ctrl-C, timeout) stay with it,
            # and the client hears of the end from the server, as every client does.
            process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                       start_new_session=True, env=environment)
        server.local_clients.append((i, process, log_path))


def watch_local_clients(server: Server) -> None:
    """A local env client (--local-env-clients) that failed stops the run, with status 1."""
    for number, process, log_path in server.local_clients:
        if process.poll() not in (None, 0) and not server.stop_requested:
            try:  # the client failed, not the run: an unreadable log only loses its last line
                with open(log_path, errors="replace") as log:
                    lines = [line.strip() for line in log if line.strip()]
            except OSError as error:
                lines = [f"(its log cannot be read: {error.strerror or error})"]
            last = (lines or ["(no output)"])[-1]
            print(f"\nerror: local env client {number} exited with status "
                  f"{process.returncode}: {last} (its log: {log_path})", file=sys.stderr)
            server.status = 1
            server.request_stop()


def reap(local_clients: list, seconds: float) -> None:
    """Wait up to `seconds` in all for the local env clients to end, then kill what is left."""
    deadline = time.monotonic() + seconds  # one for all: N hung clients cost seconds, not N times
    for _, client, _ in local_clients:
        try:
            client.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            client.kill()
            client.wait()


def env_client_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python plugrl_min.py env-client",
                                     description="Run environments against a plugrl_min server.")
    add = parser.add_argument
    add("env_id", help=f"one of {known_envs()}")
    add("--server-host", default="127.0.0.1", help="(default: 127.0.0.1)")
    add("--server-port", type=int, default=8000, help="(default: 8000)")
    add("--num-episodes", type=int, default=1, help="stop after this many finished episodes (0: "
        "when the server ends the run) (default: 1)")
    add("--num-envs", type=int, default=1, help="environments stepped together (default: 1)")
    add("--seed", type=int, help="seeds the environments")
    add_env_kwargs_flag(add)
    add("--summary-json", help="write the summary here as one JSON object")
    add("--connect-timeout", type=float, default=30.0, help="seconds to wait for the server "
        "(default: 30)")
    add_api_key_flag(add)
    add("--closed-loop-steps", type=int, metavar="K",
        help="hold each decision for K physical steps, acted out by --controller")
    add("--controller", default="track", help="track (dummy-v1, pendulum-v1) (default: track)")
    add("--no-reuse-feedback-obs", action="store_true", help="send every observation in full, "
        "even to a server that lists reuse-feedback-obs (by default a row the last feedback "
        "carried is not sent again)")
    add("--reward-aggregation", default="sum", choices=REWARD_AGGREGATIONS,
        help="a decision's reward from its physical steps'; over the wire only sum, what a "
        "feedback's rewards are (default: sum)")
    add_plugin_flag(add)
    args = parser.parse_args(argv)
    steps = args.closed_loop_steps  # None: no closed loop
    if args.num_envs < 1 or args.num_episodes < 0 or (steps is not None and steps < 1):
        parser.error("--num-envs and --closed-loop-steps must be at least 1, --num-episodes at "
                     "least 0")
    try:
        if in_a_notebook():  # [notebook] a cell: the kernel's loop runs in this thread
            return OnAThread(run_env_client(args), "plugrl-env-client").wait()  # [notebook]
        return asyncio.run(run_env_client(args))
    except CommandError as error:  # an unknown environment (2), the server's refusal (1): a line
        print_failure(error, "env-client: ")  # any other exception: the environment's traceback
        return error.status
    except KeyboardInterrupt:
        return 130


def import_plugins(argv: list[str]) -> tuple[list[str], list[str]]:
    """Import every --plugin MODULE (anywhere on the line); returns (plug-ins, the other words)."""
    parser = argparse.ArgumentParser(prog="plugrl_min.py", add_help=False, allow_abbrev=False)
    add_plugin_flag(parser.add_argument)
    plugins, rest = parser.parse_known_args(argv)
    if os.getcwd() not in sys.path:  # run by path from elsewhere, python puts only its folder
        sys.path.insert(1, os.getcwd())
    for module in plugins.plugin or []:
        if module.endswith(".py"):
            name = module[:-3].replace("/", ".")
            raise UsageError(f"--plugin takes a module name, not a file: --plugin {name}")
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            raise UsageError(f"cannot import plug-in {module!r}: {error} (is its folder the "
                             "current one, or on PYTHONPATH?)") from None
    return plugins.plugin or [], rest


def import_sac_example() -> None:
    """sac is an example plug-in that ships beside this file: imported from there, by path, unless
    it was imported already (by its name, or in a package). A plug-in that registered `sac` from
    another file, a copy being edited, is refused: two algorithms would answer to one name."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sac_example.py")
    if not os.path.isfile(path) or "sac_example" in sys.modules:
        return
    if "sac" in _ALGOS:
        owner = _ALGOS["sac"].__module__
        where = getattr(sys.modules.get(owner), "__file__", None)
        if where is not None and os.path.samefile(where, path):  # sac_example, by a package name
            return
        copy = os.path.basename(where) if where else owner
        raise UsageError(f"algorithm sac is registered twice, by {owner} and by sac_example: give "
                         f"your copy its own UID (UID = \"my-sac\" at the top of {copy}) and serve "
                         "it by that name")
    spec = importlib.util.spec_from_file_location("sac_example", path)
    sys.modules["sac_example"] = module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def main(argv: list[str] | None = None,
         background: bool = False):  # start()'s (the notebook block): a Serving, once it serves
    """The command line: the server, env-client, report or eval. main() reads sys.argv, exits
    with the status; main([...]) returns it, as pytest.main does (in a notebook cell too), and
    leaves the caller's torch thread count and global RNG states (torch, numpy) as they were."""
    words = list(sys.argv[1:] if argv is None else argv)
    threads, rng = torch.get_num_threads(), (torch.get_rng_state(), np.random.get_state())

    def put_back_rng() -> None:  # the run's --seed and draws do not outlast it
        torch.set_rng_state(rng[0])
        np.random.set_state(rng[1])
    status = None  # stays None if a user's own exception ends it: it keeps its traceback
    try:
        status = run_command(words, argv is None, background, put_back_rng)
    finally:
        if argv is not None:
            torch.set_num_threads(threads)  # the server's thread count was set in this thread
            if status is None or isinstance(status, (int, CommandError)):  # not a background run
                put_back_rng()  # (that one's at_end puts them back as it ends)
    if argv is None:
        sys.exit(status)
    return status


def run_command(words: list[str], command_line: bool, background: bool, put_back_rng):
    """main's work: the plug-ins, then the command its words name; its exit status (a background
    run: its Serving, or the CommandError that refused it)."""
    try:
        plugins, words = import_plugins(words)
        commands = {"env-client": env_client_main}
        commands["report"] = report_main  # [report]
        commands["eval"] = functools.partial(eval_main, command_line=command_line)  # [eval]
        command = commands.get(words[0] if words else "")
        if command is not None:
            status = command(words[1:])
        else:
            import_sac_example()  # only the server serves sac
            status = server_main(words, plugins,
                                 background=background,  # [notebook]
                                 at_end=put_back_rng,  # [notebook] a background run's end
                                 command_line=command_line)
    except CommandError as error:  # a usage error (2), a failure it names (1): one line
        print_failure(error)
        status = error.status
        if background:  # [notebook] start() raises it, saying why
            status = error  # [notebook]
    except SystemExit as stop:  # argparse's --help and usage errors, a plug-in's sys.exit
        if command_line:
            raise
        if isinstance(stop.code, str):  # printed as Python prints it
            print(stop.code, file=sys.stderr)
        status = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    return status


if __name__ == "__main__":  # a script: module __main__, known by its other names too (section 10)
    main()
