"""Sample text from a trained model: a checkpoint saved at any layout, or a Hugging Face GPT-2 directory.

    python sample.py --ckpt out                                   # the run in out/: its newest checkpoint
    python sample.py --ckpt out --prompt "def " --tokens 100 --temperature 0.7 --top-k 40 --seed 7
    python sample.py --hf gpt2-dir --temperature 0      # e.g. what `python -m instruments.hf export` wrote
    torchrun --nproc-per-node 4 sample.py --ckpt out --tp 2 --pp 2   # the model split over 4 processes

Nothing about the model is repeated on the command line. A checkpoint's manifest records the
architecture (`meta.model`), the tokenizer (`meta.tokenizer`, an identity the loaded tokenizer must
match: a model is only valid with its own) and the run's flags (`meta.config`, whose --cache-dir holds
the GPT-2 tokenizer's file). A Hugging Face directory has its config.json, and the tokenizer under
"nanoscale" when instruments/hf.py exported it (plain GPT-2 otherwise).

A run that is still training can be sampled: the checkpoint read is pinned (checkpoint.pin: its files
mapped, then checked), so the run deleting it beyond --keep cannot pull it away mid-read, and one that
vanishes before it is pinned is passed over, silently, for the newer one.

Any layout loads anywhere. `checkpoint.consolidate` rebuilds every full tensor from whatever wrote it
(ZeRO's flat pieces, tensor-parallel slices, pipeline stages), and each process keeps the part its
own layout needs (`checkpoint.local_part`): one process all of it; under torchrun with --tp and --pp,
each rank its slices of its stage's layers, from the same `shard.build_model` training uses.

One token at a time, with a KV cache (`GPT.generate`; across pipeline stages `pipeline.generate`
runs the same loop on every stage in lockstep, so that every rank draws the same token):

    logits (V) ──÷ temperature──▶ keep the top k ──softmax──▶ p ──draw(generator)──▶ token
    --temperature 0: the argmax (greedy decoding)

The draws come from a generator seeded with --seed, so the same seed gives the same text on the same
layout. Across layouts the logits agree to fp32 rounding (~1e-6): greedy decoding gives the same tokens,
and so does a seeded draw unless rounding decides it: a draw that falls that close to the boundary
between two tokens, or top-k's 50th and 51st logits within rounding of each other, which changes every
kept probability (seen once in 60 tokens, sampling at tp 2 x pp 2). train.py samples the same way with
its --seed (default 1337, as here), so the defaults print again the sample a run logged when it saved its
last checkpoint.

Streaming. Each token is printed as soon as it is drawn. A token is bytes, not characters: a byte
token, or a GPT-2 token, can end inside a multi-byte UTF-8 character ("✓" is two GPT-2 tokens,
b"\\xe2\\x9c" and b"\\x93"). An incremental UTF-8 decoder prints the longest prefix that forms whole
characters and holds the rest back until a later token completes it, so the stream never shows a
replacement character that the finished text would not have, and what was streamed is exactly the
finished text (`Tokenizer.decode`).

The text goes to stdout and nothing else does (`python sample.py > story.txt`); what was loaded, and
errors, go to stderr. Only rank 0 prints.
"""

import codecs
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from support import cli  # (light: no torch)

if __name__ == "__main__":  # Ctrl-C while the imports below load (seconds): one line and exit 130
    cli.exit_on_signals_while_starting()  # (main() then takes Ctrl-C as KeyboardInterrupt)

import torch

import checkpoint
import config
import kernels
import model as gpt
import parallel
import pipeline
import shard
import stability
from support import devices, interrupt, storage, tokenizer
from support.cli import arg, at_least


@dataclass
class SampleConfig:
    ckpt: str = arg("out", "what to sample from: a run directory (train.py's --out: its newest usable checkpoint), "
                    "a ckpt/ directory, one step_XXXXXXXX checkpoint, or a Hugging Face GPT-2 or Llama directory")
    hf: str = arg("", "a Hugging Face GPT-2 or Llama model directory (config.json and model.safetensors or "
                  "pytorch_model.bin); used instead of --ckpt")
    prompt: str = arg("", "text to continue; it follows <|endoftext|>, as every document did in training "
                      "(empty: the start of a new document)")
    tokens: int = arg(200, "tokens to generate (past the model's context, the window slides)", at_least(1))
    temperature: float = arg(0.8, "divide the logits by this before drawing: lower is more predictable "
                             "(0: greedy, always the most likely token)", at_least(0))
    top_k: int = arg(50, "draw only among the k most likely tokens (0: among all)", at_least(0))
    seed: int = arg(1337, "seed of the sampler's random generator (train.py samples with its --seed)",
                    (lambda v: 0 <= v < 2**63, "must be in [0, 2^63)"))
    samples: int = arg(1, "independent samples, one after another, from the one generator", at_least(1))
    device: str = arg("auto", "auto (CUDA when there is a GPU), cpu, cuda")
    precision: str = arg("auto", "fp32, or bf16 / fp16 autocast (auto: bf16 on CUDA, fp32 on CPU)",
                         choices=["auto", "fp32", "bf16", "fp16"])
    tp: int = arg(1, "tensor-parallel degree (under torchrun, which starts tp * pp processes)", at_least(1))
    pp: int = arg(1, "pipeline-parallel degree (under torchrun)", at_least(1))
    timeout: float = arg(300.0, "seconds a collective may wait for a peer", (lambda v: v > 0, "must be > 0"))


def parse_args(argv=None) -> SampleConfig:
    p = cli.parser(SampleConfig, "Sample text from a checkpoint of any layout, or from a Hugging Face GPT-2 "
                   "directory, streaming tokens as they are drawn.", prog="python sample.py",
                   epilog="The model, its tokenizer and its context length come from the checkpoint.")
    return SampleConfig(**vars(p.parse_args(argv)))


class SampleError(ValueError):
    """Bad input that is not a checkpoint's fault (a prompt longer than the context); one line."""


# ----------------------------------------------------------------------------- what to sample from


@dataclass
class Source:
    """A model to load: its architecture and tokenizer, and how to put its weights into a rank's model."""
    path: Path
    arch: dict  # GPTConfig fields that fix the shapes (GPTConfig.architecture())
    tok: tokenizer.Tokenizer
    about: str  # for the line on stderr
    reader: checkpoint.Reader | None = None  # a checkpoint's, pinned; None for a Hugging Face directory

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy this rank's slice of every parameter (a pipeline stage has only its own)."""
        if self.reader is None:
            hugging_face().load_hf(model, self.path)
            return
        full = checkpoint.consolidate(self.reader)
        with torch.no_grad():
            for name, p in model.named_parameters():
                key = gpt.canonical_name(name, model.config.tied)  # a last stage's lm_head is the tied embedding
                if key not in full:
                    raise checkpoint.CorruptCheckpoint(f"{self.path}: tensor {key} is not in the checkpoint")
                p.copy_(checkpoint.local_part(full[key], p))


def find_source(cfg: SampleConfig, log) -> Source:
    """--hf, or --ckpt: a Hugging Face directory (it has config.json), a run directory, a ckpt/
    directory (its newest checkpoint that verifies; broken ones are reported and passed over), or a
    checkpoint."""
    if cfg.hf:
        return hf_source(Path(cfg.hf))
    path = Path(cfg.ckpt)
    if (path / "config.json").is_file():
        return hf_source(path)
    if (path / "manifest.json").exists():
        return checkpoint_source(checkpoint.pin(path))
    if (path / "ckpt").is_dir():  # a run directory
        path = path / "ckpt"
    if not path.is_dir():
        raise checkpoint.CheckpointError(f"{path}: {'not a directory' if path.exists() else 'no such directory'}; "
                                         "--ckpt takes a run directory (train.py's --out), a ckpt/ directory, a "
                                         "step_XXXXXXXX checkpoint or a Hugging Face GPT-2 directory")
    if not storage.candidates(path, log=lambda msg: None):  # newest() below reports what it finds
        raise checkpoint.CheckpointError(f"{path} holds no checkpoint (a run saves one at its end and every "
                                         "--ckpt-every steps)")
    found = checkpoint.newest(path, log)  # pinned: a training run's cleanup can no longer take it away
    if found is None:
        raise checkpoint.CheckpointError(f"no usable checkpoint in {path} (each one's problem is above)")
    return checkpoint_source(found)


def checkpoint_source(reader: checkpoint.Reader) -> Source:
    path, manifest = reader.path, reader.manifest
    meta = manifest["meta"]
    if not isinstance(meta.get("model"), dict) or not isinstance(meta.get("tokenizer"), str):
        raise checkpoint.CorruptCheckpoint(f"{path}: its manifest does not describe the model and tokenizer")
    tok = tokenizer_for(meta["tokenizer"], (meta.get("config") or {}).get("cache_dir"), path)
    layout = " x ".join(f"{k} {v}" for k, v in manifest["layout"].items() if v > 1) or "one process"
    return Source(path, meta["model"], tok, f"{path} (step {manifest['step']}, saved by {layout})", reader)


def hf_source(path: Path) -> Source:
    if not (path / "config.json").is_file():
        raise checkpoint.CheckpointError(f"{path}: no config.json; --hf takes a Hugging Face GPT-2 model directory")
    arch = hugging_face().hf_config(path)  # a CheckpointError line when config.json is unreadable or not GPT-2's
    identity = json.loads((path / "config.json").read_text()).get("nanoscale", {}).get("tokenizer")
    if identity is not None:  # exported by instruments/hf.py: it says which tokenizer
        tok = tokenizer_for(identity, None, path)
    elif arch["vocab_size"] == tokenizer.GPT2Tokenizer.vocab_size:  # OpenAI's GPT-2, or a model like it
        tok = tokenizer.get_tokenizer("gpt2")
    else:
        raise checkpoint.CheckpointError(f"{path}: a vocabulary of {arch['vocab_size']} tokens is not GPT-2's "
                                         f"({tokenizer.GPT2Tokenizer.vocab_size}), and config.json does not name "
                                         "the tokenizer")
    return Source(path, arch, tok, f"{path} (Hugging Face {'Llama' if arch.get('arch') == 'llama' else 'GPT-2'})")


def hugging_face():
    """instruments/hf.py, which reads a Hugging Face directory (a fork without instruments/ samples from
    checkpoints only)."""
    try:
        from instruments import hf
    except ModuleNotFoundError as e:
        if e.name not in ("instruments", "instruments.hf"):
            raise
        raise checkpoint.CheckpointError("reading a Hugging Face directory needs instruments/hf.py, and this copy "
                                         "has no instruments/ folder") from None
    return hf


def tokenizer_for(identity: str, cache_dir: str | None, path: Path) -> tokenizer.Tokenizer:
    """The tokenizer a model was trained with, checked against the identity it saved. The GPT-2 file is
    read from the run's --cache-dir when it is there (the run may come from another machine)."""
    name = identity.split(":")[0]
    if name not in ("byte", "gpt2"):
        raise checkpoint.CheckpointError(f"{path} was trained with tokenizer {identity!r}, which this code does "
                                         "not have")
    dirs = [Path(d) for d in (cache_dir, tokenizer.DEFAULT_CACHE_DIR) if d]
    tok = tokenizer.get_tokenizer(name, next((d for d in dirs if (d / tokenizer.GPT2_FILE).exists()), dirs[-1]))
    if tok.identity() != identity:
        raise checkpoint.CheckpointError(f"{path} was trained with tokenizer {identity}, but this code's {name} "
                                         f"tokenizer is {tok.identity()}")
    return tok


# ----------------------------------------------------------------------------- the model and the loop


def build(source: Source, grid: parallel.Grid, precision: stability.Precision) -> gpt.GPT:
    """This rank's part of the model (the whole of it on one process), with the source's weights."""
    try:
        cfg = gpt.GPTConfig(**source.arch)
    except TypeError as e:
        raise checkpoint.CorruptCheckpoint(f"{source.path}: an architecture this code does not know ({e})") from None
    cfg.attn = kernels.resolve_backend(grid.device, precision.compute or torch.float32, cfg.head_dim)
    # the initial values build_model draws are overwritten at once; seq_len 0: sampling splits no sequence
    model = shard.build_model(cfg, grid, seed=0, device=grid.device, seq_len=0)
    source.load_into(model)
    return model.eval()


def prompt_ids(tok: tokenizer.Tokenizer, prompt: str, block_size: int) -> list[int]:
    """<|endoftext|> then the prompt: every training document started right after one (data.py)."""
    ids = [tok.eot] + tok.encode(prompt)
    if len(ids) > block_size:
        raise SampleError(f"the prompt is {len(ids) - 1} tokens, and with <|endoftext|> before it that is longer "
                          f"than the model's context of {block_size} tokens; shorten it")
    return ids


class Utf8Stream:
    """Bytes in, text out as soon as it is whole: a character split across tokens is held back until
    its last byte arrives. Bytes that can never be a character come out as U+FFFD, as in the finished text
    (bytes.decode(errors="replace") of all of them), so the pieces always add up to that text."""

    def __init__(self):
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self.decoder.decode(data)

    def finish(self) -> str:
        return self.decoder.decode(b"", final=True)  # a character the sample ended inside of: U+FFFD


def generate(model: gpt.GPT, grid: parallel.Grid, tok: tokenizer.Tokenizer, ids: list[int], n_tokens: int,
             temperature: float, top_k: int, generator: torch.Generator, write) -> list[int]:
    """Draw n_tokens after ids on every rank alike, calling write(text) with each new piece of text as
    soon as its token is drawn; return the new token ids."""
    stream, new = Utf8Stream(), []

    def on_token(nxt: torch.Tensor) -> None:
        new.append(int(nxt[0, 0]))
        write(stream.feed(tok.token_bytes(new[-1])))

    idx = torch.tensor([ids], device=grid.device)
    pipeline.generate(model, grid, idx, n_tokens, temperature=temperature, top_k=top_k or None,
                      generator=generator, on_token=on_token)
    write(stream.finish())
    return new


def run(cfg: SampleConfig, grid: parallel.Grid, out=None, err=None) -> list[list[int]]:
    """Load, then print --samples samples to `out` (rank 0; default stdout); every rank returns the token
    ids it drew."""
    out, err = out or sys.stdout, err or sys.stderr
    log = (lambda msg: print(msg, file=err, flush=True)) if grid.is_logger else (lambda msg: None)
    name = cfg.precision if cfg.precision != "auto" else \
        "bf16" if grid.device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    precision = stability.PRECISIONS[name]
    source = find_source(cfg, log)
    ids = prompt_ids(source.tok, cfg.prompt, source.arch["block_size"])
    model = build(source, grid, precision)
    where = f"{grid.device.type}" + (f", tp {grid.tp} x pp {grid.pp}" if grid.world > 1 else "")
    draw = "greedy" if cfg.temperature == 0 else \
        f"temperature {cfg.temperature:g}, top-k {cfg.top_k or 'off'}, seed {cfg.seed}"
    log(f"sampling {source.about}: {model.config.n_layer}-layer model, {source.tok.name} tokenizer, on {where} in "
        f"{name}; {draw}")

    def write(text: str) -> None:
        if text and grid.is_logger:
            out.write(text)
            out.flush()  # now, not when the buffer fills: the point is to watch it arrive

    generator = torch.Generator(device=grid.device).manual_seed(cfg.seed)
    drawn = []
    with precision.autocast(grid.device):
        for i in range(cfg.samples):
            if i:
                write("-" * 40 + "\n")
            write(cfg.prompt)
            drawn.append(generate(model, grid, source.tok, ids, cfg.tokens, cfg.temperature, cfg.top_k, generator,
                                  write))
            write("\n")
    return drawn


def main(argv=None) -> None:
    cli.interruptible()
    cfg = parse_args(argv)
    grid = None
    try:
        grid = parallel.layout(cfg.tp, cfg.pp, devices.pick_device(cfg.device))
        if grid.dp > 1:
            raise parallel.LayoutError(f"sampling runs on tp * pp = {cfg.tp * cfg.pp} processes, not {grid.world}; "
                                       f"launch torchrun --nproc-per-node {cfg.tp * cfg.pp}")
        parallel.connect(grid, cfg.timeout)
        run(cfg, grid)
    except (checkpoint.CheckpointError, config.ConfigError, parallel.LayoutError, tokenizer.DataError,
            SampleError) as e:
        cli.stop_every_rank(str(e))  # every rank reads the same flags and files: said once
    except interrupt.PeerError as e:
        print(f"error: {e.where}: a peer process failed or timed out ({e.detail})", file=sys.stderr)
        sys.exit(3)
    except KeyboardInterrupt:
        if sys.stdout.isatty():
            print()  # end the streamed text's line (a file gets the text alone)
        cli.stopped("the text drawn so far is above")
    finally:
        parallel.shutdown()


if __name__ == "__main__":
    main()
