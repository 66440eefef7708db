"""TorchTitan's llama3 debug model trained for a few steps, on "tpu" or on CPU with gloo.

Usage: titan_train.py DEVICE OUT_JSON WORKDIR STEPS [torchtitan overrides...]
(one process: run directly; FSDP: under torchrun). DEVICE is "tpu" (TorchTitan picks the device
and the "tpu_dist" backend by itself) or "cpu" (the reference: TorchTitan has no CPU device
selection, so its device utilities are pointed at CPU and gloo before the trainer is imported).

Both runs get the same things: a tiny word-level tokenizer and a generated text dataset in
WORKDIR (no downloads), the same initial weights (TorchTitan's own init_weights run on CPU with a
fixed seed, copied into the trainer's model, sharded or not), and the same batches. Attention:
on "tpu" TorchTitan's compiled FlexAttention runs through torch.compile's default backend, which
sends tpu graphs to the tpu compiler (the flex_attention HOP lowering); on CPU, where
FlexAttention has no backward, the reference is PyTorch's eager FlexAttention (its math
implementation). Rank 0 writes {"loss": [...], "grad_norm": [...], ...} to OUT_JSON, with
``run_facts`` (experts per rank; on "tpu" the collectives called and any CPU fallbacks). With
pipeline parallelism the last rank (it holds the last stage, which computes the loss) writes it.
Other TorchTitan models are named by the overrides (``--module deepseek_v3 --config
deepseek_v3_debugmodel``: the MoE debug model).
"""
from __future__ import annotations

import json
import os
import sys

DEVICE, OUT, WORK, STEPS = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
EXTRA = sys.argv[5:]

for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
             ("MASTER_ADDR", "127.0.0.1")):
    os.environ.setdefault(k, v)
if "MASTER_PORT" not in os.environ:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(s.getsockname()[1])

if DEVICE == "cpu":
    # the reference is plain PyTorch: torchtpu not loaded (else c10d's barrier(device_ids=)
    # resolves the accelerator to "tpu", which gloo does not serve)
    os.environ["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"

import torch  # noqa: E402

WORDS = [f"w{i}" for i in range(400)]


def make_assets(work):
    """A word-level tokenizer (tokenizer.json + tokenizer_config.json) and a json dataset."""
    tok_dir, data_dir = os.path.join(work, "tokenizer"), os.path.join(work, "data")
    if os.path.exists(os.path.join(data_dir, "train.json")):
        return tok_dir, data_dir
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    specials = ["<|begin_of_text|>", "<|end_of_text|>", "<unk>"]
    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>",
                   "add_bos_token": True, "add_eos_token": True}, f)
    g = torch.Generator().manual_seed(0)
    with open(os.path.join(data_dir, "train.json.tmp"), "w") as f:
        for _ in range(64):
            n = int(torch.randint(20, 120, (1,), generator=g))
            ids = torch.randint(0, len(WORDS), (n,), generator=g).tolist()
            f.write(json.dumps({"text": " ".join(WORDS[i] for i in ids)}) + "\n")
    os.replace(os.path.join(data_dir, "train.json.tmp"), os.path.join(data_dir, "train.json"))
    return tok_dir, data_dir


if DEVICE == "cpu":
    import importlib.util

    # TorchTitan imports Triton for CUDA-only kernels; torchtpu's stand-in for that module
    # (loaded by path: importing the torchtpu package would register the device)
    here = os.path.dirname(importlib.util.find_spec("torchtpu").origin)
    spec = importlib.util.spec_from_file_location(
        "_titan_no_triton", os.path.join(here, "integrations", "torchtitan.py"))
    no_triton = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(no_triton)
    no_triton.install()
    # TorchTitan 0.3.0's pipeline schedules pass pre-split microbatches, which torch 2.13's
    # step() does not take: the same adaptation "tpu" gets from the integration
    no_triton.schedules_take_microbatches()
    import torchtitan.tools.utils as tt_utils

    import types

    # torch.cpu lacks the CUDA-style memory queries TorchTitan's metrics read: report none
    cpu_module = types.SimpleNamespace(
        **{k: getattr(torch.cpu, k) for k in dir(torch.cpu) if not k.startswith("_")})
    cpu_module.get_device_name = lambda *a: "cpu"
    cpu_module.current_device = lambda: 0
    cpu_module.get_device_properties = lambda *a: types.SimpleNamespace(
        total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    cpu_module.memory_stats = lambda *a: {}
    cpu_module.reset_peak_memory_stats = cpu_module.empty_cache = lambda *a: None
    tt_utils.device_type, tt_utils.device_module = "cpu", cpu_module
    import torch.nn.attention.flex_attention as fa
    from torchtitan.models.common import attention as tt_attn

    _orig_validate = fa._validate_device
    # the reference: PyTorch's eager FlexAttention (math) on CPU, backward included
    fa._validate_device = lambda q, k, v: None
    tt_attn.FlexAttention._compiled_flex_attn = staticmethod(fa.flex_attention)
    tt_attn._compiled_create_block_mask = fa.create_block_mask

import torch.distributed as dist  # noqa: E402

if not hasattr(dist, "set_timeout"):
    # TorchTitan 0.3.0 calls torch.distributed.set_timeout (newer than torch 2.13, which has the
    # same function private) after the first step, on CPU and "tpu" alike
    dist.set_timeout = dist.distributed_c10d._set_pg_timeout

from torchtitan.config import ConfigManager  # noqa: E402


def initial_state(trainer):
    """TorchTitan's init_weights on a CPU copy of the model, seeded: the same in every run."""
    torch.manual_seed(1234)
    with torch.device("cpu"):
        model = trainer.model_config.build()
    model.init_weights(buffer_device=None)
    # buffers too: the RoPE cache is a non-persistent buffer (absent from state_dict)
    return {k: v.detach().clone() for k, v in
            list(model.named_parameters()) + list(model.named_buffers())}


def load_initial(trainer, state):
    from torch.distributed.tensor import DTensor, distribute_tensor

    missing = []
    for model in trainer.model_parts:
        with torch.no_grad():
            for name, t in list(model.named_parameters()) + list(model.named_buffers()):
                key = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
                if key not in state:
                    missing.append(name)
                    continue
                full = state[key].to(t.dtype)
                if isinstance(t, DTensor):
                    src = distribute_tensor(full.to(t.device), t.device_mesh, t.placements)
                    t.to_local().copy_(src.to_local())
                else:
                    t.copy_(full.to(t.device))
    assert not missing, f"no initial value for {missing}"


def grad_norm64(trainer):
    """The norm of this step's gradients summed in float64 on the host: PyTorch CPU's
    float32 ``vector_norm`` of lm_head's gradient (2048x256) was off by 1.8e-4 relative here, so
    TorchTitan's reported norm is no float32-tolerance reference."""
    from torch.distributed.tensor import DTensor

    sq = torch.zeros((), dtype=torch.float64)
    for model in trainer.model_parts:
        for p in model.parameters():
            g = p.grad
            if g is not None:
                g = g.to_local() if isinstance(g, DTensor) else g
                sq += g.detach().cpu().double().square().sum()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sq)  # CPU float64 tensor: gloo, or tpu_dist's host path
    return float(sq.sqrt())


def run_facts(trainer):
    """What the run exercised: the routed experts each rank holds (expert parallelism shards
    them), and on "tpu" the collectives called and the ops that fell back to CPU."""
    from torch.distributed.tensor import DTensor

    facts = {}
    for model in trainer.model_parts:
        for name, p in model.named_parameters():
            if name.endswith("inner_experts.w1_EFD"):
                local = p.to_local() if isinstance(p, DTensor) else p
                facts["experts_total"] = int(p.shape[0])
                facts["experts_local"] = int(local.shape[0])
                break
    if DEVICE == "tpu":
        m = torch.tpu.metrics()
        facts["dist_calls"] = m["per_op"].get("dist_calls", {})
        facts["cpu_fallbacks"] = m["per_op"].get("cpu_fallbacks", {})
        facts["compile_cpu_fallbacks"] = m["per_op"].get("compile_cpu_fallbacks", {})
        facts["compile_graphs"] = m["counters"].get("compile_graphs", 0)
    return facts


def main():
    tok_dir, data_dir = make_assets(WORK)
    # the model: llama3's debug model unless the overrides name another (--module, --config)
    model = [] if "--module" in EXTRA else ["--module", "llama3", "--config", "llama3_debugmodel"]
    args = [*model,
            "--hf_assets_path", tok_dir, "--dataloader.dataset_path", data_dir,
            "--training.steps", str(STEPS), "--training.seq_len", "64",
            "--training.local_batch_size", "2", "--metrics.log_freq", "1",
            "--dump_folder", os.path.join(WORK, f"dump_{DEVICE}"),
            "--validator.freq", "1000", "--checkpoint.interval", "1000",
            # float32 training: TorchTitan autocasts a single device to bf16, and CPU autocast
            # and "tpu" (CUDA's op lists) differ, so only float32 runs can match at float32 tolerance
            "--training.mixed_precision_param", "float32",
            # no clipping: CPU's float32 grad norm (off by 1.8e-4 here, see grad_norm64) would
            # scale the reference's gradients differently; the norm is still computed and logged
            "--training.max_norm", "1e9", *EXTRA]
    config = ConfigManager().parse_args(args)
    trainer = config.build()
    if DEVICE == "cpu":
        # TorchTitan sets FSDP's gradient divide factor to 1.0, which FSDP2 turns into
        # ReduceOp.PREMUL_SUM(1.0), and gloo has no PREMUL_SUM: a plain SUM (pre/post divide by
        # 1.0) is the same arithmetic
        from torch.distributed.fsdp import FSDPModule

        for model in trainer.model_parts:
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.set_force_sum_reduction_for_comms(True)
    load_initial(trainer, initial_state(trainer))
    rec = {"loss": [], "grad_norm": [], "grad_norm64": [], "device": str(trainer.device)}
    orig_log = trainer.metrics_processor.log

    def log(step, loss, max_loss, grad_norm, *a, **k):
        rec["loss"].append(float(loss))
        rec["grad_norm"].append(float(grad_norm))
        rec["grad_norm64"].append(grad_norm64(trainer))
        return orig_log(step, loss, max_loss, grad_norm, *a, **k)

    trainer.metrics_processor.log = log
    trainer.train()
    rec.update(run_facts(trainer))
    trainer.close()
    # the logged loss lives on the last pipeline stage (the first stage logs -1): with pipeline
    # parallelism the last rank writes (TorchTitan's mesh puts "pp" outermost)
    writer = int(os.environ["WORLD_SIZE"]) - 1 if trainer.parallel_dims.pp_enabled else 0
    if int(os.environ["RANK"]) == writer:
        with open(OUT, "w") as f:
            json.dump(rec, f)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    print("ALL OK", json.dumps(rec))


if __name__ == "__main__":
    main()
