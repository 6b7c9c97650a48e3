"""Step caching in the sampler (``python -m dit_mcore.generate --cache``): a policy that reuses nothing
equals no cache bit for bit; a static plan runs exactly the layers it names; TeaCache and First-Block-Cache
decide as their rules say on a scripted indicator and add exactly the cached residual; FORA reuses the
attention and MLP outputs between refreshes; bad input gets one line.

The checkpoint is a tiny class-conditional DiT with random weights keyed by name (as the generation tests
use)."""
import json

import pytest
import torch

from dit_mcore.errors import ConfigError
from dit_mcore.generate import cache as cache_module
from dit_mcore.generate.job import GenerateRequest, generate
from dit_mcore.models.dit.layer import DiTLayer

STEPS = 6


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    from dit_mcore.parallel.initialize import destroy_distributed
    from dit_mcore.training.trainer import Trainer
    from test_parallel_layouts import _randomize, layout_run
    root = tmp_path_factory.mktemp("cache")
    trainer = Trainer(layout_run(root / "dit", "dense"))
    _randomize(trainer)
    trainer.save()
    destroy_distributed()
    return str(root / "dit")


def _generate(run_dir, out, **kwargs) -> tuple[torch.Tensor, dict]:
    request = GenerateRequest(checkpoint=run_dir, out=str(out), labels=["1", "4", "7"], steps=STEPS, cfg_scale=2.0,
                              seed=3, progress=False, save_latents=True, **kwargs)
    summary = generate(request)
    return torch.load(out / "latents.pt"), summary


def _plan(path, compute, layers=4):
    path.write_text(json.dumps({"evaluations": len(compute), "layers": layers, "compute": compute}))
    return f"static:{path}"


def test_a_policy_that_reuses_nothing_equals_no_cache_bit_for_bit(run_dir, tmp_path):
    want, summary = _generate(run_dir, tmp_path / "none")
    assert "cache" not in summary
    full = _plan(tmp_path / "full.json", [[0, 1, 2, 3]] * STEPS)
    for policy in ("fora:1", "teacache:0", "fbcache:0", full):
        got, summary = _generate(run_dir, tmp_path / policy.split(":")[0], cache=policy)
        assert torch.equal(got, want), policy
        assert summary["cache"]["skipped"] == 0 and summary["cache"]["layer_evaluations"] == 4 * STEPS
    index = json.loads((tmp_path / "static" / "index.json").read_text())
    assert index[0]["cache"] == full


def test_a_static_plan_runs_exactly_the_layers_it_names(run_dir, tmp_path, monkeypatch):
    compute = [[0, 1, 2, 3], [0, 2], [], [3], [1, 2], [0, 1, 2, 3]]
    ran = []
    forward = DiTLayer.forward

    def counted(self, *args, **kwargs):
        ran.append(self.layer_number - 1)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(DiTLayer, "forward", counted)
    calls = []
    evaluation = cache_module.StepCache.evaluation

    def noted(self, index):
        calls.append((index, len(ran)))
        return evaluation(self, index)

    monkeypatch.setattr(cache_module.StepCache, "evaluation", noted)
    got, summary = _generate(run_dir, tmp_path / "plan", cache=_plan(tmp_path / "p.json", compute))
    ends = [n for _, n in calls[1:]] + [len(ran)]
    per_evaluation = [sorted(ran[start:end]) for (_, start), end in zip(calls, ends)]
    assert per_evaluation == [sorted(c) for c in compute]
    skipped = sum(4 - len(c) for c in compute)
    assert summary["cache"]["skipped"] == skipped
    assert summary["cache"]["flops_saved"] > 0
    uncached, _ = _generate(run_dir, tmp_path / "uncached")
    assert not torch.equal(got, uncached)  # the reused residuals change the result (a random model: by much)


def _scripted(monkeypatch, changes):
    """``_rel_l1`` returns ``changes`` in turn: the indicator as the policy sees it."""
    seq = iter(changes)
    monkeypatch.setattr(cache_module, "_rel_l1", lambda now, prev, groups=(): next(seq))


@pytest.mark.parametrize("kind", ["teacache", "fbcache"])
def test_teacache_and_first_block_cache_decide_by_their_rules_and_add_the_cached_residual(run_dir, tmp_path,
                                                                                          monkeypatch, kind):
    threshold = 0.1
    changes = [0.05, 0.04, 0.3, 0.02] if kind == "teacache" else [0.05, 0.2, 0.05, 0.5]
    # TeaCache: accumulated 0.05 (skip), 0.09 (skip), 0.39 (run, reset), 0.02 (skip); the last always runs.
    # FBCache: compared with the last computed first-layer residual: 0.05 (skip), 0.2 (run), 0.05 (skip), 0.5 (run).
    want_skips = [1, 2, 4] if kind == "teacache" else [1, 3]
    _scripted(monkeypatch, changes + [0.0] * 10)
    stack_io = []  # the layer stack's (input, output) per evaluation
    from dit_mcore.models.layer_stack import LayerStack
    forward = LayerStack.forward

    def recorded(self, hidden, cond, **kwargs):
        out = forward(self, hidden, cond, **kwargs)
        stack_io.append((hidden.detach().clone(), out.detach().clone()))
        return out

    monkeypatch.setattr(LayerStack, "forward", recorded)
    _, summary = _generate(run_dir, tmp_path / kind, cache=f"{kind}:{threshold}", batch_size=8)
    layers_skipped = 4 if kind == "teacache" else 3
    assert summary["cache"]["skipped"] == layers_skipped * len(want_skips)
    assert len(stack_io) == STEPS
    computed = 0
    for e, (x, y) in enumerate(stack_io):
        if e in want_skips:
            if kind == "teacache":  # the stack's residual of the last computed evaluation, added
                torch.testing.assert_close(y, x + (stack_io[computed][1] - stack_io[computed][0]), rtol=0, atol=1e-6)
        else:
            computed = e


def test_fora_reuses_attention_and_mlp_outputs_between_refreshes(run_dir, tmp_path, monkeypatch):
    counts = {"attention": 0, "mlp": 0}
    from dit_mcore.generate.cache import StepCache
    original = StepCache._fora

    def counting(self, key, forward):
        def run(*args, **kwargs):
            computes = self._refresh() or (self.scope, key) not in self.store
            counts["attention" if key.endswith(".0") else "mlp"] += 1 if computes else 0
            return wrapped(*args, **kwargs)
        wrapped = original(self, key, forward)
        return run

    monkeypatch.setattr(StepCache, "_fora", counting)
    _, summary = _generate(run_dir, tmp_path / "fora", cache="fora:2")
    refreshes = len([e for e in range(STEPS) if e % 2 == 0 or e == STEPS - 1])  # 0, 2, 4, 5
    assert counts == {"attention": 4 * refreshes, "mlp": 4 * refreshes}
    assert summary["cache"]["skipped"] == 4 * (STEPS - refreshes)


def test_nothing_crosses_batches(run_dir, tmp_path):
    """Items sampled one per batch equal the same items in one batch (the cache starts afresh each call)."""
    together, _ = _generate(run_dir, tmp_path / "one", cache="fora:2", batch_size=3)
    apart, _ = _generate(run_dir, tmp_path / "three", cache="fora:2", batch_size=1)
    torch.testing.assert_close(apart, together, rtol=1e-4, atol=1e-5)


def test_bad_cache_arguments_get_one_line_naming_the_argument(run_dir, tmp_path):
    def error(cache, **kwargs):
        with pytest.raises(ConfigError) as e:
            _generate(run_dir, tmp_path / "bad", cache=cache, **kwargs)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "unknown policy 'deepcache'" in error("deepcache:2")
    assert "FORA's interval must be an integer >= 1" in error("fora:0")
    assert "the threshold must be a number >= 0" in error("teacache:-0.1")
    assert "give the policy's value" in error("fbcache")
    assert "a model of 8 layers, this one has 4" in error(_plan(tmp_path / "deep.json", [[0]] * STEPS, layers=8))
    assert "covers 3 model evaluations, this sampler runs 6" in error(_plan(tmp_path / "short.json", [[0]] * 3))
    assert "not a readable plan" in error(f"static:{tmp_path / 'missing.json'}")
    heun = tmp_path / "heun.json"
    heun.write_text(json.dumps({"evaluations": STEPS, "layers": 4, "compute": [[0]] * STEPS, "sampler": "heun"}))
    assert "derived for --sampler heun, this run uses --sampler euler" in error(f"static:{heun}")
    from dit_mcore.generate.job import plan
    from dit_mcore.generate.layout import GenerateParallel
    with pytest.raises(ConfigError, match="--cache teacache:0.1 with parallel.pipeline_model_parallel_size=2: not"):
        plan(GenerateRequest(checkpoint=run_dir, out=str(tmp_path / "p"), labels=["1"], cache="teacache:0.1"),
             GenerateParallel(pipeline_model_parallel_size=2), world_size=2)
    for cache in ("fora:2", "fbcache:0.1"):  # (under PipeFusion each patch its own cache)
        assert plan(GenerateRequest(checkpoint=run_dir, out=str(tmp_path / "p"), labels=["1"], cache=cache),
                    GenerateParallel(pipefusion=2), world_size=2).cache.text == cache


def test_teacache_accumulates_the_change_rescaled_by_the_models_fit(run_dir, tmp_path, monkeypatch):
    """``teacache:T:FIT.json``: the identity polynomial is the unscaled policy bit for bit; ``2x`` decides as the
    unscaled policy at ``T / 2`` (scripted indicator); a fit for another depth is refused."""
    identity = tmp_path / "identity.json"
    identity.write_text(json.dumps({"coefficients": [0, 0, 0, 1, 0], "layers": 4}))
    plain, _ = _generate(run_dir, tmp_path / "plain", cache="teacache:2")
    fitted, _ = _generate(run_dir, tmp_path / "fitted", cache=f"teacache:2:{identity}")
    assert torch.equal(plain, fitted)
    double = tmp_path / "double.json"
    double.write_text(json.dumps({"coefficients": [2.0, 0.0], "layers": 4}))
    changes = [0.03, 0.03, 0.03, 0.03, 0.0]
    _scripted(monkeypatch, changes)
    _, doubled = _generate(run_dir, tmp_path / "doubled", cache=f"teacache:0.1:{double}")
    _scripted(monkeypatch, changes)
    _, halved = _generate(run_dir, tmp_path / "halved", cache="teacache:0.05")
    assert doubled["cache"]["skipped"] == halved["cache"]["skipped"] > 0  # 0.06 skip, 0.12 run, 0.06 skip ...
    deep = tmp_path / "deep.json"
    deep.write_text(json.dumps({"coefficients": [1.0, 0.0], "layers": 8}))
    with pytest.raises(ConfigError, match="the fit is for a model of 8 layers, this one has 4"):
        _generate(run_dir, tmp_path / "bad", cache=f"teacache:0.1:{deep}")
    with pytest.raises(ConfigError, match="only TeaCache takes a rescaling fit"):
        _generate(run_dir, tmp_path / "bad", cache=f"fbcache:0.1:{deep}")
