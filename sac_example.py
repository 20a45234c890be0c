# SPDX-License-Identifier: MIT
"""sac_example: Soft Actor-Critic as a plugrl_min plug-in, registered as `sac`, in CleanRL's style.

The server's policy (dummy-policy, a tanh-Gaussian MLP) is the actor; this file adds the twin
Q critics, their targets, the entropy coefficient and a replay buffer. Read it top to bottom:
1. Config   2. Twin critic   3. Replay buffer   4. Algorithm (the plugrl_min hooks).

Train it on the pendulum (its example_env), server and client in one command:
    python plugrl_min.py dummy-policy default sac default --local-env-clients 1

Where CleanRL's sac_continuous_action.py does each thing, the hooks do it here:
    actions = actor.get_action(obs), or random before learning_starts  -> SAC.infer
    rb.add(obs, next_obs, actions, rewards, terminations, infos)        -> SAC.feedback
    if global_step > args.learning_starts:                              -> SAC.should_learn
    the critic, actor and alpha updates, the target networks            -> SAC.learn_impl, update
    the env loop and envs.step(actions)                                 -> the server and env client
"""

import dataclasses
import math
import os
import sys

import numpy as np
import torch
from torch import nn

import plugrl_min
from plugrl_min import (BaseAlgoConfig, BaseAlgorithm, Checkpoint, ObsEncoder, map_arrays,
                        put_rows, register_algo, register_algo_config, zeros_of)

UID = "sac"  # the name on the command line: python plugrl_min.py dummy-policy default sac default


# --- 1. Config: CleanRL's hyperparameters, a shorter run; each field a flag (--algo.tau 0.01) -----

@register_algo_config(UID)
@dataclasses.dataclass
class SACConfig(BaseAlgoConfig):
    """SAC's hyperparameters. global_steps counts stored frames and ends the run."""
    global_steps: int | None = 15_000  # frames stored, then the run ends (CleanRL's: 1,000,000)
    buffer_size: int = 1_000_000  # frames kept (at most global_steps); the oldest goes first
    gamma: float = 0.99  # discount per decision
    tau: float = 0.005  # the target networks move this fraction toward the critics per update
    batch_size: int = 256  # frames per update, drawn uniformly from the buffer
    learning_starts: int = 5_000  # frames of uniform random actions before the first update
    policy_lr: float = 3e-4  # Adam's step size for the actor
    q_lr: float = 1e-3  # for the critics and the entropy coefficient, as CleanRL
    policy_frequency: int = 2  # every 2nd update runs 2 actor updates (TD3's delay)
    target_network_frequency: int = 1  # updates between target network moves
    q_hidden_size: int = 256  # the critic's width; the actor's is --policy.hidden-size
    alpha: float = 0.2  # the entropy coefficient when autotune is off (it starts at 1 if on)
    autotune: bool = True  # tune alpha so the policy's entropy tracks -(action size)
    save_every: int = 5_000  # updates between checkpoints
    log_every: int = 100  # updates between train/* metrics (reading a tensor's value costs)


# --- 2. Twin critic: Q1 and Q2 as one batched MLP, so both cost a single forward ------------------

class TwinQ(nn.Module):
    """Two Q(s, a) MLPs (hidden, hidden, 1; ReLU), their weights stacked on a leading axis of 2.

    CleanRL writes a critic as an nn.Module of three nn.Linear layers (fc1 to fc3) and builds two;
    here each layer's weight is [2, in, out], so one torch.baddbmm computes that layer of both.
    """

    def __init__(self, in_dim: int, hidden: int, encoder: nn.Module):
        super().__init__()
        sizes = [in_dim, hidden, hidden, 1]
        # An ObsEncoder, one for both critics: an image is encoded once (a flat state: no weights).
        self.encoder = encoder
        # nn.Linear's initialisation, uniform(+-1/sqrt(fan_in)), as CleanRL's critics get.
        bounds = [1 / math.sqrt(n) for n in sizes[:-1]]
        self.weights = nn.ParameterList(nn.Parameter(torch.empty(2, i, o).uniform_(-b, b))
                                        for i, o, b in zip(sizes[:-1], sizes[1:], bounds))
        self.biases = nn.ParameterList(nn.Parameter(torch.empty(2, 1, o).uniform_(-b, b))
                                       for o, b in zip(sizes[1:], bounds))

    def forward(self, obs, action: torch.Tensor) -> torch.Tensor:
        """Q-values [2, B] of B (observation, action) pairs: row 0 is Q1, row 1 is Q2."""
        x = torch.cat([self.encoder(obs), action], dim=-1).expand(2, -1, -1)
        *hidden, (out_weight, out_bias) = zip(self.weights, self.biases)
        for weight, bias in hidden:
            # relu_ in place (a fresh tensor, and relu's backward needs only its output);
            # CleanRL: x = F.relu(self.fc1(x)), one critic at a time.
            x = torch.baddbmm(bias, x, weight).relu_()
        # The output layer is 1 wide: a dot product per row is faster than a 1-wide matmul.
        return torch.linalg.vecdot(x, out_weight.transpose(1, 2)) + out_bias.squeeze(-1)


def td_target(reward, done, next_q, next_log_prob, alpha, gamma: float) -> torch.Tensor:
    """The critics' target [B]: r + gamma * (1 - done) * (min(Q1', Q2') - alpha * log pi(a'|s')).

    next_q [2, B] are the target critics at (s', a'), a' ~ pi(s'). The smaller of the two fights
    Q-learning's overestimation; only termination (done) stops bootstrapping, not truncation.
    """
    soft_value = next_q.min(dim=0).values - alpha * next_log_prob
    return reward + gamma * (1 - done) * soft_value


# --- 3. Replay buffer: numpy storage written by feedback, read as torch views by learn ------------

class ReplayBuffer:
    """A ring of (obs, action, reward, next_obs, done) frames; sample() draws a uniform batch.
    An observation's images and states, each kept in its dtype: an image stays uint8."""

    def __init__(self, capacity: int, obs_spec: dict, action_shape: tuple, action_dtype):
        self.capacity = capacity
        self.size = 0
        self.next = 0
        frame = [((2, *shape), dtype) for keys in obs_spec.values()  # obs, next_obs
                 for shape, dtype in keys.values()]
        frame += [(action_shape, action_dtype), ((2,), np.float32)]  # reward, done
        needed = capacity * sum(math.prod(shape) * np.dtype(dtype).itemsize
                                for shape, dtype in frame)
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # this machine's
        if needed > memory:  # allocated, it would fail, or fill the memory midway through the run
            raise plugrl_min.UsageError(f"sac's replay buffer needs {needed:,} bytes, more than "
                                        f"this machine's {memory:,}: lower --algo.buffer-size")
        # np.zeros, not np.zeros_like: untouched pages take no memory until a frame is written.
        self.obs, self.next_obs = (zeros_of(obs_spec, capacity) for _ in range(2))
        self.action = np.zeros((capacity, *action_shape), action_dtype)
        self.reward = np.zeros(capacity, np.float32)
        self.done = np.zeros(capacity, np.float32)
        # torch.from_numpy shares memory: frames written in numpy are seen by learn, no copy.
        self.tensors = [map_arrays(torch.from_numpy, arrays) for arrays in
                        (self.obs, self.action, self.reward, self.next_obs, self.done)]

    def add(self, obs: dict, action, reward: float, next_obs: dict, done: bool) -> None:
        """Store one frame. Assigning copies, so read-only views from the wire are safe to pass."""
        i = self.next
        put_rows(self.obs, i, obs)
        self.action[i] = action
        self.reward[i] = reward
        put_rows(self.next_obs, i, next_obs)
        self.done[i] = done
        self.next = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)

    def sample(self, batch_size: int, device: torch.device) -> list:
        """obs {key: [B, ...]}, action [B, H * action_dim], reward [B], next_obs, done [B]."""
        rows = torch.randint(self.size, (batch_size,))
        obs, action, reward, next_obs, done = (
            # index_select gathers the rows into new tensors; .to(device) copies none on the CPU
            map_arrays(lambda t: t.index_select(0, rows).to(device), tensors)
            for tensors in self.tensors)
        return [obs, action.flatten(1), reward, next_obs, done]


# --- 4. Algorithm: the plugrl_min hooks around CleanRL's update ---------------------------------

@register_algo(UID)
class SAC(BaseAlgorithm):
    """Off-policy SAC: every frame goes to the replay buffer; one update per frame after
    learning_starts (CleanRL's: one per step of its vector of environments, the same with one).
    Counters: global_step (frames stored), updates (update slots used, one per frame past
    learning_starts), saved_at (updates at the last checkpoint). Not a DDPAlgorithm: it learns
    after every frame, and shipping the replay buffer to other ranks would cost more than the
    update. The buffer stays in host memory (with --device cuda too): feedback writes one row in
    numpy, each update moves one batch to the device.
    """

    on_policy = False  # a replay-buffer learner: the server hands it every frame, stale or not
    example_env = "pendulum-v1"  # --local-env and the server's hint default to it (CleanRL: Hopper)

    def __init__(self, config: SACConfig, policy: plugrl_min.BaseTorchPolicy):
        super().__init__(config=config, policy=policy)
        if policy.num_actions is not None or not hasattr(policy, "sample"):  # refused at once
            raise plugrl_min.UsageError(f"sac trains continuous actions through the policy's "
                                        f"sample(obs), which {type(policy).__name__} lacks: serve "
                                        "dummy-policy")
        self.updates, self.saved_at = 0, 0
        spec = plugrl_min.obs_spec_of(policy.obs_spec)
        action = self.example_train_state(1)["action"][0]  # [H, action_dim]: one frame's action
        self.action_size = action.size  # the critic sees the whole action chunk, flattened
        # A run never stores more than global_steps frames: a larger buffer would stay empty.
        capacity = min(config.buffer_size, config.global_steps or config.buffer_size)
        self.buffer = ReplayBuffer(capacity, spec, action.shape, action.dtype)
        self.device = policy.device  # --device: the networks live there, as the actor does
        encoder = ObsEncoder(spec)  # the target gets one of its own, then the critic's weights
        in_dim = encoder.features + self.action_size
        self.critic = TwinQ(in_dim, config.q_hidden_size, encoder).to(self.device)
        self.critic_target = TwinQ(in_dim, config.q_hidden_size, ObsEncoder(spec)).to(self.device)
        self.critic_target.load_state_dict(self.critic.state_dict())
        self.critic_target.requires_grad_(False)  # moved by the soft update, not by gradients
        self.target_entropy = -float(self.action_size)  # CleanRL's -prod(action_shape)
        # log alpha is learned, not alpha, so alpha = exp(log_alpha) stays positive.
        start = 0.0 if config.autotune else math.log(config.alpha)
        self.log_alpha = torch.tensor([start], device=self.device, requires_grad=config.autotune)
        self.last = {}  # the newest loss tensors; read as floats every log_every updates only
        self.q_optimizer = self.actor_optimizer = None  # built by init_optimizers()

    def init_optimizers(self) -> None:
        """Adam, as CleanRL: one for the critics, one for the actor with log alpha as a group."""
        # fused=True: one C++ kernel per step instead of a Python loop over the parameters.
        self.q_optimizer = torch.optim.Adam(self.critic.parameters(), lr=self.config.q_lr,
                                            fused=True)
        self.actor_optimizer = torch.optim.Adam(
            [{"params": self.policy.parameters()},
             {"params": [self.log_alpha], "lr": self.config.q_lr}],
            lr=self.config.policy_lr, fused=True)

    def infer(self, obs: dict) -> tuple[np.ndarray, dict]:
        """Uniform random actions in [-1, 1] until learning_starts frames are stored, then pi."""
        if self.global_step < self.config.learning_starts:
            n = len(obs["text"])  # a str per environment (images may have no key)
            action = (torch.rand((n, *self.policy.action_shape)) * 2 - 1).numpy()
            return action, {"action": action}
        return self.policy.get_action_and_runtime_state(obs)

    def derive_train_state(self, runtime_state: dict) -> dict:
        """The action taken [n, H, action_dim]: all a replay frame needs from infer."""
        return {"action": runtime_state["action"]}

    def feedback(self, *, obs, runtime_state, train_state=None, terminated, truncated, next_obs,
                 reward, info, next_terminated, next_truncated, prev_node):
        """Record a finished episode, store the frame, count it."""
        self.record_finished_episode(info, next_terminated, next_truncated)
        # A stacked reward (one per physical step, --reward-aggregation stack) counts as its sum.
        self.buffer.add(obs, train_state["action"], float(np.sum(reward)), next_obs,
                        next_terminated)
        self.global_step += 1
        return prev_node, self.global_step, {}  # a replay buffer links no frames

    def should_learn(self) -> bool:
        """One update per frame past learning_starts; learn_impl catches up on every owed one."""
        return self.updates < self.global_step - self.config.learning_starts

    def learn_impl(self) -> tuple[int, dict]:
        """Every owed update (several when many environments fed at once); logs every log_every."""
        logged = self.updates // self.config.log_every
        while self.should_learn():  # every update slot the stored frames have earned
            self.updates += 1
            # After --resume the buffer starts empty: the slot is used, without an update.
            if self.buffer.size >= self.config.batch_size:
                self.update()
        if self.updates // self.config.log_every == logged or not self.last:
            return self.global_step, {}
        return self.global_step, {f"train/{key}": value.item() for key, value in self.last.items()}

    def update(self) -> None:
        """One SAC step on one sampled batch: the critics always, the actor and alpha delayed."""
        cfg = self.config
        obs, action, reward, next_obs, done = self.buffer.sample(cfg.batch_size, self.device)
        alpha = self.log_alpha.detach().exp()  # a tensor: no .item(), a host read, per step
        with torch.no_grad():
            next_action, next_log_prob = self.policy.sample(next_obs)
            next_q = self.critic_target(next_obs, next_action)
            target = td_target(reward, done, next_q, next_log_prob, alpha, cfg.gamma)
        q = self.critic(obs, action)  # [2, B]
        q_loss = (q - target).pow(2).mean(dim=1).sum()  # CleanRL's qf1_loss + qf2_loss
        self.q_optimizer.zero_grad(set_to_none=True)
        q_loss.backward()
        self.q_optimizer.step()
        self.last.update(qf_loss=q_loss.detach(), qf_values=q.detach().mean())

        if self.updates % cfg.policy_frequency == 0:  # TD3's delay, made up by as many steps
            # The actor's loss must move the actor only; a frozen critic skips its gradients.
            self.critic.requires_grad_(False)
            for _ in range(cfg.policy_frequency):
                pi, log_prob = self.policy.sample(obs)
                actor_loss = (alpha * log_prob - self.critic(obs, pi).min(dim=0).values).mean()
                # Alpha rises while the entropy (-log pi) is below target_entropy. It sees log pi
                # detached and the actor sees alpha detached, so one backward serves both losses.
                # CleanRL draws a second sample for this loss; this one estimates the same.
                entropy_gap = log_prob.detach() + self.target_entropy
                alpha_loss = -(self.log_alpha.exp() * entropy_gap).mean()
                loss = actor_loss + alpha_loss if cfg.autotune else actor_loss
                self.actor_optimizer.zero_grad(set_to_none=True)
                loss.backward()
                self.actor_optimizer.step()
                alpha = self.log_alpha.detach().exp()
            self.critic.requires_grad_(True)
            self.last.update(actor_loss=actor_loss.detach(), alpha_loss=alpha_loss.detach(),
                             alpha=alpha)

        if self.updates % cfg.target_network_frequency == 0:
            with torch.no_grad():  # Polyak averaging: target += tau * (critic - target)
                for target_param, param in zip(self.critic_target.parameters(),
                                               self.critic.parameters()):
                    target_param.lerp_(param, cfg.tau)

    def should_save(self) -> bool:
        """Every save_every updates; create_checkpoint records the update it saved at."""
        return self.updates - self.saved_at >= self.config.save_every

    def create_checkpoint(self) -> Checkpoint:
        """The actor, both optimizers; critics, targets, log alpha and counters in meta."""
        self.saved_at = self.updates
        optimizer = {"q": self.q_optimizer.state_dict(), "actor": self.actor_optimizer.state_dict()}
        meta = {"updates": self.updates, "saved_at": self.saved_at,
                "log_alpha": self.log_alpha.detach().clone(), "critic": self.critic.state_dict(),
                "critic_target": self.critic_target.state_dict()}
        return Checkpoint(step=self.global_step, model=self.policy.state_dict(),
                          optimizer=optimizer, meta=meta)

    def load_checkpoint(self, checkpoint: Checkpoint) -> None:
        """Weights, optimizers and every counter, so --resume keeps the schedule. The replay
        buffer is not saved (up to buffer_size frames); it refills after a resume."""
        super().load_checkpoint(checkpoint)  # global_step and the actor
        meta = checkpoint.meta
        self.updates = int(meta["updates"])
        self.saved_at = int(meta["saved_at"])
        self.critic.load_state_dict(meta["critic"])
        self.critic_target.load_state_dict(meta["critic_target"])
        with torch.no_grad():
            self.log_alpha.copy_(meta["log_alpha"])
        self.q_optimizer.load_state_dict(checkpoint.optimizer["q"])
        self.actor_optimizer.load_state_dict(checkpoint.optimizer["actor"])


if __name__ == "__main__":
    # plugrl_min.main() imports sac_example: it must find this module, not register "sac" twice.
    sys.modules["sac_example"] = sys.modules["__main__"]
    plugrl_min.main()
