"""Hugging Face GPT-2 interop: import their weights, export ours; transformers is the oracle."""

import json
import subprocess
import sys

import pytest
import torch
import transformers  # a test-only oracle, from requirements-dev.txt
from conftest import ROOT, final_weights, run_train

import model as gpt
from instruments import hf
from support.storage import CheckpointError


def hf_model(vocab=257):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=vocab, n_positions=64, n_embd=64, n_layer=2, n_head=4,
                                  bos_token_id=vocab - 1, eos_token_id=vocab - 1,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize("safetensors", [True, False])
def test_import_gives_the_same_logits_as_transformers(safetensors, tmp_path):
    theirs = hf_model()
    theirs.save_pretrained(tmp_path, safe_serialization=safetensors)
    ours = gpt.build(gpt.GPTConfig(**hf.hf_config(tmp_path)), seed=0).eval()
    hf.load_hf(ours, tmp_path)
    idx = torch.randint(0, 257, (2, 40))
    with torch.no_grad():
        expected = theirs(idx).logits
        got, _ = ours(idx)
    torch.testing.assert_close(got[..., :257], expected, rtol=1e-5, atol=1e-5)


def test_export_loads_in_transformers_and_round_trips(corpus, tmp_path):
    run_train(corpus, tmp_path / "run", "--max-steps", "2")
    out = subprocess.run([sys.executable, "-m", "instruments.hf", "export", str(tmp_path / "run" / "ckpt"),
                          str(tmp_path / "hf")], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "wrote a Hugging Face GPT-2 model" in out
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    weights = final_weights(tmp_path / "run")
    cfg = gpt.config_from_preset("tiny", 257)
    ours = gpt.build(cfg, seed=0).eval()
    ours.load_state_dict(weights, strict=False)
    ours.lm_head.weight = ours.transformer.wte.weight
    idx = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx)[0][..., :257], rtol=1e-5, atol=1e-5)

    # import the export on two tensor-parallel ranks, and on two ZeRO-3 ranks (which read each parameter
    # only to keep their shard of it), take one step at lr 1e-30 (below fp32's resolution for these
    # weights): they come back exactly
    for layout in (["--tp", "2"], ["--zero", "3"]):
        back = tmp_path / f"back{layout[0]}"
        run_train(corpus, back, "--init-from", str(tmp_path / "hf"), "--max-steps", "1", "--lr", "1e-30",
                  "--min-lr", "0", *layout, nproc=2)
        for name, w in final_weights(back).items():
            rows = slice(0, 257) if name == "transformer.wte.weight" else slice(None)
            assert torch.equal(w[rows], weights[name][rows]), (layout, name)


def test_init_from_a_directory_that_is_not_a_model(corpus, tmp_path):
    result = run_train(corpus, tmp_path / "run", "--init-from", str(tmp_path), check=False)
    assert result.returncode == 2
    assert "no readable config.json" in result.stderr


@pytest.mark.parametrize("flag", [["--n-layer", "4"], ["--block-size", "128"]])
def test_the_shape_of_a_hugging_face_model_is_its_own(flag, corpus, tmp_path):
    """--n-layer and --block-size change the architecture; an imported model's is fixed by its config.json."""
    hf_model().save_pretrained(tmp_path / "hf")
    result = run_train(corpus, tmp_path / "run", "--init-from", str(tmp_path / "hf"), *flag, check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{flag[0]} cannot change" in result.stderr and "(--init-from" in result.stderr


# ----------------------------------------------------------------------------- Llama


def hf_llama(tie: bool = False):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=257, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   rms_norm_eps=1e-5, rope_theta=5000.0, tie_word_embeddings=tie,
                                   bos_token_id=256, eos_token_id=256)
    return transformers.LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_llama_import_gives_the_same_logits_and_greedy_text_as_transformers(tie, tmp_path):
    theirs = hf_llama(tie)
    theirs.save_pretrained(tmp_path)
    arch = hf.hf_config(tmp_path)
    assert (arch["arch"], arch["n_kv_head"], arch["ffn_hidden"], arch["tie_embeddings"]) == ("llama", 2, 96, tie)
    ours = gpt.build(gpt.GPTConfig(**arch), seed=0).eval()
    hf.load_hf(ours, tmp_path)
    idx = torch.randint(0, 257, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx)[0][..., :257], theirs(idx).logits, rtol=1e-5, atol=1e-5)
        prompt = idx[:, :8]
        expected = theirs.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=12,
                                   do_sample=False, min_new_tokens=12)
    assert torch.equal(ours.generate(prompt, 12, temperature=0), expected)


def test_a_llama_that_model_py_does_not_compute_is_refused(tmp_path):
    hf_llama().save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}}))
    with pytest.raises(CheckpointError, match="this Llama uses rope_scaling, which model.py does not compute"):
        hf.hf_config(tmp_path)


def test_llama_export_loads_in_transformers_and_imports_back(corpus, tmp_path):
    run_train(corpus, tmp_path / "run", "--preset", "llama-tiny", "--rope-theta", "700", "--max-steps", "2")
    out = subprocess.run([sys.executable, "-m", "instruments.hf", "export", str(tmp_path / "run" / "ckpt"),
                          str(tmp_path / "hf")], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "wrote a Hugging Face Llama model" in out
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ours = gpt.build(gpt.config_from_preset("llama-tiny", 257, rope_theta=700.0), seed=0).eval()
    ours.load_state_dict(final_weights(tmp_path / "run"))
    idx = torch.randint(0, 257, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx)[0][..., :257], rtol=1e-5, atol=1e-5)
    sampled = subprocess.run([sys.executable, "sample.py", "--hf", str(tmp_path / "hf"), "--tokens", "8",
                              "--temperature", "0", "--device", "cpu"], cwd=ROOT, capture_output=True, text=True)
    assert sampled.returncode == 0 and "Hugging Face Llama" in sampled.stderr + sampled.stdout, sampled.stderr[-2000:]
    back = gpt.build(gpt.GPTConfig(**hf.hf_config(tmp_path / "hf")), seed=1)
    hf.load_hf(back, tmp_path / "hf")
    for name, w in ours.state_dict().items():
        rows = slice(0, 257) if name in hf.VOCAB_ROWS else slice(None)
        assert torch.equal(back.state_dict()[name][rows], w[rows]), name


def test_init_from_a_llama_directory_at_tp2_starts_from_its_weights(corpus, tmp_path):
    """--init-from a LlamaForCausalLM directory on two tensor-parallel ranks (q, k, v and gate, up cut per rank),
    one step at lr 1e-30: every weight comes back as Hugging Face's."""
    hf_llama().save_pretrained(tmp_path / "hf")
    run_train(corpus, tmp_path / "run", "--init-from", str(tmp_path / "hf"), "--max-steps", "1", "--lr", "1e-30",
              "--min-lr", "0", "--tp", "2", nproc=2)
    theirs = hf.read_hf_weights(tmp_path / "hf")
    for name, w in final_weights(tmp_path / "run").items():
        assert torch.equal(w[: theirs[name].size(0)], theirs[name]), name


# ----------------------------------------------------------------------------- what cannot be converted


def export_command(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "instruments.hf", "export", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True)


@pytest.mark.parametrize("arch", [[], ["--preset", "llama-tiny"]])
def test_a_mixture_of_experts_is_not_exported_as_a_dense_model(arch, corpus, tmp_path):
    """GPT2LMHeadModel and LlamaForCausalLM have no routed experts: an MoE checkpoint is refused in one line
    (exit 2), and no directory is left behind (it was a GPT-2 config with expert tensors, exit 0; under
    Llama a KeyError and an empty directory)."""
    run_train(corpus, tmp_path / "run", *arch, "--moe-experts", "4", "--max-steps", "1")
    result = export_command(tmp_path / "run" / "ckpt", tmp_path / "hf")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
    assert "mixture of experts" in result.stderr and "Mixtral" in result.stderr
    assert not (tmp_path / "hf").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.fixture(scope="module")
def tiny_run(corpus, tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    run_train(corpus, out, "--max-steps", "1")
    return out


def test_an_export_into_a_file_or_a_directory_it_cannot_make_is_one_line(tiny_run, tmp_path):
    """A path that is a file (it was FileExistsError's traceback), and one under a file: one line, exit 2,
    the file untouched and nothing else made."""
    (tmp_path / "taken").write_text("mine")
    for target in (tmp_path / "taken", tmp_path / "taken" / "hf"):
        result = export_command(tiny_run / "ckpt", target)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
        assert result.stderr.startswith("error: ") and len(result.stderr.strip().splitlines()) == 1
        assert str(tmp_path / "taken") in result.stderr
    assert (tmp_path / "taken").read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["taken"]


def test_an_export_that_fails_half_way_leaves_nothing_behind(tiny_run, tmp_path, monkeypatch):
    """The weights written, then a failure (a full disk, say) before config.json: the output directory is not
    there, half-made, for transformers to trip over (and no temporary one either)."""
    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(hf, "replace_atomically", full_disk)
    with pytest.raises(OSError):
        hf.export(tiny_run / "ckpt" / (tiny_run / "ckpt" / "latest").read_text(), tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_hf_help_names_both_families():
    result = subprocess.run([sys.executable, "-m", "instruments.hf", "--help"], cwd=ROOT, capture_output=True,
                            text=True, check=True)
    assert "LlamaForCausalLM" in result.stdout and "GPT2LMHeadModel" in result.stdout


def test_a_vocabulary_tensor_shorter_than_the_vocabulary_is_refused(corpus, tmp_path):
    """config.json says 257 tokens but wte holds 16 rows: the import padded every vocabulary tensor to the
    padded size before checking its shape, so 241 tokens silently started from zero. Only the rows between
    the true vocabulary and the padded one are zeros; a shorter tensor is one line, exit 2."""
    from support.storage import read_safetensors, write_safetensors
    hf_model().save_pretrained(tmp_path / "hf")
    weights = {n: t.clone() for n, t in read_safetensors(tmp_path / "hf" / "model.safetensors").items()}
    weights["transformer.wte.weight"] = weights["transformer.wte.weight"][:16]
    write_safetensors(tmp_path / "hf" / "model.safetensors", weights)
    result = run_train(corpus, tmp_path / "run", "--init-from", str(tmp_path / "hf"), "--max-steps", "1",
                       check=False)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "transformer.wte.weight has shape (16, 64)" in result.stderr and "257" in result.stderr


def test_consolidate_into_a_directory_is_one_line(tiny_run, tmp_path):
    result = subprocess.run([sys.executable, "-m", "instruments.checkpoints", "consolidate", str(tiny_run / "ckpt"),
                             str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert result.stderr == f"error: {tmp_path} is a directory; name a file to write\n"
