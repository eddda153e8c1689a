"""MPT model, config and Composer wrapper against an explicit float64 reference."""

import dataclasses
import math
from pathlib import Path

import pytest
import torch
from config_checks import section_problems

from foundryx.config.components import options_parameter
from foundryx.errors import ConfigError, DataError
from foundryx.models.mpt.composer import ComposerMPTCausalLM
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.mpt.modeling import MPTBlock, MPTForCausalLM
from foundryx.models.mpt.options import MPTOptions

TINY = {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 16, "vocab_size": 40}
SEQ = 16



def param_count(cfg) -> int:
    """Parameters of the MPT described by ``cfg`` (MPTConfig fields), counted on the meta
    device without allocating memory; tied embeddings count once."""
    from foundryx.models.mpt.configuration import MPTConfig

    with torch.device("meta"):
        model = MPTForCausalLM(MPTConfig(**{**cfg, "init_device": "meta"}))
    return sum(p.numel() for p in model.parameters())

def build(dtype=torch.float64, **overrides):
    """A tiny MPT with every parameter (biases and norm weights too) randomised."""
    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(**{**TINY, **overrides})).to(dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def ids(batch=2, seq=SEQ, seed=1):
    return torch.randint(
        0, TINY["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed)
    )


# -- the reference: the MPT forward pass written out in float64 ------------------------------
def ref_norm(cfg, p, name, x):
    w, b = p[f"{name}.weight"], p.get(f"{name}.bias")
    if cfg.norm_type == "layernorm":
        mean = x.mean(-1, keepdim=True)
        y = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + cfg.norm_eps)
    else:
        y = x / torch.sqrt((x**2).mean(-1, keepdim=True) + cfg.norm_eps)
    return y * w + (b if b is not None else 0)


def ref_linear(p, name, x):
    b = p.get(f"{name}.bias")
    return x @ p[f"{name}.weight"].T + (b if b is not None else 0)


def ref_positions(input_ids, attention_mask, sequence_id):
    """Index within the document; else count of real tokens before; else the index."""
    seq = input_ids.shape[1]
    ids = sequence_id.tolist() if sequence_id is not None else None
    mask = attention_mask.tolist() if attention_mask is not None else None
    pos = []
    for b in range(input_ids.shape[0]):
        row = []
        for t in range(seq):
            if ids is not None:
                start = t
                while start > 0 and ids[b][start - 1] == ids[b][t]:
                    start -= 1
                row.append(t - start)
            elif mask is not None:
                row.append(max(sum(mask[b][: t + 1]) - 1, 0))
            else:
                row.append(t)
        pos.append(row)
    return torch.tensor(pos)


def ref_rope(x, pos, theta):
    """Rotate pairs (i, i + d/2) of each head by pos * theta^(-2i/d)."""
    d = x.shape[-1]
    i = torch.arange(d // 2, dtype=torch.float64)
    angle = pos[:, :, None, None].double() * theta ** (-2 * i / d)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1)


def ref_scores_bias(cfg, attention_mask, sequence_id, batch, seq):
    """(batch, n_heads, seq, seq) additive bias: -inf where masked, -slope*|i-j| for ALiBi."""
    a = cfg.attn_config
    window = a["sliding_window_size"]
    ids = sequence_id.tolist() if sequence_id is not None else None
    mask = attention_mask.tolist() if attention_mask is not None else None
    visible = [
        [
            [
                i == j
                or (
                    j < i
                    and (window < 0 or i - j <= window)
                    and (ids is None or ids[b][i] == ids[b][j])
                    and (mask is None or bool(mask[b][j]))
                )
                for j in range(seq)
            ]
            for i in range(seq)
        ]
        for b in range(batch)
    ]
    visible = torch.tensor(visible)[:, None]
    n = cfg.n_heads  # a power of 2 in these tests
    slopes = torch.tensor([2.0 ** (-a["alibi_bias_max"] * (h + 1) / n) for h in range(n)])
    distance = torch.arange(seq)[:, None] - torch.arange(seq)[None, :]
    alibi = -slopes[:, None, None] * distance if a["alibi"] else torch.zeros(n, seq, seq)
    return alibi.double().masked_fill(~visible, float("-inf"))


def ref_logits(model, input_ids, attention_mask=None, sequence_id=None):
    cfg, a = model.config, model.config.attn_config
    p = {k: v.double() for k, v in model.state_dict().items()}
    batch, seq = input_ids.shape
    d, n, hd = cfg.d_model, cfg.n_heads, cfg.d_model // cfg.n_heads
    kv = a["kv_n_heads"] or n
    pos = ref_positions(input_ids, attention_mask, sequence_id)
    x = p["transformer.wte.weight"][input_ids]
    if cfg.learned_pos_emb:
        x = x + p["transformer.wpe.weight"][pos]
    bias = ref_scores_bias(cfg, attention_mask, sequence_id, batch, seq)
    scale = a["softmax_scale"] or 1 / math.sqrt(hd)
    for layer in range(cfg.n_layers):
        pre = f"transformer.blocks.{layer}."
        h = ref_norm(cfg, p, pre + "norm_1", x)
        qkv = ref_linear(p, pre + "attn.Wqkv", h)
        q, k, v = qkv[..., :d], qkv[..., d : d + kv * hd], qkv[..., d + kv * hd :]
        if a["qk_ln"]:
            q, k = ref_norm(cfg, p, pre + "attn.q_ln", q), ref_norm(cfg, p, pre + "attn.k_ln", k)
        q = q.reshape(batch, seq, n, hd)
        k = k.reshape(batch, seq, kv, hd).repeat_interleave(n // kv, dim=2)
        v = v.reshape(batch, seq, kv, hd).repeat_interleave(n // kv, dim=2)
        if a["rope"]:
            q, k = ref_rope(q, pos, a["rope_theta"]), ref_rope(k, pos, a["rope_theta"])
        scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale + bias
        out = torch.einsum("bhij,bjhd->bihd", torch.softmax(scores, -1), v)
        x = x + ref_linear(p, pre + "attn.out_proj", out.reshape(batch, seq, d))
        h = ref_norm(cfg, p, pre + "norm_2", x)
        if cfg.ffn_config["ffn_type"] == "mlp":
            u = ref_linear(p, pre + "ffn.up_proj", h)
            h = 0.5 * u * (1 + torch.erf(u / math.sqrt(2)))
        else:
            g = ref_linear(p, pre + "ffn.gate_proj", h)
            h = g * torch.sigmoid(g) * ref_linear(p, pre + "ffn.up_proj", h)
        x = x + ref_linear(p, pre + "ffn.down_proj", h)
    x = ref_norm(cfg, p, "transformer.norm_f", x)
    head = p["transformer.wte.weight"] if cfg.tie_word_embeddings else p["lm_head.weight"]
    logits = x @ head.T
    if cfg.logit_scale == "inv_sqrt_d_model":
        logits = logits / math.sqrt(d)
    elif cfg.logit_scale is not None:
        logits = logits * cfg.logit_scale
    return logits


VARIANTS = {
    "base": {},
    "gqa2": {"attn_config": {"kv_n_heads": 2}},
    "mqa": {"attn_config": {"kv_n_heads": 1}},
    "rope": {"learned_pos_emb": False, "attn_config": {"rope": True, "rope_theta": 500.0}},
    "alibi": {"learned_pos_emb": False, "attn_config": {"alibi": True, "alibi_bias_max": 4}},
    "swiglu": {"ffn_config": {"ffn_type": "swiglu", "ffn_hidden_size": 48}},
    "rmsnorm": {"norm_type": "rmsnorm"},
    "qk_ln": {"attn_config": {"qk_ln": True, "softmax_scale": 0.3}},
    "untied": {"tie_word_embeddings": False, "logit_scale": 0.5},
    "no_bias": {"no_bias": True, "expansion_ratio": 2.5, "logit_scale": "inv_sqrt_d_model"},
    "window": {"attn_config": {"sliding_window_size": 3}},
    "mix": {
        "learned_pos_emb": False,
        "norm_type": "rmsnorm",
        "no_bias": True,
        "attn_config": {"rope": True, "kv_n_heads": 2, "qk_ln": True},
        "ffn_config": {"ffn_type": "swiglu"},
    },
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_reference(variant):
    model = build(**VARIANTS[variant])
    x = ids()
    torch.testing.assert_close(model(x).logits, ref_logits(model, x))


@pytest.mark.parametrize("variant", ["base", "rope", "alibi", "mix"])
def test_masked_logits_match_reference(variant):
    model = build(**VARIANTS[variant])
    x = ids()
    left_padded = torch.tensor([[0] * 3 + [1] * 13, [1] * 16])
    real = left_padded.bool()
    torch.testing.assert_close(
        model(x, attention_mask=left_padded).logits[real],
        ref_logits(model, x, attention_mask=left_padded)[real],
    )
    sequence_id = torch.tensor([[0] * 6 + [1] * 10, [0] * 4 + [1] * 4 + [2] * 8])
    torch.testing.assert_close(
        model(x, sequence_id=sequence_id).logits, ref_logits(model, x, sequence_id=sequence_id)
    )


@pytest.mark.parametrize("variant", ["base", "rope", "alibi"])
def test_packed_document_matches_document_alone(variant):
    """Attention stays within a document and positions restart there, so a packed document
    gives the logits it gives alone, for learned, rotary and ALiBi positions alike."""
    model = build(**VARIANTS[variant])
    x = ids(batch=1)
    sequence_id = torch.tensor([[0] * 6 + [1] * 10])
    packed = model(x, sequence_id=sequence_id).logits[:, 6:]
    alone = model(x[:, 6:]).logits
    torch.testing.assert_close(packed, alone)
    assert not torch.allclose(model(x).logits[:, 6:], alone)  # without it, doc 2 sees doc 1


@pytest.mark.parametrize("variant", ["base", "rope", "alibi"])
def test_left_padding_does_not_change_logits(variant):
    model = build(**VARIANTS[variant])
    x = ids(batch=1, seq=12)
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), x], dim=1)
    mask = torch.tensor([[0] * 4 + [1] * 12])
    torch.testing.assert_close(model(padded, attention_mask=mask).logits[:, 4:], model(x).logits)


def test_tied_and_untied_heads():
    tied, untied = build(), build(tie_word_embeddings=False)
    assert tied.lm_head is None and tied.get_output_embeddings() is None
    assert untied.lm_head.weight.data_ptr() != untied.transformer.wte.weight.data_ptr()
    n_tied = sum(p.numel() for p in tied.parameters())
    n_untied = sum(p.numel() for p in untied.parameters())
    assert n_untied - n_tied == TINY["vocab_size"] * TINY["d_model"]


def test_no_bias_has_no_bias_parameters():
    model = build(**VARIANTS["mix"])
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]


def test_loss_is_token_mean_cross_entropy_with_ignore_index():
    model = build(dtype=torch.float32)
    x = ids()
    labels = x.clone()
    labels[0, 5:9] = -100
    labels[1, -1] = -100
    out = model(x, labels=labels)
    logp = torch.log_softmax(out.logits.double(), -1)
    terms = [
        -logp[b, t, labels[b, t + 1]]
        for b in range(2)
        for t in range(SEQ - 1)
        if labels[b, t + 1] != -100
    ]
    torch.testing.assert_close(out.loss.double(), torch.stack(terms).mean(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", ["base", "mix", "untied"])
def test_gradients_reach_every_parameter(variant):
    model = build(dtype=torch.float32, **VARIANTS[variant]).train()
    x = ids()
    model(x, labels=x).loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
        assert p.grad.abs().sum() > 0, name


def test_blocks_are_a_module_list_of_mpt_blocks():
    model = build()
    assert isinstance(model.transformer.blocks, torch.nn.ModuleList)
    assert [type(b) for b in model.transformer.blocks] == [MPTBlock] * TINY["n_layers"]


def test_too_long_sequence_is_refused():
    with pytest.raises(ValueError, match="max_seq_len"):
        build()(ids(seq=SEQ + 1))


def test_greedy_generate_matches_argmax_loop():
    model = build(dtype=torch.float32)
    prompt = ids(seq=5)
    out = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=4,
        do_sample=False,
        pad_token_id=0,
    )
    want = prompt
    for _ in range(4):
        want = torch.cat([want, model(want).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, want)


def test_save_and_load_round_trip(tmp_path):
    model = build(dtype=torch.float32, **VARIANTS["mix"])
    model.save_pretrained(tmp_path)
    loaded = MPTForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.attn_config == model.config.attn_config
    x = ids()
    torch.testing.assert_close(loaded(x).logits, model(x).logits)


# -- meta device and weight init ------------------------------------------------------------
INIT_SIZES = {**TINY, "d_model": 64, "expansion_ratio": 4, "n_layers": 2}


@pytest.mark.parametrize("how", ["init_device", "context"])
def test_meta_construction_then_init_weights(how):
    init = {"name": "baseline_", "init_std": 0.02, "emb_init_std": 0.05}
    cfg = MPTConfig(
        **INIT_SIZES, init_config=init, **({"init_device": "meta"} if how == "init_device" else {})
    )
    if how == "context":
        with torch.device("meta"):
            model = MPTForCausalLM(cfg)
    else:
        model = MPTForCausalLM(cfg)
    assert all(p.is_meta for p in model.parameters())
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    model.init_weights()
    params = dict(model.named_parameters())
    assert all(torch.isfinite(p).all() for p in params.values())
    residual_std = 0.02 / math.sqrt(2 * INIT_SIZES["n_layers"])
    expected = {
        "transformer.wte.weight": 0.05,
        "transformer.wpe.weight": 0.05,
        "transformer.blocks.0.attn.Wqkv.weight": 0.02,
        "transformer.blocks.1.ffn.up_proj.weight": 0.02,
        "transformer.blocks.0.attn.out_proj.weight": residual_std,
        "transformer.blocks.1.ffn.down_proj.weight": residual_std,
    }
    for name, std in expected.items():
        assert params[name].mean().abs() < 0.1 * std, name
        assert params[name].std().item() == pytest.approx(std, rel=0.05), name
    for name, p in params.items():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif "norm" in name:
            assert torch.all(p == 1), name


def test_kaiming_init_uses_fan_in_per_fused_matrix():
    model = MPTForCausalLM(MPTConfig(**INIT_SIZES, attn_config={"kv_n_heads": 2}))
    d, hidden = INIT_SIZES["d_model"], 4 * INIT_SIZES["d_model"]
    block = model.transformer.blocks[0]
    q, k, v = block.attn.Wqkv.weight.split(block.attn.Wqkv._fused)
    for w in (q, k, v):
        assert w.std().item() == pytest.approx(math.sqrt(2 / d), rel=0.1)
    down = block.ffn.down_proj.weight
    want = math.sqrt(2 / hidden) / math.sqrt(2 * INIT_SIZES["n_layers"])
    assert down.std().item() == pytest.approx(want, rel=0.05)


# -- config -------------------------------------------------------------------------------
def test_sub_configs_merge_over_defaults():
    cfg = MPTConfig(**TINY, attn_config={"rope": True}, ffn_config={"ffn_type": "swiglu"})
    assert cfg.attn_config["rope"] and cfg.attn_config["attn_impl"] == "torch"
    assert cfg.attn_config["alibi_bias_max"] == 8
    assert cfg.ffn_hidden_size == 4 * TINY["d_model"] and cfg.kv_n_heads == TINY["n_heads"]
    assert cfg.attn.rope is True and cfg.init.name == "kaiming_normal_"  # typed views


def test_problems_are_all_reported_with_their_keys():
    problems = section_problems(
        "models", "mpt_causal_lm", {
            "d_model": 100,
            "n_heads": 8,
            "n_layers": 0,
            "vocab_sise": 10,
            "norm_type": "rms",
            "attn_config": {
                "kv_n_heads": 3,
                "alibi": True,
                "rope": True,
                "atn_pdrop": 0.1,
                "attn_impl": "flashy",
            },
            "ffn_config": {"ffn_type": "glu"},
            "init_config": {"name": "baseline_"},
        }
    )
    text = "\n".join(problems)
    for expected in [
        "vocab_sise: unknown option of the 'mpt_causal_lm' model (did you mean 'vocab_size'?)",
        "n_layers: expected an integer > 0, got 0",
        "d_model: 100 is not divisible by n_heads 8",
        "norm_type: unknown name 'rms' in registry 'norms' (did you mean 'rmsnorm'?)",
        "attn_config.kv_n_heads: 3 does not divide n_heads 8; use one of 1, 2, 4, 8",
        "attn_config.alibi and attn_config.rope are both true; choose one",
        "attn_config.atn_pdrop: unknown option of the 'mpt_causal_lm' model (did you mean "
        "'attn_pdrop'?)",
        "attn_config.attn_impl: unknown name 'flashy'",
        "ffn_config.ffn_type: unknown name 'glu'",
        "init_config.init_std: baseline_ needs init_std",
    ]:
        assert expected in text
    assert len(problems) == 10, text


def test_options_are_one_dataclass():
    """The registered model declares MPTOptions; MPTConfig holds exactly those fields but the
    run options (peft_config), with the same defaults, and refuses what the YAML validator
    refuses."""
    from foundryx.models.mpt.options import RUN_FIELDS

    assert options_parameter(ComposerMPTCausalLM) == ("options", MPTOptions)
    saved = MPTConfig().to_dict()
    assert not set(RUN_FIELDS) & set(saved)
    for f in dataclasses.fields(MPTOptions):
        if f.name in RUN_FIELDS:
            continue
        default = getattr(MPTOptions(), f.name)
        want = dataclasses.asdict(default) if dataclasses.is_dataclass(default) else default
        assert saved[f.name] == want or f.name == "learned_pos_emb", f.name
    with pytest.raises(ConfigError, match="attn_config.atn_pdrop: unknown option"):
        MPTConfig(attn_config={"atn_pdrop": 0.1})


def test_wrapper_refuses_bad_config():
    with pytest.raises(ConfigError) as err:
        ComposerMPTCausalLM(**{**TINY, "n_heads": 5}, attn_config={"rope": 1})
    assert len(err.value.problems) == 2, err.value.problems


def test_mpt_1b_param_count():
    """The model section of yamls/mpt-1b.yaml is the 1.3B recipe (counted on meta)."""
    import yaml

    root = Path(__file__).parents[1]
    section = yaml.safe_load((root / "yamls" / "mpt-1b.yaml").read_text())["model"]
    cfg = {k: v for k, v in section.items() if k != "name"}
    cfg["max_seq_len"] = 2048  # the yaml interpolates ${variables.max_seq_len}
    n = param_count(cfg)
    d = 2048
    per_block = 4 * d * d + 2 * 4 * d * d  # attention, MLP (no biases)
    per_block += 2 * d  # two LayerNorm weights
    assert n == 24 * per_block + d + 50368 * d  # + final norm, tied token table (ALiBi: no wpe)
    assert abs(n - 1.3e9) <= 0.05e9


# -- Composer wrapper ---------------------------------------------------------------------
def composer_model(**overrides):
    torch.manual_seed(0)
    return ComposerMPTCausalLM(**{**TINY, **overrides})


def test_composer_loss_defaults_labels_to_unpadded_inputs():
    model = composer_model()
    x = ids()
    mask = torch.ones_like(x)
    mask[1, 10:] = 0
    batch = {"input_ids": x, "attention_mask": mask}
    loss = model.loss(model(batch), batch)
    labels = x.masked_fill(mask == 0, -100)
    want = model.model(x, attention_mask=mask, labels=labels).loss
    torch.testing.assert_close(loss, want)


def test_composer_eval_metrics_use_shifted_labels():
    model = composer_model()
    x = ids()
    labels = x.clone()
    labels[0, :4] = -100
    batch = {"input_ids": x, "labels": labels}
    want = model.model(x, labels=labels).loss
    logits = model.eval_forward(batch)
    assert logits.shape == (2, SEQ, TINY["vocab_size"])
    metrics = model.get_metrics(is_train=False)
    assert set(metrics) == {"LanguageCrossEntropy", "LanguagePerplexity"}
    for metric in metrics.values():
        model.update_metric(batch, logits, metric)
    torch.testing.assert_close(metrics["LanguageCrossEntropy"].compute(), want)
    torch.testing.assert_close(metrics["LanguagePerplexity"].compute(), want.exp())
    assert set(model.get_metrics(is_train=True)) == {"LanguageCrossEntropy"}


def test_composer_sequence_id_is_read_only_when_configured():
    x = ids()
    sequence_id = torch.tensor([[0] * 6 + [1] * 10] * 2)
    batch = {"input_ids": x, "sequence_id": sequence_id}
    uses = composer_model(attn_config={"attn_uses_sequence_id": True}).eval()  # eval: logits
    torch.testing.assert_close(uses(batch).logits, uses.model(x, sequence_id=sequence_id).logits)
    with pytest.raises(DataError, match="sequence_id"):
        uses({"input_ids": x})
    ignores = composer_model().eval()
    torch.testing.assert_close(ignores(batch).logits, ignores.model(x).logits)


def test_flops_per_batch():
    model = composer_model(tie_word_embeddings=False)
    d, layers, vocab, b, s = TINY["d_model"], TINY["n_layers"], TINY["vocab_size"], 3, SEQ
    block = 4 * d * d + 4 * d + 2 * (4 * d * d) + 4 * d + d + 4 * d  # attn, mlp, 2 layernorms
    matmul_params = layers * block + 2 * d + vocab * d  # + final norm + lm_head
    want = 6 * matmul_params * b * s + 12 * layers * d * s * b * s
    assert model.flops_per_batch({"input_ids": torch.zeros(b, s, dtype=torch.long)}) == want


@pytest.mark.parametrize(
    ("attn_config", "learned_pos_emb", "has_wpe"),
    [({}, None, True), ({"rope": True}, None, False), ({"alibi": True}, None, False),
     ({"rope": True}, True, True)],
)
def test_learned_positions_default_off_with_rope_or_alibi(attn_config, learned_pos_emb, has_wpe):
    cfg = MPTConfig(**TINY, attn_config=attn_config, learned_pos_emb=learned_pos_emb)
    assert (MPTForCausalLM(cfg).transformer.wpe is not None) is has_wpe
