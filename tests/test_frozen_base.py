"""``model.frozen_base``: the frozen linear weights of a LoRA run stored as NF4, FP8, int8 or
bf16 and dequantized per layer; FSDP2 shards and all-gathers the low-precision bytes;
``offload_fraction`` keeps a share of them in host memory with the same losses; bad input is
one message with its YAML path and exit code 2."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from config_checks import section_problems
from distributed import run_distributed
from hf_tiny import LLAMA_STYLE, MPT_TINY, token_batch, train_steps

from foundryx.builders import apply_frozen_storage
from foundryx.models.peft import frozen_options
from foundryx.models.peft.frozen_base import LowPrecisionLinear, stored_bytes
from foundryx.models.peft.frozen_options import FrozenBaseOptions
from foundryx.models.peft.lora import apply_lora
from foundryx.models.peft.options import LoraOptions
from foundryx.models.peft.rowwise import RowScaledTensor

DTYPES = ["bf16", "int8", "fp8", "nf4"]
# d_model 64: every frozen weight splits into whole NF4 blocks on 2 ranks
SIZES = {**MPT_TINY, "d_model": 64, **LLAMA_STYLE}
LORA = LoraOptions(target_modules=["Wqkv", "out_proj", "up_proj"], r=4, lora_alpha=8)


pytestmark = pytest.mark.usefixtures("one_thread")


def lora_model(dtype: str | None, offload: float = 0.0, seed: int = 0, **sizes):
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    torch.manual_seed(seed)
    model = ComposerMPTCausalLM(**{**SIZES, **sizes})
    apply_lora(model, LORA)
    if dtype is not None:
        apply_frozen_storage(model, FrozenBaseOptions(dtype=dtype, offload_fraction=offload))
    return model


def adapters_opt(model, lr: float = 1e-2) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)


# -- storage ----------------------------------------------------------------------------

def test_storage_bytes_error_and_no_nan_from_zero_rows():
    torch.manual_seed(0)
    w = torch.randn(64, 256) * 0.02
    w[3] = 0.0  # an all-zero row: its scale must not be 0 (0/0 = NaN)
    w[5] = 1e-30  # a row that underflows FP8
    bf16 = w.numel() * 2
    layer = torch.nn.Linear(256, 64, bias=False)
    with torch.no_grad():
        layer.weight.copy_(w)
    errors = {}
    for dtype, max_ratio in (("bf16", 1.01), ("int8", 0.51), ("fp8", 0.51), ("nf4", 0.27)):
        q = LowPrecisionLinear(layer, dtype, "w")
        assert stored_bytes(q.weight) <= max_ratio * bf16, dtype
        dense = q.dense_weight(torch.float32, torch.device("cpu"))
        assert torch.isfinite(dense).all(), dtype
        assert torch.equal(dense[3], torch.zeros(256)), dtype
        errors[dtype] = ((dense - w).norm() / w.norm()).item()
    assert errors["bf16"] < 0.005 and errors["int8"] < 0.01, errors
    assert errors["fp8"] < 0.05 and errors["nf4"] < 0.12, errors
    rs = RowScaledTensor.from_weight(w, "fp8")
    assert rs.qdata.dtype == torch.float8_e4m3fn and rs.scale.shape == (64,)
    with pytest.raises(NotImplementedError, match="dequantize"):
        rs @ torch.ones(256)  # never silently a dense matmul


def peak_allocated(fn) -> int:
    """Peak bytes held by the tensors ``fn`` allocates (CPU allocator events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
        del out
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak


@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantizing_a_layer_allocates_one_dense_copy(dtype):
    """A frozen layer's transient is its dense weight, not several: the out-of-place
    ``qdata.float() * scale`` held two float32 copies, torchao's NF4 decoding about five."""
    from foundryx.models.peft.frozen_base import dequantize
    from foundryx.models.peft.parts import STORAGE_ROWS
    from foundryx.parallel.offload import offload_layers

    torch.manual_seed(0)
    layer = torch.nn.Linear(1024, 4096, bias=False)  # an FFN weight of the benchmark's size
    q = LowPrecisionLinear(layer, dtype, "w")
    dense = 4096 * 1024 * 4  # NF4 decodes in chunks of 4096 blocks: 2 MB over this
    assert peak_allocated(lambda: dequantize(q.weight, torch.float32)) <= 1.15 * dense
    if dtype == "nf4":  # the same values as torchao's own decoding, bit for bit, in the CPU's
        # chunks and in a GPU's (the whole layer in one chunk: 4M weights)
        from foundryx.models.peft import frozen_base

        for chunk in (None, frozen_base.NF4_CHUNK_BLOCKS["gpu"]):  # the layer's option
            q.nf4_chunk = chunk
            for out in (torch.float32, torch.bfloat16):
                assert torch.equal(q.dense_weight(out, torch.device("cpu")),
                                   q.weight.get_original_weight().to(out))
        q.nf4_chunk = None
    # offloaded, the layer copies its low-precision bytes, not more: torchao's NF4 clone()
    # dequantizes and quantizes again (about 10x the dense weight, and slow)
    want = dequantize(q.weight, torch.float32)
    offload_layers([q], 1.0, STORAGE_ROWS, "cpu")
    cpu = torch.device("cpu")
    copy = stored_bytes(q.offload.host)  # the layer's low-precision bytes, copied
    assert peak_allocated(lambda: q.dense_weight(torch.float32, cpu)) <= 1.15 * dense + copy
    assert torch.equal(q.dense_weight(torch.float32, cpu), want)


def test_fused_loss_keeps_no_gradient_for_a_frozen_output_projection():
    """Under LoRA the tied embedding (the output projection) is frozen: the fused loss must
    not compute and hold its vocab x d_model gradient (it did: 2 x 32 MB per step in
    benchmarks/finetune_memory.py)."""
    from foundryx.models.layers.loss import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    h = torch.randn(2, 9, 16, generator=g, requires_grad=True)
    w = torch.randn(300, 16, generator=g)
    y = torch.randint(0, 300, (2, 9), generator=g)
    loss = linear_cross_entropy(h, w, y, None, chunk=4)
    assert loss.grad_fn.saved_tensors[1] is None
    (grad_h,) = torch.autograd.grad(loss, h)
    w.requires_grad_(True)
    want = torch.autograd.grad(linear_cross_entropy(h, w, y, None, chunk=4), h)[0]
    assert torch.equal(grad_h, want)
    model = lora_model("int8")  # and a LoRA model's training step does the same
    model.train()
    batch = token_batch(2, 16)
    loss = model.loss(model(batch), batch)
    node = loss.grad_fn
    while node is not None and "LinearCrossEntropy" not in type(node).__name__:
        node = node.next_functions[0][0] if node.next_functions else None
    assert node is not None and node.saved_tensors[1] is None


# -- config -----------------------------------------------------------------------------

@pytest.mark.parametrize(("frozen", "peft", "needle"), [
    ({"dtype": "int8", "offload_fraction": 1.5}, True,
     "frozen_base.offload_fraction: expected a number >= 0 and <= 1, got 1.5"),
    ({"dtype": "int4"}, True, "frozen_base.dtype: expected one of 'nf4', 'fp8', 'int8', 'bf16'"),
    ({"dtype": "nf4"}, False, "frozen_base: applies to the frozen linear weights of a LoRA run"),
    ({"offload_fraction": 0.5}, True, "frozen_base.dtype"),
    ({"dtype": "nf4", "fp8_gemm": "cast"}, True,
     "frozen_base.fp8_gemm: cast applies to dtype: fp8 (this base is nf4); remove it"),
    ({"dtype": "fp8", "fp8_rows": "fast"}, True,
     "frozen_base.fp8_rows: expected one of 'auto', 'torch', 'kernel'"),
], ids=["offload-range", "dtype", "no-lora", "no-dtype", "fp8-gemm-not-fp8", "fp8-rows"])
def test_bad_frozen_base_sections(frozen, peft, needle):
    section = {**SIZES, "frozen_base": frozen}
    if peft:
        section["peft_config"] = {"target_modules": ["Wqkv"]}
    found = section_problems("models", "mpt_causal_lm", section)
    assert any(needle in p for p in found), found


def test_fp8_without_a_float8_dtype_offers_int8(monkeypatch):
    monkeypatch.setattr(frozen_options.torch, "float8_e4m3fn", None, raising=False)
    found = section_problems("models", "mpt_causal_lm", {
        **SIZES, "peft_config": {"target_modules": ["Wqkv"]}, "frozen_base": {"dtype": "fp8"}})
    assert any("frozen_base.dtype: fp8 needs torch.float8_e4m3fn, which torch" in p
               and "use dtype: int8" in p for p in found), found


@pytest.mark.parametrize(("override", "needle"), [
    ("model.frozen_base={dtype: int8, offload_fraction: -0.5}",
     "model.frozen_base.offload_fraction: expected a number >= 0 and <= 1, got -0.5"),
    ("model.frozen_base={dtype: nf4}",
     "model.frozen_base: applies to the frozen linear weights of a LoRA run"),
], ids=["offload-range", "no-lora"])
def test_cli_bad_frozen_base_is_one_message_exit_2(quickstart_data, tmp_path, capsys,
                                                   override, needle):
    from foundryx.cli import main

    run = tmp_path / "run"
    code = main(["train", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
                 f"save_folder={run}/ckpt", "max_duration=2ba", override])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "Traceback" not in err and err.count("foundryx: error:") == 1, err
    assert needle in err, err
    assert not run.exists()


# -- one process: training, offload, DCP ------------------------------------------------

def test_offload_gives_the_same_losses_and_moves_weights_in_and_out(tmp_path):
    import torch.distributed.checkpoint as dcp

    runs = {}
    for offload in (0.0, 0.5, 1.0):
        model = lora_model("int8", offload)
        layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
        names = {n for n, _ in model.named_parameters()}
        runs[offload] = train_steps(model, 6, opt=adapters_opt(model))
        off = [m for m in layers if m.offload is not None]
        assert len(off) == round(offload * len(layers)), offload
        for m in off:  # out of the parameters and state dict; copied in for every use
            assert m.weight is None and m.offload.copies >= 6
        held = [n for n, m in model.named_modules() if m in off]
        assert not any(f"{n}.weight" in names for n in held)
    assert runs[0.5] == runs[0.0] and runs[1.0] == runs[0.0], runs
    assert runs[0.0][-1] < 0.7 * runs[0.0][0]

    # A model with an int8 base saves and loads what a LoRA checkpoint holds: the adapters.
    adapters = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    dcp.save(adapters, checkpoint_id=tmp_path / "ckpt")
    fresh = lora_model("int8", 1.0)
    state = {k: torch.zeros_like(v) for k, v in adapters.items()}
    dcp.load(state, checkpoint_id=tmp_path / "ckpt")
    fresh.load_state_dict(state, strict=False)
    batch = token_batch()
    with torch.no_grad():
        assert torch.equal(model(batch).logits, fresh(batch).logits)


# -- FSDP2 on 2 gloo processes ----------------------------------------------------------

@contextlib.contextmanager
def all_gather_bytes():
    """Count the bytes every all-gather of this process receives (FSDP2's unshards)."""
    import torch.distributed as dist

    seen = [0]
    patched = {}
    for name in ("all_gather_into_tensor", "all_gather_single"):
        original = getattr(dist, name, None)
        if original is None:
            continue

        def counting(*args, _original=original, **kwargs):
            output = kwargs["output_tensor"] if "output_tensor" in kwargs else args[0]
            seen[0] += output.numel() * output.element_size()
            return _original(*args, **kwargs)

        patched[name] = original
        setattr(dist, name, counting)
    try:
        yield seen
    finally:
        for name, original in patched.items():
            setattr(dist, name, original)


def _frozen_bases_under_fsdp2() -> dict:
    from torch.distributed.tensor import DTensor

    from foundryx.config.schema import ParallelismConfig
    from foundryx.parallel import parallelize

    out = {}
    for dtype in DTYPES:
        for offload in (0.0, 0.5) if dtype == "int8" else (0.0,):
            model = lora_model(dtype, offload)
            # fp32: FSDP2 gathers the adapters, norms and embedding in fp32 and the bases
            # in their own bytes (a plain bf16 weight would be upcast to fp32 first)
            parallelize(model, ParallelismConfig(), device=torch.device("cpu"))
            opt = adapters_opt(model)  # after sharding, as foundryx builds it
            params = dict(model.named_parameters())
            assert {id(p) for g in opt.param_groups for p in g["params"]} == \
                   {id(p) for p in params.values() if p.requires_grad}
            assert all(isinstance(p, DTensor) for p in params.values())
            base = {n: p for n, p in params.items() if n.endswith("base_layer.weight")}
            local = {n: type(p._local_tensor).__name__ for n, p in base.items()}
            with all_gather_bytes() as seen:
                losses = train_steps(model, 1, opt=opt)
            losses += train_steps(model, 5, opt=opt)
            out[(dtype, offload)] = {
                "local_types": sorted(set(local.values())), "n_base": len(base),
                "base_bytes": sum(stored_bytes(p) for p in base.values()),
                "gathered": seen[0], "losses": losses}
    return out


@pytest.mark.slow
def test_frozen_bases_shard_and_gather_low_precision_bytes_on_two_processes():
    results = run_distributed(_frozen_bases_under_fsdp2, timeout=600)
    r = results[0]
    assert results[0] == results[1]  # every number, both ranks
    # a bf16 base beside fp32 adapters in one unit (torch 2.7's FSDP2 dtype check) trains
    for d in ("bf16", "int8", "fp8"):
        assert r[(d, 0.0)]["local_types"] == ["RowScaledTensor"], r[(d, 0.0)]
    assert r[("nf4", 0.0)]["local_types"] == ["NF4Tensor"]
    bf16 = r[("bf16", 0.0)]
    ratios = {d: r[(d, 0.0)]["base_bytes"] / bf16["base_bytes"] for d in DTYPES}
    assert ratios["int8"] < 0.52 and ratios["fp8"] < 0.52 and ratios["nf4"] < 0.3, ratios
    # the all-gather moves the low-precision bytes (plus the bf16 adapters, norms, embedding)
    for d in ("int8", "fp8", "nf4"):
        assert r[(d, 0.0)]["gathered"] < bf16["gathered"], (d, r[(d, 0.0)], bf16)
    saved = bf16["gathered"] - r[("int8", 0.0)]["gathered"]
    assert saved >= 0.9 * 0.5 * 2 * 2 * bf16["base_bytes"]  # forward + backward, 2 ranks' shards
    for (d, off), v in r.items():
        assert v["losses"][-1] < 0.8 * v["losses"][0], (d, off, v["losses"])
    # offloaded layers are out of FSDP2 and give the same losses
    assert r[("int8", 0.5)]["n_base"] < r[("int8", 0.0)]["n_base"]
    assert r[("int8", 0.5)]["losses"] == r[("int8", 0.0)]["losses"]


# -- 300 steps on Tiny Shakespeare --------------------------------------------------------

def _shakespeare_losses(text: bytes, dtype: str, steps: int = 300) -> list[float]:
    model = lora_model(dtype, vocab_size=256, max_seq_len=64)
    opt = adapters_opt(model, lr=3e-3)
    data = torch.frombuffer(bytearray(text), dtype=torch.uint8).long()
    gen = torch.Generator().manual_seed(0)
    losses = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (8,), generator=gen)
        ids = torch.stack([data[s:s + 64] for s in starts])
        batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.mark.slow
@pytest.mark.modern_leg  # the legs' balance (tests/conftest.py)
def test_low_precision_bases_train_as_well_as_bf16_on_tinyshakespeare(shared_dir: Path):
    text = (shared_dir / "corpus" / "tinyshakespeare.txt").read_bytes()
    final = {}
    for dtype in DTYPES:
        losses = _shakespeare_losses(text, dtype)
        final[dtype] = sum(losses[-20:]) / 20  # the mean of the last 20 steps
        assert final[dtype] < 0.75 * losses[0], (dtype, losses[0], final[dtype])
    for dtype in ("int8", "fp8", "nf4"):
        assert abs(final[dtype] - final["bf16"]) <= 0.03 * final["bf16"], final


def test_a_checkpoint_holding_a_quantized_base_is_refused_up_front(quickstart_data):
    """LoRA on a frozen_base with no pretrained weights and no load_path would save the
    quantized base (pickled by DCP, which no load reads back): refused before the run, with
    the ways out; with a load_path (adapter-only checkpoints) or no save_folder it runs."""
    from foundryx.builders import frozen_base_checkpoint_problems
    from foundryx.errors import ConfigError
    from foundryx.train import load_run_config

    lora = ["model.peft_config.peft_type=LORA", "model.peft_config.r=4",
            "model.peft_config.target_modules=[o]", "model.frozen_base.dtype=int8"]
    with pytest.raises(ConfigError) as e:
        load_run_config("yamls/quickstart.yaml", [f"variables.data_root={quickstart_data}",
                                                  "save_folder=runs/x", *lora])
    assert "model.frozen_base: LoRA on a base with no pretrained weights" in str(e.value)
    assert "load_path" in str(e.value)
    model = {"peft_config": {"r": 4}, "frozen_base": {"dtype": "int8"}}
    assert frozen_base_checkpoint_problems({"model": model}) == []
    assert frozen_base_checkpoint_problems({"model": model, "save_folder": "s", "load_path": "b"}) == []
    hf = {**model, "pretrained_model_name_or_path": "some/folder"}
    assert frozen_base_checkpoint_problems({"model": hf, "save_folder": "s"}) == []
    assert len(frozen_base_checkpoint_problems({"model": {**hf, "pretrained": False},
                                                "save_folder": "s"})) == 1


def test_offloaded_weights_move_into_one_buffer_a_layer_at_a_time():
    """Packing the offloaded shards into the host buffer drops each layer's first copy before
    the next layer is copied (so the offloaded bytes are never held twice), and the weights the
    layers then read from the buffer are the ones they had."""
    import weakref

    from foundryx.parallel.offload_pack import inner_tensors, pack_offloaded

    model = lora_model("int8", offload=1.0)
    layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear) and m.offload is not None]
    want = [m.offload.host.dequantize(torch.float32).clone() for m in layers]
    for m in layers:  # separate tensors again, as the shard-on-read loader leaves them
        names, meta = inner_tensors(m.offload.host)
        m.offload.host = type(m.offload.host).__tensor_unflatten__(
            {n: getattr(m.offload.host, n).clone() for n in names}, meta, m.offload.host.shape,
            m.offload.host.stride())
    old = [weakref.ref(m.offload.host.qdata) for m in layers]
    alive = []
    pack_offloaded(layers, "cpu", release=lambda: alive.append(sum(r() is not None for r in old)))
    assert alive == list(range(len(layers) - 1, -1, -1)), alive  # one fewer after each layer
    buffer = layers[0].offload.buffer
    assert all(m.offload.buffer is buffer for m in layers)
    for m, w in zip(layers, want):
        assert m.offload.host.qdata.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
        assert torch.equal(m.offload.host.dequantize(torch.float32), w)


def test_a_checkpointed_recompute_leaves_no_copy_waiting_after_backward():
    """Under activation checkpointing backward runs each block's forward again; the prefetch
    of the next offloaded layer from inside that recompute would copy a later block's weight
    (its backward already run), which then waits until the next step (issue 46). After
    backward no offloaded layer holds a copy, at most three copies are ever alive at once
    (the estimate once saw a copy made in backward held to its end by the callback that drops
    it), and the losses equal the run without offload."""
    import weakref

    from foundryx.config.schema import ActivationCheckpointingConfig
    from foundryx.parallel import parallelize

    losses, alive, most = {}, [], [0]

    def counted(copy):
        def make(device):
            w, event = copy(device)
            alive.append(weakref.ref(w.qdata))
            most[0] = max(most[0], sum(r() is not None for r in alive))
            return w, event
        return make

    for offload in (0.0, 1.0):
        model = lora_model("int8", offload, n_layers=3)
        parallelize(model, activation_checkpointing=ActivationCheckpointingConfig(enabled=True))
        off = [m.offload for m in model.modules()
               if isinstance(m, LowPrecisionLinear) and m.offload is not None]
        for o in off:
            o._copy = counted(o._copy)
        opt = adapters_opt(model)
        losses[offload] = []
        for _ in range(2):
            opt.zero_grad()
            loss = model.loss(model(token_batch()), token_batch())
            loss.backward()
            waiting = [o.name for o in off if o.pending is not None]
            assert waiting == [], f"copies left waiting: {waiting}"
            opt.step()
            losses[offload].append(loss.item())
        assert len(off) == (15 if offload else 0)
    assert losses[1.0] == losses[0.0]
    # the layer running, the one prefetched (and the copy being made): never all 15 at once
    assert 2 <= most[0] <= 3, most[0]
