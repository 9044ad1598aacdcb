"""Our Llama against transformers on tiny random checkpoints, the KV cache against full forward passes,
and strict loading."""

import copy
import json
import os
import re
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from model import MLP, KVCache, LlamaConfig, RMSNorm, RoPE, load_model, sliding_window

transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=101, max_position_embeddings=512)
LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 64}

CASES = {
    "llama-gqa": ("LlamaConfig", "LlamaForCausalLM", dict(TINY, rope_theta=5000.0)),
    "llama-mha-tied": ("LlamaConfig", "LlamaForCausalLM", dict(TINY, num_key_value_heads=4, tie_word_embeddings=True)),
    "llama3-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", dict(TINY, rope_theta=500000.0,
                                                                    rope_scaling=LLAMA3_SCALING)),
    "linear-rope-scaling": ("LlamaConfig", "LlamaForCausalLM", dict(TINY, rope_scaling={"rope_type": "linear",
                                                                                        "factor": 4.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(TINY, sliding_window=None, head_dim=24)),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(TINY, num_key_value_heads=1, rope_theta=1e6)),
}


CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config"}


def save_tiny(case: str, path, seed: int = 0, **save):
    """A random transformers model saved as a Hugging Face folder (`save`: save_pretrained's keywords); returns the
    transformers model."""
    cfg_name, model_name, kwargs = CASES[case]
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**copy.deepcopy(kwargs))  # transformers edits rope_scaling in place
    hf = getattr(transformers, model_name)(cfg).eval()
    with torch.no_grad():  # random norms and biases too, so a missed weight shows
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    hf.save_pretrained(path, **save)
    return hf


@pytest.fixture(scope="module", params=list(CASES))
def tiny_pair(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny(request.param, path)
    return hf, load_model(str(path)), path


def test_logits_match_transformers(tiny_pair):
    hf, ours, _ = tiny_pair
    ids = torch.randint(0, 101, (2, 300), generator=torch.Generator().manual_seed(1))  # past 64 for llama3 scaling
    with torch.no_grad():
        ref = hf(ids).logits
        got = ours(ids, last_only=False)
    assert (got - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("prompt_len", [1, 7, 63, 64, 65, 130])
def test_cached_decoding_equals_full_forward(tiny_pair, prompt_len):
    _, ours, _ = tiny_pair
    ids = torch.randint(0, 101, (1, prompt_len + 9), generator=torch.Generator().manual_seed(prompt_len))
    full = ours(ids, last_only=False)[0]  # (T, V)
    cache = ours.new_cache(ids.shape[1])
    steps = [ours.prefill(ids[:, :prompt_len], cache, chunk=17)[0]]
    for t in range(prompt_len, ids.shape[1]):
        steps.append(ours.decode_step(ids[:, t], cache)[0])
    got = torch.stack(steps[:-1])
    assert (got - full[prompt_len - 1:-1]).abs().max().item() < 1e-4


def test_half_precision_runs_close(tmp_path):
    save_tiny("llama-gqa", tmp_path)
    ref = load_model(str(tmp_path))
    ids = torch.randint(0, 101, (1, 40), generator=torch.Generator().manual_seed(0))
    for dtype in (torch.bfloat16, torch.float16):
        low = load_model(str(tmp_path), dtype=dtype)
        assert low.lm_head.weight.dtype == dtype
        logits = low(ids, last_only=False)
        assert logits.dtype == torch.float32  # as the docstring says: sampling and the criterion read fp32
        assert (logits - ref(ids, last_only=False)).abs().max().item() < 0.1


def test_rms_norm_in_half_precision_is_transformers_bit_for_bit():
    # the mean square and the scaling in fp32, rounded once to the input's dtype, as transformers' LlamaRMSNorm: in
    # bf16 throughout, the scale is rounded to 8 bits and outputs move by an ulp (fp32 tests cannot see it)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 256, generator=g) * torch.logspace(-3, 1, 64)[:, None]).bfloat16()
    weight = 1 + 0.1 * torch.randn(256, generator=g)
    theirs = transformers.models.llama.modeling_llama.LlamaRMSNorm(256, eps=1e-6).bfloat16()
    ours = RMSNorm(256, 1e-6).bfloat16()
    with torch.no_grad():
        ours.weight.copy_(weight), theirs.weight.copy_(weight)
        assert torch.equal(ours(x), theirs(x))


@pytest.mark.skipif(not shutil.which(os.environ.get("CXX", "g++")), reason="torch.compile on the CPU needs a C++ "
                    "compiler")
def test_compiled_pointwise_decodes_as_the_eager_modules(tmp_path):
    """Llama.compile_pointwise after prefill, as generate.py --compile on calls it: every norm, RoPE and MLP is
    compiled, all layers' instances share one graph per module kind and shape (decoding compiles four: the layers'
    norms, the final norm, RoPE, the MLP; nine instances), and decode steps give the eager modules' logits to fp32
    rounding."""
    from torch._dynamo.utils import counters
    save_tiny("qwen2-bias", tmp_path)
    models = [load_model(str(tmp_path)), load_model(str(tmp_path))]
    ids = torch.randint(0, 101, (3, 30), generator=torch.Generator().manual_seed(2))
    caches = [m.new_cache(40, 3) for m in models]
    logits = [m.prefill(ids, c) for m, c in zip(models, caches)]
    eager, compiled = models
    torch._dynamo.reset()  # no graph left from another test: this decode compiles its own
    compiled.compile_pointwise()
    pointwise = [m for m in compiled.modules() if isinstance(m, (RMSNorm, RoPE, MLP))]
    assert len(pointwise) == 9 and all(m._compiled_call_impl is not None for m in pointwise)
    graphs = counters["stats"]["unique_graphs"]
    tokens = [lg.argmax(-1) for lg in logits]
    for _ in range(4):
        logits = [m.decode_step(t, c) for m, t, c in zip(models, tokens, caches)]
        assert (logits[0] - logits[1]).abs().max().item() < 1e-5
        tokens = [logits[0].argmax(-1)] * 2
    assert counters["stats"]["unique_graphs"] - graphs == 4


def test_rope_theta_override_changes_logits(tmp_path):
    save_tiny("llama-gqa", tmp_path)
    ids = torch.randint(0, 101, (1, 50), generator=torch.Generator().manual_seed(0))
    base = load_model(str(tmp_path))
    assert base.cfg.rope_theta == 5000.0
    other = load_model(str(tmp_path), rope_theta=2e6)
    assert other.cfg.rope_theta == 2e6
    assert (base(ids) - other(ids)).abs().max().item() > 1e-3


# --- strict loading and clear errors ---------------------------------------------------------------------


def edit_weights(path, edit):
    state = load_file(path / "model.safetensors")
    edit(state)
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    save_tiny("llama-gqa", tmp_path)
    edit_weights(tmp_path, lambda s: s.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight"):
        load_model(str(tmp_path))


def test_unexpected_tensor_is_named(tmp_path):
    save_tiny("llama-gqa", tmp_path)
    edit_weights(tmp_path, lambda s: s.update({"model.layers.9.extra.weight": torch.zeros(3)}))
    with pytest.raises(ValueError, match="model.layers.9.extra.weight"):
        load_model(str(tmp_path))


def test_misshaped_tensor_is_named(tmp_path):
    save_tiny("llama-gqa", tmp_path)
    edit_weights(tmp_path, lambda s: s.update({"model.norm.weight": torch.zeros(63)}))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_model(str(tmp_path))


def test_truncated_safetensors(tmp_path):
    save_tiny("llama-gqa", tmp_path)
    f = tmp_path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(ValueError, match="corrupt or truncated"):
        load_model(str(tmp_path))


def test_sharded_checkpoint(tmp_path):
    """A checkpoint in shards with their index, as transformers writes one (here in shards of 100 kB)."""
    hf = save_tiny("qwen2-bias", tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file() and len(list(tmp_path.glob("*.safetensors"))) > 2
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (load_model(str(tmp_path))(ids) - hf(ids).logits[:, -1]).abs().max() < 1e-4


NOT_AN_OBJECT = [("{bad", "not JSON"), (b"\xff\xfe{", "not UTF-8 text"), ("[]", "a JSON list, not an object")]
NO_WEIGHT_MAP = [("{}", "has no weight_map"), ('{"weight_map": ["model.safetensors"]}', "has no weight_map"),
                 ('{"weight_map": {"lm_head.weight": 3}}', "has no weight_map")]


@pytest.mark.parametrize("file,text,says",
                         [(f, text, f"is not {what}: {says}") for f, what in (("config.json", "a model config"),
                                                                             ("model.safetensors.index.json",
                                                                              "a shard index"))
                          for text, says in NOT_AN_OBJECT]
                         + [("model.safetensors.index.json", *case) for case in NO_WEIGHT_MAP])
def test_a_damaged_config_or_shard_index_is_one_error_naming_it(tmp_path, file, text, says):
    """config.json or model.safetensors.index.json that is damaged, JSON but no object, or (the index) without a map
    of names to files is one ValueError naming the file: a list there was a TypeError, a damaged index a decoder
    message naming no file."""
    save_tiny("llama-gqa", tmp_path)
    path = tmp_path / file
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ValueError, match=f"^{re.escape(str(path))} {says}"):
        load_model(tmp_path)


def test_unknown_model_folder_and_hub_id(tmp_path, monkeypatch):
    from weights.checkpoints import resolve
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for missing in (str(tmp_path / "nowhere"), "./nowhere", "../nowhere"):  # a relative path, not a hub id
        with pytest.raises(FileNotFoundError, match="no such folder, and not a hub id"):
            resolve(missing)
    with pytest.raises(FileNotFoundError, match="hub could not provide it"):
        resolve("no-such-owner/no-such-model-qada")
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(str(tmp_path))


def test_config_without_a_required_field_is_one_clear_error(tmp_path):
    save_tiny("llama-gqa", tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["num_attention_heads"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="config.json lacks num_attention_heads"):
        load_model(tmp_path)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cuda_without_cuda_says_so(tmp_path):
    save_tiny("llama-gqa", tmp_path)
    with pytest.raises(ValueError, match="no CUDA"):
        load_model(tmp_path, device="cuda")


def test_a_cache_refuses_what_it_cannot_hold(tmp_path):
    """A prompt longer than its cache is one clear ValueError (a shape error from torch otherwise); a stacked,
    left-padded cache takes one token at a time (a chunk there ran the prefill path over the padding)."""
    from model import KVCache
    save_tiny("llama-gqa", tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(0, 101, (1, 5), generator=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match="KV cache holds 4 positions; writing up to 5"):
        model.prefill(ids, model.new_cache(4))
    caches = [model.new_cache(n + 4) for n in (5, 3)]
    for cache, n in zip(caches, (5, 3)):
        model.prefill(ids[:, :n], cache)
    stacked = KVCache.stack(caches, 4)
    with pytest.raises(ValueError, match="a stacked \\(left-padded\\) cache decodes one token at a time"):
        model(ids[:, :1].repeat(2, 3), stacked)


def test_the_copies_of_a_stacked_caches_row_0_start_where_it_does():
    # KVCache.repeat_rows (lab.sweep's continuations of one prefill): each copy of row 0 keeps row 0's first filled
    # position, one per copy, so that its padding stays masked and its RoPE positions its own
    cfg = LlamaConfig.from_hf(TINY)
    caches = [KVCache(cfg, n) for n in (3, 5)]
    for c, n in zip(caches, (3, 5)):
        c.k.normal_(generator=torch.Generator().manual_seed(n))
        c.v.normal_(generator=torch.Generator().manual_seed(n + 10))
        c.length = n
    stacked = KVCache.stack(caches, 2)
    repeated = stacked.repeat_rows(3)
    assert repeated.start.tolist() == [2, 2, 2] and repeated.length == 5
    assert torch.equal(repeated.k, stacked.k[:, :1].expand(-1, 3, -1, -1, -1))
    assert torch.equal(repeated.v, stacked.v[:, :1].expand(-1, 3, -1, -1, -1))


def test_config_defaults_and_bounds_are_transformers(tmp_path):
    """What a config leaves out is what transformers assumes (rms_norm_eps, num_key_value_heads null: one per query
    head); Mistral's sliding window is refused only where it is shorter than the context; a rope_theta override
    must be positive (a negative one gave NaN frequencies)."""
    bare = {k: v for k, v in TINY.items() if k != "num_key_value_heads"}
    assert LlamaConfig.from_hf(bare).rms_norm_eps == transformers.LlamaConfig().rms_norm_eps
    assert LlamaConfig.from_hf(dict(TINY, num_key_value_heads=None)).num_key_value_heads == TINY["num_attention_heads"]
    with pytest.raises(ValueError, match="sliding-window"):
        LlamaConfig.from_hf(dict(TINY, model_type="mistral", sliding_window=511))
    assert LlamaConfig.from_hf(dict(TINY, model_type="mistral", sliding_window=512)).max_position_embeddings == 512
    save_tiny("llama-gqa", tmp_path)
    for theta in (-1.0, 0.0):
        with pytest.raises(ValueError, match="rope_theta must be positive"):
            load_model(tmp_path, rope_theta=theta)


def test_unsupported_configs_are_refused():
    with pytest.raises(ValueError, match="model_type"):
        LlamaConfig.from_hf(dict(TINY, model_type="gpt2"))
    with pytest.raises(ValueError, match="sliding-window"):
        LlamaConfig.from_hf(dict(TINY, model_type="mistral", sliding_window=128))
    with pytest.raises(ValueError, match="rope_scaling"):
        from model import rope_inv_freq
        rope_inv_freq(LlamaConfig.from_hf(dict(TINY, head_dim=16, rope_scaling={"rope_type": "yarn", "factor": 4})))


# --- configs as transformers reads them, loading, and the cache's stacked and static views -------------------------


LEGACY = {  # config.json as transformers 4 wrote it: rope settings at the top level, scaling named by "type"
    "defaults left out": {k: v for k, v in TINY.items() if k != "num_key_value_heads"},
    "rope_theta": dict(TINY, rope_theta=5000.0),
    "linear by type": dict(TINY, rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 4.0}),
    "llama3": dict(TINY, rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING)),
}


@pytest.mark.parametrize("case", list(LEGACY))
def test_a_transformers_4_config_reads_as_transformers_5_rewrites_it(case):
    """A config.json of transformers 4 (rope_theta and rope_scaling at the top level, as weights/convert_gguf.py still
    writes them; "type" for "rope_type"; fields left to their defaults) reads as the same file rewritten by
    transformers 5 into rope_parameters with every default filled in: the same settings, the same RoPE frequencies."""
    from dataclasses import asdict

    from model import rope_inv_freq
    legacy = LEGACY[case]
    ours = LlamaConfig.from_hf(legacy)
    theirs = LlamaConfig.from_hf(transformers.LlamaConfig(**copy.deepcopy(legacy)).to_dict())  # it edits rope_scaling
    assert {k: v for k, v in asdict(ours).items() if k != "rope_scaling"} == \
        {k: v for k, v in asdict(theirs).items() if k != "rope_scaling"}
    assert torch.equal(rope_inv_freq(ours), rope_inv_freq(theirs))
    if case != "linear by type":  # transformers 5 adds rope_type there; elsewhere rope_scaling is the same dict, no
        assert ours.rope_scaling == theirs.rope_scaling  # rope_theta in it (moments.model_identity records it)


@pytest.mark.parametrize("case", list(CASES))
def test_a_built_model_has_the_parameters_of_transformers(case):
    """Llama(cfg) itself, not only load_model, has transformers' parameters by name and shape, a tied LM head
    one parameter with the embedding (lab/bench_gpu.py builds its model so, with no checkpoint)."""
    from model import Llama
    cfg_name, model_name, kwargs = CASES[case]
    cfg = getattr(transformers, cfg_name)(**copy.deepcopy(kwargs))  # transformers edits rope_scaling in place
    hf = getattr(transformers, model_name)(cfg)
    ours_cfg = LlamaConfig.from_hf(cfg.to_dict())
    assert ours_cfg.model_type == cfg.model_type
    with torch.device("meta"):
        ours = Llama(ours_cfg)
    assert {n: p.shape for n, p in ours.named_parameters()} == {n: p.shape for n, p in hf.named_parameters()}
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == kwargs.get("tie_word_embeddings", False)


NO_CONTEXT = {k: v for k, v in TINY.items() if k != "max_position_embeddings"}


@pytest.mark.parametrize("model_type,config", [
    ("llama", NO_CONTEXT), ("mistral", NO_CONTEXT), ("qwen2", NO_CONTEXT),  # transformers' defaults
    ("mistral", dict(TINY, sliding_window=None)), ("mistral", dict(TINY, sliding_window=512)),
    ("mistral", dict(TINY, sliding_window=511)),
    ("qwen2", dict(TINY, use_sliding_window=True, sliding_window=128)),  # 2 layers, below max_window_layers' 28
    ("qwen2", dict(TINY, use_sliding_window=True, sliding_window=128, max_window_layers=1)),
    ("qwen2", dict(TINY, use_sliding_window=False, sliding_window=128, max_window_layers=0)),
    ("qwen2", dict(NO_CONTEXT, use_sliding_window=True, max_window_layers=0)),
    ("qwen2", dict(TINY, use_sliding_window=True, sliding_window=128,
                   layer_types=["full_attention", "sliding_attention"])),
    ("qwen2", dict(TINY, use_sliding_window=True, sliding_window=128, layer_types=["full_attention"] * 2))])
def test_the_context_and_the_sliding_window_are_read_as_transformers_reads_them(model_type, config):
    """A config that leaves the context out has transformers' default for its model_type; a sliding window is refused
    exactly where transformers would slide a layer over a window shorter than the context (Mistral: every layer,
    4096 when the file is silent; Qwen2: only with use_sliding_window, the layers of layer_types or from
    max_window_layers on), and taken where nothing slides."""
    theirs = getattr(transformers, CONFIG_CLASSES[model_type])(**config)
    window = getattr(theirs, "sliding_window", None)
    kinds = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers
    if window is not None and "sliding_attention" in kinds and window < theirs.max_position_embeddings:
        with pytest.raises(ValueError, match=f"^{model_type} sliding-window attention \\(window {window} of a "
                                             f"{theirs.max_position_embeddings}-token context\\) is not supported"):
            LlamaConfig.from_hf(dict(config, model_type=model_type))
    else:
        ours = LlamaConfig.from_hf(dict(config, model_type=model_type))
        assert ours.max_position_embeddings == theirs.max_position_embeddings


def test_a_sliding_window_of_0_is_none():
    """Mistral's sliding_window 0, like null, slides no layer: the config loads as full attention; a real window is
    one."""
    assert LlamaConfig.from_hf(dict(TINY, model_type="mistral", sliding_window=0)).model_type == "mistral"
    assert sliding_window(dict(TINY, sliding_window=0), "mistral") is None
    assert sliding_window(dict(TINY, sliding_window=None), "mistral") is None
    assert sliding_window(dict(TINY, sliding_window=128), "mistral") == 128


def test_a_tied_checkpoint_with_a_stored_head_or_old_rotary_buffers_loads(tmp_path):
    """Some tied checkpoints store the LM head's copy anyway, older ones each layer's rotary_emb.inv_freq buffer:
    both load (neither is a weight of ours) and give transformers' logits."""
    hf = save_tiny("llama-mha-tied", tmp_path)
    edit_weights(tmp_path, lambda s: s.update({"lm_head.weight": s["model.embed_tokens.weight"].clone(),
                                               "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}))
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(0))
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.model_dir == tmp_path
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits[:, -1]).abs().max() < 1e-4


def test_shards_without_an_index_load_and_a_folder_without_weights_says_so(tmp_path):
    """Shards with no index are read all the same (every *.safetensors of the folder); a folder without weights, or an
    index naming a shard that is not there, is a FileNotFoundError naming what is missing, not a decoder error."""
    hf = save_tiny("qwen2-bias", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(state)
    for i, keys in enumerate((names[::2], names[1::2])):
        save_file({k: state[k] for k in keys}, tmp_path / f"model-0000{i + 1}-of-00002.safetensors")
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (load_model(tmp_path)(ids) - hf(ids).logits[:, -1]).abs().max() < 1e-4
    index = {"weight_map": {k: f"model-0000{i % 2 + 1}-of-00002.safetensors" for i, k in enumerate(names)}}
    index["weight_map"]["lm_head.weight"] = "model-00003-of-00003.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match="model-00003-of-00003.safetensors is listed in the shard index but"):
        load_model(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    for f in tmp_path.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(FileNotFoundError, match=f"^{re.escape(str(tmp_path))} has no \\*.safetensors weights"):
        load_model(tmp_path)
    (tmp_path / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json: not a Hugging Face model folder"):
        load_model(tmp_path)


def test_every_missing_tensor_up_to_five_is_named(tmp_path):
    """A checkpoint missing several tensors names each (up to five), not only the first."""
    save_tiny("llama-gqa", tmp_path)
    gone = ["model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight", "model.norm.weight"]
    edit_weights(tmp_path, lambda s: [s.pop(k) for k in gone])
    with pytest.raises(ValueError) as e:
        load_model(tmp_path)
    assert all(k in str(e.value) for k in gone)


def test_a_stack_keeps_the_caches_dtype_and_right_aligns_their_filled_entries():
    """KVCache.stack: row b holds caches[b]'s filled entries (only those) right-aligned at the longest length, with
    room for `extra` more, in the caches' own dtype (a bf16 model's stack made in fp32 met bf16 queries)."""
    cfg = LlamaConfig.from_hf(TINY)
    caches = [KVCache(cfg, n + 1, dtype=torch.bfloat16) for n in (3, 5)]  # one unfilled position each, not copied
    for c, n in zip(caches, (3, 5)):
        c.k.copy_(torch.randn(c.k.shape, generator=torch.Generator().manual_seed(n)))
        c.v.copy_(torch.randn(c.v.shape, generator=torch.Generator().manual_seed(n + 10)))
        c.length = n
    stacked = KVCache.stack(caches, 2)
    assert stacked.k.dtype == stacked.v.dtype == torch.bfloat16 and stacked.max_len == 7
    for b, (c, n) in enumerate(zip(caches, (3, 5))):
        for got, want in ((stacked.k, c.k), (stacked.v, c.v)):
            assert torch.equal(got[:, b, :, 5 - n:5], want[:, 0, :, :n])
            assert not got[:, b, :, :5 - n].any() and not got[:, b, :, 5:].any()


def test_a_static_cache_decodes_through_views_that_end_at_the_new_entry(tmp_path):
    """Static mode (KVCache.fix): the views are `view` positions long, fix's argument where given, and a view that
    ends right at the entry the step writes (generate.graph_view gives views of exactly T) decodes as the growing
    cache does."""
    save_tiny("llama-gqa", tmp_path)
    model = load_model(tmp_path)
    ids = torch.randint(0, 101, (1, 20), generator=torch.Generator().manual_seed(3))
    growing, static = model.new_cache(40), model.new_cache(40)
    logits = model.prefill(ids, growing)
    model.prefill(ids, static)
    static.fix(view=21)
    assert static.view == 21
    lengths, write = [], static.write  # the length of the views each layer attends over

    def spy(layer, k, v):
        keys, values = write(layer, k, v)
        lengths.append((keys.shape[2], values.shape[2]))
        return keys, values
    static.write = spy
    L = model.cfg.num_hidden_layers
    for step in range(5):
        static.view = 21 + step  # the filled length once this step has written
        token = logits.argmax(-1)
        logits = model.decode_step(token, growing)
        torch.testing.assert_close(model.decode_step(token, static), logits, rtol=0, atol=1e-5)
        assert lengths[-L:] == [(21 + step, 21 + step)] * L
