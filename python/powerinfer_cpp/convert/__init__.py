"""Convert a Hugging Face model folder to GGUF.

    python -m powerinfer_cpp.convert HF_DIR -o OUT.gguf --outtype f32|f16|bf16|q8_0|q4_0

or, from Python, ``convert(hf_dir, out_path, outtype="f16")``.

The package: hf.py reads the folder (config.json, weights, tokenizer); one module per
architecture (arch_llama.py, ...) says which models it takes, how their config becomes
hyper-parameters and how each HF tensor maps to a GGUF tensor; registry.py collects
them; metadata.py writes the common keys; pipeline.py runs read -> mapping -> write
(the sparse pipeline, sparse/, takes over after the mapping when asked); cli.py is the
command line. Key and tensor names come from format.py; the layout is documented in
docs/FORMAT.md.
"""

from ..gguf_write import ConvertError
from .arch import HFParams
from .arch_llama import permute_qk, unpermute_qk
from .cli import main
from .hf import read_hf_tokenizer
from .pipeline import convert, read_hf_config

__all__ = ["ConvertError", "HFParams", "read_hf_config", "read_hf_tokenizer", "convert",
           "permute_qk", "unpermute_qk", "main"]
