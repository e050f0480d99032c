"""Background generation inside the app: K responses for prompts that have none.

One daemon thread runs one job at a time; the UI polls `status()` (a gr.Timer) for its progress
bar and stays usable meanwhile. Prompts are generated in small chunks and each chunk is stored as
soon as it is done (`Store.add_responses_bulk`, one transaction), so annotators can start ranking
the first items while the rest are still being sampled.

Each job is recorded as a run (kind 'generate') and every response names the policy version that
wrote it. This is the only module of the app that touches a model; issue 7's job runner
(pipeline/orchestrate/jobs.py) can replace `GenerationRunner` with a subprocess without changing the UI, which
only calls `start()` and `status()`.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import traceback
from dataclasses import dataclass

from tqdm import tqdm

from pipeline.config import GenerateConfig, ModelConfig

RUN_KIND = "generate"


@dataclass(frozen=True)
class JobStatus:
    """A snapshot of one job, safe to read from any thread."""

    run_id: int | None
    label: str
    status: str
    """running | done | failed"""
    done: int
    """Prompts finished (their responses are stored)."""
    total: int
    detail: str = ""
    error: str | None = None
    started: float = 0.0
    finished: float | None = None

    @property
    def running(self) -> bool:
        return self.status == "running"


def ensure_policy_version(store, model_cfg: ModelConfig):
    """The active policy; on first start, register the configured base model as the first policy
    version (no checkpoint path: the base weights as they are) and make it active."""
    active = store.active_policy()
    if active is not None:
        return active
    for mv in store.list_model_versions("policy"):
        if mv.path is None and mv.base_model == model_cfg.model:
            return store.set_active_policy(mv.id)
    mv = store.register_model_version("policy", base_model=model_cfg.model,
                                      meta={"source": "base model", "lora": False})
    return store.set_active_policy(mv.id)


class GenerationRunner:
    """Runs generation jobs one at a time in a background thread (see the module docstring)."""

    def __init__(self, store, model_cfg: ModelConfig, *, chunk_prompts: int = 4,
                 torch_threads: int | None = None):
        """model_cfg: how to load the base model (its `model` names it; LoRA is not needed to
        sample). chunk_prompts: prompts generated and stored together. torch_threads: CPU threads
        for sampling (default: all but one core, leaving one to serve the UI)."""
        self.store = store
        self.model_cfg = dataclasses.replace(model_cfg, lora=False)
        self.chunk_prompts = max(1, int(chunk_prompts))
        self.torch_threads = torch_threads or max(1, (os.cpu_count() or 2) - 1)
        self._lock = threading.Lock()
        self._status: JobStatus | None = None
        self._thread: threading.Thread | None = None
        self._models: dict[int, tuple] = {}  # version id -> (policy, tokenizer), loaded once
        self._fail_interrupted_runs()

    # -- what the UI calls

    def status(self) -> JobStatus | None:
        with self._lock:
            return self._status

    def busy(self) -> bool:
        status = self.status()
        return status is not None and status.running

    def start(self, prompt_ids: list[int], k: int, cfg: GenerateConfig | None = None,
              version_id: int | None = None, label: str = "Generating responses") -> JobStatus:
        """Start generating `k` responses for each prompt (in the background). Raises RuntimeError
        while another job runs, ValueError on bad settings."""
        cfg = dataclasses.replace(cfg or GenerateConfig(), k=int(k))
        if cfg.k < 2:
            raise ValueError(f"K={cfg.k}: ranking needs at least 2 responses per prompt")
        if not prompt_ids:
            raise ValueError("no prompts to generate for")
        with self._lock:
            if self._status is not None and self._status.running:
                raise RuntimeError("a generation job is already running; wait for it to finish")
            version = (self.store.get_model_version(version_id) if version_id is not None
                       else ensure_policy_version(self.store, self.model_cfg))
            run = self.store.create_run(
                RUN_KIND, config={"generate": dataclasses.asdict(cfg), "model": dataclasses.asdict(self.model_cfg)},
                inputs={"prompt_ids": list(prompt_ids), "model_version_id": version.id})
            self._status = JobStatus(run.id, label, "running", 0, len(prompt_ids),
                                     detail=f"loading {version.name}", started=time.time())
            self._thread = threading.Thread(target=self._run, args=(run.id, list(prompt_ids), cfg, version),
                                            name=f"generate-{run.id}", daemon=True)
            self._thread.start()
            return self._status

    def wait(self, timeout: float | None = None) -> JobStatus | None:
        """Block until the current job ends (tests, the CLI)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        return self.status()

    # -- the job

    def _update(self, **changes) -> None:
        with self._lock:
            self._status = dataclasses.replace(self._status, **changes)

    def _run(self, run_id: int, prompt_ids: list[int], cfg: GenerateConfig, version) -> None:
        import torch

        from pipeline.generate import generate_responses

        try:
            self.store.update_run(run_id, status="running")
            torch.set_num_threads(self.torch_threads)
            # 1. load the policy (once per version; later jobs reuse it)
            if version.id not in self._models:
                from pipeline.models import load_policy

                self._models[version.id] = load_policy(self.model_cfg, adapter_path=version.path)
            policy, tokenizer = self._models[version.id]
            policy.eval()
            sampling = {k: getattr(cfg, k) for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed")}
            done = 0
            bar = tqdm(total=len(prompt_ids), desc=f"generate K={cfg.k} with {version.name}", unit="prompt")
            # 2. chunk by chunk: sample K responses per prompt, store them as items right away
            for start in range(0, len(prompt_ids), self.chunk_prompts):
                chunk = prompt_ids[start:start + self.chunk_prompts]
                prompts = [self.store.get_prompt(pid) for pid in chunk]
                self._update(detail=f"sampling with {version.name}")
                chunk_cfg = dataclasses.replace(cfg, seed=cfg.seed + start)  # distinct samples per chunk
                gens = generate_responses(policy, tokenizer, [p.messages or p.text for p in prompts], cfg.k, chunk_cfg)
                self.store.add_responses_bulk(version.id, [
                    (p.id, [(g.text, len(g.token_ids), g.finish_reason, sampling) for g in per_prompt])
                    for p, per_prompt in zip(prompts, gens)
                ])
                done += len(chunk)
                bar.update(len(chunk))
                self._update(done=done)
            bar.close()
            self.store.update_run(run_id, status="done", outputs={"prompts": done, "responses": done * cfg.k})
            self._update(status="done", detail=f"{done * cfg.k} responses from {version.name}", finished=time.time())
        except Exception as exc:  # the job fails, the app stays up
            message = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            try:
                self.store.update_run(run_id, status="failed", error=message)
            finally:
                self._update(status="failed", error=message, detail=message, finished=time.time())

    def _fail_interrupted_runs(self) -> None:
        """A 'generate' run left running by an app that stopped is over: mark it failed."""
        stale = self.store.list_runs(kind=RUN_KIND, status="running")
        stale += self.store.list_runs(kind=RUN_KIND, status="queued")
        for run in stale:
            self.store.update_run(run.id, status="failed", error="interrupted: the app stopped before it finished")
