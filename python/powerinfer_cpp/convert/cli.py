"""The converter's command line: ``python -m powerinfer_cpp.convert HF_DIR -o OUT.gguf``."""

from __future__ import annotations

import argparse
import logging
import math
import os
import sys

from .. import format as F
from ..gguf_write import ConvertError
from ..sparse.pipeline import SparseOptions
from ..sparse.placement import parse_size
from .from_gguf import convert_from_gguf, dense_from_gguf, is_gguf_file
from .pipeline import convert, read_hf_config

__all__ = ["main"]


def _input_options(args) -> dict:
    """SparseOptions' input-sparsity fields from the command line."""
    if args.input_sparsity is None:
        for flag, given in (("--input-criterion", args.input_criterion is not None),
                            ("--no-input-refit", args.no_input_refit),
                            ("--input-ffn", args.input_ffn),
                            ("--input-refit-tokens", args.input_refit_tokens is not None)):
            if given:
                raise ConvertError(f"{flag} applies to the input sparsity --input-sparsity S (or auto) "
                                   "asks for; pass it too")
        return {}
    if args.input_sparsity == "auto":
        if args.sparsity is not None:
            raise ConvertError("--input-sparsity auto chooses the input level by the quality budget, and "
                               "--sparsity S fixes the gate level without one: pass --max-ppl-increase P "
                               "instead of --sparsity (the budget then chooses both levels), or a fixed "
                               "--input-sparsity S")
        out = {"input_sparsity": "auto"}
    else:
        try:
            value = float(args.input_sparsity)
        except ValueError:
            value = math.nan
        if not 0.0 <= value < 1.0:
            raise ConvertError(f"--input-sparsity must be a share in [0, 1) or 'auto', got {args.input_sparsity}")
        out = {"input_sparsity": value}
    if args.input_criterion is not None:
        out["input_criterion"] = args.input_criterion
    if args.no_input_refit:
        out["input_refit"] = False
    if args.input_ffn:
        out["input_ffn"] = True
    if args.input_refit_tokens is not None:
        if args.input_refit_tokens < 16:
            raise ConvertError(f"--input-refit-tokens must be at least 16, got {args.input_refit_tokens}")
        out["input_refit_tokens"] = args.input_refit_tokens
    return out


def _setup_logging(quiet: bool, verbose: bool) -> None:
    """Our progress at INFO (WARNING with -q); other libraries' INFO lines only with -v:
    gguf names its temporary files and python-mip its version, which says nothing about
    the conversion. Their warnings always show."""
    logging.basicConfig(format="%(message)s")  # a no-op where a handler exists (pytest)
    logging.getLogger().setLevel(logging.INFO if verbose else logging.WARNING)
    logging.getLogger("powerinfer_cpp").setLevel(
        logging.INFO if verbose or not quiet else logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m powerinfer_cpp.convert",
                                 description="Convert a Hugging Face model folder (LLaMA, Mistral, Qwen2, "
                                             "Falcon, OPT and their ReLU variants) to GGUF, or make a GGUF "
                                             "file (llama.cpp's, PowerInfer's, ours) sparse, keeping its "
                                             "tensor types or re-quantizing them (--outtype).")
    ap.add_argument("hf_dir", metavar="MODEL",
                    help="Hugging Face model folder (config.json, *.safetensors, tokenizer.json), or a "
                         "GGUF file (then the output is sparse and --calib is needed, or with --outtype T "
                         "--dense a re-quantized dense file)")
    ap.add_argument("-o", "--outfile", help="output GGUF path (default: HF_DIR/model-OUTTYPE.gguf; for a "
                                            "GGUF input MODEL[-OUTTYPE]-sparse.gguf, or with --dense "
                                            "MODEL-OUTTYPE.gguf, next to it)")
    ap.add_argument("--outtype", default=None,
                    help=f"{' | '.join(F.OUTTYPES)} (default f16). A GGUF input keeps its own types "
                         "unless this is given; then every weight is dequantized and stored as an HF "
                         "conversion would store it (requantizing an already-quantized file loses quality, "
                         "as with llama-quantize --allow-requantize: its error adds to the new type's)")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress bar or info messages")
    ap.add_argument("-v", "--verbose", action="store_true",
                    help="also show the libraries' own messages (gguf's temporary files, "
                         "python-mip's version)")
    sp = ap.add_argument_group("sparse conversion (the default: predictors for ReLU-family models, relu, "
                               "drelu, fatrelu; gate thresholds within a 2% perplexity budget for "
                               "SwiGLU/GeGLU models)")
    mode = sp.add_mutually_exclusive_group()
    mode.add_argument("--sparse", dest="sparse", action="store_true", default=None,
                      help="profile, train predictors (ReLU family) or calibrate gate thresholds "
                           "(SwiGLU/GeGLU: to --max-ppl-increase 0.02), place neurons and write one "
                           "extended GGUF (the default for both; an error for an ungated non-ReLU FFN)")
    mode.add_argument("--dense", dest="sparse", action="store_false", help="plain dense GGUF (no profiling)")
    sp.add_argument("--calib", metavar="FILE",
                    help="calibration text (default: HF_DIR/heldout.txt when the folder ships one; "
                         "required otherwise)")
    sp.add_argument("--calib-tokens", type=int, default=16384, metavar="N",
                    help="tokens of calibration text to profile (default 16384; capped by the text); "
                         "the last 20%% are held out of predictor training")
    sp.add_argument("--predictor-recall", type=float, default=0.99, metavar="R",
                    help="predictor recall target on held-out tokens (default 0.99)")
    sp.add_argument("--predictor-type", choices=("f32", "f16", "q8_0", "q4_0"), default=None,
                    help="storage of the predictors (default: f32 for f32 models, f16 for f16/bf16, "
                         "q8_0 for q8_0/q4_0; q4_0 halves their bytes, pair it with a lower "
                         "--predictor-threshold)")
    sp.add_argument("--predictor-threshold", type=float, default=0.0, metavar="T",
                    help="a neuron is predicted active when its score is >= T (default 0); a lower "
                         "T raises recall and the predicted density")
    sp.add_argument("--expert-predictors", action="store_true",
                    help="ReLU-family experts (--sparse on a mixture of ReGLU/dReLU experts): also train "
                         "a predictor per expert (the sparse FFN mode), to --predictor-recall on "
                         "held-out tokens")
    sp.add_argument("--sparsity", type=float, default=None, metavar="S",
                    help="training-free gate-magnitude sparsity for any gated FFN (SwiGLU, GeGLU, "
                         "ReGLU): calibrate per layer the |act(gate)| threshold that zeroes the "
                         "share S of the neurons (e.g. 0.5) instead of training predictors; implies "
                         "--sparse")
    sp.add_argument("--max-kl", type=float, default=None, metavar="K",
                    help="the quality budget's bound on the mean KL divergence to dense (nats) on the same "
                         "held-out tokens, beside the perplexity bound (default: the budget P itself, 0.02 "
                         "at the default 2%%; inf: none): input sparsity can keep perplexity while it "
                         "changes the next-token distribution several times more than the gate does")
    sp.add_argument("--max-ppl-increase", type=float, default=None, metavar="P",
                    help="gate-magnitude sparsity at the largest level whose perplexity on held-out "
                         "calibration tokens (the last 20%% of those profiled) stays within P of dense, "
                         "e.g. 0.02 = 2%% (the default for SwiGLU/GeGLU models, P = 0.02; "
                         "--sparsity S fixes the level instead); implies --sparse")
    sp.add_argument("--sparsity-allocation", choices=("uniform", "greedy"), default=None,
                    help="gate mode: the same sparsity in every layer (uniform, the default), or per "
                         "layer sparsities chosen greedily from each layer's measured KL to dense "
                         "(greedy: n_layer x 9 extra runs over --greedy-tokens)")
    sp.add_argument("--greedy-tokens", type=int, default=512, metavar="N",
                    help="calibration tokens of the greedy allocation's measurements (default 512)")
    sp.add_argument("--input-sparsity", default=None, metavar="S|auto",
                    help="also make the attention's q/k/v and o and the output head input-sparse: per "
                         "layer and projection a threshold skipping the share S of its inputs (e.g. 0.25; "
                         "stores those weights a second time, transposed; default off: see "
                         "docs/BENCHMARKS.md 'Input sparsity'); 'auto': the level (0 = off, or "
                         "10-40%%) that, with the gate level, has the shortest estimated decode time (bytes "
                         "per token weighted by each path's measured cost per byte in its type) within "
                         "the quality budget (--max-ppl-increase P, for SwiGLU models the default 0.02; "
                         "with predictors the budget is 0.02, spent on input sparsity alone). With a "
                         "budget a fixed S shares it too: the gate gets what S leaves")
    sp.add_argument("--input-criterion", choices=F.INPUT_CRITERIA, default=None,
                    help="how --input-sparsity ranks inputs: wina (|x_i| times the weight column's "
                         "norm, the default) or magnitude (|x_i|, TEAL)")
    sp.add_argument("--input-ffn", action="store_true",
                    help="also the FFN's inputs (gate mode): gate and up over the inputs above their thresholds, "
                         "and down over the rows whose |act(g) * u| passes its own (TEAL on the FFN)")
    sp.add_argument("--no-input-refit", action="store_true",
                    help="keep the input thresholds fitted on the dense-mode profile instead of refitting "
                         "each site on the inputs it sees in the sparse mode (the refit decodes "
                         "--input-refit-tokens tokens once in the sparse mode, recording those inputs)")
    sp.add_argument("--input-refit-tokens", type=int, default=None, metavar="N",
                    help="calibration tokens the refit's profile pass covers (default 1024)")
    sp.add_argument("--vram-budget", default="0", metavar="SIZE",
                    help="GPU memory for the model, e.g. 4G, 512M (default 0: CPU only; "
                         "re-solve later with python -m powerinfer_cpp.place)")
    sp.add_argument("--ctx", type=int, default=None, metavar="N",
                    help="context length whose KV cache the budget reserves (default: the model's)")
    sp.add_argument("--group-size", type=int, default=64, metavar="N", help="neurons per placement group (default 64)")
    sp.add_argument("--placement", choices=("ilp", "greedy"), default="ilp", help="placement solver (default ilp)")
    sp.add_argument("--threads", type=int, default=0, help="threads for profiling (default: all cores)")
    args = ap.parse_args(argv)
    _setup_logging(args.quiet, args.verbose)
    from_gguf = os.path.isfile(args.hf_dir) and is_gguf_file(args.hf_dir)
    if from_gguf:
        stem = os.path.splitext(args.hf_dir)[0] + (f"-{args.outtype}" if args.outtype else "")
        out = args.outfile or stem + ("" if args.sparse is False else "-sparse") + ".gguf"
    else:
        out = args.outfile or os.path.join(args.hf_dir, f"model-{args.outtype or 'f16'}.gguf")
    try:
        sparse = args.sparse
        dense = None
        if from_gguf:
            if args.outtype is not None and args.outtype not in F.OUTTYPES:
                raise ConvertError(F.outtype_refusal(args.outtype))
            if sparse is False and args.outtype is None:
                raise ConvertError("a GGUF input is dense already: --dense needs --outtype T (re-quantize it "
                                   "to T), else drop --dense to make it sparse")
            dense = dense_from_gguf(args.hf_dir, args.outtype)
        sopts = None
        gate_opts = [o for o, v in (("--sparsity", args.sparsity), ("--max-ppl-increase", args.max_ppl_increase),
                                    ("--sparsity-allocation", args.sparsity_allocation)) if v is not None]
        if args.sparsity is not None and args.max_ppl_increase is not None:
            raise ConvertError("--sparsity S fixes the level and --max-ppl-increase P chooses it by a quality "
                               "budget: pass one of them")
        if gate_opts and sparse is False:
            raise ConvertError(f"{gate_opts[0]} calibrates a sparse file; it cannot be combined with --dense")
        if args.input_sparsity is not None and sparse is False:
            raise ConvertError("--input-sparsity makes a sparse file's attention and head input-sparse (in its "
                               "sparse FFN modes); it cannot be combined with --dense")
        if sparse is not False:
            act, gated, moe = ((dense.activation, dense.gated, dense.n_expert > 0) if dense is not None else
                               (lambda p: (p.activation, p.gated, p.n_expert > 0))(read_hf_config(args.hf_dir)))
            relu = act in F.SPARSE_ACTIVATIONS
            if sparse is None:
                # SwiGLU/GeGLU: calibrated gate thresholds, as ReLU models get predictors; a
                # mixture of SwiGLU experts stays dense unless a sparse option asks (its
                # thresholds need a level), ReLU-family experts get their exact zeros
                asked = bool(gate_opts) or args.input_sparsity is not None
                sparse = (asked or not moe or relu) and (relu or bool(gate_opts) or gated or dense is not None)
                # a GGUF kept in its types can only become sparse (a SwiGLU mixture's refusal
                # then asks for the level); re-quantized, a SwiGLU mixture stays dense as above
                sparse = sparse or (dense is not None and args.outtype is None)
            gate = args.sparsity is not None or args.max_ppl_increase is not None or (gated and not relu)
            if args.sparsity_allocation is not None and not gate:
                raise ConvertError("--sparsity-allocation shares a gate-magnitude sparsity among the layers; "
                                   "this conversion trains predictors (pass --sparsity S or "
                                   "--max-ppl-increase P for gate thresholds)")
            if sparse:
                try:
                    budget = parse_size(args.vram_budget)
                except ValueError as e:
                    raise ConvertError(f"--vram-budget: {e}") from None
                if budget >= 2**63:
                    raise ConvertError(f"--vram-budget {args.vram_budget} is too large "
                                       "(at most 8 EiB)")
                if args.ctx is not None and not 1 <= args.ctx < 2**31:
                    raise ConvertError(f"--ctx must be a positive number of tokens, got {args.ctx}")
                if not 0 <= args.threads <= 512:
                    raise ConvertError(f"--threads must be between 0 (all cores) and 512, "
                                       f"got {args.threads}")
                sopts = SparseOptions(**_input_options(args), calib=args.calib, calib_tokens=args.calib_tokens,
                                      predictor_recall=args.predictor_recall, vram_budget=budget, ctx=args.ctx,
                                      group_size=args.group_size, placement=args.placement,
                                      n_threads=args.threads, predictor_type=args.predictor_type,
                                      threshold=args.predictor_threshold, sparsity=args.sparsity,
                                      expert_predictors=args.expert_predictors,
                                      max_ppl_increase=args.max_ppl_increase, max_kl=args.max_kl,
                                      allocation=args.sparsity_allocation or SparseOptions.allocation,
                                      greedy_tokens=args.greedy_tokens)
        if dense is not None:
            if not args.outfile and not sparse:  # decided above (a SwiGLU mixture re-quantized)
                out = stem + ".gguf"
            path = convert_from_gguf(args.hf_dir, out, progress=not args.quiet, sparse_options=sopts,
                                     dense=dense, outtype=args.outtype, sparse=bool(sparse))
        else:
            path = convert(args.hf_dir, out, args.outtype or "f16", progress=not args.quiet,
                           sparse=bool(sparse), sparse_options=sopts)
    except ConvertError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, ValueError, RuntimeError) as e:  # e.g. the native runtime while profiling
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 1
    if not args.quiet:
        print(f"wrote {path}", file=sys.stderr)
    return 0
