"""Which part of the model a rank holds: one GPT, transformed, then materialized slice by slice.

    meta GPT (shapes, no memory) ─▶ tensor parallel: Column/Row/Vocab layers (parallel.py)
                                 ─▶ context parallel: ring or Ulysses attention cores (context.py)
                                 ─▶ pipeline parallel: keep this stage's blocks (keep_stage)
                                 ─▶ materialize: each parameter's slice of its (seed, name) value
                                    (ZeRO-3: shapes only; zero.ZeroAdamW draws and keeps its shard)

`build_model` is the only way a rank gets a model, so every layout starts from the same weights
(DESIGN.md, principles 1 and 2). Every tensor that is split records how (`shard`: split dim `dim`
into `count` parts, within `groups` blocks, keep `index`); `take_shard` cuts that slice out of a full
tensor and `unshard` puts the slices back, which is how checkpoints and Hugging Face weights cross
layouts. `check_layout` refuses what cannot be split, before anything is built.
"""

import torch

import context
import model as gpt
from parallel import Grid, LayoutError, apply_tensor_parallel, meta_param


def check_layout(cfg: gpt.GPTConfig, grid: Grid, seq_len: int) -> None:
    if cfg.n_head % grid.tp:
        raise LayoutError(f"--tp {grid.tp} does not divide the model's {cfg.n_head} attention heads")
    if cfg.padded_vocab % grid.tp:
        raise LayoutError(f"--tp {grid.tp} does not divide the padded vocabulary {cfg.padded_vocab}")
    if cfg.n_layer < grid.pp * grid.vp:
        stages = f"--pp {grid.pp} stages" if grid.vp == 1 else \
            f"--pp {grid.pp} x --virtual-stages {grid.vp} = {grid.pp * grid.vp} virtual stages"
        raise LayoutError(f"{stages} but the model has only {cfg.n_layer} layers; use fewer stages, or more "
                          "layers (--n-layer)")
    if grid.sp and grid.tp == 1:
        raise LayoutError("--sp (sequence parallelism) needs --tp 2 or more")
    if grid.sp and seq_len % (grid.tp * grid.cp):
        raise LayoutError(f"--sp needs --seq-len ({seq_len}) divisible by --tp {grid.tp}"
                          + (f" times --cp {grid.cp}" if grid.cp > 1 else ""))
    if seq_len % (2 * grid.cp):
        raise LayoutError(f"--cp {grid.cp} cuts each sequence into 2*cp = {2 * grid.cp} chunks: --seq-len "
                          f"{seq_len} must be divisible by {2 * grid.cp}")
    if grid.cp > 1 and grid.cp_attn == "ulysses" and (cfg.n_head // grid.tp) % grid.cp:
        raise LayoutError(f"--cp-attn ulysses needs the heads per tensor-parallel rank ({cfg.n_head // grid.tp}) "
                          f"divisible by --cp {grid.cp}; use --cp-attn ring")


def stage_layers(n_layer: int, pp: int, stage: int) -> range:
    """Blocks of a pipeline stage: as even as possible, the remainder to the later stages
    (the first stage also runs the embedding, the last the loss)."""
    bounds = [n_layer * s // pp for s in range(pp + 1)]
    return range(bounds[stage], bounds[stage + 1])


def rank_layers(n_layer: int, pp: int, vp: int, pp_rank: int) -> list[range]:
    """The chunks of blocks pipeline rank `pp_rank` holds. Interleaved (Narayanan et al. 2021,
    section 2.2.2), the layers are cut into pp * vp virtual stages, and virtual stage c * pp + rank is
    chunk c of that rank: with pp = 2, vp = 2 and 8 layers, rank 0 holds h.0-1 and h.4-5, rank 1
    h.2-3 and h.6-7. With vp = 1, one chunk: stage_layers."""
    return [stage_layers(n_layer, pp * vp, c * pp + pp_rank) for c in range(vp)]


def keep_stage(model: gpt.GPT, grid: Grid) -> None:
    """Drop what this pipeline stage does not run. Blocks keep their global names (h.5 stays h.5),
    so checkpoints from any layout line up; an interleaved stage keeps its chunks in layer order.
    The embedding stays with the first stage and the loss with the last (virtual stage 0 and
    pp * vp - 1 are on those ranks)."""
    h = model.transformer.h
    held = [i for chunk in rank_layers(len(h), grid.pp, grid.vp, grid.pp_rank) for i in chunk]
    model.transformer.h = torch.nn.ModuleDict({str(i): h[i] for i in held})
    first, last = grid.first_stage, grid.last_stage
    if first and not last:
        model.transformer.wte.weight.tied_embedding = True  # its twin is the last stage's lm_head
    if not first:
        del model.transformer["wte"], model.transformer["wpe"]
    if not last:
        del model.transformer["ln_f"]
        model.lm_head = None
    elif not first:  # the last stage keeps its own copy of the tied embedding, synced by grad all-reduce
        w = model.lm_head.weight
        model.lm_head.weight = meta_param(*w.shape, spec=w.shard if hasattr(w, "shard") else None,
                                          tied_copy=True)


def build_model(cfg: gpt.GPTConfig, grid: Grid, seed: int, device: torch.device, seq_len: int,
                values: bool = True) -> torch.nn.Module:
    """This rank's part of the model: the full GPT built on meta (no memory), transformed by tensor,
    context and pipeline parallelism, then each remaining parameter materialized as this rank's slice of
    its layout-independent initial value. `values=False` (ZeRO-3): shapes only, and `initial_values`
    draws each parameter's slice when the optimizer builds its shard."""
    check_layout(cfg, grid, seq_len)
    with torch.device("meta"):
        model = gpt.GPT(cfg)
    if grid.tp > 1:
        apply_tensor_parallel(model, grid)
    if grid.cp > 1:
        context.apply_context_parallel(model, grid)
    if grid.pp > 1:
        keep_stage(model, grid)
    specs = {name: getattr(p, "shard", None) for name, p in model.named_parameters(remove_duplicate=False)}
    return gpt.materialize(model, seed, device, shard_fn=lambda name, full: take_shard(full, specs[name]),
                           values=values)


def initial_values(model: torch.nn.Module, seed: int):
    """p -> this rank's slice of parameter p's initial value (fp32, on the CPU): what build_model gives
    p, drawn only when asked."""
    names, shapes = {id(p): n for n, p in model.named_parameters()}, gpt.full_shapes(model.config)

    def value(p: torch.nn.Parameter) -> torch.Tensor:
        name = names[id(p)]
        return take_shard(gpt.init_value(name, shapes[name], seed, model.config.n_layer), getattr(p, "shard", None))
    return value


def take_shard(full: torch.Tensor, spec: dict | None) -> torch.Tensor:
    """The part of a full tensor that `spec` names (see shard_spec)."""
    if spec is None:
        return full
    blocks = full.chunk(spec["groups"], dim=spec["dim"])
    return torch.cat([b.chunk(spec["count"], dim=spec["dim"])[spec["index"]] for b in blocks], dim=spec["dim"])


def unshard(pieces: list[torch.Tensor], spec: dict) -> torch.Tensor:
    """The full tensor from every rank's take_shard(full, spec), in rank order."""
    chunks = [piece.chunk(spec["groups"], dim=spec["dim"]) for piece in pieces]  # chunks[rank][group]
    return torch.cat([chunks[r][g] for g in range(spec["groups"]) for r in range(len(pieces))], dim=spec["dim"])
