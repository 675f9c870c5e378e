"""The conversion, one straight pipeline:

    read (hf.py) -> the architecture's mapping (arch_*.py via registry.py) -> dense plan
    -> write the dense file (gguf_write.py)
       or, with sparse options, hand the plan to the sparse pipeline (sparse/pipeline.py:
       profile -> predictors or thresholds -> placement -> write ONE extended file).

Everything that can be checked (config, architecture, tensor names and shapes,
tokenizer) is checked before any output is written.
"""

from __future__ import annotations

import logging
import os

import numpy as np
from gguf import GGMLQuantizationType as Q

from .. import format as F
from ..gguf_write import ConvertError, QuantMix, TensorJob, add_kv, check_output_path, storage_type, write_gguf
from ..sparse.pipeline import DenseModel, SparseOptions, convert_sparse
from .arch import Architecture, Config, HFParams, TensorMap
from .hf import SafetensorsError, open_weights, read_config_json, read_hf_tokenizer
from .metadata import model_kv
from .registry import lookup

log = logging.getLogger("powerinfer_cpp.convert")


def read_hf_config(hf_dir: str | os.PathLike) -> HFParams:
    """Parse and validate ``config.json`` of a Hugging Face model folder."""
    return read_model_config(hf_dir)[1]


def read_model_config(hf_dir: str | os.PathLike) -> tuple[Architecture, HFParams]:
    """(architecture, hyper-parameters) of a model folder."""
    cfg = read_config_json(hf_dir)
    arch, hf_class = lookup(cfg)
    return arch, arch.read_config(Config(cfg, os.fspath(hf_dir)), hf_class)


def quant_mix(p: HFParams) -> QuantMix:
    """What the _m outtypes' per-tensor rule needs to know of the model."""
    return QuantMix(arch=p.arch, n_layer=p.n_layer, tied=p.tied, n_head=p.n_head, n_head_kv=p.n_head_kv,
                    n_expert=p.n_expert)


def _layout_present(m: TensorMap, actual: dict[str, str]) -> TensorMap:
    """m, or the first of its alternative checkpoint layouts whose sources are all present
    (m itself when none is: the missing-tensor error then names m's sources)."""
    for cand in (m, *m.alternatives):
        if all(s in actual for s in cand.sources):
            return cand
    return m


def plan_tensors(arch: Architecture, p: HFParams, src, outtype: str) -> list[TensorJob]:
    """The dense file's tensors, checked against the checkpoint's names and shapes."""
    actual = {arch.canonical(k): k for k in src.keys()}
    maps = [_layout_present(m, actual) for m in arch.tensors(p)]
    wanted = [s for m in maps for s in m.sources]
    wanted_set = set(wanted)
    missing = [k for k in wanted if k not in actual]
    if missing:
        if not p.tied and missing == [arch.tied_head]:
            raise ConvertError(f"tie_word_embeddings is false but the weights have no {arch.tied_head}")
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        raise ConvertError(f"missing tensors: {', '.join(missing[:5])}{more}")
    extra = sorted(actual[k] for k in actual if k not in wanted_set
                   and not (arch.ignored is not None and arch.ignored.match(k))
                   and not (arch.ignored_for is not None and arch.ignored_for(p, k))
                   and not (p.tied and k == arch.tied_head))
    if extra:
        more = f" (and {len(extra) - 5} more)" if len(extra) > 5 else ""
        raise ConvertError(f"unexpected tensors (not part of a {p.hf_arch} with this config): "
                           f"{', '.join(extra[:5])}{more}")
    jobs = []
    for m in maps:
        for name, shape in zip(m.sources, m.source_shapes):
            got = tuple(src.shape(actual[name]))
            if got != tuple(shape):
                raise ConvertError(f"shape mismatch: {actual[name]} is {list(got)}, config.json implies {list(shape)}")
        if m.raw_type is not None:  # already encoded in the checkpoint (gpt-oss's MXFP4 experts)
            def load_raw(m=m):
                return np.ascontiguousarray(m.transform(*[src.get(actual[s]) for s in m.sources]))

            jobs.append(TensorJob(m.name, m.shape, Q[m.raw_type], load_raw, f"kept {m.raw_type}", raw=True))
            continue
        _, il, suffix = F.parse_tensor_name(m.name)
        qtype, note = storage_type(m.kind, m.shape, outtype, il, quant_mix(p), suffix)

        def load(m=m):
            arrays = [src.get(actual[s], np.float32) for s in m.sources]
            a = m.transform(*arrays) if m.transform is not None else arrays[0]
            return np.ascontiguousarray(a, dtype=np.float32)

        jobs.append(TensorJob(m.name, m.shape, qtype, load, note))
    return jobs


def _input_files(hf_dir: str, sparse_options=None) -> list[str]:
    """The files a conversion of hf_dir may read: everything in the folder except GGUF
    outputs, plus the calibration text."""
    out = []
    try:
        for name in os.listdir(hf_dir):
            p = os.path.join(hf_dir, name)
            if os.path.isfile(p) and not name.endswith(".gguf"):
                out.append(p)
    except OSError:
        pass
    calib = getattr(sparse_options, "calib", None)
    if calib:
        out.append(os.fspath(calib))
    return out


#: What llama.cpp computes for each architecture it has (it reads no activation key), and
#: the activations it thus runs right (tanh-GELU for the exact one differs by rounding only).
LLAMA_CPP_DEFAULT_ACT = {F.ARCH_LLAMA: F.ACT_SILU, F.ARCH_QWEN2: F.ACT_SILU, F.ARCH_PHI3: F.ACT_SILU,
                         F.ARCH_FALCON: F.ACT_GELU, F.ARCH_QWEN3: F.ACT_SILU, F.ARCH_OLMO2: F.ACT_SILU,
                         F.ARCH_SMOLLM3: F.ACT_SILU, F.ARCH_GEMMA2: F.ACT_GELU,
                         F.ARCH_GEMMA3: F.ACT_GELU, F.ARCH_QWEN2MOE: F.ACT_SILU,
                         F.ARCH_QWEN3MOE: F.ACT_SILU, F.ARCH_OLMOE: F.ACT_SILU,
                         F.ARCH_GPTOSS: F.ACT_SWIGLU_OAI}
_LLAMA_CPP_RUNS = {F.ARCH_FALCON: (F.ACT_GELU, F.ACT_GELU_ERF), F.ARCH_GEMMA2: (F.ACT_GELU, F.ACT_GELU_ERF),
                   F.ARCH_GEMMA3: (F.ACT_GELU, F.ACT_GELU_ERF)}


def convert(hf_dir: str | os.PathLike, out_path: str | os.PathLike, outtype: str = "f16",
            progress: bool = True, sparse: bool = False, sparse_options: SparseOptions | None = None,
            report: list | None = None) -> str:
    """Convert the Hugging Face model folder ``hf_dir`` to a GGUF file at
    ``out_path`` with 2-D weights stored as ``outtype`` (one of
    format.OUTTYPES). Returns the absolute output path. Raises ConvertError.

    ``sparse=True`` runs the sparse pipeline (profile, predictors, placement;
    ReLU-family models only) with ``sparse_options``
    (sparse.pipeline.SparseOptions) and writes one extended GGUF; its
    SparseReport is appended to ``report`` when a list is given. (The CLI makes
    sparse the default for ReLU-family models; this function does not.)"""
    if outtype not in F.OUTTYPES:
        raise ConvertError(F.outtype_refusal(outtype))
    hf_dir = os.fspath(hf_dir)
    out_path = os.path.abspath(os.fspath(out_path))
    check_output_path(out_path, _input_files(hf_dir, sparse_options))

    arch, params = read_model_config(hf_dir)
    tok = read_hf_tokenizer(hf_dir, params.n_vocab, params)
    src = open_weights(hf_dir)
    try:
        jobs = plan_tensors(arch, params, src, outtype)
        for j in jobs:
            if j.note:
                log.warning("%s: %s", j.name, j.note)
        log.info("%s: %s (%s), %d layers, d=%d, n_ff=%d, act=%s, %d tensors -> %s (%s)", params.name,
                 params.hf_arch, params.arch, params.n_layer, params.n_embd, params.n_ff,
                 params.activation, len(jobs), out_path, outtype)
        kv = model_kv(arch, params, tok, outtype)
        try:
            if sparse:
                dense = DenseModel(
                    arch=params.arch, kv=kv, jobs=jobs, outtype=outtype, n_layer=params.n_layer,
                    n_embd=params.n_embd, n_ff=params.n_ff, n_embd_kv=params.n_head_kv * params.head_dim,
                    n_ctx=params.n_ctx, activation=params.activation, gated=params.gated, hf_dir=hf_dir,
                    act_threshold=params.act_threshold, n_expert=params.n_expert,
                    n_expert_used=params.n_expert_used, n_ff_exp=params.n_ff_exp,
                    # ffn_down_t follows its layer's ffn_down rule (the _m mixes vary it), for rows of d
                    down_types=[storage_type(F.T_FFN_DOWN, (params.n_ff, params.n_embd), outtype, il,
                                             quant_mix(params))[0] for il in range(params.n_layer)])
                path, rep = convert_sparse(dense, out_path, sparse_options or SparseOptions(), progress)
                if report is not None:
                    report.append(rep)
                return path
            runs = _LLAMA_CPP_RUNS.get(params.arch, (LLAMA_CPP_DEFAULT_ACT.get(params.arch),))
            if params.arch in LLAMA_CPP_DEFAULT_ACT and params.activation not in runs:
                # llama.cpp reads no activation key: it would run this file with its own
                log.warning("%s: a dense %s file with a %s FFN: this runtime reads its activation "
                            "from %s, but llama.cpp computes %s for every %s file, so llama.cpp's "
                            "output for it would be wrong", out_path, params.arch, params.activation,
                            F.KEY_FFN_ACTIVATION, LLAMA_CPP_DEFAULT_ACT[params.arch], params.arch)
            return write_gguf(out_path, lambda w: add_kv(w, kv), jobs, progress, arch=params.arch)
        except SafetensorsError as e:
            raise ConvertError(str(e)) from None
    finally:
        src.close()
