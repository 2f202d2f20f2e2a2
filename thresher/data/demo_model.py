"""The demo models: small Qwen3-MoE language models trained here on the standard library's source.

No download is possible (or wanted) for the demo and the tests, so thresher trains its own MoE:
a byte-level BPE tokenizer and a Qwen3-MoE (8 experts, top-2) on the ``stdlib`` train split. The
result is a normal Hugging Face checkpoint with its tokenizer, cached under the state directory
and keyed by what defines it (spec, training code, training text), so a second call reuses it.
Models carried to another machine (the GPU suite's bundle) are pinned by name in ``pinned.json``
beside them, since that machine's standard library, and so its key, differs.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import math
import os
import platform
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from thresher.data.sources import iter_documents, stdlib_files, stdlib_root
from thresher.errors import ModelError
from thresher.formats.artifact import DEMO_MODEL_META
from thresher.paths import build_dir_atomically, demo_models_dir

log = logging.getLogger(__name__)

BUILDER_VERSION = 1  # the training code's version: bump it when a change alters the weights
EOS = "<|endoftext|>"
PINNED = "pinned.json"  # in the demo-models directory: {size: directory name} used as they are


@dataclass(frozen=True)
class DemoSpec:
    """Everything that determines a demo model (its cache key is a hash of these fields)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    aux_loss_coef: float = 0.01
    seed: int = 0


SPECS: dict[str, DemoSpec] = {
    # The model the tests use: trains in under 90 s on 2 cores. Within that budget, windows of
    # 128 tokens (twice the optimizer steps for the same tokens) gave held-out perplexity 150-200
    # where 256-token windows gave 190-285, and the stronger load-balancing loss (0.1, closer to
    # the near-uniform expert loads of production MoEs) made REAP competitive with frequency
    # pruning more often. On a model this small the papers' orderings are marginal and change
    # with the training run; the runs tried and what held on each are in docs/benchmarks.md.
    "tiny": DemoSpec(vocab_size=4096, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2,
                     head_dim=32, moe_intermediate_size=64, num_experts=8, top_k=2,
                     steps=420, batch_size=8, seq_len=128, lr=4e-3, aux_loss_coef=0.1, seed=1),
    # The demo default: hidden 256 leaves two groups of 128 per row for group-wise quantization.
    "small": DemoSpec(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                      head_dim=32, moe_intermediate_size=128, num_experts=8, top_k=2,
                      steps=640, batch_size=8, seq_len=256, lr=3e-3),
    # Fine-grained, like Qwen3-30B-A3B (128 experts, top-8): 64 experts of width 32, top-8, so a
    # token's active expert width (8 x 32) is small's (2 x 128) and pruning half removes 32
    # experts per layer, where criteria can differ. Qwen3-MoE rather than Qwen2-MoE's shared
    # expert: the model it mimics (Qwen3-30B-A3B, in the REAP paper's set) has none, an always-on
    # shared expert would carry part of the function pruning and merging are measured on, and
    # it keeps the layout of the other demo models and their benchmarks.
    # small's tokens (640 x 8 x 256); a training step costs 1.74 times small's (alternating
    # steps), about 13 min on 2 idle cores; 16 min on the shared machine (docs/pruning.md).
    # For benchmarks (``--model demo:fine``); the tests and ``make demo`` do not train it.
    "fine": DemoSpec(vocab_size=4096, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                     head_dim=32, moe_intermediate_size=32, num_experts=64, top_k=8,
                     steps=640, batch_size=8, seq_len=256, lr=3e-3),
}


@functools.cache
def corpus_digest() -> str:
    """sha256 of the training text: the stdlib train split's relative paths and contents."""
    root, digest = stdlib_root(), hashlib.sha256()
    for path in stdlib_files("train"):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def demo_key(spec: DemoSpec) -> str:
    """Cache key: what defines the model — the spec (architecture, training settings, seed), the
    training code (``BUILDER_VERSION``) and the training text (``corpus_digest``). Library
    versions are recorded in the model's ``demo_model.json`` but not keyed: another torch trains
    the same recipe, and keying it would retrain on every machine a model is carried to."""
    blob = json.dumps({"spec": asdict(spec), "builder": BUILDER_VERSION,
                       "corpus": corpus_digest()}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def demo_model_dir(size: str) -> Path:
    """Where demo model ``size`` is (or will be) built: the directory ``pinned.json`` names for it,
    else ``<size>-<key>`` under the state directory's demo models."""
    spec = _spec(size)
    root = demo_models_dir()
    pinned = root / PINNED
    if pinned.is_file():
        try:
            name = json.loads(pinned.read_text()).get(size)
        except (json.JSONDecodeError, AttributeError) as exc:
            raise ModelError(f"{pinned}: not a JSON object of demo model names ({exc})") from exc
        if name:
            return root / name
    return root / f"{size}-{demo_key(spec)}"


def _spec(size: str) -> DemoSpec:
    if size not in SPECS:
        raise ModelError(f"demo:{size}: unknown demo model size; choose one of {', '.join(SPECS)}")
    return SPECS[size]


def build_demo_model(size: str = "small", force: bool = False,
                     progress: Callable[[int, int, float], None] | None = None) -> Path:
    """Train (or reuse) demo model ``size`` and return its checkpoint directory."""
    return build_from_spec(_spec(size), demo_model_dir(size), force, progress,
                           label=f"demo:{size}")


def build_from_spec(spec: DemoSpec, final: Path, force: bool = False,
                    progress: Callable[[int, int, float], None] | None = None,
                    label: str | None = None) -> Path:
    """Train (or reuse) the model ``spec`` describes into ``final`` (benchmarks try variants).

    Training takes a minute or more, so without a ``progress`` callback a build shows a progress
    bar (step, loss) on stderr under ``label``; a reused model shows nothing.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    lock_path = final.with_suffix(".lock")
    with open(lock_path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two processes asking at once train it once
        if (final / "config.json").is_file() and not force:
            return final
        for stale in final.parent.glob(f".{final.name}-*"):  # a killed build's leftovers
            shutil.rmtree(stale, ignore_errors=True)
        with build_dir_atomically(final) as tmp:
            if progress is not None:
                _train(spec, tmp, progress)
            else:
                with _progress_bar(label or final.name) as bar:
                    _train(spec, tmp, bar)
    return final


@contextmanager
def _progress_bar(label: str) -> Iterator[Callable[[int, int, float], None]]:
    """A rich progress bar on stderr; yields the ``progress`` callback that advances it."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    with Progress(TextColumn(f"[bold]training {label}"), BarColumn(),
                  TextColumn("step {task.completed}/{task.total}  loss {task.fields[loss]}"),
                  TimeElapsedColumn(), console=Console(stderr=True)) as bar:
        task = bar.add_task("train", total=None, loss="-")

        def advance(step: int, total: int, loss: float) -> None:
            bar.update(task, completed=step, total=total, loss=f"{loss:.3f}")

        yield advance


@contextmanager
def tokenizers_parallel() -> Iterator[None]:
    """Let the Rust tokenizers use every core for a while, then switch them back off.

    thresher keeps ``TOKENIZERS_PARALLELISM=false`` (servers and flows fork); training the demo
    tokenizer and encoding its corpus are the only bulk tokenizer work, and halve with 2 threads.
    """
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "true"
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


def train_tokenizer(vocab_size: int):
    """A byte-level BPE tokenizer trained on the stdlib train split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_documents("stdlib", "train"), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS, bos_token=EOS, pad_token=EOS, unk_token=None,
        model_max_length=1024,
    )


def spec_config(spec: DemoSpec, vocab_size: int | None = None, eos_id: int | None = None):
    """The Qwen3-MoE config a demo model is trained with: its shapes are known from the spec
    alone, so ``thresher check`` reads them without training it (the tokenizer's vocabulary is
    the spec's size)."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size or spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.moe_intermediate_size * spec.top_k,
        moe_intermediate_size=spec.moe_intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim, num_experts=spec.num_experts, num_experts_per_tok=spec.top_k,
        norm_topk_prob=True, output_router_logits=True, router_aux_loss_coef=spec.aux_loss_coef,
        max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0,
        bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id,
    )


def demo_config(size: str):
    """The config of ``demo:size``: the built model's when it is cached, else its spec's."""
    path = demo_model_dir(size)
    if (path / "config.json").is_file():
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(path)
    return spec_config(_spec(size))


def _train(spec: DemoSpec, out: Path, progress: Callable[[int, int, float], None] | None) -> None:
    from transformers import Qwen3MoeForCausalLM

    start = time.perf_counter()
    torch.manual_seed(spec.seed)
    with tokenizers_parallel():
        tokenizer = train_tokenizer(spec.vocab_size)
        eos_id = tokenizer.convert_tokens_to_ids(EOS)
        ids: list[int] = []
        docs = list(iter_documents("stdlib", "train"))
        for enc in tokenizer.backend_tokenizer.encode_batch(docs, add_special_tokens=False):
            ids.extend(enc.ids)
            ids.append(eos_id)
    data = torch.tensor(ids, dtype=torch.long)
    log.info("demo model: tokenizer and %d training tokens ready in %.1f s", data.numel(),
             time.perf_counter() - start)

    config = spec_config(spec, len(tokenizer), eos_id)
    config._experts_implementation = "grouped_mm"  # ~15% faster than the eager loop on a CPU
    model = Qwen3MoeForCausalLM(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=0.1, betas=(0.9, 0.95))
    warmup = max(1, spec.steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return spec.lr * (step + 1) / warmup
        t = (step - warmup) / max(1, spec.steps - warmup)
        return spec.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))

    gen = torch.Generator().manual_seed(spec.seed)
    loss_value = float("nan")
    for step in range(spec.steps):
        starts = torch.randint(0, data.numel() - spec.seq_len - 1, (spec.batch_size,), generator=gen)
        batch = torch.stack([data[s : s + spec.seq_len] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        loss = loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        if progress is not None:
            progress(step + 1, spec.steps, loss_value)
    elapsed = time.perf_counter() - start

    model.eval()
    model.config.output_router_logits = False
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    meta = {
        "spec": asdict(spec), "key": demo_key(spec), "train_seconds": round(elapsed, 1),
        "train_tokens": int(data.numel()), "final_loss": loss_value,
        "parameters": sum(p.numel() for p in model.parameters()),
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "torch": torch.__version__,
    }
    (out / DEMO_MODEL_META).write_text(json.dumps(meta, indent=2))
