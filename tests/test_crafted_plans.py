"""Crafted or mistaken plan files with homes (issue 27, item 5): each is refused in one line
by ``apply_plan`` before anything runs, and by the verbs that read the plan (``plan simulate``,
``plan inspect``: exit 2), never accepted to train wrong or to fail later with a KeyError or a
raw torch error.

The plans are streaming plans of a 2-block GPT (weights, gradients and optimizer state of
every block homed on the NVMe tier, here a temporary folder), edited as a user or an attacker
would: the identity hash recomputed after editing the parameter table, homes changed with the
schedule left as it was, a tied embedding homed off the device.
"""
from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch

from conftest import plan_for
from planner.blocks import identity_hash
from planner.errors import UserError
from planner.formats import Home, Plan, Tier as T
from planner.models import build_model, load_config, make_inputs
from runtime import apply_plan

B, S = 2, 16
CFG = dict(load_config("gpt-tiny"), n_layers=2, dtype="fp32")
ON_DISK = Home(T.NVME, T.NVME, T.NVME, T.GPU)


def _model():
    torch.manual_seed(0)
    return build_model(CFG, dtype="fp32")


@pytest.fixture(scope="module")
def streaming(tmp_path_factory):
    nvme = tmp_path_factory.mktemp("nvme")
    return plan_for(_model(), "keep-all", B, S, nvme_dir=nvme, homes={"blocks": ON_DISK}).to_dict()


def _apply(d: dict):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt, apply_plan(m, Plan.from_dict(copy.deepcopy(d)), optimizer=opt)


def _refused_everywhere(d: dict, match: str, tmp_path, capsys, verbs=("simulate", "inspect")):
    """apply_plan refuses ``d`` in one line; so does every verb given it as a file (exit 2)."""
    with pytest.raises(UserError, match=match) as e:
        _apply(d)
    assert "\n" not in str(e.value), str(e.value)
    from planner.cli import main
    path = tmp_path / "crafted.json"
    path.write_text(json.dumps(d, sort_keys=True))
    for verb in verbs:
        capsys.readouterr()
        assert main([verb, str(path)]) == 2, verb
        err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
        assert len(err) == 1 and err[0].startswith("plan: error:") and str(path) in err[0], err
        assert "Traceback" not in err[0]


def test_the_unedited_plan_trains_and_is_removed(streaming):
    """The baseline the edits start from is accepted and runs."""
    m, opt, h = _apply(streaming)
    m(**make_inputs(CFG, B, S)).loss.backward()
    opt.step()
    h.remove()


def _block_rows(d, i=0):
    return d["model"]["params"][d["units"][1 + i]["name"]]


def test_a_parameter_listed_twice_in_a_streamed_unit_is_refused(streaming, tmp_path, capsys):
    """Before: accepted (the identity hash recomputed), trained 0.02 off, then remove()
    raised KeyError and left its files."""
    d = copy.deepcopy(streaming)
    rows = _block_rows(d)
    rows.append(copy.deepcopy(rows[0]))
    d["model"]["identity"] = identity_hash(d["model"])
    _refused_everywhere(d, f"parameter {rows[0][0]!r} twice in unit", tmp_path, capsys)


def test_a_parameter_owned_by_two_units_is_refused(streaming, tmp_path, capsys):
    d = copy.deepcopy(streaming)
    _block_rows(d, 1).append(copy.deepcopy(_block_rows(d, 0)[0]))
    d["model"]["identity"] = identity_hash(d["model"])
    _refused_everywhere(d, "in units 'blocks.0' and 'blocks.1'", tmp_path, capsys)


def test_a_table_charging_a_unit_the_plan_does_not_have_is_refused(streaming, tmp_path, capsys):
    d = copy.deepcopy(streaming)
    d["model"]["params"]["blocks.7"] = [d["model"]["params"]["blocks.1"].pop()]
    d["model"]["identity"] = identity_hash(d["model"])
    _refused_everywhere(d, "not a unit of the plan", tmp_path, capsys)


@pytest.mark.parametrize("change", [
    {"weights": "gpu", "grads": "gpu", "optimizer": "gpu"},     # before: KeyError 'blocks.0'
    {"weights": "gpu"}, {"grads": "gpu"}, {"optimizer": "gpu"},
], ids=["all-home", "weights", "grads", "optimizer"])
def test_homes_changed_with_the_schedule_left_as_it_was_are_refused(streaming, change, tmp_path,
                                                                    capsys):
    d = copy.deepcopy(streaming)
    d["layers"][1].update(change)
    _refused_everywhere(d, "schedule does not match its layers", tmp_path, capsys)


def test_a_resident_unit_homed_on_nvme_without_its_transfers_is_refused(streaming, tmp_path,
                                                                        capsys):
    """The other way round: the embedding's weights sent to NVMe, no event to fetch them."""
    d = copy.deepcopy(streaming)
    d["layers"][0].update(weights="nvme")
    _refused_everywhere(d, "regenerate it with 'plan solve'", tmp_path, capsys)


def test_micro_batches_changed_alone_is_a_consistent_plan(streaming):
    """Not every edit is a mistake: these homes imply the same events whatever K is, so K
    changed alone leaves a plan whose schedule is what its decisions imply (only its
    prediction is stale); the check accepts it rather than refuse a valid plan."""
    from planner.plans.simulate import check_plan
    d = copy.deepcopy(streaming)
    d["micro_batches"] = 2
    check_plan(Plan.from_dict(d))


def _tied_embedding_on_disk(tmp_path, record_tie: bool) -> dict:
    """gpt-tiny ties lm_head.weight (head) to tok_emb.weight (embedding). A plan made with the
    embedding homed on NVMe, its schedule consistent with that; with ``record_tie`` the units
    say so (as a real profile does), without it they do not (as a crafted one may not)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = plan_for(_model(), "keep-all", B, S, nvme_dir=tmp_path / "nv",
                        homes={"embedding": Home(T.NVME, T.GPU, T.GPU, T.GPU)})
    d = plan.to_dict()
    if record_tie:
        d["units"][0]["tied_to"] = [d["units"][-1]["name"]]
        d["units"][-1]["tied_to"] = [d["units"][0]["name"]]
    return d


def test_a_tied_embedding_homed_on_nvme_is_refused_by_the_binding(tmp_path, capsys):
    """Before: accepted, then a raw torch RuntimeError (setStorage ... out of bounds) in the
    head, which reads the tied weight the embedding had sent away. The plan is consistent in
    itself (so the verbs accept it); the model's tie is what refuses it."""
    d = _tied_embedding_on_disk(tmp_path, record_tie=False)
    with pytest.raises(UserError, match="'tok_emb.weight' is tied to 'lm_head.weight'") as e:
        _apply(d)
    assert "\n" not in str(e.value)


def test_a_tied_embedding_homed_on_nvme_is_refused_by_the_plan_check(tmp_path, capsys):
    """With the tie recorded in its units (as a real profile records it), the plan itself is
    impossible: refused by apply_plan and every verb alike."""
    d = _tied_embedding_on_disk(tmp_path, record_tie=True)
    _refused_everywhere(d, "is not possible here", tmp_path, capsys)
