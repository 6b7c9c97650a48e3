"""The step-redundancy analysis (``python -m dit_mcore.analysis.redundancy``): its numbers equal a float64
recomputation from the layers' own activations, its statistics equal NumPy's on known curves, it writes
its report for every family (an image model, an ST-DiT on clips), and bad input gets one line.

The checkpoints are tiny models with random weights keyed by name (as the generation tests use)."""
import json

import numpy as np
import pytest

from dit_mcore.analysis import stability
from dit_mcore.analysis.probe import StepProbe
from dit_mcore.analysis.redundancy import AnalysisRequest, analyse, main


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``{"dit": run dir, "stdit": run dir}``: a class-conditional DiT on 8x8x4 latents and an ST-DiT on
    moving-digit clips (4 frames of 8x8, labels and text); one saved step each."""
    from dit_mcore.parallel.initialize import destroy_distributed
    from dit_mcore.training.trainer import Trainer
    from test_parallel_layouts import _randomize, layout_run
    root, out = tmp_path_factory.mktemp("redundancy"), {}
    for name, data in (("dit", "dense"), ("stdit", "video")):
        trainer = Trainer(layout_run(root / name, data, family=name))
        _randomize(trainer)
        trainer.save()
        destroy_distributed()
        out[name] = str(root / name)
    return out


def test_the_numbers_equal_a_float64_recomputation_from_the_layers_activations(runs, tmp_path, monkeypatch):
    """The probe's relative L1 and cosine of each layer's input, output and residual, per item, seed,
    branch and evaluation, against the same quantities computed in float64 from the activations an
    independent hook kept whole; and the indicators are the first layer's."""
    kept = []  # per forward of a layer: (layer index, input, output), in call order

    def keep(module, args, out):
        kept.append((module.layer_number - 1, args[0].detach().double().clone(), out.detach().double().clone()))

    start = StepProbe.start

    def start_and_keep(self):
        self._keep = [m.register_forward_hook(keep) for m in self.layers]
        return start(self)

    stop = StepProbe.stop

    def stop_keeping(self):
        for h in self._keep:
            h.remove()
        return stop(self)

    monkeypatch.setattr(StepProbe, "start", start_and_keep)
    monkeypatch.setattr(StepProbe, "stop", stop_keeping)
    result = analyse(AnalysisRequest(checkpoint=runs["dit"], out=str(tmp_path), labels=["1", "4", "7"],
                                     seeds=[0, 3], steps=[4], cfg_scale=2.0, batch_size=2))
    run = result["runs"][0]
    assert run["evaluations"] == 4 and run["branches"] == ["cond", "uncond"] and len(run["items"]) == 3
    depth = result["layers"]
    # kept: for seed in (0, 3), for batch in ([1, 4], [7]), 4 evaluations x depth layers
    calls = iter(kept)
    for seed in range(2):
        for rows in ([0, 1], [2]):
            acts = [[next(calls) for _ in range(depth)] for _ in range(4)]  # [evaluation][layer]
            for e in range(1, 4):
                for layer in range(depth):
                    i0, x0, y0 = acts[e - 1][layer]
                    i1, x1, y1 = acts[e][layer]
                    assert i0 == i1 == layer
                    n = len(rows)
                    for name, now, prev in (("input", x1, x0), ("output", y1, y0), ("residual", y1 - x1, y0 - x0)):
                        for b, half in enumerate((slice(0, n), slice(n, 2 * n))):
                            for k, item in enumerate(rows):
                                a, p = now[:, half][:, k], prev[:, half][:, k]
                                want_l1 = ((a - p).abs().sum() / p.abs().sum()).item()
                                want_cos = ((a * p).sum() / (a.norm() * p.norm())).item()
                                got_l1 = run["rel_l1"][name][seed][item][b][layer][e - 1]
                                got_cos = run["cosine"][name][seed][item][b][layer][e - 1]
                                assert got_l1 == pytest.approx(want_l1, rel=1e-5), (name, seed, item, b, layer, e)
                                assert got_cos == pytest.approx(want_cos, rel=1e-5, abs=1e-6)
                                if layer == 0 and name == "residual":
                                    assert run["indicators"]["fbcache"]["rel_l1"][seed][item][b][e - 1] == \
                                        pytest.approx(want_l1, rel=1e-5)
    assert next(calls, None) is None
    # a change exists: the model is not the identity, and nothing is compared across seeds or batches
    assert 0 < run["rel_l1"]["residual"][0][0][0][0][0] < 10
    assert (tmp_path / "summary.md").read_text().startswith("# Step redundancy: dit, 4 layers")
    for f in ("heatmap_euler_4.png", "curves_euler_4.png", "redundancy.json"):
        assert (tmp_path / f).stat().st_size > 1000


def test_an_st_dit_on_clips_gets_its_spatial_and_temporal_sub_blocks_and_two_runs_compare(runs, tmp_path):
    out = tmp_path / "stdit"
    result = analyse(AnalysisRequest(checkpoint=runs["stdit"], out=str(out), prompts=["a 1 moving left", "a 6 moving up"],
                                     seeds=[0, 1], steps=[3, 6], samplers=["euler", "heun"], cfg_scale=1.0))
    names = [r["name"] for r in result["runs"]]
    assert names == ["euler_3", "euler_6", "heun_3", "heun_6"]
    heun = result["runs"][names.index("heun_3")]
    assert heun["evaluations"] == 6 and heun["branches"] == ["cond"]  # Heun: two evaluations per step
    # a step's first evaluation is at the time its predecessor's corrector ran: left out of maps and curves
    assert heun["same_time"] == [False, True, False, True, False]
    assert set(heun["rel_l1"]) == {"input", "output", "residual", "attention", "temporal", "mlp"}
    s = result["stability"]
    assert [e["runs"] for e in s["between_step_counts"]] == [["euler_3", "euler_6"], ["heun_3", "heun_6"]]
    assert [e["runs"] for e in s["between_samplers"]] == [["euler_3", "heun_3"], ["euler_6", "heun_6"]]
    assert -1 <= s["per_run"]["euler_6"]["curves_between_seeds"] <= 1
    summary = (out / "summary.md").read_text()
    assert "## Between step counts" in summary and "## Between samplers" in summary
    # the same model against itself is the same map; against the image DiT, another
    again = analyse(AnalysisRequest(checkpoint=runs["stdit"], out=str(tmp_path / "again"),
                                    prompts=["a 1 moving left", "a 6 moving up"], seeds=[0, 1], steps=[3],
                                    cfg_scale=1.0, compare=str(out)))
    same = again["compare"]["runs"]["euler_3"]
    assert same["map"]["correlation"] == pytest.approx(1.0) and same["map"]["mean_abs_log10_difference"] < 1e-5
    assert "## Against" in (tmp_path / "again" / "summary.md").read_text()


def test_the_stability_statistics_equal_numpys_on_known_curves():
    g = np.random.default_rng(0)
    base = np.exp(g.normal(size=9))
    curves = np.stack([np.stack([base * np.exp(0.1 * g.normal(size=9)) for _ in range(3)]) for _ in range(2)])
    logs = np.log10(curves)
    want = np.mean([np.mean([np.corrcoef(logs[s, i], logs[s, j])[0, 1] for i, j in ((0, 1), (0, 2), (1, 2))])
                    for s in range(2)])
    assert stability.between_prompts(curves) == pytest.approx(want)
    want_seeds = np.mean([np.corrcoef(logs[0, i], logs[1, i])[0, 1] for i in range(3)])
    assert stability.between_seeds(curves) == pytest.approx(want_seeds)
    assert stability.variation_across_prompts(curves) == pytest.approx(np.mean(curves.std(1) / curves.mean(1)))
    # a curve sampled at twice the resolution of the same function correlates to ~1 on the normalised axis
    f = lambda u: np.exp(3 * np.sin(4 * u))  # noqa: E731
    coarse, fine = f((np.arange(16) + 1) / 16), f((np.arange(32) + 1) / 32)
    assert stability.curve_correlation(coarse, fine) > 0.99
    assert stability.curve_correlation(coarse, f((np.arange(32) + 1) / 32)[::-1]) < 0.5
    d = stability.map_difference(np.outer(np.arange(1, 5), coarse), np.outer(np.arange(1, 9) / 2, fine) / 10)
    assert d["correlation"] > 0.95 and d["mean_abs_log10_difference"] == pytest.approx(1.0, abs=0.15)


def test_bad_input_gets_one_line_naming_the_argument(runs, tmp_path, capsys):
    def error(*argv):
        assert main(["--checkpoint", runs["dit"], "--out", str(tmp_path), *argv]) == 2
        return capsys.readouterr().err.strip()

    assert error("--labels", "1", "--seeds", "0,x") == "redundancy: error: --seeds 0,x: give integers separated by commas " \
                                                          "(e.g. --seeds 0,1,2,3)"
    assert "--seeds 1,1" in error("--labels", "1", "--seeds", "1,1")
    assert error("--labels", "1", "--steps", "1").startswith("redundancy: error: --steps 1: the analysis compares")
    assert "--sampler ddpm" in error("--labels", "1", "--samplers", "ddpm")
    assert "--prompts" in error("--prompts", "a cat")
    assert error("--labels", "1", "--compare", str(tmp_path)).startswith(f"redundancy: error: --compare {tmp_path}: no")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "redundancy.json").write_text("{not json")
    assert "is not an analysis's" in error("--labels", "1", "--compare", str(tmp_path / "other"))
    assert "one sampler and one step count" in error("--labels", "1", "--steps", "2,3", "--derive-plan")
    assert error("--labels", "1", "--derive-plan", "--budget", "1.5").startswith("redundancy: error: --budget 1.5")
    for line in capsys.readouterr().err.splitlines():
        assert "Traceback" not in line


def test_a_derived_plan_recomputes_a_layer_when_its_measured_change_adds_up_and_meets_the_budget():
    from dit_mcore.analysis.cache_plan import derive_plan, schedule
    changes = np.array([[0.01] * 7, [0.2] * 7, [0.01, 0.01, 0.5, 0.01, 0.01, 0.01, 0.01]])  # 3 layers, 8 evaluations
    # layer 0 reaches 0.025 every third change, layer 1 at every change, layer 2 at its jump and 3 changes later
    assert schedule(changes, 0.025) == [[0, 1, 2], [1], [1], [0, 1, 2], [1], [1], [0, 1, 2], [0, 1, 2]]
    plan = derive_plan(changes, 0.5, kind="layers")
    assert plan["reused"] >= 0.5 and plan["evaluations"] == 8 and plan["layers"] == 3
    assert all(0 in c and 1 in c and 2 in c for c in (plan["compute"][0], plan["compute"][-1]))
    # the fast-changing layer is recomputed at least as often as the calm ones
    counts = [sum(layer in c for c in plan["compute"]) for layer in range(3)]
    assert counts[1] >= counts[0] and counts[1] >= counts[2]
    with pytest.raises(Exception, match="at most 0.750 can be reused"):
        derive_plan(changes, 0.8, kind="layers")
    # whole evaluations: every layer runs or none, from the change averaged over layers
    whole = derive_plan(changes, 0.5, kind="evaluations")
    assert all(c in ([], [0, 1, 2]) for c in whole["compute"]) and whole["reused"] >= 0.5
    # an exactly zero residual (0/0: NaN) is no change; a change without bound is always recomputed
    quiet = changes.copy()
    quiet[0] = np.nan
    assert np.isfinite(derive_plan(quiet, 0.5, kind="layers")["threshold"])
    loud = changes.copy()
    loud[:, :] = np.inf
    with pytest.raises(Exception, match="allow reusing at most 0.000"):
        derive_plan(loud, 0.5)


def test_the_analysis_derives_a_plan_the_generate_command_runs(runs, tmp_path):
    from dit_mcore.generate.job import GenerateRequest, generate
    result = analyse(AnalysisRequest(checkpoint=runs["dit"], out=str(tmp_path / "a"), labels=["2", "5"], seeds=[0],
                                     steps=[8], cfg_scale=2.0, derive_plan=True, budget=0.4))
    plan = json.loads((tmp_path / "a" / "plan.json").read_text())
    assert plan["reused"] >= 0.4 and plan["evaluations"] == 8 and result["plan"]["reused"] == plan["reused"]
    summary = generate(GenerateRequest(checkpoint=runs["dit"], out=str(tmp_path / "g"), labels=["2", "5"], steps=8,
                                       cfg_scale=2.0, progress=False, cache=f"static:{tmp_path / 'a' / 'plan.json'}"))
    assert summary["cache"]["skipped_fraction"] == pytest.approx(plan["reused"])
    assert "## Static cache plan" in (tmp_path / "a" / "summary.md").read_text()


LAYOUTS = {"dit_cfg2": {"cfg_parallel": 2}, "dit_tp2_sp": {"tensor_model_parallel_size": 2, "sequence_parallel": True},
           "dit_cp2_p2p": {"context_parallel_size": 2, "cp_comm_type": "p2p"}, "dit_pp2": {"pipeline_model_parallel_size": 2},
           "stdit_cp2_a2a": {"context_parallel_size": 2, "cp_comm_type": "a2a"},
           "dit_items2": {},  # (the two ranks share the items: 2 and 1)
           "dit_pf2": {"pipefusion": 2},  # (against the same patches on one process)
           "stdit_patches2_cp2": {"pipefusion_patches": 2, "context_parallel_size": 2, "cp_comm_type": "a2a"}}


def _request(runs, name, out, parallel=None) -> AnalysisRequest:
    family = name.split("_")[0]
    what = dict(labels=["1", "4", "7"]) if family == "dit" else dict(prompts=["a 1 moving left", "a 6 moving up"])
    return AnalysisRequest(checkpoint=runs[family], out=str(out), seeds=[0, 1], steps=[4], cfg_scale=2.0,
                           parallel=parallel, **what)


def _analyse_layouts(rank, world, runs, root):
    from dit_mcore.generate.layout import GenerateParallel
    for name, layout in LAYOUTS.items():
        analyse(_request(runs, name, root / name, GenerateParallel(**layout)))


def test_under_every_analysis_layout_the_numbers_equal_one_process(runs, tmp_path):
    """CFG-parallel, tensor + sequence parallel, ring attention, pipeline stages and the items shared over the
    ranks on the DiT, Ulysses on the ST-DiT, at 2 ranks: every relative L1 and cosine (and the indicators) equal
    the one-process run's; 2-stage PipeFusion's, and an ST-DiT's 2 patches split over Ulysses ranks, equal the same patches'
    on one process, and with every step synchronous those equal the plain run's."""
    from dist_utils import run_distributed
    run_distributed(_analyse_layouts, 2, runs, tmp_path)
    from dit_mcore.generate.layout import GenerateParallel
    references = {}
    for name in LAYOUTS:
        family = name.split("_")[0]
        patches = GenerateParallel(**LAYOUTS[name]).patches()
        if (family, patches) not in references:
            one = GenerateParallel(pipefusion_patches=patches) if patches > 1 else None
            references[family, patches] = analyse(_request(runs, name, tmp_path / f"one_{family}_{patches}",
                                                           one))["runs"][0]
        want = references[family, patches]
        got = json.loads((tmp_path / name / "redundancy.json").read_text())["runs"][0]
        assert set(got["rel_l1"]) == set(want["rel_l1"]), name
        for metric in ("rel_l1", "cosine"):
            for key in want[metric]:
                a = np.array(got[metric][key], dtype=np.float64)
                b = np.array(want[metric][key], dtype=np.float64)
                np.testing.assert_allclose(a, b, rtol=2e-4, atol=1e-6, err_msg=f"{name} {metric} {key}")
        for key in want["indicators"]:
            np.testing.assert_allclose(np.array(got["indicators"][key]["rel_l1"], dtype=np.float64),
                                       np.array(want["indicators"][key]["rel_l1"], dtype=np.float64), rtol=2e-4)
    synchronous = analyse(_request(runs, "dit", tmp_path / "pf_sync",
                                   GenerateParallel(pipefusion_patches=2, pipefusion_warmup_steps=4)))["runs"][0]
    for key in references["dit", 1]["rel_l1"]:  # (every unit the whole stream: the plain run's numbers)
        np.testing.assert_allclose(np.array(synchronous["rel_l1"][key], dtype=np.float64),
                                   np.array(references["dit", 1]["rel_l1"][key], dtype=np.float64), rtol=1e-6)
    assert references["dit", 2]["rel_l1"] != references["dit", 1]["rel_l1"]  # (displaced patches change things)


def test_the_teacache_fit_is_numpys_polyfit_of_the_output_change_on_the_indicator(runs, tmp_path):
    result = analyse(AnalysisRequest(checkpoint=runs["dit"], out=str(tmp_path), labels=["1", "4", "7"], seeds=[0, 1],
                                     steps=[6], cfg_scale=2.0))
    run = result["runs"][0]
    x = np.array(run["indicators"]["teacache"]["rel_l1"], dtype=np.float64).ravel()
    y = np.array(run["indicators"]["model_output"]["rel_l1"], dtype=np.float64).ravel()
    fit = json.loads((tmp_path / "teacache_fit.json").read_text())
    assert fit["points"] == x.size == 3 * 2 * 2 * 5 and fit["layers"] == 4
    # (the JSON's numbers carry 6 digits: compare the fitted curves, which a degree-4 fit's coefficients amplify)
    np.testing.assert_allclose(np.polyval(fit["coefficients"], x), np.polyval(np.polyfit(x, y, 4), x), rtol=1e-4)
    assert "## TeaCache's rescaling" in (tmp_path / "summary.md").read_text()
