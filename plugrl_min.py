# SPDX-License-Identifier: MIT
"""plugrl_min: a single-file reference implementation, for teaching, of the PlugRL server contract.
Environments run in client processes and talk over WebSocket to a server that batches inference and learns.

Read it top to bottom; the sections run in this order:
  1. Wire format   2. State types   3. Registries   4. Policies   5. Algorithms
  6. Server        7. Environment client            8. Command line
Every name, hook and rule of the PlugRL "Custom Algorithm" page holds here, with
`plugrl_min` as the import path instead of `plugrl_server.*`.
"""

import abc
import argparse
import asyncio
import concurrent.futures
import dataclasses
import glob
import hmac
import importlib
import io
import json
import math
import os
import signal
import struct
import subprocess
import sys
import time
import traceback
import typing

import numpy as np
import torch
import websockets
from torch import nn
from websockets.asyncio.client import connect
from websockets.asyncio.server import serve

PROTOCOL_VERSION = 1


# ===== 1. Wire format: one binary WebSocket frame per message, a JSON header then raw array bytes =====
# PlugRL page: the transport under infer() and feedback(). Nothing is ever unpickled.

# Frame layout: [4-byte little-endian header length][JSON header][array 0 bytes][array 1 bytes]...
# The header is {"message": <the message, arrays replaced by {"__array__": i}>, "arrays": [[dtype, shape], ...]}.
_HEADER_LENGTH = struct.Struct("<I")
_ALLOWED_DTYPES = {np.dtype(name).str: np.dtype(name) for name in (
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
    "float16", "float32", "float64")}


class ProtocolError(ValueError):
    """A message that breaks the wire format or the protocol; `hint` says what the sender should do."""

    def __init__(self, message: str, hint: str = "check the client against the message table in README.md"):
        super().__init__(message)
        self.hint = hint


def pack_message(message: dict) -> bytes:
    """Encode a dict (of JSON values and numpy arrays, nested) into one binary frame."""
    arrays = []

    def encode(value):
        if isinstance(value, dict):
            if "__array__" in value:
                raise ProtocolError("the key '__array__' is reserved by the wire format")
            return {str(key): encode(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [encode(item) for item in value]
        if isinstance(value, (np.ndarray, np.generic)):
            array = np.asarray(value, order="C")  # C order; unlike ascontiguousarray, keeps 0-d arrays 0-d
            if array.dtype.str not in _ALLOWED_DTYPES:
                raise ProtocolError(f"cannot send dtype {array.dtype}: only bool, int, uint and float arrays")
            arrays.append(array)
            return {"__array__": len(arrays) - 1}
        return value

    body = {"message": encode(message), "arrays": [[a.dtype.str, list(a.shape)] for a in arrays]}
    try:
        header = json.dumps(body, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as error:
        raise ProtocolError(f"cannot encode the message: {error}") from None
    # One join writes the whole frame into a single buffer: no per-array bytes copies.
    return b"".join([_HEADER_LENGTH.pack(len(header)), header, *(a.reshape(-1).view(np.uint8) for a in arrays)])


def _reject_constant(name):
    raise ProtocolError(f"the header holds {name}, which JSON does not allow")


def unpack_message(frame: bytes) -> dict:
    """Decode one binary frame. Arrays are read-only views into the frame: copy one before you modify it."""
    if not isinstance(frame, (bytes, bytearray)):
        raise ProtocolError("expected a binary frame, got a text frame", "send messages made by pack_message")
    if len(frame) < _HEADER_LENGTH.size:
        raise ProtocolError(f"frame of {len(frame)} bytes is shorter than its header length field")
    (header_length,) = _HEADER_LENGTH.unpack_from(frame)
    start = _HEADER_LENGTH.size + header_length
    if start > len(frame):
        raise ProtocolError(f"header declares {header_length} bytes but the frame holds {len(frame) - 4}")
    try:
        body = json.loads(frame[_HEADER_LENGTH.size:start], parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise ProtocolError(f"header is not valid JSON: {error}") from None
    if not (isinstance(body, dict) and isinstance(body.get("message"), dict) and isinstance(body.get("arrays"), list)):
        raise ProtocolError("header must be an object with 'message' (object) and 'arrays' (list)")
    arrays, offset = [], start
    for i, spec in enumerate(body["arrays"]):
        if not (isinstance(spec, list) and len(spec) == 2 and isinstance(spec[0], str) and spec[0] in _ALLOWED_DTYPES
                and isinstance(spec[1], list) and all(type(n) is int and n >= 0 for n in spec[1])):
            raise ProtocolError(f"array {i}: {str(spec)[:80]} is not [dtype, shape] with an allowed dtype "
                                "(bool, int, uint, float) and a shape of non-negative integers")
        dtype, shape = _ALLOWED_DTYPES[spec[0]], tuple(spec[1])
        if len(shape) > 32 or math.prod(filter(None, shape)) * dtype.itemsize >= 2**63:  # numpy's limits,
            raise ProtocolError(f"array {i}: numpy cannot make shape {str(spec[1])[:80]}")  # even when empty
        count = math.prod(shape)
        # Checked against the bytes actually present before anything is allocated or viewed.
        if count * dtype.itemsize > len(frame) - offset:
            raise ProtocolError(f"array {i} declares {count * dtype.itemsize} bytes but {len(frame) - offset} remain")
        arrays.append(np.frombuffer(frame, dtype, count, offset).reshape(shape))
        offset += count * dtype.itemsize
    if offset != len(frame):
        raise ProtocolError(f"{len(frame) - offset} bytes are left over after the declared arrays")

    def decode(value):
        if isinstance(value, dict):
            if "__array__" in value:
                index = value["__array__"]
                if type(index) is not int or not 0 <= index < len(arrays) or len(value) != 1:
                    raise ProtocolError(f"bad array reference {str(value)[:80]}")
                return arrays[index]
            return {key: decode(item) for key, item in value.items()}
        if isinstance(value, list):
            return [decode(item) for item in value]
        return value

    try:
        return decode(body["message"])
    except RecursionError:
        raise ProtocolError("header nests too deeply") from None


# ===== 2. State types: what flows from infer to feedback, and what a checkpoint holds =====
# PlugRL page: PolicyRuntimeState, PolicyTrainState (plugrl_server.policy.state) and Checkpoint.

# Whatever the policy returns from infer beside the action: an array or a dict of arrays
# (nested), batched along axis 0. The server slices it per environment for feedback.
PolicyRuntimeState: typing.TypeAlias = typing.Any
# What derive_train_state makes of a runtime state (a nested dict of arrays, or None).
PolicyTrainState: typing.TypeAlias = typing.Any


@dataclasses.dataclass
class Checkpoint:
    """What create_checkpoint returns and load_checkpoint receives.

    Keep every value a tensor or a plain Python value (dict, list, int, float, str, bool, None):
    checkpoints load with torch.load(weights_only=True), which refuses anything else.
    """

    step: int
    model: dict | None
    optimizer: dict | None
    meta: dict


def slice_rows(tree, rows):
    """Index every array or tensor of a nested dict (or a lone array) along axis 0; None stays None."""
    if tree is None:
        return None
    if isinstance(tree, dict):
        return {key: slice_rows(value, rows) for key, value in tree.items()}
    return tree[rows]


# ===== 3. Registries: where the command line finds policies and algorithms by UID and variant =====
# PlugRL page: register_algo_config, register_algo (and their policy twins), make_algo.

_POLICY_CONFIGS, _POLICIES, _ALGO_CONFIGS, _ALGOS = {}, {}, {}, {}


def _registrar(table: dict, key, what: str, value):
    """A class decorator that stores value(cls) under key, once."""
    def decorator(cls):
        if key in table:
            raise ValueError(f"{what} is already registered")
        table[key] = value(cls)
        return cls
    return decorator


def register_policy_config(uid: str, variant: str = "default"):
    """Class decorator: register a policy config dataclass's default instance under (uid, variant)."""
    return _registrar(_POLICY_CONFIGS, (uid, variant), f"policy config {uid}/{variant}", lambda cls: cls())


def register_policy(uid: str):
    """Class decorator: register a BaseTorchPolicy subclass under uid."""
    return _registrar(_POLICIES, uid, f"policy {uid}", lambda cls: cls)


def register_algo_config(uid: str, variant: str = "default"):
    """Class decorator: register an algorithm config dataclass's default instance under (uid, variant)."""
    return _registrar(_ALGO_CONFIGS, (uid, variant), f"algorithm config {uid}/{variant}", lambda cls: cls())


def register_algo(uid: str):
    """Class decorator: register a BaseAlgorithm subclass under uid."""
    return _registrar(_ALGOS, uid, f"algorithm {uid}", lambda cls: cls)


def _build(kind: str, classes: dict, configs: dict, uid: str, variant: str, config, **kwargs):
    if config is None:  # a copy of the registered default, so flags never change the registry
        if (uid, variant) not in configs:
            raise KeyError(f"{kind} config {uid}/{variant} is not registered.")
        config = dataclasses.replace(configs[(uid, variant)])
    if uid not in classes:  # the page's symptom when only the config module was imported
        raise KeyError(f"{kind} {uid} is not registered.")
    return classes[uid](config=config, **kwargs)


def make_policy(uid: str, config=None, variant: str = "default"):
    """Build the policy registered as uid, from config (default: the registered variant's defaults)."""
    return _build("Policy", _POLICIES, _POLICY_CONFIGS, uid, variant, config)


def make_algo(uid: str, policy, config=None, variant: str = "default"):
    """Build the algorithm registered as uid around policy. An abstract class raises TypeError here."""
    return _build("Algorithm", _ALGOS, _ALGO_CONFIGS, uid, variant, config, policy=policy)


# ===== 4. Policies: a batch of observations in, actions [n, action_horizon, action_dim] out =====
# PlugRL page: BaseTorchPolicy, and the dummy-policy of its smoke test.

class BaseTorchPolicy(nn.Module):
    """A policy is an nn.Module (so state_dict() works) with the methods the server and algorithms call."""

    action_dim: int
    action_horizon: int = 1
    obs_spec: dict  # observation key -> (shape without the batch axis, dtype name); sent in the metadata

    def get_action_and_runtime_state(self, obs: dict) -> tuple[np.ndarray, PolicyRuntimeState]:
        """Actions [n, action_horizon, action_dim] as float32 numpy, and the runtime state, for a batch."""
        raise NotImplementedError

    def fake_runtime_state(self, n: int) -> PolicyRuntimeState:
        """A runtime state of the right shapes for n environments (used to size buffers)."""
        raise NotImplementedError


@register_policy_config("dummy-policy")
@dataclasses.dataclass
class DummyPolicyConfig:
    """Sizes of the dummy-policy; the defaults fit dummy-v1 and pendulum-v1 (3 observations, 1 action)."""

    obs_dim: int = 3
    action_dim: int = 1
    action_horizon: int = 1
    hidden_size: int = 256
    log_std_min: float = -5.0
    log_std_max: float = 2.0


@register_policy("dummy-policy")
class DummyPolicy(BaseTorchPolicy):
    """A tanh-Gaussian MLP: actions in [-1, 1]. SAC uses it as its actor through sample()."""

    def __init__(self, config: DummyPolicyConfig):
        super().__init__()
        self.config = config
        self.action_dim, self.action_horizon = config.action_dim, config.action_horizon
        self.obs_spec = {"state": ((config.obs_dim,), "float32")}
        out = config.action_dim * config.action_horizon
        self.trunk = nn.Sequential(nn.Linear(config.obs_dim, config.hidden_size), nn.ReLU(),
                                   nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU())
        self.head = nn.Linear(config.hidden_size, 2 * out)  # mean and log-std in one matmul

    def forward(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Mean and log standard deviation of the pre-tanh Gaussian, [B, action_horizon * action_dim]."""
        mean, log_std = self.head(self.trunk(state)).chunk(2, dim=-1)
        low, high = self.config.log_std_min, self.config.log_std_max
        return mean, low + 0.5 * (high - low) * (torch.tanh(log_std) + 1)  # squashed into [low, high]

    def sample(self, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A reparameterized action in (-1, 1) and its log-probability [B] (tanh change of variables)."""
        mean, log_std = self(state)
        noise = torch.randn_like(mean)
        action = torch.tanh(mean + log_std.exp() * noise)
        # The Gaussian's log-density at mean + std·noise, written out, then the tanh change of variables.
        log_prob = -0.5 * noise.pow(2) - log_std - 0.5 * math.log(2 * math.pi)
        log_prob = log_prob - torch.log(1 - action.pow(2) + 1e-6)
        return action, log_prob.sum(-1)

    @torch.inference_mode()
    def get_action_and_runtime_state(self, obs: dict) -> tuple[np.ndarray, PolicyRuntimeState]:
        """Sample actions for a batch; the runtime state records the action taken."""
        mean, log_std = self(torch.from_numpy(obs["state"]))
        # The same distribution as sample(), without the log-probability that only learning needs.
        action = torch.tanh(torch.normal(mean, log_std.exp())).numpy()
        action = action.reshape(-1, self.action_horizon, self.action_dim)
        return action, {"action": action}

    def fake_runtime_state(self, n: int) -> PolicyRuntimeState:
        """Zeros shaped like the runtime state of n environments."""
        return {"action": np.zeros((n, self.action_horizon, self.action_dim), np.float32)}


# ===== 5. Algorithms: the hooks the server loop calls, their defaults, and the built-in dummy =====
# PlugRL page: BaseAlgoConfig, BaseAlgorithm, "Server contract" and "Design rules".

@dataclasses.dataclass
class BaseAlgoConfig:
    """Every algorithm config derives from this. global_steps is the run length the progress line reads."""

    global_steps: int | None = 100_000


class BaseAlgorithm(abc.ABC):
    """The server-side algorithm. Override learn_impl (abstract), feedback and the should_* hooks."""

    # False for a replay-buffer learner: then every frame with a step state goes to feedback.
    on_policy: bool = True

    def __init__(self, config: BaseAlgoConfig, policy: BaseTorchPolicy):
        self.config, self.policy = config, policy
        self.global_step = 0
        self._episodes = []  # (return, length, success) recorded since the last learn

    def infer(self, obs: dict) -> tuple[np.ndarray, PolicyRuntimeState]:
        """Actions and runtime state for one batch of environments (the server batches across clients)."""
        return self.policy.get_action_and_runtime_state(obs)

    def derive_train_state(self, runtime_state: PolicyRuntimeState) -> PolicyTrainState:
        """Runs right after every infer; its result comes back, per environment, as feedback(train_state=)."""
        return None

    def example_train_state(self, n: int) -> PolicyTrainState:
        """A train state for n environments, from the policy's fake runtime state: use it to size buffers."""
        return self.derive_train_state(self.policy.fake_runtime_state(n))

    def feedback(self, *, obs: dict, runtime_state: PolicyRuntimeState, train_state: PolicyTrainState = None,
                 terminated: bool, truncated: bool, next_obs: dict, reward, info: dict,
                 next_terminated: bool, next_truncated: bool, prev_node: tuple) -> tuple[tuple, int, dict]:
        """Store one frame. terminated/truncated: the previous frame's flags; next_*: this transition's.

        Returns (prev_node, global_step, log_dict); prev_node comes back to this environment's next frame.
        """
        raise NotImplementedError(f"{type(self).__name__}.feedback: store the frame and return "
                                  "(prev_node, global_step, log_dict)")

    def discard_feedback(self, *, info: dict, next_terminated: bool, next_truncated: bool) -> None:
        """Every frame that is not stored comes here. Overrides must call super(), or episodes go missing."""
        if (next_terminated or next_truncated) and "episode" in info and bool(info["episode"].get("mask", True)):
            self.record_episode_metrics(info["episode"])

    def record_episode_metrics(self, episode: dict) -> None:
        """Count one finished episode (r = return, l = length, s = success) in the next rollout/* metrics."""
        self._episodes.append((float(episode["r"]), float(episode["l"]), float(episode.get("s", 0.0))))

    def build_train_info(self, global_step: int, log_dict: dict) -> tuple[int, dict]:
        """Add rollout/* (means over the episodes recorded since the last learn; 0 when there were none)."""
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
        """One learning step: returns (global_step, log_dict). It must move what should_learn reads."""

    def pre_learn(self) -> None:
        """Runs on the event loop right before learn()."""

    def post_learn(self) -> None:
        """Runs on the event loop right after learn(). Overrides must call super(): it resets rollout/*."""
        self._episodes = []

    def should_learn(self) -> bool:
        """True when learn() should run. No inference happens while it is true."""
        return False

    def should_save(self) -> bool:
        """True when a checkpoint is due; must turn false once create_checkpoint() has run."""
        return False

    def should_stop(self) -> bool:
        """True when the run is over (a final checkpoint is written, then every client is told)."""
        return self.config.global_steps is not None and self.global_step >= self.config.global_steps

    def create_checkpoint(self) -> Checkpoint:
        """The policy weights and global_step; save schedule counters in meta."""
        return Checkpoint(step=self.global_step, model=self.policy.state_dict(), optimizer=None, meta={})

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Restore what create_checkpoint saved (called on --resume, after init_optimizers)."""
        self.global_step = checkpoint.step
        if checkpoint.model is not None:
            self.policy.load_state_dict(checkpoint.model)

    def init_optimizers(self) -> None:
        """Runs right after the algorithm is built: build optimizers here."""


@register_algo_config("dummy")
@dataclasses.dataclass
class DummyAlgoConfig(BaseAlgoConfig):
    """The dummy learns nothing: it only keeps the cadence of a real algorithm."""

    global_steps: int | None = 10_000
    learn_every: int = 1_000  # frames between learns
    save_every: int = 100  # learns between checkpoints
    learn_seconds: float = 0.0  # pretend each learn takes this long (0: instant, to measure the loop)


@register_algo("dummy")
class DummyAlgorithm(BaseAlgorithm):
    """The smallest complete algorithm: counts frames, 'learns' every learn_every, saves every save_every."""

    def __init__(self, config: DummyAlgoConfig, policy: BaseTorchPolicy):
        super().__init__(config=config, policy=policy)
        self.frames_since_learn, self.learns, self.saved_at_learn = 0, 0, 0

    def feedback(self, *, obs, runtime_state, train_state=None, terminated, truncated, next_obs, reward, info,
                 next_terminated, next_truncated, prev_node):
        """Count the frame and its finished episode; store nothing."""
        self.discard_feedback(info=info, next_terminated=next_terminated, next_truncated=next_truncated)
        self.global_step += 1
        self.frames_since_learn += 1
        return prev_node, self.global_step, {}

    def learn_impl(self):
        """Nothing to learn; moving frames_since_learn is what turns should_learn false."""
        time.sleep(self.config.learn_seconds)
        self.frames_since_learn, self.learns = 0, self.learns + 1
        return self.global_step, {"train/learns": self.learns}

    def should_learn(self):
        """Every learn_every stored frames."""
        return self.frames_since_learn >= self.config.learn_every

    def should_save(self):
        """Every save_every learns; create_checkpoint records the learn it saved."""
        return self.learns - self.saved_at_learn >= self.config.save_every

    def create_checkpoint(self):
        """Weights, and the counters the schedule reads in meta."""
        self.saved_at_learn = self.learns
        meta = {"frames_since_learn": self.frames_since_learn, "learns": self.learns, "saved_at_learn": self.learns}
        return Checkpoint(step=self.global_step, model=self.policy.state_dict(), optimizer=None, meta=meta)

    def load_checkpoint(self, checkpoint):
        """Restore the weights and every counter, so the cadence continues exactly."""
        super().load_checkpoint(checkpoint)
        self.frames_since_learn = checkpoint.meta["frames_since_learn"]
        self.learns, self.saved_at_learn = checkpoint.meta["learns"], checkpoint.meta["saved_at_learn"]


# ===== 6. Server: the asyncio WebSocket loop (batched infer, routing, learn, save, stop) =====
# PlugRL page: "Server contract" and "What the loop implies for the hooks".

RUN_FINISHED = "run finished"  # the close reason that tells a client the run is over (exit 0)
SERVER_FAILED = "server failed"  # the close reason's prefix when the algorithm raised
MAX_MESSAGE_BYTES = 16 * 2**20


@dataclasses.dataclass(eq=False)
class EnvSlot:
    """What the server keeps for one environment of one connection."""

    waiting: bool = False  # its infer is queued, its action not yet sent
    step: tuple | None = None  # (infer batch, row) of the action it was given and owes feedback for
    terminated: bool = False  # the previous frame's flags: feedback's terminated/truncated
    truncated: bool = False
    prev_node: tuple = (-1, "")  # what feedback returned for this environment last time


@dataclasses.dataclass(eq=False)
class Connection:
    """One env client: its WebSocket, its environments, and how long it has owed feedback."""

    ws: typing.Any
    slots: dict = dataclasses.field(default_factory=dict)
    owed: int = 0  # environments that were given an action and sent no feedback yet
    owed_since: float = 0.0


def save_checkpoint(run_dir: str, checkpoint: Checkpoint, server_counters: dict, keep: int = 3) -> str:
    """Write a checkpoint to a temporary file and rename it into place: a crash never damages the last good one."""
    folder = os.path.join(run_dir, "checkpoints")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"step_{checkpoint.step:012d}.pt")
    payload = {"step": checkpoint.step, "model": checkpoint.model, "optimizer": checkpoint.optimizer,
               "meta": checkpoint.meta, "server": server_counters}  # not asdict(): it deep-copies every tensor
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    buffer.seek(0)
    try:  # a checkpoint that cannot be resumed from must fail the run now, not at --resume
        torch.load(buffer, weights_only=True)
    except Exception as error:
        raise TypeError("create_checkpoint returned a value that torch.load(weights_only=True) refuses: keep "
                        "tensors and plain Python values (numpy scalars and arrays are the usual culprits)") from error
    with open(path + ".tmp", "wb") as file:
        file.write(buffer.getbuffer())
        file.flush()
        os.fsync(file.fileno())
    os.replace(path + ".tmp", path)
    for old in sorted(glob.glob(os.path.join(folder, "step_*.pt")))[:-keep]:
        os.remove(old)
    return path


def load_newest_checkpoint(run_dir: str) -> tuple[Checkpoint, dict]:
    """The newest checkpoint that loads (a damaged one is skipped), and the server's counters saved with it."""
    for path in sorted(glob.glob(os.path.join(run_dir, "checkpoints", "step_*.pt")), reverse=True):
        try:
            payload = torch.load(path, weights_only=True)
        except Exception as error:  # a file cut short by a crash: fall back to the one before
            print(f"skipping damaged checkpoint {path}: {error}", file=sys.stderr)
            continue
        server = payload.pop("server")
        return Checkpoint(**payload), server
    raise FileNotFoundError(f"nothing to resume in {run_dir}: no loadable checkpoints/step_*.pt")


class Server:
    """One run: the algorithm behind a WebSocket endpoint, writing to its run directory.

    Client handlers only validate and queue messages; one control task talks to the algorithm,
    so no hook ever runs concurrently with another (learn runs in a worker thread, alone).
    """

    def __init__(self, algo: BaseAlgorithm, run_dir: str, names: tuple[str, str], *,
                 max_message_bytes: int = MAX_MESSAGE_BYTES, feedback_timeout: float = 60.0,
                 token: str | None = None, global_step: int = 0, policy_version: int = 0,
                 learn_threads: int | None = None):
        self.algo, self.run_dir = algo, run_dir
        self.max_message_bytes, self.feedback_timeout, self.token = max_message_bytes, feedback_timeout, token
        self.global_step, self.version = global_step, policy_version
        policy = algo.policy
        self.obs_spec = {key: (tuple(shape), np.dtype(dtype)) for key, (shape, dtype) in policy.obs_spec.items()}
        self.action_shape = (policy.action_horizon, policy.action_dim)
        self.metadata = {"message_type": "metadata", "protocol_version": PROTOCOL_VERSION,
                         "policy": names[0], "algorithm": names[1],
                         "obs_spec": {key: {"shape": list(shape), "dtype": dtype.name}
                                      for key, (shape, dtype) in self.obs_spec.items()},
                         "action_dim": policy.action_dim, "action_horizon": policy.action_horizon}
        self.connections = set()  # the open ones: a connection leaves as soon as it is closed or rejected
        self.inbox = []  # validated messages, in arrival order
        self.waiting = []  # infer requests held while should_learn() is true
        self.stop_requested, self.learned_at = False, 0.0
        self.tasks = set()  # background tasks (asyncio keeps only weak references to them)
        self.infer_calls, self.inferred_envs, self.frames, self.learns = 0, 0, 0, 0
        self.feedback_log, self.last_log = {}, {}
        self.started = self.shown_at = time.perf_counter()
        # Every learn() runs in this one OS thread, with all of torch's threads (its batches are large). Not
        # asyncio.to_thread: torch's thread count and OpenMP team are per OS thread, and it may switch workers.
        self.learn_executor = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="learn", initializer=torch.set_num_threads,
            initargs=(learn_threads or torch.get_num_threads(),))

    # --- the wire side: one task per connection --------------------------------------------

    def check_token(self, connection, request):
        """process_request hook: refuse, at the handshake, a client without the run's token."""
        if self.token is None:
            return None
        given = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
        if not hmac.compare_digest(given, f"Bearer {self.token}".encode()):  # constant time
            return connection.respond(401, "missing or wrong token\n")
        return None

    async def handle_client(self, ws) -> None:
        """Send the metadata, then validate and queue every message; a bad one closes this connection alone."""
        conn = Connection(ws)
        self.connections.add(conn)
        try:
            await ws.send(pack_message(self.metadata))
            async for frame in ws:
                try:
                    self.inbox.append(self.accept(conn, unpack_message(frame)))
                except Exception as error:  # whatever a client sends costs only its own connection
                    if not isinstance(error, ProtocolError):
                        error = ProtocolError(f"malformed message ({type(error).__name__}: {error})")
                    await self.reject(conn, error)
                    return
                self.wake.set()
        except websockets.ConnectionClosed:
            pass
        finally:
            # Queued infers of a closed connection are skipped; its fed frames were complete messages.
            self.connections.discard(conn)

    async def reject(self, conn: Connection, error: ProtocolError) -> None:
        """Tell the client what was wrong, then close its connection (and no other)."""
        self.connections.discard(conn)
        try:
            await conn.ws.send(pack_message({"message_type": "error", "message": str(error), "hint": error.hint}))
            await conn.ws.close(1008, str(error).encode()[:120].decode(errors="ignore"))
        except websockets.ConnectionClosed:
            pass

    def accept(self, conn: Connection, message: dict) -> tuple:
        """Check one message against the protocol and this connection's state; return the queued item."""
        kind = message.get("message_type")
        if kind not in ("infer", "feedback"):
            raise ProtocolError(f"unknown message_type {str(kind)[:40]!r}", "clients send 'infer' or 'feedback'")
        indices = message.get("env_indices")
        if not (isinstance(indices, np.ndarray) and indices.dtype == np.int64 and indices.ndim == 1):
            raise ProtocolError("env_indices must be an int64 array [n]")
        env_ids = indices.tolist()
        if len(set(env_ids)) != len(env_ids) or min(env_ids, default=0) < 0:
            raise ProtocolError("env_indices must be distinct and non-negative", "send each environment once")
        obs = self.check_obs(message.get("obs"), len(env_ids))
        if kind == "infer":
            slots = [conn.slots[i] if i in conn.slots else conn.slots.setdefault(i, EnvSlot()) for i in env_ids]
            if any(slot.waiting or slot.step for slot in slots):
                raise ProtocolError("infer for an environment that owes feedback for its last action",
                                    "send feedback after every action, before the next infer")
            for slot in slots:
                slot.waiting = True
            return ("infer", conn, indices, obs)
        m = len(env_ids)
        reward, terminated, truncated = (message.get(key) for key in ("reward", "terminated", "truncated"))
        if not (isinstance(reward, np.ndarray) and reward.dtype.kind in "iuf" and reward.shape[:1] == (m,)
                and reward.ndim in (1, 2) and np.isfinite(reward).all()):
            raise ProtocolError("reward must be finite numbers [m] (or [m, k] for 'stack')")
        for name, flags in (("terminated", terminated), ("truncated", truncated)):
            if not (isinstance(flags, np.ndarray) and flags.dtype == np.bool_ and flags.shape == (m,)):
                raise ProtocolError(f"{name} must be a bool array [m]")
        info = message.get("info", {})
        if not isinstance(info, dict) or not all(isinstance(leaf, np.ndarray) and leaf.shape[:1] == (m,)
                                                 for leaf in _leaves(info)):
            raise ProtocolError("info must be a dict whose arrays are batched [m, ...]")
        episode = info.get("episode")
        # record_episode_metrics reads these as numbers: a bad one must not reach the algorithm.
        if episode is not None and not (isinstance(episode, dict) and all(
                isinstance(episode.get(key), np.ndarray) and episode[key].shape == (m,)
                and np.isfinite(episode[key]).all() for key in ("r", "l", "s", "mask"))):
            raise ProtocolError("info['episode'] needs finite numbers r, l, s and a bool mask, each [m]")
        slots = [conn.slots.get(i) for i in env_ids]
        if any(slot is None or slot.step is None for slot in slots):
            raise ProtocolError("feedback for an environment that has no action",
                                "send feedback only for the environments of the last action message")
        steps = [slot.step for slot in slots]
        for slot in slots:
            slot.step = None
        conn.owed -= m
        return ("feedback", conn, steps, slots, obs, reward, terminated.tolist(), truncated.tolist(), info)

    def check_obs(self, obs, n: int) -> dict:
        """Observations must match the policy's obs_spec exactly, batched [n, ...], and be finite."""
        if not isinstance(obs, dict) or obs.keys() != self.obs_spec.keys():
            raise ProtocolError(f"obs keys {sorted(obs) if isinstance(obs, dict) else obs!r} are not the policy's "
                                f"{sorted(self.obs_spec)}", "send the keys of obs_spec in the metadata")
        for key, (shape, dtype) in self.obs_spec.items():
            array = obs[key]
            if not (isinstance(array, np.ndarray) and array.shape == (n, *shape) and array.dtype == dtype):
                got = f"{array.dtype} {list(array.shape)}" if isinstance(array, np.ndarray) else type(array).__name__
                raise ProtocolError(f"obs[{key!r}] is {got}, the policy reads {dtype} {[n, *shape]}",
                                    "match obs_spec in the metadata")
            if dtype.kind == "f" and not np.isfinite(array).all():
                raise ProtocolError(f"obs[{key!r}] holds NaN or infinity", "check the environment's observations")
        return obs

    # --- the algorithm side: one control task ---------------------------------------------

    async def control_loop(self) -> None:
        """Route feedback, learn while should_learn(), save, stop, then answer the waiting infers."""
        while True:
            await self.wake.wait()
            self.wake.clear()
            inbox, self.inbox = self.inbox, []
            for item in inbox:
                if item[0] == "feedback":
                    self.route_feedback(*item[1:])
                else:
                    self.waiting.append(item)
            # No inference while should_learn() is true; learn again if it stays true.
            while self.algo.should_learn():
                await self.learn_once()
            stop = self.stop_requested or self.algo.should_stop()
            if stop or self.algo.should_save():
                save_checkpoint(self.run_dir, self.algo.create_checkpoint(),
                                {"global_step": self.global_step, "policy_version": self.version})
            if stop:
                return
            if self.waiting:
                await self.infer_waiting()
            self.drop_silent_clients()
            self.show_progress()

    def route_feedback(self, conn, steps, slots, next_obs, reward, terminated, truncated, info) -> None:
        """The routing rule: feedback() for frames that will be stored, discard_feedback() for the rest."""
        for j, ((batch, row), slot) in enumerate(zip(steps, slots)):
            obs, runtime_state, train_state, version = batch
            env_info = slice_rows(info, j)
            # A replay-buffer learner (not on_policy) stores every frame that has a step state; an on-policy
            # one only frames whose action came from the current policy, while no learn is due.
            if not self.algo.on_policy or (version == self.version and not self.algo.should_learn()):
                slot.prev_node, self.global_step, log = self.algo.feedback(
                    obs=slice_rows(obs, row), runtime_state=slice_rows(runtime_state, row),
                    train_state=slice_rows(train_state, row), terminated=slot.terminated,
                    truncated=slot.truncated, next_obs=slice_rows(next_obs, j),
                    reward=reward[j] if reward.ndim == 2 else float(reward[j]), info=env_info,
                    next_terminated=terminated[j], next_truncated=truncated[j], prev_node=slot.prev_node)
                self.feedback_log.update(log)
            else:
                self.algo.discard_feedback(info=env_info, next_terminated=terminated[j], next_truncated=truncated[j])
            slot.terminated, slot.truncated = terminated[j], truncated[j]
        self.frames += len(steps)

    async def learn_once(self) -> None:
        """pre_learn, learn() in a worker thread (the event loop keeps answering), post_learn, new version."""
        self.algo.pre_learn()
        self.global_step, log = await asyncio.get_running_loop().run_in_executor(self.learn_executor, self.algo.learn)
        self.learned_at = time.monotonic()  # the feedback clock stood still while learning
        self.algo.post_learn()
        self.version += 1
        self.learns += 1
        elapsed = time.perf_counter() - self.started
        log = {**self.feedback_log, **log, "server/policy_version": self.version, "server/fps": self.frames / elapsed,
               "server/mean_batch_size": self.inferred_envs / max(self.infer_calls, 1)}
        self.feedback_log = {}
        if log.get("rollout/episodes", 1):  # keep the last learn that saw episodes for the progress line
            self.last_log = log
        plain = {key: value.item() if hasattr(value, "item") else value for key, value in log.items()}  # tensors too
        self.metrics.write(json.dumps({"step": self.global_step, "time": round(elapsed, 3), **plain}) + "\n")

    async def infer_waiting(self) -> None:
        """One infer() for every waiting client: concatenate, infer, derive_train_state, split, send."""
        batch = [item for item in self.waiting if item[1] in self.connections]
        self.waiting = []
        if not batch:
            return
        obs = {key: np.concatenate([item[3][key] for item in batch]) for key in self.obs_spec}
        action, runtime_state = self.algo.infer(obs)
        train_state = self.algo.derive_train_state(runtime_state)
        action = np.asarray(action, np.float32)
        n = len(obs[next(iter(obs))])
        if action.shape != (n, *self.action_shape):
            raise RuntimeError(f"infer returned actions {list(action.shape)}, expected {[n, *self.action_shape]}")
        step, row = (obs, runtime_state, train_state, self.version), 0
        self.infer_calls, self.inferred_envs = self.infer_calls + 1, self.inferred_envs + n
        now = time.monotonic()
        for _, conn, indices, _ in batch:
            for i in indices.tolist():
                slot = conn.slots[i]
                slot.waiting, slot.step, row = False, (step, row), row + 1
            if conn.owed == 0:
                conn.owed_since = now
            conn.owed += len(indices)
            reply = pack_message({"message_type": "action", "env_indices": indices,
                                  "action": action[row - len(indices):row]})
            try:
                await conn.ws.send(reply)
            except websockets.ConnectionClosed:
                pass

    def drop_silent_clients(self) -> None:
        """A client owing feedback for --feedback-timeout seconds is dropped; time spent learning does not count."""
        limit = time.monotonic() - self.feedback_timeout
        for conn in list(self.connections):
            if conn.owed and max(conn.owed_since, self.learned_at) < limit:
                self.connections.discard(conn)  # once: the task below runs after this pass
                error = ProtocolError(f"no feedback for {self.feedback_timeout:g} s",
                                      "send feedback after every action")
                task = asyncio.create_task(self.reject(conn, error))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)

    def show_progress(self) -> None:
        """One progress line, refreshed in place on a terminal every second, a plain line every 10 s otherwise."""
        now = time.perf_counter()
        tty = sys.stdout.isatty()
        if now - self.shown_at < (1.0 if tty else 10.0):
            return
        self.shown_at = now
        line = (f"step {self.global_step}/{self.algo.config.global_steps} | "
                f"{self.frames / (now - self.started):.0f} fps | "
                f"rollout/reward {self.last_log.get('rollout/reward', float('nan')):.2f} | "
                f"batch {self.inferred_envs / max(self.infer_calls, 1):.1f}")
        print("\r" + line if tty else line, end="" if tty else "\n", flush=True)

    async def tick(self) -> None:
        """Wake the control loop twice a second, so timeouts, progress and should_stop are checked while idle."""
        while True:
            await asyncio.sleep(0.5)
            self.wake.set()

    def request_stop(self) -> None:
        """SIGINT/SIGTERM: finish the current step, write a final checkpoint, tell the clients, exit 0."""
        self.stop_requested = True
        self.wake.set()

    async def run(self, host: str, port: int, on_listening=None) -> int:
        """Serve until should_stop() (exit status 0) or an algorithm error (status 1)."""
        self.wake = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(signum, self.request_stop)
        os.makedirs(self.run_dir, exist_ok=True)
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a", buffering=1) as self.metrics:
            async with serve(self.handle_client, host, port, max_size=self.max_message_bytes, compression=None,
                             process_request=self.check_token) as server:
                port = server.sockets[0].getsockname()[1]
                print(f"listening on ws://{host}:{port}", flush=True)
                if on_listening is not None:
                    on_listening(port)
                ticker = asyncio.create_task(self.tick())
                try:
                    await self.control_loop()
                    code, reason, status = 1000, RUN_FINISHED, 0
                except Exception as error:  # an algorithm hook raised: no checkpoint is written after it
                    traceback.print_exc()
                    code, reason, status = 1011, f"{SERVER_FAILED}: {type(error).__name__}", 1
                ticker.cancel()
                await asyncio.gather(*(conn.ws.close(code, reason) for conn in list(self.connections)),
                                     return_exceptions=True)
        print(f"\n{reason}: global step {self.global_step}, {self.learns} learns", flush=True)
        return status


def _leaves(tree):
    """Every non-dict value of a nested dict."""
    for value in tree.values():
        yield from _leaves(value) if isinstance(value, dict) else (value,)


# ===== 7. Environment client: environments, executing a decision, the rollout loop =====
# PlugRL page: the client of its smoke test (plugrl-run-env-client dummy-v1).

class VecEnv:
    """num_envs environments stepped together in numpy; every built-in environment is one.

    Subclasses write _reset(rows), _step(action, rows) -> (reward, terminated, success) and _observe().
    """

    obs_dim, action_dim, max_steps = 3, 1, 10**9

    def __init__(self, num_envs: int, seed: int | None = None):
        self.num_envs, self.rng = num_envs, np.random.default_rng(seed)
        self.obs_spec = {"state": ((self.obs_dim,), "float32")}
        self.episode_return, self.episode_length = np.zeros(num_envs), np.zeros(num_envs, np.int64)
        self.terminated, self.truncated, self.success = (np.zeros(num_envs, bool) for _ in range(3))

    def reset(self, indices=None) -> dict:
        """Start new episodes in the given environments (all by default); returns every observation."""
        rows = np.arange(self.num_envs) if indices is None else np.asarray(indices, np.int64)
        self._reset(rows)
        for array in (self.episode_return, self.episode_length, self.terminated, self.truncated, self.success):
            array[rows] = 0
        return {"state": self._observe()}

    def step(self, action, active=None) -> tuple:
        """One physical step of the active environments; the others stand still (same obs, reward 0, same flags).

        Returns (obs, reward, terminated, truncated, info); info["episode"] (r, l, s, mask) holds finished episodes.
        """
        active = np.ones(self.num_envs, bool) if active is None else np.asarray(active, bool)
        rows = np.flatnonzero(active)
        reward = np.zeros(self.num_envs, np.float32)
        reward[rows], terminated, self.success[rows] = self._step(np.asarray(action)[rows], rows)
        self.episode_return[rows] += reward[rows]
        self.episode_length[rows] += 1
        self.terminated[rows] = terminated
        self.truncated[rows] = ~terminated & (self.episode_length[rows] >= self.max_steps)
        done = active & (self.terminated | self.truncated)
        episode = {"r": np.where(done, self.episode_return, 0).astype(np.float32),
                   "l": np.where(done, self.episode_length, 0), "s": done & self.success, "mask": done}
        return {"state": self._observe()}, reward, self.terminated.copy(), self.truncated.copy(), {"episode": episode}


class DummyEnv(VecEnv):
    """dummy-v1: a point on [-1, 1] must reach a target. obs [x, target, target - x], action moves x by 0.2·a.

    Reward -|target - x| per step; the episode terminates (a success) within 0.05 of the target,
    truncates after 50 steps. A random policy scores about -25, a good one about -3.
    """

    max_steps = 50

    def __init__(self, num_envs, seed=None):
        self.x, self.target = np.zeros(num_envs), np.zeros(num_envs)
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.x[rows], self.target[rows] = self.rng.uniform(-1, 1, (2, len(rows)))

    def _step(self, action, rows):
        self.x[rows] = np.clip(self.x[rows] + 0.2 * np.clip(action[:, 0], -1, 1), -1, 1)
        distance = np.abs(self.target[rows] - self.x[rows])
        return -distance, distance < 0.05, distance < 0.05

    def _observe(self):
        return np.stack([self.x, self.target, self.target - self.x], axis=1).astype(np.float32)

    def position_velocity(self, state):
        """What a tracking controller steers: the position x (this point has no inertia)."""
        return state[:, 0], np.zeros(len(state), np.float32)


class PendulumEnv(VecEnv):
    """pendulum-v1: Gymnasium's Pendulum-v1 in numpy. obs [cos θ, sin θ, θ̇]; action in [-1, 1] is torque / 2."""

    max_steps = 200

    def __init__(self, num_envs, seed=None):
        self.theta, self.theta_dot = np.zeros(num_envs), np.zeros(num_envs)
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        self.theta[rows] = self.rng.uniform(-np.pi, np.pi, len(rows))
        self.theta_dot[rows] = self.rng.uniform(-1, 1, len(rows))

    def _step(self, action, rows):
        g, m, length, dt = 10.0, 1.0, 1.0, 0.05
        u = 2.0 * np.clip(action[:, 0], -1, 1)
        theta, theta_dot = self.theta[rows], self.theta_dot[rows]
        upright = (theta + np.pi) % (2 * np.pi) - np.pi
        cost = upright**2 + 0.1 * theta_dot**2 + 0.001 * u**2
        theta_dot = np.clip(theta_dot + (3 * g / (2 * length) * np.sin(theta) + 3.0 / (m * length**2) * u) * dt, -8, 8)
        self.theta[rows], self.theta_dot[rows] = theta + theta_dot * dt, theta_dot
        return -cost, np.zeros(len(rows), bool), np.abs(upright) < 0.1

    def _observe(self):
        return np.stack([np.cos(self.theta), np.sin(self.theta), self.theta_dot], axis=1).astype(np.float32)

    def position_velocity(self, state):
        """What a tracking controller steers: the angle θ and its rate."""
        return np.arctan2(state[:, 1], state[:, 0]), state[:, 2]


class CountingEnv(VecEnv):
    """counting-v1: obs = physical steps taken this episode, reward 1 a step; env i terminates after 4 + i."""

    obs_dim = 1

    def _reset(self, rows):
        pass  # the step count is the base class's episode_length

    def _step(self, action, rows):
        return np.ones(len(rows)), self.episode_length[rows] + 1 >= 4 + rows, np.ones(len(rows), bool)

    def _observe(self):
        return self.episode_length[:, None].astype(np.float32)


class GymEnv(VecEnv):
    """gym:ENV_ID: any Gymnasium environment with a Box action space; actions in [-1, 1] are scaled to it."""

    def __init__(self, env_id, num_envs, seed=None):
        try:
            import gymnasium
        except ImportError:
            raise SystemExit(f"gym:{env_id} needs gymnasium: pip install gymnasium") from None
        made = [gymnasium.make(env_id) for _ in range(num_envs)]
        self.envs = [env.unwrapped for env in made]  # the time limit is kept as max_steps below
        space = made[0].action_space
        if not isinstance(space, gymnasium.spaces.Box):
            raise SystemExit(f"gym:{env_id} has a {type(space).__name__} action space; only Box is supported")
        self.low, self.high = space.low, space.high
        self.obs_dim, self.action_dim = int(np.prod(made[0].observation_space.shape)), int(np.prod(space.shape))
        self.max_steps = made[0].spec.max_episode_steps or 10**9
        self.last = np.zeros((num_envs, self.obs_dim), np.float32)
        for i, env in enumerate(self.envs if seed is not None else []):
            env.reset(seed=seed + i)  # seeds each environment's generator once; later resets continue it
        super().__init__(num_envs, seed)

    def _reset(self, rows):
        for i in rows:
            self.last[i] = np.ravel(self.envs[i].reset()[0])

    def _step(self, action, rows):
        reward, terminated, success = np.zeros(len(rows)), np.zeros(len(rows), bool), np.zeros(len(rows), bool)
        for j, i in enumerate(rows):
            scaled = self.low + (np.clip(action[j], -1, 1) + 1) / 2 * (self.high - self.low)
            obs, reward[j], terminated[j], _, info = self.envs[i].step(scaled)
            self.last[i], success[j] = np.ravel(obs), info.get("is_success", False)
        return reward, terminated, success

    def _observe(self):
        return self.last.copy()


ENVIRONMENTS = {"dummy-v1": DummyEnv, "pendulum-v1": PendulumEnv, "counting-v1": CountingEnv}


def make_env(env_id: str, num_envs: int = 1, seed: int | None = None) -> VecEnv:
    """A built-in environment by id, or gym:ENV_ID for a Gymnasium one."""
    if env_id.startswith("gym:"):
        return GymEnv(env_id[4:], num_envs, seed)
    if env_id not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {env_id!r}; known: {', '.join(ENVIRONMENTS)}, gym:ENV_ID")
    return ENVIRONMENTS[env_id](num_envs, seed)


# --- Executing a decision: one server action, one or more physical steps ---------------------

class Controller:
    """A low-level controller: at every physical step, (obs, decision, state) -> (physical action, state).

    A state is an array or a dict of arrays batched along axis 0, one row per environment.
    """

    decision_dim = 1

    def initial_state(self, n: int):
        """The state of n environments at the start of an episode."""
        return np.zeros((n, 0), np.float32)

    def reset_state(self, state, indices):
        """The state with the rows of `indices` started over (their environments were reset)."""
        n = len(next(_leaves(state))) if isinstance(state, dict) else len(state)
        return _where_rows(np.isin(np.arange(n), indices), self.initial_state(n), state)

    def __call__(self, obs: dict, decision: np.ndarray, state):
        """The physical action [n, action_dim] and the new state."""
        raise NotImplementedError


def _where_rows(mask, new, old):
    """Rows of new where mask is true, rows of old elsewhere (arrays, or dicts of arrays)."""
    if isinstance(old, dict):
        return {key: _where_rows(mask, new[key], value) for key, value in old.items()}
    return np.where(mask.reshape(-1, *[1] * (np.ndim(old) - 1)), new, old)


class PassThroughController(Controller):
    """For counting-v1: the physical action is the decision; the state counts the calls per environment."""

    def initial_state(self, n):
        return np.zeros(n, np.int64)

    def __call__(self, obs, decision, state):
        return decision, state + 1


class TrackingController(Controller):
    """For dummy-v1 and pendulum-v1: a PD law that steers the position toward the decision as a target.

    The server's policy sets targets once per round trip; this runs at every physical step.
    """

    def __init__(self, env: VecEnv, kp: float = 5.0, kd: float = 1.0, scale: float = 1.0):
        self.env, self.kp, self.kd, self.scale = env, kp, kd, scale

    def __call__(self, obs, decision, state):
        position, velocity = self.env.position_velocity(obs["state"])
        error = (self.scale * decision[:, 0] - position + np.pi) % (2 * np.pi) - np.pi
        return np.clip(self.kp * error - self.kd * velocity, -1, 1)[:, None], state


def make_controller(name: str, env: VecEnv) -> Controller:
    """A built-in controller by name: pass-through (counting-v1) or track (dummy-v1, pendulum-v1)."""
    if name == "pass-through":
        return PassThroughController()
    if name == "track" and hasattr(env, "position_velocity"):
        return TrackingController(env, scale=np.pi if isinstance(env, PendulumEnv) else 1.0)
    raise ValueError(f"unknown controller {name!r} for this environment; known: pass-through, track "
                     "(track needs dummy-v1 or pendulum-v1)")


REWARD_AGGREGATIONS = ("sum", "mean", "last", "stack")


def execute_decision(env: VecEnv, obs: dict, steps: int, physical_action, reward_aggregation: str,
                     stack_observations: bool = False) -> tuple:
    """The inner loop shared by MultiAction and ClosedLoopMultiAction.

    physical_action(t, obs, active) gives the action of physical step t. An environment that ends stops
    stepping for the rest of the decision; the frame's observation and flags are its last executed step's.
    """
    n = env.num_envs
    active, executed = np.ones(n, bool), np.zeros(n, np.int64)
    rewards = np.zeros((n, steps), np.float32)
    seen, episode = [obs], None
    for t in range(steps):
        obs, rewards[:, t], terminated, truncated, info = env.step(physical_action(t, obs, active), active)
        executed += active
        finished = info["episode"]  # keep each environment's episode from the step where it ended
        episode = finished if episode is None else {key: np.where(finished["mask"], value, episode[key])
                                                    for key, value in finished.items()}
        active &= ~(terminated | truncated)
        seen.append(obs)
        if not active.any():
            break
    if reward_aggregation == "sum":
        reward = rewards.sum(1)
    elif reward_aggregation == "mean":
        reward = rewards.sum(1) / executed  # every environment executes the first step
    elif reward_aggregation == "last":
        reward = rewards[np.arange(n), executed - 1]
    else:  # stack: zero-filled to `steps` while some env still runs, one trailing zero if all stopped early
        reward = rewards[:, :min(steps, executed.max() + 1)]
    if stack_observations:  # observations after each physical step, the last one repeated to `steps`
        seen = seen[1:] + [seen[-1]] * (steps + 1 - len(seen))
        obs = {key: np.stack([o[key] for o in seen], axis=1) for key in obs}
    return obs, reward, terminated, truncated, {"episode": episode, "executed_steps": executed}


def _check_choice(steps, reward_aggregation, name="steps"):
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 1:
        raise ValueError(f"{name} must be an integer of at least 1, got {steps!r}")
    if reward_aggregation not in REWARD_AGGREGATIONS:
        raise ValueError(f"reward_aggregation must be one of {', '.join(REWARD_AGGREGATIONS)}, "
                         f"got {reward_aggregation!r}")


class MultiAction:
    """Open loop: an action chunk [n, H, action_dim] executed step by step, up to replan_steps."""

    def __init__(self, env: VecEnv, replan_steps: int | None = None, reward_aggregation: str = "sum"):
        _check_choice(1 if replan_steps is None else replan_steps, reward_aggregation, "replan_steps")
        self.env, self.replan_steps, self.reward_aggregation = env, replan_steps, reward_aggregation
        self.obs = None

    def reset(self, indices=None) -> dict:
        """Reset all or some environments; returns every observation."""
        self.obs = self.env.reset(indices)
        return self.obs

    def step(self, action) -> tuple:
        """Execute one chunk; returns (obs, reward, terminated, truncated, info) of the whole decision."""
        chunk = np.asarray(action)
        if (chunk.ndim != 3 or chunk.shape[0] != self.env.num_envs or chunk.shape[1] < 1
                or chunk.shape[2] != self.env.action_dim):
            raise ValueError(f"action chunk must be [{self.env.num_envs}, H >= 1, {self.env.action_dim}], "
                             f"got {list(chunk.shape)}")
        steps = chunk.shape[1] if self.replan_steps is None else min(chunk.shape[1], self.replan_steps)
        result = execute_decision(self.env, self.obs, steps, lambda t, obs, active: chunk[:, t],
                                  self.reward_aggregation)
        self.obs = result[0]
        return result


class ClosedLoopMultiAction:
    """Closed loop: a decision [n, decision_dim] held for `steps` physical steps, acted out by a controller
    that sees the fresh observation at every step. With steps=1 it is exactly one plain step.
    """

    def __init__(self, env: VecEnv, controller: Controller, steps: int, reward_aggregation: str = "sum",
                 stack_observations: bool = False):
        _check_choice(steps, reward_aggregation)
        self.env, self.controller, self.steps = env, controller, int(steps)
        self.reward_aggregation, self.stack_observations = reward_aggregation, stack_observations
        self.state, self.obs = controller.initial_state(env.num_envs), None

    def reset(self, indices=None) -> dict:
        """Reset all or some environments and their controller state; returns every observation."""
        self.obs = self.env.reset(indices)
        self.state = (self.controller.initial_state(self.env.num_envs) if indices is None
                      else self.controller.reset_state(self.state, np.asarray(indices, np.int64)))
        return self.obs

    def step(self, decision) -> tuple:
        """Execute one decision; returns (obs, reward, terminated, truncated, info) of the whole decision."""
        decision = np.asarray(decision, np.float32)
        if decision.shape != (self.env.num_envs, self.controller.decision_dim):
            raise ValueError(f"decision must be [{self.env.num_envs}, {self.controller.decision_dim}], "
                             f"got {list(decision.shape)}")

        def physical_action(t, obs, active):
            action, state = self.controller(obs, decision, self.state)
            # A finished environment's controller state stays frozen until its reset.
            self.state = _where_rows(active, state, self.state)
            return action

        result = execute_decision(self.env, self.obs, self.steps, physical_action, self.reward_aggregation,
                                  self.stack_observations)
        # With stacked observations, the newest one is the last of the stack.
        self.obs = {key: value[:, -1] for key, value in result[0].items()} if self.stack_observations else result[0]
        return result


# --- The rollout loop ------------------------------------------------------------------------

async def _connect(args):
    """Connect to the server, retrying with backoff for --connect-timeout seconds."""
    uri = f"ws://{args.server_host}:{args.server_port}"
    headers = {"Authorization": f"Bearer {args.token}"} if args.token else None
    deadline, delay = time.monotonic() + args.connect_timeout, 0.05
    while True:
        try:
            return await connect(uri, additional_headers=headers, max_size=args.max_message_bytes,
                                 compression=None, proxy=None)
        except websockets.InvalidStatus as error:
            raise SystemExit(f"the server refused the connection (HTTP {error.response.status_code}): "
                             "wrong or missing --token?") from None
        except (OSError, asyncio.TimeoutError, websockets.InvalidHandshake) as error:
            if time.monotonic() > deadline:
                raise SystemExit(f"no server at {uri} after {args.connect_timeout:g} s ({error})") from None
            await asyncio.sleep(delay)
            delay = min(2 * delay, 1.0)


def _check_metadata(meta: dict, executor, closed_loop: bool) -> None:
    """Stop with a clear message when the server's policy does not fit this environment."""
    if meta.get("message_type") != "metadata" or meta.get("protocol_version") != PROTOCOL_VERSION:
        raise SystemExit(f"the server speaks protocol {meta.get('protocol_version')}, this client {PROTOCOL_VERSION}")
    env = executor.env
    decision_dim = executor.controller.decision_dim if closed_loop else env.action_dim
    mine = {key: {"shape": list(shape), "dtype": np.dtype(dtype).name} for key, (shape, dtype) in env.obs_spec.items()}
    problems = []
    if meta["obs_spec"] != mine:
        problems.append(f"the policy reads observations {meta['obs_spec']}, this environment gives {mine}")
    if meta["action_dim"] != decision_dim:
        problems.append(f"the policy acts with action_dim {meta['action_dim']}, this client needs {decision_dim}")
    if closed_loop and meta["action_horizon"] != 1:
        problems.append(f"a closed loop takes one decision, the policy sends {meta['action_horizon']}")
    if problems:
        raise SystemExit("the server's policy does not fit this environment: " + "; ".join(problems)
                         + " (set --policy.obs-dim / --policy.action-dim on the server)")


async def _run_episodes(ws, executor, num_episodes: int, tally: dict):
    """Infer, execute, feed back, reset finished environments, until num_episodes have finished."""
    env, closed_loop = executor.env, isinstance(executor, ClosedLoopMultiAction)
    _check_metadata(unpack_message(await ws.recv()), executor, closed_loop)
    indices = np.arange(env.num_envs, dtype=np.int64)
    while len(tally["returns"]) < num_episodes:
        await ws.send(pack_message({"message_type": "infer", "env_indices": indices, "obs": executor.obs}))
        reply = unpack_message(await ws.recv())
        if reply.get("message_type") == "error":
            raise SystemExit(f"the server refused a message: {reply['message']} (hint: {reply['hint']})")
        action = reply["action"][:, 0] if closed_loop else reply["action"]
        obs, reward, terminated, truncated, info = executor.step(action)
        done = terminated | truncated
        if done.any():  # the frame carries the terminal observation; the next infer the reset one
            executor.reset(np.flatnonzero(done))
        episode = info["episode"]
        tally["returns"] += episode["r"][episode["mask"]].tolist()
        tally["env_steps"] += int(info["executed_steps"].sum())
        tally["decisions"] += env.num_envs
        info = {"episode": episode} if episode["mask"].any() else {}  # only finished episodes travel
        await ws.send(pack_message({"message_type": "feedback", "env_indices": indices, "obs": obs, "reward": reward,
                                    "terminated": terminated, "truncated": truncated, "info": info}))


async def run_env_client(args) -> int:
    """The env client: connect (and reconnect), run episodes, print and write the summary."""
    env = make_env(args.env_id, args.num_envs, args.seed)
    if args.closed_loop_steps is None:
        executor = MultiAction(env, reward_aggregation=args.reward_aggregation)
    else:
        executor = ClosedLoopMultiAction(env, make_controller(args.controller, env), args.closed_loop_steps,
                                         args.reward_aggregation)
    executor.reset()
    tally = {"returns": [], "env_steps": 0, "decisions": 0}
    start = None
    while True:
        ws = await _connect(args)
        start = start or time.perf_counter()
        try:
            async with ws:
                await _run_episodes(ws, executor, args.num_episodes, tally)
            ending = f"finished {len(tally['returns'])} episodes"
            break
        except websockets.ConnectionClosed as closed:
            reason = closed.rcvd.reason if closed.rcvd else ""
            if reason == RUN_FINISHED:
                ending = "the server ended the run"
                break
            if reason.startswith(SERVER_FAILED):
                raise SystemExit(f"the server failed ({reason}); see its log") from None
            # Any other loss: the server restarted or the network blinked. The decision in flight is
            # dropped (the new server never gave its action) and the environments carry on.
            print(f"lost the server ({closed}); reconnecting", file=sys.stderr)
    seconds = time.perf_counter() - start
    returns = tally.pop("returns")
    summary = {"episodes": len(returns), **tally, "mean_return": float(np.mean(returns)) if returns else float("nan"),
               "seconds": seconds, "returns": returns}
    print(f"{ending}: {summary['episodes']} episodes, mean return {summary['mean_return']:.2f}, "
          f"{summary['env_steps']} env steps, {summary['decisions']} decisions, {seconds:.1f} s, "
          f"{summary['env_steps'] / seconds:.0f} env steps/s", flush=True)
    if args.summary_json:
        with open(args.summary_json, "w") as file:
            json.dump(summary, file)
    return 0


# ===== 8. Command line: the server (POLICY VARIANT ALGO VARIANT) and the env-client =====
# PlugRL page: plugrl-run-server and plugrl-run-env-client, flags from the config dataclasses.

def _flag_type(hint):
    """A converter for one config field's type: int, float, str, bool, or one of these | None."""
    options = [arg for arg in typing.get_args(hint) if arg is not type(None)] or [hint]
    base, optional = options[0], type(None) in typing.get_args(hint)

    def convert(text):
        if optional and text.lower() == "none":
            return None
        if base is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")
            return text.lower() in ("true", "1")
        return base(text) if base in (int, float, str) else json.loads(text)

    convert.__name__ = getattr(base, "__name__", "value")  # argparse says "invalid int value: 'x'"
    return convert


def _add_config_flags(parser, prefix: str, config) -> None:
    """--prefix.field-name for every field of a config dataclass."""
    hints = typing.get_type_hints(type(config))
    group = parser.add_argument_group(f"--{prefix}.* ({type(config).__name__})")
    for field in dataclasses.fields(config):
        default = getattr(config, field.name)
        group.add_argument(f"--{prefix}.{field.name.replace('_', '-')}", dest=f"{prefix}.{field.name}",
                           type=_flag_type(hints[field.name]), default=default, metavar="V",
                           help=f"default: {default}")


def _registered(table) -> str:
    """'uid (variant, ...)' for every uid of a config table."""
    uids = {}
    for uid, variant in table:
        uids.setdefault(uid, []).append(variant)
    return ", ".join(f"{uid} ({', '.join(variants)})" for uid, variants in sorted(uids.items()))


def _choose(table, kind: str, uid: str, variant: str):
    """The registered config of (uid, variant), or a one-line error listing the known ones."""
    if (uid, variant) not in table:
        raise SystemExit(f"error: unknown {kind} {uid!r} variant {variant!r}; known: {_registered(table)}")
    return dataclasses.replace(table[(uid, variant)])


USAGE = """usage: python plugrl_min.py POLICY VARIANT ALGO VARIANT [--algo.FIELD V] [--policy.FIELD V] [server flags]
       python plugrl_min.py env-client ENV_ID [--server-host H] [--server-port P] [--num-episodes N] ...
       add --help after POLICY VARIANT, or after all four, to see more; --plugin MODULE imports a plug-in first"""


def _server_args(argv: list[str]) -> tuple:
    """The four words, their configs (--policy.* and --algo.* applied) and the checked server flags; --help exits."""
    words = []
    for word in argv[:4]:
        if word.startswith("-"):
            break
        words.append(word)
    if len(words) < 2:
        print(f"{USAGE}\n\npolicies: {_registered(_POLICY_CONFIGS)}\nalgorithms: {_registered(_ALGO_CONFIGS)}\n"
              f"environments (env-client): {', '.join(ENVIRONMENTS)}, gym:ENV_ID")
        raise SystemExit(0 if {"-h", "--help"} & set(argv) else 2)
    policy_config = _choose(_POLICY_CONFIGS, "policy", *words[:2])
    if len(words) < 4:
        print(f"usage: python plugrl_min.py {words[0]} {words[1]} ALGO VARIANT [flags]\n\n"
              f"algorithms: {_registered(_ALGO_CONFIGS)}")
        raise SystemExit(0 if {"-h", "--help"} & set(argv) else 2)
    algo_config = _choose(_ALGO_CONFIGS, "algorithm", *words[2:4])
    parser = argparse.ArgumentParser(prog=f"python plugrl_min.py {' '.join(words)}",
                                     description="Serve this policy and algorithm to env clients over WebSocket.")
    _add_config_flags(parser, "policy", policy_config)
    _add_config_flags(parser, "algo", algo_config)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    parser.add_argument("--run-dir", help="where checkpoints and metrics go (default: runs/ALGO-TIME)")
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    parser.add_argument("--seed", type=int, help="seeds torch and numpy on the server (and local clients)")
    parser.add_argument("--local-env-clients", type=int, default=0, metavar="N",
                        help="start N env clients beside the server, so one command trains")
    parser.add_argument("--local-env", default="dummy-v1", help="environment of the local env clients")
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES, help="larger frames close")
    parser.add_argument("--feedback-timeout", type=float, default=60.0,
                        help="drop a client that owes feedback this long (seconds)")
    parser.add_argument("--token", default=os.environ.get("PLUGRL_TOKEN"),
                        help="clients must present this token (default: $PLUGRL_TOKEN)")
    args = parser.parse_args(argv[4:])
    for prefix, config in (("policy", policy_config), ("algo", algo_config)):
        for field in dataclasses.fields(config):
            setattr(config, field.name, getattr(args, f"{prefix}.{field.name}"))
    shared = {f.name for f in dataclasses.fields(policy_config)} & {f.name for f in dataclasses.fields(algo_config)}
    for name in sorted(shared):
        print(f"warning: {name!r} is in both the policy and the algorithm config: keep it in one", file=sys.stderr)
    if args.resume and not args.run_dir:
        raise SystemExit("error: --resume needs --run-dir DIR, the run to continue")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.token:
        print(f"warning: serving on {args.host} without --token: anyone who can reach it can connect",
              file=sys.stderr)
    return words, policy_config, algo_config, args


def server_main(argv: list[str]) -> int:
    """Parse the server command line, build policy and algorithm, optionally resume, and serve."""
    words, policy_config, algo_config, args = _server_args(argv)
    run_dir = args.run_dir or os.path.join("runs", f"{words[2]}-{time.strftime('%Y%m%d-%H%M%S')}")
    resolved = {"policy": words[0], "policy_variant": words[1], "policy_config": dataclasses.asdict(policy_config),
                "algorithm": words[2], "algo_variant": words[3], "algo_config": dataclasses.asdict(algo_config),
                "seed": args.seed}
    print(json.dumps(resolved, indent=2), flush=True)
    if args.seed is not None:
        torch.manual_seed(args.seed)
        np.random.seed(args.seed)
    # Inference batches are small: the main thread answers fastest with one torch thread. Only the learn
    # thread forms a multi-thread OpenMP team, set before anything is built: with more OpenMP threads than
    # cores, every parallel region of learn waits for a helper thread to wake, about twice as slow.
    learn_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    policy = make_policy(words[0], policy_config)
    try:
        algo = make_algo(words[2], policy, algo_config)
    except KeyError as error:  # the config module was imported, the class module was not
        raise SystemExit(f"KeyError: {error}") from None
    algo.init_optimizers()
    counters = {}
    if args.resume:
        try:
            checkpoint, counters = load_newest_checkpoint(run_dir)
        except FileNotFoundError as error:
            raise SystemExit(f"error: {error}") from None
        algo.load_checkpoint(checkpoint)
        print(f"resumed from step {checkpoint.step} in {run_dir}", flush=True)
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.json"), "w") as file:
        json.dump(resolved, file, indent=2)
    server = Server(algo, run_dir, (words[0], words[2]), max_message_bytes=args.max_message_bytes,
                    feedback_timeout=args.feedback_timeout, token=args.token, learn_threads=learn_threads,
                    **counters)
    clients = []

    def start_local_clients(port):
        for i in range(args.local_env_clients):
            seed = [] if args.seed is None else ["--seed", str(args.seed + i)]
            command = [sys.executable, os.path.abspath(__file__), "env-client", args.local_env,
                       "--server-port", str(port), "--num-episodes", str(10**9), *seed]
            clients.append(subprocess.Popen(command, env={**os.environ, "PLUGRL_TOKEN": args.token or ""},
                                            stdout=subprocess.DEVNULL))

    try:
        return asyncio.run(server.run(args.host, args.port, start_local_clients))
    except OSError as error:  # the port is taken, or the address is not this machine's
        raise SystemExit(f"error: cannot listen on {args.host}:{args.port}: {error.strerror or error}") from None
    finally:
        for client in clients:
            try:
                client.wait(timeout=10)
            except subprocess.TimeoutExpired:
                client.kill()


def env_client_main(argv: list[str]) -> int:
    """Parse the env-client command line and run it."""
    parser = argparse.ArgumentParser(prog="python plugrl_min.py env-client",
                                     description="Run environments against a plugrl_min server.")
    parser.add_argument("env_id", help=f"one of {', '.join(ENVIRONMENTS)}, or gym:ENV_ID")
    parser.add_argument("--server-host", default="127.0.0.1")
    parser.add_argument("--server-port", type=int, default=8000)
    parser.add_argument("--num-episodes", type=int, default=1, help="stop after this many finished episodes")
    parser.add_argument("--num-envs", type=int, default=1, help="environments stepped together")
    parser.add_argument("--seed", type=int, help="seeds the environments")
    parser.add_argument("--summary-json", help="write the summary here as one JSON object")
    parser.add_argument("--connect-timeout", type=float, default=30.0, help="seconds to wait for the server")
    parser.add_argument("--token", default=os.environ.get("PLUGRL_TOKEN") or None, help="default: $PLUGRL_TOKEN")
    parser.add_argument("--closed-loop-steps", type=int, metavar="K",
                        help="hold each decision for K physical steps, acted out by --controller")
    parser.add_argument("--controller", default="track", help="pass-through (counting-v1) or track (default)")
    parser.add_argument("--reward-aggregation", default="sum", choices=REWARD_AGGREGATIONS)
    parser.add_argument("--max-message-bytes", type=int, default=MAX_MESSAGE_BYTES)
    args = parser.parse_args(argv)
    if args.num_envs < 1 or args.num_episodes < 1:
        parser.error("--num-envs and --num-episodes must be at least 1")
    try:
        return asyncio.run(run_env_client(args))
    except (SystemExit, ValueError) as error:  # SystemExit(message): the client's own clear stop, with its reason
        if isinstance(error, SystemExit) and not isinstance(error.code, str):
            raise  # a bare exit status from elsewhere (a plug-in, a library) keeps its meaning
        print(f"env-client: {error}", file=sys.stderr)
        return 1 if isinstance(error, SystemExit) else 2
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> None:
    """The command line. --plugin MODULE (anywhere, repeatable) is imported first; exits with the status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    plugins = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == "--plugin"]
    plugins += [word.split("=", 1)[1] for word in argv if word.startswith("--plugin=")]
    argv = [word for i, word in enumerate(argv) if word != "--plugin" and not word.startswith("--plugin=")
            and (i == 0 or argv[i - 1] != "--plugin")]
    for module in ["sac_example", *plugins]:
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as error:
            if module != "sac_example" or error.name != "sac_example":  # sac_example is optional
                raise SystemExit(f"error: cannot import plug-in {module!r}: {error}") from None
    sys.exit(env_client_main(argv[1:]) if argv[:1] == ["env-client"] else server_main(argv))


if __name__ == "__main__":
    # Run as a script, this file is module __main__. Register it as plugrl_min too, so a plug-in's
    # `from plugrl_min import register_algo` reaches these registries instead of a second copy.
    sys.modules["plugrl_min"] = sys.modules["__main__"]
    main()
