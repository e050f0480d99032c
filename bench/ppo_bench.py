"""Our PPO (pipeline/train_ppo.py) against TRL's PPOTrainer (trl==1.12.0, `trl.experimental.ppo`),
and our RLOO (the same trainer without a critic, `--advantage-estimator rloo`) beside both.

    python bench/ppo_bench.py            # SmolLM2-135M, batch 16, 48 new tokens, 2 PPO epochs, 5 steps, 3 reps
    python bench/ppo_bench.py --quick    # batch 8, 32 new tokens, 1 epoch, 3 steps, 3 reps (about 10 minutes)
    python bench/ppo_bench.py --device cuda --model FOLDER --json out.json   # bf16 on a GPU (bench/gpu_check.py)
    python bench/ppo_bench.py --dtype bf16 ...  # bf16 autocast on the CPU: both sides' dtype handling, no GPU
    python bench/ppo_bench.py --quick --sides ours,rloo,trl,trl_rloo   # our RLOO and TRL's RLOOTrainer too

Each run is its own child process (so each peak-memory figure is its own), with the same: policy
(the default SmolLM2-135M-Instruct or --model, LoRA r16 on all linear layers), reward model (the
same backbone and scalar head, saved once), critic (starting as that reward model; `--critic lora`
(default): the same LoRA setting, TRL's value model wrapped with peft by hand since TRL's
peft_config covers the policy only; `--critic full`: fully trained, TRL's default arrangement),
prompts (the bundled pool, store/data/prompts.jsonl, with the same chat template), batch size,
minibatches, micro-batch size, response length, PPO epochs, temperature, fixed KL coefficient,
missing-EOS penalty, precision and threads.
Differences left as each library has them: ours points the frozen weights of the reward model and
the LoRA critic, equal here to the policy's base, at the policy's (one base in memory; TRL loads
each role whole); TRL takes one learning rate for policy and critic and,
with gradient accumulation over minibatches, steps its optimiser once per epoch; gradient
checkpointing is turned off in TRL (its default is on) because ours does not checkpoint; in bf16
TRL's LoRA critic keeps its trainable `score` head in the backbone's dtype, as TRL needs (it scores
the rollout outside autocast), where ours keeps its scalar heads in fp32.

Timing, the same span on both sides: a step runs from the end of the previous step (ours: its
status.json update; TRL: `on_step_end`, the first step from `on_train_begin`) to its own end, so
everything a step does (ours: merging LoRA for sampling, metrics; TRL: gc, empty_cache, data
loading, logging) is inside it. The update is the PPO epochs (ours: the loop's own `time/update`;
TRL: from the first policy-and-value forward to the step end); the rollout is the rest of the step.
The first step is a warm-up and is left out when there are 3 or more.
Repetitions: --reps runs of each side, the order alternating (ours first, then TRL first, ...), so
load changes on a shared machine hit both alike; each figure is printed as the median over the
repetitions with its range (min-max), and the ratio as the ratio of the medians with the range of
the per-repetition ratios (each repetition's pair run back to back).

Update FLOPs (the same count for both sides): 6 x parameters x tokens for forward and backward,
plus the attention term 12 x layers x hidden x sequence length per token (PaLM, Chowdhery et al.
2022, appendix B), for the policy (with its LM head) and the critic, over prompt + response tokens
(the prompt pool's mean prompt length) x batch x PPO epochs. With LoRA the frozen weights get no
weight gradients, so the hardware does about 2/3 of this; the figure is the usual model-FLOPs
convention, not a count of the kernels run.

The `rloo` side is ours with `advantage_estimator="rloo"` and every other setting the same: the
same episodes per step (batch / 4 prompts, each sampled 4 times), no critic loaded or trained (its
update FLOPs are the policy's alone, so its TFLOP/s figure counts the critic's FLOPs it does not
spend and is left out). The `trl_rloo` side is TRL's RLOOTrainer on the same work as our `rloo`
side (`run_trl_rloo`: its LoRA, reference, KL coefficient, samples per prompt, optimiser steps per
generation batch and epochs set to ours); a step is one generation batch, its update from the end of
TRL's generation and scoring to the batch's last optimiser step.

Figures: episodes/s, seconds per step split into rollout and update, peak memory (RSS on CPU; max
allocated on CUDA) and achieved update TFLOP/s. --json is rewritten after every run, so a bench
stopped half-way keeps the runs it finished; a side whose run fails is recorded with its traceback
(`failed`), not run again, and the other side's runs are still reported (exit code 1). Requires `pip install trl==1.12.0` (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "store" / "data" / "prompts.jsonl"  # the app's bundled pool (license: store/data/LICENSE.md)
OUT = ROOT / "bench" / "out" / "ppo"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def settings(args) -> dict:
    quick = dict(steps=3, batch_size=8, mini_batch_size=4, micro_batch_size=4, max_new_tokens=32, ppo_epochs=1)
    full = dict(steps=5, batch_size=16, mini_batch_size=8, micro_batch_size=8, max_new_tokens=48, ppo_epochs=2)
    s = quick if args.quick else full
    for key in s:
        if getattr(args, key, None):
            s[key] = getattr(args, key)
    return {**s, "temperature": 0.7, "lr": 1e-5, "kl_coef": 0.05, "missing_eos_penalty": 1.0, "lora_r": 16,
            "lora_alpha": 32, "critic": args.critic, "device": args.device, "dtype": args.dtype,
            "threads": args.threads, "n_prompts": args.n_prompts, "seed": 0, "model": args.model,
            "reward_base": args.reward_base or args.model, "work": str(Path(args.work).resolve())}


# --------------------------------------------------------------------------- shared inputs


def model_folder(name: str) -> Path:
    from pipeline.models import default_model_dir

    return default_model_dir() if name == "default" else Path(name).resolve()


def prepare(s: dict) -> dict:
    """The base model folder, a reward model folder (full backbone, seeded head), a LoRA critic
    starting as that reward model, and a prompts file; made once per model, device and dtype.
    The reward model and critic are built from --reward-base (default: --model): with a policy
    whose tokenizer's EOS lies outside the vocabulary (bench/gpu_check.py's no-EOS folders), the
    reward model needs the same weights with the real tokenizer, since it scores prompt + response
    + its own EOS."""
    import torch

    from pipeline.config import ModelConfig
    from pipeline.models import load_scalar_model
    from pipeline.saving import save_scalar_model

    base, rm_base = model_folder(s["model"]), model_folder(s["reward_base"])
    out = Path(s["work"])
    out.mkdir(parents=True, exist_ok=True)
    tag = f"{'default' if s['reward_base'] == 'default' else rm_base.name}-{s['device']}-{s['dtype']}"
    # the folders in the run's dtype (bf16 on a GPU by default), what the runs load
    rm_dir, critic_dir = out / f"reward_model-{tag}", out / f"critic_lora-{tag}"
    if not (rm_dir / "model_meta.json").is_file():
        torch.manual_seed(0)
        rm, tok = load_scalar_model(str(rm_base), kind="reward",
                                    cfg=ModelConfig(device=s["device"], dtype=s["dtype"], lora=False))
        save_scalar_model(rm, tok, rm_dir)
        del rm
    if not (critic_dir / "model_meta.json").is_file():
        # a LoRA critic on the same backbone with the reward model's head: starts equal to the RM
        from safetensors.torch import load_file

        lora_cfg = ModelConfig(device=s["device"], dtype=s["dtype"], lora=True, lora_r=s["lora_r"],
                               lora_alpha=s["lora_alpha"])
        critic, tok = load_scalar_model(str(rm_base), kind="critic", cfg=lora_cfg)
        critic.head.load_state_dict(load_file(str(rm_dir / "scalar_head.safetensors"), device=s["device"]))
        save_scalar_model(critic, tok, critic_dir)
        del critic
    if not PROMPTS.is_file():
        raise SystemExit(f"{PROMPTS} is missing: the bench needs the bundled prompts file")
    prompts = out / "prompts.jsonl"
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[: s["n_prompts"]]
    prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"base": str(base), "reward_model": str(rm_dir), "prompts": str(prompts),
            "critic_init": str(critic_dir if s["critic"] == "lora" else rm_dir)}


def update_flops(base: str, prompts: str, s: dict) -> dict:
    """Model FLOPs of one step's update (module docstring), from the model's config and the prompt
    pool's mean prompt length; the same count is used for both sides."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.models import load_tokenizer
    from pipeline.text import prompt_token_ids, read_prompts

    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters())
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    body = params - embed - (0 if tied else model.get_output_embeddings().weight.numel())  # the decoder layers
    lm_head = config.vocab_size * config.hidden_size
    tokenizer = load_tokenizer(base)
    lengths = [len(prompt_token_ids(tokenizer, r["prompt"], 512)) for r in read_prompts(prompts)]
    seq = sum(lengths) / len(lengths) + s["max_new_tokens"]
    attention = 12 * config.num_hidden_layers * config.hidden_size * seq  # per token, forward + backward
    per_token = 6 * (body + lm_head) + attention + 6 * body + attention  # policy, then critic
    tokens = s["batch_size"] * seq * s["ppo_epochs"]
    return {"update_flops": per_token * tokens, "params_policy": body + lm_head + embed * (not tied),
            "prompt_tokens_mean": seq - s["max_new_tokens"], "sequence_tokens_mean": seq}


class Marks:
    """Wall and process-CPU time at each step end (and the start); the update start when a hook
    sees it. CPU seconds (all threads of the process) are what a step costs when the machine is
    shared; wall seconds what it takes."""

    def __init__(self, device: str):
        self.ends: list[tuple[float, float]] = []
        self.update_starts: list[tuple[float, float] | None] = []
        self.cuda = device == "cuda"

    def now(self) -> tuple[float, float]:
        if self.cuda:  # kernels still queued belong to the step that queued them
            import torch

            torch.cuda.synchronize()
        return time.perf_counter(), time.process_time()

    def step_end(self) -> None:
        self.ends.append(self.now())
        self.update_starts.append(None)

    def update_start(self) -> None:
        if self.ends and self.update_starts[-1] is None:
            self.update_starts[-1] = self.now()

    def steps(self) -> list[dict]:
        """Per step: wall and cpu seconds of the whole step and of its update (when marked)."""
        out = []
        for i in range(1, len(self.ends)):
            (w0, c0), (w1, c1), mid = self.ends[i - 1], self.ends[i], self.update_starts[i - 1]
            row = {"wall": w1 - w0, "cpu": c1 - c0}
            if mid is not None:
                row["update_wall"], row["update_cpu"] = w1 - mid[0], c1 - mid[1]
            out.append(row)
        return out


def summary(steps: list[dict], batch_size: int) -> dict:
    rows = measured(steps)
    if not rows:
        raise RuntimeError("no step was timed: the timing hooks saw no step end")
    n = len(rows)
    wall, cpu = sum(r["wall"] for r in rows) / n, sum(r["cpu"] for r in rows) / n
    update, update_cpu = sum(r["update_wall"] for r in rows) / n, sum(r["update_cpu"] for r in rows) / n
    return {"eps": batch_size / wall, "eps_cpu": batch_size / cpu, "step_s": wall, "rollout_s": wall - update,
            "update_s": update, "rollout_cpu_s": cpu - update_cpu, "update_cpu_s": update_cpu, "steps_measured": n}


def measured(steps: list) -> list:
    """The steps that count: all but the first (it warms up), when there are 3 or more."""
    return steps[1:] if len(steps) >= 3 else steps


def peak_mb(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --------------------------------------------------------------------------- ours


def run_ours(s: dict, inputs: dict, estimator: str = "gae") -> dict:
    """Our trainer: PPO ('gae'), or RLOO ('rloo', the `rloo` side: no critic)."""
    import pipeline.train_ppo as tp
    from pipeline.config import ModelConfig, PPOConfig

    run_dir = Path(s["work"]) / f"ours_{estimator}_run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cfg = PPOConfig(steps=s["steps"], batch_size=s["batch_size"], mini_batch_size=s["mini_batch_size"],
                    micro_batch_size=s["micro_batch_size"], ppo_epochs=s["ppo_epochs"], lr=s["lr"],
                    critic_lr=s["lr"], max_new_tokens=s["max_new_tokens"], temperature=s["temperature"],
                    kl_control="fixed", init_kl_coef=s["kl_coef"], missing_eos_penalty=s["missing_eos_penalty"],
                    forward_batch_size=s["batch_size"], sample_every=0, seed=s["seed"],
                    advantage_estimator=estimator)
    model_cfg = ModelConfig(model=inputs["base"], lora=True, lora_r=s["lora_r"], lora_alpha=s["lora_alpha"],
                            device=s["device"], dtype=s["dtype"])
    # a step ends when the loop writes status.json 'running' (also written once before the first step)
    marks = Marks(s["device"])
    write = tp.write_status

    def timed_write(out, state, *a, **k):
        if state == "running":
            marks.step_end()
        return write(out, state, *a, **k)

    tp.write_status = timed_write
    tp.train(cfg, model_cfg, prompts=inputs["prompts"], reward=inputs["reward_model"], out_dir=run_dir,
             critic_init=inputs["critic_init"] if estimator == "gae" else "")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = marks.steps()
    if len(steps) != len(rows):
        raise RuntimeError(f"timed {len(steps)} steps but metrics.jsonl has {len(rows)}")
    for step, row in zip(steps, rows):  # the loop's own update time (phase 7), CPU time in proportion
        step["update_wall"] = row["time/update"]
        step["update_cpu"] = step["cpu"] * row["time/update"] / step["wall"]
    out = summary(steps, s["batch_size"])
    out["reward"] = rows[-1]["objective/rlhf_reward"]
    out["kl"] = rows[-1]["objective/kl"]
    out["response_tokens"] = rows[-1]["gen/length_mean"]
    kept = measured(rows)
    out["phases"] = {k: sum(r[f"time/{k}"] for r in kept) / len(kept) for k in ("sample", "forwards", "score")}
    return out


# --------------------------------------------------------------------------- TRL


def run_trl(s: dict, inputs: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl.experimental.ppo import PPOConfig as TRLConfig
    from trl.experimental.ppo import PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    from pipeline.models import load_tokenizer, pick_dtype
    from pipeline.text import prompt_token_ids, read_prompts

    cuda = s["device"] == "cuda"
    low = pick_dtype(s["dtype"], torch.device(s["device"]))  # the models' dtype; bf16 autocast when bf16
    tokenizer = load_tokenizer(inputs["base"])
    # TRL finds padding by comparing with pad_token_id; SmolLM2's pad is its EOS, which also ends
    # every chat turn, so TRL gets the distinct <|endoftext|> as pad (as TRL's examples add one).
    tokenizer.pad_token = "<|endoftext|>"
    rows = read_prompts(inputs["prompts"])
    ids = [prompt_token_ids(tokenizer, r["prompt"], 512) for r in rows]
    train_ds = Dataset.from_dict({"input_ids": ids})
    eval_ds = Dataset.from_dict({"input_ids": ids[: s["batch_size"]]})

    policy = AutoModelForCausalLM.from_pretrained(inputs["base"], dtype=low)

    def scalar(dtype):
        return trl_reward_model(inputs["reward_model"], dtype, tokenizer)

    reward_model = scalar(low)
    if s["critic"] == "lora":  # TRL's peft_config covers the policy only: the value model is wrapped here
        from peft import get_peft_model

        # As TRL wraps the policy (get_peft_model's defaults): the LoRA weights in fp32, the rest,
        # the trainable copy of the `score` head too, in the backbone's dtype. TRL scores the rollout
        # outside autocast (get_reward: the backbone's hidden states straight into model.score), so a
        # head in another dtype than the backbone's fails there ("expected m1 and m2 to have the same
        # dtype"); ours keeps its head in fp32 and casts the hidden states itself.
        value_model = get_peft_model(scalar(low), LoraConfig(
            r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=0.0, task_type="SEQ_CLS",
            target_modules=LORA_TARGETS, modules_to_save=["score"]))
    else:
        value_model = scalar(torch.float32)  # fully trained: fp32 master weights, as ours
    n_micro = s["batch_size"] // s["micro_batch_size"]
    args = TRLConfig(
        output_dir=str(Path(s["work"]) / "trl_run"), per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=n_micro, num_mini_batches=s["batch_size"] // s["mini_batch_size"],
        total_episodes=s["steps"] * s["batch_size"], num_ppo_epochs=s["ppo_epochs"],
        local_rollout_forward_batch_size=s["batch_size"], response_length=s["max_new_tokens"],
        temperature=s["temperature"], stop_token="eos", missing_eos_penalty=s["missing_eos_penalty"],
        kl_coef=s["kl_coef"], kl_estimator="k1", learning_rate=s["lr"], gradient_checkpointing=False,
        bf16=low == torch.bfloat16, fp16=False, use_cpu=not cuda, report_to="none", save_strategy="no",
        logging_steps=1,
        num_sample_generations=0, seed=s["seed"], disable_tqdm=True,
    )
    peft_config = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=LORA_TARGETS)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None,
                         reward_model=reward_model, train_dataset=train_ds, value_model=value_model,
                         eval_dataset=eval_ds, peft_config=peft_config)

    # the policy-and-value wrapper's forward runs only in the PPO epochs, so its first call in a
    # step starts the update; on_step_end ends the step (on_train_begin starts the first)
    marks = Marks(s["device"])
    wrapper_forward = trl_ppo.PolicyAndValueWrapper.forward

    def timed_forward(self, **kwargs):
        marks.update_start()
        return wrapper_forward(self, **kwargs)

    trl_ppo.PolicyAndValueWrapper.forward = timed_forward
    return train_timed(trainer, marks, s, optimiser_steps_per_step=1, reward="objective/rlhf_reward",
                       kl="objective/kl")


def run_trl_rloo(s: dict, inputs: dict) -> dict:
    """TRL's RLOOTrainer on our RLOO side's work: the same prompts (our chat template and system
    prompt, as conversations), k = 4 samples per prompt, episodes per step, minibatches (TRL's
    optimiser steps per generation), epochs (TRL's num_iterations), response length, temperature,
    KL coefficient (TRL's beta: the sequence KL subtracted from the reward, as ours), LoRA and
    reference (the adapter disabled), reward model and threads. TRL has no missing-EOS penalty."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import RLOOConfig, RLOOTrainer

    from pipeline.config import PPOConfig as OurConfig
    from pipeline.config import group_size
    from pipeline.models import load_tokenizer, pick_dtype
    from pipeline.text import read_prompts, to_messages, with_system_prompt

    low = pick_dtype(s["dtype"], torch.device(s["device"]))
    tokenizer = load_tokenizer(inputs["base"])
    tokenizer.pad_token = "<|endoftext|>"  # as the TRL PPO side: a pad distinct from the EOS
    prompts = [with_system_prompt(to_messages(r["prompt"])) for r in read_prompts(inputs["prompts"])]
    per_generation = s["batch_size"] // s["mini_batch_size"]  # optimiser steps per generation batch
    steps_per_rollout = per_generation * s["ppo_epochs"]
    args = RLOOConfig(
        output_dir=str(Path(s["work"]) / "trl_rloo_run"), per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=s["mini_batch_size"] // s["micro_batch_size"],
        steps_per_generation=per_generation, num_iterations=s["ppo_epochs"],
        num_generations=group_size(OurConfig(advantage_estimator="rloo")),
        max_steps=s["steps"] * steps_per_rollout, max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"], top_k=0, top_p=1.0, beta=s["kl_coef"], learning_rate=s["lr"],
        gradient_checkpointing=False, bf16=low == torch.bfloat16, fp16=False, use_cpu=s["device"] != "cuda",
        report_to="none", save_strategy="no", logging_steps=1, seed=s["seed"], disable_tqdm=True,
    )
    peft_config = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=LORA_TARGETS)
    trainer = RLOOTrainer(model=AutoModelForCausalLM.from_pretrained(inputs["base"], dtype=low),
                          reward_funcs=trl_reward_model(inputs["reward_model"], low, tokenizer), args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tokenizer,
                          reward_processing_classes=tokenizer, peft_config=peft_config)

    # a step is one generation batch and its optimiser steps: generation and scoring are the
    # rollout, what follows them until the last optimiser step of the batch the update
    marks = Marks(s["device"])
    generate = RLOOTrainer._generate_and_score_completions

    def timed_generate(self, *a, **k):
        out = generate(self, *a, **k)
        marks.update_start()
        return out

    RLOOTrainer._generate_and_score_completions = timed_generate
    return train_timed(trainer, marks, s, optimiser_steps_per_step=steps_per_rollout, reward="reward", kl="kl")


def train_timed(trainer, marks: Marks, s: dict, optimiser_steps_per_step: int, reward: str, kl: str) -> dict:
    """Train a TRL trainer, marking a step's end after every `optimiser_steps_per_step` of TRL's
    optimiser steps (the first step starts at on_train_begin); the timing summary and the last
    logged reward and KL (TRL's names for them)."""
    from transformers import TrainerCallback

    history: list[dict] = []

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.step_end()

        def on_step_end(self, args, state, control, **k):
            if state.global_step % optimiser_steps_per_step == 0:
                marks.step_end()

        def on_log(self, args, state, control, logs=None, **k):
            history.append(dict(logs or {}))

    trainer.add_callback(Timer())
    trainer.train()
    out = summary(marks.steps()[: s["steps"]], s["batch_size"])
    last = next((entry for entry in reversed(history) if reward in entry), {})
    out["reward"] = float(last.get(reward, float("nan")))
    out["kl"] = float(last.get(kl, float("nan")))
    return out


def trl_reward_model(folder: str, dtype, tokenizer):
    """Our reward model as TRL loads one: a sequence classifier with our scalar head."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    head = load_file(str(Path(folder) / "scalar_head.safetensors"))
    model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, dtype=dtype)
    with torch.no_grad():
        model.score.weight.copy_(head["weight"].to(dtype))  # our head's bias is 0 (unnormalised RM)
    model.config.pad_token_id = tokenizer.pad_token_id
    return model


# --------------------------------------------------------------------------- driver


SIDES = {"ours": run_ours, "rloo": lambda s, i: run_ours(s, i, "rloo"), "trl": run_trl, "trl_rloo": run_trl_rloo}
"""Each side's run; the critic-free ones (no critic FLOPs) are CRITIC_FREE_SIDES."""
CRITIC_FREE_SIDES = ("rloo", "trl_rloo")


def child(which: str, s: dict, inputs: dict) -> None:
    import torch

    torch.set_num_threads(s["threads"])
    torch.manual_seed(s["seed"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = SIDES[which](s, inputs)
    result["peak_mb"] = peak_mb(s["device"])
    print("CHILD_RESULT " + json.dumps(result), flush=True)


def run_child(which: str, inputs: dict, argv: list[str]) -> tuple[dict | None, str]:
    """(result, '') of one side's run in its own process, or (None, why: its exit code and the
    traceback) when it fails."""
    from bench.run_all import traceback_tail

    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", which] + argv
    pythonpath = os.pathsep.join(x for x in (str(ROOT), os.environ.get("PYTHONPATH", "")) if x)
    env = {**os.environ, "PPO_BENCH_INPUTS": json.dumps(inputs), "PYTHONPATH": pythonpath,
           "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if which != "ours":  # the TRL side needs datasets, which bench/gpu_check.py refuses to our side
        env.pop("RLHF_BLOCK_IMPORTS", None)
    t0 = time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, errors="replace")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD_RESULT ")]
    if proc.returncode != 0 or not lines:
        why = f"exit {proc.returncode}\n" + traceback_tail(proc.stdout + "\n" + proc.stderr)
        print(f"{which}: FAILED after {time.time() - t0:.0f}s ({why})", flush=True)
        return None, why
    print(f"{which}: done in {time.time() - t0:.0f}s", flush=True)
    return json.loads(lines[-1][len("CHILD_RESULT "):]), ""


def spread(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def fmt(values: list[float], digits: int = 3) -> str:
    med, lo, hi = spread(values)
    return f"{med:.{digits}f} [{lo:.{digits}f}-{hi:.{digits}f}]" if len(values) > 1 else f"{med:.{digits}f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small settings: about 10 minutes on 2 CPU cores")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--model", default="default",
                        help="'default' (SmolLM2-135M-Instruct) or a Hugging Face model folder")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in both runs")
    parser.add_argument("--critic", choices=["lora", "full"], default="lora",
                        help="critic: LoRA (the same LoRA setting as the policy; TRL's value model wrapped with "
                             "peft) or fully trained (TRL's default arrangement)")
    parser.add_argument("--reps", type=int, default=3, help="runs of each side, the order alternating")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=0)
    parser.add_argument("--mini-batch-size", dest="mini_batch_size", type=int, default=0)
    parser.add_argument("--micro-batch-size", dest="micro_batch_size", type=int, default=0)
    parser.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=0)
    parser.add_argument("--ppo-epochs", dest="ppo_epochs", type=int, default=0)
    parser.add_argument("--n-prompts", dest="n_prompts", type=int, default=256)
    parser.add_argument("--sides", default="ours,trl", help="comma-separated sides: ours (our PPO), trl "
                        "(TRL's PPOTrainer), rloo (our RLOO: no critic), trl_rloo (TRL's RLOOTrainer)")
    parser.add_argument("--dtype", choices=["auto", "fp32", "bf16"], default="auto",
                        help="both sides' precision: auto = bf16 on a GPU that has it, else fp32; bf16 on the "
                             "CPU runs CPU autocast (the GPU check's dry run)")
    parser.add_argument("--reward-base", default="", help="the model folder the reward model and critic are built "
                        "from (default: --model; bench/gpu_check.py gives the same weights with an in-vocabulary EOS)")
    parser.add_argument("--work", default=str(OUT), help="folder for the shared inputs and the run folders")
    parser.add_argument("--json", default="", help="also write the results to this JSON file")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    s = settings(args)
    if args.child:
        child(args.child, s, json.loads(os.environ["PPO_BENCH_INPUTS"]))
        return 0

    from bench.run_all import write_json

    inputs = prepare(s)
    flops = update_flops(inputs["base"], inputs["prompts"], s)
    print(f"settings: {json.dumps(s)}", flush=True)
    sides = args.sides.split(",")
    if not sides or set(sides) - set(SIDES):
        raise SystemExit(f"--sides {args.sides}: choose from {', '.join(SIDES)}")
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    failed: dict[str, str] = {}  # side -> its exit code and traceback; a side that failed is not run again
    result = {"settings": s, "flops": flops, "runs": runs, "failed": failed, "reps": args.reps, "complete": False}

    def save() -> None:  # after every run: a bench stopped half-way keeps the runs it finished
        if args.json:
            write_json(args.json, result)

    save()
    for rep in range(args.reps):
        for which in (sides if rep % 2 == 0 else sides[::-1]):  # alternate who goes first
            if which in failed:
                continue
            print(f"rep {rep + 1}/{args.reps}: ", end="", flush=True)
            run, why = run_child(which, inputs, sys.argv[1:])
            if run is None:
                failed[which] = why
            else:  # the FLOPs count policy and critic: the RLOO sides have no critic, so no figure
                critic = which not in CRITIC_FREE_SIDES
                run["update_tflops_s"] = flops["update_flops"] / run["update_s"] / 1e12 if critic else 0.0
                runs[which].append(run)
            save()
    result["complete"] = True
    done = [w for w in sides if runs[w]]

    def col(which: str, key: str) -> list[float]:
        return [r[key] for r in runs[which]]

    print(f"\n{args.reps} repetitions, order alternating; median [min-max]; update FLOPs per step "
          f"{flops['update_flops'] / 1e12:.3f} TFLOP ({flops['sequence_tokens_mean']:.0f} tokens per episode)")
    print(f"{'':9}{'episodes/s':>26}{'rollout s':>22}{'update s':>22}{'peak MB':>20}{'update TFLOP/s':>26}")
    for which in done:
        print(f"{which:9}{fmt(col(which, 'eps')):>26}{fmt(col(which, 'rollout_s'), 2):>22}"
              f"{fmt(col(which, 'update_s'), 2):>22}{fmt(col(which, 'peak_mb'), 0):>20}"
              f"{fmt(col(which, 'update_tflops_s'), 4):>26}")
    for which, why in failed.items():
        print(f"{which:9}FAILED: {why.splitlines()[-1] if why.strip() else why}")
    if runs.get("ours"):
        ph = runs["ours"][0]["phases"]
        print("ours, rollout phases of the first repetition (s per step): "
              + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()))
    med = {w: {k: statistics.median(col(w, k)) for k in ("eps", "eps_cpu", "rollout_s", "update_s",
                                                          "update_tflops_s")} for w in done}
    peak = {w: max(col(w, "peak_mb")) for w in done}
    result.update(median=med, peak_mb=peak)
    line = "RESULT ppo"
    for w in done:
        line += (f" {w}_eps={med[w]['eps']:.3f} {w}_eps_min={min(col(w, 'eps')):.3f} "
                 f"{w}_eps_max={max(col(w, 'eps')):.3f}")
    if "ours" in done and "rloo" in done:
        per_rep = [a["eps"] / b["eps"] for a, b in zip(runs["rloo"], runs["ours"])]
        rloo_ratio = med["rloo"]["eps"] / med["ours"]["eps"]
        print(f"\nour RLOO / our PPO: episodes/s x{rloo_ratio:.2f} (per repetition {min(per_rep):.2f}-{max(per_rep):.2f}); "
              f"update x{med['ours']['update_s'] / med['rloo']['update_s']:.2f} faster; peak memory "
              f"x{peak['rloo'] / peak['ours']:.2f}")
        line += (f" rloo_ratio={rloo_ratio:.2f} rloo_ratio_min={min(per_rep):.2f} rloo_ratio_max={max(per_rep):.2f}"
                 f" rloo_peak_ratio={peak['rloo'] / peak['ours']:.2f}")
    if "rloo" in done and "trl_rloo" in done:
        per_rep = [a["eps"] / b["eps"] for a, b in zip(runs["rloo"], runs["trl_rloo"])]
        ratio = med["rloo"]["eps"] / med["trl_rloo"]["eps"]
        print(f"\nour RLOO / TRL's RLOO: episodes/s x{ratio:.2f} (per repetition {min(per_rep):.2f}-{max(per_rep):.2f}); "
              f"rollout x{med['trl_rloo']['rollout_s'] / med['rloo']['rollout_s']:.2f} faster, update "
              f"x{med['trl_rloo']['update_s'] / med['rloo']['update_s']:.2f} faster; peak memory "
              f"x{peak['rloo'] / peak['trl_rloo']:.2f}")
        line += (f" rloo_trl_ratio={ratio:.2f} rloo_trl_ratio_min={min(per_rep):.2f} "
                 f"rloo_trl_ratio_max={max(per_rep):.2f} rloo_trl_peak_ratio={peak['rloo'] / peak['trl_rloo']:.2f}")
    if "ours" in done and "trl" in done:
        ours, trl = med["ours"], med["trl"]
        ratio, ratio_cpu = ours["eps"] / trl["eps"], ours["eps_cpu"] / trl["eps_cpu"]
        per_rep = [a["eps"] / b["eps"] for a, b in zip(runs["ours"], runs["trl"])]
        print(f"\nours / TRL: episodes/s x{ratio:.2f} (ratio of medians; per repetition {min(per_rep):.2f}-"
              f"{max(per_rep):.2f}), x{ratio_cpu:.2f} (CPU time); rollout x{trl['rollout_s'] / ours['rollout_s']:.2f} "
              f"faster, update x{trl['update_s'] / ours['update_s']:.2f} faster; peak memory x{peak['ours'] / peak['trl']:.2f}")
        line += (f" ratio={ratio:.2f} ratio_min={min(per_rep):.2f} ratio_max={max(per_rep):.2f} "
                 f"ratio_cpu={ratio_cpu:.2f}")
        result.update(ratio=ratio, ratio_per_rep=per_rep)
    for key, digits in (("rollout_s", 2), ("update_s", 2)):
        line += "".join(f" {w}_{key}={med[w][key]:.{digits}f}" for w in done)
    line += "".join(f" {w}_peak_mb={peak[w]:.0f}" for w in done)
    line += "".join(f" {w}_update_tflops_s={med[w]['update_tflops_s']:.4f}" for w in done)
    line += "".join(f" {w}=failed" for w in failed) + f" reps={args.reps} device={s['device']} dtype={s['dtype']}"
    print(line)
    result["result_line"] = line
    save()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
