"""Our PPO (pipeline/train_ppo.py) against TRL's PPOTrainer (trl==1.12.0, `trl.experimental.ppo`).

    python bench/ppo_bench.py            # SmolLM2-135M, batch 16, 48 new tokens, 2 PPO epochs, 5 steps
    python bench/ppo_bench.py --quick    # batch 8, 32 new tokens, 1 epoch, 3 steps (a few minutes)
    python bench/ppo_bench.py --device cuda   # bf16 autocast on a GPU

Both run one after the other, each in its own child process (so each peak-memory figure is its
own), with the same: policy (the default SmolLM2-135M-Instruct, LoRA r16 on all linear layers),
reward model (the same backbone and scalar head, saved once), critic (starting as that reward
model; `--critic lora` (default): the same LoRA setting, TRL's value model wrapped with peft by
hand since TRL's peft_config covers the policy only; `--critic full`: fully trained, TRL's default
arrangement), prompts (the bundled pool, store/data/prompts.jsonl, with the same chat template), batch size,
minibatches, micro-batch size, response length, PPO epochs, temperature, fixed KL coefficient,
missing-EOS penalty, precision and threads.
Differences left as each library has them: TRL takes one learning rate for policy and critic and,
with gradient accumulation over minibatches, steps its optimiser once per epoch; gradient
checkpointing is turned off in TRL (its default is on) because ours does not checkpoint.

Figures: episodes/s over the measured steps (the first step is a warm-up and is left out when
there are 3 or more), seconds per step split into rollout (sampling, reference, critic, reward,
advantages) and update (the PPO epochs), and peak memory (RSS on CPU; max allocated on CUDA).
Requires `pip install trl==1.12.0` (the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ROOT / "store" / "data" / "prompts.jsonl"  # the app's bundled pool (license: store/data/LICENSE.md)
OUT = ROOT / "bench" / "out" / "ppo"


def settings(args) -> dict:
    quick = dict(steps=3, batch_size=8, mini_batch_size=4, micro_batch_size=4, max_new_tokens=32, ppo_epochs=1)
    full = dict(steps=5, batch_size=16, mini_batch_size=8, micro_batch_size=8, max_new_tokens=48, ppo_epochs=2)
    s = quick if args.quick else full
    for key in s:
        if getattr(args, key, None):
            s[key] = getattr(args, key)
    return {**s, "temperature": 0.7, "lr": 1e-5, "kl_coef": 0.05, "missing_eos_penalty": 1.0, "lora_r": 16,
            "lora_alpha": 32, "critic": args.critic, "device": args.device, "threads": args.threads,
            "n_prompts": args.n_prompts, "seed": 0}


# --------------------------------------------------------------------------- shared inputs


def prepare(s: dict) -> dict:
    """The base model folder, a reward model folder (full backbone, seeded head) and a prompts file."""
    import torch

    from pipeline.config import ModelConfig
    from pipeline.models import default_model_dir, load_scalar_model, save_scalar_model

    base = default_model_dir()
    OUT.mkdir(parents=True, exist_ok=True)
    rm_dir, critic_dir = OUT / "reward_model", OUT / "critic_lora"
    if not (rm_dir / "model_meta.json").is_file():
        torch.manual_seed(0)
        rm, tok = load_scalar_model("default", kind="reward", cfg=ModelConfig(device="cpu", dtype="fp32", lora=False))
        save_scalar_model(rm, tok, rm_dir)
    if not (critic_dir / "model_meta.json").is_file():
        # a LoRA critic on the same backbone with the reward model's head: starts equal to the RM
        from safetensors.torch import load_file

        lora_cfg = ModelConfig(device="cpu", dtype="fp32", lora=True, lora_r=s["lora_r"], lora_alpha=s["lora_alpha"])
        critic, tok = load_scalar_model("default", kind="critic", cfg=lora_cfg)
        critic.head.load_state_dict(load_file(str(rm_dir / "scalar_head.safetensors")))
        save_scalar_model(critic, tok, critic_dir)
    if not PROMPTS.is_file():
        raise SystemExit(f"{PROMPTS} is missing: the bench needs the bundled prompts file")
    prompts = OUT / "prompts.jsonl"
    lines = PROMPTS.read_text(encoding="utf-8").splitlines()[: s["n_prompts"]]
    prompts.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return {"base": str(base), "reward_model": str(rm_dir), "prompts": str(prompts),
            "critic_init": str(critic_dir if s["critic"] == "lora" else rm_dir)}


class Marks:
    """Wall and process-CPU time at step start, update start and step end. CPU seconds (all threads
    of the process) are what a step costs when the machine is shared; wall seconds what it takes."""

    def __init__(self):
        self.rows: list[tuple[float, float, float, float]] = []  # rollout wall, update wall, rollout cpu, update cpu
        self.start = self.mid = None

    @staticmethod
    def now() -> tuple[float, float]:
        return time.perf_counter(), time.process_time()

    def step_start(self) -> None:
        self.start, self.mid = self.now(), None

    def update_start(self) -> None:
        if self.start is not None and self.mid is None:
            self.mid = self.now()

    def step_end(self) -> None:
        end = self.now()
        (ws, cs), (wm, cm) = self.start, self.mid
        self.rows.append((wm - ws, end[0] - wm, cm - cs, end[1] - cm))
        self.start, self.mid = end, None

    def summary(self, batch_size: int) -> dict:
        rows = measured(self.rows)
        n = len(rows)
        mean = [sum(r[i] for r in rows) / n for i in range(4)]
        return {"eps": batch_size / (mean[0] + mean[1]), "eps_cpu": batch_size / (mean[2] + mean[3]),
                "rollout_s": mean[0], "update_s": mean[1], "rollout_cpu_s": mean[2], "update_cpu_s": mean[3],
                "steps_measured": n}


def measured(steps: list) -> list:
    """The steps that count: all but the first (it warms up), when there are 3 or more."""
    return steps[1:] if len(steps) >= 3 else steps


def peak_mb(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


# --------------------------------------------------------------------------- ours


def run_ours(s: dict, inputs: dict) -> dict:
    import pipeline.train_ppo as tp
    from pipeline.config import ModelConfig, PPOConfig

    run_dir = OUT / "ours_run"
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cfg = PPOConfig(steps=s["steps"], batch_size=s["batch_size"], mini_batch_size=s["mini_batch_size"],
                    micro_batch_size=s["micro_batch_size"], ppo_epochs=s["ppo_epochs"], lr=s["lr"],
                    critic_lr=s["lr"], max_new_tokens=s["max_new_tokens"], temperature=s["temperature"],
                    kl_control="fixed", init_kl_coef=s["kl_coef"], missing_eos_penalty=s["missing_eos_penalty"],
                    forward_batch_size=s["batch_size"], sample_every=0, seed=s["seed"])
    model_cfg = ModelConfig(model=inputs["base"], lora=True, lora_r=s["lora_r"], lora_alpha=s["lora_alpha"],
                            device=s["device"], dtype="auto")
    # step start = sampling; update start = the first policy forward of phase 7 (the rollout's
    # forwards go through pipeline.rollout, not this module's name); step end = status.json update
    marks = Marks()
    sample, response_logits, write = tp.sample, tp.response_logits, tp.write_status

    def timed_sample(*a, **k):
        marks.step_start()
        return sample(*a, **k)

    def timed_logits(*a, **k):
        marks.update_start()
        return response_logits(*a, **k)

    def timed_write(out, state, step, *a, **k):
        if state == "running" and marks.start is not None:
            marks.step_end()
        return write(out, state, step, *a, **k)

    tp.sample, tp.response_logits, tp.write_status = timed_sample, timed_logits, timed_write
    tp.train(cfg, model_cfg, prompts=inputs["prompts"], reward=inputs["reward_model"], out_dir=run_dir,
             critic_init=inputs["critic_init"])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = marks.summary(s["batch_size"])
    out["reward"] = rows[-1]["objective/rlhf_reward"]
    out["kl"] = rows[-1]["objective/kl"]
    steps = measured(rows)
    out["phases"] = {k: sum(r[f"time/{k}"] for r in steps) / len(steps) for k in ("sample", "forwards", "score")}
    return out


# --------------------------------------------------------------------------- TRL


def run_trl(s: dict, inputs: dict) -> dict:
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, TrainerCallback
    from trl.experimental.ppo import PPOConfig as TRLConfig
    from trl.experimental.ppo import PPOTrainer
    from trl.experimental.ppo import ppo_trainer as trl_ppo

    from pipeline.text import prompt_token_ids, read_prompts
    from pipeline.models import load_tokenizer

    cuda = s["device"] == "cuda"
    low = torch.bfloat16 if cuda else torch.float32
    tokenizer = load_tokenizer(inputs["base"])
    # TRL finds padding by comparing with pad_token_id; SmolLM2's pad is its EOS, which also ends
    # every chat turn, so TRL gets the distinct <|endoftext|> as pad (as TRL's examples add one).
    tokenizer.pad_token = "<|endoftext|>"
    rows = read_prompts(inputs["prompts"])
    ids = [prompt_token_ids(tokenizer, r["prompt"], 512) for r in rows]
    train_ds = Dataset.from_dict({"input_ids": ids})
    eval_ds = Dataset.from_dict({"input_ids": ids[: s["batch_size"]]})

    policy = AutoModelForCausalLM.from_pretrained(inputs["base"], dtype=low)
    head = load_file(str(Path(inputs["reward_model"]) / "scalar_head.safetensors"))

    def scalar(dtype):
        model = AutoModelForSequenceClassification.from_pretrained(inputs["reward_model"], num_labels=1, dtype=dtype)
        with torch.no_grad():
            model.score.weight.copy_(head["weight"].to(dtype))  # our head's bias is 0 (unnormalised RM)
        model.config.pad_token_id = tokenizer.pad_token_id
        return model

    lora_targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    reward_model = scalar(low)
    if s["critic"] == "lora":  # TRL's peft_config covers the policy only: the value model is wrapped here
        from peft import get_peft_model

        value_model = get_peft_model(scalar(low), LoraConfig(
            r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=0.0, task_type="SEQ_CLS",
            target_modules=lora_targets, modules_to_save=["score"]))
        for p in value_model.parameters():  # fp32 trainable parameters over a low-precision base, as ours
            if p.requires_grad:
                p.data = p.data.float()
    else:
        value_model = scalar(torch.float32)  # fully trained: fp32 master weights, as ours
    n_micro = s["batch_size"] // s["micro_batch_size"]
    args = TRLConfig(
        output_dir=str(OUT / "trl_run"), per_device_train_batch_size=s["micro_batch_size"],
        gradient_accumulation_steps=n_micro, num_mini_batches=s["batch_size"] // s["mini_batch_size"],
        total_episodes=s["steps"] * s["batch_size"], num_ppo_epochs=s["ppo_epochs"],
        local_rollout_forward_batch_size=s["batch_size"], response_length=s["max_new_tokens"],
        temperature=s["temperature"], stop_token="eos", missing_eos_penalty=s["missing_eos_penalty"],
        kl_coef=s["kl_coef"], kl_estimator="k1", learning_rate=s["lr"], gradient_checkpointing=False,
        bf16=cuda, fp16=False, use_cpu=not cuda, report_to="none", save_strategy="no", logging_steps=1,
        num_sample_generations=0, seed=s["seed"], disable_tqdm=True,
    )
    peft_config = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=0.0, task_type="CAUSAL_LM",
                             target_modules=lora_targets)
    trainer = PPOTrainer(args=args, processing_class=tokenizer, model=policy, ref_model=None,
                         reward_model=reward_model, train_dataset=train_ds, value_model=value_model,
                         eval_dataset=eval_ds, peft_config=peft_config)

    # Rollout/update split: the policy-and-value wrapper's forward runs only in the PPO epochs, so its
    # first call in a step ends the rollout; on_step_end ends the step (and starts the next).
    marks = Marks()
    history: list[dict] = []
    wrapper_forward = trl_ppo.PolicyAndValueWrapper.forward

    def timed_forward(self, **kwargs):
        marks.update_start()
        return wrapper_forward(self, **kwargs)

    trl_ppo.PolicyAndValueWrapper.forward = timed_forward

    class Timer(TrainerCallback):
        def on_train_begin(self, *a, **k):
            marks.step_start()

        def on_step_end(self, *a, **k):
            marks.step_end()

        def on_log(self, args, state, control, logs=None, **k):
            history.append(dict(logs or {}))

    trainer.add_callback(Timer())
    trainer.train()
    out = marks.summary(s["batch_size"])
    last = next((entry for entry in reversed(history) if "objective/rlhf_reward" in entry), {})
    out["reward"] = float(last.get("objective/rlhf_reward", float("nan")))
    out["kl"] = float(last.get("objective/kl", float("nan")))
    return out


# --------------------------------------------------------------------------- driver


def child(which: str, s: dict, inputs: dict) -> None:
    import torch

    torch.set_num_threads(s["threads"])
    torch.manual_seed(s["seed"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = run_ours(s, inputs) if which == "ours" else run_trl(s, inputs)
    result["peak_mb"] = peak_mb(s["device"])
    print("CHILD_RESULT " + json.dumps(result), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small settings: a few minutes on 2 CPU cores")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads in both runs")
    parser.add_argument("--critic", choices=["lora", "full"], default="lora",
                        help="critic: LoRA (the same LoRA setting as the policy; TRL's value model wrapped with "
                             "peft) or fully trained (TRL's default arrangement)")
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--batch-size", dest="batch_size", type=int, default=0)
    parser.add_argument("--mini-batch-size", dest="mini_batch_size", type=int, default=0)
    parser.add_argument("--micro-batch-size", dest="micro_batch_size", type=int, default=0)
    parser.add_argument("--max-new-tokens", dest="max_new_tokens", type=int, default=0)
    parser.add_argument("--ppo-epochs", dest="ppo_epochs", type=int, default=0)
    parser.add_argument("--n-prompts", dest="n_prompts", type=int, default=256)
    parser.add_argument("--only", choices=["ours", "trl"], default=None, help="run one side only")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    s = settings(args)
    if args.child:
        child(args.child, s, json.loads(os.environ["PPO_BENCH_INPUTS"]))
        return 0

    inputs = prepare(s)
    print(f"settings: {json.dumps(s)}", flush=True)
    results = {}
    for which in ([args.only] if args.only else ["ours", "trl"]):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", which] + sys.argv[1:]
        env = {**os.environ, "PPO_BENCH_INPUTS": json.dumps(inputs), "PYTHONPATH": str(ROOT),
               "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        t0 = time.time()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CHILD_RESULT ")]
        if proc.returncode != 0 or not lines:
            print(proc.stdout[-3000:], proc.stderr[-6000:], sep="\n")
            raise SystemExit(f"the {which} run failed (exit {proc.returncode})")
        results[which] = json.loads(lines[-1][len("CHILD_RESULT "):])
        print(f"{which}: done in {time.time() - t0:.0f}s", flush=True)

    print(f"\n{'':6}{'episodes/s':>11}{'eps (cpu)':>10}{'rollout s':>10}{'update s':>9}{'rollout cpu':>12}"
          f"{'update cpu':>11}{'peak MB':>9}{'reward':>8}{'KL':>8}")
    for which, r in results.items():
        print(f"{which:6}{r['eps']:11.3f}{r['eps_cpu']:10.3f}{r['rollout_s']:10.2f}{r['update_s']:9.2f}"
              f"{r['rollout_cpu_s']:12.2f}{r['update_cpu_s']:11.2f}{r['peak_mb']:9.0f}{r['reward']:8.3f}{r['kl']:8.3f}")
    if "phases" in results.get("ours", {}):
        print("ours, rollout phases (s per step): " + ", ".join(f"{k} {v:.2f}" for k, v in results["ours"]["phases"].items()))
    if len(results) == 2:
        ours, trl = results["ours"], results["trl"]
        ratio, ratio_cpu = ours["eps"] / trl["eps"], ours["eps_cpu"] / trl["eps_cpu"]
        mem = ours["peak_mb"] / trl["peak_mb"]
        print(f"\nours / TRL: episodes/s x{ratio:.2f} (wall), x{ratio_cpu:.2f} (CPU time); rollout "
              f"x{trl['rollout_s'] / ours['rollout_s']:.2f} faster, update x{trl['update_s'] / ours['update_s']:.2f} "
              f"faster; peak memory x{mem:.2f}")
        print(f"RESULT ppo ours_eps={ours['eps']:.3f} trl_eps={trl['eps']:.3f} ratio={ratio:.2f} "
              f"ratio_cpu={ratio_cpu:.2f} ours_rollout_s={ours['rollout_s']:.2f} trl_rollout_s={trl['rollout_s']:.2f} "
              f"ours_update_s={ours['update_s']:.2f} trl_update_s={trl['update_s']:.2f} "
              f"ours_peak_mb={ours['peak_mb']:.0f} trl_peak_mb={trl['peak_mb']:.0f} device={s['device']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
