"""Hugging Face GPT-2 and Llama: start a run from their weights (`--init-from`), hand ours back (`export`).

    python train.py --init-from DIR ...                        # train.py's main asks `start` for the weights
    python -m instruments.hf export out/ckpt out/hf            # a checkpoint of any layout, as a HF directory

A Hugging Face GPT-2 model directory holds two files:

    config.json          the architecture: n_layer, n_head, n_embd, n_positions (our block_size),
                         vocab_size, and settings that GPT-2 fixes (GELU with tanh, LayerNorm eps 1e-5)
    model.safetensors    the weights (older directories: pytorch_model.bin, a pickled state dict)

model.py uses the names of Hugging Face's GPT2LMHeadModel (`transformer.h.0.attn.c_attn.weight`,
...), so most tensors map one to one. The differences, and what each direction does about them:

* Conv1D. OpenAI's original GPT-2 code, which Hugging Face kept, multiplies x @ W with W stored as
  (in, out). nn.Linear stores (out, in) and computes x @ W.T. So the four projection weights of each
  block (CONV1D) are transposed on the way in and on the way out; biases, LayerNorms and
  embeddings are the same either way.
* Tied weights. The output layer `lm_head.weight` *is* the token embedding `transformer.wte.weight`:
  one tensor. Import reads wte and skips lm_head; export writes wte only, with
  "tie_word_embeddings": true.
* A padded vocabulary. Our embedding has a multiple of 128 rows (50257 -> 50304) for faster
  matmuls: import appends zero rows (to a tensor of exactly config.json's vocabulary: another length is
  refused), export cuts them off.
* Old files. Some name tensors without the "transformer." prefix, and some store the attention's
  causal mask (`attn.bias`, `attn.masked_bias`), a buffer rather than a weight, which is skipped.

A Llama directory (LlamaForCausalLM, model_type "llama") names things its own way, and keeps apart what
model.py fuses (Llama section below): q_proj, k_proj and v_proj are the rows of our c_attn, gate_proj and
up_proj those of our c_fc (SwiGLU's W and V), o_proj and down_proj our two c_proj, input_layernorm and
post_attention_layernorm our ln_1 and ln_2, model.norm our ln_f; nn.Linear on both sides, so nothing is
transposed, and RoPE pairs feature i with feature i + D/2 on both sides, so q and k need no permutation.
lm_head is its own matrix unless "tie_word_embeddings".

Import (`hf_config`, `read_hf_weights`, `initial_values`, `load_hf`) renames and transposes every tensor into our
layout, then each rank copies only its own slice (`shard.take_shard`), so a model built for
tensor parallelism starts from the same weights as one on a single device. Export (`export_hf`)
takes the full fp32 tensors that `checkpoint.consolidate` rebuilds from a checkpoint of any layout, undoes
the differences above, and writes a directory that `transformers.GPT2LMHeadModel.from_pretrained` (or
`LlamaForCausalLM`'s) loads: whole or not at all (a temporary directory beside it, renamed). A mixture of
experts is refused: neither class has routed experts.
"""

import argparse
import json
from pathlib import Path

import torch

import checkpoint
from instruments import checkpoints
from model import canonical_name, ffn_hidden_rule
from parallel import placement
from shard import take_shard
from support.storage import CheckpointError, read_safetensors, replace_atomically, write_safetensors

# The weights Hugging Face stores transposed (Conv1D, (in, out)) relative to our nn.Linear ((out, in)).
CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def hf_config(directory: Path) -> dict:
    """GPTConfig fields from a Hugging Face GPT-2 config.json."""
    try:
        cfg = json.loads((Path(directory) / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{directory}: no readable config.json ({e.__class__.__name__}); point "
                              "--init-from at a Hugging Face GPT-2 model directory") from None
    if cfg.get("model_type") == "llama":
        return llama_config(cfg, directory)
    if cfg.get("model_type") != "gpt2":
        raise CheckpointError(f"{directory} holds a {cfg.get('model_type')!r} model, not GPT-2 or Llama")
    return {"n_layer": cfg["n_layer"], "n_head": cfg["n_head"], "n_embd": cfg["n_embd"],
            "block_size": cfg["n_positions"], "vocab_size": cfg["vocab_size"]}


def read_hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    """Our names and layouts for the tensors of a Hugging Face GPT-2 directory."""
    directory = Path(directory)
    if (directory / "model.safetensors").exists():
        raw = read_safetensors(directory / "model.safetensors")
    elif (directory / "pytorch_model.bin").exists():
        raw = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise CheckpointError(f"{directory} has neither model.safetensors nor pytorch_model.bin")
    if "model.embed_tokens.weight" in raw:
        return from_llama(raw)
    ours = {}
    for name, t in raw.items():
        name = name if name.startswith(("transformer.", "lm_head.")) else "transformer." + name
        if name.endswith((".attn.bias", ".attn.masked_bias")) or name == "lm_head.weight":
            continue  # the causal-mask buffers of old checkpoints; lm_head is tied to wte
        ours[name] = t.t() if name.endswith(CONV1D) else t
    return ours


def initial_values(model: torch.nn.Module, directory: Path):
    """p -> this rank's (possibly tensor-parallel) slice of the Hugging Face weight for parameter p, fp32
    on the CPU, taken when asked. Every tensor the model needs is checked to be there first."""
    weights = read_hf_weights(directory)
    names = {id(p): canonical_name(n, model.config.tied) for n, p in model.named_parameters()}
    if missing := next((n for n in names.values() if n not in weights), None):
        raise CheckpointError(f"{directory}: no tensor for {missing}")

    def value(p: torch.nn.Parameter) -> torch.Tensor:
        name, cfg = names[id(p)], model.config
        w = weights[name].float()
        if name in VOCAB_ROWS:  # one row per token of config.json's vocabulary, then zeros up to our multiple of 128
            if w.shape[0] != cfg.vocab_size:  # (padding first would start the missing tokens from zero, silently)
                raise CheckpointError(f"{directory}: {name} has shape {tuple(w.shape)}, but config.json's vocabulary "
                                      f"is {cfg.vocab_size} tokens: one row each")
            w = torch.cat([w, w.new_zeros(cfg.padded_vocab - w.shape[0], w.shape[1])])
        part = take_shard(w, placement(p).shard)  # this rank's slice under tensor parallelism
        if part.shape != p.shape:
            raise CheckpointError(f"{directory}: {name} has shape {tuple(weights[name].shape)}, which does not fit "
                                  "this model")
        return part
    return value


def start(directory: str | Path) -> tuple[dict, object]:
    """--init-from: what train.setup takes, (the model's GPTConfig fields, model -> (p -> this rank's
    slice of p's Hugging Face weight))."""
    return hf_config(Path(directory)), lambda model: initial_values(model, Path(directory))


def load_hf(model: torch.nn.Module, directory: Path) -> None:
    """Copy Hugging Face GPT-2 weights into this rank's (possibly sharded) model."""
    value = initial_values(model, directory)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(value(p))


def export_hf(weights: dict[str, torch.Tensor], manifest: dict, out_dir: Path) -> None:
    """Write a checkpoint, as checkpoint.consolidate gives it (full tensors, our names) with its
    verified manifest, into the directory `out_dir` (config.json last) as a Hugging Face GPT2LMHeadModel or
    LlamaForCausalLM."""
    m, tok = manifest["meta"]["model"], manifest["meta"]["tokenizer"]
    weights = {n: t[: m["vocab_size"]] if n in VOCAB_ROWS else t for n, t in weights.items()}
    if m.get("arch") == "llama":
        write_safetensors(out_dir / "model.safetensors", {n: t.contiguous() for n, t in to_llama(weights, m).items()})
        config = {**llama_json(m), "nanoscale": {"tokenizer": tok, "step": manifest["step"]}}
        replace_atomically(out_dir / "config.json", json.dumps(config, indent=2))
        return
    write_safetensors(out_dir / "model.safetensors",
                      {n: (t.t() if n.endswith(CONV1D) else t).contiguous() for n, t in weights.items()})
    eot = m["vocab_size"] - 1  # <|endoftext|> is the last token of both our tokenizers
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": m["vocab_size"],
              "n_positions": m["block_size"], "n_ctx": m["block_size"], "n_embd": m["n_embd"],
              "n_layer": m["n_layer"], "n_head": m["n_head"], "n_inner": None, "activation_function": "gelu_new",
              "layer_norm_epsilon": 1e-5, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
              "bos_token_id": eot, "eos_token_id": eot, "tie_word_embeddings": True,
              "nanoscale": {"tokenizer": tok, "step": manifest["step"]}}
    replace_atomically(out_dir / "config.json", json.dumps(config, indent=2))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m instruments.hf",
                                description="nanoscale checkpoints as Hugging Face GPT-2 and Llama models.")
    p.add_argument("cmd", choices=["export"], help="export: write a checkpoint as a Hugging Face model directory: "
                   "GPT2LMHeadModel for a GPT-2 run, LlamaForCausalLM for a Llama run (not a mixture of experts)")
    p.add_argument("path", help=checkpoints.PATH_HELP)
    p.add_argument("dir", help="output directory (config.json + model.safetensors); made whole or not at all")
    args = p.parse_args(argv)
    checkpoints.one_line_errors(lambda: export(checkpoints.find_checkpoint(args.path), Path(args.dir)))


def export(path: Path, out_dir: Path) -> None:
    reader = checkpoint.pin(path)
    m = reader.manifest["meta"]["model"]
    if m.get("moe_experts"):  # before any work: a dense config with expert tensors would load as something else
        raise CheckpointError(f"{path} is a mixture of experts ({m['moe_experts']} experts a block), which export "
                              "does not write: GPT2LMHeadModel and LlamaForCausalLM have no routed experts, and "
                              "transformers' Mixtral routes without a capacity (ours drops tokens over it); "
                              "sample it with sample.py")
    checkpoints.writable(out_dir)
    weights = checkpoint.consolidate(reader)
    checkpoints.write_whole(out_dir, lambda tmp: export_hf(weights, reader.manifest, tmp))
    kind = "Llama" if m.get("arch") == "llama" else "GPT-2"
    print(f"wrote a Hugging Face {kind} model from {path} to {out_dir}")


# ----------------------------------------------------------------------------- Llama

VOCAB_ROWS = ("transformer.wte.weight", "lm_head.weight")  # padded to a multiple of 128 in our model
# per layer: their name -> ours, for the tensors that map one to one
LLAMA_LAYER = {"input_layernorm.weight": "ln_1.weight", "post_attention_layernorm.weight": "ln_2.weight",
               "self_attn.o_proj.weight": "attn.c_proj.weight", "mlp.down_proj.weight": "mlp.c_proj.weight"}
FUSED = {"attn.c_attn.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"),
         "mlp.c_fc.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}  # ours: their rows, stacked


def llama_config(cfg: dict, directory: Path) -> dict:
    """GPTConfig fields from a Hugging Face Llama config.json; what model.py does not compute is refused."""
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps theta (and any scaling) here; 4 at the top
    unsupported = {"rope_scaling": cfg.get("rope_scaling") or rope.get("rope_type", "default") != "default",
                   "a head_dim other than hidden_size / heads": cfg.get("head_dim", head_dim) != head_dim,
                   f"hidden_act {cfg.get('hidden_act')!r}": cfg.get("hidden_act", "silu") != "silu",
                   "biases": cfg.get("attention_bias") or cfg.get("mlp_bias")}
    if unsupported := [what for what, bad in unsupported.items() if bad]:
        raise CheckpointError(f"{directory}: this Llama uses {', '.join(unsupported)}, which model.py does not compute")
    heads = cfg["num_attention_heads"]
    return {"arch": "llama", "n_layer": cfg["num_hidden_layers"], "n_head": heads,
            "n_kv_head": cfg.get("num_key_value_heads") or heads, "n_embd": cfg["hidden_size"],
            "ffn_hidden": cfg["intermediate_size"], "block_size": cfg["max_position_embeddings"],
            "vocab_size": cfg["vocab_size"], "rope_theta": float(cfg.get("rope_theta") or rope.get("rope_theta", 1e4)),
            "tie_embeddings": bool(cfg.get("tie_word_embeddings", False)),
            "norm_eps": float(cfg.get("rms_norm_eps", 1e-6))}


def from_llama(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names (and fused projections) for a LlamaForCausalLM state dict."""
    ours = {"transformer.wte.weight": raw["model.embed_tokens.weight"],
            "transformer.ln_f.weight": raw["model.norm.weight"]}
    if "lm_head.weight" in raw:  # absent when tied
        ours["lm_head.weight"] = raw["lm_head.weight"]
    for i in range(1 + max(int(n.split(".")[2]) for n in raw if n.startswith("model.layers."))):
        theirs, mine = f"model.layers.{i}.", f"transformer.h.{i}."
        ours |= {mine + m: raw[theirs + t] for t, m in LLAMA_LAYER.items()}
        ours |= {mine + m: torch.cat([raw[theirs + t] for t in parts]) for m, parts in FUSED.items()}
    return ours


def to_llama(weights: dict[str, torch.Tensor], m: dict) -> dict[str, torch.Tensor]:
    """A LlamaForCausalLM state dict from our full tensors (architecture `m`): the inverse of from_llama."""
    H, H_kv, D = m["n_head"], m["n_kv_head"] or m["n_head"], m["n_embd"] // m["n_head"]
    sizes = {"attn.c_attn.weight": [H * D, H_kv * D, H_kv * D], "mlp.c_fc.weight": 2}
    theirs = {"model.embed_tokens.weight": weights["transformer.wte.weight"],
              "model.norm.weight": weights["transformer.ln_f.weight"]}
    if "lm_head.weight" in weights:
        theirs["lm_head.weight"] = weights["lm_head.weight"]
    for i in range(m["n_layer"]):
        mine, out = f"transformer.h.{i}.", f"model.layers.{i}."
        theirs |= {out + t: weights[mine + ours] for t, ours in LLAMA_LAYER.items()}
        for ours, parts in FUSED.items():
            w = weights[mine + ours]
            pieces = w.chunk(sizes[ours]) if isinstance(sizes[ours], int) else w.split(sizes[ours])
            theirs |= {out + t: piece for t, piece in zip(parts, pieces)}
    return theirs


def llama_json(m: dict) -> dict:
    """config.json of a LlamaForCausalLM with architecture `m`."""
    eot = m["vocab_size"] - 1  # <|endoftext|> is the last token of both our tokenizers
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": m["vocab_size"],
            "hidden_size": m["n_embd"], "intermediate_size": m["ffn_hidden"] or ffn_hidden_rule(m["n_embd"]),
            "num_hidden_layers": m["n_layer"], "num_attention_heads": m["n_head"],
            "num_key_value_heads": m["n_kv_head"] or m["n_head"], "max_position_embeddings": m["block_size"],
            "rms_norm_eps": m["norm_eps"], "rope_theta": m["rope_theta"], "rope_scaling": None,
            "rope_parameters": {"rope_theta": m["rope_theta"], "rope_type": "default"},  # transformers 5
            "tie_word_embeddings": m["tie_embeddings"], "hidden_act": "silu", "attention_bias": False,
            "mlp_bias": False, "bos_token_id": eot, "eos_token_id": eot, "torch_dtype": "float32"}


if __name__ == "__main__":
    main()
