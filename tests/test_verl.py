"""VeRL on "tpu": the platform plugin and the SFT trainer (``torchrun -m verl.trainer.sft_trainer``)
with FSDP2, run unchanged by the documented recipe on a tiny Llama model built from a config and
synthetic parquet data (tests/verl_scripts/tiny_setup.py); losses read from VeRL's own console
log.

VeRL lives in its own environment (``make venv-verl`` -> ``.venv-verl``; ``TORCHTPU_VERL_PYTHON``
names another python): every run is a subprocess there, bounded in time. The CPU reference is
the same trainer on PyTorch's CPU (tests/verl_scripts/cpu_platform.py, a test-only VeRL
platform), in float32: under bf16 autocast "tpu" follows CUDA's autocast lists (log_softmax in
float32) where CPU's keep bf16, so those losses differ by bf16 rounding by design; the bf16
default is checked 2 ranks against 1, within what CPU/gloo's 2 ranks give against its 1.
``TORCHTPU_CPU_FALLBACK=0`` makes any op without a lowering an error (the no-padding path's
jagged ops included). VeRL with SGLang rollouts has its own environment (``make
venv-verl-sglang`` -> ``.venv-verl-sglang``; ``TORCHTPU_VERL_SGLANG_PYTHON``).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(ROOT, "tests", "verl_scripts")
VERL_PY = os.environ.get("TORCHTPU_VERL_PYTHON") or os.path.join(ROOT, ".venv-verl", "bin",
                                                                "python")
# VeRL over SGLang (``make venv-verl-sglang``): GRPO's SGLang rollouts
VERL_SGLANG_PY = (os.environ.get("TORCHTPU_VERL_SGLANG_PYTHON")
                  or os.path.join(ROOT, ".venv-verl-sglang", "bin", "python"))
sys.path.insert(0, SCRIPTS)
import recipes  # noqa: E402

FP32 = recipes.FP32


def _need_env():
    if not os.access(VERL_PY, os.X_OK):
        pytest.skip(f"the VeRL environment is absent ({os.path.relpath(VERL_PY, ROOT)}): "
                    "`make venv-verl` builds it (verl 0.9.1, ray, transformers<5.11)")


def _env(*path, **extra):
    """The VeRL subprocesses' environment: this checkout's torchtpu first on ``PYTHONPATH`` (the
    venv's editable install may name another checkout; the runs' working directory is a temporary
    folder), then ``path``; the caller's own PYTHONPATH (another venv's packages) is not passed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VERL_", "PYTEST"))}
    env["PYTHONPATH"] = os.pathsep.join((ROOT, *path))
    env.update(TORCHTPU_CPU_FALLBACK="0", TOKENIZERS_PARALLELISM="false", WANDB_MODE="disabled",
               HYDRA_FULL_ERROR="1", OMP_NUM_THREADS="1")
    env.update(extra)
    return env


def _run(args, env, timeout, log):
    """``args`` in its own session (VeRL's Ray cluster and torchrun ranks with it), the whole
    session killed if it overruns: nothing is left running after a timeout."""
    with open(log, "w") as f:
        p = subprocess.Popen(args, env=env, stdout=f, stderr=subprocess.STDOUT,
                             cwd=os.path.dirname(log), start_new_session=True)
        try:
            p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pytest.fail(f"{args[:3]} did not finish within {timeout} s:\n"
                        f"{open(log).read()[-4000:]}")
    text = open(log).read()
    assert p.returncode == 0, f"exit {p.returncode}:\n{text[-6000:]}"
    return text


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    _need_env()
    out = tmp_path_factory.mktemp("verl")
    _run([VERL_PY, os.path.join(SCRIPTS, "tiny_setup.py"), str(out)], _env(), 300,
         str(out / "setup.log"))
    return out


def sft(setup, name, nproc=1, steps=3, extra=(), env=None, timeout=600):
    """VeRL's SFT trainer under torchrun; [(loss, grad_norm)] per step from its console log."""
    d = setup / name
    d.mkdir()
    text = _run(recipes.sft(VERL_PY, setup, d, nproc, steps, extra), env or _env(), timeout,
                str(d / "run.log"))
    got = recipes.metrics(text)
    assert sorted(got) == list(range(1, steps + 1)), text[-4000:]
    return [(got[i]["train/loss"], got[i]["train/grad_norm"]) for i in range(1, steps + 1)], text


def _cpu_env():
    return _env(SCRIPTS, VERL_USE_EXTERNAL_MODULES="cpu_platform", VERL_PLATFORM="cpu")


CPU_ARGS = ["+model.override_config.attn_implementation=sdpa", "trainer.device=cpu"]


def cpu_reference(setup, name, steps, extra=()):
    return sft(setup, name, steps=steps, env=_cpu_env(), extra=[*CPU_ARGS, *extra])[0]


def ppo_update(setup, name, env, extra=(), python=VERL_PY):
    """tests/verl_scripts/ppo_update.py: one GRPO actor update on a fixed batch."""
    d = setup / name
    d.mkdir()
    result = d / "update.json"
    _run(recipes.ppo_update(python, setup, d, result, extra), env, 600, str(d / "run.log"))
    with open(result) as f:
        return json.load(f)


def _close(a, b, rtol):
    for (la, ga), (lb, gb) in zip(a, b, strict=True):
        assert la == pytest.approx(lb, rel=rtol), (a, b)
        assert ga == pytest.approx(gb, rel=rtol), (a, b)


def test_plugin_registers_tpu_without_environment_variables():
    _need_env()
    code = ("import verl\n"
            "from verl.plugin.platform import get_platform\n"
            "import torchtpu\n"
            "from torchtpu.runtime import devices\n"
            "p = get_platform()\n"
            "assert not devices.backend_created(), 'detection created the JAX backend'\n"
            "from verl.utils.device import get_device_name, get_nccl_backend, get_resource_name\n"
            "import verl.workers.engine\n"
            "from verl.workers.engine.base import EngineRegistry as R\n"
            "assert p.ray_resource_options(1 / 3) == {'resources': {'TPU': 1}}\n"
            "assert p.ray_resource_options(2) == {'resources': {'TPU': 2}}\n"
            "print(get_device_name(), get_nccl_backend(), get_resource_name(),"
            " R.get_engine_cls('language_model', 'fsdp2').__name__,"
            " R.get_engine_cls('value_model', 'fsdp').__name__)\n"
            "print(torchtpu.__file__)\n")
    out = subprocess.run([VERL_PY, "-c", code], env=_env(), capture_output=True, text=True,
                         timeout=300, cwd=SCRIPTS)
    assert out.returncode == 0, out.stderr[-4000:]
    # the tree under test, not whichever checkout the venv's editable install names
    assert out.stdout.split()[-1] == os.path.join(ROOT, "torchtpu", "__init__.py"), out.stdout
    assert out.stdout.split()[-6:-1] == ["tpu", "tpu_dist", "TPU", "FSDPEngineWithLMHead",
                                       "FSDPEngineWithValueHead"]


def _need_sglang_env():
    if not os.access(VERL_SGLANG_PY, os.X_OK):
        pytest.skip(f"VeRL's SGLang environment is absent ({os.path.relpath(VERL_SGLANG_PY, ROOT)})"
                    ": `make venv-verl-sglang` builds it (VeRL 0.9.1 over .venv-sglang)")


# torchtpu.verl's shims for VeRL 0.9.1's SGLang server and weight sync over SGLang 0.5.23
SGLANG_SHIMS = ["verl.workers.rollout.replica._load_sglang",
                "verl.workers.rollout.sglang_rollout.async_sglang_server.dataclasses",
                "verl.workers.rollout.sglang_rollout.async_sglang_server.SGLangHttpServer."
                "launch_server",
                "sglang.srt.entrypoints.engine.Engine._launch_subprocesses",
                "verl.workers.rollout.sglang_rollout.http_server_engine.HttpServerAdapter",
                "verl.workers.rollout.sglang_rollout.http_server_engine.AsyncHttpServerAdapter",
                "verl.workers.rollout.sglang_rollout.sglang_rollout.sgl_update_weights",
                "verl.workers.rollout.sglang_rollout.sglang_rollout.ServerAdapter.update_weights"]


def test_sglang_rollout_loads_for_tpu():
    """VeRL's SGLang rollout (``rollout.name=sglang``) in its venv (VeRL 0.9.1 over SGLang
    0.5.23), tests/verl_scripts/sglang_shims.py: on "tpu", VeRL's loader imports SGLang for
    torchtpu's SGLang platform (VeRL's own loader forces SGLang's CPU engine for that import,
    whose modules need SGLang's C++ CPU kernels: ModuleNotFoundError 'sgl_kernel'), and the
    rollout config's SGLang server arguments default to torchtpu's attention backend, the "tpu"
    device, CUDA's memory saver off. Every shim of VeRL's SGLang server and weight sync applies
    to the installed VeRL and SGLang; each one given a target that moved skips itself with a
    RuntimeWarning naming it. The weight handoff: "tpu" tensors (fp32, bf16) through host shared
    memory, read back by SGLang's own deserializer in another interpreter, equal value for
    value. GRPO end to end: test_grpo_rollout_on_sglang_tpu_weights_synced (slow)."""
    _need_sglang_env()
    out = subprocess.run([VERL_SGLANG_PY, os.path.join(SCRIPTS, "sglang_shims.py")], env=_env(),
                         capture_output=True, text=True, timeout=600, cwd=SCRIPTS)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["loader"] == {"sglang": {"attention_backend": "torchtpu",
                                        "enable_memory_saver": False, "device": "tpu"},
                             "replica": "SGLangReplica", "platform": "TpuSRTPlatform",
                             "device": "tpu", "cpu_engine": None}, got["loader"]
    assert got["applied"] == {k: "applied" for k in SGLANG_SHIMS}, got["applied"]
    assert len(got["moved"]) == 4, got["moved"]
    for target, r in got["moved"].items():
        assert r["status"].startswith("skipped: ") and r["warned"], (target, r)
    assert got["weights"]["equal"] == {"model.embed_tokens.weight": True,
                                       "model.norm.weight": True}, got["weights"]
    # shared-memory handles, not values: the payload is far smaller than the 64 KiB tensor
    assert got["weights"]["bytes"] < 4096, got["weights"]


def test_sft_one_rank_equals_cpu_reference(setup):
    """Two FSDP2 steps on one "tpu" rank, float32, against the same trainer on CPU."""
    tpu, text = sft(setup, "tpu_fp32", steps=2, extra=FP32)
    assert "Detect setting config.trainer.device to cuda for tpu" in text  # auto-detected
    cpu = cpu_reference(setup, "cpu_fp32", steps=2, extra=FP32)
    _close(tpu, cpu, 1e-5)
    assert tpu[1][0] < tpu[0][0]  # it trains


def _rel_diffs(a, b):
    """max over steps of |a - b| / |b|, for the loss and the grad norm: [loss, grad_norm]."""
    return [max(abs(x[i] - y[i]) / abs(y[i]) for x, y in zip(a, b, strict=True)) for i in (0, 1)]


@pytest.mark.slow
def test_sft_two_ranks_bf16_as_close_to_one_rank_as_cpu_gloo(setup):
    """VeRL's default bf16 mixed precision (FSDP2: bf16 parameters and gradients, fp32
    reduction), 2 ranks against 1, three steps, on "tpu"/tpu_dist and on CPU/gloo.

    2 ranks do not equal 1 rank to float32 rounding in bf16, on PyTorch's CPU with gloo either:
    the ranks' samplers group the 8 rows into other micro-batches (rows 0,2,4,6 and 1,3,5,7
    against 0-3 and 4-7), and each micro-batch's gradient is a bf16 sum, rounded before the
    fp32 reduction. Measured (grad norm, 3 steps): CPU/gloo 2 vs 1 rank differs by 6.3e-5,
    3.3e-4, 3.1e-4 relative; "tpu" by 2.2e-4, 1.3e-4, 1.3e-4 (losses: CPU 0, 2.4e-3, 0 -- its
    bf16 log_softmax rounds the loss; "tpu", whose autocast keeps log_softmax in fp32 as CUDA's
    does, 0, 3e-5, 6e-5). So "tpu"'s difference is bounded by CPU/gloo's for the same runs
    (twice it: the two devices round differently, the bound is a scale, not a value); a wrong
    average (sum or a missing rank) would differ by ~1e-1 and more. That the fp32 reduction
    itself equals gloo's is checked exactly in tests/dist_scripts/fsdp_check.py ("mp")."""
    one, _ = sft(setup, "tpu_bf16_1", nproc=1)
    two, _ = sft(setup, "tpu_bf16_2", nproc=2)
    cpu_one = cpu_reference(setup, "cpu_bf16_1", steps=3)
    cpu_two = sft(setup, "cpu_bf16_2", nproc=2, env=_cpu_env(), extra=CPU_ARGS)[0]
    # the first step's loss is computed before any update: equal row by row, on both devices
    assert two[0][0] == pytest.approx(one[0][0], rel=1e-6), (one, two)
    assert cpu_two[0][0] == pytest.approx(cpu_one[0][0], rel=1e-6), (cpu_one, cpu_two)
    tpu_d, cpu_d = _rel_diffs(two, one), _rel_diffs(cpu_two, cpu_one)
    assert 0 < cpu_d[1] < 1e-3, (cpu_one, cpu_two)  # the bf16 rounding the bound rests on
    for name, t, c in zip(("loss", "grad_norm"), tpu_d, cpu_d):
        assert t <= 2 * c, (name, tpu_d, cpu_d, one, two, cpu_one, cpu_two)
    assert one[2][0] < one[0][0]


@pytest.mark.slow
def test_sft_two_ranks_fp32_equal_cpu_and_warm_cache(setup, tmp_path):
    """2 ranks in float32 against the CPU reference; run twice on one compile cache folder,
    the second process reading its programs back, with the same losses."""
    cache = _env(TORCHTPU_CACHE_DIR=str(tmp_path / "cache"))
    cold, _ = sft(setup, "tpu_fp32_2_cold", nproc=2, extra=FP32, env=cache)
    warm, _ = sft(setup, "tpu_fp32_2_warm", nproc=2, extra=FP32, env=cache)
    assert cold == warm
    cpu = cpu_reference(setup, "cpu_fp32_3", steps=3, extra=FP32)
    _close(cold, cpu, 1e-5)


def grpo_weights_synced(setup, name, python, rollout, steps=6):
    """GRPO by VeRL's PPO entry point (``recipes.grpo``), ``steps`` steps; checks that the rollout
    engine samples with the actor's current weights every step."""
    d = setup / name
    d.mkdir()
    # Ray's memory monitor kills the largest worker once the host is 95% full, whoever filled it
    # (on a shared test host: other jobs); the kernel's OOM killer still stands
    text = _run(recipes.grpo(python, setup, d, steps=steps, rollout=rollout),
                _env(RAY_memory_monitor_refresh_ms="0"), 1500, str(d / "run.log"))
    m = recipes.metrics(text)
    assert sorted(m) == list(range(1, steps + 1)), text[-4000:]
    score = [m[i]["critic/score/mean"] for i in range(1, steps + 1)]
    kl = [m[i]["actor/kl_loss"] for i in range(1, steps + 1)]
    # Whether the mean reward rises over a few noisy steps is chance (scores 0.54, 0.44, 0.50,
    # 0.71, 0.47, 0.42 on one clean run): that the update itself is right is checked on a fixed
    # batch against CPU (test_grpo_actor_update_equals_cpu). Here: the actor starts as the
    # reference (KL loss exactly 0 in step 1) and has moved from it in every later step (Adam's
    # first step moves each weight by ~lr: KL ~2e-2 after it), so the weights synchronised
    # below are new ones every step.
    assert kl[0] == pytest.approx(0.0, abs=1e-6), (kl, score)
    assert all(k > 1e-3 for k in kl[1:]), (kl, score)
    for i in range(1, steps + 1):
        # the rollout engine samples with the actor's current weights: its token probabilities
        # match the actor's recomputed ones to float32 rounding, every step (without the sync,
        # one lr=3e-3 update moves them by ~1e-2 and more)
        assert m[i]["training/rollout_probs_diff_max"] < 2e-3, (i, m[i])
        for k in ("timing_s/gen", "timing_s/old_log_prob", "timing_s/ref",
                  "timing_s/update_actor", "timing_s/update_weights"):
            assert k in m[i], (k, sorted(m[i]))
    return m


@pytest.mark.slow
def test_grpo_rollout_on_vllm_tpu_weights_synced(setup):
    """GRPO by VeRL's PPO entry point: FSDP2 actor and reference on "tpu", rollouts served by
    vLLM on "tpu" (torchtpu.vllm), weights synchronised from the actor to vLLM every step, Ray
    placing the workers on "TPU" resources. With no environment variable and VeRL's defaults
    for sleep mode and attention (the plugin turns off what needs CUDA)."""
    grpo_weights_synced(setup, "grpo", VERL_PY, "vllm")


@pytest.mark.slow
def test_grpo_rollout_on_sglang_tpu_weights_synced(setup):
    """The same GRPO with SGLang rollouts (``rollout.name=sglang``, in ``.venv-verl-sglang``):
    VeRL 0.9.1's SGLang HTTP server on "tpu" (torchtpu.sglang, SGLang 0.5.23) through
    torchtpu.verl's shims (sglang_server.py, sglang_weights.py), the actor's weights handed to
    it through host shared memory inside SGLang's weight-update session every step; the KV pool
    bounded (``recipes.SGLANG``). Same bounds as vLLM's, over 4 steps. The server starts with
    random weights (VeRL's rollout ``load_format=dummy``): every step's match comes from the
    sync (with the sync made a no-op: 1.2e-2 in step 1; with it: 8e-5 .. 2.1e-4)."""
    _need_sglang_env()
    grpo_weights_synced(setup, "grpo_sglang", VERL_SGLANG_PY, "sglang", steps=4)


@pytest.mark.slow
@pytest.mark.parametrize("venv", ["vllm", "sglang"])
def test_grpo_actor_update_equals_cpu(setup, venv):
    """GRPO's actor update by VeRL's own code (FSDP2 engine, ``ppo_loss`` with the KL loss, GRPO
    advantages from fixed scores) on one fixed batch, float32: on "tpu" against the same on CPU.
    The log-probs before and after the update match to float32 rounding, and the update is a
    real step in the advantages' direction (it moves log-probs by ~0.1-0.7, 10^4x the
    tolerance); the batch is fixed, so nothing here depends on sampling. In both of GRPO's
    environments: VeRL with vLLM (``.venv-verl``) and with SGLang (``.venv-verl-sglang``, its
    own torch), the actor of test_grpo_rollout_on_{vllm,sglang}_tpu_weights_synced."""
    python = VERL_PY
    if venv == "sglang":
        _need_sglang_env()
        python = VERL_SGLANG_PY
    tpu = ppo_update(setup, f"ppo_tpu_{venv}", _env(), python=python)
    cpu = ppo_update(setup, f"ppo_cpu_{venv}", _cpu_env(), extra=CPU_ARGS, python=python)
    for k in ("actor/pg_loss", "grad_norm"):
        assert tpu["metrics"][k] == pytest.approx(cpu["metrics"][k], rel=1e-5), (tpu, cpu)
    # the actor is its own reference before the update
    assert tpu["metrics"]["kl_loss"] == cpu["metrics"]["kl_loss"] == 0.0
    for k in ("old", "new"):
        assert tpu[k] == pytest.approx(cpu[k], rel=1e-5, abs=1e-5), k
    delta = [b - a for a, b in zip(tpu["old"], tpu["new"], strict=True)]
    assert max(map(abs, delta)) > 0.1, delta
    # the advantage-weighted log-likelihood rises: responses scored above their group's mean
    # become likelier
    assert sum(a * d for a, d in zip(tpu["advantages"], delta, strict=True)) > 0, delta
    assert tpu["advantages"] == pytest.approx(cpu["advantages"], abs=1e-6)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
