"""Calibrated QAdA: the corrected labels against the equation re-derived in float64, the path applying each layer's
own correction with the right sign, the fits recovering known corrections, the calibration files, and the tools
(lab.calibrate --qada, generate.py, lab.sweep) on a tiny model."""

import json
import math
import re
import shutil

import pytest
import torch

import generate
from attention import DecodeAttention, all_scores, bulk_sample
from criterion import (CALIBRATION_KINDS, Calibration, Correction, check_calibration, check_weights, gaussian_form,
                       load_calibration, load_labels, load_local_freq, oracle_log_masses, qada_labels,
                       save_calibration, save_labels, weights_probe)
from lab import calibrate, records, sweep
from moments import FixedMoments, ReferenceKeys
from tests.test_generate import make_tiny_dir, write_prompt
from weights.checkpoints import load
from tests.test_qada import random_cov

N_SINK, N_LOCAL = 4, 16


def corrected_share_logit(q, log_local, mean, cov, n_bulk, a, b, s):
    """The calibrated log ratio from the equations alone, in float64 (no project function): Eq. 6's
    mu_s = q mu / sqrt d and sigma_s^2 = q (s Sigma) q / d per KV head, r = log A_local - log(n_bulk exp(mu_s +
    sigma_s^2 / 2)), then a + b r per query head."""
    H, D = q.shape
    Hkv = mean.shape[0]
    out = torch.empty(H, dtype=torch.float64)
    for h in range(H):
        g = h // (H // Hkv)
        qh = q[h].double()
        mu_s = qh @ mean[g].double() / math.sqrt(D)
        sigma2 = s[g] * (qh @ cov[g].double() @ qh) / D
        r = float(log_local[h]) - (math.log(n_bulk) + mu_s + sigma2 / 2)
        out[h] = a[h] + b[h] * r
    return out


def test_corrected_labels_equal_the_equation_in_float64():
    H, Hkv, D, n_bulk = 6, 2, 8, 900
    agree = 0
    for seed in range(40):
        g = torch.Generator().manual_seed(seed)
        q = torch.randn(H, D, generator=g)
        log_local = torch.randn(H, generator=g) * 2 + 6
        mean, cov = torch.randn(Hkv, D, generator=g) * 0.5, random_cov(Hkv, D, seed=seed)
        a, b = torch.randn(H, generator=g), torch.rand(H, generator=g) * 2
        s = torch.rand(Hkv, generator=g) * 3
        for tau in (0.3, 0.6, 0.9):
            want = corrected_share_logit(q, log_local, mean, cov, n_bulk, a.double(), b.double(), s.double())
            got = qada_labels(q, log_local, gaussian_form(mean, cov), n_bulk, tau, correction=Correction(a, b, s))
            clear = (want - math.log(tau / (1 - tau))).abs() > 1e-4  # leave out heads within rounding of tau
            assert torch.equal(got[clear], (want >= math.log(tau / (1 - tau)))[clear])
            agree += int(clear.sum())
    assert agree > 600
    # the identity correction is plain Eq. 7; s=None leaves the variance term alone
    ones, zeros = torch.ones(H), torch.zeros(H)
    plain = qada_labels(q, log_local, gaussian_form(mean, cov), n_bulk, 0.6)
    identity = Correction(zeros, ones, None)
    assert torch.equal(qada_labels(q, log_local, gaussian_form(mean, cov), n_bulk, 0.6, correction=identity), plain)


def layer_caches(L=3, H=4, Hkv=2, D=8, T=200, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(H, D, generator=g), torch.randn(Hkv, T, D, generator=g), torch.randn(Hkv, T, D, generator=g))
            for _ in range(L)]


def test_qada_cal_applies_each_layers_own_correction_with_its_sign():
    """Per layer a correction that moves every head's ratio to one side of the threshold, and a layer left as it is:
    applied to the wrong layer or with the wrong sign, the labels come out otherwise. At this tau Eq. 7 labels layer 2's
    heads both ways, so that a correction of another layer would change them."""
    L, H, Hkv, D, T = 3, 4, 2, 8, 200
    caches = layer_caches(L, H, Hkv, D, T)
    mean = torch.stack([k[:, N_SINK:T - (N_LOCAL - N_SINK)].float().mean(1) for _, k, _ in caches])  # (L, Hkv, D)
    cov = torch.stack([random_cov(Hkv, D, seed=i) for i in range(L)])
    moments = FixedMoments(mean, cov, T - N_LOCAL)
    a = torch.tensor([[40.0] * H, [-40.0] * H, [0.0] * H])  # layer 0 all local, layer 1 none, layer 2 Eq. 7 itself
    b = torch.ones(L, H)
    tau = 0.108
    att = DecodeAttention("qada_cal", N_SINK, N_LOCAL, dict(tau=tau, moments=moments,
                                                             calibration=Calibration(a, b, None, {})))
    plain = DecodeAttention("qada", N_SINK, N_LOCAL, dict(tau=tau, moments=moments))
    for layer, (q, k, v) in enumerate(caches):
        att(q[None, :, None], k[None], v[None], layer)
        plain(q[None, :, None], k[None], v[None], layer)
    got, eq7 = att.stats.label_tensor()[0], plain.stats.label_tensor()[0]  # (L, H)
    assert 0 < int(eq7[2].sum()) < H  # mixed: a correction applied here would show
    assert got[0].all() and not got[1].any() and torch.equal(got[2], eq7[2])


def synthetic_masses(N=400, L=2, H=4, Hkv=2, seed=0):
    """Masses (N, L, 4, H) and T_bulk (N,) whose true bulk follows known corrections of the Gaussian estimate."""
    g = torch.Generator().manual_seed(seed)
    n_bulk = torch.randint(500, 8000, (N,), generator=g).double()
    log_local = torch.randn(N, L, H, generator=g) + 8
    mu = torch.randn(N, L, H, generator=g)
    half_var = torch.rand(N, L, H, generator=g) * 2
    return n_bulk, log_local, mu, half_var


def test_the_fits_recover_known_corrections():
    L, H, Hkv = 2, 4, 2
    n_bulk, log_local, mu, half_var = synthetic_masses(L=L, H=H, Hkv=Hkv)
    log_n = n_bulk.log()[:, None, None]
    r_est = log_local - (log_n + mu + half_var)
    a0, b0 = torch.tensor([[0.5, -1.0, 2.0, 0.0], [1.5, 0.3, -0.7, 1.0]]), torch.tensor([[0.9, 0.5, 1.2, 0.0],
                                                                                           [0.8, 1.0, 0.7, 0.3]])
    r = a0 + b0 * r_est  # the true log ratio an affine map of the estimate
    masses = torch.stack([log_local, log_local - r, mu, half_var], 2)
    a, b, s = calibrate.fit_calibration(masses, n_bulk, Hkv, "affine")
    assert s is None
    torch.testing.assert_close(a, a0.float(), atol=1e-3, rtol=0)
    torch.testing.assert_close(b, b0.float(), atol=1e-4, rtol=0)

    shift = torch.tensor([[1.0, -2.0, 0.5, 3.0], [0.0, 1.0, -1.0, 2.0]])  # log A_bulk = estimate - shift + noise
    noise = torch.randn(r.shape, generator=torch.Generator().manual_seed(1)) * 0.1
    masses = torch.stack([log_local, log_n + mu + half_var - shift + noise, mu, half_var], 2)
    a, b, _ = calibrate.fit_calibration(masses, n_bulk, Hkv, "offset")
    torch.testing.assert_close(a, shift.float(), atol=0.03, rtol=0)  # r = r_est + shift: a is the shift
    assert torch.equal(b, torch.ones(L, H))
    a, _, _ = calibrate.fit_calibration(masses, n_bulk, Hkv, "quantile", eps=0.05)
    # the 5 % quantile of r - r_est = shift - noise: below the shift by ~1.64 sigma of the noise
    torch.testing.assert_close(a, (shift - 0.164).float(), atol=0.05, rtol=0)

    s0 = torch.tensor([[0.5, 2.0], [1.0, 3.0]])  # (L, Hkv)
    true_bulk = log_n + mu + s0.repeat_interleave(H // Hkv, 1) * half_var
    masses = torch.stack([log_local, true_bulk, mu, half_var], 2)
    a, b, s = calibrate.fit_calibration(masses, n_bulk, Hkv, "scale")
    torch.testing.assert_close(s, s0, atol=1e-4, rtol=0)
    assert not a.any() and torch.equal(b, torch.ones(L, H))
    with pytest.raises(ValueError, match="unknown calibration kind"):
        calibrate.fit_calibration(masses, n_bulk, Hkv, "cubic")

    # the offset is the median: a tenth of the steps off by +50 (a bulk far below its estimate) leave it at the shift
    off = torch.zeros(r.shape)
    off[: len(off) // 10] = 50.0
    masses = torch.stack([log_local, log_n + mu + half_var - shift - off, mu, half_var], 2)
    a, _, _ = calibrate.fit_calibration(masses, n_bulk, Hkv, "offset")
    torch.testing.assert_close(a, shift.float(), atol=1e-4, rtol=0)
    # slopes and scales below 0 stop at 0: the corrected ratio never falls as the estimated one rises, and a scale of
    # sigma_s^2 stays >= 0
    masses = torch.stack([log_local, log_local - (a0 - b0 * r_est), mu, half_var], 2)  # r falls as r_est rises
    a, b, _ = calibrate.fit_calibration(masses, n_bulk, Hkv, "affine")
    assert (b[b0 > 0] == 0).all() and b.abs().max() < 1e-6  # (b0 = 0: no slope to fit either way)
    torch.testing.assert_close(a, (a0 - b0 * r_est).mean(0).float(), atol=1e-3, rtol=0)  # then a is r's mean
    masses = torch.stack([log_local, log_n + mu - s0.repeat_interleave(H // Hkv, 1) * half_var, mu, half_var], 2)
    _, _, s = calibrate.fit_calibration(masses, n_bulk, Hkv, "scale")
    assert torch.equal(s, torch.zeros(L, Hkv))


def test_calibration_files_round_trip_and_refuse_what_they_are_not(tmp_path):
    c = Calibration(torch.randn(3, 4), torch.rand(3, 4), torch.rand(3, 2), {"kind": "affine", "tasks": ["fwe"]})
    save_calibration(tmp_path / "c.json", c)
    back = load_calibration(tmp_path / "c.json")
    assert all(torch.equal(x.cpu(), y.cpu()) for x, y in ((back.a, c.a), (back.b, c.b), (back.s, c.s)))
    assert back.settings == c.settings
    (tmp_path / "bad.json").write_text(json.dumps({"settings": {}, "a": [[1.0]], "b": [[1.0, 2.0]], "s": None}))
    with pytest.raises(ValueError, match="not a calibration file"):
        load_calibration(tmp_path / "bad.json")
    with pytest.raises(FileNotFoundError, match="lab.calibrate --qada"):
        load_calibration(tmp_path / "missing.json")
    save_labels(tmp_path / "ruler.json", torch.rand(3, 4), {})  # a file of the other kind, a binary one, ...
    (tmp_path / "masses.pt").write_bytes(b"\x80\x02PK\x00\xff")
    (tmp_path / "text.json").write_text("a, b")
    (tmp_path / "no_a.json").write_text(json.dumps({"settings": {}, "b": [[1.0]], "s": None}))
    (tmp_path / "list.json").write_text("[]")
    for name, message in (("ruler.json", "holds static labels (python -m lab.calibrate), not a QAdA correction"),
                          ("masses.pt", "is not a calibration file: not UTF-8 text (a binary file?)"),
                          ("text.json", "is not a calibration file: not JSON ("),
                          ("list.json", "is not a calibration file: a JSON list, not an object"),  # not "list indices"
                          ("no_a.json", "is not a calibration file: it has no 'a' entry")):  # not "KeyError: 'a'"
        with pytest.raises(ValueError, match=re.escape(f"{tmp_path / name} {message}")):
            load_calibration(tmp_path / name)
    with pytest.raises(ValueError, match="holds a QAdA correction .* not static labels"):
        load_labels(tmp_path / "c.json", 0.5)
    with pytest.raises(ValueError, match="is not a static labels file: not UTF-8 text"):
        load_labels(tmp_path / "masses.pt", 0.5)
    with pytest.raises(ValueError, match="is not a static labels file: a JSON list, not an object"):
        load_labels(tmp_path / "list.json", 0.5)
    (tmp_path / "s.json").write_text(json.dumps({"settings": {}, "a": [[1.0] * 4] * 3, "b": [[1.0] * 4] * 3,
                                                  "s": [[1.0] * 2] * 2}))  # s of 2 layers for a and b's 3
    with pytest.raises(ValueError, match="do not match"):
        load_calibration(tmp_path / "s.json")
    for taus in ({"qada_cal": 0}, {"qada_cal": 1.5}, {"qada_cal": "x"}, [0.2]):  # tau 0 ran as log(0) later
        save_calibration(tmp_path / "tau.json", Calibration(c.a, c.b, c.s, {"operating_tau": taus}))
        with pytest.raises(ValueError, match="operating_tau must map method names to taus in"):
            load_calibration(tmp_path / "tau.json")


@pytest.mark.parametrize("freq,says", [([0.5, 0.3], "is not a static labels file: local_freq holds 1 dimensions"),
                                       ([[[0.5]]], "is not a static labels file: local_freq holds 3 dimensions"),
                                       ([[0.5, math.nan]], "holds local frequencies outside \\[0, 1\\] \\(or NaN\\)"),
                                       ([[1.5, 0.2]], "holds local frequencies outside"),
                                       ([[0.5, -0.1]], "holds local frequencies outside")])
def test_static_labels_of_another_shape_or_out_of_range_are_refused_naming_the_file(tmp_path, freq, says):
    """Static labels whose local_freq is not (L, H) were an unpacking error naming no file; a NaN frequency sorted
    above every other, its head labelled local first, silently. A frequency is a fraction of decode steps."""
    (tmp_path / "ruler.json").write_text(json.dumps({"settings": {}, "local_freq": freq}))
    for load in (load_labels, lambda path, _: load_local_freq(path)):
        with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path / 'ruler.json'))} {says}"):
            load(tmp_path / "ruler.json", 0.5)
    (tmp_path / "ruler.json").write_text(json.dumps({"settings": {}, "local_freq": [[0.0, 1.0]]}))  # the ends hold
    assert load_labels(tmp_path / "ruler.json", 0.5)[0].tolist() == [[False, True]]


@pytest.mark.parametrize("entry", ["a", "b", "s"])
def test_a_calibration_with_a_value_not_finite_is_refused(tmp_path, entry):
    # a NaN anywhere, the variance scale s included, would label heads long-context silently (NaN >= x is False)
    c = {"a": torch.zeros(3, 4), "b": torch.ones(3, 4), "s": torch.ones(3, 2)}
    c[entry][1, 1] = math.nan
    save_calibration(tmp_path / "c.json", Calibration(c["a"], c["b"], c["s"], {"kind": "affine"}))
    with pytest.raises(ValueError, match="values that are not finite numbers"):
        load_calibration(tmp_path / "c.json")


def test_label_and_calibration_files_are_checked_for_what_they_hold(tmp_path):
    """label_frequencies: a labels file of other heads is refused, of these heads read as saved. calibration_file: a
    folder gives its KIND.json, or names the kinds it holds; a file of another kind is refused, one that names no kind
    (written by hand, or before kinds were recorded) taken as given."""
    freq = torch.rand(2, 4)
    save_labels(tmp_path / "ruler.json", freq, {})
    assert torch.equal(calibrate.label_frequencies(tmp_path / "ruler.json", 2, 4).cpu(), freq)
    with pytest.raises(ValueError, match=r"ruler.json holds labels of \(2, 4\) heads; the model has \(3, 4\)"):
        calibrate.label_frequencies(tmp_path / "ruler.json", 3, 4)
    c = Calibration(torch.zeros(2, 4), torch.ones(2, 4), None, {})
    (tmp_path / "cal").mkdir()
    for kind in ("affine", "quantile"):
        save_calibration(tmp_path / "cal" / f"{kind}.json", Calibration(c.a, c.b, c.s, {"kind": kind}))
    save_calibration(tmp_path / "hand.json", c)
    assert calibrate.calibration_file(tmp_path / "cal", "quantile") == tmp_path / "cal" / "quantile.json"
    assert calibrate.calibration_file(tmp_path / "hand.json", "offset") == tmp_path / "hand.json"
    with pytest.raises(FileNotFoundError, match="the folder holds no offset.json; it holds affine, quantile$"):
        calibrate.calibration_file(tmp_path / "cal", "offset")
    with pytest.raises(ValueError, match="holds the affine correction, not the offset one"):
        calibrate.calibration_file(tmp_path / "cal" / "affine.json", "offset")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_dir(tmp_path_factory.mktemp("tiny_cal"))


QUERIES = []  # (T, layer, q (H, D)) of every step the fitted fixture's first prompt recorded past the window


@pytest.fixture(scope="module")
def fitted(tiny_dir, tmp_path_factory):
    """lab.calibrate --qada on the tiny model: masses.pt and every kind's file; the first prompt's queries kept."""
    out = tmp_path_factory.mktemp("cal")
    mp = pytest.MonkeyPatch()
    mp.setenv("QADA_CACHE", str(out / "cache"))
    recorders = []

    class Kept(calibrate.MassRecorder):
        def __call__(self, q, k, v, layer):
            if not recorders or recorders[0] is self:
                recorders[:1] = [self]
                if k.shape[2] > self.n_local:
                    QUERIES.append((k.shape[2], layer, q[0, :, 0].clone()))
            return super().__call__(q, k, v, layer)

    mp.setattr(calibrate, "MassRecorder", Kept)
    assert calibrate.main(["--qada", "--tasks", "fwe", "--length", "400", "--samples", "2", "--max-new-tokens", "6",
                           "--model", str(tiny_dir), "--out", str(out / "cal")]) == 0
    mp.undo()
    return out / "cal"


def test_static_label_frequencies_weight_each_prompt_by_its_steps(tiny_dir, monkeypatch):
    """oracle_frequency (what lab.calibrate's static labels rank heads by): each head's local fraction over every
    decode step of every prompt, so a prompt of 3 steps counts three times one of 1; each prompt decodes up to the
    flag's max_new_tokens or its own task's answer length, whichever is less. The decoding is stood in for: prompt 0
    labels every head local on 1 step, prompt 1 none on 3."""
    model, tok = load(str(tiny_dir))
    L, H = model.cfg.num_hidden_layers, model.cfg.num_attention_heads
    asked, plan = [], iter([(1, True), (3, False)])

    def decode(model, cache, logits, max_new_tokens, att, eos_ids):
        asked.append(max_new_tokens)
        steps, local = next(plan)
        for _ in range(steps):
            for layer in range(L):
                att.stats.record(layer, cache.length, torch.full((H,), local))
    monkeypatch.setattr(calibrate, "decode", decode)
    own = calibrate.make_sample("fwe", 0, 400, tok, 1).max_new_tokens
    freq, steps = calibrate.oracle_frequency(model, tok, "fwe", 400, 2, 1, max_new_tokens=own + 5)
    assert steps == 4 and torch.equal(freq, torch.full((L, H), 0.25))  # not 0.5, the mean of the prompts' means
    assert asked == [own, calibrate.make_sample("fwe", 1, 400, tok, 1).max_new_tokens]
    plan = iter([(0, True)])
    with pytest.raises(ValueError, match="decoded no step"):
        calibrate.oracle_frequency(model, tok, "fwe", 400, 1, 1, max_new_tokens=2)
    assert asked[-1] == 2


def test_static_labels_record_their_weights_and_a_rerun_leaves_older_files_as_they_are(tiny_dir, tmp_path,
                                                                                         monkeypatch):
    model, tok = load(str(tiny_dir))
    monkeypatch.setattr(calibrate, "oracle_frequency", lambda *a, **k: (torch.rand(2, 4), 3))  # the oracle stood in for
    folder, probe = tmp_path / "labels", weights_probe(model)
    calibrate.ensure(model, tok, ["fwe", "vt"], folder, 400, 1, 1, 4, progress=False)
    assert all(load_local_freq(folder / f"{n}.json")[1]["weights_probe"] == probe for n in ("fwe", "vt", "ruler"))
    for name in ("fwe", "vt", "ruler"):  # as files written before the probe
        freq, settings = load_local_freq(folder / f"{name}.json")
        save_labels(folder / f"{name}.json", freq, {k: v for k, v in settings.items() if k != "weights_probe"})
    before = (folder / "ruler.json").read_bytes()
    monkeypatch.setattr(calibrate, "oracle_frequency", lambda *a, **k: pytest.fail("recalibrated"))
    calibrate.ensure(model, tok, ["fwe", "vt"], folder, 400, 1, 1, 4, progress=False)
    assert (folder / "ruler.json").read_bytes() == before  # a committed folder stays as it was
    freq, settings = load_local_freq(folder / "fwe.json")
    save_labels(folder / "fwe.json", freq, dict(settings, weights_probe=[0.5] * 16))  # new weights in the same folder
    with pytest.raises(ValueError, match="fwe.json holds the oracle's statistics of other weights than this model's"):
        calibrate.ensure(model, tok, ["fwe", "vt"], folder, 400, 1, 1, 4, progress=False)


def test_the_ruler_labels_are_the_mean_over_the_ruler_tasks_alone(tiny_dir, tmp_path, monkeypatch):
    """ensure's ruler.json is the mean of the ruler tasks' frequencies, not of every task calibrated nor their sum, and
    a ruler task not among the tasks is calibrated too; check_labels holds ruler.json to the ruler tasks. ruler.json
    records the weights only where every ruler task's file does; a task's file that cannot be read is calibrated again
    under force."""
    model, tok = load(str(tiny_dir))
    made, asked = {"qa_1": 0.9, "fwe": 0.2, "vt": 0.4}, []

    def oracle(model, tok, task, *args, **kwargs):  # the oracle stood in for: each task its own frequency
        asked.append(task)
        return torch.full((2, 4), made[task]), 3
    monkeypatch.setattr(calibrate, "oracle_frequency", oracle)
    folder = tmp_path / "labels"
    out = calibrate.ensure(model, tok, ["qa_1"], folder, 400, 1, 1, 4, progress=False, ruler_tasks=["fwe", "vt"])
    ruler, settings = load_local_freq(folder / "ruler.json")
    assert asked == ["qa_1", "fwe", "vt"] and settings["tasks"] == ["fwe", "vt"] and "weights_probe" in settings
    assert torch.allclose(ruler, torch.full((2, 4), 0.3)) and torch.equal(out["ruler"], ruler)
    common = dict(length=400, samples=1, seed=1, max_new_tokens=4, tau=settings["tau"], n_sink=16, n_local=128,
                  model=str(model.model_dir))
    calibrate.check_labels(folder, ["qa_1", "fwe", "vt"], ["fwe", "vt"], common)  # the same settings: no refusal
    freq, kept = load_local_freq(folder / "fwe.json")
    save_labels(folder / "fwe.json", freq, {k: v for k, v in kept.items() if k != "weights_probe"})  # as from before
    calibrate.ensure(model, tok, ["qa_1"], folder, 400, 1, 1, 4, progress=False, ruler_tasks=["fwe", "vt"])
    assert "weights_probe" not in load_local_freq(folder / "ruler.json")[1] and len(asked) == 3  # read back
    (folder / "vt.json").write_text("cut")
    calibrate.ensure(model, tok, ["qa_1"], folder, 400, 1, 1, 4, progress=False, ruler_tasks=["fwe", "vt"], force=True)
    assert asked[3:] == ["vt"] and load_local_freq(folder / "vt.json")[0].eq(0.4).all()


def test_corrections_record_their_weights_and_a_refit_leaves_older_files_as_they_are(fitted, tiny_dir, tmp_path,
                                                                                       monkeypatch, capsys):
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    folder, probe = tmp_path / "cal", weights_probe(load(str(tiny_dir))[0])
    shutil.copytree(fitted, folder)
    masses = torch.load(folder / "masses.pt", weights_only=True)
    assert masses["settings"]["weights_probe"] == probe
    masses["settings"].pop("weights_probe")  # as masses and corrections recorded before the probe
    torch.save(masses, folder / "masses.pt")
    for kind in CALIBRATION_KINDS:
        c = load_calibration(folder / f"{kind}.json")
        assert c.settings.pop("weights_probe") == probe
        save_calibration(folder / f"{kind}.json", c)
    before = {kind: (folder / f"{kind}.json").read_bytes() for kind in CALIBRATION_KINDS}
    monkeypatch.setattr(calibrate, "prompt_masses", lambda *a, **k: pytest.fail("recorded again"))
    argv = ["--qada", "--tasks", "fwe", "--length", "400", "--samples", "2", "--max-new-tokens", "6", "--model",
            str(tiny_dir), "--out", str(folder)]  # the fixture's command
    assert calibrate.main(argv) == 0
    assert {kind: (folder / f"{kind}.json").read_bytes() for kind in CALIBRATION_KINDS} == before  # committed: as was
    masses["settings"]["weights_probe"] = [0.5] * 16  # new weights in the same folder
    torch.save(masses, folder / "masses.pt")
    capsys.readouterr()
    assert calibrate.main(argv) == 2
    assert "masses.pt holds the masses of other weights than this model's" in capsys.readouterr().err


def test_masses_pt_is_reused_by_runs_of_its_settings_and_replaced_only_under_force(fitted, tiny_dir, tmp_path,
                                                                                    monkeypatch, capsys):
    """masses.pt's prompts serve every run of its recording settings: one of fewer samples fits on its own prompts
    alone, a prompt recorded before the sampled estimate (4 rows) is recorded again. Under --force, masses of other
    settings (another --moments, which the run records with) or unreadable ones are recorded anew, never mixed in;
    without it they are refused, as corrections fitted with another --eps or --samples are."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    data = torch.load(fitted / "masses.pt", weights_only=True)
    recorded = []

    def record(model, tok, reference, task, index, length, seed, max_new_tokens, moments_source, n_sink, n_local):
        recorded.append((f"{task}#{index}", moments_source))  # the prompt's masses as the fixture recorded them
        return data["prompts"][f"{task}#{index}"]
    monkeypatch.setattr(calibrate, "prompt_masses", record)
    argv = ["--qada", "--tasks", "fwe", "--length", "400", "--max-new-tokens", "6", "--model", str(tiny_dir)]

    def run(name, *extra, masses=None):
        """lab.calibrate into tmp_path/name, holding `masses` (a dict, or bytes for a cut file) as masses.pt."""
        folder = tmp_path / name
        folder.mkdir()
        if isinstance(masses, bytes):
            (folder / "masses.pt").write_bytes(masses)
        elif masses is not None:
            torch.save(masses, folder / "masses.pt")
        capsys.readouterr()
        return calibrate.main(argv + ["--out", str(folder), *extra]), folder
    rc, folder = run("one", "--samples", "1", masses=data)
    assert rc == 0 and recorded == []
    assert load_calibration(folder / "affine.json").settings["steps"] == len(data["prompts"]["fwe#0"][1])
    older = {"settings": data["settings"], "prompts": dict(data["prompts"], **{"fwe#1": (
        data["prompts"]["fwe#1"][0][:, :, :4], data["prompts"]["fwe#1"][1])})}
    assert run("older", "--samples", "2", masses=older)[0] == 0 and recorded == [("fwe#1", "random-words")]
    assert run("other", "--samples", "1", "--moments", "prompt", masses=data)[0] == 2
    assert "masses.pt holds masses of other settings (moments_source: 'random-words' there, 'prompt' asked" in (
        capsys.readouterr().err)
    recorded.clear()
    rc, folder = run("forced", "--samples", "1", "--moments", "prompt", "--force", masses=data)
    assert rc == 0 and recorded == [("fwe#0", "prompt")]
    assert torch.load(folder / "masses.pt", weights_only=True)["settings"]["moments_source"] == "prompt"
    rc, folder = run("cut", "--samples", "1", "--force", masses=b"PK\x03\x04 cut short")
    assert rc == 0 and recorded[1:] == [("fwe#0", "random-words")]
    shutil.copytree(fitted, tmp_path / "fitted")
    for extra, there in ((["--samples", "2", "--eps", "0.1"], "eps: 0.05 there, 0.1 asked"),
                         (["--samples", "1"], "samples: 2 there, 1 asked")):
        capsys.readouterr()
        assert calibrate.main(argv + ["--out", str(tmp_path / "fitted"), *extra]) == 2
        assert there in capsys.readouterr().err
    assert calibrate.main(argv + ["--out", str(tmp_path / "fitted"), "--samples", "2", "--eps", "0.1", "--force"]) == 0
    assert load_calibration(tmp_path / "fitted" / "quantile.json").settings["eps"] == 0.1
    model, tok = load(str(tiny_dir))  # a hub id's model is known only once loaded: calibrate_qada checks it then
    with pytest.raises(ValueError, match="offset.json holds a correction fitted with other settings .samples: 2"):
        calibrate.calibrate_qada(model, tok, ["fwe"], tmp_path / "fitted", 400, 1, 1, 6, progress=False)


def test_the_recorded_masses_are_the_true_ones_and_the_gaussian_terms(fitted, tiny_dir):
    """masses.pt's Gaussian terms of each step are Eq. 6's of the queries decoded and of the moments the file names
    (Option 2: the random-words reference prompt's, for the prompt's length, built here anew), and each KIND.json is
    that kind's fit of every prompt's masses."""
    data = torch.load(fitted / "masses.pt", weights_only=True)
    assert set(data["prompts"]) == {"fwe#0", "fwe#1"}
    masses, n_bulk = data["prompts"]["fwe#0"]
    S, L, rows, H = masses.shape
    assert (L, rows, H) == (2, 5, 4) and S == len(n_bulk) >= 1 and (n_bulk > 0).all()
    assert torch.isfinite(masses).all()
    settings = data["settings"]
    assert settings["moments_source"] == "random-words"
    model, tok = load(str(tiny_dir))
    T_prompt = QUERIES[0][0] - 1  # the first step's cache holds the prompt and the token it appended
    moments = ReferenceKeys(model, tok, "random", root=None, progress=False).for_prompt(
        T_prompt, settings["n_sink"], settings["n_local"])
    assert len(QUERIES) == S * L
    Hkv, D = moments.mean.shape[1:]
    for i, (T, layer, q) in enumerate(QUERIES):
        qg = q.view(Hkv, H // Hkv, D).double()
        mean, cov = moments.mean[layer].double(), moments.cov[layer].double()
        mu = torch.einsum("ghd,gd->gh", qg, mean).reshape(H) / math.sqrt(D)
        half_var = torch.einsum("ghd,gde,ghe->gh", qg, cov, qg).reshape(H) / (2 * D)
        step = i // L
        assert n_bulk[step] == T - settings["n_local"]
        torch.testing.assert_close(masses[step, layer, 2].double(), mu, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(masses[step, layer, 3].double(), half_var, atol=1e-5, rtol=1e-5)
    every = [data["prompts"][p] for p in sorted(data["prompts"])]
    all_masses, all_n = torch.cat([m for m, _ in every]), torch.cat([n for _, n in every])
    for kind in CALIBRATION_KINDS:
        c = load_calibration(fitted / f"{kind}.json")
        assert c.settings["kind"] == kind and c.settings["moments_source"] == "random-words"
        assert c.a.shape == (L, H) and c.settings["steps"] == sum(len(n) for _, n in data["prompts"].values())
        a, b, s = calibrate.fit_calibration(all_masses, all_n, Hkv, kind, c.settings.get("eps", 0.05))
        assert torch.equal(c.a, a) and torch.equal(c.b, b) and (c.s is None) == (s is None)
        assert s is None or torch.equal(c.s, s)


def test_mass_recorder_matches_the_oracle_and_eq6(tiny_dir):
    """One recorded step against oracle_log_masses and the quadratic form computed here."""
    H, Hkv, D, T = 4, 2, 8, 120
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, T, D, generator=g), torch.randn(1, Hkv, T, D,
                                                                                                           generator=g)
    mean, cov = torch.randn(1, Hkv, D, generator=g), random_cov(Hkv, D)[None]
    rec = calibrate.MassRecorder(FixedMoments(mean, cov, 50), N_SINK, N_LOCAL)
    rec(q, k, v, 0)
    masses, n_bulk = rec.masses()
    masses = masses.to(q.device)  # the recorder keeps them on the CPU
    log_local, log_bulk = oracle_log_masses(all_scores(q[0, :, 0], k[0]), N_SINK, N_LOCAL)
    assert torch.equal(masses[0, 0, 0], log_local) and torch.equal(masses[0, 0, 1], log_bulk)
    qg = q[0, :, 0].view(Hkv, H // Hkv, D).double()
    mu = torch.einsum("ghd,gd->gh", qg, mean[0].double()).reshape(H) / math.sqrt(D)
    half_var = torch.einsum("ghd,gde,ghe->gh", qg, cov[0].double(), qg).reshape(H) / (2 * D)
    torch.testing.assert_close(masses[0, 0, 2].double(), mu, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(masses[0, 0, 3].double(), half_var, atol=1e-5, rtol=1e-5)
    # the sampled estimate: one key from each of 64 strata of the 104 bulk keys, their mean exp times T_bulk
    idx = bulk_sample(T, N_SINK, N_LOCAL, 64, 0)
    s = all_scores(q[0, :, 0], k[0][:, idx]).double()
    torch.testing.assert_close(masses[0, 0, 4].double(), (s.exp().mean(-1) * (T - N_LOCAL)).log(), atol=1e-5, rtol=0)
    assert n_bulk.tolist() == [T - N_LOCAL]


def test_the_recorder_takes_only_steps_past_the_window_and_a_prompt_decodes_its_tasks_answer(tiny_dir, monkeypatch):
    """A step whose cache is no longer than the window has no bulk (T_bulk 0, log 0): not recorded, and a prompt
    without a step keeps the five rows, so a rerun finds it recorded. prompt_masses decodes up to max_new_tokens or
    the task's own answer length, whichever is less, as oracle_frequency does."""
    H, Hkv, D = 4, 2, 8
    g = torch.Generator().manual_seed(4)
    q, k = torch.randn(1, H, 1, D, generator=g), torch.randn(1, Hkv, N_LOCAL + 1, D, generator=g)
    rec = calibrate.MassRecorder(FixedMoments(torch.zeros(1, Hkv, D), random_cov(Hkv, D)[None], 50), N_SINK, N_LOCAL)
    rec(q, k[:, :, :N_LOCAL], k[:, :, :N_LOCAL], 0)
    masses, n_bulk = rec.masses()
    assert masses.shape == (0, 0, 5, 0) and n_bulk.shape == (0,)
    rec(q, k, k, 0)
    masses, n_bulk = rec.masses()
    assert masses.shape == (1, 1, 5, H) and n_bulk.tolist() == [1] and torch.isfinite(masses).all()
    model, tok = load(str(tiny_dir))
    asked = []
    monkeypatch.setattr(calibrate, "decode", lambda model, cache, logits, n, *a: asked.append(n))
    own = calibrate.make_sample("fwe", 0, 400, tok, 1).max_new_tokens
    for max_new_tokens in (own + 5, 2):
        calibrate.prompt_masses(model, tok, None, "fwe", 0, 400, 1, max_new_tokens, "prompt", 16, 128)
    assert asked == [own, 2]


def test_generate_and_the_sweep_run_calibrated_qada(fitted, tiny_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    prompt = str(write_prompt(tmp_path, 300))
    argv = ["--prompt", prompt, "--model", str(tiny_dir), "--max-new-tokens", "6", "--json", "--n-sink", "16"]
    assert generate.main(argv + ["--method", "qada"]) == 0
    plain = json.loads(capsys.readouterr().out)
    # the identity correction gives qada's labels and text
    identity = Calibration(torch.zeros(2, 4), torch.ones(2, 4), None, {"moments_source": "random-words"})
    save_calibration(tmp_path / "identity.json", identity)
    assert generate.main(argv + ["--method", "qada_cal", "--calibration", str(tmp_path / "identity.json")]) == 0
    same = json.loads(capsys.readouterr().out)
    assert (same["text"], same["sparsity"], same["kv_read"]) == (plain["text"], plain["sparsity"], plain["kv_read"])
    assert same["calibration"] == str(tmp_path / "identity.json") and plain["calibration"] is None
    assert generate.main(argv + ["--method", "qada_kv_cal", "--calibration", str(fitted / "affine.json")]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "qada_kv_cal"
    assert generate.main(argv + ["--method", "qada_cal"]) == 2  # a folder model ships none
    assert "needs --calibration FILE" in capsys.readouterr().err
    assert generate.main(argv + ["--method", "qada_cal", "--calibration", str(tmp_path / "identity.json"),
                                 "--moments", "prompt"]) == 2
    assert "--moments random-words" in capsys.readouterr().err
    assert generate.main(argv + ["--method", "qada_sampled_cal", "--calibration", str(fitted / "sampled.json")]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "qada_sampled_cal"
    assert generate.main(argv + ["--method", "qada_sampled_cal", "--calibration", str(fitted / "affine.json")]) == 2
    assert "corrects the gaussian estimate" in capsys.readouterr().err

    out = tmp_path / "run"
    transfer = shutil.copytree(fitted, tmp_path / "transfer")  # another correction: every head pushed local
    c = load_calibration(transfer / "affine.json")
    save_calibration(transfer / "affine.json", Calibration(c.a + 40, c.b, c.s, c.settings))
    assert sweep.main(["--out", str(out), "--tasks", "fwe", "--length", "400", "--samples", "1", "--methods",
                       "dense,qada_cal,qada_cal_quantile,qada_kv_cal,qada_cal_transfer,qada_sampled_cal,"
                       "qada_kv_sampled_cal_transfer", "--taus", "0.6",
                       "--ablations", "", "--ctxfree-samples", "0", "--track", "", "--model", str(tiny_dir),
                       "--calibration", str(fitted), "--calibration-transfer", str(transfer), "--no-report"]) == 0
    found = {r["config"]: r for r in records.read_records(out)}
    assert set(found) == {"dense", "qada_cal@0.6", "qada_cal_quantile@0.6", "qada_kv_cal@0.6",
                          "qada_cal_transfer@0.6", "qada_sampled_cal@0.6", "qada_kv_sampled_cal_transfer@0.6"}
    assert (found["qada_kv_sampled_cal_transfer@0.6"]["path"], found["qada_kv_sampled_cal_transfer@0.6"]["source"]) == (
        "qada_kv_sampled_cal", "transfer-sampled")
    assert ((found["qada_cal_quantile@0.6"]["path"], found["qada_cal_quantile@0.6"]["source"])
            == ("qada_cal", "quantile"))
    assert found["qada_cal_transfer@0.6"]["sparsity"] == 1.0 != found["qada_cal@0.6"]["sparsity"]  # each its own
    assert sweep.main(["--out", str(tmp_path / "run2"), "--tasks", "fwe", "--length", "400", "--samples", "1",
                       "--methods", "qada_cal", "--model", str(tiny_dir), "--ctxfree-samples", "0"]) == 2
    assert "give --calibration DIR" in capsys.readouterr().err


def test_calibration_mismatches_are_one_clear_line(tmp_path, capsys):
    c = Calibration(torch.zeros(2, 4), torch.ones(2, 4), torch.ones(2, 2), {"n_sink": 16, "n_local": 128,
                                                                             "moments_source": "random-words"})
    check_calibration(c, "c.json", 2, 4, 2, 16, 128, "random-words")  # fits
    for args, message in (((3, 4, 2, 16, 128), r"corrects \(2, 4\) heads"), ((2, 4, 1, 16, 128), "on 1 KV heads"),
                          ((2, 4, 2, 4, 128), "fitted with n_sink 16, not 4"),
                          ((2, 4, 2, 16, 64), "fitted with n_local 128, not 64")):
        with pytest.raises(ValueError, match=message):
            check_calibration(c, "c.json", *args)
    with pytest.raises(ValueError, match="--moments random-words"):
        check_calibration(c, "c.json", 2, 4, 2, 16, 128, "prompt")
    old = Calibration(torch.zeros(2, 4), torch.ones(2, 4), None, {})  # a file that predates the key: random words
    with pytest.raises(ValueError, match="corrects the random-words moments' estimate; run it with those moments "
                                         "\\(--moments random-words; moments='random-words' in the transformers "
                                         "adapter\\)"):
        check_calibration(old, "old.json", 2, 4, 2, 16, 128, "prompt")
    assert calibrate.main(["--qada", "--tasks", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown task 'nope'" in capsys.readouterr().err
    assert calibrate.main(["--qada", "--tasks", "fwe", "--samples", "0", "--out", str(tmp_path)]) == 2
    assert "argument --samples: must be at least 1" in capsys.readouterr().err


def test_weights_probe_tells_checkpoints_apart_but_not_dtypes(tiny_dir, tmp_path):
    model = load(str(tiny_dir))[0]
    probe = weights_probe(model)
    assert len(probe) == 16 and len(set(probe)) == 16  # 8 spread weights of the first and the last layer's k_proj
    layers = model.model.layers
    for k_proj, picks in ((layers[0].self_attn.k_proj, probe[:8]), (layers[-1].self_attn.k_proj, probe[8:])):
        flat = k_proj.weight.detach().flatten()  # spread from the first weight to the last
        assert picks[0] == float(f"{flat[0]:.6g}") and picks[-1] == float(f"{flat[-1]:.6g}")
    with pytest.raises(ValueError, match="Linear has no layers.N.self_attn.k_proj weights"):
        weights_probe(torch.nn.Linear(2, 2))
    for dtype in (torch.bfloat16, torch.float16):  # the same checkpoint in another dtype passes
        check_weights({"weights_probe": probe}, "f.json", weights_probe(load(str(tiny_dir), dtype=dtype)[0]), "x")
    other = weights_probe(load(str(make_tiny_dir(tmp_path / "other", seed=1)))[0])
    with pytest.raises(ValueError, match="f.json was fitted on other weights than this model's"):
        check_weights({"weights_probe": probe}, "f.json", other, "was fitted on")
    for i in (0, 15):  # one weight of either layer off by 2 % is another checkpoint; by 0.4 % (bf16's rounding) not
        check_weights({"weights_probe": probe}, "f.json", probe[:i] + [probe[i] * 1.004] + probe[i + 1:], "x")
        with pytest.raises(ValueError, match="other weights"):
            check_weights({"weights_probe": probe}, "f.json", probe[:i] + [probe[i] * 1.02] + probe[i + 1:], "x")
    with pytest.raises(ValueError, match="other weights"):  # a probe of another length (a shorter list) differs
        check_weights({"weights_probe": probe[:8]}, "f.json", probe, "x")
    for settings, command in (({}, "python -m lab.calibrate"), ({"kind": "affine"}, "python -m lab.calibrate --qada")):
        with pytest.raises(ValueError, match=f"fit one for this model with {command}$"):  # labels, a correction
            check_weights(dict(settings, weights_probe=probe), "f.json", other, "x")
    check_weights({}, "old.json", other, "x")  # a file saved before probes: not checked
    with pytest.raises(ValueError, match="old.json: its weights_probe must be a list of numbers"):
        check_weights({"weights_probe": "abc"}, "old.json", other, "x")


def test_files_fitted_on_other_weights_are_refused_in_one_line(fitted, tiny_dir, tmp_path, capsys, monkeypatch):
    """A correction or static labels fitted on one checkpoint, given with another of the same shape: generate.py and
    lab.sweep refuse them (the heads fit, so only the weights tell); the checkpoint they were fitted on runs."""
    monkeypatch.setenv("QADA_CACHE", str(tmp_path / "cache"))
    other = make_tiny_dir(tmp_path / "other", seed=1)
    probe = weights_probe(load(str(tiny_dir))[0])
    assert all(load_calibration(fitted / f"{k}.json").settings["weights_probe"] == probe for k in CALIBRATION_KINDS)
    save_labels(tmp_path / "ruler.json", torch.rand(2, 4), {"n_sink": 16, "n_local": 128, "weights_probe": probe,
                                                             "model": str(tiny_dir)})
    prompt = str(write_prompt(tmp_path, 300))
    for method, given in (("qada_cal", ["--calibration", str(fitted / "affine.json")]),
                          ("static", ["--static-labels", str(tmp_path / "ruler.json")])):
        argv = ["--prompt", prompt, "--max-new-tokens", "2", "--json", "--n-sink", "16", "--method", method] + given
        assert generate.main(argv + ["--model", str(tiny_dir)]) == 0
        capsys.readouterr()
        assert generate.main(argv + ["--model", str(other)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"other weights than this model's (those of {tiny_dir.name})" in err
        assert ("was fitted on" if method == "qada_cal" else "holds the oracle's statistics of") in err
    run = ["--tasks", "fwe", "--length", "400", "--samples", "1", "--taus", "0.6", "--ablations", "",
           "--ctxfree-samples", "0", "--track", "", "--no-report"]
    for method, given in (("qada_cal", ["--calibration", str(fitted)]),
                          ("static", ["--static-labels", str(tmp_path / "ruler.json")])):
        assert sweep.main(["--out", str(tmp_path / f"run-{method}"), "--methods", method, "--model", str(other)]
                          + given + run) == 2
        assert "other weights than this model's" in capsys.readouterr().err
