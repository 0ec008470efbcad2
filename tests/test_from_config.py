"""Models from the files users have: Hugging Face config.json files, written here from the published shapes, read
into the zoo's families (`al.models.from_config`), and given where the CLI takes a model name."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import autopar_lab as al

# The released configurations' shape fields, as their config.json files spell them (transformers' key names).
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "rope_theta": 500000.0, "rms_norm_eps": 1e-05,
             "tie_word_embeddings": False, "max_position_embeddings": 8192, "torch_dtype": "bfloat16",
             "hidden_act": "silu", "head_dim": 128}
LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "head_dim": 128}
LLAMA3_405B = {**LLAMA3_8B, "hidden_size": 16384, "intermediate_size": 53248, "num_hidden_layers": 126,
               "num_attention_heads": 128, "head_dim": 128, "max_position_embeddings": 131072,
               "rope_scaling": {"factor": 8.0, "rope_type": "llama3"}}
MIXTRAL = {"architectures": ["MixtralForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
           "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "num_local_experts": 8, "num_experts_per_tok": 2,
           "max_position_embeddings": 32768, "sliding_window": None, "tie_word_embeddings": False}
QWEN3_30B_A3B = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 2048, "intermediate_size": 6144,
                 "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
                 "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
                 "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                 "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "tie_word_embeddings": False,
                 "max_position_embeddings": 40960}
DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 7168, "intermediate_size": 18432,
               "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
               "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
               "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
               "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
               "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
               "scoring_func": "sigmoid", "vocab_size": 129280, "rope_theta": 10000, "rms_norm_eps": 1e-06,
               "max_position_embeddings": 163840, "num_nextn_predict_layers": 1, "tie_word_embeddings": False}

SAME_AS_ZOO = [("llama3-8b", LLAMA3_8B), ("llama3-70b", LLAMA3_70B), ("llama3-405b", LLAMA3_405B),
               ("mixtral-8x7b", MIXTRAL), ("qwen3-30b-a3b", QWEN3_30B_A3B), ("deepseek-v3", DEEPSEEK_V3)]


def _write(tmp_path: Path, cfg: dict, folder: str = "model") -> Path:
    path = tmp_path / folder / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2))
    return path


@pytest.mark.parametrize("name,cfg", SAME_AS_ZOO, ids=[n for n, _ in SAME_AS_ZOO])
def test_a_config_json_gives_the_zoo_model_of_its_shapes(tmp_path, name, cfg):
    spec = al.models.from_config(_write(tmp_path, cfg, name))
    zoo = al.models.get(name)
    assert spec.family == zoo.family
    assert spec.config == zoo.config                           # every field, the training defaults included
    assert spec.param_count == zoo.param_count
    assert spec.name == name                                   # the folder holding config.json names it


def test_the_same_graph_as_the_zoo_name_on_a_shallow_copy(tmp_path):
    """Shapes equal is not enough: the traced step is the same (4 layers keep it quick)."""
    spec = al.models.from_config(_write(tmp_path, DEEPSEEK_V3), num_layers=4, seq_len=64, batch_size=2)
    zoo = al.models.get("deepseek-v3", num_layers=4, seq_len=64, batch_size=2)
    assert spec.trace().fingerprint == zoo.trace().fingerprint


def test_overrides_and_directory_and_text(tmp_path):
    path = _write(tmp_path, LLAMA3_8B, "Meta-Llama-3-8B")
    by_dir = al.models.from_config(path.parent, seq_len=2048, batch_size=64)
    assert (by_dir.config.seq_len, by_dir.config.batch_size) == (2048, 64)
    assert by_dir.name == "meta-llama-3-8b"
    by_text = al.models.from_config(path.read_text())
    assert by_text.config == al.models.get("llama3-8b").config


def test_a_short_context_caps_the_default_sequence(tmp_path):
    short = {**LLAMA3_8B, "max_position_embeddings": 4096}
    assert al.models.from_config(short).config.seq_len == 4096
    assert al.models.from_config(short, seq_len=1024).config.seq_len == 1024


def test_qwen_architectures(tmp_path):
    qwen3 = {**LLAMA3_8B, "architectures": ["Qwen3ForCausalLM"], "hidden_size": 2560, "num_attention_heads": 32,
             "head_dim": 128, "num_key_value_heads": 8, "intermediate_size": 9728, "num_hidden_layers": 36,
             "vocab_size": 151936, "tie_word_embeddings": True}
    spec = al.models.from_config(qwen3)
    assert spec.config.qk_norm and spec.config.head_dim == 128 and spec.config.tie_embeddings
    H, V, L, F, hd = 2560, 151936, 36, 9728, 128
    per_layer = H * (32 + 2 * 8) * hd + 32 * hd * H + 3 * H * F + 2 * H + 2 * hd
    assert spec.param_count == V * H + H + L * per_layer           # tied: one embedding, no lm_head
    qwen2 = {**LLAMA3_8B, "architectures": ["Qwen2ForCausalLM"], "hidden_size": 896, "num_attention_heads": 14,
             "num_key_value_heads": 2, "intermediate_size": 4864, "num_hidden_layers": 24, "vocab_size": 151936,
             "tie_word_embeddings": True, "head_dim": None}
    spec2 = al.models.from_config(qwen2)
    H, hd, F, L = 896, 64, 4864, 24
    per_layer = H * (14 + 2 * 2) * hd + (14 + 2 * 2) * hd + 14 * hd * H + 3 * H * F + 2 * H   # q, k, v biases
    assert spec2.param_count == 151936 * H + H + L * per_layer


@pytest.mark.parametrize("cfg,words", [
    ({**LLAMA3_8B, "architectures": ["GPTNeoXForCausalLM"]}, ["GPTNeoXForCausalLM", "LlamaForCausalLM"]),
    ({k: v for k, v in LLAMA3_8B.items() if k != "num_key_value_heads" and k != "num_attention_heads"},
     ["num_attention_heads", "missing"]),
    ({k: v for k, v in LLAMA3_8B.items() if k != "architectures"}, ["architectures"]),
    ({**LLAMA3_8B, "num_hidden_layers": "32"}, ["num_hidden_layers", "whole number"]),
    ({**QWEN3_30B_A3B, "mlp_only_layers": [0, 1]}, ["mlp_only_layers"]),
    ({**LLAMA3_8B, "num_key_value_heads": 5}, ["num_kv_heads"]),
])
def test_a_bad_config_is_one_sentence(cfg, words):
    with pytest.raises(ValueError) as e:
        al.models.from_config(cfg)
    msg = str(e.value)
    assert not re.search(r"\.\s+[A-Z]", msg) and "\n" not in msg          # one sentence
    for w in words:
        assert w in msg


def test_not_a_config_file(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        al.models.from_config(bad)
    with pytest.raises(ValueError, match="config.json"):
        al.models.from_config(tmp_path / "nowhere" / "config.json")


def test_ignored_keys_are_named():
    ignored = set(al.models.hfconfig.ignored_keys(DEEPSEEK_V3))
    assert ignored >= {"topk_method", "num_nextn_predict_layers"}
    assert not ignored & {"n_group", "topk_group"}  # node-limited routing is modelled (tests/test_node_limit.py)
    c = al.models.from_config(DEEPSEEK_V3).config
    assert (c.n_group, c.topk_group) == (8, 4)
    assert "rope_scaling" in al.models.hfconfig.ignored_keys(LLAMA3_405B)
    assert al.models.hfconfig.ignored_keys(LLAMA3_8B) == []


def _cli(*args, cwd):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-m", "autopar_lab", *args], capture_output=True, text=True, cwd=cwd,
                          env=env, timeout=600)


def test_the_cli_takes_a_config_path_where_it_takes_a_name(tmp_path):
    path = _write(tmp_path, LLAMA3_8B, "llama")
    out = _cli("graph", str(path), "--layers", "2", "--seq-len", "128", "--batch", "2", "--json", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    zoo = _cli("graph", "llama3-8b", "--layers", "2", "--seq-len", "128", "--batch", "2", "--json", cwd=tmp_path)
    want = json.loads(zoo.stdout)
    assert got["num_ops"] == want["num_ops"] and got["flops_by_role"] == want["flops_by_role"]
    bad = _write(tmp_path, {**LLAMA3_8B, "architectures": ["BertModel"]}, "bert")
    out = _cli("graph", str(bad), cwd=tmp_path)
    assert out.returncode == 2 and "BertModel" in out.stderr and "Traceback" not in out.stderr
