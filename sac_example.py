# SPDX-License-Identifier: MIT
"""sac_example: Soft Actor-Critic as a plugrl_min plug-in, registered as `sac`, in the style of CleanRL's single file.
The server's policy is the actor; this file adds twin Q critics, their targets, entropy tuning and a replay buffer."""

# Read it top to bottom: 1. Config  2. Twin critic  3. Replay buffer  4. Algorithm  5. Benchmark  6. Command line.
# Train: python sac_example.py dummy-policy default sac default --local-env-clients 1 --local-env pendulum-v1
# Check: python sac_example.py bench [--seeds 3] [--steps 15000]   (the learning and speed bars, pendulum-v1)

import argparse
import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time

import numpy as np
import torch
from torch import nn

import plugrl_min
from plugrl_min import BaseAlgoConfig, BaseAlgorithm, Checkpoint, register_algo, register_algo_config

UID = "sac"  # the name on the command line: python plugrl_min.py dummy-policy default sac default


# --- 1. Config: CleanRL's defaults; every field is a flag (--algo.batch-size 128) ---------------------------

@register_algo_config(UID)
@dataclasses.dataclass
class SACConfig(BaseAlgoConfig):
    """SAC hyperparameters. global_steps (from BaseAlgoConfig) counts stored frames and ends the run."""

    global_steps: int | None = 15_000
    buffer_size: int = 1_000_000  # frames kept; the oldest is overwritten first
    gamma: float = 0.99  # discount per decision
    tau: float = 0.005  # target networks move this fraction toward the critics per update
    batch_size: int = 256
    learning_starts: int = 5_000  # frames of uniform random actions before the first update
    policy_lr: float = 3e-4
    q_lr: float = 1e-3  # for the critics and the entropy coefficient, as CleanRL
    policy_frequency: int = 2  # every policy_frequency-th update runs policy_frequency actor updates (TD3's delay)
    target_network_frequency: int = 1  # updates between target network moves
    q_hidden_size: int = 256  # critic width; the actor's is --policy.hidden-size (one name per config)
    alpha: float = 0.2  # the entropy coefficient when autotune is false; its start value is 1 otherwise
    autotune: bool = True  # tune alpha so the policy's entropy tracks -action size
    save_every: int = 5_000  # updates between checkpoints
    log_every: int = 100  # updates between train/* metrics (reading a tensor's value costs; most learns log {})


# --- 2. Twin critic: Q1 and Q2 as one batched MLP, so both cost a single forward ----------------------------

class TwinQ(nn.Module):
    """Two Q(s, a) MLPs (hidden-hidden-1, ReLU) stacked on a leading axis of size 2.

    Each layer's weight is [2, in, out], so one torch.baddbmm runs a hidden layer of both critics at once.
    """

    def __init__(self, in_dim: int, hidden: int, copies: int = 2):
        super().__init__()
        sizes = [in_dim, hidden, hidden, 1]
        self.copies = copies
        # The same uniform(+-1/sqrt(fan_in)) initialisation as nn.Linear, so it matches CleanRL's critics.
        bounds = [1 / math.sqrt(n) for n in sizes[:-1]]
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(copies, i, o).uniform_(-b, b))
                                        for i, o, b in zip(sizes[:-1], sizes[1:], bounds))
        self.biases = nn.ParameterList(nn.Parameter(torch.empty(copies, 1, o).uniform_(-b, b))
                                       for o, b in zip(sizes[1:], bounds))

    def forward(self, obs: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """Q-values [2, B] of B (observation, action) pairs: row 0 is Q1, row 1 is Q2."""
        x = torch.cat([obs.flatten(1), action], dim=-1).expand(self.copies, -1, -1)  # expand is a view: no copy
        *hidden, (out_weight, out_bias) = zip(self.weights, self.biases)
        for weight, bias in hidden:
            # relu_ in place: baddbmm's output is fresh, and relu's backward needs only its own result.
            x = torch.baddbmm(bias, x, weight).relu_()
        # The output layer is 1 wide: a dot product per row runs several times faster than a 1-wide baddbmm.
        return torch.linalg.vecdot(x, out_weight.transpose(1, 2)) + out_bias.squeeze(-1)


# --- 3. Replay buffer: numpy storage written by feedback, read as torch views by learn ----------------------

class ReplayBuffer:
    """A ring of (obs, action, reward, next_obs, done) frames; sample() draws a uniform batch of tensors."""

    def __init__(self, capacity: int, obs_shape: tuple, action_shape: tuple, action_dtype):
        self.capacity, self.size, self.next = capacity, 0, 0
        self.obs = np.zeros((capacity, *obs_shape), np.float32)
        self.next_obs = np.zeros((capacity, *obs_shape), np.float32)
        self.action = np.zeros((capacity, *action_shape), action_dtype)
        self.reward, self.done = np.zeros(capacity, np.float32), np.zeros(capacity, np.float32)
        # torch.from_numpy shares memory: frames written in numpy are visible to learn without copies.
        self.tensors = [torch.from_numpy(a) for a in (self.obs, self.action, self.reward, self.next_obs, self.done)]

    def add(self, obs, action, reward: float, next_obs, done: bool) -> None:
        """Store one frame. Assigning into the arrays copies, so read-only wire views are safe to pass."""
        i = self.next
        self.obs[i], self.action[i], self.next_obs[i] = obs, action, next_obs
        self.reward[i], self.done[i] = reward, done
        self.next, self.size = (i + 1) % self.capacity, min(self.size + 1, self.capacity)

    def sample(self, batch_size: int) -> list[torch.Tensor]:
        """obs [B, ...], action [B, H * action_dim], reward [B], next_obs [B, ...], done [B]."""
        rows = torch.randint(self.size, (batch_size,))
        obs, action, reward, next_obs, done = (t.index_select(0, rows) for t in self.tensors)
        return [obs, action.flatten(1), reward, next_obs, done]


# --- 4. Algorithm: the plugrl_min hooks around CleanRL's update ---------------------------------------------

@register_algo(UID)
class SAC(BaseAlgorithm):
    """Off-policy SAC: every frame goes to the replay buffer; one gradient update per frame after learning_starts.

    Counters: global_step = frames stored (BaseAlgorithm's), updates = update slots used (one per frame
    past learning_starts), saved_at = updates at the last checkpoint. should_learn/should_save read them.
    """

    on_policy = False  # a replay-buffer learner: the server hands it every frame, whatever policy acted

    def __init__(self, config: SACConfig, policy: plugrl_min.BaseTorchPolicy):
        super().__init__(config=config, policy=policy)
        self.updates, self.saved_at = 0, 0
        self.obs_shape = tuple(policy.obs_spec["state"][0])
        example_action = self.example_train_state(1)["action"][0]  # [H, action_dim]: what one frame stores
        self.action_size = example_action.size  # the critic sees the whole action chunk, flattened
        self.buffer = ReplayBuffer(config.buffer_size, self.obs_shape, example_action.shape, example_action.dtype)
        self.critic = TwinQ(math.prod(self.obs_shape) + self.action_size, config.q_hidden_size)
        self.critic_target = TwinQ(math.prod(self.obs_shape) + self.action_size, config.q_hidden_size)
        self.critic_target.load_state_dict(self.critic.state_dict())
        self.critic_target.requires_grad_(False)  # moved only by the soft update, never by a gradient
        self.target_entropy = -float(self.action_size)  # CleanRL's -prod(action_shape)
        # log alpha, not alpha, is learned so alpha = exp(log_alpha) stays positive; start at alpha = 1.
        start = 0.0 if config.autotune else math.log(config.alpha)
        self.log_alpha = torch.tensor([start], requires_grad=config.autotune)
        self.last = {}  # the newest loss tensors; turned into floats only every log_every updates

    def init_optimizers(self) -> None:
        """Adam (CleanRL's choice): one for the critics, one for the actor with log alpha as a second group."""
        # One C++ kernel per step (fused: torch >= 2.4 on CPU; else foreach), not a Python loop over parameters.
        fast = {"fused": True} if torch.__version__ >= "2.4" else {"foreach": True}
        self.q_optimizer = torch.optim.Adam(self.critic.parameters(), lr=self.config.q_lr, **fast)
        self.actor_optimizer = torch.optim.Adam([{"params": self.policy.parameters()},
                                                 {"params": [self.log_alpha], "lr": self.config.q_lr}],
                                                lr=self.config.policy_lr, **fast)

    def infer(self, obs: dict) -> tuple[np.ndarray, dict]:
        """Uniform random actions in [-1, 1] until learning_starts frames are stored (to explore); then the policy."""
        if self.global_step < self.config.learning_starts:
            n = len(obs["state"])
            action = (torch.rand(n, self.policy.action_horizon, self.policy.action_dim) * 2 - 1).numpy()
            return action, {"action": action}
        return self.policy.get_action_and_runtime_state(obs)

    def derive_train_state(self, runtime_state: dict) -> dict:
        """The executed action [n, H, action_dim]: the one thing a replay frame needs from infer."""
        return {"action": runtime_state["action"]}

    def feedback(self, *, obs, runtime_state, train_state=None, terminated, truncated, next_obs, reward, info,
                 next_terminated, next_truncated, prev_node):
        """Record a finished episode, store the frame and count it."""
        if (next_terminated or next_truncated) and "episode" in info and bool(info["episode"].get("mask", True)):
            self.record_episode_metrics(info["episode"])
        # Only termination stops bootstrapping: a truncated episode's next state still has a future.
        # A stacked reward (--reward-aggregation stack, one per physical step) counts as the decision's total.
        reward = float(np.sum(reward))
        self.buffer.add(obs["state"], train_state["action"], reward, next_obs["state"], next_terminated)
        self.global_step += 1
        return prev_node, self.global_step, {}

    def should_learn(self) -> bool:
        """One update per frame past learning_starts, as CleanRL; learn_impl moves updates to catch up."""
        return self.global_step > self.config.learning_starts and self.updates < self.updates_due()

    def updates_due(self) -> int:
        """How many update slots the frames stored so far have earned."""
        return self.global_step - self.config.learning_starts

    def learn_impl(self) -> tuple[int, dict]:
        """Run every owed update (several when many environments fed frames at once); log every log_every."""
        logged = self.updates // self.config.log_every
        while self.updates < self.updates_due():
            self.updates += 1
            # After --resume the buffer starts empty: the slot is used up without an update until a batch fits.
            if self.buffer.size >= self.config.batch_size:
                self.update()
        if self.updates // self.config.log_every == logged or not self.last:
            return self.global_step, {}
        logs = {f"train/{key}": value.item() for key, value in self.last.items()}
        return self.global_step, {**logs, "train/updates": self.updates}

    def update(self) -> None:
        """One SAC gradient step on one sampled batch: critics always, the actor and alpha on a delay."""
        cfg = self.config
        obs, action, reward, next_obs, done = self.buffer.sample(cfg.batch_size)
        alpha = self.log_alpha.detach().exp()  # a tensor: no .item() (a host read) on the per-step path
        # Critic target: r + gamma * (1 - done) * (min of the twin targets at a' ~ pi(s') - alpha * log pi(a'|s')).
        with torch.no_grad():
            next_action, next_log_prob = self.policy.sample(next_obs)
            next_q = self.critic_target(next_obs, next_action).min(dim=0).values - alpha * next_log_prob
            target = reward + (1 - done) * cfg.gamma * next_q
        q = self.critic(obs, action)  # [2, B]
        q_loss = (q - target).pow(2).mean(dim=1).sum()  # qf1_loss + qf2_loss, each a mean squared error
        self.q_optimizer.zero_grad(set_to_none=True)
        q_loss.backward()
        self.q_optimizer.step()
        self.last.update(qf_loss=q_loss.detach(), qf_values=q.detach().mean())

        if self.updates % cfg.policy_frequency == 0:  # TD3's delay; policy_frequency steps make up for it
            # The actor's loss must move the actor only: freezing the critic also skips its weight gradients.
            self.critic.requires_grad_(False)
            for _ in range(cfg.policy_frequency):
                pi, log_prob = self.policy.sample(obs)
                actor_loss = (alpha * log_prob - self.critic(obs, pi).min(dim=0).values).mean()
                # Alpha rises while the entropy (-log pi) is under target_entropy and falls while above.
                # It sees log pi detached and the actor sees alpha detached, so one backward and one step serve
                # both losses without mixing gradients. CleanRL draws a second sample here; this one estimates
                # the same entropy one forward cheaper.
                alpha_loss = -(self.log_alpha.exp() * (log_prob.detach() + self.target_entropy)).mean()
                self.actor_optimizer.zero_grad(set_to_none=True)
                (actor_loss + alpha_loss if cfg.autotune else actor_loss).backward()
                self.actor_optimizer.step()
                alpha = self.log_alpha.detach().exp()
            self.critic.requires_grad_(True)
            self.last.update(actor_loss=actor_loss.detach(), alpha_loss=alpha_loss.detach(), alpha=alpha)

        if self.updates % cfg.target_network_frequency == 0:
            # Polyak averaging, target += tau * (critic - target), as one fused multi-tensor kernel.
            with torch.no_grad():
                torch._foreach_lerp_(list(self.critic_target.parameters()), list(self.critic.parameters()), cfg.tau)

    def should_save(self) -> bool:
        """Every save_every updates; create_checkpoint records the update it saved at."""
        return self.updates - self.saved_at >= self.config.save_every

    def create_checkpoint(self) -> Checkpoint:
        """Actor in model, both optimizers in optimizer, critics, targets, log alpha and counters in meta."""
        self.saved_at = self.updates
        optimizers = {"q": self.q_optimizer.state_dict(), "actor": self.actor_optimizer.state_dict()}
        # Tensors and plain Python values only: checkpoints load with torch.load(weights_only=True).
        meta = {"updates": self.updates, "saved_at": self.saved_at, "critic": self.critic.state_dict(),
                "critic_target": self.critic_target.state_dict(), "log_alpha": self.log_alpha.detach().clone()}
        return Checkpoint(step=self.global_step, model=self.policy.state_dict(), optimizer=optimizers, meta=meta)

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Restore weights, optimizers and every counter, so --resume continues the same schedule.

        The replay buffer is not saved (up to buffer_size frames); it refills with the restored policy.
        """
        super().load_checkpoint(checkpoint)  # global_step and the actor
        meta = checkpoint.meta
        self.updates, self.saved_at = int(meta["updates"]), int(meta["saved_at"])
        self.critic.load_state_dict(meta["critic"])
        self.critic_target.load_state_dict(meta["critic_target"])
        with torch.no_grad():
            self.log_alpha.copy_(meta["log_alpha"])
        if checkpoint.optimizer is not None:
            self.q_optimizer.load_state_dict(checkpoint.optimizer["q"])
            self.actor_optimizer.load_state_dict(checkpoint.optimizer["actor"])


# --- 5. Benchmark: the learning and speed bars on pendulum-v1, server and client over a real WebSocket ------

def run_seed(seed: int, steps: int, folder: str) -> dict:
    """One server and one pendulum-v1 client as subprocesses; returns the client's summary plus timings."""
    run_dir, summary_path = os.path.join(folder, f"seed{seed}"), os.path.join(folder, f"seed{seed}.json")
    with socket.socket() as probe:  # a free port for this run (the client retries until the server listens)
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    command = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "plugrl_min.py")]
    server = subprocess.Popen(command + ["dummy-policy", "default", UID, "default", "--port", port, "--seed", str(seed),
                                         "--algo.global-steps", str(steps), "--run-dir", run_dir],
                              stdout=subprocess.DEVNULL)  # its errors still reach stderr
    try:
        client = subprocess.run(command + ["env-client", "pendulum-v1", "--server-port", port, "--seed", str(seed),
                                           "--num-episodes", "1000000", "--summary-json", summary_path,
                                           "--connect-timeout", "60"], stdout=subprocess.DEVNULL)
        status = server.wait(timeout=60) if client.returncode == 0 else None  # else it waits for frames forever
    finally:
        server.kill()  # does nothing once it has exited
    if status != 0 or client.returncode != 0:
        raise SystemExit(f"seed {seed}: the server exited with {status}, the client with {client.returncode}")
    with open(summary_path) as file:
        summary = json.load(file)
    with open(os.path.join(run_dir, "metrics.jsonl")) as file:
        learns = [json.loads(line) for line in file]  # one line per learn, each with the server's clock
    # Per update over the learning phase alone (first learn to last), wire and inference included.
    summary["per_update"] = (learns[-1]["time"] - learns[0]["time"]) / max(len(learns) - 1, 1) if learns else 0.0
    return summary


def cleanrl_update_ms(updates: int = 400) -> float:
    """The speed bar: ms per learning step of CleanRL's SAC loop on Pendulum, in-process and written its way
    (nn.Linear critics, torch.distributions, a second sample for alpha, three Adams, a Python target update)."""
    def mlp(n_in, n_out):
        return nn.Sequential(nn.Linear(n_in, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, n_out))

    actor, qf1, qf2, qf1_target, qf2_target = mlp(3, 2), mlp(4, 1), mlp(4, 1), mlp(4, 1), mlp(4, 1)
    log_alpha, alpha = torch.zeros(1, requires_grad=True), 1.0
    q_optimizer = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=1e-3)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=3e-4)
    alpha_optimizer = torch.optim.Adam([log_alpha], lr=1e-3)
    # Random frames (obs 3, action 1, reward 1, next obs 3, done 1): only the time of the arithmetic matters here.
    frames = np.random.randn(20_000, 9).astype(np.float32)

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
        q_loss = nn.functional.mse_loss(qf1(sa).view(-1), target) + nn.functional.mse_loss(qf2(sa).view(-1), target)
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


def bench(argv: list[str]) -> int:
    """Train on pendulum-v1 for each seed; exit 0 if every seed reaches the return bar and, on average over the
    seeds, a run takes no longer than CleanRL's loop needs in-process for the same updates (the speed bar)."""
    parser = argparse.ArgumentParser(prog="python sac_example.py bench", description=bench.__doc__)
    parser.add_argument("--seeds", type=int, default=3, help="seeds 1..N, run one after another")
    parser.add_argument("--steps", type=int, default=15_000, help="environment steps per seed")
    parser.add_argument("--bar", type=float, default=-200.0, help="the mean return every seed must reach")
    args = parser.parse_args(argv)
    updates = args.steps - SACConfig().learning_starts
    if updates < 1:
        parser.error(f"--steps must be more than learning_starts ({SACConfig().learning_starts}): no update runs")
    results = []
    with tempfile.TemporaryDirectory(prefix="sac-bench-") as folder:
        for seed in range(1, args.seeds + 1):  # one at a time: two runs would share the machine's cores
            summary = run_seed(seed, args.steps, folder)
            last10 = float(np.mean(summary["returns"][-10:]))
            # CleanRL's loop in-process, timed right after the run (the same machine, the same load); its 5,000
            # random steps (about a second) are left out, in CleanRL's favour.
            reference = updates * cleanrl_update_ms() / 1000
            results.append((last10, summary["seconds"], reference))
            print(f"seed {seed}: last-10 mean return {last10:8.1f} | {summary['seconds']:6.1f} s "
                  f"(CleanRL in-process {reference:.1f} s) | {1000 * summary['per_update']:.2f} ms/update | "
                  f"{summary['env_steps']} env steps | load average {os.getloadavg()[0]:.1f}", flush=True)
    returns, seconds, references = (np.array(column) for column in zip(*results))
    # One seed's time swings by a tenth with the machine's load: the speed bar compares means over the seeds.
    learns, fast = (returns >= args.bar).all(), seconds.mean() <= references.mean()
    print(f"summary: returns {'PASS' if learns else 'FAIL'} (worst last-10 mean {returns.min():.1f}, bar {args.bar:g}) "
          f"| speed {'PASS' if fast else 'FAIL'} (mean {seconds.mean():.1f} s per seed, CleanRL in-process "
          f"{references.mean():.1f} s)")
    return 0 if learns and fast else 1


# --- 6. Command line: `python sac_example.py [bench | plugrl_min server arguments]` -------------------------

if __name__ == "__main__":
    # plugrl_min.main() imports sac_example: it must find this module, not register "sac" a second time (that raises).
    sys.modules["sac_example"] = sys.modules["__main__"]
    if sys.argv[1:2] == ["bench"]:
        sys.exit(bench(sys.argv[2:]))
    plugrl_min.main()
