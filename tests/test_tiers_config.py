from __future__ import annotations

import pytest
import torch

from smartckpt_cli.config import load_settings
from smartckpt_cli.errors import ConfigError, UnsupportedValueError
from smartckpt_cli.state.tiers import classify, parse_rules
from smartckpt_cli.state.tree import flatten, unflatten


def _tiers_of(model, opt) -> dict[str, str]:
    out = {}
    for name, kind, obj in (("model", "module", model), ("optimizer", "optimizer", opt)):
        _, tensors = flatten(obj.state_dict(), name)
        for k, t in tensors.items():
            plan = classify(k, kind, numel=t.numel(), floating=t.is_floating_point(), precision="fp16")
            out[k] = (plan.tier, plan.transform)
    return out


def test_every_model_entry_and_hyperparameter_is_l1_moments_are_l2():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    tiers = _tiers_of(model, opt)
    for key in (
        "model/1.running_mean",
        "model/1.running_var",
        "model/1.num_batches_tracked",
        "model/0.weight",
    ):
        assert tiers[key] == ("L1", "none"), key
    assert tiers["optimizer/state/0/exp_avg"] == ("L2", "none")  # fp16 policy: first moment exact
    assert tiers["optimizer/state/0/exp_avg_sq"] == ("L2", "sqrt_fp16")
    assert tiers["optimizer/state/0/step"] == ("L1", "none")
    skeleton, _ = flatten(opt.state_dict(), "optimizer")
    group = skeleton["param_groups"][0]
    assert group["lr"] == 0.001 and group["betas"] == {"__tuple": [0.9, 0.999]}  # hyperparameters in L1 JSON


def test_rules_override_first_match_wins_and_l1_stays_lossless():
    rules = parse_rules(
        [{"match": "model/emb.*", "tier": "L2", "precision": "bf16"}, {"match": "metrics/*", "tier": "L4"}]
    )
    p = classify("model/emb.weight", "module", numel=10, floating=True, precision="exact", rules=rules)
    assert (p.tier, p.transform) == ("L2", "bf16")
    p = classify("metrics/grad_norms", "state", numel=10, floating=True, precision="exact", rules=rules)
    assert p.tier == "L4" and not p.stored
    with pytest.raises(ConfigError, match="L1 is lossless"):
        parse_rules([{"match": "*", "tier": "L1", "precision": "bf16"}])
    with pytest.raises(ConfigError, match="unknown key 'tierz'"):
        parse_rules([{"match": "*", "tierz": "L1"}])


def test_settings_precedence_flags_over_env_over_file(tmp_path):
    cfg = tmp_path / "s.yaml"
    cfg.write_text("keep_last: 5\nprecision: bf16\nmax_interval: 60\n")
    s, src = load_settings(
        cfg, {"keep_last": 7}, env={"SMARTCKPT_PRECISION": "fp16", "SMARTCKPT_CHUNK_MB": "4"}
    )
    assert (s.keep_last, s.precision, s.max_interval, s.chunk_mb) == (7, "fp16", 60.0, 4)
    assert src == {
        "keep_last": "argument",
        "precision": "env SMARTCKPT_PRECISION",
        "max_interval": str(cfg),
        "chunk_mb": "env SMARTCKPT_CHUNK_MB",
    }


@pytest.mark.parametrize(
    ("text", "env", "message"),
    [
        ("keep_lats: 3\n", {}, "unknown setting 'keep_lats'"),
        ("keep_last: three\n", {}, "keep_last must be int"),
        ("precision: fp8\n", {}, "precision must be one of"),
        ("", {"SMARTCKPT_BOGUS": "1"}, "unknown setting 'bogus'"),
        ("", {"SMARTCKPT_KEEP_LAST": "x"}, "keep_last must be int"),
    ],
)
def test_bad_settings_name_the_key(tmp_path, text, env, message):
    cfg = tmp_path / "s.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_settings(cfg, env=env)


def test_statetree_roundtrip_without_pickle():
    state = {
        "state": {0: {"step": torch.tensor(3.0), "buf": torch.arange(4)}},
        "groups": [{"betas": (0.9, 0.99), "lr": float("inf"), "name": "__x", "flag": True, "none": None}],
        "dtype": torch.bfloat16,
        "blob": b"\x00\x01",
    }
    skeleton, tensors = flatten(state, "o")
    assert set(tensors) == {"o/state/0/step", "o/state/0/buf"}
    back = unflatten(skeleton, tensors)
    assert (
        back["groups"] == state["groups"] and back["dtype"] is torch.bfloat16 and back["blob"] == b"\x00\x01"
    )
    assert list(back["state"]) == [0] and torch.equal(back["state"][0]["buf"], torch.arange(4))


def test_statetree_refuses_arbitrary_objects_naming_the_path():
    with pytest.raises(UnsupportedValueError, match="'sched/lr_lambdas/0'"):
        flatten({"lr_lambdas": [object()]}, "sched")
